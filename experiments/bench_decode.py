"""Batched cached decoding: tokens/s per mixer layer and per model at long contexts, against full attention
measured in the same run.

    python experiments/bench_decode.py                                  # GPU: both tables
    python experiments/bench_decode.py --layer-contexts none --model-contexts 131072   # the README's row

Two tables, each row against the full-attention row of its context:

- **layer**: one mixer's ``step`` (the decode path of ``hybrid_lm/model/*``) at cache length C, for full
  attention, SWA, MoBA, SSA's sparse and full streams, Lightning, Mamba-2 and Gated DeltaNet;
- **model**: ``HybridLM.decode_step`` of whole models at the scale's size (default S5): all full attention,
  the 1:1 hybrids, and SSA decoding through its sparse stream.

The cache is filled as if C - 1 tokens had been decoded (random keys / values in the compute dtype, every slot
valid, block sums of those keys), so no C-token prefill is paid. Each timing runs ``--steps`` decode steps
inside one ``lax.scan`` (one dispatch, the state donated so the caches update in place) and reports the median
of ``--reps``; each call goes on from the previous one's state (positions past C wrap around the cache, which
keeps every slot valid and the work per step the same). Every program is compiled ahead of time
(``--compile-workers`` at once) against the abstract state, then the states are built and timed one at a time.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import load_config  # noqa: E402

from hybrid_lm.model.registry import MixerContext, get_mixer  # noqa: E402
from hybrid_lm.model.transformer import HybridLM  # noqa: E402

BENCH = "decode"
# efficient-slot (or every-layer) settings per variant; "layer" rows time the slot's mixer alone
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
LAYER_SLOT = {"full": "F", "ssa_sparse": "F", "ssa_full": "F"}  # the slot whose mixer a layer row times
QUICK = ["ModelConfig.vocab_size = 256", "ModelConfig.d_model = 64", "ModelConfig.n_heads = 2",
         "ModelConfig.head_dim = 32", "ModelConfig.d_ff = 128", "ModelConfig.n_layers = 2"]


def config(scale: str, arch: str, context: int, dtype: str, extra=()):
    params = list(ARCHS[arch]) + [f"DataConfig.seq_len = {context}", f"ModelConfig.compute_dtype = '{dtype}'",
                                  *extra]
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


class Case:
    """One table row: ``make_carry()`` builds its start state (params, cache, input) and ``step(carry)`` is one
    decode step; the scan of ``steps`` of them is lowered against the state's shapes, nothing allocated."""

    def __init__(self, level, scale, arch, context, batch, dtype, extra):
        self.level, self.arch, self.context, self.batch = level, arch, context, batch
        self.cfg = config(scale, arch, context, dtype, extra)
        self.dtype = jnp.dtype(dtype)
        self.row = dict(level=level, arch=arch, scale=scale, context=context, batch=batch, dtype=dtype)
        if level == "layer":
            self.mc = self.cfg.model.mixer(LAYER_SLOT.get(arch, "E"))
            self.row["mixer"] = self.mc.kind
            self.graphdef = nnx.split(nnx.eval_shape(self._module))[0]
        else:
            self.row["layers"] = "".join(self.cfg.model.layer_types())
            self.graphdef = nnx.split(nnx.eval_shape(self._module))[0]

    def _module(self):
        if self.level == "layer":
            return get_mixer(self.mc.kind).cls(self.cfg.model, self.mc, 1, rngs=nnx.Rngs(0))
        return HybridLM(self.cfg.model, rngs=nnx.Rngs(0))

    def make_carry(self):
        _, params = nnx.split(self._module())
        graphdef, C, B = self.graphdef, self.context, self.batch
        if self.level == "layer":
            x0 = jax.random.normal(jax.random.key(1), (B, 2, self.cfg.model.d_model), jnp.float32).astype(self.dtype)
            ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (B, 2)), train=False)
            _, state = jax.jit(lambda p, x: nnx.merge(graphdef, p).prefill(x, ctx, C))(params, x0)
            return params, fill_state(state, C, jax.random.key(2)), x0[:, 0]
        prompt = jnp.zeros((B, 2), jnp.int32)
        _, cache = jax.jit(lambda p, t: nnx.merge(graphdef, p).prefill(t, C))(params, prompt)
        cache = [fill_state(s, C, jax.random.fold_in(jax.random.key(3), i)) for i, s in enumerate(cache)]
        return params, cache, jnp.ones((B,), jnp.int32)

    def step(self, carry):
        p, s, x = carry
        if self.level == "layer":  # the output feeds the next input, so no part of the step is dead code
            y, s = nnx.merge(self.graphdef, p).step(x, s)
            y = y.astype(jnp.float32)
            return p, s, (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x.dtype)
        logits, s = nnx.merge(self.graphdef, p).decode_step(x, s)  # greedy: the logits pick the next token
        return p, s, jnp.argmax(logits, -1).astype(jnp.int32)

    def program(self, steps: int):
        return jax.jit(lambda c: jax.lax.scan(lambda c, _: (self.step(c), None), c, None, length=steps)[0],
                       donate_argnums=0)


