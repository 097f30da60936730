"""The backward pass of a short causal depthwise conv (+ SiLU) in one pass (Pallas, Triton lowering).

The conv (``hybrid_lm.model.recurrent_common.short_conv``, Mamba-2's ``conv1d`` and GDN's q/k/v convs):
``pre_t = b + sum_i w[i] * x_{t-K+1+i}`` (zero history), ``y_t = silu(pre_t)`` or ``pre_t``.
``short_conv_bwd(x [B, T, C], dy [B, T, C], w [K, C], b [C] | None, silu)`` returns
``(dx [B, T, C] in x.dtype, dw [K, C] f32, db [C] f32)`` with ``g_t = dy_t * silu'(pre_t)``:

- ``dx_t = sum_i w[i] * g_{t+K-1-i}`` (g is zero past ``T``),
- ``dw[i] = sum_{b,t} x_{t-K+1+i} * g_t`` and ``db = sum_{b,t} g_t``.

Why: XLA ran it as a fusion writing ``g`` in fp32 and a multi-output column reduction reading ``g`` and
``x`` for ``dx`` and the weight sums, ~1 GB per GDN conv at ~1 TB/s (H200, S5 GDN: 81.9 ms per step for 45
convs; ``docs/BENCHMARKS.md``, session 15). Here a program reads ``x`` and ``dy`` (each shift from the
cache) and writes ``dx`` once; ``pre`` is recomputed from ``x``.

A program owns one batch row, one channel tile of ``block_c`` and a contiguous range of time blocks of
``block_t`` rows; it keeps its partial ``dw`` and ``db`` in registers and writes them once (summed
after). Shifted rows are loaded with clipped row indices and masks (``t < 0``: the zero history;
``t >= T``: nothing), so every load address is in bounds: the interpreter reads a negative slice start
wrongly. Channel indices are clipped only when interpreting (on the GPU masked lanes never load).
``dx`` is stored as contiguous masked rows (clipped indices would repeat a row, and the interpreter's
masked scatter writes every index). This module does not import ``hybrid_lm``; ``interpret=True`` runs
the kernel on the CPU. The reference is the custom VJP in ``hybrid_lm.model.recurrent_common``
(``_short_conv_bwd``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import interpret_default as _interpret

# Default launch: time rows and channels per block, warps, programs over time per batch row.
CONV_BLOCK_T = 8
CONV_BLOCK_C = 128
CONV_NUM_WARPS = 4
CONV_TIME_PROGRAMS = 8
MAX_KERNEL = 8  # taps held in registers


def _kernel(x_ref, dy_ref, w_ref, b_ref, dx_ref, dw_ref, db_ref, *, T, C, K, bt, bc, blocks_per_program,
            time_programs, silu, has_bias, clip_cols):
    pid, pc = pl.program_id(0), pl.program_id(1)
    batch, part = pid // time_programs, pid % time_programs
    c0 = pc * bc
    cols = c0 + lax.broadcasted_iota(jnp.int32, (bt, bc), 1)
    col_ok = cols < C
    cmask = c0 + jnp.arange(bc) < C
    w = [pltriton.load(w_ref.at[jnp.int32(i), pl.ds(c0, bc)], mask=cmask, other=0.0) for i in range(K)]
    bias = pltriton.load(b_ref.at[pl.ds(c0, bc)], mask=cmask, other=0.0) if has_bias else None

    def rows(ref, r, shift):
        """``[bt, bc]`` fp32 rows ``r + shift ...`` of this batch row; zeros outside ``[0, T) x [0, C)``."""
        t = r + shift + lax.broadcasted_iota(jnp.int32, (bt, bc), 0)
        ok = (t >= 0) & (t < T) & col_ok
        idx = batch * T + jnp.clip(t, 0, T - 1)
        col_idx = jnp.clip(cols, 0, C - 1) if clip_cols else cols  # masked lanes never load on the GPU
        return pltriton.load(ref.at[idx, col_idx], mask=ok, other=0.0).astype(jnp.float32)

    def block(j, acc):
        dw, db = acc
        r = (part * blocks_per_program + j) * bt
        xs = {d: rows(x_ref, r, d) for d in range(-(K - 1), K)}
        dx, g0 = None, None
        for s in range(K):  # g at rows r + s, and its share of dx_t = sum_s w[K-1-s] g_{t+s}
            g = rows(dy_ref, r, s)
            if silu:
                pre = sum(w[i][None, :] * xs[s - K + 1 + i] for i in range(K))
                if bias is not None:
                    pre = pre + bias[None, :]
                sig = jax.nn.sigmoid(pre)
                g = g * sig * (1.0 + pre * (1.0 - sig))
            term = w[K - 1 - s][None, :] * g
            dx = term if dx is None else dx + term
            g0 = g if s == 0 else g0
        t = r + lax.broadcasted_iota(jnp.int32, (bt, bc), 0)
        out_ok = (t < T) & col_ok
        pltriton.store(dx_ref.at[pl.ds(batch * T + r, bt), pl.ds(c0, bc)], dx.astype(dx_ref.dtype), mask=out_ok)
        dw = tuple(dw[i] + jnp.sum(xs[i - K + 1] * g0, axis=0) for i in range(K))
        return dw, db + jnp.sum(g0, axis=0)

    zero = jnp.zeros((bc,), jnp.float32)
    dw, db = lax.fori_loop(0, blocks_per_program, block, (tuple(zero for _ in range(K)), zero))
    for i in range(K):
        pltriton.store(dw_ref.at[pid, jnp.int32(i), pl.ds(c0, bc)], dw[i], mask=cmask)
    pltriton.store(db_ref.at[pid, pl.ds(c0, bc)], db, mask=cmask)


def _check(x, dy, w, b, block_t, block_c, num_warps, time_programs):
    if x.ndim != 3:
        raise ValueError(f"expected x [B, T, C], got shape {x.shape}")
    B, T, C = x.shape
    if min(B, T, C) < 1:
        raise ValueError(f"x {x.shape}: every axis must be >= 1")
    if dy.shape != x.shape:
        raise ValueError(f"dy {dy.shape} must match x {x.shape}")
    if w.ndim != 2 or w.shape[1] != C or not 1 <= w.shape[0] <= MAX_KERNEL:
        raise ValueError(f"w {w.shape} must be [K, {C}] with 1 <= K <= {MAX_KERNEL}")
    if b is not None and b.shape != (C,):
        raise ValueError(f"b {b.shape} must be ({C},)")
    for name, v in (("block_t", block_t), ("block_c", block_c), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two")
    if time_programs < 1:
        raise ValueError(f"time_programs={time_programs} must be >= 1")


@functools.partial(jax.jit, static_argnames=("silu", "block_t", "block_c", "num_warps", "time_programs",
                                             "interpret"))
def short_conv_bwd(x, dy, w, b=None, *, silu: bool, block_t: int | None = None, block_c: int | None = None,
                   num_warps: int | None = None, time_programs: int | None = None, interpret: bool | None = None):
    """``(dx [B, T, C] in x.dtype, dw [K, C] f32, db [C] f32)`` of the short causal conv from zero history
    (module docstring), given ``x``, the output's cotangent ``dy`` (any float dtype), fp32 ``w [K, C]``
    and ``b [C]`` or None (``db`` is then the sum it would have had). Not differentiable."""
    bt, bc = block_t or CONV_BLOCK_T, block_c or CONV_BLOCK_C
    nw = CONV_NUM_WARPS if num_warps is None else num_warps
    tp = CONV_TIME_PROGRAMS if time_programs is None else time_programs
    _check(x, dy, w, b, bt, bc, nw, tp)
    B, T, C = x.shape
    K = w.shape[0]
    n_blocks = pl.cdiv(T, bt)
    parts = min(tp, n_blocks)
    per = pl.cdiv(n_blocks, parts)
    parts = pl.cdiv(n_blocks, per)
    kernel = functools.partial(_kernel, T=T, C=C, K=K, bt=bt, bc=bc, blocks_per_program=per,
                               time_programs=parts, silu=bool(silu), has_bias=b is not None,
                               clip_cols=_interpret(interpret))
    bias = jnp.zeros((C,), jnp.float32) if b is None else b.astype(jnp.float32)
    dx, dw, db = pl.pallas_call(
        kernel,
        grid=(B * parts, pl.cdiv(C, bc)),
        out_shape=(jax.ShapeDtypeStruct((B * T, C), x.dtype),
                   jax.ShapeDtypeStruct((B * parts, K, C), jnp.float32),
                   jax.ShapeDtypeStruct((B * parts, C), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=1),
        interpret=_interpret(interpret),
        name="short_conv_bwd",
    )(x.reshape(B * T, C), dy.reshape(B * T, C), w.astype(jnp.float32), bias)
    return dx.reshape(B, T, C), jnp.sum(dw, axis=0), jnp.sum(db, axis=0)
