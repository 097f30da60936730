"""What the scaling commands print: ``fit``'s table keeps its columns apart whatever the values, and the
next steps a sweep prints fit the form its design can identify, as ``fit`` judges it."""

import re

from hybrid_lm.scaling.cli import fit_table_lines


def _fit(n_points, E, A, B, alpha, beta, se=None, holdout=None, n_opt=0.5):
    ci = {"params": {"alpha": {"se": se[0]}, "beta": {"se": se[1]}}} if se else None
    return {"n_points": n_points, "params": {"E": E, "A": A, "B": B, "alpha": alpha, "beta": beta}, "ci": ci,
            "holdout": {"holdout": {"rmse_log": holdout}} if holdout is not None else {"skipped": "too few"},
            "compute_optimal": {"N_opt_exponent": n_opt}}


def test_the_fit_table_never_runs_two_columns_together():
    fits = {"swa8": _fit(6, None, 1.234e93, 320.1, -40.9409, 0.41, se=(32.339, 0.05), holdout=0.0107),
            "a-much-longer-arch-label-than-sixteen": _fit(125, 1.8169, 482.0, 2085.4, 0.3478, 0.3659,
                                                          se=(0.0154, 0.0206), n_opt=0.513),
            "noci": _fit(4, 2.5e-21, 12.0, 3.5e12, 25.01, 0.2)}
    lines = fit_table_lines(fits)
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    assert cells[0] == ["arch", "pts", "E", "A", "B", "alpha", "beta", "a=N* exp", "hold-out RMSE"]
    assert cells[1] == ["swa8", "6", "–", "1.234e+93", "320.1", "-40.9409 ±32.3", "0.4100 ±0.05", "0.500", "0.0107"]
    assert cells[2] == ["a-much-longer-arch-label-than-sixteen", "125", "1.817", "482", "2085", "0.3478 ±0.0154",
                        "0.3659 ±0.0206", "0.513", "skipped"]
    assert cells[3] == ["noci", "4", "2.5e-21", "12", "3.5e+12", "25.0100", "0.2000", "0.500", "skipped"]
    # the columns line up: every value ends where its header ends (the arch column starts where it starts)
    ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
    for line in lines[1:]:
        assert [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)][1:] == ends[1:]


def test_the_design_verdict_is_what_fit_says_of_the_design():
    """design_verdict (what the sweep's next steps go by) gives the reasons fit_dataset records for the same
    points, runs and bootstrap, before any loss is known."""
    import numpy as np
    import pytest

    from hybrid_lm.scaling import fit as F, guardrails as GR, fit_table as FT

    N = np.array([1e6, 1e6, 4e6, 4e6, 16e6, 16e6])  # 3 sizes x 2 budgets, one run each
    D = np.array([2e7, 4e7, 8e7, 16e7, 32e7, 64e7])
    L = 1.8 + 400 / N ** 0.34 + 2000 / D ** 0.37
    L = L * (1 + 0.003 * np.random.default_rng(0).standard_normal(6))
    runs = np.array([f"r{i}" for i in range(6)])
    for form in ("with-E", "no-E"):
        said = GR.design_verdict(N, D, runs, form)
        fitted = FT.fit_dataset(N, D, L, form=form, clusters=runs, holdout="none")["guardrails"]["reasons"]
        assert said and fitted[:len(said)] == said and "bootstrap resamples" in said[0]
        assert GR.design_verdict(N, D, runs, form, n_boot=0) == []
    assert GR.design_verdict(N[:4], D[:4], runs[:4], "with-E") is None  # 4 points, 5 parameters: refused
    with pytest.raises(F.FitError):
        FT.fit_dataset(N[:4], D[:4], L[:4], form="with-E", n_boot=0, holdout="none")
    assert GR.design_verdict(N[:4], D[:4], runs[:4], "no-E", n_boot=0)[0].startswith("4 distinct (N, D) points for 4")
    for form, n in (("with-E", 9), ("no-E", 7)):  # the fewest runs whose bootstrap fit does not flag
        assert GR.runs_for_bootstrap(form) == n
        sizes = np.repeat([1e6, 4e6, 16e6], 4)[:n]
        assert GR.design_verdict(sizes, np.arange(1, n + 1) * 1e7, np.arange(n), form) == []
        assert GR.design_verdict(sizes[:-1], np.arange(1, n) * 1e7, np.arange(n - 1), form) != []
