"""Progress bars on a terminal only: redirected to a log file, a tqdm bar is a stream of
carriage-return updates; there, long loops print plain lines instead (:class:`JobLines`). No jax here."""

from __future__ import annotations

import sys
import time


def bar_disabled(progress: bool = True) -> bool | None:
    """tqdm's ``disable`` for a bar shown when ``progress``: None, which turns the bar off when its
    stream (stderr by default) is not a terminal."""
    return None if progress else True


def plain_lines(progress: bool = True) -> bool:
    """True where a bar asked for (``progress``) is not drawn because stderr is not a terminal: the
    place for plain progress lines."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(progress) and not (isatty is not None and isatty())


class JobLines:
    """One plain line on stderr per job start and end (``job 2/6 NAME: started``, ``... done in 12.3 s``,
    ``... failed (WHY), log: PATH``) where the bar that names the running job is not drawn
    (:func:`plain_lines`); silent on a terminal."""

    def __init__(self, total: int, progress: bool = True):
        self.total, self.on = total, plain_lines(progress)
        self._started: dict[str, tuple[int, float]] = {}

    def _line(self, name: str, what: str) -> None:
        if self.on:
            print(f"job {self._started[name][0]}/{self.total} {name}: {what}", file=sys.stderr, flush=True)

    def start(self, name: str, where: str = "") -> None:
        self._started[name] = (len(self._started) + 1, time.time())
        self._line(name, "started" + (f" {where}" if where else ""))

    def done(self, name: str) -> None:
        self._line(name, f"done in {time.time() - self._started[name][1]:.1f} s")

    def failed(self, name: str, why: str, log=None) -> None:
        self._line(name, f"failed ({why})" + (f", log: {log}" if log else ""))

    def not_started(self, name: str, why: str) -> None:
        if self.on:
            print(f"job {name}: not started ({why})", file=sys.stderr, flush=True)

    def stopped(self, name: str, why: str) -> None:
        self._line(name, f"stopped ({why}) after {time.time() - self._started[name][1]:.1f} s")
