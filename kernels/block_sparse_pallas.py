"""Block-sparse causal attention (MoBA): Pallas (Triton lowering) forward and backward.

Keys are cut into blocks of ``block_size`` tokens. Every query sees, causally, its own block, plus
the *past* blocks it selected. The selection comes in one of two granularities:

- per query block, ``block_idx [B, nb, Hs, S]``: all queries of block ``c`` share the list
  ``block_idx[:, c]``. Tiles of selected past blocks then need no mask at all.
- per query token, ``block_idx [B, T, Hs, S]`` (MoBA's and NSA's reference semantics): a query tile
  visits the *union* of its tokens' selections and masks each row by membership. Exact for any
  selection; the speed depends on how much neighbouring tokens agree.

``-1`` marks an empty slot; entries at or after a query's own block are ignored (its own block is
always attended, causally). ``Hs`` selection heads: query head ``h`` uses selection head
``h // (H // Hs)`` (``Hs = H``: official MoBA, one selection per query head; ``Hs = K``: SSA/NSA,
one per GQA group).

Work: a query tile visits the key tiles of its listed past blocks plus the key tiles of its own
block up to the diagonal. The lists are built outside the kernels (XLA) from a dense
``[B, Hs, T / block_q, T / block_size]`` selection matrix: O(T^2 / (block_q * block_size)) bytes,
never O(T^2). The backward runs a dQ kernel (same traversal as the forward, also writes
``delta = rowsum(o * do)``) and a dK/dV kernel that walks the transposed lists (which query tiles
selected this key block), both deterministic (no atomics).

Tiles: ``block_k`` (and ``block_q`` in per-block mode) must divide ``block_size``; they are capped
at ``block_size``. Blocks of 16 or 32 work (16-wide tiles) but run below the tensor cores' rate;
where the selection is per token and shared by a GQA group (SSA's gate) the model runs the per-token
gather kernel instead (``gather_sparse_pallas.py``). ``attention_impl='auto'`` sends every
power-of-two block of 16 or more to a kernel (``hybrid_lm.backends.moba_backend``).

This module does not import ``hybrid_lm``. ``interpret=True`` runs the same kernels on the CPU.
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

from . import tiles
from .tiles import LOG2E, cdiv as _cdiv, next_pow2 as _next_pow2, precision_for as _precision


@dataclasses.dataclass(frozen=True)
class SparseBlockSizes:
    """Tiles (powers of two >= 16) and Triton launch parameters, shared by all three kernels
    (the selection lists are per query tile, so the forward and backward must agree on it)."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2


# ------------------------------------------------------------------------------------------------
# Selection lists (XLA, outside the kernels)
# ------------------------------------------------------------------------------------------------

def _compact(mask):
    """``mask [..., n]`` -> ``[..., 1 + n']`` int32: entry 0 the count, then the True indices in
    ascending order (padding -1), n' = n rounded up to a power of two."""
    n = mask.shape[-1]
    order = jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)
    count = mask.sum(-1, dtype=jnp.int32)
    order = jnp.where(jnp.arange(n) < count[..., None], order, -1)
    width = _next_pow2(n + 1) - 1 - n
    order = jnp.pad(order, [(0, 0)] * (mask.ndim - 1) + [(0, width)], constant_values=-1)
    return jnp.concatenate([count[..., None], order], axis=-1)


