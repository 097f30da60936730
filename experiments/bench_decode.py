"""Batched cached decoding: tokens/s per mixer layer and per model at long contexts.

    python experiments/bench_decode.py --contexts 8192,32768,131072 --batch 8 --out bench_decode.json
    python experiments/bench_decode.py --check          # decode == forward pass on this device first
    python experiments/bench_decode.py --contexts 131072 --profile moba,swa   # where a layer's step goes

Two tables, each against full attention measured in the same run:
- **layer**: one mixer's ``step`` (the decode path of ``hybrid_lm/model/*``) at cache length C, for
  full attention, SWA, MoBA, SSA's sparse and full streams, Lightning, Mamba-2 and Gated DeltaNet;
- **model**: ``HybridLM.decode_step`` of whole models at the scale's size (default S5): all full
  attention, SSA decoding through its sparse stream, and the 1:1 hybrids.

The cache is filled as if C-1 tokens had been decoded (random keys/values in the compute dtype, every
slot valid, block sums of those keys), so no C-token prefill is paid. Each timing runs ``--steps``
decode steps inside one ``lax.scan`` (one dispatch, the state donated so the caches update in place)
and reports the median of ``--reps``; each call goes on from the previous one's state (positions past
C wrap around the cache, which keeps every slot valid and the work per step the same).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_lm.config import load_config
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.model.transformer import HybridLM

# efficient-slot (or every-layer) settings per variant; "layer" benches use the slot's mixer alone
ARCHS = {
    "full": ["ModelConfig.layer_pattern = 'F'"],
    "swa": ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 128"],
    "moba": ["efficient/MixerConfig.kind = 'moba'",
             "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'gate': 'ssa'}"],
    "ssa_sparse": ["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.kind = 'ssa'",
                   "full/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'gate': 'ssa', "
                   "'eval_stream': 'sparse'}"],
    "ssa_full": ["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.kind = 'ssa'",
                 "full/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'gate': 'ssa', "
                 "'eval_stream': 'full'}"],
    "lightning": ["efficient/MixerConfig.kind = 'lightning'"],
    "mamba2": ["efficient/MixerConfig.kind = 'mamba2'"],
    "gdn": ["efficient/MixerConfig.kind = 'gdn'"],
}
# the slot whose mixer a layer bench times
LAYER_SLOT = {"full": "F", "ssa_sparse": "F", "ssa_full": "F"}


GIN_PARAMS: list[str] = []  # --gin_param bindings applied to every config (e.g. a tiny model for smoke runs)


def config(scale: str, arch: str, context: int, dtype: str, extra=()):
    params = list(ARCHS[arch]) + [f"DataConfig.seq_len = {context}", f"ModelConfig.compute_dtype = '{dtype}'",
                                  *GIN_PARAMS, *extra]
    return load_config([f"scale/{scale}.gin"], params)


def fill_state(state, context: int, key):
    """A layer's decode state as after ``context - 1`` tokens: random floats, every slot valid."""
    T = context - 1

    def fill(path, x):
        name = str(getattr(path[-1], "key", ""))
        if name == "pos":
            return jnp.asarray(T, x.dtype)
        if name == "slot_pos":
            C = x.shape[0]
            return ((T - 1) - jnp.mod(T - 1 - jnp.arange(C), C)).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            k = jax.random.fold_in(key, hash(name) % (2 ** 31))
            return (0.1 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(fill, state)


def timed_scan(step_fn, carry, steps: int, reps: int) -> float:
    """Median seconds per decode step of ``steps`` steps in one scan. The carry is donated and each
    call continues from the last one's state, as a generation loop does: the scan then updates the
    caches in place (without donation every call first copies them, ~6 us per step at 128K)."""
    run = jax.jit(lambda c: jax.lax.scan(lambda c, _: (step_fn(c), None), c, None, length=steps)[0],
                  donate_argnums=0)
    carry = jax.block_until_ready(run(jax.tree.map(jnp.copy, carry)))  # compile + warm up (caller's arrays kept)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(carry))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def layer_step(scale, arch, context, batch, dtype):
    """``(step, carry, mixer kind)``: one decode step of the arch's mixer layer and its start state."""
    cfg = config(scale, arch, context, dtype)
    slot = LAYER_SLOT.get(arch, "E")
    mc = cfg.model.mixer(slot)
    mixer = get_mixer(mc.kind).cls(cfg.model, mc, 1, rngs=nnx.Rngs(0))
    d = cfg.model.d_model
    x0 = jax.random.normal(jax.random.key(1), (batch, 2, d), jnp.float32).astype(dtype)
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (batch, 2)), train=False)
    graphdef, params = nnx.split(mixer)
    _, state = jax.jit(lambda p, x: nnx.merge(graphdef, p).prefill(x, ctx, context))(params, x0)
    state = fill_state(state, context, jax.random.key(2))
    def step(carry):  # the output feeds the next input, so no part of the step is dead code
        p, s, x_t = carry
        y, s = nnx.merge(graphdef, p).step(x_t, s)
        y = y.astype(jnp.float32)
        return p, s, (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x_t.dtype)

    return step, (params, state, x0[:, 0]), mc.kind


