"""The hybrid language model: embedding, a stack of (mixer + SwiGLU) blocks from a layer pattern, head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import ModelConfig
from hybrid_lm.model.layers import Embedding, RMSNorm, SwiGLU, param
from hybrid_lm.model.registry import MixerContext, get_mixer

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer_type: str, layer_idx: int, *, rngs: nnx.Rngs):
        mc = cfg.mixer(layer_type)
        self.layer_type = layer_type
        self.mixer_kind = mc.kind
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = get_mixer(mc.kind).cls(cfg, mc, layer_idx, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x, ctx: MixerContext):
        x = x + self.mixer(self.mixer_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))


class HybridLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, t, i, rngs=rngs) for i, t in enumerate(cfg.layer_types())])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens, ctx: MixerContext | None = None):
        """Logits (fp32) ``[B, T, vocab]`` for ``tokens [B, T]``."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.compute_dtype)
        if ctx is None:
            B, T = tokens.shape
            ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
        x = self.embed(tokens, dtype)
        for block in self.blocks:
            if cfg.remat == "none":
                x = block(x, ctx)
            else:
                x = nnx.remat(lambda b, h: b(h, ctx), policy=_REMAT_POLICIES[cfg.remat])(block, x)
        x = self.final_norm(x)
        if cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = x @ self.lm_head[...].astype(dtype)
        return logits.astype(jnp.float32)


def cross_entropy(logits, targets, z_loss: float = 0.0):
    """Mean token cross-entropy (nats) and the mean log-partition, both fp32."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - tgt)
    loss = ce + z_loss * jnp.mean(lse ** 2) if z_loss else ce
    return loss, ce
