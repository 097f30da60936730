"""Sparse attention compiled for the GPU: the per-token gather kernel against a dense fp32 oracle and against
the union kernel given the same lists, and the selection kernels (gate kernel on bf16 operands + top-k kernel)
against the reference selection ``ops.select_blocks``. Interpret-mode twins on the CPU:
``tests/test_kernels_gather_sparse.py``, ``tests/test_kernels_selection.py``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_util import GPU, fwd_bwd, oracle, qkv, rel_err, same_bits

from hybrid_lm.ops import block_sparse as ops

pytestmark = GPU


def listed_oracle(q, k, v, idx, block_size):
    """Dense attention masked to the listed blocks (per token, shared by a GQA group), causal."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    blk = jnp.arange(T) // block_size
    listed = jnp.any(idx[..., None] == blk[None, None, None, None, :], axis=3)  # [B, T, K, T]
    mask = listed & (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None, :, None, :]
    mask = jnp.repeat(mask.transpose(0, 2, 1, 3), G, axis=1)  # [B, H, T, T]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


# (B, T, H, K, D, block, top_k, dtype, selection, gather launch): the default launch, 2 stages, 2 tokens per
# program with dK/dV chunks of 32, 4 warps
GATHER = [(2, 1000, 10, 1, 128, 16, 16, "bfloat16", "ssa", {}),
          (1, 777, 8, 2, 64, 32, 8, "float32", "random", dict(num_stages=2, num_stages_bwd=2)),
          (1, 1024, 4, 4, 128, 16, 16, "bfloat16", "random", dict(tokens_per_program=2, dkv_chunk=32)),
          (2, 2048, 10, 1, 128, 16, 16, "bfloat16", "ssa", dict(num_warps=4, num_warps_bwd=4))]


@pytest.mark.parametrize("B,T,H,K,D,bs,top_k,dtype,sel,launch", GATHER,
                         ids=[f"T{c[1]}-H{c[2]}K{c[3]}-{c[7][:4]}-{c[8]}" for c in GATHER])
def test_gather_kernel_against_the_oracle_and_the_union_kernel(B, T, H, K, D, bs, top_k, dtype, sel, launch):
    from hybrid_lm_kernels import block_sparse_attention, gather_sparse_attention

    q, k, v, do, _ = qkv(300 + T, B, T, H, K, D, jnp.dtype(dtype))
    if sel == "ssa":
        idx = jax.jit(lambda q, k: ops.select_blocks(q, k, block_size=bs, top_k=top_k, gate="ssa"))(q, k)
    else:
        idx = ops.random_token_selection(jax.random.key(T), B, T, K, block_size=bs, top_k=top_k)
    gather = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: gather_sparse_attention(q, k, v, idx, block_size=bs,
                                                                                 **launch), *a))
    got, again = gather(q, k, v, do), gather(q, k, v, do)
    assert same_bits(got, again)
    want = oracle(lambda q, k, v: listed_oracle(q, k, v, idx, bs), q, k, v, do)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    errs = {n: rel_err(g, r) for n, g, r in zip(("o", "dq", "dk", "dv"), got, want)}
    assert all(e < tol for e in errs.values()), errs
    union = jax.jit(lambda *a: fwd_bwd(lambda q, k, v: block_sparse_attention(q, k, v, idx, block_size=bs), *a))
    errs = {n: rel_err(g, r) for n, g, r in zip(("o", "dq", "dk", "dv"), got, union(q, k, v, do))}
    assert all(e < tol for e in errs.values()), errs


def _kernel_selection(q, k, bs, top_k, gate):
    """The selection kernels as the model's pallas path runs them for the ssa gate (bf16 operands)."""
    from hybrid_lm_kernels import select_blocks_split

    return select_blocks_split(q, ops.block_means(k, bs), block_size=bs, top_k=top_k, gate=gate, dot_dtype="bfloat16")


def _quantised(key, shape, lo, hi, div=1.0):
    return jax.random.randint(key, shape, lo, hi).astype(jnp.float32) / div


@pytest.mark.parametrize("gate,bs,heads,identical", [("moba", 16, 10, False), ("ssa", 16, 1, False),
                                                     ("ssa", 16, 10, True), ("moba", 128, 10, False)],
                         ids=["moba", "ssa-G1", "ssa-G10-identical-heads", "moba-block128"])
def test_selection_kernels_exact_on_quantised_inputs(gate, bs, heads, identical):
    """Small integers and quarters: every dot product is exact in bf16 operands with fp32 sums, so the kernels
    must select exactly the reference's blocks (identical heads: the group sum cannot create near-ties)."""
    B, T, D = 2, 4096, 128
    ks = jax.random.split(jax.random.key(0), 2)
    q = _quantised(ks[0], (B, T, 1 if identical else heads, D), -3, 4, 4.0)
    q = jnp.broadcast_to(q, (B, T, heads, D)) if identical else q
    k = _quantised(ks[1], (B, T, 1, D), -3, 4)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(lambda q, k: ops.select_blocks(q, k, block_size=bs, top_k=16, gate=gate))(q, k))
    got = np.asarray(jax.jit(lambda q, k: _kernel_selection(q, k, bs, 16, gate))(q, k))
    assert (got == want).all(), f"{int((got != want).any(-1).sum())} rows differ"


@pytest.mark.parametrize("gate,bs", [("ssa", 16), ("moba", 128)])
def test_selection_kernels_differ_only_at_near_ties(gate, bs):
    """Gaussian bf16 inputs at S5's heads: a row may differ from the reference only where the two selections'
    reference scores agree within bf16's rounding of the block means (1e-2 relative)."""
    B, T, H, D = 2, 4096, 10, 128
    ks = jax.random.split(jax.random.key(1), 2)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, 1, D), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(lambda q, k: ops.select_blocks(q, k, block_size=bs, top_k=16, gate=gate))(q, k))
    got = np.asarray(jax.jit(lambda q, k: _kernel_selection(q, k, bs, 16, gate))(q, k))
    kbar = ops.block_means(k, bs)
    for b, t, h in np.argwhere((got != want).any(-1))[:256]:
        with jax.default_matmul_precision("highest"):
            imp = np.asarray(ops.block_importance(q[b:b + 1, t:t + 1], kbar[b:b + 1], jnp.array([t]), block_size=bs,
                                                  gate=gate, scale=1 / math.sqrt(D)))[0, 0, h]
        sg, sw = (np.where(x >= 0, imp[np.maximum(x, 0)], -np.inf) for x in (got[b, t, h], want[b, t, h]))
        assert (np.isfinite(sg) == np.isfinite(sw)).all()
        fin = np.isfinite(sg)
        np.testing.assert_allclose(np.sort(sg[fin]), np.sort(sw[fin]), rtol=1e-2, atol=1e-2)
