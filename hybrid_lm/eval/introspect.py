"""Looking inside a restored model at eval time, for layerwise probing (``eval/probe.py``) and
retrieval-head tracking (``eval/heads.py``).

- **Items.** :func:`needle_items`: the 8-class needle-in-a-haystack data of the Rethinking-hybrids
  paper (section 4.2): one needle ``One of the special magic numbers for {key} is: {value}.`` with
  ``value`` one of ``31415920 .. 31415927`` (the class), at a depth drawn uniformly from 25-75% of
  the haystack, and the prompt ending with the question for the key's number. Built from
  ``eval/ruler.py``'s templates, haystacks (essays / corpus / noise) and item assembly; item i is a
  pure function of (seed, length, i, tokenizer, haystack), its class ``i % 8`` (balanced).
- **The residual stream.** :func:`run_layers` runs ``model.embed`` then each block in eval mode
  (the model's own modules, unrolled; no model code changed); :func:`last_token_states` keeps the
  last position after the embedding and after every block.
- **Attention weights.** :func:`head_attention`: the probabilities of a full-attention layer
  (``attention``, or ``attention_sink``, the full slot under ``--horizon``/``--sinks``) for chosen
  queries, recomputed in plain XLA from the layer's own ``project_qkv`` on its normed input (RoPE or
  NoPE as configured, GQA: query head h reads kv head ``h // (n_heads / n_kv_heads)``),
  ``softmax(q k^T / sqrt(head_dim))`` over the keys the layer lets the query see (causal; for
  ``attention_sink`` also ``i - horizon < j or j < sinks``). :func:`retrieval_stats` reduces them to
  the mass on the needle's span and the normalised entropy per head; :func:`qk_distance` compares
  the heads' Q/K projections of two checkpoints.
- **Jitting.** :func:`jitted` keeps one compiled function per (what, model config), so a sweep over
  checkpoints of one run compiles each shape once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.errors import ConfigError

MAGIC_BASE = 31415920  # class c hides the number MAGIC_BASE + c
N_CLASSES = 8
DEPTH_RANGE = (0.25, 0.75)  # the needle's depth, a fraction of the haystack's tokens
ITEM_TASK = "magic_number"  # the name that seeds the items' random streams (ruler.item_rng)
ATTENTION_KINDS = ("attention", "attention_sink")  # the full-attention mixers whose heads are tracked


# ----------------------------------------------------------------------------- items


def needle_item(length: int, seed: int, index: int, tok, haystack, gen_tokens: int = 0):
    """Item ``index`` (a :class:`~hybrid_lm.eval.ruler.Item`): a prompt of exactly ``length -
    gen_tokens`` ids hiding ``MAGIC_BASE + index % 8`` (``answers[0]``; ``gold`` is `` {value}``)
    at ``needle_spans[0]``, its depth drawn from :data:`DEPTH_RANGE`. Raises
    :class:`~hybrid_lm.eval.ruler.TooShort` when the template leaves no room for a haystack."""
    from hybrid_lm.eval import ruler as R

    rng = R.item_rng(ITEM_TASK, length, seed, index)
    vocab = R.words()
    key = f"{vocab[rng.integers(len(vocab))]}-{vocab[rng.integers(len(vocab))]}"
    value = str(MAGIC_BASE + index % N_CLASSES)
    depth = float(rng.uniform(*DEPTH_RANGE))
    return R._needle_item(
        ITEM_TASK, length, seed, index, tok, haystack, rng, prefix=R.TEMPLATES["niah_prefix_one"],
        needles=[R.TEMPLATES["niah_needle"].format(key=key, value=value)], depths=[depth],
        question=R.TEMPLATES["niah_question_one"].format(query=key), gen_tokens=gen_tokens,
        answers=(value,), gold=" " + value)


def needle_items(tok, length: int, samples: int, seed: int, haystack, gen_tokens: int = 0, what: str = "") -> list:
    """Items ``0 .. samples - 1`` of :func:`needle_item`; ``what`` prefixes a too-short error."""
    from hybrid_lm.eval.ruler import TooShort

    try:
        return [needle_item(length, seed, i, tok, haystack, gen_tokens) for i in range(samples)]
    except TooShort as e:
        raise TooShort(f"{what}{': ' if what else ''}{e}: use a longer seq_len") from None


def item_label(item) -> int:
    return int(item.answers[0]) - MAGIC_BASE


def answer_ids(tok, item) -> np.ndarray:
    """The teacher-forced answer: `` {value}`` (the number alone, no final period) in ``tok``'s ids."""
    return np.asarray(tok.encode(item.gold), np.int32)


def answer_budget(tok) -> int:
    """The most tokens any class's answer takes with ``tok``."""
    return max(len(tok.encode(f" {MAGIC_BASE + c}")) for c in range(N_CLASSES))


# ----------------------------------------------------------------------------- the residual stream


