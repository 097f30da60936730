"""Windowed attention with a position-id mask: Pallas (Triton lowering) forward and backward.

One kernel serves sliding-window attention (SWA, identity order) and stochastic/permuted attention
(SA, tokens given in a permuted order, causal by *original* position). With i, j the indices of
query and key in the given order and ``pos`` the original positions, key j is visible iff

    i - window < j <= i + window_right   and   pos[j] <= pos[i]

``window`` counts the query itself; ``window_right`` (static, default 0) extends the band to the
right of the query in the given order. ``window_right = 0`` is the one-sided (causal-order) band of
SA as specified; ``window_right = window - 1`` is the symmetric band ``|i - j| < window`` (SA's
``window_mode='symmetric'``), which with ``window >= T`` is exactly causal attention by position
for any order. ``window_right > 0`` needs positions: in the identity order every key right of the
query is in the future, so it would change nothing, and the position-free path skips the masks
that would hide those keys. With ``window_right = 0``, ``window >= T`` sees the keys that precede
the query in both the given order and by position (causal attention for the identity order).

Layout ``[B, T, H, D]`` for q and ``[B, T, K, D]`` for k/v with ``H % K == 0`` (GQA). Softmax
statistics and accumulators are fp32; the output has q's dtype.

Block skipping: a query block ``[q0, q0 + bq)`` only visits key blocks that intersect the band
``[q0 - window + 1, q0 + bq - 1 + window_right]``; a key block only visits the query blocks of
``[k0 - window_right, k0 + bk - 1 + window - 1]``. Work is O(T * (window + window_right)), memory
O(T). With ``positions=None`` (SWA) tiles that lie wholly inside the band run without any mask;
with positions, every tile is masked elementwise (the permuted causal part cannot be known per
tile in advance).

Padding: T is padded up to a multiple of the largest block. Padded keys carry the position
``INT32_MAX``, so ``pos[j] <= pos[i]`` hides them from every real query whatever the band (they can
fall inside it when ``window_right > 0``) and whatever the real positions are (not only < T).

Backward: two kernels, both deterministic. dQ (one program per query block and head, looping over
the band's key blocks) runs first and also computes ``delta = rowsum(o * do)`` for its rows; dK/dV
(one program per key block and KV head, looping over the GQA group's query heads and the band's
query blocks) reads that delta. ``BlockSizes(fused_bwd=True)`` instead adds dQ partials from the
dK/dV kernel with atomics (correct, but 3.5-4.5x slower on an H200: see docs/KERNELS.md).

This module does not import ``hybrid_lm``. ``interpret=True`` runs the same kernels on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import tiles
from .tiles import LOG2E, cdiv as _cdiv, next_pow2 as _next_pow2, precision_for as _precision

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters.

    Forward: ``block_q`` query rows per program, ``block_k`` key rows per inner step.
    dK/dV kernel: ``block_k_dkv`` key rows per program, ``block_q_dkv`` query rows per inner step.
    dQ kernel: ``block_q_dq`` query rows per program, ``block_k_dq`` key rows per inner step.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_dkv: int = 4
    num_stages_dkv: int = 2
    num_warps_dq: int = 4
    num_stages_dq: int = 2
    # fused_bwd: one backward kernel (dK/dV programs also add dQ partials into an fp32 buffer with
    # atomics: 5 matmuls per tile instead of 7, but dQ is not bitwise reproducible, and on an
    # H200 it measured 3.5-4.5x slower: the tile add lowers to element-wise acq_rel atomics)
    fused_bwd: bool = False

    def all_blocks(self) -> tuple[int, ...]:
        return (self.block_q, self.block_k, self.block_q_dkv, self.block_k_dkv,
                self.block_q_dq, self.block_k_dq)

    def shrink_to(self, length: int) -> "BlockSizes":
        """Caps every block at the next power of two >= length (at least 16)."""
        cap = max(16, _next_pow2(length))
        return dataclasses.replace(self, **{
            f.name: min(getattr(self, f.name), cap)
            for f in dataclasses.fields(self) if f.name.startswith("block_")})


def default_block_sizes(window: int, dtype) -> BlockSizes:
    """Tiles chosen by the H200 sweep (docs/BENCHMARKS.md, bf16, D=128): 64x64 everywhere for
    w <= 512; for w = 2048 a 128x128 forward tile with 8 warps and 3 stages is ~5% faster. The
    switch point (w > 1024) lies between the measured windows. fp32 keeps 64x64 tiles."""
    if window > 1024 and jnp.dtype(dtype).itemsize <= 2:
        return BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3)
    return BlockSizes()


def _clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


# ------------------------------------------------------------------------------------------------
# Band arithmetic (all operands non-negative int32 scalars, so lax.div is floor division)
# ------------------------------------------------------------------------------------------------

def _key_range(q0, bq, bk, window, n_kb, window_right=0):
    """Key blocks a query block [q0, q0+bq) needs, split as [lo, f_lo) left edge, [f_lo, f_hi)
    interior (every pair inside the band), [f_hi, hi) right (diagonal) edge. The band of query i is
    ``[i - window + 1, i + window_right]``."""
    lo = lax.div(jnp.maximum(q0 - window + 1, 0), bk)
    hi = jnp.minimum(_cdiv(q0 + bq + window_right, bk), n_kb)
    # interior block kb: kb*bk >= q0 + bq - window and kb*bk + bk - 1 <= q0 + window_right
    f_lo = _clamp(_cdiv(jnp.maximum(q0 + bq - window, 0), bk), lo, hi)
    f_hi = _clamp(lax.div(q0 + 1 + window_right, bk), f_lo, hi)
    return lo, f_lo, f_hi, hi


def _query_range(k0, bq, bk, window, n_qb, window_right=0):
    """Query blocks a key block [k0, k0+bk) is seen from, split like `_key_range`: [lo, f_lo)
    diagonal (right-band) edge, [f_lo, f_hi) interior, [f_hi, hi) window edge. Key j lies in the
    band of the queries ``[j - window_right, j + window - 1]``."""
    lo = lax.div(jnp.maximum(k0 - window_right, 0), bq)
    hi = jnp.minimum(_cdiv(k0 + bk - 1 + window, bq), n_qb)
    # interior block qb: qb*bq >= k0 + bk - 1 - window_right and qb*bq + bq - 1 <= k0 + window - 1
    f_lo = _clamp(_cdiv(jnp.maximum(k0 + bk - 1 - window_right, 0), bq), lo, hi)
    f_hi = _clamp(lax.div(k0 + window, bq), f_lo, hi)
    return lo, f_lo, f_hi, hi


def _tile_mask(q0, k0, bq, bk, window, posq, posk, window_right=0):
    qi = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]
    kj = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
    mask = (kj <= qi + window_right) & (kj > qi - window)
    if posq is not None:
        mask = mask & (posk[None, :] <= posq[:, None])
    return mask


def _run_segments(segments, body, carry, has_pos):
    """Runs `body(idx, carry, masked)` over [a, b) segments; interior ones unmasked for SWA."""
    for (a, b), interior in segments:
        masked = has_pos or not interior
        carry = lax.fori_loop(a, b, functools.partial(body, masked=masked), carry)
    return carry


# ------------------------------------------------------------------------------------------------
# Forward kernel
# ------------------------------------------------------------------------------------------------

def _fwd_kernel(q_ref, k_ref, v_ref, *rest, bq, bk, window, window_right, qk_scale, has_pos,
                precision):
    if has_pos:
        pq_ref, pk_ref, o_ref, lse_ref = rest
    else:
        o_ref, lse_ref = rest
    n_kb = k_ref.shape[0] // bk
    q0 = pl.program_id(0) * bq
    q = q_ref[...]
    posq = pq_ref[...] if has_pos else None

    def body(kb, carry, masked):
        k0 = kb * bk
        mask = None
        if masked:
            posk = pk_ref[pl.ds(k0, bk)] if has_pos else None
            mask = _tile_mask(q0, k0, bq, bk, window, posq, posk, window_right)
        s = tiles.scores(q, k_ref[pl.ds(k0, bk), :], qk_scale, precision, mask)
        return tiles.softmax_update(carry, s, v_ref[pl.ds(k0, bk), :], precision)

    lo, f_lo, f_hi, hi = _key_range(q0, bq, bk, window, n_kb, window_right)
    carry = _run_segments([((lo, f_lo), False), ((f_lo, f_hi), True), ((f_hi, hi), False)], body,
                          tiles.softmax_init(bq, q.shape[-1]), has_pos)
    o_ref[...], lse_ref[...] = tiles.softmax_finish(carry, o_ref.dtype)


def _fwd_call(q, k, v, pos, *, window, window_right, scale, blocks: BlockSizes, interpret):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    bq, bk = blocks.block_q, blocks.block_k
    has_pos = pos is not None
    precision = _precision(q.dtype)
    kernel = functools.partial(_fwd_kernel, bq=bq, bk=bk, window=window,
                               window_right=window_right, qk_scale=scale * LOG2E,
                               has_pos=has_pos, precision=precision)
    in_specs = [tiles.q_tile_spec(bq, D), tiles.kv_spec(T, D, G), tiles.kv_spec(T, D, G)]
    args = [q, k, v]
    if has_pos:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, T), lambda i, b, h: (b, 0))]
        args += [pos, pos]
    o, lse = tiles.query_tile_call(kernel, args, in_specs, q=q, bq=bq, num_warps=blocks.num_warps,
                                   num_stages=blocks.num_stages, interpret=interpret,
                                   name="windowed_attention_fwd")
    return o, lse


# ------------------------------------------------------------------------------------------------
# Backward kernels
# ------------------------------------------------------------------------------------------------

def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, bq, bk, window,
                window_right, scale, qk_scale, has_pos, precision, group, fused):
    rest = list(rest)
    pq_ref, pk_ref = (rest.pop(0), rest.pop(0)) if has_pos else (None, None)
    dq_in_ref = rest.pop(0) if fused else None  # aliased with the dq output below
    del dq_in_ref
    if fused:
        dk_ref, dv_ref, dq_ref = rest
    else:
        dk_ref, dv_ref = rest
    n_qb = q_ref.shape[0] // bq
    k0 = pl.program_id(0) * bk
    k = k_ref[...]
    v = v_ref[...]
    posk = pk_ref[...] if has_pos else None
    d = k.shape[-1]
    lo, f_lo, f_hi, hi = _query_range(k0, bq, bk, window, n_qb, window_right)

    def head_body(g, carry):
        def body(qb, carry, masked):
            dk, dv = carry
            q0 = qb * bq
            q = q_ref[pl.ds(q0, bq), g, :]
            do = do_ref[pl.ds(q0, bq), g, :]
            lse = lse_ref[g, pl.ds(q0, bq)]
            delta = delta_ref[g, pl.ds(q0, bq)]
            mask = None
            if masked:
                posq = pq_ref[pl.ds(q0, bq)] if has_pos else None
                mask = _tile_mask(q0, k0, bq, bk, window, posq, posk, window_right)
            p, ds = tiles.softmax_backward(tiles.scores(q, k, qk_scale, precision, mask), lse, do, v,
                                           delta, precision)
            dv = dv + pltriton.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
            ds16 = ds.astype(q.dtype)
            dk = dk + pltriton.dot(ds16, q, trans_a=True, precision=precision)
            if fused:  # unscaled fp32 partial of dq for these rows (scaled in the cast pass)
                pltriton.atomic_add(dq_ref, (pl.ds(q0, bq), g, slice(None)),
                                    pltriton.dot(ds16, k, precision=precision))
            return dk, dv

        return _run_segments(
            [((lo, f_lo), False), ((f_lo, f_hi), True), ((f_hi, hi), False)], body, carry,
            has_pos)

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, *rest, bq, bk, window, window_right,
               scale, qk_scale, has_pos, precision):
    if has_pos:
        pq_ref, pk_ref, dq_ref, delta_ref = rest
    else:
        dq_ref, delta_ref = rest
    n_kb = k_ref.shape[0] // bk
    q0 = pl.program_id(0) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    # delta_i = sum_d o_id * do_id (= sum_j p_ij dp_ij); also written out for the dK/dV kernel
    delta = tiles.row_delta(o_ref[...], do)
    delta_ref[...] = delta
    posq = pq_ref[...] if has_pos else None
    d = q.shape[-1]

    def body(kb, dq, masked):
        k0 = kb * bk
        k = k_ref[pl.ds(k0, bk), :]
        mask = None
        if masked:
            posk = pk_ref[pl.ds(k0, bk)] if has_pos else None
            mask = _tile_mask(q0, k0, bq, bk, window, posq, posk, window_right)
        s = tiles.scores(q, k, qk_scale, precision, mask)
        _, ds = tiles.softmax_backward(s, lse, do, v_ref[pl.ds(k0, bk), :], delta, precision)
        return dq + pltriton.dot(ds.astype(k.dtype), k, precision=precision)

    lo, f_lo, f_hi, hi = _key_range(q0, bq, bk, window, n_kb, window_right)
    dq = _run_segments([((lo, f_lo), False), ((f_lo, f_hi), True), ((f_hi, hi), False)], body,
                       jnp.zeros((bq, d), jnp.float32), has_pos)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _bwd_call(q, k, v, pos, o, lse, do, *, window, window_right, scale, blocks: BlockSizes,
              interpret):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    has_pos = pos is not None
    precision = _precision(q.dtype)
    if blocks.fused_bwd:
        delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
        dq_acc = jnp.zeros((B, T, K, G, D), jnp.float32)
        dk, dv, dq_acc = _dkv_call(q, k, v, pos, do, lse, delta, dq_acc, window=window,
                                   window_right=window_right, scale=scale, blocks=blocks,
                                   interpret=interpret)
        dq = (dq_acc.reshape(B, T, H, D) * scale).astype(q.dtype)
        return dq, dk, dv

    # dQ first: one program per (query block, batch, head). It also computes
    # delta = rowsum(o * do) for its rows and writes it for the dK/dV kernel.
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    in_specs = [tiles.q_tile_spec(bq, D), tiles.kv_spec(T, D, G), tiles.kv_spec(T, D, G),
                tiles.q_tile_spec(bq, D), tiles.q_tile_spec(bq, D), tiles.row_spec(bq)]
    args = [q, k, v, o, do, lse]
    if has_pos:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, T), lambda i, b, h: (b, 0))]
        args += [pos, pos]
    dq, delta = tiles.query_tile_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, window=window, window_right=window_right,
                          scale=scale, qk_scale=scale * LOG2E, has_pos=has_pos, precision=precision),
        args, in_specs, q=q, bq=bq, num_warps=blocks.num_warps_dq, num_stages=blocks.num_stages_dq,
        interpret=interpret, name="windowed_attention_dq")

    dk, dv = _dkv_call(q, k, v, pos, do, lse, delta, None, window=window,
                       window_right=window_right, scale=scale, blocks=blocks, interpret=interpret)
    return dq, dk, dv


def _dkv_call(q, k, v, pos, do, lse, delta, dq_acc, *, window, window_right, scale,
              blocks: BlockSizes, interpret):
    """dK / dV: one program per (key block, batch, kv head); loops over the group's query heads.
    With ``dq_acc`` ([B, T, K, G, D] fp32 zeros) it also accumulates dq/scale there."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    has_pos = pos is not None
    precision = _precision(q.dtype)
    fused = dq_acc is not None
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    in_specs, args = tiles.key_tile_inputs(q, k, v, do, lse, delta, bk)
    if has_pos:
        in_specs += [pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
                     pl.BlockSpec((None, bk), lambda i, b, h: (b, i))]
        args += [pos, pos]
    out_specs, out_shape = tiles.key_tile_outputs(k, v, bk)
    aliases = {}
    if fused:
        dq_spec = pl.BlockSpec((None, T, None, G, D), lambda i, b, h: (b, 0, h, 0, 0))
        in_specs.append(dq_spec)
        out_specs.append(dq_spec)
        out_shape.append(jax.ShapeDtypeStruct(dq_acc.shape, dq_acc.dtype))
        aliases = {len(args): 2}
        args.append(dq_acc)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, window=window, window_right=window_right,
                          scale=scale, qk_scale=scale * LOG2E, has_pos=has_pos,
                          precision=precision, group=G, fused=fused),
        grid=(T // bk, B, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps_dkv,
                                                num_stages=blocks.num_stages_dkv),
        interpret=interpret,
        name="windowed_attention_dkv",
    )(*args)


