"""The summary of ``experiments/determinism.sh``'s runs: per model and mode (deterministic, default), whether
its two runs are bitwise equal, and its throughput against the default mode's.

    python experiments/determinism.py ROOT [MODEL...]     # the lines determinism.sh prints

ROOT holds ``<model>-<mode><i>/metrics.jsonl`` and ``<model>-<mode><i>.log`` (i = 1, 2; or the log as
``<model>-<mode><i>/train.log``, as docs/results/determinism-* keeps it). ``experiments/report.py
--determinism ROOT`` turns the same rows into ``<results>/<device>/determinism.json`` for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

MODES = ("deterministic", "default")
FROM_STEP = 20  # tokens/s: the median over the logged steps from here on (compile and warm-up excluded)


def _rows(run_dir: Path) -> list[dict]:
    from hybrid_lm.files import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]  # a torn line: skipped


def _log(root: Path, run: str) -> Path:
    """A run's whole output: beside its directory as determinism.sh writes it, or inside it as
    docs/results/determinism-* keeps it."""
    beside = root / f"{run}.log"
    return beside if beside.is_file() else root / run / "train.log"


def _compile_s(log: Path) -> float | None:
    m = re.search(r"compiled in ([0-9.]+) s", log.read_text()) if log.is_file() else None
    return float(m.group(1)) if m else None


def summary(root: Path, models: list[str] | None = None) -> list[dict]:
    """One row per model and mode: ``bitwise_equal`` (every logged loss and gradient norm of the two runs),
    ``first_difference`` (the first logged step where they differ), ``final_loss`` of each run, ``tokens_per_sec``
    (the mean of the two runs' medians over steps >= FROM_STEP), ``compile_s`` of each, ``attention`` (the
    backends the first run's rows name) and ``vs_default`` (tokens/s over the default mode's)."""
    root = Path(root)
    if models is None:
        models = sorted({p.name.rsplit("-", 1)[0] for p in root.iterdir() if p.is_dir() and "-" in p.name})
    out = []
    for model in models:
        rows = {}
        for mode in MODES:
            runs = [f"{model}-{mode}{i}" for i in (1, 2)]
            a, b = (_rows(root / r) for r in runs)
            diff = [x["step"] for x, y in zip(a, b) if (x["loss"], x["grad_norm"]) != (y["loss"], y["grad_norm"])]
            if len(a) != len(b):
                diff = diff or [min(len(a), len(b))]
            speeds = [statistics.median(r["tokens_per_sec"] for r in rs if r["step"] >= FROM_STEP) for rs in (a, b)]
            rows[mode] = {"model": model, "mode": mode, "bitwise_equal": not diff,
                          "first_difference": diff[0] if diff else None, "steps": a[-1]["step"],
                          "final_loss": [a[-1]["loss"], b[-1]["loss"]], "tokens_per_sec": statistics.mean(speeds),
                          "run_tokens_per_sec": speeds, "compile_s": [_compile_s(_log(root, r)) for r in runs],
                          "attention": a[0].get("attention_backends")}
        for mode in MODES:
            rows[mode]["vs_default"] = rows[mode]["tokens_per_sec"] / rows["default"]["tokens_per_sec"]
            out.append(rows[mode])
    return out


def lines(rows: list[dict]) -> list[str]:
    def s(x, spec):
        return "—" if x is None else format(x, spec)

    ratio = {r["model"]: r["vs_default"] for r in rows if r["mode"] == "deterministic"}
    out = []
    for r in rows:
        out.append(f"{r['model']:10s} {r['mode']:13s} bitwise equal: {str(r['bitwise_equal']):5s} first differing "
                   f"logged step: {r['first_difference'] if r['first_difference'] is not None else '-'}  loss at step "
                   f"{r['steps']}: {r['final_loss'][0]!r} / {r['final_loss'][1]!r}  median tokens/s: "
                   f"{r['run_tokens_per_sec'][0]:,.0f} / {r['run_tokens_per_sec'][1]:,.0f}  compile s: "
                   f"{s(r['compile_s'][0], '.1f')} / {s(r['compile_s'][1], '.1f')}  attention: {r['attention']}")
        if r["mode"] == "default":
            out.append(f"{r['model']:10s} deterministic / default tokens/s: {ratio[r['model']]:.3f}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python experiments/determinism.py ROOT [MODEL...]  (ROOT: determinism.sh's runs)", file=sys.stderr)
        return 2
    root = Path(argv[0])
    if not root.is_dir():
        print(f"error: {root} is not a directory of determinism.sh's runs", file=sys.stderr)
        return 2
    try:
        rows = summary(root, argv[1:] or None)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {root}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print("\n".join(lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
