"""Fused MoBA / SSA block selection (gate scores + top-k) in one Pallas (Triton lowering) kernel.

Returns what ``hybrid_lm.ops.block_sparse.select_blocks(..., selection='token')`` returns: int32
``[B, T, Hs, min(top_k, nb)]`` selected key blocks per query token, -1 for empty slots, ordered by
score descending with ties to the lower block index, the query's own block first (its score is
+inf). The ``[T, nb]`` score matrix never leaves the chip: one program per (query tile, selection
head, batch) walks the block means ``kbar [nb, D]`` of its KV head in chunks of ``block_c`` blocks
and keeps a running top-k per query row in registers.

Gates (as the reference, ``hybrid_lm/ops/block_sparse.py``):

- ``moba``: per query head (``Hs = H``), raw ``q . kbar_c`` over complete past blocks
  ``c < t // block``.
- ``ssa``: per GQA group (``Hs = K``), the sum over the group's query heads of the softmax
  probability ``exp(scale * q . kbar_c - lse)``, lse over the complete blocks ``c < (t+1) // block``
  (0 when there is none). A first loop over the chunks computes each head's lse online, a second
  one the group-summed probabilities.

Running top-k (exact): the list holds S = min(top_k, nb) (value, block) pairs, unsorted, seeded
with the own block at +inf. For each chunk, ``n`` = the most entries any row of the tile has that
beat its list's worst pair; ``n`` passes then move the chunk's best remaining entry into the list
in place of the list's worst whenever it beats it (the order: value descending, then block index
ascending). A final S passes sort the list. Work per chunk is O(n * (block_c + S)) per row, with
``n <= S`` and typically shrinking as the list fills with good blocks.

Exactness against the reference: the dot products are accumulated in fp32 (``precision=HIGHEST``)
in a different order than XLA's einsum, the ``ssa`` lse online rather than in one reduction, so
scores can differ in the last bits. Selections are bitwise equal whenever no two candidate scores
of a row are within that rounding of each other; on inputs whose dot products are exact in fp32
(small integers / dyadic values: block means of integer keys over power-of-two blocks) the
``moba`` gate is exact always, and the ``ssa`` gate whenever its group sums have no near-ties
(always for groups of identical heads or G = 1, where only the common lse rounding differs).
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
_BIG = 1 << 30  # index of an empty list slot (plus its slot number, so pairs stay distinct)
_NONE = (1 << 31) - 1  # index of "nothing left" in the final sort
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "-inf" of the online lse


@dataclasses.dataclass(frozen=True)
class SelectionBlockSizes:
    """Query rows per program (``block_q``), key blocks per chunk (``block_c``; both powers of two
    >= 16) and Triton launch parameters."""

    block_q: int = 64
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2


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


def _worst(bv, bi, valid):
    """Per row: the list's worst pair (lowest value, then highest index) among valid slots."""
    wv = jnp.min(jnp.where(valid, bv, jnp.inf), axis=1)
    wi = jnp.max(jnp.where(valid & (bv == wv[:, None]), bi, -1), axis=1)
    return wv, wi


def _beats(v, i, wv, wi):
    """``(v, i)`` comes before ``(wv, wi)`` (value descending, index ascending) and is finite."""
    return (v > -jnp.inf) & ((v > wv) | ((v == wv) & (i < wi)))


