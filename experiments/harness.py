"""The benchmarks' shared harness: timing, device info, ahead-of-time compiles in a thread pool, the
anchors, the result files and the common command line (imported by the ``bench_*.py`` scripts beside it).

Every benchmark script answers one question, prints a table and writes one JSON file,
``experiments/results/<device>/<bench>.json`` (``<device>`` is :func:`device_name`: ``h100``, ``h200``,
``cpu``, ...), overwritten by a rerun. ``experiments/report.py`` turns those files into
``docs/BENCHMARKS.md`` and the README's table. Every file holds::

    {"bench", "command", "device", "device_kind", "devices", "platform", "jax", "date", "git", "wall_s",
     "anchor": {...} | null, "rows": [...], ...}

``command`` is the command line that reproduces the file (without ``--out``); ``anchor`` is the
reference measured in the same run (the plain-JAX GPT for train steps, cuDNN for attention kernels,
full attention for decoding and mixer layers), which every ratio divides by.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EXPERIMENTS = Path(__file__).resolve().parent
ROOT = EXPERIMENTS.parent
RESULTS = EXPERIMENTS / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # hybrid_lm from this checkout without an install

PEAK_BF16_FLOPS = 989e12  # dense bf16 of the H100 and the H200 (SXM): the MFU denominator

from hybrid_lm.experiment import load_config  # noqa: E402,F401  (the bench scripts' config loader)


# ----------------------------------------------------------------------------- device

def device_kind() -> str:
    d = jax.devices()[0]
    return str(getattr(d, "device_kind", d.platform))


def device_name(kind: str | None = None, platform: str | None = None) -> str:
    """A short name of the accelerator for the results folder: ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA H200`` -> ``h200``, any CPU -> ``cpu``."""
    if kind is None:
        platform, kind = jax.devices()[0].platform, device_kind()
    if platform == "cpu":
        return "cpu"
    low = kind.lower().replace("nvidia", "")
    m = re.findall(r"[a-z]+\d+[a-z]*", low)
    return m[0] if m else re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def memory_limit() -> int | None:
    """Bytes JAX's allocator may take on the first device (None on the CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes); ``HYBRID_LM_COMMIT`` wins, for a copy of a
    working tree whose ``.git`` is not the one it came from (a GPU machine sent the tree)."""
    if os.environ.get("HYBRID_LM_COMMIT"):
        return os.environ["HYBRID_LM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------- timing

def median_ms(fn, args, reps: int = 5, inner: int = 1, warmup: int = 2) -> tuple[float, list[float]]:
    """``(median, all)`` milliseconds per call of ``fn(*args)``: ``warmup`` calls, then ``reps``
    repetitions of ``inner`` back-to-back calls closed by ``block_until_ready`` (dispatch overlaps device
    work, so for calls of more than a few tens of microseconds this is device time)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(times), times


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def is_oom(e: BaseException) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def time_ms(fn, args, reps: int, inner: int = 1, warmup: int = 2) -> dict:
    """``{"ms": median}`` or ``{"ms": None, "error": ...}`` (a failure, e.g. out of memory, is recorded)."""
    try:
        return {"ms": median_ms(fn, args, reps, inner, warmup)[0]}
    except Exception as e:  # noqa: BLE001 - recorded, the table goes on
        print(f"    failed: {short_error(e)}", flush=True)
        return {"ms": None, "error": short_error(e)}


