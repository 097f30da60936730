#!/usr/bin/env python
"""RMSNorm on the local accelerator: XLA (autodiff of the plain norm) against the one-pass Pallas kernels.

    python3 experiments/bench_norm.py --out $OUT/bench_norm.json                 # GPU, about a minute
    python3 experiments/bench_norm.py --tokens 256 --d 96 --launches 2:4:3 --reps 2 --inner 1   # CPU smoke

Two parts, each printed as a table and written to ``--out``:

1. **check** (always): ``hybrid_lm_kernels.rms_norm_fwd`` / ``rms_norm_bwd`` at each launch against
   ``ops.norm``'s references on random bf16 rows (a tail of rows no launch divides), and
   ``rms_norm(kernel='pallas')`` under ``jax.vjp`` against autodiff of ``kernel='xla'``. Exit status 1
   if any check fails.
2. **time**: ``--tokens`` rows of each width in ``--d`` (S1 384, S3 640, S5 1280), bf16: the forward
   alone and forward + backward (``jax.vjp`` then the pullback, as a train step runs a norm; under
   remat the step runs the forward once more). Variants: ``xla`` (autodiff of the plain norm, what
   the model ran before the kernels), ``xla closed form`` (the kernels' references jitted: the same
   passes in XLA), and each kernel launch ``ROWS:WARPS:PROGRAMS``. GB/s counts the bytes a one-pass
   implementation must move: x read and y written forward; x and dy read and dx written backward.

On a CPU the kernels run interpreted: a smoke test at tiny sizes, numbers meaningless.
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

from hybrid_lm.ops.norm import rms_norm, rms_norm_bwd_reference, rms_norm_fwd_reference  # noqa: E402

EPS = 1e-6


def kernels():
    import hybrid_lm_kernels
    return hybrid_lm_kernels


def parse_launch(s: str) -> tuple[int, int, int]:
    br, w, p = (int(x) for x in s.split(":"))
    return br, w, p


def inputs(n, d, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(k[0], (n, d), jnp.float32)).astype(jnp.bfloat16)
    scale = 1.0 + 0.2 * jax.random.normal(k[1], (d,), jnp.float32)
    dy = jax.random.normal(k[2], (n, d), jnp.float32).astype(jnp.bfloat16)
    return x, scale, dy


def kernel_fns(launch):
    K = kernels()
    br, nw, p = launch
    fwd = jax.jit(lambda x, s: K.rms_norm_fwd(x, s, eps=EPS, block_rows=br, num_warps=nw))
    bwd = jax.jit(lambda x, s, r, dy: K.rms_norm_bwd(x, s, r, dy, block_rows=br, num_warps=nw, programs=p))
    return fwd, bwd


def check(args, launches) -> list[dict]:
    rows = []
    d = args.d[-1]
    n = min(args.tokens, 4096) + 3  # a tail of rows that is no multiple of any launch
    x, s, dy = inputs(n, d, seed=1)
    y_ref, r_ref = jax.jit(rms_norm_fwd_reference, static_argnums=2)(x, s, EPS)
    dx_ref, ds_ref = jax.jit(rms_norm_bwd_reference)(x, s, r_ref, dy)
    for launch in launches:
        fwd, bwd = kernel_fns(launch)
        y, r = fwd(x, s)
        dx, ds = bwd(x, s, r, dy)
        row = {"part": "check_kernels", "launch": ":".join(map(str, launch)), "rows": n, "d": d,
               "rstd_max_rel_err": float(jnp.max(jnp.abs(r - r_ref) / r_ref)), "y_rel_l2": rel_l2(y, y_ref),
               "dx_rel_l2": rel_l2(dx, dx_ref), "dscale_rel_l2": rel_l2(ds, ds_ref),
               "finite": bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32))))}
        # fp32 statistics in another order; y and dx rounded to bf16 (rel. L2 of bf16 rounding ~2e-3)
        row["ok"] = (row["finite"] and row["rstd_max_rel_err"] < 1e-5 and row["y_rel_l2"] < 5e-3
                     and row["dx_rel_l2"] < 5e-3 and row["dscale_rel_l2"] < 1e-4)
        rows.append(row)
    x3 = x[: (n // 8) * 8].reshape(8, -1, d)
    out = {}
    for kern in ("xla", "pallas"):
        y, vjp = jax.vjp(lambda x, s, kern=kern: rms_norm(x, s, EPS, kern), x3, s)
        out[kern] = (y, *vjp(dy[: x3.shape[0] * x3.shape[1]].reshape(x3.shape)))
    (yx, dxx, dsx), (yp, dxp, dsp) = out["xla"], out["pallas"]
    row = {"part": "check_vjp", "shape": list(x3.shape), "y_rel_l2": rel_l2(yp, yx), "dx_rel_l2": rel_l2(dxp, dxx),
           "dscale_rel_l2": rel_l2(dsp, dsx)}
    # the same math; y and dx rounded to bf16, the scale's gradient an fp32 sum on both sides
    row["ok"] = row["y_rel_l2"] < 5e-3 and row["dx_rel_l2"] < 5e-3 and row["dscale_rel_l2"] < 1e-4
    rows.append(row)
    return rows


def time_table(args, launches) -> list[dict]:
    rows = []
    for d in args.d:
        x, s, dy = inputs(args.tokens, d, seed=d)
        elems = x.size * x.dtype.itemsize
        variants = {}

        def plain(x, s, dy):
            y, vjp = jax.vjp(lambda x, s: rms_norm(x, s, EPS, "xla"), x, s)
            return y, vjp(dy)

        variants["xla"] = (jax.jit(lambda x, s: rms_norm(x, s, EPS, "xla")), jax.jit(plain))

        def closed(x, s, dy):
            y, r = rms_norm_fwd_reference(x, s, EPS)
            return y, rms_norm_bwd_reference(x, s, r, dy)

        variants["xla closed form"] = (jax.jit(lambda x, s: rms_norm_fwd_reference(x, s, EPS)), jax.jit(closed))
        for launch in launches:
            fwd, bwd = kernel_fns(launch)

            def both(x, s, dy, fwd=fwd, bwd=bwd):
                y, r = fwd(x, s)
                return y, bwd(x, s, r, dy)

            variants["pallas " + ":".join(map(str, launch))] = (fwd, jax.jit(both))
        for name, (fwd, both) in variants.items():
            f_ms, _ = median_ms(fwd, (x, s), reps=args.reps, inner=args.inner)
            b_ms, _ = median_ms(both, (x, s, dy), reps=args.reps, inner=args.inner)
            rows.append({"part": "time", "impl": name, "tokens": args.tokens, "d": d, "fwd_ms": f_ms,
                         "fwd_bwd_ms": b_ms, "fwd_gb_per_s": 2 * elems / (f_ms * 1e-3) / 1e9,
                         "fwd_bwd_gb_per_s": 5 * elems / (b_ms * 1e-3) / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072, help="rows (8 x 16K tokens)")
    ap.add_argument("--d", type=lambda s: [int(x) for x in s.split(",")], default=[384, 640, 1280])
    ap.add_argument("--launches", default="1:4:528,2:4:528,4:4:528,8:4:528,4:8:528,8:8:528,16:8:528,4:4:264,4:4:1056",
                    help="ROWS:WARPS:PROGRAMS launches of the kernels to check and time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default="bench_norm.json")
    args = ap.parse_args()
    K = kernels()
    launches = [parse_launch(s) for s in args.launches.split(",")]
    default = (K.rms_norm_pallas.NORM_BLOCK_ROWS, K.rms_norm_pallas.NORM_NUM_WARPS, K.rms_norm_pallas.NORM_BWD_PROGRAMS)
    print(f"device: {jax.devices()[0].device_kind}   default launch {':'.join(map(str, default))}")
    t0 = time.time()
    rows = check(args, launches)
    print_checks(rows)
    rows += time_table(args, launches)
    print(f"\n{'RMSNorm, ' + str(args.tokens) + ' rows bf16':<24}{'d':>6}{'fwd ms':>9}{'GB/s':>7}"
          f"{'fwd+bwd ms':>12}{'GB/s':>7}{'vs xla':>8}")
    base = {r["d"]: r["fwd_bwd_ms"] for r in rows if r.get("impl") == "xla"}
    for r in rows:
        if r["part"] == "time":
            print(f"{r['impl']:<24}{r['d']:>6}{r['fwd_ms']:>9.3f}{r['fwd_gb_per_s']:>7.0f}{r['fwd_bwd_ms']:>12.3f}"
                  f"{r['fwd_bwd_gb_per_s']:>7.0f}{r['fwd_bwd_ms'] / base[r['d']]:>8.3f}")
    finish_checked(args.out, rows, t0, default_launch=default)


if __name__ == "__main__":
    main()
