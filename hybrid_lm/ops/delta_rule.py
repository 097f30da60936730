"""Gated delta rule (Gated DeltaNet) in plain JAX: fla's ``gated_delta_rule``.

Per batch b and head h, with a matrix state ``S`` of shape ``[Dk, Dv]`` (fla
``naive_recurrent_gated_delta_rule``):

    S   <- exp(g_t) * S
    v'_t = beta_t * (v_t - S^T k_t)
    S   <- S + k_t v'_t^T
    o_t  = (scale * q_t)^T S

Conventions (as flash-linear-attention, ``fla/ops/gated_delta_rule``, so outputs compare directly):

- layout ``[B, T, H, D]``: q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``; Dk and Dv may differ.
- ``g`` ``[B, T, H]``: log decay (``<= 0``; not checked). ``beta`` ``[B, T, H]``: write strength,
  already through a sigmoid.
- argument order is ``(q, k, v, g, beta)`` everywhere, as fla's ``chunk_gated_delta_rule`` and
  ``fused_recurrent_gated_delta_rule``. (fla's ``naive_recurrent_gated_delta_rule`` takes
  ``(q, k, v, beta, g)``: pass by keyword when porting calls.)
- ``scale`` defaults to ``1/sqrt(Dk)`` and multiplies q.
- q and k are used as given. The delta rule is only well behaved for unit-norm keys (then
  ``I - beta k k^T`` is a contraction): L2-normalising q and k is the layer's job (fla's
  ``use_qk_l2norm_in_kernel``), not this op's.
- states are ``[B, H, Dk, Dv]`` in float32 (``initial_state`` in, final state out when
  ``output_final_state``); outputs come back in q's dtype. Compute is float32 (float64 when given
  float64 inputs, for high-precision references).

Forms:
- ``chunk_gated_delta_rule``: training form (fla ``chunk_gated_delta_rule``, WY representation / UT
  transform). With ``b`` the log decay cumulated within a chunk and ``S0`` the state entering it, the
  pseudo-values ``V'`` of the chunk solve the unit lower-triangular system

      (I + A) V' = beta V - diag(beta exp(b)) K S0,   A_ij = beta_i (k_i . k_j) exp(b_i - b_j), j < i

  so ``V' = u - w S0`` with ``w = (I + A)^{-1} diag(beta exp(b)) K`` and ``u = (I + A)^{-1} diag(beta) V``
  computed for all chunks at once (one batched triangular solve). A ``lax.scan`` across chunks then
  carries the state: ``V' = u - w S``, ``S <- exp(b_last) S + (K exp(b_last - b))^T V'``. Outputs are
  ``o = (q exp(b)) S0 + (q k^T * exp(b_i - b_j))_{j <= i} V'``. Only differences with ``j <= i``,
  ``b`` and ``b_last - b`` are exponentiated (all ``<= 0``). T need not be a multiple of the chunk: the
  tail is padded with ``k = v = beta = g = 0``, which leaves the final state exact.
- ``naive_recurrent_gated_delta_rule``: the token-by-token reference (``lax.scan`` over time).
- ``gated_delta_rule_step``: one decode step on a carried state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hybrid_lm.ops.linear_attention import _check_qkv, _check_state, _chunk_setup, _pad_time, compute_dtype


def _check_gates(g, beta, B, T, H):
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = {(B, T, H)}, got {x.shape}")


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                           output_final_state: bool = False, chunk_size: int = 64, precision=None):
    """Chunked gated delta rule (fla ``chunk_gated_delta_rule``, without the in-kernel L2 norm).

    Args:
      q, k: ``[B, T, H, Dk]`` (L2-normalised by the caller); v: ``[B, T, H, Dv]``.
      g: log decay ``[B, T, H]``; beta: write strength in (0, 1) ``[B, T, H]``.
      scale, initial_state, output_final_state, chunk_size, precision and the return value: as
      :func:`hybrid_lm.ops.linear_attention.chunk_simple_gla`.
    """
    B, T, H, Dk, Dv, dt, scale, C, N = _chunk_setup(q, k, v, initial_state, scale, chunk_size, (g, beta))
    _check_gates(g, beta, B, T, H)
    out_dtype = q.dtype
    Tp = N * C

    # Zero tail: k = beta = 0 writes nothing, g = 0 does not decay the state.
    q, k, v, g, beta = (_pad_time(x.astype(dt), Tp) for x in (q, k, v, g, beta))
    q = q * scale
    # [B, T, H, D] -> [B, H, N, C, D]; gates [B, T, H] -> [B, H, N, C]
    qc, kc, vc = (x.reshape(B, N, C, H, -1).transpose(0, 3, 1, 2, 4) for x in (q, k, v))
    bc = beta.reshape(B, N, C, H).transpose(0, 3, 1, 2)
    b = jnp.cumsum(g.reshape(B, N, C, H).transpose(0, 3, 1, 2), axis=-1)  # in-chunk cumulative
    b_last = b[..., -1]

    # Relative decays exp(b_i - b_j), masked before the exp (above the diagonal they are >= 0).
    idx = jnp.arange(C)
    diff = b[..., :, None] - b[..., None, :]
    decay_causal = jnp.exp(jnp.where(idx[:, None] >= idx[None, :], diff, -jnp.inf))
    decay_strict = jnp.exp(jnp.where(idx[:, None] > idx[None, :], diff, -jnp.inf))

    # UT transform: solve (I + A) [w | u] = [beta exp(b) k | beta v] for every chunk at once.
    A = bc[..., :, None] * jnp.einsum("bhnid,bhnjd->bhnij", kc, kc, precision=precision) * decay_strict
    rhs = jnp.concatenate([(bc * jnp.exp(b))[..., None] * kc, bc[..., None] * vc], axis=-1)
    wu = lax.linalg.triangular_solve(A, rhs, left_side=True, lower=True, unit_diagonal=True)
    w, u = wu[..., :Dk], wu[..., Dk:]

    k_to_end = kc * jnp.exp(b_last[..., None] - b)[..., None]

    # Across chunks: the pseudo-values depend on the entering state, so they are formed in the scan.
    def body(S, xs):
        w_n, u_n, k_n, a_last = xs
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, S, precision=precision)
        S_next = jnp.exp(a_last)[..., None, None] * S + jnp.einsum("bhck,bhcv->bhkv", k_n, v_new,
                                                                   precision=precision)
        return S_next, (S, v_new)

    S0 = jnp.zeros((B, H, Dk, Dv), dt) if initial_state is None else initial_state.astype(dt)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, k_to_end, b_last))
    S_final, (S_in, v_new) = lax.scan(body, S0, xs)
    S_in, v_new = jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(v_new, 0, 2)

    scores = jnp.einsum("bhnid,bhnjd->bhnij", qc, kc, precision=precision) * decay_causal
    o = jnp.einsum("bhnik,bhnkv->bhniv", qc * jnp.exp(b)[..., None], S_in, precision=precision)
    o = o + jnp.einsum("bhnij,bhnjv->bhniv", scores, v_new, precision=precision)
    o = o.transpose(0, 2, 3, 1, 4).reshape(B, Tp, H, Dv)[:, :T]
    return o.astype(out_dtype), (S_final if output_final_state else None)


def gated_delta_rule_step(state, q_t, k_t, v_t, g_t, beta_t, *, scale: float | None = None):
    """One recurrent step of the gated delta rule (see the module docstring).

    Args:
      state: ``[B, H, Dk, Dv]``.
      q_t, k_t: ``[B, H, Dk]``; v_t: ``[B, H, Dv]``; g_t, beta_t: ``[B, H]``.
    Returns:
      ``(o_t [B, H, Dv] in q_t.dtype, new state in the compute dtype, float32 or float64)``.
    """
    dt = compute_dtype(state, q_t, k_t, v_t, g_t, beta_t)
    scale = q_t.shape[-1] ** -0.5 if scale is None else scale
    k_t = k_t.astype(dt)
    # Elementwise products and sums, no matmul: true fp32 on every backend (no TF32 passes).
    S = state.astype(dt) * jnp.exp(g_t.astype(dt))[..., None, None]
    v_new = beta_t.astype(dt)[..., None] * (v_t.astype(dt) - jnp.sum(S * k_t[..., :, None], axis=-2))
    S = S + k_t[..., :, None] * v_new[..., None, :]
    o = jnp.sum((q_t.astype(dt) * scale)[..., :, None] * S, axis=-2)
    return o.astype(q_t.dtype), S


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                                     output_final_state: bool = False):
    """Token-by-token reference (fla ``naive_recurrent_gated_delta_rule``), a ``lax.scan`` over time.

    Same arguments and returns as :func:`chunk_gated_delta_rule` (note: g before beta).
    """
    _check_qkv(q, k, v)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    _check_gates(g, beta, B, T, H)
    _check_state(initial_state, B, H, Dk, Dv)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    S0 = jnp.zeros((B, H, Dk, Dv), dt) if initial_state is None else initial_state.astype(dt)

    def body(S, xs):
        o_t, S = gated_delta_rule_step(S, *xs, scale=scale)
        return S, o_t

    xs = tuple(jnp.moveaxis(x.astype(dt), 1, 0) for x in (q, k, v, g, beta))
    S, o = lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), (S if output_final_state else None)
