"""GDN's gated output norm: the one-pass kernels (hybrid_lm_kernels.gated_rms_norm_fwd / _bwd) against their
references (ops.norm), the custom VJP against autodiff of the plain norm, the padded input the kernel reads
in place, the GDN layer on the kernel, and the dispatch.

CPU: the kernels run in interpret mode (the same body as on the GPU). The Triton lowering is checked by
exporting for CUDA; the compiled GPU check is ``experiments/bench_gated_norm.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to_ref, triton_calls_for_cuda
from flax import nnx

from hybrid_lm.backends import gated_norm_kernel_backend
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.recurrent_common import GatedRMSNorm
from hybrid_lm.ops.norm import gated_rms_norm, gated_rms_norm_bwd_reference, gated_rms_norm_fwd_reference
from hybrid_lm_kernels import gated_rms_norm_bwd, gated_rms_norm_fwd

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _inputs(lead, d, W, dtype, seed):
    """x ``[*lead, W]`` whose columns past d are zero (a kernel's padded output), z and dy ``[*lead, d]``."""
    k = jax.random.split(jax.random.key(seed), 4)
    x = 3.0 * jax.random.normal(k[0], (*lead, d), jnp.float32)
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, W - d)]).astype(dtype)
    z = (2.0 * jax.random.normal(k[1], (*lead, d), jnp.float32)).astype(dtype)
    scale = 1.0 + 0.2 * jax.random.normal(k[2], (d,), jnp.float32)
    dy = jax.random.normal(k[3], (*lead, d), jnp.float32).astype(dtype)
    return x, z, scale, dy


@pytest.mark.parametrize("N,d,W,dtype,rows,programs", [
    (37, 24, 32, jnp.float32, 4, 3),      # row tail; padded input; uneven shares of blocks
    (64, 192, 256, jnp.bfloat16, 16, 1056),  # GDN's Dv in jla's width; more programs than blocks
    (50, 96, 96, jnp.float32, 8, 1),      # not padded, d not a power of two; one program
    (9, 20, 40, jnp.bfloat16, 1, 4),      # one row per block; W not a power of two
])
def test_equals_reference(N, d, W, dtype, rows, programs):
    x, z, scale, dy = _inputs((N,), d, W, dtype, seed=N + d)
    y, rstd = gated_rms_norm_fwd(x, z, scale, eps=1e-5, block_rows=rows, interpret=True)
    y_ref, rstd_ref = gated_rms_norm_fwd_reference(x, z, scale, 1e-5)
    assert y.dtype == z.dtype and y.shape == (N, d) and rstd.shape == (N,) and rstd.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(rstd_ref), rtol=1e-6)
    assert_close_to_ref(y, y_ref, dtype, 1e-6)
    dx, dz, dscale = gated_rms_norm_bwd(x, z, scale, rstd, dy, block_rows=rows, programs=programs, interpret=True)
    dx_ref, dz_ref, dscale_ref = gated_rms_norm_bwd_reference(x, z, scale, rstd_ref, dy)
    assert dx.dtype == x.dtype and dx.shape == (N, W) and dz.dtype == z.dtype and dz.shape == (N, d)
    assert not np.any(np.asarray(dx[:, d:], np.float32))  # the padded columns' gradient is zero
    assert_close_to_ref(dx, dx_ref, dtype, 1e-5)
    assert_close_to_ref(dz, dz_ref, dtype, 1e-5)
    assert_close_to_ref(dscale, dscale_ref, jnp.float32, 1e-5)  # fp32 sums in another order


