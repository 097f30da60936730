import os

import pytest

# One CPU device per test process; the sharding tests set their own device count in subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HYBRID_LM_COMPILATION_CACHE", "off")  # parallel tests: no shared on-disk cache


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
