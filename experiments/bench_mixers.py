#!/usr/bin/env python
"""Linear-attention ops (Lightning, Mamba-2 SSD, Gated DeltaNet): GPU benchmark and parity check.

Times, in one process and one run, forward and forward+backward of three ops (bf16, by default
B=2, T=16384, H=16, Dk=Dv=128):

  * ``lightning``: ``simple_gla`` with a constant per-head log decay ``g_gamma [H]`` (ALiBi slopes,
    scale 1), gradients w.r.t. q, k, v (the decay is a constant of the layer);
  * ``mamba2``: ``simple_gla`` with a per-token log decay ``g = A * dt [B, T, H]`` (scale 1; q = C,
    k = B, v = x * dt), gradients w.r.t. q, k, v, g;
  * ``gdn``: the gated delta rule with unit-norm q, k, ``g [B, T, H]`` and ``beta [B, T, H]``,
    gradients w.r.t. q, k, v, g, beta;

each through these implementations:

  * ``fast``: our ``hybrid_lm.ops.linear_attention_gpu`` op with ``impl='auto'`` (on a Hopper GPU with
    jax-linear-attention installed: jla's Mosaic GPU kernel behind our conventions; the resolved impl
    is recorded);
  * ``xla``: our chunked XLA op (``impl='xla'``, chunk 64, default matmul precision);
  * ``jla``: ``jla.ops.linear_attention(kind, impl='mosaic_gpu')`` called directly with jla-native
    inputs (for Lightning the ``[B, T, H]`` decay is built outside the timed function), GPU only;
  * ``jla_chunked``: ``jla.ops.linear_attention(kind, impl='chunked')``, jla's plain-JAX chunked path
    as it ships (its default matmul precision is HIGHEST).

Forward = ``jit(op)`` returning the output only; forward+backward = one ``jit`` of ``jax.vjp`` and the
pullback of a random cotangent. Timing is ``experiments/bench_attention.py``'s ``time_fn``: 3 warm-up
calls, then ``--reps`` repetitions of ``--inner`` back-to-back calls closed by ``block_until_ready``;
the median per-call time is reported.

``--check`` first compares the fast path against our XLA op in float32 at HIGHEST matmul precision
(the oracle), output, final state and every gradient (initial state included, with a cotangent on
the final state too), at several shapes: T not a multiple of 64, with and without initial state,
bf16 / fp16 inputs and fp32 inputs cast for the kernel (``kernel_dtype``, as the layers call it),
sequences long enough for jla's sequence split, and the delta rule's large-head path. Relative L2
errors (``bench_attention.rel_err``) must stay below bf16-level thresholds. On a GPU it also checks
that ``impl='auto'`` resolves to the kernel at the benchmark shapes. Exits non-zero on failure.

``--smoke`` runs the script itself on CPU at tiny shapes: ``fast`` resolves to XLA there, ``jla`` is
skipped, and ``--check`` routes our conversions through jla's chunked ops instead of the kernel.

Usage (device machine, repo root; the repo need not be installed; jla and the wheels it needs are
carried in ``.whl/``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/jax_linear_attention-0.1.0-py3-none-any.whl
    PYTHONPATH=/tmp/site python3 experiments/bench_mixers.py --check --out $OUT/bench_mixers.json

CPU: ``.venv/bin/python experiments/bench_mixers.py --smoke --check``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hybrid_lm.ops needs only jax; the repo need not be installed
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_attention as BA  # noqa: E402  (time_fn, rel_err)
from hybrid_lm import backends  # noqa: E402
from hybrid_lm.ops import linear_attention_gpu as lag  # noqa: E402
from hybrid_lm.ops.delta_rule import chunk_gated_delta_rule  # noqa: E402
from hybrid_lm.ops.linear_attention import chunk_simple_gla  # noqa: E402

OPS = ("lightning", "mamba2", "gdn")
IMPLS = ("fast", "xla", "jla", "jla_chunked")
JLA_KIND = {"lightning": "simple_gla", "mamba2": "simple_gla", "gdn": "gated_deltanet"}
HIGHEST = jax.lax.Precision.HIGHEST


def load_jla():
    try:
        import jla
        import jla.ops as jla_ops
        return jla_ops, getattr(jla, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - optional
        print(f"[jla] not available: {type(e).__name__}: {e}")
        return None, None


# ------------------------------------------------------------------------------------------------
# inputs (fresh random numbers, realistic gates)
# ------------------------------------------------------------------------------------------------

def alibi_log_decay(H):
    """Lightning's per-head log decay at the first layer: ``-2^(-8 (h+1) / H)`` (power-of-two H; the
    layer's exact rule, interleave and per-layer factor are in hybrid_lm/model/lightning.py)."""
    return -np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def make_inputs(op, seed, B, T, H, Dk, Dv, dtype, *, state=False):
    """``dict`` of the op's inputs in our conventions: q, k, v in ``dtype``; gates and state fp32."""
    r = np.random.default_rng(seed)
    f32 = jnp.float32
    q, k = r.normal(size=(B, T, H, Dk)), r.normal(size=(B, T, H, Dk))
    v = r.normal(size=(B, T, H, Dv))
    out = {}
    if op == "gdn":
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # the layer's L2 norm
        A = r.uniform(1.0, 16.0, size=(H,))
        dt = np.log1p(np.exp(r.normal(size=(B, T, H)) + np.log(np.expm1(0.01))))  # softplus(a + dt_bias)
        out["g"] = jnp.asarray(-A * dt, f32)
        out["beta"] = jnp.asarray(1.0 / (1.0 + np.exp(-r.normal(size=(B, T, H)))), f32)
    elif op == "mamba2":
        A = r.uniform(1.0, 16.0, size=(H,))
        dt = np.exp(r.uniform(np.log(1e-3), np.log(0.1), size=(B, T, H)))
        out["g"] = jnp.asarray(-A * dt, f32)  # A * dt
        v = v * dt[..., None]  # x * dt
        out["scale"] = 1.0
    elif op == "lightning":
        out["g_gamma"] = jnp.asarray(alibi_log_decay(H), f32)
        out["scale"] = 1.0
    else:  # generic simple_gla cases of the check: set by the caller
        pass
    out.update(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype))
    if state:
        out["initial_state"] = jnp.asarray(0.5 * r.normal(size=(B, H, Dk, Dv)), f32)
    return out


