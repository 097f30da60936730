"""Block-sparse (MoBA) kernel (hybrid_lm_kernels) against the ops/ reference.

CPU: the Pallas kernels run in interpret mode (same kernel bodies as on the GPU), forward and
dq/dk/dv; per-token and per-block selections, one selection per query head (MoBA) or per GQA
group (SSA), T not a multiple of the block or the tiles, tiles wider than the block, fp32 and bf16.
The Triton lowering (what the GPU compiles) is checked on the CPU by exporting for CUDA; the
compiled GPU check is ``tests/gpu/test_gpu_attention.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import triton_calls_for_cuda

import jax
import jax.numpy as jnp

from hybrid_lm.ops.attention import dense_attention
from hybrid_lm.ops.block_sparse import block_sparse_attention as ref_block_sparse
from hybrid_lm_kernels import SparseBlockSizes, block_sparse_attention
from hybrid_lm_kernels import block_sparse_pallas as bs_mod

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in kernel output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6)


def _selection(key, B, rows, Hs, nb, top_k, block_of_row):
    """Top-k of random scores with the own block forced and later blocks excluded (as the gates)."""
    imp = jax.random.normal(key, (B, rows, Hs, nb))
    c = jnp.arange(nb)[None, :]
    own = block_of_row[:, None]
    imp = jnp.where((c > own)[None, :, None, :], -jnp.inf, imp)
    imp = jnp.where((c == own)[None, :, None, :], jnp.inf, imp)
    vals, idx = jax.lax.top_k(imp, min(top_k, nb))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def _inputs(seed, B, T, H, K, D, dtype, block_size, top_k, Hs, per_token):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, D), jnp.float32).astype(dtype)
    nb = -(-T // block_size)
    if per_token:
        idx = _selection(ks[4], B, T, Hs, nb, top_k, jnp.arange(T) // block_size)
        tok_idx = idx
    else:
        idx = _selection(ks[4], B, nb, Hs, nb, top_k, jnp.arange(nb))
        tok_idx = idx[:, jnp.arange(T) // block_size]  # every query of a block shares its list
    return q, k, v, do, idx, tok_idx


def _fwd_bwd(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do))


def _check(B, T, H, K, D, block_size, top_k, Hs, per_token, dtype=jnp.float32, blocks=None,
           tol=2e-5, seed=0):
    q, k, v, do, idx, tok_idx = _inputs(seed, B, T, H, K, D, dtype, block_size, top_k, Hs, per_token)
    got = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: block_sparse_attention(
        q, k, v, idx, block_size=block_size, interpret=True, block_sizes=blocks), *a))(q, k, v, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: ref_block_sparse(
            q, k, v, tok_idx, block_size=block_size), *a))(*f32)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype, name
        assert _rel(g, r) < tol, (name, _rel(g, r))


TINY = SparseBlockSizes(block_q=16, block_k=16)


@pytest.mark.integration
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_block"])
@pytest.mark.parametrize("heads", ["moba", "ssa"])
def test_fp32_against_reference(per_token, heads):
    H, K = 4, 2
    Hs = H if heads == "moba" else K
    _check(1, 200, H, K, 32, block_size=32, top_k=3, Hs=Hs, per_token=per_token, blocks=TINY)


@pytest.mark.integration
def test_per_token_tiles_wider_than_block():
    # query tiles of 64 span two blocks of 32: the own zone mixes own-block and selected rows
    _check(2, 150, 2, 1, 16, block_size=32, top_k=2, Hs=2, per_token=True,
           blocks=SparseBlockSizes(block_q=64, block_k=32), seed=1)


@pytest.mark.integration
def test_per_block_rectangular_tiles_and_odd_head_dim():
    _check(1, 300, 3, 1, 40, block_size=64, top_k=3, Hs=3, per_token=False,
           blocks=SparseBlockSizes(block_q=32, block_k=16), seed=2)


@pytest.mark.integration
def test_bf16_default_tiles():
    _check(1, 256, 2, 1, 64, block_size=64, top_k=2, Hs=1, per_token=False, dtype=jnp.bfloat16,
           tol=2e-2, seed=3)


@pytest.mark.integration
def test_top_k_covering_all_blocks_is_causal_attention():
    B, T, H, K, D, bs = 1, 160, 2, 1, 32, 32
    q, k, v, do, idx, _ = _inputs(4, B, T, H, K, D, jnp.float32, bs, 99, K, True)
    got = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: block_sparse_attention(
        q, k, v, idx, block_size=bs, interpret=True, block_sizes=TINY), *a))(q, k, v, do)
    with jax.default_matmul_precision("highest"):
        want = _fwd_bwd(lambda q, k, v: dense_attention(q, k, v), q, k, v, do)
    for g, r in zip(got, want):
        assert _rel(g, r) < 2e-5


def test_lists_are_exact_and_transposed():
    """Tile lists hold exactly the past blocks some row selected, and the reverse lists invert them."""
    T, bs, bq = 256, 32, 64
    idx = _selection(jax.random.key(5), 1, T, 1, T // bs, 3, jnp.arange(T) // bs)
    m = np.asarray(bs_mod.selection_matrix(idx, seq_len=T, block_size=bs, block_q=bq, per_token=True))
    want = np.zeros_like(m)
    for t in range(T):
        for c in np.asarray(idx[0, t, 0]):
            if 0 <= c < (t // bq * bq) // bs:
                want[0, 0, t // bq, c] = True
    np.testing.assert_array_equal(m, want)
    lists = np.asarray(bs_mod._compact(jnp.asarray(m)))
    rev = np.asarray(bs_mod._compact(jnp.swapaxes(jnp.asarray(m), 2, 3)))
    for qt in range(m.shape[2]):
        n = lists[0, 0, qt, 0]
        assert list(lists[0, 0, qt, 1:1 + n]) == list(np.flatnonzero(m[0, 0, qt]))
    for c in range(m.shape[3]):
        n = rev[0, 0, c, 0]
        assert list(rev[0, 0, c, 1:1 + n]) == list(np.flatnonzero(m[0, 0, :, c]))


def test_rejects_bad_inputs():
    q = jnp.zeros((1, 64, 2, 32))
    k = jnp.zeros((1, 64, 1, 32))
    idx = jnp.zeros((1, 64, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        block_sparse_attention(q, k, k, idx, block_size=24)
    with pytest.raises(ValueError, match="block_idx must be"):
        block_sparse_attention(q, k, k, jnp.zeros((1, 7, 1, 2), jnp.int32), block_size=16)
    with pytest.raises(ValueError, match="integer"):
        block_sparse_attention(q, k, k, idx.astype(jnp.float32), block_size=16)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_block", "per_token"])
def test_triton_lowering_for_cuda(per_token):
    B, T, H, K, D, bs = 1, 512, 4, 1, 128, 128
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, T if per_token else T // bs, H, 2), jnp.int32)

    def loss(q, k, v, idx):
        o = block_sparse_attention(q, k, v, idx, block_size=bs)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    assert triton_calls_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv, idx) == 3  # fwd, dq, dkv


@pytest.mark.integration
@pytest.mark.parametrize("selection,gate", [("token", "moba"), ("block", "ssa")])
def test_kernel_runs_the_reference_selection_end_to_end(selection, gate):
    """ops.select_blocks -> kernel equals ops.moba_attention (the model's xla path), fwd and grads."""
    from hybrid_lm.ops import block_sparse as ops
    B, T, H, K, D, bs = 1, 192, 4, 2, 32, 32
    ks = jax.random.split(jax.random.key(7), 4)
    q, k, v, do = (jax.random.normal(kk, s) for kk, s in zip(ks, [(B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)]))

    def kernel_path(q, k, v):
        idx = ops.select_blocks(q, k, block_size=bs, top_k=3, gate=gate, selection=selection)
        return block_sparse_attention(q, k, v, idx, block_size=bs, interpret=True, block_sizes=TINY)

    got = jax.jit(lambda *a: _fwd_bwd(kernel_path, *a))(q, k, v, do)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: ops.moba_attention(
            q, k, v, block_size=bs, top_k=3, gate=gate, selection=selection), *a))(q, k, v, do)
    for g, r in zip(got, want):
        assert _rel(g, r) < 2e-5
