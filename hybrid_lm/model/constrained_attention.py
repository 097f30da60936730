"""Full attention under a receptive-field constraint (``attention_sink``): the last H tokens + S sinks.

Qiao et al. (arXiv 2606.15378) evaluate their hybrids with the full-attention layers limited to a
horizon H (``eval_sliding_window``), keeping S "attention sink" tokens (``eval_attention_sink_size``)
visible (docs/SOURCES.md section 5). Query i sees key j iff ``j <= i`` and (``i - H < j`` or ``j < S``);
the op and its dense oracle are ``hybrid_lm/ops/sink_attention.py``.

The parameters are exactly those of ``attention`` (wq, wk, wv, wo; RoPE or NoPE per slot), so a
checkpoint trained with full attention loads unchanged: ``hybrid-lm eval --horizon H --sinks S``
(``hybrid_lm/run/swap.py``) switches its full slot to this mixer. It can also be trained with, as
any mixer: ``full/MixerConfig.kind = 'attention_sink'``,
``full/MixerConfig.options = {'horizon': 2048, 'sinks': 4}``.

Dispatch: ``horizon >= T`` is the very same call as ``attention`` (bitwise equal results);
``sinks = 0`` is sliding-window attention of window H through ``attend`` (cuDNN / Pallas kernels on
GPU); otherwise the O(T (H + S)) jnp reference (XLA on every backend: no kernel takes sinks yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import attention_mixing_flops
from hybrid_lm.model.attention import Attention, attend, attention_projection_flops
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops import sink_attention as ops


@dataclass(frozen=True)
class SinkOptions:
    """``horizon``: visible recent tokens, the query included (required); ``sinks``: first positions
    that every later query also sees (0: none)."""

    horizon: int | None = None
    sinks: int = 0

    def validate(self) -> None:
        h, s = self.horizon, self.sinks
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ConfigError(f"attention_sink option horizon={h!r} must be an int >= 1 "
                              "(it counts the query itself; a horizon >= seq_len is no constraint)")
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(f"attention_sink option sinks={s!r} must be an int >= 0")


def sink_document_mask(mc: MixerConfig, seq_len: int) -> str | None:
    """Document masking runs where the layer is ``attention`` (horizon >= T) or ``swa`` (no sinks);
    sinks are the first positions of the *window*, and per-document sinks are not implemented."""
    o = SinkOptions(**mc.options)
    if o.sinks and o.horizon < seq_len:
        return (f"its sinks ({o.sinks}) are the window's first tokens (per-document sinks are not "
                f"implemented); only sinks=0 or horizon >= seq_len={seq_len} masks documents")
    return None


def sink_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Visible pairs, exact (as ``attention`` counts its causal triangle)."""
    o = SinkOptions(**mc.options)
    keys = ops.mean_keys_per_query(seq_len, o.horizon, o.sinks)
    return {"matmul": attention_projection_flops(cfg), "mixing": attention_mixing_flops(cfg, keys)}


@register_mixer("attention_sink", flops=sink_flops, reads=("rope", "rope_theta", "rope_scaling", "options"), options=SinkOptions,
                description="causal attention limited to the last `horizon` tokens plus `sinks` first "
                            "positions (receptive-field constraint); same parameters as attention",
                document_mask=sink_document_mask)
class SinkAttention(Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=None)
        self.opts = SinkOptions(**mc.options)
        self.opts.validate()
        self.mc = mc

    def __call__(self, x, ctx: MixerContext):
        q, k, v = self.project_qkv(x, ctx.positions)
        T = q.shape[1]
        H, S = self.opts.horizon, self.opts.sinks
        seg = ctx.segment_ids
        if H >= T:  # no constraint: exactly the full-attention call
            o = attend(q, k, v, window=None, positions=ctx.positions, impl=ctx.attention_impl, segment_ids=seg)
        elif S == 0:
            o = attend(q, k, v, window=H, positions=ctx.positions, impl=ctx.attention_impl, segment_ids=seg)
        elif seg is not None:
            raise ConfigError(f"attention_sink with DataConfig.document_mask: {sink_document_mask(self.mc, T)}")
        else:
            o = ops.sink_attention(q, k, v, H, S)
        return self.project_out(o)