# differentiable inputs per op in the timing (the rest are constants of the call)
DIFF = {"lightning": ("q", "k", "v"), "mamba2": ("q", "k", "v", "g"), "gdn": ("q", "k", "v", "g", "beta")}


# ------------------------------------------------------------------------------------------------
# implementations: f(**inputs) -> (o, final_state)
# ------------------------------------------------------------------------------------------------

def ours(op, impl, **kw):
    """Our op (``hybrid_lm.ops.linear_attention_gpu``) with ``impl`` in auto | xla | jla."""
    def f(q, k, v, g=None, g_gamma=None, beta=None, scale=None, initial_state=None, output_final_state=False):
        if op == "gdn":
            return lag.gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, impl=impl, **kw)
        return lag.simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, impl=impl, **kw)
    return f


def ours_via_jla_backend(op, backend, kernel_dtype=None):
    """Our conversions into jla's API with jla's ``backend`` (``chunked`` on CPU, where no kernel runs)."""
    def f(q, k, v, g=None, g_gamma=None, beta=None, scale=None, initial_state=None, output_final_state=False):
        if op == "gdn":
            return lag._jla_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                             output_final_state=output_final_state, kernel_dtype=kernel_dtype,
                                             backend=backend)
        return lag._jla_simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, kernel_dtype=kernel_dtype,
                                   backend=backend)
    return f


def jla_native(jla_ops, op, backend):
    """jla's own API, jla-native inputs: one ``g [B, T, H]`` (Lightning's broadcast decay is an input)."""
    kind = JLA_KIND[op]

    def f(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False):
        gates = dict(g=g, beta=beta) if op == "gdn" else dict(g=g)
        return jla_ops.linear_attention(kind, q, k, v, impl=backend, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, **gates)
    return f


