"""Train step per scale x architecture: tokens/s, MFU, peak memory and compile time, against the anchor GPT
measured in the same run.

    python experiments/bench_train.py --scale s5 --arch full,swa,sa,sa_swa,lightning,mamba2,gdn,moba,ssa \\
        --batch rule --anchor-batch 4 --deadline 420        # the README's table (bash experiments/gpu.sh readme)
    python experiments/bench_train.py --scale s1,s3 --arch full,swa,sa --sweep-microbatch 8,16 --table-out T.json

Every variant is one jitted train step of the trainer (``make_train_step``, one micro-batch of ``--batch``
sequences of random tokens, one device). The steps (and their parameter inits) are compiled ahead of time in a
pool of ``--compile-workers`` threads, so compiles overlap; once all are compiled, each is timed alone on the
device (XLA's autotuner runs kernels on the device while compiling, which would disturb a timing beside it).
``compile_s`` is lowering + compile under that contention. Peak memory is XLA's account of the compiled step
(arguments + outputs + temporaries); a step whose account exceeds the device's memory is reported as ``oom``
without running it. ``--deadline S`` bounds the whole run: compiles unfinished when the timings must start are
reported as ``not_compiled``, variants not timed by then as ``not_timed``.

``--batch rule`` gives each variant the micro-batch a one-device run takes: the measured best of
``configs/microbatch_h200.json`` for its scale, arch and remat policy, fitted to this device's memory, then to a
divisor of the global batch (``hybrid_lm.train.microbatch.rule_for``). An arch the table has no entry for at
that scale (MoBA and SSA at S5) takes the smallest micro-batch the rule gives the scale's measured archs.

An arch name may end in ``+scan`` (the same stack under ``ModelConfig.scan_layers``) and in ``@REMAT``
(``full@dots_attn``: that variant's remat policy instead of ``--remat``). ``--sweep-microbatch`` times each
(scale, arch) at several micro-batches and writes the best that fits as the table ``hybrid_lm.train.microbatch``
reads (``--table-out``). MFU counts FLOPs per layer type (``hybrid_lm.model.accounting``) against 989 TF/s.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import load_config  # noqa: E402

from hybrid_lm.backends import recorded_backends  # noqa: E402
from hybrid_lm.model.accounting import count_params, flops_per_token  # noqa: E402
from hybrid_lm.train import microbatch  # noqa: E402
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds  # noqa: E402
from hybrid_lm.step import ModelFns, StateInit, make_train_step  # noqa: E402

BENCH = "train"
# the README's architectures: the scale preset's 1:1 full + SWA-128 hybrid (swa), all full attention, and the
# presets of configs/arch/ in the efficient slot (SSA: every layer)
ARCH = {"full": ["ModelConfig.layer_pattern = 'F'"], "swa": []}
ARCH.update({a: [f"include 'arch/{a}.gin'"] for a in ("sa", "sa_swa", "lightning", "mamba2", "gdn", "moba", "ssa")})
README_ARCHS = "full,swa,sa,sa_swa,lightning,mamba2,gdn,moba,ssa"
SCAN = "+scan"
# --quick: a tiny model (a CPU smoke run of the script)
QUICK = ["ModelConfig.vocab_size = 256", "ModelConfig.d_model = 64", "ModelConfig.n_heads = 2",
         "ModelConfig.n_kv_heads = 1", "ModelConfig.head_dim = 32", "ModelConfig.d_ff = 128",
         "ModelConfig.n_layers = 2", "ModelConfig.compute_dtype = 'float32'"]


def arch_bindings(arch: str) -> list[str]:
    """The gin bindings of ``arch`` (``name``, ``name+scan``, either with ``@REMAT``)."""
    arch, _, remat = arch.partition("@")
    base = arch.removesuffix(SCAN)
    if base not in ARCH:
        raise SystemExit(f"unknown arch {arch!r}: choose from {sorted(ARCH)}, optionally with {SCAN!r} or @REMAT")
    return (ARCH[base] + (["ModelConfig.scan_layers = True"] if arch.endswith(SCAN) else [])
            + ([f"ModelConfig.remat = '{remat}'"] if remat else []))


def make_config(scale: str, arch: str, seq_len: int, batch: int | None, remat: str | None, impl: str, extra=()):
    """The variant's config: ``batch`` sequences in one micro-batch (``None``: the preset's global batch and
    micro-batches, as a run takes them); ``remat`` None keeps the preset's policy."""
    bindings = arch_bindings(arch)
    gin_files = [f"scale/{scale}.gin"] + [b.split("'")[1] for b in bindings if b.startswith("include")]
    batching = [] if batch is None else [f"TrainConfig.global_batch = {batch}", "TrainConfig.microbatches = 1"]
    params = ([f"ModelConfig.remat = '{remat}'"] if remat else []) + [
        b for b in bindings if not b.startswith("include")] + [
        f"DataConfig.seq_len = {seq_len}", *batching, f"ModelConfig.attention_impl = '{impl}'", *extra]
    return load_config(gin_files, params)


