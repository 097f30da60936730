"""Train-step throughput, MFU, memory and compile time of hybrid stacks (random tokens).

    python experiments/bench_train.py --scale s4 --arch full,swa,sa --seq-len 16384 --batch 2
    python experiments/bench_train.py --scale s1,s3 --arch full,swa,sa --sweep-microbatch 1,2,4,8,16

Every variant is one jitted train step of the trainer (``make_train_step`` with one micro-batch of
``batch`` sequences). The steps are compiled ahead of time in a pool of threads (XLA compiles outside
the GIL), so compiles overlap while the main thread times the ready ones one at a time on the device.
``compile_s`` is therefore measured under that contention; ``--compile-alone`` compiles one at a
time; ``--time-after-compiles`` compiles them all in parallel, then times them one at a time. Peak memory is XLA's own account of the compiled step (arguments + outputs + temporaries,
``memory_analysis``); a step whose account exceeds the device's memory is reported as ``oom``
without running it, and one that fails to allocate at run time likewise.

An arch name may end in ``+scan`` (``gdn+scan``): the same variant with ``ModelConfig.scan_layers``
on, so one call times the scanned and unrolled stacks side by side. ``--deadline`` bounds the whole
call: variants whose compile has not finished by then are reported as ``not_compiled`` and the
process exits without waiting for the compile threads. ``@REMAT`` after an arch (``full@dots_attn``)
sets that variant's remat policy, so one call compares policies.

``--accumulate M`` runs M micro-batches of ``batch`` sequences per step (``TrainConfig.microbatches``,
gradients accumulated in fp32), as a run does when its global batch exceeds one micro-batch: the
optimizer update is then paid once per M micro-batches, which a one-micro-batch step overstates.

``--batch rule`` gives each variant the micro-batch that ``configs/microbatch_h200.json`` holds for its
scale, arch and remat policy (the one a run takes), so one call times every cell at its best micro-batch.

``--sweep-microbatch`` picks, per (scale, arch), the micro-batch (sequences per device) with the
highest tokens/s among those that fit, and writes them as the measured table that
``hybrid_lm.train.microbatch`` reads (``--table-out``). MFU counts FLOPs per layer type
(``hybrid_lm.model.accounting``) against 989 TF/s dense bf16.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.backends import loss_backend, recorded_backends
from hybrid_lm.config import load_config
from hybrid_lm.model import transformer
from hybrid_lm.model.accounting import PEAK_FLOPS_H200_BF16, count_params, flops_per_token
from hybrid_lm.train import microbatch
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.train.step import ModelFns, StateInit, make_train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import GpuSampler  # noqa: E402

ARCH = {  # gin bindings per variant (the full-attention slot unchanged unless said)
    "full": ["ModelConfig.layer_pattern = 'F'"],
    "swa": ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 128"],
    "sa": ["efficient/MixerConfig.kind = 'sa'", "efficient/MixerConfig.window = 128"],
    "sa_swa": ["efficient/MixerConfig.kind = 'sa_swa'", "efficient/MixerConfig.window = 128"],
    "lightning": ["efficient/MixerConfig.kind = 'lightning'"],
    "mamba2": ["efficient/MixerConfig.kind = 'mamba2'"],
    "gdn": ["efficient/MixerConfig.kind = 'gdn'"],
    # GDN's output norm on the one-pass kernels (ModelConfig.gated_norm_kernel), beside the default
    "gdn_norm_pallas": ["efficient/MixerConfig.kind = 'gdn'", "ModelConfig.gated_norm_kernel = 'pallas'"],
    # MoBA at the official gate's scale of blocks (configs/arch/moba.gin has SSA's block 16)
    "moba": ["efficient/MixerConfig.kind = 'moba'",
             "efficient/MixerConfig.options = {'block_size': 128, 'top_k': 16, 'gate': 'moba'}"],
    "moba_block": ["efficient/MixerConfig.kind = 'moba'",
                   "efficient/MixerConfig.options = {'block_size': 128, 'top_k': 16, 'gate': 'moba', "
                   "'selection': 'block'}"],
    "moba16": ["include 'arch/moba.gin'"],
    "ssa": ["include 'arch/ssa.gin'"],
    # the same two with the per-token gather kernel / the fused selection (ModelConfig.sparse_impl, selection_impl)
    "moba16_gather": ["include 'arch/moba.gin'", "ModelConfig.sparse_impl = 'gather'"],
    "ssa_gather": ["include 'arch/ssa.gin'", "ModelConfig.sparse_impl = 'gather'"],
    "moba16_union": ["include 'arch/moba.gin'", "ModelConfig.sparse_impl = 'union'"],
    "ssa_union": ["include 'arch/ssa.gin'", "ModelConfig.sparse_impl = 'union'"],
    "moba16_gather_fused": ["include 'arch/moba.gin'", "ModelConfig.sparse_impl = 'gather'",
                            "ModelConfig.selection_impl = 'fused'"],
    "ssa_gather_fused": ["include 'arch/ssa.gin'", "ModelConfig.sparse_impl = 'gather'",
                         "ModelConfig.selection_impl = 'fused'"],
    # the split selection: gate kernel + top-k kernel (ModelConfig.selection_impl = 'split')
    "moba16_split": ["include 'arch/moba.gin'", "ModelConfig.selection_impl = 'split'"],
    "ssa_split": ["include 'arch/ssa.gin'", "ModelConfig.selection_impl = 'split'"],
}


SCAN = "+scan"  # arch suffix: the same stack under ModelConfig.scan_layers


def arch_bindings(arch: str) -> list[str]:
    """The gin bindings of ``arch`` (``name``, ``name+scan``, either with ``@REMAT``: ``full@dots_attn``
    runs that variant under ``ModelConfig.remat = REMAT`` instead of ``--remat``)."""
    arch, _, remat = arch.partition("@")
    base = arch.removesuffix(SCAN)
    if base not in ARCH:
        raise SystemExit(f"unknown arch {arch!r}: choose from {sorted(ARCH)}, optionally with {SCAN!r}")
    return (ARCH[base] + (["ModelConfig.scan_layers = True"] if arch.endswith(SCAN) else [])
            + ([f"ModelConfig.remat = '{remat}'"] if remat else []))


def make_config(scale: str, arch: str, seq_len: int, batch: int | None, remat: str, impl: str, extra=(),
                accumulate: int = 1):
    """The variant's config: ``batch`` sequences per micro-batch, ``accumulate`` micro-batches per step
    (``batch=None``: the preset's global batch and micro-batches, as a run takes them)."""
    bindings = arch_bindings(arch)
    gin_files = [f"scale/{scale}.gin"] + [b.split("'")[1] for b in bindings if b.startswith("include")]
    batching = [] if batch is None else [f"TrainConfig.global_batch = {batch * accumulate}",
                                         f"TrainConfig.microbatches = {accumulate}"]
    params = [f"ModelConfig.remat = '{remat}'"] + [b for b in bindings if not b.startswith("include")] + [
        f"DataConfig.seq_len = {seq_len}", *batching, f"ModelConfig.attention_impl = '{impl}'", *extra]
    return load_config(gin_files, params)


def rule_batch(scale: str, arch: str, args) -> int:
    """The micro-batch a one-device run of the variant's global batch takes (``--batch rule``): the table's
    measured best for ``(scale, arch)`` under the variant's remat policy, fitted to this device's memory limit,
    then to a divisor of the global batch (``train.microbatch.rule_for``), as a run's is."""
    remat = arch.partition("@")[2] or args.remat
    cfg = make_config(scale, arch, args.seq_len, None, remat, args.impl, args.gin_param)
    if microbatch.measured_per_device(cfg) is None:
        raise SystemExit(f"--batch rule: {microbatch.TABLE.name} has no entry for {scale}/"
                         f"{microbatch.arch_name(cfg.model)}/{args.seq_len} (arch {arch}); give --batch N")
    M, why = microbatch.rule_for(cfg, 1, memory_limit=device_memory())
    if "scaled from" in why:
        print(f"--batch rule: {scale} {arch}: {cfg.train.global_batch // M} sequences ({why})", flush=True)
    return cfg.train.global_batch // M


class Variant:
    """One (scale, arch, batch) train step: its config, compiled executable and measurements."""

    def __init__(self, scale, arch, batch, args):
        accumulate = getattr(args, "accumulate", 1)
        self.key = dict(scale=scale, arch=arch, batch=batch, seq_len=args.seq_len, accumulate=accumulate,
                        remat=arch.partition("@")[2] or args.remat,
                        attention_impl=args.impl, loss_impl=args.loss, gin_param=list(args.gin_param),
                        save_primitive=list(getattr(args, "save_primitive", [])),
                        jla_grouped_keys=not getattr(args, "jla_repeated_keys", False),
                        short_conv_vjp=not getattr(args, "short_conv_autodiff", False),
                        gdn_padded_output=not getattr(args, "gdn_sliced_output", False))
        extra = ([f"ModelConfig.loss_impl = '{args.loss}'"] if args.loss != "default" else []) + args.gin_param
        self.cfg = make_config(scale, arch, args.seq_len, batch, args.remat, args.impl, extra, accumulate)
        self.key["rule_arch"] = microbatch.arch_name(self.cfg.model)
        self.fns = ModelFns(self.cfg)
        self.build = optimizer_for_bounds(self.cfg.optim, self.fns.axes)
        self.bounds = np.asarray(wsd_bounds(self.cfg.optim, 1000), np.int32)
        self.init = StateInit(self.fns, self.build(self.bounds)[0])
        self.seed = jnp.asarray(0, jnp.uint32)

    @property
    def sequences(self) -> int:
        """Sequences per step: the micro-batch times the micro-batches accumulated."""
        return self.key["batch"] * self.key["accumulate"]

    def lower(self):
        """(lowered step, seconds, backends): tracing runs in the main thread, one variant at a time,
        so the record of backends is this variant's alone."""
        t0 = time.perf_counter()
        state = jax.eval_shape(self.init, self.seed)
        tokens = jax.ShapeDtypeStruct((self.sequences, self.key["seq_len"] + 1), jnp.int32)
        recorded_backends(clear=True)
        lowered = jax.jit(make_train_step(self.fns, self.build), donate_argnums=0).lower(state, tokens, self.bounds)
        return lowered, time.perf_counter() - t0, recorded_backends()

    def compile(self, lowered, lower_s):
        """(compiled step, lower + compile seconds, XLA's memory account in bytes). The parameter
        init is compiled here too (in the pool), so timing a variant does not wait on its compile;
        its seconds are ``init_compile_s`` (not part of ``compile_s``)."""
        t0 = time.perf_counter()
        self.init.compile(self.seed)
        self.init_compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        m = compiled.memory_analysis()
        peak = None if m is None else int(m.argument_size_in_bytes + m.output_size_in_bytes
                                          + m.temp_size_in_bytes - m.alias_size_in_bytes)
        return compiled, lower_s + time.perf_counter() - t0, peak

    def run(self, compiled, steps: int) -> dict:
        state = self.init(self.seed)
        tokens = jax.random.randint(jax.random.key(0), (self.sequences, self.key["seq_len"] + 1), 0,
                                    self.cfg.model.vocab_size)
        t0 = time.perf_counter()
        state, stats = compiled(state, tokens, self.bounds)  # warm-up
        jax.block_until_ready(stats["loss"])
        warmup_s = time.perf_counter() - t0
        times = []
        with GpuSampler() as smi:  # the SM clock and power beside the time (the H200 is power-limited)
            for _ in range(steps):
                t0 = time.perf_counter()
                state, stats = compiled(state, tokens, self.bounds)
                jax.block_until_ready(stats["loss"])
                times.append(time.perf_counter() - t0)
        loss = float(stats["loss"])
        del state, stats
        ms = 1e3 * np.asarray(times)
        return {"ms_per_step": float(np.median(ms)), "ms_min": float(ms.min()), "ms_max": float(ms.max()),
                "loss": loss, "warmup_s": warmup_s, **smi.means()}


NONFINITE_LOSS = "nonfinite_loss"


def mark_nonfinite_loss(row: dict) -> dict:
    """A timed step whose loss is NaN or infinite is not a valid timing: on the H200, NaN activations ran the
    unrelated cuDNN attention and MLP matmul kernels 13-15% faster (the power limit: NaN operands draw less
    power, so the clock stays higher; experiments/bench_data_power.py, docs/BENCHMARKS.md session 21). Such a row gets status ``nonfinite_loss``, so no table
    and no micro-batch rule takes its time."""
    loss = row.get("loss")
    if loss is not None and not math.isfinite(loss):
        row.update(status=NONFINITE_LOSS, error=f"loss {loss} after the timed steps: the step time is not valid "
                                                "(NaN/inf data runs faster than real data)")
    return row


def device_memory() -> int | None:
    return microbatch.device_memory_limit(jax.devices()[0])


def measure(variants, args, deadline: float | None = None) -> tuple[list[dict], bool]:
    """(rows in the order of ``variants``, whether compiles were left running at the deadline).
    Ready variants are timed in the order their compiles finish, one at a time on the device.
    ``--compile-alone`` runs strictly one variant at a time: lower, compile, time, then the next, so
    no lowering in the main thread competes with a compile either."""
    limit = device_memory()
    rows: dict[int, dict] = {}
    workers = 1 if args.compile_alone else args.compile_workers
    pool = cf.ThreadPoolExecutor(max_workers=workers)
    pending: dict = {}  # future -> (index, variant, backends)
    t0 = time.time()

    def take(fut):  # time one compiled variant and save the rows so far
        i, v, backends = pending.pop(fut)
        t_take = time.time() - t0
        rows[i] = finish(v, backends, fut, limit, args)
        # seconds from the start of measure(): lowered, compile seen done, timing finished
        rows[i].update(t_lowered_s=backends.get("t_lowered_s"), t_taken_s=t_take, t_done_s=time.time() - t0)
        if args.out:
            save(args.out, [rows[k] for k in sorted(rows)])

    left_running = False
    for i, v in enumerate(variants):
        if deadline is not None and time.time() > deadline:
            rows[i] = dict(v.key, status="not_compiled", error="not lowered by the --deadline")
            report(rows[i])
            continue
        try:
            lowered, lower_s, backends = v.lower()
            pending[pool.submit(v.compile, lowered, lower_s)] = (
                i, v, dict(backends, lower_s=lower_s, t_lowered_s=time.time() - t0))
        except Exception as e:  # noqa: BLE001 - a variant that cannot trace is reported, not fatal
            rows[i] = finish(v, {}, e, limit, args)
        if args.compile_alone:
            cf.wait(list(pending), timeout=None if deadline is None else max(0.0, deadline - time.time()))
        if getattr(args, "time_after_compiles", False):
            continue
        for fut in [f for f in pending if f.done()]:  # time what is ready while later ones lower
            take(fut)
    try:
        if getattr(args, "time_after_compiles", False):  # no compile (nor XLA's autotuner) beside a timing
            done, _ = cf.wait(list(pending), timeout=None if deadline is None else max(0.0, deadline - time.time()))
            if len(done) < len(pending):
                raise cf.TimeoutError
        for fut in cf.as_completed(list(pending),
                                   timeout=None if deadline is None else max(0.0, deadline - time.time())):
            take(fut)
    except cf.TimeoutError:
        left_running = True
        for fut, (i, v, backends) in pending.items():
            fut.cancel()
            rows[i] = dict(v.key, status="not_compiled", error="compile not finished by the --deadline",
                           lower_s=backends.get("lower_s"), t_lowered_s=backends.get("t_lowered_s"))
            report(rows[i])
    pool.shutdown(wait=not left_running, cancel_futures=True)
    return [rows[k] for k in sorted(rows)], left_running


def finish(v: Variant, backends: dict, fut, limit: int | None, args) -> dict:
    """The row of one variant: compile result (or error), then its timed steps unless it cannot fit."""
    backends = dict(backends)
    lower_s = backends.pop("lower_s", None)
    backends.pop("t_lowered_s", None)
    row = dict(v.key, attention_backends=backends, lower_s=lower_s,
               loss_backend=loss_backend(v.cfg.model.loss_impl, v.key["batch"] * v.key["seq_len"],
                                         v.cfg.model.vocab_size, v.cfg.model.loss_kernel)[0])
    f = flops_per_token(v.cfg.model, v.key["seq_len"])
    row.update(non_embedding=count_params(v.cfg.model)["non_embedding"], train_flops_per_token=f["train"],
               tokens_per_step=v.sequences * v.key["seq_len"])
    try:
        if isinstance(fut, Exception):
            raise fut
        compiled, row["compile_s"], row["peak_bytes"] = fut.result()
        row["init_compile_s"] = getattr(v, "init_compile_s", None)
    except Exception as e:  # noqa: BLE001 - a variant that cannot compile is reported, not fatal
        row.update(status="compile_error", error=str(e).splitlines()[0][:300])
        report(row)
        return row
    if limit and row["peak_bytes"] and row["peak_bytes"] > limit:
        row["status"] = "oom"
    elif getattr(args, "compile_only", False):  # the program's size: XLA's fusions after optimisation
        row.update(status="compiled", fusions=len(re.findall(r"^\s*\S+ = \S+ fusion\(", compiled.as_text(), re.M)))
    else:
        try:
            row.update(v.run(compiled, args.steps))
            row["status"] = "ok"
            tps = row["tokens_per_step"] / (row["ms_per_step"] / 1e3)
            row.update(tokens_per_sec=tps, mfu=tps * f["train"] / (PEAK_FLOPS_H200_BF16 * jax.device_count()))
            mark_nonfinite_loss(row)
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            row.update(status="oom" if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
                       else "run_error", error=msg.splitlines()[0][:300])
    del compiled
    report(row)
    return row


def _batch(r) -> str:
    """``B`` or, with micro-batches accumulated, ``BxM``."""
    m = r.get("accumulate", 1)
    return f"{r['batch']}" + (f"x{m}" if m > 1 else "")


def _clock(r) -> str:
    """``  SM <MHz> MHz <W> W`` while the variant was timed (nvidia-smi), or nothing without it."""
    return "" if r.get("sm_clock_mhz") is None else f"  SM {r['sm_clock_mhz']:.0f} MHz {r['power_w']:.0f} W"


def report(r):
    gib = (r.get("peak_bytes") or 0) / 2 ** 30
    if r.get("status") == "ok":
        print(f"{r['scale']:<5}{r['arch']:<11}{_batch(r):>4}{r['ms_per_step']:>10.1f}{r['tokens_per_sec'] / 1e3:>10.1f}"
              f"{100 * r['mfu']:>7.1f}%{gib:>8.1f}{r['compile_s']:>9.1f}  {r['attention_backends']}{_clock(r)}", flush=True)
    elif r.get("status") == "compiled":
        print(f"{r['scale']:<5}{r['arch']:<11}{_batch(r):>4}  compiled in {r['compile_s']:.1f} s (lowering "
              f"{r['lower_s']:.1f} s, init {r['init_compile_s']:.1f} s), {r['fusions']} fusions  peak {gib:.1f} GiB",
              flush=True)
    else:
        print(f"{r['scale']:<5}{r['arch']:<11}{_batch(r):>4}  {r.get('status')}  peak {gib:.1f} GiB  "
              f"{r.get('error', '')}", flush=True)


def table_key(r) -> str:
    """``scale/arch/seq_len@remat`` of a row: the micro-batch table's key. ``arch`` is the rule's name for
    the variant's architecture (``rule_arch``, ``hybrid_lm.train.microbatch.arch_name``: the ``moba16``
    variant is the ``moba`` preset) where the row has it, else the variant's label without its ``@REMAT``."""
    key = f"{r['scale']}/{r.get('rule_arch') or r['arch'].partition('@')[0]}/{r['seq_len']}"
    return key + (f"@{r['remat']}" if r.get("remat") else "")


def best_microbatches(rows) -> dict:
    """Per (scale, arch, seq_len, remat): the micro-batch with the highest tokens/s among those that
    ran, ``tried``: every micro-batch that ran or was found not to fit, and ``variants``: the labels
    measured under that key (two labels of one architecture, e.g. ``gdn`` and ``gdn_norm_pallas``, make
    the key ambiguous: :func:`write_table` leaves it out). ``+scan`` variants are not keyed (the rule
    keys on the architecture, not on how its stack is compiled)."""
    best: dict = {}
    tried: dict = {}
    labels: dict = {}
    for r in rows:
        label = r["arch"].partition("@")[0]
        if SCAN in label:
            continue
        k = table_key(r)
        if r.get("status") in ("ok", "oom"):
            tried.setdefault(k, []).append(r["batch"])
            labels.setdefault(k, set()).add(label)
        if r.get("status") != "ok":
            continue
        if k not in best or r["tokens_per_sec"] > best[k]["tokens_per_sec"]:
            best[k] = {"batch": r["batch"], "tokens_per_sec": r["tokens_per_sec"], "mfu": r["mfu"]}
            if r.get("peak_bytes"):
                best[k]["peak_bytes"] = r["peak_bytes"]
    for k in best:
        best[k]["tried"] = sorted(tried[k])
        best[k]["variants"] = sorted(labels[k])
    return best


def save(path, rows, extra=None):
    with open(path, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "rows": rows, **(extra or {})}, fh, indent=2)


