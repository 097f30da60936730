"""The GPU fast path of the linear-attention ops (``hybrid_lm/ops/linear_attention_gpu.py``), on CPU.

- dispatch: ``auto`` is our XLA op on CPU (same bits); ``jla`` on CPU or without the package raises a
  clear error; unknown impls are refused; ``ModelConfig.linear_impl`` is validated, reaches the layers
  and does not change the run id.
- conventions: our calls converted into jla's API (gates summed/broadcast, scale, states, dtypes) and
  run through jla's plain-JAX ``chunked`` ops (what runs on CPU; the Mosaic GPU kernel has the same
  contract) match our float32 token-loop references, forward and gradients, T not a multiple of 64,
  with and without initial states. Skipped when jax-linear-attention is not installed.
- the layers routed through the jla conversion (backend swapped to jla's chunked ops) equal their XLA
  path, so the layer wiring (kernel_dtype casts, output dtype) is checked too.

The kernels themselves are checked on a GPU by ``tests/gpu/test_gpu_linear.py``.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm import backends
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import config_record, load_config, run_id
from hybrid_lm.errors import ConfigError
from hybrid_lm.ops import linear_attention_gpu as lag
from hybrid_lm.ops.delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from hybrid_lm.ops.linear_attention import chunk_simple_gla, naive_recurrent_simple_gla

HIGHEST = jax.lax.Precision.HIGHEST


def _inputs(seed, B=2, T=70, H=2, Dk=16, Dv=8, unit_qk=False):
    """Fresh random fp32 inputs (numpy RNG: no per-shape compile of jax.random)."""
    r = np.random.default_rng(seed)
    q, k = r.normal(size=(B, T, H, Dk)), r.normal(size=(B, T, H, Dk))
    if unit_qk:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = r.normal(size=(B, T, H, Dv))
    g = -np.log1p(np.exp(r.normal(size=(B, T, H)) - 1.0))  # log decays < 0 (-softplus)
    g_gamma = -np.exp(r.normal(size=(H,)) - 2.0)
    beta = 1.0 / (1.0 + np.exp(-r.normal(size=(B, T, H))))
    S0 = 0.5 * r.normal(size=(B, H, Dk, Dv))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, g_gamma, beta, S0))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- dispatch

def test_auto_is_xla_on_cpu_bitwise():
    assert jax.default_backend() == "cpu"
    q, k, v, g, g_gamma, beta, S0 = _inputs(0, T=20)
    assert lag.resolve_simple_gla(q, k, v, g, g_gamma) == "xla"
    assert lag.resolve_gated_delta_rule(q, k, v, g, beta, kernel_dtype=jnp.bfloat16) == "xla"
    kw = dict(initial_state=S0, output_final_state=True, chunk_size=8)
    pairs = [
        (lambda *a: lag.simple_gla(*a, **kw), lambda *a: chunk_simple_gla(*a, **kw), (q, k, v, g, g_gamma)),
        (lambda *a: lag.gated_delta_rule(*a, **kw, impl="xla"), lambda *a: chunk_gated_delta_rule(*a, **kw),
         (q, k, v, g, beta)),
    ]
    for ours, ref, args in pairs:
        (o, S), (o2, S2) = jax.jit(ours)(*args), jax.jit(ref)(*args)
        assert jnp.array_equal(o, o2) and jnp.array_equal(S, S2)


def test_jla_on_cpu_is_a_clear_error():
    q, k, v, g, g_gamma, beta, _ = _inputs(0, T=8)
    with pytest.raises(lag.FastPathUnavailable, match="needs a GPU.*'cpu'"):
        lag.simple_gla(q, k, v, g, impl="jla")
    with pytest.raises(lag.FastPathUnavailable, match="needs a GPU"):
        lag.gated_delta_rule(q, k, v, g, beta, impl="jla")
    with pytest.raises(ValueError, match="impl='pallas'"):
        lag.simple_gla(q, k, v, g, impl="pallas")


def test_missing_package(monkeypatch):
    """As if on a GPU without jax-linear-attention: 'jla' says how to install it, 'auto' falls back."""
    monkeypatch.setattr(backends, "on_gpu", lambda platform=None: True)
    monkeypatch.setitem(sys.modules, "jla", None)  # makes `import jla.ops` raise ImportError
    monkeypatch.setitem(sys.modules, "jla.ops", None)
    q, k, v, g, g_gamma, beta, _ = _inputs(0, T=8)
    assert not lag.jla_available()
    with pytest.raises(lag.FastPathUnavailable, match=r"pip install -e '\.\[gpu\]'"):
        lag.simple_gla(q, k, v, g, impl="jla")
    with pytest.raises(lag.FastPathUnavailable, match="jax-linear-attention"):
        lag.gated_delta_rule(q, k, v, g, beta, impl="jla")
    assert lag.resolve_simple_gla(q, k, v, g, impl="auto") == "xla"
    assert lag.resolve_gated_delta_rule(q, k, v, g, beta, impl="auto") == "xla"


def test_unsupported_call_on_gpu_falls_back_or_explains(monkeypatch):
    """jla's predicate rejects a call: auto -> xla, jla -> the reason (simulated GPU, predicate stubbed)."""
    if not lag.jla_available():
        pytest.skip("jax-linear-attention not installed")
    monkeypatch.setattr(backends, "on_gpu", lambda platform=None: True)
    monkeypatch.setattr(lag, "_jla_kernel_reason", lambda op, *a: "head dims K=16, V=8 must be in (64, 128)")
    q, k, v, g, *_ = _inputs(0, T=8)
    assert lag.resolve_simple_gla(q, k, v, g) == "xla"
    with pytest.raises(lag.FastPathUnavailable, match="head dims K=16"):
        lag.simple_gla(q, k, v, g, impl="jla")
    # a traced scale cannot be a kernel constant
    monkeypatch.setattr(lag, "_jla_kernel_reason", lambda op, *a: None)
    assert lag.resolve_simple_gla(q, k, v, g, scale=0.5) == "jla"
    assert lag.resolve_simple_gla(q, k, v, g, scale=jnp.float32(0.5)) == "xla"


