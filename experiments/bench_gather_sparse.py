#!/usr/bin/env python
"""Per-token gather sparse attention (``hybrid_lm_kernels.gather_sparse_attention``) on one GPU:
a correctness check and a timing table at S5's shapes.

``--check``: forward and dq/dk/dv on the device against a dense fp32 masked oracle (HIGHEST matmul
precision; key j visible from token t iff j <= t and j's block is in t's list) and against the
union kernel (``hybrid_lm_kernels.block_sparse_attention``) given the same per-token lists, at a
few shapes (S5's 10 heads on 1 KV head, GQA, T not a multiple of the block, fp32 and bf16, the
real SSA selection and random ones, dK/dV chunks of 32 tokens in one case). Prints max abs and
relative L2 errors, and checks that a repeat gives identical bits (no race). Exits 1 on a failure.

Then (unless ``--check-only``) times forward and forward+backward (``jax.vjp`` + pullback of a
random cotangent, one jit), bf16, B 2, H 10, K 1, D 128, block 16, top-16 from the real SSA
selection (``hybrid_lm.ops.block_sparse.select_blocks(gate='ssa', selection='token')``), T in
``--T``, for: cuDNN full causal attention (``jax.nn.dot_product_attention(implementation=
'cudnn')``, the anchor), the union kernel, and the gather kernel per launch config in
``--configs`` (``t<tokens per program>w<warps>s<stages>[c<dK/dV chunk>]``), plus the gather
kernel's XLA list building alone. Median of ``--reps`` x ``--inner`` calls closed by
``block_until_ready``; the selection is a jit argument (closed over, XLA would fold the list
building into a constant).

    python3 experiments/bench_gather_sparse.py --check --out $OUT/gather_sparse.json

(a few minutes on an H200, most of it compiles: 4 check cases, then per T 2 x 7 variants; the JSON
is rewritten after every variant, so a run cut short keeps what it measured).

Needs only JAX: ``kernels/`` is loaded as ``hybrid_lm_kernels`` and ``hybrid_lm.ops`` from this
checkout. ``--tiny`` runs it all on the CPU (interpret mode, tiny shapes, XLA attention in place of
cuDNN): a smoke test of the script, numbers meaningless.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import re
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # hybrid_lm.ops (needs only jax) without an install

from hybrid_lm.ops import block_sparse as ops  # noqa: E402


def load_kernels():
    try:
        return importlib.import_module("hybrid_lm_kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "hybrid_lm_kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


KERN = load_kernels()


def parse_config(name: str) -> dict:
    """``t1w4s2`` or ``t1w4s2c64`` -> tokens per program, warps and stages (forward and backward
    alike) and, with ``c``, the dK/dV chunk of the gather kernel."""
    m = re.fullmatch(r"t(\d+)w(\d+)s(\d+)(?:c(\d+))?", name)
    if m is None:
        raise SystemExit(f"bad config {name!r}: expected t<tokens>w<warps>s<stages>[c<chunk>]")
    t, w, s, c = m.groups()
    cfg = dict(tokens_per_program=int(t), num_warps=int(w), num_stages=int(s),
               num_warps_bwd=int(w), num_stages_bwd=int(s))
    return cfg | ({} if c is None else dict(dkv_chunk=int(c)))


# ------------------------------------------------------------------------------------------------
# inputs, selections, oracle
# ------------------------------------------------------------------------------------------------

def inputs(seed, B, T, H, K, D, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(kk, (B, T, h, D), jnp.float32).astype(dtype)
                 for kk, h in zip(ks, (H, K, K, H)))


def ssa_selection(q, k, block_size, top_k):
    return jax.jit(lambda q, k: ops.select_blocks(q, k, block_size=block_size, top_k=top_k,
                                                  gate="ssa", selection="token"))(q, k)


def random_selection(seed, B, T, K, block_size, top_k):
    return ops.random_token_selection(jax.random.key(seed), B, T, K, block_size=block_size, top_k=top_k)


def dense_oracle(q, k, v, idx, block_size):
    """fp32 dense attention masked to the listed blocks (distinct lists), causal."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    blk = jnp.arange(T) // block_size
    listed = jnp.any(idx[..., None] == blk[None, None, None, None, :], axis=3)  # [B, T, K, T]
    mask = listed & (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None, :, None, :]
    mask = jnp.repeat(mask.transpose(0, 2, 1, 3), G, axis=1)  # [B, H, T, T]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


def fwd_bwd(attn):
    def fb(q, k, v, do, idx):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, idx), q, k, v)
        return (o, *vjp(do))
    return fb


def errors(got, want):
    out = {}
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        r = np.asarray(jnp.asarray(r, jnp.float32), np.float64)
        out[name] = dict(max_abs=float(np.abs(g - r).max()) if np.all(np.isfinite(g)) else math.inf,
                         rel_l2=float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-12)))
    return out


