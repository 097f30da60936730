"""A fit's guardrails: whether a design can identify a form before fitting, and the reasons a fitted
law is not trustworthy after."""

from __future__ import annotations

import math

import numpy as np

from hybrid_lm.scaling.bootstrap import cluster_weights, unidentified_resamples
from hybrid_lm.scaling.fit import FORMS, FitError, Form, free_parameters, get_form, parse_bounds

EXPONENT_RANGE = (0.05, 1.5)  # plausible alpha, beta (Chinchilla ~0.34/0.37; Kaplan-like data ~0.07-0.1)
COEFFICIENT_MAX = 1e25  # A or B beyond this: the fit traded the exponent for an astronomical coefficient
E_FLOOR = 1e-3  # E below this fraction of the smallest observed value: the irreducible term collapsed
CI_MAX_RATIO = 100.0  # a 95% CI of E, A or B wider than hi/lo = 100 (two orders of magnitude)
CI_MAX_EXPONENT_WIDTH = 1.0  # a 95% CI of alpha or beta wider than this
MAX_UNIDENTIFIED = 0.1  # fraction of bootstrap resamples with fewer distinct (N, D) points than parameters


def check_design(N, D, form: Form, lo, hi, label: str = "fit") -> tuple[list[str], list[str]]:
    """Whether the points can identify ``form``'s free parameters, before fitting.

    Raises :class:`FitError` (saying what to do) when they cannot: fewer distinct (N, D) points than
    free parameters, or a single N or D for a free exponent. Returns (reasons the fit will not be
    valid, warnings): as many points as parameters leaves no degree of freedom.
    """
    free = free_parameters(form, lo, hi)
    pts = len(np.unique(np.stack([N, D], 1), axis=0))
    n_N, n_D = len(np.unique(N)), len(np.unique(D))
    if len(free) > pts:
        todo = ["train more runs (more D/N budgets or scales in the sweep)"]
        if form.has_e and pts >= len(FORMS["no-E"].theta):
            todo.append("fit --form no-E (4 parameters; on 4 points it is marked not valid)")
        todo.append("fix parameters with --bound NAME=V:V (e.g. --bound alpha=0.3:0.3)")
        raise FitError(f"{label}: {pts} distinct (N, D) points cannot determine the {len(free)} free parameters "
                       f"of {form.name} ({', '.join(free)}); " + "; or ".join(todo))
    if "alpha" in free and n_N < 2:
        raise FitError(f"{label}: one model size (N = {N[0]:.4g}) cannot determine alpha; train at least 2 sizes "
                       "(3 or more to test the form), or fix alpha with --bound alpha=V:V")
    if "beta" in free and n_D < 2:
        raise FitError(f"{label}: one token count (D = {D[0]:.4g}) cannot determine beta; train at least 2 budgets, "
                       "or fix beta with --bound beta=V:V")
    reasons, warnings = [], []
    if len(free) == pts:
        reasons.append(f"{pts} distinct (N, D) points for {len(free)} free parameters: no degree of freedom is left, "
                       "so nothing tests the form (train more runs)")
    if "alpha" in free and n_N == 2:
        warnings.append("2 model sizes: alpha rests on one ratio of sizes; 3 or more test the form in N")
    return reasons, warnings