def test_linear_impl_config():
    import gin

    try:
        with pytest.raises(ConfigError, match="linear_impl='magic'"):
            load_config([], ["ModelConfig.linear_impl = 'magic'"])
        base = load_config(["quickstart.gin"])
        jla_cfg = load_config(["quickstart.gin"], ["ModelConfig.linear_impl = 'jla'"])
    finally:
        gin.clear_config()  # gin bindings are global: later ModelConfig() calls must not see 'jla'
    assert base.model.linear_impl == "auto" and jla_cfg.model.linear_impl == "jla"
    assert run_id(base) == run_id(jla_cfg)  # an execution detail, like microbatches
    assert config_record(jla_cfg)["model"]["linear_impl"] == "jla"  # recorded in config.json


# ----------------------------------------------------------------------------- conventions vs jla's ops

needs_jla = pytest.mark.skipif(not lag.jla_available(),
                               reason="jax-linear-attention not installed (pip install -e '.[dev]')")


def _grads(fn, args, seed):
    """Forward (o, S) and the gradients of <o, co> + <S, cS> w.r.t. every array in ``args``."""
    o, S = fn(*args)
    r = np.random.default_rng(seed)
    co, cS = (jnp.asarray(r.normal(size=x.shape), jnp.float32) for x in (o, S))
    loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) * c) for x, c in zip(fn(*a), (co, cS)))  # noqa: E731
    return (o, S), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


# (use g, use g_gamma, use initial state, scale): both gates summed + state + explicit scale (Mamba-2 and
# Lightning conversions at once), and neither gate (jla's zero g) with the default scale
SIMPLE_GLA_CASES = {
    "g_plus_g_gamma_state_scale": (True, True, True, 0.3),
    "no_decay_default_scale": (False, False, False, None),
}


@pytest.mark.integration
@needs_jla
@pytest.mark.parametrize("case", list(SIMPLE_GLA_CASES))
def test_simple_gla_conversion_matches_reference(case):
    use_g, use_gamma, use_state, scale = SIMPLE_GLA_CASES[case]
    q, k, v, g, g_gamma, _, S0 = _inputs(1, T=70)
    args = [q, k, v] + ([g] if use_g else []) + ([g_gamma] if use_gamma else []) + ([S0] if use_state else [])

    def call(impl_fn, *a):
        a = list(a)
        q, k, v = a[:3]
        rest = a[3:]
        gg = rest.pop(0) if use_g else None
        gam = rest.pop(0) if use_gamma else None
        s0 = rest.pop(0) if use_state else None
        return impl_fn(q, k, v, gg, gam, scale=scale, initial_state=s0, output_final_state=True)

    ours = functools.partial(lag._jla_simple_gla, backend="chunked")
    with jax.default_matmul_precision("highest"):
        (o, S), grads = _grads(jax.jit(functools.partial(call, ours)), args, 2)
        (o_r, S_r), grads_r = _grads(jax.jit(functools.partial(call, naive_recurrent_simple_gla)), args, 2)
    assert o.dtype == q.dtype and S.dtype == jnp.float32
    assert _rel(o, o_r) < 1e-5 and _rel(S, S_r) < 1e-5
    for i, (a, b) in enumerate(zip(grads, grads_r)):
        assert _rel(a, b) < 1e-4, (case, i, _rel(a, b))


