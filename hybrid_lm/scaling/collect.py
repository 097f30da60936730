"""Collect run directories into one scaling table (CSV / JSONL) that ``hybrid-lm fit`` reads directly.

Inputs: sweep roots (directories holding ``sweep.json``: their runs, stable runs excluded unless
asked), run directories (holding ``metrics.jsonl``), or any directory searched recursively for them.

One row per run (its last evaluation); with ``intermediate=True`` also one row per earlier
evaluation (``final = 0``), so fits can use intermediate checkpoints with the bootstrap clustered by
``run_id``. Columns, in order (docs/SCALING.md section 7):

* ``run_id, arch, scale, N, D``: ``arch`` is the sweep's arch name, else a label derived from the
  run's ``config.json`` (``model/architecture.py``: ``arch_label``); N as the sweep defined it (non-embedding parameters by
  default); D = tokens seen at that row;
* ``final`` (1 on the row of a finished run's final evaluation), ``converged`` (1 on rows a fit may
  take as converged: a final row, or the end of a learning-rate decay), ``status`` (finished |
  partial), ``step``, ``phase`` (``stable`` before the WSD decay, ``decay`` in it, ``-`` unknown),
  ``source_run`` (the run that trained the row: a branch's rows up to its branch point are its
  stable run's);
* ``loss`` (validation cross-entropy, nats/token), ``bpb``, ``loss_train``, ``loss_at_25/50/75``,
  ``loss_stable`` (branches: the validation loss at the branch point);
* evaluation tasks from ``<run>/eval.jsonl`` (``hybrid-lm longppl``, ``hybrid-lm eval``, ...), on
  the row of the step they evaluated (:func:`read_eval_rows`), plus older sources on the last row:
  ``metrics.jsonl`` rows of other kinds and flat ``<run>/eval/*.json`` files;
* bookkeeping: ``seed, kind, budget, steps, tokens_per_step, N_non_embedding, N_total, C`` (training
  FLOPs of D tokens), ``flops_per_token``, ``arch_spec`` (the architecture as JSON), ``run_dir``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from tqdm.auto import tqdm

from hybrid_lm.errors import DataError
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import (config_path, eval_rows_path, find_run_dirs, load_run_config, metrics_path,
                                     run_architecture)
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.scaling.sweep import decay_start
from hybrid_lm.scaling.table import BOOKKEEPING, write_table

log = logging.getLogger(__name__)


def parse_label_overrides(items: list[str] | None) -> list[tuple[re.Pattern, str]]:
    """``["t1-.*=baseline"]`` -> ``[(regex on the run id, label)]``; the first match wins."""
    out = []
    for it in items or []:
        pattern, sep, label = it.rpartition("=")
        if not sep or not pattern or not label:
            raise DataError(f"--label {it!r}: write REGEX=LABEL (a regex on the run id, e.g. 't1-.*=baseline')")
        try:
            out.append((re.compile(pattern), label))
        except re.error as e:
            raise DataError(f"--label {it!r}: {pattern!r} is not a regex ({e})") from None
    return out


# ----------------------------------------------------------------------------- eval.jsonl

# fields of eval.jsonl rows that are neither a task's settings nor its metrics
_EVAL_BOOKKEEPING = frozenset({
    "kind", "time", "step", "checkpoint_step", "run_id", "wall_s", "key_cache", "keys_cached", "self_evaluator",
    "evaluator_step", "attention_backends", "devices", "mixers", "trained_mixers", "layer_types",
    "attention_impl", "trained_seq_len", "trained_eval_loss", "nonfinite"})
# what makes two rows of one task comparable (a task not listed: its scalar text / flag fields)
_EVAL_SETTINGS = {"longppl": ("length", "docs", "trunc_len", "window", "alpha", "beta", "evaluator", "inputs",
                              "min_tokens"),
                  "swap_eval": ("swaps", "horizon", "sinks", "seq_len", "eval_windows"),
                  "ruler": ("length", "samples", "seed", "haystack"),
                  "probe": ("samples", "seq_len", "seed", "haystack", "prompt"),
                  "heads": ("samples", "seq_len", "seed", "haystack", "reference_step"),
                  "influence": ("seq_len", "samples", "last", "seed", "windows", "inputs", "document_mask"),
                  "lm_eval": ("limit", "num_fewshot", "max_length")}
# the numbers a task reports (a task not listed: its numeric fields); per-item results, curves and
# per-layer lists stay in eval.jsonl
_EVAL_METRICS = {"longppl": ("longppl", "key_nll", "ppl", "nll", "n_key", "n_token", "key_rate"),
                 "swap_eval": ("loss", "bpb", "delta_loss"),
                 "ruler": ("exact_match", "answer_nll", "ll_accuracy"),
                 "probe": ("best_accuracy",),
                 "heads": ("top_head_mass",),
                 "influence": ("reach", "mean_distance", "g_max", "g_sum"),
                 "lm_eval": ("score",)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def eval_task(row: dict) -> str:
    """A row's task as a column name: its ``task`` (``ruler/niah_single``, ``lm_eval/hellaswag``) where
    the row names one, else its ``kind`` (``longppl``, ``swap_eval``)."""
    task = row.get("task")
    return task if isinstance(task, str) and task else row["kind"]


def eval_settings(row: dict) -> tuple:
    """The settings of an ``eval.jsonl`` row, as a hashable tuple of (field, JSON value)."""
    task = row.get("kind")
    if task in _EVAL_SETTINGS:
        keys = list(_EVAL_SETTINGS[task])
        if task == "longppl" and not row.get("self_evaluator", True) and row.get("evaluator") != "newest":
            keys.append("evaluator_step")  # a fixed evaluator's checkpoint marks the key tokens (each run's
            # newest checkpoint is the same setting across runs of a sweep)
    else:  # short scalar text and flags only: never results, lists, or file paths
        keys = [k for k, v in row.items() if k not in _EVAL_BOOKKEEPING and k != "task" and isinstance(v, (str, bool))
                and not k.endswith(("_cache", "_path", "_dir"))]
    return tuple((k, json.dumps(row.get(k), sort_keys=True)) for k in keys)


def eval_metrics(row: dict) -> dict:
    names = _EVAL_METRICS.get(row.get("kind")) or [k for k, v in row.items() if k not in _EVAL_BOOKKEEPING and _number(v)]
    return {k: row.get(k) for k in names}


def read_eval_rows(d: Path) -> tuple[dict, dict]:
    """``<d>/eval.jsonl`` as ``{(task, settings, step): row}``, the last row of each key kept (an
    evaluation run again supersedes the earlier one), and counts ``{"read", "superseded", "bad_lines"}``.
    A line that is not a JSON object (a torn last line after a kill) is skipped and counted."""
    path = eval_rows_path(d)
    out: dict = {}
    stats = {"read": 0, "superseded": 0, "bad_lines": 0}
    if not path.exists():
        return out, stats
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        step = row.get("step", row.get("checkpoint_step")) if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("kind"), str) or not _number(step):
            log.warning("%s:%d: not an evaluation row (JSON object with kind and step); skipped", path, i)
            stats["bad_lines"] += 1
            continue
        key = (eval_task(row), eval_settings(row), int(step))
        stats["read"] += 1
        stats["superseded"] += key in out
        out[key] = row
    return out, stats


def eval_column_names(settings_by_task: dict[str, set]) -> dict[tuple, str]:
    """Column prefix per (task, settings): the task's name when all runs evaluated it one way,
    else ``task[field=value,...]`` naming the settings that differ."""
    names = {}
    for task, variants in settings_by_task.items():
        variants = sorted(variants)
        if len(variants) == 1:
            names[(task, variants[0])] = task
            continue
        fields = dict.fromkeys(k for v in variants for k, _ in v)
        differ = [k for k in fields if len({dict(v).get(k) for v in variants}) > 1]
        for v in variants:
            dv = dict(v)
            tag = ",".join(f"{k}={_tag_value(dv.get(k))}" for k in differ)
            names[(task, v)] = f"{task}[{tag}]"
    return names


def _tag_value(js: str | None) -> str:
    v = None if js is None else json.loads(js)
    if isinstance(v, list):
        return "+".join(map(str, v)) or "none"
    return "none" if v is None else str(v)


def _metric_columns(prefix: str, task: str, metrics: dict) -> dict:
    """``<prefix>`` for the metric named like the task, else ``<prefix>_<field>``."""
    out = {}
    for field, v in metrics.items():
        if not _number(v):
            continue
        out[prefix if field == task else f"{prefix}_{field}"] = v
    return out


def add_log_columns(row: dict) -> None:
    """``log_<col>`` for each positive column whose name, its ``[settings]`` tag aside, ends in
    ``longppl`` (the Rethinking paper fits log LongPPL)."""
    for col, v in list(row.items()):
        base = col.split("[", 1)[0]
        if base.endswith("longppl") and not col.startswith("log_") and _number(v) and v > 0:
            row.setdefault(f"log_{col}", math.log(v))


# ----------------------------------------------------------------------------- one run

def _run_meta(d: Path) -> dict:
    """The sweep's metadata for this run, or one derived from config.json (counts need JAX)."""
    meta_path = d / "sweep_run.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    if not config_path(d).exists():
        raise FileNotFoundError(f"{d} has neither sweep_run.json nor config.json")

    cfg = load_run_config(d)
    counts = count_params(cfg.model)
    m = cfg.model
    return {"name": d.name, "kind": "run", "arch": None, "scale": f"d{m.d_model}L{m.n_layers}",
            "seed": cfg.train.seed, "budget": None, "steps": cfg.train.steps,
            "tokens_per_step": cfg.train.global_batch * cfg.data.seq_len, "N": counts["non_embedding"],
            "N_non_embedding": counts["non_embedding"], "N_total": counts["total"],
            "flops_per_token": float(flops_per_token(m, cfg.data.seq_len)["train"]), "branch_from": None,
            "decay_fraction": cfg.optim.decay_fraction}