def bench_layer(scale, arch, context, batch, steps, reps, dtype):
    step, carry, kind = layer_step(scale, arch, context, batch, dtype)
    sec = timed_scan(step, carry, steps, reps)
    return {"level": "layer", "arch": arch, "mixer": kind, "context": context, "batch": batch,
            "ms_per_step": 1e3 * sec, "tokens_per_sec": batch / sec}


def profile_layer(scale, arch, context, batch, steps, dtype, out_dir, top):
    """A ``jax.profiler`` trace of ``steps`` decode steps of one layer (one scan), summarised per
    kernel (``profile_train.summarize``: ms per decode step), plus the scan's optimised HLO."""
    from pathlib import Path

    from profile_train import keep_trace, print_summary, summarize

    step, carry, _ = layer_step(scale, arch, context, batch, dtype)
    run = jax.jit(lambda c: jax.lax.scan(lambda c, _: (step(c), None), c, None, length=steps)[0])
    compiled = run.lower(carry).compile()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_{arch}_{context}.hlo.txt").write_text(compiled.as_text())
    jax.block_until_ready(compiled(carry))
    trace_dir = out / f"trace_{arch}"
    with jax.profiler.trace(str(trace_dir)):
        jax.block_until_ready(compiled(carry))
    saved = keep_trace(trace_dir, out / f"trace_decode_{arch}_{context}.json.gz")
    summary = summarize(saved, steps, None, top)
    print(f"profile: {arch} layer, one decode step at {context} tokens, batch {batch}")
    print_summary(summary)
    return dict(summary, level="profile", arch=arch, context=context, batch=batch)


def bench_model(scale, arch, context, batch, steps, reps, dtype):
    cfg = config(scale, arch, context, dtype)
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    prompt = jnp.zeros((batch, 2), jnp.int32)
    _, cache = jax.jit(lambda p, t: nnx.merge(graphdef, p).prefill(t, context))(params, prompt)
    cache = [fill_state(s, context, jax.random.fold_in(jax.random.key(3), i)) for i, s in enumerate(cache)]
    def step(carry):  # greedy: each step's logits pick the next token
        p, c, token = carry
        logits, c = nnx.merge(graphdef, p).decode_step(token, c)
        return p, c, jnp.argmax(logits, -1).astype(jnp.int32)

    sec = timed_scan(step, (params, cache, jnp.ones((batch,), jnp.int32)), steps, reps)
    return {"level": "model", "arch": arch, "scale": scale, "layers": "".join(cfg.model.layer_types()),
            "context": context, "batch": batch, "ms_per_step": 1e3 * sec, "tokens_per_sec": batch / sec}


# gather_decode_attention launches (chunk_rows, num_warps) --parts times beside the default
DECODE_KERNEL_LAUNCHES = [(256, 4), (256, 8), (64, 4), (128, 2), (64, 2)]


