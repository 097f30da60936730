"""Backend dispatch (``hybrid_lm/backends.py``): each op family on CPU and on a faked GPU, the reasons,
the per-layer description behind ``hybrid-lm info --backends``, and the labels the mixers record."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from hybrid_lm import backends, describe
from hybrid_lm.ops.linear_attention_gpu import linear_attention_backend
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ARCHS = sorted(p.name for p in (ROOT / "configs" / "arch").glob("*.gin"))


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")


def _specs(D=128, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct((1, 64, 4, D), dtype)
    return s, s, s


# ----------------------------------------------------------------------------- platform

def test_on_gpu_and_platform():
    assert backends.current_platform() == jax.default_backend() == "cpu"
    assert not backends.on_gpu() and backends.on_gpu("gpu") and not backends.on_gpu("cpu")


def test_one_gpu_check_in_the_package():
    """Every "on a GPU?" question in hybrid_lm/ goes through backends.on_gpu."""
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "hybrid_lm").rglob("*.py")
            if p.name != "backends.py" and 'default_backend() == "gpu"' in p.read_text()]
    assert hits == []


# ----------------------------------------------------------------------------- attention

def test_attention_on_cpu_is_xla_with_the_reason():
    for permuted, window in [(False, None), (False, 128), (True, 128)]:
        b, why = backends.attention_backend("auto", permuted=permuted, window=window, qkv=_specs())
        assert b == "xla" and why == "auto: no GPU: the default JAX backend is 'cpu'"
    assert backends.attention_backend("pallas", permuted=True, window=8) == (
        "pallas", "attention_impl='pallas' set explicitly")


def test_attention_on_a_gpu(fake_gpu, monkeypatch):
    qkv = _specs()
    assert backends.attention_backend("auto", permuted=True, window=128, qkv=qkv)[0] == "pallas"
    b, why = backends.attention_backend("auto", permuted=False, window=None, qkv=qkv)
    assert b == "cudnn" and "full causal" in why
    # jla is not usable on this host: the fallback says why, around the measured window threshold
    w = backends.PALLAS_SWA_MAX_WINDOW
    b, why = backends.attention_backend("auto", permuted=False, window=w, qkv=qkv)
    assert b == "pallas" and f"<= PALLAS_SWA_MAX_WINDOW={w}" in why and "not jla" in why
    b, why = backends.attention_backend("auto", permuted=False, window=w + 1, qkv=qkv)
    assert b == "cudnn" and f"> PALLAS_SWA_MAX_WINDOW={w}" in why
    assert "no operands" in backends.attention_backend("auto", permuted=False, window=64)[1]
    monkeypatch.setattr(backends, "jla_attention_reason", lambda q, k, v, platform=None: None)
    assert backends.attention_backend("auto", permuted=False, window=4096, qkv=qkv) == (
        "jla", "auto: jla's Mosaic GPU kernel takes these operands")


def test_deterministic_ops_keep_cudnn_out_of_attention(fake_gpu, monkeypatch):
    """Under --xla_gpu_deterministic_ops, auto never picks cuDNN: jla where it takes the operands, else
    our kernel; the reason says so. An explicit choice still runs what it names."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    for window in (None, 128, 4096):
        for qkv in (_specs(), _specs(dtype=jnp.float32), None):
            b, why = backends.attention_backend("auto", permuted=False, window=window, qkv=qkv)
            assert b == "pallas" and "deterministic GPU ops" in why and "not jla" in why
    assert backends.attention_backend("auto", permuted=True, window=128, qkv=_specs())[0] == "pallas"
    assert backends.attention_backend("cudnn", permuted=False, window=None)[0] == "cudnn"
    monkeypatch.setattr(backends, "jla_attention_reason", lambda q, k, v, platform=None: None)
    for window in (None, 128):
        b, why = backends.attention_backend("auto", permuted=False, window=window, qkv=_specs())
        assert b == "jla" and "deterministic backward" in why
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert backends.attention_backend("auto", permuted=False, window=None, qkv=_specs())[0] == "cudnn"


