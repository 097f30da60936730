"""Where the time of one train step goes: a ``jax.profiler`` trace of a few steps, summarised by op.

    python experiments/profile_train.py --scale s3 --arch full --batch 8 --out-dir $OUT/profile
    python experiments/profile_train.py --summarize path/to/host.trace.json.gz [--hlo-file hlo.txt.gz]

The step is ``bench_train``'s (the trainer's ``make_train_step``, random tokens). After two warm-up
steps, ``--steps`` steps run under ``jax.profiler.trace``; the trace's ``*.trace.json.gz`` is copied to
``--out-dir`` and summarised: device time per kernel name over the GPU's stream lines, the share of
each kind of op (matmul, attention, loss, copies, other fusions; a name-based guess), and the busy
fraction of the step (device time over wall time). ``--summarize`` reads a saved trace instead.

``--compile-trace`` traces the step's XLA compile instead of its steps: host time by event name (self
time, i.e. less the events nested inside; inclusive; and wall, the union over threads), so a slow
compile shows which phase holds it (HLO passes, the autotuner, LLVM / ptxas code generation). With
``--hlo`` the optimised program is saved beside it.

With ``--hlo`` the compiled step's optimised HLO is saved beside the trace, and the device time is
also split by part of the step (loss, attention mixer, MLP, norms, optimizer, ...: the innermost source
frame of each kernel's HLO instruction, ``PARTS``) and by kind of kernel. Run under
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` so that every kernel in the trace names its instruction
(inside CUDA graphs they name only the graph).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

# the first pattern that matches a kernel's name gives its kind
KINDS = [
    ("attention", r"flash|fmha|cudnn|attention|attn|mosaic|pallas|windowed"),
    ("matmul", r"gemm|gemv|cublas|nvjet|xmma|cutlass|sm90_|sm80_|dot|wgmma|matmul"),
    ("copy", r"memcpy|memset|copy|transpose|dynamic.update.slice|concatenate"),
    ("reduce", r"reduce|softmax|argmax|scatter"),
    ("fusion", r"fusion|loop_|input_|triton|elementwise|convert|multiply|add"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


# the part of the step a kernel belongs to, from the innermost source frame of its HLO instruction
# inside this repository (or optax): the first rule whose pattern matches "path:function" wins
PARTS = [
    ("loss", r"ops/cross_entropy\.py|cross_entropy_pallas|/jla/ops/(mosaic_gpu/linear_)?cross_entropy"),
    ("optimizer", r"optax/|train/optim\.py"),
    ("step (grad norms, guard)", r"train/step\.py"),
    ("attention mixer", r"model/(attention|stochastic|moba|ssa|constrained_attention)\.py|ops/(attention|permutation|"
                        r"block_sparse)\.py|windowed_pallas|sparse_pallas|selection_pallas|/jla/ops/mosaic_gpu/attention"),
    # jla's other kernels (scalar_gate: Lightning / Mamba-2, the delta rule: GDN) are the linear mixers'
    ("linear mixer", r"model/(lightning|mamba2|gated_deltanet|recurrent_common)\.py|ops/(linear_attention|delta_rule)|/jla/"),
    ("norms", r"layers\.py:RMSNorm|ops/norm\.py|rms_norm_pallas"),
    ("mlp", r"layers\.py:SwiGLU"),
    ("embedding / stack", r"model/transformer\.py"),
]


def hlo_sources(hlo_text: str) -> dict[str, dict]:
    """Per instruction of an optimised HLO module's text (``compiled.as_text()``): its output shape,
    ``op_name`` and the source frames of its ``stack_frame_id``, innermost first (``path:function:line``),
    from the module's FileNames / FunctionNames / FileLocations / StackFrames tables. Keys are the
    instruction names with dots as underscores, as kernel names appear in a trace."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section, tables[line] = line, {}
        elif section and (m := re.match(r"(\d+) (.*)", line)):
            tables[section][int(m.group(1))] = m.group(2)
        elif section and line.strip():
            section = None
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = f"{files.get(int(f['file_name_id']), '?')}:{funcs.get(int(f['function_name_id']), '?')}:{f.get('line')}"
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        frames[k] = (int(f["file_location_id"]), int(f["parent_frame_id"]))

    def chain(fid: int) -> list[str]:
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            out.append(locs.get(loc, "?"))
            fid = parent
        return out

    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) .*$", hlo_text, re.M):
        line = m.group(0)
        op = re.search(r'op_name="([^"]*)"', line)
        sf = re.search(r"stack_frame_id=(\d+)", line)
        out[m.group(1).replace(".", "_")] = {"shape": m.group(2)[:80], "op_name": op.group(1) if op else "",
                                              "frames": chain(int(sf.group(1))) if sf else []}
    return out


