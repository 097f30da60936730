"""Windowed-attention kernel (hybrid_lm_kernels) against the ops/ references.

CPU: the Pallas kernels run in interpret mode (same kernel bodies as on the GPU), forward and
dq/dk/dv, fp32 and bf16, T not a multiple of the blocks, GQA, w in {1, 64, 128, 1000}, identity
and permuted positions, and the two-sided band (``window_right > 0``, SA
``window_mode='symmetric'``). The Triton lowering of the same kernels (what the GPU compiles) is
checked on the CPU by exporting for CUDA. The compiled kernels are checked on a GPU by
``tests/gpu/test_gpu_attention.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import triton_calls_for_cuda

import jax
import jax.numpy as jnp

from hybrid_lm.ops.attention import dense_attention, windowed_attention as ref_windowed
from hybrid_lm_kernels import BlockSizes, windowed_attention
from hybrid_lm_kernels import windowed_pallas as wa_mod

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# Small tiles so that T=100..300 spans many blocks and is not a multiple of any of them.
SMALL = BlockSizes(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16,
                   block_k_dq=16)


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in kernel output"
    # dq/dk are exactly zero at w=1 (a one-key softmax has no gradient): there the error is
    # measured against an RMS of 0.05, small next to the O(0.1-1) gradients of the other cases.
    floor = 0.05 * np.sqrt(b.size)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), floor)


def _inputs(seed, B, T, H, K, D, dtype, permuted):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, D), jnp.float32).astype(dtype)
    pos = None
    if permuted:
        pos = jax.vmap(lambda kk: jax.random.permutation(kk, T))(jax.random.split(ks[4], B))
        pos = pos.astype(jnp.int32)
    return q, k, v, do, pos


def _fwd_bwd(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do))


def _check(B, T, H, K, D, w, dtype, permuted, blocks=SMALL, tol=None, seed=0, window_right=0,
           pos_map=None):
    """Kernel fwd + dq/dk/dv against the dense fp32 oracle. ``pos_map`` transforms the positions
    given to the kernel only (any strictly increasing map leaves the mask unchanged)."""
    q, k, v, do, pos = _inputs(seed, B, T, H, K, D, dtype, permuted)
    kpos = pos if pos_map is None else pos_map(pos)
    got = jax.jit(lambda *a: _fwd_bwd(
        lambda q, k, v: windowed_attention(q, k, v, kpos, w, window_right=window_right,
                                           interpret=True, block_sizes=blocks),
        *a))(q, k, v, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: _fwd_bwd(
            lambda q, k, v: dense_attention(q, k, v, window=w, positions=pos,
                                            window_right=window_right), *a))(*f32)
    tol = tol or (2e-5 if dtype == jnp.float32 else 2e-2)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype, (name, g.dtype)
        err = _rel(g, r)
        assert err < tol, f"{name}: rel err {err:.3g} >= {tol} (w={w}, permuted={permuted})"


@pytest.mark.parametrize("w,permuted", [(1, False), (64, True), (128, False), (1000, True)],
                         ids=["w1-swa", "w64-sa", "w128-swa", "w1000-sa"])
@pytest.mark.integration
def test_fp32_gqa_against_dense(w, permuted):
    # T=150: not a multiple of 16 or 32; H=4 over K=2 (GQA groups of 2); w=1000 > T is causal.
    _check(B=2, T=150, H=4, K=2, D=32, w=w, dtype=jnp.float32, permuted=permuted)


@pytest.mark.integration
@pytest.mark.parametrize("w,permuted", [(64, False), (1000, True)], ids=["w64-swa", "w1000-sa"])
def test_bf16_against_fp32_reference(w, permuted):
    _check(B=1, T=200, H=4, K=1, D=32, w=w, dtype=jnp.bfloat16, permuted=permuted, seed=1)


@pytest.mark.integration
def test_bf16_w128_gqa3_default_blocks():
    # Default (64-row) tiles, T=300 padded to 320, three query heads on one KV head (G=3, not a
    # power of two), w=128 spanning three key blocks.
    _check(B=1, T=300, H=3, K=1, D=32, w=128, dtype=jnp.bfloat16, permuted=True,
           blocks=BlockSizes(), seed=2)


@pytest.mark.integration
def test_fp32_fused_backward_atomics():
    # the single-kernel backward (dq partials added with atomics), GQA groups of 3
    _check(B=1, T=120, H=6, K=2, D=16, w=64, dtype=jnp.float32, permuted=True,
           blocks=dataclasses.replace(SMALL, fused_bwd=True), seed=6)


@pytest.mark.integration
def test_fp32_odd_head_dim_and_window_one_block():
    # D=24 is padded to 32 inside; w=16 equals a block, T=97 prime.
    _check(B=1, T=97, H=2, K=2, D=24, w=16, dtype=jnp.float32, permuted=False, seed=3)


@pytest.mark.integration
def test_against_blocked_reference_and_identity_positions():
    """Positions = identity must equal the position-free SWA path and the blocked reference."""
    B, T, H, K, D, w = 2, 130, 4, 4, 16, 40
    q, k, v, _, _ = _inputs(4, B, T, H, K, D, jnp.float32, False)
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    a, b = jax.jit(lambda q, k, v: [
        windowed_attention(q, k, v, p, w, interpret=True, block_sizes=SMALL) for p in (None, ident)
    ])(q, k, v)
    with jax.default_matmul_precision("highest"):
        r = ref_windowed(q, k, v, w)
    assert _rel(a, r) < 2e-5 and _rel(b, r) < 2e-5


def test_rejects_bad_shapes():
    q = jnp.ones((1, 32, 3, 16))
    kv = jnp.ones((1, 32, 2, 16))
    with pytest.raises(ValueError):
        windowed_attention(q, kv, kv, None, 8, interpret=True)
    with pytest.raises(ValueError):
        windowed_attention(q, q, q, None, 0, interpret=True)
    with pytest.raises(ValueError, match="needs positions"):
        windowed_attention(q, q, q, None, 8, window_right=7, interpret=True)
    with pytest.raises(ValueError, match="window_right"):
        windowed_attention(q, q, q, jnp.zeros((1, 32), jnp.int32), 8, window_right=-1,
                           interpret=True)


# ------------------------------------------------------------------------------------------------
# Two-sided band (window_right > 0): SA window_mode='symmetric' and asymmetric bands
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w,wr,pos_map", [
    (24, 23, None),                        # symmetric |i - j| < 24 over several blocks
    (5, 40, lambda p: 7 * p + 1000),       # asymmetric; positions far above T: padded keys (in
                                           # the right band of the last queries) must stay hidden
    (1000, 999, None),                     # symmetric band covering T: causal attention by position
], ids=["sym-w24", "asym-5-40-bigpos", "sym-w1000"])
@pytest.mark.integration
def test_fp32_gqa_window_right_against_dense(w, wr, pos_map):
    # T=150: not a multiple of 16 or 32 (padded to 160); H=4 over K=2; random permutation.
    _check(B=2, T=150, H=4, K=2, D=32, w=w, dtype=jnp.float32, permuted=True, window_right=wr,
           pos_map=pos_map, seed=7)


def test_fp32_window_right_fused_backward_gqa3():
    _check(B=1, T=120, H=6, K=2, D=16, w=16, dtype=jnp.float32, permuted=True, window_right=15,
           blocks=dataclasses.replace(SMALL, fused_bwd=True), seed=8)


@pytest.mark.integration
def test_symmetric_band_with_identity_positions_is_swa():
    """window_right = w - 1 with identity positions equals the position-free SWA path (every key
    right of the query is in the future), forward and gradients. (The one-sided default,
    window_right = 0, is what every other test here checks.)"""
    B, T, H, K, D, w = 1, 70, 2, 1, 16, 12
    q, k, v, do, _ = _inputs(9, B, T, H, K, D, jnp.float32, False)
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def run(p, wr):
        return _fwd_bwd(lambda q, k, v: windowed_attention(
            q, k, v, p, w, window_right=wr, interpret=True, block_sizes=SMALL), q, k, v, do)

    swa, sym = jax.jit(lambda: [run(None, 0), run(ident, w - 1)])()
    for a, b in zip(swa, sym):
        assert _rel(b, a) < 1e-5


# ------------------------------------------------------------------------------------------------
# Block skipping: the visited key/query blocks are exactly those that intersect the band, and the
# tiles run without a mask (SWA) have every pair inside the band.
# ------------------------------------------------------------------------------------------------

_RANGE_CASES = [(w, 0) for w in (1, 5, 64, 128, 200, 1000)] + [
    (1, 1), (5, 4), (64, 63), (128, 127), (200, 199), (1000, 999),  # symmetric
    (1, 70), (64, 5), (16, 1024)]  # asymmetric; a right band past the end


@pytest.mark.parametrize("bq,bk", [(16, 16), (64, 32), (32, 128), (128, 64)])
@pytest.mark.parametrize("w,wr", _RANGE_CASES)
def test_block_ranges_cover_band_exactly(bq, bk, w, wr):
    Tp = 1024
    idx = np.arange(Tp)
    # pair visibility by index only (positions can only remove more pairs)
    vis = (idx[None, :] <= idx[:, None] + wr) & (idx[None, :] > idx[:, None] - w)
    tiles = vis.reshape(Tp // bq, bq, Tp // bk, bk)
    any_vis, all_vis = tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))  # [n_qb, n_kb]

    # the range helpers are elementwise, so all blocks are evaluated in one call
    qr = np.stack([np.asarray(x) for x in wa_mod._key_range(
        jnp.arange(Tp // bq, dtype=jnp.int32) * bq, bq, bk, w, Tp // bk, wr)], 1)
    kr = np.stack([np.asarray(x) for x in wa_mod._query_range(
        jnp.arange(Tp // bk, dtype=jnp.int32) * bk, bq, bk, w, Tp // bq, wr)], 1)
    mask = np.asarray(wa_mod._tile_mask(0, 0, Tp, Tp, w, None, None, wr))
    np.testing.assert_array_equal(mask, vis)
    for qb, (lo, flo, fhi, hi) in enumerate(qr):
        assert lo <= flo <= fhi <= hi
        assert set(np.flatnonzero(any_vis[qb])) == set(range(lo, hi)), (qb, lo, hi)
        assert all_vis[qb, flo:fhi].all()  # tiles run without a mask in SWA
    for kb, (lo, flo, fhi, hi) in enumerate(kr):
        assert lo <= flo <= fhi <= hi
        assert set(np.flatnonzero(any_vis[:, kb])) == set(range(lo, hi)), (kb, lo, hi)
        assert all_vis[flo:fhi, kb].all()


# ------------------------------------------------------------------------------------------------
# Triton lowering, checked on the CPU: export the jitted fwd+bwd for CUDA (sm_90). This runs the
# Pallas -> Triton IR lowering that the GPU uses (PTX compilation itself happens only on a GPU).
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("permuted,window_right", [(False, 0), (True, 0), (True, 127)],
                         ids=["swa", "sa", "sa-symmetric"])
def test_triton_lowering_for_cuda(permuted, window_right):
    B, T, H, K, D = 1, 512, 4, 1, 128
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, p):
        o = windowed_attention(q, k, v, p if permuted else None, 128, window_right=window_right)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    assert triton_calls_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv, pos) == 3  # fwd, dkv, dq
