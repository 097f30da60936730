import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.model.layers import apply_rope
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


def test_dispatch_pallas_matches_xla_in_interpret_mode(monkeypatch):
    """attention_impl='pallas' routes SWA and permuted attention to our kernel (interpreted on CPU)."""
    import functools

    import hybrid_lm_kernels

    from hybrid_lm.model.attention import attend
    monkeypatch.setattr(hybrid_lm_kernels, "windowed_attention",
                        functools.partial(hybrid_lm_kernels.windowed_attention, interpret=True))
    q, k, v = _inputs(jax.random.key(5), 2, 40, 4, 2, 16)
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, 40))(jax.random.split(jax.random.key(6), 2))
    for window, permuted, pos in [(8, False, None), (8, True, perm), (None, False, None)]:
        positions = pos if pos is not None else jnp.broadcast_to(jnp.arange(40), (2, 40))
        a = attend(q, k, v, window=window, positions=positions, impl="pallas", permuted=permuted)
        b = attend(q, k, v, window=window, positions=positions, impl="xla", permuted=permuted)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
