"""Stochastic attention (``sa``) and gated SA + SWA (``sa_swa``); design notes in docs/STOCHASTIC_ATTENTION.md.

SA (Jin & Sui, arXiv 2604.00754) permutes the tokens at random, runs causal sliding-window attention
of window w in the permuted order and restores the order. Causality stays by *original* position:
with i, j permuted slots, key j is visible iff ``i - w < j <= i`` and ``pos[j] <= pos[i]`` (the mask
of ``hybrid_lm/ops/attention.py``). RoPE uses the original positions.

``window_mode='symmetric'`` (option; the default ``'causal'`` is the mask above, as specified) uses
the two-sided band in permuted order: visible iff ``|i - j| < w`` and ``pos[j] <= pos[i]``. It is
still SWA(w-1, 0) for the identity order, exactly causal attention for ``w >= T`` whatever the
permutation, and sees about ``(2w-1) p / T`` keys at position p, at about twice the band (cost).

Every op before and after the attention is token-wise, so the permutation commutes with it: the
``sa`` mixer gathers the residual input ``x`` once (``[B, T, d]``), projects it with RoPE at the
permuted original positions, attends in permuted order and un-permutes the projected output with the
inverse permutation (exact: gathers copy values).

Permutations: one per layer, per step and per example (or per batch), from
``fold_in(key(seed), step, layer, global example id)`` (``hybrid_lm/ops/permutation.py``).

Decoding (option ``decode``, docs/STOCHASTIC_ATTENTION.md §9): ``'permutation'`` (default) draws, at
prefill, the eval permutation of all ``max_len`` positions and keeps the slot of every position; a new
token at position t then attends to the cached keys in its band (the forward's mask), so prefill plus
steps give exactly the eval forward pass of the whole ``max_len``-token sequence. ``'swa'``: SA on the
prompt, sliding-window attention of window w for the new tokens (the paper's training-free protocol).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import attention_mixing_flops
from hybrid_lm.model.attention import (Attention, attend, attention_projection_flops, mean_keys_per_query,
                                       project_qkv, qk_norm_params, qkv_params)
from hybrid_lm.model.layers import param
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops import permutation as P


# ----------------------------------------------------------------------------- options

WINDOW_MODES = ("causal", "symmetric")
# 'permutation': the eval permutation of all max_len positions, drawn at prefill (decode = the eval
# forward of the whole sequence); 'swa': SA at prefill, sliding-window attention at decode
DECODE_MODES = ("permutation", "swa")


def sa_window_right(window: int, window_mode: str) -> int:
    """Band slots right of the query in permuted order: 0 ('causal') or ``window - 1`` ('symmetric')."""
    if window_mode not in WINDOW_MODES:
        raise ConfigError(f"window_mode={window_mode!r}: choose one of {WINDOW_MODES}")
    return window - 1 if window_mode == "symmetric" else 0


@dataclass(frozen=True)
class SAOptions:
    """Options of ``sa`` (``efficient/MixerConfig.options``); reasons in docs/STOCHASTIC_ATTENTION.md."""

    per_example: bool = True  # one permutation per example; False: one per batch (shared by all rows)
    eval_draws: int = 1  # eval: 1 = one fixed draw; k > 1 = mean of the layer output over k draws
    eval_seed: int | None = None  # eval permutations' seed; None = the run's seed (own stream, see ops)
    # 'causal': band i - w < j <= i in permuted order (the spec); 'symmetric': |i - j| < w (2w - 1
    # slots, ~2x the cost; w >= T is then exactly causal full attention). Both causal by position.
    window_mode: str = "causal"
    # token-by-token generation (docs/STOCHASTIC_ATTENTION.md §9): 'permutation' = the eval forward's
    # mask over all max_len positions; 'swa' = SA at prefill, SWA of window w at decode
    decode: str = "permutation"

    def validate(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"sa option decode={self.decode!r}: choose one of {DECODE_MODES} ('permutation': "
                              "the eval permutation of every position, drawn at prefill; 'swa': SA at prefill, "
                              "sliding-window attention at decode)")
        if self.window_mode not in WINDOW_MODES:
            raise ConfigError(f"sa option window_mode={self.window_mode!r}: choose one of {WINDOW_MODES} "
                              "('causal': i - w < j <= i in permuted order, the spec; 'symmetric': |i - j| < w)")
        if not isinstance(self.eval_draws, int) or self.eval_draws < 1:
            raise ConfigError(f"sa option eval_draws={self.eval_draws!r} must be an int >= 1")
        if not isinstance(self.per_example, bool):
            raise ConfigError(f"sa option per_example={self.per_example!r} must be a bool")
        if self.eval_seed is not None and not isinstance(self.eval_seed, int):
            raise ConfigError(f"sa option eval_seed={self.eval_seed!r} must be an int or None")


@dataclass(frozen=True)
class SASWAOptions(SAOptions):
    """Options of ``sa_swa``: those of ``sa`` plus the gate granularity and projection sharing."""

    gate: str = "head"  # head: one sigmoid per (token, head); channel: one per (token, head, channel)
    shared_qkv: bool = True  # SA and SWA branches share wq/wk/wv (wo is always shared)

    def validate(self) -> None:
        super().validate()
        if self.gate not in ("head", "channel"):
            raise ConfigError(f"sa_swa option gate={self.gate!r}: choose 'head' or 'channel'")
        if not isinstance(self.shared_qkv, bool):
            raise ConfigError(f"sa_swa option shared_qkv={self.shared_qkv!r} must be a bool")


# ----------------------------------------------------------------------------- permutations

def sa_permutations(opts: SAOptions, ctx: MixerContext, layer: int, batch: int, length: int):
    """``[(perm, inv), ...]``: one pair when training, ``eval_draws`` pairs at eval.

    Training draws from ``(ctx.seed, ctx.step)``; eval from ``(eval_seed, EVAL_STREAM + draw)`` so
    that every checkpoint is evaluated under the same permutations. ``ctx.example_ids`` are global
    example indices; without them (a caller outside the trainer) the global row index is used.
    ``ctx.layer`` (the traced index under ``scan_layers``), when set, replaces ``layer``.
    """
    layer = layer if ctx.layer is None else ctx.layer
    ids = ctx.example_ids if ctx.example_ids is not None else jnp.arange(batch, dtype=jnp.int32)
    if ctx.train:
        streams = [(ctx.seed, ctx.step)]
    else:
        seed = ctx.seed if opts.eval_seed is None else opts.eval_seed
        streams = [(seed, P.EVAL_STREAM + d) for d in range(opts.eval_draws)]
    out = []
    for seed, step in streams:
        perm = P.draw_permutations(seed, step, layer, ids, length, per_example=opts.per_example)
        out.append((perm, P.invert(perm)))
    return out


def permute_positions(positions, perm):
    """Original positions in permuted order (integers: no gradient, plain gather)."""
    return jnp.take_along_axis(positions, perm, axis=1)


def _mean(ys):
    return ys[0] if len(ys) == 1 else sum(ys[1:], ys[0]) / len(ys)


# ----------------------------------------------------------------------------- FLOPs

def sa_mean_band_keys(seq_len: int, window: int, window_right: int = 0) -> float:
    """Exact mean number of slots (the query's included) in the permuted-order band
    ``[s - window + 1, s + window_right] ∩ [0, T)`` of a slot s, averaged over s.

    ``m + (1/T) sum_{k<T} min(k, r)`` with m = ``mean_keys_per_query(T, window)`` (the left part, as
    SWA) and ``r = min(window_right, T - 1)``: ``m`` for 'causal', ``2m - 1`` for 'symmetric'
    (``r = w - 1``), which is ``T`` once ``w >= T``.
    """
    T = seq_len
    m = mean_keys_per_query(T, window)
    r = min(window_right, T - 1)
    return m + (r * (r + 1) / 2 + (T - 1 - r) * r) / T


def sa_mean_visible_keys(seq_len: int, window: int, position: float | None = None,
                         window_right: int = 0) -> float:
    """Exact expected number of visible keys (the query included) under a uniform permutation.

    A token at original position p sits in a uniformly random slot s and shares the band with
    ``band(s) - 1`` other slots, each holding a uniformly random other token, visible iff its
    position is < p (probability p / (T-1)). So, by linearity,
    ``E[keys | p] = 1 + (M - 1) p / (T - 1)`` with M = ``sa_mean_band_keys`` the mean band size:
    M = m (the mean causal band of SWA, ``mean_keys_per_query``) for the one-sided band,
    ``~ w p / T`` for w << T; M = 2m - 1 for the symmetric band (``window_right = w - 1``),
    ``~ (2w - 1) p / T``, and exactly ``p + 1`` (causal attention) once w >= T. Averaged over p
    (``position=None``): ``1 + (M - 1) / 2`` (= m for the symmetric band: as many keys as SWA sees).
    Positions are assumed to be 0..T-1 (one document per row).
    """
    T = seq_len
    if T == 1:
        return 1.0
    band = sa_mean_band_keys(T, window, window_right)
    frac = 0.5 if position is None else position / (T - 1)
    return 1.0 + (band - 1.0) * frac


def _sa_keys(mc: MixerConfig, opts: SAOptions, seq_len: int) -> tuple[float, float]:
    """(band, visible): mean keys per query a kernel computes, and the mean visible among them."""
    wr = sa_window_right(mc.window, opts.window_mode)
    return (sa_mean_band_keys(seq_len, mc.window, wr),
            sa_mean_visible_keys(seq_len, mc.window, window_right=wr))


def sa_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Counts the band a kernel computes, not the ~half of it that is visible.

    'causal': m keys per query, as SWA; 'symmetric': 2m - 1 (both sides of the query in permuted
    order). The masked half of the band is scattered at random inside every tile (causality by
    original position in a permuted order), so no kernel can skip it: counting visible pairs would
    rate SA at half its cost (the same as SWA for 'causal', about twice for 'symmetric').
    ``mixing_visible`` reports the useful part (exact expectation under a uniform permutation,
    ``sa_mean_visible_keys``).
    """
    band, visible = _sa_keys(mc, SAOptions(**mc.options), seq_len)
    return {"matmul": attention_projection_flops(cfg), "mixing": attention_mixing_flops(cfg, band),
            "mixing_visible": attention_mixing_flops(cfg, visible)}


def sa_swa_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    opts = SASWAOptions(**mc.options)
    d, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    matmul = attention_projection_flops(cfg)
    if not opts.shared_qkv:
        matmul += 2.0 * d * (H + 2 * K) * Dh  # the SA branch's own q/k/v projections
    matmul += 2 * 2.0 * d * H * (Dh if opts.gate == "channel" else 1)  # two gate projections
    swa_band = mean_keys_per_query(seq_len, mc.window)
    sa_band, sa_visible = _sa_keys(mc, opts, seq_len)
    swa = attention_mixing_flops(cfg, swa_band)
    return {"matmul": matmul, "mixing": swa + attention_mixing_flops(cfg, sa_band),
            "mixing_visible": swa + attention_mixing_flops(cfg, sa_visible)}


# ----------------------------------------------------------------------------- decode

def extend_positions(positions, length: int):
    """``positions [B, T]`` continued one by one to ``[B, length]`` (the positions still to come)."""
    T = positions.shape[1]
    if length == T:
        return positions
    return jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(length - T, dtype=positions.dtype)], 1)


