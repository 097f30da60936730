"""Per-token gather sparse attention (MoBA/SSA/NSA selections): Pallas (Triton lowering) forward and
backward.

Every query token ``t`` and KV head lists ``S`` selected key blocks of ``block_size`` tokens
(``block_idx [B, T, K, S]``, -1 = empty slot; one selection per GQA group, as SSA/NSA). A program
serves one token and one KV head at a time: the group's ``G`` query heads are the rows of the
matmuls (padded to a power of two >= 16) and it loops over that token's listed blocks only, ``S x
block_size`` keys, with the log2-domain online softmax of ``tiles.py``. This is the structure of
NSA's ``parallel_nsa_fwd_kernel`` (fla-org/native-sparse-attention). Unlike the union kernel of
``block_sparse_pallas.py``, whose 64-query tiles visit the union of their tokens' selections, the
work is exactly ``T * S * block_size`` key rows per KV head, whatever the selections are.

Semantics: those of ``hybrid_lm.ops.block_sparse.block_sparse_attention`` with per-token lists
(``Hs = K``): a token attends to the keys ``j <= t`` of the blocks it lists. So its own block counts
only when listed (the references always list it), a block listed twice counts twice, and ``-1``,
blocks after the token's own and blocks past the sequence contribute nothing. A token with no
visible key gets a zero output and zero gradients (the XLA reference averages clipped rows there).
The union kernel differs on those edge cases only: it always attends the own block and counts a
listed block once.

Backward: a dQ kernel with the forward's structure (recomputes ``p`` from the saved lse; also
writes ``delta = rowsum(o * do)``), and dK/dV from the inverse lists: for every key block, the
tokens that listed it, built in XLA by one sort of the flattened ``(block, token)`` pairs (offsets
by a cumsum of the per-block counts). A key block's tokens are cut into chunks of at most
``dkv_chunk``; one program per (chunk, KV head) sums its tokens' ``[block_size, D]`` contributions
in fp32, and a small kernel per (key block, KV head) adds up its block's chunks in order. Without
the chunks, a block that many tokens list (block 0 of a random SSA selection: ~5x the mean at 8K
tokens; an attention-sink block: every token) would be one long serial program. All of it is
deterministic (no atomics) and does ``T * S`` token visits per KV head.

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

# Imported for its side effect: it registers a config that is part of jit's trace context. Left to
# Pallas, which imports it during the first pallas_call, that changes the cache key of the function
# being traced, so its next call traces and compiles it a second time.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

from . import tiles
from .tiles import LOG2E, next_pow2, precision_for

# ------------------------------------------------------------------------------------------------
# Lists (XLA, outside the kernels)
# ------------------------------------------------------------------------------------------------


def _exclusive_cumsum(counts):
    """``[..., n]`` -> ``[..., n + 1]`` int32 offsets, starting at 0."""
    total = jnp.cumsum(counts, axis=-1, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros_like(total[..., :1]), total], axis=-1)


def token_lists(block_idx, *, block_size: int):
    """``[B, T, K, 1 + S]`` int32: per token and KV head the count of its visible listed blocks,
    then those blocks in slot order (duplicates kept; padding -1). Visible: ``0 <= c <= t //
    block_size``; every visible block holds at least key ``c * block_size <= t``."""
    T = block_idx.shape[1]
    idx = block_idx.astype(jnp.int32)
    own = (jnp.arange(T, dtype=jnp.int32) // block_size)[None, :, None, None]
    visible = (idx >= 0) & (idx <= own)
    order = jnp.argsort(~visible, axis=-1, stable=True)
    blocks = jnp.take_along_axis(jnp.where(visible, idx, -1), order, axis=-1)
    count = visible.sum(-1, dtype=jnp.int32)
    return jnp.concatenate([count[..., None], blocks], axis=-1)


def inverse_lists(lists, n_blocks: int):
    """The tokens that listed each key block, from ``token_lists`` output ``[B, T, K, 1 + S]``.

    Returns ``(tokens [B, K, T * S], offsets [B, K, n_blocks + 1])``: block ``c`` of KV head ``h``
    was listed by ``tokens[b, h, offsets[b, h, c]:offsets[b, h, c + 1]]``, ascending (a token twice
    if it listed the block twice). One sort of the (block, token) pairs (packed in one int32 key
    when they fit); offsets are the cumsum of the per-block counts."""
    B, T, K, L = lists.shape
    S = L - 1
    slot = jnp.arange(S, dtype=jnp.int32)
    block = jnp.where(slot < lists[..., :1], lists[..., 1:], n_blocks)  # empty slots sort last
    block = block.transpose(0, 2, 1, 3).reshape(B, K, T * S)
    token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, S)).reshape(T * S)
    if (n_blocks + 1) * T < 2**31:
        packed = jnp.sort(block * T + token, axis=-1)
        block, token = packed // T, packed % T
    else:
        block, token = lax.sort((block, jnp.broadcast_to(token, block.shape)), num_keys=1,
                                is_stable=True)
    counts = jnp.zeros((B, K, n_blocks + 1), jnp.int32).at[
        jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], block].add(1)
    return token, _exclusive_cumsum(counts[..., :n_blocks])


def chunk_ranges(offsets, chunk: int, n_chunks: int):
    """Cuts every key block's range of the inverse lists into chunks of at most ``chunk`` tokens.

    ``offsets [B, K, nb + 1]`` from :func:`inverse_lists`; ``n_chunks`` a static bound on the total
    (``nb + ceil(pairs / chunk)``). Returns ``(ranges [B, K, n_chunks, 4], chunk_offsets [B, K, nb +
    1])``: chunk p covers ``tokens[start:end]`` of key block ``block`` (``ranges[..., p, :3]``; the
    unused chunks are empty ranges of block 0), and block c's chunks are ``chunk_offsets[c] ...
    chunk_offsets[c + 1] - 1``."""
    counts = offsets[..., 1:] - offsets[..., :-1]
    per_block = (counts + chunk - 1) // chunk
    chunk_offsets = _exclusive_cumsum(per_block)
    p = jnp.arange(n_chunks, dtype=jnp.int32)
    block = jax.vmap(jax.vmap(lambda co: jnp.searchsorted(co, p, side="right") - 1))(chunk_offsets)
    used = block < counts.shape[-1]
    block = jnp.where(used, block, 0).astype(jnp.int32)
    first = jnp.take_along_axis(chunk_offsets, block, axis=-1)
    start = jnp.take_along_axis(offsets, block, axis=-1) + (p - first) * chunk
    end = jnp.minimum(start + chunk, jnp.take_along_axis(offsets, block + 1, axis=-1))
    start, end = jnp.where(used, start, 0), jnp.where(used, end, 0)
    return jnp.stack([block, start, end, jnp.zeros_like(block)], axis=-1), chunk_offsets


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _visible(k0, t, block_size):
    """``[1, block_size]``: keys ``k0 ...`` of one block at or before token ``t``."""
    return (k0 + jnp.arange(block_size, dtype=jnp.int32) <= t)[None, :]


def _over_listed_blocks(lst_ref, j, body, carry, block_size):
    """``body(k0, carry)`` over the key blocks listed by the program's token ``j``."""
    return lax.fori_loop(0, lst_ref[j, 0],
                         lambda n, c: body(lst_ref[j, 1 + n] * block_size, c), carry)


