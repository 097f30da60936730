"""SSA training mode (arXiv 2511.20102): every attention layer runs a full and a block-sparse stream.

Per micro-batch a coin (p = 0.5, ``fold_in(seed, step, micro-batch index)``, one draw shared by all
layers) picks the stream that feeds the output projection and the residual path. The other stream
is used only by the bidirectional alignment loss, per layer, on the gated pre-``o_proj`` outputs::

    SmoothL1(full, sg(sparse)) + SmoothL1(sg(full), sparse)      (beta = 1, mean over elements)

averaged over the SSA layers and weighted by ``align_weight`` (10 in the released code). Both
streams share q/k/v/o and one sigmoid gate per (token, head) (``g_slc``), as in the released code.
The sparse stream is MoBA-like block selection with the NSA importance rule (block 16, top-16,
RoPE'd block-mean keys, softmax importance summed over the GQA group, own block forced); see
``hybrid_lm/ops/block_sparse.py``. At eval the stream is fixed by ``eval_stream``.

Aux outputs are sown as ``nnx.Intermediate``: ``aux_loss`` (added to the objective by the train
step) and ``ssa_align`` / ``ssa_sparse`` (logged; ``ssa_sparse`` every step, see ``step_stats``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import attention_mixing_flops
from hybrid_lm.model.attention import (Attention, AttentionDecode, attend, attention_projection_flops,
                                        mean_keys_per_query)
from hybrid_lm.model.layers import param, sow_intermediate
from hybrid_lm.model.moba import (MOBA_DOCUMENT_MASK, MobaOptions, moba_attend, moba_extend_state,
                                  moba_gate_flops, moba_mean_keys, moba_read)
from hybrid_lm.model.registry import MixerContext, register_mixer


@dataclass(frozen=True)
class SSAOptions(MobaOptions):
    """MoBA's selection options (block 16, top-16, the NSA-style ``ssa`` gate, token selection, as in
    the released code) plus SSA's own."""

    _mixer: ClassVar[str] = "ssa"
    align_weight: float = 10.0  # alpha in loss = ce + alpha * mean_layers(align)
    eval_stream: str = "full"  # stream used when not training: full | sparse

    def validate(self) -> None:
        super().validate()
        if self.eval_stream not in ("full", "sparse"):
            raise ConfigError(f"ssa option eval_stream={self.eval_stream!r}: choose full or sparse")
        if self.align_weight < 0:
            raise ConfigError("ssa option align_weight must be >= 0")


def ssa_coin(seed: int, step, micro_index) -> jax.Array:
    """True = sparse stream for this micro-batch (p = 0.5), shared by all layers."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), micro_index)
    return jax.random.bernoulli(key, 0.5)


def smooth_l1(a, b):
    d = jnp.abs(a - b)
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5))


def alignment_loss(full, sparse):
    """Sparsity term (full -> sg(sparse)) + commitment term (sg(full) -> sparse), fp32."""
    full, sparse = full.astype(jnp.float32), sparse.astype(jnp.float32)
    return smooth_l1(full, jax.lax.stop_gradient(sparse)) + smooth_l1(jax.lax.stop_gradient(full), sparse)


def _ssa_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    o = SSAOptions(**mc.options)
    # training runs both streams: full causal + block-sparse, plus the selection scores (as moba counts them)
    keys = mean_keys_per_query(seq_len, None) + moba_mean_keys(seq_len, o.block_size, o.top_k)
    return {"matmul": attention_projection_flops(cfg) + 2.0 * cfg.d_model * cfg.n_heads,
            "mixing": attention_mixing_flops(cfg, keys) + moba_gate_flops(cfg, seq_len, o.block_size, o.selection)}


@register_mixer("ssa", flops=_ssa_flops, reads=("rope", "rope_theta", "rope_scaling", "options"), options=SSAOptions,
                description="SSA: full + block-sparse streams, coin per micro-batch, alignment loss",
                document_mask="its sparse stream is MoBA's: " + MOBA_DOCUMENT_MASK,
                decode="the cache of its eval stream")
class SSAAttention(AttentionDecode, Attention):
    step_stats = ("ssa_sparse",)  # sown stats the trainer logs every step (the stream each step used)

    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=None)
        self.opts = SSAOptions(**mc.options)
        self.w_gate = param(rngs, (cfg.d_model, cfg.n_heads), ("embed", "heads"), cfg.init_std)
        self.n_ssa_layers = sum(cfg.mixer(t).kind == "ssa" for t in cfg.layer_types())

    def stream_gate(self, x):
        """Per-head sigmoid gate ``[B, T, H, 1]`` on both streams' outputs."""
        return jax.nn.sigmoid(x @ self.w_gate[...].astype(x.dtype))[..., None]

    def _stream(self, name: str, q, k, v, ctx: MixerContext):
        """One stream's attention output, before the gate: ``full`` causal or block-``sparse``."""
        if name == "sparse":
            o = self.opts
            return moba_attend(q, k, v, block_size=o.block_size, top_k=o.top_k, gate=o.gate,
                               selection=o.selection, impl=ctx.attention_impl, label="ssa sparse")
        return attend(q, k, v, window=None, positions=ctx.positions, impl=ctx.attention_impl)

    def _streams(self, x, ctx: MixerContext, want_full: bool, want_sparse: bool):
        q, k, v = self.project_qkv(x, ctx.positions)
        g = self.stream_gate(x)
        full = self._stream("full", q, k, v, ctx) * g if want_full else None
        sparse = self._stream("sparse", q, k, v, ctx) * g if want_sparse else None
        return full, sparse

    # -- decode: the eval stream (eval_stream) on the KV cache, times the stream gate

    def attend_prompt(self, q, k, v, ctx: MixerContext):
        return self._stream(self.opts.eval_stream, q, k, v, ctx)

    def extend_state(self, state: dict, q, k, pos) -> dict:
        return moba_extend_state(state, q, k, pos, self.opts) if self.opts.eval_stream == "sparse" else state

    def read(self, q_t, state: dict):
        return moba_read(q_t, state, self.opts) if self.opts.eval_stream == "sparse" else super().read(q_t, state)

    def decode_output(self, o, x):
        return self.project_out(o.astype(x.dtype) * self.stream_gate(x))

    def __call__(self, x, ctx: MixerContext):
        if not ctx.train:
            sparse_mode = self.opts.eval_stream == "sparse"
            full, sparse = self._streams(x, ctx, not sparse_mode, sparse_mode)
            return self.project_out(sparse if sparse_mode else full)
        full, sparse = self._streams(x, ctx, True, True)
        use_sparse = ssa_coin(ctx.seed, ctx.step, ctx.micro_index)
        align = alignment_loss(full, sparse)
        sow_intermediate(self, "aux_loss", self.opts.align_weight * align / self.n_ssa_layers)
        sow_intermediate(self, "ssa_align", align / self.n_ssa_layers)
        sow_intermediate(self, "ssa_sparse", use_sparse.astype(jnp.float32) / self.n_ssa_layers)
        return self.project_out(jnp.where(use_sparse, sparse, full))
