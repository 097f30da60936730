"""Layerwise probing (the Rethinking-hybrids paper, section 4.2 and Fig. 4; thunlp/rethinking-hybrid-attention
at feaad08, ``src/probing/``): how linearly decodable the hidden magic number is from the last
token's residual stream after each layer.

Data (``01_prepare_data.py``, the README's ``--haystack_type repeat --num_samples 10000 --seq_len
16000 --num_classes 8 --difficulty hard``): :func:`hybrid_lm.eval.introspect.needle_items`, 8
classes (the number ``31415920 + c``), item i of class ``i % 8``. ``prompt="official"`` (default):
the official recipe at the nominal ``seq_len`` (noise: ``max(100, seq_len // 100)`` lines, the
needle at a random line of the middle half; essays / corpus: ``max(1000, seq_len // 4)`` words, the
needle at a sentence depth of 0-99%), so the prompt's length in tokens depends on the tokenizer;
``prompt="exact"``: prompts of exactly ``seq_len`` tokens, the needle at 25-75% depth of the haystack.
Features (``02_extract_hiddenstate.py``, ``residual``): the last prompt token's hidden state after
each block ``L0 .. L{n-1}``, the last one through the final norm (``introspect.hidden_states``; eval
mode, jitted and batched, prompts right-padded). Classifier (``03_train_probing.py``,
:func:`probe_accuracy`): per layer, a stratified 80/20 split (``random_state=42``), features
standardised on the train part, scikit-learn ``LogisticRegression(C=0.1, solver="liblinear",
max_iter=1000, random_state=42)`` one-vs-rest; the test accuracy per layer; chance is 1/8.

Python: ``rows = evaluate_probe(RestoredRun(wd), samples=10000)``; ``format_probe(rows)``;
``plot_probe(rows_of_several_checkpoints, out_dir)``.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import introspect as I, ruler as R
from hybrid_lm.eval.ruler_items import haystack_for
from hybrid_lm.experiment import run_id
from hybrid_lm.optional import optional_import
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.swap import describe
from hybrid_lm.sharding import put_batch

log = logging.getLogger(__name__)

HEADLINE = "best_accuracy"
CHANCE = 1.0 / I.N_CLASSES
C_REG = 0.1  # 03_train_probing.py create_classifier("logistic"): C, max_iter, solver, random_state
MAX_ITER = 1000
SOLVER = "liblinear"
RANDOM_STATE = 42  # the split's and the classifier's (03_train_probing.py)
TEST_FRACTION = 0.2
SAMPLES = 10000  # the probing README's --num_samples
MIN_SAMPLES = 5 * I.N_CLASSES  # the 20% test split must hold every class at least once


def check_samples(samples) -> None:
    """``samples`` is an int >= ``MIN_SAMPLES``: the 20% test split holds every class."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < MIN_SAMPLES:
        raise ConfigError(f"probe: samples={samples!r}; the probe needs at least {MIN_SAMPLES} "
                          f"({I.N_CLASSES} classes, {TEST_FRACTION:.0%} held out, each class in the test split)")


def official_classifier(C: float = C_REG):
    """03_train_probing.py create_classifier("logistic"): ``LogisticRegression(random_state=42,
    max_iter=1000, solver="liblinear", C=0.1, multi_class="ovr")``. scikit-learn 1.7 dropped
    ``multi_class``; liblinear's multiclass was one-vs-rest, which ``OneVsRestClassifier`` of the same
    binary liblinear problems is (predicting the class of the largest decision value)."""
    from sklearn.linear_model import LogisticRegression  # the [eval] extra

    kw = dict(random_state=RANDOM_STATE, max_iter=MAX_ITER, solver=SOLVER, C=C)
    if "multi_class" in inspect.signature(LogisticRegression).parameters:
        return LogisticRegression(**kw, multi_class="ovr")
    from sklearn.multiclass import OneVsRestClassifier  # the [eval] extra
    return OneVsRestClassifier(LogisticRegression(**kw))


