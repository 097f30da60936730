#!/usr/bin/env python
"""MoBA/SSA block selection (gate + top-k) on the local accelerator: the XLA reference against the
fused selection kernel (``hybrid_lm_kernels.select_blocks``).

    python3 experiments/bench_selection.py --check --out results.json     # the GPU run (< 4 min)

Modes:

- ``--check``: fused == ``ops.select_blocks`` exactly on the device, on quantised inputs (small
  integers / quarters, so every dot product is exact in fp32): the ``moba`` gate, the ``ssa`` gate
  with G = 1, and the ``ssa`` gate with S5's G = 10 on group-identical heads (the group sum then
  cannot create near-ties); plus Gaussian bf16 inputs with S5 heads, where mismatches are
  allowed only as near-ties (the reference scores of the two sorted selections agree to 1e-5).
  Then the fused table below.
- ``--fused`` (implied by ``--check``): at T in ``--T`` (16K, 32K), B = 2, S5's heads (H = 10,
  K = 1, D = 128), bf16: block 16 top-16 gate ssa and block 128 top-16 gate moba. Times (forward)
  ``ops.select_blocks`` with the top-k ``auto`` / ``passes`` / ``sort``, the fused kernel (IEEE
  fp32 dots, and tf32 dots for comparison), the kernel's per-token visit lists alone
  (``selection_matrix`` + compaction), and the whole ``moba_attend`` pallas path fwd+bwd
  (selection + ``block_sparse_attention``) with the old (XLA) and the new (fused) selection. Also
  the mean union list length per 64-query tile of the selections.
- ``--split``: the split selection (``block_importance`` + ``top_k_blocks``): its check (as
  ``--check``, at tf32, IEEE fp32 and bf16 dots, ``--check-impls``; tf32 may differ from the
  reference only between scores within 2e-3, bf16 within 1e-2), then the table of the selection's parts (``split_table``) instead of the fused table.
- ``--unions`` (CPU is fine): union list lengths per query tile for random and for correlated
  (smooth) q, k, at ``--unions-T`` (list lengths, not time).
- neither: the earlier table (``--cases``: per-token vs per-block XLA selection, query chunks).

Prints tables and writes JSON (``--out``). Needs only JAX: ``kernels/`` is loaded as
``hybrid_lm_kernels`` and ``hybrid_lm.ops`` from this checkout. ``--interpret`` (or a CPU backend)
runs the kernels in interpret mode: a smoke test at tiny sizes, numbers meaningless.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # hybrid_lm.ops (needs only jax) without an install


def load_ops():
    from hybrid_lm.ops import block_sparse
    return block_sparse


def load_kernels():
    try:
        return importlib.import_module("hybrid_lm_kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location("hybrid_lm_kernels", ROOT / "kernels" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def time_ms(fn, args, reps=5, inner=5):
    return median_ms(fn, args, reps, inner, warmup=1)[0]


def _try_ms(fn, args, reps, inner, what):
    try:
        return time_ms(fn, args, reps, inner)
    except Exception as e:  # noqa: BLE001 (e.g. out of memory): record and go on
        print(f"  {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


# ----------------------------------------------------------------------------- check

def _quantised(key, shape, lo, hi, div=1.0):
    return (jax.random.randint(key, shape, lo, hi).astype(jnp.float32) / div)


def kernel_selection(ops, kern, impl, interpret):
    """``select(q, k, bs, top_k, gate)`` of a kernel path: ``fused`` (one kernel) or ``split``
    (gate kernel + top-k kernel; ``split`` tf32 dots on a GPU, ``split@highest`` IEEE fp32,
    ``split@bf16`` bf16 operands)."""
    if impl == "fused":
        return lambda q, k, bs, top_k, gate: kern.select_blocks(q, k, block_size=bs, top_k=top_k, gate=gate,
                                                                interpret=interpret)
    prec = jax.lax.Precision.HIGHEST if impl == "split@highest" else jax.lax.Precision.DEFAULT
    dt = "bfloat16" if impl == "split@bf16" else "float32"
    return lambda q, k, bs, top_k, gate: kern.select_blocks_split(
        q, ops.block_means(k, bs), block_size=bs, top_k=top_k, gate=gate, interpret=interpret, precision=prec,
        dot_dtype=dt)


# a kernel selection may differ from the reference only between scores this close (relative):
# IEEE fp32 dots (fused, split@highest) differ in the order of accumulation; tf32 rounds the inputs
# to 10 mantissa bits, bf16 to 7
NEAR_TIE = {"fused": 1e-5, "split@highest": 1e-5, "split": 2e-3, "split@bf16": 1e-2}


def check(ops, kern, interpret, T, B, impl="fused"):
    """Exactness of a kernel selection (``fused``, ``split``, ``split@highest``, ``split@bf16``)
    against the reference on this device."""
    select = jax.jit(kernel_selection(ops, kern, impl, interpret), static_argnums=(2, 3, 4))
    rows = []
    H, K, D = 10, 1, 128
    ks = jax.random.split(jax.random.key(0), 4)
    cases = [("quantised moba", "moba", 16, 16, False), ("quantised ssa G=1", "ssa", 16, 16, False),
             ("quantised ssa G=10, identical heads", "ssa", 16, 16, True),
             ("quantised moba block 128", "moba", 128, 16, False)]
    for name, gate, bs, top_k, identical in cases:
        h = 1 if name.endswith("G=1") else H
        q = _quantised(ks[0], (B, T, 1 if identical else h, D), -3, 4, 4.0)
        q = jnp.broadcast_to(q, (B, T, h, D)) if identical else q
        k = _quantised(ks[1], (B, T, K, D), -3, 4)
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(lambda q, k: ops.select_blocks(
                q, k, block_size=bs, top_k=top_k, gate=gate))(q, k))
        got = np.asarray(select(q, k, bs, top_k, gate))
        rows.append(dict(impl=impl, case=name, gate=gate, block=bs, top_k=top_k, T=T, B=B, H=h, K=K, D=D,
                         ok=bool((got == want).all()), rows_differing=int((got != want).any(-1).sum())))
    # Gaussian bf16: differences allowed only between near-equal reference scores
    for gate, bs in (("ssa", 16), ("moba", 128)):
        q = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[3], (B, T, K, D), jnp.bfloat16)
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(lambda q, k: ops.select_blocks(
                q, k, block_size=bs, top_k=16, gate=gate))(q, k))
        got = np.asarray(select(q, k, bs, 16, gate))
        diff = np.argwhere((got != want).any(-1))  # [n, 3]: b, t, h
        worst = 0.0
        if len(diff):
            kbar = ops.block_means(k, bs)
            for b, t, h in diff[:256]:
                with jax.default_matmul_precision("highest"):
                    imp = np.asarray(ops.block_importance(q[b:b + 1, t:t + 1], kbar[b:b + 1], jnp.array([t]),
                                                          block_size=bs, gate=gate, scale=1 / math.sqrt(D)))[0, 0, h]
                sg, sw = (np.where(x >= 0, imp[np.maximum(x, 0)], -np.inf) for x in (got[b, t, h], want[b, t, h]))
                fin = np.isfinite(sg) & np.isfinite(sw)
                rel = np.abs(sg[fin] - sw[fin]) / np.maximum(1.0, np.abs(sw[fin]))
                same_empty = (np.isfinite(sg) == np.isfinite(sw)).all()
                worst = max(worst, float(rel.max(initial=0.0)) if same_empty else float("inf"))
        rows.append(dict(impl=impl, case=f"gaussian bf16 {gate}", gate=gate, block=bs, top_k=16, T=T, B=B, H=H,
                         K=K, D=D, ok=worst < NEAR_TIE[impl], rows_differing=len(diff), worst_near_tie=worst,
                         rows=int(np.prod(got.shape[:3]))))
    print(f"\n{impl}: | check | T | rows differing | ok |\n|---|---|---|---|")
    for r in rows:
        extra = f" (worst score gap {r['worst_near_tie']:.1e})" if "worst_near_tie" in r else ""
        print(f"| {r['case']} | {r['T']} | {r['rows_differing']}{extra} | {r['ok']} |", flush=True)
    return rows


# ----------------------------------------------------------------------------- union lists

def union_stats(kern, idx, T, block_size, block_q=64):
    """Mean and max union list length per query tile, and the mean number of past blocks a tile's
    rows could select (what random per-token choices fill)."""
    bsp = kern.block_sparse_pallas
    Tp = -(-T // max(block_size, block_q)) * max(block_size, block_q)
    idx = jnp.pad(idx, ((0, 0), (0, Tp - T), (0, 0), (0, 0)), constant_values=-1)
    m = np.asarray(bsp.selection_matrix(idx, seq_len=Tp, block_size=block_size, block_q=block_q, per_token=True))
    n = m.sum(-1)  # [B, Hs, n_tiles]
    past = np.arange(m.shape[2]) * block_q // block_size  # past blocks of each tile
    return dict(mean=float(n.mean()), max=int(n.max()), mean_past=float(past.mean()),
                mean_fraction_of_past=float((n / np.maximum(past, 1)).mean()))


def unions(ops, kern, T, block_size=16, top_k=16, H=10, K=1, D=64):
    """Union list lengths for random (Gaussian) and correlated (AR(1) in time, rho = 0.99) q, k."""
    ks = jax.random.split(jax.random.key(1), 4)
    out = []

    def ar1(key, shape, rho=0.99):
        e = jax.random.normal(key, shape)
        return jax.lax.associative_scan(lambda a, b: (a[0] * b[0], a[1] * b[0] + b[1]),
                                        (jnp.full(shape, rho), e), axis=1)[1] * math.sqrt(1 - rho ** 2)

    for name, q, k in [("random", jax.random.normal(ks[0], (1, T, H, D)), jax.random.normal(ks[1], (1, T, K, D))),
                       ("correlated", ar1(ks[2], (1, T, H, D)), ar1(ks[3], (1, T, K, D)))]:
        for gate in ("ssa", "moba"):
            idx = jax.jit(lambda q, k, gate=gate: ops.select_blocks(q, k, block_size=block_size, top_k=top_k,
                                                                    gate=gate))(q, k)
            st = union_stats(kern, idx, T, block_size)
            out.append(dict(inputs=name, gate=gate, T=T, block=block_size, top_k=top_k, **st))
    print(f"\n| inputs | gate | T | block | top-k | union per 64-query tile: mean / max | mean past blocks | "
          "mean fraction of past |\n|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['inputs']} | {r['gate']} | {r['T']} | {r['block']} | {r['top_k']} | {r['mean']:.1f} / "
              f"{r['max']} | {r['mean_past']:.1f} | {r['mean_fraction_of_past']:.2f} |", flush=True)
    return out


# ----------------------------------------------------------------------------- fused table

def fused_table(ops, kern, interpret, Ts, B, cases, reps, inner):
    H, K, D = 10, 1, 128  # configs/scale/s5.gin
    bsp = kern.block_sparse_pallas
    rows = []
    print(f"\nB={B}, H={H}, K={K}, D={D}, bf16; ms, median of {reps} x {inner} calls")
    print("| T | block | top-k | gate | xla auto | xla passes | xla sort | fused | fused tf32 | lists alone | "
          "moba_attend fwd+bwd: xla sel / fused sel | union mean / past |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in Ts:
        ks = jax.random.split(jax.random.key(T), 4)
        q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, K, D), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, K, D), jnp.bfloat16)
        do = jax.random.normal(ks[3], (B, T, H, D), jnp.bfloat16)
        for bs, top_k, gate in cases:
            r = dict(T=T, B=B, H=H, K=K, D=D, block=bs, top_k=top_k, gate=gate)
            what = f"T={T} block={bs} {gate}"
            for m in ("auto", "passes", "sort"):
                r[f"xla_{m}_ms"] = _try_ms(jax.jit(lambda q, k, m=m: ops.select_blocks(
                    q, k, block_size=bs, top_k=top_k, gate=gate, topk=m)), (q, k), reps, inner, f"{what} xla {m}")
            fused = jax.jit(lambda q, k: kern.select_blocks(q, k, block_size=bs, top_k=top_k, gate=gate,
                                                              interpret=interpret))
            r["fused_ms"] = _try_ms(fused, (q, k), reps, inner, f"{what} fused")
            r["fused_tf32_ms"] = _try_ms(jax.jit(lambda q, k: kern.select_blocks(
                q, k, block_size=bs, top_k=top_k, gate=gate, interpret=interpret,
                precision=jax.lax.Precision.DEFAULT)), (q, k), reps, inner, f"{what} fused tf32")
            idx = fused(q, k)

            Tp = -(-T // max(bs, 64)) * max(bs, 64)

            def lists(idx):  # what block_sparse_attention builds from per-token selections
                idx = jnp.pad(idx, ((0, 0), (0, Tp - T), (0, 0), (0, 0)), constant_values=-1)
                m = bsp.selection_matrix(idx, seq_len=Tp, block_size=bs, block_q=64, per_token=True)
                return bsp._compact(m), bsp._compact(jnp.swapaxes(m, 2, 3))

            r["lists_ms"] = _try_ms(jax.jit(lists), (idx,), reps, inner, f"{what} lists")
            r["union"] = union_stats(kern, idx, T, bs)

            def attend(select):
                def fn(q, k, v):  # moba_attend's pallas path
                    return kern.block_sparse_attention(q, k, v, select(q, k), block_size=bs, interpret=interpret)

                def fwd_bwd(q, k, v, do):
                    o, vjp = jax.vjp(fn, q, k, v)
                    return o, *vjp(do)
                return jax.jit(fwd_bwd)

            r["attend_xla_sel_ms"] = _try_ms(attend(lambda q, k: ops.select_blocks(
                q, k, block_size=bs, top_k=top_k, gate=gate)), (q, k, v, do), reps, inner, f"{what} attend xla")
            r["attend_fused_sel_ms"] = _try_ms(attend(lambda q, k: kern.select_blocks(
                q, k, block_size=bs, top_k=top_k, gate=gate, interpret=interpret)), (q, k, v, do), reps, inner,
                f"{what} attend fused")
            rows.append(r)

            def f(x):
                return "—" if x is None else f"{x:.3f}"
            print(f"| {T} | {bs} | {top_k} | {gate} | {f(r['xla_auto_ms'])} | {f(r['xla_passes_ms'])} | "
                  f"{f(r['xla_sort_ms'])} | **{f(r['fused_ms'])}** | {f(r['fused_tf32_ms'])} | {f(r['lists_ms'])} | "
                  f"{f(r['attend_xla_sel_ms'])} / **{f(r['attend_fused_sel_ms'])}** | "
                  f"{r['union']['mean']:.1f} / {r['union']['mean_past']:.1f} |", flush=True)
    return rows


# ----------------------------------------------------------------------------- split table

def split_table(ops, kern, interpret, Ts, B, reps, inner):
    """The selection's parts at S5's heads (H = 10, K = 1, D = 128), bf16, block 16, top-16, ssa
    gate, forward: the XLA reference (``ops.select_blocks``), its importance and top-k apart, and
    the split kernels (``block_importance`` with tf32 dots and with bf16 dots, ``top_k_blocks`` at
    8 and 16 rows per program)."""
    H, K, D, bs, top_k, gate = 10, 1, 128, 16, 16, "ssa"
    rows = []
    print(f"\nsplit selection: B={B}, H={H}, K={K}, D={D}, block {bs}, top-{top_k}, {gate} gate, bf16; ms, "
          f"median of {reps} x {inner} calls")
    print("| T | xla select | xla importance | xla top-k (passes) | kernel top-k rows 8 / 16 | kernel importance "
          "tf32 / bf16 | split tf32 / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for T in Ts:
        ks = jax.random.split(jax.random.key(T), 2)
        q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, K, D), jnp.bfloat16)
        kbar = jax.jit(lambda k: ops.block_means(k, bs))(k)
        scale = 1.0 / math.sqrt(D)
        r = dict(T=T, B=B, H=H, K=K, D=D, block=bs, top_k=top_k, gate=gate)
        what = f"T={T}"
        imp_fn = jax.jit(lambda q, kbar: ops.block_importance(q, kbar, jnp.arange(T), block_size=bs, gate=gate,
                                                               scale=scale))
        imp = imp_fn(q, kbar)
        for dt in ("float32", "bfloat16"):
            name = "tf32" if dt == "float32" else "bf16"
            r[f"split_{name}_ms"] = _try_ms(jax.jit(lambda q, k, dt=dt: kern.select_blocks_split(
                q, ops.block_means(k, bs), block_size=bs, top_k=top_k, gate=gate, interpret=interpret,
                dot_dtype=dt)), (q, k), reps, inner, f"{what} split {name}")
            r[f"kernel_importance_{name}_ms"] = _try_ms(jax.jit(lambda q, kbar, dt=dt: kern.block_importance(
                q, kbar, block_size=bs, gate=gate, interpret=interpret, dot_dtype=dt)), (q, kbar), reps, inner,
                f"{what} kernel importance {name}")
        for br in (8, 16):
            r[f"kernel_topk_rows{br}_ms"] = _try_ms(jax.jit(lambda x, br=br: kern.top_k_blocks(
                x, top_k, block_rows=br, interpret=interpret)), (imp,), reps, inner, f"{what} top-k rows {br}")
        r["xla_select_ms"] = _try_ms(jax.jit(lambda q, k: ops.select_blocks(q, k, block_size=bs, top_k=top_k,
                                                                             gate=gate)), (q, k), reps, inner, what)
        r["xla_importance_ms"] = _try_ms(imp_fn, (q, kbar), reps, inner, f"{what} xla importance")
        r["xla_topk_ms"] = _try_ms(jax.jit(lambda x: ops._top_blocks(x, top_k, "passes")), (imp,), reps, inner,
                                   f"{what} xla top-k")
        rows.append(r)

        def f(x):
            return "—" if x is None else f"{x:.3f}"
        print(f"| {T} | {f(r['xla_select_ms'])} | {f(r['xla_importance_ms'])} | {f(r['xla_topk_ms'])} | "
              f"{f(r['kernel_topk_rows8_ms'])} / {f(r['kernel_topk_rows16_ms'])} | "
              f"{f(r['kernel_importance_tf32_ms'])} / {f(r['kernel_importance_bf16_ms'])} | "
              f"**{f(r['split_tf32_ms'])}** / {f(r['split_bf16_ms'])} |", flush=True)
    return rows


def split_sweep(ops, kern, interpret, T, B, reps, inner, tiles, topk_launches):
    """Launch sweep of the split kernels at S5's heads (as :func:`split_table`), bf16 dots:
    ``block_importance`` per ``tiles`` (``q<block_q>c<block_c>w<warps>s<stages>[h]``, ``h`` = query
    tiles hoisted), then ``top_k_blocks`` per ``topk_launches`` (``r<rows>w<warps>``). Each row
    is one launch's ms (median of reps x inner calls); the fastest of each kernel is marked."""
    H, K, D, bs, top_k, gate = 10, 1, 128, 16, 16, "ssa"
    parsed = [(name, re.fullmatch(r"q(\d+)c(\d+)w(\d+)s(\d+)(h?)", name)) for name in tiles.split(",")]
    launches = [(name, re.fullmatch(r"r(\d+)w(\d+)", name)) for name in topk_launches.split(",")]
    bad = [n for n, m in parsed + launches if m is None]
    if bad:
        raise SystemExit(f"bad launches {bad}: expected q<block_q>c<block_c>w<warps>s<stages>[h] (gate) and "
                         "r<rows>w<warps> (top-k)")
    ks = jax.random.split(jax.random.key(T), 2)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    kbar = jax.jit(lambda k: ops.block_means(k, bs))(jax.random.normal(ks[1], (B, T, K, D), jnp.bfloat16))
    imp = jax.jit(lambda q, kbar: kern.block_importance(q, kbar, block_size=bs, gate=gate, interpret=interpret,
                                                        dot_dtype="bfloat16"))(q, kbar)
    rows = []
    print(f"\nsplit-kernel launch sweep: T={T} B={B} H={H} K={K} D={D}, block {bs}, top-{top_k}, {gate} gate")
    print("| kernel | launch | rows per program | ms |")
    print("|---|---|---|---|")
    for name, m in parsed:
        bq, bc, w, st, h = m.groups()
        blocks = kern.SelectionBlockSizes(block_q=int(bq), block_c=int(bc), num_warps=int(w), num_stages=int(st),
                                          hoist_q=bool(h))
        sel = kern.selection_pallas  # the rows per program _gate_call takes for these tiles
        used = sel.query_tile(int(bq), T, H // K, min(int(bc), sel._next_pow2(-(-T // bs))), D, 2)
        ms = _try_ms(jax.jit(lambda q, kbar, blocks=blocks: kern.block_importance(
            q, kbar, block_size=bs, gate=gate, interpret=interpret, dot_dtype="bfloat16", block_sizes=blocks)),
            (q, kbar), reps, inner, f"importance {name}")
        rows.append(dict(kernel="block_importance", launch=name, rows=used, ms=ms))
    for name, m in launches:
        br, w = (int(x) for x in m.groups())
        ms = _try_ms(jax.jit(lambda x, br=br, w=w: kern.top_k_blocks(x, top_k, block_rows=br, num_warps=w,
                                                                       interpret=interpret)),
                     (imp,), reps, inner, f"top-k {name}")
        rows.append(dict(kernel="top_k_blocks", launch=name, rows=br, ms=ms))
    for kernel in ("block_importance", "top_k_blocks"):
        timed = [r for r in rows if r["kernel"] == kernel and r["ms"] is not None]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        for r in rows:
            if r["kernel"] == kernel:
                r["fastest"] = r is best
                ms = "—" if r["ms"] is None else f"{r['ms']:.3f}"
                print(f"| {kernel} | {r['launch']} | {r['rows']} | {'**' + ms + '**' if r['fastest'] else ms} |",
                      flush=True)
    return rows


# ----------------------------------------------------------------------------- the earlier table

def xla_table(ops, args):
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
            ms = _try_ms(fn, (q, k), 5, 5, f"{case} {selection} {chunk}")
            default_chunk = ops._query_chunks(T, H * nb, 1, None)
            rows.append(dict(T=T, block=bs, top_k=top_k, gate=gate, selection=selection,
                             query_chunk=chunk or default_chunk, default_chunk=chunk is None,
                             ms=ms, topk_only_ms=topk_ms))
            print(f"| {T} | {bs} | {top_k} | {gate} | {selection} | "
                  f"{(chunk or default_chunk) if selection == 'token' else '—'}{' (default)' if selection == 'token' and chunk is None else ''} | "
                  f"{'—' if ms is None else f'{ms:.3f}'} | {topk_ms['sort']:.3f} / {topk_ms['passes']:.3f} |",
                  flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exactness on the device, then the fused table")
    p.add_argument("--fused", action="store_true", help="the fused-vs-XLA table")
    p.add_argument("--unions", action="store_true", help="union list lengths, random vs correlated inputs")
    p.add_argument("--split", action="store_true", help="the split selection (gate kernel + top-k kernel): check + "
                   "its table at S5 heads")
    p.add_argument("--no-check", action="store_true", help="with --split: the table only")
    p.add_argument("--check-impls", default="split,split@highest,split@bf16", help="with --split: the kernel "
                   "selections checked")
    p.add_argument("--no-table", action="store_true", help="with --split: the check only")
    p.add_argument("--sweep", default=None, metavar="TILES", help="with --split: a launch sweep of the bf16 gate "
                   "kernel over these tiles (q16c64w4s2,q32c64w4s2h,...; h = hoisted query tiles), then of the "
                   "top-k kernel over --sweep-topk, at T = the first of --T")
    p.add_argument("--sweep-topk", default="r8w4,r4w4,r4w2,r2w2,r8w8", help="top-k launches r<rows>w<warps>")
    p.add_argument("--T", default="16384,32768", help="sequence lengths of the fused table")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--check-T", type=int, default=4096)
    p.add_argument("--unions-T", type=int, default=4096)
    p.add_argument("--fused-cases", default="16:16:ssa,128:16:moba", help="block:top_k:gate list")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke)")
    p.add_argument("--cases", default="16384:16:16:ssa,16384:16:16:moba,32768:128:32:moba",
                   help="T:block:top_k:gate list (the earlier table)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--chunks", default="0", help="query_chunk values (0 = default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bad = [i for i in args.check_impls.split(",") if i not in NEAR_TIE or i == "fused"]
    if bad:
        p.error(f"--check-impls: unknown {bad}; choose from {[i for i in NEAR_TIE if i != 'fused']}")
    ops = load_ops()
    result = dict(device=jax.devices()[0].device_kind)
    interpret = args.interpret or jax.default_backend() == "cpu"
    if args.check or args.fused or args.unions or args.split:
        kern = load_kernels()
        print(f"device: {result['device']}{' (Pallas interpret mode)' if interpret else ''}")
        if args.split:
            if not args.no_check:
                result["check"] = [r for impl in args.check_impls.split(",")
                                   for r in check(ops, kern, interpret, args.check_T, args.B, impl)]
            if args.sweep:
                result["sweep"] = split_sweep(ops, kern, interpret, int(args.T.split(",")[0]), args.B, args.reps,
                                              args.inner, args.sweep, args.sweep_topk)
            result["split"] = [] if args.no_table else split_table(ops, kern, interpret, [int(t) for t in args.T.split(",")], args.B,
                                          args.reps, args.inner)
        elif args.check:
            result["check"] = check(ops, kern, interpret, args.check_T, args.B)
        if args.unions:
            result["unions"] = unions(ops, kern, args.unions_T)
        if (args.check or args.fused) and not args.split:
            cases = [(int(a), int(b), g) for a, b, g in (c.split(":") for c in args.fused_cases.split(","))]
            result["fused"] = fused_table(ops, kern, interpret, [int(t) for t in args.T.split(",")], args.B, cases,
                                          args.reps, args.inner)
    else:
        result["rows"] = xla_table(ops, args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "check" in result and not all(r["ok"] for r in result["check"]):
        print("check FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
