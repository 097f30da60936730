"""Recurrent mixers (lightning, mamba2, gdn): layer oracles, decode == chunked, gradients, bf16, FLOPs,
parameter accounting, training inside a 1:1 hybrid.

Oracles:
- a float64 numpy token loop per layer, written from the reference layers (TNL/lightning_attn,
  mamba_ssm's decode path, fla's GatedDeltaNet + naive recurrence), sharing no code with the layer;
- the layer's own decode ``step`` scanned over time, against the chunked ``forward`` (values, states,
  gradients), from a non-zero carried state (conv and recurrent), with T not a multiple of the chunk;
- FLOPs: the multiply-adds of every ``dot_general`` / ``triangular_solve`` the traced layer executes.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.model.gated_deltanet import GatedDeltaNet
from hybrid_lm.model.lightning import LightningAttention, alibi_slopes, lightning_log_decay
from hybrid_lm.model import recurrent_common as rc
from hybrid_lm.model.mamba2 import Mamba2
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.model.transformer import HybridLM
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.train.optim import decay_mask

B, T, D_MODEL, H, DH, N_LAYERS = 2, 19, 32, 2, 16, 4
CHUNK = 8  # T = 19 is not a multiple

# small but complete variants of each layer: (class, options)
LAYERS = {
    "lightning": (LightningAttention, {"chunk_size": CHUNK}),
    "lightning_fla_rms_full": (LightningAttention, {"chunk_size": CHUNK, "decay": "fla", "norm": "rms",
                                                    "gate": "full"}),
    "mamba2": (Mamba2, {"chunk_size": CHUNK, "d_state": 8, "head_dim": 16, "n_groups": 2}),  # 4 heads, 2 groups
    "gdn": (GatedDeltaNet, {"chunk_size": CHUNK}),  # 2 heads, Dk = 0.75 * 32 / 2 = 12, Dv = 24
    "gdn_nogate_convbias": (GatedDeltaNet, {"chunk_size": CHUNK, "use_gate": False, "conv_bias": True,
                                            "num_heads": 3, "head_dim": 8, "expand_v": 1.5}),
}


def _cfg(dtype="float32"):
    return ModelConfig(d_model=D_MODEL, n_heads=H, n_kv_heads=1, head_dim=DH, n_layers=N_LAYERS,
                       compute_dtype=dtype)


def _layer(name, seed=0, layer_idx=1, dtype="float32"):
    """A layer with fresh random parameters (numpy RNG: no per-shape compile of jax.random init).

    Matrices N(0, 1/fan_in) (unit-scale activations), norm scales and D ``1 + noise``, biases noise;
    ``A_log`` / ``dt_bias`` drawn from the reference init ranges (a realistic range of decays).
    """
    cls, opts = LAYERS[name]
    abstract = nnx.eval_shape(lambda: cls(_cfg(dtype), MixerConfig(kind="x", options=opts), layer_idx,
                                          rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    r = np.random.default_rng(seed)
    new = []
    for path, var in nnx.to_flat_state(state):
        shape, key, axes = var.get_value().shape, str(path[-1]), var.get_metadata()["logical_axes"]
        if key == "A_log":
            x = np.log(r.uniform(1.0, 16.0, shape))
        elif key == "dt_bias":
            dt = np.exp(r.uniform(np.log(1e-3), np.log(0.1), shape))
            x = dt + np.log(-np.expm1(-dt))
        elif "norm" in axes or key == "D":
            x = 1.0 + 0.3 * r.normal(size=shape)
        elif "bias" in axes:
            x = 0.3 * r.normal(size=shape)
        else:  # matrices and conv taps
            fan_in = int(np.prod(shape[:-1])) if axes[-1] == "embed" else shape[0]  # out-proj: H*D
            x = r.normal(size=shape) / math.sqrt(fan_in)
        new.append((path, var.replace(jnp.asarray(x, jnp.float32))))
    return nnx.merge(graphdef, nnx.from_flat_state(new))


def _x(seed, t=T, b=B):
    return jax.random.normal(jax.random.key(seed), (b, t, D_MODEL), jnp.float32)


def _ctx(b=B, t=T):
    return MixerContext(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))


def _scan_steps(m, x, state):
    """Decode ``step`` over time: the recurrent form of the whole layer."""
    def body(s, x_t):
        y_t, s = m.step(x_t, s)
        return s, y_t
    s, ys = jax.lax.scan(body, state, jnp.moveaxis(x, 1, 0))
    return jnp.moveaxis(ys, 0, 1), s


def _assert_close_tree(a, b, tol):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for u, w in zip(la, lb):
        u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
        assert u.shape == w.shape
        err = np.linalg.norm(u - w) / max(np.linalg.norm(w), 1e-30)
        assert err < tol, err


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- numpy oracles (float64)

def _np(p):
    return np.asarray(p[...], np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _conv_np(x, w, b=None):
    """Causal depthwise conv as torch Conv1d(padding=K-1)[..., :T]: x [T, C], w [K, C]."""
    K = w.shape[0]
    xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x], 0)
    y = sum(xp[i:i + x.shape[0]] * w[i] for i in range(K))
    return y if b is None else y + b


def _lightning_np(m, x):
    """TNL / lightning_attn_func semantics, O(T^2): o_t = scale sum_s exp(-slope (t-s)) (q_t.k_s) v_s."""
    o_opts = m.opts
    slopes = -np.asarray(m.g_gamma)
    out = []
    for xb in np.asarray(x, np.float64):
        q, k, v = (_silu(np.einsum("td,dhk->thk", xb, _np(w))) for w in (m.wq, m.wk, m.wv))
        t = np.arange(xb.shape[0])
        dist = t[:, None] - t[None, :]
        decay = np.where(dist >= 0, np.exp(-slopes[:, None, None] * np.maximum(dist, 0)), 0.0)  # [H, T, T]
        o = m.scale * np.einsum("thk,shk,hts,shv->thv", q, k, decay, v)
        if o_opts.norm == "layer":
            o = o - o.mean(axis=(1, 2), keepdims=True)
        o = o / np.sqrt((o * o).mean(axis=(1, 2), keepdims=True) + 1e-5) * _np(m.norm_scale)
        if m.norm_bias is not None:
            o = o + _np(m.norm_bias)
        if o_opts.gate == "lowrank":
            o = o / (1 + np.exp(-np.einsum("tr,rhk->thk", xb @ _np(m.wg_down), _np(m.wg_up))))
        elif o_opts.gate == "full":
            o = o / (1 + np.exp(-np.einsum("td,dhk->thk", xb, _np(m.wg))))
        out.append(np.einsum("thk,hkd->td", o, _np(m.wo)))
    return np.stack(out)


def _mamba2_np(m, x):
    """mamba_ssm / HF Mamba2 decode path, token by token, state [H, P, N] (their layout)."""
    o = m.opts
    Hh, P, N, G = m.n_heads, o.head_dim, o.d_state, o.n_groups
    di = Hh * P
    out = []
    for xb in np.asarray(x, np.float64):
        z = np.einsum("td,dhp->thp", xb, _np(m.w_z)).reshape(-1, di)
        bias = None if m.conv.bias is None else _np(m.conv.bias)
        xbc = _silu(_conv_np(xb @ _np(m.w_xbc), _np(m.conv.weight), bias))
        xs, Bm, Cm = xbc[:, :di], xbc[:, di:di + G * N], xbc[:, di + G * N:]
        dt = _softplus(xb @ _np(m.w_dt) + _np(m.dt_bias))  # [T, H]
        A = -np.exp(_np(m.A_log))
        S = np.zeros((Hh, P, N))
        ys = []
        for t in range(xb.shape[0]):
            xh = xs[t].reshape(Hh, P)
            grp = np.arange(Hh) // (Hh // G)  # head h reads group h // (H / G)
            Bh, Ch = Bm[t].reshape(G, N)[grp], Cm[t].reshape(G, N)[grp]
            S = S * np.exp(dt[t] * A)[:, None, None] + (dt[t][:, None, None] * Bh[:, None, :]) * xh[:, :, None]
            ys.append((S @ Ch[:, :, None])[..., 0] + _np(m.D)[:, None] * xh)
        y = np.stack(ys).reshape(-1, di) * _silu(z)  # norm_before_gate=False
        gs = di // G
        yg = y.reshape(-1, G, gs)
        y = (yg / np.sqrt((yg ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(-1, di) * _np(m.norm.scale)
        out.append(np.einsum("thp,hpd->td", y.reshape(-1, Hh, P), _np(m.w_out)))
    return np.stack(out)


def _gdn_np(m, x):
    """fla GatedDeltaNet forward with ``naive_recurrent_gated_delta_rule`` (S [Dk, Dv])."""
    Hh, Dk, Dv = m.n_heads, m.dk, m.dv
    out = []
    for xb in np.asarray(x, np.float64):
        def conv(w, c):
            return _silu(_conv_np(xb @ _np(w), _np(c.weight), None if c.bias is None else _np(c.bias)))
        q = conv(m.w_q, m.conv_q).reshape(-1, Hh, Dk)
        k = conv(m.w_k, m.conv_k).reshape(-1, Hh, Dk)
        v = conv(m.w_v, m.conv_v).reshape(-1, Hh, Dv)
        q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
        beta = 1 / (1 + np.exp(-(xb @ _np(m.w_b))))
        g = -np.exp(_np(m.A_log)) * _softplus(xb @ _np(m.w_a) + _np(m.dt_bias))
        S = np.zeros((Hh, Dk, Dv))
        os_ = []
        for t in range(xb.shape[0]):
            S = S * np.exp(g[t])[:, None, None]
            vn = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * vn[:, None, :]
            os_.append(np.einsum("hkv,hk->hv", S, q[t] / math.sqrt(Dk)))
        o = np.stack(os_)
        o = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * _np(m.o_norm.scale)
        if m.w_g is not None:
            o = o * _silu(np.einsum("td,dhv->thv", xb, _np(m.w_g)))  # fla: norm, then gate
        out.append(np.einsum("thv,hvd->td", o, _np(m.w_o)))
    return np.stack(out)


ORACLES = {"lightning": _lightning_np, "lightning_fla_rms_full": _lightning_np, "mamba2": _mamba2_np,
           "gdn": _gdn_np, "gdn_nogate_convbias": _gdn_np}


def _jit(m, fn):
    """``fn(module, *args)`` jitted over the module's state (one compile; eager NNX is slow on CPU)."""
    graphdef, state = nnx.split(m)
    f = jax.jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))
    return lambda *a: f(state, *a)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_float64_reference_loop(name):
    m = _layer(name, seed=1)
    x = _x(2)
    y = _jit(m, lambda mm, x: mm(x, _ctx()))(x)
    ref = ORACLES[name](m, x)
    assert np.abs(ref).mean() > 1e-2  # the oracle's output is not trivially small
    assert _rel(y, ref) < 2e-5, _rel(y, ref)


