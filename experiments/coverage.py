"""Coverage simulator: how many layers until every token can have information from every earlier token?

    python experiments/coverage.py                                   # the docs/COVERAGE.md run
    python experiments/coverage.py --n 1024 4096 --w 16 64 --patterns swa sa sa+swa --two-sided

Stacks sampled attention graphs and propagates boolean reachability: after l layers token i "has"
token j if a chain of attention edges j -> ... -> i exists through the l layers (the residual stream
keeps what a token had, and every mask here includes the query itself). Reported per depth l: the
fraction of causal pairs (i, j <= i), diagonal included, that are reachable; and the depth to 50 /
90 / 99 / 100 % coverage, against the O(n/w) (SWA) and O(log_w n) (SA, the paper's claim)
predictions.

Layers (a pattern is a string of these letters, tiled over the depth):

- ``W`` SWA: key j visible iff ``i - w < j <= i`` (w counts the query).
- ``S`` SA, the project's mask (``hybrid_lm/ops/attention.py``): permuted slots ``s_i, s_j``, key
  visible iff ``s_i - w < s_j <= s_i`` and ``pos[j] <= pos[i]``; permutations drawn by
  ``hybrid_lm/ops/permutation.py`` from ``fold_in(key(seed), sample, layer)`` exactly as the model
  draws them from ``(seed, step, layer)``. ``--two-sided``: ``|s_i - s_j| < w`` instead (the
  variant docs/STOCHASTIC_ATTENTION.md §2 discusses: full attention when w >= n).
- ``T`` SA with the two-sided window, whatever ``--two-sided`` says.
- ``G`` gated SA + SWA in one layer (``sa_swa``): the union of an SA and a SWA graph.
- ``F`` full causal attention; ``H`` full attention under the receptive-field constraint: the last
  ``--horizon`` tokens plus ``--sinks`` first positions (``attention_sink``).

Named patterns: swa=W, sa=S, sa2=T, sa+swa=SW (1:1 interleave), sa2+swa=TW, sa_swa=G, full+sa=FS,
full+swa=FW, fullH+sa=HS, fullH+swa=HW. Any letter string is accepted too.

Reachability rows are bitsets (n x ceil(n/64) uint64). SWA / horizon windows are ORed by doubling
(log2 w passes over the matrix); SA by one pass per window offset in permuted order, masked by the
causal test (w - 1 passes; 2 (w - 1) two-sided). At n = 4096, w = 32 a SWA layer costs about 3 ms and
an SA layer about 20 ms on one CPU core.

Output: a printed table, JSON (``--json``) and a PNG (``--plot``): coverage against depth per pattern,
and depth to 99 % / full coverage against n with the n/w and log_w n lines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMED = {"swa": "W", "sa": "S", "sa2": "T", "sa+swa": "SW", "sa2+swa": "TW", "sa_swa": "G", "full+sa": "FS",
         "full+swa": "FW", "fullh+sa": "HS", "fullh+swa": "HW", "full": "F"}
LETTERS = set("WSTGFH")
THRESHOLDS = (0.5, 0.9, 0.99, 1.0)


def pattern_letters(pattern: str) -> str:
    p = NAMED.get(pattern.lower(), pattern)
    if not p or set(p) - LETTERS:
        raise ValueError(f"pattern {pattern!r}: use a name ({', '.join(NAMED)}) or letters W S T G F H")
    return p


# ----------------------------------------------------------------------------- bitset reachability

def identity_bits(n: int) -> np.ndarray:
    """R[i] = {i}: bit i of row i."""
    nw = -(-n // 64)
    R = np.zeros((n, nw), np.uint64)
    i = np.arange(n)
    R[i, i // 64] = np.left_shift(np.uint64(1), (i % 64).astype(np.uint64))
    return R


def window_or(R: np.ndarray, w: int) -> np.ndarray:
    """Row i -> OR of rows (i - w, i] (clipped at 0), by doubling: ceil(log2 w) + 1 passes."""
    n = R.shape[0]
    w = min(w, n)
    P = R.copy()
    span = 1
    while 2 * span <= w:
        P[span:] |= P[:-span].copy()  # P[i] = OR of rows [i - 2 span + 1, i]
        span *= 2
    out = P.copy()
    rest = w - span  # 0 <= rest < span: P[i - rest] covers [i - w + 1, i - rest]
    if rest:
        out[rest:] |= P[:-rest]
    return out


def prefix_or(R: np.ndarray) -> np.ndarray:
    return np.bitwise_or.accumulate(R, axis=0)


def full_layer(R: np.ndarray, horizon: int | None = None, sinks: int = 0) -> np.ndarray:
    """Full causal attention, or (horizon) the last H tokens plus the first S positions."""
    if horizon is None or horizon >= R.shape[0]:
        return prefix_or(R)
    out = window_or(R, horizon)
    if sinks:
        S = min(sinks, R.shape[0])
        ps = prefix_or(R[:S])  # row i gets sinks j <= min(i, S - 1)
        out[:S] |= ps
        out[S:] |= ps[-1]
    return out


def permuted_window_or(R: np.ndarray, perm: np.ndarray, w: int, two_sided: bool = False) -> np.ndarray:
    """SA layer: token at slot s gets the rows of slots s' in its permuted window with pos <= its own.

    ``perm[s]`` is the original position at permuted slot s (``hybrid_lm.ops.permutation``
    convention). One-sided window ``s - w < s' <= s``; two-sided ``|s - s'| < w``.
    """
    n = R.shape[0]
    Rp = R[perm]  # rows in permuted order
    acc = Rp.copy()  # offset 0: the query itself
    w = min(w, n)
    offsets = list(range(1, w)) + ([-d for d in range(1, w)] if two_sided else [])
    for d in offsets:
        if d > 0:  # key at slot s - d for queries s >= d
            ok = perm[:-d] <= perm[d:]
            np.bitwise_or(acc[d:], Rp[:-d], out=acc[d:], where=ok[:, None])
        else:  # key at slot s + |d|
            e = -d
            ok = perm[e:] <= perm[:-e]
            np.bitwise_or(acc[:-e], Rp[e:], out=acc[:-e], where=ok[:, None])
    out = np.empty_like(acc)
    out[perm] = acc  # back to original order
    return out


def sa_permutation(n: int, seed: int, sample: int, layer: int) -> np.ndarray:
    """The model's SA permutation for (seed, step=sample, layer, example 0): ``ops/permutation.py``."""
    from hybrid_lm.ops import permutation as P
    return np.asarray(P.draw_permutations(seed, sample, layer, np.zeros(1, np.int32), n)[0])


