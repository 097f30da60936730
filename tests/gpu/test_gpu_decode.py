"""Cached decoding on the GPU gives the forward pass's logits: prefill 64 tokens, then decode 31 one at a time
with each mixer's decode path (the kernels this device resolves), against one forward pass over all 96. The CPU
twin is ``tests/test_generate.py``. The float32 cases run their matmuls at full precision: XLA on a GPU computes
float32 dots in TF32 by default (about 5e-4 relative here), which would also flip near-tied sparse block choices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from gpu_util import GPU

from hybrid_lm.experiment import load_config
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.transformer import HybridLM

pytestmark = GPU

ARCHS = {
    "full": ["ModelConfig.layer_pattern = 'F'"],
    "swa": ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 32"],
    "moba": ["efficient/MixerConfig.kind = 'moba'",
             "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 2, 'gate': 'ssa'}"],
    "ssa_sparse": ["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.kind = 'ssa'",
                   "full/MixerConfig.options = {'block_size': 16, 'top_k': 2, 'gate': 'ssa', 'eval_stream': 'sparse'}"],
    "lightning": ["efficient/MixerConfig.kind = 'lightning'"],
    "mamba2": ["efficient/MixerConfig.kind = 'mamba2'"],
    "gdn": ["efficient/MixerConfig.kind = 'gdn'"],
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_decode_equals_the_forward_pass(arch, dtype):
    with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
        _check_decode(arch, dtype)


def _check_decode(arch, dtype):
    cfg = load_config(["scale/s1.gin"], ARCHS[arch] + ["DataConfig.seq_len = 96", "ModelConfig.n_layers = 2",
                                                       "ModelConfig.vocab_size = 512",
                                                       f"ModelConfig.compute_dtype = '{dtype}'"])
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 96), 0, 512)
    ref = model(tokens, MixerContext(positions=jnp.broadcast_to(jnp.arange(96), (2, 96)), train=False))
    logits, cache = model.prefill(tokens[:, :64], 96)
    got = [logits[:, -1]]
    for t in range(64, 95):
        lt, cache = model.decode_step(tokens[:, t], cache)
        got.append(lt)
    got = jnp.stack(got, 1).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - ref[:, 63:95].astype(jnp.float32))) / jnp.max(jnp.abs(ref.astype(jnp.float32))))
    assert err < (2e-2 if dtype == "bfloat16" else 1e-4), err
