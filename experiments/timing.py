"""Device timing and check helpers shared by the benchmarks in ``experiments/`` (imported as a sibling module)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
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


class GpuSampler:
    """``nvidia-smi`` sampling the SM clock (MHz) and power (W) every ``ms`` milliseconds while the block runs;
    inert without ``nvidia-smi``. The H200 is power-limited: on real-valued data it holds ~690 W at ~1480 MHz, on
    NaN or zeros ~1800 MHz (``bench_data_power.py``), so a clock beside a time says which regime it ran in."""

    def __init__(self, ms: int = 100):
        self.ms, self.proc = ms, None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", f"-lms={self.ms}"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            for line in out.splitlines():
                try:
                    self.samples.append(tuple(float(x) for x in line.split(",")))
                except ValueError:  # a partial line at termination, or "[N/A]"
                    continue

    def means(self) -> dict:
        if not self.samples:
            return {"sm_clock_mhz": None, "power_w": None, "smi_samples": 0}
        # the first samples precede the loop's steady state: drop the first quarter
        s = self.samples[len(self.samples) // 4:] or self.samples
        return {"sm_clock_mhz": sum(x[0] for x in s) / len(s), "power_w": sum(x[1] for x in s) / len(s),
                "smi_samples": len(s)}
