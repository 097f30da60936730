"""Pieces shared by the recurrent mixers (``lightning``, ``mamba2``, ``gdn``).

- :class:`ShortConv`: causal depthwise conv along time (fla ``ShortConvolution``, the ``conv1d`` of
  mamba_ssm), with a decode state holding the last ``kernel - 1`` inputs.
- :class:`GatedRMSNorm`: RMSNorm with a SiLU gate, in both orders (mamba_ssm ``RMSNormGated`` with
  ``norm_before_gate=False``; fla ``FusedRMSNormGated``, which normalises first).
- initialisers of the per-head scalars (``A_log``, ``dt_bias``) as mamba_ssm / fla.

Conventions: parameters fp32; activations in the compute dtype; decode states fp32. A decode state
is a dict (a pytree) so that a model-level cache is a list of them.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.backends import conv_kernel_backend
from hybrid_lm.ops.norm import gated_rms_norm

# eps of the norms *inside* the recurrent layers (mamba_ssm, fla and MiniMax all use 1e-5); the
# block's pre-norms keep ModelConfig.norm_eps.
INNER_NORM_EPS = 1e-5
# fla ``l2norm``: x / sqrt(sum(x^2) + eps)
L2NORM_EPS = 1e-6
# Why the recurrent mixers refuse DataConfig.document_mask (register_mixer(document_mask=...))
RECURRENT_DOCUMENT_MASK = ("its recurrent state and short convs run across the whole window; resetting "
                           "them at document starts is not implemented")


def uniform_param(rngs: nnx.Rngs, shape, axes, low: float, high: float) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    v = jax.random.uniform(rngs.params(), shape, jnp.float32, low, high)
    return nnx.Param(v, logical_axes=tuple(axes))


def const_param(value, axes) -> nnx.Param:
    value = jnp.asarray(value, jnp.float32)
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=tuple(axes))


def a_log_init(rngs: nnx.Rngs, n: int, low: float, high: float) -> jax.Array:
    """``log(A)`` with ``A ~ U(low, high)``; the decay rate is ``-exp(A_log)``.

    mamba_ssm uses ``A_init_range = (1, 16)``; fla's GatedDeltaNet ``U(0, 16)``. A draw of exactly 0
    would give ``-inf``, so A is floored at 1e-4 (it changes nothing else).
    """
    a = jax.random.uniform(rngs.params(), (n,), jnp.float32, low, high)
    return jnp.log(jnp.maximum(a, 1e-4))


def dt_bias_init(rngs: nnx.Rngs, n: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                 floor: float = 1e-4) -> jax.Array:
    """mamba_ssm / fla: ``dt`` log-uniform in ``[dt_min, dt_max]``, floored, stored as softplus^-1(dt)."""
    u = jax.random.uniform(rngs.params(), (n,), jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, floor)
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus


def l2norm(x, eps: float = L2NORM_EPS):
    """fla ``l2norm`` over the last axis, computed in fp32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# ----------------------------------------------------------------------------- short causal conv

# ShortConv's training form (zero history) through :func:`short_conv`'s hand-written backward, which writes
# the input gradient in the input's dtype. Off: plain autodiff of :func:`_short_conv_plain` (the reference),
# whose backward fusion wrote an fp32 input gradient (Mamba-2 at S5: [8, 16384, 2816] per layer).
SHORT_CONV_VJP = True


def _conv_finish(pre, b, activation, dtype):
    if b is not None:
        pre = pre + b
    if activation == "silu":
        pre = jax.nn.silu(pre)
    return pre.astype(dtype)


def _taps(xp, w, T):
    """``sum_i w[i] * xp[:, i:i+T]`` over the K taps of ``w``: K shifted multiply-adds (K = 4: exact,
    fused by XLA, no conv lowering quirks)."""
    return sum(xp[:, i:i + T] * w[i] for i in range(w.shape[0]))


def _short_conv_plain(x, w, b, activation, prev):
    """The reference: ``(y in x.dtype, xp)`` with ``xp = [prev | x]`` in fp32."""
    xp = jnp.concatenate([prev, x.astype(jnp.float32)], axis=1)  # [B, K-1+T, C]
    return _conv_finish(_taps(xp, w, x.shape[1]), b, activation, x.dtype), xp