def bench_sparse_parts(context, batch, heads, kv_heads, head_dim, block, top_k, steps, reps, dtype):
    """The parts of one MoBA/SSA decode read at cache length ``context``: the gate's scores, its
    top-k (sort vs argmax passes; on a GPU the top-k kernel too), the attention over the selected
    blocks (XLA; on a GPU the decode kernel too), the block-sum update."""
    from hybrid_lm.ops import block_sparse as bs

    ks = jax.random.split(jax.random.key(4), 4)
    nb = context // block
    q = jax.random.normal(ks[0], (batch, 1, heads, head_dim), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (batch, context, kv_heads, head_dim), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], (batch, context, kv_heads, head_dim), jnp.float32).astype(dtype)
    kbar_sum = jax.random.normal(ks[3], (batch, nb, kv_heads, head_dim), jnp.float32)
    pos = jnp.asarray(context - 1, jnp.int32)
    scale = 1.0 / head_dim ** 0.5
    imp0 = bs.block_importance(q, kbar_sum / block, pos[None], block_size=block, gate="ssa", scale=scale)
    idx0 = bs._top_blocks(imp0, top_k, "sort")
    parts = {
        "gate scores": lambda c: c + bs.block_importance(q + c.astype(dtype), kbar_sum / block, pos[None],
                                                         block_size=block, gate="ssa", scale=scale)[..., :1].sum(),
        "top-k sort": lambda c: c + jax.lax.top_k(imp0 + c, top_k)[0][..., :1].sum() * 0,
        "top-k passes": lambda c: c + bs.top_k_by_passes(imp0 + c, top_k)[0][..., :1].sum() * 0,
        "attend selected": lambda c: c + bs.decode_attend(q + c.astype(dtype), kc, vc, idx0, pos,
                                                          block_size=block)[..., :1].sum(),
    }
    if jax.default_backend() == "gpu":  # the kernels moba_read takes on a GPU (backends.sparse_decode_backend)
        import hybrid_lm_kernels as kernels
        parts |= {
            "top-k kernel": lambda c: c + (kernels.top_k_blocks(imp0[:, 0] + c, top_k)[..., :1].sum() * 0
                                           ).astype(jnp.float32),
            "attend kernel": lambda c: c + kernels.gather_decode_attention(
                q[:, 0] + c.astype(dtype), kc, vc, idx0[:, 0], pos, block_size=block)[..., :1].sum(),
        }
        for rows, warps in DECODE_KERNEL_LAUNCHES:  # launches beside the default
            parts[f"attend kernel c{rows}w{warps}"] = lambda c, rows=rows, warps=warps: c + kernels.gather_decode_attention(
                q[:, 0] + c.astype(dtype), kc, vc, idx0[:, 0], pos, block_size=block, chunk_rows=rows,
                num_warps=warps)[..., :1].sum()
    parts |= {
        "block-sum update": None,
    }
    out = []
    for name, fn in parts.items():
        if fn is None:
            def upd(carry):
                sums, c = carry
                return bs.add_block_sums(sums, q[:, :, :kv_heads] + c.astype(dtype), pos, block), c
            sec = timed_scan(upd, (kbar_sum, jnp.zeros((), jnp.float32)), steps, reps)
        else:
            sec = timed_scan(fn, jnp.zeros((), jnp.float32), steps, reps)
        out.append({"level": "part", "part": name, "context": context, "batch": batch, "ms": 1e3 * sec})
        print(f"part  {name:<18}{context:>8}{batch:>4}{1e3 * sec:>10.3f} ms", flush=True)
    return out


