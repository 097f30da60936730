"""MoBA / SSA per-token block selection in two Pallas (Triton lowering) kernels: the gate's block
importance (:func:`block_importance`), then each row's top-k (:func:`top_k_blocks`);
:func:`select_blocks_split` runs both.

Returns what ``hybrid_lm.ops.block_sparse.select_blocks(..., selection='token')`` returns: int32
``[B, T, Hs, min(top_k, nb)]`` selected key blocks per query token, -1 for empty slots, ordered by
score descending with ties to the lower block index, the query's own block first (its score is
+inf). One gate program per (query tile, selection head, batch) walks the block means
``kbar [nb, D]`` of its KV head in chunks of ``block_c`` blocks.

Gates (as the reference, ``hybrid_lm/ops/block_sparse.py``):

- ``moba``: per query head (``Hs = H``), raw ``q . kbar_c`` over complete past blocks
  ``c < t // block``.
- ``ssa``: per GQA group (``Hs = K``), the sum over the group's query heads of the softmax
  probability ``exp(scale * q . kbar_c - lse)``, lse over the complete blocks ``c < (t+1) // block``
  (0 when there is none). A first loop over the chunks computes each head's lse online, a second
  one the group-summed probabilities.

Exactness against the reference: with fp32 operands and ``precision=HIGHEST`` the dot products are
accumulated in fp32 in a different order than XLA's einsum, the ``ssa`` lse online rather than in
one reduction, so scores can differ in the last bits. Selections are bitwise equal whenever no two
candidate scores of a row are within that rounding of each other; on inputs whose dot products are
exact in fp32 (small integers / dyadic values: block means of integer keys over power-of-two
blocks) the ``moba`` gate is exact always, and the ``ssa`` gate whenever its group sums have no
near-ties. ``dot_dtype='bfloat16'`` (what the model runs) rounds the block means to bf16 first.
``-0.0`` and ``+0.0`` tie (as ``top_k_by_passes``).

This module does not import ``hybrid_lm``. ``interpret=True`` runs the same kernel on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import cdiv as _cdiv, next_pow2 as _next_pow2

GATES = ("moba", "ssa")
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "-inf" of the online lse


@dataclasses.dataclass(frozen=True)
class SelectionBlockSizes:
    """Query rows per program (``block_q``), key blocks per chunk (``block_c``; both powers of two
    >= 16), Triton launch parameters, and ``hoist_q``: load the G query-head tiles once per program
    (kept in registers across the chunk loops) instead of once per chunk and head."""

    block_q: int = 64
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2
    hoist_q: bool = False


def block_means(k, block_size: int):
    """Mean key of each block ``[B, nb, K, D]`` (fp32): the same computation as
    ``hybrid_lm.ops.block_sparse.block_means`` (so the same bits)."""
    B, T, K, D = k.shape
    nb = -(-T // block_size)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, nb * block_size - T), (0, 0), (0, 0)))
    counts = jnp.minimum(block_size, T - jnp.arange(nb) * block_size).astype(jnp.float32)
    return kp.reshape(B, nb, block_size, K, D).sum(2) / counts[None, :, None, None]


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _best(x, idx, big):
    """Per row: the largest value and, among its copies, the lowest index."""
    v = jnp.max(x, axis=1)
    return v, jnp.min(jnp.where(x == v[:, None], idx, big), axis=1)


def _gate_tile(q_ref, kbar_ref, *, bq, bc, block_size, seq_len, group, gate, scale, precision,
               dot_dtype=jnp.float32, hoist_q=False):
    """The gate of one query tile (program 0's axis): runs the ssa
    lse pass and returns ``(own, last, chunk_scores)``: each row's own block, the tile's last real
    token, and ``chunk_scores(c0) -> (c, imp)``, the importance ``[bq, bc]`` of blocks
    ``c = c0 ... c0 + bc - 1`` (the gate's score for past blocks, ``-inf`` elsewhere)."""
    q0 = pl.program_id(0) * bq
    t = q0 + jnp.arange(bq, dtype=jnp.int32)  # token index of each row
    own = lax.div(t, block_size)
    complete = lax.div(t + 1, block_size)  # blocks c < complete enter the ssa lse
    last = jnp.minimum(q0 + bq, seq_len) - 1  # the tile's last real token

    qs = [q_ref[:, g, :].astype(dot_dtype) for g in range(group)] if hoist_q else None

    def scores(g, c0):
        qg = qs[g] if hoist_q else q_ref[:, g, :].astype(dot_dtype)
        return pltriton.dot(qg, kbar_ref[pl.ds(c0, bc), :], trans_b=True,
                            precision=precision)  # [bq, bc], fp32 accumulation

    def cols(c0):
        return c0 + jnp.arange(bc, dtype=jnp.int32)[None, :]

    # -- pass 1 (ssa): per query head, the online log-sum-exp over the complete blocks
    lses = []
    if gate == "ssa":
        n_lse = _cdiv(lax.div(last + 1, block_size), bc)
        for g in range(group):
            def lse_body(j, carry, g=g):
                m, l = carry
                c0 = j * bc
                s = jnp.where(cols(c0) < complete[:, None], scores(g, c0) * scale, _MASK)
                m_new = jnp.maximum(m, jnp.max(s, axis=1))
                l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
                return m_new, l

            m, l = lax.fori_loop(0, n_lse, lse_body, (jnp.full((bq,), _MASK, jnp.float32),
                                                        jnp.zeros((bq,), jnp.float32)))
            lses.append(jnp.where(complete > 0, m + jnp.log(l), 0.0))

    def chunk_scores(c0):
        c = cols(c0)
        past = c < own[:, None]
        if gate == "moba":
            return c, jnp.where(past, scores(0, c0), -jnp.inf)
        acc = jnp.zeros((bq, bc), jnp.float32)
        for g in range(group):
            s = scores(g, c0) * scale
            acc = acc + jnp.where(past, jnp.exp(jnp.where(past, s, 0.0) - lses[g][:, None]), 0.0)
        return c, jnp.where(past, acc, -jnp.inf)

    return own, last, chunk_scores


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------

# Operand tiles a program holds in shared memory: the G query-head tiles and one chunk of block
# means, in the dots' dtype. The H200 has 227 KiB per block; the first H200 run (S5: G = 10, D = 128,
# 64-row fp32 tiles) asked for 352 KiB and failed to launch, so the query tile shrinks until the
# operands fit this.
SMEM_OPERAND_BUDGET = 160 * 1024


def query_tile(block_q: int, seq_len: int, group: int, block_c: int, head_dim_padded: int,
               itemsize: int = 4) -> int:
    """Query rows per program: ``block_q`` (a power of two >= 16), halved while the operand tiles
    (``group`` query heads of ``rows x D`` and one ``block_c x D`` chunk, ``itemsize`` bytes each:
    4 for fp32 / tf32 dots, 2 for bf16) exceed :data:`SMEM_OPERAND_BUDGET`, and no more than the
    sequence needs; never below 16 (``tl.dot``)."""
    bq = min(block_q, max(16, _next_pow2(seq_len)))
    while bq > 16 and (group * bq + block_c) * head_dim_padded * itemsize > SMEM_OPERAND_BUDGET:
        bq //= 2
    return bq


def _check_tiles(blocks: SelectionBlockSizes) -> None:
    for b in (blocks.block_q, blocks.block_c):
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {blocks}")


def _gate_call(kernel, q, kb, *, block_size, gate, scale, precision, blocks, interpret, out_cols, out_dtype,
               name, **kernel_args):
    """One gate kernel over ``q [B, T, H, D]`` and block means ``kb [B, nb, K, D]`` (in their dot
    dtype), grid (query tile, selection head, batch), with the shared padding and tiles; the
    output ``[B, T, Hs, out_cols(nb_padded)]`` is cut back to T rows (columns are the caller's)."""
    B, T, H, D = q.shape
    nb, K = kb.shape[1], kb.shape[2]
    Hs = H if gate == "moba" else K
    G = H // Hs  # query heads per selection head: 1 (moba) or the GQA group (ssa)
    per_kv = Hs // K  # selection heads per KV head
    bc = min(blocks.block_c, max(16, _next_pow2(nb)))
    Dp = max(16, _next_pow2(D))
    bq = query_tile(blocks.block_q, T, G, bc, Dp, kb.dtype.itemsize)
    Tp, nbp = -(-T // bq) * bq, -(-nb // bc) * bc
    n_out = out_cols(nbp)
    q = jnp.pad(lax.stop_gradient(q), ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))).reshape(B, Tp, Hs, G, Dp)
    kb = jnp.pad(lax.stop_gradient(kb), ((0, 0), (0, nbp - nb), (0, 0), (0, Dp - D)))
    out = pl.pallas_call(
        functools.partial(kernel, bq=bq, bc=bc, block_size=block_size, seq_len=T, group=G, gate=gate,
                          scale=scale, precision=precision, hoist_q=blocks.hoist_q, **kernel_args),
        grid=(Tp // bq, Hs, B),
        in_specs=[pl.BlockSpec((None, bq, None, G, Dp), lambda i, h, b: (b, i, h, 0, 0)),
                  pl.BlockSpec((None, nbp, None, Dp), lambda i, h, b: (b, 0, h // per_kv, 0))],
        out_specs=pl.BlockSpec((None, bq, None, n_out), lambda i, h, b: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hs, n_out), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(q, kb)
    return out[:, :T]


# ------------------------------------------------------------------------------------------------
# Selection in two kernels: the gate's block importance, then the top-k of its rows
# ------------------------------------------------------------------------------------------------
# Each kernel does one simple thing at full occupancy: `block_importance` writes the gate's
# importance [B, T, Hs, nb] (fp32; the ssa gate's [.., G, nb] scores never reach HBM), and
# `top_k_blocks` reads each row once and takes its top-k in registers.

def _top_k_kernel(x_ref, o_ref, *, k):
    x = x_ref[...]  # [rows, n] fp32, padding at -inf
    br, n = x.shape
    iota = lax.broadcasted_iota(jnp.int32, (br, n), 1)
    slot = lax.broadcasted_iota(jnp.int32, o_ref.shape, 1)

    def one_pass(s, carry):  # the best entry after the previous pick (value descending, index ascending)
        out, m, i = carry
        below = (x < m[:, None]) | ((x == m[:, None]) & (iota > i[:, None]))
        m, i = _best(jnp.where(below, x, -jnp.inf), iota, n)
        return jnp.where(slot == s, jnp.where(m > -jnp.inf, i, -1)[:, None], out), m, i

    out, _, _ = lax.fori_loop(0, k, one_pass, (jnp.full(o_ref.shape, -1, jnp.int32),
                                               jnp.full((br,), jnp.inf, jnp.float32),
                                               jnp.full((br,), -1, jnp.int32)))
    o_ref[...] = out


# fp32 entries of x one top-k program holds (rows x padded row length), and per thread: the default
# launch takes as many warps as give each thread TOPK_THREAD_ELEMENTS (H200, S5 importance rows of
# 1,024 blocks: 2 rows and 1 warp 0.393 ms, 8 rows and 4 warps 0.467, 8 rows and 8 warps
# 0.603; a decode row of 8,192 blocks: 1 row, 4 warps)
TOPK_PROGRAM_ELEMENTS = 2048
TOPK_THREAD_ELEMENTS = 64


@functools.partial(jax.jit, static_argnames=("k", "block_rows", "num_warps", "interpret"))
def top_k_blocks(x, k: int, *, block_rows: int | None = None, num_warps: int | None = None,
                 interpret: bool | None = None):
    """Indices ``[..., min(k, n)]`` (int32) of the ``k`` largest entries of each row of ``x [..., n]``,
    value descending, ties to the lower index, -1 where the value is -inf: what
    ``hybrid_lm.ops.block_sparse._top_blocks`` returns (its ``passes`` method; ``-0.0`` and ``+0.0``
    tie). One program per ``block_rows`` rows reads them once and takes ``k`` argmax passes in
    registers (XLA's passes read the rows ``k`` times from HBM). NaN is never selected."""
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"expected x [..., n] with n >= 1, got {x.shape}")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    *lead, n = x.shape
    k = min(int(k), n)
    R = math.prod(lead)
    npad = _next_pow2(n)
    br = block_rows or max(1, min(64, TOPK_PROGRAM_ELEMENTS // npad))
    if br & (br - 1):
        raise ValueError(f"block_rows={br} must be a power of two")
    warps = num_warps or max(1, min(8, br * npad // (32 * TOPK_THREAD_ELEMENTS)))
    Rp = -(-R // br) * br
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    x2 = jnp.pad(lax.stop_gradient(x).astype(jnp.float32).reshape(R, n), ((0, Rp - R), (0, npad - n)),
                 constant_values=-jnp.inf)
    Sp = max(2, _next_pow2(k))
    out = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k),
        grid=(Rp // br,),
        in_specs=[pl.BlockSpec((br, npad), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((br, Sp), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((Rp, Sp), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="top_k_blocks",
    )(x2)
    return out[:R, :k].reshape(*lead, k)


def _importance_kernel(q_ref, kbar_ref, o_ref, *, bq, bc, block_size, seq_len, group, gate, scale,
                       precision, dot_dtype, hoist_q):
    own, last, chunk_scores = _gate_tile(q_ref, kbar_ref, bq=bq, bc=bc, block_size=block_size, seq_len=seq_len,
                                         group=group, gate=gate, scale=scale, precision=precision,
                                         dot_dtype=dot_dtype, hoist_q=hoist_q)
    nbp = o_ref.shape[-1]

    def chunk_body(j, carry):
        c, imp = chunk_scores(j * bc)
        o_ref[:, pl.ds(j * bc, bc)] = jnp.where(c == own[:, None], jnp.inf, imp)
        return carry

    n_own = _cdiv(lax.div(last, block_size) + 1, bc)  # chunks up to the tile's last own block
    lax.fori_loop(0, n_own, chunk_body, jnp.int32(0))

    def later(j, carry):  # blocks after every row's own block: never selectable
        o_ref[:, pl.ds(j * bc, bc)] = jnp.full((bq, bc), -jnp.inf, jnp.float32)
        return carry

    lax.fori_loop(n_own, nbp // bc, later, jnp.int32(0))


DOT_DTYPES = ("float32", "bfloat16")
# The gate kernel's default tiles with bf16 dots (H200, S5: T = 16K, B = 2, G = 10, a sweep of 16
# launches: 16 rows x 128-block chunks, 4 warps, 2 stages 0.847 ms; 16 x 64 1.030;
# 32 x 64 0.886). fp32 / tf32 dots keep SelectionBlockSizes()' tiles.
BF16_GATE_BLOCKS = SelectionBlockSizes(block_q=16, block_c=128)


@functools.partial(jax.jit, static_argnames=("block_size", "gate", "scale", "interpret", "block_sizes", "precision",
                                             "dot_dtype"))
def block_importance(q, kbar, *, block_size: int, gate: str, scale: float | None = None,
                     interpret: bool | None = None, block_sizes: SelectionBlockSizes | None = None,
                     precision=lax.Precision.DEFAULT, dot_dtype: str = "float32"):
    """The gate's block importance ``[B, T, Hs, nb]`` (fp32), what
    ``hybrid_lm.ops.block_sparse.block_importance`` gives every query token: ``+inf`` for the own
    block, ``-inf`` for later blocks, the gate's score for complete past blocks (``ssa``: the
    softmax probability summed over the GQA group, so ``Hs = K``; ``moba``: per head, ``Hs = H``).

    ``kbar [B, nb, K, D]``: the block means (fp32, as ``block_means``). ``precision`` of the
    in-kernel dots: DEFAULT lets the GPU round the fp32 operands to tf32 (as XLA's default fp32
    einsum on a GPU; exact in interpret mode on the CPU), HIGHEST keeps IEEE fp32. One program per
    (query tile, selection head, batch) runs the lse pass and the importance pass over the block
    chunks up to its own blocks only (the causal half). ``dot_dtype='bfloat16'`` runs the dots on
    bf16 operands (the block means rounded to bf16, as NSA's own kernel scores bf16 compressed
    keys), fp32 accumulation: the scores then differ from the reference by the block means'
    rounding."""
    if q.ndim != 4 or kbar.ndim != 4 or kbar.shape[0] != q.shape[0] or kbar.shape[3] != q.shape[3] \
            or q.shape[2] % kbar.shape[2]:
        raise ValueError(f"expected q [B,T,H,D] and kbar [B,nb,K,D] with H % K == 0: q{q.shape} kbar{kbar.shape}")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: choose one of {GATES}")
    B, T, H, D = q.shape
    nb, K = kbar.shape[1], kbar.shape[2]
    block_size = int(block_size)
    if block_size < 1 or nb != -(-T // block_size):
        raise ValueError(f"kbar{kbar.shape}: expected ceil(T / block_size) = {-(-T // max(1, block_size))} blocks")
    if dot_dtype not in DOT_DTYPES:
        raise ValueError(f"dot_dtype={dot_dtype!r}: choose one of {DOT_DTYPES}")
    blocks = block_sizes or (BF16_GATE_BLOCKS if dot_dtype == "bfloat16" else SelectionBlockSizes())
    _check_tiles(blocks)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = _gate_call(_importance_kernel, q, kbar.astype(dot_dtype), block_size=block_size, gate=gate, scale=scale,
                     precision=precision, blocks=blocks, interpret=interpret, out_cols=lambda nbp: nbp,
                     out_dtype=jnp.float32, name=f"block_importance_{gate}", dot_dtype=jnp.dtype(dot_dtype))
    return out[..., :nb]


def select_blocks_split(q, kbar, *, block_size: int, top_k: int, gate: str, scale: float | None = None,
                        interpret: bool | None = None, precision=lax.Precision.DEFAULT, dot_dtype: str = "float32",
                        block_sizes: SelectionBlockSizes | None = None):
    """Selected key blocks per query token: :func:`block_importance`, then :func:`top_k_blocks`; what
    ``hybrid_lm.ops.block_sparse.select_blocks(..., selection='token')`` returns up to near-ties of the
    scores. ``kbar``: the block means ``[B, nb, K, D]``. Returns int32 ``[B, T, Hs, min(top_k, nb)]``,
    ordered by score descending (ties to the lower block), the own block first, -1 for empty slots."""
    imp = block_importance(q, kbar, block_size=block_size, gate=gate, scale=scale, interpret=interpret,
                           precision=precision, dot_dtype=dot_dtype, block_sizes=block_sizes)
    return top_k_blocks(imp, int(top_k), interpret=interpret)