@pytest.mark.integration
@needs_jla
def test_gated_delta_rule_conversion_matches_reference():
    q, k, v, g, _, beta, S0 = _inputs(3, T=70, unit_qk=True)
    args = [q, k, v, g, beta, S0]

    def call(impl_fn, q, k, v, g, beta, s0=None):
        return impl_fn(q, k, v, g, beta, scale=None, initial_state=s0, output_final_state=True)

    ours = functools.partial(lag._jla_gated_delta_rule, backend="chunked")
    with jax.default_matmul_precision("highest"):
        (o, S), grads = _grads(jax.jit(functools.partial(call, ours)), args, 4)
        (o_r, S_r), grads_r = _grads(jax.jit(functools.partial(call, naive_recurrent_gated_delta_rule)), args, 4)
    assert _rel(o, o_r) < 1e-5 and _rel(S, S_r) < 1e-5
    for i, (a, b) in enumerate(zip(grads, grads_r)):
        assert _rel(a, b) < 1e-4, (i, _rel(a, b))


@pytest.mark.integration
@needs_jla
@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])
def test_zero_padded_head_widths_are_exact(op):
    """Widths the kernel rejects (GDN at the presets: Dk=96, Dv=192) are zero-padded to ones it takes and
    sliced back: output, final state and every gradient equal the unpadded reference."""
    delta = op == "gated_delta_rule"
    q, k, v, g, _, beta, S0 = _inputs(5, B=1, T=40, H=2, Dk=24, Dv=40, unit_qk=delta)
    if delta:
        args = [q, k, v, g, beta, S0]
        fn = functools.partial(lag._jla_gated_delta_rule, backend="chunked", pad_to=(32, 64))
        ref = naive_recurrent_gated_delta_rule
    else:
        args = [q, k, v, g, jnp.full((2,), -0.1, jnp.float32), S0]  # per-token g + per-head g_gamma
        fn = functools.partial(lag._jla_simple_gla, backend="chunked", pad_to=(32, 64))
        ref = naive_recurrent_simple_gla

    def call(impl_fn, *a):
        *a, s0 = a
        return impl_fn(*a, scale=None, initial_state=s0, output_final_state=True)

    with jax.default_matmul_precision("highest"):
        (o, S), grads = _grads(jax.jit(functools.partial(call, fn)), args, 6)
        (o_r, S_r), grads_r = _grads(jax.jit(functools.partial(call, ref)), args, 6)
    assert o.shape == o_r.shape and S.shape == S_r.shape == (1, 2, 24, 40)
    assert _rel(o, o_r) < 1e-5 and _rel(S, S_r) < 1e-5
    for i, (a, b) in enumerate(zip(grads, grads_r)):
        assert a.shape == b.shape and _rel(a, b) < 1e-4, (op, i, _rel(a, b))