# ----------------------------------------------------------------------------- decode == chunked

SPLIT = 1  # a split inside x at its first token; [prefix | x] splits at 11, not a chunk boundary


def _decode_and_chunked(m, prefix, x, cot):
    """Everything the decode test compares, in one traced function."""
    _, state0 = m.forward(prefix)  # a real carried state: conv tail + recurrent state
    out = {"state0": state0, "chunk": m.forward(x, state0),
           "step": _scan_steps(m, jnp.concatenate([prefix, x], 1), m.init_state(x.shape[0]))}
    ya, sa = m.forward(x[:, :SPLIT], state0)
    yb, sb = m.forward(x[:, SPLIT:], sa)
    out["split"] = (jnp.concatenate([ya, yb], 1), sb)
    graphdef, params = nnx.split(m)

    def loss(fn, p, x, s0):
        y, s = fn(nnx.merge(graphdef, p), x, s0)
        return jnp.sum(y * cot) + sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(s))

    grad = lambda fn: jax.grad(lambda p, x, s: loss(fn, p, x, s), argnums=(0, 1, 2))(params, x, state0)  # noqa: E731
    out["g_chunk"] = grad(lambda mm, x, s: mm.forward(x, s))
    out["g_step"] = grad(_scan_steps)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("name", ["lightning", "mamba2", "gdn"])
