#!/usr/bin/env python
"""Random faults against a short CPU training run.

    .venv/bin/python experiments/fault_stress.py --faults 56 --out runs/fault_stress.json

Each fault runs the tiny test config (``tests/conftest.py`` TINY) in child processes of
``hybrid-lm train`` and then checks, under a timeout:
- no hang (every child returns within ``--timeout`` seconds);
- no silent restart (a run over existing checkpoints says "resumed from step", or refuses);
- no mixed metrics (every step's train rows agree bitwise, the steps are 1..N without gaps);
- where the fault allows a resume, the final state and loss curve are bitwise those of an
  uninterrupted run. A kill before the first save committed leaves rows and no checkpoint: the rerun
  archives the rows with one warning and trains from step 0 (bitwise equal); where checkpoints exist and
  none restores, the rerun refuses in one line naming ``--restart``, and ``--restart`` ends bitwise equal.

Every fault happens at the moment it names whatever the machine's speed: the trainer sends the signal
to itself from a hook at an exact point (``tests/cluster_sim.py`` HOOKED: after a step's row, as a
checkpoint is committed) or pauses there.

Kinds: ``sigkill`` / ``sigterm`` after a random step, ``kill_during_save`` (SIGKILL while a
checkpoint is being committed: its files written, not yet renamed into place), ``corrupt_newest``
(garbage written into the newest checkpoint: it is moved aside and the run resumes from the one
before), ``corrupt_all`` (every checkpoint corrupt: train refuses in one line, metrics untouched), ``byte_flip``
(3 x 16 bytes XOR 0xFF, or one bit, at random offsets of the newest checkpoint's largest file: damage that
mostly still decodes, caught by the checksums saved with it; moved aside, resumed from the one before),
``readonly_checkpoints`` (the save fails fast in one line; after the directory is writable again the
run resumes), ``second_trainer`` (a second ``train`` on the same workdir while the first is paused
mid-run refuses naming the holder; the first then finishes), ``long_lived_lock`` (the same with the
second trainer judging every lock older than the staleness age, ``HYBRID_LM_LOCK_STALE_HOURS=0``: a lock
whose pid runs on this host is still kept, nothing is archived) and ``nan`` (an exploding learning rate:
the run stops in one line with the last good state saved).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from cluster_sim import HOOKED  # noqa: E402  (test tooling: a trainer that signals itself at an exact point)
from conftest import TINY  # noqa: E402  (the tiny CPU config the tests use)
from resume_check import compare_runs, make_unwritable, train_subprocess, write_gin  # noqa: E402  (test tooling)

KINDS = ("sigkill", "sigterm", "kill_during_save", "corrupt_newest", "corrupt_all", "byte_flip", "readonly_checkpoints",
         "second_trainer", "long_lived_lock", "nan")
EVERY = 3  # checkpoint cadence of the stress config


def ckpt_steps(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def corrupt(step_dir: Path) -> None:
    """Overwrite every file of a checkpoint step with garbage of the same size."""
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(os.urandom(max(16, f.stat().st_size)))


def flip_bytes(step_dir: Path, rng: random.Random) -> dict:
    """XOR 0xFF into 3 x 16 bytes, or flip one bit, at random offsets of the largest file of a checkpoint."""
    f = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    how = rng.choice(["bytes", "bit"])
    at = sorted(rng.randrange(max(1, len(data) - 16)) for _ in range(3 if how == "bytes" else 1))
    for a in at:
        if how == "bit":
            data[a] ^= 1 << rng.randrange(8)
        else:
            data[a:a + 16] = bytes(b ^ 0xFF for b in data[a:a + 16])
    f.write_bytes(bytes(data))
    return {"file": f.relative_to(step_dir).as_posix(), "how": how, "at": at}


def metrics_mixed(workdir: Path, steps: int) -> str | None:
    """Why the metrics look like two trajectories, or None."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return None
    by_step = collections.defaultdict(set)
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            return "a torn line"
        if r.get("kind") == "train":
            by_step[r["step"]].add((r["loss"], r.get("grad_norm")))
    bad = [s for s, v in by_step.items() if len(v) > 1]
    if bad:
        return f"steps {bad[:3]} logged with different values"
    seen = sorted(by_step)
    if seen and seen != list(range(seen[0], seen[-1] + 1)):
        return "gaps in the logged steps"
    if seen and seen[-1] > steps:
        return "steps beyond the run length"
    return None


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


