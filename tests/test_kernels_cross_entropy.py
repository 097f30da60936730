"""The chunked loss's softmax pass as a Pallas kernel (hybrid_lm_kernels.softmax_xent_rows) against its
reference (ops.cross_entropy.softmax_xent_rows_reference), and the chunked loss on it.

CPU: the kernel runs in interpret mode (the same body as on the GPU). The Triton lowering is checked
by exporting for CUDA; the compiled GPU check is ``tests/gpu/test_gpu_kernels.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import triton_calls_for_cuda

from hybrid_lm.ops.cross_entropy import chunked_cross_entropy, softmax_xent_rows_reference
from hybrid_lm_kernels import softmax_xent_rows

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _rows(N, V, dtype, scale, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (scale * jax.random.normal(k[0], (N, V), jnp.float32)).astype(dtype)
    t = jax.random.randint(k[1], (N,), 0, V)
    w = jax.random.uniform(k[2], (N,), jnp.float32, 0.1, 1.0)
    return x, t, w


@pytest.mark.parametrize("N,V,dtype,rows,cols,z,scale", [
    (37, 1000, jnp.float32, 1, 256, 0.0, 3.0),     # V a multiple of nothing, one row per program
    (64, 77, jnp.bfloat16, 4, 32, 1e-3, 3.0),      # row tail in the last program, tiny vocab
    (5, 4096, jnp.float32, 2, 1024, 1e-2, 30.0),   # large logits: the online max must rescale
    (19, 300, jnp.bfloat16, 8, 512, 0.0, 1.0),     # one column tile wider than V, rows > N per program
])
def test_equals_reference(N, V, dtype, rows, cols, z, scale):
    x, t, w = _rows(N, V, dtype, scale, seed=N + V)
    d, lse, tgt = softmax_xent_rows(x, t, w, z_loss=z, block_rows=rows, block_cols=cols, interpret=True)
    d_ref, lse_ref, tgt_ref = softmax_xent_rows_reference(x, t, w, z)
    assert d.dtype == x.dtype and d.shape == x.shape and lse.shape == tgt.shape == (N,)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(tgt), np.asarray(tgt_ref))  # the same element, picked
    # fp32 statistics summed in another order; the gradient rounded to the logits' dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(d_ref, np.float32), atol=tol * float(jnp.max(w)))
    # each row of the gradient sums to w * 2 z lse (softmax sums to one, minus the one-hot)
    row_sums = np.asarray(jnp.sum(d.astype(jnp.float32), axis=1))
    np.testing.assert_allclose(row_sums, np.asarray(w * 2 * z * lse_ref), atol=50 * tol)


def test_rejects_bad_inputs():
    x, t, w = _rows(8, 40, jnp.float32, 1.0, 0)
    with pytest.raises(ValueError, match=r"logits \[N, V\]"):
        softmax_xent_rows(x[None], t, w)
    with pytest.raises(ValueError, match="must both be"):
        softmax_xent_rows(x, t[:4], w)
    with pytest.raises(ValueError, match="powers of two"):
        softmax_xent_rows(x, t, w, block_rows=3)


@pytest.mark.parametrize("N,chunk,z", [(300, 128, 1e-3), (96, 1000, 0.0)])
def test_chunked_loss_on_the_kernel_equals_xla(N, chunk, z):
    """The chunked loss and its gradients with the softmax pass on the kernel equal the XLA pass."""
    d, V = 16, 333
    k = jax.random.split(jax.random.key(N), 3)
    h = jax.random.normal(k[0], (N, d), jnp.float32)
    wh = 0.3 * jax.random.normal(k[1], (d, V), jnp.float32)
    t = jax.random.randint(k[2], (N,), 0, V)
    out = {}
    for kern in ("xla", "pallas"):
        out[kern] = jax.value_and_grad(lambda h, wh, kern=kern: chunked_cross_entropy(
            h, wh, t, z, chunk=chunk, kernel=kern)[0], argnums=(0, 1))(h, wh)
    (lx, gx), (lp, gp) = out["xla"], out["pallas"]
    np.testing.assert_allclose(float(lp), float(lx), rtol=1e-6)
    for a, b in zip(gx, gp):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))


def test_unknown_kernel_is_refused():
    h, wh, t = jnp.ones((4, 2)), jnp.ones((2, 3)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="choose 'xla' or 'pallas'"):
        chunked_cross_entropy(h, wh, t, kernel="triton")


def test_lowers_for_cuda():
    """The kernel lowers through Triton for sm_90 at a chunk of S5's loss (8,192 x 73,448 bf16)."""
    x = jax.ShapeDtypeStruct((8192, 73448), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((8192,), jnp.int32)
    w = jax.ShapeDtypeStruct((8192,), jnp.float32)
    fn = jax.jit(lambda x, t, w: softmax_xent_rows(x, t, w, z_loss=1e-4, interpret=False))
    assert triton_calls_for_cuda(fn, x, t, w) == 1


def test_loss_kernel_backend_rule():
    """The softmax pass runs the Pallas kernel on one GPU, XLA elsewhere; ``jla`` is no longer a choice."""
    from hybrid_lm import backends

    assert backends.loss_kernel_backend("auto", "gpu", devices=1)[0] == "pallas"
    assert backends.loss_kernel_backend("auto", "gpu", devices=2)[0] == "xla"
    assert backends.loss_kernel_backend("auto", "cpu")[0] == "xla"
    assert backends.loss_kernel_backend("pallas", "cpu")[0] == "pallas"  # interpreted (tests)
    for removed in ("jla", "cuda"):
        with pytest.raises(ValueError, match="choose one of"):
            backends.loss_kernel_backend(removed)
