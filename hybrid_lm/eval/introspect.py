"""Looking inside a restored model at eval time, for layerwise probing (``eval/probe.py``) and
retrieval-head tracking (``eval/heads.py``), after the Rethinking-hybrids paper's official code
(thunlp/rethinking-hybrid-attention at feaad08: ``src/probing/``, ``src/tracing/``).

- **Items.** The 8-class needle-in-a-haystack prompt of ``src/probing/01_prepare_data.py``: one
  needle ``One of the special magic numbers for {key} is: {value}.`` with ``value`` one of
  ``31415920 .. 31415927`` (the class; item i is class ``i % 8``, balanced), in :data:`TEMPLATE`.
  :func:`probe_item` builds it as the official script does (``official``: the noise line repeated
  ``max(100, seq_len // 100)`` times with the needle at a random line of the middle half, or
  ``max(1000, seq_len // 4)`` words of essays / corpus from a random start with the needle at a
  sentence depth of 0, 3, ..., 99%), so its length in tokens follows from ``seq_len`` nominally;
  :func:`needle_item` builds the same prompt at exactly ``length`` tokens (``exact``; the needle at a
  depth drawn from 25-75% of the haystack). An item is a pure function of (seed, length, index,
  tokenizer, haystack).
- **The residual stream.** :func:`run_layers` runs ``model.embed`` then each block in eval mode
  (the model's own modules, unrolled; no model code changed); :func:`hidden_states` keeps one
  position per row after every block, the last through the final norm (Hugging Face's
  ``output_hidden_states[1:]``, which the official probe reads).
- **Attention weights.** :func:`head_attention`: the probabilities of a full-attention layer
  (``attention``, or ``attention_sink``, the full slot under ``--horizon``/``--sinks``) for chosen
  queries, recomputed in plain XLA from the layer's own ``project_qkv`` on its normed input (RoPE or
  NoPE as configured, GQA: query head h reads kv head ``h // (n_heads / n_kv_heads)``),
  ``softmax(q k^T / sqrt(head_dim))`` over the keys the layer lets the query see (causal; for
  ``attention_sink`` also ``i - horizon < j or j < sinks``). :func:`retrieval_stats` reduces them to
  the official retrieval score (``find_retrieval_heads.py``: the attention of the query at
  ``len - 2`` on the answer's token positions) and attention entropy (``compute_attention_metrics.py``:
  the last 4 queries, normalised by log(q + 1)); :func:`qk_distance` is ``compute_weight_distance.py``'s
  ``qk_rel_l2`` between two checkpoints' Q/K projections.
- **Jitting.** :func:`jitted` keeps one compiled function per (what, model config), so a sweep over
  checkpoints of one run compiles each shape once.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import ruler_items as R
from hybrid_lm.eval.ruler_items import TooShort
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.step import ModelFns

MAGIC_BASE = 31415920  # class c hides the number MAGIC_BASE + c (01_prepare_data.py MAGIC_NUMBERS_HARD)
N_CLASSES = 8
DEPTH_RANGE = (0.25, 0.75)  # exact prompts: the needle's depth, a fraction of the haystack's units
ITEM_TASK = "magic_number"  # the name that seeds the items' random streams (ruler.item_rng)
ATTENTION_KINDS = ("attention", "attention_sink")  # the full-attention mixers whose heads are tracked
PROMPTS = ("official", "exact")
# 01_prepare_data.py: TEMPLATE (the single form of RULER's NIAH template with its answer prefix)
TEMPLATE = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the number afterwards.\n{context}\nWhat is the special magic number for {query} mentioned "
            "in the provided text? The special magic number for {query} mentioned in the provided text is")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
ESSAY_DEPTHS = tuple(range(0, 100, 3))  # common.py build_depths(0, 99, 3): the essay needle's depths in percent


# ----------------------------------------------------------------------------- items


def _key_value(rng, index: int) -> tuple[str, str]:
    vocab = R.words()
    key = f"{vocab[rng.integers(len(vocab))]}-{vocab[rng.integers(len(vocab))]}"
    return key, str(MAGIC_BASE + index % N_CLASSES)


def simple_sent_tokenize(text: str) -> list[str]:
    """01_prepare_data.py simple_sent_tokenize (its sentence splitter without NLTK)."""
    sentences = re.split(r"([.!?]+)\s+", text)
    result = []
    for i in range(0, len(sentences) - 1, 2):
        result.append(sentences[i] + sentences[i + 1] if i + 1 < len(sentences) else sentences[i])
    if len(sentences) % 2 == 1:
        result.append(sentences[-1])
    return [s.strip() for s in result if s.strip()]


_WORDS: dict = {}


def haystack_words(haystack) -> list[str]:
    """The haystack's text as 01_prepare_data.py load_essay_haystack splits it: whitespace runs folded,
    split at spaces."""
    if haystack.identity not in _WORDS:
        _WORDS.clear()
        _WORDS[haystack.identity] = re.sub(r"\s+", " ", " ".join(haystack.texts)).split(" ")
    return _WORDS[haystack.identity]


def probe_text(seq_len: int, seed: int, index: int, haystack) -> tuple[str, str, str, float | None]:
    """``(prompt, key, value, depth)`` of item ``index`` as 01_prepare_data.py generates it for
    ``--seq_len seq_len``: the noise haystack ``max(100, seq_len // 100)`` lines with the needle at a
    line drawn from ``[n // 4, 3n // 4]`` (generate_input_output_repeat), else ``max(1000, seq_len // 4)``
    words from a random start of essays / corpus with the needle before sentence
    ``int(n_sentences * depth / 100)``, depth drawn from 0, 3, ..., 99 (generate_input_output_essay)."""
    rng = R.item_rng(ITEM_TASK, seq_len, seed, index)
    key, value = _key_value(rng, index)
    needle = NEEDLE.format(key=key, value=value)
    depth = None
    if haystack.lines:
        n = max(100, seq_len // 100)
        lines = [haystack.texts[0]] * n
        lines.insert(int(rng.integers(n // 4, n * 3 // 4 + 1)), needle)
        context = "\n".join(lines)
    else:
        words = haystack_words(haystack)
        n = min(max(1000, seq_len // 4), len(words))
        start = int(rng.integers(0, max(0, len(words) - n) + 1))
        sents = simple_sent_tokenize(" ".join(words[start:start + n]).strip())
        if not sents:
            context = " ".join(words[start:start + n]) + " " + needle
        else:
            depth = int(ESSAY_DEPTHS[rng.integers(len(ESSAY_DEPTHS))])
            sents.insert(min(int(len(sents) * (depth / 100)), len(sents)), needle)
            context = " ".join(sents)
            depth = depth / 100
    return TEMPLATE.format(context=context, query=key), key, value, depth


def probe_item(seq_len: int, seed: int, index: int, tok, haystack):
    """Item ``index`` (a :class:`~hybrid_lm.eval.ruler_items.Item`) of the official recipe
    (:func:`probe_text`) in ``tok``'s ids: its length follows from ``seq_len`` (nominal)."""
    text, key, value, depth = probe_text(seq_len, seed, index, haystack)
    ids = np.asarray(tok.encode(text), np.int32)
    return R.Item(ITEM_TASK, seq_len, seed, index, haystack.name, ids, 0, answers=(value,), gold=" " + value,
                  depths=() if depth is None else (depth,))


def needle_item(length: int, seed: int, index: int, tok, haystack, gen_tokens: int = 0):
    """Item ``index`` (a :class:`~hybrid_lm.eval.ruler_items.Item`) at exactly ``length - gen_tokens`` ids:
    :data:`TEMPLATE` with ``MAGIC_BASE + index % 8`` (``answers[0]``; ``gold`` is `` {value}``) in the
    haystack at ``needle_spans[0]``, before unit ``int(n_units * depth)``, the depth drawn from
    :data:`DEPTH_RANGE`. Raises :class:`~hybrid_lm.eval.ruler_items.TooShort` when the template leaves no
    room for a haystack."""
    rng = R.item_rng(ITEM_TASK, length, seed, index)
    key, value = _key_value(rng, index)
    depth = float(rng.uniform(*DEPTH_RANGE))
    prefix, question = R.split_template(TEMPLATE, query=key)
    return R._needle_item(
        ITEM_TASK, length, seed, index, tok, haystack, prefix=prefix, question=question,
        needles=[NEEDLE.format(key=key, value=value)], place=lambda n: [int(n * depth)], gen_tokens=gen_tokens,
        answers=(value,), gold=" " + value)


def needle_items(tok, length: int, samples: int, seed: int, haystack, gen_tokens: int = 0, what: str = "",
                 prompt: str = "exact") -> list:
    """Items ``0 .. samples - 1`` of :func:`needle_item` (``prompt="exact"``) or :func:`probe_item`
    (``"official"``, ``length`` the nominal seq_len); ``what`` prefixes a too-short error."""
    if prompt not in PROMPTS:
        raise ConfigError(f"{what or 'items'}: prompt={prompt!r}; choose one of {', '.join(PROMPTS)}")
    if prompt == "official":
        return [probe_item(length, seed, i, tok, haystack) for i in range(samples)]
    try:
        return [needle_item(length, seed, i, tok, haystack, gen_tokens) for i in range(samples)]
    except TooShort as e:
        raise TooShort(f"{what}{': ' if what else ''}{e}: use a longer seq_len") from None


def item_label(item) -> int:
    return int(item.answers[0]) - MAGIC_BASE


def answer_ids(tok, item) -> np.ndarray:
    """The teacher-forced answer: `` {value}`` (the number alone, no final period) in ``tok``'s ids."""
    return np.asarray(tok.encode(item.gold), np.int32)


def answer_positions(tok, ids, answers) -> np.ndarray:
    """find_retrieval_heads.py _needle_positions: every position of ``ids`` inside an occurrence of one
    of each answer's variants (``a``, `` a``, ``a.``, `` a.``, ``: a``, ``: a.``, each encoded alone),
    sorted; empty when none occurs (the official script then skips the item)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    found = np.zeros(len(ids), bool)
    for a in answers:
        for variant in (a, f" {a}", f"{a}.", f" {a}.", f": {a}", f": {a}."):
            pat = np.asarray(tok.encode(variant), np.int64)
            if not len(pat) or len(pat) > len(ids):
                continue
            starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, len(pat)) == pat, axis=1))
            for st in starts:
                found[st:st + len(pat)] = True
    return np.flatnonzero(found)


# ----------------------------------------------------------------------------- the residual stream


def eval_context(cfg, batch: int, length: int):
    """The eval-mode :class:`~hybrid_lm.model.registry.MixerContext` the trainer's eval uses."""
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


def hidden_states(model, tokens, ctx, last) -> jax.Array:
    """``[B, n_layers, d]`` fp32: each row's residual stream at position ``last [B]`` (or ``[B, 1]``) after every block,
    the last block's through the final norm: Hugging Face's ``output_hidden_states[1:]`` (its last entry
    is the final norm's output), the features 02_extract_hiddenstate.py keeps (``residual``)."""
    outs = run_layers(model, tokens, ctx)[1:]
    last = jnp.asarray(last, jnp.int32).reshape(-1)
    rows = jnp.arange(tokens.shape[0])
    feats = [x[rows, last].astype(jnp.float32) for x in outs[:-1]]
    feats.append(model.final_norm(outs[-1][rows, last][:, None])[:, 0].astype(jnp.float32))
    return jnp.stack(feats, axis=1)


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


SCORE_QUERY_FROM_END = 2  # find_retrieval_heads.py --query-index-from-end: the query at len(input) - 2
TAIL_QUERIES = 4  # compute_attention_metrics.py --tail-queries: the entropy's queries, the last 4
EPS = 1e-12  # compute_attention_metrics.py / compute_weight_distance.py --eps


def retrieval_stats(model, tokens, ctx, lengths, needle, layers: list[AttentionLayer]):
    """Per item, layer of ``layers`` and head, for prompts of ``lengths [B]`` tokens (right-padded in
    ``tokens``): ``(score, entropy, uniform)``.

    ``lengths`` may be ``[B]`` or ``[B, 1]``.

    - ``score [B, La, H]`` (find_retrieval_heads.py): the attention of the query at
      ``max(0, length - 2)`` summed over the keys where ``needle [B, T]`` (the answer's positions);
    - ``entropy [B, La, H]`` (compute_attention_metrics.py): over the last :data:`TAIL_QUERIES`
      queries q, the mean of ``H(p) / log(q + 1)``, p the query's attention on keys ``0..q``
      renormalised by ``sum + eps`` and clamped at eps;
    - ``uniform [B, La]``: the score uniform attention over the visible keys would give (chance)."""
    T = tokens.shape[1]
    lengths = jnp.asarray(lengths, jnp.int32).reshape(-1)
    q_score = jnp.clip(lengths - SCORE_QUERY_FROM_END, 0, lengths - 1)[:, None]
    q_tail = lengths[:, None] - TAIL_QUERIES + jnp.arange(TAIL_QUERIES)[None, :]
    tail_ok = (q_tail >= 0).astype(jnp.float32)  # a prompt shorter than 4 has fewer queries
    q_tail = jnp.maximum(q_tail, 0)
    qpos = jnp.concatenate([q_score, q_tail], axis=1)  # [B, 1 + TAIL]
    j = jnp.arange(T)[None, None, :]
    causal = j <= q_tail[..., None]  # [B, TAIL, T]: the keys 0..q the official slice keeps
    needle = jnp.asarray(needle, bool)
    by_layer = {a.layer: a for a in layers}
    score, entropy, uniform = [], [], []

    def visit(i, block, x):
        a = by_layer.get(i)
        if a is None:
            return
        p = head_attention(block, x, ctx.positions, qpos, a.horizon, a.sinks)  # [B, H, 1 + TAIL, T]
        score.append(jnp.sum(jnp.where(needle[:, None], p[:, :, 0], 0.0), -1))  # [B, H]
        pt = jnp.where(causal[:, None], p[:, :, 1:], 0.0)
        pt = pt / (pt.sum(-1, keepdims=True) + EPS)
        pt = jnp.maximum(pt, EPS)
        ent = -jnp.sum(jnp.where(causal[:, None], pt * jnp.log(pt), 0.0), -1)  # [B, H, TAIL]
        ent = ent / jnp.log(jnp.maximum(q_tail + 1, 2).astype(jnp.float32))[:, None]
        entropy.append(jnp.sum(ent * tail_ok[:, None], -1) / jnp.maximum(tail_ok.sum(-1), 1.0)[:, None])
        vis = visible_keys(q_score, T, a.horizon, a.sinks)[:, 0]  # [B, T]
        uniform.append((vis & needle).sum(-1) / jnp.maximum(vis.sum(-1), 1))

    run_layers(model, tokens, ctx, on_block=visit, stop=max(by_layer) + 1)
    return jnp.stack(score, 1), jnp.stack(entropy, 1), jnp.stack(uniform, 1)


def qk_weights(model, layers) -> list[tuple]:
    """``(wq [d, H, Dh], wk [d, K, Dh])`` fp32 of each layer index in ``layers``."""
    out = []
    for i in layers:
        mixer = model.blocks[i].mixer
        out.append((mixer.wq[...].astype(jnp.float32), mixer.wk[...].astype(jnp.float32)))
    return out


def qk_distance(wq, wk, wq_ref, wk_ref, eps: float = EPS) -> np.ndarray:
    """``[H]``: compute_weight_distance.py's ``qk_rel_l2`` per query head h: ``||Q_h - Q_h,ref||_F /
    (||Q_h,ref||_F + eps) + ||K_g - K_g,ref||_F / (||K_g,ref||_F + eps)``, Q_h the head's query columns
    ``wq[:, h]`` and K_g its kv head's key columns ``wk[:, h // group]`` (numpy)."""
    wq, wk, wq_ref, wk_ref = (np.asarray(w, np.float64) for w in (wq, wk, wq_ref, wk_ref))
    H, K = wq.shape[1], wk.shape[1]
    kv = np.minimum(np.arange(H) // max(1, H // K), K - 1)
    rel_q = np.sqrt(np.sum((wq - wq_ref) ** 2, axis=(0, 2))) / (np.sqrt(np.sum(wq_ref ** 2, axis=(0, 2))) + eps)
    rel_k = np.sqrt(np.sum((wk - wk_ref) ** 2, axis=(0, 2))) / (np.sqrt(np.sum(wk_ref ** 2, axis=(0, 2))) + eps)
    return rel_q + rel_k[kv]


# ----------------------------------------------------------------------------- jitting


_JITTED: dict = {}
_MODEL_FNS: dict = {}
MAX_JITTED = 32


def model_fns(run, cfg):
    """The :class:`~hybrid_lm.step.ModelFns` of ``cfg`` (the run's own when the model is the
    run's), built once per model config."""
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
    n = cfg.data.seq_len if seq_len is None else seq_len
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"{what}: seq_len={seq_len!r} must be a positive int")
    if n > cfg.data.seq_len:
        logging.getLogger(__name__).warning("%s at %d tokens, beyond the trained seq_len %d", what, n,
                                            cfg.data.seq_len)
    return int(n)


__all__ = ["ATTENTION_KINDS", "AttentionLayer", "DEPTH_RANGE", "MAGIC_BASE", "N_CLASSES", "PROMPTS", "TEMPLATE",
           "answer_ids", "answer_positions", "attention_layers", "check_length", "eval_context", "head_attention",
           "hidden_states", "item_label", "jitted", "last_token_states", "model_fns", "needle_item", "needle_items",
           "probe_item", "probe_text", "qk_distance", "qk_weights", "retrieval_stats", "run_layers",
           "simple_sent_tokenize", "visible_keys"]


def plot_setup(rows: list[dict], out_dir):
    """``(one row per checkpoint step in step order (the last given for a step), out_dir created,
    matplotlib.pyplot on the Agg backend)`` for a task's plots over checkpoints."""
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    rows = sorted({r["checkpoint_step"]: r for r in rows}.values(), key=lambda r: r["checkpoint_step"])
    out_dir = Path(out_dir)
    if rows:
        out_dir.mkdir(parents=True, exist_ok=True)
    return rows, out_dir, plt
