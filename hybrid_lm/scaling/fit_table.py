"""fit.json: one data set's entry (the point fit, its intervals, guardrails, compute-optimal allocation and
hold-out checks) and a table's fits, one per architecture."""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from pathlib import Path

import numpy as np

from hybrid_lm.files import atomic_write_text
from hybrid_lm.scaling.bootstrap import intervals
from hybrid_lm.scaling.fit import (DELTA, PUBLIC, FitError, Form, HuberLogObjective, fit_point, free_parameters,
                                   get_form, parse_bounds, theta_to_public)
from hybrid_lm.scaling.guardrails import EXPONENT_RANGE, at_bounds, check_design, check_fit
from hybrid_lm.scaling.holdout import check_holdout, error_metrics, leave_one_size_out
from hybrid_lm.scaling.law import EXTRAPOLATION_LIMIT, compute_optimal
from hybrid_lm.scaling.plots import write_figures
from hybrid_lm.scaling.table import NON_METRIC_COLUMNS

SCHEMA = "hybrid_lm.fit/2"  # 2: valid, guardrails, extrapolation per compute point


def fit_dataset(N, D, y, *, form: str | Form = "with-E", clusters=None, bounds: dict | None = None,
                grid: dict | None = None, multistart: str = "lm", n_boot: int = 1000, seed: int = 0,
                holdout: str = "largest", flops_per_nd: float = 6.0, compute_at=None, level: float = 0.95,
                delta: float = DELTA, loso: bool = False, progress: bool = False, label: str = "fit",
                resample: str | None = None, exponent_range=EXPONENT_RANGE, keep_samples: bool = False) -> dict:
    """Fit one data set (one architecture); returns the JSON-ready entry of fit.json (see SCALING.md).

    Raises :class:`FitError` when the points cannot identify the form (:func:`check_design`). A fit
    that a guardrail flags (:func:`check_design`, :func:`check_fit`) has ``valid: false`` with the
    reasons, and so has its ``compute_optimal``. ``keep_samples`` adds the bootstrap parameter
    samples under ``_samples`` (arrays, for the figures; not JSON).
    """
    form = get_form(form) if isinstance(form, str) else form
    N, D, y = (np.asarray(v, np.float64) for v in (N, D, y))
    clusters = np.arange(len(N)) if clusters is None else np.asarray(clusters)
    lo, hi, bounds_clean = parse_bounds(bounds, form)
    reasons, warnings = check_design(N, D, form, lo, hi, label)
    obj = HuberLogObjective(form, N, D, y, delta)
    pt = fit_point(obj, lo, hi, grid, multistart, progress=progress, desc=label)
    params = theta_to_public(form, pt.theta)
    pred = np.exp(obj.log_predict(pt.theta)[0])
    at_bound = at_bounds(form, pt.theta, lo, hi)
    entry = {
        "form": form.name, "formula": form.description, "delta": delta,
        "n_points": int(len(N)), "n_distinct_points": int(len(np.unique(np.stack([N, D], 1), axis=0))),
        "n_runs": int(len(np.unique(clusters))), "n_sizes": int(len(np.unique(N))),
        "N_range": [float(N.min()), float(N.max())], "D_range": [float(D.min()), float(D.max())],
        "params": params,
        "log_params": {name: float(pt.theta[form.index(name)]) for name in form.theta if name in ("a", "b", "e")},
        "free_parameters": free_parameters(form, lo, hi),
        "objective": pt.objective,
        "residuals": {k: v for k, v in error_metrics(y, pred).items() if k not in ("worst_index",)},
        "bounds": bounds_clean, "at_bound": at_bound,
        "optimizer": pt.info,
        "minima": [{"objective": f, "params": theta_to_public(form, th)} for f, th in pt.minima],
    }

    Cdata = flops_per_nd * N * D
    cmax = float(Cdata.max())
    if compute_at is None:
        compute_at = [float(Cdata.min()), cmax, 10 * cmax, 100 * cmax]
    compute_at = [float(c) for c in compute_at]
    samples, entry["ci"] = None, None
    if n_boot and n_boot > 1:
        entry["ci"], samples = intervals(obj, form, pt, clusters, lo, hi, n_boot=n_boot, seed=seed, level=level,
                                         compute_at=compute_at, flops_per_nd=flops_per_nd, resample=resample,
                                         progress=progress, desc=f"{label}: bootstrap")
    n_unidentified = entry["ci"]["n_unidentified"] if entry["ci"] else 0

    # guardrails: the design's, then the fitted law's
    reasons += check_fit(form, params, at_bound, y, lo, hi, entry["ci"], n_unidentified, exponent_range)
    entry["valid"] = not reasons
    entry["guardrails"] = {"reasons": reasons, "warnings": warnings, "exponent_range": list(exponent_range)}

    entry["compute_optimal"] = _compute_optimal_entry(params, compute_at, flops_per_nd, cmax, entry["ci"], reasons)

    # hold-out validation
    entry["holdout"] = check_holdout(N, D, y, clusters, form, bounds, grid, multistart, holdout, delta, label,
                                     progress, exponent_range)
    if loso:
        entry["leave_one_size_out"] = leave_one_size_out(N, D, y, form, bounds, grid, multistart, delta, label,
                                                         progress, exponent_range)
    entry["predictions"] = {"fitted": pred.tolist()}
    if keep_samples and samples is not None:
        entry["_samples"] = {k: samples[k] for k in PUBLIC if k in samples}
    return entry