def test_attention_platform_argument_without_faking():
    """An explicit platform decides as the default backend would."""
    assert backends.attention_backend("auto", permuted=False, window=None, platform="gpu")[0] == "cudnn"
    assert backends.attention_backend("auto", permuted=True, window=8, platform="gpu")[0] == "pallas"
    assert backends.attention_backend("auto", permuted=True, window=8, platform="cpu")[0] == "xla"
    assert "no GPU" in backends.jla_attention_reason(*_specs(), platform="cpu")
    with pytest.raises(ConfigError, match="stochastic"):
        backends.attention_backend("cudnn", permuted=True, window=8, platform="gpu")


def test_attention_op_names():
    assert backends.attention_op_name(None, False) == "full"
    assert backends.attention_op_name(128, False) == "swa w=128"
    assert backends.attention_op_name(64, True) == "sa w=64"


# ----------------------------------------------------------------------------- block-sparse

def test_moba_backend_per_platform_and_block():
    assert backends.moba_backend("auto", 16) == ("xla", "auto: no GPU: the default JAX backend is 'cpu'")
    b, why = backends.moba_backend("auto", 16, platform="gpu")
    assert b == "pallas" and "power of two" in why
    b, why = backends.moba_backend("auto", 8, platform="gpu")  # below MOBA_PALLAS_MIN_BLOCK
    assert b == "xla" and f">= {backends.MOBA_PALLAS_MIN_BLOCK}" in why
    assert backends.moba_backend("auto", 96, platform="gpu")[0] == "xla"
    with pytest.raises(ConfigError, match="power of two"):
        backends.moba_backend("pallas", 8)


def test_moba_backend_on_a_faked_gpu(fake_gpu):
    assert backends.moba_backend("auto", 128)[0] == "pallas"


def test_topk_method(fake_gpu):
    r, k = backends.PASSES_MIN_RATIO, backends.PASSES_MAX_K
    assert backends.topk_method("auto", 16, 16 * r)[0] == "passes"
    assert backends.topk_method("auto", 16, 16 * r - 1)[0] == "sort"
    assert backends.topk_method("auto", k + 1, 10 ** 6)[0] == "sort"
    assert backends.topk_method("auto", 16, 16 * r, platform="cpu") == (
        "sort", "auto: no GPU: the default JAX backend is 'cpu'")
    assert backends.topk_method("passes", 4, 8)[0] == "passes"
    with pytest.raises(ValueError, match="method"):
        backends.topk_method("heap", 4, 8)


# ----------------------------------------------------------------------------- linear attention

def _linear_specs(D=64):
    s = jax.ShapeDtypeStruct((1, 64, 2, D), jnp.bfloat16)
    return (s, s, s), (jax.ShapeDtypeStruct((1, 64, 2), jnp.float32),)


def test_linear_backend_on_cpu():
    qkv, gates = _linear_specs()
    b, why = linear_attention_backend("simple_gla", "auto", *qkv, gates)
    assert b == "xla" and why.startswith("auto: no GPU: the default JAX backend is 'cpu'")
    assert linear_attention_backend("simple_gla", "xla", *qkv, gates) == (
        "xla", "linear_impl='xla' set explicitly")
    with pytest.raises(backends.FastPathUnavailable, match="needs a GPU.*'cpu'"):
        linear_attention_backend("gated_delta_rule", "jla", *qkv, gates)
    with pytest.raises(ValueError, match="impl='pallas'"):
        linear_attention_backend("simple_gla", "pallas", *qkv, gates)


def test_linear_backend_on_a_faked_gpu(fake_gpu, monkeypatch):
    qkv, gates = _linear_specs()
    monkeypatch.setitem(sys.modules, "jla", None)  # as if jax-linear-attention were not installed
    monkeypatch.setitem(sys.modules, "jla.ops", None)
    b, why = linear_attention_backend("simple_gla", "auto", *qkv, gates)
    assert b == "xla" and "not installed" in why
    with pytest.raises(backends.FastPathUnavailable, match="jax-linear-attention"):
        linear_attention_backend("simple_gla", "jla", *qkv, gates)
    monkeypatch.undo()
    if not backends.jla_available():
        return
    monkeypatch.setattr(backends, "on_gpu", lambda platform=None: True)
    from hybrid_lm.ops import linear_attention_gpu as lag
    monkeypatch.setattr(lag, "_jla_kernel_reason", lambda op, *a: None)
    assert linear_attention_backend("simple_gla", "auto", *qkv, gates, scale=0.5) == (
        "jla", "auto: jla's Mosaic GPU kernel takes this call")
    b, why = linear_attention_backend("simple_gla", "auto", *qkv, gates, scale=jnp.float32(0.5))
    assert b == "xla" and "scale must be a Python number" in why