def write_table(path: str, best: dict, command: str, device: str, remat: str,
                memory_limit: int | None = None) -> dict:
    """Merge ``best`` into the micro-batch table at ``path`` (entries of other keys are kept) and
    return the table written. Only sweeps enter it: a key with fewer than two micro-batches tried
    is left out, and so is a key measured by several variants (``variants``). Keys measured
    under the table's remat policy (``remat`` for a new table) are written plain, others keep their
    ``@POLICY`` ending (``hybrid_lm.train.microbatch``). Each written key's compiled peak goes to
    ``peak_gib`` and ``memory_limit`` (bytes, the measuring device's) to ``memory_limit_gib``: the rule
    fits an entry to a device with less memory from them."""
    table = json.loads(open(path).read()) if os.path.exists(path) else {}
    if table.get("device", device) != device:
        raise ValueError(f"{path} holds entries measured on {table['device']}, not {device}: write this sweep to a "
                         "table of its own (--table-out)")
    own = table.get("remat", remat)
    merged, peaks = dict(table.get("best", {})), dict(table.get("peak_gib", {}))
    for k, b in best.items():
        if len(b.get("tried", ())) < 2:
            continue
        if len(b.get("variants", ())) > 1:
            print(f"micro-batch table: {k} left out: measured by several variants ({', '.join(b['variants'])})")
            continue
        base, _, policy = k.partition("@")
        key = base if policy in ("", own) else k
        merged[key] = b["batch"]
        peaks.pop(key, None)
        gib = round((b.get("peak_bytes") or 0) / 2 ** 30, 2)
        if gib > 0:  # a peak that rounds to 0 GiB (a tiny CPU sweep) is left out: the table needs positive peaks
            peaks[key] = gib
    commands = table.get("commands", [table["command"]] if "command" in table else [])
    limit = round(memory_limit / 2 ** 30, 1) if memory_limit else table.get("memory_limit_gib")
    out = {"device": device, "measured": time.strftime("%Y-%m-%d"), "remat": own,
           **({"memory_limit_gib": limit} if limit else {}),
           "commands": [*commands, command] if command not in commands else commands,
           "best": dict(sorted(merged.items())), "peak_gib": dict(sorted(peaks.items()))}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="s4", help="comma-separated scales")
    ap.add_argument("--arch", default="full,swa,sa", help=f"comma-separated, from {sorted(ARCH)}")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", default="2",
                    help="sequences per step (one micro-batch), or 'rule': each variant's measured best micro-batch "
                         "under its remat policy (configs/microbatch_h200.json, as a run takes it)")
    ap.add_argument("--sweep-microbatch", default=None, metavar="B1,B2,...",
                    help="micro-batch sizes to try per (scale, arch); the best that fits is kept")
    ap.add_argument("--accumulate", type=int, default=1, metavar="M",
                    help="micro-batches per step (gradient accumulation, TrainConfig.microbatches): the step "
                         "then holds M x --batch sequences and its optimizer update is shared by M micro-batches, "
                         "as in a run whose global batch exceeds one micro-batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--loss", default="default", help="ModelConfig.loss_impl (default: the config's)")
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin binding (repeatable)")
    ap.add_argument("--save-primitive", action="append", default=[], metavar="NAME",
                    help="remat 'dots_attn' also saves this primitive's outputs (repeatable; e.g. "
                         "custom_partitioning, which wraps jla's kernels)")
    ap.add_argument("--compile-workers", type=int, default=8)
    ap.add_argument("--compile-alone", action="store_true", help="compile one variant at a time")
    ap.add_argument("--time-after-compiles", action="store_true",
                    help="compile every variant (in parallel) before timing any: XLA's autotuner runs candidate "
                         "kernels on the device during a compile, which disturbs a step timed beside it")
    ap.add_argument("--compile-only", action="store_true",
                    help="lower and compile, never run (compile times of any scale on the CPU)")
    ap.add_argument("--order", choices=("scale", "arch"), default="scale",
                    help="variant order (compiles start in this order): scale-major or arch-major")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start: report unfinished compiles as not_compiled and exit")
    ap.add_argument("--out", default="bench_train.json")
    ap.add_argument("--table-out", default=None, help="with --sweep-microbatch: the measured best table")
    ap.add_argument("--jla-repeated-keys", action="store_true",
                    help="repeat Mamba-2's B/C groups before jla's kernel (ops.linear_attention_gpu.JLA_GROUPED_KEYS off)")
    ap.add_argument("--short-conv-autodiff", action="store_true",
                    help="ShortConv's backward by autodiff of the reference (model.recurrent_common.SHORT_CONV_VJP off)")
    ap.add_argument("--gdn-sliced-output", action="store_true",
                    help="GDN takes jla's output sliced and cast to fp32 before its norm (model.gated_deltanet."
                         "GDN_PADDED_OUTPUT off: the path before session 18)")
    args = ap.parse_args()
    if args.accumulate < 1:
        raise SystemExit(f"--accumulate {args.accumulate}: need at least one micro-batch per step")
    if args.short_conv_autodiff:
        from hybrid_lm.model import recurrent_common
        recurrent_common.SHORT_CONV_VJP = False
    if args.gdn_sliced_output:
        from hybrid_lm.model import gated_deltanet
        gated_deltanet.GDN_PADDED_OUTPUT = False
    if args.jla_repeated_keys:
        from hybrid_lm.ops import linear_attention_gpu
        linear_attention_gpu.JLA_GROUPED_KEYS = False
    if args.save_primitive:
        transformer._ATTENTION_KERNELS = (*transformer._ATTENTION_KERNELS, *args.save_primitive)
    if args.batch != "rule" and not args.batch.isdigit():
        raise SystemExit(f"--batch {args.batch!r}: give a number of sequences or 'rule'")
    if args.batch == "rule" and args.sweep_microbatch:
        raise SystemExit("--batch rule and --sweep-microbatch exclude each other: the sweep measures the rule")
    batches = [int(b) for b in args.sweep_microbatch.split(",")] if args.sweep_microbatch else [
        None if args.batch == "rule" else int(args.batch)]
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}   memory limit "
          f"{(device_memory() or 0) / 2 ** 30:.1f} GiB")
    print(f"{'scale':<5}{'arch':<11}{'B':>4}{'ms/step':>10}{'ktok/s':>10}{'MFU':>8}{'GiB':>8}{'compile':>9}")
    t_start = time.time()
    scales, archs = args.scale.split(","), args.arch.split(",")
    for a in archs:
        arch_bindings(a)
    keys = ([(s, a, b) for s in scales for a in archs for b in batches] if args.order == "scale"
            else [(s, a, b) for a in archs for s in scales for b in batches])
    if args.batch == "rule":
        keys = [(s, a, rule_batch(s, a, args)) for s, a, _ in keys]
    variants = [Variant(s, a, b, args) for s, a, b in keys]
    rows, left_running = measure(variants, args, None if args.deadline is None else t_start + args.deadline)
    best = best_microbatches(rows)
    save(args.out, rows, {"best": best, "wall_s": time.time() - t_start})
    if args.sweep_microbatch:
        print("\nbest micro-batch (sequences per device):")
        for k, b in sorted(best.items()):
            print(f"  {k:<28} {b['batch']:>3}   {b['tokens_per_sec'] / 1e3:.1f} ktok/s   {100 * b['mfu']:.1f}% MFU")
        if args.table_out:
            try:
                write_table(args.table_out, best, f"experiments/bench_train.py --scale {args.scale} --arch {args.arch} "
                                                  f"--remat {args.remat} --sweep-microbatch {args.sweep_microbatch}",
                            jax.devices()[0].device_kind, args.remat, device_memory())
            except ValueError as err:
                raise SystemExit(f"--table-out: {err}") from None
    if left_running:  # compile threads cannot be stopped: leave without joining them
        os._exit(0)


if __name__ == "__main__":
    main()
