"""Sparse decoding on the kernels (``hybrid_lm_kernels.top_k_blocks``, which ``moba_read`` takes on a
GPU) against the ops/ reference (``decode_select``).

CPU: interpret mode, the same kernel bodies as on the GPU. The whole decode path: MoBA and
SSA-sparse mixers decoded with ``moba_read`` forced onto its GPU path equal the same decode on the
reference, step by step, and their forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm import backends
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.model import moba as moba_mod
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.ops import block_sparse as ops
from hybrid_lm_kernels import top_k_blocks

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


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


@pytest.mark.integration  # a whole model across the mixers
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
