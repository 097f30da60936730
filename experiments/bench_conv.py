#!/usr/bin/env python
"""The recurrent mixers' short causal conv (+ SiLU) on the local accelerator: its backward in jnp against
the one-pass Pallas kernel (``hybrid_lm_kernels.short_conv_bwd``).

    python3 experiments/bench_conv.py --out $OUT/bench_conv.json                       # GPU, about a minute
    python3 experiments/bench_conv.py --batch 2 --seq 40 --channels 24 --launches 8:16:4:2 --reps 1 --inner 1  # CPU smoke

Two parts, each printed and written to ``--out``:

1. **check** (always): the kernel at each launch, without and with a bias, against the jnp backward
   (``model.recurrent_common._short_conv_bwd``) on random bf16 inputs with a time tail no launch divides,
   and the conv under ``jax.vjp`` with ``kernel='pallas'`` against autodiff of the plain conv. Exit
   status 1 if any check fails.
2. **time**: forward + backward (``jax.vjp`` then the pullback) of ``--batch`` x ``--seq`` tokens at each
   width in ``--channels`` (S5 GDN's q/k conv 960 and v conv 1920, S5 Mamba-2's 2816), bf16, K = 4,
   SiLU. Variants: ``autodiff`` (of the plain conv), ``jnp vjp`` (the hand-written backward in XLA, the
   default), and each kernel launch ``BLOCK_T:BLOCK_C:WARPS:TIME_PROGRAMS``. GB/s counts the bytes a
   one-pass implementation moves: x read and y written forward; x and dy read and dx written backward.

On a CPU the kernel runs interpreted: a smoke test at tiny sizes, numbers meaningless.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from timing import finish_checked, median_ms, print_checks, rel_l2

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybrid_lm.model import recurrent_common as rc  # noqa: E402

K_TAPS = 4


def parse_launch(s: str) -> tuple[int, int, int, int]:
    bt, bc, w, p = (int(x) for x in s.split(":"))
    return bt, bc, w, p


def inputs(B, T, C, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (B, T, C), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.uniform(k[1], (K_TAPS, C), jnp.float32, -0.5, 0.5)
    dy = jax.random.normal(k[2], (B, T, C), jnp.float32).astype(jnp.bfloat16)
    return x, w, dy


def kernel_bwd(launch):
    from hybrid_lm_kernels import short_conv_bwd
    bt, bc, nw, p = launch
    return jax.jit(lambda x, dy, w, b=None: short_conv_bwd(x, dy, w, b, silu=True, block_t=bt, block_c=bc,
                                                           num_warps=nw, time_programs=p))


def conv_vjp(kind: str, launch=None):
    """fwd + bwd of the conv (no bias, SiLU) as the model runs it: ``autodiff``, ``vjp`` (jnp) or ``pallas``."""
    def run(x, w, dy):
        if kind == "autodiff":
            f = lambda x, w: rc._short_conv_plain(x, w, None, "silu", jnp.zeros((x.shape[0], K_TAPS - 1, x.shape[2])))[0]
            y, pull = jax.vjp(f, x, w)
            return y, pull(dy)
        if kind == "pallas" and launch is not None:
            y = rc.short_conv(x, w, None, "silu", "xla")
            dx, dw, _ = kernel_bwd(launch)(x, dy, w)
            return y, (dx, dw)
        y, pull = jax.vjp(lambda x, w: rc.short_conv(x, w, None, "silu", kind), x, w)
        return y, pull(dy)
    return jax.jit(run)


def check(args, launches) -> list[dict]:
    rows = []
    C = args.channels[0]
    T = min(args.seq, 4096) + 3  # a time tail that is no multiple of any launch
    x, w, dy = inputs(2, T, C, seed=1)
    b = jax.random.normal(jax.random.key(2), (C,), jnp.float32)
    ref = jax.jit(lambda x, w, b, dy: rc._short_conv_bwd("silu", "xla", (x, w, b), dy))
    for bias in (None, b):  # GDN's convs have no bias, Mamba-2's has one
        dx_ref, dw_ref, db_ref = ref(x, w, bias, dy)
        for launch in launches:
            dx, dw, db = kernel_bwd(launch)(x, dy, w, bias)
            row = {"part": "check_kernel", "launch": ":".join(map(str, launch)), "shape": [2, T, C],
                   "bias": bias is not None, "dx_rel_l2": rel_l2(dx, dx_ref), "dw_rel_l2": rel_l2(dw, dw_ref),
                   "db_rel_l2": 0.0 if bias is None else rel_l2(db, db_ref),
                   "finite": bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32))))}
            # fp32 sums in another order; dx rounded to bf16 on both sides
            row["ok"] = (row["finite"] and row["dx_rel_l2"] < 5e-3 and row["dw_rel_l2"] < 1e-4
                         and row["db_rel_l2"] < 1e-4)
            rows.append(row)
    (y_a, (dx_a, dw_a)), (y_p, (dx_p, dw_p)) = conv_vjp("autodiff")(x, w, dy), conv_vjp("pallas")(x, w, dy)
    row = {"part": "check_vjp", "shape": [2, T, C], "y_rel_l2": rel_l2(y_p, y_a), "dx_rel_l2": rel_l2(dx_p, dx_a),
           "dw_rel_l2": rel_l2(dw_p, dw_a)}
    row["ok"] = row["y_rel_l2"] < 5e-3 and row["dx_rel_l2"] < 5e-3 and row["dw_rel_l2"] < 1e-4
    rows.append(row)
    return rows


def time_table(args, launches) -> list[dict]:
    rows = []
    for C in args.channels:
        x, w, dy = inputs(args.batch, args.seq, C, seed=C)
        elems = x.size * x.dtype.itemsize
        variants = {"autodiff": conv_vjp("autodiff"), "jnp vjp": conv_vjp("xla")}
        for launch in launches:
            variants["pallas " + ":".join(map(str, launch))] = conv_vjp("pallas", launch)
        for name, fn in variants.items():
            ms, _ = median_ms(fn, (x, w, dy), reps=args.reps, inner=args.inner)
            rows.append({"part": "time", "impl": name, "shape": [args.batch, args.seq, C], "channels": C,
                         "fwd_bwd_ms": ms, "gb_per_s": 5 * elems / (ms * 1e-3) / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--channels", type=lambda s: [int(x) for x in s.split(",")], default=[960, 1920, 2816])
    ap.add_argument("--launches", default="16:256:4:32,8:512:4:32,4:512:4:64,8:1024:8:16,8:256:2:64,16:512:8:32",
                    help="BLOCK_T:BLOCK_C:WARPS:TIME_PROGRAMS launches of the kernel to check and time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--out", default="bench_conv.json")
    args = ap.parse_args()
    from hybrid_lm_kernels import short_conv_pallas as scp
    launches = [parse_launch(s) for s in args.launches.split(",")]
    default = (scp.CONV_BLOCK_T, scp.CONV_BLOCK_C, scp.CONV_NUM_WARPS, scp.CONV_TIME_PROGRAMS)
    print(f"device: {jax.devices()[0].device_kind}   default launch {':'.join(map(str, default))}")
    t0 = time.time()
    rows = check(args, launches)
    print_checks(rows)
    rows += time_table(args, launches)
    print(f"\n{'conv fwd+bwd, bf16, K=4':<26}{'C':>6}{'ms':>9}{'GB/s':>7}{'vs jnp vjp':>12}")
    base = {r["channels"]: r["fwd_bwd_ms"] for r in rows if r.get("impl") == "jnp vjp"}
    for r in rows:
        if r["part"] == "time":
            print(f"{r['impl']:<26}{r['channels']:>6}{r['fwd_bwd_ms']:>9.3f}{r['gb_per_s']:>7.0f}"
                  f"{r['fwd_bwd_ms'] / base[r['channels']]:>12.3f}")
    finish_checked(args.out, rows, t0, default_launch=default)


if __name__ == "__main__":
    main()