def to_jla_native(op, inputs):
    """Lightning's ``g_gamma [H]`` as jla's ``g [B, T, H]`` (built once, outside the timed call)."""
    x = dict(inputs)
    if "g_gamma" in x:
        gam = x.pop("g_gamma")
        B, T, H = x["q"].shape[:3]
        x["g"] = jnp.broadcast_to(gam[None, None, :], (B, T, H)).astype(jnp.float32)
    return x


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def fwd_and_fwd_bwd(f, diff_names):
    """(jit forward -> o, jit forward+backward -> (o, *grads)) over (diff dict, const dict[, do])."""
    def fwd(diff, const):
        return f(**diff, **const)[0]

    def fb(diff, const, do):
        o, vjp = jax.vjp(lambda d: f(**d, **const)[0], diff)
        return o, vjp(do)[0]
    return jax.jit(fwd), jax.jit(fb)


def split_static(f, inputs):
    """Bind the Python-number inputs (``scale``: static for the kernel) into ``f``; return (f, arrays)."""
    static = {n: x for n, x in inputs.items() if not hasattr(x, "shape")}
    return functools.partial(f, **static), {n: x for n, x in inputs.items() if n not in static}


def measure(name, f, inputs, diff_names, reps, inner):
    f, inputs = split_static(f, inputs)
    diff = {n: inputs[n] for n in diff_names}
    const = {n: x for n, x in inputs.items() if n not in diff_names}
    r = np.random.default_rng(11)
    do = jnp.asarray(r.normal(size=inputs["v"].shape), inputs["q"].dtype)
    fwd, fb = fwd_and_fwd_bwd(f, diff_names)
    res = {}
    for mode, fn, args in (("fwd", fwd, (diff, const)), ("fwd_bwd", fb, (diff, const, do))):
        try:
            med, all_t = BA.time_fn(fn, args, reps, inner)
            res[mode], res[mode + "_all"] = med, [round(t, 4) for t in all_t]
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            print(f"  [{name} {mode}] failed: {msg[:300]}", flush=True)
            res[mode], res[mode + "_error"] = None, msg[:1000]
    return res


def resolved(op, inputs, impl="auto"):
    x = dict(inputs)
    try:
        if op == "gdn":
            return lag.resolve_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x.get("scale"),
                                                initial_state=x.get("initial_state"), impl=impl)
        return lag.resolve_simple_gla(x["q"], x["k"], x["v"], x.get("g"), x.get("g_gamma"), scale=x.get("scale"),
                                      initial_state=x.get("initial_state"), impl=impl)
    except lag.FastPathUnavailable as e:
        return f"unavailable: {e}"


def run_table(args, results, jla_ops, on_gpu):
    B, T, H, Dk, Dv = args.batch, args.seq_len, args.heads, args.dk, args.dv
    dtype = jnp.dtype(args.dtype)
    impls = [i for i in args.impls.split(",") if i]
    print(f"\n== timing: B={B} T={T} H={H} Dk={Dk} Dv={Dv} {dtype.name} (ms, median of {args.reps} x {args.inner}) ==")
    for op in args.ops.split(","):
        inputs = make_inputs(op, 1000 + OPS.index(op), B, T, H, Dk, Dv, dtype)
        row = dict(op=op, B=B, T=T, H=H, Dk=Dk, Dv=Dv, dtype=dtype.name, fast_resolves_to=resolved(op, inputs))
        for impl in impls:
            if impl in ("jla", "jla_chunked") and jla_ops is None:
                row[impl] = dict(skipped="jax-linear-attention not installed")
                continue
            if impl == "jla" and not on_gpu:
                row[impl] = dict(skipped="no GPU")
                continue
            if impl == "fast":
                f, x = ours(op, "auto"), inputs
            elif impl == "xla":
                f, x = ours(op, "xla"), inputs
            else:
                f, x = jla_native(jla_ops, op, "mosaic_gpu" if impl == "jla" else "chunked"), to_jla_native(op, inputs)
            row[impl] = measure(f"{op} {impl}", f, x, DIFF[op], args.reps, args.inner)
            r = row[impl]
            print(f"  {op:9s} {impl:11s}: fwd {fmt(r['fwd'])} ms, fwd+bwd {fmt(r['fwd_bwd'])} ms"
                  + (f"  (resolves to {row['fast_resolves_to']})" if impl == "fast" else ""), flush=True)
        results["rows"].append(row)
        del inputs


