"""Scalar-decay (gated) linear attention in plain JAX: fla's ``simple_gla``.

One recurrence covers Lightning attention and the Mamba-2 SSD core. Per batch b and head h, with a
matrix state ``S`` of shape ``[Dk, Dv]``:

    S_t = exp(g_t) * S_{t-1} + k_t v_t^T          o_t = scale * q_t^T S_t

Conventions (as flash-linear-attention, ``fla/ops/simple_gla``, so outputs compare directly):

- layout ``[B, T, H, D]``: q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``; Dk and Dv may differ. q, k
  and v have the same number of heads (broadcast grouped heads, e.g. Mamba-2's B/C groups, first).
- gates in log space: ``g`` ``[B, T, H]`` is a log decay per token and head, ``g_gamma`` ``[H]`` a
  constant log decay per head. Both are optional and add up when both are given; neither means no
  decay. Decays must be ``<= 0`` (log of a factor in (0, 1]); this is not checked.
- ``scale`` defaults to ``1/sqrt(Dk)`` and multiplies q. Mamba-2 passes ``scale=1``.
- states are ``[B, H, Dk, Dv]`` in float32 (``initial_state`` in, final state out when
  ``output_final_state``); outputs come back in q's dtype.
- compute is float32 (float64 when given float64 inputs, for high-precision references).

Uses:
- Lightning (fla ``chunk_lightning_attn``): ``g_gamma[h]`` = the layer's per-head log decay.
- Mamba-2 SSD: ``q=C, k=B, v=x*dt, g=A*dt, scale=1``; the ``D*x`` skip is the layer's job.

Forms:
- ``chunk_simple_gla``: training form. Inside a chunk of C tokens everything is matmuls over all
  chunks at once; a ``lax.scan`` across chunks carries only the state. Decays are cumulated *within*
  a chunk and only differences ``b_i - b_j`` (j <= i), ``b_i`` and ``b_last - b_j`` are ever
  exponentiated: all are ``<= 0``, so nothing overflows however strong the decay. T need not be a
  multiple of C: the tail is zero-padded with ``g = 0``, which leaves the final state exact.
- ``naive_recurrent_simple_gla``: the token-by-token reference (``lax.scan`` over time), fla's
  ``naive_recurrent_simple_gla``.
- ``simple_gla_step``: one decode step on a carried state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def compute_dtype(*xs):
    """float32, or float64 if any input is float64 (high-precision references under x64)."""
    return jnp.result_type(jnp.float32, *[x for x in xs if x is not None])


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, Dk] and v [B, T, H, Dv]: "
                         f"q{q.shape} k{k.shape} v{v.shape}")


def _check_state(initial_state, B, H, Dk, Dv):
    if initial_state is not None and initial_state.shape != (B, H, Dk, Dv):
        raise ValueError(f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, "
                         f"got {initial_state.shape}")


def _log_decay(g, g_gamma, B, T, H, dtype):
    """Total log decay ``[B, T, H]`` from the optional per-token ``g`` and per-head ``g_gamma``."""
    out = jnp.zeros((B, T, H), dtype)
    if g is not None:
        if g.shape != (B, T, H):
            raise ValueError(f"g must be [B, T, H] = {(B, T, H)}, got {g.shape}")
        out = out + g.astype(dtype)
    if g_gamma is not None:
        if g_gamma.shape != (H,):
            raise ValueError(f"g_gamma must be [H] = {(H,)}, got {g_gamma.shape}")
        out = out + g_gamma.astype(dtype)
    return out


def _chunk_setup(q, k, v, initial_state, scale, chunk_size, gates=()):
    """Checks and constants shared by the chunked forms: ``(B, T, H, Dk, Dv, dtype, scale, C, N)``
    with C tokens per chunk (clamped to T) and N chunks."""
    _check_qkv(q, k, v)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    _check_state(initial_state, B, H, Dk, Dv)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dt = compute_dtype(q, k, v, *gates, initial_state)
    scale = Dk ** -0.5 if scale is None else scale
    C = min(chunk_size, T)
    return B, T, H, Dk, Dv, dt, scale, C, -(-T // C)


def _pad_time(x, Tp):
    """Zero-pad axis 1 (time) to length Tp."""
    if x.shape[1] == Tp:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, Tp - x.shape[1])
    return jnp.pad(x, widths)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, *, scale: float | None = None, initial_state=None,
                     output_final_state: bool = False, chunk_size: int = 64, precision=None):
    """Chunked scalar-decay linear attention (fla ``chunk_simple_gla``).

    Args:
      q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``.
      g: optional log decay per token and head ``[B, T, H]``.
      g_gamma: optional constant log decay per head ``[H]``.
      scale: query scale, default ``1/sqrt(Dk)``.
      initial_state: optional ``[B, H, Dk, Dv]``.
      output_final_state: return the final state (else ``None``).
      chunk_size: tokens per chunk (clamped to T).
      precision: ``lax.Precision`` of the matmuls (None: backend default; HIGHEST for an oracle).
    Returns:
      ``(o [B, T, H, Dv] in q.dtype, final_state [B, H, Dk, Dv] float32 or None)``.
    """
    B, T, H, Dk, Dv, dt, scale, C, N = _chunk_setup(q, k, v, initial_state, scale, chunk_size, (g, g_gamma))
    out_dtype = q.dtype
    Tp = N * C

    # Pad the tail with zeros: k = 0 adds nothing to the state and g = 0 does not decay it.
    gt = _log_decay(g, g_gamma, B, T, H, dt)
    q, k, v, gt = (_pad_time(x.astype(dt), Tp) for x in (q, k, v, gt))
    q = q * scale
    # [B, T, H, D] -> [B, H, N, C, D]
    qc, kc, vc = (x.reshape(B, N, C, H, -1).transpose(0, 3, 1, 2, 4) for x in (q, k, v))
    b = jnp.cumsum(gt.reshape(B, N, C, H).transpose(0, 3, 1, 2), axis=-1)  # [B, H, N, C], in-chunk
    b_last = b[..., -1]  # [B, H, N]

    # Intra-chunk: (q_i . k_j) exp(b_i - b_j) for j <= i. Mask *before* exp: above the diagonal the
    # difference is >= 0 and could overflow (and poison gradients through the where).
    causal = jnp.tril(jnp.ones((C, C), bool))
    diff = b[..., :, None] - b[..., None, :]
    decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # [B, H, N, C, C]
    scores = jnp.einsum("bhnid,bhnjd->bhnij", qc, kc, precision=precision) * decay
    o = jnp.einsum("bhnij,bhnjv->bhniv", scores, vc, precision=precision)

    # Each chunk's own contribution to the state at its end: sum_j exp(b_last - b_j) k_j v_j^T.
    k_to_end = kc * jnp.exp(b_last[..., None] - b)[..., None]
    chunk_kv = jnp.einsum("bhnjk,bhnjv->bhnkv", k_to_end, vc, precision=precision)  # [B, H, N, Dk, Dv]

    # Across chunks: S_n = exp(b_last_n) S_{n-1} + chunk_kv_n; keep the state entering each chunk.
    def body(S, xs):
        a_last, kv = xs
        return jnp.exp(a_last)[..., None, None] * S + kv, S

    S0 = jnp.zeros((B, H, Dk, Dv), dt) if initial_state is None else initial_state.astype(dt)
    S_final, S_in = lax.scan(body, S0, (jnp.moveaxis(b_last, 2, 0), jnp.moveaxis(chunk_kv, 2, 0)))
    S_in = jnp.moveaxis(S_in, 0, 2)  # [B, H, N, Dk, Dv]

    # Inter-chunk: exp(b_i) q_i^T S_in (exp(b_i) <= 1).
    o = o + jnp.einsum("bhnik,bhnkv->bhniv", qc * jnp.exp(b)[..., None], S_in, precision=precision)
    o = o.transpose(0, 2, 3, 1, 4).reshape(B, Tp, H, Dv)[:, :T]
    return o.astype(out_dtype), (S_final if output_final_state else None)


def simple_gla_step(state, q_t, k_t, v_t, g_t=None, *, scale: float | None = None):
    """One recurrent step: ``S <- exp(g_t) S + k_t v_t^T``; ``o_t = scale * q_t^T S``.

    Args:
      state: ``[B, H, Dk, Dv]``.
      q_t, k_t: ``[B, H, Dk]``; v_t: ``[B, H, Dv]``.
      g_t: log decay broadcastable to ``[B, H]`` (a per-head ``[H]`` constant works), or None.
    Returns:
      ``(o_t [B, H, Dv] in q_t.dtype, new state in the compute dtype, float32 or float64)``.
    """
    dt = compute_dtype(state, q_t, k_t, v_t, g_t)
    scale = q_t.shape[-1] ** -0.5 if scale is None else scale
    S = state.astype(dt)
    if g_t is not None:
        S = S * jnp.exp(jnp.asarray(g_t, dt))[..., None, None]
    # Elementwise products and sums, no matmul: true fp32 on every backend (no TF32 passes).
    S = S + k_t.astype(dt)[..., :, None] * v_t.astype(dt)[..., None, :]
    o = jnp.sum((q_t.astype(dt) * scale)[..., :, None] * S, axis=-2)
    return o.astype(q_t.dtype), S


def naive_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, *, scale: float | None = None,
                               initial_state=None, output_final_state: bool = False):
    """Token-by-token reference (fla ``naive_recurrent_simple_gla``), a ``lax.scan`` over time.

    Same arguments and returns as :func:`chunk_simple_gla`.
    """
    _check_qkv(q, k, v)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    _check_state(initial_state, B, H, Dk, Dv)
    dt = compute_dtype(q, k, v, g, g_gamma, initial_state)
    gt = _log_decay(g, g_gamma, B, T, H, dt)
    S0 = jnp.zeros((B, H, Dk, Dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(S, xs):
        q_t, k_t, v_t, g_t = xs
        o_t, S = simple_gla_step(S, q_t, k_t, v_t, g_t, scale=scale)
        return S, o_t

    xs = tuple(jnp.moveaxis(x.astype(dt), 1, 0) for x in (q, k, v, gt))
    S, o = lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), (S if output_final_state else None)