def _fwd_kernel(lst_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, tokens, block_size, qk_scale,
                precision):
    """One program: ``tokens`` consecutive tokens, one KV head; ``q_ref [tokens, Gp, Dp]``."""
    for j in range(tokens):
        t = pl.program_id(0) * tokens + j
        q = q_ref[j]

        def body(k0, carry, q=q, t=t):
            s = tiles.scores(q, k_ref[pl.ds(k0, block_size), :], qk_scale, precision,
                             _visible(k0, t, block_size))
            return tiles.softmax_update(carry, s, v_ref[pl.ds(k0, block_size), :], precision)

        acc, m, l = _over_listed_blocks(lst_ref, j, body, tiles.softmax_init(*q.shape), block_size)
        # a token with no visible key: o = 0 (acc = 0), finite lse
        o_ref[j], lse_ref[j] = tiles.softmax_finish((acc, m, jnp.where(l > 0, l, 1.0)), o_ref.dtype)


def _dq_kernel(lst_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, delta_ref, *, tokens,
               block_size, scale, qk_scale, precision):
    """The forward's programs: dq of their tokens, and ``delta = rowsum(o * do)`` for dK/dV."""
    for j in range(tokens):
        t = pl.program_id(0) * tokens + j
        q, do, lse = q_ref[j], do_ref[j], lse_ref[j]
        delta = tiles.row_delta(o_ref[j], do)
        delta_ref[j] = delta

        def body(k0, dq, q=q, do=do, lse=lse, delta=delta, t=t):
            k = k_ref[pl.ds(k0, block_size), :]
            s = tiles.scores(q, k, qk_scale, precision, _visible(k0, t, block_size))
            _, ds = tiles.softmax_backward(s, lse, do, v_ref[pl.ds(k0, block_size), :], delta,
                                           precision)
            return dq + pltriton.dot(ds.astype(k.dtype), k, precision=precision)

        dq = _over_listed_blocks(lst_ref, j, body, jnp.zeros(q.shape, jnp.float32), block_size)
        dq_ref[j] = (dq * scale).astype(dq_ref.dtype)


