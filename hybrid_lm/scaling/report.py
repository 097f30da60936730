"""One markdown report per sweep: the sweep's state and cost, and the fits per architecture side by side.

Reads ``fit.json`` (and its figures, linked by relative path) and, when given, the sweep root's
``sweep.json`` and run directories. No JAX.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _g(x, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def _ci(ci: dict | None, name: str) -> str:
    if not ci or not ci.get("params") or not ci["params"].get(name):
        return ""
    c = ci["params"][name]
    return f" [{_g(c['lo'], 3)}, {_g(c['hi'], 3)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def sweep_section(root: Path) -> list[str]:
    from hybrid_lm.scaling.launch import job_state  # a sweep's state needs JAX; a fit's report does not
    from hybrid_lm.scaling.sweep import Job  # a sweep's state needs JAX; a fit's report does not

    man = json.loads((root / "sweep.json").read_text())
    jobs = [Job.from_dict(j) for j in man["jobs"]]
    s = man.get("summary", {})
    lines = [f"## Sweep `{man['name']}`", ""]
    if man.get("spec", {}).get("description"):
        lines += [man["spec"]["description"], ""]
    lines += [f"- spec: `{man.get('spec_path')}` (digest `{man.get('spec_digest')}`), root `{root}`"]
    if man.get("extra_params"):
        lines.append(f"- extra bindings: `{'`, `'.join(man['extra_params'])}`")
    if s:
        lines.append(f"- {s['jobs']} jobs: {s['budget_runs']} budget runs, {s['stable_runs']} stable runs; "
                     f"{s['planned_flops']:.3g} FLOPs = {_g(s['planned_gpu_hours'])} H200 GPU-hours at "
                     f"{s['mfu']:.1%} MFU as planned")
        lines.append(f"- independent runs would cost {_g(s['independent_gpu_hours'])} GPU-hours; WSD branching "
                     f"{_g(s['branched_gpu_hours'])} (saving {s['branching_saving']:.1%})")
    states: dict[tuple, dict] = {}
    for j in jobs:
        if j.kind == "stable":
            continue
        st = job_state(root, j)
        d = states.setdefault((j.scale, j.arch), {})
        d[st] = d.get(st, 0) + 1
    archs = list(dict.fromkeys(j.arch for j in jobs))
    scales = list(dict.fromkeys(j.scale for j in jobs))
    rows = []
    for sc in scales:
        cells = []
        for a in archs:
            d = states.get((sc, a), {})
            tot = sum(d.values())
            cells.append(f"{d.get('done', 0)}/{tot}" + (f" ({d['partial']} partial)" if d.get("partial") else ""))
        rows.append([sc] + cells)
    lines += ["", "Finished budget runs per scale and architecture:", ""]
    lines += _table(["scale"] + archs, rows)
    return lines + [""]


def _extrapolation(c: float, cmax: float) -> str:
    x = c / cmax
    if x <= 1.0 + 1e-9:
        return "within the data"
    return f"extrapolated {x:.3g}x beyond the largest run"


def fits_section(doc: dict, fig_dir: Path, out_dir: Path) -> list[str]:
    fits = doc["fits"]
    archs = list(fits)
    first = next(iter(fits.values()))
    lines = [f"## Fits of `{doc['metric']}`: {doc['form']} ({first['formula']})", ""]
    lines.append(f"Log-space Huber (δ = {first['delta']:g}, summed), multi-start from a grid, "
                 f"tight polish; {doc['n_boot']} bootstrap resamples by run (seed {doc['seed']}), 95% percentile "
                 f"CIs in brackets. Rows: {doc['rows']}.")
    if doc.get("undecayed_rows_used"):
        lines.append(f"**{doc['undecayed_rows_used']} rows from before a WSD decay (never decayed) are in these fits** "
                     "(`--rows intermediate`); they bias L(N, D) upwards.")
    lines.append("")
    names = [("E", "E"), ("A", "A"), ("B", "B"), ("alpha", "α"), ("beta", "β")]
    rows = [["valid"] + ["yes" if fits[a].get("valid", True) else "**NOT VALID**" for a in archs]]
    for key, label in names:
        if doc["form"] == "no-E" and key == "E":
            continue
        rows.append([label] + [_g(fits[a]["params"][key]) + _ci(fits[a].get("ci"), key) for a in archs])
    rows.append(["a = β/(α+β) (N* ∝ C^a)"] + [
        _g(fits[a]["compute_optimal"].get("N_opt_exponent")) + _ci(fits[a].get("ci"), "N_opt_exponent")
        for a in archs])
    rows.append(["b = α/(α+β) (D* ∝ C^b)"] + [
        _g(fits[a]["compute_optimal"].get("D_opt_exponent")) + _ci(fits[a].get("ci"), "D_opt_exponent")
        for a in archs])
    rows.append(["points / distinct / runs / sizes"] + [
        " / ".join(str(fits[a].get(k, "–")) for k in ("n_points", "n_distinct_points", "n_runs", "n_sizes"))
        for a in archs])
    rows.append(["Huber objective"] + [_g(fits[a]["objective"]) for a in archs])
    rows.append(["fit RMSE (log)"] + [_g(fits[a]["residuals"]["rmse_log"]) for a in archs])
    rows.append(["bounds"] + [", ".join(f"{k}∈[{v[0]}, {v[1]}]" for k, v in fits[a]["bounds"].items()) or "none"
                              for a in archs])
    rows.append(["at a bound"] + [", ".join(fits[a]["at_bound"]) or "–" for a in archs])
    lines += _table(["parameter"] + archs, rows)
    flagged = [(a, fits[a].get("guardrails", {})) for a in archs]
    if any(g.get("reasons") or g.get("warnings") for _, g in flagged) or any(fits[a].get("warning") for a in archs):
        lines += ["", "**Guardrails.** A fit with a reason below is not valid: its compute-optimal allocation is "
                  "not used and it is not ranked.", ""]
        for a, g in flagged:
            for r in g.get("reasons", []):
                lines.append(f"- {a}: **not valid**: {r}")
            for w in g.get("warnings", []) + ([fits[a]["warning"]] if fits[a].get("warning") else []):
                lines.append(f"- {a}: warning: {w}")

    lines += ["", "### Hold-out validation", ""]
    rows = []
    for a in archs:
        h = fits[a].get("holdout") or {}
        if "skipped" in h:
            rows.append([a, h.get("rule", ""), "–", "–", "–", "–", "–", f"skipped: {h['skipped']}", "–"])
            continue
        m = h["holdout"]
        ok = "yes" if h.get("valid", True) else "no: " + "; ".join(h.get("reasons", []))
        rows.append([a, h["rule"], f"{h['n_train']} / {h['n_holdout']}", f"{m['bias_log']:+.4f}",
                     f"{m['rmse_log']:.4f}", f"{m['mae_log']:.4f}", f"{100 * m['worst_rel_error']:+.2f}%",
                     f"α={h['params']['alpha']:.3f}, β={h['params']['beta']:.3f}"
                     + (f"; at a bound: {', '.join(h['at_bound'])}" if h.get("at_bound") else ""), ok])
    lines += _table(["arch", "held out", "train / held-out points", "bias (log)", "RMSE (log)", "MAE (log)",
                     "worst rel. error", "hold-out fit", "valid"], rows)
    lines += ["", "Bias = mean of log(observed) − log(predicted) (positive: the fit under-predicts); the worst "
              "relative error is predicted/observed − 1 at the worst held-out point."]
    loso = [(a, r) for a in archs for r in fits[a].get("leave_one_size_out") or []]
    if loso:
        lines += ["", "Leave one size out:", ""]
        lines += _table(["arch", "N left out", "bias (log)", "RMSE (log)", "α", "β", "at a bound", "valid"], [
            [a, _g(r["N"], 3), f"{r['bias_log']:+.4f}", f"{r['rmse_log']:.4f}", f"{r['alpha']:.3f}",
             f"{r['beta']:.3f}", ", ".join(r.get("at_bound", [])) or "–", "yes" if r.get("valid", True) else "no"]
            for a, r in loso])

    lines += ["", "### Compute-optimal allocation", ""]
    cs = doc["compute_at"]
    cmax_all = max(fits[a]["compute_optimal"].get("C_max_data") or 0.0 for a in archs) or None
    header = ["arch", "FLOPs/(N·D)"] + [
        f"C = {c:.3g}" + (f" ({_extrapolation(c, cmax_all)})" if cmax_all else "") + ": N*, D*, D*/N*, L*"
        for c in cs]
    rows = []
    for a in archs:
        co = fits[a]["compute_optimal"]
        if not co.get("valid"):
            rows.append([a, _g(co["flops_per_nd"])] + ["– (fit not valid)"] * len(cs))
            continue
        rows.append([a, _g(co["flops_per_nd"])] + [
            f"{_g(p['N'], 3)}, {_g(p['D'], 3)}, {_g(p['D_over_N'], 3)}, {_g(p['L'])}" for p in co["points"]])
    lines += _table(header, rows)
    lines += ["", *(f"- {x}" for x in ranking(doc))]
    figs = doc.get("figures", {})
    if figs:
        lines += ["", "### Figures", ""]
        for key, title in (("fit", "Fits: metric against D per N, 95% bootstrap bands (held-out points: red "
                                   "diamonds, hold-out fit dashed)"),
                           ("frontier", "Compute-optimal frontiers and iso-FLOP profiles")):
            if key in figs:
                rel = os.path.relpath(fig_dir / figs[key], out_dir)
                lines += [f"**{title}**", "", f"![{key}]({rel})", ""]
    return lines


def ranking(doc: dict) -> list[str]:
    """The ranking of the valid fits by predicted compute-optimal metric, at the largest reference C no
    more than ``extrapolation_limit`` times beyond every ranked arch's largest run, labelled with its
    extrapolation; the archs left out and why."""
    fits = doc["fits"]
    limit = doc.get("extrapolation_limit", 10.0)
    valid = [a for a in fits if fits[a]["compute_optimal"].get("valid")]
    out = [f"Not ranked (fit not valid): {', '.join(a for a in fits if a not in valid)}." if len(valid) < len(fits)
           else ""]
    if len(valid) < 2:
        return [x for x in out if x] + [f"No ranking: {len(valid)} valid fit(s), a ranking needs 2."]
    pts = {a: fits[a]["compute_optimal"]["points"] for a in valid}
    if any(fits[a]["compute_optimal"].get("C_max_data") is None for a in valid):  # a fit.json of schema 1
        c = doc["compute_at"][-1]
        order = sorted(valid, key=lambda a: pts[a][-1]["L"])
        return [x for x in out if x] + [
            f"Predicted compute-optimal {doc['metric']} at C = {c:.3g} (the fit does not record the data's compute "
            "range: refit to see the extrapolation): " + ", ".join(f"{a} {_g(pts[a][-1]['L'])}" for a in order)]
    cmax = min(fits[a]["compute_optimal"]["C_max_data"] for a in valid)
    allowed = [j for j, c in enumerate(doc["compute_at"]) if c <= limit * cmax * (1 + 1e-9)]
    beyond = [c for c in doc["compute_at"] if c > limit * cmax * (1 + 1e-9)]
    if beyond:
        out.append(f"Not ranked at C = {', '.join(f'{c:.3g}' for c in beyond)}: more than {limit:g}x beyond the "
                   "largest run (the extrapolation limit).")
    if not allowed:
        return [x for x in out if x] + ["No ranking: every reference compute is past the extrapolation limit."]
    j = max(allowed, key=lambda i: doc["compute_at"][i])
    c = doc["compute_at"][j]
    order = sorted(valid, key=lambda a: pts[a][j]["L"])
    out.insert(0, f"Predicted compute-optimal {doc['metric']} at C = {c:.3g}, **{_extrapolation(c, cmax)}** "
               f"(best first): " + ", ".join(f"{a} {_g(pts[a][j]['L'])}" for a in order))
    return [x for x in out if x]


def write_report(fit_json: str | Path, out: str | Path | None = None, sweep_root: str | Path | None = None) -> Path:
    fit_json = Path(fit_json)
    if fit_json.is_dir():
        fit_json = fit_json / "fit.json"
    if not fit_json.exists():
        raise FileNotFoundError(f"{fit_json} does not exist (run `hybrid-lm fit TABLE --out DIR` first)")
    docs = [json.loads(fit_json.read_text())]
    out = Path(out) if out else fit_json.parent / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    title = docs[0].get("table") or str(fit_json)
    lines = ["# Scaling report", "", f"Table `{title}`; fit `{fit_json}`; created {docs[0]['created']}.", ""]
    if sweep_root is not None and (Path(sweep_root) / "sweep.json").exists():
        lines += sweep_section(Path(sweep_root))
    for doc in docs:
        lines += fits_section(doc, fit_json.parent, out.parent)
    from hybrid_lm.files import atomic_write_text
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out
