#!/usr/bin/env python
"""Does the data loader starve the train step? (issue 14, item 7)

    python experiments/bench_loader_step.py --store STORE --tokenizer TOKENIZER.json \\
        --scale s1 --arch full --seq-len 16384 --batch 8 --steps 30 --out loader_step.json

The project's train step (experiments/bench_train.py's ``Variant``: ModelFns, make_train_step,
one device) is timed over ``--steps`` steps dispatched back to back, as the trainer dispatches
them, in two ways within one process: (a) the anchor, one random batch already on the device;
(b) each step's batch read from the token store by ``DataStreams.batch(step)`` and put on the device
before its dispatch, as ``hybrid_lm/train/loop.py`` does. The two alternate ``--reps`` times.
Target: (b) within 3% of (a). Also reported: the host time of ``DataStreams.batch`` alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import Variant  # noqa: E402  (sibling module)


def timed_steps(compiled, state, bounds, batches) -> tuple[object, float]:
    """ms per step over ``batches`` (a callable step -> device batch), dispatched without waiting."""
    t0 = time.perf_counter()
    for s in range(len(batches)):
        state, stats = compiled(state, batches[s](), bounds)
    jax.block_until_ready(stats["loss"])
    return state, 1e3 * (time.perf_counter() - t0) / len(batches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--scale", default="s1")
    ap.add_argument("--arch", default="full")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--document-mask", action="store_true", help="also carry segment ids (XLA attention)")
    ap.add_argument("--out", default="loader_step.json")
    args = ap.parse_args()
    ns = argparse.Namespace(seq_len=args.seq_len, remat="dots", impl="auto", loss="default", gin_param=[
        "DataConfig.source = 'tokens'", f"DataConfig.path = '{args.store}'",
        f"DataConfig.tokenizer = '{args.tokenizer}'", "DataConfig.eval_windows = 1",
        f"DataConfig.document_mask = {args.document_mask}"])
    from hybrid_lm.data.pipeline import DataStreams

    v = Variant(args.scale, args.arch, args.batch, ns)
    data = DataStreams(v.cfg)
    t0 = time.perf_counter()
    for s in range(args.steps):
        data.batch(s)
    host_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    first = data.batch(0)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first)
    state0 = jax.eval_shape(v.init, v.seed)
    from hybrid_lm.train.step import make_train_step
    compiled = jax.jit(make_train_step(v.fns, v.build), donate_argnums=0).lower(state0, shapes, v.bounds).compile()
    state = v.init(v.seed)
    rng = np.random.default_rng(0)
    tokens = first["tokens"] if isinstance(first, dict) else first
    random_tokens = rng.integers(0, v.cfg.model.vocab_size, tokens.shape, dtype=tokens.dtype)
    fixed = jax.device_put({**first, "tokens": random_tokens} if isinstance(first, dict) else random_tokens)
    anchor = [lambda: fixed] * args.steps
    state, _ = timed_steps(compiled, state, v.bounds, anchor[:3])  # warm-up
    runs = {"random_on_device": [], "store_loader": []}
    for rep in range(args.reps):
        base = rep * args.steps
        loader = [lambda s=s: jax.device_put(data.batch(base + s)) for s in range(args.steps)]
        state, ms_a = timed_steps(compiled, state, v.bounds, anchor)
        state, ms_b = timed_steps(compiled, state, v.bounds, loader)
        runs["random_on_device"].append(ms_a)
        runs["store_loader"].append(ms_b)
    med = {k: statistics.median(x) for k, x in runs.items()}
    res = {"device": str(jax.devices()[0]), "scale": args.scale, "arch": args.arch, "seq_len": args.seq_len,
           "batch": args.batch, "steps": args.steps, "reps": args.reps, "document_mask": args.document_mask,
           "ms_per_step": med, "runs": runs, "loader_host_ms_per_step": host_ms,
           "ratio_loader_vs_random": med["store_loader"] / med["random_on_device"],
           "store_fingerprint": data.store.fingerprint, "store_tokens": data.store.n_tokens("train")}
    print(f"{'batches':<20}{'ms/step':>10}{'vs anchor':>11}")
    for k in ("random_on_device", "store_loader"):
        print(f"{k:<20}{med[k]:>10.2f}{med[k] / med['random_on_device']:>11.3f}")
    print(f"DataStreams.batch alone: {host_ms:.2f} ms per step on the host")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