def test_decode_steps_equal_chunked_forward_values_states_and_gradients(name):
    """T decode steps from the zero state over [prefix | x] equal a chunked pass over the prefix and a
    chunked pass over x from the carried state, and a further split of x; gradients agree too."""
    m = _layer(name, seed=3)
    prefix, x, cot = _x(4, t=11), _x(5), _x(6)
    r = jax.jit(_decode_and_chunked)(m, prefix, x, cot)
    assert all(float(jnp.abs(s).max()) > 0 for s in jax.tree.leaves(r["state0"]))
    y_step, s_step = r["step"]
    assert jax.tree.structure(s_step) == jax.tree.structure(m.init_state(B))
    for y, s in (r["chunk"], r["split"]):
        assert jax.tree.structure(s) == jax.tree.structure(s_step)
        _assert_close_tree(y, y_step[:, 11:], 2e-5)
        _assert_close_tree(s, s_step, 2e-5)
    # gradients through the chunked form equal those through the step recurrence (params, x, state)
    _assert_close_tree(r["g_chunk"], r["g_step"], 1e-4)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(r["g_chunk"]))
    for path, var in nnx.to_flat_state(r["g_chunk"][0]):  # every parameter receives gradient
        assert float(jnp.abs(var.get_value()).max()) > 0, path


