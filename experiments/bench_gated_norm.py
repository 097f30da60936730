#!/usr/bin/env python
"""GDN's gated output norm on the local accelerator: what the model ran (slice of the kernel's padded output,
cast, plain norm, autodiff) against the one-pass Pallas kernels that read the padded rows in place.

    python3 experiments/bench_gated_norm.py --out $OUT/bench_gated_norm.json      # GPU, about a minute
    python3 experiments/bench_gated_norm.py --rows 512 --launches 4:4:3 --reps 2 --inner 1   # CPU smoke

Two parts, each printed as a table and written to ``--out``:

1. **check** (always): ``hybrid_lm_kernels.gated_rms_norm_fwd`` / ``_bwd`` at each launch against
   ``ops.norm``'s references on random bf16 rows (a tail no launch divides), and
   ``gated_rms_norm(kernel='pallas')`` under ``jax.vjp`` against autodiff of ``kernel='xla'``. Exit
   status 1 if any check fails.
2. **time**: ``--rows`` head rows (S5 GDN at 4 x 16K: 655,360) of ``--d`` values read from ``--width``
   columns, bf16, forward + backward (``jax.vjp`` then the pullback). Variants: ``xla`` (the model's
   path before the kernel: ``o[..., :d].astype(f32)``, the plain norm, autodiff), ``xla padded`` (the
   plain norm on the padded rows, as the model runs it under ``gated_norm_kernel='xla'`` now) and each
   kernel launch ``ROWS:WARPS:PROGRAMS``. GB/s counts what a one-pass implementation moves: forward x
   (width), z read and y written; backward x, z, dy read and dx (width), dz written.

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

from hybrid_lm.ops.norm import (gated_rms_norm, gated_rms_norm_bwd_reference,  # noqa: E402
                                gated_rms_norm_fwd_reference)

EPS = 1e-5


def kernels():
    import hybrid_lm_kernels
    return hybrid_lm_kernels


def inputs(n, d, width, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jnp.pad(3.0 * jax.random.normal(k[0], (n, d), jnp.float32), ((0, 0), (0, width - d))).astype(jnp.bfloat16)
    z = (2.0 * jax.random.normal(k[1], (n, d), jnp.float32)).astype(jnp.bfloat16)
    scale = 1.0 + 0.2 * jax.random.normal(k[2], (d,), jnp.float32)
    dy = jax.random.normal(k[3], (n, d), jnp.float32).astype(jnp.bfloat16)
    return x, z, scale, dy


def kernel_fns(launch):
    K = kernels()
    br, nw, p = launch
    fwd = jax.jit(lambda x, z, s: K.gated_rms_norm_fwd(x, z, s, eps=EPS, block_rows=br, num_warps=nw))
    bwd = jax.jit(lambda x, z, s, r, dy: K.gated_rms_norm_bwd(x, z, s, r, dy, block_rows=br, num_warps=nw,
                                                              programs=p))
    return fwd, bwd


def check(args, launches) -> list[dict]:
    rows = []
    n = min(args.rows, 65536) + 3  # a tail of rows that is no multiple of any launch
    x, z, s, dy = inputs(n, args.d, args.width, seed=1)
    y_ref, r_ref = jax.jit(gated_rms_norm_fwd_reference, static_argnums=3)(x, z, s, EPS)
    dx_ref, dz_ref, ds_ref = jax.jit(gated_rms_norm_bwd_reference)(x, z, s, r_ref, dy)
    for launch in launches:
        fwd, bwd = kernel_fns(launch)
        y, r = fwd(x, z, s)
        dx, dz, ds = bwd(x, z, s, r, dy)
        row = {"part": "check_kernels", "launch": ":".join(map(str, launch)), "rows": n, "d": args.d,
               "width": args.width, "rstd_max_rel_err": float(jnp.max(jnp.abs(r - r_ref) / r_ref)),
               "y_rel_l2": rel_l2(y, y_ref), "dx_rel_l2": rel_l2(dx, dx_ref), "dz_rel_l2": rel_l2(dz, dz_ref),
               "dscale_rel_l2": rel_l2(ds, ds_ref), "pad_grad_zero": bool(jnp.all(dx[:, args.d:] == 0)),
               "finite": bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32))) & jnp.all(jnp.isfinite(dz.astype(jnp.float32))))}
        # fp32 statistics in another order; y, dx, dz rounded to bf16 (rel. L2 of bf16 rounding ~2e-3)
        row["ok"] = (row["finite"] and row["pad_grad_zero"] and row["rstd_max_rel_err"] < 1e-5
                     and max(row["y_rel_l2"], row["dx_rel_l2"], row["dz_rel_l2"]) < 5e-3 and row["dscale_rel_l2"] < 1e-4)
        rows.append(row)
    shape = (8, -1, 4)  # [B, T, H] head rows
    m = (n // 32) * 32
    x4, z4, dy4 = (a[:m].reshape(*shape, a.shape[-1]) for a in (x, z, dy))
    out = {}
    for kern in ("xla", "pallas"):
        y, vjp = jax.vjp(lambda x, z, s, kern=kern: gated_rms_norm(x, z, s, EPS, kern), x4, z4, s)
        out[kern] = (y, *vjp(dy4))
    names = ("y", "dx", "dz", "dscale")
    row = {"part": "check_vjp", "shape": list(x4.shape)}
    row.update({f"{k}_rel_l2": rel_l2(a, b) for k, a, b in zip(names, out["pallas"], out["xla"])})
    row["ok"] = max(row[f"{k}_rel_l2"] for k in names[:3]) < 5e-3 and row["dscale_rel_l2"] < 1e-4
    rows.append(row)
    return rows


def time_table(args, launches) -> list[dict]:
    rows = []
    x, z, s, dy = inputs(args.rows, args.d, args.width, seed=2)
    nbytes = 2 * args.rows  # bf16
    fwd_bytes = nbytes * (args.width + 2 * args.d)
    bwd_bytes = nbytes * (2 * args.width + 4 * args.d)
    d = args.d

    def sliced(x, z, s):  # the model before the kernel: slice + fp32 copy of the kernel's output, then the norm
        return gated_rms_norm(x[:, :d].astype(jnp.float32), z, s, EPS, "xla")

    def vjp_of(f):
        def both(x, z, s, dy):
            y, vjp = jax.vjp(f, x, z, s)
            return y, vjp(dy)
        return jax.jit(both)

    variants = {"xla": vjp_of(sliced),
                "xla padded": vjp_of(lambda x, z, s: gated_rms_norm(x, z, s, EPS, "xla"))}
    for launch in launches:
        fwd, bwd = kernel_fns(launch)

        def both(x, z, s, dy, fwd=fwd, bwd=bwd):
            y, r = fwd(x, z, s)
            return y, bwd(x, z, s, r, dy)

        variants["pallas " + ":".join(map(str, launch))] = jax.jit(both)
    for name, fn in variants.items():
        ms, _ = median_ms(fn, (x, z, s, dy), reps=args.reps, inner=args.inner)
        rows.append({"part": "time", "impl": name, "rows": args.rows, "d": d, "width": args.width,
                     "fwd_bwd_ms": ms, "gb_per_s": (fwd_bytes + bwd_bytes) / (ms * 1e-3) / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4 * 16384 * 10, help="head rows (S5 GDN at 4 x 16K)")
    ap.add_argument("--d", type=int, default=192, help="values per head (GDN's Dv at S1-S5)")
    ap.add_argument("--width", type=int, default=256, help="columns per row of x (jla's padded Dv)")
    ap.add_argument("--launches", default="16:4:1056,8:4:1056,32:4:1056,32:8:1056,16:4:528,16:4:2112,64:8:1056",
                    help="ROWS:WARPS:PROGRAMS launches of the kernels to check and time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default="bench_gated_norm.json")
    args = ap.parse_args()
    if not 1 <= args.d <= args.width:
        ap.error(f"--d {args.d} must be in [1, --width {args.width}]")
    K = kernels()
    launches = [tuple(int(v) for v in s.split(":")) for s in args.launches.split(",")]
    mod = K.gated_norm_pallas
    default = (mod.GATED_NORM_BLOCK_ROWS, mod.GATED_NORM_NUM_WARPS, mod.GATED_NORM_BWD_PROGRAMS)
    print(f"device: {jax.devices()[0].device_kind}   default launch {':'.join(map(str, default))}")
    t0 = time.time()
    rows = check(args, launches)
    print_checks(rows)
    rows += time_table(args, launches)
    print(f"\n{'gated norm, fwd+bwd':<22}{'rows':>9}{'d/W':>9}{'ms':>9}{'GB/s':>7}{'vs xla':>8}")
    base = next(r["fwd_bwd_ms"] for r in rows if r.get("impl") == "xla")
    for r in rows:
        if r["part"] == "time":
            print(f"{r['impl']:<22}{r['rows']:>9}{str(r['d']) + '/' + str(r['width']):>9}{r['fwd_bwd_ms']:>9.3f}"
                  f"{r['gb_per_s']:>7.0f}{r['fwd_bwd_ms'] / base:>8.3f}")
    finish_checked(args.out, rows, t0, default_launch=default)


if __name__ == "__main__":
    main()
