"""Launch a sweep: locally (in sequence, or one job per local GPU) or through a SLURM job array.

Idempotent by construction:

* a run directory holds ``sweep_done.json`` once its job finished: such jobs are skipped;
* any other job is (re)started through ``train()``, which resumes from the newest checkpoint in its
  directory, so partial runs continue where they stopped;
* a *stable* WSD run trains in segments that end at each branch point ``s_b`` (the constant-LR
  schedule does not depend on the run length, so segments equal one long run), and right after each
  segment seeds its branches: the stable checkpoint at ``s_b`` is restored and saved again as the
  branch's checkpoint at ``s_b`` through orbax (its ``meta`` item with the branch's run id and
  provenance), and the stable run's metrics rows up to ``s_b`` are copied into the branch's ``metrics.jsonl``
  (marked ``copied_from``). A branch runs once seeded; it only trains its decay phase.

**SLURM.** ``--launch slurm`` writes ``<root>/slurm/phase1.sbatch`` (stable and independent runs, a job
array), one ``branches-<k>.sbatch`` array per stable run ``k`` of phase 1 holding its WSD branches, and
``submit.sh``, which submits phase 1 and then each branch array with ``--dependency=afterany:<phase 1>_<k>``:
a branch waits for its own stable run's task only, not for the whole phase (each branch also checks
that it is seeded and fails with a clear message otherwise). Each script holds its run names itself
(``phase1.txt`` only lists them for reading): SLURM keeps the script it was given, so regenerating
the scripts never changes what an already submitted task runs. Logs go to
``slurm/logs/<job name>-<array job>_<task>.out``, appended (``--open-mode=append``), so a requeued
task's log keeps every segment. Chosen over submitit: no extra dependency, the scripts are plain
files that can be read, edited and resubmitted, and a resubmission lists only the unfinished jobs.
``--signal=B:USR1@<s>`` + ``--requeue`` let the trainer save and requeue its own array task
(``<array job>_<task>``) before the time limit (``signals.py``).

**Micro-batches.** Each run's ``TrainConfig.microbatches`` comes from the micro-batch rule
(``hybrid_lm/train/microbatch.py``): the fewest gradient-accumulation steps that put at most the
measured best sequences per device (``configs/microbatch_h200.json``) on each device of the run's
mesh. A spec or gin file that sets ``microbatches > 1`` keeps its value; unmeasured (scale, arch,
seq_len) keep the configured one. The choice and its reason are written to ``sweep_run.json``.

Worker entry point (used by the local GPU pool and by the SLURM scripts)::

    python -m hybrid_lm.scaling.launch --root ROOT --job NAME

It catches SIGTERM / SIGUSR1 / SIGINT for its whole life (a signal between two segments of a stable
run stops the next segment before its first step, and SIGUSR1 then requeues), and reports a failed
job in one line (exit 1).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import traceback
import contextlib
import re
import signal as _signal
import signal
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from hybrid_lm import sharding as shd, signals
from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.files import atomic_write_json, atomic_write_text
from hybrid_lm.progress import JobLines, bar_disabled
from hybrid_lm.scaling.sweep import Job, Plan, SweepError, manifest_jobs, read_manifest, write_manifest
from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.config import CheckpointConfig
from hybrid_lm.run.checkpoint import Checkpointer
from hybrid_lm.run.directory import checkpoint_dir, checkpoint_steps, metrics_path
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.train import distributed
from hybrid_lm.train.loop import train
from hybrid_lm.train.microbatch import apply_rule, device_memory_limit

DONE = "sweep_done.json"
RUN_META = "sweep_run.json"
REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- state of a run dir

def is_done(root: Path, job: Job, jobs: dict[str, Job] | None = None) -> bool:
    """Finished: ``sweep_done.json`` exists; for a stable run, also none of its branches (when ``jobs`` is
    given) still waits for a seed, e.g. because its directory was deleted after the stable run finished."""
    if not (Path(root) / job.name / DONE).exists():
        return False
    if job.kind == "stable" and jobs is not None:
        return all(job_state(root, jobs[b]) != "new" for b in job.branches if b in jobs)
    return True


def job_state(root: Path, job: Job) -> str:
    """done | partial (checkpoints past the start) | seeded (a branch holding only its seed) | new."""
    d = Path(root) / job.name
    if (d / DONE).exists():
        return "done"
    steps = checkpoint_steps(d, missing_ok=True)
    if job.kind == "branch":
        if not steps:
            return "new"
        return "seeded" if steps == [job.branch_from["step"]] else "partial"
    return "partial" if steps else "new"


def is_ready(root: Path, job: Job) -> bool:
    """A branch is ready once seeded (or already past its seed); other jobs always are."""
    return job.kind != "branch" or job_state(root, job) != "new"


def _atomic_json(path: Path, obj) -> None:
    atomic_write_json(path, obj, indent=1, default=str)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- running one job

def _load(job: Job, extra: list[str] | None = None):
    """The job's config with ``TrainConfig.microbatches`` set by the micro-batch rule for this process's
    devices (:func:`microbatch_plan`)."""
    return _config(job, extra)[0]


def _config(job: Job, extra: list[str] | None = None):
    """``(config, micro-batch reason)`` of ``job``; a config that no longer matches the planned run id fails."""
    cfg = load_config(job.gin_files, job.gin_params + list(extra or []))
    if run_id(cfg) != job.config_run_id:
        raise SweepError(
            f"job {job.name}: its gin files now resolve to config {run_id(cfg)}, not {job.config_run_id} as when "
            "the sweep was planned (a gin file changed?). Re-run `hybrid-lm sweep SPEC --launch ...` to re-plan; "
            "the changed runs get new ids.")
    return microbatch_plan(cfg)


def microbatch_plan(cfg, devices=None):
    """``(cfg, reason)``: ``cfg`` with ``TrainConfig.microbatches`` from the micro-batch rule on the
    mesh that ``train()`` builds from ``cfg.mesh`` and ``devices`` (default: all of this process's), fitted
    to the smallest memory limit among the mesh's devices."""
    mesh = shd.make_mesh(cfg.mesh, devices)
    limits = [b for b in (device_memory_limit(d) for d in mesh.devices.flat) if b]
    return apply_rule(cfg, shd.n_batch_shards(mesh), memory_limit=min(limits, default=None))


def seed_branch(root: Path, stable: Job, branch: Job) -> bool:
    """Save the stable run's checkpoint at the branch step as the branch's first checkpoint, through orbax
    (restored as it was saved, saved again with the branch's run id and ``branched_from`` in its meta
    item), and the stable phase of the loss curve as the branch's first metrics rows; False if already
    seeded."""
    step = branch.branch_from["step"]
    sdir, bdir = Path(root) / stable.name, Path(root) / branch.name
    if step in checkpoint_steps(bdir, missing_ok=True) or job_state(root, branch) in ("done", "partial"):
        return False
    have = checkpoint_steps(sdir, missing_ok=True)
    if step not in have:
        raise SweepError(f"cannot seed branch {branch.name}: the stable run {stable.name} has no checkpoint at "
                         f"step {step} (has {have}). It was deleted by the retention policy; "
                         f"delete {checkpoint_dir(sdir)} to retrain the stable run, or raise CheckpointConfig.keep.")
    cc = CheckpointConfig(async_save=False)
    src = Checkpointer(checkpoint_dir(sdir), cc, read_only=True)
    try:
        state, meta = src.restore_as_saved(step)
    finally:
        src.close()
    meta.update(run_id=branch.config_run_id,
                branched_from={"run": stable.name, "run_id": meta.get("run_id"), "step": step})
    bdir.mkdir(parents=True, exist_ok=True)
    dst = Checkpointer(checkpoint_dir(bdir), cc)
    try:
        dst.save(step, state, meta, force=True)
    finally:
        dst.close()
    del state
    # the stable phase of the loss curve, so the branch's metrics read like an independent run's
    src_metrics, dst_metrics = metrics_path(sdir), metrics_path(bdir)
    if src_metrics.exists() and not dst_metrics.exists():
        rows = [r for r in read_metrics(src_metrics) if r.get("step", 0) <= step]
        atomic_write_text(dst_metrics, "".join(json.dumps({**r, "copied_from": stable.name}) + "\n" for r in rows))
    _atomic_json(bdir / "branch.json", {"stable": stable.name, "step": step, "seeded_at": _now()})
    return True


def _write_run_meta(root: Path, job: Job) -> None:
    """``sweep_run.json``: the job, the sweep root, and the micro-batches the rule chose and why."""
    d = Path(root) / job.name
    d.mkdir(parents=True, exist_ok=True)
    cfg, why = _config(job)
    _atomic_json(d / RUN_META, {**job.to_dict(), "sweep_root": str(Path(root).resolve()),
                                "microbatches": cfg.train.microbatches, "microbatch_reason": why})


@contextmanager
def job_lock(run_dir: Path):
    """An exclusive ``flock`` on ``<run>/.sweep.lock`` (released by the OS if the process dies), so that
    two launches of the same sweep never train one run twice at the same time."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fh = (run_dir / ".sweep.lock").open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise SweepError(f"{run_dir.name} is being run by another process (holds {run_dir / '.sweep.lock'})") from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.uname().nodename} {os.getpid()} {_now()}\n")
        fh.flush()
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def run_job(root: Path, job: Job, jobs: dict[str, Job] | None = None) -> dict:
    """Run one job in this process (under its lock); returns {"status": done|skipped|preempted, ...}."""
    root = Path(root)
    if job.kind == "stable" and jobs is None:
        jobs = {j.name: j for j in manifest_jobs(root)}
    if is_done(root, job, jobs):
        return {"status": "skipped", "job": job.name}
    with job_lock(root / job.name):
        if is_done(root, job, jobs):  # finished by another process meanwhile
            return {"status": "skipped", "job": job.name}
        return _run_job(root, job, jobs)


def _run_job(root: Path, job: Job, jobs: dict[str, Job] | None) -> dict:
    d = root / job.name
    if job.kind == "branch" and job_state(root, job) == "new":
        raise SweepError(f"branch {job.name} is not seeded: its stable run {job.branch_from['run']} has not reached "
                         f"step {job.branch_from['step']} yet (run the stable job first; under SLURM, see phase 1's "
                         "logs)")
    _write_run_meta(root, job)
    t0 = time.time()
    if job.kind == "stable":
        jobs = jobs or {j.name: j for j in manifest_jobs(root)}
        branches = [jobs[n] for n in job.branches]
        seeded, segments = [], []
        for sb in job.branch_points:
            targets = [b for b in branches if b.branch_from["step"] == sb and job_state(root, b) == "new"]
            if not targets:
                continue
            have = checkpoint_steps(d, missing_ok=True)
            if sb not in have:
                if have and max(have) > sb:
                    raise SweepError(f"stable run {job.name} is past step {sb} (checkpoints {have}) but has no "
                                     f"checkpoint there to seed {[b.name for b in targets]}; delete {d}/checkpoints "
                                     "to retrain it")
                cfg = _load(job, [f"TrainConfig.steps = {sb}"])
                res = train(cfg, d)
                segments.append({"to_step": sb, "resumed_from": res.resumed_from, "wall_seconds": res.wall_seconds})
                if res.preempted:
                    return _preempted(job, res)
            for b in targets:
                if seed_branch(root, job, b):
                    seeded.append(b.name)
        (d / "sweep_error.txt").unlink(missing_ok=True)
        _atomic_json(d / DONE, {"job": job.name, "kind": "stable", "finished_at": _now(), "seeded": seeded,
                                "segments": segments, "wall_seconds": time.time() - t0})
        return {"status": "done", "job": job.name, "seeded": seeded}
    cfg = _load(job)
    res = train(cfg, d)
    if res.preempted:
        return _preempted(job, res)
    if res.step < job.steps:
        raise SweepError(f"job {job.name} stopped at step {res.step} of {job.steps}")
    (d / "sweep_error.txt").unlink(missing_ok=True)
    _atomic_json(d / DONE, {"job": job.name, "kind": job.kind, "finished_at": _now(), "step": res.step,
                            "final_eval": res.final_eval, "resumed_from": res.resumed_from,
                            "wall_seconds": res.wall_seconds, "skipped_steps": res.skipped_steps})
    return {"status": "done", "job": job.name, "resumed_from": res.resumed_from, "final_eval": res.final_eval}


def _preempted(job: Job, res) -> dict:
    return {"status": "preempted", "job": job.name, "step": res.step, "signal": res.preempted,
            "before_training": res.before_training, "requeued": res.requeued}


# ----------------------------------------------------------------------------- local launch

def select_jobs(jobs: list[Job], only: str | None) -> list[Job]:
    """Jobs whose name matches the regex ``only``, plus the stable runs that matched branches need."""
    if not only:
        return list(jobs)

    pat = re.compile(only)
    names = {j.name for j in jobs if pat.search(j.name)}
    for j in jobs:
        if j.name in names and j.kind == "branch":
            names.add(j.branch_from["run"])
    sel = [j for j in jobs if j.name in names]
    if not sel:
        raise SweepError(f"--only {only!r} matches no job")
    return sel


def detect_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip() != ""]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def launch_local(plan: Plan, gpus: list[str] | None = None, only: str | None = None, progress: bool = True,
                 max_minutes: float | None = None) -> dict:
    """Run the plan's unfinished jobs: in this process one after another, or one subprocess per GPU.

    ``max_minutes``: after that much wall time the launch stops as a SIGTERM would stop it (the running
    job saves a checkpoint after its current step, no new job starts; ``summary["deadline"]`` says when it
    fired), so a long sweep runs in parts of bounded length, each continuing the last."""
    root = plan.root
    if max_minutes is not None and not max_minutes > 0:
        raise SweepError(f"--max-minutes {max_minutes:g}: must be > 0")
    write_manifest(plan)
    jobs = select_jobs(plan.jobs, only)
    by_name = {j.name: j for j in plan.jobs}
    todo = [j for j in jobs if not is_done(root, j, by_name)]
    summary = {"root": str(root), "jobs": len(jobs), "skipped": len(jobs) - len(todo), "launched": 0, "done": [],
               "failed": {}, "blocked": [], "preempted": None}
    if not todo:
        return summary
    if gpus and len(gpus) > 1:
        return _gpu_pool(plan, todo, gpus, summary, progress, max_minutes)

    with signals.catching():  # Ctrl-C / SIGTERM: the running job saves and stops, and so does the sweep
        with _deadline(max_minutes, summary):
            return _in_sequence(root, todo, by_name, summary, plan, progress)


@contextmanager
def _deadline(max_minutes: float | None, summary: dict):
    """After ``max_minutes`` of wall time, raise the process's stop flag as SIGTERM does (inside the
    caller's ``signals.catching()``: the running job saves and stops; the GPU pool stops its workers
    the same way). ``summary["deadline"]`` records whether it fired."""
    summary["deadline"] = None
    if max_minutes is None:
        yield
        return


    def fire():
        summary["deadline"] = {"minutes": max_minutes, "at": _now()}
        signals.current_flag().request(_signal.SIGTERM)

    timer = threading.Timer(max_minutes * 60.0, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _in_sequence(root: Path, todo: list[Job], by_name: dict, summary: dict, plan: Plan, progress: bool) -> dict:
    bar = tqdm(total=len(todo), desc=f"sweep {plan.spec.name}", disable=bar_disabled(progress), dynamic_ncols=True)
    lines = JobLines(len(todo), progress)  # the bar names the running job; a log file gets these lines instead
    try:
        for j in todo:
            if j.kind == "branch" and not is_ready(root, j):
                summary["blocked"].append(j.name)
                lines.not_started(j.name, f"its stable run {j.branch_from['run']} did not seed it")
                bar.update(1)
                continue
            bar.set_postfix_str(j.name)
            summary["launched"] += 1
            lines.start(j.name)
            try:
                r = run_job(root, j, by_name)
            except Exception as e:  # one failed run must not stop the sweep; the traceback goes to the run dir
                summary["failed"][j.name] = f"{type(e).__name__}: {e}"
                (root / j.name).mkdir(parents=True, exist_ok=True)
                (root / j.name / "sweep_error.txt").write_text(traceback.format_exc())
                if lines.on:
                    lines.failed(j.name, f"{type(e).__name__}: {e}", root / j.name / "sweep_error.txt")
                else:
                    tqdm.write(f"FAILED {j.name}: {type(e).__name__}: {e} "
                               f"(traceback in {root / j.name / 'sweep_error.txt'})")
                bar.update(1)
                continue
            if r["status"] == "preempted":
                summary["preempted"] = r
                lines.stopped(j.name, f"preempted by {r.get('signal')} at step {r.get('step')}")
                break
            summary["done"].append(j.name)
            lines.done(j.name)
            bar.update(1)
    finally:
        bar.close()
    return summary


class _PrefixedLog:
    """A worker's merged stdout/stderr appended to its log file, each line prefixed with ``[run]``."""

    def __init__(self, path: Path, name: str):
        self._fh = path.open("ab")
        self._prefix = f"[{name}] ".encode()
        self._thread: threading.Thread | None = None

    def pump(self, stream) -> None:
        self._thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self._thread.start()

    def _copy(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self._fh.write(self._prefix + line)
            self._fh.flush()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._fh.close()


def _gpu_pool(plan: Plan, todo: list[Job], gpus: list[str], summary: dict, progress: bool,
              max_minutes: float | None = None) -> dict:
    """One worker subprocess per GPU (CUDA_VISIBLE_DEVICES); branches start as soon as they are seeded.
    A stop signal (Ctrl-C, SIGTERM) or the deadline starts no new job and sends SIGTERM to the running
    workers, which save and stop."""
    with signals.catching() as flag, _deadline(max_minutes, summary):
        return _pool(plan, todo, gpus, summary, progress, flag)


def _pool(plan: Plan, todo: list[Job], gpus: list[str], summary: dict, progress: bool, flag) -> dict:
    root = plan.root
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending = list(todo)
    running: dict[str, tuple] = {}  # gpu -> (Popen, job, log handle)
    failed_stables: set[str] = set()
    bar = tqdm(total=len(todo), desc=f"sweep {plan.spec.name} on GPUs {','.join(gpus)}",
               disable=bar_disabled(progress), dynamic_ncols=True)
    lines = JobLines(len(todo), progress)  # the bar names the running jobs; a log file gets these lines instead
    stopping = False
    try:
        while pending or running:
            if flag.requested and not stopping:  # SIGTERM (not the signal itself: a 2nd Ctrl-C exits at once)
                stopping = True
                for proc, _, _ in running.values():
                    with contextlib.suppress(OSError):
                        proc.send_signal(signal.SIGTERM)
                summary["preempted"] = summary["preempted"] or {"signal": flag.name}
            if stopping and not running:
                break
            for g in gpus:
                if g in running or stopping:
                    continue
                ready = next((j for j in pending if is_ready(root, j)), None)
                if ready is None:
                    break
                pending.remove(ready)
                fh = _PrefixedLog(logs / f"{ready.name}.log", ready.name)
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": g}
                cmd = [sys.executable, "-m", "hybrid_lm.scaling.launch", "--root", str(root), "--job", ready.name]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
                fh.pump(proc.stdout)
                running[g] = (proc, ready, fh)
                summary["launched"] += 1
                lines.start(ready.name, f"on GPU {g}")
                bar.set_postfix_str(f"gpu{g}: {ready.name}")
            for g, (proc, job, fh) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                fh.close()
                del running[g]
                if rc == 0 and (root / job.name / DONE).exists():
                    summary["done"].append(job.name)
                    lines.done(job.name)
                elif rc == 3:
                    summary["preempted"] = {"job": job.name}
                    lines.stopped(job.name, "preempted")
                else:
                    summary["failed"][job.name] = f"exit code {rc}; log: {logs / (job.name + '.log')}"
                    if lines.on:
                        lines.failed(job.name, f"rc {rc}", logs / (job.name + ".log"))
                    else:
                        tqdm.write(f"FAILED {job.name} (exit {rc}); see {logs / (job.name + '.log')}")
                    if job.kind == "stable":
                        failed_stables.add(job.name)
                bar.update(1)
            # branches whose stable run failed (or ended) without seeding them can never start
            live_stables = {j.name for _, j, _ in running.values()} | {j.name for j in pending if j.kind == "stable"}
            for j in list(pending):
                if j.kind == "branch" and not is_ready(root, j) and j.branch_from["run"] not in live_stables:
                    pending.remove(j)
                    summary["blocked"].append(j.name)
                    lines.not_started(j.name, f"its stable run {j.branch_from['run']} did not seed it")
                    bar.update(1)
            if summary["preempted"]:
                for proc, _, fh in running.values():
                    proc.wait()
                    fh.close()
                break
            time.sleep(0.5)
    finally:
        bar.close()
    return summary


# ----------------------------------------------------------------------------- SLURM

# what a value interpolated into an ``#SBATCH --flag=value`` line may hold: no space, quote, shell or control
# character, so that it stays one option of one line (sbatch reads these lines, the shell never runs them)
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%+/|\[\]-]+")
_SLURM_INTS = ("cpus_per_task", "max_parallel", "signal_seconds")


