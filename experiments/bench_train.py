"""Train-step throughput and MFU of hybrid stacks on the local accelerator (random tokens).

    python experiments/bench_train.py --scale s4 --arch swa --seq-len 16384 --batch 2 --out bench_train.json

Prints ms/step, tokens/s and MFU (FLOPs counted per layer type, 989 TF/s bf16 dense) per variant.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.config import load_config
from hybrid_lm.model.accounting import PEAK_FLOPS_H200_BF16, count_params, flops_per_token
from hybrid_lm.backends import recorded_backends
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.train.step import ModelFns, make_init, make_train_step

ARCH = {  # efficient-slot settings per variant (full-attention slot unchanged)
    "full": ["ModelConfig.layer_pattern = 'F'"],
    "swa": ["efficient/MixerConfig.kind = 'swa'"],
    "sa": ["efficient/MixerConfig.kind = 'sa'"],
    "sa_swa": ["efficient/MixerConfig.kind = 'sa_swa'"],
    # MoBA at the official gate's scale of blocks (configs/arch/moba.gin has SSA's block 16)
    "moba": ["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.window = None",
             "efficient/MixerConfig.options = {'block_size': 128, 'top_k': 16, 'gate': 'moba'}"],
    "moba_block": ["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.window = None",
                   "efficient/MixerConfig.options = {'block_size': 128, 'top_k': 16, 'gate': 'moba', "
                   "'selection': 'block'}"],
    "moba16": ["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.window = None",  # arch/moba.gin
               "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'gate': 'ssa'}"],
}


def bench(scale: str, arch: str, window: int, seq_len: int, batch: int, steps: int, remat: str, impl: str) -> dict:
    window_param = [] if "moba" in arch else [f"efficient/MixerConfig.window = {window}"]
    params = ARCH[arch] + window_param + [ f"DataConfig.seq_len = {seq_len}",
                           f"TrainConfig.global_batch = {batch}", f"ModelConfig.remat = '{remat}'",
                           f"ModelConfig.attention_impl = '{impl}'"]
    cfg = load_config([f"scale/{scale}.gin"], params)
    fns = ModelFns(cfg)
    build = optimizer_for_bounds(cfg.optim, fns.axes)
    bounds = np.asarray(wsd_bounds(cfg.optim, 1000), np.int32)
    step = jax.jit(make_train_step(fns, build), donate_argnums=0)
    state = jax.jit(make_init(fns, build(bounds)[0]))(jnp.asarray(0, jnp.uint32))
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, cfg.model.vocab_size)
    t0 = time.time()
    recorded_backends(clear=True)
    state, stats = step(state, tokens, bounds)
    jax.block_until_ready(state)
    compile_s = time.time() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, stats = step(state, tokens, bounds)
        jax.block_until_ready(stats["loss"])
        times.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(times))
    tps = batch * seq_len / (ms / 1e3)
    f = flops_per_token(cfg.model, seq_len)
    return {"scale": scale, "arch": arch, "window": window, "seq_len": seq_len, "batch": batch, "remat": remat,
            "attention_impl": impl, "attention_backends": recorded_backends(), "non_embedding": count_params(cfg.model)["non_embedding"],
            "ms_per_step": ms, "tokens_per_sec": tps, "train_flops_per_token": f["train"],
            "mfu": tps * f["train"] / (PEAK_FLOPS_H200_BF16 * jax.device_count()), "compile_s": compile_s,
            "loss": float(stats["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="s4")
    ap.add_argument("--arch", default="full,swa,sa")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--out", default="bench_train.json")
    args = ap.parse_args()
    rows = []
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}")
    print(f"{'scale':<6}{'arch':<8}{'w':>6}{'T':>7}{'B':>3}{'ms/step':>10}{'ktok/s':>9}{'MFU':>7}{'vs full':>9}")
    for arch in args.arch.split(","):
        r = bench(args.scale, arch, args.window, args.seq_len, args.batch, args.steps, args.remat, args.impl)
        rows.append(r)
        base = next((x for x in rows if x["arch"] == "full"), None)
        ratio = f"{r['ms_per_step'] / base['ms_per_step']:.2f}" if base else "-"
        print(f"{r['scale']:<6}{arch:<8}{r['window']:>6}{r['seq_len']:>7}{r['batch']:>3}{r['ms_per_step']:>10.1f}"
              f"{r['tokens_per_sec'] / 1e3:>9.1f}{100 * r['mfu']:>6.1f}%{ratio:>9}  {r['attention_backends']}",
              flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