def eval_context(cfg, batch: int, length: int):
    """The eval-mode :class:`~hybrid_lm.model.registry.MixerContext` the trainer's eval uses."""
    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    return MixerContext(positions=default_positions(batch, length), attention_impl=cfg.model.attention_impl,
                        seed=cfg.train.seed, train=False)


def run_layers(model, tokens, ctx, *, on_block=None, stop: int | None = None) -> list:
    """``[embedding, after block 0, ..., after block n-1]`` (each ``[B, T, d]``) of ``tokens [B, T]``:
    the residual stream, blocks run one by one as ``HybridLM.run_blocks`` runs them unrolled.
    ``on_block(i, block, x)`` is called with each block's input; ``stop``: run blocks ``< stop`` only."""
    x = model.embed(tokens, jnp.dtype(model.cfg.compute_dtype))
    out = [x]
    for i, block in enumerate(model.blocks):
        if stop is not None and i >= stop:
            break
        if on_block is not None:
            on_block(i, block, x)
        x = block(x, ctx)
        out.append(x)
    return out


def last_token_states(model, tokens, ctx) -> jax.Array:
    """``[B, n_layers + 1, d]`` fp32: the last position's residual stream after the embedding and
    after each block."""
    return jnp.stack([x[:, -1].astype(jnp.float32) for x in run_layers(model, tokens, ctx)], axis=1)


# ----------------------------------------------------------------------------- attention weights


@dataclass(frozen=True)
class AttentionLayer:
    """A full-attention layer: its index, mixer kind and receptive-field constraint (None: causal)."""

    layer: int
    kind: str
    horizon: int | None = None
    sinks: int = 0


def attention_layers(model) -> list[AttentionLayer]:
    """The layers whose mixer kind is one of :data:`ATTENTION_KINDS`, in order."""
    out = []
    for i, block in enumerate(model.blocks):
        if block.mixer_kind == "attention":
            out.append(AttentionLayer(i, "attention"))
        elif block.mixer_kind == "attention_sink":
            o = block.mixer.opts
            out.append(AttentionLayer(i, "attention_sink", int(o.horizon), int(o.sinks)))
    return out


def visible_keys(qpos, length: int, horizon: int | None = None, sinks: int = 0):
    """``[B, A, T]`` bool: key j is visible to the query at ``qpos [B, A]`` (causal; with a horizon,
    ``qpos - horizon < j or j < sinks`` too: ``ops/sink_attention.py``'s rule)."""
    j = jnp.arange(length)[None, None, :]
    i = qpos[..., None]
    vis = j <= i
    if horizon is not None:
        vis &= (j > i - horizon) | (j < sinks)
    return vis


def head_attention(block, x, positions, qpos, horizon: int | None = None, sinks: int = 0) -> jax.Array:
    """``[B, H, A, T]`` fp32 attention probabilities of ``block``'s heads for the queries at
    ``qpos [B, A]``, ``x [B, T, d]`` being the block's input (the residual stream before it)."""
    h = block.mixer_norm(x)
    q, k, _ = block.mixer.project_qkv(h, positions)  # [B, T, H, Dh], [B, T, K, Dh]
    B, T, H, Dh = q.shape
    group = H // k.shape[2]
    q = jnp.take_along_axis(q, qpos[:, :, None, None], axis=1).astype(jnp.float32)  # [B, A, H, Dh]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # query head h reads kv head h // group
    s = jnp.einsum("bahd,bthd->bhat", q, k) * (1.0 / math.sqrt(Dh))
    vis = visible_keys(qpos, T, horizon, sinks)[:, None]
    return jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)


def retrieval_stats(model, tokens, ctx, qpos, qvalid, spans, layers: list[AttentionLayer]):
    """Per item, layer of ``layers`` and head, averaged over the valid queries (``qvalid [B, A]``) at
    ``qpos [B, A]``: ``(mass, entropy, uniform)``: ``mass [B, La, H]`` the attention on keys in
    ``[spans[:, 0], spans[:, 1])``, ``entropy [B, La, H]`` the attention's entropy over the
    visible keys divided by log(their count) (1 = uniform, 0 = one key), ``uniform [B, La]`` the
    mass uniform attention would put on the span (the chance level)."""
    T = tokens.shape[1]
    j = jnp.arange(T)[None, None, :]
    in_span = (j >= spans[:, :1, None]) & (j < spans[:, 1:2, None])  # [B, 1, T]
    w = qvalid.astype(jnp.float32)
    w = w / jnp.maximum(w.sum(1, keepdims=True), 1.0)  # [B, A]
    by_layer = {a.layer: a for a in layers}
    mass, entropy, uniform = [], [], []

    def visit(i, block, x):
        a = by_layer.get(i)
        if a is None:
            return
        p = head_attention(block, x, ctx.positions, qpos, a.horizon, a.sinks)  # [B, H, A, T]
        vis = visible_keys(qpos, T, a.horizon, a.sinks)  # [B, A, T]
        n_vis = vis.sum(-1).astype(jnp.float32)  # [B, A]
        m = jnp.sum(jnp.where(in_span[:, None], p, 0.0), -1)  # [B, H, A]
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
        ent = ent / jnp.log(jnp.maximum(n_vis, 2.0))[:, None]
        mass.append(jnp.einsum("bha,ba->bh", m, w))
        entropy.append(jnp.einsum("bha,ba->bh", ent, w))
        uniform.append(jnp.einsum("ba,ba->b", (vis & in_span).sum(-1) / n_vis, w))

    run_layers(model, tokens, ctx, on_block=visit, stop=max(by_layer) + 1)
    return jnp.stack(mass, 1), jnp.stack(entropy, 1), jnp.stack(uniform, 1)


