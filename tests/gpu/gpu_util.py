"""Helpers of the GPU tests (``tests/gpu``): inputs, the relative error, whether a GPU is here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# every module of tests/gpu: ``pytestmark = GPU``
GPU = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU"),
       pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


def rel_err(a, b, floor_rms: float = 0.0) -> float:
    """Relative L2 error of ``a`` against the reference ``b`` (float64 on the host); ``inf`` if ``a`` is not
    finite. ``floor_rms``: the denominator is at least that RMS (exactly-zero references, e.g. w = 1 gradients)."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return math.inf
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor_rms * math.sqrt(b.size), 1e-30))


def qkv(seed, B, T, H, K, D, dtype):
    """``q [B,T,H,D]``, ``k, v [B,T,K,D]``, a cotangent ``do [B,T,H,D]`` and a permutation ``[B,T]`` per row."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, D), jnp.float32).astype(dtype)
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, T))(jax.random.split(ks[4], B)).astype(jnp.int32)
    return q, k, v, do, perm


def fwd_bwd(attn, q, k, v, do):
    """``(o, dq, dk, dv)`` of ``attn(q, k, v)`` for the cotangent ``do``."""
    o, vjp = jax.vjp(attn, q, k, v)
    return (o, *vjp(do))


def oracle(attn, q, k, v, do):
    """:func:`fwd_bwd` of a reference on the fp32 copies of the inputs at HIGHEST matmul precision."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda *a: fwd_bwd(attn, *a))(*f32)


def same_bits(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b))
