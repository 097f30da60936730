"""The anchor of the train-step benchmarks: a plain-JAX GPT with no hybrid_lm code in it.

    python experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out anchor.json
    python experiments/anchor_gpt.py --tiny            # CPU smoke run (a few seconds)

Default shape: 24 layers, d_model 1024, 16 heads of 64, MLP 4x (GELU), learned positions, vocab
32,768 untied: ~369M parameters besides the input embeddings (the "375M GPT" anchor of issue 17).
fp32 parameters, bf16 compute, pre-LayerNorm, causal `jax.nn.dot_product_attention` (cuDNN on a GPU),
remat `dots_with_no_batch_dims_saveable` per layer, whole fp32 logits, optax AdamW. The step is
compiled ahead of time; `ms_step` is the median of `--steps` steps after one warm-up. MFU counts
6 N_matmul + 6 L T d FLOPs per token (causal attention, as `hybrid_lm.model.accounting` counts it)
against 989 TF/s, so its MFU is comparable with `bench_train.py`'s rows.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

PEAK_FLOPS = 989e12  # H200 dense bf16, the figure bench_train.py counts against


def init_params(key, *, layers, d, vocab, seq_len):
    def dense(k, shape):
        return jax.random.normal(k, shape, jnp.float32) * (1.0 / np.sqrt(shape[0]))

    ks = jax.random.split(key, 3 + layers)
    blocks = []
    for i in range(layers):
        k = jax.random.split(ks[3 + i], 4)
        blocks.append({"ln1": jnp.ones(d), "ln2": jnp.ones(d), "qkv": dense(k[0], (d, 3 * d)),
                       "out": dense(k[1], (d, d)) / np.sqrt(2 * layers), "up": dense(k[2], (d, 4 * d)),
                       "down": dense(k[3], (4 * d, d)) / np.sqrt(2 * layers)})
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *blocks)
    return {"embed": jax.random.normal(ks[0], (vocab, d)) * 0.02, "pos": jax.random.normal(ks[1], (seq_len, d)) * 0.02,
            "blocks": stacked, "ln_f": jnp.ones(d), "head": dense(ks[2], (d, vocab))}


def layer_norm(x, g):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g).astype(x.dtype)


def make_loss(*, heads, impl):
    def block(x, p):
        b, t, d = x.shape
        h = layer_norm(x, p["ln1"])
        q, k, v = jnp.split(h @ p["qkv"].astype(h.dtype), 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).reshape(b, t, d)
        x = x + a @ p["out"].astype(x.dtype)
        h = layer_norm(x, p["ln2"])
        return x + jax.nn.gelu(h @ p["up"].astype(h.dtype)) @ p["down"].astype(h.dtype), None

    block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    def loss_fn(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = (params["embed"][inputs] + params["pos"][: inputs.shape[1]]).astype(jnp.bfloat16)
        x, _ = jax.lax.scan(block, x, params["blocks"])
        logits = (layer_norm(x, params["ln_f"]) @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    return loss_fn


def flops_per_token(*, layers, d, vocab, seq_len) -> float:
    n_matmul = layers * 12 * d * d + d * vocab  # qkv + out + MLP, and the LM head
    return 6.0 * n_matmul + 6.0 * layers * seq_len * d


def run(*, layers, d, heads, vocab, seq_len, batch, steps, seed=0) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    params = init_params(jax.random.key(seed), layers=layers, d=d, vocab=vocab, seq_len=seq_len)
    opt = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    loss_fn = make_loss(heads=heads, impl="cudnn" if on_gpu else None)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq_len + 1), 0, vocab, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                     + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    params, opt_state, loss = compiled(params, opt_state, tokens)  # warm-up
    loss.block_until_ready()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    tok_s = batch * seq_len / (ms / 1e3)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {"arch": "anchor_gpt", "layers": layers, "d_model": d, "heads": heads, "vocab": vocab,
            "seq_len": seq_len, "batch": batch, "params": int(n_params),
            "params_non_embedding": int(n_params - params["embed"].size - params["pos"].size),
            "ms_step": ms, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3, "tokens_per_sec": tok_s,
            "mfu": tok_s * flops_per_token(layers=layers, d=d, vocab=vocab, seq_len=seq_len) / PEAK_FLOPS,
            "peak_gib": None if peak is None else peak / 2**30, "compile_s": compile_s,
            "final_loss": float(loss), "device": jax.devices()[0].device_kind}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="2 layers, d 64, T 128, B 2 (a CPU smoke run)")
    ap.add_argument("--out", default=None, help="write the row as JSON here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers, a.d_model, a.heads, a.vocab, a.seq_len, a.batch, a.steps = 2, 64, 4, 256, 128, 2, 2
    if a.d_model % a.heads:
        ap.error(f"--d-model {a.d_model} is not a multiple of --heads {a.heads}")
    row = run(layers=a.layers, d=a.d_model, heads=a.heads, vocab=a.vocab, seq_len=a.seq_len, batch=a.batch,
              steps=a.steps)
    print(f"{'arch':<11}{'params':>8}{'B x T':>12}{'ms/step':>10}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}"
          f"{'compile s':>11}")
    peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
    print(f"{row['arch']:<11}{row['params'] / 1e6:>7.0f}M{a.batch:>5} x {a.seq_len:<5}{row['ms_step']:>10.1f}"
          f"{row['tokens_per_sec'] / 1e3:>10.1f}K{row['mfu']:>7.1%}{peak:>10}{row['compile_s']:>11.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