def qk_weights(model, layers) -> list[tuple]:
    """``(wq [d, H, Dh], wk [d, K, Dh])`` fp32 of each layer index in ``layers``."""
    out = []
    for i in layers:
        mixer = model.blocks[i].mixer
        out.append((mixer.wq[...].astype(jnp.float32), mixer.wk[...].astype(jnp.float32)))
    return out


def qk_distance(wq, wk, wq_ref, wk_ref) -> np.ndarray:
    """``[H]``: per query head h, ``||W_t - W_ref||_F / ||W_ref||_F`` over the concatenation of h's
    query columns ``wq[:, h]`` and its kv head's key columns ``wk[:, h // group]`` (numpy)."""
    wq, wk, wq_ref, wk_ref = (np.asarray(w, np.float64) for w in (wq, wk, wq_ref, wk_ref))
    H, K = wq.shape[1], wk.shape[1]
    kv = np.arange(H) // (H // K)
    dq = np.sum((wq - wq_ref) ** 2, axis=(0, 2))
    dk = np.sum((wk - wk_ref) ** 2, axis=(0, 2))[kv]
    nq = np.sum(wq_ref ** 2, axis=(0, 2))
    nk = np.sum(wk_ref ** 2, axis=(0, 2))[kv]
    return np.sqrt(dq + dk) / np.maximum(np.sqrt(nq + nk), 1e-30)


# ----------------------------------------------------------------------------- jitting


_JITTED: dict = {}
_MODEL_FNS: dict = {}
MAX_JITTED = 32


def model_fns(run, cfg):
    """The :class:`~hybrid_lm.train.step.ModelFns` of ``cfg`` (the run's own when the model is the
    run's), built once per model config."""
    from hybrid_lm.train.step import ModelFns

    if cfg.model == run.cfg.model:
        return run.fns
    key = ("fns", repr(cfg.model))
    if key not in _MODEL_FNS:
        if len(_MODEL_FNS) >= MAX_JITTED:
            _MODEL_FNS.pop(next(iter(_MODEL_FNS)))
        _MODEL_FNS[key] = ModelFns(cfg)
    return _MODEL_FNS[key]


def jitted(name: str, run, cfg, build, *static, out_shardings=None):
    """``jax.jit(build(fns, cfg, *static))``, one per (name, model config (attention impl
    included), seed, static, out_shardings): the same compiled function serves every checkpoint of
    a run."""
    key = (name, repr(cfg.model), cfg.train.seed, static, out_shardings)
    if key not in _JITTED:
        if len(_JITTED) >= MAX_JITTED:  # a sweep over many configs: drop the oldest
            _JITTED.pop(next(iter(_JITTED)))
        fn = build(model_fns(run, cfg), cfg, *static)
        _JITTED[key] = jax.jit(fn) if out_shardings is None else jax.jit(fn, out_shardings=out_shardings)
    return _JITTED[key]


def check_length(cfg, seq_len: int | None, what: str) -> int:
    """``seq_len`` (default the config's) as an int >= 1; longer than the trained length is allowed."""
    import logging

    n = cfg.data.seq_len if seq_len is None else seq_len
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"{what}: seq_len={seq_len!r} must be a positive int")
    if n > cfg.data.seq_len:
        logging.getLogger(__name__).warning("%s at %d tokens, beyond the trained seq_len %d", what, n,
                                            cfg.data.seq_len)
    return int(n)


__all__ = ["ATTENTION_KINDS", "AttentionLayer", "DEPTH_RANGE", "MAGIC_BASE", "N_CLASSES", "answer_budget",
           "answer_ids", "attention_layers", "check_length", "eval_context", "head_attention", "item_label",
           "jitted", "last_token_states", "model_fns", "needle_item", "needle_items", "qk_distance",
           "qk_weights", "retrieval_stats", "run_layers", "visible_keys"]


def plot_setup(rows: list[dict], out_dir):
    """``(one row per checkpoint step in step order (the last given for a step), out_dir created,
    matplotlib.pyplot on the Agg backend)`` for a task's plots over checkpoints."""
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({r["checkpoint_step"]: r for r in rows}.values(), key=lambda r: r["checkpoint_step"])
    out_dir = Path(out_dir)
    if rows:
        out_dir.mkdir(parents=True, exist_ok=True)
    return rows, out_dir, plt
