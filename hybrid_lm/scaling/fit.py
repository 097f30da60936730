"""Fit L(N, D) scaling laws: log-space Huber, multi-start from a grid, bootstrap CIs, hold-out checks.

No JAX here: numpy + scipy in float64 (the objective is ~1e-3 with delta = 1e-3, float32 is not
enough). The procedure follows Epoch AI's Chinchilla replication (Besiroglu et al. 2024,
``data_analysis.ipynb``) and thunlp's ``fit_scaling.py`` (details: docs/SCALING.md). Figures: ``plots.py``.

* **Forms.** ``with-E``: ``log L = LSE(a - alpha log N, b - beta log D, e)``, i.e.
  ``L = E + A/N^alpha + B/D^beta`` with ``A = e^a, B = e^b, E = e^e``. ``no-E``: the same without
  ``e`` (``L = A/N^alpha + B/D^beta``, thunlp's ``no_constant``; used for log LongPPL).
* **Objective.** ``sum_i Huber_delta(log L_hat_i - log L_i)`` with delta = 1e-3, **summed, never
  averaged** (a mean makes the objective n times smaller and L-BFGS-B stops early).
* **Multi-start.** Every point of a grid (Epoch's 4,500-point grid for ``with-E``, thunlp's
  1,728-point grid for ``no-E``) is refined in one vectorised batch by a Levenberg-Marquardt /
  IRLS iteration with exact gradients, with successive halving (the worse half of the starts is
  dropped every few iterations until ``survivors`` remain, which then run to convergence). The best
  ``lbfgsb_starts`` distinct minima are then refined by scipy L-BFGS-B (exact gradient, tight
  tolerances ``ftol=1e-15, gtol=1e-12``), and the best is polished by a damped Newton iteration with
  the exact Hessian until no step lowers the objective in float64. ``multistart="lbfgsb"`` instead
  runs L-BFGS-B from *every* grid point (Epoch's literal procedure; minutes instead of seconds).
* **Bounds** (optional, e.g. ``alpha in [0.2, 0.3]`` as thunlp used for log LongPPL) are honoured
  by every stage (projected steps with an active set; L-BFGS-B bounds) and reported.
* **Bootstrap.** Resample *runs* (clusters of rows sharing a ``run_id``) with replacement; refit each
  resample from the point estimate and from the other distinct minima (mode switches), by the exact
  Newton iteration run to float64 convergence (loose tolerances shrink bootstrap SEs 100-1000x; see
  docs/SCALING.md); resamples that do not converge are refitted by tight L-BFGS-B. Percentile CIs.
* **Hold-out.** Refit (full multi-start) without the largest N and report the bias, RMSE, MAE and
  worst error of the held-out predictions.
* **Guardrails.** Before fitting, :func:`check_design` refuses points that cannot identify the form
  (fewer distinct (N, D) points than free parameters, one N or one D for a free exponent) and says
  what to do; after, :func:`check_fit` flags exponents outside a plausible range, parameters at a
  bound, E collapsed to ~0, astronomical A or B and degenerate bootstrap CIs. A flagged fit has
  ``valid: false`` and the reasons, and its compute-optimal allocation is not valid either.
* **Compute-optimal allocation.** ``N*(C) = G (C/k)^a``, ``D*(C) = G^-1 (C/k)^b`` with
  ``a = beta/(alpha+beta)``, ``b = alpha/(alpha+beta)``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``
  and ``C = k N D`` (k = 6 by default, or measured from the table's FLOPs column).
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from tqdm.auto import tqdm

from hybrid_lm.progress import bar_disabled
from hybrid_lm.scaling.law import EXTRAPOLATION_LIMIT, compute_optimal, predict  # noqa: F401  (part of this API)
from hybrid_lm.scaling.plots import write_figures
from hybrid_lm.scaling.table import NON_METRIC_COLUMNS

log = logging.getLogger(__name__)

SCHEMA = "hybrid_lm.fit/2"  # 2: valid, guardrails, extrapolation per compute point
DELTA = 1e-3
PUBLIC = ("E", "A", "B", "alpha", "beta")
DERIVED = ("N_opt_exponent", "D_opt_exponent", "G")


class FitError(ValueError):
    """Data or options that cannot be fitted; the message says why."""


@dataclass(frozen=True)
class Form:
    name: str
    theta: tuple[str, ...]  # internal parameters, in order
    grid: dict  # default start grid, per internal parameter
    description: str

    @property
    def has_e(self) -> bool:
        return "e" in self.theta

    def index(self, name: str) -> int:
        return self.theta.index(name)


FORMS = {
    "with-E": Form(
        "with-E", ("a", "b", "e", "alpha", "beta"),
        # Epoch AI data_analysis.ipynb cell 18: 6 x 6 x 5 x 5 x 5 = 4,500 starts
        {"a": (0, 5, 10, 15, 20, 25), "b": (0, 5, 10, 15, 20, 25), "e": (-1, -0.5, 0, 0.5, 1),
         "alpha": (0, 0.5, 1, 1.5, 2), "beta": (0, 0.5, 1, 1.5, 2)},
        "L = E + A / N^alpha + B / D^beta"),
    "no-E": Form(
        "no-E", ("a", "b", "alpha", "beta"),
        # thunlp fit_scaling.py no_constant: 8 x 6 x 6 x 6 = 1,728 starts
        {"a": (0, 1, 2, 4, 6, 8, 10, 12), "b": (0, 1, 2, 8, 10, 12),
         "alpha": (0.1, 0.2, 0.5, 1, 1.5, 2), "beta": (0.1, 0.2, 0.5, 0.8, 1.0, 1.2)},
        "L = A / N^alpha + B / D^beta"),
}


def get_form(name: str) -> Form:
    key = {"with-e": "with-E", "no-e": "no-E", "withe": "with-E", "noe": "no-E", "default": "with-E",
           "no_constant": "no-E"}.get(name.lower().replace(" ", ""), name)
    if key not in FORMS:
        raise FitError(f"unknown form {name!r}; choose with-E or no-E")
    return FORMS[key]


# ----------------------------------------------------------------------------- parameters

def theta_to_public(form: Form, th) -> dict:
    th = np.asarray(th, float)
    p = {"E": float(math.exp(th[form.index("e")])) if form.has_e else None,
         "A": float(math.exp(th[form.index("a")])), "B": float(math.exp(th[form.index("b")])),
         "alpha": float(th[form.index("alpha")]), "beta": float(th[form.index("beta")])}
    return p


def public_array(form: Form, th: np.ndarray) -> dict[str, np.ndarray]:
    """Public parameters and derived exponents for a batch ``th [P, k]``."""
    al, be = th[:, form.index("alpha")], th[:, form.index("beta")]
    a, b = th[:, form.index("a")], th[:, form.index("b")]
    out = {"A": np.exp(a), "B": np.exp(b), "alpha": al, "beta": be}
    if form.has_e:
        out["E"] = np.exp(th[:, form.index("e")])
    with np.errstate(all="ignore"):
        s = al + be
        out["N_opt_exponent"] = be / s
        out["D_opt_exponent"] = al / s
        out["G"] = np.exp((np.log(al) + a - np.log(be) - b) / s)
    return out


def parse_bounds(spec: dict | None, form: Form) -> tuple[np.ndarray, np.ndarray, dict]:
    """Bounds on public (E, A, B, alpha, beta) or internal (a, b, e) names -> internal lo/hi arrays.

    ``spec`` maps a name to ``(lo, hi)``, either end ``None`` for open. E, A and B bounds are on the
    positive values (converted to logs).
    """
    k = len(form.theta)
    lo, hi = np.full(k, -np.inf), np.full(k, np.inf)
    clean: dict[str, list] = {}
    for name, (b_lo, b_hi) in (spec or {}).items():
        if name in ("E", "A", "B"):
            internal = name.lower()
            for v in (b_lo, b_hi):
                if v is not None and v <= 0:
                    raise FitError(f"bound on {name} must be > 0 (it is a positive coefficient), got {v}")
            conv = (None if b_lo is None else math.log(b_lo), None if b_hi is None else math.log(b_hi))
        elif name in ("a", "b", "e", "alpha", "beta"):
            internal, conv = name, (b_lo, b_hi)
        else:
            raise FitError(f"unknown parameter {name!r} in bounds; use E, A, B, alpha, beta (or a, b, e)")
        if internal not in form.theta:
            raise FitError(f"form {form.name} has no parameter {name!r}")
        if b_lo is not None and b_hi is not None and b_lo > b_hi:
            raise FitError(f"bound on {name}: lower {b_lo} > upper {b_hi}")
        j = form.index(internal)
        if conv[0] is not None:
            lo[j] = conv[0]
        if conv[1] is not None:
            hi[j] = conv[1]
        clean[name] = [b_lo, b_hi]
    return lo, hi, clean


def parse_range(text: str) -> tuple[float, float]:
    """``"0.05:1.5"`` -> ``(0.05, 1.5)``."""
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise FitError(f"range {text!r}: write LO:HI, e.g. 0.05:1.5") from None
    if not lo < hi:
        raise FitError(f"range {text!r}: LO must be < HI")
    return lo, hi


def parse_bound_args(items: list[str] | None) -> dict:
    """``["alpha=0.2:0.3", "beta=0:"]`` -> ``{"alpha": (0.2, 0.3), "beta": (0.0, None)}``."""
    out = {}
    for it in items or []:
        if "=" not in it or ":" not in it.split("=", 1)[1]:
            raise FitError(f"bound {it!r}: write NAME=LO:HI, either side may be empty (alpha=0.2:0.3, beta=0:)")
        name, rng = it.split("=", 1)
        lo_s, hi_s = rng.split(":", 1)
        try:
            out[name.strip()] = (float(lo_s) if lo_s.strip() else None, float(hi_s) if hi_s.strip() else None)
        except ValueError:
            raise FitError(f"bound {it!r}: {lo_s!r} / {hi_s!r} are not numbers") from None
    return out


# ----------------------------------------------------------------------------- objective

class HuberLogObjective:
    """Summed Huber(delta) of ``log L_hat - log y`` over points, for batches of parameter vectors.

    Weights ``W`` (``None``, ``[n]`` or ``[P, n]``) multiply each point's term: bootstrap resamples
    are integer weights. All methods take ``th [P, k]``.
    """

    def __init__(self, form: Form, N, D, y, delta: float = DELTA):
        N, D, y = (np.asarray(v, np.float64).ravel() for v in (N, D, y))
        if not (N.shape == D.shape == y.shape):
            raise FitError("N, D and the metric must have the same length")
        for name, v in (("N", N), ("D", D), ("metric", y)):
            if not np.all(np.isfinite(v)) or np.any(v <= 0):
                raise FitError(f"{name} must be finite and > 0 for a log-space fit")
        self.form, self.delta = form, float(delta)
        self.lnN, self.lnD, self.ly = np.log(N), np.log(D), np.log(y)
        self.n, self.k = len(y), len(form.theta)
        self.ia, self.ib = form.index("a"), form.index("b")
        self.ial, self.ibe = form.index("alpha"), form.index("beta")
        self.ie = form.index("e") if form.has_e else None

    # -- model
    def log_predict(self, th, lnN=None, lnD=None) -> np.ndarray:
        th = np.atleast_2d(th)
        lnN = self.lnN if lnN is None else np.asarray(lnN, float)
        lnD = self.lnD if lnD is None else np.asarray(lnD, float)
        t = self._terms(th, lnN, lnD)
        m = t.max(-1, keepdims=True)
        return m[..., 0] + np.log(np.exp(t - m).sum(-1))

    def _terms(self, th, lnN, lnD):
        P = th.shape[0]
        t1 = th[:, [self.ia]] - th[:, [self.ial]] * lnN
        t2 = th[:, [self.ib]] - th[:, [self.ibe]] * lnD
        parts = [t1, t2]
        if self.ie is not None:
            parts.append(np.broadcast_to(th[:, [self.ie]], (P, lnN.shape[-1])))
        return np.stack(parts, -1)

    def _huber(self, r):
        ar = np.abs(r)
        return np.where(ar <= self.delta, 0.5 * r * r, self.delta * (ar - 0.5 * self.delta))

    def value(self, th, W=None) -> np.ndarray:
        r = self.log_predict(th) - self.ly
        h = self._huber(r)
        return (h if W is None else W * h).sum(-1)

    def derivatives(self, th, W=None, hessian: str | None = "exact"):
        """(f [P], g [P, k], H [P, k, k]); ``hessian`` is ``exact``, ``irls`` (Gauss-Newton, PSD) or None."""
        th = np.atleast_2d(th)
        t = self._terms(th, self.lnN, self.lnD)
        m = t.max(-1, keepdims=True)
        ex = np.exp(t - m)
        s = ex.sum(-1)
        w = ex / s[..., None]
        r = m[..., 0] + np.log(s) - self.ly
        ar = np.abs(r)
        inside = ar <= self.delta
        h = np.where(inside, 0.5 * r * r, self.delta * (ar - 0.5 * self.delta))
        psi = np.clip(r, -self.delta, self.delta)
        Wb = 1.0 if W is None else W
        f = (Wb * h).sum(-1)
        psiw = Wb * psi
        P = th.shape[0]
        J = np.empty((P, self.n, self.k))
        J[..., self.ia] = w[..., 0]
        J[..., self.ib] = w[..., 1]
        J[..., self.ial] = -w[..., 0] * self.lnN
        J[..., self.ibe] = -w[..., 1] * self.lnD
        if self.ie is not None:
            J[..., self.ie] = w[..., 2]
        g = np.einsum("pn,pnj->pj", psiw, J)
        if hessian is None:
            return f, g, None
        if hessian == "irls":
            omega = Wb * np.where(inside, 1.0, self.delta / np.maximum(ar, 1e-300))
            H = np.einsum("pnj,pnl->pjl", J * omega[..., None], J)
            return f, g, H
        dpsi = Wb * inside
        H = np.einsum("pnj,pnl->pjl", J * (dpsi - psiw)[..., None], J)
        c1, c2 = psiw * w[..., 0], psiw * w[..., 1]
        H[:, self.ia, self.ia] += c1.sum(-1)
        x = -(c1 * self.lnN).sum(-1)
        H[:, self.ia, self.ial] += x
        H[:, self.ial, self.ia] += x
        H[:, self.ial, self.ial] += (c1 * self.lnN ** 2).sum(-1)
        H[:, self.ib, self.ib] += c2.sum(-1)
        x = -(c2 * self.lnD).sum(-1)
        H[:, self.ib, self.ibe] += x
        H[:, self.ibe, self.ib] += x
        H[:, self.ibe, self.ibe] += (c2 * self.lnD ** 2).sum(-1)
        if self.ie is not None:
            H[:, self.ie, self.ie] += (psiw * w[..., 2]).sum(-1)
        return f, g, H

    def scipy_fun(self, weights=None):
        """``x -> (f, grad)`` for scipy.optimize.minimize(jac=True)."""
        def fun(x):
            f, g, _ = self.derivatives(x[None], None if weights is None else weights[None], hessian=None)
            return float(f[0]), g[0]
        return fun


# ----------------------------------------------------------------------------- batched optimisers

def _free_mask(th, g, lo, hi, eps=1e-12):
    """Coordinates not held at a bound by an outward-pointing descent direction."""
    at_lo = (th <= lo + eps) & (g > 0)
    at_hi = (th >= hi - eps) & (g < 0)
    return ~(at_lo | at_hi)


def _reduce_system(H, g, free):
    """Active-set reduction: fixed coordinates get an identity row/column and a zero gradient."""
    Hr = H * free[:, :, None] * free[:, None, :]
    k = H.shape[-1]
    eye = np.eye(k)[None]
    Hr = Hr + eye * (~free)[:, :, None]
    return Hr, g * free


def newton_batch(obj: HuberLogObjective, th0, W=None, lo=None, hi=None, max_iter: int = 200,
                 max_halvings: int = 40):
    """Damped Newton with the exact Hessian (|eigenvalues|, floored), Armijo backtracking, projection
    onto bounds with an active set. Runs each problem until no step lowers its objective in float64.

    Returns (theta [P, k], f [P], converged [P]); ``converged`` is False only at ``max_iter``.
    """
    th = np.array(th0, np.float64, copy=True)
    P, k = th.shape
    lo = np.full(k, -np.inf) if lo is None else lo
    hi = np.full(k, np.inf) if hi is None else hi
    th = np.clip(th, lo, hi)
    Wfull = None if W is None else np.broadcast_to(W, (P, obj.n))
    active = np.ones(P, bool)
    f_out = obj.value(th, Wfull)
    converged = np.zeros(P, bool)
    for _ in range(max_iter):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        Wi = None if Wfull is None else Wfull[idx]
        f, g, H = obj.derivatives(th[idx], Wi, hessian="exact")
        free = _free_mask(th[idx], g, lo, hi)
        Hr, gr = _reduce_system(H, g, free)
        lam, V = np.linalg.eigh(Hr)
        lam_abs = np.abs(lam)
        floor = 1e-12 * lam_abs.max(-1, keepdims=True) + 1e-300
        lam_mod = np.maximum(lam_abs, floor)
        p = -np.einsum("pij,pj,pj->pi", V, 1.0 / lam_mod, np.einsum("pij,pi->pj", V, gr))
        p *= free
        big = np.abs(p).max(-1)
        p *= np.minimum(1.0, 10.0 / np.maximum(big, 1e-300))[:, None]  # no leap of more than 10 in a log
        gp = (gr * p).sum(-1)
        step = np.zeros(idx.size)
        f_new = f.copy()
        pending = np.ones(idx.size, bool)
        s = 1.0
        for _h in range(max_halvings):
            sub = np.nonzero(pending)[0]
            cand = np.clip(th[idx[sub]] + s * p[sub], lo, hi)
            ft = obj.value(cand, None if Wi is None else Wi[sub])
            ok = ft <= f[sub] + 1e-4 * s * np.minimum(gp[sub], 0.0)
            ok &= ft < f[sub]
            hit = sub[ok]
            step[hit], f_new[hit] = s, ft[ok]
            pending[hit] = False
            if not pending.any():
                break
            s *= 0.5
        moved = step > 0
        th[idx[moved]] = np.clip(th[idx[moved]] + step[moved, None] * p[moved], lo, hi)
        f_out[idx] = f_new
        # converged: no step lowers f, or the decrease is at float64 resolution
        done = (~moved) | ((f - f_new) <= 1e-15 * np.abs(f))
        converged[idx[done]] = True
        active[idx[done]] = False
    return th, f_out, converged


_CHUNK_ELEMS = 4e6  # starts x points x parameters per vectorised batch (~32 MB per float64 array)


class _LMBatch:
    """Levenberg-Marquardt on the IRLS (Gauss-Newton) Hessian for many starts at once."""

    def __init__(self, obj: HuberLogObjective, th0, lo, hi):
        self.obj, self.lo, self.hi = obj, lo, hi
        self.th = np.clip(np.array(th0, np.float64, copy=True), lo, hi)
        P = self.th.shape[0]
        self.mu = np.full(P, 1e-3)
        self.f = obj.value(self.th)
        self.done = np.zeros(P, bool)

    def run(self, idx: np.ndarray, iters: int, tol: float = 1e-13) -> None:
        """``iters`` iterations for the starts ``idx``, in chunks that bound memory (starts x points x k)."""
        chunk = max(8, int(_CHUNK_ELEMS // max(self.obj.n * self.obj.k, 1)))
        for c0 in range(0, len(idx), chunk):
            self._run(idx[c0:c0 + chunk], iters, tol)

    def _run(self, idx: np.ndarray, iters: int, tol: float) -> None:
        idx = idx[~self.done[idx]]
        for _ in range(iters):
            if idx.size == 0:
                return
            f, g, H = self.obj.derivatives(self.th[idx], hessian="irls")
            free = _free_mask(self.th[idx], g, self.lo, self.hi)
            Hr, gr = _reduce_system(H, g, free)
            dg = np.einsum("pjj->pj", Hr)
            A = Hr + (self.mu[idx, None] * (dg + 1e-12))[:, :, None] * np.eye(self.obj.k)[None]
            try:
                p = -np.linalg.solve(A, gr[..., None])[..., 0]
            except np.linalg.LinAlgError:
                p = -gr / np.maximum(dg, 1e-12)
            p *= free
            p *= np.minimum(1.0, 10.0 / np.maximum(np.abs(p).max(-1), 1e-300))[:, None]
            cand = np.clip(self.th[idx] + p, self.lo, self.hi)
            ft = self.obj.value(cand)
            ok = np.isfinite(ft) & (ft < f)
            self.th[idx[ok]] = cand[ok]
            self.f[idx[ok]] = ft[ok]
            self.mu[idx[ok]] = np.maximum(self.mu[idx[ok]] / 3.0, 1e-12)
            self.mu[idx[~ok]] *= 4.0
            rel = np.where(ok, (f - ft) / np.maximum(np.abs(f), 1e-300), 0.0)
            stop = (ok & (rel < tol)) | (self.mu[idx] > 1e12)
            self.done[idx[stop]] = True
            idx = idx[~stop]


def make_grid(form: Form, grid: dict | None, lo, hi) -> np.ndarray:
    g = dict(form.grid)
    for k, v in (grid or {}).items():
        if k not in form.theta:
            raise FitError(f"grid key {k!r} is not a parameter of form {form.name} ({', '.join(form.theta)})")
        g[k] = tuple(v)
    pts = np.array(list(itertools.product(*(g[name] for name in form.theta))), np.float64)
    pts = np.clip(pts, lo, hi)
    return np.unique(pts, axis=0)


def _distinct(th: np.ndarray, f: np.ndarray, limit: int, tol: float = 1e-3) -> list[int]:
    """Indices of the best ``limit`` distinct minima (sorted by f; distinct in parameter space)."""
    order = np.argsort(f, kind="stable")
    keep: list[int] = []
    for i in order:
        if not np.isfinite(f[i]):
            continue
        if all(np.max(np.abs(th[i] - th[j]) / (1.0 + np.abs(th[j]))) > tol for j in keep):
            keep.append(int(i))
        if len(keep) >= limit:
            break
    return keep


@dataclass
class PointFit:
    theta: np.ndarray
    objective: float
    minima: list  # [(objective, theta)] distinct, best first
    info: dict


def fit_point(obj: HuberLogObjective, lo, hi, grid: dict | None = None, multistart: str = "lm",
              survivors: int = 64, lbfgsb_starts: int = 8, round_iters: int = 10,
              progress: bool = False, desc: str = "fit") -> PointFit:
    """Multi-start fit of one data set (see the module docstring)."""
    t0 = time.time()
    starts = make_grid(obj.form, grid, lo, hi)
    bounds = [(None if not np.isfinite(a) else a, None if not np.isfinite(b) else b) for a, b in zip(lo, hi)]
    info = {"multistart": multistart, "grid_size": int(len(starts))}
    if multistart == "lm":
        lm = _LMBatch(obj, starts, lo, hi)
        pool = np.arange(len(starts))
        rounds = 0
        with tqdm(total=len(starts), desc=f"{desc}: grid", disable=bar_disabled(progress), leave=False) as bar:
            while True:
                lm.run(pool, round_iters)
                rounds += 1
                if len(pool) <= survivors:
                    break
                keep = max(survivors, len(pool) // 2)
                order = np.argsort(lm.f[pool], kind="stable")
                bar.update(len(pool) - keep)
                pool = pool[order[:keep]]
            lm.run(pool, 1000)
            bar.update(bar.total - bar.n)
        cand = pool[_distinct(lm.th[pool], lm.f[pool], lbfgsb_starts)] if len(pool) else pool
        cand_th = lm.th[cand]
        info.update(survivors=int(len(pool)), halving_rounds=rounds)
    elif multistart == "lbfgsb":
        fun = obj.scipy_fun()
        res_th, res_f = [], []
        for x0 in tqdm(starts, desc=f"{desc}: L-BFGS-B from every grid point", disable=bar_disabled(progress),
                       leave=False):
            r = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds)
            res_th.append(r.x)
            res_f.append(r.fun)
        res_th, res_f = np.array(res_th), np.array(res_f)
        cand_th = res_th[_distinct(res_th, res_f, lbfgsb_starts)]
    else:
        raise FitError(f"multistart={multistart!r}: choose lm or lbfgsb")
    if len(cand_th) == 0:
        raise FitError("no start gave a finite objective")
    # L-BFGS-B from the best distinct candidates, tight tolerances
    fun = obj.scipy_fun()
    refined = []
    for x0 in cand_th:
        r = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                     options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 20000, "maxfun": 50000})
        refined.append(r.x)
    refined = np.array(refined)
    # exact-Hessian polish of every candidate, to float64 convergence
    pol, pf, _ = newton_batch(obj, refined, lo=lo, hi=hi)
    keep = _distinct(pol, pf, 5)
    minima = [(float(pf[i]), pol[i].copy()) for i in keep]
    best_f, best = minima[0]
    info.update(lbfgsb_starts=int(len(cand_th)), tolerances={"ftol": 1e-15, "gtol": 1e-12},
                seconds=round(time.time() - t0, 2))
    return PointFit(theta=best, objective=best_f, minima=minima, info=info)


# ----------------------------------------------------------------------------- bootstrap

def cluster_weights(clusters: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n] integer weights: each resample draws the clusters (runs) with replacement."""
    uniq, inv = np.unique(clusters, return_inverse=True)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(uniq), size=(n_boot, len(uniq)))
    counts = np.zeros((n_boot, len(uniq)))
    np.add.at(counts, (np.arange(n_boot)[:, None], draws), 1.0)
    return counts[:, inv]


