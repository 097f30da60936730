"""One mixer layer's forward and forward+backward per kind (projections included), against the full-attention
layer at the same shape, measured in the same run.

    python experiments/bench_mixers.py                      # GPU: S5's layer shape, T = 16K, B = 2
    python experiments/bench_mixers.py --scale s3 --archs full,swa,sa,gdn

Each row is the mixer of one architecture's efficient slot (SSA: every layer's; ``full``: a full-attention
layer) built from ``configs/scale/<scale>.gin`` and the presets of ``configs/arch/``, called as the model calls
it (``mixer(x, ctx)``, ``attention_impl`` auto: the backends this device resolves) on bf16 inputs ``[B, T,
d_model]``. Forward+backward is ``jax.grad`` of a random projection of the output w.r.t. the parameters and the
input. Compiled ahead of time, then each timed alone (median of ``--reps`` x ``--inner`` calls).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import load_config  # noqa: E402

from hybrid_lm.backends import recorded_backends  # noqa: E402
from hybrid_lm.model.registry import MixerContext, get_mixer  # noqa: E402

BENCH = "mixers"
ARCHS = ("full", "swa", "sa", "sa_swa", "moba", "ssa", "lightning", "mamba2", "gdn")
QUICK = ["ModelConfig.vocab_size = 256", "ModelConfig.d_model = 64", "ModelConfig.n_heads = 2",
         "ModelConfig.head_dim = 32", "ModelConfig.compute_dtype = 'float32'"]


def layer_config(scale: str, arch: str, seq_len: int, extra=()):
    files = [f"scale/{scale}.gin"] + ([f"arch/{arch}.gin"] if arch not in ("full", "swa") else [])
    params = [f"DataConfig.seq_len = {seq_len}", *extra]
    return load_config(files, params)


def mixer_programs(scale, arch, B, T, extra, seed=0):
    """``(fwd, fwd_bwd, args, row)`` of the arch's mixer layer."""
    cfg = layer_config(scale, arch, T, extra)
    slot = "F" if arch in ("full", "ssa") else "E"
    mc = cfg.model.mixer(slot)
    mixer = get_mixer(mc.kind).cls(cfg.model, mc, 1, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(mixer)
    dtype = jnp.dtype(cfg.model.compute_dtype)
    ks = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(ks[0], (B, T, cfg.model.d_model), jnp.float32).astype(dtype)
    r = jax.random.normal(ks[1], (B, T, cfg.model.d_model), jnp.float32).astype(dtype)
    impl = cfg.model.attention_impl

    def fwd(params, x):
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        ctx = MixerContext(positions=pos, attention_impl=impl, step=jnp.int32(3), seed=0,
                           example_ids=jnp.arange(B, dtype=jnp.int32))
        return nnx.merge(graphdef, params)(x, ctx)

    def fwd_bwd(params, x, r):
        return jax.grad(lambda p, x: jnp.sum((fwd(p, x) * r).astype(jnp.float32)), argnums=(0, 1))(params, x)

    row = dict(arch=arch, mixer=mc.kind, scale=scale, B=B, T=T, d_model=cfg.model.d_model, dtype=dtype.name)
    return jax.jit(fwd), jax.jit(fwd_bwd), (params, x, r), row


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--scale", default="s5")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin binding (repeatable)")
    ap.add_argument("--compile-workers", type=int, default=8)
    args = ap.parse_args(argv)
    extra = list(args.gin_param)
    if args.quick:
        args.scale, args.seq_len, args.batch, args.reps, args.inner, args.compile_workers = "s1", 64, 1, 1, 1, 2
        extra = QUICK + extra
    t_start = time.time()
    print(f"device: {harness.device_kind()}, scale {args.scale}, B={args.batch} T={args.seq_len}")
    programs, rows = {}, {}
    for arch in args.archs.split(","):
        recorded_backends(clear=True)
        f, fb, (params, x, r), row = mixer_programs(args.scale, arch, args.batch, args.seq_len, extra)
        programs[(arch, "fwd")] = (f, (params, x))
        programs[(arch, "fwd_bwd")] = (fb, (params, x, r))
        rows[arch] = row
    times, left_running = harness.time_programs(programs, args.reps, args.inner, args.compile_workers)
    for arch, row in rows.items():
        fwd, fb = times[(arch, "fwd")], times[(arch, "fwd_bwd")]
        row.update(fwd_ms=fwd["ms"], fwd_bwd_ms=fb["ms"], compile_s=fb.get("compile_s"))
        if fwd.get("error") or fb.get("error"):
            row["error"] = fwd.get("error") or fb.get("error")
    base = rows.get("full", {})
    for row in rows.values():
        for m in ("fwd_ms", "fwd_bwd_ms"):
            row[m.replace("_ms", "_vs_full")] = None if not (row[m] and base.get(m)) else row[m] / base[m]
    rows = list(rows.values())
    harness.print_table(["arch", "mixer", "fwd ms", "fwd / full", "fwd+bwd ms", "fwd+bwd / full"],
                        [[r["arch"], r["mixer"], harness.fmt(r["fwd_ms"]), harness.fmt(r["fwd_vs_full"], ".2f"),
                          harness.fmt(r["fwd_bwd_ms"]), harness.fmt(r["fwd_bwd_vs_full"], ".2f")] for r in rows])
    return harness.finish(BENCH, args.out, argv, rows, started=t_start, left_running=left_running,
                          anchor="the full-attention layer")


if __name__ == "__main__":
    main()
