"""Sparse attention at S5's shapes: block selection (XLA against the selection kernels) and the two sparse
kernels given the same per-token lists (union and gather), against cuDNN's full causal attention.

    python experiments/bench_sparse.py                  # GPU: T = 16K and 32K, a few minutes
    python experiments/bench_sparse.py --T 16384

S5's heads (H = 10 query heads on K = 1 KV head, D = 128), bf16, block 16, top-16, the ssa gate (NSA-style:
importance summed over the GQA group), per-token selection: the setting of ``configs/arch/moba.gin`` and of
SSA's sparse stream. Rows per T:

* ``cudnn_full_causal`` (the anchor): ``jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)``;
* selection (forward): ``xla`` (``ops.select_blocks``) and ``kernel`` (``hybrid_lm_kernels.select_blocks_split``:
  the gate kernel on bf16 operands, then the top-k kernel);
* attention given the selection (a program argument): ``union`` (``block_sparse_attention``: a query tile visits
  the union of its rows' blocks) and ``gather`` (``gather_sparse_attention``: one token's GQA group over that
  token's blocks only);
* ``model_path``: selection + kernel as the model runs it on this device (``model.moba.moba_attend``).

Forward and forward+backward (one jit of ``jax.vjp`` and the pullback of a random cotangent); compiled ahead
of time, then each timed alone (median of ``--reps`` x ``--inner`` calls). ``--quick``: tiny shapes, the
kernels in interpret mode and XLA in place of cuDNN (a CPU smoke run).
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
from hybrid_lm.model.moba import moba_attend  # noqa: E402
from hybrid_lm.ops import block_sparse as ops  # noqa: E402

BENCH = "sparse"


def kernel_selection(q, k, *, block_size, top_k, gate, interpret):
    """The selection kernels as the model's pallas path runs them for the ssa gate (bf16 dots)."""
    kbar = ops.block_means(k, block_size)
    return K.select_blocks_split(q, kbar, block_size=block_size, top_k=top_k, gate=gate, interpret=interpret,
                                 dot_dtype="bfloat16")


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--T", default="16384,32768", help="sequence lengths")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--compile-workers", type=int, default=8)
    args = ap.parse_args(argv)
    H, KV, D, bs, top_k, gate = 10, 1, 128, 16, 16, "ssa"
    if args.quick:
        args.T, args.B, args.reps, args.inner, args.compile_workers = "64", 1, 1, 1, 2
        H, D, top_k = 4, 32, 2
    t_start = time.time()
    interpret = not harness.on_gpu()
    anchor = harness.anchor_attention_name()
    print(f"device: {harness.device_kind()}, H={H} K={KV} D={D} block {bs} top-{top_k} {gate} gate, bf16")
    programs, meta = {}, {}
    for T in (int(t) for t in args.T.split(",")):
        ks = jax.random.split(jax.random.key(T), 4)
        q = jax.random.normal(ks[0], (args.B, T, H, D), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (args.B, T, KV, D), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:3])
        do = jax.random.normal(ks[3], (args.B, T, H, D), jnp.float32).astype(jnp.bfloat16)
        sel = dict(block_size=bs, top_k=top_k, gate=gate)
        idx = jax.jit(lambda q, k: ops.select_blocks(q, k, **sel, selection="token"))(q, k)
        attn = {
            "anchor": ("attention", lambda q, k, v, idx: harness.reference_attention(q, k, v)),
            "union": ("attention", lambda q, k, v, idx: K.block_sparse_attention(
                q, k, v, idx, block_size=bs, interpret=interpret)),
            "gather": ("attention", lambda q, k, v, idx: K.gather_sparse_attention(
                q, k, v, idx, block_size=bs, interpret=interpret)),
            "model_path": ("path", lambda q, k, v, idx: moba_attend(
                q, k, v, **sel, selection="token", impl="pallas", interpret=interpret)),
        }
        for name, (part, f) in attn.items():
            def fb(q, k, v, do, idx, f=f):
                o, vjp = jax.vjp(lambda q, k, v: f(q, k, v, idx), q, k, v)
                return (o, *vjp(do))
            programs[(T, name, "fwd")] = (jax.jit(f), (q, k, v, idx))
            programs[(T, name, "fwd_bwd")] = (jax.jit(fb), (q, k, v, do, idx))
            meta[(T, name)] = dict(part=part, impl=f"{anchor}_full_causal" if name == "anchor" else name)
        programs[(T, "xla", "fwd")] = (jax.jit(lambda q, k: ops.select_blocks(q, k, **sel, selection="token")), (q, k))
        programs[(T, "kernel", "fwd")] = (jax.jit(lambda q, k: kernel_selection(q, k, **sel, interpret=interpret)),
                                          (q, k))
        meta[(T, "xla")], meta[(T, "kernel")] = dict(part="selection", impl="xla"), dict(part="selection", impl="kernel")
    times, left_running = harness.time_programs(programs, args.reps, args.inner, args.compile_workers)
    rows = []
    for (T, name), m in meta.items():
        fwd, fb = times[(T, name, "fwd")], times.get((T, name, "fwd_bwd"), {})
        row = dict(T=T, B=args.B, H=H, K=KV, D=D, block=bs, top_k=top_k, gate=gate, **m, anchor=name == "anchor",
                   fwd_ms=fwd["ms"], fwd_bwd_ms=fb.get("ms"))
        err = fwd.get("error") or fb.get("error")
        if err:
            row["error"] = err
        rows.append(row)
    for r in rows:
        a = next(x for x in rows if x["anchor"] and x["T"] == r["T"])
        for m in ("fwd_ms", "fwd_bwd_ms"):
            r[m.replace("_ms", "_vs_anchor")] = None if not (r[m] and a[m]) else r[m] / a[m]
    harness.print_table(["T", "part", "impl", "fwd ms", "fwd / anchor", "fwd+bwd ms", "fwd+bwd / anchor"],
                        [[r["T"], r["part"], r["impl"], harness.fmt(r["fwd_ms"]), harness.fmt(r["fwd_vs_anchor"], ".2f"),
                          harness.fmt(r["fwd_bwd_ms"]), harness.fmt(r["fwd_bwd_vs_anchor"], ".2f")] for r in rows])
    return harness.finish(BENCH, args.out, argv, rows, started=t_start, left_running=left_running,
                          anchor=f"{anchor} full causal")


if __name__ == "__main__":
    main()
