"""One line instead of XLA's abort when process 0 of a multi-process run dies.

Process 0 hosts JAX's coordination service. When it dies, XLA's coordination client in every other
process logs a fatal error from C++ ("Terminating process because the JAX distributed service detected
fatal errors ... the leader task was preempted/died") with a stack trace and aborts the process: Python
never runs again there, and jaxlib offers no callback that survives it. So the other processes' stderr
goes through a small child process (this file, run as a script: the standard library only, started
before ``jax.distributed.initialize``) that passes every byte through unchanged, except that fatal
message, which it replaces with one line saying which process was lost and that a rerun resumes.

The child ignores the stop signals (they are the trainer's) and ends when the stderr pipe closes: when
the trainer exits (:func:`install`'s restore runs first on a normal or abrupt exit, and waits for the
child to write what it holds), or is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

# XLA's log lines: severity letter, MMDD, time, thread id, file:line]
_GLOG = re.compile(rb"^[IWEF]\d{4} ")
# only the loss of the leader (process 0) is replaced; other fatal errors pass through as XLA wrote them
_FATAL = re.compile(rb"^F\d{4} [^\]]*\] Terminating process because the JAX distributed service detected fatal "
                    rb"errors.*the leader task")
RECENT = 5  # lines: an `error:` line of the trainer this close before the fatal message already said it
_POLLED = re.compile(rb"^E\d{4} [^\]]*coordination_service_agent\.cc:\d+\] Polled an error from coordination service")


def _could_open_a_log_line(fragment: bytes) -> bool:
    """Whether an unfinished line may still turn out to be an XLA log line (held until it ends)."""
    if fragment[:1] not in (b"I", b"W", b"E", b"F"):
        return False
    digits = fragment[1:5]  # MMDD, maybe not all of it yet
    if digits and not digits.isdigit():
        return False
    return len(fragment) <= 5 or fragment[5:6] == b" "


def _line_end(buf: bytes) -> int:
    ends = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
    return min(ends) if ends else -1


def relay(src: int, dst: int, line: bytes) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends; replace XLA's coordination-loss fatal message (and the
    error line that announces it) with ``line``, unless the trainer already printed its own ``error:``."""
    held = b""  # "Polled an error": shown only if no fatal line follows
    buf, sent = b"", 0  # the unfinished line, and how much of it went out already (progress bars)
    since_error = RECENT + 1  # lines since the trainer's last `error:` line

    def out(data: bytes) -> None:
        while data:
            data = data[os.write(dst, data):]

    while chunk := os.read(src, 1 << 16):
        buf += chunk
        while (nl := _line_end(buf)) >= 0:  # a progress bar's \r ends a line too
            ln, buf = buf[: nl + 1], buf[nl + 1:]
            if sent:  # its start went out as a fragment: not a log line
                out(ln[sent:])
                sent = 0
                continue
            if _FATAL.match(ln):
                if since_error > RECENT:
                    out(line)
                while os.read(src, 1 << 16):  # the stack trace and anything after it: dropped
                    pass
                return
            if held:
                out(held)
                held = b""
            if _POLLED.match(ln):
                held = ln
                continue
            since_error = 0 if ln.startswith(b"error: ") else since_error + 1
            out(ln)
        if buf and not _could_open_a_log_line(buf):
            out(held + buf[sent:])  # a held line came first
            held, sent = b"", len(buf)
    out(held + buf[sent:])


def install(process_id: int, num_processes: int, coordinator: str):
    """Route this process's stderr (fd 2) through the relay; returns ``restore()``, which puts fd 2 back
    and waits for the relay to finish writing. No-op (returns None) where there is no fd 2 to route."""
    try:
        os.fstat(2)
    except OSError:
        return None
    line = (f"error: lost process 0 of {num_processes} (the coordinator, {coordinator}): it stopped (killed, out "
            f"of memory, or its host failed) or its network did; stopping process {process_id} of {num_processes} "
            "too. Nothing saved is lost: rerun the same command on every process to resume from the newest "
            "checkpoint\n")
    sys.stderr.flush()
    child = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), line], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL)
    saved = os.dup(2)
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    done = []

    def restore() -> None:
        if done:
            return
        done.append(True)
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - leaving: nothing to report to
            pass
        os.dup2(saved, 2)  # closes this process's end of the pipe: the relay reads to its end, then exits
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a child process of the trainer still holds the pipe
            pass

    return restore


if __name__ == "__main__":
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, getattr(signal, "SIGUSR1", signal.SIGTERM)):
        signal.signal(s, signal.SIG_IGN)
    relay(0, 2, sys.argv[1].encode())