@pytest.mark.parametrize("name", ["lightning", "mamba2", "gdn"])
def test_bf16_forward_is_finite_and_close_to_fp32(name):
    m32 = _layer(name, seed=7)
    m16 = _layer(name, seed=7, dtype="bfloat16")  # same parameters, bf16 compute
    x = _x(8, t=64)
    y32 = _jit(m32, lambda mm, x: mm(x, _ctx(t=64)))(x)
    y16, s16 = _jit(m16, lambda mm, x: (mm(x, _ctx(t=64)), mm.forward(x)[1]))(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(y16.astype(jnp.float32)).all())
    assert _rel(y16.astype(jnp.float32), y32) < 5e-2
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(s16))  # fp32 states
    for _, var in nnx.to_flat_state(nnx.state(m16, nnx.Param)):
        assert var.get_value().dtype == jnp.float32  # fp32 parameters


# ----------------------------------------------------------------------------- ShortConv's backward

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation,bias", [("silu", True), ("silu", False), (None, True)])
@pytest.mark.parametrize("B,T,C,K", [(2, 7, 5, 4), (1, 3, 6, 4), (2, 2, 5, 4), (2, 9, 3, 1), (1, 16, 8, 2)])
def test_short_conv_backward_equals_autodiff_of_the_reference(dtype, activation, bias, B, T, C, K):
    """The hand-written backward (dx written in x's dtype) equals autodiff of the plain conv from zero
    history: output and the gradients of x, w and b, at T < K - 1 too."""
    r = np.random.default_rng(B * 100 + T * 10 + K)
    x = jnp.asarray(r.normal(size=(B, T, C)), dtype)
    w = jnp.asarray(r.normal(size=(K, C)), jnp.float32)
    b = jnp.asarray(r.normal(size=(C,)), jnp.float32) if bias else None
    dy = jnp.asarray(r.normal(size=(B, T, C)), dtype)
    y, vjp = jax.vjp(lambda x, w, b: rc.short_conv(x, w, b, activation), x, w, b)
    y_ref, vjp_ref = jax.vjp(lambda x, w, b: rc._short_conv_plain(x, w, b, activation,
                                                                jnp.zeros((B, K - 1, C)))[0], x, w, b)
    got, want = (y, *vjp(dy)), (y_ref, *vjp_ref(dy))
    assert got[1].dtype == x.dtype and (b is None) == (got[3] is None)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # fp32 sums in another order, rounded once: bf16 outputs may differ by one ulp
        tol = 1e-5 if dtype == "float32" else 1e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=tol, atol=tol)


