"""Gated DeltaNet mixer (``gdn``): fla ``GatedDeltaNet`` (Yang, Kautz & Hatamizadeh, arXiv 2412.06464).

Layer (H heads; key width Dk = head_dim, value width Dv = expand_v * Dk)::

    q, k, v = silu(conv(x Wq)), silu(conv(x Wk)), silu(conv(x Wv))   # short causal convs, kernel 4
    q, k    = l2norm(q), l2norm(k)                                    # per head
    beta    = sigmoid(x Wb)                                           # [H]
    g       = -exp(A_log) * softplus(x Wa + dt_bias)                  # [H], log decay
    S_t     = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t / sqrt(Dk)
    out     = Wo( rmsnorm(o) * silu(x Wg) )                           # per-head norm, then the gate

The core is ``chunk_gated_delta_rule`` (training, called through ``ops/linear_attention_gpu``: jla's
Hopper kernel under ``ModelConfig.linear_impl`` when the head dims fit it) / ``gated_delta_rule_step`` (decode).

fla's defaults, kept: ``expand_v`` 2, conv kernel 4 without bias, output gate on (fla
``FusedRMSNormGated``: normalise, scale, then multiply by ``silu(gate)``; eps 1e-5, weight shared by
the heads), ``A ~ U(0, 16)``, ``dt`` log-uniform in [1e-3, 0.1] (floor 1e-4) stored as softplus^-1,
no bias anywhere, no weight decay on ``A_log``/``dt_bias``.

Sizing. fla's defaults (head_dim 256, 6 heads) are for d = 2048; its rule is ``num_heads * head_dim =
0.75 d`` so that the layer holds about ``6 d^2`` parameters (q, k: 0.75 d^2 each; v, gate, out:
1.5 d^2 each). We keep the rule and choose heads to match the model's: ``num_heads = n_heads``
(= d / 128 in the S1-S5 presets) and ``head_dim = 0.75 d / num_heads`` (= 96 there, Dv = 192).
Both are options. ``MixerConfig.rope`` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.layers import out_proj_std, param
from hybrid_lm.model.recurrent_common import (INNER_NORM_EPS, RECURRENT_DOCUMENT_MASK, GatedRMSNorm, ShortConv,
                                              a_log_init, const_param, delta_rule_chunk_macs, dt_bias_init,
                                              l2norm)
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops.delta_rule import gated_delta_rule_step
from hybrid_lm.ops.linear_attention_gpu import gated_delta_rule

# The jla path hands o back at the kernel's padded width and dtype, read in place by the output norm
# (gated_delta_rule(padded_output=True)); off: sliced and cast to q's dtype (fp32) first.
GDN_PADDED_OUTPUT = True


@dataclass(frozen=True)
class GDNOptions:
    """Options of ``gdn`` (``efficient/MixerConfig.options``); see the module docstring for defaults."""

    num_heads: int | None = None  # None: ModelConfig.n_heads
    head_dim: int | None = None  # key width Dk; None: 0.75 * d_model / num_heads (fla's 0.75 d rule)
    expand_v: float = 2.0  # Dv = expand_v * Dk
    conv_size: int = 4
    conv_bias: bool = False
    use_gate: bool = True  # output gate (fla FusedRMSNormGated); False: plain per-head RMSNorm
    chunk_size: int = 64  # tokens per chunk of the training scan (speed/memory only)

    def validate(self) -> None:
        for name in ("num_heads", "head_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"gdn option {name}={v!r} must be None or an int >= 1")
        for name in ("conv_size", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"gdn option {name}={v!r} must be an int >= 1")
        if not isinstance(self.expand_v, (int, float)) or self.expand_v <= 0:
            raise ConfigError(f"gdn option expand_v={self.expand_v!r} must be a number > 0")

    def dims(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """``(heads, Dk, Dv)``; raises ConfigError when the sizes do not fit."""
        H = self.num_heads or cfg.n_heads
        if self.head_dim is not None:
            Dk = self.head_dim
        else:
            if (3 * cfg.d_model) % (4 * H):
                raise ConfigError(f"gdn: 0.75 * d_model = {0.75 * cfg.d_model} is not a multiple of num_heads={H}; "
                                  "set options head_dim or num_heads")
            Dk = 3 * cfg.d_model // (4 * H)
        Dv = Dk * self.expand_v
        if abs(Dv - round(Dv)) > 1e-9:
            raise ConfigError(f"gdn: expand_v={self.expand_v} x head_dim={Dk} is not an integer")
        return H, Dk, int(round(Dv))


def gdn_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Forward FLOPs per token (2 per MAC), chunk ``C = min(chunk_size, T)``, ``Kd = H Dk``, ``Vd = H Dv``:

    - matmul: ``d (2 Kd + Vd + 2 H)`` (q, k, v, a, b), the gate ``d Vd`` if on, and ``Vd d`` (out);
    - mixing: the chunked delta rule per head
      ``2 C Dk + C Dv + (C - 1)/2 (Dk + Dv) + 3 Dk Dv`` (see ``delta_rule_chunk_macs``), plus the three
      short convs ``K (2 Kd + Vd)``.

    Elementwise work (L2 norms, gates, norm) is not counted.
    """
    o = GDNOptions(**mc.options)
    d = cfg.d_model
    H, Dk, Dv = o.dims(cfg)
    Kd, Vd = H * Dk, H * Dv
    C = min(o.chunk_size, seq_len)
    matmul = 2.0 * (d * (2 * Kd + Vd + 2 * H) + (d * Vd if o.use_gate else 0) + Vd * d)
    mixing = 2.0 * (H * delta_rule_chunk_macs(C, Dk, Dv) + o.conv_size * (2 * Kd + Vd))
    return {"matmul": matmul, "mixing": mixing}


