"""Figures of a scaling fit (the fitting is ``fit.py``'s, the law ``law.py``'s; matplotlib is imported here only).

* ``fit.png``: the metric against D, one panel per architecture on shared axes, one colour per N
  (a discrete legend), the fitted curve of each N with its 95% bootstrap band, held-out points as
  filled red diamonds with the hold-out fit dashed, and fits a guardrail flagged marked NOT VALID.
* ``frontier.png``: left, the compute-optimal frontier L*(C) of each valid fit with the runs (solid
  within the data's compute range, dashed up to the extrapolation limit); right, iso-FLOP profiles
  L(N, C/(kN)) at three compute levels inside the data's range, N*(C) marked. Both panels share the
  metric's axis, which spans the data plus a margin.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from hybrid_lm.run.metrics import metric_label
from hybrid_lm.scaling.law import EXTRAPOLATION_LIMIT, compute_optimal, predict

HELD_OUT_COLOR = "#d62728"
BAND_LEVEL = 0.95
BAND_MIN_SAMPLES = 20  # fewer resamples with a finite curve: no band is drawn


def write_figures(doc: dict, groups: dict[str, list[dict]], out: Path, samples: dict | None = None) -> dict:
    """Both figures of a ``fit_table`` document into ``out``; ``samples`` maps an arch to its bootstrap
    parameter samples (for the bands). Returns the figure names for ``doc["figures"]``."""
    data = {a: _group_arrays(rs, doc["metric"]) for a, rs in groups.items()}
    return {"fit": plot_fits(doc, data, Path(out) / "fit.png", samples or {}).name,
            "frontier": plot_frontier(doc, data, Path(out) / "frontier.png").name}


def _group_arrays(rs, metric):
    return {"N": np.array([float(r["N"]) for r in rs]), "D": np.array([float(r["D"]) for r in rs]),
            "y": np.array([float(r[metric]) for r in rs]),
            "C": np.array([float(r["C"]) if isinstance(r.get("C"), (int, float)) else np.nan for r in rs])}


def _plt():
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)
    return plt


# ----------------------------------------------------------------------------- axes

def fmt_number(v: float) -> str:
    """Compact tick text: 2.5K, 12M, 3B, 1.5T, 1e16, 0.01, 3.2."""
    a = abs(v)
    if a >= 1e15 or 0 < a < 1e-3:
        mantissa, exponent = f"{v:.2g}".split("e")
        return f"{mantissa}e{int(exponent)}"
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if a >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


def log_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """At most ``max_ticks`` round values in [lo, hi] for a log axis: the densest of a few mantissa
    sets per decade (1-1.5-2-3-4-5-6-8 down to 1) that gives 3 to ``max_ticks`` ticks, evenly spaced
    round numbers on a range too narrow for that, every few decades on a very wide one."""
    lo, hi = min(lo, hi), max(lo, hi)
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for mantissas in ((1, 1.5, 2, 3, 4, 5, 6, 8), (1, 1.5, 2, 3, 5, 7), (1, 2, 3, 5), (1, 2, 5), (1, 3), (1,)):
        ticks = [m * 10.0 ** e for e in decades for m in mantissas]
        ticks = [float(f"{t:.6g}") for t in ticks if lo <= t * (1 + 1e-12) and t <= hi * (1 + 1e-12)]
        if len(ticks) < 3 and mantissas[0] == 1 and len(mantissas) == 8:
            break  # too narrow a range even for the densest set
        if len(ticks) <= max_ticks:
            return ticks
    else:
        return ticks[::math.ceil(len(ticks) / max_ticks)]
    raw = (hi - lo) / max(max_ticks - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):  # the finest round step giving at most max_ticks ticks
        step = m * mag
        ticks = [t * step for t in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]
        if len(ticks) <= max_ticks:
            break
    return [float(f"{t:.6g}") for t in ticks]


def set_log_axis(axis, lo: float, hi: float, max_ticks: int = 6) -> None:
    """Log scale on ``axis`` (ax.xaxis / ax.yaxis) limited to [lo, hi], with :func:`log_ticks` labelled
    by :func:`fmt_number` and no minor labels, so tick labels never collide."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator  # plots only (a slow import)

    ax = axis.axes
    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log")
    (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(lo, hi)
    axis.set_major_locator(FixedLocator(log_ticks(lo, hi, max_ticks)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt_number(v)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def padded(lo: float, hi: float, frac: float = 0.08) -> tuple[float, float]:
    """[lo, hi] widened by ``frac`` of its log span on each side (at least 2%)."""
    span = max(math.log(hi / lo), 1e-9)
    pad = max(frac * span, 0.02)
    return lo * math.exp(-pad), hi * math.exp(pad)


def size_colors(sizes) -> dict[float, tuple]:
    """One colour per distinct N, ordered by size (viridis without its palest yellow)."""
    from matplotlib import colormaps  # plots only (a slow import)
    sizes = sorted(set(float(n) for n in sizes))
    cmap = colormaps["viridis"]
    pos = np.linspace(0.0, 0.85, len(sizes)) if len(sizes) > 1 else [0.35]
    return {n: cmap(p) for n, p in zip(sizes, pos)}


def _band(samples: dict | None, n: float, Dg: np.ndarray):
    """(lo, hi) of the bootstrap predictions at (n, Dg), or None."""
    if not samples:
        return None
    E = samples.get("E")
    with np.errstate(all="ignore"):
        pred = (samples["A"][:, None] * n ** -samples["alpha"][:, None]
                + samples["B"][:, None] * Dg[None] ** -samples["beta"][:, None]
                + (0.0 if E is None else E[:, None]))
    # the band from the resamples whose whole curve is finite: percentiles over one set of curves are smooth
    # (over a different subset at each D, as where some resamples overflow, the edges jump)
    whole = pred[np.all(np.isfinite(pred) & (pred > 0), axis=1)]
    if len(whole) < BAND_MIN_SAMPLES:
        return None
    q = 100 * (1 - BAND_LEVEL) / 2
    return np.percentile(whole, q, axis=0), np.percentile(whole, 100 - q, axis=0)


def _not_valid_note(ax, entry: dict) -> None:
    reasons = entry.get("guardrails", {}).get("reasons") or []
    if entry.get("valid", True) or not reasons:
        return
    more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
    text = "NOT VALID: " + textwrap.shorten(reasons[0], 110) + more
    ax.text(0.02, 0.02, "\n".join(textwrap.wrap(text, 48)), transform=ax.transAxes, fontsize=6.5, color="#b00000",
            va="bottom", ha="left", bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#b00000", alpha=0.9), zorder=10)


# ----------------------------------------------------------------------------- fit.png

def plot_fits(doc: dict, data: dict, path: Path, samples: dict | None = None) -> Path:
    """:func:`fit_figure` written to ``path``; returns ``path``."""
    return _save(fit_figure(doc, data, samples), path)


def plot_frontier(doc: dict, data: dict, path: Path) -> Path:
    """:func:`frontier_figure` written to ``path``; returns ``path``."""
    return _save(frontier_figure(doc, data), path)


def _save(fig, path: Path) -> Path:
    from hybrid_lm.files import atomic_savefig

    try:
        atomic_savefig(fig, path, dpi=130)
    finally:
        _plt().close(fig)
    return path


def fit_figure(doc: dict, data: dict, samples: dict | None = None):
    """The metric against D per architecture (see the module docstring); returns the Figure."""
    plt = _plt()
    from matplotlib.lines import Line2D  # plots only (a slow import)
    from matplotlib.patches import Patch  # plots only (a slow import)

    samples = samples or {}
    archs = list(doc["fits"])
    ncol = min(3, len(archs))
    nrow = math.ceil(len(archs) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.7 * nrow + 0.9), squeeze=False, sharex=True,
                             sharey=True, layout="constrained")
    colors = size_colors(np.concatenate([data[a]["N"] for a in archs]))
    allD = np.concatenate([data[a]["D"] for a in archs])
    ally = np.concatenate([data[a]["y"] for a in archs])
    xlo, xhi = padded(allD.min(), allD.max(), 0.12)
    ylo, yhi = padded(ally.min(), ally.max(), 0.12)
    any_held = any_band = False
    for ax, a in zip(axes.flat, archs):
        e, d = doc["fits"][a], data[a]
        p = e["params"]
        ho = e.get("holdout") or {}
        held = set(ho.get("held_out_index", []))
        for n in np.unique(d["N"]):
            sel = d["N"] == n
            c = colors[float(n)]
            Dg = np.geomspace(max(d["D"][sel].min() / 1.3, xlo), min(d["D"][sel].max() * 1.3, xhi), 100)
            band = _band(samples.get(a), n, Dg)
            if band is not None:
                ax.fill_between(Dg, band[0], band[1], color=c, alpha=0.18, lw=0, zorder=1)
                any_band = True
            ax.plot(Dg, predict(p, n, Dg), color=c, lw=1.5, zorder=2)
            idx = np.nonzero(sel)[0]
            inn = [i for i in idx if i not in held]
            out = [i for i in idx if i in held]
            ax.scatter(d["D"][inn], d["y"][inn], color=c, s=30, edgecolors="white", linewidths=0.6, zorder=3)
            if out:
                any_held = True
                ax.plot(Dg, predict(ho["params"], n, Dg), color=HELD_OUT_COLOR, lw=1.3, ls="--", zorder=4)
                ax.scatter(d["D"][out], d["y"][out], marker="D", s=52, color=HELD_OUT_COLOR, edgecolors="black",
                           linewidths=0.8, zorder=5)
        set_log_axis(ax.xaxis, xlo, xhi)
        set_log_axis(ax.yaxis, ylo, yhi)
        t = f"{a}: α={p['alpha']:.3g}, β={p['beta']:.3g}"
        if p.get("E") is not None:
            t += f", E={p['E']:.3g}"
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3)
        _not_valid_note(ax, e)
    for ax in axes[-1]:
        ax.set_xlabel("D (tokens)")
    for ax in axes[:, 0]:
        ax.set_ylabel(metric_label(doc["metric"]))
    for ax in list(axes.flat)[len(archs):]:
        ax.axis("off")
    handles = [Line2D([], [], color=c, marker="o", lw=1.5, markeredgecolor="white", label=f"N = {fmt_number(n)}")
               for n, c in colors.items()]
    if any_band:
        handles.append(Patch(color="gray", alpha=0.3, label="95% bootstrap band"))
    if any_held:
        handles += [Line2D([], [], color=HELD_OUT_COLOR, marker="D", ls="none", markeredgecolor="black",
                           label="held out"),
                    Line2D([], [], color=HELD_OUT_COLOR, ls="--", label="hold-out fit (without them)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle(f"{doc['form']} fit of log({doc['metric']}), rows: {doc['rows']}", fontsize=10)
    return fig


# ----------------------------------------------------------------------------- frontier.png

def frontier_figure(doc: dict, data: dict):
    """Compute-optimal frontiers and iso-FLOP profiles (see the module docstring); returns the Figure."""
    plt = _plt()
    from matplotlib.lines import Line2D  # plots only (a slow import)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True, layout="constrained")
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    archs = list(doc["fits"])
    Cs = {}
    for a in archs:
        k = doc["fits"][a]["compute_optimal"]["flops_per_nd"]
        d = data[a]
        Cs[a] = np.where(np.isfinite(d["C"]), d["C"], k * d["N"] * d["D"])
    allC = np.concatenate(list(Cs.values()))
    cmin, cmax = float(allC.min()), float(allC.max())
    limit = doc.get("extrapolation_limit", EXTRAPOLATION_LIMIT)
    Cin = np.geomspace(cmin, cmax, 80)
    Cout = np.geomspace(cmax, cmax * limit, 40)
    iso = np.geomspace(cmin, cmax, 3) if cmax > cmin * 1.01 else np.array([cmax])
    styles = ["-", "--", ":"]
    yvals = [np.concatenate([data[a]["y"] for a in archs])]
    Nall = np.concatenate([data[a]["N"] for a in archs])
    nlo, nhi = Nall.min() / 4, Nall.max() * 4
    arch_handles = []
    any_frontier = False
    for i, a in enumerate(archs):
        e, d, col = doc["fits"][a], data[a], palette[i % len(palette)]
        p, co = e["params"], e["compute_optimal"]
        k = co["flops_per_nd"]
        ax1.scatter(Cs[a], d["y"], color=col, s=16, alpha=0.7, edgecolors="none", zorder=3)
        if not co.get("valid"):
            arch_handles.append(Line2D([], [], color=col, marker="o", ls="none",
                                       label=f"{a} (no frontier: fit not valid)"))
            continue
        fin, fout = compute_optimal(p, Cin, k), compute_optimal(p, Cout, k)
        ax1.plot(Cin, fin["L"], color=col, lw=1.8, zorder=4)
        ax1.plot(Cout, fout["L"], color=col, lw=1.4, ls="--", zorder=4)
        yvals += [np.asarray(fin["L"]), np.asarray(fout["L"])]
        any_frontier = True
        arch_handles.append(Line2D([], [], color=col, marker="o", lw=1.8,
                                   label=f"{a} (N* ∝ C^{co['N_opt_exponent']:.2f})"))
        for c, ls in zip(iso, styles):
            co1 = compute_optimal(p, c, k)
            lo_n, hi_n = min(nlo, float(co1["N"]) / 3), max(nhi, float(co1["N"]) * 3)
            nlo, nhi = min(nlo, lo_n), max(nhi, hi_n)
            Ng = np.geomspace(lo_n, hi_n, 160)
            ax2.plot(Ng, predict(p, Ng, c / (k * Ng)), color=col, ls=ls, lw=1.3, zorder=3)
            ax2.scatter([co1["N"]], [co1["L"]], color=col, s=28, edgecolors="black", linewidths=0.6, zorder=5)
            yvals.append(np.atleast_1d(co1["L"]))
    allv = np.concatenate(yvals)
    ylo, yhi = padded(float(allv.min()), float(allv.max()), 0.12)
    ax1.axvline(cmax, color="gray", lw=0.8, ls=":", zorder=1)
    ax1.text(cmax, yhi, "largest run ", fontsize=7, color="gray", va="top", ha="right", rotation=90)
    set_log_axis(ax1.xaxis, *padded(cmin, cmax * (limit if any_frontier else 1.0), 0.05))
    set_log_axis(ax1.yaxis, ylo, yhi)
    set_log_axis(ax2.xaxis, *padded(nlo, nhi, 0.02))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.set_ylabel(metric_label(doc["metric"]))
    ax1.set_xlabel("C (training FLOPs)")
    ax2.set_xlabel("N (parameters)")
    ax1.set_title("compute-optimal frontier L*(C) and the runs", fontsize=10)
    ax2.set_title("iso-FLOP profiles L(N, D = C / (k N))", fontsize=10)
    style_handles = [Line2D([], [], color="black", lw=1.8, label="frontier within the data"),
                     Line2D([], [], color="black", lw=1.4, ls="--",
                            label=f"extrapolated (up to {limit:g}x the largest run)")] if any_frontier else []
    below = dict(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7.5, frameon=False, ncol=2)
    ax1.legend(handles=arch_handles + style_handles, **below)
    if any_frontier:
        iso_handles = [Line2D([], [], color="black", ls=ls, lw=1.3, label=f"C = {fmt_number(c)} FLOPs")
                       for c, ls in zip(iso, styles)]
        iso_handles.append(Line2D([], [], color="gray", marker="o", ls="none", markeredgecolor="black",
                                  label="N*(C), the optimum"))
        ax2.legend(handles=iso_handles, **below)
    else:
        ax2.text(0.5, 0.5, "no valid fit: no iso-FLOP profiles", transform=ax2.transAxes, ha="center", va="center",
                 fontsize=9, color="gray")
    return fig