# ----------------------------------------------------------------------------- the record

def test_record_keeps_reasons_and_clears_both():
    backends.recorded_backends(clear=True)
    backends.record_backend("op a", "xla", "because")
    assert backends.recorded_backends() == {"op a": "xla"}
    assert backends.recorded_reasons() == {"op a": "because"}
    assert backends.recorded_backends(clear=True) == {"op a": "xla"}
    assert backends.recorded_backends() == {} and backends.recorded_reasons() == {}


def _forward(model):
    """A traced forward pass (the record is filled while tracing, as in the train step)."""
    nnx.eval_shape(lambda m, t: m(t), model, jnp.zeros((1, 32), jnp.int32))


def _cfg(kind, **opts):
    return ModelConfig(d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, n_layers=2, layer_pattern="E",
                       compute_dtype="float32", efficient=MixerConfig(kind=kind, options=opts))


@pytest.mark.parametrize("kind,opts", [("lightning", {"chunk_size": 16}),
                                       ("mamba2", {"chunk_size": 16, "d_state": 16, "head_dim": 8}),
                                       ("gdn", {"chunk_size": 16})])
def test_linear_mixers_record_their_backend(kind, opts):
    from hybrid_lm.model.transformer import HybridLM
    model = nnx.eval_shape(lambda: HybridLM(_cfg(kind, **opts), rngs=nnx.Rngs(0)))
    backends.recorded_backends(clear=True)
    _forward(model)
    assert backends.recorded_backends() == {kind: "xla"}
    assert "no GPU" in backends.recorded_reasons()[kind]


def test_ssa_records_its_sparse_stream_under_its_own_label():
    from hybrid_lm.model.transformer import HybridLM
    model = nnx.eval_shape(lambda: HybridLM(_cfg("ssa", block_size=8, top_k=2), rngs=nnx.Rngs(0)))
    backends.recorded_backends(clear=True)
    _forward(model)
    assert backends.recorded_backends() == {"full": "xla", "ssa sparse block=8": "xla"}
    model = nnx.eval_shape(lambda: HybridLM(_cfg("moba", block_size=8, top_k=2), rngs=nnx.Rngs(0)))
    backends.recorded_backends(clear=True)
    _forward(model)
    assert backends.recorded_backends() == {"moba block=8": "xla"}


# ----------------------------------------------------------------------------- per layer

def _ops_by_layer(rows):
    out = {}
    for r in rows:
        out.setdefault(r["layer"], []).append(r["op"])
    return out


def test_describe_layers_quickstart():
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin")])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert _ops_by_layer(rows) == {0: ["full"], 1: ["swa w=32"], 2: ["full"], 3: ["swa w=32"]}
    assert [r["slot"] for r in rows] == ["full", "efficient"] * 2
    assert all(r["backend"] == "xla" and "no GPU" in r["reason"] for r in rows)
    assert rows[1] == {"layer": 1, "slot": "efficient", "kind": "swa", "window": 32, "block": None,
                       "op": "swa w=32", "backend": "xla",
                       "reason": "auto: no GPU: the default JAX backend is 'cpu'"}
    lines = describe.format_layers(rows)
    assert lines[0].split() == ["layer", "slot", "mixer", "window/block", "op", "backend", "reason"]
    assert len(lines) == 5 and "swa w=32" in lines[2]


