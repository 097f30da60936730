"""A fit's hold-out checks: refits without some points and their errors on them."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from hybrid_lm.progress import bar_disabled
from hybrid_lm.scaling.fit import FitError, HuberLogObjective, fit_point, free_parameters, parse_bounds, theta_to_public
from hybrid_lm.scaling.guardrails import EXPONENT_RANGE, at_bounds, check_design, check_fit
from hybrid_lm.scaling.law import predict


def _holdout_mask(N: np.ndarray, rule: str):
    """The points ``rule`` holds out (``largest``, ``none``, ``N>V``, ``N>=V``) and the rule in words."""
    rule = (rule or "none").strip()
    if rule in ("none", "off", ""):
        return None, "none"
    if rule in ("largest", "largest-N", "largest_N", "max"):
        return N == N.max(), f"N == {N.max():.6g} (largest N)"
    for op in (">=", ">"):
        if rule.lower().startswith("n" + op):
            thr = float(rule[1 + len(op):])
            return (N >= thr if op == ">=" else N > thr), f"N {op} {thr:.6g}"
    raise FitError(f"holdout rule {rule!r}: use largest, none, N>VALUE or N>=VALUE")


def error_metrics(obs, pred) -> dict:
    """How far ``pred`` is from ``obs`` in log space (bias, RMSE, MAE, the largest error, R^2) and
    the worst relative error with its index."""
    obs, pred = np.asarray(obs, float), np.asarray(pred, float)
    r = np.log(obs) - np.log(pred)  # > 0: the fit under-predicts
    rel = pred / obs - 1.0
    ss_tot = float(((np.log(obs) - np.log(obs).mean()) ** 2).sum())
    w = int(np.argmax(np.abs(rel)))
    return {"n": int(obs.size), "bias_log": float(r.mean()), "rmse_log": float(np.sqrt((r ** 2).mean())),
            "mae_log": float(np.abs(r).mean()), "max_abs_log": float(np.abs(r).max()),
            "worst_rel_error": float(rel[w]), "worst_index": w,
            "r2_log": float(1.0 - (r ** 2).sum() / ss_tot) if ss_tot > 0 else None}


def _refit(N, D, y, form, bounds, grid, multistart, delta, label, progress, exponent_range) -> tuple[dict, dict]:
    """A multi-start fit of a subset: (public parameters, {"at_bound", "valid", "reasons"})."""
    lo, hi, _ = parse_bounds(bounds, form)
    obj = HuberLogObjective(form, N, D, y, delta)
    pt = fit_point(obj, lo, hi, grid, multistart, progress=progress, desc=label)
    params = theta_to_public(form, pt.theta)
    at_bound = at_bounds(form, pt.theta, lo, hi)
    try:
        reasons, _ = check_design(N, D, form, lo, hi, label)
    except FitError as e:
        reasons = [str(e)]
    reasons += check_fit(form, params, at_bound, y, lo, hi, exponent_range=exponent_range)
    return params, {"at_bound": at_bound, "valid": not reasons, "reasons": reasons}


def check_holdout(N, D, y, clusters, form, bounds, grid, multistart, rule, delta, label, progress,
                  exponent_range=EXPONENT_RANGE) -> dict:
    """fit.json's ``holdout``: a full multi-start refit without the points ``rule`` holds out (the largest
    N by default), with the bias, RMSE, MAE and worst error of its predictions of them."""
    mask, desc = _holdout_mask(N, rule)
    if mask is None:
        return {"skipped": "no hold-out requested", "rule": desc}
    train = ~mask
    if mask.sum() == 0:
        return {"skipped": f"no point matches the hold-out rule ({desc})", "rule": desc}
    if len(np.unique(N[train])) < 2:
        return {"skipped": f"fewer than 2 distinct N remain after holding out {desc}", "rule": desc}
    lo, hi, _ = parse_bounds(bounds, form)
    n_free = len(free_parameters(form, lo, hi))
    n_pts = len(np.unique(np.stack([N[train], D[train]], 1), axis=0))
    if n_pts < n_free:
        return {"skipped": f"{n_pts} distinct training points < {n_free} free parameters", "rule": desc}
    params, flags = _refit(N[train], D[train], y[train], form, bounds, grid, multistart, delta,
                           f"{label}: hold-out", progress, exponent_range)
    pred = predict(params, N[mask], D[mask])
    m = error_metrics(y[mask], pred)
    w = int(np.nonzero(mask)[0][m.pop("worst_index")])
    m["worst_point"] = {"N": float(N[w]), "D": float(D[w]), "observed": float(y[w]),
                        "predicted": float(predict(params, N[w], D[w]))}
    train_pred = predict(params, N[train], D[train])
    return {"rule": desc, "n_train": int(train.sum()), "n_holdout": int(mask.sum()), "params": params, **flags,
            "holdout": m, "train": {k: v for k, v in error_metrics(y[train], train_pred).items() if k != "worst_index"},
            "held_out_index": np.nonzero(mask)[0].tolist(), "predicted": pred.tolist()}


def leave_one_size_out(N, D, y, form, bounds, grid, multistart, delta, label, progress,
                       exponent_range=EXPONENT_RANGE) -> list[dict]:
    """fit.json's ``leave_one_size_out``: per model size, a refit without it and its errors on it."""
    out = []
    lo, hi, _ = parse_bounds(bounds, form)
    n_free = len(free_parameters(form, lo, hi))
    for n in tqdm(np.unique(N), desc=f"{label}: leave one size out", disable=bar_disabled(progress), leave=False):
        mask = N == n
        if len(np.unique(N[~mask])) < 2 or len(np.unique(np.stack([N[~mask], D[~mask]], 1), axis=0)) < n_free:
            continue
        params, flags = _refit(N[~mask], D[~mask], y[~mask], form, bounds, grid, multistart, delta, label, False,
                               exponent_range)
        m = error_metrics(y[mask], predict(params, N[mask], D[mask]))
        m.pop("worst_index")
        out.append({"N": float(n), **m, "alpha": params["alpha"], "beta": params["beta"], **flags})
    return out
