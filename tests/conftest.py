import os
import shutil
import tempfile

import pytest

# One CPU device per test process; the sharding tests set their own device count in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HYBRID_LM_COMPILATION_CACHE", "off")  # never the user's ~/.cache/hybrid_lm/jax
os.environ.setdefault("HYBRID_LM_WEIGHTS_SHA_CACHE", "off")  # nor its weights_sha256.json
# XLA's CPU backend without its expensive optimisation passes (JAX's documented switch): the tests'
# tiny programs spend far longer compiling than running, and this cut the suite from ~1600 to ~1030 s
# on 2 cores. Every tolerance still holds; the library's own runs are not affected. The few tests
# that run large programs, or compare two different programs bitwise, take the `xla_optimized` fixture.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

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
    os.environ["HYBRID_LM_TESTS_JAX_CACHE"] = _OWN_JAX_CACHE
if os.environ.get("HYBRID_LM_TESTS_JAX_CACHE") == os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    # In the test processes (not their subprocesses) every program goes to the cache, the op-by-op
    # (eager) ones too, which the other xdist worker then reads back. With the size limit each write
    # would list the whole directory to evict (quadratic in the entries); this temp dir needs no
    # eviction, so the listing is skipped and the lock kept. Where JAX's cache class differs, only the
    # programs compiling in 0.1 s or more are cached.
    import jax
    from jax._src import lru_cache as _jax_lru_cache

    if callable(getattr(_jax_lru_cache.LRUCache, "_evict_if_needed", None)):
        _jax_lru_cache.LRUCache._evict_if_needed = lambda self, additional_size=0: None
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def assert_close_to_ref(a, b, dtype, rel):
    """``a`` within ``rel`` of ``b``'s largest magnitude, plus one rounding step of ``dtype`` (bf16) at that size."""
    import jax.numpy as jnp
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    big = float(np.max(np.abs(b)))
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 0.0
    np.testing.assert_allclose(a, b, atol=big * (rel + ulp))


def triton_calls_for_cuda(fn, *args) -> int:
    """How many Triton custom calls the jitted ``fn`` lowers to for ``args`` (arrays or shape structs)
    when exported for CUDA, with an sm_90 GPU faked for Pallas's Triton lowering: the CPU-side check
    that a kernel lowers. Skips the test if JAX's private GPU-info API has moved (not our bug)."""
    from unittest import mock

    from jax import export
    try:
        try:
            from jax._src.pallas.triton import gpu_info as gi  # jax 0.11
        except ImportError:
            from jax._src import gpu_info as gi  # jax 0.12
        info = gi.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"cannot fake a GPU for the Triton lowering: {e}")
    with mock.patch.object(gi, "get_gpu_info", lambda: info):
        exp = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exp.mlir_module().count("__gpu$xla.gpu.triton")


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
def xla_optimized(monkeypatch):
    """This test's programs, and its subprocesses', compiled with XLA's usual optimisations (the
    library's own setting, not the suite's ``JAX_DISABLE_MOST_OPTIMIZATIONS``). For a test that
    compares two *different* programs bitwise (their results agree only when XLA's optimiser lowers
    their shared part alike), and for tests whose time goes to running large programs rather than
    compiling small ones (unoptimised elementwise code runs several times slower)."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


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
def tiny_run(tmp_path_factory, worker_id, _data_dir):
    """``tiny_run(steps)``: a copy of a tiny run (``TINY``, ``TrainConfig.steps = steps``, checkpoints
    every 5 steps) in a fresh temp dir. The run is trained once per test run (across xdist workers too)
    for each ``steps`` and copied on every call, so the eval test modules share the training and still
    each write into their own run directory."""
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train

    trained = {}  # steps -> the trained run (never handed out)

    def get(steps: int):
        if steps not in trained:
            trained[steps] = _built_once_per_run(tmp_path_factory, worker_id, f"tiny_run_{steps}", lambda d: train(
                load_config([], list(TINY) + [f"TrainConfig.steps = {steps}"]), d / "run")) / "run"
        copy = tmp_path_factory.mktemp(f"tiny_run_{steps}") / "run"
        shutil.copytree(trained[steps], copy)
        return copy

    return get


def _built_once_per_run(tmp_path_factory, worker_id: str, name: str, build):
    """``build(dir)`` run once per test run, also across xdist workers: the first worker that asks
    builds ``name`` under a file lock in the run's shared temp dir (the workers' basetemps' parent),
    the others wait for it and reuse it. Returns the built directory (never to be written into)."""
    import fcntl
    from pathlib import Path

    if worker_id == "master":  # no xdist: this session is the run
        d = tmp_path_factory.mktemp(name)
        build(d)
        return d
    shared = Path(tmp_path_factory.getbasetemp()).parent
    d = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / ".complete").exists():  # a failed build is done again (and fails again)
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            build(d)
            (d / ".complete").touch()
    return d


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory, worker_id):
    """``(root, stdout)`` of ``hybrid-lm sweep configs/sweeps/tiny_cpu.toml --only swa8 --launch local``
    (2 stable runs, 4 WSD branches), run once per test run as a subprocess, for the end-to-end sweep and
    collect tests. Tests must not write into ``root``: they copy it (``shutil.copytree``)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]

    def build(d):
        r = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "sweep", str(repo / "configs/sweeps/tiny_cpu.toml"),
                            "--only", "swa8", "--launch", "local", "--root", str(d / "tiny")], capture_output=True,
                           text=True, cwd=repo, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        (d / "stdout.txt").write_text(r.stdout)

    d = _built_once_per_run(tmp_path_factory, worker_id, "tiny_sweep", build)
    return d / "tiny", (d / "stdout.txt").read_text()


# Modules whose tests take a minute or more each start the run (in this order, each module's own order
# kept): near the end of a run such a test leaves the other xdist worker idle. The two end-to-end sweep
# tests sit next to each other, so one worker runs both on the sweep it launched (tiny_sweep).
_RUN_FIRST = ("test_cluster.py", "test_wide_vocab.py", "test_sharding.py", "test_signals.py", "test_benchmarks.py",
              "test_scaling_collect.py", "test_scaling_sweep.py")
_TIERS = {"integration": pytest.mark.integration, "gpu": pytest.mark.gpu}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tiers: tests under tests/integration/ and tests/gpu/ carry their folder's marker; the rest of
    tests/ is the unit tier unless a test is marked ``integration`` itself (``make test-fast`` runs
    ``-m "not integration and not gpu"``). Then the long modules first (_RUN_FIRST)."""
    for item in items:
        if item.path.parent.name in _TIERS:
            item.add_marker(_TIERS[item.path.parent.name])
    first = {name: i for i, name in enumerate(_RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
