"""RMSNorm's one-pass kernels (hybrid_lm_kernels.rms_norm_fwd / rms_norm_bwd) against their references
(ops.norm), the custom VJP against autodiff of the plain norm, and a model on the kernels.

CPU: the kernels run in interpret mode (the same body as on the GPU). The Triton lowering is checked
by exporting for CUDA; the compiled GPU check is ``experiments/bench_norm.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to_ref, triton_calls_for_cuda

from hybrid_lm.backends import loss_kernel_backend, norm_kernel_backend
from hybrid_lm.errors import ConfigError
from hybrid_lm.ops.norm import rms_norm, rms_norm_bwd_reference, rms_norm_fwd_reference
from hybrid_lm_kernels import rms_norm_bwd, rms_norm_fwd

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _inputs(shape, dtype, seed, x_scale=3.0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (x_scale * jax.random.normal(k[0], shape, jnp.float32)).astype(dtype)
    scale = 1.0 + 0.2 * jax.random.normal(k[1], (shape[-1],), jnp.float32)
    dy = jax.random.normal(k[2], shape, jnp.float32).astype(dtype)
    return x, scale, dy


@pytest.mark.parametrize("N,d,dtype,rows,programs", [
    (37, 96, jnp.float32, 4, 3),       # row tail; d not a power of two; programs with uneven shares
    (64, 384, jnp.bfloat16, 2, 528),   # S1's width; more programs asked for than row blocks
    (5, 1280, jnp.float32, 8, 1),      # S5's width; one block larger than N, one program
    (130, 20, jnp.bfloat16, 1, 7),     # narrow rows, one row per block
])
def test_equals_reference(N, d, dtype, rows, programs):
    x, scale, dy = _inputs((N, d), dtype, seed=N + d)
    y, rstd = rms_norm_fwd(x, scale, eps=1e-6, block_rows=rows, interpret=True)
    y_ref, rstd_ref = rms_norm_fwd_reference(x, scale, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape and rstd.shape == (N,) and rstd.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(rstd_ref), rtol=1e-6)
    assert_close_to_ref(y, y_ref, dtype, 1e-6)
    dx, dscale = rms_norm_bwd(x, scale, rstd, dy, block_rows=rows, programs=programs, interpret=True)
    dx_ref, dscale_ref = rms_norm_bwd_reference(x, scale, rstd_ref, dy)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dscale.shape == (d,)
    assert_close_to_ref(dx, dx_ref, dtype, 1e-5)
    assert_close_to_ref(dscale, dscale_ref, jnp.float32, 1e-5)  # fp32 sums in another order


def test_references_are_the_plain_norm_and_its_gradient():
    """The closed-form passes equal the plain norm and autodiff of it (fp32)."""
    x, scale, dy = _inputs((3, 7, 48), jnp.float32, seed=0)
    y, rstd = rms_norm_fwd_reference(x, scale, 1e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(rms_norm(x, scale, 1e-5)), rtol=1e-6)
    _, vjp = jax.vjp(lambda x, s: rms_norm(x, s, 1e-5), x, scale)
    dx, dscale = vjp(dy)
    dx_ref, dscale_ref = rms_norm_bwd_reference(x, scale, rstd, dy)
    np.testing.assert_allclose(np.asarray(dx_ref), np.asarray(dx), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dscale_ref), np.asarray(dscale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_custom_vjp_equals_autodiff_of_the_plain_norm(dtype):
    """rms_norm(kernel='pallas') under grad equals kernel='xla' on a [B, T, d] input."""
    x, scale, dy = _inputs((2, 9, 160), dtype, seed=3)
    out = {}
    for kern in ("xla", "pallas"):
        def f(x, s, kern=kern):
            return jnp.sum(rms_norm(x, s, 1e-6, kern).astype(jnp.float32) * dy.astype(jnp.float32))
        out[kern] = jax.value_and_grad(f, argnums=(0, 1))(x, scale)
    (vx, (dxx, dsx)), (vp, (dxp, dsp)) = out["xla"], out["pallas"]
    np.testing.assert_allclose(float(vp), float(vx), rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    assert dxp.dtype == dtype and dsp.dtype == jnp.float32
    assert_close_to_ref(dxp, dxx, dtype, 1e-5)
    assert_close_to_ref(dsp, dsx, jnp.float32, 1e-5)  # fp32 sums of dy * xhat on both sides


def test_rejects_bad_inputs():
    x, scale, dy = _inputs((8, 16), jnp.float32, seed=0)
    with pytest.raises(ValueError, match=r"x \[N, d\]"):
        rms_norm_fwd(x[None], scale, eps=1e-6)
    with pytest.raises(ValueError, match="scale"):
        rms_norm_fwd(x, scale[:8], eps=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_fwd(x, scale, eps=1e-6, block_rows=3)
    with pytest.raises(ValueError, match="N >= 1"):
        rms_norm_fwd(x[:0], scale, eps=1e-6)
    rstd = jnp.ones((8,))
    with pytest.raises(ValueError, match="dy"):
        rms_norm_bwd(x, scale, rstd, dy[:4])
    with pytest.raises(ValueError, match="dy"):
        rms_norm_bwd(x, scale, rstd, dy.astype(jnp.bfloat16))  # a cotangent in another dtype than x
    with pytest.raises(ValueError, match="rstd"):
        rms_norm_bwd(x, scale, rstd[:4], dy)
    with pytest.raises(ValueError, match="choose 'xla' or 'pallas'"):
        rms_norm(x, scale, 1e-6, kernel="triton")


def test_backend_rule_and_config():
    from hybrid_lm.experiment import load_config

    assert loss_kernel_backend("auto", "gpu", devices=1)[0] == "pallas"
    assert norm_kernel_backend("auto", "gpu", devices=1)[0] == "xla"  # opt-in: no step gain measured
    for rule, field in ((norm_kernel_backend, "norm_kernel"), (loss_kernel_backend, "loss_kernel")):
        assert rule("auto", "gpu", devices=2) == ("xla", "auto: 2 devices (the kernel has no sharding rule)")
        assert rule("auto", "cpu")[0] == "xla"
        assert rule("pallas", "cpu")[0] == "pallas"  # interpreted (tests)
        assert rule("xla", "gpu", devices=1)[0] == "xla"
        with pytest.raises(ConfigError, match=field):
            rule("cuda")
        assert getattr(load_config([], [f"ModelConfig.{field} = 'xla'"]).model, field) == "xla"
        with pytest.raises(ConfigError):
            load_config([], [f"ModelConfig.{field} = 'fast'"])


def test_dots_attn_recomputes_the_norm_kernel():
    """remat 'dots_attn' saves Pallas attention kernels' outputs but not the norm kernel's (recomputed in
    the backward pass, as XLA's norm is: saving it cost 0.31 GiB per norm at S5 for no step time)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from hybrid_lm.model.transformer import _REMAT_POLICIES

    x, scale, _ = _inputs((2, 16, 32), jnp.float32, seed=0)

    def saved(policy):
        f = jax.checkpoint(lambda x, s: (rms_norm(x, s, 1e-6, "pallas") ** 2).sum(), policy=policy)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(f, x, scale)
        return [line for line in buf.getvalue().splitlines() if "pallas_call" in line or "rms_norm_fwd" in line]

    assert saved(_REMAT_POLICIES["dots_attn"]) == []
    # saving every value keeps the kernel's outputs: the check can see them
    assert saved(jax.checkpoint_policies.everything_saveable) != []


def test_lowers_for_cuda():
    """Both kernels lower through Triton for sm_90 at S5's activations (131,072 x 1,280 bf16)."""
    x = jax.ShapeDtypeStruct((131072, 1280), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1280,), jnp.float32)
    r = jax.ShapeDtypeStruct((131072,), jnp.float32)

    def both(x, s, r, dy):
        y, rstd = rms_norm_fwd(x, s, eps=1e-6, interpret=False)
        return y, rstd, rms_norm_bwd(x, s, r, dy, interpret=False)

    assert triton_calls_for_cuda(jax.jit(both), x, s, r, x) == 2