def probe_accuracy(features: np.ndarray, labels, seed: int = RANDOM_STATE, *, C: float = C_REG) -> np.ndarray:
    """``[L]`` test accuracy of a linear probe per layer: ``features [N, L, d]``, ``labels [N]``;
    one stratified 80/20 split (``random_state=seed``, 42 as the official script) shared by all layers,
    features standardised on the train part, :func:`official_classifier`."""
    optional_import("sklearn")  # one-line install hint when scikit-learn is missing
    from sklearn.exceptions import ConvergenceWarning  # the [eval] extra
    from sklearn.model_selection import train_test_split  # the [eval] extra
    from sklearn.preprocessing import StandardScaler  # the [eval] extra

    features = np.asarray(features, np.float64)
    labels = np.asarray(labels)
    if features.ndim != 3 or len(features) != len(labels):
        raise ValueError(f"features must be [N, L, d] with N = len(labels), got {features.shape} and {labels.shape}")
    train, test = train_test_split(np.arange(len(labels)), test_size=TEST_FRACTION, random_state=seed,
                                   stratify=labels if len(np.unique(labels)) > 1 else None)
    out = np.zeros(features.shape[1])
    for layer in range(features.shape[1]):
        scaler = StandardScaler().fit(features[train, layer])
        clf = official_classifier(C)
        with warnings.catch_warnings():  # a probe near chance may stop at max_iter: its accuracy stands
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(scaler.transform(features[train, layer]), labels[train])
        out[layer] = float(np.mean(clf.predict(scaler.transform(features[test, layer])) == labels[test]))
    return out


def _features_fn(fns, cfg):
    def features(params, tokens, last):
        B, T = tokens.shape
        return I.hidden_states(fns.model(params), tokens, I.eval_context(cfg, B, T), last)
    return features


