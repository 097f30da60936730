"""The linear-attention ops' GPU fast path (jax-linear-attention's Mosaic GPU kernels behind
``hybrid_lm.ops.linear_attention_gpu``) against our XLA ops in fp32 at HIGHEST precision: output, final state
and every gradient (initial state included), T not a multiple of 64, with and without an initial state, fp32
inputs cast for the kernel, sequences long enough for jla's sequence split, the delta rule's large heads; and
``impl='auto'`` resolves to the kernel at the benchmarks' shapes. The CPU twin (the same conversions through
jla's plain-JAX ops) is ``tests/test_linear_gpu_path.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_util import GPU, rel_err

from hybrid_lm.ops import linear_attention_gpu as lag
from hybrid_lm.ops.delta_rule import chunk_gated_delta_rule
from hybrid_lm.ops.linear_attention import chunk_simple_gla

pytestmark = GPU + [pytest.mark.skipif(not lag.jla_available(), reason="needs jax-linear-attention")]
HIGHEST = jax.lax.Precision.HIGHEST


def make_inputs(op, seed, B, T, H, Dk, Dv, dtype, state=False, both_gates=False):
    """The op's inputs in our conventions: q, k, v in ``dtype``; gates and state fp32 (realistic gates)."""
    r = np.random.default_rng(seed)
    q, k, v = r.normal(size=(B, T, H, Dk)), r.normal(size=(B, T, H, Dk)), r.normal(size=(B, T, H, Dv))
    out = {}
    if op == "gdn":
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # the layer's L2 norm
        A = r.uniform(1.0, 16.0, size=(H,))
        dt = np.log1p(np.exp(r.normal(size=(B, T, H)) + np.log(np.expm1(0.01))))
        out["g"] = jnp.asarray(-A * dt, jnp.float32)
        out["beta"] = jnp.asarray(1.0 / (1.0 + np.exp(-r.normal(size=(B, T, H)))), jnp.float32)
    elif op == "mamba2" or both_gates:
        A = r.uniform(1.0, 16.0, size=(H,))
        dt = np.exp(r.uniform(np.log(1e-3), np.log(0.1), size=(B, T, H)))
        out["g"] = jnp.asarray(-A * dt, jnp.float32)
        v = v * dt[..., None]
        out["scale"] = 1.0
    if op == "lightning" or both_gates:  # ALiBi-like per-head decays
        out["g_gamma"] = jnp.asarray([-(2.0 ** (-8.0 * (h + 1) / H)) for h in range(H)], jnp.float32)
        out["scale"] = 0.5 if both_gates else 1.0
    out.update(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    if state:
        out["initial_state"] = jnp.asarray(0.5 * r.normal(size=(B, H, Dk, Dv)), jnp.float32)
    return out


def grads_of(f, arrays, seed):
    """``(o, S)`` and the gradients of <o, do> + <S, dS> w.r.t. every array input."""
    o, S = f(**arrays, output_final_state=True)
    r = np.random.default_rng(seed)
    do, dS = (jnp.asarray(r.normal(size=x.shape), jnp.float32) for x in (o, S))

    def loss(a):
        o, S = f(**a, output_final_state=True)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS)
    return (o, S), jax.grad(loss)(arrays)


