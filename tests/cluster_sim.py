"""A cluster simulated on one CPU machine, for the tests of multi-process runs, SLURM and signals (test
tooling, not part of the package; the tests put ``tests/`` on ``sys.path``).

- :func:`fake_slurm_bin`: a stand-in ``scontrol`` that records its arguments and then does what a real
  ``scontrol requeue`` of a running job does to it: SIGTERM to the job's processes (the pids in a file,
  else the caller).
- :func:`slurm_env`: the variables SLURM sets for a task of a batch job or of an ``srun`` step.
- :func:`trainer`: a ``hybrid-lm train`` child with its own environment (another "host" through
  ``HYBRID_LM_HOSTNAME``; several processes through ``HYBRID_LM_*`` or SLURM variables, each with its
  own simulated CPU devices).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hybrid_lm.run.metrics import read_metrics

SCONTROL = """#!/bin/bash
# stand-in for SLURM's scontrol: record the call, then act as a requeue of a running job does
echo "$@" >> "$FAKE_SCONTROL_LOG"
if [ "$1" = requeue ]; then
  if [ -n "$FAKE_SLURM_PIDS" ]; then  # the job's processes, one pid a line (none: signal nobody)
    for p in $(cat "$FAKE_SLURM_PIDS" 2>/dev/null); do kill -TERM "$p" 2>/dev/null || true; done
  else
    kill -TERM "$PPID" 2>/dev/null || true
  fi
fi
exit 0
"""


# A Python command line (``python -c HOOKED ARGS``, ARGS as for ``python -m hybrid_lm.cli`` or ``-m MODULE ...``
# for a module with ``main(argv)``) that first installs a hook from the JSON in $HOOK: the process sends
# itself the signals in "signals" (then sleeps "sleep" seconds) at one point of the run, "where":
#   "row": after step "at"'s metrics row;  "save": entering the checkpoint save of step "at";
#   "restore": right after the start-up restore;  "seed": when a stable run seeds its first branch;
#   "commit": as the checkpoint of step "at" is about to be committed (its files written, not renamed).
# With "ready" / "go" (paths) it then writes "ready" and waits for "go" to exist (a paused trainer).
# So each case hits the moment it names, whatever the machine's speed. Without $HOOK: no hook.
HOOKED = r"""
import importlib, json, os, sys, time
spec = json.loads(os.environ.get("HOOK") or "null")
fired = []

def fire():
    if fired:
        return
    fired.append(1)
    for s in spec.get("signals", []):
        os.kill(os.getpid(), s)
        time.sleep(0.3)
    time.sleep(spec.get("sleep", 0))
    if spec.get("ready"):
        open(spec["ready"], "w").close()
        t0 = time.time()
        while not os.path.exists(spec["go"]) and time.time() - t0 < 900:
            time.sleep(0.05)

if spec:
    from hybrid_lm.run import checkpoint
    from hybrid_lm.train import logger, loop
    if spec["where"] == "row":
        row = logger.StepLogger.train_row
        def train_row(self, done, *a, **k):
            row(self, done, *a, **k)
            if done == spec["at"]:
                fire()
        logger.StepLogger.train_row = train_row
    elif spec["where"] == "save":
        save = checkpoint.Checkpointer.save
        def hooked_save(self, step, *a, **k):
            if step == spec["at"]:
                fire()
            return save(self, step, *a, **k)
        checkpoint.Checkpointer.save = hooked_save
    elif spec["where"] == "restore":
        restore = loop.init_or_restore
        def init_or_restore(*a, **k):
            out = restore(*a, **k)
            fire()
            return out
        loop.init_or_restore = init_or_restore
    elif spec["where"] == "commit":
        from orbax.checkpoint._src.path import atomicity
        finalize = atomicity.AtomicRenameTemporaryPath.finalize
        async def hooked_finalize(self, *a, **k):
            if self.get_final().name == str(spec["at"]):
                fire()
            return await finalize(self, *a, **k)
        atomicity.AtomicRenameTemporaryPath.finalize = hooked_finalize
    elif spec["where"] == "seed":
        from hybrid_lm.scaling import launch
        seed = launch.seed_branch
        def seed_branch(*a, **k):
            out = seed(*a, **k)
            fire()
            return out
        launch.seed_branch = seed_branch