# ------------------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------------------

CHECK_CASES = [  # the kernel's default launch (1 warp, 3 stages, dK/dV chunks of 128), the earlier 2-stage one,
    # and the 4-warp one of session 7
    dict(B=2, T=1000, H=10, K=1, D=128, block=16, top_k=16, dtype="bfloat16", sel="ssa", config="t1w1s3c128"),
    dict(B=1, T=777, H=8, K=2, D=64, block=32, top_k=8, dtype="float32", sel="random", config="t1w1s2"),
    dict(B=1, T=1024, H=4, K=4, D=128, block=16, top_k=16, dtype="bfloat16", sel="random", config="t2w1s2c32"),
    dict(B=2, T=2048, H=10, K=1, D=128, block=16, top_k=16, dtype="bfloat16", sel="ssa", config="t1w4s2"),
]
TINY_CHECK_CASES = [
    dict(B=1, T=40, H=4, K=1, D=32, block=16, top_k=4, dtype="float32", sel="ssa", config="t1w4s2"),
    dict(B=2, T=64, H=4, K=2, D=16, block=16, top_k=2, dtype="bfloat16", sel="random", config="t2w4s2"),
]


def run_check(cases, interpret):
    print("\n== check: gather kernel vs dense fp32 oracle and vs the union kernel (o, dq, dk, dv) ==")
    rows, ok_all = [], True
    for i, c in enumerate(cases):
        dtype = jnp.dtype(c["dtype"])
        q, k, v, do = inputs(100 + i, c["B"], c["T"], c["H"], c["K"], c["D"], dtype)
        idx = (ssa_selection(q, k, c["block"], c["top_k"]) if c["sel"] == "ssa" else
               random_selection(i, c["B"], c["T"], c["K"], c["block"], c["top_k"]))
        bs, cfg = c["block"], parse_config(c["config"])
        row = dict(c)
        try:
            gather = jax.jit(fwd_bwd(lambda q, k, v, idx: KERN.gather_sparse_attention(
                q, k, v, idx, block_size=bs, interpret=interpret, **cfg)))
            got = jax.block_until_ready(gather(q, k, v, do, idx))
            again = jax.block_until_ready(gather(q, k, v, do, idx))
            row["deterministic"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again))
            union = jax.jit(fwd_bwd(lambda q, k, v, idx: KERN.block_sparse_attention(
                q, k, v, idx, block_size=bs, interpret=interpret)))
            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            with jax.default_matmul_precision("highest"):
                want = jax.jit(fwd_bwd(lambda q, k, v, idx: dense_oracle(q, k, v, idx, bs)))(*f32, idx)
            row["vs_oracle"] = errors(got, want)
            row["vs_union"] = errors(got, union(q, k, v, do, idx))
            row["union_vs_oracle"] = errors(union(q, k, v, do, idx), want)
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            row["ok"] = row["deterministic"] and all(e["rel_l2"] < tol for e in row["vs_oracle"].values())
        except Exception as e:  # noqa: BLE001 - record and go on
            traceback.print_exc()
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
        ok_all &= row["ok"]
        rows.append(row)
        shape = " ".join(f"{n}={c[n]}" for n in ("B", "T", "H", "K", "D", "block", "top_k", "dtype", "sel", "config"))
        print(f"  {'PASS' if row['ok'] else 'FAIL'} {shape}", flush=True)
        for ref in ("vs_oracle", "vs_union", "union_vs_oracle"):
            if ref in row:
                print(f"    {ref:16s} " + "  ".join(f"{n}: max {e['max_abs']:.2e} rel {e['rel_l2']:.2e}"
                                               for n, e in row[ref].items()))
        if "deterministic" in row:
            print(f"    identical bits on a repeat: {row['deterministic']}")
    print(f"== check {'PASSED' if ok_all else 'FAILED'} ==", flush=True)
    return rows, ok_all


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def time_ms(fn, args, reps, inner):
    try:
        return median_ms(fn, args, reps, inner, warmup=2)[0]
    except Exception as e:  # noqa: BLE001 (e.g. out of memory): record and go on
        print(f"    failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def list_stats(idx, block_size):
    """How many tokens list a key block: mean and max over blocks (what the dK/dV chunks split)."""
    gs = KERN.gather_sparse_pallas
    lists = gs.token_lists(idx, block_size=block_size)
    _, offsets = gs.inverse_lists(lists, idx.shape[1] // block_size)
    n = np.diff(np.asarray(offsets), axis=-1)
    return dict(tokens_per_block_mean=float(n.mean()), tokens_per_block_max=int(n.max()))


def run_table(Ts, B, configs, reps, inner, interpret, H=10, K=1, D=128, block_size=16, top_k=16,
              rows=None, dump=lambda: None):
    """Appends one row per T to ``rows``, calling ``dump()`` after every variant (a run cut short
    keeps what it measured)."""
    rows = [] if rows is None else rows
    for T in Ts:
        q, k, v, do = inputs(T, B, T, H, K, D, jnp.bfloat16)
        idx = jax.block_until_ready(ssa_selection(q, k, block_size, top_k))
        stats = list_stats(idx, block_size)
        print(f"\n== T={T} B={B} H={H} K={K} D={D} block={block_size} top-{top_k} (ssa), bf16; "
              f"tokens listing a key block: mean {stats['tokens_per_block_mean']:.0f}, "
              f"max {stats['tokens_per_block_max']} ==", flush=True)
        impl = "xla" if interpret else "cudnn"  # no cuDNN on the CPU: XLA's attention stands in

        def anchor(q, k, v, idx):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        variants = {f"{impl}_full_causal": anchor,
                    "union_kernel": lambda q, k, v, idx: KERN.block_sparse_attention(
                        q, k, v, idx, block_size=block_size, interpret=interpret)}
        for name in configs:
            cfg = parse_config(name)
            variants[f"gather_kernel[{name}]"] = (
                lambda q, k, v, idx, cfg=cfg: KERN.gather_sparse_attention(
                    q, k, v, idx, block_size=block_size, interpret=interpret, **cfg))
        gs = KERN.gather_sparse_pallas
        lists_only = jax.jit(lambda idx: gs.inverse_lists(
            gs.token_lists(idx, block_size=block_size), T // block_size))
        r = dict(T=T, B=B, H=H, K=K, D=D, block=block_size, top_k=top_k, **stats, variants={},
                 gather_lists_xla_ms=None)
        rows.append(r)
        for name, attn in variants.items():
            fwd = time_ms(jax.jit(attn), (q, k, v, idx), reps, inner)
            fb = time_ms(jax.jit(fwd_bwd(attn)), (q, k, v, do, idx), reps, inner)
            r["variants"][name] = dict(fwd_ms=fwd, fwd_bwd_ms=fb)
            print(f"  {name}: fwd {fwd} ms, fwd+bwd {fb} ms", flush=True)
            dump()
        r["gather_lists_xla_ms"] = time_ms(lists_only, (idx,), reps, inner)
        dump()
        print_table(r)
    return rows


def print_table(r):
    anchor, base = next(iter(r["variants"].items()))

    def ratio(x, key):
        return "—" if x[key] is None or base[key] is None else f"{x[key] / base[key]:.2f}"

    def ms(x):
        return "—" if x is None else f"{x:.3f}"

    print(f"\nT={r['T']} B={r['B']}: time / {anchor} time (< 1: faster than the anchor)")
    print("| variant | fwd ms | fwd / anchor | fwd+bwd ms | fwd+bwd / anchor |")
    print("|---|---|---|---|---|")
    for name, x in r["variants"].items():
        print(f"| {name} | {ms(x['fwd_ms'])} | {ratio(x, 'fwd_ms')} | {ms(x['fwd_bwd_ms'])} | "
              f"{ratio(x, 'fwd_bwd_ms')} |")
    print(f"| gather lists alone (XLA: token lists + inverse lists) | — | — | "
          f"{ms(r['gather_lists_xla_ms'])} | — |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="correctness check first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--T", default="16384,32768", help="sequence lengths of the table")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--configs", default="t1w4s2,t1w2s2,t1w1s2,t2w2s2,t1w2s2c64",
                   help="gather kernel configs: t<tokens per program>w<warps>s<stages>[c<dK/dV chunk>]")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode, tiny shapes")
    p.add_argument("--out", default=None, help="JSON output path")
    a = p.parse_args()
    interpret = a.tiny or jax.default_backend() == "cpu"
    results = dict(device=str(jax.devices()[0]), jax=jax.__version__, interpret=interpret)

    def dump():
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))

    ok = True
    if a.check or a.check_only:
        results["check"], ok = run_check(TINY_CHECK_CASES if a.tiny else CHECK_CASES, interpret)
        dump()
    if not a.check_only:
        Ts = [64] if a.tiny else [int(t) for t in a.T.split(",")]
        B, reps, inner = (1, 1, 1) if a.tiny else (a.B, a.reps, a.inner)
        configs = a.configs.split(",")[:1] if a.tiny else a.configs.split(",")
        shape = dict(H=4, D=32) if a.tiny else {}
        results["table"] = []
        run_table(Ts, B, configs, reps, inner, interpret, **shape, rows=results["table"], dump=dump)
    if a.out:
        print(f"wrote {a.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