def _extra_metrics(d: Path, rows: list[dict]) -> dict:
    """Metrics of the run's last state: metrics.jsonl rows of other kinds (the last per kind) and
    flat ``<run>/eval/*.json`` files."""
    out: dict = {}
    last: dict[str, dict] = {}
    for r in rows:
        k = r.get("kind")
        if k in ("train", "eval") or k is None:
            continue
        if k not in last or r.get("step", 0) >= last[k].get("step", 0):
            last[k] = r
    sources = list(last.items())
    ev = d / "eval"
    if ev.is_dir():
        for f in sorted(ev.glob("*.json")):
            try:
                obj = json.loads(f.read_text())
            except json.JSONDecodeError:
                log.warning("%s: not JSON; skipped", f)
                continue
            if isinstance(obj, dict):
                sources.append((f.stem, obj))
    for kind, obj in sources:
        out.update(_metric_columns(kind, kind, {k: v for k, v in obj.items() if k not in ("kind", "step", "tokens")}))
    return out


def _phase(step: int, meta: dict, steps: int) -> str:
    """``stable`` (before the WSD decay: never decayed), ``decay`` (in it, or at its end), ``-`` unknown."""
    if meta.get("kind") == "stable":
        return "stable"
    bstep = (meta.get("branch_from") or {}).get("step")
    if bstep is None:
        f = meta.get("decay_fraction")
        if f is None:
            return "-"
        bstep = decay_start(steps, f)
    return "stable" if step <= bstep else "decay"