def _compute_optimal_entry(params: dict, compute_at: list[float], flops_per_nd: float, cmax: float, ci: dict | None,
                           reasons: list[str]) -> dict:
    """fit.json's ``compute_optimal``: ``N*(C) = G (C/k)^a``, ``D*(C) = G^-1 (C/k)^b`` with
    ``a = beta/(alpha+beta)``, ``b = alpha/(alpha+beta)``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``
    and ``C = k N D`` (``k = flops_per_nd``) at each of ``compute_at``, with the bootstrap's intervals
    (``ci``) where there are; computed where the math allows, valid only for a fit with no ``reasons``."""
    co = compute_optimal(params, compute_at, flops_per_nd)
    co_entry = {"flops_per_nd": flops_per_nd, "valid": bool(co["valid"] and not reasons), "C_max_data": cmax}
    if co["valid"]:
        co_entry.update(N_opt_exponent=co["a"], D_opt_exponent=co["b"], G=co["G"], points=[
            {"C": c, "extrapolation": c / cmax, "N": float(n), "D": float(d), "D_over_N": float(d / n),
             "L": float(l)} for c, n, d, l in zip(compute_at, co["N"], co["D"], co["L"])])
        if ci:
            for p in co_entry["points"]:
                p["N_ci"] = ci["params"].get(f"N_opt@{p['C']:.3g}")
                p["D_ci"] = ci["params"].get(f"D_opt@{p['C']:.3g}")
    if not co_entry["valid"]:
        co_entry["reasons"] = ([co["reason"]] if not co["valid"] else []) + reasons
        co_entry["reason"] = "; ".join(co_entry["reasons"])
    return co_entry


# ----------------------------------------------------------------------------- tables -> fit.json

ROWS = ("final", "all", "intermediate")


