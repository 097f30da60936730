"""RULER-offline's rows shown: the task x length table and ``ruler.png``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from hybrid_lm.eval.ruler_items import TASKS


LL_LEGEND = ("gold beats distractors: the share of items whose gold answer has a higher log-likelihood than "
             "each of the task's wrong answers of the same form (other keys' numbers, other listed words), in "
             "brackets the rate of a model that cannot tell them apart, 1 / (1 + wrong answers); — where a task "
             "has none")


def format_table(rows: list[dict], skipped: list[dict] = ()) -> str:
    """Tasks x lengths: exact match, answer NLL (nats/token) and gold-beats-distractors (chance in
    brackets); "—" where a score does not apply, "short" where the length was too short."""
    if not rows and not skipped:
        return "no RULER results"
    lengths = sorted({r["length"] for r in rows} | {s["length"] for s in skipped})
    tasks = [t for t in TASKS if any(r["task"] == f"ruler/{t}" for r in rows) or any(s["task"] == t for s in skipped)]
    cell = {(r["task"][len("ruler/"):], r["length"]): r for r in rows}
    short = {(s["task"], s["length"]) for s in skipped}

    def fmt(task, length, what):
        if (task, length) in short:
            return "short"
        r = cell.get((task, length))
        if r is None:
            return ""
        if what == "ll":
            return "—" if r["ll_accuracy"] is None else f"{r['ll_accuracy']:.2f} ({r['ll_chance']:.2f})"
        v = r[what]
        return "—" if v is None else f"{v:.3f}"

    lines = []
    first = rows[0] if rows else {}
    if first:
        hays: dict = {}
        for r in rows:
            if r["haystack"]:
                hays.setdefault(r["haystack"], []).append(r["task"][len("ruler/"):])
        hay = ("  haystack " + next(iter(hays)) if len(hays) == 1 else
               "  haystacks " + ", ".join(f"{h} ({', '.join(dict.fromkeys(ts))})" for h, ts in hays.items()) if hays
               else "")
        lines.append(f"RULER  step {first['checkpoint_step']}  {first['samples']} samples  seed {first['seed']}"
                     + hay + f"  generation: {first['generation']}")
    width = max(14, *(len(str(L)) for L in lengths))
    for title, what in (("exact match (greedy)", "exact_match"), ("answer NLL (nats/token)", "answer_nll"),
                        ("gold beats distractors (chance)", "ll")):
        lines.append(title)
        lines.append(f"  {'task':<16}" + "".join(f"{L:>{width}}" for L in lengths))
        for t in tasks:
            lines.append(f"  {t:<16}" + "".join(f"{fmt(t, L, what):>{width}}" for L in lengths))
    if any(r.get("ll_accuracy") is not None for r in rows):
        lines += textwrap.wrap(LL_LEGEND, 110)
    for s in skipped:
        lines.append(f"short: {s['reason']}")
    return "\n".join(lines)


def plot_ruler(rows: list[dict], out_dir: Path) -> list[Path]:
    """``ruler.png``: exact match (greedy) and the gold answer's NLL, one line per RULER task: against
    tokens seen (one line per task and length) over several checkpoints, against the context length
    for one checkpoint. The legend sits beside the axes (the NLL moves long before exact match leaves 0)."""
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    one = len({r["tokens_seen"] for r in rows}) == 1
    series: dict = {}
    for r in rows:
        name = r["task"].split("/", 1)[-1]
        series.setdefault(name if one else f"{name} @ {r['length']}", []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.4))
    colors = plt.get_cmap("tab10" if one else "tab20").colors * 4
    for (name, rs), color in zip(sorted(series.items()), colors):
        rs.sort(key=lambda r: r["length"] if one else r["tokens_seen"])
        x = [r["length"] if one else r["tokens_seen"] for r in rs]
        for ax, key in zip(axes, ("exact_match", "answer_nll")):
            y = [np.nan if r.get(key) is None else r[key] for r in rs]
            ax.plot(x, y, "o-", ms=4, lw=1.2, color=color, label=name)
    axes[0].set_ylabel("exact match, greedy (higher is better)")
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].set_ylabel("answer NLL, nats/token (lower is better)")
    lengths = sorted({r["length"] for r in rows})
    for ax in axes:
        ax.grid(alpha=0.3)
        if one:
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
            ax.minorticks_off()
            if len(lengths) == 1:
                ax.set_xlim(lengths[0] / 1.5, lengths[0] * 1.5)
            ax.set_xlabel("context length (tokens)")
        else:
            ax.set_xscale("log")
            ax.set_xlabel("tokens seen")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.86, 0.5), fontsize=7, frameon=False,
               ncol=1 if len(labels) <= 16 else 2)
    r0 = rows[0]
    fig.suptitle(f"RULER-offline at step {r0['checkpoint_step']} ({r0['tokens_seen']:,} tokens seen)" if one
                 else "RULER-offline over training")
    fig.tight_layout(rect=(0, 0, 0.86 if len(labels) <= 16 else 0.78, 1))
    path = out_dir / "ruler.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