def device_memory() -> int | None:
    return microbatch.device_memory_limit(jax.devices()[0])


def _rule(scale: str, arch: str, args) -> tuple[int | None, str]:
    """``(micro-batch, why)`` of the rule for the variant, or ``(None, its table key)`` without an entry."""
    limit = device_memory()
    key = (scale, arch, args.seq_len, args.remat, args.impl, tuple(args.gin_param), microbatch.TABLE, limit)
    if key not in _RULES:
        remat = arch.partition("@")[2] or args.remat
        cfg = make_config(scale, arch, args.seq_len, None, remat, args.impl, args.gin_param)
        if microbatch.measured_per_device(cfg) is None:
            _RULES[key] = None, f"{scale}/{microbatch.arch_name(cfg.model)}/{args.seq_len}"
        else:
            M, why = microbatch.rule_for(cfg, 1, memory_limit=limit)
            _RULES[key] = cfg.train.global_batch // M, why
    return _RULES[key]


_RULES: dict = {}  # the rule per variant, setting, table and memory limit (fitting builds an abstract model)


def rule_batch(scale: str, arch: str, args) -> int:
    """The micro-batch a one-device run of the variant's global batch takes (``--batch rule``): the table's
    measured best for ``(scale, arch)`` under the variant's remat policy, fitted to this device's memory limit,
    then to a divisor of the global batch (``train.microbatch.rule_for``), as a run's is. An arch without an
    entry takes the smallest the rule gives the measured archs of its scale."""
    batch, why = _rule(scale, arch, args)
    if batch is None:
        policy = arch.partition("@")[2]
        others = [b for a in ARCH if a != arch.partition("@")[0]
                  for b in [_rule(scale, a + (f"@{policy}" if policy else ""), args)[0]] if b is not None]
        if not others:
            raise SystemExit(f"--batch rule: {microbatch.TABLE.name} has no entry for {why} (arch {arch}); "
                             "give --batch N")
        batch, why = min(others), f"no entry for {why}: the smallest of the scale's measured archs"
    if "scaled from" in why or "no entry" in why:
        print(f"--batch rule: {scale} {arch}: {batch} sequences ({why})", flush=True)
    return batch