def _select_kernel(q_ref, kbar_ref, o_ref, *, bq, bc, block_size, seq_len, top_k, group, gate,
                   scale, precision):
    q0 = pl.program_id(0) * bq
    t = q0 + jnp.arange(bq, dtype=jnp.int32)  # token index of each row
    own = lax.div(t, block_size)
    complete = lax.div(t + 1, block_size)  # blocks c < complete enter the ssa lse
    last = jnp.minimum(q0 + bq, seq_len) - 1  # the tile's last real token
    Sp = o_ref.shape[-1]
    slot = jnp.arange(Sp, dtype=jnp.int32)[None, :]
    valid = slot < top_k

    def scores(g, c0):
        qg = q_ref[:, g, :].astype(jnp.float32)
        kb = kbar_ref[pl.ds(c0, bc), :]
        return pltriton.dot(qg, kb, trans_b=True, precision=precision)  # [bq, bc]

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

    # -- pass 2: chunk scores merged into a running top-k list per row
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

    def chunk_body(j, carry):
        bv, bi = carry
        c, x = chunk_scores(j * bc)
        wv, wi = _worst(bv, bi, valid)
        n_beat = jnp.sum(_beats(x, c, wv[:, None], wi[:, None]).astype(jnp.int32), axis=1)
        n = jnp.minimum(jnp.max(n_beat), top_k)

        def insert(_, carry):
            bv, bi, xm = carry
            cv, ci = _best(xm, c, _BIG)
            xm = jnp.where(c == ci[:, None], -jnp.inf, xm)  # taken
            wv, wi = _worst(bv, bi, valid)
            hit = (bi == wi[:, None]) & _beats(cv, ci, wv, wi)[:, None]
            return jnp.where(hit, cv[:, None], bv), jnp.where(hit, ci[:, None], bi), xm

        bv, bi, _ = lax.fori_loop(0, n, insert, (bv, bi, x))
        return bv, bi

    bv = jnp.where(slot == 0, jnp.inf, -jnp.inf) + jnp.zeros((bq, 1), jnp.float32)
    bi = jnp.where(slot == 0, own[:, None], _BIG + slot)
    n_past = _cdiv(lax.div(last, block_size), bc)
    bv, bi = lax.fori_loop(0, n_past, chunk_body, (bv, bi))

    # -- sort the list: S passes, each taking the best pair after the previous pick
    bv = jnp.where(valid, bv, -jnp.inf)
    out = jnp.full((bq, Sp), -1, jnp.int32)
    pv = jnp.full((bq,), jnp.inf, jnp.float32)
    pi = jnp.full((bq,), -1, jnp.int32)
    for s in range(top_k):
        below = (bv < pv[:, None]) | ((bv == pv[:, None]) & (bi > pi[:, None]))
        pv, pi = _best(jnp.where(below, bv, -jnp.inf), jnp.where(below, bi, _NONE), _NONE)
        out = jnp.where(slot == s, jnp.where(pv > -jnp.inf, pi, -1)[:, None], out)
    o_ref[...] = out


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------

# fp32 operand tiles a program holds in shared memory: the G query-head tiles and one chunk of block
# means. The H200 has 227 KiB per block; the first H200 run (S5: G = 10, D = 128, 64-row tiles)
# asked for 352 KiB and failed to launch, so the query tile shrinks until the operands fit this.
SMEM_OPERAND_BUDGET = 160 * 1024


def query_tile(block_q: int, seq_len: int, group: int, block_c: int, head_dim_padded: int) -> int:
    """Query rows per program: ``block_q`` (a power of two >= 16), halved while the fp32 operand
    tiles (``group`` query heads of ``rows x D`` and one ``block_c x D`` chunk) exceed
    :data:`SMEM_OPERAND_BUDGET`, and no more than the sequence needs; never below 16 (``tl.dot``)."""
    bq = min(block_q, max(16, _next_pow2(seq_len)))
    while bq > 16 and (group * bq + block_c) * head_dim_padded * 4 > SMEM_OPERAND_BUDGET:
        bq //= 2
    return bq


