"""One trainer per workdir: ``<workdir>/.lock``, created atomically (``O_CREAT | O_EXCL``), records the
holder's host, pid and start time, and under SLURM its job (``<array job>_<task>`` or the job id) and
restart count. A lock is stale, and taken over with a warning, when:

- its pid is not running on this host, or runs a process started after the lock was taken (the pid was
  reused: ``/proc/<pid>/stat``);
- it was taken by an earlier run of this same SLURM job (a lower ``SLURM_RESTART_COUNT``, or a start
  before this run's ``SLURM_JOB_START_TIME``): SLURM ended that run before requeueing the job, so a
  requeue (or a node failure) that lands the job on another node resumes instead of refusing;
- it was taken on another host (whose processes this host cannot see) and is older than
  ``HYBRID_LM_LOCK_STALE_HOURS`` (default 24). A lock whose pid runs on this host is never stale by age:
  runs last days.

The host is ``socket.gethostname()``, or ``HYBRID_LM_HOSTNAME`` where set. A lock held by this process
is released also when the process ends abruptly (a second Ctrl-C, a failed peer process)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from hybrid_lm.errors import WorkdirError
from hybrid_lm import signals

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


def _stale_seconds() -> float:
    return 3600.0 * float(os.environ.get("HYBRID_LM_LOCK_STALE_HOURS", "24"))


def hostname() -> str:
    return os.environ.get("HYBRID_LM_HOSTNAME") or socket.gethostname()


def _slurm_restart() -> int:
    raw = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    return int(raw) if raw.isdigit() else 0


def _slurm_record() -> dict:
    job = signals.slurm_job()
    return {"slurm_job": job, "slurm_restart": _slurm_restart()} if job else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _process_start(pid: int) -> float | None:
    """When ``pid``'s process started (Unix time, to about a second), from ``/proc``; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, after the command's name
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _pid_holds(holder: dict) -> bool | None:
    """Whether the lock ``holder`` taken on this host is still held by its process: False when its pid is
    not running or runs a process started after the lock (a reused pid), None where the start is unknown."""
    pid, started = holder["pid"], holder.get("started")
    if not _pid_alive(pid):
        return False
    begun = _process_start(pid)
    if begun is None or not isinstance(started, (int, float)):
        return None
    return begun <= started + 2.0  # /proc's boot time has a resolution of one second


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or unreadable: judged by its age alone


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}{job} since "
            f"{holder.get('started_utc', '?')}")


def _why_stale(path: Path, holder: dict) -> str | None:
    """Why the lock ``holder`` read from ``path`` is stale, or None while it is live."""
    here = holder.get("host") == hostname() and isinstance(holder.get("pid"), int)
    if here and not _pid_alive(holder["pid"]):
        return f"its pid {holder['pid']} is not running on this host"
    if here and _pid_holds(holder) is False:
        return f"its pid {holder['pid']} now runs a process started after the lock was taken"
    job = signals.slurm_job()
    if job and holder.get("slurm_job") == job:
        theirs, ours = holder.get("slurm_restart"), _slurm_restart()
        if isinstance(theirs, int) and theirs < ours:
            return (f"it was taken by run {theirs} of SLURM job {job}, which SLURM ended before this run "
                    f"(SLURM_RESTART_COUNT={ours}) started")
        start = os.environ.get("SLURM_JOB_START_TIME", "").strip()
        if start.isdigit() and isinstance(holder.get("started"), (int, float)) and holder["started"] < int(start) - 1:
            return f"it was taken before SLURM started this run of job {job} (SLURM_JOB_START_TIME={start})"
    if here:  # its process runs on this host: live however old
        return None
    try:
        age = time.time() - float(holder.get("started", path.stat().st_mtime))
    except (OSError, ValueError, TypeError):
        return None
    if age > _stale_seconds():
        return f"it is {age / 3600:.1f} h old (HYBRID_LM_LOCK_STALE_HOURS={_stale_seconds() / 3600:g})"
    return None


class WorkdirLock:
    def __init__(self, workdir: Path):
        self.path = Path(workdir) / LOCK_NAME
        self.record = {"host": hostname(), "pid": os.getpid(), "started": time.time(),
                       "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "token": uuid.uuid4().hex, **_slurm_record()}
        self.held = False

    def acquire(self) -> WorkdirLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                if self._create():
                    self.held = True
                    signals.on_abrupt_exit(self.release)
                    return self
                holder = _read(self.path)
                if holder is None:  # released meanwhile
                    continue
                why = _why_stale(self.path, holder)
                if why is None:
                    raise WorkdirError(f"{self.path.parent} is in use by another trainer ({_describe(holder)}); "
                                       f"wait for it to finish, or remove {self.path} if it is gone")
                self._take_over(holder, why)
        except PermissionError as e:
            raise WorkdirError(f"cannot write the lock {self.path}: {e.strerror or e}") from e
        raise WorkdirError(f"could not take the lock {self.path}: other trainers keep taking it")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self, holder: dict, why: str) -> None:
        """Move the stale lock aside; if what moved is not the lock judged stale (another trainer
        took it over meanwhile), put it back."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{self.record['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != holder:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # fails if a lock exists again: then that one holds
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        log.warning("taking over the stale lock %s (%s): %s", self.path, _describe(holder), why)

    def release(self) -> None:
        if self.held and _read(self.path) == self.record:
            self.path.unlink(missing_ok=True)
        self.held = False
        signals.drop_abrupt_exit(self.release)


@contextlib.contextmanager
def workdir_lock(workdir: Path, enabled: bool = True):
    """Hold ``workdir``'s lock for the block (only where ``enabled``: process 0 of a job)."""
    lock = WorkdirLock(workdir).acquire() if enabled else None
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
