"""Tile math shared by the attention kernels (Pallas, Triton lowering): scores, the online-softmax
update of the forward pass, and the softmax backward of one tile. Softmax runs in log2 units
(``qk_scale = scale * log2(e)``, ``exp2``) with fp32 statistics; masked logits are a finite
``MASK_VALUE`` so that a fully masked row never computes ``inf - inf``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
# Finite "minus infinity": masked logits never make inf - inf = NaN in the running max.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def interpret_default(interpret: bool | None) -> bool:
    """A kernel's ``interpret`` argument: None means interpret on a CPU backend, compile elsewhere."""
    return jax.default_backend() == "cpu" if interpret is None else interpret


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    """Ceiling division of non-negative int32 scalars (traced or not)."""
    return lax.div(a + b - 1, b)


def precision_for(dtype):
    """fp32 inputs: full-precision dots (Triton would otherwise use tf32); bf16/fp16: default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def scores(q, k, qk_scale, precision, mask=None):
    """``[bq, bk]`` logits in log2 units, ``MASK_VALUE`` where ``mask`` is False."""
    s = pltriton.dot(q, k, trans_b=True, precision=precision) * qk_scale
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def softmax_init(bq: int, d: int):
    """Carry of the online softmax: (accumulator, running max, running sum)."""
    return (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))


def softmax_update(carry, s, v, precision):
    """Adds one key tile (logits ``s``, values ``v``) to the online softmax."""
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    corr = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_prev * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_next, l_next


def softmax_finish(carry, dtype):
    """``(o in dtype, lse in log2 units)`` from the online-softmax carry."""
    acc, m, l = carry
    return (acc / l[:, None]).astype(dtype), m + jnp.log2(l)


def softmax_backward(s, lse, do, v, delta, precision):
    """``(p, ds)`` of one tile: probabilities from the saved lse, and ``ds = p * (dp - delta)`` with
    ``dp = do v^T`` (``delta = rowsum(o * do)``). dq += ds k, dk += ds^T q, dv += p^T do."""
    p = jnp.exp2(s - lse[:, None])
    dp = pltriton.dot(do, v, trans_b=True, precision=precision)
    return p, p * (dp - delta[:, None])


def row_delta(o, do):
    """``rowsum(o * do)`` in fp32."""
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=1)


# ------------------------------------------------------------------------------------------------
# Query-side pallas_call plumbing (forward and dQ kernels of both attention kernels)
# ------------------------------------------------------------------------------------------------

def q_tile_spec(bq: int, d: int):
    """``[B, T, H, D]`` -> the program's ``[bq, D]`` tile (grid ``(query tile, batch, head)``)."""
    return pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))


def kv_spec(t: int, d: int, group: int):
    """``[B, T, K, D]`` -> the whole sequence of the program's KV head (``h // group``)."""
    return pl.BlockSpec((None, t, None, d), lambda i, b, h: (b, 0, h // group, 0))


def row_spec(bq: int):
    """``[B, H, T]`` row statistics (lse, delta) -> the program's ``[bq]`` slice."""
    return pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))


def query_tile_call(kernel, args, in_specs, *, q, bq, num_warps, num_stages, interpret, name):
    """``pallas_call`` over ``(query tile, batch, head)`` programs that write a ``[bq, D]`` tile like
    q (o or dq) and a ``[bq]`` fp32 row statistic (lse or delta, as ``[B, H, T]``)."""
    B, T, H, D = q.shape
    return pl.pallas_call(
        kernel,
        grid=(T // bq, B, H),
        in_specs=in_specs,
        out_specs=[q_tile_spec(bq, D), row_spec(bq)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def key_tile_inputs(q, k, v, do, lse, delta, bk: int):
    """``(in_specs, args)`` of the six standard inputs of a dK/dV program over ``(key tile, batch, kv
    head)``: the whole sequence of the KV head's query group (q, do as ``[T, G, D]``, lse and delta as
    ``[G, T]``) and the program's ``[bk, D]`` tiles of k and v."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    group = pl.BlockSpec((None, T, None, G, D), lambda i, b, h: (b, 0, h, 0, 0))
    rows = pl.BlockSpec((None, None, G, T), lambda i, b, h: (b, h, 0, 0))
    tile = pl.BlockSpec((None, bk, None, D), lambda i, b, h: (b, i, h, 0))
    args = [q.reshape(B, T, K, G, D), k, v, do.reshape(B, T, K, G, D), lse.reshape(B, K, G, T),
            delta.reshape(B, K, G, T)]
    return [group, tile, tile, group, rows, rows], args


def key_tile_outputs(k, v, bk: int):
    """``(out_specs, out_shape)`` of dk, dv: the program's ``[bk, D]`` tiles."""
    tile = pl.BlockSpec((None, bk, None, k.shape[-1]), lambda i, b, h: (b, i, h, 0))
    return [tile, tile], [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
