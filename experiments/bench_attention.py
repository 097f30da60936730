"""Attention kernels against cuDNN: our windowed kernel (SWA, SA) against cuDNN's sliding window, and the
block-sparse (MoBA) kernel against cuDNN's full causal attention, forward and forward+backward.

    python experiments/bench_attention.py                      # GPU: both tables, a few minutes
    python experiments/bench_attention.py --shapes 16384x2 --windows 128 --no-moba

Windowed table (bf16, H = 16, D = 128, every (T, B) of ``--shapes`` and window of ``--windows``):

* ``cudnn`` (the anchor): ``jax.nn.dot_product_attention(implementation='cudnn', is_causal=True,
  local_window_size=(w - 1, 0))``;
* ``pallas_swa``: ``hybrid_lm_kernels.windowed_attention`` with no positions (SWA);
* ``pallas_sa``: the same kernel with a random permutation as positions (SA's mask; cuDNN cannot express it);
* ``jla``: jax-linear-attention's Mosaic GPU ``flash_attention(sliding_window=w)``, where it is installed.

MoBA table (T = ``--moba-T``, B = 1, block ``--moba-block``, top-k = 1/8 of the blocks): cuDNN full causal
attention (the anchor), the block-sparse kernel given per-block lists and per-token lists (random: the worst
case for a query tile's union of lists), and the model's path (``ops.select_blocks`` with the moba gate, then
the kernel).

Forward+backward is one jit of ``jax.vjp`` and the pullback of a random cotangent. Every program is compiled
ahead of time (``--compile-workers`` at once), then timed alone: the median of ``--reps`` repetitions of
``--inner`` back-to-back calls. TF/s counts the visible (query, key) pairs, 4 D FLOPs each forward, 3.5x that
forward+backward. On a CPU (``--quick``) the kernels run in interpret mode and XLA stands in for cuDNN.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import hybrid_lm_kernels as K  # noqa: E402
from hybrid_lm.ops import block_sparse as ops_bs  # noqa: E402

BENCH = "attention"
IMPLS = ("pallas_swa", "pallas_sa", "jla")


def load_jla():
    try:
        from jla.ops.mosaic_gpu.attention import flash_attention
        return flash_attention
    except Exception as e:  # noqa: BLE001 - optional
        print(f"[jla] not available: {type(e).__name__}: {e}")
        return None


def inputs(seed, B, T, H, D, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.float32).astype(dtype) for kk in ks[:4])
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, T))(jax.random.split(ks[4], B)).astype(jnp.int32)
    return q, k, v, do, perm


def fwd_and_fwd_bwd(attn):
    """(jit forward, jit forward+backward) of ``attn(q, k, v, extra)``; ``extra`` is a program argument."""
    def fb(q, k, v, do, extra):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, extra), q, k, v)
        return (o, *vjp(do))
    return jax.jit(attn), jax.jit(fb)


def windowed_impl(name, w, jla, interpret):
    if name == "anchor":
        return lambda q, k, v, perm: harness.reference_attention(q, k, v, window=w)
    if name == "pallas_swa":
        return lambda q, k, v, perm: K.windowed_attention(q, k, v, None, w, interpret=interpret)
    if name == "pallas_sa":
        return lambda q, k, v, perm: K.windowed_attention(q, k, v, perm, w, interpret=interpret)
    if name == "jla":
        return lambda q, k, v, perm: jla(q, k, v, sliding_window=w)
    raise ValueError(name)


def window_pairs(T, w):
    w = min(w, T)
    return T * w - w * (w - 1) // 2


def moba_pairs(T, bs, top_k):
    """Visible (query, key) pairs of block-level MoBA (own block causal + min(k - 1, c) past blocks)."""
    total = 0
    for c in range(-(-T // bs)):
        n = min(bs, T - c * bs)
        total += n * (n + 1) // 2 + n * bs * min(top_k - 1, c)
    return total


def random_selection(seed, B, rows, Hs, nb, top_k, block_of_row):
    """``top_k`` blocks per row from random scores: the own block forced, later blocks excluded."""
    imp = jax.random.normal(jax.random.key(seed), (B, rows, Hs, nb))
    c = jnp.arange(nb)[None, :]
    own = block_of_row[:, None]
    imp = jnp.where((c > own)[None, :, None, :], -jnp.inf, imp)
    imp = jnp.where((c == own)[None, :, None, :], jnp.inf, imp)
    vals, idx = jax.lax.top_k(imp, min(top_k, nb))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--shapes", default="4096x8,16384x2,65536x1", help="TxB list of the windowed table")
    ap.add_argument("--windows", default="128,512,2048")
    ap.add_argument("--no-moba", action="store_true", help="leave the MoBA table out")
    ap.add_argument("--moba-T", type=int, default=32768)
    ap.add_argument("--moba-block", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--compile-workers", type=int, default=8)
    args = ap.parse_args(argv)
    H, D = 16, 128
    if args.quick:
        args.shapes, args.windows, args.moba_T, args.moba_block = "64x2", "16", 128, 32
        args.reps, args.inner, args.compile_workers, H, D = 1, 1, 2, 2, 32
    t_start = time.time()
    interpret = not harness.on_gpu()
    jla = load_jla() if harness.on_gpu() else None
    anchor = harness.anchor_attention_name()
    print(f"device: {harness.device_kind()}, anchor {anchor}, H={H} D={D} bf16")
    programs, meta = {}, {}
    for T, B in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        q, k, v, do, perm = inputs(T + B, B, T, H, D)
        for w in (int(x) for x in args.windows.split(",")):
            for impl in ("anchor", *IMPLS):
                if impl == "jla" and jla is None:
                    continue
                f, fb = fwd_and_fwd_bwd(windowed_impl(impl, w, jla, interpret))
                label = anchor if impl == "anchor" else impl
                base = dict(table="windowed", T=T, B=B, H=H, D=D, window=w, impl=label, anchor=impl == "anchor",
                            pairs=B * H * window_pairs(T, w))
                programs[("windowed", T, B, w, impl, "fwd")] = (f, (q, k, v, perm))
                programs[("windowed", T, B, w, impl, "fwd_bwd")] = (fb, (q, k, v, do, perm))
                meta[("windowed", T, B, w, impl)] = base
    if not args.no_moba:
        T, B, bs = args.moba_T, 1, args.moba_block
        nb = -(-T // bs)
        top_k = max(1, nb // 8)
        q, k, v, do, _ = inputs(3, B, T, H, D)
        per_block = random_selection(1, B, nb, H, nb, top_k, jnp.arange(nb))
        per_token = random_selection(2, B, T, H, nb, top_k, jnp.arange(T) // bs)
        variants = {
            "anchor": (lambda q, k, v, sel: harness.reference_attention(q, k, v), per_block),
            "pallas_block_lists": (lambda q, k, v, sel: K.block_sparse_attention(
                q, k, v, sel, block_size=bs, interpret=interpret), per_block),
            "pallas_token_lists": (lambda q, k, v, sel: K.block_sparse_attention(
                q, k, v, sel, block_size=bs, interpret=interpret), per_token),
            "moba_path": (lambda q, k, v, sel: K.block_sparse_attention(
                q, k, v, ops_bs.select_blocks(q, k, block_size=bs, top_k=top_k, gate="moba", selection="token"),
                block_size=bs, interpret=interpret), per_block),
        }
        for impl, (attn, sel) in variants.items():
            f, fb = fwd_and_fwd_bwd(attn)
            label = f"{anchor}_full_causal" if impl == "anchor" else impl
            programs[("moba", T, B, bs, impl, "fwd")] = (f, (q, k, v, sel))
            programs[("moba", T, B, bs, impl, "fwd_bwd")] = (fb, (q, k, v, do, sel))
            meta[("moba", T, B, bs, impl)] = dict(
                table="moba", T=T, B=B, H=H, D=D, block=bs, top_k=top_k, impl=label, anchor=impl == "anchor",
                pairs=B * H * (T * (T + 1) // 2 if impl == "anchor" else moba_pairs(T, bs, top_k)))
    times, left_running = harness.time_programs(programs, args.reps, args.inner, args.compile_workers)
    rows = []
    for key, base in meta.items():
        fwd, fb = times[(*key, "fwd")], times[(*key, "fwd_bwd")]
        row = dict(base, fwd_ms=fwd["ms"], fwd_bwd_ms=fb["ms"], compile_s=fb.get("compile_s"))
        errors = [r.get("error") for r in (fwd, fb) if r.get("error")]
        if errors:
            row["error"] = errors[0]
        if fb["ms"]:
            row["fwd_bwd_tflops"] = 3.5 * 4 * D * row["pairs"] / (fb["ms"] * 1e-3) / 1e12
        rows.append(row)
    for r in rows:  # against the anchor of the same table and shape
        a = next(x for x in rows if x["anchor"] and x["table"] == r["table"] and x["T"] == r["T"] and x["B"] == r["B"]
                 and x.get("window") == r.get("window"))
        for m in ("fwd_ms", "fwd_bwd_ms"):
            r[m.replace("_ms", "_vs_anchor")] = None if not (r[m] and a[m]) else r[m] / a[m]
    heads = ["table", "T", "B", "w / block", "impl", "fwd ms", "fwd / anchor", "fwd+bwd ms", "fwd+bwd / anchor",
             "fwd+bwd TF/s"]
    harness.print_table(heads, [[r["table"], r["T"], r["B"], r.get("window", r.get("block")), r["impl"],
                                 harness.fmt(r["fwd_ms"]), harness.fmt(r["fwd_vs_anchor"], ".2f"),
                                 harness.fmt(r["fwd_bwd_ms"]), harness.fmt(r["fwd_bwd_vs_anchor"], ".2f"),
                                 harness.fmt(r.get("fwd_bwd_tflops"), ".0f")] for r in rows])
    return harness.finish(BENCH, args.out, argv, rows, started=t_start, left_running=left_running,
                          anchor={"windowed": f"{anchor} sliding window", "moba": f"{anchor} full causal"})


if __name__ == "__main__":
    main()