def collect_run(d: Path, intermediate: bool = False, eval_rows: dict | None = None,
                eval_names: dict | None = None, label: str | None = None) -> tuple[list[dict], set]:
    """Table rows of run ``d`` and the keys of ``eval_rows`` (from :func:`read_eval_rows`) it placed."""
    d = Path(d)
    meta = _run_meta(d)
    rows = read_metrics(metrics_path(d))
    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("loss"), (int, float))]
    trains = [r for r in rows if r.get("kind") == "train"]
    if not evals:
        return [], set()
    derived_label, spec = run_architecture(d)
    arch = label or meta.get("arch") or derived_label or "unknown"
    tps = meta["tokens_per_step"]
    steps = meta["steps"]
    finished = (d / "sweep_done.json").exists() or (meta.get("kind") == "run" and evals[-1]["step"] >= steps)
    branch_from = meta.get("branch_from") or {}
    bstep = branch_from.get("step")
    fpt = meta.get("flops_per_token")
    loss_stable = next((r["loss"] for r in reversed(evals) if bstep is not None and r["step"] == bstep), None)
    decays = bstep is not None or (meta.get("kind") != "stable" and (meta.get("decay_fraction") or 0) > 0)

    def loss_near(frac):
        target = frac * steps
        cand = [r for r in evals if r["step"] > 0]
        if not cand:
            return None
        return min(cand, key=lambda r: (abs(r["step"] - target), r["step"]))["loss"]

    extra = _extra_metrics(d, rows)
    by_step: dict[int, dict] = {}
    for (task, settings, step), er in (eval_rows or {}).items():
        prefix = (eval_names or {}).get((task, settings), task)
        by_step.setdefault(step, {}).update(_metric_columns(prefix, task, eval_metrics(er)))
    placed = set()
    out = []
    chosen = [r for r in evals if r["step"] > 0] if intermediate else evals[-1:]
    for r in chosen:
        is_last = r is evals[-1]
        step = int(r["step"])
        D = step * tps
        tr = [t for t in trains if t["step"] <= step]
        phase = _phase(step, meta, steps)
        final = int(is_last and finished and meta.get("kind") != "stable")  # a stable WSD run never decayed
        row = {
            "run_id": meta["name"], "arch": arch, "scale": meta["scale"], "N": meta["N"], "D": D,
            "final": final,
            # a converged point: the run's final row, or the end of a decay
            "converged": int(bool(final or (decays and step >= steps))),
            "status": "finished" if finished else "partial",
            "step": step, "phase": phase,
            "source_run": branch_from["run"] if bstep is not None and step <= bstep and branch_from.get("run")
            else meta["name"],
            "loss": r["loss"], "bpb": r.get("bpb"), "loss_train": tr[-1]["loss"] if tr else None,
            # summaries of the whole run: on its last row only
            "loss_at_25": loss_near(0.25) if is_last else None, "loss_at_50": loss_near(0.5) if is_last else None,
            "loss_at_75": loss_near(0.75) if is_last else None, "loss_stable": loss_stable if is_last else None,
        }
        row.update({k: (v if is_last else None) for k, v in extra.items()})
        row.update(by_step.get(step, {}))
        placed |= {k for k in (eval_rows or {}) if k[2] == step}
        add_log_columns(row)
        row.update({"seed": meta.get("seed"), "kind": meta.get("kind"), "budget": meta.get("budget"),
                    "steps": steps, "tokens_per_step": tps, "N_non_embedding": meta.get("N_non_embedding"),
                    "N_total": meta.get("N_total"), "C": fpt * D if fpt else None, "flops_per_token": fpt,
                    "arch_spec": json.dumps(spec, sort_keys=True) if spec else None, "run_dir": str(d)})
        out.append(row)
    return out, placed


