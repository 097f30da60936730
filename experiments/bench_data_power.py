"""Does a matmul's speed depend on the values it multiplies? One bf16 GEMM timed on operands of several kinds,
with the GPU's SM clock and power draw sampled by ``nvidia-smi`` while it runs.

    python experiments/bench_data_power.py --size 8192 --seconds 8 --out $OUT/data_power.json

Session 21 found a train step 0.883x faster once its loss was NaN, with kernels that never saw the change
(cuDNN attention, the MLP matmuls) 13-15% faster. The likely cause is the power limit: operands that toggle fewer
bits draw less power, so the clock stays higher. This script measures that on one GEMM. Kinds: ``normal`` (N(0, 1)),
``init`` (N(0, 0.02^2), like freshly initialised weights times activations), ``zeros`` and ``nan``. "vs normal" is
each kind's time over the ``normal`` time of the same run. Without ``nvidia-smi`` (the CPU) the clock and power
columns are empty.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import GpuSampler, median_ms  # noqa: E402

KINDS = ("normal", "init", "zeros", "nan")
def operands(kind: str, n: int):
    """Two ``[n, n]`` bf16 operands of the given kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown operand kind {kind!r}; expected one of {KINDS}")
    ka, kb = jax.random.split(jax.random.key(0))
    if kind in ("normal", "init"):
        std = 1.0 if kind == "normal" else 0.02
        return tuple((std * jax.random.normal(k, (n, n), jnp.float32)).astype(jnp.bfloat16) for k in (ka, kb))
    fill = 0.0 if kind == "zeros" else float("nan")
    return tuple(jnp.full((n, n), fill, jnp.bfloat16) for _ in range(2))


def run(kind: str, n: int, seconds: float) -> dict:
    a, b = operands(kind, n)
    mm = jax.jit(lambda x, y: x @ y)
    one, _ = median_ms(mm, (a, b), reps=3, inner=5)  # compile, warm up, and size the loop
    inner = max(1, int(1e3 * seconds / max(one, 1e-3) / 5))
    with GpuSampler() as smp:
        ms, _ = median_ms(mm, (a, b), reps=5, inner=inner, warmup=1)
    return {"kind": kind, "size": n, "ms": ms, "tflops": 2 * n ** 3 / (ms * 1e-3) / 1e12, **smp.means()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192, help="n of the [n, n] x [n, n] bf16 GEMM")
    ap.add_argument("--seconds", type=float, default=8.0, help="about how long each kind runs while sampled")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {KINDS}")
    ap.add_argument("--out", default="data_power.json")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad or args.size < 1 or args.seconds <= 0:
        ap.error(f"--kinds {bad} not in {KINDS}" if bad else "--size and --seconds must be positive")
    t0 = time.time()
    rows = [run(k, args.size, args.seconds) for k in kinds]
    ref = next((r["ms"] for r in rows if r["kind"] == "normal"), None)
    print(f"device: {jax.devices()[0].device_kind}   bf16 GEMM {args.size}^3")
    print(f"{'kind':<8}{'ms':>9}{'TF/s':>8}{'vs normal':>11}{'SM MHz':>8}{'W':>7}")
    for r in rows:
        r["vs_normal"] = None if ref is None else r["ms"] / ref
        vs = "" if r["vs_normal"] is None else f"{r['vs_normal']:.3f}x"
        mhz = "" if r["sm_clock_mhz"] is None else f"{r['sm_clock_mhz']:.0f}"
        w = "" if r["power_w"] is None else f"{r['power_w']:.0f}"
        print(f"{r['kind']:<8}{r['ms']:>9.3f}{r['tflops']:>8.1f}{vs:>11}{mhz:>8}{w:>7}")
    Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "size": args.size,
                                          "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "wall_s": time.time() - t0, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