def _short_conv_pre(x, w):
    """``(xp, pre)`` from zero history: x padded with K-1 zero rows in fp32, and its taps before bias."""
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
    return xp, _taps(xp, w, x.shape[1])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def short_conv(x, w, b, activation, kernel="xla"):
    """Causal depthwise conv from zero history: ``x [B, T, C]``, ``w [K, C]`` fp32, ``b [C]`` or None ->
    ``y [B, T, C]`` in x's dtype. Equal to :func:`_short_conv_plain` with ``prev = 0``, forward and
    gradients (the same fp32 sums); its backward recomputes the pre-activation from ``x`` and rounds
    ``dx`` once, to x's dtype: in jnp (``kernel='xla'``) or in one Pallas pass (``'pallas'``,
    ``hybrid_lm_kernels.short_conv_bwd``; interpreted on the CPU)."""
    return _conv_finish(_short_conv_pre(x, w)[1], b, activation, x.dtype)


def _short_conv_fwd(x, w, b, activation, kernel):
    return short_conv(x, w, b, activation, kernel), (x, w, b)


def _short_conv_bwd(activation, kernel, res, dy):
    x, w, b = res
    if kernel == "pallas":
        from hybrid_lm_kernels import short_conv_bwd  # may not import here (backends.py picks xla then)
        dx, dw, db = short_conv_bwd(x, dy, w, b, silu=activation == "silu")
        return dx, dw.astype(w.dtype), None if b is None else db.astype(b.dtype)
    if kernel != "xla":
        raise ValueError(f"short conv kernel {kernel!r}: choose 'xla' or 'pallas'")
    K, T = w.shape[0], x.shape[1]
    xp, pre = _short_conv_pre(x, w)
    if b is not None:
        pre = pre + b
    g = dy.astype(jnp.float32)
    if activation == "silu":
        s = jax.nn.sigmoid(pre)
        g = g * s * (1.0 + pre * (1.0 - s))
    # dx_t = sum_i w[i] g_{t+K-1-i}: the transposed taps over g padded with K-1 zeros at the end
    gp = jnp.pad(g, ((0, 0), (0, K - 1), (0, 0)))
    dx = sum(gp[:, K - 1 - i:K - 1 - i + T] * w[i] for i in range(K)).astype(x.dtype)
    dw = jnp.stack([jnp.sum(xp[:, i:i + T] * g, axis=(0, 1)) for i in range(K)])
    db = None if b is None else jnp.sum(g, axis=(0, 1)).astype(b.dtype)
    return dx, dw.astype(w.dtype), db


short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


class ShortConv(nnx.Module):
    """Causal depthwise conv over time of width ``kernel_size`` with an optional SiLU.

    ``y_t = act(b + sum_i w[i] * x_{t - K + 1 + i})``: ``w[K-1]`` multiplies the current token (the
    layout of torch's ``Conv1d(C, C, K, groups=C, padding=K-1)`` weight ``[C, 1, K]``, transposed).
    Init as torch ``Conv1d`` (what mamba_ssm and fla use): weight and bias ``U(+-1/sqrt(K))``.

    Decode state: the last ``K - 1`` inputs ``[B, K-1, C]`` (fp32), oldest first; zeros at start,
    which is what the zero padding of the training form means.
    """

    def __init__(self, channels: int, kernel_size: int, *, rngs: nnx.Rngs, bias: bool = False,
                 activation: str | None = "silu", kernel: str = "auto"):
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = uniform_param(rngs, (kernel_size, channels), ("conv_kernel", "conv_dim"), -bound, bound)
        self.bias = uniform_param(rngs, (channels,), ("bias",), -bound, bound) if bias else None
        self.kernel_size = kernel_size
        self.channels = channels
        self.activation = activation
        self.kernel = kernel  # who runs the training form's backward: auto | xla | pallas (resolved when traced)

    def init_state(self, batch: int):
        return jnp.zeros((batch, self.kernel_size - 1, self.channels), jnp.float32)

    def __call__(self, x, state=None):
        """``x [B, T, C]`` -> ``(y [B, T, C] in x.dtype, new state [B, K-1, C])``."""
        B, T, C = x.shape
        K = self.kernel_size
        w = self.weight[...]
        b = None if self.bias is None else self.bias[...]
        if state is None and SHORT_CONV_VJP:  # the training form: zero history, the hand-written backward
            tail = jnp.pad(x.astype(jnp.float32), ((0, 0), (K - 1, 0), (0, 0)))[:, T:]
            return short_conv(x, w, b, self.activation, conv_kernel_backend(self.kernel)[0]), tail
        prev = self.init_state(B) if state is None else state.astype(jnp.float32)
        y, xp = _short_conv_plain(x, w, b, self.activation, prev)
        return y, xp[:, T:]

    def step(self, x_t, state):
        """``x_t [B, C]`` -> ``(y_t [B, C], new state)``."""
        window = jnp.concatenate([state.astype(jnp.float32), x_t.astype(jnp.float32)[:, None]], axis=1)
        y = jnp.sum(window * self.weight[...], axis=1)
        return _conv_finish(y, None if self.bias is None else self.bias[...], self.activation, x_t.dtype), window[:, 1:]


