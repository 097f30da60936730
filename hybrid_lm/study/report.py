"""A study judged: ``claims.json`` (every number with the row it came from), ``claims.md`` (the tables
docs/RESULTS.md quotes) and the figures (``plots/study_loss.png``, ``plots/noise.png``)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from hybrid_lm.run.directory import metrics_path
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.study.evaluations import is_done, rows_for
from hybrid_lm.study import verdict as V
from hybrid_lm.study.runs import Run, Value, final_eval, row_value, training_speed
from hybrid_lm.study.spec import TRAIN_METRIC, ClaimsSpec

SCHEMA = "hybrid_lm.claims/2"


def metric_values(spec: ClaimsSpec, runs: list[Run], evals) -> dict:
    """``values[arm][seed][metric] -> Value`` of the runs at the study's budget."""
    by_key = {(e.metric, e.run.key): e for e in evals}
    out: dict = {}
    for r in runs:
        row = out.setdefault(r.arch, {}).setdefault(r.seed, {})
        row[TRAIN_METRIC] = final_eval(r)
        for m in spec.metrics.values():
            if m.eval is not None and m.on(r.arch, r.seed):
                ev = by_key.get((m.name, r.key))
                row[m.name] = row_value(r, rows_for(ev), m.task) if ev is not None else None
    return out


def _numbers(j: V.Judged) -> dict:
    return {"d": j.d, "se": j.se, "se_seed": j.se_seed, "se_val": j.se_val, "seed_dof": j.seed_dof,
            "paired_windows": j.paired, "arms": j.per_arm}


def judge_claims(spec: ClaimsSpec, values: dict) -> dict:
    """Every claim: its parts' d, standard errors, verdicts (all seeds, and each half of them)."""
    out = {}
    for name, c in spec.claims.items():
        if c.untested:
            out[name] = {"title": c.title, "verdict": V.NOT_TESTED, "why": c.untested, "parts": []}
            continue
        if c.report:
            per = {arm: {str(s): (v.get(c.report).value if v.get(c.report) else None) for s, v in seeds.items()}
                   for arm, seeds in values.items()}
            out[name] = {"title": c.title, "verdict": V.REPORTED, "metric": c.report, "numbers": per, "parts": []}
            continue
        parts = []
        for p in c.parts:
            entry = {"part": p.part, "statement": p.statement, "d_expression": p.d, "predict": p.predict,
                     "margin": p.margin if p.predict == "close" else None}
            missing = [a for a in p.arms if a not in values]
            j = None if missing else V.judge(p.terms, values)
            if j is None:
                entry.update(verdict=V.NOT_EVALUATED, why=f"not evaluated: {', '.join(missing)} not trained yet"
                             if missing else "not evaluated: its numbers are not recorded")
                parts.append(entry)
                continue
            entry.update(_numbers(j), verdict=V.verdict(j.d, j.se, p.predict, spec.k, p.margin))
            halves = []
            for seeds in V.halves(values, p.arms):
                h = V.judge(p.terms, values, seeds)
                halves.append(None if h is None else {"seeds": seeds, "d": h.d, "se": h.se,
                                                      "verdict": V.verdict(h.d, h.se, p.predict, spec.k, p.margin)})
            entry["halves"] = halves
            entry["halves_agree"] = all(h is not None and h["verdict"] == entry["verdict"] for h in halves)
            parts.append(entry)
        out[name] = {"title": c.title, "verdict": V.combine([x["verdict"] for x in parts]), "parts": parts}
    return out


def noise_table(runs_all: list[Run], reference: str) -> list[dict]:
    """The reference arm's final val loss at every budget it trained: each seed's loss and its error over
    windows, their mean, standard deviation and spread."""
    out = []
    for b in sorted({r.budget for r in runs_all if r.arch == reference}):
        vals = {r.seed: final_eval(r) for r in runs_all if r.arch == reference and r.budget == b}
        vals = {s: v for s, v in sorted(vals.items()) if v is not None}
        losses = [v.value for v in vals.values()]
        out.append({"arch": reference, "budget": b, "seeds": list(vals), "loss": losses,
                    "loss_se": [v.se for v in vals.values()], "windows": [len(v.windows or ()) for v in vals.values()],
                    "mean": float(np.mean(losses)) if losses else None,
                    "sd": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
                    "spread": max(losses) - min(losses) if len(losses) > 1 else None,
                    "runs": [r.key for r in runs_all if r.arch == reference and r.budget == b]})
    return out


