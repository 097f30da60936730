"""The signals a run reacts to, caught from the start of a run (or of the command) to its end.

- ``SIGTERM`` (a scheduler's preemption, ``kill``): save a checkpoint after the current step and exit
  cleanly; before the first step there is nothing new to save, so the run just stops.
- ``SIGUSR1`` (SLURM's ``--signal=B:USR1@<s>``): the same, then requeue the job (an array task: that
  task only, ``<array job id>_<task id>``).
- ``SIGINT`` (Ctrl-C): the first acts as ``SIGTERM``; a second one exits at once, without a traceback
  (the newest committed checkpoint is kept; a save in flight is dropped, never half-committed).

One set of handlers per process: nested :func:`catching` blocks share it, so a signal that arrives
between two runs of one process (a sweep's stable-run segments) stops the next run at its first step.
A thread reads Python's signal wakeup fd, so a signal is seen while the main thread is inside a long
computation or a save (a second Ctrl-C then ends the process at once). In a multi-process run the
processes agree on the signal (the train loop gathers it each step), so a signal that reaches any
process stops all of them, and a ``SIGUSR1`` on any process requeues the job once (process 0 calls
``scontrol``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

CAUGHT = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_URGENCY = {signal.SIGINT: 1, signal.SIGTERM: 2, signal.SIGUSR1: 3}  # USR1 (requeue) wins when several arrive


def most_urgent(codes) -> int | None:
    """The signal a set of processes acts on: SIGUSR1 if any process got one, else SIGTERM, else SIGINT."""
    found = [int(c) for c in codes if int(c) in _URGENCY]
    return max(found, key=_URGENCY.__getitem__) if found else None


class PreemptionFlag:
    """What the process was asked to do: ``signal`` is the most urgent stop signal received (or None)."""

    def __init__(self):
        self.signal: int | None = None
        self.interrupts = 0  # SIGINTs received

    def _handle(self, signum, frame=None):
        del frame
        if self.signal is None or _URGENCY.get(signum, 0) > _URGENCY.get(self.signal, 0):
            self.signal = signum

    def request(self, signum: int) -> None:
        """Ask for a stop as if ``signum`` had arrived (a deadline: ``hybrid-lm sweep --max-minutes``)."""
        self._handle(signum)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signal).name if self.signal else None

    def reset(self) -> None:
        self.signal, self.interrupts = None, 0


# ----------------------------------------------------------------------------- leaving at once

_EXIT_HOOKS: list = []  # run before an abrupt exit (os._exit): release the workdir lock, tell the other processes


def on_abrupt_exit(fn) -> None:
    _EXIT_HOOKS.append(fn)


def drop_abrupt_exit(fn) -> None:
    with contextlib.suppress(ValueError):
        _EXIT_HOOKS.remove(fn)


def exit_now(line: str | None, code: int) -> None:
    """Print ``line`` (one line, stderr), run the abrupt-exit hooks, and end the process with ``code``
    without unwinding: for a second Ctrl-C, and for a multi-process run whose peer failed (a normal
    exit would wait on JAX's shutdown barrier for processes that are gone)."""
    if line:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
    for fn in list(reversed(_EXIT_HOOKS)):
        with contextlib.suppress(Exception):
            fn()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- the handlers

class _Handlers:
    """The process-wide handlers and the thread that reads the wakeup fd."""

    def __init__(self):
        self.flag = PreemptionFlag()
        self.depth = 0
        self.installed = False
        self._old: dict = {}
        self._old_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.requeued = False  # a requeue was asked for: SLURM's SIGTERM that ends this job is expected

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; a run elsewhere is not signalled
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in CAUGHT:
            self._old[sig] = signal.signal(sig, self.flag._handle)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(r,), name="hybrid_lm signals", daemon=True)
        self._thread.start()
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, old in self._old.items():
            # after a requeue SLURM ends the job with SIGTERM: ignored for the rest of the process, so that
            # no process of the job dies on it before all have passed JAX's shutdown barrier
            signal.signal(sig, signal.SIG_IGN if self.requeued and sig == signal.SIGTERM else old)
        self._old.clear()
        r, w = self._pipe
        os.close(w)  # the watcher reads EOF and ends
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(r)
        self._pipe, self._thread, self.installed = None, None, False

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum not in _URGENCY:
            return
        self.flag._handle(signum)
        if signum != signal.SIGINT:
            return
        self.flag.interrupts += 1
        if self.flag.interrupts >= 2:
            exit_now("interrupted again: exiting now without saving (the newest committed checkpoint is kept; "
                     "run the same command to resume from it)", 130)
        elif sys.stderr.isatty():
            print("\nCtrl-C: stopping after this step with a checkpoint (press Ctrl-C again to exit at once)",
                  file=sys.stderr, flush=True)


_HANDLERS = _Handlers()


@contextlib.contextmanager
def catching():
    """The process's :class:`PreemptionFlag`, with SIGTERM / SIGUSR1 / SIGINT caught for the block (the
    outermost block installs the handlers and, at its end, restores the old ones and clears the flag)."""
    h = _HANDLERS
    if h.depth == 0:
        h.flag.reset()
        h.install()
    h.depth += 1
    try:
        yield h.flag
    finally:
        h.depth -= 1
        if h.depth == 0:
            h.uninstall()
            h.flag.reset()


def current_flag() -> PreemptionFlag:
    return _HANDLERS.flag


def expect_requeue() -> None:
    """The run stopped for a requeue (SIGUSR1 on any process): SLURM's SIGTERM that follows is ignored
    once the handlers are uninstalled."""
    _HANDLERS.requeued = True


# ----------------------------------------------------------------------------- SLURM requeue

def slurm_job(env=None) -> str | None:
    """What ``scontrol requeue`` must name for this job: ``<array job id>_<task id>`` for an array task
    (the array job id alone would requeue every task of the array), else ``SLURM_JOB_ID``; None outside SLURM."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def requeue() -> str:
    """Requeue this SLURM job (``scontrol requeue``); returns one line saying what happened. SLURM then
    ends the running job (SIGTERM, then SIGKILL after its KillWait) and starts it again later."""
    job = slurm_job()
    if job is None:
        return "not running under SLURM (no SLURM_JOB_ID): nothing to requeue"
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not requeue SLURM job {job}: {e}"
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return f"could not requeue SLURM job {job}: scontrol exited {r.returncode}" + (f" ({why[-1]})" if why else "")
    return f"requeued SLURM job {job}"