def covered_pairs(R: np.ndarray) -> int:
    """Reachable causal pairs (rows only ever hold j <= i)."""
    return int(np.bitwise_count(R).sum())


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


# ----------------------------------------------------------------------------- simulation

@dataclass
class Spec:
    n: int
    w: int
    pattern: str
    two_sided: bool = False
    horizon: int | None = None
    sinks: int = 0
    seed: int = 0


def apply_layer(R, letter: str, layer: int, spec: Spec, sample: int):
    if letter == "W":
        return window_or(R, spec.w)
    if letter == "F":
        return full_layer(R)
    if letter == "H":
        if spec.horizon is None:
            raise ValueError("pattern letter H needs --horizon")
        return full_layer(R, spec.horizon, spec.sinks)
    perm = sa_permutation(spec.n, spec.seed, sample, layer)
    sa = permuted_window_or(R, perm, spec.w, spec.two_sided or letter == "T")
    if letter in "ST":
        return sa
    if letter == "G":
        return sa | window_or(R, spec.w)
    raise ValueError(f"unknown layer letter {letter!r}")


def simulate(spec: Spec, depth: int, sample: int = 0, stop_at_full: bool = True) -> list[float]:
    """Coverage fractions after 0, 1, ..., depth layers (shorter if full coverage stops it early)."""
    letters = pattern_letters(spec.pattern)
    total = causal_pairs(spec.n)
    R = identity_bits(spec.n)
    cov = [covered_pairs(R) / total]
    for layer in range(depth):
        R = apply_layer(R, letters[layer % len(letters)], layer, spec, sample)
        c = covered_pairs(R)
        cov.append(c / total)
        if stop_at_full and c == total:
            break
    return cov


def depth_to(cov: list[float], frac: float) -> int | None:
    """First depth whose coverage reaches ``frac`` (1.0: every causal pair); None if never."""
    for ell, c in enumerate(cov):
        if c >= frac:
            return ell
    return None


def swa_depth(n: int, w: int) -> int:
    """Exact layers for SWA to cover every causal pair: the receptive field grows by w - 1 per layer."""
    return 0 if n == 1 else math.ceil((n - 1) / (w - 1)) if w > 1 else math.inf


def swa_coverage(n: int, w: int, ell: int) -> float:
    """Exact SWA coverage after ell layers: token i has the last min(i+1, ell (w-1) + 1) tokens."""
    i = np.arange(n)
    return float(np.minimum(i + 1, ell * (w - 1) + 1).sum()) / causal_pairs(n)


def log_w(n: int, w: int) -> float:
    return math.log(n) / math.log(w)