def arm_table(spec: ClaimsSpec, runs: list[Run], values: dict) -> list[dict]:
    """One row per run at the study's budget: every metric, the speed, the device."""
    rows = []
    for r in runs:
        v = values.get(r.arch, {}).get(r.seed, {})
        row = {"run": r.key, "arch": r.arch, "seed": r.seed,
               "part": next((i for i in range(1, len(spec.parts) + 1) if spec.in_part(i, r.arch, r.seed)), None),
               **training_speed(r)}
        for m in spec.metrics:
            x: Value | None = v.get(m)
            row[m] = x.value if x else None
            row[f"{m}_se"] = x.se if x else None
        rows.append(row)
    return rows


def arm_means(spec: ClaimsSpec, values: dict) -> list[dict]:
    """Each arm's mean val loss over its seeds, with the seeds' standard error (pooled seed variance of the
    loss over every arm) and the mean error over windows."""
    s2, dof = V.pooled_seed_variance(((1.0, TRAIN_METRIC),), values)
    out = []
    for arm in spec.arms:
        seeds = {s: v[TRAIN_METRIC] for s, v in values.get(arm, {}).items() if v.get(TRAIN_METRIC) is not None}
        if not seeds:
            continue
        losses = [x.value for x in seeds.values()]
        out.append({"arch": arm, "seeds": sorted(seeds), "mean": float(np.mean(losses)),
                    "se_seed": math.sqrt(s2 / len(losses)) if s2 is not None else None,
                    "se_val": float(np.mean([x.se for x in seeds.values() if x.se is not None] or [np.nan])),
                    "min": min(losses), "max": max(losses)})
    return out, (math.sqrt(s2) if s2 is not None else None), dof


def document(spec: ClaimsSpec, root: Path, runs: list[Run], runs_all: list[Run], evals, stats: dict) -> dict:
    values = metric_values(spec, runs, evals)
    means, seed_sd, dof = arm_means(spec, values)
    return {"schema": SCHEMA, "root": str(root), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "claims_file": str(spec.path), "claims_text": spec.text, "budget": spec.budget, "k": spec.k,
            "seq_len": runs[0].seq_len if runs else None, "runs": [r.key for r in runs],
            "table": arm_table(spec, runs, values), "arms": means,
            "seed_sd_loss": seed_sd, "seed_dof_loss": dof,
            "noise": noise_table(runs_all, spec.arms[0]),
            "claims": judge_claims(spec, values),
            "parts": [{"part": i, "members": [a if s is None else f"{a}:{','.join(map(str, s))}" for a, s in p],
                       "trained": [a if s is None else f"{a}:{','.join(map(str, s))}" for a, s in p
                                   if a in values and (s is None or set(s) <= set(values[a]))]}
                      for i, p in enumerate(spec.parts, 1)],
            "evaluations": [{"metric": e.metric, "run": e.run.key, "command": e.command(), "done": bool(d)}
                            for e, d in evals_done(evals)],
            "evaluation_stats": stats}


def evals_done(evals):
    return [(e, is_done(e)) for e in evals]


# ----------------------------------------------------------------------------- markdown

