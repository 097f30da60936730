"""The evaluations a study's metrics need: one ``hybrid-lm eval`` request per (metric, run), recorded as
the eval suite records it (a row in the run's ``eval.jsonl``), skipped when its rows exist, so a rerun
evaluates nothing twice and a finished study nothing at all.

Rows are found by their eval key; a study copied elsewhere (its results files in docs/results) still finds
the rows whose settings name a folder (LongPPL's evaluator, lm-eval's task folder) by that folder's name.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.data.corpus import ensure_store
from hybrid_lm.eval.next_line import MAX_CHARS, ensure_next_line_task
from hybrid_lm.run.directory import load_run_config
from hybrid_lm.eval.suite import EvalRequest, current_rows, eval_key, evaluate_run, task_of
from hybrid_lm.study.runs import Run
from hybrid_lm.study.spec import ClaimsSpec, Metric, parse_member

NEXT_LINE = "next_line"
_PATH_SETTINGS = ("evaluator", "include_path")


@dataclass
class Evaluation:
    """One ``hybrid-lm eval`` request on one run, named by the metric it records."""

    metric: str
    run: Run
    request: EvalRequest

    def command(self) -> str:
        """The ``hybrid-lm eval`` command that records the same rows."""
        r = self.request
        parts = [f"hybrid-lm eval {self.run.dir} --tasks {','.join(r.tasks)}"]
        parts += [f"--swap {s}" for s in r.swaps]
        for flag, v in (("--seq-len", r.seq_len), ("--evaluator", r.evaluator), ("--evaluator-step", r.evaluator_step),
                        ("--docs", r.longppl_docs), ("--samples", r.samples)):
            if v is not None:
                parts.append(f"{flag} {v}")
        if "longppl" in r.tasks:
            parts.append(f"--trunc-len {r.trunc_len} --window {r.window}")
        if r.ruler_lengths:
            parts.append(f"--ruler-lengths {','.join(map(str, r.ruler_lengths))}")
        if r.ruler_tasks:
            parts.append(f"--ruler-tasks {','.join(r.ruler_tasks)}")
        if "lm_eval" in r.tasks:
            parts.append(f"--lm-eval-include {r.lm_eval_include} --lm-eval-tasks {','.join(r.lm_eval_tasks)}")
        if r.swap_prefill_only:
            parts.append("--swap-prefill-only")
        return " ".join(parts)


def next_line_dir(root: Path, ev: dict, T: int) -> Path:
    """A next_line task's folder under the study root, named by its settings (lm-eval's rows name the
    folder, so other settings never read these rows)."""
    return Path(root) / f"{NEXT_LINE}_c{ev.get('context', T // 2)}_n{ev.get('items', 200)}"


def build_next_line(root: Path, runs: list[Run], ev: dict) -> str | None:
    """Build (or find) a next_line task from the study's store (its val split); the reason when it cannot be
    built (its metric is then not evaluated)."""
    run = runs[0]
    d = dataclasses.asdict(load_run_config(run.dir).data)
    T = run.seq_len
    C = ev.get("context", T // 2)
    if not 0 < C < T:
        return f"next_line context {C} must be below the trained length {T}"
    try:
        ensure_next_line_task(ensure_store(d["source"], d.get("path"), d["tokenizer"]), d["tokenizer"],
                              next_line_dir(root, ev, T), items=ev.get("items", 200), context_tokens=C,
                              max_line_chars=MAX_CHARS, max_continuation_tokens=T - C)
    except (DataError, ConfigError, FileNotFoundError) as e:
        return " ".join(str(e).split())
    return None


def evaluator_run(runs: list[Run], member: str) -> Run | None:
    """LongPPL's evaluator: ``"arm:seed"``'s run, or the arm's first seed."""
    arm, seeds = parse_member(member, "longppl evaluator")
    mine = sorted((r for r in runs if r.arch == arm and (seeds is None or r.seed in seeds)), key=lambda r: r.seed)
    return mine[0] if mine else None


