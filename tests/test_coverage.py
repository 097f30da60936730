"""experiments/coverage.py: bitset reachability of stacked attention graphs."""

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.ops.attention import windowed_attention
from hybrid_lm.ops.sink_attention import sink_mask

_spec = importlib.util.spec_from_file_location("experiments_coverage",
                                               Path(__file__).parents[1] / "experiments" / "coverage.py")
C = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = C  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(C)


def _dense(R, n):
    """Bitset rows -> boolean [n, n] (row i: the tokens i has information from)."""
    return np.unpackbits(R.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)


@pytest.mark.parametrize("n,w", [(100, 2), (257, 16), (64, 64), (1000, 7), (513, 33), (50, 200)])
def test_swa_depth_to_coverage_is_exactly_ceil_n_minus_1_over_w_minus_1(n, w):
    cov = C.simulate(C.Spec(n, w, "swa"), depth=10_000)
    assert len(cov) - 1 == math.ceil((n - 1) / (w - 1)) == C.swa_depth(n, w)
    assert cov[-1] == 1.0 and cov[-2] < 1.0
    for ell, c in enumerate(cov):  # the whole curve: token i has the last min(i+1, l(w-1)+1) tokens
        assert c == pytest.approx(C.swa_coverage(n, w, ell), abs=1e-12)


def test_full_attention_covers_in_one_layer_and_the_horizon_constraint_is_the_op_mask():
    n = 300
    for pattern in ("full", "full+sa", "full+swa"):
        cov = C.simulate(C.Spec(n, 8, pattern), depth=50)
        assert cov == [n / C.causal_pairs(n), 1.0]
    for horizon, sinks in ((16, 0), (16, 4), (5, 40)):
        R = C.full_layer(C.identity_bits(n), horizon, sinks)
        np.testing.assert_array_equal(_dense(R, n), sink_mask(n, horizon, sinks))  # the attention_sink mask
    cov = C.simulate(C.Spec(n, 8, "fullH+swa", horizon=16, sinks=4), depth=200)
    assert 1 < len(cov) - 1 < C.swa_depth(n, 8)  # faster than SWA alone, not in one layer


@pytest.mark.integration
def test_one_sa_layer_reaches_exactly_what_the_model_op_attends_to():
    """The simulator's SA edges are the keys hybrid_lm/ops/attention.py gives nonzero weight, under the
    model's permutation draw (ops/permutation.py)."""
    n, w = 48, 5
    perm = C.sa_permutation(n, seed=0, sample=3, layer=2)
    assert sorted(perm) == list(range(n))
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(0.3 * rng.standard_normal((1, n, 1, 4), np.float32)) for _ in range(2))
    v = jnp.asarray(np.eye(n, dtype=np.float32)[perm][None, :, None, :])  # slot s carries one-hot(pos)
    pos = jnp.asarray(perm[None], jnp.int32)  # original positions in permuted order
    o = np.asarray(windowed_attention(q, k, v, w, positions=pos))[0, :, 0]  # [slot, position]
    visible = np.zeros((n, n), bool)
    visible[perm] = o > 0  # row: the query's original position
    R1 = _dense(C.permuted_window_or(C.identity_bits(n), perm, w), n)
    np.testing.assert_array_equal(R1, visible)
    assert visible.sum() < np.tril(np.ones((n, n))).sum() / 2  # a sparse graph, not causal attention
    # two-sided: |s_i - s_j| < w in permuted order, causal by position
    slot = np.argsort(perm)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    two = (np.abs(slot[i] - slot[j]) < w) & (j <= i)
    np.testing.assert_array_equal(_dense(C.permuted_window_or(C.identity_bits(n), perm, w, two_sided=True), n), two)