def selection_matrix(block_idx, *, seq_len: int, block_size: int, block_q: int, per_token: bool):
    """Dense ``[B, Hs, n_qtiles, n_blocks]`` bool: query tile qt lists past block c.

    A tile lists block c if some query of the tile selected it and c lies wholly before the
    tile's first block (later blocks belong to the tile's own, causally masked, zone).
    ``seq_len`` is the padded length (a multiple of block_size and block_q).
    """
    B, _, Hs, S = block_idx.shape
    nqt, nb = seq_len // block_q, seq_len // block_size
    idx = block_idx.astype(jnp.int32)
    if per_token:
        t = jnp.arange(seq_len, dtype=jnp.int32)
        first_block = (t // block_q * block_q // block_size)[None, :, None, None]
        ok = (idx >= 0) & (idx < first_block)
        col = jnp.where(ok, idx, nb)  # nb = a dump column, dropped below
        rows = jnp.broadcast_to((t // block_q)[None, :, None, None], idx.shape)
        bb = jnp.broadcast_to(jnp.arange(B)[:, None, None, None], idx.shape)
        hh = jnp.broadcast_to(jnp.arange(Hs)[None, None, :, None], idx.shape)
        m = jnp.zeros((B, Hs, nqt, nb + 1), bool).at[bb, hh, rows, col].set(True)
        return m[..., :nb]
    c = jnp.arange(nb, dtype=jnp.int32)
    ok = (idx >= 0) & (idx < c[None, :, None, None])
    col = jnp.where(ok, idx, nb)
    rows = jnp.broadcast_to(c[None, :, None, None], idx.shape)
    bb = jnp.broadcast_to(jnp.arange(B)[:, None, None, None], idx.shape)
    hh = jnp.broadcast_to(jnp.arange(Hs)[None, None, :, None], idx.shape)
    m = jnp.zeros((B, Hs, nb, nb + 1), bool).at[bb, hh, rows, col].set(True)[..., :nb]
    return jnp.repeat(m, block_size // block_q, axis=2)  # every tile of block c shares its list


# ------------------------------------------------------------------------------------------------
# Tile masks
# ------------------------------------------------------------------------------------------------

def _tile_mask(q0, k0, bq, bk, block_size, sel, zone):
    """Visibility of a [bq, bk] tile whose key tile lies in one block ``k0 // block_size``.

    ``zone``: the tile is in the query tile's own zone (causal mask, own block always visible);
    otherwise a listed past block. ``sel [bq, S]``: per-token selections (row membership), or None
    (per-block mode: every row selected the block).
    """
    qi = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]
    kj = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
    ck = lax.div(k0, block_size)
    member = None
    if sel is not None:
        member = jnp.max((sel == ck).astype(jnp.int32), axis=1)[:, None] > 0  # [bq, 1]
    if not zone:
        return jnp.broadcast_to(member, (bq, bk))
    causal = kj <= qi
    if member is None:
        return causal
    return causal & ((lax.div(qi, block_size) == ck) | member)


# ------------------------------------------------------------------------------------------------
# Forward and dQ kernels: one program per (query tile, batch, head)
# ------------------------------------------------------------------------------------------------

def _query_side_loop(q0, bq, bk, block_size, lst_ref, body, carry, per_token):
    """Runs ``body(k0, carry, masked, zone)`` over the listed past blocks' key tiles, then over the
    query tile's own zone ``[own block start, q0 + bq)``."""
    per_block = block_size // bk
    n_past = lst_ref[0] * per_block

    def past(n, carry):
        k0 = lst_ref[1 + lax.div(n, per_block)] * block_size + lax.rem(n, per_block) * bk
        return body(k0, carry, masked=per_token, zone=False)

    carry = lax.fori_loop(0, n_past, past, carry)
    z_lo = lax.div(lax.div(q0, block_size) * block_size, bk)
    z_hi = _cdiv(q0 + bq, bk)
    # per-block mode: zone key tiles wholly at or before the tile's first query need no mask
    z_mid = z_lo if per_token else jnp.maximum(z_lo, lax.div(q0 + 1, bk))

    def zone(masked):
        return lambda kb, carry: body(kb * bk, carry, masked=masked, zone=True)

    carry = lax.fori_loop(z_lo, z_mid, zone(False), carry)
    return lax.fori_loop(z_mid, z_hi, zone(True), carry)


def _fwd_kernel(q_ref, k_ref, v_ref, lst_ref, *rest, bq, bk, block_size, qk_scale, per_token,
                precision):
    if per_token:
        sel_ref, o_ref, lse_ref = rest
        sel = sel_ref[...]
    else:
        (o_ref, lse_ref), sel = rest, None
    q0 = pl.program_id(0) * bq
    q = q_ref[...]

    def body(k0, carry, masked, zone):
        mask = _tile_mask(q0, k0, bq, bk, block_size, sel, zone) if masked else None
        s = tiles.scores(q, k_ref[pl.ds(k0, bk), :], qk_scale, precision, mask)
        return tiles.softmax_update(carry, s, v_ref[pl.ds(k0, bk), :], precision)

    carry = _query_side_loop(q0, bq, bk, block_size, lst_ref, body,
                             tiles.softmax_init(bq, q.shape[-1]), per_token)
    o_ref[...], lse_ref[...] = tiles.softmax_finish(carry, o_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, lst_ref, *rest, bq, bk, block_size,
               scale, qk_scale, per_token, precision):
    if per_token:
        sel_ref, dq_ref, delta_ref = rest
        sel = sel_ref[...]
    else:
        (dq_ref, delta_ref), sel = rest, None
    q0 = pl.program_id(0) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = tiles.row_delta(o_ref[...], do)
    delta_ref[...] = delta

    def body(k0, dq, masked, zone):
        k = k_ref[pl.ds(k0, bk), :]
        mask = _tile_mask(q0, k0, bq, bk, block_size, sel, zone) if masked else None
        s = tiles.scores(q, k, qk_scale, precision, mask)
        _, ds = tiles.softmax_backward(s, lse, do, v_ref[pl.ds(k0, bk), :], delta, precision)
        return dq + pltriton.dot(ds.astype(k.dtype), k, precision=precision)

    dq = _query_side_loop(q0, bq, bk, block_size, lst_ref, body,
                          jnp.zeros((bq, q.shape[-1]), jnp.float32), per_token)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------------------------
# dK/dV kernel: one program per (key tile, batch, kv head), looping over the group's query heads
# ------------------------------------------------------------------------------------------------

def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, rev_ref, *rest, bq, bk,
                block_size, scale, qk_scale, per_token, precision, group, n_qtiles):
    if per_token:
        sel_ref, dk_ref, dv_ref = rest
    else:
        (dk_ref, dv_ref), sel_ref = rest, None
    k0 = pl.program_id(0) * bk
    cb = lax.div(k0, block_size)
    k = k_ref[...]
    v = v_ref[...]

    def head_body(g, carry):
        def body(q0, carry, masked, zone):
            dk, dv = carry
            q = q_ref[pl.ds(q0, bq), g, :]
            do = do_ref[pl.ds(q0, bq), g, :]
            lse = lse_ref[g, pl.ds(q0, bq)]
            delta = delta_ref[g, pl.ds(q0, bq)]
            mask = None
            if masked:
                sel = sel_ref[g, pl.ds(q0, bq), :] if per_token else None
                mask = _tile_mask(q0, k0, bq, bk, block_size, sel, zone)
            p, ds = tiles.softmax_backward(tiles.scores(q, k, qk_scale, precision, mask), lse, do, v,
                                           delta, precision)
            dv = dv + pltriton.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
            dk = dk + pltriton.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
            return dk, dv

        # query tiles that listed this key block as a past block
        carry = lax.fori_loop(
            0, rev_ref[g, cb, 0],
            lambda n, c: body(rev_ref[g, cb, 1 + n] * bq, c, masked=per_token, zone=False), carry)
        # query tiles whose own zone holds this key tile: from the diagonal to the block's end
        z_lo = lax.div(k0, bq)
        z_hi = jnp.minimum(_cdiv((cb + 1) * block_size, bq), n_qtiles)
        # per-block mode: query tiles wholly at or after the key tile's last key need no mask
        z_mid = z_hi if per_token else jnp.minimum(z_hi, _cdiv(k0 + bk - 1, bq))

        def zone(masked):
            return lambda qt, c: body(qt * bq, c, masked=masked, zone=True)

        carry = lax.fori_loop(z_lo, z_mid, zone(True), carry)
        return lax.fori_loop(z_mid, z_hi, zone(False), carry)

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ------------------------------------------------------------------------------------------------

def _heads(H, Hs):
    """Selection head of query head h."""
    per = H // Hs
    return lambda h: h // per


def _fwd_call(q, k, v, lists, sel, *, block_size, scale, blocks, interpret):
    B, T, H, D = q.shape
    G = H // k.shape[2]
    Hs = lists.shape[1]
    hs = _heads(H, Hs)
    bq, bk = blocks.block_q, blocks.block_k
    per_token = sel is not None
    L = lists.shape[-1]
    in_specs = [tiles.q_tile_spec(bq, D), tiles.kv_spec(T, D, G), tiles.kv_spec(T, D, G),
                pl.BlockSpec((None, None, None, L), lambda i, b, h: (b, hs(h), i, 0))]
    args = [q, k, v, lists]
    if per_token:
        in_specs.append(pl.BlockSpec((None, None, bq, sel.shape[-1]), lambda i, b, h: (b, hs(h), i, 0)))
        args.append(sel)
    return tiles.query_tile_call(
        functools.partial(_fwd_kernel, bq=bq, bk=bk, block_size=block_size, qk_scale=scale * LOG2E,
                          per_token=per_token, precision=_precision(q.dtype)),
        args, in_specs, q=q, bq=bq, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=interpret, name="block_sparse_attention_fwd")


def _bwd_call(q, k, v, lists, rev, sel, o, lse, do, *, block_size, scale, blocks, interpret):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    Hs = lists.shape[1]
    hs = _heads(H, Hs)
    bq, bk = blocks.block_q, blocks.block_k
    per_token = sel is not None
    precision = _precision(q.dtype)
    params = pltriton.CompilerParams(num_warps=blocks.num_warps_bwd,
                                     num_stages=blocks.num_stages_bwd)
    L = lists.shape[-1]

    in_specs = [tiles.q_tile_spec(bq, D), tiles.kv_spec(T, D, G), tiles.kv_spec(T, D, G),
                tiles.q_tile_spec(bq, D), tiles.q_tile_spec(bq, D), tiles.row_spec(bq),
                pl.BlockSpec((None, None, None, L), lambda i, b, h: (b, hs(h), i, 0))]
    args = [q, k, v, o, do, lse, lists]
    if per_token:
        in_specs.append(pl.BlockSpec((None, None, bq, sel.shape[-1]), lambda i, b, h: (b, hs(h), i, 0)))
        args.append(sel)
    dq, delta = tiles.query_tile_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, block_size=block_size, scale=scale,
                          qk_scale=scale * LOG2E, per_token=per_token, precision=precision),
        args, in_specs, q=q, bq=bq, num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd,
        interpret=interpret, name="block_sparse_attention_dq")

    # dK/dV: per (key tile, batch, kv head); per-query-head views of the transposed lists
    # ([B, K, G, n_blocks, 1 + R]) and of the per-token selections ([B, K, G, T, S]).
    def per_query_head(x):
        x = jnp.repeat(x, H // Hs, axis=1)
        return x.reshape(B, K, G, *x.shape[2:])

    rev5 = per_query_head(rev)
    nb, R = rev5.shape[3], rev5.shape[4]
    in_specs, args = tiles.key_tile_inputs(q, k, v, do, lse, delta, bk)
    in_specs.append(pl.BlockSpec((None, None, G, nb, R), lambda i, b, h: (b, h, 0, 0, 0)))
    args.append(rev5)
    if per_token:
        sel5 = per_query_head(sel)
        in_specs.append(pl.BlockSpec((None, None, G, T, sel5.shape[-1]),
                                     lambda i, b, h: (b, h, 0, 0, 0)))
        args.append(sel5)
    out_specs, out_shape = tiles.key_tile_outputs(k, v, bk)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, block_size=block_size, scale=scale,
                          qk_scale=scale * LOG2E, per_token=per_token, precision=precision,
                          group=G, n_qtiles=T // bq),
        grid=(T // bk, B, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_attention_dkv",
    )(*args)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _core(q, k, v, lists, rev, sel, block_size, scale, blocks, interpret):
    o, _ = _fwd_call(q, k, v, lists, sel, block_size=block_size, scale=scale, blocks=blocks,
                     interpret=interpret)
    return o


def _core_fwd(q, k, v, lists, rev, sel, block_size, scale, blocks, interpret):
    o, lse = _fwd_call(q, k, v, lists, sel, block_size=block_size, scale=scale, blocks=blocks,
                       interpret=interpret)
    return o, (q, k, v, lists, rev, sel, o, lse)


def _core_bwd(block_size, scale, blocks, interpret, res, do):
    q, k, v, lists, rev, sel, o, lse = res
    dq, dk, dv = _bwd_call(q, k, v, lists, rev, sel, o, lse, do, block_size=block_size,
                           scale=scale, blocks=blocks, interpret=interpret)
    return dq, dk, dv, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------

# jitted: identical calls (one per layer) lower, and compile their Triton kernels, once per program
@functools.partial(jax.jit, static_argnames=("block_size", "scale", "interpret", "block_sizes"))
def block_sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None,
                           interpret: bool = False, block_sizes: SparseBlockSizes | None = None):
    """Causal block-sparse attention over selected key blocks (Pallas, Triton lowering).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, K, D]`` with ``H % K == 0``.
      block_idx: int ``[B, T, Hs, S]`` (per query token) or ``[B, ceil(T / block_size), Hs, S]``
        (per query block) selected key blocks, -1 = empty; ``Hs`` divides H and is a multiple of K.
        Entries at or after a query's own block are ignored; the own block is always attended.
      block_size: tokens per key block, a power of two >= 16 (static).
      scale: logit scale, default ``1/sqrt(D)``.
      interpret: run the Pallas kernels in interpret mode (CPU).
      block_sizes: tiles and launch parameters (`SparseBlockSizes`).
    Returns:
      ``[B, T, H, D]`` in q's dtype; no gradient flows to ``block_idx``.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or block_idx.ndim != 4:
        raise ValueError(f"expected q [B,T,H,D], k/v [B,T,K,D], block_idx [B,T|nb,Hs,S]: "
                         f"q{q.shape} k{k.shape} v{v.shape} block_idx{block_idx.shape}")
    B, T, H, D = q.shape
    K = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"k/v must be [B, T, K, D] matching q: q{q.shape} k{k.shape} v{v.shape}")
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    block_size = int(block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size} "
                         "(smaller blocks: use the XLA reference hybrid_lm.ops.block_sparse)")
    nb = -(-T // block_size)
    Bi, N, Hs, S = block_idx.shape
    if Bi != B or N not in (T, nb) or H % Hs or Hs % K:
        raise ValueError(f"block_idx must be [B, T or ceil(T/block_size), Hs, S] with Hs dividing "
                         f"H={H} and a multiple of K={K}; got {block_idx.shape} for T={T}, "
                         f"block_size={block_size}")
    if not jnp.issubdtype(block_idx.dtype, jnp.integer):
        raise ValueError(f"block_idx must be integer, got {block_idx.dtype}")
    per_token = N == T and T > 1  # T == 1: both readings coincide
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    blocks = block_sizes or SparseBlockSizes()
    for b in (blocks.block_q, blocks.block_k):
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {blocks}")
    bk = min(blocks.block_k, block_size)
    bq = blocks.block_q if per_token else min(blocks.block_q, block_size)
    blocks = dataclasses.replace(blocks, block_q=bq, block_k=bk)

    Tp = -(-T // max(block_size, bq)) * max(block_size, bq)
    Dp = max(16, _next_pow2(D))
    idx = lax.stop_gradient(block_idx).astype(jnp.int32)
    if Tp != T or Dp != D:
        # Padded keys are later than every real query (causally invisible); padded blocks are
        # never a real query's past block; padded query rows are sliced off.
        def pad(x):
            return jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D)))
        q, k, v = pad(q), pad(k), pad(v)
    rows = Tp if per_token else Tp // block_size
    idx = jnp.pad(idx, ((0, 0), (0, rows - idx.shape[1]), (0, 0), (0, 0)), constant_values=-1)
    m = selection_matrix(idx, seq_len=Tp, block_size=block_size, block_q=bq, per_token=per_token)
    lists = _compact(m)  # [B, Hs, n_qtiles, 1 + L]: past key blocks per query tile
    rev = _compact(jnp.swapaxes(m, 2, 3))  # [B, Hs, n_blocks, 1 + R]: query tiles per key block
    sel = None
    if per_token:
        Sp = max(2, _next_pow2(S))
        sel = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, Sp - S)), constant_values=-1)
        sel = jnp.swapaxes(sel, 1, 2)  # [B, Hs, Tp, Sp]
    o = _core(q, k, v, lists, rev, sel, block_size, scale, blocks, interpret)
    return o[:, :T, :, :D]
