"""Lightning attention mixer (``lightning``): linear attention with a constant decay per head.

Layer (the reference layer of the library the Rethinking repo pins, ``lightning_attn==0.0.5``,
``examples/module/tnl_attn.py``, TransNormerLLM; MiniMax-01's layer is the same up to the norm and
the gate width, both options)::

    q, k, v = silu(x Wq), silu(x Wk), silu(x Wv)                 # H heads of head_dim D, no RoPE
    o_t     = scale * sum_{s<=t} exp(-slope_h (t - s)) (q_t . k_s) v_s      # per head
    y       = Wo( norm(o) * sigmoid(gate(x)) )                    # norm over all H*D channels

The core is ``chunk_simple_gla`` with a constant per-head log decay ``g_gamma[h] = -slope_h``, called
through ``ops/linear_attention_gpu.simple_gla`` (jla's Hopper kernel under ``ModelConfig.linear_impl``).

Per-head decay (``decay`` option):

- ``alibi`` (default): OpenNLPLab ``lightning_attn`` (``_build_slope_tensor``) and MiniMax-01. ALiBi
  slopes ``s_h = 2^(-8 (h+1) / H)`` for a power-of-two H (else the ALiBi interleave of the
  neighbouring powers), scaled per layer by ``1 - l / (L - 1) + 1e-5``: the first layer decays most,
  the last almost not at all. ``l`` is the global layer index and ``L = ModelConfig.n_layers``,
  softmax layers included, as MiniMax-01 counts them in its hybrid. ``lightning_attn_func`` has no
  query scale, so the default scale is 1.
- ``fla``: fla ``chunk_lightning_attn``: ``g_gamma[h] = -(8 / H) (1 - l / L) h``, linear in the head
  index, so head 0 never decays (a plain running sum); default scale ``1/sqrt(D)``.

We default to ``alibi`` because it is what the pinned library computes; neither choice is confirmed
as the paper's (its ``modeling.py`` is unreleased). The scale barely matters: the output norm is
invariant to it up to eps.

Output norm (``norm``): ``layer`` = TNL's ``LayerNorm(H*D)`` with bias (default); ``rms`` = MiniMax-01's
``RMSNorm(H*D)``. Gate (``gate``): ``lowrank`` = TNL's ``Linear(d, D) -> Linear(D, H*D)`` (default),
``full`` = MiniMax-01's ``Linear(d, H*D)``, ``none``.

Heads: ``ModelConfig.n_heads`` x ``head_dim`` for q, k and v alike (no grouped KV heads: the state is
per head). ``MixerConfig.rope`` is ignored (position enters through the decay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.layers import out_proj_std, param
from hybrid_lm.model.recurrent_common import (INNER_NORM_EPS, RECURRENT_DOCUMENT_MASK, const_param,
                                              simple_gla_chunk_macs)
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops.linear_attention import simple_gla_step
from hybrid_lm.ops.linear_attention_gpu import simple_gla

DECAYS = ("alibi", "fla")
NORMS = ("layer", "rms")
GATES = ("lowrank", "full", "none")


@dataclass(frozen=True)
class LightningOptions:
    """Options of ``lightning`` (``efficient/MixerConfig.options``); see the module docstring."""

    decay: str = "alibi"  # alibi: OpenNLPLab/MiniMax slopes x per-layer factor; fla: linear in head, head 0 no decay
    scale: float | None = None  # query scale; None: 1 for alibi (lightning_attn_func), 1/sqrt(D) for fla
    norm: str = "layer"  # output norm over H*D: layer (TNL LayerNorm) | rms (MiniMax-01 RMSNorm)
    gate: str = "lowrank"  # sigmoid output gate: lowrank (TNL, rank head_dim) | full (MiniMax-01) | none
    chunk_size: int = 64  # tokens per chunk of the training scan (speed/memory only)

    def validate(self) -> None:
        for name, val, allowed in (("decay", self.decay, DECAYS), ("norm", self.norm, NORMS),
                                   ("gate", self.gate, GATES)):
            if val not in allowed:
                raise ConfigError(f"lightning option {name}={val!r}: choose one of {allowed}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ConfigError(f"lightning option scale={self.scale!r} must be None or a number > 0")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ConfigError(f"lightning option chunk_size={self.chunk_size!r} must be an int >= 1")


# ----------------------------------------------------------------------------- decay conventions

def alibi_slopes(n: int) -> list[float]:
    """OpenNLPLab ``_build_slope_tensor`` / ALiBi: ``2^(-8 (h+1) / n)`` for a power of two n."""
    def pow2(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))  # = 2^(-8/m)
        return [start ** (i + 1) for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    p = 2 ** math.floor(math.log2(n))
    return pow2(p) + alibi_slopes(2 * p)[0::2][: n - p]


def lightning_log_decay(decay: str, n_heads: int, layer_idx: int, n_layers: int) -> list[float]:
    """Per-head log decay ``g_gamma [H]`` (``<= 0``) of layer ``layer_idx`` (0-based) of ``n_layers``."""
    if decay == "alibi":
        factor = 1.0 + 1e-5 if n_layers <= 1 else 1.0 - layer_idx / (n_layers - 1) + 1e-5
        return [-s * factor for s in alibi_slopes(n_heads)]
    if decay == "fla":
        return [-(8.0 / n_heads) * (1.0 - layer_idx / n_layers) * h for h in range(n_heads)]
    raise ValueError(f"unknown decay {decay!r}")


# ----------------------------------------------------------------------------- FLOPs

def _gate_params(d: int, H: int, D: int, gate: str) -> int:
    return {"lowrank": d * D + D * H * D, "full": d * H * D, "none": 0}[gate]


def lightning_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Forward FLOPs per token (2 per MAC), chunk ``C = min(chunk_size, T)``:

    - matmul: q, k, v, o projections ``4 d H D`` plus the gate (lowrank ``d D + D H D``; full
      ``d H D``), times 2;
    - mixing: the chunked scan, ``2 H (C (Dk + Dv) + 2 Dk Dv)`` with ``Dk = Dv = D``.

    Elementwise work (SiLU, decay, norm, sigmoid gate) is not counted, as softmax is not for attention.
    """
    o = LightningOptions(**mc.options)
    d, H, D = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
    C = min(o.chunk_size, seq_len)
    matmul = 2.0 * (4 * d * H * D + _gate_params(d, H, D, o.gate))
    return {"matmul": matmul, "mixing": 2.0 * H * simple_gla_chunk_macs(C, D, D)}