def test_sa_coverage_is_monotone_and_beats_swa_at_small_depth():
    n, w, depth = 1024, 16, 24
    cov = C.simulate(C.Spec(n, w, "sa"), depth=depth, stop_at_full=False)
    assert all(b >= a for a, b in zip(cov, cov[1:]))
    assert cov[1] < cov[2] < cov[3] < cov[4]
    # log_w n ~ 2.5 layers vs n/w ~ 68 layers: at depth 4, three draws' mean minus 6 sample standard
    # deviations is still above 0.5, and SWA's exact coverage is below half of that
    draws = [cov[4]] + [C.simulate(C.Spec(n, w, "sa"), depth=4, sample=s, stop_at_full=False)[4] for s in (1, 2)]
    assert np.mean(draws) - 6 * np.std(draws, ddof=1) > 0.5 > C.swa_coverage(n, w, 4) * 2
    # adjacent tokens (i-1, i) have no position between them: only a direct edge in some layer joins
    # them, so the U pairs that no layer's draw joins stay uncovered. E[U] = (n-1)(1-p)^24 ~ 720.
    joined = np.zeros(n - 1, bool)
    for layer in range(depth):
        slot = np.argsort(C.sa_permutation(n, seed=0, sample=0, layer=layer))
        d = slot[1:] - slot[:-1]  # key i-1 sits d slots before query i
        joined |= (d >= 1) & (d <= w - 1)
    uncovered = int((~joined).sum())
    assert (n - 1) * (1 - C.sa_adjacent_edge_prob(n, w)) ** depth > 700 and uncovered > 0
    assert cov[-1] <= 1 - uncovered / C.causal_pairs(n)  # pure SA is slow to cover everything
    mixed = C.simulate(C.Spec(n, w, "sa+swa"), depth=24)
    assert mixed[-1] == 1.0 and len(mixed) - 1 < 10


def test_window_covering_the_sequence_two_sided_is_full_attention_one_sided_is_not():
    n = 200
    two = C.simulate(C.Spec(n, n, "sa2"), depth=5)
    assert len(two) == 2 and two[1] == 1.0
    one = C.simulate(C.Spec(n, n, "sa"), depth=1, stop_at_full=False)
    # each query sees the keys before it in both orders: besides itself, the non-inversions of the draw
    perm = C.sa_permutation(n, seed=0, sample=0, layer=0)
    slot = np.argsort(perm)
    before = int(np.tril(slot[None, :] < slot[:, None], -1).sum())  # [i, j]: j < i, j's slot first
    total = C.causal_pairs(n)
    assert one[1] == (n + before) / total
    # about half: the non-inversion count of a uniform permutation has mean n(n-1)/4 and variance
    # n(n-1)(2n+5)/72 (as the inversion count); the draw is within 6 standard deviations
    mean, sd = (n + n * (n - 1) / 4) / total, math.sqrt(n * (n - 1) * (2 * n + 5) / 72) / total
    assert abs(one[1] - mean) < 6 * sd and abs(mean - 0.5) < 0.01


def test_gated_layer_is_the_union_of_sa_and_swa():
    n, w = 256, 8
    spec = C.Spec(n, w, "G")
    R = C.identity_bits(n)
    g = C.apply_layer(R, "G", 0, spec, 0)
    np.testing.assert_array_equal(g, C.apply_layer(R, "S", 0, spec, 0) | C.apply_layer(R, "W", 0, spec, 0))


def test_adjacent_edge_probability_is_exact():
    n, w = 6, 3
    hits = [0, 0]
    for perm in itertools.permutations(range(n)):
        slot = np.argsort(perm)
        d = slot[3] - slot[2]  # query 3, key 2
        hits[0] += 1 <= d <= w - 1
        hits[1] += 1 <= abs(d) <= w - 1
    total = math.factorial(n)
    assert C.sa_adjacent_edge_prob(n, w) == pytest.approx(hits[0] / total, abs=1e-15)
    assert C.sa_adjacent_edge_prob(n, w, two_sided=True) == pytest.approx(hits[1] / total, abs=1e-15)


@pytest.mark.integration
def test_driver_writes_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    assert C.main(["--n", "64", "128", "--w", "8", "--patterns", "swa", "sa", "fullH+sa", "--depth", "40",
                   "--samples", "2", "--json", str(js), "--plot", str(png), "--no-progress"]) == 0
    import json
    rows = json.loads(js.read_text())["rows"]
    assert {(r["pattern"], r["n"]) for r in rows} == {(p, n) for p in ("swa", "sa", "fullH+sa") for n in (64, 128)}
    swa = next(r for r in rows if r["pattern"] == "swa" and r["n"] == 128)
    assert swa["depth_100"] == C.swa_depth(128, 8) and len(swa["seconds"]) == 1
    assert png.stat().st_size > 10_000 and "d100" in capsys.readouterr().out
