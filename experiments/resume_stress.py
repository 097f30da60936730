"""Kill a training run from outside at random steps (SIGKILL / SIGTERM), resume it, and check that the
loss curve and the final state are bitwise equal to an uninterrupted run.

    .venv/bin/python experiments/resume_stress.py --points 5 --out runs/resume_stress.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TINY  # noqa: E402  (the tiny CPU config the tests use)
from resume_check import compare_runs, train_subprocess, write_gin  # noqa: E402  (test tooling)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=5, help="random kill points per signal")
    ap.add_argument("--signals", default="SIGKILL,SIGTERM")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/resume_stress.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="resume_stress_"))
    os.environ.setdefault("HYBRID_LM_DATA_DIR", str(work / "data"))
    gin = write_gin(work / "run.gin", TINY + [f"TrainConfig.steps = {args.steps}", "TrainConfig.log_every = 1",
                                              "CheckpointConfig.every_steps = 3", "CheckpointConfig.async_save = True"])
    r = train_subprocess(gin, work / "straight")
    if r["returncode"] != 0:
        print(r["output"][-3000:])
        return 1
    jobs = [(sig, rng.randint(1, args.steps - 2)) for sig in args.signals.split(",") for _ in range(args.points)]
    rows = []
    for i, (sig_name, at) in enumerate(tqdm(jobs, desc="kill + resume")):
        d = work / f"run{i}"
        t0 = time.time()
        killed = train_subprocess(gin, d, kill_at=at, sig=getattr(signal, sig_name))
        resumed = train_subprocess(gin, d)
        cmp = compare_runs(work / "straight", d)
        restarted = [l for l in resumed["output"].splitlines() if "resumed from step" in l]
        rows.append({"signal": sig_name, "kill_requested_at": at, "killed_at_step": killed["killed_at"],
                     "kill_returncode": killed["returncode"], "resumed_from": restarted[-1].split("resumed from step")[-1]
                     .strip(" )") if restarted else None, "loss_equal": cmp["loss_equal"],
                     "state_equal": cmp["state_equal"], "seconds": round(time.time() - t0, 1)})
    print(f"\n{'signal':<9}{'kill@':>7}{'resumed from':>14}{'loss bitwise':>14}{'state bitwise':>15}{'s':>7}")
    for r in rows:
        print(f"{r['signal']:<9}{str(r['killed_at_step']):>7}{str(r['resumed_from']):>14}{str(r['loss_equal']):>14}"
              f"{str(r['state_equal']):>15}{r['seconds']:>7}")
    ok = all(r["loss_equal"] and r["state_equal"] for r in rows)
    print(f"\n{sum(r['loss_equal'] and r['state_equal'] for r in rows)}/{len(rows)} kill points resumed bitwise-exactly")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "rows": rows, "all_equal": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