def time_case(case: Case, compiled, steps: int, reps: int) -> float:
    """Median seconds per decode step; each call goes on from the last one's state (donated)."""
    carry = jax.block_until_ready(compiled(case.make_carry()))  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(compiled(carry))
        times.append(time.perf_counter() - t0)
    del carry
    return float(np.median(times)) / steps


def contexts(s: str) -> list[int]:
    return [] if s in ("", "none") else [int(c) for c in s.split(",")]


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--scale", default="s5")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layer-contexts", default="8192,32768,131072", help="contexts of the layer table ('none': none)")
    ap.add_argument("--layer-archs", default="full,swa,moba,ssa_sparse,ssa_full,lightning,mamba2,gdn")
    ap.add_argument("--model-contexts", default="131072", help="contexts of the model table ('none': none)")
    ap.add_argument("--model-archs", default="full,swa,moba,ssa_sparse,lightning,mamba2,gdn")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed scan")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin binding (repeatable)")
    ap.add_argument("--compile-workers", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start: compiles unfinished then "
                                                                   "are reported as not_compiled")
    args = ap.parse_args(argv)
    extra = list(args.gin_param)
    if args.quick:
        args.scale, args.batch, args.steps, args.reps, args.dtype = "s1", 2, 2, 1, "float32"
        args.layer_contexts, args.model_contexts = "256", "256"
        extra = QUICK + extra
    t_start = time.time()
    print(f"device: {harness.device_kind()}, scale {args.scale}, batch {args.batch}, {args.dtype}")
    cases = [Case("layer", args.scale, a, C, args.batch, args.dtype, extra)
             for C in contexts(args.layer_contexts) for a in args.layer_archs.split(",")]
    cases += [Case("model", args.scale, a, C, args.batch, args.dtype, extra)
              for C in contexts(args.model_contexts) for a in args.model_archs.split(",")]

    def jobs():
        for i, c in enumerate(cases):
            try:
                lowered = c.program(args.steps).lower(jax.eval_shape(c.make_carry))
            except Exception as e:  # noqa: BLE001 - reported as its compile error
                yield i, (lambda e=e: harness.reraise(e))
                continue
            yield i, lowered.compile

    deadline = None if args.deadline is None else t_start + args.deadline
    compiled, left_running = harness.compile_all(jobs(), args.compile_workers, deadline)
    rows = []
    print(f"{'level':<6}{'arch':<12}{'context':>8}{'B':>4}{'ms/step':>10}{'tokens/s':>12}{'vs full':>9}")
    for i, c in enumerate(cases):
        row, res = dict(c.row), compiled[i]
        if res["status"] != "compiled":
            row.update(status=res["status"], error=res.get("error"))
        else:
            try:
                sec = time_case(c, res["value"], args.steps, args.reps)
                row.update(status="ok", ms_per_step=1e3 * sec, tokens_per_sec=c.batch / sec,
                           compile_s=res["compile_s"])
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded
                row.update(status="oom" if harness.is_oom(e) else "run_error", error=harness.short_error(e))
            res["value"] = None
        base = next((r for r in rows if r["level"] == c.level and r["context"] == c.context and r["arch"] == "full"
                     and r.get("status") == "ok"), None)
        if row.get("status") == "ok":
            row["vs_full"] = row["tokens_per_sec"] / base["tokens_per_sec"] if base else (1.0 if c.arch == "full"
                                                                                           else None)
            print(f"{c.level:<6}{c.arch:<12}{c.context:>8}{c.batch:>4}{row['ms_per_step']:>10.3f}"
                  f"{row['tokens_per_sec']:>12.0f}{harness.fmt(row['vs_full'], '>8.2f')}x", flush=True)
        else:
            print(f"{c.level:<6}{c.arch:<12}{c.context:>8}{c.batch:>4}  {row['status']}: {row.get('error')}", flush=True)
        rows.append(row)
        harness.write_result(BENCH, args.out, argv, rows, started=t_start, anchor="full attention, same context")
    return harness.finish(BENCH, args.out, argv, rows, started=t_start, left_running=left_running,
                          anchor="full attention, same context")


if __name__ == "__main__":
    main()
