"""The L(N, D) law forms and their fit to one data set: log-space Huber, multi-start from a grid.

No JAX here: numpy + scipy in float64 (the objective is ~1e-3 with delta = 1e-3, float32 is not
enough). The procedure follows Epoch AI's Chinchilla replication (Besiroglu et al. 2024,
``data_analysis.ipynb``) and thunlp's ``fit_scaling.py`` (details: docs/SCALING.md). The bootstrap is
``bootstrap.py``'s, the hold-out checks ``holdout.py``'s, the guardrails ``guardrails.py``'s, fit.json
``fit_table.py``'s, the figures ``plots.py``'s.

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
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from tqdm.auto import tqdm

from hybrid_lm.progress import bar_disabled

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


def free_parameters(form: Form, lo, hi) -> list[str]:
    """The parameters of ``form`` not fixed by a bound ``lo == hi``."""
    return [name for j, name in enumerate(form.theta) if not (np.isfinite(lo[j]) and lo[j] == hi[j])]


def scipy_bounds(lo, hi) -> list[tuple]:
    """``lo``, ``hi`` as scipy's bounds (None for an open end)."""
    return [(None if not np.isfinite(a) else a, None if not np.isfinite(b) else b) for a, b in zip(lo, hi)]


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


CHUNK_ELEMS = 4e6  # starts x points x parameters per vectorised batch (~32 MB per float64 array)
TIGHT = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 20000, "maxfun": 50000}  # L-BFGS-B's refinement


def chunk_size(obj: HuberLogObjective) -> int:
    """Problems per vectorised batch: ``CHUNK_ELEMS`` bounds problems x points x parameters."""
    return max(8, int(CHUNK_ELEMS // max(obj.n * obj.k, 1)))


def lbfgsb_tight(fun, x0, bounds):
    """scipy L-BFGS-B from ``x0`` with ``fun``'s exact gradient and the tight tolerances ``TIGHT``."""
    return minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds, options=TIGHT)


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
        chunk = chunk_size(self.obj)
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
    bounds = scipy_bounds(lo, hi)
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
        refined.append(lbfgsb_tight(fun, x0, bounds).x)
    refined = np.array(refined)
    # exact-Hessian polish of every candidate, to float64 convergence
    pol, pf, _ = newton_batch(obj, refined, lo=lo, hi=hi)
    keep = _distinct(pol, pf, 5)
    minima = [(float(pf[i]), pol[i].copy()) for i in keep]
    best_f, best = minima[0]
    info.update(lbfgsb_starts=int(len(cand_th)), tolerances={k: TIGHT[k] for k in ("ftol", "gtol")},
                seconds=round(time.time() - t0, 2))
    return PointFit(theta=best, objective=best_f, minima=minima, info=info)
