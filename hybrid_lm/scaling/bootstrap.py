"""The run bootstrap of a fit: resampled refits and the percentile intervals of fit.json's ``ci``."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from hybrid_lm.progress import bar_disabled
from hybrid_lm.scaling.fit import (Form, HuberLogObjective, PointFit, chunk_size, free_parameters, lbfgsb_tight,
                                   newton_batch, public_array, scipy_bounds)


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
    """Refit ``n_boot`` cluster resamples; returns thetas [n_boot, k] and bookkeeping.

    Resamples *runs* (clusters of rows sharing a ``run_id``) with replacement; refits each resample from
    the point estimate and from the other distinct minima (mode switches), by the exact Newton iteration
    run to float64 convergence (loose tolerances shrink bootstrap SEs 100-1000x; see docs/SCALING.md);
    resamples that do not converge are refitted by tight L-BFGS-B."""
    W = cluster_weights(np.asarray(clusters), n_boot, seed)
    starts = [point.theta] + [th for _, th in point.minima[1:4]]
    chunk = chunk or chunk_size(obj)
    out = np.empty((n_boot, obj.k))
    fout = np.full(n_boot, np.inf)
    conv_all = np.zeros(n_boot, bool)
    bounds = scipy_bounds(lo, hi)
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
    n_free = len(free_parameters(obj.form, lo, hi))
    n_unidentified = unidentified_resamples(W, obj.lnN, obj.lnD, n_free)
    fallback = np.nonzero(~conv_all)[0]
    for i in fallback:
        r = lbfgsb_tight(obj.scipy_fun(W[i]), out[i], bounds)
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
    """Percentile intervals at ``level`` of each sample array: ``{lo, hi, se, median}`` (None with
    fewer than 2 finite values)."""
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


def intervals(obj: HuberLogObjective, form: Form, point: PointFit, clusters, lo, hi, *, n_boot: int, seed: int,
              level: float, compute_at: list[float], flops_per_nd: float, resample: str | None,
              progress: bool, desc: str) -> tuple[dict, dict[str, np.ndarray]]:
    """fit.json's ``ci`` of ``point`` from ``n_boot`` resamples of the ``clusters``, and the samples
    it summarises: the public parameters, the derived exponents, and N*(C), D*(C) at each of
    ``compute_at`` (``N_opt@C``, ``D_opt@C``). ``resample`` names what was resampled (default: ``run``
    when clusters hold several rows, else ``row``)."""
    bs = bootstrap(obj, point, clusters, lo, hi, n_boot=n_boot, seed=seed, progress=progress, desc=desc)
    samples = public_array(form, bs["theta"])
    for c in compute_at:
        with np.errstate(all="ignore"):
            samples[f"N_opt@{c:.3g}"] = samples["G"] * (c / flops_per_nd) ** samples["N_opt_exponent"]
            samples[f"D_opt@{c:.3g}"] = (c / flops_per_nd) ** samples["D_opt_exponent"] / samples["G"]
    ci = {"level": level, "n_boot": n_boot, "seed": seed,
          "resample": resample or ("run" if len(np.unique(clusters)) < obj.n else "row"),
          "n_clusters": bs["n_clusters"], "n_fallback": bs["n_fallback"],
          "n_unidentified": bs["n_unidentified"], "params": summarize_samples(samples, level)}
    return ci, samples