class Variant:
    """One (scale, arch, batch) train step: its config, compiled executable and measurements."""

    def __init__(self, scale, arch, batch, args):
        self.cfg = make_config(scale, arch, args.seq_len, batch, arch.partition("@")[2] or args.remat, args.impl,
                               args.gin_param)
        self.key = dict(scale=scale, arch=arch, batch=batch, seq_len=args.seq_len, remat=self.cfg.model.remat,
                        attention_impl=args.impl, gin_param=list(args.gin_param),
                        rule_arch=microbatch.arch_name(self.cfg.model))
        self.fns = ModelFns(self.cfg)
        self.build = optimizer_for_bounds(self.cfg.optim, self.fns.axes)
        self.bounds = np.asarray(wsd_bounds(self.cfg.optim, 1000), np.int32)
        self.init = StateInit(self.fns, self.build(self.bounds)[0])
        self.seed = jnp.asarray(0, jnp.uint32)

    def lower(self):
        """(lowered step, seconds, backends): tracing runs in the main thread, one variant at a time, so the
        record of backends is this variant's alone."""
        t0 = time.perf_counter()
        state = jax.eval_shape(self.init, self.seed)
        tokens = jax.ShapeDtypeStruct((self.key["batch"], self.key["seq_len"] + 1), jnp.int32)
        recorded_backends(clear=True)
        lowered = jax.jit(make_train_step(self.fns, self.build), donate_argnums=0).lower(state, tokens, self.bounds)
        return lowered, time.perf_counter() - t0, recorded_backends()

    def compile(self, lowered, lower_s):
        """(compiled step, lower + compile seconds, XLA's memory account in bytes). The parameter init is
        compiled here too (its seconds are ``init_compile_s``, not part of ``compile_s``)."""
        t0 = time.perf_counter()
        self.init.compile(self.seed)
        self.init_compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        return compiled, lower_s + time.perf_counter() - t0, harness.peak_bytes(compiled)

    def run(self, compiled, steps: int) -> dict:
        state = self.init(self.seed)
        tokens = jax.random.randint(jax.random.key(0), (self.key["batch"], self.key["seq_len"] + 1), 0,
                                    self.cfg.model.vocab_size)
        t0 = time.perf_counter()
        state, stats = compiled(state, tokens, self.bounds)  # warm-up
        jax.block_until_ready(stats["loss"])
        warmup_s = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, stats = compiled(state, tokens, self.bounds)
            jax.block_until_ready(stats["loss"])
            times.append(time.perf_counter() - t0)
        loss = float(stats["loss"])
        del state, stats
        ms = 1e3 * np.asarray(times)
        f = flops_per_token(self.cfg.model, self.key["seq_len"])["train"]
        return {"ms_per_step": float(np.median(ms)), "ms_min": float(ms.min()), "ms_max": float(ms.max()),
                "loss": loss, "warmup_s": warmup_s, "init_compile_s": getattr(self, "init_compile_s", None),
                "non_embedding": count_params(self.cfg.model)["non_embedding"], "train_flops_per_token": f,
                "tokens_per_step": self.key["batch"] * self.key["seq_len"]}


NONFINITE_LOSS = "nonfinite_loss"


def mark_nonfinite_loss(row: dict) -> dict:
    """A timed step whose loss is NaN or infinite is not a valid timing (NaN operands draw less power, so a
    power-limited GPU clocks higher and runs them faster). Such a row gets status ``nonfinite_loss``, so no
    table and no micro-batch rule takes its time."""
    loss = row.get("loss")
    if loss is not None and not math.isfinite(loss):
        row.update(status=NONFINITE_LOSS, error=f"loss {loss} after the timed steps: the step time is not valid "
                                                "(NaN/inf data runs faster than real data)")
    return row


def measure(variants: dict, args, t_start: float, on_row=None) -> tuple[dict, bool]:
    """Rows by key: every variant lowered (main thread) and compiled (pool), then each timed alone, in order
    (``on_row(rows)`` after each). With ``--deadline``, compiles get until the timings must start
    (``--time-reserve`` seconds per variant before the end) and a variant not timed by the end is ``not_timed``."""
    end = None if args.deadline is None else t_start + args.deadline
    compile_end = None if end is None else end - args.time_reserve * len(variants)
    limit = device_memory()
    lowered_at: dict = {}

    def jobs():
        for k, v in variants.items():
            if compile_end is not None and time.time() > compile_end:
                yield k, None  # not lowered: reported below
                continue
            try:
                lowered, lower_s, backends = v.lower()
            except Exception as e:  # noqa: BLE001 - a variant that cannot trace is reported as a compile error
                yield k, functools.partial(harness.reraise, e)
                continue
            lowered_at[k] = dict(lower_s=lower_s, attention_backends=backends)
            yield k, (lambda v=v, lowered=lowered, lower_s=lower_s: v.compile(lowered, lower_s))

    compiled, left_running = harness.compile_all(jobs(), args.compile_workers, compile_end)
    rows = {}
    for k, v in variants.items():
        c = compiled[k]
        row = dict(v.key, **lowered_at.get(k, {}))
        if c["status"] != "compiled":
            row.update(status=c["status"], error=c.get("error"))
        else:
            exe, row["compile_s"], row["peak_bytes"] = c["value"]
            if limit and row["peak_bytes"] and row["peak_bytes"] > limit:
                row.update(status="oom", error=f"XLA's account {row['peak_bytes'] / 2 ** 30:.1f} GiB exceeds the "
                                                f"device's {limit / 2 ** 30:.1f} GiB")
            elif end is not None and time.time() > end:
                row.update(status="not_timed", error="the deadline came before its turn")
            else:
                try:
                    row.update(v.run(exe, args.steps), status="ok")
                    tps = row["tokens_per_step"] / (row["ms_per_step"] / 1e3)
                    row.update(tokens_per_sec=tps,
                               mfu=tps * row["train_flops_per_token"] / (harness.PEAK_BF16_FLOPS * jax.device_count()))
                    mark_nonfinite_loss(row)
                except Exception as e:  # noqa: BLE001
                    row.update(status="oom" if harness.is_oom(e) else "run_error", error=harness.short_error(e))
            c["value"] = exe = None
        rows[k] = row
        report(row)
        if on_row:
            on_row(rows)
    return rows, left_running


