"""Figures of ``hybrid-lm fit``: tick labels that never collide, a discrete legend per N (no colour
bar), bootstrap bands, shared axes, held-out points as filled red diamonds, fits a guardrail flagged
marked NOT VALID, and a frontier whose metric axis spans the data plus a margin with every line style
in a legend."""

import itertools
import math

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from hybrid_lm.scaling import fit_table as FT, law
from hybrid_lm.scaling import plots as P

TRUE = {"E": 1.7, "A": 400.0, "B": 1500.0, "alpha": 0.33, "beta": 0.30}
SIZES = (2e7, 5e7, 1.2e8, 3e8, 7e8)
GRID = {"a": (6.0,), "b": (7.0,), "e": (0.5,), "alpha": (0.3,), "beta": (0.3,)}  # one start near the truth: fast


def _rows(archs=(("full", 1.0), ("swa128", 1.015)), sizes=SIZES, ratios=(5, 10, 20, 40), noise=0.004):
    rng = np.random.default_rng(0)
    rows = []
    for arch, shift in archs:
        for n, r in itertools.product(sizes, ratios):
            loss = law.predict(TRUE, n, n * r) * shift * math.exp(rng.normal(0, noise))
            rows.append({"run_id": f"{arch}-{n:.0e}-{r}", "arch": arch, "N": n, "D": n * r, "final": 1,
                         "loss": loss, "C": 6.2 * n * n * r})
    return rows


@pytest.fixture(scope="module")
def fitted():
    rows = _rows()
    doc = FT.fit_table(rows, grid=GRID, n_boot=60, seed=0, plots=False, progress=False)
    groups = {a: [r for r in rows if r["arch"] == a] for a in doc["fits"]}
    data = {a: P._group_arrays(rs, "loss") for a, rs in groups.items()}
    samples = {}
    for a, rs in groups.items():  # the bootstrap samples the bands are drawn from
        e = FT.fit_dataset([r["N"] for r in rs], [r["D"] for r in rs], [r["loss"] for r in rs], grid=GRID,
                          clusters=[r["run_id"] for r in rs], n_boot=60, holdout="none", keep_samples=True)
        samples[a] = e["_samples"]
    return doc, data, samples


def _overlaps(boxes) -> bool:
    return any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


def _tick_boxes(fig, axis):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return [t.get_window_extent(r) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]


def test_log_ticks_are_few_round_and_inside_the_range():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lo = 10 ** rng.uniform(-3, 20)
        hi = lo * 10 ** rng.uniform(0.01, 12)
        t = P.log_ticks(lo, hi)
        assert 2 <= len(t) <= 6, (lo, hi, t)
        assert all(lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9) for x in t) and t == sorted(set(t))
        assert len({P.fmt_number(x) for x in t}) == len(t), (lo, hi, t)  # labels tell the ticks apart
    assert P.log_ticks(900, 6000) == [1000, 1500, 2000, 3000, 5000]
    assert P.log_ticks(2.4, 10.4) == [3, 4, 5, 6, 8, 10]
    assert [P.fmt_number(x) for x in (2500, 1.2e7, 3e9, 1.5e12, 1e16, 3.25)] == ["2.5K", "12M", "3B", "1.5T",
                                                                                  "1e16", "3.25"]