def check(dtype: str, archs=("full", "swa", "moba", "ssa_sparse", "lightning", "mamba2", "gdn")) -> list[dict]:
    """Prefill + cached decode against the forward pass's logits on this device (small model)."""
    out = []
    for arch in archs:
        cfg = config("s1", arch, 96, dtype, ["ModelConfig.n_layers = 2", "ModelConfig.vocab_size = 512"])
        model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(0), (2, 96), 0, 512)
        ref = model(tokens, MixerContext(positions=jnp.broadcast_to(jnp.arange(96), (2, 96)), train=False))
        logits, cache = model.prefill(tokens[:, :64], 96)
        got = [logits[:, -1]]
        for t in range(64, 95):
            lt, cache = model.decode_step(tokens[:, t], cache)
            got.append(lt)
        got = jnp.stack(got, 1)
        err = float(jnp.max(jnp.abs(got - ref[:, 63:95])) / jnp.max(jnp.abs(ref)))
        tol = 2e-2 if dtype == "bfloat16" else 1e-4
        out.append({"arch": arch, "max_rel_err": err, "ok": err < tol})
        print(f"check {arch:<11} max |decode - forward| / max |forward| = {err:.2e}  {'ok' if err < tol else 'FAIL'}",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="s5")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layer-archs", default="full,swa,moba,ssa_sparse,ssa_full,lightning,mamba2,gdn")
    ap.add_argument("--model-archs", default="full,ssa_sparse,swa,moba")
    ap.add_argument("--model-contexts", default="131072")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", action="store_true", help="time the parts of the sparse decode read too")
    ap.add_argument("--profile", default="", metavar="ARCHS",
                    help="jax.profiler traces of these layer archs' decode steps (at the first context), then exit")
    ap.add_argument("--profile-dir", default="decode_profile")
    ap.add_argument("--check-archs", default="full,swa,moba,ssa_sparse,lightning,mamba2,gdn")
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin binding (repeatable)")
    ap.add_argument("--check", action="store_true", help="decode == forward on this device, then exit")
    ap.add_argument("--out", default="bench_decode.json")
    args = ap.parse_args()
    GIN_PARAMS.extend(args.gin_param)
    dev = jax.devices()[0].device_kind
    print(f"device: {dev}")
    rows: list[dict] = []
    result = {"device": dev, "args": vars(args), "rows": rows}
    if args.check:
        result["check"] = check(args.dtype, args.check_archs.split(","))
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
        raise SystemExit(0 if all(r["ok"] for r in result["check"]) else 1)

    if args.profile:
        C = int(args.contexts.split(",")[0])
        result["profiles"] = [profile_layer(args.scale, a, C, args.batch, args.steps, args.dtype, args.profile_dir, 30)
                              for a in args.profile.split(",")]
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
        return

    def save():
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)

    def report(r, base):
        ratio = r["tokens_per_sec"] / base["tokens_per_sec"] if base else float("nan")
        print(f"{r['level']:<6}{r['arch']:<12}{r['context']:>8}{r['batch']:>4}{r['ms_per_step']:>10.3f}"
              f"{r['tokens_per_sec']:>12.0f}{ratio:>9.2f}x", flush=True)
        r["vs_full"] = ratio
        rows.append(r)
        save()  # after every row: a timed-out call keeps what it measured

    print(f"{'level':<6}{'arch':<12}{'context':>8}{'B':>4}{'ms/step':>10}{'tokens/s':>12}{'vs full':>10}")
    def table(bench, contexts, archs):  # each row against the full-attention row of its context
        for C in (int(c) for c in contexts.split(",") if c):
            base = None
            for arch in archs.split(","):
                r = bench(args.scale, arch, C, args.batch, args.steps, args.reps, args.dtype)
                base = r if arch == "full" else base
                report(r, base)

    table(bench_layer, args.contexts, args.layer_archs)
    if args.parts:
        m = config(args.scale, "moba", 1024, args.dtype).model
        o = m.efficient.options
        for C in (int(c) for c in args.contexts.split(",") if c):
            rows.extend(bench_sparse_parts(C, args.batch, m.n_heads, m.n_kv_heads, m.resolved_head_dim,
                                           o["block_size"], o["top_k"], args.steps, args.reps, args.dtype))
            save()
    table(bench_model, args.model_contexts, args.model_archs)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