def report(r):
    gib = (r.get("peak_bytes") or 0) / 2 ** 30
    head = f"{r['scale']:<7}{r['arch']:<12}{r['batch']:>4}"
    if r.get("status") == "ok":
        print(f"{head}{r['ms_per_step']:>10.1f}{r['tokens_per_sec'] / 1e3:>10.1f}{100 * r['mfu']:>7.1f}%{gib:>8.1f}"
              f"{r['compile_s']:>9.1f}  {r.get('attention_backends', '')}", flush=True)
    else:
        print(f"{head}  {r.get('status')}  peak {gib:.1f} GiB  {r.get('error') or ''}", flush=True)


def table_key(r) -> str:
    """``scale/arch/seq_len@remat`` of a row: the micro-batch table's key (``rule_arch``: the rule's name for
    the variant's architecture where the row has it, else the variant's label without its ``@REMAT``)."""
    key = f"{r['scale']}/{r.get('rule_arch') or r['arch'].partition('@')[0]}/{r['seq_len']}"
    return key + (f"@{r['remat']}" if r.get("remat") else "")


def best_microbatches(rows) -> dict:
    """Per (scale, arch, seq_len, remat): the micro-batch with the highest tokens/s among those that ran,
    ``tried``: every micro-batch that ran or was found not to fit, and ``variants``: the labels measured under
    that key (two labels of one architecture make the key ambiguous: :func:`write_table` leaves it out).
    ``+scan`` variants are not keyed (the rule keys on the architecture, not on how its stack is compiled)."""
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


