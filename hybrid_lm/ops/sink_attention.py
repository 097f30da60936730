"""Causal attention limited to a horizon of H tokens plus S sink tokens: pure jnp, O(T * (H + S)).

The receptive-field constraint of Qiao et al. (arXiv 2606.15378; docs/SOURCES.md section 5; their HF
``modeling.py`` knobs ``eval_sliding_window`` / ``eval_attention_sink_size``): a full-attention layer
may only look at the last H tokens, plus the first S positions of the sequence (the "attention
sinks"), which stay visible to every later query. Query i sees key j iff

    j <= i   and   ( i - horizon < j      or      j < sinks )

``horizon`` counts the query itself, like every window in this project (``horizon=1``: the query
only, plus the sinks). ``horizon >= T`` is plain causal attention; ``sinks=0`` is sliding-window
attention of window ``horizon``. Layouts as ``hybrid_lm/ops/attention.py``: q ``[B, T, H, D]``,
k/v ``[B, T, K, D]`` (GQA), identity order (positions only enter upstream, through RoPE).

Cost: queries are cut into blocks of ``block_size``. Block b scores its own key span
``[b*block - horizon + 1, (b+1)*block)`` (as the windowed reference) *and* the S sink keys, and
takes one softmax over both sets (the same result as merging a windowed pass and a sink pass by
log-sum-exp): O(T * (block + horizon + S)) time and memory, never T x T. A sink key that also lies
inside the query's window is masked in the sink part, so no key is counted twice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.ops.attention import _check_shapes, _default_block

_NEG = -1e30  # finite "minus infinity", as ops/attention.py


def _check_args(horizon: int, sinks: int) -> None:
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise ValueError(f"horizon must be an int >= 1 (it counts the query itself), got {horizon!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, (int, np.integer)) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")


def sink_mask(length: int, horizon: int, sinks: int) -> np.ndarray:
    """The dense ``[Tq, Tk]`` boolean mask (test oracle, and the rule written out)."""
    _check_args(horizon, sinks)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return (j <= i) & ((j > i - horizon) | (j < sinks))


def mean_keys_per_query(length: int, horizon: int, sinks: int) -> float:
    """Exact mean number of visible keys per query: ``min(i+1, H) + min(S, max(0, i+1-H))``."""
    _check_args(horizon, sinks)
    i = np.arange(length, dtype=np.int64)
    n = np.minimum(i + 1, horizon) + np.minimum(sinks, np.maximum(0, i + 1 - horizon))
    return float(n.mean())


def dense_sink_attention(q, k, v, horizon: int, sinks: int, *, scale: float | None = None):
    """O(T^2) masked attention with :func:`sink_mask`. Test oracle only."""
    _check_shapes(q, k, v)
    B, T, H, D = q.shape
    KV = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.reshape(B, T, KV, H // KV, D)
    s = jnp.einsum("bqkgd,blkd->bkgql", qg.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(jnp.asarray(sink_mask(T, horizon, sinks)), s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgql,blkd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[3]).astype(q.dtype)


def sink_attention(q, k, v, horizon: int, sinks: int = 0, *, scale: float | None = None,
                   block_size: int | None = None):
    """Causal attention to the last ``horizon`` tokens and the first ``sinks`` positions, O(T(H+S)).

    Blocked as ``ops.attention.windowed_attention``; the S sink keys are shared by every query block
    and joined to each block's window span before a single softmax.
    """
    _check_shapes(q, k, v)
    _check_args(horizon, sinks)
    B, T, H, D = q.shape
    KV, Dv = k.shape[2], v.shape[3]
    G = H // KV
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    bq = block_size or _default_block(horizon, T)
    nb = -(-T // bq)
    Tp = nb * bq
    w = min(horizon, Tp)  # every causal key is inside the band once the horizon covers the sequence
    S = min(sinks, T)
    P = w - 1  # left padding: block b's key span starts at padded index b*bq
    L = bq + P

    def pad_t(x, left, right):
        widths = [(0, 0)] * x.ndim
        widths[1] = (left, right)
        return jnp.pad(x, widths)

    qb = pad_t(q, 0, Tp - T).reshape(B, nb, bq, KV, G, D).astype(jnp.float32)
    kp, vp = pad_t(k, P, Tp - T), pad_t(v, P, Tp - T)
    key_idx = jnp.arange(nb)[:, None] * bq + jnp.arange(L)[None, :]  # padded coordinates [nb, L]
    kb = jnp.take(kp, key_idx, axis=1).astype(jnp.float32)  # [B, nb, L, KV, D]
    vb = jnp.take(vp, key_idx, axis=1).astype(jnp.float32)

    qi = jnp.arange(nb)[:, None] * bq + jnp.arange(bq)[None, :]  # query index [nb, bq]
    kj = key_idx - P  # key index [nb, L]
    band = (kj[:, None, :] <= qi[:, :, None]) & (kj[:, None, :] > qi[:, :, None] - w)
    band &= (kj[:, None, :] >= 0) & (kj[:, None, :] < T)  # [nb, bq, L]
    s = jnp.einsum("bnqkgd,bnlkd->bnkgql", qb, kb) * scale
    s = jnp.where(band[None, :, None, None], s, _NEG)

    if S == 0:
        o = jnp.einsum("bnkgql,bnlkd->bnqkgd", jax.nn.softmax(s, axis=-1), vb)
    else:
        ks, vs = k[:, :S].astype(jnp.float32), v[:, :S].astype(jnp.float32)  # [B, S, KV, D]
        # sink j: causal and outside the query's window (inside it, the band already holds it)
        smask = jnp.arange(S)[None, None, :] <= qi[:, :, None] - w  # [nb, bq, S]
        ss = jnp.einsum("bnqkgd,bskd->bnkgqs", qb, ks) * scale
        ss = jnp.where(smask[None, :, None, None], ss, _NEG)
        p = jax.nn.softmax(jnp.concatenate([ss, s], axis=-1), axis=-1)  # [B, nb, KV, G, bq, S + L]
        o = (jnp.einsum("bnkgqs,bskd->bnqkgd", p[..., :S], vs)
             + jnp.einsum("bnkgql,bnlkd->bnqkgd", p[..., S:], vb))
    return o.reshape(B, Tp, H, Dv)[:, :T].astype(q.dtype)
