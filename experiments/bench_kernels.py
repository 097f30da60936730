"""The two small Pallas kernels against XLA: the chunked loss's softmax pass (``softmax_xent_rows``) and the
short causal conv's backward (``short_conv_bwd``), each at the shapes the S1-S5 models run.

    python experiments/bench_kernels.py            # GPU, about a minute
    python experiments/bench_kernels.py --quick    # interpret mode on the CPU: a smoke run

* **loss pass**: one chunk of ``--chunk`` rows of bf16 logits over ``--vocab`` ids (z-loss on): the XLA
  reference (``ops.cross_entropy.softmax_xent_rows_reference``, the anchor) against the kernel. GB/s counts
  the bytes the kernel must move (the logits read twice, the gradient written once).
* **conv backward**: forward + backward of a K = 4 causal depthwise conv + SiLU over ``--batch`` x ``--seq``
  tokens at each width of ``--channels`` (S5 GDN's q/k 960 and v 1920, S5 Mamba-2's 2816), bf16: autodiff
  of the jnp conv (the anchor) against the jnp forward + the kernel's one-pass backward. GB/s counts what a
  one-pass implementation moves (x read and y written forward; x and dy read and dx written backward).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import hybrid_lm_kernels as K  # noqa: E402
from hybrid_lm.ops.cross_entropy import softmax_xent_rows_reference  # noqa: E402

BENCH = "kernels"
Z_LOSS = 1e-4
TAPS = 4


def conv(x, w):
    """Causal depthwise conv + SiLU from zero history: ``x [B, T, C]``, ``w [K, C]`` fp32 -> x's dtype."""
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
    T = x.shape[1]
    y = sum(xp[:, i:i + T] * w[i] for i in range(w.shape[0]))
    return jax.nn.silu(y).astype(x.dtype)


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--chunk", type=int, default=8192, help="rows of one loss chunk")
    ap.add_argument("--vocab", type=int, default=73448, help="ids (the presets' vocabulary)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--channels", default="960,1920,2816")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.chunk, args.vocab, args.batch, args.seq, args.channels = 40, 300, 1, 40, "24"
        args.reps, args.inner = 1, 1
    t_start = time.time()
    interpret = not harness.on_gpu()
    print(f"device: {harness.device_kind()}")
    programs, meta = {}, {}
    k = jax.random.split(jax.random.key(0), 3)
    logits = (4.0 * jax.random.normal(k[0], (args.chunk, args.vocab), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(k[1], (args.chunk,), 0, args.vocab)
    weights = jax.random.uniform(k[2], (args.chunk,), jnp.float32) / args.chunk
    moved = 3 * logits.size * logits.dtype.itemsize
    programs[("loss", "xla")] = (jax.jit(lambda x, t, w: softmax_xent_rows_reference(x, t, w, Z_LOSS)),
                                 (logits, targets, weights))
    programs[("loss", "pallas")] = (jax.jit(lambda x, t, w: K.softmax_xent_rows(
        x, t, w, z_loss=Z_LOSS, interpret=interpret)), (logits, targets, weights))
    for impl in ("xla", "pallas"):
        meta[("loss", impl)] = dict(part="loss pass", impl=impl, shape=[args.chunk, args.vocab], bytes=moved,
                                    anchor=impl == "xla")
    for C in (int(c) for c in args.channels.split(",")):
        k = jax.random.split(jax.random.key(C), 3)
        x = jax.random.normal(k[0], (args.batch, args.seq, C), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.uniform(k[1], (TAPS, C), jnp.float32, -0.5, 0.5)
        dy = jax.random.normal(k[2], (args.batch, args.seq, C), jnp.float32).astype(jnp.bfloat16)

        def autodiff(x, w, dy):
            y, pull = jax.vjp(conv, x, w)
            return y, pull(dy)

        def kernel(x, w, dy):
            dx, dw, _ = K.short_conv_bwd(x, dy, w, None, silu=True, interpret=interpret)
            return conv(x, w), (dx, dw)

        for impl, f in (("xla", autodiff), ("pallas", kernel)):
            programs[("conv", C, impl)] = (jax.jit(f), (x, w, dy))
            meta[("conv", C, impl)] = dict(part="conv fwd+bwd", impl=impl, shape=[args.batch, args.seq, C],
                                           bytes=5 * x.size * x.dtype.itemsize, anchor=impl == "xla")
    times, left_running = harness.time_programs(programs, args.reps, args.inner, workers=4)
    rows = []
    for key, m in meta.items():
        t = times[key]
        row = dict(m, ms=t["ms"], gb_per_s=None if not t["ms"] else m["bytes"] / (t["ms"] * 1e-3) / 1e9)
        if t.get("error"):
            row["error"] = t["error"]
        rows.append(row)
    for r in rows:
        a = next(x for x in rows if x["anchor"] and x["part"] == r["part"] and x["shape"] == r["shape"])
        r["vs_anchor"] = None if not (r["ms"] and a["ms"]) else r["ms"] / a["ms"]
    harness.print_table(["part", "shape", "impl", "ms", "GB/s", "time / xla"],
                        [[r["part"], "x".join(map(str, r["shape"])), r["impl"], harness.fmt(r["ms"]),
                          harness.fmt(r["gb_per_s"], ".0f"), harness.fmt(r["vs_anchor"], ".2f")] for r in rows])
    return harness.finish(BENCH, args.out, argv, rows, started=t_start, left_running=left_running,
                          anchor="XLA (the same computation)")


if __name__ == "__main__":
    main()
