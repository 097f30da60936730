import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.model.layers import apply_rope, rope_attention_factor, rope_frequencies
from hybrid_lm.ops.attention import causal_attention, dense_attention, windowed_attention


def _inputs(key, B, T, H, K, D, Dv=None):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, K, D)),
            jax.random.normal(kv, (B, T, K, Dv or D)))


def _masked_full_reference(q, k, v, w):
    """Independent float64 numpy oracle: full score matrix with a banded causal mask."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & (j > i - w), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.integration
@pytest.mark.parametrize("T,H,K,w", [(37, 4, 2, 1), (37, 4, 2, 7), (37, 2, 1, 37), (50, 2, 2, 7), (19, 3, 1, 19)])
def test_windowed_equals_masked_full_forward_and_grad(T, H, K, w):
    key = jax.random.key(T * 131 + w)
    q, k, v = _inputs(key, 2, T, H, K, 8, Dv=6)
    out = windowed_attention(q, k, v, w, block_size=8)
    np.testing.assert_allclose(out, _masked_full_reference(q, k, v, w), rtol=2e-5, atol=2e-5)

    proj = jax.random.normal(jax.random.key(7), out.shape)
    f_win = lambda *a: jnp.sum(windowed_attention(*a, w, block_size=8) * proj)
    f_ref = lambda *a: jnp.sum(dense_attention(*a, window=w) * proj)
    for g1, g2 in zip(jax.grad(f_win, (0, 1, 2))(q, k, v), jax.grad(f_ref, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


def _masked_positions_reference(q, k, v, w, wr, pos):
    """Independent float64 numpy oracle for the two-sided band: i - w < j <= i + wr, pos[j] <= pos[i]."""
    q, k, v, pos = (np.asarray(x, np.float64) for x in (q, k, v, pos))
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = ((j <= i + wr) & (j > i - w))[None] & (pos[:, None, :] <= pos[:, :, None])  # [B, Tq, Tk]
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _perm(key, B, T):
    return jax.vmap(lambda kk: jax.random.permutation(kk, T))(jax.random.split(key, B)).astype(jnp.int32)


@pytest.mark.integration
@pytest.mark.parametrize("T,H,K,w,wr", [(37, 4, 2, 7, 6), (37, 2, 1, 3, 20), (29, 3, 1, 40, 39)])
def test_windowed_window_right_matches_oracles_forward_and_grad(T, H, K, w, wr):
    """Two-sided band in a random order (SA window_mode='symmetric' is wr = w - 1), T not a multiple
    of the block, GQA: blocked reference = numpy float64 oracle = dense oracle, forward and grads."""
    q, k, v = _inputs(jax.random.key(T + 7 * w + wr), 2, T, H, K, 8)
    pos = _perm(jax.random.key(w), 2, T)
    proj = jax.random.normal(jax.random.key(8), q.shape)

    def out_and_grads(attn):  # jitted: one compile is cheaper than eager op-by-op autodiff here
        return jax.jit(lambda *a: (attn(*a), jax.grad(lambda *b: jnp.sum(attn(*b) * proj), (0, 1, 2))(*a)))(q, k, v)

    out, g_win = out_and_grads(lambda *a: windowed_attention(*a, w, positions=pos, window_right=wr, block_size=8))
    ref, g_ref = out_and_grads(lambda *a: dense_attention(*a, window=w, positions=pos, window_right=wr))
    np.testing.assert_allclose(out, _masked_positions_reference(q, k, v, w, wr, pos), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ref, out, rtol=2e-5, atol=2e-5)
    for g1, g2 in zip(g_win, g_ref):
        np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_symmetric_window_covering_T_is_causal_attention_for_any_order():
    """The issue's "SA with w >= T equals causal full attention", at op level, for the symmetric band:
    gather q/k/v by a random permutation, attend with positions = the permutation and
    window_right = w - 1, un-gather; equals causal attention in original order, forward and grads.
    (The one-sided default does not: a query sees only the keys before it in both orders.)"""
    B, T, H, K, D = 2, 30, 4, 2, 8
    q, k, v = _inputs(jax.random.key(11), B, T, H, K, D)
    perm = _perm(jax.random.key(12), B, T)
    inv = jnp.argsort(perm, axis=1)
    g = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)  # noqa: E731

    def sa(w, wr):
        return lambda q, k, v: g(windowed_attention(g(q, perm), g(k, perm), g(v, perm), w, positions=perm,
                                                    window_right=wr, block_size=8), inv)

    proj = jax.random.normal(jax.random.key(13), q.shape)

    def out_and_grads(attn):
        return jax.jit(lambda *a: (attn(*a), jax.grad(lambda *b: jnp.sum(attn(*b) * proj), (0, 1, 2))(*a)))(q, k, v)

    ref, g_ref = out_and_grads(causal_attention)
    for w in (T, 3 * T):
        out, g_sa = out_and_grads(sa(w, w - 1))
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
        for g1, g2 in zip(g_sa, g_ref):
            np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)
    one_sided = jax.jit(sa(T, 0))(q, k, v)
    assert np.abs(np.asarray(one_sided - ref)).max() > 1e-2  # the one-sided default is not causal attention


@pytest.mark.integration
def test_windowed_full_window_equals_causal():
    q, k, v = _inputs(jax.random.key(3), 2, 45, 4, 2, 16)
    np.testing.assert_allclose(windowed_attention(q, k, v, 45), causal_attention(q, k, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(windowed_attention(q, k, v, 10_000), causal_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_windowed_cost_is_linear_in_T():
    """The blocked reference never materialises T x T scores: its largest intermediate grows like T*(block+w)."""
    def largest(T, w):
        q, k, v = _inputs(jax.random.key(0), 1, T, 2, 1, 8)
        jaxpr = jax.make_jaxpr(lambda a, b, c: windowed_attention(a, b, c, w, block_size=16))(q, k, v)
        return max(np.prod(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars)
    assert largest(2048, 16) < 2048 * 2048 / 8
    assert largest(4096, 16) <= 2.2 * largest(2048, 16)

    def largest_two_sided(T, w):
        q, k, v = _inputs(jax.random.key(0), 1, T, 2, 1, 8)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T))
        jaxpr = jax.make_jaxpr(lambda a, b, c: windowed_attention(
            a, b, c, w, positions=pos, window_right=w - 1, block_size=16))(q, k, v)
        return max(np.prod(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars)
    assert largest_two_sided(2048, 16) < 2048 * 2048 / 8
    assert largest_two_sided(4096, 16) <= 2.2 * largest_two_sided(2048, 16)


def test_rope_is_relative_and_nope_is_position_free():
    key = jax.random.key(1)
    q = jax.random.normal(key, (1, 1, 1, 32))
    k = jax.random.normal(jax.random.key(2), (1, 1, 1, 32))
    def score(pq, pk, shift):
        qr = apply_rope(q, jnp.array([[pq + shift]]))
        kr = apply_rope(k, jnp.array([[pk + shift]]))
        return float(jnp.sum(qr * kr))
    assert score(9, 4, 0) == pytest.approx(score(9, 4, 1000), rel=1e-4, abs=1e-4)  # only the offset matters
    assert abs(score(9, 4, 0) - score(9, 2, 0)) > 1e-3  # and the offset does matter
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, jnp.array([[77]]))), jnp.linalg.norm(q), rtol=1e-5)


@pytest.mark.integration
def test_dispatch_pallas_matches_xla_in_interpret_mode(monkeypatch):
    """attention_impl='pallas' routes SWA and permuted attention to our kernel (interpreted on CPU)."""
    import functools

    import hybrid_lm_kernels

    from hybrid_lm.model.attention import attend
    monkeypatch.setattr(hybrid_lm_kernels, "windowed_attention",
                        functools.partial(hybrid_lm_kernels.windowed_attention, interpret=True))
    q, k, v = _inputs(jax.random.key(5), 2, 40, 4, 2, 16)
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, 40))(jax.random.split(jax.random.key(6), 2))
    for window, permuted, pos, wr in [(8, False, None, 0), (8, True, perm, 0), (None, False, None, 0),
                                      (8, True, perm, 7)]:
        positions = pos if pos is not None else jnp.broadcast_to(jnp.arange(40), (2, 40))
        a = attend(q, k, v, window=window, positions=positions, impl="pallas", permuted=permuted, window_right=wr)
        b = attend(q, k, v, window=window, positions=positions, impl="xla", permuted=permuted, window_right=wr)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_auto_dispatch_per_platform_and_mask(monkeypatch):
    """auto: xla on CPU; on a GPU SA -> pallas, full -> cudnn, SWA -> jla where its kernel takes the
    operands, else pallas up to w=256 and cudnn above. Explicit choices that cannot run say why."""
    from hybrid_lm import backends
    from hybrid_lm.errors import ConfigError

    def resolve_impl(impl, **kw):
        return backends.attention_backend(impl, **kw)[0]
    spec = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
    qkv = (spec, spec, spec)
    assert resolve_impl("auto", permuted=False, window=128, qkv=qkv) == "xla"  # CPU
    assert "no GPU" in backends.jla_attention_reason(*qkv)
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(backends, "jla_attention_reason", lambda q, k, v, platform=None: None)
    assert resolve_impl("auto", permuted=True, window=128, qkv=qkv) == "pallas"
    assert resolve_impl("auto", permuted=False, window=None, qkv=qkv) == "cudnn"
    assert resolve_impl("auto", permuted=False, window=2048, qkv=qkv) == "jla"
    monkeypatch.setattr(backends, "jla_attention_reason", lambda q, k, v, platform=None: "head dims must be 64 or 128")
    assert resolve_impl("auto", permuted=False, window=128, qkv=qkv) == "pallas"
    assert resolve_impl("auto", permuted=False, window=512, qkv=qkv) == "cudnn"
    with pytest.raises(ConfigError, match="head dims"):
        resolve_impl("jla", permuted=False, window=128, qkv=qkv)
    for impl in ("cudnn", "jla"):
        with pytest.raises(ConfigError, match="stochastic"):
            resolve_impl(impl, permuted=True, window=128, qkv=qkv)


def _llama3_frequencies(head_dim, theta, factor, low_freq_factor, high_freq_factor, original):
    """Llama 3.1's RoPE rescaling as its release states it, one frequency at a time in float64: short
    wavelengths keep their frequency, long ones are divided by ``factor``, the band between interpolates."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < original / high_freq_factor:
            out.append(f)
        elif wavelen > original / low_freq_factor:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