def request(metric: Metric, run: Run, runs: list[Run], root: Path) -> EvalRequest | None:
    """The eval request that records ``metric`` on ``run`` (None: its evaluator is not among the runs)."""
    ev = metric.eval
    swaps = tuple(ev.get("swaps", ()))
    if ev["task"] == "loss":
        return EvalRequest(tasks=("loss",), swaps=swaps, seq_len=ev.get("seq_len"), progress=False)
    if ev["task"] == NEXT_LINE:
        return EvalRequest(tasks=("lm_eval",), swaps=swaps, swap_prefill_only=bool(ev.get("prefill_only")),
                           lm_eval_tasks=(NEXT_LINE,), lm_eval_include=str(next_line_dir(root, ev, run.seq_len).resolve()),
                           progress=False)
    if ev["task"] == "ruler":
        return EvalRequest(tasks=("ruler",), ruler_tasks=tuple(ev["tasks"]) if "tasks" in ev else None,
                           ruler_lengths=(ev.get("length", run.seq_len),), samples=ev.get("samples", 8),
                           allow_longer=ev.get("length", run.seq_len) > run.seq_len, progress=False)
    judge = evaluator_run(runs, ev.get("evaluator", "full"))
    if judge is None:
        return None
    return EvalRequest(tasks=("longppl",), evaluator=str(judge.dir.resolve()), evaluator_step=judge.steps[-1],
                       trunc_len=ev.get("trunc_len", 4096), window=ev.get("window", 1024),
                       longppl_docs=ev.get("docs"), progress=False)


def plan(spec: ClaimsSpec, runs: list[Run], root: Path) -> list[Evaluation]:
    """Every evaluation the metrics need on ``runs``, metric by metric in the file's order."""
    out = []
    for m in spec.metrics.values():
        if m.eval is None:
            continue
        for run in runs:
            if m.on(run.arch, run.seed):
                req = request(m, run, runs, root)
                if req is not None:
                    out.append(Evaluation(m.name, run, req))
    return out


def rows_for(ev: Evaluation) -> list[dict]:
    """The current ``eval.jsonl`` rows of ``ev``'s request at the run's final checkpoint."""
    keys = {t: eval_key(ev.request.config(t)) for t in ev.request.tasks}
    step = ev.run.steps[-1:] if ev.run.steps else []
    mine = [r for r in current_rows(ev.run.dir) if r.get("checkpoint_step") in step]
    rows = [r for r in mine if r.get("eval_key") == keys.get(task_of(r))]
    if rows:
        return rows
    want = {t: json.loads(json.dumps(ev.request.config(t), default=str)) for t in ev.request.tasks}

    def same(k, a, b):
        return a == b or (k in _PATH_SETTINGS and isinstance(a, str) and isinstance(b, str) and Path(a).name == Path(b).name)

    for r in mine:
        conf, w = r.get("eval_config"), want.get(task_of(r))
        if isinstance(conf, dict) and w is not None and set(conf) == set(w) and all(same(k, conf[k], w[k]) for k in w):
            rows.append(r)
    return rows


def is_done(ev: Evaluation) -> bool:
    return bool(rows_for(ev))


def run_evaluations(evals: list[Evaluation], max_minutes: float | None = None, printer=print) -> dict:
    """Run the evaluations without rows, in order, on the runs whose checkpoints are here; stop starting new
    ones after ``max_minutes``. Returns ``{"done", "skipped", "left", "failed": {metric@run: reason}}``."""
    t0 = time.monotonic()
    stats = {"done": 0, "skipped": 0, "left": 0, "failed": {}}
    todo = [e for e in evals if not is_done(e)]
    stats["skipped"] = len(evals) - len(todo)
    for i, ev in enumerate(todo):
        if max_minutes is not None and time.monotonic() - t0 > max_minutes * 60:
            stats["left"] = len(todo) - i
            break
        printer(f"[{i + 1}/{len(todo)}] {ev.command()}")
        try:
            evaluate_run(ev.run.dir, ev.request, "latest", record=True, plots=False, printer=lambda *_: None)
            stats["done"] += 1
        except (ConfigError, WorkdirError, ValueError, FileNotFoundError) as e:  # recorded; the claim says why
            stats["failed"][f"{ev.metric}@{ev.run.key}"] = " ".join(str(e).split())
            printer(f"  failed: {' '.join(str(e).split())}")
    return stats
