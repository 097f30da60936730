"""Softmax-attention mixers: full causal attention (``attention``) and sliding-window (``swa``).

Both share :class:`Attention` (GQA projections, RoPE or NoPE per slot); they differ only in the
window. The windowed path never builds an O(T^2) mask: see ``hybrid_lm/ops/attention.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.backends import attention_backend, attention_op_name, record_backend
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import attention_mixing_flops
from hybrid_lm.model.layers import RMSNorm, apply_rope, out_proj_std, param
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops import attention as ops


# ----------------------------------------------------------------------------- dispatch

def attend(q, k, v, *, window: int | None, positions, impl: str, permuted: bool = False,
           window_right: int = 0, segment_ids=None):
    """Causal attention with an optional window, dispatched to xla / cudnn / pallas / jla
    (``hybrid_lm.backends.attention_backend``).

    q ``[B,T,H,D]``, k/v ``[B,T,K,D]``, ``positions [B,T]`` original positions in the given order
    (only read when ``permuted``: otherwise the order is the identity). ``window_right``: the band
    also covers keys up to ``window_right`` slots right of the query in the given order, still
    causal by position (SA's ``window_mode='symmetric'`` passes ``window - 1``). It only acts when
    ``permuted``: in the identity order those keys are all in the future, so it is dropped there.
    ``segment_ids [B, T]`` (``DataConfig.document_mask``, in the given order): keys of the query's
    document only; the backend resolver sends it to xla (or refuses an explicit other backend).
    """
    T = q.shape[1]
    if window_right < 0:
        raise ValueError(f"window_right must be >= 0, got {window_right}")
    if not permuted:
        window_right = 0  # identity order: every key right of the query is in the future
    if window is not None and window >= T and not permuted:
        window = None  # a window covering the sequence is plain causal attention
    impl, reason = attention_backend(impl, permuted=permuted, window=window, qkv=(q, k, v),
                                     segments=segment_ids is not None)
    record_backend(attention_op_name(window, permuted), impl, reason)
    if impl == "pallas":
        try:
            import hybrid_lm_kernels as kernels  # may not import here (backends.py picks xla then)
        except ImportError as e:
            raise ConfigError(f"attention_impl='pallas' needs the Pallas kernels (hybrid_lm_kernels): {e}") from None
        return kernels.windowed_attention(q, k, v, positions if permuted else None, window or T,
                                          window_right=window_right)
    if impl == "jla":
        # the default "ranged" backward: deterministic (bitwise resume), unlike "fused"
        return _jla_flash_attention()(q, k, v, sliding_window=window)
    if window is None and not permuted:
        if segment_ids is not None:  # xla (the resolver's choice)
            return ops.causal_attention(q, k, v, implementation="xla", segment_ids=segment_ids)
        return ops.causal_attention(q, k, v, implementation="cudnn" if impl == "cudnn" else "xla")
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0),
                                            implementation="cudnn")
    return ops.windowed_attention(q, k, v, window if window is not None else T, positions=positions,
                                  window_right=window_right, segment_ids=segment_ids)


@functools.cache
def _jla_flash_attention():
    """jla's Mosaic GPU attention, jitted so identical calls (one per layer) lower and compile once."""
    from jla.ops.mosaic_gpu.attention import flash_attention  # the [gpu] extra
    return jax.jit(flash_attention, static_argnames=("sliding_window",))


# ----------------------------------------------------------------------------- FLOPs

def mean_keys_per_query(seq_len: int, window: int | None) -> float:
    """Exact mean number of visible keys per query for causal attention with a window."""
    T = seq_len
    if window is None or window >= T:
        return (T + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (T - w) * w) / T


def attention_projection_flops(cfg: ModelConfig) -> float:
    d, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    return 2.0 * (d * H * Dh + 2 * d * K * Dh + H * Dh * d)


def _attention_flops(window_of):
    def flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
        keys = mean_keys_per_query(seq_len, window_of(mc))
        return {"matmul": attention_projection_flops(cfg), "mixing": attention_mixing_flops(cfg, keys)}
    return flops


# ----------------------------------------------------------------------------- module

def qkv_params(cfg: ModelConfig, rngs: nnx.Rngs):
    """GQA projection kernels ``wq [d, H, Dh]``, ``wk``/``wv [d, K, Dh]``."""
    d, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    return (param(rngs, (d, H, Dh), ("embed", "heads", "head_dim"), cfg.init_std),
            param(rngs, (d, K, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std),
            param(rngs, (d, K, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std))


def qk_norm_params(cfg: ModelConfig):
    """``(q_norm, k_norm)``: per-head RMSNorms of q and k (``ModelConfig.qk_norm``, Qwen3's)."""
    return RMSNorm(cfg.resolved_head_dim, cfg.norm_eps), RMSNorm(cfg.resolved_head_dim, cfg.norm_eps)


def project_qkv(x, wq, wk, wv, positions, rope: bool, rope_theta: float, q_norm=None, k_norm=None,
                rope_scaling=()):
    """q, k, v ``[B, T, heads, Dh]`` in x's dtype: q and k RMS-normed per head when ``q_norm`` /
    ``k_norm`` are given (``ModelConfig.qk_norm``), then RoPE at ``positions`` unless NoPE
    (``rope_scaling``: ``MixerConfig.rope_scaling``'s items)."""
    dt = x.dtype
    q = jnp.einsum("btd,dhk->bthk", x, wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, wv[...].astype(dt))
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if rope:
        q, k = apply_rope(q, positions, rope_theta, rope_scaling), apply_rope(k, positions, rope_theta, rope_scaling)
    return q, k, v


class Attention(nnx.Module):
    """Multi-head causal attention with grouped KV heads; ``window=None`` means full attention.
    With ``ModelConfig.qk_norm`` it also holds ``q_norm`` / ``k_norm`` (every subclass applies them
    through :meth:`project_qkv`)."""

    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs,
                 window: int | None = None):
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
        self.wq, self.wk, self.wv = qkv_params(cfg, rngs)
        self.wo = param(rngs, (H, Dh, d), ("heads", "head_dim", "embed"), out_proj_std(cfg))
        if cfg.qk_norm:  # no attribute otherwise: the parameter tree of existing models is unchanged
            self.q_norm, self.k_norm = qk_norm_params(cfg)
        self.window = window
        self.rope = mc.rope
        self.rope_theta = mc.rope_theta
        self.rope_scaling = tuple(sorted(mc.rope_scaling.items()))  # hashable: static module data
        self.layer_idx = layer_idx

    def project_qkv(self, x, positions):
        return project_qkv(x, self.wq, self.wk, self.wv, positions, self.rope, self.rope_theta,
                           getattr(self, "q_norm", None), getattr(self, "k_norm", None), self.rope_scaling)

    def project_out(self, o):
        return jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(o.dtype))

    def __call__(self, x, ctx: MixerContext):
        q, k, v = self.project_qkv(x, ctx.positions)
        o = attend(q, k, v, window=self.window, positions=ctx.positions, impl=ctx.attention_impl,
                   segment_ids=ctx.segment_ids)
        return self.project_out(o)


class AttentionDecode:
    """Decode path of causal attention mixers (mixed into full and sliding-window attention; MoBA
    and SSA extend it): a KV cache of ``window`` slots (a ring buffer; ``max_len`` for full
    attention) with the original position of each slot. State: ``{"k", "v": [B, C, K, Dh],
    "slot_pos": [C] int32 (-1 = empty), "pos": int32}`` (one position for the whole batch: prompts
    are aligned, no left padding). Subclasses override ``attend_prompt`` (the forward pass's
    attention), ``read`` (one query against the cache) and ``extend_state``."""

    def _capacity(self, max_len: int) -> int:
        return max_len if self.window is None else min(self.window, max_len)

    def attend_prompt(self, q, k, v, ctx: MixerContext):
        return attend(q, k, v, window=self.window, positions=ctx.positions, impl=ctx.attention_impl,
                      segment_ids=ctx.segment_ids)

    def extend_state(self, state: dict, q, k, pos) -> dict:
        """Extra decode state after writing ``q, k [B, n, heads, Dh]`` at positions ``pos ... pos+n-1``
        (the prompt at prefill, one token per step); plain attention keeps none."""
        return state

    def read(self, q_t, state: dict):
        """Attention of ``q_t [B, 1, H, Dh]`` at position ``state["pos"]`` over the cache (which holds it)."""
        pos, kc, vc, slot_pos = state["pos"], state["k"], state["v"], state["slot_pos"]
        visible = slot_pos >= 0
        if self.window is not None:
            visible &= slot_pos > pos - self.window
        B, _, Kh, Dh = kc.shape
        # the cache is read in its own dtype with fp32 accumulation (no fp32 copy of the cache);
        # the probabilities meet V in V's dtype, as in flash attention
        qg = q_t[:, 0].astype(kc.dtype).reshape(B, Kh, -1, Dh)  # [B, K, G, Dh]
        s = jnp.einsum("bkgd,bckd->bkgc", qg, kc, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(Dh))
        p = jax.nn.softmax(jnp.where(visible[None, None, None, :], s, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgc,bckd->bkgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return o.reshape(B, 1, -1, Dh)

    def decode_output(self, o, x):
        """``o [B, n, H, Dh]`` (the stream's attention output) -> the mixer's output for input ``x``."""
        return self.project_out(o.astype(x.dtype))

    def prefill(self, x, ctx: MixerContext, max_len: int):
        """The forward pass over a prompt ``x [B, T, d]`` plus the cache it leaves: ``(y, state)``."""
        B, T = x.shape[:2]
        if T > max_len:
            raise ValueError(f"prompt of {T} tokens is longer than max_len={max_len}")
        q, k, v = self.project_qkv(x, ctx.positions)
        y = self.decode_output(self.attend_prompt(q, k, v, ctx), x)
        C = self._capacity(max_len)
        # slot s holds the latest prompt position p < T with p % C == s (none: -1)
        slot_pos = (T - 1) - jnp.mod(T - 1 - jnp.arange(C), C)
        take = jnp.clip(slot_pos, 0, T - 1)
        state = {"k": k[:, take], "v": v[:, take],
                 "slot_pos": jnp.where(slot_pos >= 0, slot_pos, -1).astype(jnp.int32),
                 "pos": jnp.asarray(T, jnp.int32)}
        return y, self.extend_state(state, q, k, jnp.asarray(0, jnp.int32))

    def step(self, x_t, state: dict):
        """One token ``x_t [B, d]`` at position ``state["pos"]`` -> ``(y_t [B, d], new state)``.
        Full attention: the caller keeps ``pos < max_len`` (``hybrid_lm.eval.generate`` checks)."""
        B = x_t.shape[0]
        pos = state["pos"]
        C = state["slot_pos"].shape[0]
        q, k, v = self.project_qkv(x_t[:, None], jnp.broadcast_to(pos, (B, 1)))
        slot = jnp.mod(pos, C)
        state = dict(state,
                     k=jax.lax.dynamic_update_slice_in_dim(state["k"], k.astype(state["k"].dtype), slot, axis=1),
                     v=jax.lax.dynamic_update_slice_in_dim(state["v"], v.astype(state["v"].dtype), slot, axis=1),
                     slot_pos=state["slot_pos"].at[slot].set(pos))
        state = self.extend_state(state, q, k, pos)
        y = self.decode_output(self.read(q, state), x_t[:, None])[:, 0]
        return y, dict(state, pos=pos + 1)


@register_mixer("attention", flops=_attention_flops(lambda mc: None), reads=("rope", "rope_theta", "rope_scaling"),
                description="full causal softmax attention (GQA), RoPE or NoPE", document_mask=True,
                decode="a KV cache")
class FullAttention(AttentionDecode, Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=None)


@register_mixer("swa", flops=_attention_flops(lambda mc: mc.window), reads=("window", "rope", "rope_theta", "rope_scaling"),
                description="causal sliding-window attention, window w counts the query itself", document_mask=True,
                decode="a ring buffer of `window` keys")
class SlidingWindowAttention(AttentionDecode, Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=mc.window)