def _f(x, fmt="{:.4f}") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def format_markdown(doc: dict, command: str) -> str:
    T = doc["seq_len"]
    lines = [f"Generated by `{command}` ({doc['created']}) from the rows under `{doc['root']}`; `claims.json` "
             "names the row behind every number.", ""]
    lines += [f"**Noise.** Final val loss of `{doc['noise'][0]['arch'] if doc['noise'] else 'full'}` (nats/token, "
              f"every val window at T = {T}; ± its standard error over windows) by budget and seed:", "",
              "| D/N | seeds | val loss per seed | mean | SD over seeds | spread |", "|---|---|---|---|---|---|"]
    for n in doc["noise"]:
        per = ", ".join(f"{_f(v)} ± {_f(se)}" for v, se in zip(n["loss"], n["loss_se"]))
        lines.append(f"| {n['budget']:g} | {len(n['seeds'])} | {per} | {_f(n['mean'])} | {_f(n['sd'])} | {_f(n['spread'])} |")
    lines += ["", f"Pooled over every arm at D/N = {doc['budget']:g}: seed SD of the val loss "
                  f"{_f(doc['seed_sd_loss'])} nats ({doc['seed_dof_loss']} degrees of freedom).", ""]
    lines += ["**Arms** (D/N = %g; mean over seeds, ± the seeds' standard error and the mean error over windows):"
              % doc["budget"], "", "| arm | part | seeds | val loss | ± seeds | ± windows | range over seeds |",
              "|---|---|---|---|---|---|---|"]
    part_of: dict[str, list] = {}
    for p in doc["parts"]:
        for m in p["members"]:
            part_of.setdefault(m.split(":")[0], []).append(str(p["part"]))
    for a in doc["arms"]:
        lines.append(f"| {a['arch']} | {', '.join(part_of.get(a['arch'], ['—']))} | {', '.join(map(str, a['seeds']))} | {_f(a['mean'])} "
                     f"| {_f(a['se_seed'])} | {_f(a['se_val'])} | {_f(a['min'])}–{_f(a['max'])} |")
    untrained = [(m, p["part"]) for p in doc["parts"] for m in p["members"] if m not in p["trained"]]
    if untrained:
        lines += ["", "Not trained yet: " + ", ".join(f"{m} (part {n})" for m, n in untrained) + "."]
    reported = {c["metric"] for c in doc["claims"].values() if c.get("metric")}
    metric_cols = [k for k in ("loss_2T", "loss_4T", *sorted(reported)) if any(r.get(k) is not None for r in doc["table"])]
    lines += ["", "**Runs:**", "", "| run | arm | seed | val loss | bits/byte | "
              + " | ".join(metric_cols) + (" | " if metric_cols else "") + "tokens/s | MFU | device |",
              "|" + "---|" * (8 + len(metric_cols))]
    for r in doc["table"]:
        cols = [_f(r.get(k), "{:.3f}" if k == "longppl" else "{:.4f}") for k in metric_cols]
        lines.append(f"| {r['run']} | {r['arch']} | {r['seed']} | {_f(r.get('loss'))} ± {_f(r.get('loss_se'))} | "
                     f"{_f(r.get('bpb'))} | " + "".join(c + " | " for c in cols)
                     + f"{_f(r.get('tokens_per_sec'), '{:,.0f}')} | {_f(r['mfu'] * 100 if r.get('mfu') else None, '{:.1f}%')} "
                     f"| {r.get('device') or '—'} |")
    lines += ["", f"**Claims** (k = {doc['k']:g}: a part is decided when d clears k standard errors; SE = "
                  "sqrt(seeds² + val set²)):", "",
              "| claim | verdict | part | d | SE (seeds, val set) | verdict of the part | first half / second half of the seeds |",
              "|---|---|---|---|---|---|---|"]
    for name, c in doc["claims"].items():
        if not c["parts"]:
            lines.append(f"| {name} | {c['verdict']} | {c.get('why') or c['title']} | | | | |")
            continue
        for i, p in enumerate(c["parts"]):
            se = (f"{_f(p['se'])} ({_f(p['se_seed'])}, {_f(p['se_val'])}{', paired' if p.get('paired_windows') else ''})"
                  if "se" in p else "—")
            halves = " / ".join("—" if h is None else h["verdict"] for h in p.get("halves") or []) or "—"
            stmt = p["statement"].replace("|", "\\|") + f" (d = {p['d_expression']}"
            stmt += f", close within {p['margin']:g})" if p["predict"] == "close" else ", predicted > 0)"
            lines.append(f"| {name if i == 0 else ''} | {c['verdict'] if i == 0 else ''} | {p['part']}: {stmt} | "
                         f"{_f(p.get('d'))} | {se} | {p['verdict']} | {halves} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- figures

def plot_study(doc: dict, runs: list[Run], out_png: Path) -> Path:
    """Left: each run's val loss against tokens (the trainer's evals, every val window); right: each arm's
    final val loss, the mean over its seeds with each seed as a cross and a bar of ± k seed standard errors
    (the error of a paired difference between arms is about sqrt(2) times it: the val-set term cancels)."""
    import matplotlib  # plots only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    arms = [a["arch"] for a in doc["arms"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.4, 1]})
    highs, lows = [], []
    for r in runs:
        if r.arch not in arms:
            continue
        rows = [x for x in read_metrics(metrics_path(r.dir), "eval")
                if isinstance(x.get("loss"), (int, float)) and x.get("step", 0) > 0]
        if not rows:
            continue
        x = np.array([x["tokens"] for x in rows], float) / 1e6
        y = np.array([x["loss"] for x in rows], float)
        first = min(s.seed for s in runs if s.arch == r.arch)
        ax.plot(x, y, lw=1.0, marker=".", ms=4, color=colors[arms.index(r.arch) % len(colors)],
                ls=("-", "--", ":", "-.")[r.seed % 4], label=r.arch if r.seed == first else None)
        highs.append(y[min(1, len(y) - 1)])
        lows.append(y.min())
    if lows:
        ax.set_ylim(min(lows) - 0.05, max(highs) + 0.05)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel(f"val loss at T = {doc['seq_len']} (nats/token)")
    ax.set_title("val loss during training (line style: seed)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    k = doc["k"]
    ys = np.arange(len(doc["arms"]))[::-1]
    per_run = {(t["arch"], t["seed"]): t["loss"] for t in doc["table"]}
    for yy, a in zip(ys, doc["arms"]):
        c = colors[arms.index(a["arch"]) % len(colors)]
        se = a["se_seed"] or 0.0
        bx.errorbar([a["mean"]], [yy], xerr=[[k * se], [k * se]], fmt="o", color=c, capsize=3, ms=6)
        bx.scatter([per_run[(a["arch"], s)] for s in a["seeds"]], [yy - 0.25] * len(a["seeds"]), color=c, marker="x",
                   s=18, lw=1)
        bx.text(a["mean"], yy + 0.12, f"{a['mean']:.3f}", fontsize=7, ha="center", va="bottom")
    bx.set_yticks(ys, [a["arch"] for a in doc["arms"]], fontsize=8)
    bx.set_ylim(-0.7, len(ys) - 0.4)
    bx.set_xlabel(f"final val loss at T = {doc['seq_len']} (nats/token, lower is better)")
    bx.set_title(f"mean over seeds ± {k:g} seed SE; x: each seed", fontsize=10)
    bx.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def plot_noise(doc: dict, out_png: Path) -> Path:
    """The reference arm's final val loss against the budget: each seed a dot, its error over windows a bar."""
    import matplotlib  # plots only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for n in doc["noise"]:
        for s, v, se in zip(n["seeds"], n["loss"], n["loss_se"]):
            ax.errorbar([n["budget"] * (1 + 0.03 * (s - 1))], [v], yerr=[2 * (se or 0)], fmt="o", ms=4, capsize=2,
                        color=f"C{s % 10}", label=f"seed {s}" if n is doc["noise"][0] else None)
    ax.set_xscale("log")
    budgets = [n["budget"] for n in doc["noise"]]
    ax.minorticks_off()
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlabel("D/N (tokens per non-embedding parameter)")
    ax.set_ylabel("final val loss (nats/token), ± 2 SE over windows")
    ax.set_title(f"{doc['noise'][0]['arch'] if doc['noise'] else ''}: each seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    sd = [(n["budget"], n["sd"], n["spread"]) for n in doc["noise"] if n["sd"] is not None]
    if sd:
        bx.plot([b for b, _, _ in sd], [s for _, s, _ in sd], "o-", label="SD over seeds")
        bx.plot([b for b, _, _ in sd], [s for _, _, s in sd], "s--", label="spread (max - min)")
        se = [(n["budget"], float(np.mean([x for x in n["loss_se"] if x is not None]))) for n in doc["noise"]
              if any(x is not None for x in n["loss_se"])]
        bx.plot([b for b, _ in se], [s for _, s in se], "^:", label="SE over val windows (one run)")
    bx.set_xscale("log")
    bx.minorticks_off()
    bx.set_xticks(budgets, [f"{b:g}" for b in budgets])
    bx.set_xlabel("D/N")
    bx.set_ylabel("nats/token")
    bx.set_title("noise of the final val loss", fontsize=10)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
