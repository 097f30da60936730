"""Mamba-2 mixer (``mamba2``): the SSD layer of mamba_ssm ``Mamba2`` / fla ``Mamba2``.

Layer (``d_inner = expand * d``, ``H = d_inner / head_dim`` heads of width P = head_dim, G groups
of B/C with state size N = d_state)::

    z, xBC, dt = x W_z, x W_xBC, x W_dt                  # in-projection (no bias)
    xBC        = silu(conv1d_causal(xBC))                # depthwise, kernel 4, with bias
    x, B, C    = split(xBC)                              # [H, P], [G, N], [G, N]
    dt         = softplus(dt + dt_bias)                  # [H]
    A          = -exp(A_log)                             # [H]
    S_t        = exp(A dt_t) S_{t-1} + B_t (dt_t x_t)^T  # per head, S [N, P]
    y_t        = C_t^T S_t + D x_t                       # D skip, one scalar per head
    out        = W_out( rmsnorm(y * silu(z)) )           # gated RMSNorm, norm_before_gate=False

The SSD core is ``chunk_simple_gla`` with ``q = C, k = B, v = x * dt, g = A * dt, scale = 1`` (called
through ``ops/linear_attention_gpu.simple_gla``: jla's Hopper kernel under ``ModelConfig.linear_impl``). Head h
reads B/C group ``h // (H / G)`` (mamba_ssm's kernels). The in-projection is stored as three
matrices (z, xBC, dt) rather than mamba_ssm's one fused ``in_proj``: same function and count.

Defaults (``Mamba2Options``) are mamba_ssm's / fla's ``Mamba2Config``: d_state 128, expand 2,
head_dim 64, n_groups 1, conv kernel 4 with bias, no in/out-projection bias, ``A ~ U(1, 16)``,
``dt`` log-uniform in [1e-3, 0.1] (floor 1e-4) stored as softplus^-1, D = 1, gated RMSNorm in groups
of ``d_inner / n_groups`` with eps 1e-5, ``dt_limit = (0, inf)`` (no clamp). Two differences, both
documented in docs/MIXERS.md: projection weights use the model's init (normal ``init_std``, output
projection ``out_proj_std``) instead of torch's ``Linear`` init, and the XLA scan's chunk is 64
(mamba_ssm's kernel uses 256; the result does not depend on it). ``MixerConfig.rope`` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.layers import out_proj_std, param
from hybrid_lm.model.recurrent_common import (RECURRENT_DOCUMENT_MASK, GatedRMSNorm, ShortConv, a_log_init,
                                              const_param, dt_bias_init)
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops.linear_attention import simple_gla_step
from hybrid_lm.ops.linear_attention_gpu import simple_gla


@dataclass(frozen=True)
class Mamba2Options:
    """Options of ``mamba2`` (``efficient/MixerConfig.options``); defaults are mamba_ssm's."""

    d_state: int = 128  # N
    expand: int = 2  # d_inner = expand * d_model
    head_dim: int = 64  # P; heads = d_inner / head_dim
    n_groups: int = 1  # B/C groups (G), must divide the heads
    conv_kernel: int = 4
    conv_bias: bool = True
    A_init_range: tuple = (1.0, 16.0)
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    chunk_size: int = 64  # tokens per chunk of the training scan (speed/memory only)

    def validate(self) -> None:
        for name in ("d_state", "expand", "head_dim", "n_groups", "conv_kernel", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"mamba2 option {name}={v!r} must be an int >= 1")
        r = tuple(self.A_init_range)
        if len(r) != 2 or not 0 < r[0] <= r[1]:
            raise ConfigError(f"mamba2 option A_init_range={self.A_init_range!r} must be (lo, hi) with 0 < lo <= hi")
        if not 0 < self.dt_min <= self.dt_max or self.dt_init_floor <= 0:
            raise ConfigError(f"mamba2 options need 0 < dt_min <= dt_max and dt_init_floor > 0, got "
                              f"{self.dt_min}, {self.dt_max}, {self.dt_init_floor}")

    def dims(self, d_model: int) -> tuple[int, int, int]:
        """``(d_inner, heads, conv_dim)``; raises ConfigError when the sizes do not fit."""
        d_inner = self.expand * d_model
        if d_inner % self.head_dim:
            raise ConfigError(f"mamba2: head_dim={self.head_dim} does not divide d_inner = expand * d_model "
                              f"= {d_inner}")
        H = d_inner // self.head_dim
        if H % self.n_groups:
            raise ConfigError(f"mamba2: n_groups={self.n_groups} does not divide the {H} heads")
        return d_inner, H, d_inner + 2 * self.n_groups * self.d_state