def select_rows(rows: list[dict], metric: str, which: str = "final") -> tuple[list[dict], dict]:
    """Rows usable for a fit of ``metric``, and the counts of rows dropped per reason.

    ``which``: ``final`` (rows flagged ``final``, the default); ``all`` (every converged row: a
    final row or the end of a learning-rate decay, per the ``converged`` column; in a table without
    it, every row not in a WSD ``stable`` phase); ``intermediate`` (every row, un-decayed ones
    included at the caller's request). A row trained once but listed by several runs (a WSD stable
    row copied into each branch: same ``source_run`` and ``step``) is used once.
    """
    if which not in ROWS:
        raise FitError(f"rows={which!r}: choose one of {', '.join(ROWS)}")
    if not rows:
        raise FitError("the table is empty")
    cols = set().union(*(r.keys() for r in rows))
    if metric not in cols:
        raise FitError(f"metric column {metric!r} is not in the table; its metric columns are: "
                       f"{', '.join(metric_columns(rows)) or 'none'}")
    for col in ("N", "D"):
        if col not in cols:
            raise FitError(f"the table has no {col!r} column (N = parameters, D = tokens)")
    has_converged = "converged" in cols
    dropped = {"not_final": 0, "not_converged": 0, "duplicate": 0, "missing_metric": 0, "nonfinite_metric": 0,
               "nonpositive_N_or_D": 0}
    out, seen = [], set()
    for r in rows:
        if which == "final" and "final" in r and not _truthy(r.get("final")):
            dropped["not_final"] += 1
            continue
        if which == "all" and ((has_converged and not _truthy(r.get("converged")))
                               or (not has_converged and r.get("phase") == "stable")):
            dropped["not_converged"] += 1
            continue
        src, step = r.get("source_run") or r.get("run_id"), r.get("step")
        if src is not None and step is not None:
            if (src, step) in seen:
                dropped["duplicate"] += 1
                continue
            seen.add((src, step))
        if not all(isinstance(r.get(c), (int, float)) and r[c] > 0 for c in ("N", "D")):
            dropped["nonpositive_N_or_D"] += 1
            continue
        v = r.get(metric)
        if v is None or not isinstance(v, (int, float)):
            dropped["missing_metric"] += 1
            continue
        if not math.isfinite(v):
            dropped["nonfinite_metric"] += 1
            continue
        if v <= 0:
            raise FitError(f"metric {metric!r} must be > 0 for a log-space fit; run {r.get('run_id')} has {v}")
        out.append(r)
    return out, dropped


def describe_dropped(dropped: dict, metric: str, total: int) -> str | None:
    """One line naming how many rows :func:`select_rows` dropped and why (None if it dropped none)."""
    why = {"not_final": "not final", "not_converged": "not converged (before the end of a decay)",
           "duplicate": "the same trained row listed again (a WSD stable row in another branch)",
           "missing_metric": f"no {metric} value", "nonfinite_metric": f"NaN or inf {metric}",
           "nonpositive_N_or_D": "N or D missing or <= 0"}
    parts = [f"{n} {why.get(k, k)}" for k, n in dropped.items() if n]
    if not parts:
        return None
    return f"dropped {sum(dropped.values())} of {total} rows: {', '.join(parts)}"