def part_of(frames: list[str]) -> str:
    """The step part (``PARTS``) of an instruction's frames, innermost first; "other" if none matches."""
    for f in frames:
        for part, pat in PARTS:
            if re.search(pat, f):
                return part
    return "other"


def breakdown(trace_path: str | Path, hlo_path: str | Path, steps: int) -> dict:
    """Device ms per step by (part, kind of kernel) from a trace recorded without command buffers
    (``XLA_FLAGS=--xla_gpu_enable_command_buffer=``, so each kernel names its HLO instruction) and the
    module's optimised HLO. Kernels whose instruction is not found (inside a command buffer) are
    attributed by their own name, when it is an instruction's."""
    with gzip.open(hlo_path, "rt") as fh:
        src = hlo_sources(fh.read())
    events, procs, threads = _events(trace_path)
    cells: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    unmatched = 0.0
    for e in events:
        if e.get("ph") != "X" or "GPU" not in procs.get(e["pid"], ""):
            continue
        if not threads.get((e["pid"], e["tid"]), "").lower().startswith("stream"):
            continue
        op = e.get("args", {}).get("hlo_op", "").replace(".", "_")
        ins = src.get(op) or src.get(e["name"])
        if ins is None:
            unmatched += e.get("dur", 0.0)
        part = part_of(ins["frames"]) if ins else "unattributed"
        kind = kind_of(e["name"])
        cells[(part, kind)] += e.get("dur", 0.0)
        ops[(part, kind, op or e["name"], ins["shape"] if ins else "")] += e.get("dur", 0.0)
    per = 1e-3 / max(steps, 1)
    total = sum(cells.values()) * per
    parts: collections.Counter = collections.Counter()
    for (part, _), us in cells.items():
        parts[part] += us * per
    return {"device_ms_per_step": total, "unattributed_ms": unmatched * per,
            "parts": {p: ms for p, ms in parts.most_common()},
            "cells": [{"part": p, "kind": k, "ms": us * per} for (p, k), us in cells.most_common()],
            "ops": [{"part": p, "kind": k, "op": o, "shape": sh, "ms": us * per}
                    for (p, k, o, sh), us in ops.most_common(40)]}


def print_breakdown(b: dict) -> None:
    print(f"by part (device {b['device_ms_per_step']:.2f} ms/step, unattributed {b['unattributed_ms']:.2f}):")
    for p, ms in b["parts"].items():
        kinds = ", ".join(f"{c['kind']} {c['ms']:.2f}" for c in b["cells"] if c["part"] == p)
        print(f"  {p:<26}{ms:>9.2f} ms  {100 * ms / b['device_ms_per_step']:>5.1f}%   ({kinds})")


def _events(trace_path):
    with gzip.open(trace_path, "rb") as fh:
        events = json.load(fh)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, procs, threads


def summarize(trace_path: str | Path, steps: int, wall_ms: float | None = None, top: int = 25) -> dict:
    """Device time by kernel and by kind from a trace.json.gz: returns {"lines", "kernels", "kinds", ...}
    (milliseconds per step)."""
    events, procs, threads = _events(trace_path)
    lines: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "GPU" not in procs.get(e["pid"], ""):
            continue
        line = threads.get((e["pid"], e["tid"]), str(e["tid"]))
        lines[line] += e.get("dur", 0.0)
        if line.lower().startswith("stream"):  # the kernels themselves (not the XLA op/module lines)
            kernels[e["name"]] += e.get("dur", 0.0)
            counts[e["name"]] += 1
    per = 1e-3 / max(steps, 1)  # us in the whole trace -> ms per step
    total = sum(kernels.values()) * per
    kinds: collections.Counter = collections.Counter()
    for name, us in kernels.items():
        kinds[kind_of(name)] += us * per
    out = {
        "trace": str(trace_path), "steps": steps, "device_ms_per_step": total, "wall_ms_per_step": wall_ms,
        "busy_fraction": (total / wall_ms) if wall_ms else None,
        "lines": {k: v * per for k, v in lines.most_common()},
        "kinds": {k: {"ms": v, "share": v / total if total else 0.0} for k, v in kinds.most_common()},
        "kernels": [{"name": n, "ms": us * per, "share": us * per / total if total else 0.0,
                     "calls_per_step": counts[n] / max(steps, 1), "kind": kind_of(n)}
                    for n, us in kernels.most_common(top)],
    }
    return out


