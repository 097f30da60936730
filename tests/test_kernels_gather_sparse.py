"""Per-token gather sparse attention kernel (hybrid_lm_kernels) against the ops/ reference.

CPU: the Pallas kernels run in interpret mode (same kernel bodies as on the GPU), forward and
dq/dk/dv in fp32 (bf16 loosely) against ``ops.block_sparse.block_sparse_attention`` with per-token
lists: GQA groups of 1, 2, 4 and 10 query heads, T a multiple of the block or not, blocks 16 and
32, S from 1 to 16 with more slots than blocks (-1 slots), the reference's own SSA selection,
random valid selections and messy lists (duplicates, unlisted own block, future and out-of-range
blocks, tokens that see nothing), dK/dV chunks smaller than a block's token list. Each shape
compiles once (without LLVM optimisation); its selections are arguments. The inverse lists and
their chunks are checked against a brute-force construction. The Triton lowering (what the GPU
compiles) is checked by exporting for CUDA at S5's shapes; the compiled GPU check is
``tests/gpu/test_gpu_sparse.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import triton_calls_for_cuda

import jax
import jax.numpy as jnp

from hybrid_lm.ops.block_sparse import block_sparse_attention as ref_block_sparse
from hybrid_lm.ops.block_sparse import random_token_selection, select_blocks
from hybrid_lm_kernels import gather_sparse_attention
from hybrid_lm_kernels import gather_sparse_pallas as gs_mod

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in kernel output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6)


def _fwd_bwd(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do))


_EXECUTABLES = {}


def _quick_compiled(fn):
    """``fn(*arrays, **static)`` jitted, compiled once per shapes and statics without LLVM
    optimisation: XLA's CPU backend then compiles the interpreted kernels about twice as fast, and
    these programs run for milliseconds."""
    def call(*args, **static):
        key = (fn, tuple((a.shape, a.dtype) for a in args), tuple(sorted(static.items())))
        if key not in _EXECUTABLES:
            jitted = jax.jit(functools.partial(fn, **static))
            _EXECUTABLES[key] = jitted.lower(*args).compile(
                compiler_options={"xla_backend_optimization_level": 0})
        return _EXECUTABLES[key](*args)
    return call


@_quick_compiled
def _kernel(q, k, v, do, idx, *, block_size, tokens=1, chunk=256):
    return _fwd_bwd(lambda q, k, v: gather_sparse_attention(
        q, k, v, idx, block_size=block_size, interpret=True, tokens_per_program=tokens,
        dkv_chunk=chunk), q, k, v, do)


@_quick_compiled
def _reference(q, k, v, do, idx, *, block_size):
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        return _fwd_bwd(lambda q, k, v: ref_block_sparse(q, k, v, idx, block_size=block_size), *f32)


@functools.partial(jax.jit, static_argnums=range(7))
def _inputs(seed, B, T, H, K, D, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(kk, (B, T, h, D), jnp.float32).astype(dtype)
                 for kk, h in zip(ks, (H, K, K, H)))


def _pad_slots(idx, S):
    return jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, S - idx.shape[-1])), constant_values=-1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _ssa_selection(q, k, block_size, S):
    """The reference's SSA selection (per token, shared by the GQA group), padded to S slots."""
    return _pad_slots(select_blocks(q, k, block_size=block_size, top_k=S, gate="ssa",
                                    selection="token"), S)


@functools.partial(jax.jit, static_argnums=range(6))
def _random_selection(seed, B, T, K, block_size, S):
    """A random valid selection (``ops.random_token_selection``), -1 slots padded to ``S``."""
    return _pad_slots(random_token_selection(jax.random.key(seed), B, T, K, block_size=block_size, top_k=S), S)


