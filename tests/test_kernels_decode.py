"""Sparse decoding on the kernels (``hybrid_lm_kernels.top_k_blocks``, which ``moba_read`` takes on a
GPU, and ``gather_decode_attention``, opt-in) against the ops/ reference (``decode_attend``,
``decode_select``).

CPU: interpret mode, the same kernel bodies as on the GPU. The decode kernel is compared with
``ops.block_sparse.decode_attend`` on random inputs: SSA's group gate (one selection per KV head,
groups of 2 and 10) and MoBA's per-head gate (several selection heads per KV head), fp32 and bf16
caches, positions inside a block and at its ends, duplicated and empty (-1) slots. Then the whole
decode path: MoBA and SSA-sparse mixers decoded with ``moba_read`` forced onto its GPU path equal the
same decode on the reference, step by step, and their forward pass. The Triton lowering is
checked by exporting for CUDA at S5's shapes (the GPU check is ``bench_decode.py --check``).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import triton_calls_for_cuda

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm import backends
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.model import moba as moba_mod
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.ops import block_sparse as ops
from hybrid_lm_kernels import gather_decode_attention, top_k_blocks

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _inputs(seed, B, C, H, K, D, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, H, D), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (B, C, K, D), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], (B, C, K, D), jnp.float32).astype(dtype)
    return q, kc, vc


def _selection(seed, B, Hs, S, pos, block_size, n_empty=0, dup=False):
    """Own block first, then distinct random past blocks; ``n_empty`` trailing -1 slots, and slot
    1 repeated in slot 2 when ``dup``."""
    own = pos // block_size
    rng = np.random.default_rng(seed)
    idx = np.full((B, Hs, S), -1, np.int32)
    for b in range(B):
        for h in range(Hs):
            past = rng.permutation(own)[: S - 1 - n_empty] if own else []
            row = [own, *past]
            if dup and len(row) > 2:
                row[2] = row[1]
            idx[b, h, : len(row)] = row
    return jnp.asarray(idx)


CASES = [  # B, C, H, K, D, block, S, Hs, pos
    (2, 128, 4, 2, 32, 16, 4, 2, 77),  # SSA gate: groups of 2
    (1, 512, 10, 1, 128, 16, 16, 1, 511),  # S5's heads, the cache's last slot
    (2, 256, 4, 1, 64, 32, 3, 4, 64),  # MoBA gate: 4 selection heads on one KV head, a block's first token
    (1, 256, 8, 2, 32, 16, 8, 8, 250),  # MoBA gate on 2 KV heads
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slots,chunk_rows", [("full", 128), ("empty_and_dup", 16)])
def test_decode_kernel_equals_decode_attend(case, dtype, slots, chunk_rows):
    """``chunk_rows`` 16: one block per gathered chunk (several online-softmax steps); 128: the
    default (one or two chunks, slots padded to fill them)."""
    B, C, H, K, D, bs, S, Hs, pos = case
    q, kc, vc = _inputs(sum(case), B, C, H, K, D, dtype)
    messy = slots == "empty_and_dup"
    idx = _selection(pos, B, Hs, S, pos, bs, n_empty=1 if messy else 0, dup=messy)
    got = gather_decode_attention(q, kc, vc, idx, jnp.int32(pos), block_size=bs, interpret=True,
                                  chunk_rows=max(chunk_rows, bs))
    with jax.default_matmul_precision("highest"):
        want = ops.decode_attend(q[:, None], kc, vc, idx[:, None], jnp.int32(pos), block_size=bs)[:, 0]
    assert got.shape == (B, H, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_decode_kernel_skips_slots_that_see_nothing():
    """-1, past-the-cache and wholly-future slots add nothing, even in the first slots."""
    B, C, H, K, D, bs = 1, 128, 2, 1, 32, 16
    q, kc, vc = _inputs(0, B, C, H, K, D, jnp.float32)
    pos = 40  # block 2
    bad = jnp.asarray([[[-1, 9, 5, 2, 0]]], jnp.int32)  # 9: past the cache (8 blocks), 5: future
    good = jnp.asarray([[[2, 0]]], jnp.int32)
    got = gather_decode_attention(q, kc, vc, bad, jnp.int32(pos), block_size=bs, interpret=True, chunk_rows=16)
    want = gather_decode_attention(q, kc, vc, good, jnp.int32(pos), block_size=bs, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    nothing = gather_decode_attention(q, kc, vc, jnp.asarray([[[-1, 6]]], jnp.int32), jnp.int32(pos),
                                      block_size=bs, interpret=True)
    np.testing.assert_array_equal(np.asarray(nothing), 0)


def test_decode_kernel_rejects_bad_inputs():
    q, kc, vc = _inputs(0, 1, 128, 2, 1, 32, jnp.float32)
    idx = jnp.zeros((1, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        gather_decode_attention(q, kc[:, :120], vc[:, :120], idx, 0, block_size=16)
    with pytest.raises(ValueError, match="power of two >= 16"):
        gather_decode_attention(q, kc, vc, idx, 0, block_size=24)
    with pytest.raises(ValueError, match="head_dim 24"):
        gather_decode_attention(q[..., :24], kc[..., :24], vc[..., :24], idx, 0, block_size=16)
    with pytest.raises(ValueError, match="do not match"):
        gather_decode_attention(q, kc, vc, jnp.zeros((1, 3, 2), jnp.int32), 0, block_size=16)
    with pytest.raises(ValueError, match="integer"):
        gather_decode_attention(q, kc, vc, idx.astype(jnp.float32), 0, block_size=16)
    with pytest.raises(ValueError, match="chunk_rows"):
        gather_decode_attention(q, kc, vc, idx, 0, block_size=16, chunk_rows=48)
    with pytest.raises(ValueError, match="expected q"):
        gather_decode_attention(q[:, None], kc, vc, idx, 0, block_size=16)


def test_sparse_decode_backend_rule():
    assert backends.sparse_decode_backend(platform="cpu")[0] == "xla"
    assert backends.sparse_decode_backend(platform="gpu")[0] == "pallas"


def test_one_token_block_sums_are_the_scatter_sums():
    sums = jax.random.normal(jax.random.key(0), (2, 8, 1, 16))
    x = jax.random.normal(jax.random.key(1), (2, 1, 1, 16))
    for pos in (0, 15, 16, 127):
        want = sums.at[:, jnp.asarray([pos // 16])].add(x)
        np.testing.assert_array_equal(np.asarray(ops.add_block_sums(sums, x, jnp.int32(pos), 16)),
                                      np.asarray(want))


MIXERS = {
    "moba_ssa_gate": ("moba", {"block_size": 16, "top_k": 3, "gate": "ssa"}),
    "moba_per_head_gate": ("moba", {"block_size": 16, "top_k": 2, "gate": "moba"}),
    "ssa_sparse_stream": ("ssa", {"block_size": 16, "top_k": 3, "gate": "ssa", "eval_stream": "sparse"}),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_kernel_decode_equals_reference_decode_and_the_forward(name, monkeypatch):
    """A mixer's prefill + decode steps with ``moba_read`` on the kernels vs on the reference (step
    outputs), and both vs the mixer's forward pass over the whole sequence."""
    kind, options = MIXERS[name]
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, vocab_size=97,
                      compute_dtype="float32", init_std=0.2)
    mixer = get_mixer(kind).cls(cfg, MixerConfig(kind=kind, options=options), 1, rngs=nnx.Rngs(0))
    T, P, B = 80, 40, 2
    x = jax.random.normal(jax.random.key(1), (B, T, 64))
    ctx = lambda n: MixerContext(positions=jnp.broadcast_to(jnp.arange(n), (B, n)), train=False)
    with jax.default_matmul_precision("highest"):
        ref = mixer(x, ctx(T))

    def decode(impl):
        monkeypatch.setattr(moba_mod, "sparse_decode_backend", lambda: (impl, "test"))
        with jax.default_matmul_precision("highest"):
            _, state = mixer.prefill(x[:, :P], ctx(P), T)
            out = []
            for t in range(P, T):
                y, state = mixer.step(x[:, t], state)
                out.append(y)
        return jnp.stack(out, 1)

    kernel, xla = decode("pallas"), decode("xla")
    scale = float(jnp.max(jnp.abs(xla)))
    assert scale > 0.1
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(xla), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(ref[:, P:]), rtol=0, atol=1e-4 * scale)


