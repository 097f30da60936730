"""The verdict rule: a claim part's difference of arm means against its standard error.

``d = sum_i c_i mean_seeds(arm_i.metric_i)``. Grouping the terms by arm, each run of an arm contributes
``r = sum c_i metric_i(run)`` over that arm's terms, and ``d = sum_arm mean_seeds(r_arm)``. Its variance has
two independent parts:

- **seeds**: ``sum_arm s2 / n_arm``, where ``s2`` is the seed variance of ``r`` pooled over every arm that
  has the same terms (the same metrics and coefficients) on two or more seeds (degrees of freedom
  ``sum (n - 1)``): the study's arms share one estimate of how far a seed moves a loss, so two seeds per
  arm suffice;
- **val set**: where every term carries per-window values on the same windows, ``d`` is computed window by
  window and its standard error over the windows taken (a paired difference: what the windows share
  cancels); else the terms' own errors add in quadrature (0 where a row has none).

A ``greater`` part is reproduced when ``d > k SE``, not reproduced when ``d < -k SE``, else inconclusive; a
``close`` part is reproduced when ``|d| + k SE <= margin``, not reproduced when ``|d| - k SE > margin``, else
inconclusive. A part whose numbers are missing is not evaluated. A claim is not reproduced if any part is,
reproduced if all are, else inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_EVALUATED, NOT_TESTED, REPORTED = (
    "reproduced", "not reproduced", "inconclusive", "not evaluated", "not tested at this scale", "reported")


def verdict(d: float, se: float, predict: str, k: float, margin: float) -> str:
    if predict == "greater":
        return REPRODUCED if d > k * se else NOT_REPRODUCED if d < -k * se else INCONCLUSIVE
    if abs(d) + k * se <= margin:
        return REPRODUCED
    return NOT_REPRODUCED if abs(d) - k * se > margin else INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    """A claim's verdict from its parts': not reproduced if any part is not; reproduced only when every
    part is judged and reproduced (a part still to be trained leaves the claim inconclusive)."""
    v = [x for x in verdicts if x != NOT_EVALUATED]
    if not v:
        return NOT_EVALUATED
    if NOT_REPRODUCED in v:
        return NOT_REPRODUCED
    return REPRODUCED if all(x == REPRODUCED for x in verdicts) else INCONCLUSIVE


@dataclass
class Judged:
    d: float
    se: float
    se_seed: float
    se_val: float
    seed_dof: int
    paired: bool
    per_arm: dict  # arm -> {"seeds": [...], "mean": r mean, "values": {seed: r}}


def _terms_by_arm(terms) -> dict:
    out: dict[str, list] = {}
    for c, arm, metric in terms:
        out.setdefault(arm, []).append((c, metric))
    return out


def _signature(arm_terms) -> tuple:
    """What a seed variance is pooled by: the arm's metrics and their coefficients."""
    return tuple(sorted(arm_terms))


def pooled_seed_variance(sig: tuple, values: dict) -> tuple[float | None, int]:
    """``(s2, dof)`` of ``r = sum c metric`` pooled over every arm with all of ``sig``'s metrics on two or more
    seeds. ``values[arm][seed][metric]`` is a :class:`~hybrid_lm.study.runs.Value` (or missing)."""
    ss, dof = 0.0, 0
    for arm, seeds in values.items():
        rs = []
        for by_metric in seeds.values():
            if all(by_metric.get(m) is not None for _, m in sig):
                rs.append(sum(c * by_metric[m].value for c, m in sig))
        if len(rs) >= 2:
            ss += float(np.var(rs, ddof=1)) * (len(rs) - 1)
            dof += len(rs) - 1
    return (ss / dof if dof else None), dof


def judge(terms, values: dict, seeds: dict | None = None) -> Judged | None:
    """``d`` and its standard error (the module doc) from ``values[arm][seed][metric]``; ``seeds`` (arm -> the
    seeds to use) judges a subset of them, the seed variance still pooled over all. None when a term has no
    run with all of its arm's metrics."""
    by_arm = _terms_by_arm(terms)
    d, var_seed, dof, per_arm = 0.0, 0.0, None, {}
    window_rows = []  # per arm: the seed-mean of sum c * windows, or None when not all terms have windows
    own_var = 0.0
    for arm, arm_terms in by_arm.items():
        use = (seeds or {}).get(arm)
        have = {s: v for s, v in values.get(arm, {}).items() if (use is None or s in use)
                and all(v.get(m) is not None for _, m in arm_terms)}
        if not have:
            return None
        rs = {s: sum(c * v[m].value for c, m in arm_terms) for s, v in have.items()}
        mean = float(np.mean(list(rs.values())))
        d += mean
        s2, k = pooled_seed_variance(_signature(arm_terms), values)
        var_seed += (s2 or 0.0) / len(rs)
        dof = k if dof is None else min(dof, k)
        per_arm[arm] = {"seeds": sorted(rs), "mean": mean, "values": {str(s): r for s, r in sorted(rs.items())},
                        "seed_sd": math.sqrt(s2) if s2 is not None else None, "seed_dof": k}
        wins = [[np.asarray(v[m].windows, np.float64) if v[m].windows else None for _, m in arm_terms]
                for v in have.values()]
        if all(w is not None for ws in wins for w in ws) and len({w.shape for ws in wins for w in ws}) == 1:
            window_rows.append(np.mean([sum(c * w for (c, _), w in zip(arm_terms, ws)) for ws in wins], axis=0))
        else:
            window_rows.append(None)
        for c, m in arm_terms:  # each term's own error (used where the windows cannot be paired)
            ses = [v[m].se for v in have.values()]
            if all(x is not None for x in ses):
                own_var += c * c * float(np.mean(np.square(ses))) / len(ses)
    paired = all(w is not None for w in window_rows) and len({w.shape for w in window_rows}) == 1
    if paired:
        dw = np.sum(window_rows, axis=0)
        se_val = float(np.std(dw, ddof=1) / np.sqrt(dw.size)) if dw.size > 1 else 0.0
    else:
        se_val = math.sqrt(own_var)
    se_seed = math.sqrt(var_seed)
    return Judged(d, math.sqrt(var_seed + se_val ** 2), se_seed, se_val, dof or 0, paired, per_arm)


def halves(values: dict, arms) -> tuple[dict, dict]:
    """Each arm's seeds split in two: the first half (rounded up) and the rest."""
    a, b = {}, {}
    for arm in arms:
        s = sorted(values.get(arm, {}))
        cut = (len(s) + 1) // 2
        a[arm], b[arm] = s[:cut], s[cut:]
    return a, b