class Stress:
    def __init__(self, work: Path, steps: int, timeout: float):
        self.work, self.steps, self.timeout = work, steps, timeout
        self.gin = write_gin(work / "run.gin", TINY + [f"TrainConfig.steps = {steps}", "TrainConfig.log_every = 1",
                                                      f"CheckpointConfig.every_steps = {EVERY}",
                                                      "CheckpointConfig.keep = 3", "CheckpointConfig.async_save = True"])
        self.nan_gin = write_gin(work / "nan.gin", TINY + [f"TrainConfig.steps = {steps}", "TrainConfig.log_every = 1",
                                                          f"CheckpointConfig.every_steps = {EVERY}",
                                                          "OptimConfig.lr = 1e12", "OptimConfig.warmup_steps = 1"])
        self.straight = work / "straight"

    def run(self, workdir, hook: dict | None = None, **kw):
        """``hybrid-lm train`` in a child; with ``hook``, the trainer signals itself (or pauses) at that point."""
        gin = kw.pop("gin", self.gin)
        if hook is None:
            return train_subprocess(gin, workdir, timeout=self.timeout, **kw)
        env = dict(os.environ, JAX_PLATFORMS="cpu", HOOK=json.dumps(hook))
        cmd = [sys.executable, "-c", HOOKED, "train", str(gin), "--workdir", str(workdir), *kw.pop("extra_args", ())]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"training subprocess timed out:\n{str(e.stdout or '')[-3000:]}") from None
        return {"returncode": r.returncode, "output": r.stdout + r.stderr}

    def resume_equal(self, d: Path, row: dict, expect_resume: bool = True) -> None:
        """Rerun ``d``: it resumes and ends bitwise equal to the uninterrupted run. When the fault left
        rows and no checkpoint (a kill before the first save committed), the rerun archives the rows
        with one warning and trains from step 0 (``row["expected"]`` records whether it said so); when
        checkpoints exist and none restores (every checkpoint corrupt), it must refuse in one line naming
        --restart; ``--restart`` then archives the old records and the run ends bitwise equal."""
        had = bool(ckpt_steps(d))
        rows_only = not had and (d / "metrics.jsonl").exists() and not (d / "checkpoints" / "corrupt").exists()
        r = self.run(d)
        row["resumed_rc"] = r["returncode"]
        said = "resumed from step" in r["output"]
        row["silent_restart"] = expect_resume and had and not said and r["returncode"] == 0
        if rows_only:
            row["restarted_from_0"] = r["returncode"] == 0 and r["output"].count("no checkpoint was committed") == 1
            row["expected"] = row.get("expected", True) and row["restarted_from_0"]
        if r["returncode"] == 2 and "--restart" in last_line(r["output"]):
            row["refused_nothing_restores"] = last_line(r["output"])[:160]
            r = self.run(d, extra_args=("--restart",))
            row["restart_rc"] = r["returncode"]
            row["archived"] = (d / "archive").is_dir()
        if r["returncode"] == 0:
            cmp = compare_runs(self.straight, d)
            row["bitwise_equal"] = cmp["loss_equal"] and cmp["state_equal"]
        else:
            row["bitwise_equal"] = False
            row["error"] = last_line(r["output"])

    def fault(self, kind: str, i: int, rng: random.Random) -> dict:
        d = self.work / f"f{i:03d}_{kind}"
        row: dict = {"kind": kind}
        t0 = time.time()
        try:
            getattr(self, kind)(d, row, rng)
            row["hang"] = False
        except RuntimeError as e:  # train_subprocess's timeout
            row["hang"], row["error"] = True, str(e)[:300]
        row["mixed_metrics"] = metrics_mixed(d, self.steps)
        row["seconds"] = round(time.time() - t0, 1)
        row["ok"] = (not row["hang"] and not row.get("silent_restart") and row["mixed_metrics"] is None
                     and row.get("expected", True) and row.get("bitwise_equal", True))
        return row

    # ------------------------------------------------------------------ the faults
    def _kill(self, d, row, at, sig, where="row"):
        """Run ``d``; the trainer sends itself ``sig`` after step ``at``'s row (``where="row"``) or while
        the checkpoint of step ``at`` is being committed (``where="commit"``)."""
        r = self.run(d, hook={"where": where, "at": at, "signals": [sig]})
        row.update(kill_at=at, kill_where=where, kill_rc=r["returncode"], checkpoints_at_kill=ckpt_steps(d))
        if r["returncode"] == 0 and sig == signal.SIGKILL:
            row["note"] = "the run ended before the kill"
            row["expected"] = False

    def sigkill(self, d, row, rng):
        self._kill(d, row, rng.randint(1, self.steps - 2), signal.SIGKILL)
        self.resume_equal(d, row)

    def sigterm(self, d, row, rng):
        self._kill(d, row, rng.randint(1, self.steps - 2), signal.SIGTERM)
        row["expected"] = row["kill_rc"] == 0  # SIGTERM: save and exit cleanly
        self.resume_equal(d, row)

    def kill_during_save(self, d, row, rng):
        at = EVERY * rng.randint(1, (self.steps - 2) // EVERY)
        self._kill(d, row, at, signal.SIGKILL, where="commit")
        row["expected"] = row.get("expected", True) and at not in row["checkpoints_at_kill"]  # not committed
        self.resume_equal(d, row)

    def _killed_with_two_checkpoints(self, d, row):
        """The run killed while committing step 3 * EVERY: the saves of EVERY and 2 * EVERY had finished (each
        save waits for the one before), so two checkpoints are there; their steps, or None (the row says so)."""
        self._kill(d, row, 3 * EVERY, signal.SIGKILL, where="commit")
        steps = ckpt_steps(d)
        if len(steps) < 2:
            row["note"] = "fewer than 2 checkpoints at the kill"
            row["expected"] = False
            return None
        return steps

    def corrupt_newest(self, d, row, rng):
        steps = self._killed_with_two_checkpoints(d, row)
        if steps is None:
            return
        corrupt(d / "checkpoints" / str(steps[-1]))
        row["corrupted"] = steps[-1]
        self.resume_equal(d, row)
        # moved aside to checkpoints/corrupt/<step> (after a --restart, that is under archive/<UTC>/)
        moved = [*d.glob(f"checkpoints/corrupt/{steps[-1]}"), *d.glob(f"archive/*/checkpoints/corrupt/{steps[-1]}")]
        row["expected"] = bool(moved) and row["resumed_rc"] == 0 and "refused_nothing_restores" not in row

    def byte_flip(self, d, row, rng):
        steps = self._killed_with_two_checkpoints(d, row)
        if steps is None:
            return
        row["flipped"] = {"step": steps[-1], **flip_bytes(d / "checkpoints" / str(steps[-1]), rng)}
        self.resume_equal(d, row)
        # moved aside when the damage shows (a checksum or the decoder); a flip the decoder never reads leaves the
        # arrays intact, and then resuming from it is right: either way the run ends bitwise equal
        row["moved_aside"] = (d / "checkpoints" / "corrupt" / str(steps[-1])).is_dir()
        row["expected"] = row["resumed_rc"] == 0 and "refused_nothing_restores" not in row

    def corrupt_all(self, d, row, rng):
        self._kill(d, row, EVERY * rng.randint(2, (self.steps - 2) // EVERY), signal.SIGKILL, where="commit")
        steps = ckpt_steps(d)
        for s in steps:
            corrupt(d / "checkpoints" / str(s))
        before = (d / "metrics.jsonl").read_bytes()
        r = self.run(d)
        err = last_line(r["output"])
        row.update(corrupted=steps, rc=r["returncode"], error=err)
        row["expected"] = (bool(steps) and r["returncode"] == 2 and "--restart" in err
                           and (d / "metrics.jsonl").read_bytes() == before)
        row["silent_restart"] = r["returncode"] == 0

    def readonly_checkpoints(self, d, row, rng):
        self._kill(d, row, 3 * EVERY, signal.SIGKILL, where="commit")
        undo = make_unwritable(d / "checkpoints")
        if undo is None:
            row["note"] = "cannot make a directory read-only here"
            row["expected"] = False
            return
        try:
            t0 = time.time()
            r = self.run(d)
            row.update(rc=r["returncode"], error=last_line(r["output"]), fail_seconds=round(time.time() - t0, 1))
        finally:
            undo()
        # the save fails fast in one line; nothing is written
        ok_fail = r["returncode"] == 2 and "error: saving the checkpoint" in row["error"]
        self.resume_equal(d, row)
        row["expected"] = ok_fail

    def second_trainer(self, d, row, rng, second_env: dict | None = None):
        """The first trainer pauses after a random step's row (holding the lock, mid-run); a second
        ``train`` on the workdir (with ``second_env`` added to its environment) must refuse naming it;
        then the first finishes."""
        d.mkdir(parents=True, exist_ok=True)
        ready, go = d.parent / f"{d.name}.paused", d.parent / f"{d.name}.go"
        hook = {"where": "row", "at": rng.randint(1, self.steps - 2), "ready": str(ready), "go": str(go)}
        env = dict(os.environ, JAX_PLATFORMS="cpu", HOOK=json.dumps(hook))
        cmd = [sys.executable, "-c", HOOKED, "train", str(self.gin), "--workdir", str(d)]
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + self.timeout
        while time.time() < deadline and first.poll() is None and not ready.exists():
            time.sleep(0.05)
        overlapped = first.poll() is None and ready.exists()
        second = self.run(d, env=dict(os.environ, **(second_env or {})))
        go.touch()
        out, _ = first.communicate(timeout=max(1.0, deadline - time.time()))
        row.update(first_rc=first.returncode, second_rc=second["returncode"], error=last_line(second["output"]),
                   paused_at=hook["at"], overlapped=overlapped)
        row["expected"] = (overlapped and first.returncode == 0 and second["returncode"] == 2
                           and "in use by another trainer" in row["error"])
        cmp = compare_runs(self.straight, d) if first.returncode == 0 else {}
        row["bitwise_equal"] = bool(cmp.get("loss_equal") and cmp.get("state_equal"))

    def long_lived_lock(self, d, row, rng):
        """A second trainer for which the first one's lock is past the staleness age: the holder's pid runs
        on this host, so the lock is kept (the second refuses, the first's metrics are not archived)."""
        self.second_trainer(d, row, rng, second_env={"HYBRID_LM_LOCK_STALE_HOURS": "0"})
        row["archived"] = (d / "archive").exists()
        row["expected"] = row["expected"] and not row["archived"]

    def nan(self, d, row, rng):
        r = self.run(d, gin=self.nan_gin)
        err = last_line(r["output"])
        row.update(rc=r["returncode"], error=err, checkpoints=ckpt_steps(d))
        row["expected"] = r["returncode"] == 2 and "non-finite" in err and bool(row["checkpoints"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=56)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a child counts as hung")
    ap.add_argument("--out", default="runs/fault_stress.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    plan = [kinds[i % len(kinds)] for i in range(args.faults)]
    rng.shuffle(plan)
    work = Path(tempfile.mkdtemp(prefix="fault_stress_"))
    os.environ.setdefault("HYBRID_LM_DATA_DIR", str(work / "data"))
    stress = Stress(work, args.steps, args.timeout)
    r = stress.run(stress.straight)
    if r["returncode"] != 0:
        print(r["output"][-3000:])
        return 1
    rows = [stress.fault(k, i, rng) for i, k in enumerate(tqdm(plan, desc="faults"))]
    print(f"\n{'kind':<22}{'n':>4}{'ok':>5}{'hangs':>7}{'silent restarts':>17}{'mixed metrics':>15}{'not bitwise':>13}"
          f"{'refused, --restart':>20}{'rows only, from 0':>19}")
    summary = {}
    for k in kinds:
        rs = [x for x in rows if x["kind"] == k]
        s = {"n": len(rs), "ok": sum(x["ok"] for x in rs), "hangs": sum(x["hang"] for x in rs),
             "silent_restarts": sum(bool(x.get("silent_restart")) for x in rs),
             "mixed_metrics": sum(x["mixed_metrics"] is not None for x in rs),
             "not_bitwise": sum(x.get("bitwise_equal") is False for x in rs),
             "refused_then_restarted": sum("refused_nothing_restores" in x for x in rs),
             "rows_only_restarted": sum(bool(x.get("restarted_from_0")) for x in rs)}
        summary[k] = s
        print(f"{k:<22}{s['n']:>4}{s['ok']:>5}{s['hangs']:>7}{s['silent_restarts']:>17}{s['mixed_metrics']:>15}"
              f"{s['not_bitwise']:>13}{s['refused_then_restarted']:>20}{s['rows_only_restarted']:>19}")
    bad = [x for x in rows if not x["ok"]]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} faults handled as specified")
    for x in bad:
        print("  NOT OK:", json.dumps(x)[:400])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "seed": args.seed, "summary": summary, "rows": rows},
                                         indent=2))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