def check_slurm(slurm: dict, spec_name: str, root: Path) -> None:
    """Refuse, in one line naming the key, a ``[slurm]`` value that would not stay the one ``#SBATCH`` option
    (or the one argument) it is meant to be in the generated scripts: an injected newline, space or shell
    character. ``setup`` is written verbatim by design (shell lines the user asks for), and must be a list of
    strings; ``sbatch`` entries are whole ``--flag[=value]`` options, without a control character."""
    def bad(key: str, value, why: str) -> SweepError:
        return SweepError(f"slurm.{key} = {value!r}: {why}; it is written into the generated sbatch scripts")

    for key in ("partition", "account", "qos", "time", "mem", "gpus_per_task", *_SLURM_INTS):
        v = slurm.get(key)
        if v is None:
            continue
        if key in _SLURM_INTS and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad(key, v, "must be a whole number of at least 1")
        if not isinstance(v, (str, int)) or isinstance(v, bool) or not _SBATCH_VALUE.fullmatch(str(v)):
            raise bad(key, v, "may hold only letters, digits and _.,:=@%+/|[]- (no space, quote, shell or "
                      "control character)")
    extra = slurm.get("sbatch", [])
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise bad("sbatch", extra, "must be a list of options, e.g. [\"--constraint=h100\"]")
    for x in extra:
        if not x.startswith("-") or any(c < " " or c == "\x7f" for c in x):
            raise bad("sbatch", x, "each entry must be one --flag[=value] option without a control character")
    setup = slurm.get("setup", [])
    if not isinstance(setup, list) or not all(isinstance(x, str) for x in setup):
        raise bad("setup", setup, "must be a list of shell lines (written verbatim)")
    py = slurm.get("python")
    if py is not None and (not isinstance(py, str) or any(c < " " for c in py)):
        raise bad("python", py, "must be a path without a control character")
    for what, v in (("the sweep name", spec_name), ("the sweep root", str(root))):
        if any(c.isspace() or c < " " for c in v):
            raise SweepError(f"{what} {v!r} holds a space or a control character, which the generated sbatch "
                             "scripts' #SBATCH lines cannot hold; choose another")