def _truthy(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes")
    return bool(v)


def fit_table(rows: list[dict], *, metric: str = "loss", form: str = "with-E", out_dir: str | Path | None = None,
              archs: list[str] | None = None, which: str = "final", bounds: dict | None = None,
              n_boot: int = 1000, seed: int = 0, holdout: str = "largest", flops_per_nd: str | float = "auto",
              compute_at=None, multistart: str = "lm", grid: dict | None = None, loso: bool = False,
              table_path: str | None = None, plots: bool = True, progress: bool = True,
              exponent_range=EXPONENT_RANGE) -> dict:
    """Fit every architecture of a table separately (rows grouped by ``arch``, never pooled); writes
    fit.json (+ figures) to ``out_dir`` and returns the document."""
    form_obj = get_form(form)
    used, dropped = select_rows(rows, metric, which)
    groups: dict[str, list[dict]] = {}
    for r in used:
        groups.setdefault(str(r.get("arch") or "all"), []).append(r)
    if archs:
        missing = [a for a in archs if a not in groups]
        if missing:
            raise FitError(f"arch(s) {missing} have no usable rows; present: {sorted(groups)}")
        groups = {a: groups[a] for a in archs}
    if not groups:
        raise FitError(f"no row has a usable {metric!r} value (dropped: {dropped})")
    lo, hi, _ = parse_bounds(bounds, form_obj)
    refused = {}
    for a, rs in groups.items():
        check_one_architecture(a, rs)
        N, D = (np.array([float(r[c]) for r in rs]) for c in ("N", "D"))
        try:
            check_design(N, D, form_obj, lo, hi, f"arch {a!r}")
        except FitError as e:
            refused[a] = str(e)
    if refused:
        fittable = " ".join(f"--arch {a}" for a in groups if a not in refused)
        raise FitError(next(iter(refused.values()))
                       + (f" ({len(refused) - 1} more arch(s) likewise)" if len(refused) > 1 else "")
                       + (f"; to fit the others alone: {fittable}" if fittable else ""))
    # one compute grid shared by all archs, so frontiers compare at the same C
    fits, samples = {}, {}
    k_by_arch = {a: _flops_per_nd(rs, flops_per_nd) for a, rs in groups.items()}
    if compute_at is None:
        allC = [k_by_arch[a] * float(r["N"]) * float(r["D"]) for a, rs in groups.items() for r in rs]
        cmax = max(allC)
        compute_at = [min(allC), cmax, 10 * cmax, 100 * cmax]
    for a, rs in groups.items():
        N = np.array([float(r["N"]) for r in rs])
        D = np.array([float(r["D"]) for r in rs])
        y = np.array([float(r[metric]) for r in rs])
        clusters = np.array([str(r.get("source_run") or r.get("run_id") or i) for i, r in enumerate(rs)])
        t0 = time.time()
        entry = fit_dataset(N, D, y, form=form_obj, clusters=clusters, bounds=bounds, grid=grid,
                            multistart=multistart, n_boot=n_boot, seed=seed, holdout=holdout,
                            flops_per_nd=k_by_arch[a], compute_at=compute_at, loso=loso, progress=progress,
                            label=a, resample="run" if any("run_id" in r for r in rs) else None,
                            exponent_range=exponent_range, keep_samples=plots)
        samples[a] = entry.pop("_samples", None)
        entry["arch"] = a
        entry["arch_spec"] = next((r["arch_spec"] for r in rs if r.get("arch_spec")), None)
        entry["flops_per_nd_source"] = _k_source(rs, flops_per_nd, k_by_arch[a])
        entry["run_ids"] = [str(r.get("run_id", "")) for r in rs]
        entry["seconds"] = round(time.time() - t0, 2)
        fits[a] = entry
    undecayed = sum(1 for rs in groups.values() for r in rs if r.get("phase") == "stable")
    doc = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "table": table_path, "metric": metric, "target": f"log({metric})", "form": form_obj.name,
           "rows": which, "dropped_rows": dropped, "undecayed_rows_used": undecayed, "holdout_rule": holdout,
           "n_boot": n_boot, "seed": seed, "compute_at": compute_at, "extrapolation_limit": EXTRAPOLATION_LIMIT,
           "fits": fits, "figures": {}}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if plots:
            doc["figures"] = write_figures(doc, groups, out, samples)
        atomic_write_text(out / "fit.json", json.dumps(doc, indent=2, default=_json_default))
    return doc


def check_one_architecture(label: str, rows: list[dict]) -> None:
    """Raise :class:`FitError` when the rows of one label were trained with different architectures
    (their ``arch_spec`` differs): a fit must never pool them."""
    specs = {}
    for r in rows:
        s = r.get("arch_spec")
        if s:
            specs.setdefault(s if isinstance(s, str) else json.dumps(s, sort_keys=True), []).append(r.get("run_id"))
    if len(specs) > 1:
        listed = "; ".join(f"{s} (e.g. {ids[0]})" for s, ids in specs.items())
        raise FitError(f"arch {label!r} holds runs of {len(specs)} different architectures: {listed}. Give them "
                       "their own labels: hybrid-lm collect ... --label 'REGEX=LABEL' (a regex on the run id)")


def metric_columns(rows: list[dict]) -> list[str]:
    """Columns holding a number in some row, the table's fixed columns (N, D, step, ...) aside."""
    cols = dict.fromkeys(k for r in rows for k, v in r.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool))
    return [c for c in cols if c not in NON_METRIC_COLUMNS]


def _flops_per_nd(rs, setting) -> float:
    if setting not in ("auto", None):
        return float(setting)
    ks = [float(r["C"]) / (float(r["N"]) * float(r["D"])) for r in rs
          if isinstance(r.get("C"), (int, float)) and r["C"] > 0]
    return float(np.median(ks)) if ks else 6.0


def _k_source(rs, setting, k) -> str:
    if setting not in ("auto", None):
        return "given"
    has = any(isinstance(r.get("C"), (int, float)) for r in rs)
    return f"median of C/(N D) over the rows = {k:.4g}" if has else "6 (no C column)"


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o))