def collect(paths: list[str | Path], out: str | Path | None = None, intermediate: bool = False,
            include_stable: bool = False, labels: list[str] | None = None,
            progress: bool = True) -> tuple[list[dict], dict]:
    """Rows for every run under ``paths``; writes ``out`` (.csv or .jsonl) and returns (rows, stats).

    ``labels`` (``REGEX=LABEL``, on the run id, the first match wins) override the arch labels.
    """

    overrides = parse_label_overrides(labels)
    dirs = find_run_dirs(paths, include_stable=include_stable)
    evals = {}
    ev_stats = {"read": 0, "superseded": 0, "bad_lines": 0, "unplaced": 0}
    settings_by_task: dict[str, set] = {}
    for d in dirs:
        evals[d], s = read_eval_rows(d)
        for k in s:
            ev_stats[k] += s[k]
        for task, settings, _ in evals[d]:
            settings_by_task.setdefault(task, set()).add(settings)
    names = eval_column_names(settings_by_task)
    rows, empty = [], []
    for d in tqdm(dirs, desc="collect", disable=bar_disabled(progress), leave=False):
        label = next((lab for rx, lab in overrides if rx.fullmatch(d.name)), None)
        r, placed = collect_run(d, intermediate=intermediate, eval_rows=evals[d], eval_names=names, label=label)
        ev_stats["unplaced"] += len(evals[d]) - len(placed)
        if not r:
            empty.append(str(d))
        rows.extend(r)
    rows.sort(key=lambda r: (str(r["arch"]), float(r["N"]), str(r["run_id"]), int(r["step"])))
    # every row carries every column (metrics first, bookkeeping last), so CSV columns are stable
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in BOOKKEEPING] + list(BOOKKEEPING)
    rows = [{c: r.get(c) for c in cols} for r in rows]
    stats = {"run_dirs": len(dirs), "rows": len(rows), "finished": sum(r["final"] for r in rows),
             "partial": sorted({r["run_id"] for r in rows if r["status"] == "partial"}), "no_eval": empty,
             "eval_rows": ev_stats, "eval_columns": sorted(set(names.values()))}
    if out is not None:
        write_table(rows, out)
        if Path(out).suffix == ".csv":
            write_table(rows, Path(out).with_suffix(".jsonl"))
    return rows, stats
