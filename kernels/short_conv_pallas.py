"""The backward pass of a short causal depthwise conv (+ SiLU) in one pass (Pallas, Triton lowering).

The conv (``hybrid_lm.model.recurrent_common.short_conv``, Mamba-2's ``conv1d`` and GDN's q/k/v convs):
``pre_t = b + sum_i w[i] * x_{t-K+1+i}`` (zero history), ``y_t = silu(pre_t)`` or ``pre_t``.
``short_conv_bwd(x [B, T, C], dy [B, T, C], w [K, C], b [C] | None, silu)`` returns
``(dx [B, T, C] in x.dtype, dw [K, C] f32, db [C] f32)`` with ``g_t = dy_t * silu'(pre_t)``:

- ``dx_t = sum_i w[i] * g_{t+K-1-i}`` (g is zero past ``T``),
- ``dw[i] = sum_{b,t} x_{t-K+1+i} * g_t`` and ``db = sum_{b,t} g_t``.

Why: XLA ran it as a fusion writing ``g`` in fp32 and a multi-output column reduction reading ``g`` and
``x`` for ``dx`` and the weight sums, ~1 GB per GDN conv at ~1 TB/s (H200, S5 GDN: 81.9 ms per step for 45
convs). Here a program reads each row of ``x`` and ``dy`` once and
writes ``dx`` once; ``pre`` is recomputed from ``x``.

A program owns one batch row, one channel tile of ``block_c`` and a contiguous segment of time. It walks
its segment backwards, ``block_t`` rows per step, each row a ``[block_c]`` vector: a step loads
``block_t`` new rows of ``x`` (the oldest rows its window needs) and of ``dy``, and carries the ``K - 1``
newest ``x`` rows and ``K - 1`` oldest ``g`` rows over to the next (older) step, so every shift of the
taps is a choice among row vectors already in registers (no re-read, no recompute). A prologue builds
the ``g`` of the ``K - 1`` rows past the segment's end (owned by the next segment) from their own rows.
Partial ``dw`` and ``db`` stay in registers and are written once per program (summed after). Rows outside
``[0, T)`` load as zeros (``t < 0``: the zero history; ``t >= T``: no gradient) from clipped, in-bounds
addresses (the interpreter reads a negative slice start wrongly); rows before the segment are masked out
of the stores and sums. Channel indices are clipped only when interpreting (on the GPU masked lanes never
load). This module does not import ``hybrid_lm``; ``interpret=True`` runs the kernel on the CPU. The
reference is the custom VJP in ``hybrid_lm.model.recurrent_common`` (``_short_conv_bwd``). Re-reading
``2K - 1`` shifted row blocks per block through masked gathers instead ran at 0.5–0.76 TB/s on the H200,
slower than XLA. This design (H200): 1.6–2.2 TB/s, 0.49–0.63x the jnp
backward alone and train steps 0.978–0.984x (S3/S5 Mamba-2 / GDN), so the dispatch takes it on one GPU
(``hybrid_lm.backends.conv_kernel_backend``; docs/KERNELS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import interpret_default as _interpret

# Default launch: rows per step, channels per program, warps, programs over time per batch row
# (the fastest of 6 on an H200 at C = 2816, within 0.6% of the best at 1920).
CONV_BLOCK_T = 16
CONV_BLOCK_C = 256
CONV_NUM_WARPS = 4
CONV_TIME_PROGRAMS = 32
MAX_KERNEL = 8  # taps held in registers


def _kernel(x_ref, dy_ref, w_ref, b_ref, dx_ref, dw_ref, db_ref, *, T, C, K, U, bc, seg_len, steps,
            time_programs, silu, has_bias, clip_cols):
    pid, pc = pl.program_id(0), pl.program_id(1)
    batch, part = pid // time_programs, pid % time_programs
    s0 = part * seg_len  # this program's rows: [s0, min(s0 + seg_len, T))
    s1 = jnp.minimum(s0 + seg_len, T)
    c0 = pc * bc
    cmask = c0 + jnp.arange(bc) < C
    cols = jnp.clip(c0 + jnp.arange(bc), 0, C - 1) if clip_cols else c0 + jnp.arange(bc)
    w = [pltriton.load(w_ref.at[jnp.int32(i), pl.ds(c0, bc)], mask=cmask, other=0.0) for i in range(K)]
    bias = pltriton.load(b_ref.at[pl.ds(c0, bc)], mask=cmask, other=0.0) if has_bias else None

    def row(ref, t):
        """Row ``t`` of this batch row as a ``[bc]`` fp32 vector; zeros outside ``[0, T)``."""
        idx = batch * T + jnp.clip(t, 0, T - 1)
        return pltriton.load(ref.at[idx, cols], mask=cmask & (t >= 0) & (t < T), other=0.0).astype(jnp.float32)

    def grad_pre(dy, xs):
        """``g = dy * act'(pre)`` with ``pre`` from the K rows ``xs`` (oldest first)."""
        if not silu:
            return dy
        pre = sum(w[i] * xs[i] for i in range(K))
        if bias is not None:
            pre = pre + bias
        sig = jax.nn.sigmoid(pre)
        return dy * sig * (1.0 + pre * (1.0 - sig))

    # prologue: x rows s1-K+1 .. s1-1 (the carry) and g of rows s1 .. s1+K-2 (past the segment)
    xw = [row(x_ref, s1 - K + 1 + j) for j in range(2 * K - 2)]  # rows s1-K+1 .. s1+K-2
    x_carry = tuple(xw[:K - 1])
    g_carry = tuple(grad_pre(row(dy_ref, s1 + j), xw[j:j + K]) for j in range(K - 1))

    def step(j, acc):
        x_carry, g_carry, dw, db = acc
        top = s1 - 1 - j * U  # this step's rows: top-U+1 .. top, ascending below
        xs = [row(x_ref, top - U - K + 2 + u) for u in range(U)] + list(x_carry)  # rows top-U-K+2 .. top
        gs = []
        for u in range(U):
            t = top - U + 1 + u
            ok = (t >= s0).astype(jnp.float32)  # rows before the segment belong to another program
            gs.append(grad_pre(row(dy_ref, t), xs[u:u + K]) * ok)
        gs += list(g_carry)  # rows top-U+1 .. top+K-1
        dw = list(dw)
        for u in range(U):
            t = top - U + 1 + u
            dx = sum(w[i] * gs[u + K - 1 - i] for i in range(K))
            pltriton.store(dx_ref.at[batch * T + jnp.clip(t, 0, T - 1), pl.ds(c0, bc)], dx.astype(dx_ref.dtype),
                           mask=cmask & (t >= s0))  # a slice: the interpreter's masked scatter writes every index
            for i in range(K):
                dw[i] = dw[i] + xs[u + i] * gs[u]
            db = db + gs[u]
        return tuple(xs[:K - 1]), tuple(gs[:K - 1]), tuple(dw), db

    zero = jnp.zeros((bc,), jnp.float32)
    acc = (x_carry, g_carry, tuple(zero for _ in range(K)), zero)
    _, _, dw, db = lax.fori_loop(0, steps, step, acc)
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
    seg_len = pl.cdiv(T, min(tp, T))  # rows per program
    parts = pl.cdiv(T, seg_len)
    kernel = functools.partial(_kernel, T=T, C=C, K=K, U=bt, bc=bc, seg_len=seg_len,
                               steps=pl.cdiv(seg_len, bt), time_programs=parts, silu=bool(silu),
                               has_bias=b is not None, clip_cols=_interpret(interpret))
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
