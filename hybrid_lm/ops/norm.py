"""RMSNorm over the last axis: the plain version, the closed-form passes the kernels compute, and the
dispatch between them.

``rms_norm(x, scale, eps, kernel='xla')`` is the reference (what ``model.layers.RMSNorm`` always
computed; autodiff gives its gradient). ``kernel='pallas'`` runs ``hybrid_lm_kernels.rms_norm_fwd`` /
``rms_norm_bwd`` under a custom VJP: one pass each way, the backward reading ``x`` and ``dy`` once for
both ``dx`` and the scale's gradient. ``hybrid_lm.backends.norm_kernel_backend`` picks the kernel.
``rms_norm_fwd_reference`` / ``rms_norm_bwd_reference`` are the kernels' references in plain jnp.
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
