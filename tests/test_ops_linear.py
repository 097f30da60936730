"""Scalar-decay linear attention (simple GLA: Lightning, Mamba-2 SSD) and the gated delta rule.

Oracles, from most to least independent:
- a float64 numpy loop written from fla's naive recurrences (checks the JAX reference itself);
- the naive ``lax.scan`` recurrence run in float64 (x64 enabled locally), for forward and gradients
  of the chunked form at several (T, chunk) pairs, including T not divisible by the chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.ops.delta_rule import (chunk_gated_delta_rule, gated_delta_rule_step,
                                      naive_recurrent_gated_delta_rule)
from hybrid_lm.ops.linear_attention import chunk_simple_gla, naive_recurrent_simple_gla, simple_gla_step

B, H, DK, DV = 2, 3, 8, 12  # Dk != Dv on purpose


def _rel(a, b):
    """fla's metric: RMS error relative to the reference's RMS."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(op, T, seed, *, h0=True, g_mode="both", strong=False):
    """Fresh random inputs as float64 numpy arrays (cast by the caller)."""
    r = np.random.default_rng(seed)
    x = {"q": r.normal(size=(B, T, H, DK)), "k": r.normal(size=(B, T, H, DK)),
         "v": r.normal(size=(B, T, H, DV))}
    logsig = lambda z: -np.logaddexp(0.0, -z)  # noqa: E731
    if op == "gla":
        if g_mode in ("g", "both"):
            x["g"] = logsig(r.normal(1.0, 1.5, size=(B, T, H)))
            if strong:  # a few tokens that wipe the state; cumulated over a chunk this is ~ -1e3
                x["g"] = np.where(r.random((B, T, H)) < 0.2, -50.0, x["g"])
        if g_mode in ("gamma", "both"):
            # head 0 has no decay, as fla's Lightning head 0
            x["g_gamma"] = (np.array([0.0, -8.0, -30.0]) if strong
                            else -r.uniform(0.05, 1.0, size=H) * [0, 1, 1])
    else:
        x["q"] /= np.linalg.norm(x["q"], axis=-1, keepdims=True)  # the layer's L2 norm
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
        x["g"] = logsig(r.normal(3.0, 1.5, size=(B, T, H)))
        if strong:
            x["g"] = np.where(r.random((B, T, H)) < 0.2, -50.0, x["g"])
        x["beta"] = 1.0 / (1.0 + np.exp(-r.normal(size=(B, T, H))))
    if h0:
        x["initial_state"] = 0.5 * r.normal(size=(B, H, DK, DV))
    return x


def _cast(x, dtype):
    return {n: jnp.asarray(a, dtype) for n, a in x.items()}


def _call(op, form, x, **kw):
    """Run one op/form on the dict of inputs; returns (o, final_state)."""
    x = dict(x)
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
    if op == "gla":
        f = chunk_simple_gla if form == "chunk" else naive_recurrent_simple_gla
        return f(q, k, v, x.pop("g", None), x.pop("g_gamma", None), output_final_state=True, **x, **kw)
    f = chunk_gated_delta_rule if form == "chunk" else naive_recurrent_gated_delta_rule
    return f(q, k, v, x.pop("g"), x.pop("beta"), output_final_state=True, **x, **kw)


def _run(op, form, x, proj, **kw):
    """Jitted: o, final state, a random projection of both, and its gradient w.r.t. every input."""

    def loss(x):
        o, s = _call(op, form, x, **kw)
        return jnp.sum(o * proj[0]) + jnp.sum(s * proj[1]), (o, s)

    (l, (o, s)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return o, s, l, grads


def _proj(T, dtype, seed=123):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.normal(size=(B, T, H, DV)), dtype), jnp.asarray(r.normal(size=(B, H, DK, DV)), dtype)


# --- the JAX reference against fla's recurrences written out in numpy float64 ---------------------------