def print_summary(s: dict) -> None:
    if s.get("loss") is not None and not math.isfinite(s["loss"]):
        print(f"WARNING: loss {s['loss']} in the traced steps: NaN/inf data runs faster than real data on the H200, "
              "so these kernel times are not valid")
    busy = f"   busy {100 * s['busy_fraction']:.1f}% of {s['wall_ms_per_step']:.1f} ms wall" if s["busy_fraction"] else ""
    print(f"device time {s['device_ms_per_step']:.2f} ms/step over stream lines{busy}")
    print("by kind: " + ", ".join(f"{k} {v['ms']:.2f} ms ({100 * v['share']:.1f}%)" for k, v in s["kinds"].items()))
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  kind       kernel")
    for k in s["kernels"]:
        print(f"{k['ms']:>9.3f} {100 * k['share']:>5.1f}% {k['calls_per_step']:>6.1f}  {k['kind']:<10} {k['name'][:110]}")


def _variant(args):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_train import Variant

    bench_args = argparse.Namespace(seq_len=args.seq_len, remat=args.remat, impl=args.impl, loss="default",
                                    gin_param=args.gin_param)
    return Variant(args.scale, args.arch, args.batch, bench_args)


def profile(args) -> dict:
    import jax

    v = _variant(args)
    lowered, lower_s, backends = v.lower()
    compiled, compile_s, peak = v.compile(lowered, lower_s)
    state = v.init(v.seed)
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq_len + 1), 0, v.cfg.model.vocab_size)
    for _ in range(2):
        state, stats = compiled(state, tokens, v.bounds)
    jax.block_until_ready(stats["loss"])
    out_dir = Path(args.out_dir)
    trace_dir = out_dir / "trace"
    with jax.profiler.trace(str(trace_dir)):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, stats = compiled(state, tokens, v.bounds)
        jax.block_until_ready(stats["loss"])
        wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    loss = float(stats["loss"])
    tag = f"{args.scale}_{args.arch}_b{args.batch}"
    saved = keep_trace(trace_dir, out_dir / f"trace_{tag}.json.gz")
    s = summarize(saved, args.steps, wall_ms, args.top)
    if args.hlo:  # the optimised program: maps a trace's kernels to their instructions and source lines
        hlo_path = out_dir / f"hlo_{tag}.txt.gz"
        with gzip.open(hlo_path, "wt") as fh:
            fh.write(compiled.as_text())
        s["breakdown"] = breakdown(saved, hlo_path, args.steps)
    s.update(loss=loss, scale=args.scale, arch=args.arch, batch=args.batch, seq_len=args.seq_len, compile_s=compile_s,
             peak_bytes=peak, attention_backends=backends, device=jax.devices()[0].device_kind)
    return s