# ------------------------------------------------------------------------------------------------
# custom_vjp core (T a multiple of every block, D a power of two >= 16)
# ------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _core(q, k, v, pos, window, window_right, scale, blocks, interpret):
    o, _ = _fwd_call(q, k, v, pos, window=window, window_right=window_right, scale=scale,
                     blocks=blocks, interpret=interpret)
    return o


def _core_fwd(q, k, v, pos, window, window_right, scale, blocks, interpret):
    o, lse = _fwd_call(q, k, v, pos, window=window, window_right=window_right, scale=scale,
                       blocks=blocks, interpret=interpret)
    return o, (q, k, v, pos, o, lse)


def _core_bwd(window, window_right, scale, blocks, interpret, res, do):
    q, k, v, pos, o, lse = res
    dq, dk, dv = _bwd_call(q, k, v, pos, o, lse, do, window=window, window_right=window_right,
                           scale=scale, blocks=blocks, interpret=interpret)
    return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------

# jitted: identical calls (one per layer) lower, and compile their Triton kernels, once per program
@functools.partial(jax.jit, static_argnames=("window", "window_right", "scale", "interpret", "block_sizes"))
def windowed_attention(q, k, v, positions=None, window: int = 128, *, window_right: int = 0,
                       scale: float | None = None, interpret: bool = False,
                       block_sizes: BlockSizes | None = None):
    """Windowed attention with a position mask (Pallas, Triton lowering), differentiable.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, K, D]`` with ``H % K == 0``.
      positions: ``[B, T]`` int original positions in the given order, or ``None`` for the
        identity order (plain sliding-window attention; enables unmasked interior tiles).
      window: band width left of the query, including itself (static): keys ``j > i - window``.
      window_right: band width right of the query in the given order (static, >= 0): keys
        ``j <= i + window_right``, still subject to ``pos[j] <= pos[i]``. 0 (default) is the
        one-sided SA / SWA band; ``window - 1`` the symmetric band ``|i - j| < window``. Values
        > 0 need ``positions`` (ValueError otherwise).
      scale: logit scale, default ``1/sqrt(D)``.
      interpret: run the Pallas kernels in interpret mode (CPU).
      block_sizes: tiles and launch parameters (see `BlockSizes`); default
        `default_block_sizes(window + window_right, q.dtype)`.
    Returns:
      ``[B, T, H, D]`` in q's dtype.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"k/v must be [B, T, K, D] matching q: q{q.shape} k{k.shape} v{v.shape}")
    if H % k.shape[2]:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {k.shape[2]}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if int(window_right) != window_right or window_right < 0:
        raise ValueError(f"window_right must be an int >= 0, got {window_right!r}")
    window_right = int(window_right)
    if window_right > 0 and positions is None:
        raise ValueError(
            f"window_right={window_right} > 0 needs positions: keys right of the query are only "
            "visible when they precede it by position (with positions=None, the identity order, "
            "they are all in the future; pass window_right=0)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # default tiles by the band's width (measured for window_right = 0 only)
    blocks = (block_sizes or default_block_sizes(window + window_right, q.dtype)).shrink_to(T)
    for b in blocks.all_blocks():
        if b < 16 or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two >= 16, got {blocks}")

    step = max(blocks.all_blocks())
    Tp = -(-T // step) * step
    Dp = max(16, _next_pow2(D))
    window = min(window, Tp)
    window_right = min(window_right, Tp)
    if positions is not None:
        positions = jnp.asarray(positions).astype(jnp.int32)
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T] = {(B, T)}, got {positions.shape}")
    if Tp != T or Dp != D:
        # Padded keys (j >= T): without positions they are only in the band of padded queries
        # (window_right = 0 there, so i >= j). With positions they carry INT32_MAX, so
        # pos[j] <= pos[i] hides them from every real query even when window_right > 0 puts them
        # in its band, and whatever the real positions are (no assumption that they are < T).
        # Padded queries see keys (their own at least), so their rows stay finite; their outputs
        # and cotangents are sliced off / zero. Padded head dims are zeros in q, k (no effect on
        # logits) and v (sliced off).
        def pad(x):
            return jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D)))
        q, k, v = pad(q), pad(k), pad(v)
        if positions is not None:
            positions = jnp.pad(positions, ((0, 0), (0, Tp - T)),
                                constant_values=np.iinfo(np.int32).max)
    o = _core(q, k, v, positions, window, window_right, scale, blocks, interpret)
    return o[:, :T, :, :D]