def bootstrap(obj: HuberLogObjective, point: PointFit, clusters, lo, hi, n_boot: int = 1000, seed: int = 0,
              progress: bool = False, desc: str = "bootstrap", chunk: int | None = None) -> dict:
    """Refit ``n_boot`` cluster resamples; returns thetas [n_boot, k] and bookkeeping."""
    W = cluster_weights(np.asarray(clusters), n_boot, seed)
    starts = [point.theta] + [th for _, th in point.minima[1:4]]
    chunk = chunk or max(8, int(_CHUNK_ELEMS // max(obj.n * obj.k, 1)))
    out = np.empty((n_boot, obj.k))
    fout = np.full(n_boot, np.inf)
    conv_all = np.zeros(n_boot, bool)
    bounds = [(None if not np.isfinite(a) else a, None if not np.isfinite(b) else b) for a, b in zip(lo, hi)]
    with tqdm(total=n_boot, desc=desc, disable=bar_disabled(progress), leave=False) as bar:
        for c0 in range(0, n_boot, chunk):
            sl = slice(c0, min(n_boot, c0 + chunk))
            Wc = W[sl]
            for s in starts:
                th, f, conv = newton_batch(obj, np.repeat(s[None], len(Wc), 0), Wc, lo, hi)
                better = f < fout[sl]
                out[sl][better] = th[better]
                fout[sl][better] = f[better]
                conv_all[sl][better] = conv[better]
            bar.update(len(Wc))
    n_free = int(np.sum(~(np.isfinite(lo) & np.isfinite(hi) & (lo == hi))))
    n_unidentified = unidentified_resamples(W, obj.lnN, obj.lnD, n_free)
    fallback = np.nonzero(~conv_all)[0]
    for i in fallback:
        r = minimize(obj.scipy_fun(W[i]), out[i], jac=True, method="L-BFGS-B", bounds=bounds,
                     options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 20000, "maxfun": 50000})
        if r.fun <= fout[i]:
            out[i], fout[i] = r.x, r.fun
    return {"theta": out, "objective": fout, "n_fallback": int(len(fallback)), "n_unidentified": n_unidentified,
            "seed": seed,
            "n_clusters": int(len(np.unique(clusters))), "n_boot": n_boot}


def unidentified_resamples(W: np.ndarray, N, D, n_free: int) -> int:
    """Resamples (rows of the weights ``W``) that cannot determine the parameters: they draw fewer
    distinct (N, D) points than the ``n_free`` free parameters."""
    _, point_id = np.unique(np.stack([np.asarray(N, np.float64), np.asarray(D, np.float64)], 1), axis=0,
                            return_inverse=True)
    drawn = W @ np.eye(point_id.max() + 1)[point_id.ravel()]  # [n_boot, distinct points]: draws of each
    return int(np.sum((drawn > 0).sum(1) < n_free))


def summarize_samples(samples: dict[str, np.ndarray], level: float = 0.95) -> dict:
    q = 100 * (1 - level) / 2
    out = {}
    for k, v in samples.items():
        v = np.asarray(v, float)
        v = v[np.isfinite(v)]
        if v.size < 2:
            out[k] = None
            continue
        lo, med, hi = np.percentile(v, [q, 50, 100 - q])
        out[k] = {"lo": float(lo), "hi": float(hi), "se": float(v.std(ddof=1)), "median": float(med)}
    return out


# ----------------------------------------------------------------------------- one data set


def _holdout_mask(N: np.ndarray, rule: str):
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
    obs, pred = np.asarray(obs, float), np.asarray(pred, float)
    r = np.log(obs) - np.log(pred)  # > 0: the fit under-predicts
    rel = pred / obs - 1.0
    ss_tot = float(((np.log(obs) - np.log(obs).mean()) ** 2).sum())
    w = int(np.argmax(np.abs(rel)))
    return {"n": int(obs.size), "bias_log": float(r.mean()), "rmse_log": float(np.sqrt((r ** 2).mean())),
            "mae_log": float(np.abs(r).mean()), "max_abs_log": float(np.abs(r).max()),
            "worst_rel_error": float(rel[w]), "worst_index": w,
            "r2_log": float(1.0 - (r ** 2).sum() / ss_tot) if ss_tot > 0 else None}


# ----------------------------------------------------------------------------- guardrails

EXPONENT_RANGE = (0.05, 1.5)  # plausible alpha, beta (Chinchilla ~0.34/0.37; Kaplan-like data ~0.07-0.1)
COEFFICIENT_MAX = 1e25  # A or B beyond this: the fit traded the exponent for an astronomical coefficient
E_FLOOR = 1e-3  # E below this fraction of the smallest observed value: the irreducible term collapsed
CI_MAX_RATIO = 100.0  # a 95% CI of E, A or B wider than hi/lo = 100 (two orders of magnitude)
CI_MAX_EXPONENT_WIDTH = 1.0  # a 95% CI of alpha or beta wider than this
MAX_UNIDENTIFIED = 0.1  # fraction of bootstrap resamples with fewer distinct (N, D) points than parameters


def free_parameters(form: Form, lo, hi) -> list[str]:
    """The parameters of ``form`` not fixed by a bound ``lo == hi``."""
    return [name for j, name in enumerate(form.theta) if not (np.isfinite(lo[j]) and lo[j] == hi[j])]


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


# ----------------------------------------------------------------------------- one data set

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

    # bootstrap
    samples = None
    Cdata = flops_per_nd * N * D
    cmax = float(Cdata.max())
    if compute_at is None:
        compute_at = [float(Cdata.min()), cmax, 10 * cmax, 100 * cmax]
    compute_at = [float(c) for c in compute_at]
    n_unidentified = 0
    if n_boot and n_boot > 1:
        bs = bootstrap(obj, pt, clusters, lo, hi, n_boot=n_boot, seed=seed, progress=progress,
                       desc=f"{label}: bootstrap")
        n_unidentified = bs["n_unidentified"]
        samples = public_array(form, bs["theta"])
        for c in compute_at:
            with np.errstate(all="ignore"):
                samples[f"N_opt@{c:.3g}"] = samples["G"] * (c / flops_per_nd) ** samples["N_opt_exponent"]
                samples[f"D_opt@{c:.3g}"] = (c / flops_per_nd) ** samples["D_opt_exponent"] / samples["G"]
        ci = summarize_samples(samples, level)
        entry["ci"] = {"level": level, "n_boot": n_boot, "seed": seed,
                       "resample": resample or ("run" if len(np.unique(clusters)) < len(N) else "row"),
                       "n_clusters": bs["n_clusters"], "n_fallback": bs["n_fallback"],
                       "n_unidentified": n_unidentified, "params": ci}
    else:
        entry["ci"] = None

    # guardrails: the design's, then the fitted law's
    reasons += check_fit(form, params, at_bound, y, lo, hi, entry["ci"], n_unidentified, exponent_range)
    entry["valid"] = not reasons
    entry["guardrails"] = {"reasons": reasons, "warnings": warnings, "exponent_range": list(exponent_range)}

    # compute-optimal allocation: computed where the math allows, valid only for a valid fit
    co = compute_optimal(params, compute_at, flops_per_nd)
    co_entry = {"flops_per_nd": flops_per_nd, "valid": bool(co["valid"] and not reasons), "C_max_data": cmax}
    if co["valid"]:
        co_entry.update(N_opt_exponent=co["a"], D_opt_exponent=co["b"], G=co["G"], points=[
            {"C": c, "extrapolation": c / cmax, "N": float(n), "D": float(d), "D_over_N": float(d / n),
             "L": float(l)} for c, n, d, l in zip(compute_at, co["N"], co["D"], co["L"])])
        if entry["ci"]:
            for p in co_entry["points"]:
                p["N_ci"] = entry["ci"]["params"].get(f"N_opt@{p['C']:.3g}")
                p["D_ci"] = entry["ci"]["params"].get(f"D_opt@{p['C']:.3g}")
    if not co_entry["valid"]:
        co_entry["reasons"] = ([co["reason"]] if not co["valid"] else []) + reasons
        co_entry["reason"] = "; ".join(co_entry["reasons"])
    entry["compute_optimal"] = co_entry

    # hold-out validation
    entry["holdout"] = _holdout(N, D, y, clusters, form, bounds, grid, multistart, holdout, delta, label, progress,
                                exponent_range)
    if loso:
        entry["leave_one_size_out"] = _loso(N, D, y, form, bounds, grid, multistart, delta, label, progress,
                                            exponent_range)
    entry["predictions"] = {"fitted": pred.tolist()}
    if keep_samples and samples is not None:
        entry["_samples"] = {k: samples[k] for k in PUBLIC if k in samples}
    return entry


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


def _holdout(N, D, y, clusters, form, bounds, grid, multistart, rule, delta, label, progress,
             exponent_range=EXPONENT_RANGE) -> dict:
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


def _loso(N, D, y, form, bounds, grid, multistart, delta, label, progress, exponent_range=EXPONENT_RANGE) -> list[dict]:
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
        from hybrid_lm.files import atomic_write_text
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
