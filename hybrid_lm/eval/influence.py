"""Gradient influence G(d): how strongly the last outputs depend on the input ``d`` tokens back
(the Rethinking-hybrids paper's Fig. 5; thunlp/rethinking-hybrid-attention
``src/gradient/run_gradient_influence.py``).

For an input of T tokens, ``e = model.embed(tokens)`` ``[B, T, d_model]`` and
``s = sum_v mean_{t in the last 20 positions} logits[t, v]`` (the logits of the last ``last``
positions averaged over those positions, then summed over the vocabulary: the official
``logit_sum`` target), ``G(d) = E_documents ||ds/de_{T-1-d}||_2``: d = 0 is the last input token,
d = T-1 the first. The model runs in eval mode (``MixerContext(train=False)``); the gradient is taken
in fp32 with respect to the embeddings (cast to the compute dtype inside), so a position outside
every output's receptive field gets exactly 0 (masked attention weights are exactly zero, and so are
their gradients).

Inputs (``inputs``): ``documents`` (default, as the official code): whole documents of the val split
of ``data`` (a prepared token store) or of the run's own store, each one's first T tokens after a
BOS (the tokenizer's separator, which precedes every document in the packed training stream; none
under ``DataConfig.document_mask``, where a document starts at position 0), documents shorter than T
left out; ``samples`` (default 1,000, the official ``--max-samples``) of them, T (default 8,192, the
official ``--context-len``, capped at the run's trained seq_len). ``windows``: the run's fixed eval
windows, which cross document boundaries (for a store without documents of T tokens).

:func:`evaluate_influence` returns one row (``task: influence``) with ``g`` (G(d) for every d) and
summaries: ``reach`` (the last distance with G(d) >= 1e-3 max G), ``mean_distance`` (the G-weighted
mean distance, the :data:`HEADLINE`) and ``bins`` (log2-binned means and mass fractions).
:func:`format_influence` prints rows, :func:`plot_influence` draws G(d) against d on log-log axes,
one curve per row (the Rethinking paper's Fig. 5).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from hybrid_lm.backends import recorded_backends
from hybrid_lm.errors import ConfigError, DataError
from hybrid_lm.eval.longppl import val_documents
from hybrid_lm.eval.ruler import batch_rows
from hybrid_lm.experiment import run_id
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions, segment_positions
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.swap import describe, swapped_config
from hybrid_lm.sharding import put_batch

log = logging.getLogger(__name__)

REACH_THRESHOLD = 1e-3  # reach: G(d) relative to max G below which a distance counts as out of reach
CONTEXT = 8192  # the official --context-len: tokens per document (capped at the run's trained seq_len)
SAMPLES = 1000  # the official --max-samples: documents averaged
LAST = 20  # the official --target-last-n-tokens
INPUTS = ("documents", "windows")

# mean_distance is normalised by sum G, so it does not move with the overall logit scale (which grows
# as training sharpens the logits); it is in tokens, has no threshold, and does not saturate at T-1 as
# reach does once a full-attention layer sees the whole window: comparable across checkpoints of a run.
HEADLINE = "mean_distance"


# ----------------------------------------------------------------------------- summaries of G(d)

def log2_bins(n: int) -> list[tuple[int, int]]:
    """Inclusive distance ranges ``[0,0], [1,1], [2,3], [4,7], ...`` covering ``0..n-1`` (the last cut)."""
    bins, lo = [(0, 0)], 1
    while lo < n:
        bins.append((lo, min(2 * lo - 1, n - 1)))
        lo *= 2
    return bins if n > 0 else []


def summarize(g) -> dict:
    """Summaries of ``g`` (G(d) for d = 0..T-1).

    - ``reach``: ``max{d : G(d) >= REACH_THRESHOLD * max G}``, so G(d) < 1e-3 max G for every d > reach
      (None when G is zero everywhere); ``reach_saturated``: reach == T-1 (the window is too short to
      see G fall below the threshold).
    - ``mean_distance``: ``sum_d d G(d) / sum_d G(d)`` in tokens (None when G is zero everywhere).
    - ``bins``: per :func:`log2_bins` range, ``lo``, ``hi`` (inclusive), ``mean`` G and ``mass`` (its
      share of sum G).
    """
    g = np.asarray(g, np.float64)
    T = len(g)
    total, top = float(g.sum()), float(g.max()) if T else 0.0
    reach = int(np.nonzero(g >= REACH_THRESHOLD * top)[0].max()) if top > 0 else None
    bins = [{"lo": lo, "hi": hi, "mean": float(g[lo:hi + 1].mean()),
             "mass": float(g[lo:hi + 1].sum() / total) if total > 0 else None} for lo, hi in log2_bins(T)]
    return {"g_max": top, "g_sum": total, "reach": reach, "reach_threshold": REACH_THRESHOLD,
            "reach_saturated": reach == T - 1 if reach is not None else None,
            "mean_distance": float((np.arange(T) * g).sum() / total) if total > 0 else None, "bins": bins}


# ----------------------------------------------------------------------------- the gradient

def _norms_fn(model, cfg, last: int):
    """Jitted ``(state, tokens [B, T], segment_ids or None) -> [B, T]``: ||ds/de|| per position, column
    d = distance d from the last position, s the official ``logit_sum`` target: the last ``last``
    positions' logits averaged over the positions, summed over the vocabulary (per row: rows do not
    interact). ``model`` gives the graph; its state is an argument."""

    graphdef, _ = nnx.split(model)
    dtype = jnp.dtype(cfg.model.compute_dtype)

    def norms(state, tokens, segment_ids):
        B, T = tokens.shape
        ctx = MixerContext(positions=default_positions(B, T) if segment_ids is None else segment_positions(segment_ids),
                           attention_impl=cfg.model.attention_impl, step=jnp.zeros((), jnp.int32),
                           seed=cfg.train.seed, example_ids=jnp.arange(B, dtype=jnp.int32), train=False,
                           segment_ids=segment_ids)
        e = nnx.merge(graphdef, state).embed(tokens, dtype).astype(jnp.float32)

        def s_of(e):  # the module is merged inside the differentiated function (its own trace)
            m = nnx.merge(graphdef, state)
            h = m.run_blocks(e.astype(dtype), ctx)
            return m.logits(h[:, T - last:]).mean(axis=1).sum()

        grad = jax.grad(s_of)(e)
        return jnp.sqrt(jnp.sum(jnp.square(grad), axis=-1))[:, ::-1]

    return jax.jit(norms)


def _pick(n_available: int, samples: int, seed: int) -> np.ndarray:
    """``min(samples, n_available)`` row indices, drawn without replacement by ``seed``, in order."""
    n = min(samples, n_available)
    if n == n_available:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n_available, n, replace=False))


def evaluate_influence(run, cfg=None, *, windows=None, samples: int = SAMPLES, seq_len: int | None = None,
                       last: int = LAST, seed: int = 0, progress: bool = True, batch_size: int | None = None,
                       inputs: str = "documents", data=None) -> list[dict]:
    """G(d) of ``run`` (a :class:`~hybrid_lm.run.restore.RestoredRun`) with the model of ``cfg``
    (default the run's; e.g. ``run.task_config(horizon=H)``): ``[row]``, nothing recorded.

    ``inputs``: ``documents`` (whole val documents of the store ``data``, default the run's own, after
    a BOS; the module doc) or ``windows`` (the run's fixed eval windows, their first T tokens, with
    their segment ids when the run masks documents). ``windows``: token ids ``[N, T]`` given directly
    (``inputs`` is then ``given``). T: ``seq_len``, default :data:`CONTEXT` capped at ``cfg``'s seq_len
    (the run's trained one unless ``cfg`` says otherwise). ``samples`` inputs are averaged: all when there are at most that many, else ``samples``
    drawn by ``seed``. ``last``: how many final positions' logits make s. ``batch_size``: rows per
    gradient pass (default: the trainer's tokens per step at T).
    """

    t0 = time.time()
    cfg = cfg or run.cfg
    if cfg.model.remat != "none":  # nnx.remat inside this jax.grad mutates Params across traces; same values
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="none"))
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"influence: samples={samples!r} must be an int >= 1")
    if inputs not in INPUTS:
        raise ConfigError(f"influence: inputs={inputs!r}; choose one of {', '.join(INPUTS)}")
    segments, prefix, info = None, None, {}
    if windows is not None:
        tokens = np.asarray(windows)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.shape[1] < 1:
            raise ConfigError(f"influence: windows must be token ids [N, T], got an array of shape {tokens.shape} "
                              f"and dtype {tokens.dtype}")
        if seq_len is not None and seq_len != tokens.shape[1]:
            raise ConfigError(f"influence: seq_len={seq_len} but the given windows hold {tokens.shape[1]} tokens")
        if tokens.min() < 0 or tokens.max() >= cfg.model.vocab_size:
            raise ConfigError(f"influence: token ids must lie in [0, {cfg.model.vocab_size}) (the model's vocab_size)")
        source = "given"
    elif inputs == "windows":
        if seq_len is not None and seq_len != cfg.data.seq_len:
            cfg = swapped_config(cfg, seq_len=seq_len)  # validated for this length; same parameters
        batch = run.streams(cfg).eval_batch
        tokens = (batch["tokens"] if isinstance(batch, dict) else batch)[:, :-1]
        if isinstance(batch, dict):
            segments = batch["segment_ids"][:, :-1]
        source = "windows"
    else:
        T = seq_len if seq_len is not None else min(CONTEXT, cfg.data.seq_len)
        if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 2:
            raise ConfigError(f"influence: seq_len={seq_len!r} must be an int >= 2")
        tok = run.tokenizer
        prefix = [] if cfg.data.document_mask else [int(x) for x in tok.separator]
        store = data if data is not None else run.streams().store.path
        try:
            docs, info = val_documents(store, tok, min_tokens=T - len(prefix), max_tokens=T - len(prefix),
                                       count=samples, seed=seed, what="influence: the store" if data is None else "--data")
        except DataError as e:
            raise DataError(f"{e}: G(d) reads rows of T = {T} tokens, a BOS of {len(prefix)} and the start of one "
                            f"document; give a shorter --seq-len, or --influence-inputs windows") from None
        tokens = np.stack([np.concatenate([np.asarray(prefix, np.int32), d]) for d in docs])
        source = "documents"
    T = tokens.shape[1]
    if cfg.data.seq_len != T:
        cfg = swapped_config(cfg, seq_len=T)
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= T:
        raise ConfigError(f"influence: last={last!r} must be an int in [1, T={T}]")
    idx = _pick(len(tokens), samples, seed) if source != "documents" else np.arange(len(tokens))
    if len(idx) < samples:
        log.warning("influence: %d %s asked, %d available; averaging over %d", samples,
                    "documents of %d tokens" % T if source == "documents" else "windows", len(idx), len(idx))
    tokens = np.ascontiguousarray(tokens[idx], dtype=np.int32)
    segments = None if segments is None else np.ascontiguousarray(segments[idx], dtype=np.int32)
    n = len(tokens)
    per = batch_rows(run, T, n, batch_size)

    model = run.model(cfg)
    state = nnx.state(model)
    fn = _norms_fn(model, cfg, last)
    total = np.zeros(T, np.float64)
    recorded_backends(clear=True)
    bar = tqdm(total=-(-n // per), desc=f"influence T={T}", unit="batch", disable=bar_disabled(progress), leave=False)
    with jax.set_mesh(run.mesh):
        for i in range(0, n, per):
            real = min(per, n - i)
            rows = np.arange(i, i + per) % n if real < per else np.arange(i, i + per)  # pad by wrapping
            part = put_batch(tokens[rows], run.batch_shard)
            seg = None if segments is None else put_batch(segments[rows], run.batch_shard)
            norms = np.asarray(fn(state, part, seg), np.float64)
            total += norms[:real].sum(0)
            bar.update()
    bar.close()
    g = total / n
    if not np.all(np.isfinite(g)):
        log.warning("influence: G(d) is not finite at %d distances", int((~np.isfinite(g)).sum()))
    row = {"kind": "influence", "task": "influence", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "step": run.step, "checkpoint_step": run.step, "run_id": run_id(run.cfg),
           "seq_len": T, "trained_seq_len": run.cfg.data.seq_len, "samples": n, "last": last, "seed": seed,
           "inputs": source, "bos": prefix, "data": info.get("store"),
           "documents_available": info.get("available"), "target": "logit_sum, mean over the last positions",
           "document_mask": segments is not None,
           "g": [float(x) for x in g], **summarize(g),
           "layer_types": "".join(cfg.model.layer_types()), "mixers": describe(cfg.model),
           "attention_impl": cfg.model.attention_impl, "attention_backends": recorded_backends(),
           "devices": int(run.mesh.devices.size), "wall_s": round(time.time() - t0, 3)}
    return [row]


# ----------------------------------------------------------------------------- report

def _label(row: dict, rows: list[dict]) -> str:
    """``step N``, with the run id / mixers / seq_len when the rows differ in them."""
    parts = [f"step {row['checkpoint_step']}"]
    if len({r.get("run_id") for r in rows}) > 1:
        parts.insert(0, str(row.get("run_id", "?"))[:12])
    if len({repr(r.get("mixers")) for r in rows}) > 1:
        full = (row.get("mixers") or {}).get("full", {})
        opts = ",".join(f"{k}={v}" for k, v in (full.get("options") or {}).items())
        parts.append(f"full {full.get('kind')}" + (f"({opts})" if opts else ""))
    if len({r["seq_len"] for r in rows}) > 1:
        parts.append(f"T={row['seq_len']}")
    return " ".join(parts)


def format_influence(rows: list[dict]) -> str:
    """One summary line per row, then the log2-binned mean G(d) per row."""
    if not rows:
        return "no influence results"
    lines = []
    for r in rows:
        reach = "—" if r["reach"] is None else f"{r['reach']}" + (" (saturated: = T-1)" if r["reach_saturated"] else "")
        md = "—" if r["mean_distance"] is None else f"{r['mean_distance']:.2f}"
        what = {"documents": "documents", "given": "inputs"}.get(r.get("inputs"), "windows")
        lines.append(f"influence  {_label(r, rows)}  seq_len {r['seq_len']}  {r['samples']} {what}  last {r['last']}  "
                     f"reach {reach}  mean distance {md} tokens  max G {r['g_max']:.4g}")
    bins = max((r["bins"] for r in rows), key=len)
    heads = [f"{b['lo']}" if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}" for b in bins]
    width = max(10, *(len(h) + 1 for h in heads))
    names = [_label(r, rows) for r in rows]
    lead = max(len("mean G(d), d"), *(len(x) for x in names)) + 2
    lines.append("mean G(d), d".ljust(lead) + "".join(h.rjust(width) for h in heads))
    for name, r in zip(names, rows):
        lines.append(name.ljust(lead) + "".join(f"{b['mean']:.3g}".rjust(width) for b in r["bins"]))
    return "\n".join(lines)


def plot_influence(rows: list[dict], out_dir) -> list[Path]:
    """``out_dir/influence.png``: G(d) against d (d >= 1; zeros left out) on log-log axes, per row a
    faint per-d curve and its log2-binned means (markers at the bins' geometric centres). Returns the paths written ([] without rows)."""
    if not rows:
        return []
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in sorted(rows, key=lambda r: (str(r.get("run_id")), r["checkpoint_step"])):
        g = np.asarray(r["g"], np.float64)[1:]
        d = np.arange(1, len(g) + 1)
        raw, = ax.plot(d, np.where(g > 0, g, np.nan), lw=0.6, alpha=0.25)
        b = [x for x in r["bins"] if x["lo"] >= 1 and x["mean"] > 0]  # per-d values are noisy at long T
        ax.plot([np.sqrt(x["lo"] * x["hi"]) for x in b], [x["mean"] for x in b], "o-", color=raw.get_color(),
                lw=1.6, ms=3.5, label=_label(r, rows) + " (log2-bin mean)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distance d from the last token (tokens)")
    ax.set_ylabel(r"$G(d) = \mathbb{E}\,\|\partial s / \partial e_{T-d}\|_2$")
    ax.set_title(f"gradient influence (s: the last {rows[0]['last']} positions' mean logits, summed)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "influence.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


__all__ = ["CONTEXT", "HEADLINE", "INPUTS", "LAST", "REACH_THRESHOLD", "SAMPLES", "evaluate_influence", "format_influence", "log2_bins", "plot_influence",
           "summarize"]