def probe_features(run, cfg, items, *, batch_size: int | None = None, progress: bool = True) -> np.ndarray:
    """``[N, n_layers, d]`` fp32 hidden states of ``items`` at their last prompt token (the prompts
    right-padded to the longest: a causal model's states at a position do not see what follows)."""

    T = max(len(it.ids) for it in items)
    tokens = np.zeros((len(items), T), np.int32)
    for r, it in enumerate(items):
        tokens[r, :len(it.ids)] = it.ids
    last = np.array([[len(it.ids) - 1] for it in items], np.int32)  # [N, 1]: batch-sharded as rows
    fn = I.jitted("probe_features", run, cfg, _features_fn)
    per = R.batch_rows(run, T, len(tokens), batch_size)
    out = []
    with jax.set_mesh(run.mesh), tqdm(total=-(-len(tokens) // per), desc="probe features", unit="batch",
                                      disable=bar_disabled(progress), leave=False) as bar:
        for (part, n), (lp, _) in zip(R._batches(tokens, per), R._batches(last, per)):
            out.append(np.asarray(fn(run.params, put_batch(part, run.batch_shard), put_batch(lp, run.batch_shard)))[:n])
            bar.update()
    return np.concatenate(out)


def evaluate_probe(run, cfg=None, *, samples: int = SAMPLES, seq_len: int | None = None, seed: int = 0,
                   progress: bool = True, batch_size: int | None = None, haystack: str | None = None,
                   prompt: str = "official") -> list[dict]:
    """One row (``task: probe``) for ``run``'s checkpoint with the model of ``cfg`` (default the
    run's): the probe's test accuracy per layer (``L0`` ...), its best layer, chance 1/8. ``seq_len``
    (default the config's) is the official recipe's nominal length (``prompt="official"``) or the
    prompts' exact length (``"exact"``); ``haystack`` default ``noise`` (the official ``repeat``).
    Nothing is recorded."""
    t0 = time.time()
    cfg = cfg or run.cfg
    check_samples(samples)
    if prompt not in I.PROMPTS:
        raise ConfigError(f"probe: prompt={prompt!r}; choose one of {', '.join(I.PROMPTS)}")
    seq_len = I.check_length(cfg, seq_len, "probe") if prompt == "exact" else int(seq_len or cfg.data.seq_len)
    tok = run.tokenizer
    hay = haystack_for(haystack or "noise", tok, run)
    items = I.needle_items(tok, seq_len, samples, seed, hay, what="probe", prompt=prompt)
    lengths = np.array([len(it.ids) for it in items])
    if lengths.max() > run.cfg.data.seq_len:
        log.warning("probe: prompts of up to %d tokens, beyond the trained seq_len %d", lengths.max(),
                    run.cfg.data.seq_len)
    labels = np.array([I.item_label(it) for it in items])
    run.model(cfg)  # builds (and so validates) the model of cfg on the run's parameters
    feats = probe_features(run, cfg, items, batch_size=batch_size, progress=progress)
    acc = probe_accuracy(feats, labels)
    layers = [f"L{i}" for i in range(feats.shape[1])]
    best = int(np.argmax(acc))
    n_test = math.ceil(TEST_FRACTION * samples)  # as train_test_split rounds
    return [{"kind": "probe", "task": "probe", "step": run.step, "checkpoint_step": run.step,
             "tokens_seen": R.tokens_seen(run), "run_id": run_id(run.cfg), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "samples": samples, "seq_len": seq_len, "prompt": prompt,
             "prompt_tokens": [int(lengths.min()), int(lengths.max())],
             "trained_seq_len": run.cfg.data.seq_len, "seed": seed,
             "haystack": hay.name, "classes": I.N_CLASSES,
             "depths": [None if not it.depths else round(it.depths[0], 4) for it in items],
             "test_samples": n_test, "C": C_REG, "classifier": f"{SOLVER} one-vs-rest, max_iter {MAX_ITER}",
             "features": "hidden state after each block at the last prompt token, the last after the final norm",
             "layers": layers, "layer_types": "".join(cfg.model.layer_types()),
             "accuracy": [float(a) for a in acc], "best_layer": layers[best], "best_accuracy": float(acc[best]),
             "chance": CHANCE, "mixers": describe(cfg.model), "attention_impl": cfg.model.attention_impl,
             "wall_s": round(time.time() - t0, 3)}]


def format_probe(rows: list[dict]) -> str:
    """Checkpoints x layers: the probe's test accuracy, the best layer and chance."""
    if not rows:
        return "no probe results"
    r0 = rows[0]
    lo, hi = r0.get("prompt_tokens") or (r0["seq_len"], r0["seq_len"])
    shape = f"prompts {lo}-{hi} tokens" if lo != hi else f"prompts {lo} tokens"
    lines = [f"probe  {r0['samples']} samples  seq_len {r0['seq_len']} ({r0.get('prompt', 'exact')}, {shape})  "
             f"haystack {r0['haystack']}  "
             f"chance {rows[0]['chance']:.3f}  (accuracy of a linear probe on the last token, per layer)"]
    layers = max((r["layers"] for r in rows), key=len)
    types = rows[0]["layer_types"]
    head = [f"{n}" + (f"({types[int(n[1:])]})" if n != "emb" and int(n[1:]) < len(types) else "") for n in layers]
    width = max(8, *(len(h) + 1 for h in head))
    lines.append(f"  {'step':>8}" + "".join(f"{h:>{width}}" for h in head) + "   best")
    for r in sorted(rows, key=lambda r: r["checkpoint_step"]):
        cells = "".join(f"{a:>{width}.3f}" for a in r["accuracy"])
        lines.append(f"  {r['checkpoint_step']:>8}{cells}   {r['best_layer']} {r['best_accuracy']:.3f}")
    return "\n".join(lines)


def plot_probe(rows: list[dict], out_dir: Path) -> list[Path]:
    """``probe_heatmap.png`` (accuracy, layer x checkpoint: Rethinking Fig. 4) and
    ``probe_accuracy.png`` (accuracy against layer, one line per checkpoint, chance dashed)."""
    rows, out_dir, plt = I.plot_setup(rows, out_dir)
    if not rows:
        return []
    layers = max((r["layers"] for r in rows), key=len)
    grid = np.full((len(layers), len(rows)), np.nan)
    for c, r in enumerate(rows):
        grid[:len(r["accuracy"]), c] = r["accuracy"]
    steps = [r["checkpoint_step"] for r in rows]

    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 2.5), max(3.0, 0.35 * len(layers) + 1.5)))
    im = ax.imshow(grid, aspect="auto", origin="lower", vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(len(rows)), [str(s) for s in steps], rotation=45 if len(rows) > 6 else 0)
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("layer")
    ax.set_title(f"probe accuracy (chance {rows[0]['chance']:.3f})")
    fig.colorbar(im, ax=ax, label="test accuracy")
    fig.tight_layout()
    heat = out_dir / "probe_heatmap.png"
    fig.savefig(heat, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    cmap = plt.get_cmap("viridis")
    for c, r in enumerate(rows):
        ax.plot(range(len(r["accuracy"])), r["accuracy"], "o-", lw=1.2, ms=3,
                color=cmap(c / max(1, len(rows) - 1)), label=f"step {r['checkpoint_step']}")
    ax.axhline(rows[0]["chance"], color="gray", ls="--", lw=1, label="chance")
    ax.set_xticks(range(len(layers)), layers, rotation=45 if len(layers) > 12 else 0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel("test accuracy")
    ax.set_title("linear probe on the last token: which magic number")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=1 + len(rows) // 8)
    fig.tight_layout()
    curve = out_dir / "probe_accuracy.png"
    fig.savefig(curve, dpi=120)
    plt.close(fig)
    return [heat, curve]


__all__ = ["CHANCE", "HEADLINE", "SAMPLES", "check_samples", "evaluate_probe", "format_probe", "official_classifier",
           "plot_probe", "probe_accuracy", "probe_features"]
