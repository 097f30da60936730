"""The hybrid language model: embedding, a stack of (mixer + SwiGLU) blocks from a layer pattern, head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import ModelConfig
from hybrid_lm.model.layers import Embedding, RMSNorm, SwiGLU, param
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.ops.attention import default_positions

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

    # -- decode (mixers with ``prefill`` and ``step``: attention, swa, moba, ssa, lightning, mamba2, gdn)

    def check_decode(self, layer_idx: int) -> None:
        if not (callable(getattr(self.mixer, "prefill", None)) and callable(getattr(self.mixer, "step", None))):
            raise NotImplementedError(
                f"layer {layer_idx}: mixer {self.mixer_kind!r} has no decode path (mixers with one: "
                "attention, swa, moba, ssa, lightning, mamba2, gdn); score such models with `hybrid-lm eval`")

    def prefill(self, x, ctx: MixerContext, max_len: int):
        y, state = self.mixer.prefill(self.mixer_norm(x), ctx, max_len)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x_t, state):
        y, state = self.mixer.step(self.mixer_norm(x_t), state)
        x_t = x_t + y
        return x_t + self.mlp(self.mlp_norm(x_t)), state


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
            ctx = MixerContext(positions=default_positions(B, T))
        x = self.embed(tokens, dtype)
        for block in self.blocks:
            if cfg.remat == "none":
                x = block(x, ctx)
            else:
                x = nnx.remat(lambda b, h: b(h, ctx), policy=_REMAT_POLICIES[cfg.remat])(block, x)
        return self.logits(x)

    def logits(self, x):
        """fp32 logits from the last block's output ``x [..., d]``."""
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = x @ self.lm_head[...].astype(x.dtype)
        return logits.astype(jnp.float32)

    # -- decode: prefill a prompt, then one token at a time (hybrid_lm/eval/generate.py drives it)

    def prefill(self, tokens, max_len: int, attention_impl: str = "auto"):
        """Logits ``[B, T, vocab]`` of a prompt ``tokens [B, T]`` and the decode cache (one state per
        layer) for up to ``max_len`` positions in all."""
        for i, block in enumerate(self.blocks):
            block.check_decode(i)
        B, T = tokens.shape
        ctx = MixerContext(positions=default_positions(B, T), attention_impl=attention_impl, train=False)
        x = self.embed(tokens, jnp.dtype(self.cfg.compute_dtype))
        cache = []
        for block in self.blocks:
            x, state = block.prefill(x, ctx, max_len)
            cache.append(state)
        return self.logits(x), cache

    def decode_step(self, token, cache):
        """Logits ``[B, vocab]`` after one more token ``token [B]``, and the updated cache."""
        x = self.embed(token[:, None], jnp.dtype(self.cfg.compute_dtype))[:, 0]
        new = []
        for block, state in zip(self.blocks, cache):
            x, state = block.step(x, state)
            new.append(state)
        return self.logits(x), new


def cross_entropy(logits, targets, z_loss: float = 0.0):
    """Mean token cross-entropy (nats) and the mean log-partition, both fp32."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - tgt)
    loss = ce + z_loss * jnp.mean(lse ** 2) if z_loss else ce
    return loss, ce
