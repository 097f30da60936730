"""``hybrid-lm eval-report SWEEP_ROOT|RUN_DIRS...``: runs' eval results overlaid, one curve per architecture.

For every run found (``hybrid_lm.run.directory.find_run_dirs``: a sweep root, run directories, or
folders searched), the current rows of its ``eval.jsonl`` (``suite.current_rows``) are grouped by
(task, eval_key): one figure per group, the task's headline number (``suite.headline``) against
tokens seen, one curve per run labelled by its architecture (``model/architecture.py``) and size; a
horizontal bar per run where every run has one checkpoint. RULER rows are split per RULER task and
length; rows without exact match (``--ruler-no-generation``, ``--swap-prefill-only``) are plotted as
their answer NLL, in a figure of their own. Runs whose rows were evaluated with other settings land
in another figure, never on the same axes; a figure is titled by the settings that are not at
``hybrid-lm eval``'s defaults, in its options' spelling. A run left out (no eval.jsonl, none of
``--tasks``) and a task whose rows have no headline number are one ``skipped ...`` line each, with
the reason.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import NamedTuple

from hybrid_lm.errors import WorkdirError
from hybrid_lm.eval.suite import (EvalRequest, HEADLINES, _task_module, check_tasks, config_option, current_rows,
                                 headline, task_of)
from hybrid_lm.run.directory import eval_rows_path, find_run_dirs, load_run_config, metrics_path, run_architecture
from hybrid_lm.run.metrics import metric_label, read_metrics

log = logging.getLogger(__name__)

# written only when set, so rows written before them keep their eval key
ABSENT_DEFAULTS = {"swap_prefill_only": False, "generation": True}
NLL_LABEL = "answer NLL (nats, lower is better)"


class Group(NamedTuple):
    """One figure: a task's rows of one eval config (and RULER length), scored by one metric."""

    task: str  # e.g. loss, ruler/niah_single
    eval_key: str
    metric: str  # the headline (suite.HEADLINES or the task module's HEADLINE), or answer_nll
    length: int = 0  # RULER: the rows' context length
    settings: tuple[str, ...] = ()  # the eval config's non-default settings, e.g. ("--seq-len 8192",)


def metric_name(fam: str) -> str:
    """The headline metric of a task family: ``suite.HEADLINES``, else the task module's ``HEADLINE``."""
    key = HEADLINES.get(fam, (None, None))[0]
    if key is None and fam in ("probe", "heads", "influence"):
        try:
            key = _task_module(fam).HEADLINE
        except ImportError:
            pass
    return key or "headline"


def point(row: dict) -> tuple[str, float] | None:
    """(metric, value) a row is plotted by: its headline number, else RULER's answer NLL where the row has
    no exact match (log-likelihood scores only)."""
    fam = task_of(row)
    v = headline(row)
    if v is not None:
        return metric_name(fam), v
    nll = row.get("answer_nll")
    if fam == "ruler" and row.get("exact_match") is None and isinstance(nll, (int, float)):
        return "answer_nll", float(nll)
    return None


def eval_settings(row: dict) -> tuple[str, ...]:
    """The row's ``eval_config`` settings that differ from a plain ``hybrid-lm eval --tasks TASK``, as
    `hybrid-lm eval` options (``--swap full=sa:128``; ``alpha=2.5`` where no option sets it); RULER's
    lengths are left out (a figure holds one length, in its title)."""
    conf = row.get("eval_config")
    if not isinstance(conf, dict):
        return ()
    fam = task_of(row)
    defaults = {**ABSENT_DEFAULTS, **EvalRequest(tasks=(fam,)).config(fam)}
    out = []
    for k, v in conf.items():
        if (k in defaults and v == defaults[k]) or (k not in defaults and v is None):
            continue
        if k in ("generator", "definition") or (fam == "ruler" and k == "lengths") or (k == "sinks" and not v):
            continue  # fixed by the suite; one length per RULER figure; no sinks
        opt = config_option(fam, k)
        flag = opt.flags[0] if opt else k
        given = opt is None or opt.action != "store_false"  # the value a bare flag sets
        if k == "swaps":
            out += [f"{flag} {x}" for x in v]
        elif v is given:
            out.append(flag)
        elif k in ("evaluator", "data", "include_path") and isinstance(v, str):
            out.append(f"{flag} {Path(v).name or v}")  # the run or store's name, not its whole path
        elif isinstance(v, (list, tuple)):
            out.append(f"{flag} {','.join(map(str, v))}")
        elif flag == k:  # no option of `hybrid-lm eval`
            out.append(f"{k}={v}")
        else:
            out.append(f"{flag} {v}")
    return tuple(out)


def _tokens(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:g}"