@needs_jla
def test_padded_output_is_the_kernels_output_unsliced():
    """gated_delta_rule(padded_output=True) on the jla path (GDN's call): o at the padded width in the
    kernel's dtype, its first Dv columns the usual output, the padded columns zero, and a consumer that
    reads only those columns gets the same gradients as from the sliced output."""
    q, k, v, g, _, beta, _ = _inputs(7, B=1, T=24, H=2, Dk=24, Dv=40, unit_qk=True)
    fn = functools.partial(lag._jla_gated_delta_rule, scale=None, initial_state=None, output_final_state=False,
                           kernel_dtype=jnp.bfloat16, backend="chunked", pad_to=(32, 64))
    o_pad, _ = jax.jit(functools.partial(fn, padded_output=True))(q, k, v, g, beta)
    o, _ = jax.jit(fn)(q, k, v, g, beta)
    assert o_pad.shape == (1, 24, 2, 64) and o_pad.dtype == jnp.bfloat16 and o.dtype == q.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o_pad[..., :40], np.float32), np.asarray(o))
    assert not np.any(np.asarray(o_pad[..., 40:], np.float32))
    w = jnp.linspace(-1.0, 1.0, 40)

    def loss(padded, q, v):
        out, _ = fn(q, k, v, g, beta, padded_output=padded)
        return jnp.sum(out[..., :40].astype(jnp.float32) * w)

    grads = [jax.jit(jax.grad(functools.partial(loss, p), argnums=(0, 1)))(q, v) for p in (True, False)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_widths_pick_the_cheapest_accepted_padding(monkeypatch):
    """With jla's predicate stubbed to its documented set, (96, 192) pads to (128, 256); accepted widths
    stay; nothing acceptable -> None (auto then runs XLA)."""
    ok = {(64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128), (256, 256)}
    monkeypatch.setattr(lag, "_jla_kernel_reason",
                        lambda op, q, k, v, gates, options: None if (q.shape[-1], v.shape[-1]) in ok else "no")

    def widths(dk, dv):
        spec = lambda d: jax.ShapeDtypeStruct((1, 64, 2, d), jnp.bfloat16)  # noqa: E731
        return lag.kernel_widths("gated_delta_rule", spec(dk), spec(dk), spec(dv), ())

    assert widths(96, 192) == (128, 256)
    assert widths(128, 128) == (128, 128)
    assert widths(48, 32) == (64, 64)
    assert widths(600, 64) is None


@needs_jla
def test_kernel_dtype_cast_and_output_dtype():
    """fp32 q/k/v with kernel_dtype=bf16 (the layers' call): the kernel sees bf16, the output comes back
    in fp32 (q's dtype), within bf16 rounding of the fp32 reference."""
    import jla.ops as jla_ops

    seen = []
    real = jla_ops.linear_attention

    def spy(kind, q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, kw["g"].dtype))
        return real(kind, q, k, v, **kw)

    q, k, v, g, g_gamma, beta, S0 = _inputs(5, T=40)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jla_ops, "linear_attention", spy)
        fn = jax.jit(functools.partial(lag._jla_simple_gla, scale=None, output_final_state=True,
                                       kernel_dtype=jnp.bfloat16, backend="chunked"))
        o, S = fn(q, k, v, g, None, initial_state=S0)
    assert seen == [(jnp.bfloat16,) * 3 + (jnp.float32,)]
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    o_r, S_r = jax.jit(functools.partial(chunk_simple_gla, output_final_state=True))(q, k, v, g, initial_state=S0)
    assert _rel(o, o_r) < 2e-2 and _rel(S, S_r) < 2e-2


# ----------------------------------------------------------------------------- layers

def _build(kind, impl):
    from hybrid_lm.model.registry import get_mixer

    opts = {"lightning": {"chunk_size": 16}, "mamba2": {"chunk_size": 16, "d_state": 16, "head_dim": 8},
            "gdn": {"chunk_size": 16}}[kind]
    cfg = ModelConfig(d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, n_layers=4, compute_dtype="float32",
                      linear_impl=impl)
    return get_mixer(kind).cls(cfg, MixerConfig(kind=kind, options=opts), 1, rngs=nnx.Rngs(0))


def test_layer_jla_on_cpu_raises():
    x = jnp.asarray(np.random.default_rng(7).normal(size=(1, 8, 32)), jnp.float32)
    with pytest.raises(lag.FastPathUnavailable, match="needs a GPU"):
        _build("lightning", "jla").forward(x)


@pytest.mark.integration
@needs_jla
@pytest.mark.parametrize("kind", ["lightning", "mamba2", "gdn"])
def test_layers_through_the_jla_conversion(kind, monkeypatch):
    """linear_impl='jla' reaches the layer's op call with the layer's compute dtype as kernel_dtype; routed to
    jla's chunked ops through our conversions (a simulated GPU), the layer's output and final state equal
    its XLA path. (Gradients of the conversions are checked at the op level above.)"""
    monkeypatch.setattr(backends, "on_gpu", lambda platform=None: True)
    monkeypatch.setattr(lag, "_jla_kernel_reason", lambda op, *a: None)
    calls = []
    for name in ("_jla_simple_gla", "_jla_gated_delta_rule"):
        real = getattr(lag, name)

        def routed(*a, _real=real, **kw):
            calls.append(kw.get("kernel_dtype"))
            return _real(*a, **kw, backend="chunked")
        monkeypatch.setattr(lag, name, routed)

    def run(impl):
        graphdef, params = nnx.split(_build(kind, impl))
        fwd = jax.jit(lambda params, x: nnx.merge(graphdef, params).forward(x))
        y, st = fwd(params, x)
        return y, st["recurrent_state"]

    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 37, 32)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        y_jla, S_jla = run("jla")
        assert calls and {jnp.dtype(c) for c in calls} == {jnp.dtype(jnp.float32)}  # its compute dtype
        y_xla, S_xla = run("xla")
    assert _rel(y_jla, y_xla) < 1e-5 and _rel(S_jla, S_xla) < 1e-5