def sa_band_visible(inv, pos, window: int, window_right: int = 0):
    """``[B, L]`` bool: the keys (by position) the query at position ``pos`` sees under the
    permutations whose inverses are ``inv [B, L]`` (``inv[b, j]`` = the slot of position j): a slot in
    the band ``(s - window, s + window_right]`` of the query's slot s, at a position <= pos. This is
    the forward's mask (``ops.attention``), one query row of it."""
    slot = jnp.take(inv, pos, axis=1)[:, None]  # [B, 1] the query's slot
    return (inv > slot - window) & (inv <= slot + window_right) & (jnp.arange(inv.shape[1]) <= pos)[None]


def window_visible(slot_pos, pos, window: int):
    """``[C]`` bool: the cache slots holding one of the last ``window`` positions up to ``pos``."""
    return (slot_pos >= 0) & (slot_pos <= pos) & (slot_pos > pos - window)


def read_cache(q_t, kc, vc, visible):
    """Attention of ``q_t [B, 1, H, Dh]`` over the cache ``kc``/``vc [B, C, K, Dh]`` restricted to
    ``visible`` (``[C]`` or per row ``[B, C]``); fp32 ``[B, 1, H, Dh]``. Same numerics as
    ``AttentionDecode.read``: the cache in its own dtype, fp32 accumulation."""
    B, _, Kh, Dh = kc.shape
    visible = visible if visible.ndim == 2 else visible[None]
    qg = q_t[:, 0].astype(kc.dtype).reshape(B, Kh, -1, Dh)  # [B, K, G, Dh]
    s = jnp.einsum("bkgd,bckd->bkgc", qg, kc, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(Dh))
    p = jax.nn.softmax(jnp.where(visible[:, None, None, :], s, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgc,bckd->bkgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    return o.reshape(B, 1, -1, Dh)


def prompt_cache(kv: dict, T: int, capacity: int) -> dict:
    """A cache of ``capacity`` slots from the prompt's ``kv`` (name -> ``[B, T, K, Dh]``): slot c holds
    the latest prompt position p with ``p % capacity == c`` (``slot_pos``, -1 = empty); ``pos`` = T."""
    slot_pos = (T - 1) - jnp.mod(T - 1 - jnp.arange(capacity), capacity)
    take = jnp.clip(slot_pos, 0, T - 1)
    state = {name: a[:, take] for name, a in kv.items()}
    state.update(slot_pos=jnp.where(slot_pos >= 0, slot_pos, -1).astype(jnp.int32), pos=jnp.asarray(T, jnp.int32))
    return state


def write_cache(state: dict, kv: dict, pos) -> dict:
    """``state`` with one token's ``kv`` (name -> ``[B, 1, K, Dh]``) written at position ``pos``."""
    slot = jnp.mod(pos, state["slot_pos"].shape[0])
    new = {name: jax.lax.dynamic_update_slice_in_dim(state[name], a.astype(state[name].dtype), slot, axis=1)
           for name, a in kv.items()}
    return dict(state, **new, slot_pos=state["slot_pos"].at[slot].set(pos))


class SADecode:
    """Decode path of ``sa`` and ``sa_swa`` (docs/STOCHASTIC_ATTENTION.md §9).

    ``decode='permutation'``: the prefill runs the eval forward over ``max_len`` positions (the prompt
    followed by zeros, which no prompt query sees: the mask is causal by position) under the eval
    permutations of length ``max_len``, and keeps their inverses (``inv [draws, B, max_len]``, the
    slot of every position) with a full KV cache. A new token at position t attends to the cached
    keys in its band (``sa_band_visible``), so prefill plus steps reproduce the eval forward of the
    whole sequence, and the keys a token sees have exactly the law of the training mask at position
    t of a ``max_len``-token sequence. ``decode='swa'``: the prompt through the eval forward (SA),
    then SWA of window w over a ring buffer of w slots (the SA branch of ``sa_swa`` too).

    Subclasses give ``forward(x, ctx, draws)`` (the mixer under given permutations), ``decode_kv``
    (the prompt's cached arrays), ``decode_qkv`` (one token's queries and cache entries) and
    ``decode_out`` (the mixer output of one token from the updated state).
    """

    def prefill(self, x, ctx: MixerContext, max_len: int):
        """The eval forward over a prompt ``x [B, T, d]`` plus the decode state: ``(y, state)``."""
        B, T = x.shape[:2]
        if T > max_len:
            raise ValueError(f"prompt of {T} tokens is longer than max_len={max_len}")
        full = self.opts.decode == "permutation"
        L = max_len if full else T  # the length the permutations are drawn for
        ctx_l = dataclasses.replace(ctx, positions=extend_positions(ctx.positions, L))
        draws = sa_permutations(self.opts, ctx_l, self.layer_idx, B, L)
        x_l = x if L == T else jnp.pad(x, ((0, 0), (0, L - T), (0, 0)))
        y = self.forward(x_l, ctx_l, draws)[:, :T]
        state = prompt_cache(self.decode_kv(x, ctx.positions), T, max_len if full else min(self.window, max_len))
        if full:
            state["inv"] = jnp.stack([inv for _, inv in draws])
        return y, state

    def step(self, x_t, state: dict):
        """One token ``x_t [B, d]`` at position ``state["pos"]`` -> ``(y_t [B, d], new state)``; the
        caller keeps ``pos < max_len`` (``hybrid_lm.eval.generate`` checks)."""
        pos = state["pos"]
        x1 = x_t[:, None]
        queries, kv = self.decode_qkv(x1, jnp.broadcast_to(pos, (x_t.shape[0], 1)))
        state = write_cache(state, kv, pos)
        return self.decode_out(x1, queries, state)[:, 0], dict(state, pos=pos + 1)

    def sa_read(self, q_t, kc, vc, state: dict):
        """The SA head outputs ``[B, 1, H, Dh]`` (fp32) of the query at ``state["pos"]``: the band of
        its slot in every eval draw (mean over draws), or the last w positions (``decode='swa'``)."""
        pos = state["pos"]
        if self.opts.decode == "swa":
            return read_cache(q_t, kc, vc, window_visible(state["slot_pos"], pos, self.window))
        inv = state["inv"]
        return _mean([read_cache(q_t, kc, vc, sa_band_visible(inv[d], pos, self.window, self.window_right))
                      for d in range(inv.shape[0])])


# ----------------------------------------------------------------------------- sa

# Why SA refuses DataConfig.document_mask (docs/MIXERS.md, "Document masking")
SA_DOCUMENT_MASK = ("its random order spans the whole window, and the band is causal by position: with positions restarting per document that compares positions of different documents (a leak of later documents), and with a document test added a query keeps only its own document's share of the band (docs/MIXERS.md)")


@register_mixer("sa", flops=sa_flops, reads=("window", "rope", "rope_theta", "rope_scaling", "options"), options=SAOptions,
                description="stochastic attention: windowed attention in a random token order, causal by "
                            "original position, RoPE at original positions", document_mask=SA_DOCUMENT_MASK,
                decode="a KV cache and each position's slot in the eval permutation, or with option decode='swa' "
                       "SA on the prompt, then a ring buffer")
class StochasticAttention(SADecode, Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=mc.window)
        self.opts = SAOptions(**mc.options)
        self.opts.validate()
        self.window_right = sa_window_right(mc.window, self.opts.window_mode)

    def attend_permuted(self, x, positions, perm, inv, impl: str):
        """SA of ``x [B, T, d]`` under the given permutations; output in the original order."""
        xp = P.permute(x, perm, inv)  # the one gather of the residual input
        pp = permute_positions(positions, perm)
        q, k, v = self.project_qkv(xp, pp)  # RoPE at the permuted ORIGINAL positions
        o = attend(q, k, v, window=self.window, positions=pp, impl=impl, permuted=True,
                   window_right=self.window_right)
        return P.unpermute(self.project_out(o), perm, inv)

    def forward(self, x, ctx: MixerContext, draws):
        """The mixer under the given ``[(perm, inv), ...]`` (mean over them)."""
        return _mean([self.attend_permuted(x, ctx.positions, p, i, ctx.attention_impl) for p, i in draws])

    def __call__(self, x, ctx: MixerContext):
        B, T = x.shape[:2]
        return self.forward(x, ctx, sa_permutations(self.opts, ctx, self.layer_idx, B, T))

    # -- decode (SADecode)

    def decode_kv(self, x, positions):
        _, k, v = self.project_qkv(x, positions)
        return {"k": k, "v": v}

    def decode_qkv(self, x1, positions):
        q, k, v = self.project_qkv(x1, positions)
        return {"q": q}, {"k": k, "v": v}

    def decode_out(self, x1, queries, state):
        o = self.sa_read(queries["q"], state["k"], state["v"], state)
        return self.project_out(o.astype(x1.dtype))


# ----------------------------------------------------------------------------- sa_swa

class QKVProjection(nnx.Module):
    """Separate q/k/v projections (the SA branch's own, when ``shared_qkv=False``)."""

    def __init__(self, cfg: ModelConfig, mc: MixerConfig, *, rngs: nnx.Rngs):
        self.wq, self.wk, self.wv = qkv_params(cfg, rngs)
        self.rope, self.rope_theta = mc.rope, mc.rope_theta
        self.rope_scaling = tuple(sorted(mc.rope_scaling.items()))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = qk_norm_params(cfg)

    def __call__(self, x, positions):
        return project_qkv(x, self.wq, self.wk, self.wv, positions, self.rope, self.rope_theta,
                           getattr(self, "q_norm", None), getattr(self, "k_norm", None), self.rope_scaling)


@register_mixer("sa_swa", flops=sa_swa_flops, reads=("window", "rope", "rope_theta", "rope_scaling", "options"),
                options=SASWAOptions,
                description="gated SA + SWA: sigmoid(x W_sa) * Y_sa + sigmoid(x W_swa) * Y_swa per head",
                document_mask="its SA branch: " + SA_DOCUMENT_MASK, decode="as sa, for both branches")
class GatedSASWA(SADecode, Attention):
    """``Y = Wo[sigmoid(x W_sa) ⊙ O_sa + sigmoid(x W_swa) ⊙ O_swa]`` on the per-head outputs O.

    Two independent sigmoid gates computed from the mixer input x (as SSA's ``g_proj``: no bias, so
    both start near 0.5). The gates act on the head outputs before the shared output projection;
    with ``shared_qkv`` the SA branch reuses SWA's q/k/v and adds only the gate parameters.
    """

    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=mc.window)
        self.opts = SASWAOptions(**mc.options)
        self.opts.validate()
        self.window_right = sa_window_right(mc.window, self.opts.window_mode)  # SA branch only
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
        shape, axes = ((d, H, Dh), ("embed", "heads", "head_dim")) if self.opts.gate == "channel" else \
            ((d, H), ("embed", "heads"))
        self.w_gate_sa = param(rngs, shape, axes, cfg.init_std)
        self.w_gate_swa = param(rngs, shape, axes, cfg.init_std)
        self.sa_qkv = None if self.opts.shared_qkv else QKVProjection(cfg, mc, rngs=rngs)

    def gate(self, x, w):
        g = jax.nn.sigmoid(jnp.einsum("btd,d...->bt...", x, w[...].astype(x.dtype)))
        return g if self.opts.gate == "channel" else g[..., None]  # broadcast over head_dim

    def sa_heads(self, x, qkv, positions, perm, inv, impl: str):
        """SA head outputs ``[B, T, H, Dh]`` in original order.

        Shared projections: gather the RoPE'd q, k, v (RoPE at original positions commutes with the
        gather). Separate projections: gather x once and project it, as in ``sa``.
        """
        pp = permute_positions(positions, perm)
        if self.sa_qkv is None:
            q, k, v = (P.permute(t, perm, inv) for t in qkv)
        else:
            q, k, v = self.sa_qkv(P.permute(x, perm, inv), pp)
        o = attend(q, k, v, window=self.window, positions=pp, impl=impl, permuted=True,
                   window_right=self.window_right)
        return P.unpermute(o, perm, inv)

    def forward(self, x, ctx: MixerContext, draws):
        """The mixer with its SA branch under the given ``[(perm, inv), ...]`` (mean over them)."""
        qkv = self.project_qkv(x, ctx.positions)
        o_swa = attend(*qkv, window=self.window, positions=ctx.positions, impl=ctx.attention_impl)
        o_sa = _mean([self.sa_heads(x, qkv, ctx.positions, p, i, ctx.attention_impl) for p, i in draws])
        return self.combine(x, o_sa, o_swa)

    def combine(self, x, o_sa, o_swa):
        """``Wo[sigmoid(x W_sa) ⊙ O_sa + sigmoid(x W_swa) ⊙ O_swa]``."""
        return self.project_out(self.gate(x, self.w_gate_sa) * o_sa + self.gate(x, self.w_gate_swa) * o_swa)

    def __call__(self, x, ctx: MixerContext):
        B, T = x.shape[:2]
        return self.forward(x, ctx, sa_permutations(self.opts, ctx, self.layer_idx, B, T))

    # -- decode (SADecode): the SWA branch reads the last w cached positions, the SA branch its band

    def decode_kv(self, x, positions):
        _, k, v = self.project_qkv(x, positions)
        kv = {"k": k, "v": v}
        if self.sa_qkv is not None:
            _, kv["k_sa"], kv["v_sa"] = self.sa_qkv(x, positions)
        return kv

    def decode_qkv(self, x1, positions):
        q, k, v = self.project_qkv(x1, positions)
        queries, kv = {"q": q}, {"k": k, "v": v}
        if self.sa_qkv is not None:
            queries["q_sa"], kv["k_sa"], kv["v_sa"] = self.sa_qkv(x1, positions)
        return queries, kv

    def decode_out(self, x1, queries, state):
        o_swa = read_cache(queries["q"], state["k"], state["v"],
                           window_visible(state["slot_pos"], state["pos"], self.window))
        if self.sa_qkv is not None:
            o_sa = self.sa_read(queries["q_sa"], state["k_sa"], state["v_sa"], state)
        elif self.opts.decode == "swa":
            o_sa = o_swa  # shared projections: the SA branch decodes as the SWA branch
        else:
            o_sa = self.sa_read(queries["q"], state["k"], state["v"], state)
        return self.combine(x1, o_sa.astype(x1.dtype), o_swa.astype(x1.dtype))