@functools.partial(jax.jit, static_argnums=range(6))
def _messy_selection(seed, B, T, K, block_size, S):
    """Lists the kernels must read as the reference does: entries anywhere in [-1, nb + 2)
    (duplicates, the own block left out, future and out-of-range blocks), slot 0 a visible block,
    and every 7th token listing nothing visible. Returns (idx, empty [T] bool)."""
    nb = -(-T // block_size)
    k1, k2 = jax.random.split(jax.random.key(seed))
    idx = jax.random.randint(k1, (B, T, K, S), -1, nb + 2)
    own = jnp.arange(T) // block_size
    first = jnp.floor(jax.random.uniform(k2, (B, T, K)) * (own + 1)[None, :, None])
    idx = idx.at[..., 0].set(first.astype(jnp.int32))
    empty = jnp.arange(T) % 7 == 3
    nothing = jnp.where(jax.random.bernoulli(k2, 0.5, idx.shape), -1, own[None, :, None, None] + 1)
    return jnp.where(empty[None, :, None, None], nothing, idx).astype(jnp.int32), empty


def _check(inputs, idx, block_size, tol, tokens=1, chunk=256, empty=None):
    q, k, v, do = inputs
    if empty is not None:  # tokens that see nothing: o = 0; no cotangent so the grads compare
        do = jnp.where(empty[None, :, None, None], 0, do)
    got = _kernel(q, k, v, do, idx, block_size=block_size, tokens=tokens, chunk=chunk)
    want = _reference(q, k, v, do, idx, block_size=block_size)
    if empty is not None:
        np.testing.assert_array_equal(np.asarray(got[0])[:, np.asarray(empty)], 0)
        want = (jnp.where(empty[None, :, None, None], 0, want[0]), *want[1:])
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == q.dtype, name
        assert _rel(g, r) < tol, (name, _rel(g, r))


@pytest.mark.integration  # larger interpreted kernels
def test_s5_group_of_10_t_not_a_multiple_of_the_block():
    # S5's heads (10 query heads on 1 KV head), S = 16 slots for 7 blocks; dK/dV chunks of 8
    # tokens, so a block most tokens list is summed from many chunks
    B, T, H, K, D, bs, S = 1, 100, 10, 1, 32, 16, 16
    inputs = _inputs(0, B, T, H, K, D)
    _check(inputs, _ssa_selection(*inputs[:2], bs, S), bs, 2e-5, chunk=8)
    _check(inputs, _random_selection(1, B, T, K, bs, S), bs, 2e-5, chunk=8)
    idx, empty = _messy_selection(2, B, T, K, bs, S)
    _check(inputs, idx, bs, 2e-5, chunk=8, empty=empty)


@pytest.mark.integration  # larger interpreted kernels
def test_group_of_4_block_32_two_batches_several_tokens_per_program():
    B, T, H, K, D, bs, S = 2, 64, 8, 2, 64, 32, 4
    inputs = _inputs(3, B, T, H, K, D)
    _check(inputs, _ssa_selection(*inputs[:2], bs, S), bs, 2e-5, tokens=2)
    _check(inputs, _random_selection(4, B, T, K, bs, S), bs, 2e-5, tokens=2)


def test_one_head_per_group_one_slot():
    # S = 1: the SSA selection is the own block alone; messy lists read one arbitrary entry
    B, T, H, K, D, bs, S = 2, 40, 2, 2, 16, 16, 1
    inputs = _inputs(5, B, T, H, K, D)
    _check(inputs, _ssa_selection(*inputs[:2], bs, S), bs, 2e-5, chunk=3)
    idx, empty = _messy_selection(6, B, T, K, bs, S)
    _check(inputs, idx, bs, 2e-5, chunk=3, empty=empty)


def test_bf16_group_of_2():
    B, T, H, K, D, bs, S = 1, 80, 4, 2, 32, 16, 4
    inputs = _inputs(7, B, T, H, K, D, jnp.bfloat16)
    _check(inputs, _ssa_selection(*inputs[:2], bs, S), bs, 2e-2)


def test_inverse_lists_and_chunks_against_brute_force():
    B, T, K, S, bs, chunk = 2, 96, 2, 5, 16, 7
    nb = T // bs
    n_chunks = nb + -(-T * S // chunk)
    idx, _ = _messy_selection(8, B, T, K, bs, S)

    @jax.jit
    def build(idx):
        lists = gs_mod.token_lists(idx, block_size=bs)
        tokens, offsets = gs_mod.inverse_lists(lists, nb)
        return (lists, tokens, offsets, *gs_mod.chunk_ranges(offsets, chunk, n_chunks))

    lists, tokens, offsets, ranges, chunk_offsets = (np.asarray(x) for x in build(idx))
    raw = np.asarray(idx)
    for b in range(B):
        for h in range(K):
            want = {c: [] for c in range(nb)}
            for t in range(T):
                listed = [c for c in raw[b, t, h] if 0 <= c <= t // bs]
                assert list(lists[b, t, h, 1:1 + lists[b, t, h, 0]]) == listed
                for c in listed:
                    want[c].append(t)
            for c in range(nb):
                got = tokens[b, h, offsets[b, h, c]:offsets[b, h, c + 1]]
                assert list(got) == want[c], (b, h, c)
            assert offsets[b, h, nb] == sum(len(x) for x in want.values())
            # chunks: each block's tokens in order, cut into pieces of `chunk` (the last shorter)
            for c in range(nb):
                pieces = [tuple(ranges[b, h, p, :3]) for p in range(chunk_offsets[b, h, c],
                                                                    chunk_offsets[b, h, c + 1])]
                lo, hi = offsets[b, h, c], offsets[b, h, c + 1]
                want_pieces = [(c, s, min(s + chunk, hi)) for s in range(lo, hi, chunk)]
                assert pieces == want_pieces, (b, h, c)
            unused = ranges[b, h, chunk_offsets[b, h, nb]:]
            assert (unused[:, 1] == unused[:, 2]).all()


def test_rejects_bad_inputs():
    q = jnp.zeros((1, 64, 2, 32))
    k = jnp.zeros((1, 64, 1, 32))
    idx = jnp.zeros((1, 64, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        gather_sparse_attention(q, k, k, idx, block_size=24)
    with pytest.raises(ValueError, match="tokens_per_program"):
        gather_sparse_attention(q, k, k, idx, block_size=16, tokens_per_program=3)
    with pytest.raises(ValueError, match="dkv_chunk"):
        gather_sparse_attention(q, k, k, idx, block_size=16, dkv_chunk=0)
    with pytest.raises(ValueError, match="block_idx must be"):
        gather_sparse_attention(q, k, k, jnp.zeros((1, 64, 2, 2), jnp.int32), block_size=16)
    with pytest.raises(ValueError, match="integer"):
        gather_sparse_attention(q, k, k, idx.astype(jnp.float32), block_size=16)


@pytest.mark.parametrize("tokens", [1, 4])
def test_triton_lowering_for_cuda(tokens):
    B, T, H, K, D, bs, S = 1, 4096, 10, 1, 128, 16, 16  # S5's heads, SSA's block and top-k
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, T, K, S), jnp.int32)

    def loss(q, k, v, idx):
        o = gather_sparse_attention(q, k, v, idx, block_size=bs, interpret=False,
                                    tokens_per_program=tokens)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    assert triton_calls_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv, idx) == 4  # fwd, dq, dkv chunks, dkv sums