def check_fit(form: Form, params: dict, at_bound: list[str], y, lo, hi, ci: dict | None = None,
              n_unidentified: int = 0, exponent_range=EXPONENT_RANGE) -> list[str]:
    """Reasons a fitted law is not trustworthy (empty: none found): free exponents outside
    ``exponent_range``, parameters at a bound, E collapsed to ~0, astronomical A or B, and bootstrap
    CIs that are degenerate (zero width, spanning orders of magnitude, or from resamples that cannot
    determine the parameters)."""
    free = set(free_parameters(form, lo, hi))
    reasons = []
    lo_x, hi_x = exponent_range
    for name in ("alpha", "beta"):
        v = params[name]
        if name in free and not lo_x < v < hi_x:
            reasons.append(f"{name} = {v:.4g} is outside the plausible range ({lo_x:g}, {hi_x:g})")
    for name in at_bound:
        pub = {"a": "A", "b": "B", "e": "E"}.get(name, name)
        reasons.append(f"{pub} = {params[pub]:.4g} sits on its bound: the bound, not the data, sets it")
    if form.has_e and "e" in free and params["E"] < E_FLOOR * float(np.min(y)):
        reasons.append(f"E = {params['E']:.3g} collapsed to ~0 (below {E_FLOOR:g} x the smallest observed value "
                       f"{float(np.min(y)):.4g}): the data do not determine the irreducible term")
    for name, internal in (("A", "a"), ("B", "b")):
        if internal in free and params[name] > COEFFICIENT_MAX:
            reasons.append(f"{name} = {params[name]:.3g} is astronomically large (> {COEFFICIENT_MAX:.0e})")
    if ci:
        p = ci["params"]
        n = ci["n_boot"]
        if n_unidentified > MAX_UNIDENTIFIED * n:
            reasons.append(_unidentified_reason(n_unidentified, n, len(free), ci["n_clusters"]))
        for name, internal in (("E", "e"), ("A", "a"), ("B", "b"), ("alpha", "alpha"), ("beta", "beta")):
            c = p.get(name)
            if internal not in free or not c:
                continue
            width = c["hi"] - c["lo"]
            if width <= 1e-9 * max(abs(c["median"]), 1e-300):
                reasons.append(f"the bootstrap CI of {name} has zero width: the resamples never moved the fit")
            elif name in ("E", "A", "B") and c["lo"] > 0 and c["hi"] / c["lo"] > CI_MAX_RATIO:
                reasons.append(f"the 95% CI of {name} [{c['lo']:.3g}, {c['hi']:.3g}] spans "
                               f"{math.log10(c['hi'] / c['lo']):.1f} orders of magnitude")
            elif name in ("alpha", "beta") and width > CI_MAX_EXPONENT_WIDTH:
                reasons.append(f"the 95% CI of {name} [{c['lo']:.3g}, {c['hi']:.3g}] is wider than "
                               f"{CI_MAX_EXPONENT_WIDTH:g}")
    return reasons


def _unidentified_reason(k: int, n: int, n_free: int, n_runs: int) -> str:
    return (f"{k} of {n} bootstrap resamples ({k / n:.0%}) drew fewer distinct (N, D) points than the {n_free} "
            f"free parameters (only {n_runs} runs to resample): the CIs are not meaningful")


def design_verdict(N, D, clusters, form: str, n_boot: int = 1000, seed: int = 0) -> list[str] | None:
    """What ``fit`` (no bounds, ``n_boot`` resamples with ``seed``: its defaults) will say of a design
    before any loss is known: None if it refuses ``form`` on these points, else the reasons it will mark
    the fit not valid whatever the losses (empty: none). The laws it fits can add reasons of their own."""
    f = get_form(form)
    N, D = np.asarray(N, np.float64), np.asarray(D, np.float64)
    lo, hi, _ = parse_bounds(None, f)
    try:
        reasons, _ = check_design(N, D, f, lo, hi)
    except FitError:
        return None
    if n_boot and n_boot > 1:
        n_free = len(free_parameters(f, lo, hi))
        k = unidentified_resamples(cluster_weights(np.asarray(clusters), n_boot, seed), N, D, n_free)
        if k > MAX_UNIDENTIFIED * n_boot:
            reasons.append(_unidentified_reason(k, n_boot, n_free, len(np.unique(clusters))))
    return reasons


def runs_for_bootstrap(form: str, n_boot: int = 1000, seed: int = 0) -> int:
    """The fewest runs, each at its own (N, D), whose run bootstrap ``fit`` does not flag for ``form``."""
    n_free = len(get_form(form).theta)
    n = n_free + 1
    while unidentified_resamples(cluster_weights(np.arange(n), n_boot, seed), np.arange(n), np.ones(n),
                                 n_free) > MAX_UNIDENTIFIED * n_boot:
        n += 1
    return n


def at_bounds(form: Form, theta, lo, hi) -> list[str]:
    """Free parameters (internal names) that ended on a bound; parameters fixed by ``lo == hi`` aside."""
    free = set(free_parameters(form, lo, hi))
    return [name for j, name in enumerate(form.theta) if name in free
            and ((np.isfinite(lo[j]) and abs(theta[j] - lo[j]) < 1e-9)
                 or (np.isfinite(hi[j]) and abs(theta[j] - hi[j]) < 1e-9))]