def peak_bytes(compiled) -> int | None:
    """XLA's account of a compiled program's memory: arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def compile_all(jobs, workers: int, deadline: float | None = None) -> tuple[dict, bool]:
    """Run the compiles ``jobs`` (an iterable of ``(key, fn)``, ``fn()`` returning what it compiled; the
    iterable may lower each program in this thread as it is asked for the next) in a pool of ``workers``
    threads: XLA compiles outside the GIL, so they overlap each other and the next lowering. Returns
    ``(results, left_running)``: ``results[key]`` is ``{"status": "compiled", "value", "compile_s"}``,
    ``{"status": "compile_error", "error"}`` or, unfinished at ``deadline`` (``time.time()`` seconds),
    ``{"status": "not_compiled", "error"}``. Compile threads cannot be stopped: with ``left_running`` the
    caller ends with :func:`exit_now`."""
    def timed(fn):
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0

    pool = cf.ThreadPoolExecutor(max_workers=max(1, workers))
    futs, results = {}, {}
    for key, fn in jobs:
        if deadline is not None and time.time() > deadline:
            results[key] = {"status": "not_compiled", "error": "not lowered by the deadline"}
        else:
            futs[pool.submit(timed, fn)] = key
    left_running = False
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        for fut in cf.as_completed(futs, timeout=timeout):
            try:
                value, seconds = fut.result()
                results[futs[fut]] = {"status": "compiled", "value": value, "compile_s": seconds}
            except Exception as e:  # noqa: BLE001 - a program that cannot compile is reported
                results[futs[fut]] = {"status": "compile_error", "error": short_error(e)}
    except cf.TimeoutError:
        left_running = True
        for fut, key in futs.items():
            if key not in results:
                fut.cancel()
                results[key] = {"status": "not_compiled", "error": "compile not finished by the deadline"}
    pool.shutdown(wait=not left_running, cancel_futures=True)
    return results, left_running


def time_programs(programs: dict, reps: int, inner: int = 1, workers: int = 8, deadline: float | None = None,
                  warmup: int = 2) -> tuple[dict, bool]:
    """``programs``: key -> ``(jitted fn, args)``. Each is lowered here, compiled in the pool
    (:func:`compile_all`), then timed alone in the order given (:func:`time_ms`). Returns ``(results,
    left_running)``: ``results[key]`` holds ``ms`` (None where it failed: ``error``, ``status``) and
    ``compile_s``. Pass the arrays a program must not constant-fold (e.g. a selection) as arguments."""
    def jobs():
        for key, (fn, args) in programs.items():
            try:
                lowered = fn.lower(*args)
            except Exception as e:  # noqa: BLE001 - reported as its compile error
                yield key, functools.partial(reraise, e)
                continue
            yield key, lowered.compile

    compiled, left_running = compile_all(jobs(), workers, deadline)
    out = {}
    for key, (fn, args) in programs.items():
        c = compiled[key]
        if c["status"] != "compiled":
            out[key] = {"ms": None, "status": c["status"], "error": c.get("error")}
            print(f"  {key}: {c['status']}: {c.get('error')}", flush=True)
            continue
        r = time_ms(c["value"], args, reps, inner, warmup)
        c["value"] = None
        out[key] = dict(r, compile_s=c["compile_s"], status="ok" if r["ms"] is not None else "run_error")
    return out, left_running


def reraise(e: BaseException):
    """Raise ``e`` (a lowering's error, reported as its program's compile error)."""
    raise e


def exit_now(code: int = 0) -> None:
    """Leave without joining compile threads still running past a deadline (they cannot be stopped)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- anchors

def reference_attention(q, k, v, window: int | None = None):
    """The attention anchor: cuDNN's causal attention (``window``: its sliding window of ``window`` keys)
    on a GPU; XLA's on a CPU, where cuDNN does not exist (smoke runs)."""
    impl = "cudnn" if on_gpu() else "xla"
    lw = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=lw, implementation=impl)


def anchor_attention_name() -> str:
    return "cudnn" if on_gpu() else "xla"