# jitted: identical calls (one per layer) lower, and compile their Triton kernels, once per program
@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "gate", "scale", "interpret", "block_sizes", "kbar", "precision"))
def select_blocks(q, k_or_kbar, *, block_size: int, top_k: int, gate: str, scale: float | None = None,
                  interpret: bool | None = None, block_sizes: SelectionBlockSizes | None = None,
                  kbar: bool | None = None, precision=lax.Precision.HIGHEST):
    """Selected key blocks per query token, fused (gate + top-k in one kernel); no gradient.

    Args:
      q: ``[B, T, H, D]`` queries (any float dtype; scored in fp32).
      k_or_kbar: keys ``[B, T, K, D]`` or their block means ``[B, ceil(T / block_size), K, D]``
        (fp32, as ``block_means``); ``kbar`` says which (default: by the second axis).
      block_size: tokens per key block (any int >= 1; static).
      top_k: selected blocks per query, counting its own.
      gate: ``moba`` (per query head, raw dot) or ``ssa`` (softmax probability summed over the GQA
        group, ``scale`` default ``1/sqrt(D)``).
      interpret: run the kernel in interpret mode (default: when JAX's default backend is the CPU).
      block_sizes: tiles and launch parameters (`SelectionBlockSizes`).
      precision: of the in-kernel dots; HIGHEST = IEEE fp32 (tf32 would round the inputs).
    Returns:
      int32 ``[B, T, Hs, min(top_k, nb)]``, ``Hs = H`` (moba) or ``K`` (ssa); -1 = empty slot.
    """
    if q.ndim != 4 or k_or_kbar.ndim != 4:
        raise ValueError(f"expected q [B,T,H,D] and k [B,T,K,D] or kbar [B,nb,K,D]: q{q.shape} "
                         f"k_or_kbar{k_or_kbar.shape}")
    B, T, H, D = q.shape
    K = k_or_kbar.shape[2]
    block_size, top_k = int(block_size), int(top_k)
    if block_size < 1 or top_k < 1:
        raise ValueError(f"block_size={block_size} and top_k={top_k} must be >= 1")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: choose one of {GATES}")
    if H % K or k_or_kbar.shape[0] != B or k_or_kbar.shape[3] != D:
        raise ValueError(f"q{q.shape} and k_or_kbar{k_or_kbar.shape} do not match (B, D; H % K == 0)")
    nb = -(-T // block_size)
    if kbar is None:
        if T == nb and T > 1:
            raise ValueError("block_size 1: say kbar=True or kbar=False (k and kbar have the same shape)")
        kbar = k_or_kbar.shape[1] == nb and T != nb
    if kbar and k_or_kbar.shape[1] != nb or not kbar and k_or_kbar.shape[1] != T:
        raise ValueError(f"k_or_kbar{k_or_kbar.shape}: expected [B, {T}, K, D] keys or [B, {nb}, K, D] "
                         "block means")
    blocks = block_sizes or SelectionBlockSizes()
    for b in (blocks.block_q, blocks.block_c):
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {blocks}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = lax.stop_gradient(q)
    kb = lax.stop_gradient(k_or_kbar).astype(jnp.float32) if kbar else block_means(
        lax.stop_gradient(k_or_kbar), block_size)
    S = min(top_k, nb)
    Hs = H if gate == "moba" else K
    G = H // Hs  # query heads per selection head: 1 (moba) or the GQA group (ssa)
    per_kv = Hs // K  # selection heads per KV head
    bc = min(blocks.block_c, max(16, _next_pow2(nb)))
    Dp = max(16, _next_pow2(D))
    bq = query_tile(blocks.block_q, T, G, bc, Dp)
    Tp, nbp = -(-T // bq) * bq, -(-nb // bc) * bc
    Sp = max(2, _next_pow2(S))
    q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))).reshape(B, Tp, Hs, G, Dp)
    kb = jnp.pad(kb, ((0, 0), (0, nbp - nb), (0, 0), (0, Dp - D)))
    out = pl.pallas_call(
        functools.partial(_select_kernel, bq=bq, bc=bc, block_size=block_size, seq_len=T, top_k=S,
                          group=G, gate=gate, scale=scale, precision=precision),
        grid=(Tp // bq, Hs, B),
        in_specs=[pl.BlockSpec((None, bq, None, G, Dp), lambda i, h, b: (b, i, h, 0, 0)),
                  pl.BlockSpec((None, nbp, None, Dp), lambda i, h, b: (b, 0, h // per_kv, 0))],
        out_specs=pl.BlockSpec((None, bq, None, Sp), lambda i, h, b: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hs, Sp), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"select_blocks_{gate}",
    )(q, kb)
    return out[:, :T, :, :S]