# (op, B, T, H, Dk, Dv, input dtype, kernel dtype, initial state, both gates)
CASES = {
    "lightning T=1000 state": ("lightning", 2, 1000, 4, 128, 128, "bfloat16", None, True, False),
    "lightning T=8192 split": ("lightning", 1, 8192, 2, 128, 128, "bfloat16", None, False, False),
    "mamba2 fp32->bf16 T=1000 state": ("mamba2", 2, 1000, 8, 128, 64, "float32", "bfloat16", True, False),
    "mamba2 T=4096 split": ("mamba2", 1, 4096, 4, 128, 64, "bfloat16", None, False, False),
    "g+g_gamma fp16 T=777 state": ("simple_gla", 2, 777, 4, 64, 64, "float16", None, True, True),
    "no decay T=300": ("simple_gla", 1, 300, 4, 64, 64, "bfloat16", None, False, False),
    "gdn T=1000 state": ("gdn", 2, 1000, 4, 128, 128, "bfloat16", None, True, False),
    "gdn T=8192 split": ("gdn", 1, 8192, 2, 128, 128, "bfloat16", None, False, False),
    "gdn fp32->bf16 K=64 V=128 state": ("gdn", 2, 1000, 4, 64, 128, "float32", "bfloat16", True, False),
    "gdn K=128 V=256 large heads": ("gdn", 1, 500, 2, 128, 256, "bfloat16", None, True, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_against_the_fp32_xla_op(name):
    op, B, T, H, Dk, Dv, dt, kdt, state, both = CASES[name]
    x = make_inputs(op, 100 + T + H, B, T, H, Dk, Dv, jnp.dtype(dt), state=state, both_gates=both)
    if op == "simple_gla" and not both:
        x.pop("scale", None)  # the default 1/sqrt(Dk)
    gdn = op == "gdn"
    kernel_dtype = None if kdt is None else jnp.dtype(kdt)

    def fast(q, k, v, g=None, g_gamma=None, beta=None, scale=None, initial_state=None, output_final_state=False):
        if gdn:
            return lag.gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, impl="jla", kernel_dtype=kernel_dtype)
        return lag.simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, impl="jla", kernel_dtype=kernel_dtype)

    def ref(q, k, v, g=None, g_gamma=None, beta=None, scale=None, initial_state=None, output_final_state=False):
        up = lambda t: t.astype(jnp.float32)  # noqa: E731 - the same rounded inputs, upcast
        if gdn:
            return chunk_gated_delta_rule(up(q), up(k), up(v), g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, precision=HIGHEST)
        return chunk_simple_gla(up(q), up(k), up(v), g, g_gamma, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, precision=HIGHEST)

    static = {n: a for n, a in x.items() if not hasattr(a, "shape")}
    arrays = {n: a for n, a in x.items() if n not in static}
    (o, S), g_fast = jax.jit(functools.partial(grads_of, functools.partial(fast, **static), seed=7))(arrays)
    (o_r, S_r), g_ref = jax.jit(functools.partial(grads_of, functools.partial(ref, **static), seed=7))(arrays)
    assert o.dtype == jnp.dtype(dt) and S.dtype == jnp.float32
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r), **{f"d{n}": rel_err(g_fast[n], g_ref[n]) for n in g_ref}}
    # bf16-level for outputs and q/k/v gradients; gate and state gradients sum many products of differences
    bad = {n: e for n, e in errs.items() if e >= (2e-2 if n in ("o", "S", "dq", "dk", "dv") else 5e-2)}
    assert not bad, errs


@pytest.mark.parametrize("op", ["lightning", "mamba2", "gdn"])
def test_auto_runs_the_kernel_at_the_benchmark_shapes(op):
    B, T, H, Dk, Dv = 2, 16384, 16, 128, 128
    x = make_inputs(op, 0, B, 128, H, Dk, Dv, jnp.bfloat16)
    spec = {n: (jax.ShapeDtypeStruct((B, T, *a.shape[2:]), a.dtype) if getattr(a, "ndim", 0) >= 3 else a)
            for n, a in x.items()}
    if op == "gdn":
        which = lag.resolve_gated_delta_rule(spec["q"], spec["k"], spec["v"], spec["g"], spec["beta"],
                                             scale=spec.get("scale"), impl="auto")
    else:
        which = lag.resolve_simple_gla(spec["q"], spec["k"], spec["v"], spec.get("g"), spec.get("g_gamma"),
                                       scale=spec.get("scale"), impl="auto")
    assert which == "jla"


def _grads(fn, args, seed):
    """Forward (o, S) and the gradients of <o, co> + <S, cS> w.r.t. every array in ``args``."""
    o, S = fn(*args)
    r = np.random.default_rng(seed)
    co, cS = (jnp.asarray(r.normal(size=x.shape), jnp.float32) for x in (o, S))
    loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) * c) for x, c in zip(fn(*a), (co, cS)))  # noqa: E731
    return (o, S), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def test_grouped_keys_on_the_kernel():
    """The check that turns JLA_GROUPED_KEYS on: jla's Mosaic GPU kernel given Mamba-2's groups (q, k of
    G = 1 head, v of 16; S5's d_state 128, head_dim 64) equals the kernel given the keys repeated, forward
    and gradients, bf16."""
    r = np.random.default_rng(0)
    B, T, G, rep, Dk, Dv = 2, 1000, 1, 16, 128, 64
    q, k = (jnp.asarray(r.normal(size=(B, T, G, Dk)) / Dk ** 0.5, jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, T, G * rep, Dv)), jnp.bfloat16)
    g = jnp.asarray(-np.log1p(np.exp(r.normal(size=(B, T, G * rep)) - 1.0)), jnp.float32)
    call = jax.jit(lambda q, k, v, g: lag._jla_simple_gla(q, k, v, g, None, scale=1.0, initial_state=None,
                                                          output_final_state=True, grouped_keys=True))
    (o, S), (dq, dk, dv, dg) = _grads(call, [q, k, v, g], 7)
    (o_r, S_r), (dq_r, dk_r, dv_r, dg_r) = _grads(call, [jnp.repeat(q, rep, 2), jnp.repeat(k, rep, 2), v, g], 7)
    assert rel_err(o, o_r) < 1e-2 and rel_err(S, S_r) < 1e-2 and rel_err(dv, dv_r) < 1e-2 and rel_err(dg, dg_r) < 1e-2
    for a, b in ((dq, dq_r), (dk, dk_r)):
        assert rel_err(a, b.astype(jnp.float32).reshape(B, T, G, rep, Dk).sum(axis=3)) < 1e-2
