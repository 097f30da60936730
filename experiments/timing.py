"""Device timing shared by the benchmarks in ``experiments/`` (imported as a sibling module)."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, args, reps: int, inner: int, warmup: int = 3):
    """``(median, all)`` ms per call of ``fn(*args)``: ``warmup`` calls, then ``reps`` repetitions
    of ``inner`` back-to-back calls closed by ``block_until_ready`` (dispatch overlaps device work,
    so for calls of more than a few tens of microseconds this is device time)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(times), times
