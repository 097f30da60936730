"""L(N, D) fitting: Chinchilla acceptance against Epoch AI's published refit, recovery of known
parameters (both forms), hold-out metrics, bounds, compute-optimal allocation, CLI + fit.json schema."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from hybrid_lm.scaling import fit as F, bootstrap as BS, guardrails as GR, fit_table as FT, law

REPO = Path(__file__).resolve().parents[1]
# Epoch AI's data (no licence upstream, so not in the repository): where to get it, docs/SOURCES.md section 7
CHINCHILLA_ENV = "HYBRID_LM_CHINCHILLA_CSV"

# Besiroglu et al. 2024 (Epoch AI), data_analysis.ipynb cells 25-26: estimate, bootstrap SE, 95% CI
EPOCH = {"E": (1.81686, 0.02566, (1.769, 1.871)), "A": (482.006, 124.52, (285.214, 743.626)),
         "B": (2085.434, 1293.28, (1042.357, 5810.344)), "alpha": (0.34781, 0.01540, (0.317, 0.373)),
         "beta": (0.36585, 0.02060, (0.331, 0.415))}


def _chinchilla_points():
    import csv
    path = Path(os.environ.get(CHINCHILLA_ENV) or "/nonexistent")
    if not path.is_file():
        pytest.skip(f"set {CHINCHILLA_ENV} to Epoch AI's svg_extracted_data.csv (not in the repository: no licence "
                    "upstream; docs/SOURCES.md section 7 names the file and its sha256)")
    rows = list(csv.DictReader(path.open()))
    N = np.array([float(r["Model Size"]) for r in rows])
    C = np.array([float(r["Training FLOP"]) for r in rows])
    L = np.array([float(r["loss"]) for r in rows])
    return N, C / (6 * N), L  # D = FLOP / (6 N), Epoch's cell 3


@pytest.mark.integration
def test_chinchilla_acceptance():
    """Epoch AI's procedure on their data reproduces their refit (one test: the fit is shared, and pytest-xdist
    would otherwise repeat it on every worker)."""
    N, D, L = _chinchilla_points()
    assert len(L) == 245
    keep = L < np.sort(L)[-5]  # Epoch cells 14-15: drop the 5 highest-loss runs
    dropped = np.sort(L[~keep])[::-1]
    np.testing.assert_allclose(dropped, [5.006, 4.665, 3.794, 3.766, 3.447], atol=1e-3)
    e = FT.fit_dataset(N[keep], D[keep], L[keep], form="with-E", n_boot=600, seed=42, holdout="N>1e9",
                      compute_at=[5.88e23])

    # point estimate: inside Epoch's 95% CIs, and equal to their grid fit (cell 18)
    assert e["n_points"] == 240
    p = e["params"]
    for name, (_, _, (lo, hi)) in EPOCH.items():
        assert lo <= p[name] <= hi, (name, p[name], (lo, hi))
    assert abs(p["E"] - 1.8172) < 1e-3 and abs(p["alpha"] - 0.34731) < 1e-3 and abs(p["beta"] - 0.36718) < 1e-3
    assert abs(p["A"] / 477.84 - 1) < 0.01 and abs(p["B"] / 2143.86 - 1) < 0.01
    assert abs(e["objective"] - 1.01827e-3) < 1e-8  # the summed Huber at the optimum
    a = p["beta"] / (p["alpha"] + p["beta"])
    assert abs(a - 0.513) <= 0.02
    assert abs(e["compute_optimal"]["N_opt_exponent"] - a) < 1e-12

    # bootstrap: SEs of the same order as Epoch's (loose tolerances would make them 100-1000x smaller)
    ci = e["ci"]
    assert ci["n_boot"] == 600 and ci["resample"] == "row" and ci["n_clusters"] == 240
    assert ci["n_fallback"] == 0  # every refit converged in float64
    for name, (_, se, (lo, hi)) in EPOCH.items():
        ours = ci["params"][name]
        assert se / 1.6 < ours["se"] < se * 1.6, (name, ours["se"], se)
        assert abs(ours["lo"] - lo) < 0.5 * (hi - lo) and abs(ours["hi"] - hi) < 0.5 * (hi - lo), (name, ours)
    assert 0.012 < ci["params"]["N_opt_exponent"]["se"] < 0.03  # Epoch: a = 0.513, SE 0.020

    # compute-optimal allocation at Chinchilla's compute: ~18 tokens/parameter from Epoch's estimate
    pt = e["compute_optimal"]["points"][0]
    assert pt["C"] == 5.88e23 and 14 < pt["D_over_N"] < 23
    assert pt["N_ci"]["lo"] < pt["N"] < pt["N_ci"]["hi"]

    # fit on N <= 1e9, predict N > 1e9 (scaling_eval.md A.3): bias +0.0045, log RMSE 0.0124, worst ~4.7%
    h = e["holdout"]
    assert h["n_train"] == 118 and h["n_holdout"] == 122
    assert abs(h["holdout"]["bias_log"] - 0.0045) < 0.001
    assert abs(h["holdout"]["rmse_log"] - 0.0124) < 0.001
    assert 0.035 < abs(h["holdout"]["worst_rel_error"]) < 0.055


# ----------------------------------------------------------------------------- synthetic data

TRUE = {"E": 1.7, "A": 400.0, "B": 1500.0, "alpha": 0.33, "beta": 0.30}


def _synthetic(params, noise=0.0, seed=0, sizes=(2e7, 5e7, 1.2e8, 3e8, 7e8, 1.5e9), ratios=(5, 10, 20, 40, 80)):
    N, D = np.meshgrid(np.array(sizes), np.array(ratios), indexing="ij")
    N, D = N.ravel(), (N * D).ravel()
    L = law.predict(params, N, D)
    if noise:
        L = L * np.exp(np.random.default_rng(seed).normal(0, noise, L.shape))
    return N, D, L


@pytest.mark.parametrize("form", ["with-E", "no-E"])
def test_noiseless_synthetic_recovers_parameters(form):
    true = dict(TRUE) if form == "with-E" else {**TRUE, "E": None, "A": 30.0, "B": 80.0, "alpha": 0.25, "beta": 0.35}
    N, D, L = _synthetic(true)
    e = FT.fit_dataset(N, D, L, form=form, n_boot=0, holdout="largest")
    for k, v in true.items():
        if v is None:
            assert e["params"][k] is None
        else:
            assert e["params"][k] == pytest.approx(v, rel=2e-4), (k, e["params"][k], v)
    assert e["objective"] < 1e-12
    # hold-out of the largest N on exact data: predicted exactly
    h = e["holdout"]
    assert h["n_holdout"] == 5 and h["holdout"]["rmse_log"] < 1e-5 and abs(h["holdout"]["bias_log"]) < 1e-5


def test_noisy_synthetic_parameters_inside_bootstrap_cis():
    N, D, L = _synthetic(TRUE, noise=0.004, seed=1)
    e = FT.fit_dataset(N, D, L, form="with-E", n_boot=300, seed=3, holdout="none")
    ci = e["ci"]["params"]
    for k, v in TRUE.items():
        assert ci[k]["lo"] <= v <= ci[k]["hi"], (k, v, ci[k])
    assert ci["alpha"]["hi"] - ci["alpha"]["lo"] < 0.2  # informative, not degenerate
    assert 0.003 < e["residuals"]["rmse_log"] < 0.006
    assert e["holdout"]["skipped"]


@pytest.mark.integration
def test_holdout_metrics_measure_a_shifted_largest_size():
    N, D, L = _synthetic(TRUE)
    big = N == N.max()
    L = np.where(big, L * 1.02, L)  # the largest model does 2% worse than the law
    e = FT.fit_dataset(N, D, L, form="with-E", n_boot=0, holdout="largest")
    m = e["holdout"]["holdout"]
    assert m["n"] == big.sum()
    assert m["bias_log"] == pytest.approx(math.log(1.02), abs=2e-4)  # observed above prediction
    assert m["rmse_log"] == pytest.approx(math.log(1.02), abs=2e-4)
    assert m["worst_rel_error"] == pytest.approx(1 / 1.02 - 1, abs=3e-4)  # predicted / observed - 1
    assert m["worst_point"]["N"] == N.max()
    # N>=VALUE rule and a rule that leaves one size: skipped with a reason
    assert FT.fit_dataset(N, D, L, n_boot=0, holdout="N>=3e8")["holdout"]["n_holdout"] == 15
    assert "fewer than 2" in FT.fit_dataset(N, D, L, n_boot=0, holdout="N>2.5e7")["holdout"]["skipped"]


def test_bounds_are_honoured_and_reported():
    true = {"E": None, "A": 30.0, "B": 80.0, "alpha": 0.35, "beta": 0.35}
    N, D, L = _synthetic(true)
    e = FT.fit_dataset(N, D, L, form="no-E", bounds={"alpha": (0.2, 0.3), "beta": (0.0, None)}, n_boot=20,
                      holdout="none")
    assert e["params"]["alpha"] == pytest.approx(0.3, abs=1e-9)
    assert e["at_bound"] == ["alpha"] and e["bounds"] == {"alpha": [0.2, 0.3], "beta": [0.0, None]}
    assert all(0.2 - 1e-12 <= m["params"]["alpha"] <= 0.3 + 1e-12 for m in e["minima"])
    assert 0.2 - 1e-12 <= e["ci"]["params"]["alpha"]["lo"] and e["ci"]["params"]["alpha"]["hi"] <= 0.3 + 1e-12
    with pytest.raises(F.FitError, match="must be > 0"):
        F.parse_bounds({"A": (0, 10)}, F.get_form("no-E"))
    with pytest.raises(F.FitError, match="no parameter"):
        F.parse_bounds({"E": (1, 2)}, F.get_form("no-E"))
    assert F.parse_bound_args(["alpha=0.2:0.3", "beta=0:"]) == {"alpha": (0.2, 0.3), "beta": (0.0, None)}


@pytest.mark.integration  # a whole model across the mixers
def test_vectorised_multistart_agrees_with_lbfgsb_from_every_start():
    N, D, L = _synthetic(TRUE, noise=0.003, seed=5, sizes=(3e7, 1e8, 4e8, 1.2e9), ratios=(5, 20, 80))
    grid = {"a": (5, 15), "b": (5, 15), "e": (0, 1), "alpha": (0.2, 1.0), "beta": (0.2, 1.0)}
    lo, hi, _ = F.parse_bounds(None, F.get_form("with-E"))
    obj = F.HuberLogObjective(F.get_form("with-E"), N, D, L)
    a = F.fit_point(obj, lo, hi, grid=grid, multistart="lm")
    b = F.fit_point(obj, lo, hi, grid=grid, multistart="lbfgsb")
    assert a.info["grid_size"] == b.info["grid_size"] == 32
    assert a.objective == pytest.approx(b.objective, rel=1e-9)
    np.testing.assert_allclose(a.theta, b.theta, rtol=1e-5, atol=1e-6)
    # the optimum is stationary at the resolution of the objective: no Newton step could lower f by more
    # than f's own float64 rounding noise. Each point's Huber term carries |psi| <= delta times the
    # rounding of r = log L_hat - log y (a few eps of 1 + |log y|), so sigma_f <= n delta 8 eps (1 + |log y|).
    # (An absolute bound on |g| is not portable: what remains, up to sqrt(2 lambda_max sigma_f), depends
    # on the CPU's rounding.)
    _, g, H = obj.derivatives(a.theta[None])
    assert np.all(np.linalg.eigvalsh(H[0]) > 0)  # a strict minimum
    sigma_f = obj.n * obj.delta * 8 * np.finfo(np.float64).eps * (1 + np.abs(obj.ly).max())
    assert 0.5 * g[0] @ np.linalg.solve(H[0], g[0]) <= sigma_f


def test_bootstrap_refits_are_true_minima_and_resample_whole_runs():
    N, D, L = _synthetic(TRUE, noise=0.004, seed=2)
    clusters = np.repeat(np.arange(len(N) // 5), 5)  # 5 rows per "run"
    W = BS.cluster_weights(clusters, 50, seed=0)
    for c in np.unique(clusters):
        rows = W[:, clusters == c]
        assert np.all(rows == rows[:, :1])  # a run's rows are drawn together
    assert np.all(W.sum(1) == len(N))
    form = F.get_form("with-E")
    obj = F.HuberLogObjective(form, N, D, L)
    lo, hi, _ = F.parse_bounds(None, form)
    pt = F.fit_point(obj, lo, hi)
    bs = BS.bootstrap(obj, pt, clusters, lo, hi, n_boot=40, seed=1)
    Wb = BS.cluster_weights(clusters, 40, seed=1)
    at_point = obj.value(np.repeat(pt.theta[None], 40, 0), Wb)
    assert np.all(bs["objective"] <= at_point * (1 + 1e-12))  # each refit beats the point estimate on its data
    assert np.mean(bs["objective"] < at_point * (1 - 1e-6)) > 0.9  # and actually moved
    _, g, _ = obj.derivatives(bs["theta"], Wb)
    assert np.abs(g).max() < 1e-8
    assert bs["n_clusters"] == len(N) // 5


def test_compute_optimal_matches_numerical_minimum():
    k = 6.0
    for C in (1e20, 1e23):
        co = law.compute_optimal(TRUE, C, k)
        res = minimize_scalar(lambda x, C=C: law.predict(TRUE, math.exp(x), C / (k * math.exp(x))), bounds=(10, 35),
                              method="bounded", options={"xatol": 1e-10})
        assert co["N"] == pytest.approx(math.exp(res.x), rel=1e-4)
        assert co["N"] * co["D"] * k == pytest.approx(C, rel=1e-12)
        assert co["L"] == pytest.approx(res.fun, rel=1e-10)
    assert law.compute_optimal({**TRUE, "beta": -0.1}, 1e20)["valid"] is False


@pytest.mark.integration
def test_no_jax_in_fitting_code():
    code = ("import sys; import hybrid_lm.scaling.fit_table, hybrid_lm.scaling.table, hybrid_lm.scaling.report; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.') or m == 'flax']; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- CLI, fit.json schema, report

def _write_two_arch_table(path: Path):
    from hybrid_lm.scaling.table import write_table
    rows = []
    for arch, shift in (("full", 1.0), ("swa128", 1.015)):
        N, D, L = _synthetic(TRUE, noise=0.003, seed=7 if arch == "full" else 8)
        for i, (n, d, l) in enumerate(zip(N, D, L * shift)):
            rows.append({"run_id": f"{arch}-{i}", "arch": arch, "scale": f"s{i // 5}", "N": int(n), "D": int(d),
                         "final": 1, "loss": float(l), "C": 6.2 * n * d})
        rows.append({"run_id": f"{arch}-partial", "arch": arch, "scale": "s0", "N": int(N[0]), "D": int(D[0]) // 2,
                     "final": 0, "loss": 9.9, "C": None})
    write_table(rows, path)


@pytest.mark.integration
def test_fit_cli_writes_schema_figures_and_report(tmp_path):
    table = tmp_path / "table.csv"
    _write_two_arch_table(table)
    out = tmp_path / "fit"
    cli = [sys.executable, "-m", "hybrid_lm.cli"]
    r = subprocess.run(cli + ["fit", str(table), "--out", str(out), "--bootstrap", "100", "--seed", "1",
                              "--compute", "1e21,1e23"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "swa128" in r.stdout and "full" in r.stdout
    doc = json.loads((out / "fit.json").read_text())
    assert doc["schema"] == FT.SCHEMA and doc["form"] == "with-E" and doc["metric"] == "loss"
    assert doc["dropped_rows"]["not_final"] == 2 and doc["compute_at"] == [1e21, 1e23]
    assert set(doc["fits"]) == {"full", "swa128"}
    for e in doc["fits"].values():
        assert set(e["params"]) == {"E", "A", "B", "alpha", "beta"}
        assert e["n_points"] == 30 and e["n_runs"] == 30 and e["n_sizes"] == 6
        assert set(e["ci"]["params"]) >= {"E", "A", "B", "alpha", "beta", "N_opt_exponent", "D_opt_exponent"}
        assert e["holdout"]["n_holdout"] == 5 and set(e["holdout"]["holdout"]) >= {"bias_log", "rmse_log",
                                                                                   "worst_rel_error", "r2_log"}
        co = e["compute_optimal"]
        assert co["flops_per_nd"] == pytest.approx(6.2) and len(co["points"]) == 2
        assert e["params"]["alpha"] == pytest.approx(TRUE["alpha"], abs=0.05)
    # swa128's losses are the same law x 1.015: its frontier lies above full's by about that much
    ratio = (doc["fits"]["swa128"]["compute_optimal"]["points"][0]["L"]
             / doc["fits"]["full"]["compute_optimal"]["points"][0]["L"])
    assert 1.005 < ratio < 1.025
    assert (out / "fit.png").stat().st_size > 10_000 and (out / "frontier.png").stat().st_size > 10_000
    r = subprocess.run(cli + ["report", str(out)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = (out / "report.md").read_text()
    assert "| parameter | full | swa128 |" in rep and "![frontier](frontier.png)" in rep
    assert "Hold-out validation" in rep and "Compute-optimal allocation" in rep
    # no-E with a bound, and a clear error for a missing metric column
    r = subprocess.run(cli + ["fit", str(table), "--form", "no-E", "--bound", "alpha=0.2:0.3", "--bootstrap", "0",
                              "--arch", "full", "--no-plots", "--out", str(tmp_path / "noe")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    e = json.loads((tmp_path / "noe" / "fit.json").read_text())["fits"]["full"]
    assert e["form"] == "no-E" and e["params"]["E"] is None and 0.2 <= e["params"]["alpha"] <= 0.3
    r = subprocess.run(cli + ["fit", str(table), "--metric", "log_longppl"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "metric column 'log_longppl' is not in the table" in r.stderr


# ----------------------------------------------------------------------------- guardrails

# the shipped tiny sweep's four final swa8 rows (configs/sweeps/tiny_cpu.toml on the CPU): N, D, loss
TINY_ROWS = [(4688, 1152, 5.091552019119263), (4688, 2304, 4.5951666831970215),
             (10488, 2560, 4.1049017906188965), (10488, 5248, 3.2543529272079468)]


def test_design_guardrails_refuse_what_cannot_be_identified_and_say_what_to_do():
    N, D, L = (np.array(c, float) for c in zip(*TINY_ROWS))
    with pytest.raises(F.FitError, match=r"4 distinct \(N, D\) points cannot determine the 5 free parameters of "
                                         r"with-E.*more D/N budgets or scales.*--form no-E.*--bound"):
        FT.fit_dataset(N, D, L, form="with-E", n_boot=0, holdout="none")
    with pytest.raises(F.FitError, match="one model size"):
        FT.fit_dataset(np.full(4, 1e8), D, L, form="no-E", n_boot=0, holdout="none")
    with pytest.raises(F.FitError, match="one token count"):
        FT.fit_dataset(np.geomspace(1e7, 1e9, 6), np.full(6, 1e10), np.linspace(4, 3, 6), form="no-E", n_boot=0,
                      holdout="none")
    # a parameter fixed by a bound is not free: 4 free parameters on 4 points are flagged, not refused
    e = FT.fit_dataset(N, D, L, form="with-E", bounds={"E": (1.0, 1.0)}, n_boot=0, holdout="none")
    assert e["free_parameters"] == ["a", "b", "alpha", "beta"] and e["at_bound"] == []
    assert e["valid"] is False and "no degree of freedom is left" in e["guardrails"]["reasons"][0]
    # the same duplicated rows (one point listed twice) do not count as new points
    with pytest.raises(F.FitError, match="4 distinct"):
        FT.fit_dataset(np.r_[N, N], np.r_[D, D], np.r_[L, L], form="with-E", n_boot=0, holdout="none")


def test_guardrails_fire_on_the_tiny_sweeps_exploding_fit():
    """The issue's case: no-E on the tiny sweep's 4 points gave alpha 25.7 and A ~ 1e94 with CIs and
    compute_optimal.valid True. Now every problem is named and nothing downstream may use the fit."""
    N, D, L = (np.array(c, float) for c in zip(*TINY_ROWS))
    e = FT.fit_dataset(N, D, L, form="no-E", n_boot=200, seed=0, holdout="none", clusters=np.arange(4))
    assert e["params"]["alpha"] > 10 and e["params"]["A"] > 1e50  # the degenerate optimum itself is unchanged
    reasons = e["guardrails"]["reasons"]
    for pattern in (r"4 distinct \(N, D\) points for 4 free parameters: no degree of freedom is left",
                    r"alpha = 2\d\.\d+ is outside the plausible range \(0.05, 1.5\)",
                    r"A = .*e\+\d\d is astronomically large",
                    r"bootstrap resamples .* drew fewer distinct \(N, D\) points than the 4 free parameters"):
        assert any(re.search(pattern, r) for r in reasons), (pattern, reasons)
    assert e["valid"] is False and e["compute_optimal"]["valid"] is False
    assert e["compute_optimal"]["reasons"] == reasons and "no degree of freedom" in e["compute_optimal"]["reason"]
    assert e["ci"]["n_unidentified"] > 150


def test_guardrails_stay_quiet_on_a_well_conditioned_fit():
    N, D, L = _synthetic(TRUE, noise=0.004, seed=1)
    e = FT.fit_dataset(N, D, L, form="with-E", n_boot=100, seed=3, holdout="largest")
    assert e["valid"] is True and e["guardrails"] == {"reasons": [], "warnings": [], "exponent_range": [0.05, 1.5]}
    assert e["compute_optimal"]["valid"] is True and "reasons" not in e["compute_optimal"]
    assert e["ci"]["n_unidentified"] == 0 and e["holdout"]["valid"] is True and e["holdout"]["at_bound"] == []
    pts = e["compute_optimal"]["points"]
    assert pts[1]["extrapolation"] == pytest.approx(1.0) and pts[3]["extrapolation"] == pytest.approx(100.0)


def test_guardrails_collapsed_E_exponent_range_and_bounds():
    # pure power-law data fitted with an E: the irreducible term collapses to ~0
    power = {"E": None, "A": 30.0, "B": 80.0, "alpha": 0.25, "beta": 0.35}
    N, D, L = _synthetic(power)
    e = FT.fit_dataset(N, D, L, form="with-E", n_boot=0, holdout="none")
    assert any("collapsed to ~0" in r for r in e["guardrails"]["reasons"]), (e["params"], e["guardrails"])
    # an exponent outside the range the caller calls plausible
    N, D, L = _synthetic(TRUE)
    e = FT.fit_dataset(N, D, L, n_boot=0, holdout="none", exponent_range=(0.4, 1.5))
    assert [r.split(" is ")[0] for r in e["guardrails"]["reasons"]] == ["alpha = 0.33", "beta = 0.3"]
    # a parameter held at a bound is reported everywhere: the fit, its hold-out and leave-one-size-out refits
    true = {"E": None, "A": 30.0, "B": 80.0, "alpha": 0.35, "beta": 0.35}
    N, D, L = _synthetic(true)
    e = FT.fit_dataset(N, D, L, form="no-E", bounds={"alpha": (0.2, 0.3)}, n_boot=0, holdout="largest", loso=True)
    assert e["at_bound"] == ["alpha"] and e["valid"] is False
    assert any(r.startswith("alpha = 0.3 sits on its bound") for r in e["guardrails"]["reasons"])
    assert e["holdout"]["at_bound"] == ["alpha"] and e["holdout"]["valid"] is False
    assert e["leave_one_size_out"] and all(r["at_bound"] == ["alpha"] for r in e["leave_one_size_out"])


def test_degenerate_bootstrap_cis_are_flagged():
    form = F.get_form("with-E")
    lo, hi, _ = F.parse_bounds(None, form)
    params = {"E": 1.7, "A": 400.0, "B": 1500.0, "alpha": 0.33, "beta": 0.30}

    def ci(**over):
        base = {k: {"lo": v * 0.9, "hi": v * 1.1, "se": 0.05 * v, "median": v} for k, v in params.items()}
        base.update(over)
        return {"n_boot": 100, "n_clusters": 30, "params": base}

    assert GR.check_fit(form, params, [], [3.0], lo, hi, ci()) == []
    wide = GR.check_fit(form, params, [], [3.0], lo, hi, ci(B={"lo": 10.0, "hi": 1e5, "se": 1.0, "median": 1500.0}))
    assert wide == ["the 95% CI of B [10, 1e+05] spans 4.0 orders of magnitude"]
    flat = GR.check_fit(form, params, [], [3.0], lo, hi, ci(alpha={"lo": 0.33, "hi": 0.33, "se": 0, "median": 0.33}))
    assert flat == ["the bootstrap CI of alpha has zero width: the resamples never moved the fit"]
    assert "wider than 1" in GR.check_fit(form, params, [], [3.0], lo, hi,
                                         ci(beta={"lo": 0.01, "hi": 1.4, "se": 0.3, "median": 0.3}))[0]
    assert "not meaningful" in GR.check_fit(form, params, [], [3.0], lo, hi, ci(), n_unidentified=40)[0]


def test_report_ranks_valid_fits_only_and_labels_extrapolation():
    from hybrid_lm.scaling.report import ranking

    def fit(valid, Ls, cmax=1e20):
        co = {"valid": valid, "C_max_data": cmax, "flops_per_nd": 6.0}
        if valid:
            co["points"] = [{"C": c, "L": L} for c, L in zip((1e18, 1e20, 1e21, 1e22), Ls)]
        return {"compute_optimal": co}

    doc = {"metric": "loss", "compute_at": [1e18, 1e20, 1e21, 1e22], "extrapolation_limit": 10.0,
           "fits": {"full": fit(True, (4, 3, 2.5, 2.2)), "swa": fit(True, (4, 3.1, 2.4, 2.0)),
                    "broken": fit(False, None)}}
    lines = ranking(doc)
    assert lines[0] == ("Predicted compute-optimal loss at C = 1e+21, **extrapolated 10x beyond the largest run** "
                        "(best first): swa 2.4, full 2.5")
    assert "Not ranked (fit not valid): broken." in lines
    assert any(x.startswith("Not ranked at C = 1e+22: more than 10x beyond the largest run") for x in lines)
    doc["compute_at"] = [1e18, 1e20]
    for f in doc["fits"].values():
        f["compute_optimal"].get("points", [None, None])[2:] = []
    assert "**within the data**" in ranking(doc)[0] and "swa 3.1" not in ranking(doc)[0].split(": ")[0]
    doc["fits"]["swa"] = fit(False, None)
    assert ranking(doc)[-1] == "No ranking: 1 valid fit(s), a ranking needs 2."
