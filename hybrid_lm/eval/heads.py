"""Retrieval-head tracking (the Rethinking-hybrids paper, Fig. 5; thunlp/rethinking-hybrid-attention at
feaad08, ``src/tracing/``): which full-attention heads read the needle, how focused they are, and how
far their Q/K projections still are from the reference checkpoint's.

Data: :func:`hybrid_lm.eval.introspect.needle_items`, the magic-number NIAH prompt (the probe's
template) at exactly ``seq_len`` tokens (default 8,192, the official ``--max-input-tokens``, capped at
the run's trained seq_len), the needle at 25-75% depth; ``samples`` prompts (default 500, the
official attention-metrics ``--max-samples``).

For every head of every layer whose mixer is ``attention`` (the full slot; other mixers are skipped)
or ``attention_sink`` (the full slot under a receptive-field constraint, ``--horizon H --sinks S``:
the constraint is applied, i.e. a query sees key j iff ``j <= i`` and ``i - H < j or j < S``):

- ``mass``, the retrieval score (``find_retrieval_heads.py``): the attention of the query at
  ``len - 2`` summed over the positions of the answer's tokens (every occurrence of ``v``, `` v``,
  ``v.``, `` v.``, ``: v``, ``: v.``), averaged over the first 200 items (``--max-samples``) in which
  they occur; ``uniform_mass`` is what uniform attention over the visible keys would give (chance).
  The heads ranked by it are ``top_heads``; the top 4 are the official target heads;
- ``entropy`` (``compute_attention_metrics.py``): the attention entropy of the last 4 queries of the
  prompt, normalised by log(q + 1) (1 = uniform over the causal keys), averaged over queries and items;
- ``d_qk`` (``compute_weight_distance.py`` ``qk_rel_l2``): ``||Q_h - Q_h,ref||_F / ||Q_h,ref||_F +
  ||K_g - K_g,ref||_F / ||K_g,ref||_F``, Q_h the head's query columns ``wq[:, h, :]``, K_g its kv
  head's key columns ``wk[:, h // group, :]`` (GQA: heads of a group share the key part), ref the
  reference: ``reference_params`` if given, else the checkpoint at ``reference_step``, else the run's
  newest checkpoint that restores (0 there).

The official scripts report entropy and d_QK for the final checkpoint's 4 target heads; rows hold
every head, and :func:`plot_heads` draws the last checkpoint's top 4 over checkpoints. The attention
weights are recomputed in plain XLA from the layer's own ``project_qkv`` on its normed input
(``introspect.head_attention``): no training kernel is involved. Rows name heads ``L{layer}H{head}``.

Python: ``rows = evaluate_heads(RestoredRun(wd, step=s))``; ``format_heads(rows)``;
``plot_heads(rows_of_several_checkpoints, out_dir)``.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import introspect as I, ruler as R
from hybrid_lm.eval.ruler_items import haystack_for
from hybrid_lm.experiment import run_id
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import checkpoint_steps
from hybrid_lm.run.restore import RestoredRun
from hybrid_lm.run.swap import describe
from hybrid_lm.sharding import put_batch, replicated

HEADLINE = "top_head_mass"
TOP = 8  # heads listed in ``top_heads``
PLOTTED = 4  # find_retrieval_heads.py --top-k: the target heads (the last checkpoint's) drawn over checkpoints
CONTEXT = 8192  # the official --max-input-tokens: the prompts' length (capped at the run's trained seq_len)
SAMPLES = 500  # compute_attention_metrics.py --max-samples
SCORE_SAMPLES = 200  # find_retrieval_heads.py --max-samples: the items the retrieval score averages

_REFERENCE: dict = {}  # (workdir, step, layers) -> the reference checkpoint's Q/K weights (host arrays)


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def _stats_fn(fns, cfg, layers):
    layers = list(layers)

    def stats(params, tokens, lengths, needle):
        B, T = tokens.shape
        return I.retrieval_stats(fns.model(params), tokens, I.eval_context(cfg, B, T), lengths, needle, layers)
    return stats


def _qk_fn(fns, cfg, layers):
    layers = list(layers)
    return lambda params: I.qk_weights(fns.model(params), layers)


def qk_host(run, cfg, params, layers) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(wq, wk)`` per layer of ``layers`` from ``params`` (the run's parameter tree), on the host."""

    fn = I.jitted("qk_weights", run, cfg, _qk_fn, tuple(layers), out_shardings=replicated(run.mesh))
    with jax.set_mesh(run.mesh):
        out = fn(params)
    return [(np.asarray(q), np.asarray(k)) for q, k in out]


