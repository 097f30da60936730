"""One mixer layer's forward+backward (projections, permutation, attention) on the local accelerator.

    python experiments/bench_mixer.py --d-model 2048 --seq-len 16384 --batch 2 --kinds swa,sa,sa_swa

The issue-8 target: the SA mixer layer at most 1.25x our SWA mixer layer at the same w and shape.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.model.registry import MixerContext, get_mixer


def time_fn(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--kinds", default="swa,sa,sa_swa")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--out", default="bench_mixer.json")
    args = ap.parse_args()
    cfg = ModelConfig(d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads, n_layers=2,
                      d_ff=4 * args.d_model, attention_impl=args.impl)
    B, T = args.batch, args.seq_len
    x = jax.random.normal(jax.random.key(0), (B, T, args.d_model), jnp.bfloat16)
    r = jax.random.normal(jax.random.key(1), (B, T, args.d_model), jnp.bfloat16)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}  d={args.d_model} H={args.heads} T={T} B={B} w={args.window}")
    print(f"{'mixer':<10}{'fwd ms':>10}{'fwd+bwd ms':>12}{'vs swa':>8}")
    for kind in args.kinds.split(","):
        mc = MixerConfig(kind=kind, window=args.window)
        mixer = get_mixer(kind).cls(cfg, mc, 1, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(mixer)

        def fwd(params, x):
            m = nnx.merge(graphdef, params)
            pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            ctx = MixerContext(positions=pos, attention_impl=args.impl, step=jnp.int32(3), seed=0,
                               example_ids=jnp.arange(B, dtype=jnp.int32))
            return m(x, ctx)

        f = jax.jit(fwd)
        fb = jax.jit(jax.grad(lambda p, x: jnp.sum((fwd(p, x) * r).astype(jnp.float32)), argnums=(0, 1)))
        row = {"mixer": kind, "fwd_ms": time_fn(f, params, x), "fwd_bwd_ms": time_fn(fb, params, x)}
        rows.append(row)
        base = rows[0]["fwd_bwd_ms"]
        print(f"{kind:<10}{row['fwd_ms']:>10.3f}{row['fwd_bwd_ms']:>12.3f}{row['fwd_bwd_ms'] / base:>8.2f}", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
