"""RMSNorm forward and backward, each one pass over its rows (Pallas, Triton lowering).

``rms_norm_fwd(x [N, d], scale [d], eps)`` returns ``(y [N, d] in x.dtype, rstd [N] f32)``:
``y = x * rstd * scale`` with ``rstd = rsqrt(mean(x**2) + eps)``, statistics in fp32.
``rms_norm_bwd(x, scale, rstd, dy)`` returns ``(dx [N, d] in x.dtype, dscale [d] f32)``:
``dx = rstd * (dy*scale - xhat * mean(dy*scale*xhat))`` and ``dscale = sum_rows(dy * xhat)``, where
``xhat = x * rstd``.

Why: XLA runs the norm's forward as a row reduction plus an elementwise pass (x read twice), and its
backward as a row reduction, an elementwise pass and a column reduction for the scale's gradient, each
reading ``x`` and ``dy`` again (H200, S5 full: 76.8 ms of norms per step, ~2.7x the bytes of one pass;
``docs/BENCHMARKS.md``, session 13). Here the forward reads ``x`` once and writes ``y``; the backward
reads ``x`` and ``dy`` once and writes ``dx``. Each backward program walks a contiguous range of row
blocks and keeps its partial ``dscale`` in registers; the ``[programs, d]`` partials are summed after.

Measured (H200, session 14): 0.75–0.84x XLA's norm alone, but no train step gained (XLA fuses the
residual add and casts around its own norm), so the model runs them only on request
(``ModelConfig.norm_kernel='pallas'``).

A row is one tile of ``next_pow2(d)`` columns (masked past ``d``, at most ``MAX_WIDTH``: one row block
lives in registers); rows past ``N`` are masked. This
module does not import ``hybrid_lm``; ``interpret=True`` runs the same kernels on the CPU. The
reference is ``hybrid_lm.ops.norm`` (``rms_norm_fwd_reference``, ``rms_norm_bwd_reference``).
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

# Default launch: rows per block, warps, backward programs (each walks its share of the row blocks).
NORM_BLOCK_ROWS = 4
NORM_NUM_WARPS = 4
NORM_BWD_PROGRAMS = 528  # 4 per SM of an H100 / H200 (132 SMs)
MAX_WIDTH = 16384  # widest row (d): a block of rows is held in registers


def _check(x, scale, block_rows):
    if x.ndim != 2:
        raise ValueError(f"expected x [N, d], got shape {x.shape}")
    if x.shape[0] < 1 or not 1 <= x.shape[1] <= MAX_WIDTH:
        raise ValueError(f"x {x.shape}: need N >= 1 rows and 1 <= d <= {MAX_WIDTH}")
    if scale.shape != (x.shape[1],):
        raise ValueError(f"scale {scale.shape} must be ({x.shape[1]},) for x {x.shape}")
    br = NORM_BLOCK_ROWS if block_rows is None else block_rows
    if br < 1 or br & (br - 1):
        raise ValueError(f"block_rows={br} must be a power of two")
    return br


def _rows(ref, r0, br, n_rows, d, bd, other=0.0):
    """``[br, bd]`` fp32 block of rows ``r0 .. r0 + br`` (zeros outside ``[n_rows) x [d)``) and its mask."""
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br, bd), 0)
    cols = lax.broadcasted_iota(jnp.int32, (br, bd), 1)
    mask = (rows < n_rows) & (cols < d)
    return pltriton.load(ref.at[pl.ds(r0, br), pl.ds(0, bd)], mask=mask, other=other).astype(jnp.float32), mask


def _fwd_kernel(x_ref, s_ref, y_ref, rstd_ref, *, n_rows, d, br, bd, eps):
    r0 = pl.program_id(0) * br
    x, mask = _rows(x_ref, r0, br, n_rows, d, bd)
    s = pltriton.load(s_ref.at[pl.ds(0, bd)], mask=jnp.arange(bd) < d, other=0.0).astype(jnp.float32)
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    y = x * rstd[:, None] * s[None, :]
    pltriton.store(y_ref.at[pl.ds(r0, br), pl.ds(0, bd)], y.astype(y_ref.dtype), mask=mask)
    pltriton.store(rstd_ref.at[pl.ds(r0, br)], rstd, mask=r0 + jnp.arange(br) < n_rows)


def _bwd_kernel(x_ref, s_ref, rstd_ref, dy_ref, dx_ref, ds_ref, *, n_rows, d, br, bd, blocks_per_program):
    s = pltriton.load(s_ref.at[pl.ds(0, bd)], mask=jnp.arange(bd) < d, other=0.0).astype(jnp.float32)
    first = pl.program_id(0) * blocks_per_program

    def block(i, ds):
        r0 = (first + i) * br
        x, mask = _rows(x_ref, r0, br, n_rows, d, bd)
        dy, _ = _rows(dy_ref, r0, br, n_rows, d, bd)
        rstd = pltriton.load(rstd_ref.at[pl.ds(r0, br)], mask=r0 + jnp.arange(br) < n_rows, other=0.0)
        xhat = x * rstd[:, None]
        gs = dy * s[None, :]
        c = jnp.sum(gs * xhat, axis=1) / d
        dx = rstd[:, None] * (gs - xhat * c[:, None])
        pltriton.store(dx_ref.at[pl.ds(r0, br), pl.ds(0, bd)], dx.astype(dx_ref.dtype), mask=mask)
        return ds + jnp.sum(dy * xhat, axis=0)

    ds = lax.fori_loop(0, blocks_per_program, block, jnp.zeros((bd,), jnp.float32))
    pltriton.store(ds_ref.at[pl.program_id(0), pl.ds(0, bd)], ds, mask=jnp.arange(bd) < d)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def rms_norm_fwd(x, scale, *, eps: float, block_rows: int | None = None, num_warps: int | None = None,
                 interpret: bool | None = None):
    """``(y [N, d] in x.dtype, rstd [N] f32)`` of ``x [N, d]`` (bf16 or fp32) and fp32 ``scale [d]``:
    ``y = x * rsqrt(mean(x**2) + eps) * scale``. Not differentiable (see ``hybrid_lm.ops.norm``)."""
    br = _check(x, scale, block_rows)
    N, d = x.shape
    kernel = functools.partial(_fwd_kernel, n_rows=N, d=d, br=br, bd=_next_pow2(d), eps=float(eps))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, br),),
        out_shape=(jax.ShapeDtypeStruct((N, d), x.dtype), jax.ShapeDtypeStruct((N,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NORM_NUM_WARPS, num_stages=1),
        interpret=_interpret(interpret),
        name="rms_norm_fwd",
    )(x, scale.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_rows", "num_warps", "programs", "interpret"))
def rms_norm_bwd(x, scale, rstd, dy, *, block_rows: int | None = None, num_warps: int | None = None,
                 programs: int | None = None, interpret: bool | None = None):
    """``(dx [N, d] in x.dtype, dscale [d] f32)``: the gradients of ``sum(dy * y)`` for ``y`` of
    :func:`rms_norm_fwd`, given its ``rstd [N]``."""
    br = _check(x, scale, block_rows)
    N, d = x.shape
    if dy.shape != x.shape or dy.dtype != x.dtype or rstd.shape != (N,):
        raise ValueError(f"dy {dy.shape} {dy.dtype} must be {x.shape} {x.dtype} and rstd {rstd.shape} must be ({N},)")
    n_blocks = pl.cdiv(N, br)
    per = pl.cdiv(n_blocks, min(programs or NORM_BWD_PROGRAMS, n_blocks))
    grid = pl.cdiv(n_blocks, per)
    kernel = functools.partial(_bwd_kernel, n_rows=N, d=d, br=br, bd=_next_pow2(d), blocks_per_program=per)
    dx, ds = pl.pallas_call(
        kernel,
        grid=(grid,),
        out_shape=(jax.ShapeDtypeStruct((N, d), x.dtype), jax.ShapeDtypeStruct((grid, d), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NORM_NUM_WARPS, num_stages=1),
        interpret=_interpret(interpret),
        name="rms_norm_bwd",
    )(x, scale.astype(jnp.float32), rstd.astype(jnp.float32), dy)
    return dx, jnp.sum(ds, axis=0)