def fmt(x):
    return "—" if x is None else f"{x:.3f}"


def ratio(a, b):
    return "—" if a is None or b is None else f"{a / b:.2f}"


def print_table(results):
    print("\n| op | impl | fwd ms | fwd+bwd ms | fwd+bwd / jla | fwd+bwd / ours xla |")
    print("|---|---|---|---|---|---|")
    for row in results["rows"]:
        jla_fb = row.get("jla", {}).get("fwd_bwd")
        xla_fb = row.get("xla", {}).get("fwd_bwd")
        for impl in IMPLS:
            r = row.get(impl)
            if r is None:
                continue
            if "skipped" in r:
                print(f"| {row['op']} | {impl} | skipped: {r['skipped']} | | | |")
                continue
            label = f"fast ({row['fast_resolves_to']})" if impl == "fast" else impl
            print(f"| {row['op']} | {label} | {fmt(r.get('fwd'))} | {fmt(r.get('fwd_bwd'))} | "
                  f"{ratio(r.get('fwd_bwd'), jla_fb)} | {ratio(r.get('fwd_bwd'), xla_fb)} |")
    print("\nTargets (issue 7): fast fwd+bwd <= 1.1x jla; ours xla <= jla_chunked.")
    for row in results["rows"]:
        get = lambda i, m="fwd_bwd": row.get(i, {}).get(m)  # noqa: E731
        print(f"  {row['op']}: fast/jla {ratio(get('fast'), get('jla'))} (fwd {ratio(get('fast', 'fwd'), get('jla', 'fwd'))}), "
              f"xla/jla_chunked {ratio(get('xla'), get('jla_chunked'))} (fwd {ratio(get('xla', 'fwd'), get('jla_chunked', 'fwd'))})")


# ------------------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------------------

def check_cases(smoke):
    """(name, op, B, T, H, Dk, Dv, input dtype, kernel_dtype, initial state, extra inputs)."""
    if smoke:
        return [
            ("lightning T=130 state", "lightning", 1, 130, 2, 32, 32, "bfloat16", None, True, {}),
            ("mamba2 fp32->bf16 T=100", "mamba2", 2, 100, 2, 32, 16, "float32", "bfloat16", True, {}),
            ("g+g_gamma fp16 T=70", "simple_gla", 1, 70, 2, 16, 16, "float16", None, True, {"both": True}),
            ("no decay T=65", "simple_gla", 1, 65, 2, 16, 16, "bfloat16", None, False, {}),
            ("gdn T=130 state", "gdn", 1, 130, 2, 32, 32, "bfloat16", None, True, {}),
            ("gdn fp32->bf16 Dk!=Dv", "gdn", 1, 70, 2, 16, 32, "float32", "bfloat16", False, {}),
        ]
    return [
        ("lightning T=1000 state", "lightning", 2, 1000, 4, 128, 128, "bfloat16", None, True, {}),
        ("lightning T=8192 split", "lightning", 1, 8192, 2, 128, 128, "bfloat16", None, False, {}),
        ("mamba2 fp32->bf16 T=1000 state", "mamba2", 2, 1000, 8, 128, 64, "float32", "bfloat16", True, {}),
        ("mamba2 T=4096 split", "mamba2", 1, 4096, 4, 128, 64, "bfloat16", None, False, {}),
        ("g+g_gamma fp16 T=777 state", "simple_gla", 2, 777, 4, 64, 64, "float16", None, True, {"both": True}),
        ("no decay T=300", "simple_gla", 1, 300, 4, 64, 64, "bfloat16", None, False, {}),
        ("gdn T=1000 state", "gdn", 2, 1000, 4, 128, 128, "bfloat16", None, True, {}),
        ("gdn T=8192 split", "gdn", 1, 8192, 2, 128, 128, "bfloat16", None, False, {}),
        ("gdn fp32->bf16 K=64 V=128 state", "gdn", 2, 1000, 4, 64, 128, "float32", "bfloat16", True, {}),
        ("gdn K=128 V=256 (large heads) state", "gdn", 1, 500, 2, 128, 256, "bfloat16", None, True, {}),
    ]


