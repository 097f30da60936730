#!/usr/bin/env python
"""MoBA/SSA block selection (gate + top-k) on the local accelerator: where the per-token model path
spends its time (docs/BENCHMARKS.md: at T=16K, block 16 the per-token forward took 33 ms, the kernel
on ready lists 1 ms).

    python experiments/bench_selection.py --out selection.json

Times ``hybrid_lm.ops.block_sparse.select_blocks`` forward (it carries no gradient) for per-token and
per-block selection, with the default query chunking and larger chunks, and the top-k alone. Prints a
table and writes JSON. Loads the op by path (no install needed beyond JAX).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from timing import median_ms

ROOT = Path(__file__).resolve().parents[1]


def load_ops():
    spec = importlib.util.spec_from_file_location("_block_sparse", ROOT / "hybrid_lm" / "ops" / "block_sparse.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def time_ms(fn, args, reps=5, inner=5):
    return median_ms(fn, args, reps, inner, warmup=1)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="16384:16:16:ssa,16384:16:16:moba,32768:128:32:moba",
                   help="T:block:top_k:gate list")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--chunks", default="0", help="query_chunk values (0 = default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ops = load_ops()
    H, K, D = args.heads, args.kv_heads, 128
    rows = []
    print(f"device: {jax.devices()[0].device_kind}, H={H} K={K} D={D}, B=1, bf16 inputs")
    print("| T | block | top-k | gate | selection | query_chunk | ms (auto top-k) | top-k alone: sort / passes ms |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        T, bs, top_k, gate = case.split(":")
        T, bs, top_k = int(T), int(bs), int(top_k)
        ks = jax.random.split(jax.random.key(0), 2)
        q = jax.random.normal(ks[0], (1, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, T, K, D), jnp.bfloat16)
        nb = -(-T // bs)
        Hs = ops.selection_heads(gate, H, K)
        imp = jax.random.normal(ks[0], (1, T, Hs, nb), jnp.float32)
        topk_ms = {m: time_ms(jax.jit(lambda x, m=m: ops._top_blocks(x, top_k, m)), (imp,))
                   for m in ("sort", "passes")}
        variants = [("block", None)] + [("token", int(c) or None) for c in args.chunks.split(",")]
        for selection, chunk in variants:
            fn = jax.jit(lambda q, k, selection=selection, chunk=chunk: ops.select_blocks(
                q, k, block_size=bs, top_k=top_k, gate=gate, selection=selection, query_chunk=chunk))
            try:
                ms = time_ms(fn, (q, k))
            except Exception as e:  # noqa: BLE001 (e.g. out of memory for an unchunked pass)
                ms = None
                print(f"  {case} {selection} {chunk}: {type(e).__name__}: {str(e)[:200]}")
            default_chunk = ops._query_chunks(T, H * nb, 1, None)
            rows.append(dict(T=T, block=bs, top_k=top_k, gate=gate, selection=selection,
                             query_chunk=chunk or default_chunk, default_chunk=chunk is None,
                             ms=ms, topk_only_ms=topk_ms))
            print(f"| {T} | {bs} | {top_k} | {gate} | {selection} | "
                  f"{(chunk or default_chunk) if selection == 'token' else '—'}{' (default)' if selection == 'token' and chunk is None else ''} | "
                  f"{'—' if ms is None else f'{ms:.3f}'} | {topk_ms['sort']:.3f} / {topk_ms['passes']:.3f} |",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))


if __name__ == "__main__":
    main()