class AnchorGPT:
    """The anchor of the train-step benchmark: a plain-JAX GPT with no hybrid_lm code in it.

    Default shape: 24 layers, d_model 1024, 16 heads of 64, MLP 4x (GELU), learned positions, vocab 32,768
    untied (~369M parameters besides the input embeddings). fp32 parameters, bf16 compute, pre-LayerNorm,
    causal ``jax.nn.dot_product_attention`` (cuDNN on a GPU), remat ``dots_with_no_batch_dims_saveable`` per
    layer, whole fp32 logits, optax AdamW. MFU counts 6 N_matmul + 6 L T d FLOPs per token (causal
    attention, as ``hybrid_lm.model.accounting`` counts it), so it compares with the hybrid stacks' MFU.
    Same interface as ``bench_train.Variant``: ``lower``, ``compile``, ``run``."""

    def __init__(self, seq_len: int, batch: int, layers: int = 24, d: int = 1024, heads: int = 16,
                 vocab: int = 32768, seed: int = 0):
        if d % heads:
            raise ValueError(f"anchor d_model {d} is not a multiple of its {heads} heads")
        self.seq_len, self.batch, self.layers, self.d, self.heads, self.vocab = seq_len, batch, layers, d, heads, vocab
        self.seed = seed
        self.key = dict(scale="anchor", arch="anchor_gpt", batch=batch, seq_len=seq_len, layers=layers, d_model=d,
                        heads=heads, vocab=vocab)

    def init_params(self, key):
        d, layers = self.d, self.layers

        def dense(k, shape):
            return jax.random.normal(k, shape, jnp.float32) * (1.0 / np.sqrt(shape[0]))

        ks = jax.random.split(key, 3 + layers)
        blocks = []
        for i in range(layers):
            k = jax.random.split(ks[3 + i], 4)
            blocks.append({"ln1": jnp.ones(d), "ln2": jnp.ones(d), "qkv": dense(k[0], (d, 3 * d)),
                           "out": dense(k[1], (d, d)) / np.sqrt(2 * layers), "up": dense(k[2], (d, 4 * d)),
                           "down": dense(k[3], (4 * d, d)) / np.sqrt(2 * layers)})
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *blocks)
        return {"embed": jax.random.normal(ks[0], (self.vocab, d)) * 0.02,
                "pos": jax.random.normal(ks[1], (self.seq_len, d)) * 0.02,
                "blocks": stacked, "ln_f": jnp.ones(d), "head": dense(ks[2], (d, self.vocab))}

    def loss_fn(self, params, tokens):
        heads, impl = self.heads, ("cudnn" if on_gpu() else None)

        def layer_norm(x, g):
            x32 = x.astype(jnp.float32)
            mu = x32.mean(-1, keepdims=True)
            var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
            return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g).astype(x.dtype)

        def block(x, p):
            b, t, d = x.shape
            h = layer_norm(x, p["ln1"])
            q, k, v = jnp.split(h @ p["qkv"].astype(h.dtype), 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).reshape(b, t, d)
            x = x + a @ p["out"].astype(x.dtype)
            h = layer_norm(x, p["ln2"])
            return x + jax.nn.gelu(h @ p["up"].astype(h.dtype)) @ p["down"].astype(h.dtype), None

        block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = (params["embed"][inputs] + params["pos"][: inputs.shape[1]]).astype(jnp.bfloat16)
        x, _ = jax.lax.scan(block, x, params["blocks"])
        logits = (layer_norm(x, params["ln_f"]) @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    def flops_per_token(self) -> float:
        n_matmul = self.layers * 12 * self.d * self.d + self.d * self.vocab  # qkv + out + MLP, and the LM head
        return 6.0 * n_matmul + 6.0 * self.layers * self.seq_len * self.d

    def _step(self):
        import optax

        opt = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)

        def step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(self.loss_fn)(params, tokens)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return opt, step

    def _state(self):
        opt, _ = self._step()
        params = self.init_params(jax.random.key(self.seed))
        return params, opt.init(params)

    def lower(self):
        """(lowered step, seconds, backends): traced abstractly, nothing allocated."""
        t0 = time.perf_counter()
        params, opt_state = jax.eval_shape(self._state)
        tokens = jax.ShapeDtypeStruct((self.batch, self.seq_len + 1), jnp.int32)
        lowered = jax.jit(self._step()[1], donate_argnums=(0, 1)).lower(params, opt_state, tokens)
        return lowered, time.perf_counter() - t0, {"attention": anchor_attention_name()}

    def compile(self, lowered, lower_s):
        t0 = time.perf_counter()
        compiled = lowered.compile()
        return compiled, lower_s + time.perf_counter() - t0, peak_bytes(compiled)

    def run(self, compiled, steps: int) -> dict:
        params, opt_state = jax.jit(self._state)()
        tokens = jax.random.randint(jax.random.key(self.seed + 1), (self.batch, self.seq_len + 1), 0, self.vocab,
                                    jnp.int32)
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens)  # warm-up
        loss.block_until_ready()
        warmup_s = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            params, opt_state, loss = compiled(params, opt_state, tokens)
            loss.block_until_ready()
            times.append(time.perf_counter() - t0)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        ms = 1e3 * np.asarray(times)
        return {"ms_per_step": float(np.median(ms)), "ms_min": float(ms.min()), "ms_max": float(ms.max()),
                "loss": float(loss), "warmup_s": warmup_s, "params": int(n_params),
                "non_embedding": int(n_params - params["embed"].size - params["pos"].size),
                "train_flops_per_token": self.flops_per_token(), "tokens_per_step": self.batch * self.seq_len}


# ----------------------------------------------------------------------------- command line and results

def parser(bench: str, doc: str) -> argparse.ArgumentParser:
    """The common command line: ``--out`` (default ``experiments/results/<device>/<bench>.json``),
    ``--quick`` (tiny shapes: a CPU smoke run, numbers meaningless)."""
    ap = argparse.ArgumentParser(prog=f"experiments/bench_{bench}.py", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"result JSON (default experiments/results/<device>/{bench}.json)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions: a smoke run of the script")
    return ap


def result_path(bench: str, out: str | None = None) -> Path:
    return Path(out) if out else RESULTS / device_name() / f"{bench}.json"


def command(bench: str, argv) -> str:
    """The command line that reproduces a result (``--out`` left out)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        kept.append(a)
    return shlex.join(["python", f"experiments/bench_{bench}.py", *kept])


def finish(bench: str, out: str | None, argv, rows: list, *, left_running: bool = False, **meta) -> dict:
    """The scripts' common end: write the JSON (:func:`write_result`), say where, and leave at once if
    compile threads are still running past the deadline. Returns ``{"rows": rows}``."""
    path = write_result(bench, out, argv, rows, **meta)
    print(f"wrote {path}")
    if left_running:
        exit_now(0)
    return {"rows": rows}


def write_result(bench: str, out: str | None, argv, rows: list, *, anchor: dict | None = None,
                 started: float | None = None, **extra) -> Path:
    """Write (overwrite) the bench's JSON, atomically; returns its path. Called after every finished row
    too, so a run cut short keeps what it measured."""
    path = result_path(bench, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = jax.devices()[0]
    doc = {"bench": bench, "command": command(bench, argv), "device": device_name(), "device_kind": device_kind(),
           "devices": jax.device_count(), "platform": d.platform, "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_commit(),
           "wall_s": None if started is None else round(time.time() - started, 1),
           "anchor": anchor, "rows": rows, **extra}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    return str(x)


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """A markdown table on stdout (what the scripts print)."""
    if title:
        print(f"\n{title}")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join("—" if c is None else str(c) for c in r) + " |", flush=True)


def fmt(x, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def ratio(a, b, spec: str = ".2f") -> str:
    return "—" if a is None or b is None or b == 0 else format(a / b, spec)
