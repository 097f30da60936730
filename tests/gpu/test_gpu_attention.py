"""The attention kernels compiled for the GPU against fp32 references: the windowed kernel (SWA, SA, SA's
symmetric band) and the block-sparse kernel (MoBA's per-block and per-token lists). Forward and dq/dk/dv,
bf16 and fp32, T not a multiple of the tiles, GQA; a repeat gives identical bits (no race). The same kernel
bodies run in interpret mode on the CPU in ``tests/test_kernels_windowed.py`` and
``tests/test_kernels_block_sparse.py``."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from gpu_util import GPU, fwd_bwd, oracle, qkv, rel_err, same_bits

from hybrid_lm.ops.attention import dense_attention, windowed_attention as blocked_reference

pytestmark = GPU

TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def _windowed(q, k, v, pos, w, wr=0, blocks=None):
    from hybrid_lm_kernels import windowed_attention
    return windowed_attention(q, k, v, pos, w, window_right=wr, block_sizes=blocks)


@pytest.mark.parametrize("permuted,wr", [(False, 0), (True, 0), (True, 127)], ids=["swa", "sa", "sa-symmetric"])
def test_gpu_compiled_bf16(permuted, wr):
    B, T, H, K, D, w = 2, 1000, 8, 2, 128, 128
    q, k, v, do, perm = qkv(5, B, T, H, K, D, jnp.bfloat16)
    pos = perm if permuted else None
    got = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: _windowed(q, k, v, pos, w, wr), *a))(q, k, v, do)
    want = oracle(lambda q, k, v: dense_attention(q, k, v, window=w, positions=pos, window_right=wr), q, k, v, do)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 2e-2


# (B, T, H, K, D, w, window_right, dtype, permuted, reference, fused backward)
WINDOWED = [(2, 1000, 8, 2, 128, w, 0, "bfloat16", p, "dense", False) for w in (1, 64, 128, 1000) for p in (False, True)]
WINDOWED += [
    (1, 520, 4, 1, 64, 128, 0, "float32", True, "dense", False),
    (1, 520, 4, 1, 64, 1000, 0, "float32", False, "dense", False),
    (1, 4096, 4, 4, 128, 512, 0, "bfloat16", True, "blocked", False),
    (1, 4096, 4, 2, 128, 2048, 0, "bfloat16", True, "blocked", False),  # the large-window default tiles
    (2, 3000, 4, 4, 128, 2048, 0, "bfloat16", False, "blocked", False),
    (2, 1000, 8, 2, 128, 128, 0, "bfloat16", True, "dense", True),
    (1, 4096, 4, 4, 128, 2048, 0, "bfloat16", False, "blocked", True),
    (2, 1000, 8, 2, 128, 128, 127, "bfloat16", True, "dense", False),  # SA window_mode='symmetric'
    (1, 4096, 4, 2, 128, 512, 511, "bfloat16", True, "blocked", False),
    (1, 520, 4, 1, 64, 600, 599, "float32", True, "dense", False),
]


@pytest.mark.parametrize("B,T,H,K,D,w,wr,dtype,permuted,ref,fused", WINDOWED,
                         ids=[f"T{c[1]}-w{c[5]}{'-r' if c[6] else ''}-{c[7][:4]}-{'sa' if c[8] else 'swa'}"
                              f"{'-fused' if c[10] else ''}" for c in WINDOWED])
def test_windowed_kernel_against_the_reference(B, T, H, K, D, w, wr, dtype, permuted, ref, fused):
    q, k, v, do, perm = qkv(100 + T + w, B, T, H, K, D, jnp.dtype(dtype))
    pos = perm if permuted else None
    from hybrid_lm_kernels import default_block_sizes
    blocks = dataclasses.replace(default_block_sizes(w, q.dtype), fused_bwd=True) if fused else None
    kernel = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: _windowed(q, k, v, pos, w, wr, blocks), *a))
    got, again = kernel(q, k, v, do), kernel(q, k, v, do)
    if ref == "dense":
        reference = lambda q, k, v: dense_attention(q, k, v, window=w, positions=pos, window_right=wr)  # noqa: E731
    else:
        reference = lambda q, k, v: blocked_reference(q, k, v, w, positions=pos, window_right=wr)  # noqa: E731
    want = oracle(reference, q, k, v, do)
    # dq/dk are exactly zero at w = 1 (a one-key softmax has no gradient): an RMS floor of 0.05
    errs = {n: rel_err(g, r, floor_rms=0.05) for n, g, r in zip(("o", "dq", "dk", "dv"), got, want)}
    assert all(e < TOL[dtype] for e in errs.values()), errs
    assert fused or same_bits(got, again)  # fused: fp32 atomics reorder dq's sums


def _selection(seed, B, rows, Hs, nb, top_k, block_of_row):
    """``top_k`` blocks per row from random scores: the own block forced, later blocks excluded."""
    imp = jax.random.normal(jax.random.key(seed), (B, rows, Hs, nb))
    c = jnp.arange(nb)[None, :]
    own = block_of_row[:, None]
    imp = jnp.where((c > own)[None, :, None, :], -jnp.inf, imp)
    imp = jnp.where((c == own)[None, :, None, :], jnp.inf, imp)
    vals, idx = jax.lax.top_k(imp, min(top_k, nb))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def moba_oracle(q, k, v, tok_idx, block_size):
    """Dense attention where key j is visible from t iff j <= t and (same block or j's block selected)."""
    B, T, H, D = q.shape
    Hs = tok_idx.shape[2]
    blk = jnp.arange(T) // block_size
    sel = jnp.any(tok_idx[..., None] == blk[None, None, None, None, :], axis=3)  # [B, T, Hs, T]
    mask = (sel | (blk[:, None] == blk[None, :])[None, :, None, :]) & (
        jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None, :, None, :]
    mask = jnp.repeat(mask.transpose(0, 2, 1, 3), H // Hs, axis=1)  # [B, H, T, T]
    G = H // k.shape[2]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


# (B, T, H, K, selection heads, block, top_k, per-token lists, dtype)
MOBA = [(2, 1000, 8, 2, 8, 64, 4, True, "bfloat16"), (2, 1000, 8, 2, 2, 64, 4, False, "bfloat16"),
        (1, 1500, 4, 1, 4, 128, 3, False, "bfloat16"), (1, 1500, 4, 1, 1, 128, 3, True, "bfloat16"),
        (1, 700, 4, 2, 4, 32, 5, True, "float32"), (1, 1024, 4, 4, 4, 128, 3, False, "float32")]


@pytest.mark.parametrize("B,T,H,K,Hs,bs,top_k,per_token,dtype", MOBA,
                         ids=[f"T{c[1]}-b{c[5]}-{'token' if c[7] else 'block'}-{c[8][:4]}" for c in MOBA])
def test_block_sparse_kernel_against_the_dense_oracle(B, T, H, K, Hs, bs, top_k, per_token, dtype):
    from hybrid_lm_kernels import block_sparse_attention

    q, k, v, do, _ = qkv(200 + T, B, T, H, K, 128, jnp.dtype(dtype))
    nb = -(-T // bs)
    if per_token:
        idx = tok = _selection(T, B, T, Hs, nb, top_k, jnp.arange(T) // bs)
    else:
        idx = _selection(T, B, nb, Hs, nb, top_k, jnp.arange(nb))
        tok = idx[:, jnp.arange(T) // bs]
    kernel = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: block_sparse_attention(q, k, v, idx, block_size=bs), *a))
    got, again = kernel(q, k, v, do), kernel(q, k, v, do)
    want = oracle(lambda q, k, v: moba_oracle(q, k, v, tok, bs), q, k, v, do)
    errs = {n: rel_err(g, r) for n, g, r in zip(("o", "dq", "dk", "dv"), got, want)}
    assert all(e < TOL[dtype] for e in errs.values()), errs
    assert same_bits(got, again)