def host_phases(trace_path: str | Path, top: int = 30) -> dict:
    """Host time by event name in a trace (seconds): ``self`` (less the events nested inside it on the
    same thread) and ``inclusive``, summed over every host thread, and ``wall`` (the union of its
    intervals over all threads: what it adds to the compile's wall time when nothing else overlaps it);
    the busiest names by self time first."""
    events, procs, threads = _events(trace_path)
    by_thread: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "GPU" not in procs.get(e["pid"], ""):
            by_thread[(e["pid"], e["tid"])].append(e)
    self_us: collections.Counter = collections.Counter()
    incl_us: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    spans: dict = collections.defaultdict(list)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list = []  # [end, name, children's us, us] of the open events
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]):
                end, name, child, dur = stack.pop()
                self_us[name] += dur - child
                if stack:
                    stack[-1][2] += dur
            if e is None:
                break
            dur = e.get("dur", 0.0)
            incl_us[e["name"]] += dur
            counts[e["name"]] += 1
            spans[e["name"]].append((e["ts"], e["ts"] + dur))
            stack.append([e["ts"] + dur, e["name"], 0.0, dur])
    return {"threads": len(by_thread),
            "phases": [{"name": n, "self_s": us * 1e-6, "inclusive_s": incl_us[n] * 1e-6,
                        "wall_s": _union_length(spans[n]) * 1e-6, "count": counts[n]}
                       for n, us in self_us.most_common(top)]}


def _union_length(intervals) -> float:
    """The length covered by a list of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def trace_compile(args) -> dict:
    """Lowers the step, then compiles it under ``jax.profiler.trace``; the host phases of the compile."""
    import jax

    v = _variant(args)
    lowered, lower_s, _ = v.lower()
    out_dir = Path(args.out_dir)
    trace_dir = out_dir / "trace"
    with jax.profiler.trace(str(trace_dir)):
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
    tag = f"{args.scale}_{args.arch}_b{args.batch}"
    saved = keep_trace(trace_dir, out_dir / f"compile_trace_{tag}.json.gz")
    s = host_phases(saved, args.top)
    if args.hlo:  # the optimised program: its fusions and kernels, to count what was compiled
        with gzip.open(out_dir / f"hlo_{tag}.txt.gz", "wt") as fh:
            fh.write(compiled.as_text())
    s.update(scale=args.scale, arch=args.arch, batch=args.batch, remat=args.remat, lower_s=lower_s,
             compile_s=compile_s, trace=str(saved), device=jax.devices()[0].device_kind)
    return s


def print_phases(s: dict) -> None:
    print(f"lower {s['lower_s']:.1f} s, compile {s['compile_s']:.1f} s ({s['threads']} host threads traced)")
    print(f"{'self s':>8} {'incl s':>8} {'wall s':>8} {'count':>7}  event")
    for p in s["phases"]:
        print(f"{p['self_s']:>8.2f} {p['inclusive_s']:>8.2f} {p['wall_s']:>8.2f} {p['count']:>7}  {p['name'][:110]}")


def keep_trace(trace_dir: Path, saved: Path) -> Path:
    """Copies the newest ``*.trace.json.gz`` under ``trace_dir`` (a ``jax.profiler.trace`` directory)
    to ``saved`` and removes ``trace_dir``: the copy is the one that travels."""
    found = sorted(glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True))
    if not found:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}")
    shutil.copy(found[-1], saved)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="s3")
    ap.add_argument("--arch", default="full")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3, help="steps under the profiler")
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hlo", action="store_true", help="also save the compiled step's optimised HLO (gzip)")
    ap.add_argument("--out-dir", default="profile_out")
    ap.add_argument("--summarize", default=None, metavar="TRACE_JSON_GZ", help="summarise a saved trace instead")
    ap.add_argument("--hlo-file", default=None, help="with --summarize: the step's saved HLO (--hlo), for the parts")
    ap.add_argument("--compile-trace", action="store_true",
                    help="trace the step's compile (host phases) instead of its steps")
    args = ap.parse_args()
    if args.compile_trace and (args.summarize or args.hlo_file):
        ap.error("--compile-trace compiles and traces a step; it does not read a saved trace (--summarize, --hlo-file)")
    if args.compile_trace:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        s = trace_compile(args)
        (Path(args.out_dir) / "compile_phases.json").write_text(json.dumps(s, indent=2))
        print_phases(s)
        return
    if args.summarize:
        s = summarize(args.summarize, args.steps, None, args.top)
        if args.hlo_file:
            s["breakdown"] = breakdown(args.summarize, args.hlo_file, args.steps)
    else:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        s = profile(args)
        (Path(args.out_dir) / "profile_summary.json").write_text(json.dumps(s, indent=2))
    print_summary(s)
    if "breakdown" in s:
        print_breakdown(s["breakdown"])


if __name__ == "__main__":
    main()
