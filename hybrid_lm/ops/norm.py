"""RMSNorm over the last axis: the plain version, the closed-form passes the kernels compute, and the
dispatch between them.

``rms_norm(x, scale, eps, kernel='xla')`` is the reference (what ``model.layers.RMSNorm`` always
computed; autodiff gives its gradient). ``kernel='pallas'`` runs ``hybrid_lm_kernels.rms_norm_fwd`` /
``rms_norm_bwd`` under a custom VJP: one pass each way, the backward reading ``x`` and ``dy`` once for
both ``dx`` and the scale's gradient. ``hybrid_lm.backends.norm_kernel_backend`` picks the kernel.
``rms_norm_fwd_reference`` / ``rms_norm_bwd_reference`` are the kernels' references in plain jnp.

``gated_rms_norm`` is the same pattern for Gated DeltaNet's output norm (fla ``FusedRMSNormGated``:
normalise, scale, then ``* silu(z)``), whose input may be wider than the norm (the linear-attention
kernel's padded output): ``kernel='pallas'`` runs ``hybrid_lm_kernels.gated_rms_norm_fwd`` / ``_bwd``;
``hybrid_lm.backends.gated_norm_kernel_backend`` picks it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def rms_norm_fwd_reference(x, scale, eps: float):
    """``(y in x.dtype, rstd f32)`` over the last axis of ``x``: ``y = x * rstd * scale``."""
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    return (xf * rstd[..., None] * scale).astype(x.dtype), rstd


def rms_norm_bwd_reference(x, scale, rstd, dy):
    """``(dx in x.dtype, dscale f32)``, the closed-form backward of :func:`rms_norm_fwd_reference`."""
    xhat = x.astype(jnp.float32) * rstd[..., None]
    dyf = dy.astype(jnp.float32)
    gs = dyf * scale
    c = jnp.mean(gs * xhat, axis=-1, keepdims=True)
    dx = rstd[..., None] * (gs - xhat * c)
    return dx.astype(x.dtype), jnp.sum((dyf * xhat).reshape(-1, x.shape[-1]), axis=0)


def rms_norm(x, scale, eps: float, kernel: str = "xla"):
    """RMSNorm of ``x [..., d]`` with fp32 ``scale [d]``, in ``x``'s dtype (statistics in fp32).
    ``kernel``: ``'xla'`` (plain jnp, autodiff) or ``'pallas'`` (one-pass kernels; interpreted on the CPU)."""
    if kernel == "xla":
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * scale).astype(x.dtype)
    if kernel == "pallas":
        return _pallas_norm(x, scale, float(eps))
    raise ValueError(f"norm kernel {kernel!r}: choose 'xla' or 'pallas'")


def _flat(x):
    return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_norm(x, scale, eps):
    return _pallas_norm_fwd(x, scale, eps)[0]


def _pallas_norm_fwd(x, scale, eps):
    from hybrid_lm_kernels import rms_norm_fwd
    y, rstd = rms_norm_fwd(_flat(x), scale, eps=eps)
    return y.reshape(x.shape), (x, scale, rstd)


def _pallas_norm_bwd(eps, res, dy):
    from hybrid_lm_kernels import rms_norm_bwd
    x, scale, rstd = res
    dx, dscale = rms_norm_bwd(_flat(x), scale, rstd, _flat(dy).astype(x.dtype))  # y's cotangent: x's dtype
    return dx.reshape(x.shape), dscale.astype(scale.dtype)


_pallas_norm.defvjp(_pallas_norm_fwd, _pallas_norm_bwd)


# ----------------------------------------------------------------------------- gated RMSNorm (norm before the gate)

def gated_rms_norm_fwd_reference(x, z, scale, eps: float):
    """``(y in z.dtype, rstd f32)``: fla ``FusedRMSNormGated``, ``y = x * rstd * scale * silu(z)`` with
    ``rstd = rsqrt(mean(x**2) + eps)`` over the first ``d = z.shape[-1]`` columns of ``x`` (``x`` may be
    wider: a kernel's padded output)."""
    d = z.shape[-1]
    xf = x[..., :d].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    return (xf * rstd[..., None] * scale * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype), rstd


def gated_rms_norm_bwd_reference(x, z, scale, rstd, dy):
    """``(dx in x.dtype at x's width, zero past d; dz in z.dtype; dscale f32)``, the closed-form backward
    of :func:`gated_rms_norm_fwd_reference`."""
    d = z.shape[-1]
    xhat = x[..., :d].astype(jnp.float32) * rstd[..., None]
    zf, dyf = z.astype(jnp.float32), dy.astype(jnp.float32)
    sig = jax.nn.sigmoid(zf)
    g = dyf * zf * sig
    gs = g * scale
    dx = rstd[..., None] * (gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
    dx = jnp.pad(dx, [(0, 0)] * (x.ndim - 1) + [(0, x.shape[-1] - d)]).astype(x.dtype)
    dz = (dyf * xhat * scale * sig * (1.0 + zf * (1.0 - sig))).astype(z.dtype)
    return dx, dz, jnp.sum((g * xhat).reshape(-1, d), axis=0)


def gated_rms_norm(x, z, scale, eps: float, kernel: str = "xla"):
    """fla's gated RMSNorm (norm, scale, then ``* silu(z)``) of ``x [..., W]``'s first ``d`` columns, with
    ``z [..., d]`` and fp32 ``scale [d]``; returns ``[..., d]`` in z's dtype (statistics in fp32).
    ``kernel``: ``'xla'`` (plain jnp, autodiff) or ``'pallas'`` (``hybrid_lm_kernels.gated_rms_norm_fwd`` /
    ``_bwd`` under a custom VJP, one pass each way; interpreted on the CPU)."""
    if x.shape[:-1] != z.shape[:-1] or x.shape[-1] < z.shape[-1]:
        raise ValueError(f"x {x.shape} must have z's {z.shape} leading axes and at least its width")
    if kernel == "xla":
        xf = x[..., :z.shape[-1]].astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)
    if kernel == "pallas":
        return _pallas_gated_norm(x, z, scale, float(eps))
    raise ValueError(f"gated norm kernel {kernel!r}: choose 'xla' or 'pallas'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_gated_norm(x, z, scale, eps):
    return _pallas_gated_norm_fwd(x, z, scale, eps)[0]


def _pallas_gated_norm_fwd(x, z, scale, eps):
    from hybrid_lm_kernels import gated_rms_norm_fwd
    y, rstd = gated_rms_norm_fwd(_flat(x), _flat(z), scale, eps=eps)
    return y.reshape(z.shape), (x, z, scale, rstd)


def _pallas_gated_norm_bwd(eps, res, dy):
    from hybrid_lm_kernels import gated_rms_norm_bwd
    x, z, scale, rstd = res
    dx, dz, dscale = gated_rms_norm_bwd(_flat(x), _flat(z), scale, rstd, _flat(dy).astype(z.dtype))
    return dx.reshape(x.shape), dz.reshape(z.shape), dscale.astype(scale.dtype)


_pallas_gated_norm.defvjp(_pallas_gated_norm_fwd, _pallas_gated_norm_bwd)
