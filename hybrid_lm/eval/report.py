"""``hybrid-lm eval-report SWEEP_ROOT|RUN_DIRS...``: runs' eval results overlaid, one curve per architecture.

For every run found (``hybrid_lm.scaling.collect.find_run_dirs``: a sweep root, run directories, or
folders searched), the current rows of its ``eval.jsonl`` (``suite.current_rows``) are grouped by
(task, eval_key): one figure per group, the task's headline number (``suite.headline``) against
tokens seen, one curve per run labelled by its architecture (``collect.arch_label``) and size.
RULER rows are split per RULER task. Runs whose rows were evaluated with other settings land in
another figure, never on the same axes. A run left out (no eval.jsonl, none of ``--tasks``) and a
task whose rows have no headline number are one ``skipped ...`` line each, with the reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hybrid_lm.errors import WorkdirError

log = logging.getLogger(__name__)


def run_label(d: Path) -> str:
    """``<arch label> <size>`` of a run directory, e.g. ``full+swa128 d64L4`` (the sweep's names
    where the sweep wrote them)."""
    import json

    from hybrid_lm.scaling.collect import _arch_of

    arch, _ = _arch_of(d)
    meta = d / "sweep_run.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        return f"{m.get('arch') or arch or d.name} {m.get('scale') or ''}".strip()
    size = ""
    try:
        from hybrid_lm.eval.restore import load_run_config
        c = load_run_config(d).model
        size = f"d{c.d_model}L{c.n_layers}"
    except (OSError, ValueError):
        pass
    return f"{arch or d.name} {size}".strip()


def why_no_headline(row: dict) -> str:
    """Why an eval.jsonl row gives no point to plot (no headline number, or no tokens seen), from what
    the row says."""
    from hybrid_lm.eval.suite import HEADLINES, headline, task_of

    fam = task_of(row)
    if headline(row) is not None:
        return ("no tokens seen: written outside the suite (`hybrid-lm longppl`, or `hybrid-lm eval` without "
                "--tasks); rerun it with `hybrid-lm eval RUN_DIR --tasks ...`")
    if fam == "longppl" and row.get("n_key") == 0:
        return (f"LongPPL undefined: the evaluator found 0 key tokens (key 0/{row.get('n_token')}, documents of "
                f"up to {row.get('length')} tokens, --trunc-len {row.get('trunc_len')}); only tokens past the short "
                "context can be key: use longer documents (--longppl-length, default 32767 capped at the run's "
                "seq_len + 1; --data a store of long documents), a smaller --trunc-len, or a stronger --evaluator")
    if fam == "ruler" and str(row.get("generation", "")).startswith("unavailable"):
        return f"no exact match: generation {row['generation']}"
    if fam == "influence":
        return "G(d) is zero at every distance (no mean_distance)"
    if fam == "lm_eval":
        return "lm-eval reported none of the score metrics (acc_norm, acc, ...)"
    return f"no {HEADLINES.get(fam, (None,))[0] or 'headline number'} in the row"


def collect_eval(paths: list[str | Path], tasks: tuple[str, ...] | None = None,
                 skipped: list[str] | None = None) -> dict:
    """``{(task, eval_key): {label: [(tokens_seen, value, step), ...]}}`` over the runs under ``paths``;
    a line per run and per task left out, with the reason, is appended to ``skipped``."""
    from hybrid_lm.eval.suite import check_tasks, current_rows, headline, task_of
    from hybrid_lm.scaling.collect import find_run_dirs

    if tasks:
        check_tasks(tasks)
    skipped = [] if skipped is None else skipped
    try:
        dirs = find_run_dirs(list(paths))
    except FileNotFoundError as e:
        raise WorkdirError(str(e)) from None
    if not dirs:
        raise WorkdirError(f"no run directory (metrics.jsonl) under {', '.join(map(str, paths))}")
    groups: dict = {}
    labels: dict = {}
    for d in dirs:
        label = run_label(d)
        n = labels.setdefault(label, 0)
        labels[label] = n + 1
        if n:  # two runs of one architecture and size (seeds): keep both curves apart
            label = f"{label} #{n + 1}"
        rows = current_rows(d)
        asked = [r for r in rows if not tasks or task_of(r) in tasks]
        if not asked:
            why = ("no eval.jsonl" if not (d / "eval.jsonl").exists() else "its eval.jsonl holds no rows" if not rows
                   else f"its eval.jsonl holds no {','.join(tasks)} rows (it holds "
                        f"{', '.join(sorted({task_of(r) for r in rows}))})")
            skipped.append(f"skipped run {d} ({label}): {why} (`hybrid-lm eval {d} --tasks "
                           f"{','.join(tasks) if tasks else 'loss'} --steps all` writes them)")
            continue
        missing: dict[str, list[str]] = {}
        for r in asked:
            name = str(r.get("task") or task_of(r))
            v = headline(r)
            if v is None or r.get("tokens_seen") is None:
                missing.setdefault(name, []).append(why_no_headline(r))
                continue
            groups.setdefault((name, r.get("eval_key") or "-"), {}).setdefault(label, []).append(
                (int(r["tokens_seen"]), v, int(r["checkpoint_step"])))
        for name, whys in sorted(missing.items()):
            skipped.append(f"skipped {name} of {d}: {len(whys)} row{'s' if len(whys) != 1 else ''} without a "
                           f"headline number ({'; '.join(dict.fromkeys(whys))})")
    for series in groups.values():
        for pts in series.values():
            pts.sort()
    return groups


def format_report(groups: dict) -> str:
    from hybrid_lm.eval.suite import HEADLINES

    lines = []
    for (task, key), series in sorted(groups.items()):
        metric, better = HEADLINES.get(task.split("/")[0], (None, None))
        lines.append(f"{task}  [eval config {key}]  {metric or 'headline'}"
                     + (f" ({better} is better)" if better else ""))
        for label, pts in sorted(series.items()):
            t, v, s = pts[-1]
            lines.append(f"  {label:<36} {len(pts):>3} checkpoints   last: step {s:>7}  tokens {t:>14,}  {v:.4g}")
    return "\n".join(lines) if lines else "no eval rows with a headline number"


def nothing_to_report(paths: list[str | Path], tasks: tuple[str, ...] | None = None) -> str:
    """Why :func:`collect_eval` found no curve: what the run dirs under ``paths`` hold (eval-suite
    rows per task, the trainer's periodic eval rows) and the command that writes suite results."""
    from hybrid_lm.eval.suite import current_rows, headline, task_of
    from hybrid_lm.scaling.collect import find_run_dirs
    from hybrid_lm.train.metrics import read_metrics

    dirs = find_run_dirs(list(paths))
    per_task: dict[str, int] = {}
    asked = scored = trainer = 0
    for d in dirs:
        for r in current_rows(d):
            fam = task_of(r)
            per_task[fam] = per_task.get(fam, 0) + 1
            if not tasks or fam in tasks:
                asked += 1
                scored += headline(r) is not None and r.get("tokens_seen") is not None
        trainer += len(read_metrics(d / "metrics.jsonl", "eval"))
    found = f"{len(dirs)} run dir{'s' if len(dirs) != 1 else ''}: "
    if per_task:
        found += "eval.jsonl holds " + ", ".join(f"{n} {t}" for t, n in sorted(per_task.items())) + " eval-suite rows"
        if tasks and not asked:
            found += f", none of --tasks {','.join(tasks)}"
        elif not scored:
            found += ", none with a headline number and tokens seen"
    else:
        found += "no eval-suite results (no eval.jsonl rows)"
    found += (f"; metrics.jsonl holds {trainer} trainer eval row{'s' if trainer != 1 else ''} (the periodic val "
              "loss of training: `hybrid-lm collect` tabulates them, eval-report does not plot them)")
    return (f"nothing to plot in {found}. Write eval-suite results with `hybrid-lm eval RUN_DIR --tasks "
            f"{','.join(tasks) if tasks else 'loss'} --steps all` for each run, then run eval-report again")


def plot_report(groups: dict, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybrid_lm.eval.suite import HEADLINES

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (task, key), series in sorted(groups.items()):
        metric, better = HEADLINES.get(task.split("/")[0], (None, None))
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, pts in sorted(series.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.set_xscale("log")
        if task == "longppl":
            ax.set_yscale("log")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel((metric or "headline") + (f" ({better} is better)" if better else ""))
        ax.set_title(f"{task}  (eval config {key})", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{task.replace('/', '_')}_{key}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def eval_report(paths: list[str | Path], out_dir: str | Path | None = None, tasks: tuple[str, ...] | None = None,
                printer=print) -> list[Path]:
    skipped: list[str] = []
    groups = collect_eval(paths, tasks, skipped)
    for line in skipped:
        printer(line)
    printer(format_report(groups) if groups else nothing_to_report(paths, tasks))
    out = Path(out_dir) if out_dir else Path(paths[0]) / "eval_report"
    plots = plot_report(groups, out) if groups else []
    for p in plots:
        printer(f"plot: {p}")
    return plots