def write_table(path: str, best: dict, command: str, device: str, remat: str,
                memory_limit: int | None = None) -> dict:
    """Merge ``best`` into the micro-batch table at ``path`` (entries of other keys are kept) and return the
    table written. Only sweeps enter it: a key with fewer than two micro-batches tried is left out, and so is a
    key measured by several variants. Keys measured under the table's remat policy (``remat`` for a new table)
    are written plain, others keep their ``@POLICY`` ending. Each written key's compiled peak goes to
    ``peak_gib`` and ``memory_limit`` (bytes, the measuring device's) to ``memory_limit_gib``: the rule fits an
    entry to a device with less memory from them."""
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


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--scale", default="s5", help="comma-separated scales (configs/scale/)")
    ap.add_argument("--arch", default=README_ARCHS, help=f"comma-separated, from {sorted(ARCH)}")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", default="rule", help="sequences per step, or 'rule' (see above)")
    ap.add_argument("--sweep-microbatch", default=None, metavar="B1,B2,...",
                    help="micro-batch sizes to try per (scale, arch); the best that fits is kept")
    ap.add_argument("--table-out", default=None, help="with --sweep-microbatch: the measured best table")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--remat", default=None, help="ModelConfig.remat (default: the preset's)")
    ap.add_argument("--impl", default="auto", help="ModelConfig.attention_impl")
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin binding (repeatable)")
    ap.add_argument("--anchor-batch", type=int, default=4,
                    help="sequences of the anchor GPT (0: no anchor); 4 x 16K fits an 80 GB H100, 8 does not")
    ap.add_argument("--compile-workers", type=int, default=10)
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start by which the run ends")
    ap.add_argument("--time-reserve", type=float, default=8.0,
                    help="with --deadline: seconds kept per variant for the timings after the compiles")
    args = ap.parse_args(argv)
    if args.quick:
        args.gin_param = QUICK + args.gin_param
        if args.seq_len == 16384:
            args.seq_len = 64
        if args.batch == "rule":
            args.batch = "1"
        args.steps, args.compile_workers = min(args.steps, 1), min(args.compile_workers, 2)
    if args.batch != "rule" and not args.batch.isdigit():
        raise SystemExit(f"--batch {args.batch!r}: give a number of sequences or 'rule'")
    if args.batch == "rule" and args.sweep_microbatch:
        raise SystemExit("--batch rule and --sweep-microbatch exclude each other: the sweep measures the rule")
    t_start = time.time()
    batches = [int(b) for b in args.sweep_microbatch.split(",")] if args.sweep_microbatch else [
        None if args.batch == "rule" else int(args.batch)]
    scales, archs = args.scale.split(","), args.arch.split(",")
    for a in archs:
        arch_bindings(a)
    keys = [(s, a, b) for s in scales for a in archs for b in batches]
    if args.batch == "rule":
        keys = [(s, a, rule_batch(s, a, args)) for s, a, _ in keys]
    limit = device_memory()
    print(f"device: {harness.device_kind()} x{jax.device_count()}   memory limit {(limit or 0) / 2 ** 30:.1f} GiB")
    print(f"{'scale':<7}{'arch':<12}{'B':>4}{'ms/step':>10}{'ktok/s':>10}{'MFU':>8}{'GiB':>8}{'compile':>9}")
    variants = {}
    if args.anchor_batch > 0:
        variants["anchor"] = (harness.AnchorGPT(args.seq_len, 2, layers=2, d=64, heads=4, vocab=256)
                              if args.quick else harness.AnchorGPT(args.seq_len, args.anchor_batch))
    variants.update({k: Variant(*k, args) for k in keys})
    def save(rows):  # after every timed variant: a run stopped by a timeout keeps what it measured
        done = dict(rows)
        harness.write_result(BENCH, args.out, argv, [r for k, r in done.items() if k != "anchor"],
                             anchor=done.get("anchor"), started=t_start, batch=args.batch,
                             peak_flops=harness.PEAK_BF16_FLOPS, memory_limit_bytes=limit)

    rows, left_running = measure(variants, args, t_start, save)
    anchor = rows.pop("anchor", None)
    rows = list(rows.values())
    if anchor and anchor.get("status") == "ok":
        for r in rows:
            if r.get("status") == "ok":
                r["mfu_vs_anchor"] = r["mfu"] / anchor["mfu"]
    best = best_microbatches(rows)
    path = harness.write_result(BENCH, args.out, argv, rows, anchor=anchor, started=t_start, batch=args.batch,
                                peak_flops=harness.PEAK_BF16_FLOPS, memory_limit_bytes=limit, best=best)
    print(f"wrote {path}")
    if args.sweep_microbatch:
        print("\nbest micro-batch (sequences per device):")
        for k, b in sorted(best.items()):
            print(f"  {k:<28} {b['batch']:>3}   {b['tokens_per_sec'] / 1e3:.1f} ktok/s   {100 * b['mfu']:.1f}% MFU")
        if args.table_out:
            try:
                write_table(args.table_out, best, harness.command(BENCH, argv), harness.device_kind(),
                            args.remat or (rows[0]["remat"] if rows else "none"), limit)
            except ValueError as err:
                raise SystemExit(f"--table-out: {err}") from None
    if left_running:
        harness.exit_now(0)
    return {"anchor": anchor, "rows": rows}


if __name__ == "__main__":
    main()