# the ops each efficient (or, for ssa, full) slot of an arch file records at the quickstart's T=128
ARCH_OPS = {"gdn.gin": ["gdn"], "lightning.gin": ["lightning"], "mamba2.gin": ["mamba2"],
            "moba.gin": ["moba block=16"], "sa.gin": ["sa w=128"], "sa_swa.gin": ["full", "sa w=128"],
            "ssa.gin": ["full", "ssa sparse block=16"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_describe_layers_arch(arch):
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin"), str(ROOT / "configs" / "arch" / arch)])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    by_layer = _ops_by_layer(rows)
    assert sorted(by_layer) == list(range(cfg.model.n_layers))
    mixed = [i for i, t in enumerate(cfg.model.layer_types()) if cfg.model.mixer(t).kind not in ("attention",)]
    assert mixed and all(by_layer[i] == ARCH_OPS[arch] for i in mixed)
    assert all(r["backend"] == "xla" and r["reason"] for r in rows)
    if arch == "ssa.gin":
        assert {r["block"] for r in rows} == {16}


def test_describe_layers_leaves_the_record_alone():
    backends.recorded_backends(clear=True)
    backends.record_backend("mine", "xla", "kept")
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin")])
    describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert backends.recorded_backends(clear=True) == {"mine": "xla"}


def test_describe_layers_on_a_faked_gpu(fake_gpu, monkeypatch):
    """What each layer would run on a GPU (cuDNN itself cannot run here: stubbed)."""
    from hybrid_lm.ops import attention as ops
    monkeypatch.setattr(ops, "causal_attention", lambda q, k, v, implementation: q)
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin"), str(ROOT / "configs" / "arch" / "ssa.gin")],
                      ["ModelConfig.compute_dtype = 'bfloat16'"])  # cuDNN takes bf16/fp16 only
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert [(r["op"], r["backend"]) for r in rows[:2]] == [("full", "cudnn"), ("ssa sparse block=16", "pallas-gather")]
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin")], ["ModelConfig.compute_dtype = 'bfloat16'"])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert [(r["op"], r["backend"]) for r in rows[:2]] == [("full", "cudnn"), ("swa w=32", "pallas")]
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin")])  # fp32: cuDNN would reject it
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert [(r["op"], r["backend"]) for r in rows[:2]] == [("full", "xla"), ("swa w=32", "pallas")]


def test_describe_layers_reports_an_impossible_choice():
    cfg = load_config([str(ROOT / "configs" / "quickstart.gin"), str(ROOT / "configs" / "arch" / "sa.gin")],
                      ["ModelConfig.attention_impl = 'cudnn'"])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len)
    err = [r for r in rows if r["op"] == "error" and r["kind"] == "sa"]
    assert err and all("ConfigError" in r["reason"] and "stochastic" in r["reason"] for r in err)


@pytest.mark.integration
def test_cli_info_backends(capsys):
    from hybrid_lm.cli import main
    qs = str(ROOT / "configs" / "quickstart.gin")
    assert main(["info", qs, "--backends"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("platform cpu   seq_len 128") and out[1].split()[:2] == ["layer", "slot"]
    assert len(out) == 2 + 4
    assert main(["info", qs, "--backends", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"] == "cpu" and info["seq_len"] == 128 and len(info["layers"]) == 4
    assert all(r["backend"] == "xla" for r in info["layers"])


def test_auto_never_sends_fp32_to_cudnn():
    """cuDNN rejects fp32 q/k/v: under auto on a GPU, fp32 full attention runs xla and fp32 SWA our kernel."""
    import jax
    import jax.numpy as jnp

    from hybrid_lm import backends

    def qkv(dtype):
        return tuple(jax.ShapeDtypeStruct((1, 64, 2, 64), dtype) for _ in range(3))

    full32, why = backends.attention_backend("auto", permuted=False, window=None, qkv=qkv(jnp.float32), platform="gpu")
    assert full32 == "xla" and "float32" in why
    full16, _ = backends.attention_backend("auto", permuted=False, window=None, qkv=qkv(jnp.bfloat16), platform="gpu")
    assert full16 == "cudnn"
    swa32, _ = backends.attention_backend("auto", permuted=False, window=512, qkv=qkv(jnp.float32), platform="gpu")
    assert swa32 != "cudnn"
