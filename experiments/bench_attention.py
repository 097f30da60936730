#!/usr/bin/env python
"""Windowed-attention benchmark and GPU correctness check (one H200).

Times, in one process and one run, bf16 with H=16, D=128:
  * cuDNN sliding window: ``jax.nn.dot_product_attention(implementation='cudnn', is_causal=True,
    local_window_size=(w-1, 0))`` (the anchor; every ratio is against it, same run),
  * our Pallas kernel (``hybrid_lm_kernels.windowed_attention``) for SWA (positions=None) and for
    SA (random permutation positions, same band: cuDNN cannot express this mask),
  * the naive SA route (``pallas_sa_gather``: gather q, k, v by the permutation, kernel, scatter
    the output back), to show what the gathers cost,
  * jax-linear-attention's Mosaic GPU ``flash_attention(sliding_window=w)`` where importable,
forward and forward+backward (``jax.vjp`` then the pullback of a random cotangent, in one jit), for
(T, B) in {(4096, 8), (16384, 2), (65536, 1)} and w in {128, 512, 2048}.

Timing: jit, 3 warm-up calls, then ``--reps`` repetitions of ``--inner`` back-to-back calls closed
by ``block_until_ready``; the median per-call time is reported (dispatch overlaps device work, so
this is device time for calls of more than a few tens of microseconds).

``--check`` compares forward and dq/dk/dv on the GPU against the fp32 references of
``hybrid_lm/ops/attention.py`` (dense oracle, HIGHEST matmul precision), identity and permuted
positions, bf16 and fp32, T not a multiple of the blocks, GQA, w in {1, 64, 128, 1000}, and
checks that two runs give identical bits (no race).

``--moba`` adds the block-sparse (MoBA) kernel: a GPU check against a dense fp32 oracle (per-token
and per-block selections, bf16/fp32, T not a multiple of the block, GQA) and a table at T=32768,
B=1, block 128, top-k = 1/8 of the blocks, against cuDNN *full causal* attention (the anchor),
per-block lists, per-token lists (coherent, i.e. shared within a block, and random, the worst
case for the union lists), and the model's path (gate + selection + kernel). ``--moba-only``
skips the windowed part.

``--sweep`` times a few tile configurations at T=16384, B=2 and uses the fastest per window
for the table; ``--config FWD+DKV+DQ`` (names below) fixes one; otherwise the kernel's own
``default_block_sizes(window)`` is used.

Usage (device machine, repo root; jla optional, carried as a wheel in ``.whl/``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 experiments/bench_attention.py --check --sweep --out $OUT/bench.json

Works without installing the repo: ``kernels/`` is loaded as ``hybrid_lm_kernels`` and the
reference module by path. ``--interpret`` runs a tiny CPU smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import functools
import importlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

ROOT = Path(__file__).resolve().parents[1]


def _load_path(name: str, path: Path, package_dir: Path | None = None):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_kernels():
    try:
        return importlib.import_module("hybrid_lm_kernels")
    except ImportError:
        return _load_path("hybrid_lm_kernels", ROOT / "kernels" / "__init__.py", ROOT / "kernels")


def load_reference():
    # by path: the reference only needs jax, whatever else hybrid_lm imports
    return _load_path("_hybrid_lm_ops_attention", ROOT / "hybrid_lm" / "ops" / "attention.py")


def load_jla():
    try:
        from jla.ops.mosaic_gpu.attention import flash_attention
        return flash_attention
    except Exception as e:  # noqa: BLE001 - optional anchor
        print(f"[jla] not available: {type(e).__name__}: {e}")
        return None


K = load_kernels()
REF = load_reference()
INTERPRET = False  # --interpret: CPU smoke test of this script (Pallas interpret mode)

# ------------------------------------------------------------------------------------------------
# tile configurations
# ------------------------------------------------------------------------------------------------

BS = K.BlockSizes
FWD_CONFIGS = {
    "f64": dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
    "f64s3": dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    "f64x128": dict(block_q=64, block_k=128, num_warps=4, num_stages=2),
    "f128": dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    "f128s3": dict(block_q=128, block_k=128, num_warps=8, num_stages=3),
}
DKV_CONFIGS = {  # key rows per program (k), query rows per step (q)
    "k64": dict(block_k_dkv=64, block_q_dkv=64, num_warps_dkv=4, num_stages_dkv=2),
    "k64s3": dict(block_k_dkv=64, block_q_dkv=64, num_warps_dkv=4, num_stages_dkv=3),
    "k64q32": dict(block_k_dkv=64, block_q_dkv=32, num_warps_dkv=4, num_stages_dkv=3),
    "k128w8": dict(block_k_dkv=128, block_q_dkv=64, num_warps_dkv=8, num_stages_dkv=2),
}
DQ_CONFIGS = {  # query rows per program (q), key rows per step (k)
    "q64": dict(block_q_dq=64, block_k_dq=64, num_warps_dq=4, num_stages_dq=2),
    "q64s3": dict(block_q_dq=64, block_k_dq=64, num_warps_dq=4, num_stages_dq=3),
    "q64k32": dict(block_q_dq=64, block_k_dq=32, num_warps_dq=4, num_stages_dq=3),
    "q128w8": dict(block_q_dq=128, block_k_dq=64, num_warps_dq=8, num_stages_dq=2),
    # no dQ kernel: the dK/dV kernel adds dQ partials with fp32 atomics (not bitwise reproducible)
    "fused": dict(fused_bwd=True),
}
DEFAULT_CFG = ("f64", "k64", "q64")  # baseline of the sweep


def make_blocks(fwd: str, dkv: str, dq: str):
    return BS(**FWD_CONFIGS[fwd], **DKV_CONFIGS[dkv], **DQ_CONFIGS[dq])


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

GPU_LOCK = None  # --gpu-lock: workers of --parallel take turns on the GPU (compile outside it)
_turn_depth = 0


@contextlib.contextmanager
def gpu_turn():
    """Exclusive use of the GPU among the processes sharing ``--gpu-lock`` (a no-op otherwise):
    every GPU execution of this script (inputs, checks, timings) runs inside one. Re-entrant."""
    global _turn_depth
    if GPU_LOCK is None or _turn_depth:
        _turn_depth += 1
        try:
            yield
        finally:
            _turn_depth -= 1
        return
    with open(GPU_LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _turn_depth += 1
        try:
            yield
        finally:
            _turn_depth -= 1
            fcntl.flock(f, fcntl.LOCK_UN)


def on_gpu_turn(fn):
    """Decorator: eager GPU work (input generation) inside a GPU turn, finished before it ends."""
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        with gpu_turn():
            return jax.block_until_ready(fn(*a, **kw))
    return wrapped


@on_gpu_turn
def rand_inputs(seed, B, T, H, KV, D, dtype):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, KV, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, KV, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, D), jnp.float32).astype(dtype)
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, T))(jax.random.split(ks[4], B))
    return q, k, v, do, perm.astype(jnp.int32)


def fwd_bwd(attn):
    def fb(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))
    return fb


def compiled(fn, args):
    """AOT-compiles a jitted ``fn`` for ``args`` (outside the GPU turn: compiles run in parallel)."""
    return fn.lower(*args).compile()


def run_once(fn, args):
    """Compiles ``fn`` for ``args`` (unless already compiled), then runs it once in this worker's
    GPU turn."""
    fn = compiled(fn, args) if hasattr(fn, "lower") else fn
    with gpu_turn():
        return jax.block_until_ready(fn(*args))


def time_fn(fn, args, reps, inner):
    fn = compiled(fn, args)
    with gpu_turn():
        return _time_compiled(fn, args, reps, inner)


def _time_compiled(fn, args, reps, inner):
    return median_ms(fn, args, reps, inner)


def useful_flops(B, T, H, D, w):
    w = min(w, T)
    pairs = T * w - w * (w - 1) // 2
    return 4 * D * pairs * B * H  # forward; forward+backward counted as 3.5x


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    floor = 0.05 * math.sqrt(b.size)  # exactly-zero gradients (w=1) compare against RMS 0.05
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))


# ------------------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------------------

def run_check(blocks, results):
    print("\n== check: kernel vs fp32 reference on the GPU (rel. L2 error of o, dq, dk, dv) ==")
    cases = []
    for w in (1, 64, 128, 1000):
        for permuted in (False, True):
            cases.append(dict(B=2, T=1000, H=8, KV=2, D=128, w=w, dtype="bfloat16",
                              permuted=permuted, ref="dense"))
    cases += [
        dict(B=1, T=520, H=4, KV=1, D=64, w=128, dtype="float32", permuted=True, ref="dense"),
        dict(B=1, T=520, H=4, KV=1, D=64, w=1000, dtype="float32", permuted=False, ref="dense"),
        dict(B=1, T=4096, H=4, KV=4, D=128, w=512, dtype="bfloat16", permuted=True,
             ref="blocked"),
        dict(B=1, T=4096, H=4, KV=4, D=128, w=512, dtype="bfloat16", permuted=False,
             ref="blocked"),
        # the kernel's default tiles for large windows (128x128 forward, 8 warps, 3 stages)
        dict(B=1, T=4096, H=4, KV=2, D=128, w=2048, dtype="bfloat16", permuted=True,
             ref="blocked", default_blocks=True),
        dict(B=2, T=3000, H=4, KV=4, D=128, w=2048, dtype="bfloat16", permuted=False,
             ref="blocked", default_blocks=True),
        dict(B=2, T=1000, H=8, KV=2, D=128, w=128, dtype="bfloat16", permuted=True,
             ref="dense", fused=True),
        dict(B=1, T=4096, H=4, KV=4, D=128, w=2048, dtype="bfloat16", permuted=False,
             ref="blocked", fused=True),
        # SA window_mode='symmetric': |i - j| < w in the permuted order (window_right = w - 1)
        dict(B=2, T=1000, H=8, KV=2, D=128, w=128, wr=127, dtype="bfloat16", permuted=True,
             ref="dense"),
        dict(B=1, T=4096, H=4, KV=2, D=128, w=512, wr=511, dtype="bfloat16", permuted=True,
             ref="blocked", default_blocks=True),
        dict(B=1, T=520, H=4, KV=1, D=64, w=600, wr=599, dtype="float32", permuted=True,
             ref="dense"),
    ]
    ok_all = True
    for i, c in enumerate(cases):
        dtype = jnp.dtype(c["dtype"])
        q, k, v, do, perm = rand_inputs(100 + i, c["B"], c["T"], c["H"], c["KV"], c["D"], dtype)
        pos = perm if c["permuted"] else None
        w = c["w"]
        wr = c.get("wr", 0)
        fused = c.get("fused", False)
        cblocks = (None if c.get("default_blocks") else
                   dataclasses.replace(blocks, fused_bwd=fused))
        try:
            ours = jax.jit(fwd_bwd(lambda q, k, v: K.windowed_attention(
                q, k, v, pos, w, block_sizes=cblocks, interpret=INTERPRET, window_right=wr)))
            ours = compiled(ours, (q, k, v, do))
            got = run_once(ours, (q, k, v, do))
            again = run_once(ours, (q, k, v, do))
            with gpu_turn():
                same_bits = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again))
            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            if c["ref"] == "dense":
                ref_fn = lambda q, k, v: REF.dense_attention(q, k, v, window=w, positions=pos,
                                                             window_right=wr)
            else:
                ref_fn = lambda q, k, v: REF.windowed_attention(q, k, v, w, positions=pos,
                                                                window_right=wr)
            with jax.default_matmul_precision("highest"):
                want = run_once(jax.jit(fwd_bwd(ref_fn)), f32)
            with gpu_turn():
                errs = [rel_err(g, r) for g, r in zip(got, want)]
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            # fp32 atomics (fused backward) reorder dq sums: bitwise equality only without them
            ok = all(e < tol for e in errs) and (same_bits or fused)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errs, same_bits, ok, tol = [float("nan")] * 4, False, False, None
            c["error"] = f"{type(e).__name__}: {e}"[:500]
        ok_all &= ok
        c.update(errors=dict(zip(("o", "dq", "dk", "dv"), errs)), deterministic=same_bits,
                 tol=tol, ok=ok)
        results["check"].append(c)
        print(f"  {'PASS' if ok else 'FAIL'} B={c['B']} T={c['T']} H={c['H']} K={c['KV']} "
              f"D={c['D']} w={w}{f'/right {wr}' if wr else ''} {c['dtype']} {'SA' if c['permuted'] else 'SWA'} ref={c['ref']}"
              f"{' fused-bwd' if fused else ''}{' default-tiles' if cblocks is None else ''}: "
              + " ".join(f"{n}={e:.2e}" for n, e in zip(("o", "dq", "dk", "dv"), errs))
              + f" same_bits={same_bits}")
    # cuDNN against the same reference once, so the comparison itself is checked
    try:
        q, k, v, do, _ = rand_inputs(7, 2, 1024, 8, 2, 128, jnp.bfloat16)
        w = 128
        cud = run_once(jax.jit(fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(w - 1, 0), implementation="cudnn"))),
            (q, k, v, do))
        with jax.default_matmul_precision("highest"):
            want = run_once(jax.jit(fwd_bwd(lambda q, k, v: REF.dense_attention(q, k, v, window=w))),
                            [x.astype(jnp.float32) for x in (q, k, v, do)])
        with gpu_turn():
            errs = [rel_err(g, r) for g, r in zip(cud, want)]
        print("  cuDNN w=128 vs reference: " + " ".join(
            f"{n}={e:.2e}" for n, e in zip(("o", "dq", "dk", "dv"), errs)))
        results["check_cudnn"] = errs
    except Exception as e:  # noqa: BLE001
        print(f"  cuDNN check failed: {type(e).__name__}: {e}")
    print(f"== check {'PASSED' if ok_all else 'FAILED'} ==")
    results["check_ok"] = ok_all
    return ok_all


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def impl_fns(name, w, blocks, perm, jla):
    if name == "cudnn":
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                local_window_size=(w - 1, 0),
                                                implementation="cudnn")
    elif name == "pallas_swa":
        def attn(q, k, v):
            return K.windowed_attention(q, k, v, None, w, block_sizes=blocks,
                                        interpret=INTERPRET)
    elif name == "pallas_sa":
        def attn(q, k, v):
            return K.windowed_attention(q, k, v, perm, w, block_sizes=blocks,
                                        interpret=INTERPRET)
    elif name == "pallas_sa_sym":  # SA window_mode='symmetric': |i - j| < w (about 2x the band)
        def attn(q, k, v):
            return K.windowed_attention(q, k, v, perm, w, block_sizes=blocks,
                                        interpret=INTERPRET, window_right=w - 1)
    elif name == "pallas_sa_gather":
        # naive SA route for scale: gather q, k, v into the permuted order, run the kernel with
        # the permutation as positions, scatter the output back to the original order
        inv = jnp.argsort(perm, axis=1)

        def attn(q, k, v):
            g = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
            o = K.windowed_attention(g(q, perm), g(k, perm), g(v, perm), perm, w,
                                     block_sizes=blocks, interpret=INTERPRET)
            return g(o, inv)
    elif name == "jla":
        def attn(q, k, v):
            return jla(q, k, v, sliding_window=w)
    elif name == "jla_fused":  # jla's one-kernel backward: dq by TMA reduce-add (5 matmuls per tile)
        def attn(q, k, v):
            return jla(q, k, v, sliding_window=w, backward="fused")
    else:
        raise ValueError(name)
    return jax.jit(attn), jax.jit(fwd_bwd(attn))


def measure(name, T, B, w, blocks, args, jla, reps, inner, modes=("fwd", "fwd_bwd")):
    q, k, v, do, perm = args
    f, fb = impl_fns(name, w, blocks, perm, jla)
    res = {}
    for mode in modes:
        try:
            fn, fargs = (f, (q, k, v)) if mode == "fwd" else (fb, (q, k, v, do))
            med, all_t = time_fn(fn, fargs, reps, inner)
            res[mode] = med
            res[mode + "_all"] = [round(x, 4) for x in all_t]
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            print(f"  [{name} {mode} T={T} B={B} w={w}] failed: {msg[:300]}")
            res[mode] = None
            res[mode + "_error"] = msg[:1000]
    return res


def run_sweep(args, results, jla):
    """Per window: best forward tiles (forward time), then best dK/dV tiles with the default dQ,
    then best dQ tiles (both by forward+backward time)."""
    T, B = args.sweep_shape
    H, D = 16, 128
    best = {}
    print(f"\n== sweep: tile configs at T={T}, B={B}, H={H}, D={D} (ms, SWA) ==")
    inputs = rand_inputs(1, B, T, H, H, D, jnp.bfloat16)

    def pick(times, default):
        valid = {n: t for n, t in times.items() if t is not None}
        return min(valid, key=valid.get) if valid else default

    for w in args.windows:
        fwd_t, dkv_t, dq_t = {}, {}, {}
        for name in FWD_CONFIGS:
            r = measure("pallas_swa", T, B, w, make_blocks(name, *DEFAULT_CFG[1:]), inputs, jla,
                        args.reps, args.inner, modes=("fwd",))
            fwd_t[name] = r["fwd"]
            print(f"  w={w} fwd {name}: {r['fwd']}", flush=True)
        fbest = pick(fwd_t, DEFAULT_CFG[0])
        for name in DKV_CONFIGS:
            r = measure("pallas_swa", T, B, w, make_blocks(fbest, name, DEFAULT_CFG[2]), inputs,
                        jla, args.reps, args.inner, modes=("fwd_bwd",))
            dkv_t[name] = r["fwd_bwd"]
            print(f"  w={w} fwd+bwd {fbest}+{name}+{DEFAULT_CFG[2]}: {r['fwd_bwd']}", flush=True)
        kbest = pick(dkv_t, DEFAULT_CFG[1])
        dq_t[DEFAULT_CFG[2]] = dkv_t[kbest]
        for name in DQ_CONFIGS:
            if name == DEFAULT_CFG[2]:
                continue
            r = measure("pallas_swa", T, B, w, make_blocks(fbest, kbest, name), inputs, jla,
                        args.reps, args.inner, modes=("fwd_bwd",))
            dq_t[name] = r["fwd_bwd"]
            print(f"  w={w} fwd+bwd {fbest}+{kbest}+{name}: {r['fwd_bwd']}", flush=True)
        qbest = pick(dq_t, DEFAULT_CFG[2])
        best[w] = (fbest, kbest, qbest)
        results["sweep"].append(dict(T=T, B=B, w=w, fwd=fwd_t, fwd_bwd_dkv=dkv_t,
                                     fwd_bwd_dq=dq_t, best=list(best[w])))
        print(f"  w={w}: best {'+'.join(best[w])}")
    del inputs
    return best


# ------------------------------------------------------------------------------------------------
# --moba: block-sparse kernel
# ------------------------------------------------------------------------------------------------

MOBA_CONFIGS = {  # tiles shared by the three kernels (the lists are per query tile); key tiles are
    # capped at the block, so at SSA's block 16 these run 16-wide key tiles
    "m64": dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
    "m128x64": dict(block_q=128, block_k=64, num_warps=8, num_stages=2, num_warps_bwd=8),
    "m128": dict(block_q=128, block_k=128, num_warps=8, num_stages=2, num_warps_bwd=8),
    "m64s3": dict(block_q=64, block_k=64, num_warps=4, num_stages=3, num_stages_bwd=3),
}


@on_gpu_turn
def moba_selection(seed, B, rows, Hs, nb, top_k, block_of_row):
    """top_k blocks per row from random scores: own block forced, later blocks excluded."""
    imp = jax.random.normal(jax.random.key(seed), (B, rows, Hs, nb))
    c = jnp.arange(nb)[None, :]
    own = block_of_row[:, None]
    imp = jnp.where((c > own)[None, :, None, :], -jnp.inf, imp)
    imp = jnp.where((c == own)[None, :, None, :], jnp.inf, imp)
    vals, idx = jax.lax.top_k(imp, min(top_k, nb))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def moba_dense_oracle(q, k, v, tok_idx, block_size):
    """fp32 dense masked attention: key j visible from t iff j <= t and (same block or selected)."""
    B, T, H, D = q.shape
    Hs = tok_idx.shape[2]
    blk = jnp.arange(T) // block_size
    sel = jnp.any(tok_idx[..., None] == blk[None, None, None, None, :], axis=3)  # [B, T, Hs, T]
    mask = (sel | (blk[:, None] == blk[None, :])[None, :, None, :]) & (
        jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None, :, None, :]
    mask = jnp.repeat(mask.transpose(0, 2, 1, 3), H // Hs, axis=1)  # [B, H, T, T]
    G = H // k.shape[2]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


def run_moba_check(results):
    print("\n== moba check: block-sparse kernel vs dense fp32 oracle (rel. L2 of o, dq, dk, dv) ==")
    cases = [
        dict(B=2, T=1000, H=8, KV=2, Hs=8, bs=64, top_k=4, per_token=True, dtype="bfloat16"),
        dict(B=2, T=1000, H=8, KV=2, Hs=2, bs=64, top_k=4, per_token=False, dtype="bfloat16"),
        dict(B=1, T=1500, H=4, KV=1, Hs=4, bs=128, top_k=3, per_token=False, dtype="bfloat16"),
        dict(B=1, T=1500, H=4, KV=1, Hs=1, bs=128, top_k=3, per_token=True, dtype="bfloat16",
             config="m128"),
        dict(B=1, T=700, H=4, KV=2, Hs=4, bs=32, top_k=5, per_token=True, dtype="float32"),
        dict(B=1, T=1024, H=4, KV=4, Hs=4, bs=128, top_k=3, per_token=False, dtype="float32",
             config="m128x64"),
    ]
    ok_all = True
    for i, c in enumerate(cases):
        dtype = jnp.dtype(c["dtype"])
        q, k, v, do, _ = rand_inputs(200 + i, c["B"], c["T"], c["H"], c["KV"], 128, dtype)
        nb = -(-c["T"] // c["bs"])
        if c["per_token"]:
            idx = moba_selection(i, c["B"], c["T"], c["Hs"], nb, c["top_k"], jnp.arange(c["T"]) // c["bs"])
            tok = idx
        else:
            idx = moba_selection(i, c["B"], nb, c["Hs"], nb, c["top_k"], jnp.arange(nb))
            tok = idx[:, jnp.arange(c["T"]) // c["bs"]]
        blocks = K.SparseBlockSizes(**MOBA_CONFIGS[c.get("config", "m64")])
        try:
            ours = jax.jit(fwd_bwd(lambda q, k, v: K.block_sparse_attention(
                q, k, v, idx, block_size=c["bs"], block_sizes=blocks, interpret=INTERPRET)))
            ours = compiled(ours, (q, k, v, do))
            got = run_once(ours, (q, k, v, do))
            again = run_once(ours, (q, k, v, do))
            with gpu_turn():
                same_bits = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again))
            with jax.default_matmul_precision("highest"):
                want = run_once(jax.jit(fwd_bwd(lambda q, k, v: moba_dense_oracle(q, k, v, tok, c["bs"]))),
                                [x.astype(jnp.float32) for x in (q, k, v, do)])
            with gpu_turn():
                errs = [rel_err(g, r) for g, r in zip(got, want)]
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            ok = all(e < tol for e in errs) and same_bits
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errs, same_bits, ok, tol = [float("nan")] * 4, False, False, None
            c["error"] = f"{type(e).__name__}: {e}"[:500]
        ok_all &= ok
        c.update(errors=dict(zip(("o", "dq", "dk", "dv"), errs)), deterministic=same_bits, tol=tol, ok=ok)
        results["moba_check"].append(c)
        print(f"  {'PASS' if ok else 'FAIL'} {c}: " + " ".join(
            f"{n}={e:.2e}" for n, e in zip(("o", "dq", "dk", "dv"), errs)), flush=True)
    print(f"== moba check {'PASSED' if ok_all else 'FAILED'} ==")
    results["moba_check_ok"] = ok_all
    return ok_all


def moba_pairs(T, bs, top_k):
    """Visible (query, key) pairs of block-level MoBA (own block causal + min(k-1, c) past blocks)."""
    total = 0
    for c in range(-(-T // bs)):
        n = min(bs, T - c * bs)
        total += n * (n + 1) // 2 + n * bs * min(top_k - 1, c)
    return total


def run_moba_table(args, results, dump=lambda: None):
    T, B, H, D, bs = args.moba_T, 1, 16, 128, args.moba_block
    nb = T // bs
    top_k = args.moba_topk or max(1, nb // 8)
    print(f"\n== moba table: T={T} B={B} H={H} D={D} block={bs} top_k={top_k} (of {nb}) ==")
    q, k, v, do, _ = rand_inputs(3, B, T, H, H, D, jnp.bfloat16)
    per_block = moba_selection(1, B, nb, H, nb, top_k, jnp.arange(nb))
    with gpu_turn():
        coherent = jax.block_until_ready(per_block[:, jnp.arange(T) // bs])
    random_tok = moba_selection(2, B, T, H, nb, top_k, jnp.arange(T) // bs)
    ops_bs = _load_path("_hybrid_lm_ops_block_sparse", ROOT / "hybrid_lm" / "ops" / "block_sparse.py")
    variants = {"cudnn_full": None}
    jla = load_jla() if args.moba_jla else None
    if jla is not None:
        variants["jla_full"] = ("jla_full", None)  # jla's FA3-style causal kernel: a second anchor
    for name in args.moba_configs.split(","):
        variants[f"pallas_block[{name}]"] = (per_block, name)
    variants["pallas_token_coherent[m64]"] = (coherent, "m64")
    variants["pallas_token_random[m64]"] = (random_tok, "m64")
    variants["model_block_moba_gate[m64]"] = ("select_block", "m64")
    variants["model_token_moba_gate[m64]"] = ("select_token", "m64")
    if args.moba_xla:  # the XLA reference of the model path (gate + chunked gathers); slow at 32K
        variants["xla_reference_token_moba_gate"] = ("xla", None)
    pairs = moba_pairs(T, bs, top_k) * B * H
    full_pairs = T * (T + 1) // 2 * B * H
    rows = {}
    dummy = jnp.zeros((1,), jnp.int32)
    for name, spec in variants.items():
        # the selection is a jit *argument*: closed over, XLA would constant-fold the list building
        # (argsort of the selection matrix) at compile time and the timing would leave it out
        if spec is None:
            sel, blocks = dummy, None

            def attn(q, k, v, sel):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        elif spec[0] == "jla_full":
            sel, blocks = dummy, None

            def attn(q, k, v, sel):
                return jla(q, k, v)
        elif spec[0] == "xla":
            sel, blocks = dummy, None

            def attn(q, k, v, sel):
                return ops_bs.moba_attention(q, k, v, block_size=bs, top_k=top_k, gate="moba")
        else:
            sel, cfg = spec
            blocks = K.SparseBlockSizes(**MOBA_CONFIGS[cfg])
            mode = sel if isinstance(sel, str) else None
            if mode:
                sel = dummy

            def attn(q, k, v, sel, blocks=blocks, mode=mode):
                if mode:  # the model's path: gate + top-k + kernel
                    sel = ops_bs.select_blocks(q, k, block_size=bs, top_k=top_k, gate="moba",
                                               selection=mode.split("_")[1])
                return K.block_sparse_attention(q, k, v, sel, block_size=bs, block_sizes=blocks,
                                                interpret=INTERPRET)

        def fb(q, k, v, do, sel, attn=attn):
            o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, sel), q, k, v)
            return (o, *vjp(do))

        r = {}
        for mode_name, fn, fargs in (("fwd", jax.jit(attn), (q, k, v, sel)),
                                     ("fwd_bwd", jax.jit(fb), (q, k, v, do, sel))):
            try:
                r[mode_name], r[mode_name + "_all"] = time_fn(fn, fargs, args.reps, args.inner)
            except Exception as e:  # noqa: BLE001
                r[mode_name] = None
                r[mode_name + "_error"] = f"{type(e).__name__}: {e}"[:1000]
                print(f"  [{name} {mode_name}] failed: {r[mode_name + '_error'][:300]}")
        rows[name] = r
        print(f"  {name}: fwd {r.get('fwd')} ms, fwd+bwd {r.get('fwd_bwd')} ms", flush=True)
        results["moba"] = dict(T=T, B=B, H=H, D=D, block=bs, top_k=top_k, n_blocks=nb,
                               visible_pairs=pairs, full_causal_pairs=full_pairs, rows=rows)
        dump()  # a run cut short keeps the finished variants
    results["moba"] = dict(T=T, B=B, H=H, D=D, block=bs, top_k=top_k, n_blocks=nb,
                           visible_pairs=pairs, full_causal_pairs=full_pairs, rows=rows)
    print_moba_table(results["moba"])


def print_moba_table(m):
    rows, D = m["rows"], m["D"]
    base = rows["cudnn_full"]
    print(f"\n== moba table: T={m['T']} B={m['B']} H={m['H']} D={D} block={m['block']} "
          f"top_k={m['top_k']} (of {m['n_blocks']}) ==")
    print("| variant | fwd ms | cuDNN full / this (fwd) | fwd+bwd ms | cuDNN full / this (fwd+bwd) | fwd+bwd TF/s (visible pairs) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        p = m["full_causal_pairs"] if name in ("cudnn_full", "jla_full") else m["visible_pairs"]
        sp = lambda k: "—" if r.get(k) is None or base.get(k) is None else f"{base[k] / r[k]:.2f}x"
        tfs = "—" if r.get("fwd_bwd") is None else f"{3.5 * 4 * D * p / (r['fwd_bwd'] * 1e-3) / 1e12:.0f}"
        fmt = lambda x: "—" if x is None else f"{x:.3f}"
        print(f"| {name} | {fmt(r.get('fwd'))} | {sp('fwd')} | {fmt(r.get('fwd_bwd'))} | {sp('fwd_bwd')} | {tfs} |")


def copy_bandwidth():
    x = jax.random.normal(jax.random.key(0), (4, 16384, 16, 128), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    med, _ = time_fn(f, (x,), 7, 10)
    return 2 * x.size * 2 / (med * 1e-3) / 1e12  # TB/s, read + write


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="GPU correctness check first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--sweep", action="store_true", help="pick tiles per window by a sweep")
    p.add_argument("--sweep-shape", type=int, nargs=2, default=(16384, 2), metavar=("T", "B"))
    p.add_argument("--config", default=None, help="FWD+DKV+DQ config names, e.g. f64+k64+q64")
    p.add_argument("--shapes", default="4096x8,16384x2,65536x1", help="TxB list")
    p.add_argument("--windows", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--impls", default="cudnn,pallas_swa,pallas_sa,pallas_sa_gather,jla")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test (interpret mode)")
    p.add_argument("--moba", action="store_true", help="also check and time the block-sparse kernel")
    p.add_argument("--moba-only", action="store_true", help="only the block-sparse part")
    p.add_argument("--moba-T", type=int, default=32768)
    p.add_argument("--moba-block", type=int, default=128)
    p.add_argument("--moba-configs", default="m128,m64,m128x64,m64s3")
    p.add_argument("--moba-topk", type=int, default=None, help="default: 1/8 of the blocks")
    p.add_argument("--moba-xla", action="store_true", help="also time the XLA reference (model path)")
    p.add_argument("--moba-jla", action="store_true", help="also time jla's full causal kernel")
    p.add_argument("--parallel", action="store_true",
                   help="one worker process per part (check, each shape, MoBA): compiles run in "
                        "parallel, GPU work takes turns under a file lock")
    p.add_argument("--gpu-lock", default=None,
                   help="file lock held around every GPU execution (timing, check runs), so that "
                        "benchmarks of several processes never share the GPU (--parallel sets it)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a --parallel worker's part
    args = p.parse_args()
    global INTERPRET
    INTERPRET = args.interpret

    global GPU_LOCK
    GPU_LOCK = args.gpu_lock
    if args.parallel and args.sweep:
        p.error("--sweep picks tiles before the table: run it without --parallel")
    if args.parallel:
        return run_parallel(args)

    dev = jax.devices()[0]
    results = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv), device=str(getattr(dev, "device_kind", dev)),
        platform=dev.platform, jax=jax.__version__, heads=16, head_dim=128, dtype="bfloat16",
        check=[], sweep=[], rows=[], moba_check=[])
    print(f"device: {results['device']} ({dev.platform}), jax {jax.__version__}")

    def dump():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))

    part = args.part  # None: everything asked for, in order (one process)
    check = args.check or args.check_only
    if (args.moba or args.moba_only) and part in (None, "moba"):
        if check:
            run_moba_check(results)
            dump()
        if not args.check_only:
            run_moba_table(args, results, dump)
            dump()
    if args.moba_only or part == "moba":
        return
    jla = load_jla() if "jla" in args.impls else None  # also jla_fused
    # without --config / --sweep the kernel's own default_block_sizes(window) is used
    default_cfg = tuple(args.config.split("+")) if args.config else None
    if check and part in (None, "check"):
        run_check(make_blocks(*(default_cfg or DEFAULT_CFG)), results)
        dump()
    if args.check_only or part == "check":
        return
    if part is None or part == args.shapes.split(",")[0]:
        try:
            results["copy_tb_s"] = copy_bandwidth()
            print(f"copy bandwidth (bf16 x+1, read+write): {results['copy_tb_s']:.2f} TB/s")
        except Exception as e:  # noqa: BLE001
            print(f"copy bandwidth failed: {e}")

    best = {}
    if args.sweep and not args.config:
        best = run_sweep(args, results, jla)
        dump()
    impls = [i for i in args.impls.split(",") if not i.startswith("jla") or jla is not None]
    shapes = [tuple(int(x) for x in s.split("x")) for s in (part or args.shapes).split(",")]
    H, D = 16, 128
    print("\n== table ==")
    for T, B in shapes:
        inputs = rand_inputs(T + B, B, T, H, H, D, jnp.bfloat16)
        for w in args.windows:
            cfg = best.get(w, default_cfg)
            blocks = make_blocks(*cfg) if cfg else None
            row = dict(T=T, B=B, w=w, config="+".join(cfg) if cfg else "default",
                       flops_fwd=useful_flops(B, T, H, D, w))
            for impl in impls:
                row[impl] = measure(impl, T, B, w, blocks, inputs, jla, args.reps, args.inner)
                r = row[impl]
                print(f"  T={T} B={B} w={w} {impl}: fwd {r['fwd']} ms, fwd+bwd {r['fwd_bwd']} ms",
                      flush=True)
            results["rows"].append(row)
            dump()
        del inputs
    results["impls"] = impls
    print_table(results)
    dump()


def print_table(results):
    def fmt(x):
        return "—" if x is None else f"{x:.3f}"

    def ratio(a, b):
        return "—" if a is None or b is None else f"{a / b:.2f}"

    print("\n| T | B | w | impl | fwd ms | fwd / cuDNN | fwd+bwd ms | fwd+bwd / cuDNN | "
          "fwd+bwd TF/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results["rows"]:
        base = row.get("cudnn", {})
        for impl in results["impls"]:
            r = row[impl]
            tfs = ("—" if r.get("fwd_bwd") is None
                   else f"{3.5 * row['flops_fwd'] / (r['fwd_bwd'] * 1e-3) / 1e12:.0f}")
            print(f"| {row['T']} | {row['B']} | {row['w']} | {impl}"
                  f"{' (' + row['config'] + ')' if impl.startswith('pallas') else ''} | "
                  f"{fmt(r.get('fwd'))} | {ratio(r.get('fwd'), base.get('fwd'))} | "
                  f"{fmt(r.get('fwd_bwd'))} | {ratio(r.get('fwd_bwd'), base.get('fwd_bwd'))} | "
                  f"{tfs} |")


def run_parallel(args):
    """Runs the parts of one benchmark (windowed check, each shape's rows, MoBA) as worker
    processes of this script. Compiles overlap; every GPU execution (timing and check runs) holds
    one file lock, so timings never share the GPU. Merges the parts into one result and table."""
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="bench_attention_"))
    lock = args.gpu_lock or tmp / "gpu.lock"  # other jobs may share it (experiments/gpu_session.sh)
    parts = []
    if (args.check or args.check_only) and not args.moba_only:
        parts.append("check")
    if not (args.check_only or args.moba_only):
        parts += args.shapes.split(",")
    if args.moba or args.moba_only:
        parts.append("moba")
    argv = [a for a in sys.argv[1:] if a != "--parallel"]
    for opt in ("--out", "--gpu-lock"):
        if opt in argv:
            i = argv.index(opt)
            del argv[i:i + 2]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.75 / len(parts):.3f}")
    started = time.perf_counter()
    procs = {}
    for part in parts:
        log = open(tmp / f"{part}.log", "w")
        part_env = env
        if part == "check":  # its oracles' autotuning would run on the GPU outside the turns
            part_env = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip())
        cmd = [sys.executable, __file__, *argv, "--part", part, "--gpu-lock", str(lock),
               "--out", str(tmp / f"{part}.json")]
        procs[part] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=part_env), log)
    print(f"{len(parts)} workers: {', '.join(parts)} (logs in {tmp})", flush=True)
    failed = []

    def stop(signum, frame):  # a timeout's SIGTERM: stop the workers, keep the finished rows
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for part, (proc, log) in procs.items():
            rc = proc.wait()
            print(f"\n==== worker {part}: exit {rc} ({time.perf_counter() - started:.0f} s) ====")
            print((tmp / f"{part}.log").read_text(), flush=True)
            if rc:
                failed.append(part)
    except KeyboardInterrupt:
        print("\n==== interrupted: stopping the workers, merging what they finished ====")
        for part, (proc, log) in procs.items():
            if proc.poll() is None:
                proc.kill()
                failed.append(part)
                print(f"---- {part} (unfinished), log tail:\n" + "".join(
                    (tmp / f"{part}.log").read_text().splitlines(True)[-15:]))
    merged = None
    for part in parts:
        f = tmp / f"{part}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        if merged is None:
            merged = dict(r, command=" ".join(sys.argv), check=[], rows=[], moba_check=[])
        for key in ("check", "rows", "moba_check"):
            merged[key] += r.get(key, [])
        for key in ("check_ok", "check_cudnn", "moba_check_ok", "moba", "copy_tb_s", "impls"):
            if key in r:
                merged[key] = r[key]
    if merged is None:
        sys.exit("every worker failed")
    merged["workers_failed"] = failed
    merged["wall_s"] = round(time.perf_counter() - started, 1)
    if merged["rows"]:
        print_table(merged)
    if "moba" in merged:
        print_moba_table(merged["moba"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(merged, indent=1))
    print(f"\nall workers done in {merged['wall_s']} s; failed: {failed or 'none'}")
    if failed:
        sys.exit(f"worker logs kept in {tmp}")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)  # every log was printed above, the results merged

if __name__ == "__main__":
    main()