args = sys.argv[1:]
if args[:1] == ["-m"]:
    sys.exit(importlib.import_module(args[1]).main(args[2:]))
from hybrid_lm.cli import main
sys.exit(main(args))
"""


def hooked_python(path: Path) -> Path:
    """An executable that runs this Python with :data:`HOOKED` (for scripts that call ``PYTHON -m ...``)."""
    import shlex

    path = Path(path)
    path.write_text(f"#!/bin/bash\nexec {shlex.quote(sys.executable)} -c {shlex.quote(HOOKED)} \"$@\"\n")
    path.chmod(0o755)
    return path


def fake_slurm_bin(directory: Path) -> tuple[Path, Path]:
    """``(bin dir to put first on PATH, the log of scontrol calls)``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "scontrol").write_text(SCONTROL)
    (directory / "scontrol").chmod(0o755)
    return directory, directory / "scontrol_calls.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(job: int, *, array_task: int | None = None, restart: int = 0, ntasks: int = 1, procid: int = 0,
              localid: int = 0, nodeid: int = 0, tasks_per_node: str | None = None, nodelist: str = "127.0.0.1",
              step: bool = True, gpus: str | None = None, gpus_per_task: int | None = None) -> dict:
    """SLURM's variables for one task (an array task when ``array_task`` is given: SLURM_JOB_ID then
    differs from SLURM_ARRAY_JOB_ID, except for one task, as in a real array)."""
    env = {"SLURM_JOB_ID": str(job + (array_task or 0)), "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_RESTART_COUNT": str(restart),
           "SLURM_JOB_NODELIST": nodelist}
    if array_task is not None:
        env.update(SLURM_ARRAY_JOB_ID=str(job), SLURM_ARRAY_TASK_ID=str(array_task))
    if step:
        env.update(SLURM_STEP_ID="0", SLURM_STEP_NODELIST=nodelist,
                   SLURM_STEP_TASKS_PER_NODE=tasks_per_node or str(ntasks))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if gpus_per_task is not None:
        env["SLURM_GPUS_PER_TASK"] = str(gpus_per_task)
    return env


def base_env(devices: int = 1, **extra) -> dict:
    """This process's environment for a child on the CPU, without any cluster variable inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HYBRID_LM_COORDINATOR",
                                                                   "HYBRID_LM_NUM_PROCESSES",
                                                                   "HYBRID_LM_PROCESS_ID", "CUDA_VISIBLE"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def trainer(args: list[str], env: dict, out: Path, cwd: Path | None = None) -> subprocess.Popen:
    """``python -m hybrid_lm.cli ARGS`` with stdout and stderr to the file ``out``."""
    fh = open(out, "w")
    return subprocess.Popen([sys.executable, "-m", "hybrid_lm.cli", *args], env=env, stdout=fh,
                            stderr=subprocess.STDOUT, cwd=cwd)


def hooked(args: list[str], env: dict, out: Path, hook: dict | None = None) -> subprocess.Popen:
    """``python -c HOOKED ARGS`` with ``hook`` (see :data:`HOOKED`), output to the file ``out``."""
    import json

    env = dict(env, HOOK=json.dumps(hook)) if hook else {k: v for k, v in env.items() if k != "HOOK"}
    fh = open(out, "w")
    return subprocess.Popen([sys.executable, "-c", HOOKED, *args], env=env, stdout=fh, stderr=subprocess.STDOUT)


def wait_all(procs, timeout: float) -> list[int]:
    """Return codes of ``procs``; kills them all and raises when any is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"a process was still running after {timeout} s") from None
    return [p.returncode for p in procs]


def wait_for_step(workdir: Path, step: int, procs, timeout: float = 300) -> int:
    """Wait until ``workdir``'s metrics log a train row at ``step`` or later; returns the step seen."""
    metrics = Path(workdir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a trainer ended before the step was reached")
        if metrics.exists():
            rows = read_metrics(metrics, "train")
            if rows and rows[-1]["step"] >= step:
                return rows[-1]["step"]
        time.sleep(0.05)
    raise RuntimeError(f"step {step} not reached in {timeout} s")


def last_line(path: Path) -> str:
    lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def text(path: Path) -> str:
    return Path(path).read_text()


def signal_name(code: int) -> str:
    return signal.Signals(code).name
