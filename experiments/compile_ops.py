"""Compile time of one model's linear-attention op calls alone, forward and forward + backward.

    python experiments/compile_ops.py --scale s5 --arch lightning --seq-len 16384 --batch 8 --out ops.json

Traces the arch's train loss once (shapes only) and records every call the mixers make to
``ops/linear_attention_gpu.simple_gla`` / ``gated_delta_rule``, with its shapes, dtypes and keywords.
Each distinct call is then jitted on its own: the op's outputs summed (``fwd``), or that sum's
gradient with respect to the float inputs (``fwd+bwd``), and lowered and compiled, timed apart.
``--impl`` picks the op's ``impl`` (``auto``: the jla kernel on a GPU that takes it, else our XLA
scan). Answers whether a slow train-step compile comes from the op (its kernels) or from the rest.
Prints a table and writes JSON after every row, so a run cut off by its time limit keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from bench_train import make_config
from hybrid_lm.model import gated_deltanet, lightning, mamba2
from hybrid_lm.train.step import ModelFns

OPS = {"simple_gla": (lightning, mamba2), "gated_delta_rule": (gated_deltanet,)}
LINEAR_ARCHS = ("lightning", "mamba2", "gdn")  # the bench_train archs whose mixers call OPS


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def record_calls(cfg) -> list[tuple[str, dict, dict]]:
    """The distinct (op, array argument specs by position or keyword, static keywords) the model's
    loss calls, from one shape-only trace (``impl``, ``label`` and an initial state left out)."""
    calls: list[tuple[str, dict, dict]] = []
    originals = {}

    def recorder(name, fn):
        def wrapped(*args, **kwargs):
            named = {**dict(enumerate(args)), **{k: v for k, v in kwargs.items() if k != "initial_state"}}
            specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in named.items() if _is_array(v)}
            keys = {k: v for k, v in kwargs.items()
                    if k not in ("impl", "label", "initial_state") and not _is_array(v)}
            if (name, specs, keys) not in calls:
                calls.append((name, specs, keys))
            return fn(*args, **kwargs)
        return wrapped

    for name, modules in OPS.items():
        for mod in modules:
            if hasattr(mod, name):
                originals[(mod, name)] = getattr(mod, name)
                setattr(mod, name, recorder(name, getattr(mod, name)))
    try:
        fns = ModelFns(cfg)
        params = jax.eval_shape(fns.init, 0)
        tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jnp.int32)
        jax.eval_shape(lambda p, t: fns.loss(p, t, 0, jnp.zeros(t.shape[0], jnp.int32))[0], params, tokens)
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)
    return calls


def op_program(name: str, specs: dict, keys: dict, impl: str, backward: bool):
    """A jitted function of the call's arrays: the sum of its outputs, or its gradient."""
    from hybrid_lm.ops import linear_attention_gpu as lag
    op = getattr(lag, name)
    present = list(specs)  # positions (int) and keywords (str) of the array arguments
    n_pos = 1 + max((k for k in present if isinstance(k, int)), default=-1)

    def loss(*arrays):
        given = dict(zip(present, arrays))
        args = [given.get(i) for i in range(n_pos)]
        o, state = op(*args, impl=impl, **keys, **{k: a for k, a in given.items() if isinstance(k, str)})
        total = jnp.sum(o.astype(jnp.float32))
        return total + (0.0 if state is None else jnp.sum(state))

    fn = jax.grad(loss, argnums=tuple(range(len(present)))) if backward else loss
    return jax.jit(fn), [specs[i] for i in present]


def measure(name, specs, keys, impl, backward) -> dict:
    fn, arrays = op_program(name, specs, keys, impl, backward)
    t0 = time.perf_counter()
    lowered = fn.lower(*arrays)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    text = lowered.as_text()
    return dict(op=name, pass_="fwd+bwd" if backward else "fwd", impl=impl,
                shapes=[list(s.shape) + [str(s.dtype)] for s in arrays], lower_s=t1 - t0, compile_s=t2 - t1,
                kernel_calls=text.count("custom_call @mosaic_gpu"), stablehlo_mb=len(text) / 2 ** 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="s5")
    ap.add_argument("--arch", default="lightning", choices=LINEAR_ARCHS)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--impl", default="auto", choices=("auto", "xla", "jla"))
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    ap.add_argument("--out", default="compile_ops.json")
    args = ap.parse_args()
    passes = args.passes.split(",")
    if bad := sorted(set(passes) - {"fwd", "fwd+bwd"}):
        raise SystemExit(f"--passes: unknown {bad}; choose from fwd, fwd+bwd")
    cfg = make_config(args.scale, args.arch, args.seq_len, args.batch, "dots_attn", "auto")
    calls = record_calls(cfg)
    if not calls:
        raise SystemExit(f"{args.scale} {args.arch}: the loss made no linear-attention op call")
    rows = []
    print(f"{'op':<18}{'pass':<9}{'impl':<6}{'lower s':>9}{'compile s':>11}{'kernels':>9}  shapes", flush=True)
    for name, specs, keys in calls:
        for p in passes:
            r = dict(scale=args.scale, arch=args.arch, **measure(name, specs, keys, args.impl, p == "fwd+bwd"))
            rows.append(r)
            print(f"{r['op']:<18}{r['pass_']:<9}{r['impl']:<6}{r['lower_s']:>9.1f}{r['compile_s']:>11.1f}"
                  f"{r['kernel_calls']:>9}  {r['shapes'][:3]}", flush=True)
            with open(args.out, "w") as f:
                json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