def test_short_conv_module_paths_agree(monkeypatch):
    """ShortConv's training form (state None) gives the same output, tail state and gradients through
    the hand-written backward as through the reference."""
    conv = rc.ShortConv(6, 4, rngs=nnx.Rngs(0), bias=True)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 6)), jnp.float32)
    graphdef, params = nnx.split(conv)
    calls = []
    real = rc.short_conv
    monkeypatch.setattr(rc, "short_conv", lambda *a: calls.append(a[-1]) or real(*a))

    def run():
        loss = lambda params, x: jnp.sum(nnx.merge(graphdef, params)(x)[0] ** 2)
        return conv(x), jax.grad(loss, argnums=(0, 1))(params, x)

    fast = run()
    assert calls and set(calls) == {"xla"}  # the hand-written backward ran (SHORT_CONV_VJP on by default)
    monkeypatch.setattr(rc, "SHORT_CONV_VJP", False)
    n = len(calls)
    ref = run()
    assert len(calls) == n  # the reference path
    for a, e in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- conventions

def test_lightning_decay_conventions():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    np.testing.assert_allclose(alibi_slopes(3), [2.0 ** -4, 2.0 ** -8, 2.0 ** -2])  # ALiBi interleave
    L = 10
    first, last = lightning_log_decay("alibi", 4, 0, L), lightning_log_decay("alibi", 4, L - 1, L)
    np.testing.assert_allclose(first, [-(1 + 1e-5) * 2.0 ** (-2 * (h + 1)) for h in range(4)])
    np.testing.assert_allclose(last, [-1e-5 * 2.0 ** (-2 * (h + 1)) for h in range(4)])
    fla = lightning_log_decay("fla", 4, 5, L)
    np.testing.assert_allclose(fla, [-(8 / 4) * 0.5 * h for h in range(4)])
    assert fla[0] == 0.0  # fla: head 0 never decays
    m = nnx.eval_shape(lambda: LightningAttention(_cfg(), MixerConfig(kind="lightning"), 3, rngs=nnx.Rngs(0)))
    assert m.scale == 1.0 and m.g_gamma == tuple(lightning_log_decay("alibi", H, 3, N_LAYERS))
    m = nnx.eval_shape(lambda: LightningAttention(_cfg(), MixerConfig(kind="lightning", options={"decay": "fla"}), 3,
                                                  rngs=nnx.Rngs(0)))
    assert m.scale == DH ** -0.5


def test_options_are_validated(tiny_params):
    bad = [("lightning", "{'decay': 'linear'}"), ("lightning", "{'gate': 'tanh'}"), ("lightning", "{'scale': -1.0}"),
           ("mamba2", "{'d_state': 0}"), ("mamba2", "{'A_init_range': (0.0, 16.0)}"), ("mamba2", "{'dstate': 16}"),
           ("gdn", "{'expand_v': 0}"), ("gdn", "{'head_dim': 'big'}")]
    for kind, opts in bad:
        with pytest.raises(ConfigError):
            load_config([], tiny_params + [f"efficient/MixerConfig.kind = '{kind}'",
                                           f"efficient/MixerConfig.options = {opts}"])
    # sizes that only fail against the model's d_model fail when the model is built
    cfg = load_config([], tiny_params + ["efficient/MixerConfig.kind = 'mamba2'",
                                         "efficient/MixerConfig.options = {'head_dim': 24}"])  # 24 !| 64
    with pytest.raises(ConfigError, match="head_dim"):
        count_params(cfg.model)