def test_references_are_the_plain_norm_and_its_gradient():
    """The closed-form passes equal the plain norm and autodiff of it (fp32), on a padded input."""
    x, z, scale, dy = _inputs((3, 7), 48, 64, jnp.float32, seed=0)
    y, rstd = gated_rms_norm_fwd_reference(x, z, scale, 1e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(gated_rms_norm(x, z, scale, 1e-5)), rtol=1e-6)
    _, vjp = jax.vjp(lambda x, z, s: gated_rms_norm(x, z, s, 1e-5), x, z, scale)
    dx, dz, dscale = vjp(dy)
    dx_ref, dz_ref, dscale_ref = gated_rms_norm_bwd_reference(x, z, scale, rstd, dy)
    for a, e in ((dx_ref, dx), (dz_ref, dz), (dscale_ref, dscale)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,W", [(jnp.float32, 40), (jnp.bfloat16, 64)])
def test_custom_vjp_equals_autodiff_of_the_plain_norm(dtype, W):
    """gated_rms_norm(kernel='pallas') under grad equals kernel='xla' on a [B, T, H, W] input."""
    x, z, scale, dy = _inputs((2, 5, 3), 40, W, dtype, seed=3)
    out = {}
    for kern in ("xla", "pallas"):
        def f(x, z, s, kern=kern):
            return jnp.sum(gated_rms_norm(x, z, s, 1e-5, kern).astype(jnp.float32) * dy.astype(jnp.float32))
        out[kern] = jax.value_and_grad(f, argnums=(0, 1, 2))(x, z, scale)
    (vx, gx), (vp, gp) = out["xla"], out["pallas"]
    np.testing.assert_allclose(float(vp), float(vx), rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    for a, e in zip(gp, gx):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert_close_to_ref(a, e, dtype if a.dtype == dtype else jnp.float32, 1e-5)


def test_module_reads_the_padded_columns_in_place():
    """GatedRMSNorm (norm first, one group) on x padded past its dim equals it on the unpadded x, and
    keeps the plain math it had before the dispatch (fp32, bitwise on the CPU)."""
    x, z, _, _ = _inputs((2, 3, 4), 24, 32, jnp.float32, seed=5)
    norm = GatedRMSNorm(24, norm_before_gate=True)
    norm.scale[...] = 1.0 + jnp.arange(24) / 24.0
    np.testing.assert_array_equal(np.asarray(norm(x, z)), np.asarray(norm(x[..., :24], z)))
    xf = x[..., :24]
    plain = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm.eps) * norm.scale[...]
    np.testing.assert_array_equal(np.asarray(norm(x, z)), np.asarray(plain * jax.nn.silu(z)))
    with pytest.raises(ValueError, match="takes 24 columns"):
        GatedRMSNorm(24, norm_before_gate=False)(x, z)  # Mamba-2's form reads no padding


def test_gdn_layer_on_the_kernel_equals_the_plain_norm(monkeypatch):
    """A GDN layer with gated_norm_kernel='pallas': output and every parameter's gradient equal 'xla'."""
    import hybrid_lm_kernels
    from hybrid_lm.config import MixerConfig, ModelConfig
    from hybrid_lm.model.gated_deltanet import GatedDeltaNet

    calls = []
    real = hybrid_lm_kernels.gated_rms_norm_bwd
    monkeypatch.setattr(hybrid_lm_kernels, "gated_rms_norm_bwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 12, 64)), jnp.float32)
    out = {}
    for kern in ("xla", "pallas"):
        cfg = ModelConfig(d_model=64, n_heads=2, compute_dtype="float32", gated_norm_kernel=kern)
        layer = GatedDeltaNet(cfg, MixerConfig(kind="gdn", options={"chunk_size": 4}), 0, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer)
        loss = lambda params, x: jnp.sum(jnp.sin(nnx.merge(graphdef, params).forward(x)[0]))
        out[kern] = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    assert calls  # the kernel's backward ran
    for a, e in zip(jax.tree.leaves(out["pallas"]), jax.tree.leaves(out["xla"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)


def test_rejects_bad_inputs():
    x, z, scale, dy = _inputs((8,), 16, 32, jnp.float32, seed=0)
    with pytest.raises(ValueError, match=r"x \[N, W\] and z \[N, d\]"):
        gated_rms_norm_fwd(x[None], z, scale, eps=1e-5)
    with pytest.raises(ValueError, match="same N >= 1 rows"):
        gated_rms_norm_fwd(x[:4], z, scale, eps=1e-5)
    with pytest.raises(ValueError, match="d <= W"):
        gated_rms_norm_fwd(x[:, :8], z, scale, eps=1e-5)  # x narrower than the norm
    with pytest.raises(ValueError, match="scale"):
        gated_rms_norm_fwd(x, z, scale[:8], eps=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        gated_rms_norm_fwd(x, z, scale, eps=1e-5, block_rows=3)
    rstd = jnp.ones((8,))
    with pytest.raises(ValueError, match="dy"):
        gated_rms_norm_bwd(x, z, scale, rstd, dy[:4])
    with pytest.raises(ValueError, match="rstd"):
        gated_rms_norm_bwd(x, z, scale, rstd[:4], dy)
    with pytest.raises(ValueError, match="at least its width"):
        gated_rms_norm(x[:, :8], z, scale, 1e-5)
    with pytest.raises(ValueError, match="choose 'xla' or 'pallas'"):
        gated_rms_norm(x, z, scale, 1e-5, kernel="triton")


def test_backend_rule_and_config():
    from hybrid_lm.experiment import load_config

    assert gated_norm_kernel_backend("auto", "gpu", devices=2)[0] == "xla"  # no sharding rule
    assert gated_norm_kernel_backend("auto", "cpu")[0] == "xla"
    assert gated_norm_kernel_backend("pallas", "cpu")[0] == "pallas"  # interpreted (tests)
    with pytest.raises(ConfigError, match="gated_norm_kernel"):
        gated_norm_kernel_backend("triton")
    assert load_config([], ["ModelConfig.gated_norm_kernel = 'pallas'"]).model.gated_norm_kernel == "pallas"
    with pytest.raises(ConfigError):
        load_config([], ["ModelConfig.gated_norm_kernel = 'fast'"])


def test_startup_summary_names_the_gdn_norm_for_gdn_only():
    from types import SimpleNamespace

    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.logger import startup_summary

    data = SimpleNamespace(meta={}, n_train_windows=4, eval_tokens=[0])
    mesh = SimpleNamespace(shape={"data": 1}, devices=np.zeros(1))
    lines = {k: startup_summary(load_config([], b), data, mesh) for k, b in (
        ("gdn", ["efficient/MixerConfig.kind = 'gdn'", "ModelConfig.gated_norm_kernel = 'pallas'"]),
        ("mamba2", ["efficient/MixerConfig.kind = 'mamba2'"]))}
    norm = [line for line in lines["gdn"] if "gdn output norm" in line]
    assert norm == ["backend  gdn output norm: pallas (gated_norm_kernel='pallas' set explicitly)"]
    assert not any("gdn output norm" in line for line in lines["mamba2"])


def test_lowers_for_cuda():
    """Both kernels lower through Triton for sm_90 at S5 GDN's output (4 x 16,384 x 10 heads, Dv 192 read
    from jla's 256 columns, bf16)."""
    N = 4 * 16384 * 10
    x = jax.ShapeDtypeStruct((N, 256), jnp.bfloat16)
    z = jax.ShapeDtypeStruct((N, 192), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((192,), jnp.float32)
    r = jax.ShapeDtypeStruct((N,), jnp.float32)

    def both(x, z, s, r, dy):
        y, rstd = gated_rms_norm_fwd(x, z, s, eps=1e-5, interpret=False)
        return y, rstd, gated_rms_norm_bwd(x, z, s, r, dy, interpret=False)

    assert triton_calls_for_cuda(jax.jit(both), x, z, s, r, z) == 2