def sa_adjacent_edge_prob(n: int, w: int, two_sided: bool = False) -> float:
    """Probability that one SA layer joins two given tokens directly (key j < query i): their slots
    must lie within w - 1 of each other, the key's slot first (one-sided). Exact for a uniform draw."""
    w = min(w, n)
    pairs = sum(n - d for d in range(1, w))  # ordered slot pairs (a, b) with 1 <= b - a <= w - 1
    return (2 if two_sided else 1) * pairs / (n * (n - 1))


def sa_full_depth_estimate(n: int, w: int, two_sided: bool = False) -> float:
    """SA-only stack: adjacent tokens (i-1, i) have no intermediate position, so each needs a direct
    edge in some layer: the expected maximum of n - 1 geometric waits, ``(ln(n-1) + gamma) / -ln(1-p)``
    (independence approximation). A lower estimate of the depth to full coverage (close pairs at
    distance 2, 3, ... have few intermediates too)."""
    p = sa_adjacent_edge_prob(n, w, two_sided)
    return (math.log(n - 1) + 0.5772) / -math.log1p(-p) if p < 1 else 1.0


# ----------------------------------------------------------------------------- driver

def run(ns, ws, patterns, depth, samples, two_sided=False, horizon=None, sinks=0, seed=0, progress=True):
    from tqdm.auto import tqdm

    jobs = [(n, w, p, s) for n in ns for w in ws for p in patterns for s in range(samples)]
    results: dict[tuple, dict] = {}
    bar = tqdm(jobs, desc="coverage", disable=not progress, dynamic_ncols=True)
    for n, w, p, s in bar:
        bar.set_postfix(n=n, w=w, pattern=p, sample=s)
        letters = pattern_letters(p)
        random = bool(set(letters) & set("STG"))
        if s > 0 and not random:
            continue  # deterministic patterns need one sample
        spec = Spec(n, w, p, two_sided, horizon, sinks, seed)
        t0 = time.perf_counter()
        cov = simulate(spec, depth, sample=s)
        dt = time.perf_counter() - t0
        r = results.setdefault((n, w, p), {"n": n, "w": w, "pattern": p, "letters": letters, "random": random,
                                           "two_sided": two_sided, "horizon": horizon if "H" in letters else None,
                                           "sinks": sinks if "H" in letters else None, "samples": [],
                                           "seconds": []})
        r["samples"].append(cov)
        r["seconds"].append(round(dt, 3))
    out = []
    for r in results.values():
        L = max(len(c) for c in r["samples"])
        padded = np.array([c + [c[-1]] * (L - len(c)) for c in r["samples"]])  # full coverage stays full
        r["coverage_mean"] = padded.mean(0).round(6).tolist()
        r["coverage_min"] = padded.min(0).round(6).tolist()
        for f in THRESHOLDS:
            ds = [depth_to(c, f) for c in r["samples"]]
            key = f"depth_{int(round(100 * f))}"
            r[key] = None if any(d is None for d in ds) else float(np.mean(ds))
            r[key + "_max"] = None if any(d is None for d in ds) else int(max(ds))
        r["pred_swa_depth"] = swa_depth(r["n"], r["w"])
        r["pred_log_w_n"] = round(log_w(r["n"], r["w"]), 3)
        r["pred_sa_full_depth"] = (round(sa_full_depth_estimate(r["n"], r["w"], two_sided or r["letters"] == "T"), 1)
                                   if r["letters"] in ("S", "T") else None)
        r["max_depth"] = depth
        del r["samples"]
        out.append(r)
    return out


def print_table(rows) -> None:
    head = (f"{'pattern':<11}{'n':>6}{'w':>5}{'samples':>8}{'d50':>6}{'d90':>6}{'d99':>7}{'d100':>8}"
            f"{'log_w n':>9}{'(n-1)/(w-1)':>13}{'SA adj. est.':>13}{'cov@2':>7}{'cov@4':>7}{'s/sample':>9}")
    print(head)
    print("-" * len(head))

    def f(x):
        return "-" if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}")

    for r in rows:
        cov = r["coverage_mean"]
        d100 = f(r["depth_100"]) if r["depth_100"] is not None else f">{r['max_depth']}"
        print(f"{r['pattern']:<11}{r['n']:>6}{r['w']:>5}{len(r['seconds']):>8}{f(r['depth_50']):>6}"
              f"{f(r['depth_90']):>6}{f(r['depth_99']):>7}{d100:>8}{r['pred_log_w_n']:>9.2f}"
              f"{r['pred_swa_depth']:>13}{f(r['pred_sa_full_depth']):>13}{cov[min(2, len(cov) - 1)]:>7.3f}"
              f"{cov[min(4, len(cov) - 1)]:>7.3f}{np.mean(r['seconds']):>9.2f}")


