#!/usr/bin/env python
"""The chunked loss's softmax pass on the local accelerator: XLA's passes against the Pallas kernel.

    python3 experiments/bench_loss.py --out $OUT/bench_loss.json                      # GPU, about a minute
    python3 experiments/bench_loss.py --tokens 512 --chunk 256 --vocab 1000 --d 32 --launches 1:256:4

Three parts, each printed as a table and written to ``--out``:

1. **check** (always): ``hybrid_lm_kernels.softmax_xent_rows`` against
   ``ops.cross_entropy.softmax_xent_rows_reference`` on random bf16 logits (z-loss on): the largest
   error of lse and of the target logit, and the relative L2 error of dlogits; then the chunked loss
   (``chunked_cross_entropy``: loss, dh, dw) with each of ``--kernels`` (``pallas``; ``jla``, its fused
   LM-head loss) against ``kernel='xla'``.
   Each launch of ``--launches`` is checked. Exit status 1 if any check fails.
2. **pass**: one chunk's softmax pass alone (``[chunk, V]`` bf16 logits): the reference and each
   launch ``ROWS:COLS:WARPS``, ms and the bandwidth of the bytes the kernel must move (the logits read
   twice, the gradient written once).
3. **loss**: ``value_and_grad`` of the chunked loss over ``--tokens`` tokens for each model width in
   ``--d`` (S1 384, S3 640, S5 1280), with xla and each of ``--kernels``: ms, and the head's matmul FLOP rate (three
   matmuls per token) over the whole loss time.

On a CPU the kernel runs interpreted: a smoke test at tiny sizes, numbers meaningless.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from timing import finish_checked, median_ms, print_checks, rel_l2

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybrid_lm.backends import jla_available  # noqa: E402
from hybrid_lm.ops.cross_entropy import chunked_cross_entropy, softmax_xent_rows_reference  # noqa: E402

Z_LOSS = 1e-4


def kernels():
    import hybrid_lm_kernels
    return hybrid_lm_kernels


def parse_launch(s: str) -> tuple[int, int, int]:
    br, bv, w = (int(x) for x in s.split(":"))
    return br, bv, w


def rows_inputs(n, v, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    logits = (4.0 * jax.random.normal(k[0], (n, v), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(k[1], (n,), 0, v)
    weights = jax.random.uniform(k[2], (n,), jnp.float32) / n
    return logits, targets, weights


def check(args, launches) -> list[dict]:
    K = kernels()
    rows = []
    n = min(args.chunk, 3000) + 3  # a tail of rows that is no multiple of any launch
    logits, t, w = rows_inputs(n, args.vocab, seed=1)
    d_ref, lse_ref, tgt_ref = jax.jit(softmax_xent_rows_reference, static_argnums=3)(logits, t, w, Z_LOSS)
    for br, bv, nw in launches:
        d, lse, tgt = K.softmax_xent_rows(logits, t, w, z_loss=Z_LOSS, block_rows=br, block_cols=bv, num_warps=nw)
        r = {"part": "check_rows", "launch": f"{br}:{bv}:{nw}", "rows": n, "vocab": args.vocab,
             "lse_max_err": float(jnp.max(jnp.abs(lse - lse_ref))),
             "tgt_max_err": float(jnp.max(jnp.abs(tgt - tgt_ref))), "dlogits_rel_l2": rel_l2(d, d_ref),
             "finite": bool(jnp.all(jnp.isfinite(d.astype(jnp.float32))))}
        # fp32 statistics in another order: lse to ~1e-5 of its size; bf16 dlogits to rounding
        r["ok"] = (r["finite"] and r["lse_max_err"] < 1e-3 and r["tgt_max_err"] == 0.0 and r["dlogits_rel_l2"] < 1e-2)
        rows.append(r)
    d = args.d[0]
    k = jax.random.split(jax.random.key(2), 3)
    N = 2 * args.chunk + 5
    h = jax.random.normal(k[0], (N, d), jnp.float32).astype(jnp.bfloat16)
    wh = jax.random.normal(k[1], (d, args.vocab), jnp.float32) / np.sqrt(d)
    tt = jax.random.randint(k[2], (N,), 0, args.vocab)
    out = {}
    for kern in ("xla", *args.kernels):
        f = jax.jit(jax.value_and_grad(lambda h, wh, kern=kern: chunked_cross_entropy(
            h, wh, tt, Z_LOSS, chunk=args.chunk, kernel=kern)[0], argnums=(0, 1)))
        out[kern] = f(h, wh)
    lx, (dhx, dwx) = out["xla"]
    for kern in args.kernels:
        lp, (dhp, dwp) = out[kern]
        r = {"part": "check_loss", "kernel": kern, "tokens": N, "d": d, "vocab": args.vocab, "loss_xla": float(lx),
             "loss_kernel": float(lp), "loss_rel_err": abs(float(lp) - float(lx)) / abs(float(lx)),
             "dh_rel_l2": rel_l2(dhp, dhx), "dw_rel_l2": rel_l2(dwp, dwx)}
        # jla's kernel rounds exp(logit - tile max) to fp16 for the gradient: looser than bf16 rounding alone
        tol = (1e-4, 2e-2) if kern == "jla" else (1e-5, 1e-2)
        r["ok"] = r["loss_rel_err"] < tol[0] and r["dh_rel_l2"] < tol[1] and r["dw_rel_l2"] < tol[1]
        rows.append(r)
    return rows


def pass_table(args, launches) -> list[dict]:
    K = kernels()
    logits, t, w = rows_inputs(args.chunk, args.vocab, seed=3)
    moved = 3 * logits.size * logits.dtype.itemsize  # read twice, gradient written once
    fns = {"xla (reference)": jax.jit(lambda x, t, w: softmax_xent_rows_reference(x, t, w, Z_LOSS))}
    for br, bv, nw in launches:
        fns[f"pallas {br}:{bv}:{nw}"] = jax.jit(lambda x, t, w, br=br, bv=bv, nw=nw: K.softmax_xent_rows(
            x, t, w, z_loss=Z_LOSS, block_rows=br, block_cols=bv, num_warps=nw))
    rows = []
    for name, f in fns.items():
        ms, _ = median_ms(f, (logits, t, w), reps=args.reps, inner=args.inner)
        rows.append({"part": "pass", "impl": name, "rows": args.chunk, "vocab": args.vocab, "ms": ms,
                     "gb_per_s": moved / (ms * 1e-3) / 1e9})
    return rows


def loss_table(args, launch) -> list[dict]:
    K = kernels()
    rows = []
    for d in args.d:
        k = jax.random.split(jax.random.key(d), 3)
        h = jax.random.normal(k[0], (args.tokens, d), jnp.float32).astype(jnp.bfloat16)
        wh = jax.random.normal(k[1], (d, args.vocab), jnp.float32) / np.sqrt(d)
        tt = jax.random.randint(k[2], (args.tokens,), 0, args.vocab)
        flops = 3 * 2 * args.tokens * d * args.vocab
        for kern in ("xla", *args.kernels):
            # the default launch unless --loss-launch names one (patched into the module's defaults)
            K.cross_entropy_pallas.XENT_BLOCK_ROWS, K.cross_entropy_pallas.XENT_BLOCK_COLS, \
                K.cross_entropy_pallas.XENT_NUM_WARPS = launch
            f = jax.jit(jax.value_and_grad(lambda h, wh, kern=kern: chunked_cross_entropy(
                h, wh, tt, Z_LOSS, chunk=args.chunk, kernel=kern)[0], argnums=(0, 1)))
            ms, _ = median_ms(f, (h, wh), reps=args.reps, inner=1)
            rows.append({"part": "loss", "kernel": kern, "tokens": args.tokens, "d": d, "vocab": args.vocab,
                         "chunk": args.chunk, "ms": ms, "matmul_tflops": flops / (ms * 1e-3) / 1e12})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072, help="tokens of the loss part (8 x 16K)")
    ap.add_argument("--chunk", type=int, default=8192, help="ModelConfig.loss_chunk")
    ap.add_argument("--vocab", type=int, default=73448)
    ap.add_argument("--d", type=lambda s: [int(x) for x in s.split(",")], default=[384, 640, 1280])
    ap.add_argument("--launches", default="1:4096:8,1:2048:4,1:8192:8,2:2048:8,2:4096:8,4:1024:8,1:1024:4,1:4096:4",
                    help="ROWS:COLS:WARPS launches of the kernel to check and time")
    ap.add_argument("--loss-launch", default=None, help="the launch of the loss part (default: the kernel's)")
    ap.add_argument("--kernels", default="pallas,jla",
                    help="loss kernels beside xla: pallas, jla (jla's fused LM-head loss; left out if not installed)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--out", default="bench_loss.json")
    args = ap.parse_args()
    args.kernels = [k for k in args.kernels.split(",") if k]
    if "jla" in args.kernels and not jla_available():
        print("jla: jax-linear-attention is not installed; its fused loss is left out")
        args.kernels.remove("jla")
    K = kernels()
    launches = [parse_launch(s) for s in args.launches.split(",")]
    default = (K.cross_entropy_pallas.XENT_BLOCK_ROWS, K.cross_entropy_pallas.XENT_BLOCK_COLS,
               K.cross_entropy_pallas.XENT_NUM_WARPS)
    launch = parse_launch(args.loss_launch) if args.loss_launch else default
    print(f"device: {jax.devices()[0].device_kind}   default launch {default}")
    t0 = time.time()
    rows = check(args, launches)
    print_checks(rows)
    rows += pass_table(args, launches)
    print(f"\n{'softmax pass, ' + str(args.chunk) + ' x ' + str(args.vocab) + ' bf16':<34}{'ms':>9}{'GB/s':>9}")
    for r in rows:
        if r["part"] == "pass":
            print(f"{r['impl']:<34}{r['ms']:>9.3f}{r['gb_per_s']:>9.0f}")
    rows += loss_table(args, launch)
    print(f"\n{'loss fwd+bwd, ' + str(args.tokens) + ' tokens':<26}{'d':>6}{'ms':>9}{'TF/s':>8}")
    for r in rows:
        if r["part"] == "loss":
            print(f"{r['kernel']:<26}{r['d']:>6}{r['ms']:>9.2f}{r['matmul_tflops']:>8.0f}")
    finish_checked(args.out, rows, t0, default_launch=default, loss_launch=launch)


if __name__ == "__main__":
    main()
