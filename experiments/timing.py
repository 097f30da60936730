"""Device timing and check helpers shared by the benchmarks in ``experiments/`` (imported as a sibling module)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp


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


def rel_l2(a, b) -> float:
    """Relative L2 error of ``a`` against the reference ``b`` (in fp32)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def print_checks(rows) -> None:
    """One ``PASS`` / ``FAIL`` line per check row (a row with an ``ok`` key), its fields as JSON."""
    for r in rows:
        if "ok" in r:
            print(("PASS " if r["ok"] else "FAIL ") + json.dumps({k: v for k, v in r.items() if k != "ok"}))


def finish_checked(out: str, rows: list[dict], t0: float, **meta) -> None:
    """Write ``{"device", "utc", **meta, "wall_s", "ok", "rows"}`` to ``out``, print the verdict of the
    check rows and exit with status 1 if any failed (the kernel benchmarks' common end)."""
    ok = all(r["ok"] for r in rows if "ok" in r)
    with open(out, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   **meta, "wall_s": time.time() - t0, "ok": ok, "rows": rows}, fh, indent=2)
    print("checks:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
