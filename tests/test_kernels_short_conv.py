"""The short conv's one-pass backward kernel (hybrid_lm_kernels.short_conv_bwd) against the jnp backward
(model.recurrent_common), the conv on the kernel against autodiff of the plain conv, and the dispatch.

CPU: the kernel runs in interpret mode (the same body as on the GPU). The Triton lowering is checked by
exporting for CUDA; the GPU check is ``tests/gpu/test_gpu_kernels.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import triton_calls_for_cuda
from flax import nnx

from hybrid_lm.backends import conv_kernel_backend
from hybrid_lm.model import recurrent_common as rc
from hybrid_lm_kernels import short_conv_bwd

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _inputs(B, T, C, K, dtype, bias, seed):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(B, T, C)), dtype)
    w = jnp.asarray(r.normal(size=(K, C)) / K, jnp.float32)
    b = jnp.asarray(r.normal(size=(C,)), jnp.float32) if bias else None
    dy = jnp.asarray(r.normal(size=(B, T, C)), dtype)
    return x, w, b, dy


@pytest.mark.parametrize("B,T,C,K,dtype,bias,silu,bt,bc,programs", [
    # time and channel tails, uneven shares
    pytest.param(2, 37, 20, 4, jnp.float32, True, True, 8, 16, 3, marks=pytest.mark.integration),
    (1, 5, 7, 4, jnp.bfloat16, False, True, 8, 8, 8),      # T < one block; more programs than blocks
    (2, 16, 33, 2, jnp.float32, True, False, 4, 32, 2),    # no activation; K = 2
    (3, 9, 5, 1, jnp.bfloat16, True, True, 8, 8, 1),       # K = 1 (no history), one program per row
    pytest.param(1, 70, 96, 4, jnp.bfloat16, False, True, 16, 64, 4, marks=pytest.mark.integration),  # GDN-like
    (2, 2, 5, 4, jnp.float32, True, True, 8, 8, 1),        # T < K - 1
    (2, 1, 3, 4, jnp.float32, False, True, 4, 4, 2),       # one token
    (1, 23, 12, 4, jnp.float32, True, True, 2, 8, 2),      # fewer rows per step than K - 1 (carries span steps)
    (2, 11, 9, 3, jnp.bfloat16, False, True, 1, 16, 4),    # one row per step
])
def test_equals_the_jnp_backward(B, T, C, K, dtype, bias, silu, bt, bc, programs):
    x, w, b, dy = _inputs(B, T, C, K, dtype, bias, seed=B + T + C)
    dx, dw, db = short_conv_bwd(x, dy, w, b, silu=silu, block_t=bt, block_c=bc, time_programs=programs,
                                interpret=True)
    dx_ref, dw_ref, db_ref = rc._short_conv_bwd("silu" if silu else None, "xla", (x, w, b), dy)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dw.shape == (K, C) and db.shape == (C,)
    # fp32 sums in another order; bf16 dx may differ by one rounding step
    tol = 2e-5 if dtype == jnp.float32 else 2 ** -7
    big = float(jnp.max(jnp.abs(dx_ref.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), atol=big * tol)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-4)
    if bias:
        np.testing.assert_allclose(np.asarray(db), np.asarray(db_ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_on_the_kernel_equals_autodiff_of_the_plain_conv(bias, monkeypatch):
    """ShortConv with conv_kernel='pallas': output, tail state and gradients (input, weight, bias) equal
    autodiff of the reference form."""
    import hybrid_lm_kernels

    conv = rc.ShortConv(24, 4, rngs=nnx.Rngs(0), bias=bias, kernel="pallas")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 19, 24)), jnp.float32)
    graphdef, params = nnx.split(conv)
    calls = []
    real = hybrid_lm_kernels.short_conv_bwd
    monkeypatch.setattr(hybrid_lm_kernels, "short_conv_bwd", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        loss = lambda params, x: jnp.sum(jnp.sin(nnx.merge(graphdef, params)(x)[0]))
        return conv(x), jax.grad(loss, argnums=(0, 1))(params, x)

    fast = run()
    assert calls  # the kernel ran
    monkeypatch.setattr(rc, "SHORT_CONV_VJP", False)  # autodiff of the plain conv
    ref = run()
    for a, e in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)


def test_rejects_bad_inputs():
    x, w, b, dy = _inputs(2, 8, 6, 4, jnp.float32, True, seed=0)
    with pytest.raises(ValueError, match=r"x \[B, T, C\]"):
        short_conv_bwd(x[0], dy[0], w, b, silu=True)
    with pytest.raises(ValueError, match="dy"):
        short_conv_bwd(x, dy[:, :4], w, b, silu=True)
    with pytest.raises(ValueError, match=r"w \(4, 5\)"):
        short_conv_bwd(x, dy, w[:, :5], b, silu=True)
    with pytest.raises(ValueError, match="1 <= K <= 8"):
        short_conv_bwd(x, dy, jnp.zeros((9, 6)), b, silu=True)
    with pytest.raises(ValueError, match=r"b \(5,\)"):
        short_conv_bwd(x, dy, w, b[:5], silu=True)
    with pytest.raises(ValueError, match="block_t=3 must be a power of two"):
        short_conv_bwd(x, dy, w, b, silu=True, block_t=3)
    with pytest.raises(ValueError, match="num_warps=3 must be a power of two"):
        short_conv_bwd(x, dy, w, b, silu=True, num_warps=3)
    with pytest.raises(ValueError, match="time_programs=0 must be >= 1"):
        short_conv_bwd(x, dy, w, b, silu=True, time_programs=0)
    with pytest.raises(ValueError, match="every axis"):
        short_conv_bwd(x[:, :0], dy[:, :0], w, b, silu=True)
    with pytest.raises(ValueError, match="choose 'xla' or 'pallas'"):
        rc._short_conv_bwd("silu", "cuda", (x, w, b), dy)


def test_backend_rule():
    assert conv_kernel_backend("auto", "gpu", devices=1)[0] == "pallas"  # faster in the train step
    assert conv_kernel_backend("auto", "cpu")[0] == "xla"
    assert conv_kernel_backend("auto", "gpu", devices=2)[0] == "xla"
    assert conv_kernel_backend("pallas", "cpu")[0] == "pallas"  # interpreted (tests)
    with pytest.raises(ValueError, match="choose one of"):
        conv_kernel_backend("triton")


@pytest.mark.parametrize("C,bias", [(960, False), (2816, True)])
def test_lowers_for_cuda(C, bias):
    """The kernel lowers through Triton for sm_90 at S5 GDN's q conv (8 x 16,384 x 960 bf16, no bias) and
    S5 Mamba-2's conv (2,816 channels, with its default bias). Only the Triton call is emitted here; its
    compile is checked on the GPU (tests/gpu/test_gpu_kernels.py)."""
    x = jax.ShapeDtypeStruct((8, 16384, C), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, C), jnp.float32)
    b = jax.ShapeDtypeStruct((C,), jnp.float32) if bias else None
    fn = jax.jit(lambda x, dy, w, b: short_conv_bwd(x, dy, w, b, silu=True, interpret=False))
    assert triton_calls_for_cuda(fn, x, x, w, b) == 1


def test_startup_summary_names_the_conv_backward_for_recurrent_mixers_only():
    from types import SimpleNamespace

    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.logger import startup_summary

    data = SimpleNamespace(meta={}, n_train_windows=4, eval_tokens=[0])
    mesh = SimpleNamespace(shape={"data": 1}, devices=np.zeros(1))
    lines = {k: startup_summary(load_config([], b), data, mesh) for k, b in (
        ("gdn", ["efficient/MixerConfig.kind = 'gdn'"]), ("swa", []))}
    conv = [line for line in lines["gdn"] if "short convs' backward" in line]
    assert conv == ["backend  short convs' backward: xla (auto: no GPU: the default JAX backend is 'cpu')"]
    assert not any("short convs" in line for line in lines["swa"])