def title(g: Group, width: int = 0) -> str:
    """``loss — --swap full=sa:128``: the task (RULER: at its length) and the non-default settings; with
    ``width``, lines of about that many characters, broken between settings."""
    head = g.task + (f" at {g.length // 1024}K tokens" if g.length and g.length % 1024 == 0 else
                     f" at {g.length} tokens" if g.length else "")
    if not g.settings:
        return head
    lines = [f"{head} —"]
    for x in g.settings:
        if width and len(lines[-1]) + 1 + len(x) > width:
            lines.append(x)
        else:
            lines[-1] += " " + x
    return "\n".join(lines)


def file_name(g: Group) -> str:
    """``<task>[_<metric>][_<length>][_<settings>]_<eval key>.png``; the metric only where it is not the
    task's headline."""
    parts = [g.task.replace("/", "_")]
    if g.metric != metric_name(task_of({"task": g.task})):
        parts.append(g.metric)
    if g.length:
        parts.append(str(g.length))
    slug = ""
    for x in g.settings:  # whole settings while the name stays short
        x = re.sub(r"[^A-Za-z0-9=.,+]+", "-", x).strip("-")
        if slug and len(slug) + len(x) > 40:
            break
        slug = f"{slug}_{x}" if slug else x
    if slug:
        parts.append(slug)
    return "_".join(parts + [g.eval_key]) + ".png"


def y_label(g: Group) -> str:
    if g.metric == "answer_nll":
        return NLL_LABEL
    better = HEADLINES.get(g.task.split("/")[0], (None, None))[1]
    return metric_label(g.metric) + (f", {better} is better" if better else "")


def run_label(d: Path) -> str:
    """``<arch label> <size>`` of a run directory, e.g. ``full+swa128 d64L4`` (the sweep's names
    where the sweep wrote them)."""

    arch, _ = run_architecture(d)
    meta, m = d / "sweep_run.json", None
    if meta.exists():
        m = json.loads(meta.read_text())
    elif (d.parent / "sweep.json").exists():  # a copy of a sweep's results files: the root's plan names the job
        try:
            m = next((j for j in json.loads((d.parent / "sweep.json").read_text()).get("jobs", [])
                      if j.get("name") == d.name), None)
        except (OSError, ValueError, AttributeError):
            m = None
    if m is not None:
        seed = f" seed {m['seed']}" if m.get("seed") else ""  # seed 0 is the default: unnamed
        return f"{m.get('arch') or arch or d.name} {m.get('scale') or ''}".strip() + seed
    size = ""
    try:
        c = load_run_config(d).model
        size = f"d{c.d_model}L{c.n_layers}"
    except (OSError, ValueError):
        pass
    return f"{arch or d.name} {size}".strip()


def why_no_headline(row: dict) -> str:
    """Why an eval.jsonl row gives no point to plot (no headline number, or no tokens seen), from what
    the row says."""
    fam = task_of(row)
    if point(row) is not None:
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
    """``{Group: {label: [(tokens_seen, value, step), ...]}}`` over the runs under ``paths``; a line per
    run and per task left out, with the reason, is appended to ``skipped``."""
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
            why = ("no eval.jsonl" if not eval_rows_path(d).exists() else "its eval.jsonl holds no rows" if not rows
                   else f"its eval.jsonl holds no {','.join(tasks)} rows (it holds "
                        f"{', '.join(sorted({task_of(r) for r in rows}))})")
            skipped.append(f"skipped run {d} ({label}): {why} (`hybrid-lm eval {d} --tasks "
                           f"{','.join(tasks) if tasks else 'loss'} --steps all` writes them)")
            continue
        missing: dict[str, list[str]] = {}
        for r in asked:
            name = str(r.get("task") or task_of(r))
            p = point(r)
            if p is None or r.get("tokens_seen") is None:
                missing.setdefault(name, []).append(why_no_headline(r))
                continue
            length = int(r.get("length") or 0) if task_of(r) == "ruler" else 0
            g = Group(name, r.get("eval_key") or "-", p[0], length, eval_settings(r))
            groups.setdefault(g, {}).setdefault(label, []).append((int(r["tokens_seen"]), p[1],
                                                                    int(r["checkpoint_step"])))
        for name, whys in sorted(missing.items()):
            skipped.append(f"skipped {name} of {d}: {len(whys)} row{'s' if len(whys) != 1 else ''} without a "
                           f"headline number ({'; '.join(dict.fromkeys(whys))})")
    for series in groups.values():
        for pts in series.values():
            pts.sort()
    return groups


def format_report(groups: dict) -> str:
    lines = []
    for g, series in sorted(groups.items()):
        lines.append(f"{title(g)}  [eval config {g.eval_key}]  {y_label(g)}")
        for label, pts in sorted(series.items()):
            t, v, s = pts[-1]
            lines.append(f"  {label:<36} {len(pts):>3} checkpoint{'s' if len(pts) != 1 else ' '}   last: step "
                         f"{s:>7}  tokens {t:>14,}  {v:.4g}")
    return "\n".join(lines) if lines else "no eval rows with a headline number"