@pytest.mark.parametrize("head_dim,theta,factor,lo,hi,original", [
    (128, 5e5, 8.0, 1.0, 4.0, 8192),    # Llama 3.1 8B / 70B
    (64, 5e5, 32.0, 1.0, 4.0, 8192),    # Llama 3.2 1B
    (16, 5e5, 8.0, 1.0, 8.0, 64),       # the tiny models of tests/hf_families.py: one frequency per band
    (32, 1e4, 4.0, 2.0, 16.0, 256),
])
def test_llama3_frequencies_equal_the_per_frequency_formula(head_dim, theta, factor, lo, hi, original):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
               "original_max_position_embeddings": original}
    ref = _llama3_frequencies(head_dim, theta, factor, lo, hi, original)
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    bands = {"kept": np.isclose(ref, plain), "divided": np.isclose(ref, plain / factor)}
    assert bands["kept"].any() and bands["divided"].any()  # each case exercises the rescaling
    np.testing.assert_allclose(np.asarray(rope_frequencies(head_dim, theta, scaling)), ref, rtol=2e-6)
    # in tuple form (as the attention modules hold it) the same; an empty scaling is plain RoPE, bitwise
    np.testing.assert_array_equal(rope_frequencies(head_dim, theta, tuple(sorted(scaling.items()))),
                                  rope_frequencies(head_dim, theta, scaling))
    np.testing.assert_array_equal(rope_frequencies(head_dim, theta, {}), rope_frequencies(head_dim, theta))