def check_inputs(op, seed, B, T, H, Dk, Dv, dtype, state, extra):
    if op != "simple_gla":
        return make_inputs(op, seed, B, T, H, Dk, Dv, dtype, state=state)
    x = make_inputs("mamba2" if extra.get("both") else "none", seed, B, T, H, Dk, Dv, dtype, state=state)
    if extra.get("both"):
        x["g_gamma"] = jnp.asarray(alibi_log_decay(H), jnp.float32)
        x["scale"] = 0.5
    else:
        x.pop("scale", None)  # default 1/sqrt(Dk)
    return x


def grads_of(f, arrays, seed):
    """(o, S) and the gradients of <o, do> + <S, dS> w.r.t. every array input (q, k, v, gates, state)."""
    o, S = f(**arrays, output_final_state=True)
    r = np.random.default_rng(seed)
    do = jnp.asarray(r.normal(size=o.shape), jnp.float32)
    dS = jnp.asarray(r.normal(size=S.shape), jnp.float32)

    def loss(a):
        o, S = f(**a, output_final_state=True)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS)
    return (o, S), jax.grad(loss)(arrays)


def run_check(args, results, jla_ops, on_gpu):
    if on_gpu:
        fast_label = "fast path (impl='jla', the Mosaic GPU kernel)"
    elif jla_ops is not None:
        fast_label = "our conversions through jla's chunked ops (CPU: no kernel)"
    else:
        print("\n== check skipped: no GPU and no jax-linear-attention ==")
        results["check_ok"] = None
        return True
    print(f"\n== check: {fast_label} vs our XLA op in fp32 at HIGHEST precision (rel. L2 errors) ==")
    scale_tol = args.tol_scale
    ok_all = True
    for i, (name, op, B, T, H, Dk, Dv, dt, kdt, state, extra) in enumerate(check_cases(args.smoke)):
        dtype = jnp.dtype(dt)
        x = check_inputs(op, 100 + i, B, T, H, Dk, Dv, dtype, state, extra)
        kernel_dtype = None if kdt is None else jnp.dtype(kdt)
        fam = "gdn" if op == "gdn" else "simple_gla"
        if on_gpu:
            fast = ours(fam, "jla", kernel_dtype=kernel_dtype)
        else:
            fast = ours_via_jla_backend(fam, "chunked", kernel_dtype)
        # the oracle: our XLA chunked op on the same (rounded) inputs upcast to fp32, HIGHEST precision
        ref_op = chunk_gated_delta_rule if fam == "gdn" else chunk_simple_gla

        def ref(q, k, v, g=None, g_gamma=None, beta=None, scale=None, initial_state=None, output_final_state=False):
            up = lambda t: t.astype(jnp.float32)  # noqa: E731
            if fam == "gdn":
                return ref_op(up(q), up(k), up(v), g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, precision=HIGHEST)
            return ref_op(up(q), up(k), up(v), g, g_gamma, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, precision=HIGHEST)
        # tolerances: bf16-level for outputs and q/k/v gradients, looser for gate / state gradients
        # (sums over many tokens of products of differences); fp32 inputs cast to bf16 for the kernel
        # include that rounding, as the layers' calls do
        tol_main, tol_gate = 2e-2 * scale_tol, 5e-2 * scale_tol
        case = dict(name=name, op=op, B=B, T=T, H=H, Dk=Dk, Dv=Dv, dtype=dt, kernel_dtype=kdt, state=state)
        try:
            fast_s, xa = split_static(fast, x)
            ref_s, _ = split_static(ref, x)
            (o, S), g_fast = jax.jit(functools.partial(grads_of, fast_s, seed=7))(xa)
            (o_r, S_r), g_ref = jax.jit(functools.partial(grads_of, ref_s, seed=7))(xa)
            errs = {"o": BA.rel_err(o, o_r), "S": BA.rel_err(S, S_r)}
            errs.update({f"d{n}": BA.rel_err(g_fast[n], g_ref[n]) for n in g_ref})
            tols = {n: (tol_main if n in ("o", "S", "dq", "dk", "dv") else tol_gate) for n in errs}
            ok = all(errs[n] < tols[n] for n in errs) and o.dtype == dtype and S.dtype == jnp.float32
            case.update(errors=errs, tols=tols, out_dtype=str(o.dtype))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ok, errs = False, {}
            case["error"] = f"{type(e).__name__}: {e}"[:1000]
        case["ok"] = ok
        ok_all &= ok
        results["check"].append(case)
        print(f"  {'PASS' if ok else 'FAIL'} {name} (B={B} T={T} H={H} K={Dk} V={Dv} {dt}"
              f"{' -> ' + kdt if kdt else ''}): " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)
    if on_gpu:  # the fast path is what impl='auto' runs at the benchmark shapes
        for op in args.ops.split(","):
            spec = make_inputs(op, 0, args.batch, 128, args.heads, args.dk, args.dv, jnp.dtype(args.dtype))
            spec = {n: (jax.ShapeDtypeStruct((args.batch, args.seq_len, *x.shape[2:]), x.dtype)
                        if getattr(x, "ndim", 0) >= 3 else x) for n, x in spec.items()}
            which = resolved(op, spec)
            ok = which == "jla"
            ok_all &= ok
            results["check"].append(dict(name=f"auto resolves to jla: {op}", resolved=which, ok=ok))
            print(f"  {'PASS' if ok else 'FAIL'} impl='auto' at the benchmark shape runs {which} for {op}")
    print(f"== check {'PASSED' if ok_all else 'FAILED'} ==")
    results["check_ok"] = ok_all
    return ok_all