def test_decode_top_k_kernel_equals_decode_select():
    B, nb, H, K, D, bs = 2, 64, 10, 1, 32, 16
    ks = jax.random.split(jax.random.key(3), 2)
    q = jax.random.normal(ks[0], (B, 1, H, D))
    kbar_sum = jax.random.normal(ks[1], (B, nb, K, D)) * bs
    pos = jnp.int32(nb * bs - 5)
    imp = ops.decode_importance(q, kbar_sum, pos, block_size=bs, gate="ssa", selection="token")
    want = ops.decode_select(q, kbar_sum, pos, block_size=bs, top_k=16, gate="ssa", selection="token")
    np.testing.assert_array_equal(np.asarray(top_k_blocks(imp[:, 0], 16, interpret=True)), np.asarray(want[:, 0]))


def test_decode_kernel_triton_lowering_for_cuda():
    B, C, H, K, D, bs, S = 8, 131072, 10, 1, 128, 16, 16  # S5 at 128K, SSA's block and top-k
    q = jax.ShapeDtypeStruct((B, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, C, K, D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, K, S), jnp.int32)
    pos = jax.ShapeDtypeStruct((), jnp.int32)
    assert triton_calls_for_cuda(jax.jit(lambda q, k, v, i, p: gather_decode_attention(q, k, v, i, p, block_size=bs, interpret=False)), q, kv, kv, idx, pos) == 1
