"""MoBA block-sparse attention mixer (``moba``); the op is ``hybrid_lm/ops/block_sparse.py``.

Same parameters as full attention (GQA q/k/v/o, RoPE or NoPE): only the set of keys each query sees
changes. Selection runs on the RoPE'd q and k, as in both references (MoBA and SSA/NSA).
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from hybrid_lm.config import ConfigError, MixerConfig, ModelConfig
from hybrid_lm.model.attention import Attention, attention_projection_flops
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops import block_sparse as ops


@dataclass(frozen=True)
class MobaOptions:
    """Defaults: SSA's from-scratch MoBA baseline (block 16, top-16, NSA-style gate), see the docs.

    The official MoBA recipe (raw per-head gate, block 4096, top-12) targets >= 32K contexts; at our
    sequence lengths it would be full attention (T <= block * top_k). Set ``gate='moba'`` and a
    block of 512+ for the official gate.
    """

    block_size: int = 16  # tokens per key block
    top_k: int = 16  # selected blocks per query, counting its own (always selected, causal inside)
    gate: str = "ssa"  # ssa: softmax importance summed over the GQA group; moba: raw q.mean(k) per head

    def validate(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"moba option block_size={self.block_size!r} must be an int >= 1")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"moba option top_k={self.top_k!r} must be an int >= 1 (it counts the own block)")
        if self.gate not in ops.GATES:
            raise ConfigError(f"moba option gate={self.gate!r}: choose one of {ops.GATES}")


def moba_mean_keys(seq_len: int, block_size: int, top_k: int) -> float:
    """Exact mean over query positions of the keys a query attends to.

    Query t sees ``t % b + 1`` keys of its own block plus ``b * min(top_k - 1, t // b)`` keys of
    complete past blocks.
    """
    T, b = seq_len, block_size
    total = 0
    for c in range(-(-T // b)):  # queries of block c: n of them, own-block counts 1..n
        n = min(b, T - c * b)
        total += n * (n + 1) // 2 + n * b * min(top_k - 1, c)
    return total / T


def moba_gate_dots(seq_len: int, block_size: int) -> float:
    """Mean number of block-mean dot products per query head for the gate (complete past blocks)."""
    T, b = seq_len, block_size
    q, r = divmod(T, b)  # sum over t < T of t // b
    return (b * q * (q - 1) // 2 + r * q) / T


def moba_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Attention over the selected keys (visible pairs; the causal own block is half-filled on average,
    as for full attention) plus the gate's dot products against block means."""
    o = MobaOptions(**mc.options)
    H, Dh = cfg.n_heads, cfg.resolved_head_dim
    keys = moba_mean_keys(seq_len, o.block_size, o.top_k)
    gate = 2.0 * H * Dh * moba_gate_dots(seq_len, o.block_size)
    return {"matmul": attention_projection_flops(cfg), "mixing": 4.0 * H * Dh * keys + gate}


@register_mixer("moba", flops=moba_flops, options=MobaOptions,
                description="MoBA block-sparse causal attention: top-k key blocks per query (own block "
                            "included), official per-head gate or SSA/NSA group gate")
class MobaAttention(Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=None)
        self.opts = MobaOptions(**mc.options)

    def __call__(self, x, ctx: MixerContext):
        q, k, v = self.project_qkv(x, ctx.positions)
        o = ops.moba_attention(q, k, v, block_size=self.opts.block_size, top_k=self.opts.top_k, gate=self.opts.gate)
        return self.project_out(o)
