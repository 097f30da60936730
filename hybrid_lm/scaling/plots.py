"""Figures of a scaling fit: ``fit.png`` (metric against D per N, fitted curves, hold-out) and
``frontier.png`` (compute-optimal frontier and iso-FLOP profiles). The math is ``fit.py``'s."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hybrid_lm.scaling.fit import compute_optimal, predict


def write_figures(doc: dict, groups: dict[str, list[dict]], out: Path) -> dict:
    """Both figures of a ``fit_table`` document into ``out``; returns their names for ``doc["figures"]``."""
    data = {a: _group_arrays(rs, doc["metric"]) for a, rs in groups.items()}
    return {"fit": plot_fits(doc, data, Path(out) / "fit.png").name,
            "frontier": plot_frontier(doc, data, Path(out) / "frontier.png").name}


def _group_arrays(rs, metric):
    return {"N": np.array([float(r["N"]) for r in rs]), "D": np.array([float(r["D"]) for r in rs]),
            "y": np.array([float(r[metric]) for r in rs]),
            "C": np.array([float(r["C"]) if isinstance(r.get("C"), (int, float)) else np.nan for r in rs])}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_fits(doc: dict, data: dict, path: Path) -> Path:
    """Metric against D, one colour per N, fitted curves; held-out points hollow, hold-out fit dashed."""
    plt = _plt()
    from matplotlib import cm, colors
    archs = list(doc["fits"])
    ncol = min(3, len(archs))
    nrow = math.ceil(len(archs) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol + 1.0, 4.0 * nrow), squeeze=False,
                             layout="constrained")
    allN = np.concatenate([data[a]["N"] for a in archs])
    norm = colors.LogNorm(vmin=allN.min(), vmax=max(allN.max(), allN.min() * 1.0001))
    cmap = cm.viridis
    for ax, a in zip(axes.flat, archs):
        e, d = doc["fits"][a], data[a]
        p = e["params"]
        ho = e.get("holdout") or {}
        held = set(ho.get("held_out_index", []))
        for n in np.unique(d["N"]):
            sel = d["N"] == n
            c = cmap(norm(n))
            Dg = np.geomspace(d["D"][sel].min() / 1.5, d["D"][sel].max() * 1.5, 100)
            ax.plot(Dg, predict(p, n, Dg), color=c, lw=1.3)
            idx = np.nonzero(sel)[0]
            inn = [i for i in idx if i not in held]
            out = [i for i in idx if i in held]
            ax.scatter(d["D"][inn], d["y"][inn], color=c, s=18, zorder=3)
            if out:
                ax.scatter(d["D"][out], d["y"][out], facecolors="none", edgecolors=c, s=46, lw=1.5, zorder=4,
                           label="held out" if n == max(d["N"][list(held)]) else None)
                ax.plot(Dg, predict(ho["params"], n, Dg), color=c, lw=1.2, ls="--",
                        label="hold-out fit" if n == max(d["N"][list(held)]) else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("D (tokens)")
        ax.set_ylabel(doc["metric"])
        t = f"{a}: α={p['alpha']:.3f} β={p['beta']:.3f}"
        if p.get("E") is not None:
            t += f" E={p['E']:.3g}"
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if held:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(archs):]:
        ax.axis("off")
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=axes.ravel().tolist(), label="N (parameters)")
    fig.suptitle(f"{doc['form']} fit of {doc['metric']}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_frontier(doc: dict, data: dict, path: Path) -> Path:
    """Left: compute-optimal frontier L*(C) per architecture with the runs; right: iso-FLOP profiles."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    allC = []
    for a in doc["fits"]:
        k = doc["fits"][a]["compute_optimal"]["flops_per_nd"]
        d = data[a]
        allC.append(np.where(np.isfinite(d["C"]), d["C"], k * d["N"] * d["D"]))
    allC = np.concatenate(allC)
    Cg = np.geomspace(allC.min() / 3, allC.max() * 30, 120)
    iso = np.geomspace(allC.min(), allC.max(), 3)
    styles = ["-", "--", ":"]
    for i, a in enumerate(doc["fits"]):
        e, d, col = doc["fits"][a], data[a], colors[i % len(colors)]
        p, k = e["params"], e["compute_optimal"]["flops_per_nd"]
        C = np.where(np.isfinite(d["C"]), d["C"], k * d["N"] * d["D"])
        ax1.scatter(C, d["y"], color=col, s=10, alpha=0.5)
        co = compute_optimal(p, Cg, k)
        if co["valid"]:
            ax1.plot(Cg, co["L"], color=col, lw=1.5, label=f"{a} (a={co['a']:.2f})")
        else:
            ax1.plot([], [], color=col, label=f"{a} (no frontier: {co['reason']})")
        for c, ls in zip(iso, styles):
            co1 = compute_optimal(p, c, k)
            lo_n, hi_n = d["N"].min() / 4, d["N"].max() * 4
            if co1["valid"]:
                lo_n, hi_n = min(lo_n, float(co1["N"]) / 3), max(hi_n, float(co1["N"]) * 3)
            Ng = np.geomspace(lo_n, hi_n, 120)
            ax2.plot(Ng, predict(p, Ng, c / (k * Ng)), color=col, ls=ls, lw=1.2,
                     label=a if ls == "-" else None)
            if co1["valid"]:
                ax2.scatter([co1["N"]], [co1["L"]], color=col, s=16, zorder=3)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_ylabel(doc["metric"])
    ax1.set_xlabel("C (training FLOPs)")
    ax1.set_title("compute-optimal frontier L*(C) and the runs", fontsize=10)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("N (parameters)")
    ax2.set_title("iso-FLOP profiles, C = " + ", ".join(f"{c:.2g}" for c in iso)
                  + "\n(solid, dashed, dotted); dot = N*(C)", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