def nothing_to_report(paths: list[str | Path], tasks: tuple[str, ...] | None = None) -> str:
    """Why :func:`collect_eval` found no curve: what the run dirs under ``paths`` hold (eval-suite
    rows per task, the trainer's periodic eval rows) and the command that writes suite results."""
    dirs = find_run_dirs(list(paths))
    per_task: dict[str, int] = {}
    asked = scored = trainer = 0
    for d in dirs:
        for r in current_rows(d):
            fam = task_of(r)
            per_task[fam] = per_task.get(fam, 0) + 1
            if not tasks or fam in tasks:
                asked += 1
                scored += point(r) is not None and r.get("tokens_seen") is not None
        trainer += len(read_metrics(metrics_path(d), "eval"))
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


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def series_styles(labels) -> dict[str, tuple]:
    """A (colour, marker) per label, none alike: tab20's dark shades (tab10's colours) then its light
    ones, then the colours again with another marker."""
    from matplotlib import colormaps  # plots only (a slow import)

    cmap = colormaps["tab20"]
    colours = [cmap(i) for i in range(0, 20, 2)] + [cmap(i) for i in range(1, 20, 2)]
    return {label: (colours[i % 20], MARKERS[(i // 20) % len(MARKERS)]) for i, label in enumerate(sorted(labels))}


def _bars(ax, g: Group, series: dict, styles: dict) -> str:
    """One horizontal bar per run (its single checkpoint), the value at the bar's end; the note for the
    small print (the tokens seen, where the runs share them)."""
    labels = sorted(series)
    values = [series[lb][0][1] for lb in labels]
    seen = {series[lb][0][0] for lb in labels}
    log = g.task == "longppl" and min(values) > 0
    if log:  # bars from a power of ten well below the smallest value: a log axis has no zero
        base = 10 ** math.floor(math.log10(min(values) / 1.5))
        ax.set_xscale("log")
    else:
        base = 0.0
    bars = ax.barh(range(len(labels)), [v - base for v in values], left=base,
                   color=[styles[lb][0] for lb in labels], height=0.7)
    texts = [f"{v:.4g}" + ("" if len(seen) == 1 else f"  ({_tokens(series[lb][0][0])} tokens)")
             for lb, v in zip(labels, values)]
    ax.bar_label(bars, texts, padding=3, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    pad = max(0, 3 - len(labels)) / 2  # room for three bars: one or two runs keep a bar's thickness
    ax.set_ylim(len(labels) - 0.5 + pad, -0.5 - pad)  # the first label on top
    hi = max(values)
    if log:
        ax.set_xlim(base, hi * (4 if len(seen) == 1 else 12))
    else:
        lo = min(0.0, min(values))
        ax.set_xlim(lo, hi + (hi - lo) * (0.18 if len(seen) == 1 else 0.45))
    ax.set_xlabel(y_label(g))
    ax.grid(alpha=0.3, axis="x", which="both")
    if len(seen) == 1:
        (t,) = seen
        steps = {series[lb][0][2] for lb in labels}
        return f"at {_tokens(t)} tokens seen" + (f" (step {next(iter(steps))})" if len(steps) == 1 else "")
    return "one checkpoint per run"


def plot_report(groups: dict, out_dir: Path) -> list[Path]:
    """One PNG per :class:`Group` of :func:`collect_eval`: curves against tokens seen, or bars where every
    run has one checkpoint; a run keeps its colour and marker across figures."""
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    out_dir.mkdir(parents=True, exist_ok=True)
    styles = series_styles({label for series in groups.values() for label in series})
    paths = []
    for g, series in sorted(groups.items()):
        one_each = all(len(pts) == 1 for pts in series.values())
        if one_each:
            fig, ax = plt.subplots(figsize=(6.4, max(2.4, 1.3 + 0.3 * len(series))))
            note = _bars(ax, g, series, styles)
        else:
            fig, ax = plt.subplots(figsize=(7.6, 4.2))
            for label, pts in sorted(series.items()):
                colour, marker = styles[label]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=4, color=colour, label=label)
            ax.set_xscale("log")
            if g.task == "longppl":
                ax.set_yscale("log")
            ax.set_xlabel("tokens seen")
            ax.set_ylabel(y_label(g))
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0,
                      ncol=-(-len(series) // 16))  # columns of 16: the legend stays as tall as the axes
            note = ""
        ax.set_title(title(g, width=80), fontsize=9)
        fig.tight_layout(rect=(0, 0.02, 1, 1))
        fig.text(0.995, 0.0, "  ".join(x for x in (note, f"eval config {g.eval_key}") if x), ha="right",
                 va="bottom", fontsize=6, color="0.4")
        p = out_dir / file_name(g)
        fig.savefig(p, dpi=120, bbox_inches="tight")
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
