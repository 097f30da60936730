"""Progress bars on a terminal only: redirected to a log file, a tqdm bar is a stream of
carriage-return updates. No jax here."""

from __future__ import annotations


def bar_disabled(progress: bool = True) -> bool | None:
    """tqdm's ``disable`` for a bar shown when ``progress``: None, which turns the bar off when its
    stream (stderr by default) is not a terminal."""
    return None if progress else True
