"""RMSNorm over the last axis, and Gated DeltaNet's gated output norm (plain jnp; autodiff gives the
gradients; statistics in fp32).

One-pass Pallas kernels for both were measured faster alone on an H200 but gave no train-step gain
(XLA fuses the residual adds and casts around its norms), so they were removed (docs/KERNELS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, scale, eps: float):
    """RMSNorm of ``x [..., d]`` with fp32 ``scale [d]``, in ``x``'s dtype (statistics in fp32)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def gated_rms_norm(x, z, scale, eps: float):
    """fla's gated RMSNorm (``FusedRMSNormGated``: norm, scale, then ``* silu(z)``) of ``x [..., W]``'s
    first ``d`` columns, with ``z [..., d]`` and fp32 ``scale [d]``; returns ``[..., d]`` in z's dtype.
    ``x`` may be wider than ``d``: the linear-attention kernel's padded output is read in place."""
    if x.shape[:-1] != z.shape[:-1] or x.shape[-1] < z.shape[-1]:
        raise ValueError(f"x {x.shape} must have z's {z.shape} leading axes and at least its width")
    xf = x[..., :z.shape[-1]].astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)
