"""Gated DeltaNet's output norm, forward and backward, each one pass over its rows (Pallas, Triton lowering).

The norm is fla's ``FusedRMSNormGated`` (norm before the gate), over rows of ``d`` (one head's values):
``y = x * rstd * scale * silu(z)`` with ``rstd = rsqrt(mean(x[:d]**2) + eps)``, statistics in fp32.
The rows of ``x`` may be wider than ``d`` (``W >= d``): the linear-attention kernel returns the heads'
values padded to its width (GDN at S1-S5: Dv 192 in 256 columns), and the norm reads the first ``d``
columns in place instead of a sliced copy.

- ``gated_rms_norm_fwd(x [N, W], z [N, d], scale [d], eps)`` -> ``(y [N, d] in z.dtype, rstd [N] f32)``;
- ``gated_rms_norm_bwd(x, z, scale, rstd, dy [N, d])`` -> ``(dx [N, W] in x.dtype, zero past d;
  dz [N, d] in z.dtype; dscale [d] f32)``. With ``xhat = x * rstd``, ``s = sigmoid(z)``,
  ``g = dy * z * s`` (the cotangent of ``xhat * scale``):
  ``dx = rstd * (g*scale - xhat * mean(g*scale*xhat))``, ``dz = dy * xhat * scale * s * (1 + z (1 - s))``,
  ``dscale = sum_rows(g * xhat)``.

Why: XLA ran GDN's output as a slice of the kernel's padded output, a cast to fp32 written to memory,
and the gate and norm fusions reading it again, forward and backward (H200, S5 GDN: 26.3 + 31.4 ms per
step with the q/k casts; ``docs/BENCHMARKS.md``, session 15). Here the forward reads ``x`` and ``z``
once and writes ``y``; the backward reads ``x``, ``z`` and ``dy`` once and writes ``dx`` (at the
kernel's width, ready for its backward) and ``dz``. Backward programs walk contiguous ranges of row
blocks and keep their partial ``dscale`` in registers; the ``[programs, d]`` partials are summed after.

Measured (H200, session 18, ``experiments/bench_gated_norm.py``): 0.65–0.86x the model's former XLA path
alone (forward + backward, 655,360 rows of 192 in 256 columns), but the S5 GDN step did not move (897.1 vs
897.2 ms; XLA had fused the slice and casts into its neighbours), so the model runs them only on request
(``ModelConfig.gated_norm_kernel='pallas'``).

A block is ``block_rows`` rows of ``next_pow2(W)`` columns, masked past ``d`` (loads) or ``W`` (the
``dx`` store) and past ``N``. This module does not import ``hybrid_lm``; ``interpret=True`` runs the
kernels on the CPU. The references are ``hybrid_lm.ops.norm.gated_rms_norm_fwd_reference`` /
``gated_rms_norm_bwd_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import interpret_default as _interpret
from .tiles import next_pow2 as _next_pow2

# Default launch: rows per block, warps, backward programs (each walks its share of the row blocks); the
# fastest of 7 on an H200 (session 18).
GATED_NORM_BLOCK_ROWS = 8
GATED_NORM_NUM_WARPS = 4
GATED_NORM_BWD_PROGRAMS = 1056  # 8 per SM of an H100 / H200 (132 SMs)
MAX_WIDTH = 4096  # widest row (W): a block of rows is held in registers


def _check(x, z, scale, block_rows):
    if x.ndim != 2 or z.ndim != 2:
        raise ValueError(f"expected x [N, W] and z [N, d], got shapes {x.shape} and {z.shape}")
    (N, W), d = x.shape, z.shape[1]
    if N < 1 or z.shape[0] != N or not 1 <= d <= W <= MAX_WIDTH:
        raise ValueError(f"x {x.shape}, z {z.shape}: need the same N >= 1 rows and 1 <= d <= W <= {MAX_WIDTH}")
    if scale.shape != (d,):
        raise ValueError(f"scale {scale.shape} must be ({d},) for z {z.shape}")
    br = GATED_NORM_BLOCK_ROWS if block_rows is None else block_rows
    if br < 1 or br & (br - 1):
        raise ValueError(f"block_rows={br} must be a power of two")
    return br


def _block(ref, r0, br, n_rows, width, bw):
    """``[br, bw]`` fp32 block of rows ``r0 .. r0 + br`` (zeros outside ``[n_rows) x [width)``)."""
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br, bw), 0)
    cols = lax.broadcasted_iota(jnp.int32, (br, bw), 1)
    mask = (rows < n_rows) & (cols < width)
    return pltriton.load(ref.at[pl.ds(r0, br), pl.ds(0, bw)], mask=mask, other=0.0).astype(jnp.float32)


def _store(ref, r0, value, n_rows, width):
    br, bw = value.shape
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br, bw), 0)
    cols = lax.broadcasted_iota(jnp.int32, (br, bw), 1)
    pltriton.store(ref.at[pl.ds(r0, br), pl.ds(0, bw)], value.astype(ref.dtype),
                   mask=(rows < n_rows) & (cols < width))


def _scale(s_ref, d, bw):
    return pltriton.load(s_ref.at[pl.ds(0, bw)], mask=jnp.arange(bw) < d, other=0.0).astype(jnp.float32)


def _fwd_kernel(x_ref, z_ref, s_ref, y_ref, rstd_ref, *, n_rows, d, br, bw, eps):
    r0 = pl.program_id(0) * br
    x = _block(x_ref, r0, br, n_rows, d, bw)
    z = _block(z_ref, r0, br, n_rows, d, bw)
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    y = x * rstd[:, None] * _scale(s_ref, d, bw)[None, :] * (z * jax.nn.sigmoid(z))
    _store(y_ref, r0, y, n_rows, d)
    pltriton.store(rstd_ref.at[pl.ds(r0, br)], rstd, mask=r0 + jnp.arange(br) < n_rows)


def _bwd_kernel(x_ref, z_ref, s_ref, rstd_ref, dy_ref, dx_ref, dz_ref, ds_ref, *, n_rows, d, W, br, bw,
                blocks_per_program):
    s = _scale(s_ref, d, bw)[None, :]
    first = pl.program_id(0) * blocks_per_program

    def block(i, ds):
        r0 = (first + i) * br
        x = _block(x_ref, r0, br, n_rows, d, bw)
        z = _block(z_ref, r0, br, n_rows, d, bw)
        dy = _block(dy_ref, r0, br, n_rows, d, bw)
        rstd = pltriton.load(rstd_ref.at[pl.ds(r0, br)], mask=r0 + jnp.arange(br) < n_rows, other=0.0)
        xhat = x * rstd[:, None]
        sig = jax.nn.sigmoid(z)
        g = dy * z * sig
        gs = g * s
        c = jnp.sum(gs * xhat, axis=1) / d
        _store(dx_ref, r0, rstd[:, None] * (gs - xhat * c[:, None]), n_rows, W)  # zeros in [d, W)
        _store(dz_ref, r0, dy * xhat * s * sig * (1.0 + z * (1.0 - sig)), n_rows, d)
        return ds + jnp.sum(g * xhat, axis=0)

    ds = lax.fori_loop(0, blocks_per_program, block, jnp.zeros((bw,), jnp.float32))
    pltriton.store(ds_ref.at[pl.program_id(0), pl.ds(0, bw)], ds, mask=jnp.arange(bw) < d)


def _params(num_warps):
    return pltriton.CompilerParams(num_warps=num_warps or GATED_NORM_NUM_WARPS, num_stages=1)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def gated_rms_norm_fwd(x, z, scale, *, eps: float, block_rows: int | None = None, num_warps: int | None = None,
                       interpret: bool | None = None):
    """``(y [N, d] in z.dtype, rstd [N] f32)`` of ``x [N, W]`` (the first ``d`` columns), the gate
    ``z [N, d]`` and fp32 ``scale [d]``: ``y = x * rsqrt(mean(x**2) + eps) * scale * silu(z)``.
    Not differentiable (see ``hybrid_lm.ops.norm.gated_rms_norm``)."""
    br = _check(x, z, scale, block_rows)
    (N, W), d = x.shape, z.shape[1]
    kernel = functools.partial(_fwd_kernel, n_rows=N, d=d, br=br, bw=_next_pow2(W), eps=float(eps))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, br),),
        out_shape=(jax.ShapeDtypeStruct((N, d), z.dtype), jax.ShapeDtypeStruct((N,), jnp.float32)),
        compiler_params=_params(num_warps),
        interpret=_interpret(interpret),
        name="gated_rms_norm_fwd",
    )(x, z, scale.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_rows", "num_warps", "programs", "interpret"))
def gated_rms_norm_bwd(x, z, scale, rstd, dy, *, block_rows: int | None = None, num_warps: int | None = None,
                       programs: int | None = None, interpret: bool | None = None):
    """``(dx [N, W] in x.dtype, dz [N, d] in z.dtype, dscale [d] f32)``: the gradients of ``sum(dy * y)``
    for ``y`` of :func:`gated_rms_norm_fwd`, given its ``rstd [N]``; ``dx`` is zero past column ``d``."""
    br = _check(x, z, scale, block_rows)
    (N, W), d = x.shape, z.shape[1]
    if dy.shape != z.shape or rstd.shape != (N,):
        raise ValueError(f"dy {dy.shape} must be z's {z.shape} and rstd {rstd.shape} must be ({N},)")
    n_blocks = pl.cdiv(N, br)
    per = pl.cdiv(n_blocks, min(programs or GATED_NORM_BWD_PROGRAMS, n_blocks))
    grid = pl.cdiv(n_blocks, per)
    kernel = functools.partial(_bwd_kernel, n_rows=N, d=d, W=W, br=br, bw=_next_pow2(W), blocks_per_program=per)
    dx, dz, ds = pl.pallas_call(
        kernel,
        grid=(grid,),
        out_shape=(jax.ShapeDtypeStruct((N, W), x.dtype), jax.ShapeDtypeStruct((N, d), z.dtype),
                   jax.ShapeDtypeStruct((grid, d), jnp.float32)),
        compiler_params=_params(num_warps),
        interpret=_interpret(interpret),
        name="gated_rms_norm_bwd",
    )(x, z, scale.astype(jnp.float32), rstd.astype(jnp.float32), dy)
    return dx, dz, jnp.sum(ds, axis=0)