def _yarn_frequencies(head_dim, theta, factor, original, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """YaRN's frequencies as transformers computes them (``_compute_yarn_parameters``, 5.x), one at a time in
    float64: the dimension indices that turn beta_fast and beta_slow times over ``original`` positions
    (rounded outwards when ``truncate``) bound a linear ramp from the kept to the divided frequency."""
    def index(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(beta_fast), index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return np.array(out)


@pytest.mark.parametrize("head_dim,theta,factor,original,extra", [
    (128, 1e6, 4.0, 32768, {}),                                 # Qwen3's model card, 32K -> 131K
    (64, 1.5e5, 32.0, 4096, {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),  # gpt-oss's settings
    (24, 1e6, 4.0, 4096, {}),                                   # tests/hf_families.py's qwen3_yarn
    (32, 1e4, 8.0, 512, {"beta_fast": 16.0, "beta_slow": 2.0}),
])
def test_yarn_frequencies_equal_the_per_frequency_formula(head_dim, theta, factor, original, extra):
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original, **extra}
    ref = _yarn_frequencies(head_dim, theta, factor, original, **extra)
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    assert np.isclose(ref, plain).any() and np.isclose(ref, plain / factor).any()  # both ends exercised
    ours = np.asarray(rope_frequencies(head_dim, theta, scaling))
    np.testing.assert_allclose(ours, ref, rtol=2e-6)
    if extra.get("truncate") is False:  # the paper's rule at the ends: r = original / wavelength
        r = original * plain / (2 * math.pi)
        fast, slow = r > extra["beta_fast"], r < extra["beta_slow"]
        assert fast.any() and slow.any()
        np.testing.assert_allclose(ours[fast], plain[fast], rtol=2e-6)  # many turns: kept
        np.testing.assert_allclose(ours[slow], plain[slow] / factor, rtol=2e-6)  # under one: interpolated


def test_yarn_nulls_read_as_transformers_reads_them():
    """A null beta or attention factor is the default (transformers reads them with `or`), a null truncate
    is no truncation (`if truncate`): in a gin config as it stands, and as the config check stores it."""
    from hybrid_lm.config import check_rope_scaling

    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    nulls = {**base, "beta_fast": None, "beta_slow": None, "attention_factor": None, "mscale": None}
    np.testing.assert_array_equal(rope_frequencies(24, 1e6, nulls), rope_frequencies(24, 1e6, base))
    assert rope_attention_factor(nulls) == rope_attention_factor(base)
    np.testing.assert_array_equal(rope_frequencies(24, 1e6, {**base, "truncate": None}),
                                  rope_frequencies(24, 1e6, {**base, "truncate": False}))
    assert not np.array_equal(rope_frequencies(24, 1e6, {**base, "truncate": False}), rope_frequencies(24, 1e6, base))
    assert check_rope_scaling({**nulls, "truncate": None}, "x") == {**base, "truncate": False}


def test_rope_attention_factor_and_linear_scaling():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert rope_attention_factor(yarn) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert rope_attention_factor({**yarn, "attention_factor": 1.5}) == 1.5
    assert rope_attention_factor({**yarn, "mscale": 1.0, "mscale_all_dim": 1.0}) == 1.0  # DeepSeek-V3's
    assert rope_attention_factor({**yarn, "mscale": 0.707, "mscale_all_dim": 1.0}) == pytest.approx(
        (0.0707 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))
    assert rope_attention_factor({**yarn, "factor": 1.0}) == 1.0 and rope_attention_factor({}) == 1.0
    assert rope_attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0
    np.testing.assert_array_equal(rope_frequencies(16, 1e4, {"rope_type": "linear", "factor": 4.0}),
                                  rope_frequencies(16, 1e4) / 4.0)
    # q and k each come out scaled by the factor (RoPE itself is a rotation): their logits by its square
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 16)), jnp.float32)
    pos = jnp.arange(5)[None]
    np.testing.assert_allclose(np.linalg.norm(np.asarray(apply_rope(x, pos, 1e4, yarn)), axis=-1),
                               rope_attention_factor(yarn) * np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 8.0},
], ids=lambda s: s["rope_type"])
def test_scaled_rope_is_still_relative(scaling):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))

    def score(pq, pk):
        qr = apply_rope(q, jnp.array([[pq]]), 5e5, scaling)
        kr = apply_rope(k, jnp.array([[pk]]), 5e5, scaling)
        return float(jnp.sum(qr * kr))

    assert score(200, 180) == pytest.approx(score(20, 0), rel=1e-4, abs=1e-5)
    assert score(200, 180) != pytest.approx(float(jnp.sum(apply_rope(q, jnp.array([[200]]), 5e5)
                                                          * apply_rope(k, jnp.array([[180]]), 5e5))), rel=1e-3)
