"""Block selection kernels (hybrid_lm_kernels.block_importance + top_k_blocks) against ops.select_blocks.

CPU: the Pallas kernels run in interpret mode (the same kernel bodies as on the GPU). Selections must
be *exactly* equal to the reference for both gates. Most inputs are quantised (small integers and
dyadic values, block means over power-of-two blocks), so every dot product is exact in fp32 and
the many exact ties test the tie-breaking (lower block index first); the others are Gaussian
(no near-ties at these sizes). The Triton lowering is checked by exporting for CUDA; the compiled
GPU check is ``tests/gpu/test_gpu_sparse.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import triton_calls_for_cuda

import jax
import jax.numpy as jnp

from hybrid_lm.model.moba import moba_attend, selection_backend
from hybrid_lm.ops import block_sparse as ops
from hybrid_lm_kernels import SelectionBlockSizes, block_importance, select_blocks_split, top_k_blocks
from hybrid_lm_kernels import selection_pallas as sel_mod

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SMALL = SelectionBlockSizes(block_q=16, block_c=16)  # several query tiles and block chunks
HOIST = SelectionBlockSizes(block_q=16, block_c=16, hoist_q=True)  # the same, query tiles loaded once


def _inputs(seed, B, T, H, K, D, quantised):
    kq, kk = jax.random.split(jax.random.key(seed))
    if quantised:  # q in quarters, k integers: q . kbar exact in fp32
        q = jax.random.randint(kq, (B, T, H, D), -3, 4).astype(jnp.float32) / 4
        k = jax.random.randint(kk, (B, T, K, D), -3, 4).astype(jnp.float32)
    else:
        q, k = jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, K, D))
    return q, k


CASES = [  # B, T, H, K, D, block, top_k, gate, quantised, tiles
    (1, 200, 4, 2, 32, 16, 4, "ssa", True, None),  # T not a multiple of the block or the tile
    (2, 150, 4, 1, 16, 8, 3, "moba", True, None),  # B = 2, GQA group 4, per-head gate
    pytest.param(1, 97, 2, 2, 64, 32, 16, "ssa", True, None, marks=pytest.mark.integration),  # nb = 4 < top_k, G = 1
    # G = 4, 25 query tiles x 7 block chunks
    pytest.param(1, 400, 8, 2, 32, 4, 6, "ssa", True, HOIST, marks=pytest.mark.integration),
    pytest.param(1, 300, 4, 4, 16, 4, 6, "moba", False, SMALL, marks=pytest.mark.integration),  # Gaussian
    pytest.param(2, 333, 4, 1, 16, 2, 5, "ssa", False, HOIST, marks=pytest.mark.integration),  # Gaussian, G = 4
    (1, 20, 2, 1, 24, 16, 4, "moba", True, None),  # one complete block at most; D padded to 32
]


def test_block_means_ties_go_to_the_lower_index():
    """Identical keys everywhere: every score ties, so the past blocks come in ascending order;
    top-1 is the own block."""
    B, T, H, K, D, block = 1, 130, 2, 1, 16, 8
    q = jax.random.normal(jax.random.key(3), (B, T, H, D))
    k = jnp.ones((B, T, K, D))
    kbar = ops.block_means(k, block)
    for gate in ("moba", "ssa"):
        want = np.asarray(ops.select_blocks(q, k, block_size=block, top_k=4, gate=gate))
        got = np.asarray(jax.jit(lambda q, kbar, gate=gate: select_blocks_split(
            q, kbar, block_size=block, top_k=4, gate=gate, interpret=True))(q, kbar))
        np.testing.assert_array_equal(got, want)
        t = 100
        assert list(got[0, t, 0]) == [t // block, 0, 1, 2]
    one = np.asarray(jax.jit(lambda q, kbar: select_blocks_split(q, kbar, block_size=block, top_k=1, gate="ssa",
                                                                 interpret=True))(q, kbar))
    np.testing.assert_array_equal(one[0, :, 0, 0], np.arange(T) // block)


def test_selection_backend_rules():
    assert selection_backend("auto", "token", "ssa")[0] == "split_bf16"  # measured fastest (docs/KERNELS.md)
    assert selection_backend("auto", "token", "moba")[0] == "xla"  # the kernels are not timed on the moba gate
    assert selection_backend("split_bf16", "token", "moba")[0] == "split_bf16"
    assert selection_backend("auto", "block")[0] == "xla"  # per-block: the reference
    assert selection_backend("xla", "token")[0] == "xla"
    with pytest.raises(ValueError, match="per-token selection only"):
        selection_backend("split_bf16", "block")
    for removed in ("fused", "split", "triton"):
        with pytest.raises(ValueError, match="selection_impl"):
            selection_backend(removed, "token")


@pytest.mark.integration
@pytest.mark.parametrize("gate,H,K,sel", [("ssa", 4, 2, "auto"), ("ssa", 4, 2, "xla"), ("moba", 2, 1, "auto")])
def test_moba_attend_kernel_selection_end_to_end(gate, H, K, sel):
    """moba_attend's pallas path with each selection equals the reference moba_attention (the xla
    path) in output and dq, dk, dv; the selection carries no gradient."""
    B, T, D, block, top_k = 1, 80, 16, 16, 3
    ks = jax.random.split(jax.random.key(11), 4)
    q, k, v, do = (jax.random.normal(kk, s) for kk, s in zip(ks, [(B, T, H, D), (B, T, K, D), (B, T, K, D),
                                                                (B, T, H, D)]))

    def fwd_bwd(fn):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    got = jax.jit(lambda: fwd_bwd(lambda q, k, v: moba_attend(
        q, k, v, block_size=block, top_k=top_k, gate=gate, selection="token", impl="pallas",
        selection_impl=sel, interpret=True)))()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda: fwd_bwd(lambda q, k, v: ops.moba_attention(
            q, k, v, block_size=block, top_k=top_k, gate=gate)))()
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        err = np.linalg.norm(np.asarray(g) - np.asarray(r)) / np.linalg.norm(np.asarray(r))
        assert err < 2e-5, (name, err)


def test_same_block_means_as_reference():
    k = jax.random.normal(jax.random.key(5), (2, 77, 3, 8))
    np.testing.assert_array_equal(np.asarray(sel_mod.block_means(k, 16)), np.asarray(ops.block_means(k, 16)))


def test_query_tile_fits_shared_memory():
    """S5's SSA gate (G = 10 query heads per KV head, D = 128) asked for 352 KiB of shared memory
    with 64-row tiles on the H200 (227 KiB per block): the tile shrinks until the operands fit."""
    for group, d in ((10, 128), (4, 128), (1, 128), (16, 256)):
        bq = sel_mod.query_tile(64, 16384, group, 64, d)
        assert bq >= 16 and bq & (bq - 1) == 0
        assert bq == 16 or (group * bq + 64) * d * 4 <= sel_mod.SMEM_OPERAND_BUDGET
    assert sel_mod.query_tile(64, 16384, 10, 64, 128) == 16
    assert sel_mod.query_tile(64, 16384, 1, 64, 128) == 64  # moba: unchanged
    assert sel_mod.query_tile(64, 20, 1, 64, 128) == 32  # no more rows than the sequence needs
    assert sel_mod.query_tile(64, 16384, 10, 64, 128, itemsize=2) == 32  # bf16 operands: half the bytes


# ----------------------------------------------------------------------------- the split selection

def test_top_k_blocks_equals_the_passes():
    """The top-k kernel against ``top_k_by_passes`` (value descending, ties to the lower index):
    integer values (many ties), rows with fewer finite entries than k, all -inf rows, +-0, NaN
    (never selected), a row length that is no power of two, several row tiles."""
    x = jax.random.randint(jax.random.key(0), (3, 37, 45), -4, 5).astype(jnp.float32)
    x = x.at[0, :, 10:].set(-jnp.inf)  # 10 finite entries < k
    x = x.at[1, 3].set(-jnp.inf)  # nothing selectable
    x = x.at[1, 4].set(-jnp.inf).at[1, 4, :6].set(jnp.array([0.0, -0.0, 0.0, jnp.nan, -0.0, 4.0]))
    x = x.at[2, 5, 7].set(jnp.inf)  # the own block
    for k, rows in ((12, None), (1, 4), (45, 16), (60, 2)):
        got = np.asarray(top_k_blocks(x, k, block_rows=rows, interpret=True))
        vals, idx = ops.top_k_by_passes(jnp.where(jnp.isnan(x), -jnp.inf, x), min(k, 45))
        want = np.where(np.asarray(vals) > -np.inf, np.asarray(idx), -1)
        assert got.dtype == np.int32 and got.shape == (3, 37, min(k, 45))
        np.testing.assert_array_equal(got, want)
    assert list(np.asarray(top_k_blocks(x, 4, interpret=True))[1, 4]) == [5, 0, 1, 2]  # +-0 tie by index
    g = jax.random.normal(jax.random.key(1), (5, 1000))  # Gaussian: the same as lax.top_k
    np.testing.assert_array_equal(np.asarray(top_k_blocks(g, 16, interpret=True)),
                                  np.asarray(jax.lax.top_k(g, 16)[1]))


@pytest.mark.parametrize("B,T,H,K,D,block,top_k,gate,quantised,tiles", CASES)
def test_split_selection_equals_reference(B, T, H, K, D, block, top_k, gate, quantised, tiles):
    """Gate kernel + top-k kernel: the same selection as the reference, and the importance the
    reference's ``block_importance`` (infinities exactly, scores to fp32 rounding: the ssa lse is
    online in the kernel)."""
    q, k = _inputs(B * T + D, B, T, H, K, D, quantised)
    kbar = ops.block_means(k, block)
    scale = 1.0 / np.sqrt(D)
    imp = np.asarray(block_importance(q, kbar, block_size=block, gate=gate, interpret=True, block_sizes=tiles))
    ref = np.asarray(ops.block_importance(q, kbar, jnp.arange(T), block_size=block, gate=gate, scale=scale))
    assert imp.shape == ref.shape and imp.dtype == np.float32
    np.testing.assert_array_equal(np.isinf(imp), np.isinf(ref))
    np.testing.assert_array_equal(imp[np.isinf(imp)], ref[np.isinf(ref)])
    np.testing.assert_allclose(imp[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=2e-6, atol=1e-7)
    want = np.asarray(ops.select_blocks(q, k, block_size=block, top_k=top_k, gate=gate))
    got = np.asarray(jax.jit(lambda q, kbar: select_blocks_split(
        q, kbar, block_size=block, top_k=top_k, gate=gate, interpret=True, block_sizes=tiles))(q, kbar))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("gate,H,K,block", [("ssa", 8, 2, 4), ("moba", 4, 1, 8)])
def test_split_selection_bf16_dots_on_exact_inputs(gate, H, K, block):
    """``dot_dtype='bfloat16'``: on quantised inputs the block means are exact in bf16 (multiples of
    1/16 below 4), so the selection is still the reference's."""
    q, k = _inputs(7, 1, 300, H, K, 16, True)
    kbar = ops.block_means(k, block)
    want = np.asarray(ops.select_blocks(q, k, block_size=block, top_k=5, gate=gate))
    got = np.asarray(jax.jit(lambda q, kbar: select_blocks_split(
        q, kbar, block_size=block, top_k=5, gate=gate, interpret=True, dot_dtype="bfloat16"))(q, kbar))
    np.testing.assert_array_equal(got, want)