class _RMSNorm(nnx.Module):
    """Ungated per-head output norm (fla ``RMSNorm(head_v_dim)``), used when ``use_gate=False``."""

    def __init__(self, dim: int):
        self.scale = const_param(jnp.ones((dim,)), ("norm",))

    def __call__(self, x, z=None):
        """``x [..., W >= dim]``: the first ``dim`` columns (the kernel's padded output) are normalised."""
        xf = x[..., :self.scale.shape[0]].astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + INNER_NORM_EPS)
        return (y * self.scale[...]).astype(x.dtype)


@register_mixer("gdn", flops=gdn_flops, reads=("options",), options=GDNOptions,
                description="Gated DeltaNet: short convs, L2-normed q/k, gated delta rule (chunked), "
                            "gated RMSNorm output", document_mask=RECURRENT_DOCUMENT_MASK,
                decode="the recurrent state and the convs' last inputs")
class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        o = GDNOptions(**mc.options)
        o.validate()
        d = cfg.d_model
        H, Dk, Dv = o.dims(cfg)
        std = cfg.init_std
        # Projections that feed a short conv carry the conv's channel axis ("conv_dim").
        self.w_q = param(rngs, (d, H * Dk), ("embed", "conv_dim"), std)
        self.w_k = param(rngs, (d, H * Dk), ("embed", "conv_dim"), std)
        self.w_v = param(rngs, (d, H * Dv), ("embed", "conv_dim"), std)
        self.conv_q = ShortConv(H * Dk, o.conv_size, rngs=rngs, bias=o.conv_bias)
        self.conv_k = ShortConv(H * Dk, o.conv_size, rngs=rngs, bias=o.conv_bias)
        self.conv_v = ShortConv(H * Dv, o.conv_size, rngs=rngs, bias=o.conv_bias)
        self.w_a = param(rngs, (d, H), ("embed", "heads"), std)
        self.w_b = param(rngs, (d, H), ("embed", "heads"), std)
        self.A_log = const_param(a_log_init(rngs, H, 0.0, 16.0), ("ssm_heads",))
        self.dt_bias = const_param(dt_bias_init(rngs, H), ("ssm_heads",))
        if o.use_gate:
            self.w_g = param(rngs, (d, H, Dv), ("embed", "heads", "head_dim"), std)
            self.o_norm = GatedRMSNorm(Dv, norm_before_gate=True)
        else:
            self.w_g = None
            self.o_norm = _RMSNorm(Dv)
        self.w_o = param(rngs, (H, Dv, d), ("heads", "head_dim", "embed"), out_proj_std(cfg))
        self.opts = o
        self.layer_idx = layer_idx
        self.n_heads, self.dk, self.dv = H, Dk, Dv
        self.linear_impl = cfg.linear_impl  # auto | xla | jla (ops/linear_attention_gpu.py)

    # -- pieces shared by the chunked forward and the decode step (any leading shape [..., d])

    def _project(self, x):
        dt = x.dtype
        return tuple(x @ w[...].astype(dt) for w in (self.w_q, self.w_k, self.w_v))

    def _heads_and_gates(self, x, q, k, v):
        lead = q.shape[:-1]
        # fp32 unit-norm q, k: the op computes in fp32 anyway (fla normalises inside its kernel)
        q = l2norm(q.reshape(*lead, self.n_heads, self.dk).astype(jnp.float32))
        k = l2norm(k.reshape(*lead, self.n_heads, self.dk).astype(jnp.float32))
        v = v.reshape(*lead, self.n_heads, self.dv)
        beta = jax.nn.sigmoid((x @ self.w_b[...].astype(x.dtype)).astype(jnp.float32))
        a = (x @ self.w_a[...].astype(x.dtype)).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        return q, k, v, g, beta

    def _output(self, o, x):
        """``o [..., H, W >= Dv]`` (the values' first Dv columns; wider: the kernel's padded output)."""
        gate = None
        if self.w_g is not None:
            gate = jnp.einsum("...d,dhv->...hv", x, self.w_g[...].astype(x.dtype))
        y = self.o_norm(o, gate).astype(x.dtype)
        return jnp.einsum("...hv,hvd->...d", y, self.w_o[...].astype(x.dtype))

    # -- training / prefill

    def forward(self, x, state=None):
        """``x [B, T, d]`` -> ``(y [B, T, d], state)``; ``state`` as :meth:`init_state` (None = zeros)."""
        q, k, v = self._project(x)
        cs = (None, None, None) if state is None else state["conv_state"]
        (q, sq), (k, sk), (v, sv) = self.conv_q(q, cs[0]), self.conv_k(k, cs[1]), self.conv_v(v, cs[2])
        q, k, v, g, beta = self._heads_and_gates(x, q, k, v)
        # the fast path rounds the fp32 unit-norm q, k to the compute dtype for the kernel (kernel_dtype) and
        # hands back o at its padded width, which the output norm reads in place (padded_output)
        o, S = gated_delta_rule(q, k, v, g, beta,
                                initial_state=None if state is None else state["recurrent_state"],
                                output_final_state=True, chunk_size=self.opts.chunk_size,
                                impl=self.linear_impl, kernel_dtype=x.dtype, label="gdn",
                                padded_output=GDN_PADDED_OUTPUT)
        return self._output(o, x), {"conv_state": (sq, sk, sv), "recurrent_state": S}

    def __call__(self, x, ctx: MixerContext):
        return self.forward(x)[0]

    def prefill(self, x, ctx: MixerContext, max_len: int):
        """The forward pass over a prompt plus the state it leaves (``max_len``: not needed)."""
        return self.forward(x)

    # -- decode

    def init_state(self, batch: int) -> dict:
        """Conv states (q, k, v) ``[B, K-1, channels]`` and the delta-rule state ``[B, H, Dk, Dv]`` (fp32)."""
        return {"conv_state": (self.conv_q.init_state(batch), self.conv_k.init_state(batch),
                               self.conv_v.init_state(batch)),
                "recurrent_state": jnp.zeros((batch, self.n_heads, self.dk, self.dv), jnp.float32)}

    def step(self, x_t, state: dict):
        """One token: ``x_t [B, d]`` -> ``(y_t [B, d], new state)``."""
        q, k, v = self._project(x_t)
        cs = state["conv_state"]
        (q, sq), (k, sk), (v, sv) = (self.conv_q.step(q, cs[0]), self.conv_k.step(k, cs[1]),
                                     self.conv_v.step(v, cs[2]))
        q, k, v, g, beta = self._heads_and_gates(x_t, q, k, v)
        o, S = gated_delta_rule_step(state["recurrent_state"], q, k, v, g, beta)
        return self._output(o, x_t), {"conv_state": (sq, sk, sv), "recurrent_state": S}