def plot(rows, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["n"] for r in rows})
    ws = sorted({r["w"] for r in rows})
    pats = list(dict.fromkeys(r["pattern"] for r in rows))
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(pats)}
    n0, w0 = ns[-1], ws[0]

    def label(r):
        return r["pattern"] + (f" (H={r['horizon']}, S={r['sinks']})" if r["horizon"] else "")

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    ax = axes[0]
    for r in rows:
        if r["n"] == n0 and r["w"] == w0:
            cov = r["coverage_mean"]
            ax.plot(range(len(cov)), cov, ".-", color=colors[r["pattern"]], label=label(r), lw=1.8, ms=4)
    ax.axvline(log_w(n0, w0), color="k", ls=":", label=f"log_w n = {log_w(n0, w0):.2f}")
    ax.axvline(swa_depth(n0, w0), color="gray", ls="--", label=f"(n-1)/(w-1) = {swa_depth(n0, w0)}")
    ax.set_xscale("symlog", linthresh=2)
    ax.set_xlim(0, max(len(r["coverage_mean"]) for r in rows) * 1.05)
    ax.set_xlabel("depth (layers)")
    ax.set_ylabel("fraction of causal pairs (i, j<=i) reachable")
    ax.set_title(f"coverage vs depth, n={n0}, w={w0} (mean over samples)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    for p in pats:
        sub = sorted((r for r in rows if r["pattern"] == p and r["w"] == w0), key=lambda r: r["n"])
        pts = [(r["n"], r["depth_99"]) for r in sub if r["depth_99"] is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[p], label=f"{label(sub[0])}")
        pts = [(r["n"], r["depth_100"]) for r in sub if r["depth_100"] is not None]
        if pts:
            ax.plot(*zip(*pts), "s--", color=colors[p], alpha=0.55, mfc="none")
        est = [(r["n"], r["pred_sa_full_depth"]) for r in sub if r["pred_sa_full_depth"] is not None]
        if est:
            ax.plot(*zip(*est), ":", color=colors[p], lw=1.2, label=f"{p}: adjacent-pair estimate of 100%")
    xs = np.array(ns, float)
    ax.plot(xs, (xs - 1) / (w0 - 1), "k--", lw=1, label="(n-1)/(w-1)  [O(n/w)]")
    ax.plot(xs, np.log(xs) / np.log(w0), "k:", lw=1.5, label="log_w n  [O(log_w n)]")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(0.8, None)
    ax.set_xlabel("n (tokens)")
    ax.set_ylabel("depth (layers)")
    ax.set_title(f"depth to 99% (o, solid) and 100% (open squares, dashed) coverage, w={w0}")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--w", type=int, nargs="+", default=[32])
    ap.add_argument("--patterns", nargs="+", default=["swa", "sa", "sa2", "sa+swa", "full+sa", "fullH+swa", "fullH+sa"])
    ap.add_argument("--depth", type=int, default=160, help="maximum depth (stops early at full coverage)")
    ap.add_argument("--samples", type=int, default=3, help="permutation samples for patterns with SA")
    ap.add_argument("--two-sided", action="store_true", help="SA window |s_i - s_j| < w instead of one-sided")
    ap.add_argument("--horizon", type=int, default=None, help="H layers: last H tokens (default 4 w)")
    ap.add_argument("--sinks", type=int, default=4, help="H layers: sink tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="experiments/results/coverage.json")
    ap.add_argument("--plot", default="docs/coverage.png")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for p in args.patterns:
        pattern_letters(p)
    if min(args.w) < 2:
        ap.error("w must be >= 2 (w = 1 never connects two tokens)")
    horizon = args.horizon if args.horizon is not None else 4 * min(args.w)
    t0 = time.time()
    rows = run(args.n, args.w, args.patterns, args.depth, args.samples, args.two_sided, horizon, args.sinks,
               args.seed, progress=not args.no_progress)
    print_table(rows)
    wall = time.time() - t0
    mask = "two-sided" if args.two_sided else "one-sided"
    print(f"\nSA mask {mask}; H layers: horizon {horizon}, sinks {args.sinks}; wall {wall:.1f} s")
    meta = {"argv": sys.argv[1:] if argv is None else list(argv), "sa_mask": mask, "horizon": horizon,
            "sinks": args.sinks, "seed": args.seed, "max_depth": args.depth, "wall_seconds": round(wall, 1)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, Path(args.plot), f"stacked attention coverage ({mask} SA window; H = {horizon}, S = {args.sinks})")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
