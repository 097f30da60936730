"""The softmax cross-entropy pass over rows of logits, in two reads and one write (Pallas, Triton lowering).

``softmax_xent_rows(logits [N, V], targets [N], weights [N], z_loss)`` returns ``(dlogits [N, V],
lse [N], target_logit [N])``: each row's log-sum-exp, its target's logit, and the gradient of
``weight * (lse - target_logit + z_loss * lse**2)`` with respect to the row,
``weight * (softmax * (1 + 2 z_loss lse) - onehot(target))``, in the logits' dtype.

The chunked loss (``hybrid_lm.ops.cross_entropy``) computes this between the head's matmuls, once per
chunk of tokens. XLA does it in three passes over a chunk's ``[chunk, V]`` logits (a max, a sum of
exponentials, then the gradient), each a separate kernel, and its row reductions over 73,448 columns
run well below memory bandwidth (H200, S1 at 8 x 16K: 1.85 ms per 8,192-token chunk, 14% of the
step). Here one program takes ``block_rows`` rows: a first loop
over column tiles keeps the online (max, sum of exponentials) and picks the target's logit, a second
loop re-reads the tiles and writes the gradient. Bytes moved: the logits twice, the gradient once.

Tails (``N`` or ``V`` not a multiple of the tile) are masked loads and stores. Statistics are fp32.
This module does not import ``hybrid_lm``; ``interpret=True`` runs the same kernel on the CPU. The
reference is ``hybrid_lm.ops.cross_entropy.softmax_xent_rows_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import MASK_VALUE, cdiv as _cdiv, next_pow2 as _next_pow2

# Default launch: rows per program, columns per tile, warps. H200, one 8,192 x 73,448 bf16 chunk
# (`experiments/bench_kernels.py`): 1:2048:4 1.139 ms, 1:4096:4 1.166, 1:4096:8 1.175, 1:1024:4 1.234,
# 1:8192:8 1.241, 2:2048:8 1.358, 4:1024:8 1.389, 2:4096:8 1.420; XLA's passes 1.735 ms.
XENT_BLOCK_ROWS = 1
XENT_BLOCK_COLS = 2048
XENT_NUM_WARPS = 4


def _xent_kernel(x_ref, t_ref, w_ref, dx_ref, lse_ref, tgt_ref, *, n_rows, n_cols, br, bv, z_loss):
    r0 = pl.program_id(0) * br
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br,), 0)
    row_ok = rows < n_rows
    t = pltriton.load(t_ref.at[pl.ds(r0, br)], mask=row_ok, other=-1)
    w = pltriton.load(w_ref.at[pl.ds(r0, br)], mask=row_ok, other=0.0)
    col = lax.broadcasted_iota(jnp.int32, (br, bv), 1)

    def tile(j):
        cols = j * bv + col
        mask = row_ok[:, None] & (cols < n_cols)
        x = pltriton.load(x_ref.at[pl.ds(r0, br), pl.ds(j * bv, bv)], mask=mask, other=MASK_VALUE)
        return cols, mask, x.astype(jnp.float32)

    def stats(j, carry):  # online softmax statistics and the target's logit
        m, s, tg = carry
        cols, _, x = tile(j)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        tg = tg + jnp.sum(jnp.where(cols == t[:, None], x, 0.0), axis=1)
        return m_new, s, tg

    n_tiles = _cdiv(n_cols, bv)
    zeros = jnp.zeros((br,), jnp.float32)
    m, s, tg = lax.fori_loop(0, n_tiles, stats, (jnp.full((br,), MASK_VALUE, jnp.float32), zeros, zeros))
    lse = m + jnp.log(s)
    coef = (w * (1.0 + 2.0 * z_loss * lse))[:, None]

    def grad(j, carry):
        cols, mask, x = tile(j)
        d = jnp.exp(x - lse[:, None]) * coef - jnp.where(cols == t[:, None], w[:, None], 0.0)
        pltriton.store(dx_ref.at[pl.ds(r0, br), pl.ds(j * bv, bv)], d.astype(dx_ref.dtype), mask=mask)
        return carry

    lax.fori_loop(0, n_tiles, grad, jnp.int32(0))
    pltriton.store(lse_ref.at[pl.ds(r0, br)], lse, mask=row_ok)
    pltriton.store(tgt_ref.at[pl.ds(r0, br)], tg, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("z_loss", "block_rows", "block_cols", "num_warps", "interpret"))
def softmax_xent_rows(logits, targets, weights, *, z_loss: float = 0.0, block_rows: int | None = None,
                      block_cols: int | None = None, num_warps: int | None = None, interpret: bool | None = None):
    """``(dlogits [N, V] in logits.dtype, lse [N] f32, target_logit [N] f32)`` of ``logits [N, V]``
    (bf16 or fp32), int ``targets [N]`` in ``[0, V)`` and fp32 ``weights [N]``:
    ``dlogits = weights * (softmax(logits) * (1 + 2 z_loss lse) - onehot(targets))``. No gradient
    flows through this function (it *is* the gradient pass)."""
    if logits.ndim != 2:
        raise ValueError(f"expected logits [N, V], got shape {logits.shape}")
    N, V = logits.shape
    if targets.shape != (N,) or weights.shape != (N,):
        raise ValueError(f"targets {targets.shape} and weights {weights.shape} must both be ({N},)")
    br = block_rows or XENT_BLOCK_ROWS
    bv = min(block_cols or XENT_BLOCK_COLS, _next_pow2(V))
    if br & (br - 1) or bv & (bv - 1):
        raise ValueError(f"block_rows={br} and block_cols={bv} must be powers of two")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    kernel = functools.partial(_xent_kernel, n_rows=N, n_cols=V, br=br, bv=bv, z_loss=float(z_loss))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, br),),
        out_shape=(jax.ShapeDtypeStruct((N, V), logits.dtype), jax.ShapeDtypeStruct((N,), jnp.float32),
                   jax.ShapeDtypeStruct((N,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or XENT_NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="softmax_xent_rows",
    )(lax.stop_gradient(logits), targets.astype(jnp.int32), lax.stop_gradient(weights).astype(jnp.float32))