def test_fit_figure_legend_bands_shared_axes_and_held_out_points(fitted):
    doc, data, samples = fitted
    fig = P.fit_figure(doc, data, samples)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    assert len(fig.axes) == 2 and len(panels) == 2  # no colour bar axes
    a, b = panels
    assert a.get_shared_x_axes().joined(a, b) and a.get_shared_y_axes().joined(a, b)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:5] == ["N = 20M", "N = 50M", "N = 120M", "N = 300M", "N = 700M"]  # discrete, one per size
    assert {"95% bootstrap band", "held out", "hold-out fit (without them)"} <= set(labels)
    for ax in panels:
        bands = [c for c in ax.collections if type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection")]
        assert len(bands) == len(SIZES)
        held = [c for c in ax.collections if type(c).__name__ == "PathCollection"
                and np.allclose(c.get_facecolor()[0], to_rgba(P.HELD_OUT_COLOR))]
        (h,) = held
        assert len(h.get_offsets()) == 4 and np.allclose(h.get_edgecolor()[0], to_rgba("black"))
        assert not _overlaps(_tick_boxes(fig, ax.xaxis)) and not _overlaps(_tick_boxes(fig, ax.yaxis))
        lo, hi = ax.get_ylim()
        y = np.concatenate([d["y"] for d in data.values()])
        assert lo < y.min() and hi > y.max() and hi / lo < (y.max() / y.min()) * 1.5
    P._plt().close(fig)


def test_frontier_figure_limits_and_line_styles(fitted):
    doc, data, _ = fitted
    fig = P.frontier_figure(doc, data)
    ax1, ax2 = fig.axes
    assert ax1.get_shared_y_axes().joined(ax1, ax2)
    lo, hi = ax1.get_ylim()
    y = np.concatenate([d["y"] for d in data.values()])
    assert hi / lo < 3 * y.max() / y.min() and lo > 0.5 * y.min()  # the data plus a margin, not 1 to 1e14
    left = [t.get_text() for t in ax1.get_legend().get_texts()]
    assert left[0].startswith("full (N* ∝ C^0.") and left[1].startswith("swa128 (N* ∝ C^0.")
    assert "frontier within the data" in left and any(x.startswith("extrapolated (up to 10x") for x in left)
    right = ax2.get_legend()
    styles = {h.get_linestyle() for h in right.legend_handles if h.get_label().startswith("C = ")}
    assert len(styles) == 3  # solid, dashed, dotted: each compute level's style is named
    C = np.concatenate([6.2 * d["N"] * d["D"] for d in data.values()])
    assert ax1.get_xlim()[1] <= C.max() * law.EXTRAPOLATION_LIMIT * 2  # no further than the limit (+ a margin)
    for ax in (ax1, ax2):
        assert not _overlaps(_tick_boxes(fig, ax.xaxis)) and not _overlaps(_tick_boxes(fig, ax.yaxis))
    P._plt().close(fig)


def test_invalid_fits_are_marked_and_get_no_frontier():
    rows = _rows(archs=(("tiny", 1.0),), sizes=(2e7, 5e7), ratios=(5, 10))  # 4 points for 4 parameters
    doc = FT.fit_table(rows, form="no-E", n_boot=0, holdout="none", plots=False, progress=False)
    assert doc["fits"]["tiny"]["valid"] is False
    data = {"tiny": P._group_arrays(rows, "loss")}
    fig = P.fit_figure(doc, data)
    assert any(t.get_text().startswith("NOT VALID: 4 distinct (N, D) points") for t in fig.axes[0].texts)
    P._plt().close(fig)
    fig = P.frontier_figure(doc, data)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["tiny (no frontier: fit not valid)"]
    assert not fig.axes[0].lines[1:]  # only the largest-run marker, no frontier curve
    P._plt().close(fig)


def test_fit_table_writes_both_figures(tmp_path):
    rows = _rows(archs=(("full", 1.0),))
    doc = FT.fit_table(rows, grid=GRID, n_boot=20, out_dir=tmp_path, progress=False)
    assert doc["figures"] == {"fit": "fit.png", "frontier": "frontier.png"}
    assert (tmp_path / "fit.png").stat().st_size > 20_000 and (tmp_path / "frontier.png").stat().st_size > 20_000


def test_axis_labels_name_the_unit():
    from hybrid_lm.run.metrics import metric_label

    assert metric_label("loss") == "val loss (nats/token)" and metric_label("bpb") == "val bits/byte"
    assert metric_label("loss@8192") == "val loss (nats/token) at 8192"
    assert metric_label("loss_2T") == "val loss (nats/token) at 2T"
    assert metric_label("custom_metric") == "custom_metric"


def test_bootstrap_band_comes_from_whole_curves():
    """A resample that overflows at some D is left out of the band everywhere, so each edge is one
    percentile over one set of curves (smooth), not a different subset at each D."""
    rng = np.random.default_rng(0)
    n = 200
    samples = {"A": rng.normal(400, 5, n), "alpha": rng.normal(0.34, 0.005, n), "B": rng.normal(400, 5, n),
               "beta": rng.normal(0.28, 0.005, n), "E": rng.normal(1.7, 0.01, n)}
    Dg = np.geomspace(1e8, 1e10, 50)
    lo, hi = P._band(samples, 1e8, Dg)
    assert np.all(lo < hi) and np.all(np.diff(lo) < 0) and np.all(np.diff(hi) < 0)  # loss falls with D
    broken = {k: v.copy() for k, v in samples.items()}
    broken["B"][:30] = np.where(np.arange(30) % 2 == 0, np.inf, broken["B"][:30])  # 15 curves overflow
    blo, bhi = P._band(broken, 1e8, Dg)
    keep = np.ones(n, bool)
    keep[:30:2] = False
    ref = {k: v[keep] for k, v in samples.items()}
    np.testing.assert_allclose(np.asarray(P._band(ref, 1e8, Dg)), np.asarray((blo, bhi)))
    few = {k: v[:P.BAND_MIN_SAMPLES - 1] for k, v in samples.items()}
    assert P._band(few, 1e8, Dg) is None