def _np_simple_gla(x, scale):
    q, k, v = x["q"], x["k"], x["v"]
    T = q.shape[1]
    g = x.get("g", np.zeros((B, T, H))) + x.get("g_gamma", np.zeros(H))
    S = x.get("initial_state", np.zeros((B, H, DK, DV))).copy()
    o = np.zeros((B, T, H, DV))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def _np_gated_delta_rule(x, scale):
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    S = x.get("initial_state", np.zeros((B, H, DK, DV))).copy()
    o = np.zeros((B, q.shape[1], H, DV))
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        v_new = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * v_new[:, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


@pytest.mark.parametrize("op,scale", [("gla", None), ("gla", 1.0), ("delta", None)])
def test_naive_matches_numpy_float64(op, scale):
    x = _inputs(op, 29, seed=1)
    ref = (_np_simple_gla if op == "gla" else _np_gated_delta_rule)(x, DK ** -0.5 if scale is None else scale)
    for form, kw in (("naive", {}), ("chunk", {"chunk_size": 8})):
        run = jax.jit(lambda x, form=form, kw=kw: _call(op, form, x, scale=scale, **kw))
        o, s = run(_cast(x, jnp.float32))
        assert o.dtype == jnp.float32 and s.dtype == jnp.float32 and s.shape == (B, H, DK, DV)
        assert _rel(o, ref[0]) < 2e-6, form
        assert _rel(s, ref[1]) < 2e-6, form


# --- chunked against naive: forward and gradients -------------------------------------------------------

CASES = [  # (op, T, chunk, g_mode, initial state, also check the chunked form in float64)
    ("gla", 37, 16, "g", True, True),
    ("gla", 130, 32, "gamma", True, False),
    ("gla", 20, 64, "both", False, False),  # T < chunk: one chunk of T
    ("gla", 45, 7, "none", True, False),  # no decay at all: plain causal linear attention
    ("delta", 37, 16, None, False, True),
    ("delta", 130, 32, None, True, False),
    ("delta", 20, 64, None, True, False),
]


def _check_chunk_vs_naive(op, T, chunk, x, fwd_tol, grad_tol, check_f64):
    proj64 = _proj(T, jnp.float64)
    ref_o, ref_s, ref_l, ref_g = _run(op, "naive", _cast(x, jnp.float64), proj64)
    if check_f64:  # float64 chunked: algorithm errors cannot hide behind rounding here
        o64, s64, l64, g64 = _run(op, "chunk", _cast(x, jnp.float64), proj64, chunk_size=chunk)
        assert _rel(o64, ref_o) < 1e-11 and _rel(s64, ref_s) < 1e-11
        assert abs(float(l64 - ref_l)) < 1e-9 * abs(float(ref_l))
        for n in ref_g:
            assert _rel(g64[n], ref_g[n]) < 1e-11, n
    # float32 chunked, the training configuration
    o32, s32, _, g32 = _run(op, "chunk", _cast(x, jnp.float32), _proj(T, jnp.float32), chunk_size=chunk)
    assert o32.dtype == jnp.float32 and s32.dtype == jnp.float32
    assert _rel(o32, ref_o) < fwd_tol and _rel(s32, ref_s) < fwd_tol
    for n in ref_g:
        assert g32[n].dtype == jnp.float32 and g32[n].shape == x[n].shape, n
        assert _rel(g32[n], ref_g[n]) < grad_tol, n


@pytest.mark.integration
@pytest.mark.parametrize("op,T,chunk,g_mode,h0,check_f64", CASES)
def test_chunk_matches_naive(op, T, chunk, g_mode, h0, check_f64):
    x = _inputs(op, T, seed=T + chunk, h0=h0, g_mode=g_mode)
    with jax.enable_x64(True):
        _check_chunk_vs_naive(op, T, chunk, x, fwd_tol=1e-5, grad_tol=1e-4, check_f64=check_f64)


@pytest.mark.integration
@pytest.mark.parametrize("op", ["gla", "delta"])
def test_strong_decay_is_stable(op):
    """Log decays of -30 per token and -50 spikes: cumulated over a 64-token chunk these reach ~ -2e3.
    A chunked form that exponentiated the cumulated decays (or their negatives) would give inf/NaN."""
    x = _inputs(op, 130, seed=7, strong=True)
    with jax.enable_x64(True):
        _check_chunk_vs_naive(op, 130, 64, x, fwd_tol=1e-5, grad_tol=1e-4, check_f64=False)


# --- state carrying, bf16, decode -----------------------------------------------------------------------

def _split_time(x, lo, hi):
    return {n: (a[:, lo:hi] if n in ("q", "k", "v", "g", "beta") else a) for n, a in x.items()}


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_carry_state(op):
    """[0:T1] then [T1:T] from the returned state equals one pass (T1 and T - T1 not multiples of the
    chunk). Forward only: gradients w.r.t. the initial state and through the final state are checked
    in test_chunk_matches_naive, so the chain rule covers the composition."""
    T, T1, chunk = 70, 27, 16
    x = _cast(_inputs(op, T, seed=3), jnp.float32)

    @jax.jit
    def passes(x):
        o1, s1 = _call(op, "chunk", _split_time(x, 0, T1), chunk_size=chunk)
        o2, s2 = _call(op, "chunk", dict(_split_time(x, T1, T), initial_state=s1), chunk_size=chunk)
        o, s = _call(op, "chunk", x, chunk_size=chunk)
        return jnp.concatenate([o1, o2], axis=1), s2, o, s

    o_two, s_two, o_one, s_one = passes(x)
    assert _rel(o_two, o_one) < 1e-5 and _rel(s_two, s_one) < 1e-5


@pytest.mark.integration
@pytest.mark.parametrize("op,strong", [("gla", True), ("delta", False)])
def test_bf16_stays_finite(op, strong):
    T = 130
    x = _inputs(op, T, seed=11, strong=strong)
    xb = {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else jnp.bfloat16) for n, a in x.items()}
    o, s, _, grads = _run(op, "chunk", xb, _proj(T, jnp.bfloat16))
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.isfinite(s).all())
    # close to the float32 result on the same (bf16-rounded) inputs
    o32, s32 = jax.jit(lambda x: _call(op, "chunk", x))({n: a.astype(jnp.float32) for n, a in xb.items()})
    assert _rel(o, o32) < 2e-2 and _rel(s, s32) < 1e-4
    for n, gr in grads.items():
        assert gr.dtype == xb[n].dtype and bool(jnp.isfinite(gr.astype(jnp.float32)).all()), n


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_decode_steps_match_chunk(op):
    T = 23
    x = _cast(_inputs(op, T, seed=5), jnp.float32)
    o_ref, s_ref = jax.jit(lambda x: _call(op, "chunk", x, chunk_size=8))(x)
    if op == "gla":
        step = jax.jit(simple_gla_step)
        gates = lambda t: (x["g"][:, t] + x["g_gamma"],)  # noqa: E731
    else:
        step = jax.jit(gated_delta_rule_step)
        gates = lambda t: (x["g"][:, t], x["beta"][:, t])  # noqa: E731
    state, outs = x["initial_state"], []
    for t in range(T):
        o_t, state = step(state, x["q"][:, t], x["k"][:, t], x["v"][:, t], *gates(t))
        outs.append(o_t)
    assert state.dtype == jnp.float32 and state.shape == (B, H, DK, DV)
    assert _rel(jnp.stack(outs, axis=1), o_ref) < 1e-5 and _rel(state, s_ref) < 1e-5


def test_gla_step_constant_decay_per_head():
    """Lightning decode passes the per-head [H] log decay straight to the step."""
    x = _cast(_inputs("gla", 5, seed=9, g_mode="gamma"), jnp.float32)
    o_ref, s_ref = _call("gla", "naive", x)
    state = x["initial_state"]
    for t in range(5):
        o_t, state = simple_gla_step(state, x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g_gamma"])
        assert _rel(o_t, o_ref[:, t]) < 1e-6
    assert _rel(state, s_ref) < 1e-6


def test_final_state_optional_and_shape_errors():
    x = _cast(_inputs("delta", 10, seed=2, h0=False), jnp.float32)
    o, s = jax.eval_shape(lambda x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"]), x)
    assert s is None and o.shape == (B, 10, H, DV)
    o, s = jax.eval_shape(lambda x: chunk_simple_gla(x["q"], x["k"], x["v"], x["g"]), x)
    assert s is None and o.shape == (B, 10, H, DV)
    with pytest.raises(ValueError):
        chunk_simple_gla(x["q"], x["k"], x["v"], g_gamma=x["g"])  # [B, T, H] where [H] is expected
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                               initial_state=jnp.ones((B, H, DV, DK)))  # [B, H, Dv, Dk]: transposed