# ----------------------------------------------------------------------------- gated RMSNorm

class GatedRMSNorm(nnx.Module):
    """RMSNorm with a SiLU gate over the last axis, optionally in groups.

    - ``norm_before_gate=False`` (mamba_ssm ``RMSNormGated``, Mamba-2's default):
      ``y = rms(x * silu(z)) * w``.
    - ``norm_before_gate=True`` (fla ``FusedRMSNormGated``, Gated DeltaNet's output norm):
      ``y = rms(x) * w * silu(z)``.

    ``group_size`` splits the last axis into groups normalised separately (mamba_ssm uses
    ``d_inner / n_groups``); None means one group. Computed in fp32, returned in x's dtype.
    """

    def __init__(self, dim: int, *, norm_before_gate: bool, group_size: int | None = None,
                 eps: float = INNER_NORM_EPS):
        group_size = group_size or dim
        if dim % group_size:
            raise ValueError(f"group_size={group_size} does not divide dim={dim}")
        self.scale = const_param(jnp.ones((dim,)), ("norm",))
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size
        self.eps = eps

    def __call__(self, x, z):
        """``x [..., W]``, ``z [..., dim]`` -> ``[..., dim]`` in x's dtype. ``W > dim`` (the norm-first,
        one-group form only): the norm reads x's first ``dim`` columns (a kernel's padded output)."""
        dtype = x.dtype
        dim = self.scale.shape[0]
        if self.norm_before_gate and self.group_size == dim:
            return gated_rms_norm(x, z, self.scale[...], self.eps).astype(dtype)
        if x.shape[-1] != dim:
            raise ValueError(f"x {x.shape}: this gated norm takes {dim} columns")
        x, z = x.astype(jnp.float32), z.astype(jnp.float32)
        if not self.norm_before_gate:
            x = x * jax.nn.silu(z)
        shape = x.shape
        xg = x.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        xg = xg * jax.lax.rsqrt(jnp.mean(xg * xg, axis=-1, keepdims=True) + self.eps)
        y = xg.reshape(shape) * self.scale[...]
        if self.norm_before_gate:
            y = y * jax.nn.silu(z)
        return y.astype(dtype)


# ----------------------------------------------------------------------------- FLOPs of the chunked scans

def simple_gla_chunk_macs(chunk: int, dk: int, dv: int) -> float:
    """Multiply-adds per token and head of ``chunk_simple_gla`` (chunk C, as computed: full C x C tiles).

    intra-chunk ``q k^T`` (C Dk) and ``scores v`` (C Dv); the chunk's state contribution ``K^T V``
    (Dk Dv per token) and the inter-chunk read-out ``q S`` (Dk Dv): ``C (Dk + Dv) + 2 Dk Dv``.
    """
    return chunk * (dk + dv) + 2.0 * dk * dv


def delta_rule_chunk_macs(chunk: int, dk: int, dv: int) -> float:
    """Multiply-adds per token and head of ``chunk_gated_delta_rule`` (chunk C).

    ``K K^T`` (C Dk); the unit-triangular solve for ``[w | u]`` ((C-1)/2 (Dk + Dv)); in the scan
    ``u - w S`` and ``K^T V'`` (2 Dk Dv); output ``q k^T`` (C Dk), ``scores V'`` (C Dv) and ``q S``
    (Dk Dv): ``2 C Dk + C Dv + (C-1)/2 (Dk + Dv) + 3 Dk Dv``.
    """
    return 2.0 * chunk * dk + chunk * dv + (chunk - 1) / 2.0 * (dk + dv) + 3.0 * dk * dv