def reference_qk(run, cfg, layers, reference_params=None, reference_step: int | None = None):
    """``(Q/K weights per layer, reference step or None)`` of the reference (see the module doc)."""
    if reference_params is not None:
        if reference_step is not None:
            raise ConfigError("heads: give reference_params or reference_step, not both")
        return qk_host(run, cfg, reference_params, layers), None
    step = reference_step
    if step is None:
        steps = checkpoint_steps(run.workdir, missing_ok=True)
        step = max(steps) if steps else run.step
    if step == run.step:
        return qk_host(run, cfg, run.params, layers), run.step
    key = (str(run.workdir.resolve()), step, tuple(layers))
    if key not in _REFERENCE:
        try:
            ref = RestoredRun(run.workdir, step=step if reference_step is not None else None)
        except FileNotFoundError as e:
            raise ConfigError(f"heads: reference checkpoint: {e}") from None
        weights = qk_host(run, cfg, ref.params, layers)
        _REFERENCE.clear()  # one reference kept: a sweep over checkpoints shares it
        _REFERENCE[key] = (weights, ref.step)
    return _REFERENCE[key]


def _sequences(tok, items, length: int):
    """The prompts ``[N, length]`` (right-padded with 0), their lengths ``[N, 1]`` and the answer's
    positions ``[N, length]`` (:func:`~hybrid_lm.eval.introspect.answer_positions`)."""
    seqs = np.zeros((len(items), length), np.int32)
    lengths = np.array([[len(it.ids)] for it in items], np.int32)  # [N, 1]: batch-sharded as rows
    needle = np.zeros((len(items), length), bool)
    for r, it in enumerate(items):
        seqs[r, :len(it.ids)] = it.ids
        needle[r, I.answer_positions(tok, it.ids, it.answers)] = True
    return seqs, lengths, needle


def require_attention(cfg) -> None:
    """Raise :class:`ConfigError` unless the layer pattern has a full-attention layer (the heads tracked)."""
    kinds = sorted({cfg.model.mixer(t).kind for t in cfg.model.layer_types()})
    if not set(kinds) & set(I.ATTENTION_KINDS):
        raise ConfigError(f"heads: no full-attention layer (mixer {' or '.join(I.ATTENTION_KINDS)}) in layer "
                          f"pattern {''.join(cfg.model.layer_types())} (mixers: {', '.join(kinds)}); retrieval "
                          "heads are tracked on full-attention layers only")


