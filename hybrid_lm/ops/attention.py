"""Reference softmax attention ops in plain jnp (no parameters).

Layout follows flash-linear-attention: q ``[B, T, H, D]``, k/v ``[B, T, K, D]`` with ``H % K == 0``
(GQA). ``positions`` are ``[B, T]`` original token positions *in the order the tokens are given*.

The windowed mask used everywhere in this project (SWA, stochastic attention, kernels): with i, j the
indices of query and key in the given order, key j is visible iff

    i - window < j <= i + window_right   and   positions[j] <= positions[i].

With the identity order this is causal sliding-window attention (``local_window_size=(w-1, 0)``)
whatever ``window_right`` is (every key right of the query is in the future); with a permuted order
it is stochastic attention (causal by *original* position). ``window`` counts the query itself.
``window_right = 0`` (default) is SA's one-sided band: with ``window >= T`` a query sees the keys
before it in both orders. ``window_right = window - 1`` is the symmetric band ``|i - j| < window``
(SA ``window_mode='symmetric'``): with ``window >= T`` it is exactly causal attention by position.

Document masking (``DataConfig.document_mask``): with ``segment_ids [B, T]`` (the document index of
each token in the given order) the mask also needs ``segment_ids[j] == segment_ids[i]``: a query
never sees another document of its packed window. ``segment_ids=None`` leaves every op exactly as
without it. :func:`segment_positions` gives the per-document positions (RoPE restarts at 0 at each
document start).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": keeps fully-masked padding rows NaN-free


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape[:3] + (k.shape[3],) or k.shape[:2] != q.shape[:2]:
        raise ValueError(f"k/v must be [B, T, K, D] matching q in B, T: q{q.shape} k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")


def default_positions(batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def segment_positions(segment_ids) -> jax.Array:
    """Positions ``[B, T]`` int32 that restart at 0 at each document start: ``i - start(i)``, with
    ``start(i)`` the first index of i's segment (``segment_ids [B, T]`` non-decreasing along a row).
    One segment per row gives :func:`default_positions`."""
    B, T = segment_ids.shape
    idx = default_positions(B, T)
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def same_segment(segment_ids_q, segment_ids_k) -> jax.Array:
    """``[B, Tq, Tk]`` bool: query i and key j lie in the same document."""
    return segment_ids_q[:, :, None] == segment_ids_k[:, None, :]


def dense_attention(q, k, v, *, window: int | None = None, positions=None, scale: float | None = None,
                    window_right: int = 0, segment_ids=None):
    """O(T^2) masked attention. Test oracle only: it materialises the full score matrix.

    ``window=None``: no left limit; ``window_right``: keys up to ``i + window_right`` in the given
    order (still causal by ``positions``); ``segment_ids [B, T]``: only keys of the query's document."""
    if window_right < 0:
        raise ValueError(f"window_right must be >= 0, got {window_right}")
    _check_shapes(q, k, v)
    B, T, H, D = q.shape
    KV = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = default_positions(B, T) if positions is None else positions
    qg = q.reshape(B, T, KV, H // KV, D)
    s = jnp.einsum("bqkgd,blkd->bkgql", qg.astype(jnp.float32), k.astype(jnp.float32)) * scale
    idx = jnp.arange(T)
    band = idx[None, :] <= idx[:, None] + window_right
    if window is not None:
        band &= idx[None, :] > idx[:, None] - window
    mask = band[None] & (pos[:, None, :] <= pos[:, :, None])  # [B, Tq, Tk]
    if segment_ids is not None:
        mask &= same_segment(segment_ids, segment_ids)
    s = jnp.where(mask[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgql,blkd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[3]).astype(q.dtype)


def _default_block(window: int, length: int) -> int:
    b = 16
    while b < min(window, 512):
        b *= 2
    return min(b, max(16, length))


def windowed_attention(q, k, v, window: int, *, positions=None, scale: float | None = None,
                       block_size: int | None = None, window_right: int = 0, segment_ids=None):
    """Blocked windowed attention in O(T * (block + window + window_right)) time and memory.

    Queries are cut into blocks of ``block_size``; block b attends to the key span
    ``[b*block - window + 1, (b+1)*block - 1 + window_right]`` only, with the mask in the module
    docstring (``segment_ids [B, T]`` in the given order: only keys of the query's document).
    ``window_right > 0`` only matters with non-identity ``positions``.
    """
    _check_shapes(q, k, v)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if window_right < 0:
        raise ValueError(f"window_right must be >= 0, got {window_right}")
    B, T, H, D = q.shape
    KV, Dv = k.shape[2], v.shape[3]
    G = H // KV
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = default_positions(B, T) if positions is None else positions.astype(jnp.int32)

    bq = block_size or _default_block(window, T)
    nb = -(-T // bq)
    Tp = nb * bq
    w = min(window, Tp)  # every valid key is inside the band once w >= T
    R = min(window_right, Tp)  # likewise on the right
    P = w - 1  # left padding so block b's key span starts at padded index b*bq
    L = bq + P + R

    def pad_t(x, left, right, value=0):
        widths = [(0, 0)] * x.ndim
        widths[1] = (left, right)
        return jnp.pad(x, widths, constant_values=value)

    qb = pad_t(q, 0, Tp - T).reshape(B, nb, bq, KV, G, D)
    kp, vp = pad_t(k, P, Tp - T + R), pad_t(v, P, Tp - T + R)
    posq = pad_t(pos, 0, Tp - T).reshape(B, nb, bq)
    posk = pad_t(pos, P, Tp - T + R)

    key_idx = jnp.arange(nb)[:, None] * bq + jnp.arange(L)[None, :]  # padded coordinates [nb, L]
    kb = jnp.take(kp, key_idx, axis=1)  # [B, nb, L, KV, D]
    vb = jnp.take(vp, key_idx, axis=1)
    pkb = jnp.take(posk, key_idx, axis=1)  # [B, nb, L]

    qi = jnp.arange(nb)[:, None] * bq + jnp.arange(bq)[None, :]  # original index [nb, bq]
    kj = key_idx - P  # original index [nb, L]
    band = (kj[:, None, :] <= qi[:, :, None] + R) & (kj[:, None, :] > qi[:, :, None] - w)
    band &= (kj[:, None, :] >= 0) & (kj[:, None, :] < T)  # padded keys: never visible
    mask = band[None] & (pkb[:, :, None, :] <= posq[:, :, :, None])  # [B, nb, bq, L]
    if segment_ids is not None:  # padded slots: masked by the band (keys) or sliced off (queries)
        segq = pad_t(segment_ids, 0, Tp - T).reshape(B, nb, bq)
        segk = jnp.take(pad_t(segment_ids, P, Tp - T + R), key_idx, axis=1)  # [B, nb, L]
        mask &= segk[:, :, None, :] == segq[:, :, :, None]

    s = jnp.einsum("bnqkgd,bnlkd->bnkgql", qb.astype(jnp.float32), kb.astype(jnp.float32)) * scale
    s = jnp.where(mask[:, :, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnkgql,bnlkd->bnqkgd", p, vb.astype(jnp.float32))
    return o.reshape(B, Tp, H, Dv)[:, :T].astype(q.dtype)


def causal_attention(q, k, v, *, scale: float | None = None, implementation: str | None = None,
                     segment_ids=None):
    """Full causal attention through ``jax.nn.dot_product_attention`` (XLA or cuDNN).

    ``segment_ids [B, T]``: XLA only, as a dense ``[B, 1, T, T]`` mask (the public API takes no
    segment ids; cuDNN would get the mask as an O(T^2) bias, so ``hybrid_lm.backends`` never sends
    it there)."""
    _check_shapes(q, k, v)
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    if implementation not in (None, "xla"):
        raise ValueError(f"causal_attention with segment_ids runs on xla only, got implementation={implementation!r}")
    mask = same_segment(segment_ids, segment_ids)[:, None]  # [B, 1, Tq, Tk]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True, implementation="xla")
