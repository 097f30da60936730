"""The two small kernels compiled for the GPU against their references: the loss's softmax pass
(``softmax_xent_rows``) and the short causal conv's one-pass backward (``short_conv_bwd``), on row / time tails
no launch divides. Interpret-mode twins: ``tests/test_kernels_cross_entropy.py``,
``tests/test_kernels_short_conv.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_util import GPU, rel_err

from hybrid_lm.ops.cross_entropy import softmax_xent_rows_reference

pytestmark = GPU


@pytest.mark.parametrize("rows,vocab", [(3003, 73448), (517, 32768), (64, 1000)])
def test_softmax_pass_against_the_reference(rows, vocab):
    from hybrid_lm_kernels import softmax_xent_rows

    k = jax.random.split(jax.random.key(rows), 3)
    logits = (4.0 * jax.random.normal(k[0], (rows, vocab), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(k[1], (rows,), 0, vocab)
    weights = jax.random.uniform(k[2], (rows,), jnp.float32) / rows
    d_ref, lse_ref, tgt_ref = jax.jit(softmax_xent_rows_reference, static_argnums=3)(logits, targets, weights, 1e-4)
    d, lse, tgt = jax.jit(lambda x, t, w: softmax_xent_rows(x, t, w, z_loss=1e-4))(logits, targets, weights)
    # fp32 statistics summed in another order: lse to ~1e-5 of its size; bf16 dlogits to rounding
    assert float(jnp.max(jnp.abs(lse - lse_ref))) < 1e-3
    assert float(jnp.max(jnp.abs(tgt - tgt_ref))) == 0.0
    assert rel_err(d, d_ref) < 1e-2


def _conv(x, w, b):
    """Causal depthwise conv (+ bias) + SiLU from zero history, fp32 sums, output in x's dtype."""
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
    y = sum(xp[:, i:i + x.shape[1]] * w[i] for i in range(w.shape[0]))
    return jax.nn.silu(y if b is None else y + b).astype(x.dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias (GDN)", "bias (Mamba-2)"])
@pytest.mark.parametrize("T,C", [(4099, 960), (1027, 2816)])
def test_conv_backward_against_autodiff(T, C, bias):
    from hybrid_lm_kernels import short_conv_bwd

    k = jax.random.split(jax.random.key(C), 4)
    x = jax.random.normal(k[0], (2, T, C), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.uniform(k[1], (4, C), jnp.float32, -0.5, 0.5)
    b = jax.random.normal(k[2], (C,), jnp.float32) if bias else None
    dy = jax.random.normal(k[3], (2, T, C), jnp.float32).astype(jnp.bfloat16)
    if bias:
        _, pull = jax.vjp(_conv, x, w, b)
        dx_r, dw_r, db_r = pull(dy)
    else:
        _, pull = jax.vjp(lambda x, w: _conv(x, w, None), x, w)
        (dx_r, dw_r), db_r = pull(dy), None
    dx, dw, db = jax.jit(lambda x, dy, w, b: short_conv_bwd(x, dy, w, b, silu=True))(x, dy, w, b)
    assert bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32))))
    assert rel_err(dx, dx_r) < 1e-2  # dx rounded to bf16 on both sides
    assert rel_err(dw, dw_r) < 1e-3
    if bias:
        assert rel_err(db, db_r) < 1e-3