def mamba2_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Forward FLOPs per token (2 per MAC), chunk ``C = min(chunk_size, T)``:

    - matmul: in-projection ``d (d_inner + conv_dim + H)`` (z, xBC, dt) and out-projection
      ``d_inner d``, with ``conv_dim = d_inner + 2 G N``;
    - mixing: the SSD scan as mamba_ssm computes it, ``C^T B`` once per *group* (``G C N``) and per
      head ``C P`` (scores x values) + ``2 N P`` (state update and read-out); plus the short conv
      ``K conv_dim``. I.e. ``2 (G C N + H (C P + 2 N P) + K conv_dim)``.

    Elementwise work (softplus, exp, D skip, gated norm) is not counted. Our XLA path broadcasts B
    and C to the heads, so it executes ``H C N`` for the scores; a kernel need not.
    """
    o = Mamba2Options(**mc.options)
    d = cfg.d_model
    d_inner, H, conv_dim = o.dims(d)
    C, N, P, G = min(o.chunk_size, seq_len), o.d_state, o.head_dim, o.n_groups
    matmul = 2.0 * (d * (d_inner + conv_dim + H) + d_inner * d)
    ssd = G * C * N + H * (C * P + 2.0 * N * P)  # = H * simple_gla_chunk_macs(C, N, P) - (H - G) C N
    return {"matmul": matmul, "mixing": 2.0 * (ssd + o.conv_kernel * conv_dim)}


@register_mixer("mamba2", flops=mamba2_flops, reads=("options",), options=Mamba2Options,
                description="Mamba-2 (SSD): in-projection, short causal conv, selective scalar-decay scan "
                            "(chunked), D skip, gated RMSNorm", document_mask=RECURRENT_DOCUMENT_MASK,
                decode="the recurrent state and the conv's last inputs")
class Mamba2(nnx.Module):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        o = Mamba2Options(**mc.options)
        o.validate()
        d = cfg.d_model
        d_inner, H, conv_dim = o.dims(d)
        P, N, G = o.head_dim, o.d_state, o.n_groups
        std = cfg.init_std
        self.w_z = param(rngs, (d, H, P), ("embed", "heads", "head_dim"), std)
        self.w_xbc = param(rngs, (d, conv_dim), ("embed", "conv_dim"), std)
        self.w_dt = param(rngs, (d, H), ("embed", "heads"), std)
        self.conv = ShortConv(conv_dim, o.conv_kernel, rngs=rngs, bias=o.conv_bias, activation="silu")
        self.A_log = const_param(a_log_init(rngs, H, *o.A_init_range), ("ssm_heads",))
        self.dt_bias = const_param(dt_bias_init(rngs, H, o.dt_min, o.dt_max, o.dt_init_floor), ("ssm_heads",))
        self.D = const_param(jnp.ones((H,)), ("ssm_heads",))
        self.norm = GatedRMSNorm(d_inner, norm_before_gate=False, group_size=d_inner // G)
        self.w_out = param(rngs, (H, P, d), ("heads", "head_dim", "embed"), out_proj_std(cfg))
        self.opts = o
        self.layer_idx = layer_idx
        self.d_inner, self.n_heads, self.conv_dim = d_inner, H, conv_dim
        self.linear_impl = cfg.linear_impl  # auto | xla | jla (ops/linear_attention_gpu.py)

    # -- pieces shared by the chunked forward and the decode step (any leading shape [..., d])

    def _project(self, x):
        dt = x.dtype
        z = jnp.einsum("...d,dhp->...hp", x, self.w_z[...].astype(dt))
        xbc = x @ self.w_xbc[...].astype(dt)
        dt_raw = x @ self.w_dt[...].astype(dt)
        return z, xbc, dt_raw

    def _ssm_inputs(self, xbc, dt_raw, grouped: bool = False):
        """Split the conv output into per-head x [.., H, P] and B/C: per group [.., G, N] when ``grouped``
        (``simple_gla`` reads head h's from group h // (H / G)), else repeated to the heads [.., H, N];
        and dt, the log decay."""
        o, H = self.opts, self.n_heads
        GN = o.n_groups * o.d_state
        xs = xbc[..., : self.d_inner].reshape(*xbc.shape[:-1], H, o.head_dim)
        Bm = xbc[..., self.d_inner: self.d_inner + GN].reshape(*xbc.shape[:-1], o.n_groups, o.d_state)
        Cm = xbc[..., self.d_inner + GN:].reshape(*xbc.shape[:-1], o.n_groups, o.d_state)
        if not grouped:
            Bm, Cm = (jnp.repeat(x, H // o.n_groups, axis=-2) for x in (Bm, Cm))
        delta = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...])  # [.., H] fp32
        g = -jnp.exp(self.A_log[...]) * delta  # log decay A * dt <= 0
        v = xs.astype(jnp.float32) * delta[..., None]
        return xs, Bm, Cm, v, g

    def _output(self, y, xs, z, x_dtype):
        y = y.astype(jnp.float32) + self.D[...][:, None] * xs.astype(jnp.float32)  # D skip
        lead = y.shape[:-2]
        y = self.norm(y.reshape(*lead, self.d_inner), z.reshape(*lead, self.d_inner)).astype(x_dtype)
        return jnp.einsum("...hp,hpd->...d", y.reshape(*lead, self.n_heads, self.opts.head_dim),
                          self.w_out[...].astype(x_dtype))

    # -- training / prefill

    def forward(self, x, state=None):
        """``x [B, T, d]`` -> ``(y [B, T, d], state)``; ``state`` as :meth:`init_state` (None = zeros)."""
        z, xbc, dt_raw = self._project(x)
        xbc, conv_state = self.conv(xbc, None if state is None else state["conv_state"])
        xs, Bm, Cm, v, g = self._ssm_inputs(xbc, dt_raw, grouped=True)  # simple_gla repeats them if it must
        # the fast path rounds v = x * dt (fp32 here) to the compute dtype for the kernel (kernel_dtype)
        y, S = simple_gla(Cm, Bm, v, g=g, scale=1.0,
                          initial_state=None if state is None else state["recurrent_state"],
                          output_final_state=True, chunk_size=self.opts.chunk_size,
                          impl=self.linear_impl, kernel_dtype=x.dtype, label="mamba2")
        return self._output(y, xs, z, x.dtype), {"conv_state": conv_state, "recurrent_state": S}

    def __call__(self, x, ctx: MixerContext):
        return self.forward(x)[0]

    def prefill(self, x, ctx: MixerContext, max_len: int):
        """The forward pass over a prompt plus the state it leaves (``max_len``: not needed)."""
        return self.forward(x)

    # -- decode

    def init_state(self, batch: int) -> dict:
        """Conv state ``[B, K-1, conv_dim]`` and SSM state ``[B, H, N, P]`` (fp32)."""
        return {"conv_state": self.conv.init_state(batch),
                "recurrent_state": jnp.zeros((batch, self.n_heads, self.opts.d_state, self.opts.head_dim),
                                             jnp.float32)}

    def step(self, x_t, state: dict):
        """One token: ``x_t [B, d]`` -> ``(y_t [B, d], new state)``."""
        z, xbc, dt_raw = self._project(x_t)
        xbc, conv_state = self.conv.step(xbc, state["conv_state"])
        xs, Bm, Cm, v, g = self._ssm_inputs(xbc, dt_raw)
        y, S = simple_gla_step(state["recurrent_state"], Cm, Bm, v, g, scale=1.0)
        return self._output(y, xs, z, x_t.dtype), {"conv_state": conv_state, "recurrent_state": S}
