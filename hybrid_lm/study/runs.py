"""A study's runs (the sweep's finished jobs) and the numbers their results rows hold.

A run's numbers come from its results files only: the trainer's final eval row in ``metrics.jsonl`` (the
``loss`` metric), ``eval.jsonl`` rows (every other metric, found by :mod:`hybrid_lm.study.evaluations`),
``provenance.json`` (the device). A loss row carries each val window's loss, so two runs' losses on the same
windows can be differenced window by window.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_lm.errors import WorkdirError
from hybrid_lm.eval.suite import current_rows
from hybrid_lm.run.directory import checkpoint_steps, load_run_config, metrics_path, provenance_path
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.scaling.launch import DONE
from hybrid_lm.scaling.sweep import read_manifest


@dataclass
class Run:
    name: str
    arch: str
    seed: int
    budget: float
    dir: Path
    seq_len: int = 0
    steps: list = field(default_factory=list)  # checkpoint steps (evaluated ones, for a copy of the rows)
    checkpoints: bool = False  # its checkpoints/ are here: it can be evaluated

    @property
    def key(self) -> str:
        return self.name


@dataclass
class Value:
    """One metric of one run: the number, its per-window values (loss metrics), its own standard error
    (over windows, or an accuracy's binomial error) and the row it was read from."""

    value: float
    windows: list | None = None
    se: float | None = None
    source: dict | None = None


def study_runs(root: Path) -> list[Run]:
    """The finished runs of the sweep under ``root`` (``sweep.json`` jobs with ``sweep_done.json``, stable
    WSD runs left out), in the sweep's order. A run without ``checkpoints/`` (a copy of its results files)
    takes its steps from its eval rows and its final step."""
    out = []
    for j in read_manifest(root)["jobs"]:
        d = Path(root) / j["name"]
        if j["kind"] == "stable" or not (d / DONE).exists():
            continue
        seq_len = load_run_config(d).data.seq_len
        steps = checkpoint_steps(d, missing_ok=True)
        has = bool(steps)
        if not has:
            final = json.loads((d / DONE).read_text()).get("step")
            steps = sorted({r["checkpoint_step"] for r in current_rows(d) if isinstance(r.get("checkpoint_step"), int)}
                           | ({final} if isinstance(final, int) else set()))
        out.append(Run(j["name"], j["arch"], int(j["seed"]), float(j["budget"]), d, seq_len, steps, has))
    return out


def final_eval(run: Run) -> Value | None:
    """The trainer's last eval row of the run (its final val loss), or None."""
    rows = [r for r in read_metrics(metrics_path(run.dir), "eval") if isinstance(r.get("loss"), (int, float))]
    if not rows:
        return None
    r = rows[-1]
    return Value(r["loss"], r.get("window_losses"), r.get("loss_se"),
                 {"run": run.key, "file": str(run.dir / "metrics.jsonl"), "kind": "eval", "step": r["step"]})


def training_speed(run: Run) -> dict:
    """Median tokens/s and MFU over the train rows of the run's second half, the device, and the bits/byte of
    the final eval."""
    rows = read_metrics(metrics_path(run.dir))
    train = [r for r in rows if r.get("kind") == "train" and isinstance(r.get("tokens_per_sec"), (int, float))
             and not r.get("copied_from")]
    half = [r for r in train if r["step"] > (train[-1]["step"] + train[0]["step"]) / 2] if train else []

    def med(key):
        v = [r[key] for r in half if isinstance(r.get(key), (int, float))]
        return statistics.median(v) if v else None

    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("bpb"), (int, float))]
    try:
        prov = json.loads(provenance_path(run.dir).read_text())
    except (OSError, ValueError):
        prov = {}
    return {"tokens_per_sec": med("tokens_per_sec"), "mfu": med("mfu"), "bpb": evals[-1]["bpb"] if evals else None,
            "device": prov.get("device_kind") or (prov.get("devices") or [None])[0]}


def row_value(run: Run, rows: list[dict], task: str) -> Value | None:
    """The metric a task's eval row holds: a loss (with its windows), lm-eval's score (acc_norm, with its
    binomial error over the items), RULER's log-likelihood accuracy (gold above the distractors) or LongPPL."""
    if not rows:
        return None
    r = rows[-1]
    src = {"run": run.key, "file": str(run.dir / "eval.jsonl"), "eval_key": r.get("eval_key"),
           "task": r.get("task"), "checkpoint_step": r.get("checkpoint_step")}
    if task == "loss":
        return Value(r["loss"], r.get("window_losses"), r.get("loss_se"), src) if isinstance(r.get("loss"), (int, float)) else None
    if task == "next_line":
        p, n = r.get("score"), (r.get("n_samples") or {}).get("effective")
        if not isinstance(p, (int, float)):
            return None
        return Value(p, None, math.sqrt(p * (1 - p) / n) if isinstance(n, int) and n > 1 else None, src)
    if task == "ruler":  # the gold answer's log-likelihood above every distractor's, over the tasks' items
        wins = [w for x in rows for w in ((x.get("per_item") or {}).get("win") or []) if w is not None]
        if not wins:
            return None
        p = sum(wins) / len(wins)
        return Value(p, None, math.sqrt(p * (1 - p) / len(wins)) if len(wins) > 1 else None,
                     {**src, "chance": rows[-1].get("ll_chance"), "items": len(wins)})
    v = r.get("longppl")
    return Value(v, None, None, src) if isinstance(v, (int, float)) and math.isfinite(v) else None


def require_runs(root: Path, runs: list[Run]) -> None:
    if not runs:
        raise WorkdirError(f"{root}: no finished run yet (sweep_done.json): launch the study first "
                           "(bash experiments/study.sh)")