def write_slurm(plan: Plan, only: str | None = None, submit: bool = True, python: str | None = None) -> dict:
    """Write phase-1/phase-2 job-array scripts and submit.sh; submit them if asked and sbatch exists. Every
    ``[slurm]`` value is checked first (:func:`check_slurm`): nothing is written for a bad one."""
    root = plan.root.resolve()
    check_slurm(plan.spec.slurm, plan.spec.name, root)
    write_manifest(plan)
    by_name = {j.name: j for j in plan.jobs}
    jobs = [j for j in select_jobs(plan.jobs, only) if not is_done(plan.root, j, by_name)]
    p1 = [j.name for j in jobs if j.kind != "branch"]
    p2 = [j.name for j in jobs if j.kind == "branch"]
    sd = root / "slurm"
    (sd / "logs").mkdir(parents=True, exist_ok=True)
    for old in [*sd.glob("branches-*.sbatch"), sd / "phase2.sbatch", sd / "phase1.sbatch"]:
        old.unlink(missing_ok=True)  # a script of an earlier plan (submitted tasks keep their own copy)
    s = plan.spec.slurm
    py = python or s.get("python") or sys.executable
    out = {"dir": str(sd), "phase1": len(p1), "phase2": len(p2), "scripts": [], "submitted": None}
    atomic_write_text(sd / "phase1.txt", "".join(n + "\n" for n in p1))
    atomic_write_text(sd / "phase2.txt", "".join(n + "\n" for n in p2))
    # branches grouped by their stable run: each group waits for that run's phase-1 task only
    groups: dict[str, list[str]] = {}
    for n in p2:
        groups.setdefault(by_name[n].branch_from["run"], []).append(n)
    arrays = [("phase1", "phase1", p1, None)] if p1 else []
    for k, (stable, names) in enumerate(groups.items()):
        after = p1.index(stable) if stable in p1 else None  # None: the stable run is done already
        arrays.append((f"branches-{k}", f"branches-{k}", names, after))
    for file, phase, names, _ in arrays:
        path = sd / f"{file}.sbatch"
        atomic_write_text(path, _sbatch_script(plan, phase, names, py, root))
        path.chmod(0o755)
        out["scripts"].append(str(path))
    submit_sh = sd / "submit.sh"
    lines = ["#!/bin/bash", "# Generated by `hybrid-lm sweep --launch slurm`; safe to re-run after regenerating.",
             "# Each branch array waits for its own stable run's phase-1 task (afterany:<phase 1>_<task>).",
             "set -euo pipefail", f"cd {shlex.quote(str(sd))}"]
    if p1:
        lines += ["P1=$(sbatch --parsable phase1.sbatch)", "P1=${P1%%;*}", 'echo "phase1 ${P1}"']
    for file, _, names, after in arrays[1 if p1 else 0:]:
        dep = f"--dependency=afterany:${{P1}}_{after} " if after is not None else ""
        stable = by_name[names[0]].branch_from["run"]
        lines += [f"B=$(sbatch --parsable {dep}{file}.sbatch)",
                  f'echo "{file} ${{B%%;*}}: {len(names)} branch(es) of "{shlex.quote(stable)}']
    if not arrays:
        lines += ['echo "nothing to submit: every job is done"']
    atomic_write_text(submit_sh, "\n".join(lines) + "\n")
    submit_sh.chmod(0o755)
    out["submit_sh"] = str(submit_sh)
    if submit and (p1 or p2):
        if shutil.which("sbatch") is None:
            out["submitted"] = False
            out["note"] = f"sbatch is not on PATH: run {submit_sh} on the cluster's login node"
        else:
            r = subprocess.run(["bash", str(submit_sh)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SweepError(f"sbatch failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
            out["submitted"] = True
            out["sbatch_output"] = r.stdout.strip()
    return out


def _sbatch_script(plan: Plan, phase: str, names: list[str], python: str, root: Path) -> str:
    s = plan.spec.slurm
    name = f"{plan.spec.name}-{phase}"
    par = s.get("max_parallel")
    arr = f"0-{len(names) - 1}" + (f"%{par}" if par else "")
    hdr = [f"#SBATCH --job-name={name}", f"#SBATCH --array={arr}",
           f"#SBATCH --output={root}/slurm/logs/%x-%A_%a.out", "#SBATCH --open-mode=append",
           "#SBATCH --ntasks=1", f"#SBATCH --gpus-per-task={s.get('gpus_per_task', 1)}",
           f"#SBATCH --signal=B:USR1@{s.get('signal_seconds', 120)}", "#SBATCH --requeue"]
    for key, flag in (("cpus_per_task", "cpus-per-task"), ("time", "time"), ("mem", "mem"),
                      ("partition", "partition"), ("account", "account"), ("qos", "qos")):
        if s.get(key) is not None:
            hdr.append(f"#SBATCH --{flag}={s[key]}")
    hdr += [f"#SBATCH {x}" for x in s.get("sbatch", [])]
    listed = "\n".join(f"  {shlex.quote(n)}" for n in names)
    body = ["set -eo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}", *s.get("setup", []),
            "# the runs of this array, by task id: held here, so a regenerated plan never changes a submitted task",
            f"NAMES=(\n{listed}\n)", 'NAME=${NAMES[$SLURM_ARRAY_TASK_ID]}',
            'echo "$(date -u +%FT%TZ) task ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}: ${NAME} on $(hostname)'
            ' (restart ${SLURM_RESTART_COUNT:-0})"',
            # exec: the trainer is the batch shell, so it receives USR1, saves and requeues itself
            f'exec {shlex.quote(python)} -m hybrid_lm.scaling.launch --root {shlex.quote(str(root))} --job "$NAME"']
    return "#!/bin/bash\n" + "\n".join(hdr) + "\n\n" + "\n".join(body) + "\n"


# ----------------------------------------------------------------------------- worker entry point

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_lm.scaling.launch", description="run one job of a sweep")
    ap.add_argument("--root", required=True, help="sweep root (holds sweep.json)")
    ap.add_argument("--job", required=True, help="job name (run id) from sweep.json")
    args = ap.parse_args(argv)

    with signals.catching():  # for the whole job: a signal between two segments is seen by the next one
        try:
            rc = _work(args)
        except (SweepError, ConfigError, WorkdirError, DataError, ImportError, OSError,
                distributed.ClusterError) as e:  # one line; a bug still shows its traceback
            print(f"error: job {args.job}: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
            rc = 1
    distributed.leave_if_failing(rc)
    return rc


def _work(args) -> int:
    read_manifest(args.root)
    jobs = {j.name: j for j in manifest_jobs(args.root)}
    if args.job not in jobs:
        print(f"error: no job {args.job!r} in {args.root}/sweep.json", file=sys.stderr)
        return 2
    r = run_job(Path(args.root), jobs[args.job], jobs)
    if r.get("requeued"):
        print(r["requeued"], file=sys.stderr)
    print(json.dumps(r, default=str))
    return 3 if r["status"] == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