def evaluate_heads(run, cfg=None, *, samples: int = SAMPLES, seq_len: int | None = None, seed: int = 0,
                   progress: bool = True, batch_size: int | None = None, haystack: str | None = "essays",
                   reference_params=None, reference_step: int | None = None) -> list[dict]:
    """One row (``task: heads``) for ``run``'s checkpoint with the model of ``cfg`` (default the
    run's): per full-attention layer and head the retrieval score (``mass``), normalised entropy and
    d_QK against the reference, and the heads ranked by score. Prompts are ``seq_len`` tokens (default
    :data:`CONTEXT` capped at the run's trained seq_len). Nothing is recorded. Raises ConfigError when
    no layer of ``cfg`` is full attention."""

    t0 = time.time()
    cfg = cfg or run.cfg
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"heads: samples={samples!r} must be an int >= 1")
    seq_len = I.check_length(cfg, min(CONTEXT, cfg.data.seq_len) if seq_len is None else seq_len, "heads")
    require_attention(cfg)
    layers = I.attention_layers(run.model(cfg))
    tok = run.tokenizer
    hay = haystack_for(haystack or "essays", tok, run)
    items = I.needle_items(tok, seq_len, samples, seed, hay, what="heads")
    seqs, lengths, needle = _sequences(tok, items, seq_len)
    found = needle.any(1)
    scored = found & (np.arange(samples) < SCORE_SAMPLES)  # the official script skips items without the answer
    idx = tuple(a.layer for a in layers)
    fn = I.jitted("heads_stats", run, cfg, _stats_fn, tuple(layers))
    per = R.batch_rows(run, seq_len, samples, batch_size)
    mass, entropy, uniform = [], [], []
    with jax.set_mesh(run.mesh), tqdm(total=-(-samples // per), desc="heads attention", unit="batch",
                                      disable=bar_disabled(progress), leave=False) as bar:
        parts = [R._batches(a, per) for a in (seqs, lengths, needle)]
        for batch in zip(*parts):
            n = batch[0][1]
            args = [put_batch(a, run.batch_shard) for a, _ in batch]
            m, e, u = (np.asarray(x)[:n] for x in fn(run.params, *args))
            mass.append(m)
            entropy.append(e)
            uniform.append(u)
            bar.update()
    mass, uniform = np.concatenate(mass), np.concatenate(uniform)
    if not scored.any():
        raise ConfigError(f"heads: the answer's tokens occur in none of the {samples} prompts with the run's "
                          "tokenizer (find_retrieval_heads.py skips such items)")
    mass = np.clip(mass[scored].mean(0), 0.0, 1.0)  # [La, H]; the clip only absorbs rounding
    uniform = uniform[scored].mean(0)  # [La]
    entropy = np.clip(np.concatenate(entropy).mean(0), 0.0, 1.0)
    current = qk_host(run, cfg, run.params, idx)
    ref, ref_step = reference_qk(run, cfg, idx, reference_params, reference_step)
    d_qk = np.stack([I.qk_distance(q, k, qr, kr) for (q, k), (qr, kr) in zip(current, ref)])
    heads = [{"head": head_name(a.layer, h), "layer": a.layer, "index": h, "mass": float(mass[li, h]),
              "entropy": float(entropy[li, h]), "d_qk": float(d_qk[li, h])}
             for li, a in enumerate(layers) for h in range(mass.shape[1])]
    ranked = sorted(heads, key=lambda x: -x["mass"])
    return [{"kind": "heads", "task": "heads", "step": run.step, "checkpoint_step": run.step,
             "tokens_seen": R.tokens_seen(run), "run_id": run_id(run.cfg), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "samples": samples, "score_samples": int(scored.sum()), "answer_missing": int((~found).sum()),
             "seq_len": seq_len, "trained_seq_len": run.cfg.data.seq_len, "seed": seed,
             "haystack": hay.name, "prompt_tokens": seq_len, "score_query": f"len - {I.SCORE_QUERY_FROM_END}",
             "entropy_queries": I.TAIL_QUERIES,
             "depth_range": list(I.DEPTH_RANGE), "depths": [round(it.depths[0], 4) for it in items], "layers": list(idx), "layer_kinds": [a.kind for a in layers],
             "constraints": [None if a.horizon is None else {"horizon": a.horizon, "sinks": a.sinks} for a in layers],
             "n_heads": int(mass.shape[1]), "n_kv_heads": int(cfg.model.n_kv_heads),
             "mass": mass.tolist(), "entropy": entropy.tolist(), "d_qk": d_qk.tolist(),
             "uniform_mass": [float(u) for u in uniform], "reference_step": ref_step,
             "top_heads": ranked[:TOP], "target_heads": [h["head"] for h in ranked[:PLOTTED]],
             "top_head": ranked[0]["head"], "top_head_mass": ranked[0]["mass"],
             "layer_types": "".join(cfg.model.layer_types()), "mixers": describe(cfg.model),
             "attention_impl": cfg.model.attention_impl, "wall_s": round(time.time() - t0, 3)}]


def format_heads(rows: list[dict]) -> str:
    """Per checkpoint: the top heads by needle mass, with entropy and d_QK, and the chance mass."""
    if not rows:
        return "no retrieval-head results"
    lines = []
    for r in sorted(rows, key=lambda r: r["checkpoint_step"]):
        ref = "given parameters" if r["reference_step"] is None else f"step {r['reference_step']}"
        chance = ", ".join(f"L{a} {u:.3f}" for a, u in zip(r["layers"], r["uniform_mass"]))
        lines.append(f"heads  step {r['checkpoint_step']}  {r['samples']} samples  seq_len {r['seq_len']}  "
                     f"haystack {r['haystack']}  d_QK against {ref}")
        lines.append(f"  score: attention of the query at len - 2 on the answer's tokens ({r.get('score_samples', '?')} "
                     f"items); under uniform attention: {chance}")
        lines.append(f"  {'head':<10}{'score':>8}{'entropy':>9}{'d_QK':>8}")
        for h in r["top_heads"]:
            lines.append(f"  {h['head']:<10}{h['mass']:>8.3f}{h['entropy']:>9.3f}{h['d_qk']:>8.3f}")
    return "\n".join(lines)


def _value(row: dict, key: str, name: str) -> float:
    """``row[key]`` of head ``name`` (NaN when that checkpoint lacks the head)."""
    layer, head = (int(x) for x in name[1:].split("H"))
    if layer not in row["layers"] or head >= row["n_heads"]:
        return float("nan")
    return float(row[key][row["layers"].index(layer)][head])


def plot_heads(rows: list[dict], out_dir: Path) -> list[Path]:
    """``heads_entropy_dqk.png``: normalised entropy H(t) and d_QK(t) over checkpoints for the last
    checkpoint's top heads by mass (Rethinking Fig. 5); ``heads_mass.png``: the needle mass,
    layer x head, at the last checkpoint."""
    rows, out_dir, plt = I.plot_setup(rows, out_dir)
    if not rows:
        return []
    last = rows[-1]
    top = [h["head"] for h in last["top_heads"][:PLOTTED]]
    steps = [r["checkpoint_step"] for r in rows]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in top:
        for ax, key in zip(axes, ("entropy", "d_qk")):
            ax.plot(steps, [_value(r, key, name) for r in rows], "o-", lw=1.2, ms=3, label=name)
    axes[0].set_ylabel("normalised attention entropy H (last 4 queries)")
    axes[1].set_ylabel("d_QK (relative to the reference)")
    for ax in axes:
        ax.set_xlabel("checkpoint step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(0, 1.02)
    fig.suptitle(f"target heads: the top {PLOTTED} by retrieval score at step {last['checkpoint_step']}")
    fig.tight_layout()
    curves = out_dir / "heads_entropy_dqk.png"
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    mass = np.asarray(last["mass"])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * mass.shape[1] + 2.5), max(2.5, 0.45 * mass.shape[0] + 1.5)))
    im = ax.imshow(mass, aspect="auto", origin="lower", vmin=0.0, vmax=max(1e-6, float(mass.max())), cmap="magma")
    ax.set_xticks(range(mass.shape[1]), [str(h) for h in range(mass.shape[1])])
    ax.set_yticks(range(mass.shape[0]), [f"L{a}" for a in last["layers"]])
    if mass.size <= 128:  # small grids: the values too
        for (li, h), m in np.ndenumerate(mass):
            ax.text(h, li, f"{m:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if m > 0.6 * mass.max() else "white")
    ax.set_xlabel("head")
    ax.set_ylabel("full-attention layer")
    ax.set_title(f"retrieval score, step {last['checkpoint_step']}\n(attention of the query at len - 2 on the "
                 "answer)", fontsize=9)
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    heat = out_dir / "heads_mass.png"
    fig.savefig(heat, dpi=120)
    plt.close(fig)
    return [curves, heat]


__all__ = ["HEADLINE", "evaluate_heads", "require_attention", "format_heads", "head_name", "plot_heads", "qk_host", "reference_qk"]
