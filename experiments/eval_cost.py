"""What the trainer's periodic evals cost, from a run's (or a study's) metrics.jsonl rows.

    python experiments/eval_cost.py docs/results/study            # every run under a study root
    python experiments/eval_cost.py runs/quickstart               # one run

Per eval: its own wall time where the row records it (``eval_s``), else the time the log interval that
holds the eval took beyond the run's median interval of the same length (the eval runs between two
logged steps, so the interval's tokens/s drops by exactly its cost). Prints each run's evals, windows and
seconds, and the evals' share of the run's training time; ``--json`` for the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a torn last line
            continue
    return out


def run_cost(run: Path) -> dict | None:
    """``{"run", "windows", "evals", "eval_s", "train_s"}`` of one run's own rows (copied rows left out)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [r for r in _rows(path) if not r.get("copied_from")]
    train = [r for r in rows if r.get("kind") == "train" and isinstance(r.get("tokens_per_sec"), (int, float))]
    evals = [r for r in rows if r.get("kind") == "eval" and r.get("step", 0) > 0]
    if len(train) < 3 or not evals:
        return None
    tokens_per_step = train[0]["tokens"] / train[0]["step"] if train[0].get("step") else None
    med = statistics.median(r["tokens_per_sec"] for r in train)
    costs = []
    for e in evals:
        if isinstance(e.get("eval_s"), (int, float)):
            costs.append(float(e["eval_s"]))
            continue
        for a, b in zip(train, train[1:]):  # the interval (a, b] whose end-of-step eval ran inside it
            if a["step"] <= e["step"] < b["step"] and tokens_per_step:
                n = (b["step"] - a["step"]) * tokens_per_step
                costs.append(max(0.0, n / b["tokens_per_sec"] - n / med))
                break
    steps = train[-1]["step"] - train[0]["step"]
    train_s = steps * tokens_per_step / med if tokens_per_step else None
    if not costs:  # only a final eval, after the last logged step
        return None
    return {"run": run.name, "windows": evals[-1].get("eval_windows"), "evals": len(costs),
            "eval_s": costs, "train_s": train_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a run directory, or a directory of runs (a sweep or study root)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.root)
    runs = [root] if (root / "metrics.jsonl").is_file() else sorted(p for p in root.iterdir() if p.is_dir())
    found = [c for c in map(run_cost, runs) if c is not None]
    if not found:
        print(f"error: no run with eval and train rows under {root}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    every = [s for c in found for s in c["eval_s"]]
    for c in found:
        share = sum(c["eval_s"]) / c["train_s"] if c["train_s"] else None
        print(f"{c['run']:<44} {c['windows']:>6} windows  {c['evals']:>2} evals  "
              f"{statistics.median(c['eval_s']):6.2f} s each (median)  "
              + (f"{100 * share:5.1f}% of training" if share is not None else ""))
    print(f"{len(every)} evals: median {statistics.median(every):.2f} s, range {min(every):.2f}-{max(every):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