def test_no_weight_decay_on_recurrent_scalars_norms_and_biases(tiny_params):
    from hybrid_lm.train.loop import ModelFns
    for kind in ("lightning", "mamba2", "gdn"):
        opts = "{'chunk_size': 8, 'conv_bias': True}" if kind == "gdn" else "{'chunk_size': 8}"
        cfg = load_config([], tiny_params + [f"efficient/MixerConfig.kind = '{kind}'",
                                             "efficient/MixerConfig.window = None",
                                             f"efficient/MixerConfig.options = {opts}"])
        fns = ModelFns(cfg)
        mask = decay_mask(fns.axes)["blocks"][1]["mixer"]
        flat = {"/".join(str(k.key) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
        no_decay = {k for k, v in flat.items() if not v}
        expected = {"lightning": {"norm_scale", "norm_bias"},
                    "mamba2": {"A_log", "dt_bias", "D", "conv/bias", "norm/scale"},
                    "gdn": {"A_log", "dt_bias", "o_norm/scale", "conv_q/bias", "conv_k/bias", "conv_v/bias"}}[kind]
        assert no_decay == expected, (kind, sorted(flat))


# ----------------------------------------------------------------------------- FLOPs and parameter accounting

def _dot_macs(jaxpr) -> float:
    """Multiply-adds of every dot_general and triangular_solve a jaxpr executes (scans multiplied out)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            a = eqn.invars[0].aval.shape
            total += np.prod(eqn.outvars[0].aval.shape) * np.prod([a[i] for i in lc])
        elif name == "triangular_solve":
            a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            assert eqn.params["left_side"] and eqn.params["unit_diagonal"]
            m = a[-1]
            total += np.prod(b[:-2]) * m * (m - 1) / 2 * b[-1]
        elif name == "scan":
            total += eqn.params["length"] * _dot_macs(eqn.params["jaxpr"].jaxpr)
        else:
            for p in eqn.params.values():
                sub = getattr(p, "jaxpr", p)
                if hasattr(sub, "eqns"):
                    total += _dot_macs(sub)
    return total


@pytest.mark.parametrize("kind,opts", [
    ("lightning", {"chunk_size": 8}),
    ("lightning", {"chunk_size": 16, "gate": "full", "decay": "fla"}),
    ("mamba2", {"chunk_size": 8, "d_state": 8, "head_dim": 16, "n_groups": 4}),  # G = H: scores per head
    ("mamba2", {"chunk_size": 8, "d_state": 8, "head_dim": 16, "n_groups": 1}),
    ("gdn", {"chunk_size": 8}),
    ("gdn", {"chunk_size": 16, "use_gate": False, "num_heads": 4, "head_dim": 8}),
])
def test_flops_formula_counts_the_executed_matmuls(kind, opts):
    cfg = _cfg()
    mc = MixerConfig(kind=kind, options=opts)
    spec = get_mixer(kind)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: spec.cls(cfg, mc, 1, rngs=nnx.Rngs(0))))
    t = 32  # a multiple of both chunks: no padded tail
    x = jax.ShapeDtypeStruct((B, t, D_MODEL), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda st, x: nnx.merge(graphdef, st)(x, _ctx(t=t)))(state, x).jaxpr
    executed = 2.0 * _dot_macs(jaxpr) / (B * t)  # FLOPs per token
    f = spec.flops(cfg, mc, t)
    params = nnx.to_flat_state(state)
    conv = sum(v.get_value().size for p, v in params if "conv_kernel" in v.get_metadata()["logical_axes"])
    proj = sum(v.get_value().size for p, v in params
               if v.get_value().ndim >= 2
               and not {"conv_kernel", "norm", "bias"} & set(v.get_metadata()["logical_axes"]))
    assert f["matmul"] == 2.0 * proj  # every projection weight is used once per token
    scan_flops = f["mixing"] - 2.0 * conv  # the short convs are K multiply-adds per channel
    if kind == "mamba2" and opts["n_groups"] < cfg.d_model * 2 // opts["head_dim"]:
        Hm = cfg.d_model * 2 // opts["head_dim"]  # XLA path broadcasts B/C to heads: (H - G) C N extra
        scan_flops += 2.0 * (Hm - opts["n_groups"]) * opts["chunk_size"] * opts["d_state"]
    assert executed == pytest.approx(f["matmul"] + scan_flops, rel=1e-12)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["lightning", "mamba2", "gdn"])
def test_info_counts_match_the_real_parameter_arrays(kind, capsys):
    from hybrid_lm.cli import main
    arch = f"arch/{kind}.gin"
    small = ["ModelConfig.d_model = 64", "ModelConfig.n_heads = 2", "ModelConfig.head_dim = 32",
             "ModelConfig.n_layers = 4", "ModelConfig.d_ff = 96", "ModelConfig.vocab_size = 256",
             "DataConfig.seq_len = 16384"]
    cfg = load_config(["base.gin", arch], small)
    counts = count_params(cfg.model)
    per = counts["per_layer_type"]
    # the real arrays of one efficient layer, initialised for real (jitted: one compile)
    spec = get_mixer(kind)
    real = jax.jit(lambda: nnx.state(spec.cls(cfg.model, cfg.model.efficient, 1, rngs=nnx.Rngs(0)), nnx.Param))()
    leaves = jax.tree.leaves(real)
    assert per[f"E:{kind}"]["layers"] == 2 and per[f"E:{kind}"]["mixer"] == 2 * sum(x.size for x in leaves)
    assert all(x.dtype == jnp.float32 and bool(jnp.isfinite(x).all()) for x in leaves)
    assert counts["non_embedding"] - count_params(load_config(["base.gin"], small).model)["non_embedding"] == \
        per[f"E:{kind}"]["mixer"] - 2 * (64 * 2 * 32 + 2 * 64 * 32 + 2 * 32 * 64)  # vs SWA layers (1 KV head)
    assert main(["info", "configs/base.gin", f"configs/{arch}", "--json"]
                + [a for b in small for a in ("--gin_param", b)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"] == json.loads(json.dumps(counts))
    f = info["flops_per_token"]["per_layer_type"]
    assert f[f"E:{kind}"] == json.loads(json.dumps(flops_per_token(cfg.model, 16384)["per_layer_type"][f"E:{kind}"]))
    assert f[f"E:{kind}"]["mixing"] < 0.2 * f["F:attention"]["mixing"]  # linear, not quadratic, in T


def test_s1_parameter_counts_per_layer():
    """Closed forms at S1 (d 384, 10 layers, heads 3 x 128): the numbers docs/MIXERS.md reports."""
    d, Hs, D = 384, 3, 128
    attn = d * Hs * D + 2 * d * D + Hs * D * d
    lightning = 4 * d * Hs * D + (d * D + D * Hs * D) + 2 * Hs * D
    di, Hm, N = 2 * d, 2 * d // 64, 128
    conv_dim = di + 2 * N
    mamba = d * (di + conv_dim + Hm) + 5 * conv_dim + 3 * Hm + di + di * d
    Kd, Vd, Hg = 3 * d // 4, 3 * d // 2, 3
    gdn = d * (2 * Kd + Vd + 2 * Hg) + 4 * (2 * Kd + Vd) + 2 * Hg + d * Vd + Vd // Hg + Vd * d
    for kind, n in (("lightning", lightning), ("mamba2", mamba), ("gdn", gdn)):
        c = count_params(load_config(["scale/s1.gin", f"arch/{kind}.gin"]).model)
        assert c["per_layer_type"][f"E:{kind}"]["mixer"] == 5 * n
        assert c["per_layer_type"]["F:attention"]["mixer"] == 5 * attn
        assert c["non_embedding"] - 14_999_424 == 5 * (n - attn)


# ----------------------------------------------------------------------------- training in a 1:1 hybrid

@pytest.mark.parametrize("kind,opts", [
    ("lightning", "{'chunk_size': 16}"),
    ("mamba2", "{'chunk_size': 16, 'd_state': 16, 'head_dim': 16}"),
    ("gdn", "{'chunk_size': 16}"),
])
@pytest.mark.integration
def test_tiny_hybrid_trains(kind, opts, tiny_params, tmp_path):
    from hybrid_lm.train.loop import train
    cfg = load_config([], tiny_params + [f"efficient/MixerConfig.kind = '{kind}'", "efficient/MixerConfig.window = None",
                                         f"efficient/MixerConfig.options = {opts}", "TrainConfig.steps = 20",
                                         "TrainConfig.eval_every = 20"])
    assert [b for b in cfg.model.layer_types()] == ["F", "E"]
    res = train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    losses = [r["loss"] for r in rows]
    assert all(np.isfinite(losses)) and losses[0] > losses[-1] + 0.3, losses
    assert np.isfinite(res.final_eval["loss"]) and res.final_eval["loss"] < losses[0]