def _dkv_chunk_kernel(rng_ref, tok_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                      dv_ref, *, block_size, qk_scale, precision):
    """One program: one chunk of the tokens that listed key block ``c``, one KV head; writes the
    chunk's fp32 dk (without the scale) and dv."""
    k0 = rng_ref[0] * block_size
    k, v = k_ref[pl.ds(k0, block_size), :], v_ref[pl.ds(k0, block_size), :]

    def body(r, carry):
        dk, dv = carry
        t = tok_ref[r]
        q, do = q_ref[t], do_ref[t]
        s = tiles.scores(q, k, qk_scale, precision, _visible(k0, t, block_size))
        p, ds = tiles.softmax_backward(s, lse_ref[t], do, v, delta_ref[t], precision)
        dv = dv + pltriton.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        dk = dk + pltriton.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk_ref[...], dv_ref[...] = lax.fori_loop(rng_ref[1], rng_ref[2], body, (zeros, zeros))


def _dkv_sum_kernel(coff_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref, *, scale):
    """One program: key block ``c``, one KV head; adds up the block's chunks in order."""
    c = pl.program_id(0)

    def body(p, carry):
        return carry[0] + dk_part_ref[p], carry[1] + dv_part_ref[p]

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(coff_ref[c], coff_ref[c + 1], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------------
# pallas_call wrappers. Layouts: q, o, do, dq [B, Tp, K, Gp, Dp]; k, v [B, Tp, K, Dp];
# lse, delta [B, Tp, K, Gp]; lists [B, Tp, K, 1 + S]. Grids (token tile | chunk | key block,
# K, B).
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static arguments of the kernels (hashable: a custom_vjp non-differentiable argument)."""

    block_size: int
    scale: float
    tokens_per_program: int
    dkv_chunk: int
    interpret: bool
    launch: tuple  # num_warps, num_stages, num_warps_bwd, num_stages_bwd

    def params(self, backward: bool):
        warps, stages = self.launch[2:] if backward else self.launch[:2]
        return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _token_specs(tokens, q, lists):
    """BlockSpecs of a token-tile program: its tokens' rows (``[tokens, Gp, Dp]``), the whole
    sequence of its KV head (``[Tp, Dp]``), its row statistics (``[tokens, Gp]``) and lists."""
    _, Tp, _, Gp, Dp = q.shape
    rows = pl.BlockSpec((None, tokens, None, Gp, Dp), lambda i, h, b: (b, i, h, 0, 0))
    seq = pl.BlockSpec((None, Tp, None, Dp), lambda i, h, b: (b, 0, h, 0))
    stats = pl.BlockSpec((None, tokens, None, Gp), lambda i, h, b: (b, i, h, 0))
    lst = pl.BlockSpec((None, tokens, None, lists.shape[-1]), lambda i, h, b: (b, i, h, 0))
    return rows, seq, stats, lst


def _token_call(kernel, args, in_specs, out_specs, out_shape, *, q, cfg, backward, name):
    B, Tp, K = q.shape[:3]
    return pl.pallas_call(
        kernel, grid=(Tp // cfg.tokens_per_program, K, B), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=cfg.params(backward), interpret=cfg.interpret,
        name=name)(*args)


def _fwd_call(q, k, v, lists, cfg):
    B, Tp, K, Gp, Dp = q.shape
    rows, seq, stats, lst = _token_specs(cfg.tokens_per_program, q, lists)
    return _token_call(
        functools.partial(_fwd_kernel, tokens=cfg.tokens_per_program, block_size=cfg.block_size,
                          qk_scale=cfg.scale * LOG2E, precision=precision_for(q.dtype)),
        [lists, q, k, v], [lst, rows, seq, seq], [rows, stats],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, Tp, K, Gp), jnp.float32)],
        q=q, cfg=cfg, backward=False, name="gather_sparse_attention_fwd")


def _bwd_call(q, k, v, lists, o, lse, do, cfg):
    B, Tp, K, Gp, Dp = q.shape
    block_size, scale = cfg.block_size, cfg.scale
    precision = precision_for(q.dtype)
    rows, seq, stats, lst = _token_specs(cfg.tokens_per_program, q, lists)
    dq, delta = _token_call(
        functools.partial(_dq_kernel, tokens=cfg.tokens_per_program, block_size=block_size,
                          scale=scale, qk_scale=scale * LOG2E, precision=precision),
        [lists, q, k, v, o, do, lse], [lst, rows, seq, seq, rows, rows, stats], [rows, stats],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32)],
        q=q, cfg=cfg, backward=True, name="gather_sparse_attention_dq")

    # dK/dV: chunk partials over (chunk, K, B), then their sums over (key block, K, B)
    nb = Tp // block_size
    inv_tokens, offsets = inverse_lists(lists, nb)
    n_chunks = nb + -(-inv_tokens.shape[-1] // cfg.dkv_chunk)
    ranges, chunk_offsets = chunk_ranges(offsets, cfg.dkv_chunk, n_chunks)
    whole = pl.BlockSpec((None, Tp, None, Gp, Dp), lambda p, h, b: (b, 0, h, 0, 0))
    whole_stats = pl.BlockSpec((None, Tp, None, Gp), lambda p, h, b: (b, 0, h, 0))
    part = pl.BlockSpec((None, None, None, block_size, Dp), lambda p, h, b: (b, h, p, 0, 0))
    part_shape = jax.ShapeDtypeStruct((B, K, n_chunks, block_size, Dp), jnp.float32)
    params = cfg.params(backward=True)
    dk_part, dv_part = pl.pallas_call(
        functools.partial(_dkv_chunk_kernel, block_size=block_size, qk_scale=scale * LOG2E,
                          precision=precision),
        grid=(n_chunks, K, B),
        in_specs=[pl.BlockSpec((None, None, None, 4), lambda p, h, b: (b, h, p, 0)),
                  pl.BlockSpec((None, None, inv_tokens.shape[-1]), lambda p, h, b: (b, h, 0)),
                  whole, seq, seq, whole, whole_stats, whole_stats],
        out_specs=[part, part], out_shape=[part_shape, part_shape], compiler_params=params,
        interpret=cfg.interpret, name="gather_sparse_attention_dkv",
    )(ranges, inv_tokens, q, k, v, do, lse, delta)

    parts = pl.BlockSpec((None, None, n_chunks, block_size, Dp), lambda c, h, b: (b, h, 0, 0, 0))
    key_block = pl.BlockSpec((None, block_size, None, Dp), lambda c, h, b: (b, c, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_sum_kernel, scale=scale),
        grid=(nb, K, B),
        in_specs=[pl.BlockSpec((None, None, nb + 1), lambda c, h, b: (b, h, 0)), parts, parts],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=cfg.interpret, name="gather_sparse_attention_dkv_sum",
    )(chunk_offsets, dk_part, dv_part)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(q, k, v, lists, cfg):
    return _fwd_call(q, k, v, lists, cfg)[0]


def _core_fwd(q, k, v, lists, cfg):
    o, lse = _fwd_call(q, k, v, lists, cfg)
    return o, (q, k, v, lists, o, lse)


def _core_bwd(cfg, res, do):
    return (*_bwd_call(*res, do, cfg), None)


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------


# jitted: identical calls (one per layer) lower, and compile their Triton kernels, once per program
@functools.partial(jax.jit, static_argnames=("block_size", "scale", "interpret", "tokens_per_program", "dkv_chunk",
                                             "num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"))
def gather_sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None,
                            interpret: bool | None = None, tokens_per_program: int = 1,
                            dkv_chunk: int = 128, num_warps: int = 1, num_stages: int = 3,
                            num_warps_bwd: int = 1, num_stages_bwd: int = 3):
    """Causal attention of every token over its own selected key blocks (Pallas, Triton lowering).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, K, D]`` with ``H % K == 0``.
      block_idx: int ``[B, T, K, S]``: per token and KV head the selected key blocks, -1 = empty.
        A token attends to the keys at or before it of the blocks it lists (list its own block).
      block_size: tokens per key block, a power of two >= 16 (static).
      scale: logit scale, default ``1/sqrt(D)``.
      interpret: run the kernels in interpret mode (default: when JAX's default backend is the CPU).
      tokens_per_program: consecutive tokens one program serves in turn (a power of two).
      dkv_chunk: most tokens one dK/dV program visits (a key block listed by more is split).
      num_warps, num_stages: Triton launch parameters of the forward; ``*_bwd``: of the backward.
        Defaults: one warp, three stages, dK/dV chunks of 128 (H200, T = 16K, B = 2, block 16,
        top-16, G = 10: fwd+bwd 2.507 ms against 2.850 with two stages and chunks of 256; one warp
        took 0.62x the four-warp time).
    Returns:
      ``[B, T, H, D]`` in q's dtype; no gradient flows to ``block_idx``.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or block_idx.ndim != 4:
        raise ValueError(f"expected q [B,T,H,D], k/v [B,T,K,D], block_idx [B,T,K,S]: "
                         f"q{q.shape} k{k.shape} v{v.shape} block_idx{block_idx.shape}")
    B, T, H, D = q.shape
    K = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D or H % K:
        raise ValueError(f"k/v must be [B, T, K, D] matching q with H % K == 0: q{q.shape} "
                         f"k{k.shape} v{v.shape}")
    if block_idx.shape[:3] != (B, T, K):
        raise ValueError(f"block_idx must be [B, T, K, S] = [{B}, {T}, {K}, S] (one selection per "
                         f"KV head), got {block_idx.shape}")
    if not jnp.issubdtype(block_idx.dtype, jnp.integer):
        raise ValueError(f"block_idx must be integer, got {block_idx.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    block_size, tokens = int(block_size), int(tokens_per_program)
    for name, x in (("block_size", block_size), ("tokens_per_program", tokens)):
        if x < (16 if name == "block_size" else 1) or x & (x - 1):
            raise ValueError(f"{name} must be a power of two{' >= 16' * (name == 'block_size')}, "
                             f"got {x}")
    if int(dkv_chunk) < 1:
        raise ValueError(f"dkv_chunk must be >= 1, got {dkv_chunk}")
    cfg = _Config(
        block_size=block_size, scale=1.0 / math.sqrt(D) if scale is None else float(scale),
        tokens_per_program=tokens, dkv_chunk=int(dkv_chunk),
        interpret=jax.default_backend() == "cpu" if interpret is None else bool(interpret),
        launch=(int(num_warps), int(num_stages), int(num_warps_bwd), int(num_stages_bwd)))
    G = H // K
    Gp, Dp = max(16, next_pow2(G)), max(16, next_pow2(D))
    Tp = -(-T // max(block_size, tokens)) * max(block_size, tokens)
    # Padding: extra tokens list nothing (sliced off), extra keys lie after every real token,
    # extra query-head rows and head-dim columns are zeros.
    q = jnp.pad(q.reshape(B, T, K, G, D), ((0, 0), (0, Tp - T), (0, 0), (0, Gp - G), (0, Dp - D)))
    k, v = (jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))) for x in (k, v))
    idx = jnp.pad(lax.stop_gradient(block_idx), ((0, 0), (0, Tp - T), (0, 0), (0, 0)),
                  constant_values=-1)
    lists = token_lists(idx, block_size=block_size)
    o = _core(q, k, v, lists, cfg)
    return o[:, :T, :, :G, :D].reshape(B, T, H, D)
