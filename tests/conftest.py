import os
import shutil
import tempfile

import pytest

# One CPU device per test process; the sharding tests set their own device count in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HYBRID_LM_COMPILATION_CACHE", "off")  # never the user's ~/.cache/hybrid_lm/jax

# One persistent compilation cache for this test run, in a fresh temp dir: many tests compile the same
# tiny model (most of a tiny train is XLA's compile), so a program compiled by one test, xdist worker or
# subprocess is read back by the next. A cached executable is the compile of the identical program
# (JAX keys it on the HLO, the compile options and flags, the backend and versions), so what a test
# checks is unchanged. The xdist controller loads this file first and its workers and their
# subprocesses inherit the variables. A size limit turns on JAX's file lock around reads and writes,
# so concurrent processes never read a half-written entry.
_OWN_JAX_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_JAX_CACHE = tempfile.mkdtemp(prefix="hybrid_lm_tests_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_JAX_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))


def pytest_unconfigure(config):
    if _OWN_JAX_CACHE is not None:
        shutil.rmtree(_OWN_JAX_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _data_dir(tmp_path_factory):
    """Prepared corpora go to a per-session temp dir, never into the checkout."""
    d = tmp_path_factory.mktemp("data_cache")
    old = os.environ.get("HYBRID_LM_DATA_DIR")
    os.environ["HYBRID_LM_DATA_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("HYBRID_LM_DATA_DIR", None)
    else:
        os.environ["HYBRID_LM_DATA_DIR"] = old


TINY = [
    "ModelConfig.d_model = 32", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 2",
    "ModelConfig.n_kv_heads = 1", "ModelConfig.d_ff = 64", "ModelConfig.compute_dtype = 'float32'",
    "efficient/swa/MixerConfig.window = 8", "efficient/sa/MixerConfig.window = 8",  # windowed kinds only
    "efficient/sa_swa/MixerConfig.window = 8", "DataConfig.seq_len = 32", "TrainConfig.global_batch = 4",
    "TrainConfig.log_every = 5", "TrainConfig.eval_every = 1000", "TrainConfig.progress = False",
    "DataConfig.eval_windows = 8", "OptimConfig.warmup_steps = 5", "OptimConfig.lr = 3e-3",
    "CheckpointConfig.every_steps = 5", "CheckpointConfig.async_save = False",
]


@pytest.fixture
def tiny_params():
    return list(TINY)


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are global: a test that builds ``ModelConfig(...)`` directly must not inherit the
    bindings an earlier test's ``load_config`` left behind (e.g. a layer pattern)."""
    import gin
    gin.clear_config()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, _data_dir):
    """``tiny_run(steps)``: a copy of a tiny run (``TINY``, ``TrainConfig.steps = steps``, checkpoints
    every 5 steps) in a fresh temp dir. The run is trained once per test session (per xdist worker)
    for each ``steps`` and copied on every call, so the eval test modules share the training and still
    each write into their own run directory."""
    from hybrid_lm.config import load_config
    from hybrid_lm.train.loop import train

    trained = {}  # steps -> the trained run (never handed out)

    def get(steps: int):
        if steps not in trained:
            wd = tmp_path_factory.mktemp(f"tiny_run_{steps}_trained")
            train(load_config([], list(TINY) + [f"TrainConfig.steps = {steps}"]), wd)
            trained[steps] = wd
        copy = tmp_path_factory.mktemp(f"tiny_run_{steps}") / "run"
        shutil.copytree(trained[steps], copy)
        return copy

    return get