# ----------------------------------------------------------------------------- grouped keys (Mamba-2's B/C groups)

def _grouped_inputs(seed, groups=2, rep=3):
    q, k, v, g, _, _, S0 = _inputs(seed, T=37, H=groups * rep)
    return q[:, :, :groups], k[:, :, :groups], v, g, S0, rep


@pytest.mark.parametrize("backend", ["xla", "jla_chunked"])
def test_grouped_keys_equal_repeated_keys(backend):
    """simple_gla with q, k of G heads for H = 3G value heads equals the call with q, k repeated to H heads
    (value head h reads group h // 3): outputs, state, and gradients (the grouped ones are the repeated
    ones summed over each group). On the jla conversion the keys are repeated for jla's plain-JAX ops, so
    this checks our repeat; jla's kernel reading the groups itself is checked by the GPU-marked test below."""
    if backend == "jla_chunked":
        if not lag.jla_available():
            pytest.skip("jax-linear-attention not installed")
        fn = functools.partial(lag._jla_simple_gla, backend="chunked")
    else:
        fn = functools.partial(lag.simple_gla, impl="xla")
    q, k, v, g, S0, rep = _grouped_inputs(5)
    call = jax.jit(lambda q, k, v, g, s0: fn(q, k, v, g, None, scale=0.5, initial_state=s0, output_final_state=True))
    with jax.default_matmul_precision("highest"):
        (o, S), (dq, dk, dv, dg, dS) = _grads(call, [q, k, v, g, S0], 6)
        qr, kr = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
        (o_r, S_r), (dq_r, dk_r, dv_r, dg_r, dS_r) = _grads(call, [qr, kr, v, g, S0], 6)
    assert _rel(o, o_r) < 1e-6 and _rel(S, S_r) < 1e-6
    for a, b in ((dv, dv_r), (dg, dg_r), (dS, dS_r)):
        assert _rel(a, b) < 1e-6
    B, T, G, D = q.shape
    for a, b in ((dq, dq_r), (dk, dk_r)):
        assert _rel(a, b.reshape(B, T, G, rep, D).sum(axis=3)) < 1e-5


def test_grouped_keys_bad_shapes():
    q, k, v, g, S0, _ = _grouped_inputs(0, groups=4, rep=1)
    with pytest.raises(ValueError, match="Hk dividing H"):
        lag.simple_gla(q[:, :, :3], k[:, :, :3], v, g, impl="xla")  # 3 key heads for 4 value heads
    with pytest.raises(ValueError, match="Hk dividing H"):
        lag.simple_gla(q, k[:, :, :2], v, g, impl="xla")  # q and k differ


@pytest.mark.parametrize("grouped_flag", [False, True])
def test_grouped_keys_reach_the_kernel_as_the_flag_says(grouped_flag, monkeypatch):
    """With JLA_GROUPED_KEYS on (the default) jla's kernel predicate sees the groups; off, q, k repeated
    to the value heads."""
    seen = []
    monkeypatch.setattr(backends, "on_gpu", lambda platform=None: True)
    monkeypatch.setattr(backends, "jla_available", lambda: True)
    monkeypatch.setattr(lag, "JLA_GROUPED_KEYS", grouped_flag)
    monkeypatch.setattr(lag, "_jla_kernel_reason", lambda op, q, *a: seen.append(q.shape) or None)
    q, k, v, g, S0, rep = _grouped_inputs(0)
    assert lag.resolve_simple_gla(q, k, v, g, impl="auto") == "jla"
    H = v.shape[2]
    assert seen and seen[0][2] == (q.shape[2] if grouped_flag else H)