# ----------------------------------------------------------------------------- module

@register_mixer("lightning", flops=lightning_flops, reads=("options",), options=LightningOptions,
                description="Lightning attention: SiLU linear attention with a constant per-head decay "
                            "(ALiBi slopes x layer factor, or fla's), output norm and sigmoid gate",
                document_mask=RECURRENT_DOCUMENT_MASK, decode="the recurrent state")
class LightningAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        o = LightningOptions(**mc.options)
        o.validate()
        d, H, D = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
        std = cfg.init_std
        self.wq = param(rngs, (d, H, D), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (d, H, D), ("embed", "heads", "head_dim"), std)
        self.wv = param(rngs, (d, H, D), ("embed", "heads", "head_dim"), std)
        self.wo = param(rngs, (H, D, d), ("heads", "head_dim", "embed"), out_proj_std(cfg))
        self.norm_scale = const_param(jnp.ones((H, D)), ("heads", "norm"))
        self.norm_bias = const_param(jnp.zeros((H, D)), ("heads", "bias")) if o.norm == "layer" else None
        if o.gate == "lowrank":
            self.wg_down = param(rngs, (d, D), ("embed", "lowrank"), std)
            self.wg_up = param(rngs, (D, H, D), ("lowrank", "heads", "head_dim"), std)
        elif o.gate == "full":
            self.wg = param(rngs, (d, H, D), ("embed", "heads", "head_dim"), std)
        self.opts = o
        self.layer_idx, self.n_layers = layer_idx, cfg.n_layers
        self.n_heads, self.head_dim = H, D
        self.scale = o.scale if o.scale is not None else (1.0 if o.decay == "alibi" else D ** -0.5)
        self.linear_impl = cfg.linear_impl  # auto | xla | jla (ops/linear_attention_gpu.py)

    @property
    def g_gamma(self) -> tuple[float, ...]:
        """This layer's per-head log decay (static floats)."""
        return tuple(lightning_log_decay(self.opts.decay, self.n_heads, self.layer_idx, self.n_layers))

    def log_decay(self, layer=None):
        """``g_gamma [H]`` fp32 of ``layer`` (a traced index under ``scan_layers``; None: this layer)."""
        if layer is None:  # a barrier: else XLA folds the constant's broadcast and cumsum over [B, T, H]
            return jax.lax.optimization_barrier(jnp.asarray(self.g_gamma, jnp.float32))
        table = [lightning_log_decay(self.opts.decay, self.n_heads, i, self.n_layers) for i in range(self.n_layers)]
        return jnp.asarray(table, jnp.float32)[layer]

    # -- pieces shared by the chunked forward and the decode step (any leading shape [..., d])

    def _qkv(self, x):
        w = lambda p: p[...].astype(x.dtype)  # noqa: E731
        return tuple(jax.nn.silu(jnp.einsum("...d,dhk->...hk", x, w(p))) for p in (self.wq, self.wk, self.wv))

    def _output(self, o, x):
        """norm over all H*D channels, sigmoid gate from x, out projection; ``o [..., H, D]``."""
        of = o.astype(jnp.float32)
        axes = (-2, -1)
        if self.opts.norm == "layer":
            of = of - jnp.mean(of, axis=axes, keepdims=True)
        of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=axes, keepdims=True) + INNER_NORM_EPS)
        of = of * self.norm_scale[...]
        if self.norm_bias is not None:
            of = of + self.norm_bias[...]
        y = of.astype(x.dtype)
        dt = x.dtype
        if self.opts.gate == "lowrank":
            gate = jnp.einsum("...r,rhk->...hk", x @ self.wg_down[...].astype(dt), self.wg_up[...].astype(dt))
        elif self.opts.gate == "full":
            gate = jnp.einsum("...d,dhk->...hk", x, self.wg[...].astype(dt))
        if self.opts.gate != "none":
            y = y * jax.nn.sigmoid(gate)
        return jnp.einsum("...hk,hkd->...d", y, self.wo[...].astype(dt))

    # -- training / prefill

    def forward(self, x, state=None, layer=None):
        """``x [B, T, d]`` -> ``(y [B, T, d], state)``; ``state`` as :meth:`init_state` (None = zeros)."""
        q, k, v = self._qkv(x)
        o, S = simple_gla(q, k, v, g_gamma=self.log_decay(layer), scale=self.scale,
                          initial_state=None if state is None else state["recurrent_state"],
                          output_final_state=True, chunk_size=self.opts.chunk_size,
                          impl=self.linear_impl, kernel_dtype=x.dtype, label="lightning")
        return self._output(o, x), {"recurrent_state": S}

    def __call__(self, x, ctx: MixerContext):
        return self.forward(x, layer=ctx.layer)[0]

    def prefill(self, x, ctx: MixerContext, max_len: int):
        """The forward pass over a prompt plus the state it leaves (``max_len``: not needed)."""
        return self.forward(x)

    # -- decode

    def init_state(self, batch: int) -> dict:
        return {"recurrent_state": jnp.zeros((batch, self.n_heads, self.head_dim, self.head_dim), jnp.float32)}

    def step(self, x_t, state: dict):
        """One token: ``x_t [B, d]`` -> ``(y_t [B, d], new state)``."""
        q, k, v = self._qkv(x_t)
        o, S = simple_gla_step(state["recurrent_state"], q, k, v, self.log_decay(),
                               scale=self.scale)
        return self._output(o, x_t), {"recurrent_state": S}