# ------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="parity check of the fast path first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few reps: a CPU test of the script")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dk", type=int, default=128, help="key width (Mamba-2: d_state)")
    p.add_argument("--dv", type=int, default=128, help="value width (Mamba-2: head_dim)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--tol-scale", type=float, default=1.0, help="multiply the check's error thresholds")
    p.add_argument("--out", default=None, help="JSON path (default experiments/results/bench_mixers_<device>_<date>.json)")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq_len, args.heads, args.dk, args.dv = 1, 200, 2, 32, 32
        args.reps, args.inner = 2, 1

    dev = jax.devices()[0]
    on_gpu = backends.on_gpu()
    jla_ops, jla_version = load_jla()
    date = datetime.datetime.now(datetime.timezone.utc)
    results = dict(date=date.isoformat(timespec="seconds"), command=" ".join(sys.argv),
                   device=str(getattr(dev, "device_kind", dev)), platform=dev.platform, jax=jax.__version__,
                   jla=jla_version, smoke=args.smoke, shape=dict(B=args.batch, T=args.seq_len, H=args.heads,
                                                                 Dk=args.dk, Dv=args.dv, dtype=args.dtype),
                   check=[], rows=[])
    print(f"device: {results['device']} ({dev.platform}), jax {jax.__version__}, jla {jla_version}")
    device_tag = "cpu-smoke" if args.smoke else str(results["device"]).lower().replace("nvidia ", "").replace(" ", "-")
    out = Path(args.out) if args.out else ROOT / "experiments" / "results" / f"bench_mixers_{device_tag}_{date:%Y-%m-%d}.json"

    def dump():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str))

    ok = True
    if args.check or args.check_only:
        ok = run_check(args, results, jla_ops, on_gpu)
        dump()
    if not args.check_only:
        run_table(args, results, jla_ops, on_gpu)
        print_table(results)
        dump()
    print(f"\nwrote {out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