def test_split_selection_rejects_bad_inputs():
    q, kbar = jnp.zeros((1, 64, 4, 16)), jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="gate"):
        block_importance(q, kbar, block_size=16, gate="nsa")
    with pytest.raises(ValueError, match="blocks"):
        block_importance(q, kbar[:, :3], block_size=16, gate="moba")
    with pytest.raises(ValueError, match="H % K"):
        block_importance(q, jnp.zeros((1, 4, 3, 16)), block_size=16, gate="ssa")
    with pytest.raises(ValueError, match="powers of two"):
        block_importance(q, kbar, block_size=16, gate="ssa", block_sizes=SelectionBlockSizes(block_c=24))
    with pytest.raises(ValueError, match="dot_dtype"):
        block_importance(q, kbar, block_size=16, gate="ssa", dot_dtype="float16")
    with pytest.raises(ValueError, match="k=0"):
        top_k_blocks(jnp.zeros((4, 8)), 0)
    with pytest.raises(ValueError, match="power of two"):
        top_k_blocks(jnp.zeros((4, 8)), 2, block_rows=3)


def test_split_selection_lowers_for_cuda():
    """Both split kernels lower through Triton for sm_90 at S5's heads (G = 10): two custom calls."""
    q = jax.ShapeDtypeStruct((2, 1000, 10, 128), jnp.bfloat16)
    kbar = jax.ShapeDtypeStruct((2, 63, 1, 128), jnp.float32)
    fn = jax.jit(lambda q, kbar: select_blocks_split(q, kbar, block_size=16, top_k=16, gate="ssa", interpret=False))
    assert triton_calls_for_cuda(fn, q, kbar) == 2
