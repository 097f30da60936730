"""``hybrid-lm claims ROOT [ROOT ...]``: the papers' claims tested on a study's runs (docs/RESULTS.md).

Given the root of a launched study (``configs/sweeps/study.toml``: arms named ``full``, ``full_rerun``,
``swa128``, ``swa512``, ``swa128_nope``, ``sa128``, ``sa_swa128``, ``moba``, ``ssa``, ``mamba2``,
``gdn``, ``lightning``), this

1. runs the evaluations each claim needs with the project's own eval suite (``eval/suite.py``: the
   rows ``hybrid-lm eval`` would record, in each run's ``eval.jsonl``), skipping those whose rows exist
   (same task, settings and checkpoint), so a rerun evaluates nothing twice and a finished study
   nothing at all; ``max_minutes`` stops starting new evaluations after that long (the next call
   continues);
2. reads every number from a results file row (``metrics.jsonl``, ``eval.jsonl``, ``provenance.json``)
   and records where it came from;
3. computes each claim's verdict under the rule of :func:`verdict_greater` / :func:`verdict_close`:
   the noise band of a metric is its spread (max - min) over the replicates of one config (``full`` seeds
   0 and 1 and ``full_rerun``; any arm with several seeds); a claim part is reproduced / not reproduced
   only beyond that band, else inconclusive;
4. writes ``ROOT/claims.json`` (every number with its source) and ``ROOT/claims.md`` (the tables that
   docs/RESULTS.md includes).

Several roots holding runs of the same study (the same job names: the same configs) are judged
together into ``--out``: an arm's number is the mean over the roots of its run of that config and seed,
and every run is a replicate in the bands.

A claim whose arms are missing (a smaller study, the tiny CPU version) is reported as not evaluated,
naming them. Settings scale with the trained length T (the study: T = 4096): the swap window
W = min(128, T // 8), RULER at T (and 2T, 4T for C4), LongPPL's short context K = T // 4 and step
W_L = T // 8 on documents of T + 1 tokens, losses at 2T and 4T.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.files import atomic_write_json, atomic_write_text

SCHEMA = "hybrid_lm.claims/1"
CLAIMS = ("C1", "C2", "C3", "C4", "C5", "C6")
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_EVALUATED = ("reproduced", "not reproduced",
                                                           "inconclusive at this scale", "not evaluated")
# arms of configs/sweeps/study.toml, in table order
ARMS = ("full", "full_rerun", "swa128", "swa512", "swa128_nope", "sa128", "sa_swa128", "moba", "ssa", "mamba2",
        "gdn", "lightning")
REFERENCE = "full"
MOBA_SSA = "full=moba:256,block_size=16,gate=ssa"  # SSA's sparse stream's pattern on the full model's layers
SSA_SPARSE = "full=ssa,eval_stream=sparse"


# ----------------------------------------------------------------------------- verdict rule

def verdict_greater(d: float | None, band: float | None) -> str:
    """A claim part that predicts ``d > 0``: reproduced when ``d > band``, not reproduced when
    ``d < -band``, else inconclusive; inconclusive without a measured band or value."""
    if d is None or band is None or not math.isfinite(d):
        return INCONCLUSIVE
    if d > band:
        return REPRODUCED
    if d < -band:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def verdict_close(d: float | None, band: float | None) -> str:
    """A claim part that predicts ``d`` about 0 ("close", "costs about nothing"): reproduced when
    ``|d| <= band``, not reproduced when ``|d| > band``; inconclusive without a measured band or value."""
    if d is None or band is None or not math.isfinite(d):
        return INCONCLUSIVE
    return REPRODUCED if abs(d) <= band else NOT_REPRODUCED


def combine(parts: list[str]) -> str:
    """A claim's verdict from its parts': not reproduced if any part is, reproduced if all are, else
    inconclusive (not evaluated if no part was)."""
    parts = [p for p in parts if p != NOT_EVALUATED]
    if not parts:
        return NOT_EVALUATED
    if NOT_REPRODUCED in parts:
        return NOT_REPRODUCED
    if all(p == REPRODUCED for p in parts):
        return REPRODUCED
    return INCONCLUSIVE


def spread(values) -> float | None:
    """max - min of the finite values; None for fewer than two."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    return max(v) - min(v) if len(v) >= 2 else None


# ----------------------------------------------------------------------------- runs

@dataclass
class Run:
    name: str
    arch: str
    seed: int
    dir: Path
    seq_len: int = 0
    steps: list = field(default_factory=list)
    study: str = ""  # the study root's label when several roots are judged together, else ""

    @property
    def group(self) -> str:
        """Replicates of one config share a group: ``full_rerun`` repeats ``full``."""
        return self.arch.removesuffix("_rerun")

    @property
    def key(self) -> str:
        """The run's name in claims.json: its job name, prefixed by its study's label when pooled."""
        return f"{self.study}/{self.name}" if self.study else self.name


def study_runs(root: Path, *, checkpoints: bool = True, study: str = "") -> list[Run]:
    """The finished runs of the study under ``root`` (``sweep.json`` jobs with ``sweep_done.json``).
    ``checkpoints=False`` (judging only): a run without its ``checkpoints/`` (a copy of the results files,
    e.g. ``docs/results/study``) takes its checkpoint steps from the rows of its ``eval.jsonl`` and its final
    step from ``sweep_done.json``."""
    from hybrid_lm.scaling.launch import DONE
    from hybrid_lm.scaling.sweep import read_manifest

    from hybrid_lm.run.directory import checkpoint_steps

    man = read_manifest(root)
    out = []
    for j in man["jobs"]:
        d = Path(root) / j["name"]
        if j["kind"] == "stable" or not (d / DONE).exists():
            continue
        cfg = json.loads((d / "config.json").read_text())
        if checkpoints or (d / "checkpoints").is_dir():
            steps = checkpoint_steps(d)  # the steps `eval --steps all` reads
        else:  # the steps evaluated, and the final one (a run never evaluated still has it)
            final = json.loads((d / DONE).read_text()).get("step")
            steps = sorted({r["checkpoint_step"] for r in _current_rows(d)
                            if isinstance(r.get("checkpoint_step"), int)} | ({final} if isinstance(final, int) else set()))
        out.append(Run(j["name"], j["arch"], j["seed"], d, cfg["data"]["seq_len"], steps, study))
    order = {a: i for i, a in enumerate(ARMS)}
    return sorted(out, key=lambda r: (order.get(r.arch, len(ARMS)), r.arch, r.seed, r.name))


# ----------------------------------------------------------------------------- settings and the eval plan

@dataclass
class Settings:
    """What the claims evaluate; defaults scale with the trained length T (module doc)."""

    window: int | None = None  # W of the C2 swaps; default min(128, T // 8)
    ruler_length: int | None = None  # default T; 0: no RULER (C2's protocol part, C4's RULER part, the table column)
    ruler_tasks: tuple | None = None  # default all seven
    ruler_samples: int = 8  # RULER-offline's default here (docs/EVAL.md)
    heads_samples: int | None = 100  # prompts per checkpoint (the task's default, 500, costs 5x the time)
    longppl_docs: int | None = None  # default the task's (50)
    beyond: tuple = (2, 4)  # C4: losses at these multiples of T
    claims: tuple = CLAIMS
    table: bool = True  # False: only the evaluations the selected claims need (not every arm's columns)
    mc_items: int = 200  # C2(c): items of the next_line task (eval/next_line.py)
    mc_context: int | None = None  # C2(c): its context in tokens; default T // 2; 0: no C2(c)

    def resolved(self, T: int) -> "Settings":
        w = self.window or min(128, max(2, T // 8))
        if w >= T:
            raise ConfigError(f"claims: the swap window {w} must be below the trained length {T} (W << T)")
        if self.mc_items < 1:
            raise ConfigError(f"claims: --mc-items {self.mc_items}: must be >= 1")
        if self.mc_context is not None and not 0 <= self.mc_context < T:
            raise ConfigError(f"claims: --mc-context {self.mc_context}: must be below the trained length {T} "
                              "(0: no C2(c))")
        return dataclasses.replace(self, window=w, ruler_length=T if self.ruler_length is None else self.ruler_length,
                                   mc_context=T // 2 if self.mc_context is None else self.mc_context)


@dataclass
class Evaluation:
    """One ``hybrid-lm eval`` request on one run, with the name the claims read it by."""

    key: str  # e.g. "c2/loss/sa"
    run: Run
    request: object  # suite.EvalRequest
    steps: str = "latest"

    def command(self) -> str:
        """The ``hybrid-lm eval`` command that records the same rows."""
        r = self.request
        parts = [f"hybrid-lm eval {self.run.dir} --tasks {','.join(r.tasks)}"]
        if self.steps != "latest":
            parts.append(f"--steps {self.steps}")
        parts += [f"--swap {s}" for s in r.swaps]
        for flag, v in (("--seq-len", r.seq_len), ("--samples", r.samples), ("--evaluator", r.evaluator),
                        ("--docs", r.longppl_docs)):
            if v is not None:
                parts.append(f"{flag} {v}")
        if "longppl" in r.tasks:
            parts.append(f"--trunc-len {r.trunc_len} --window {r.window}")
        if r.ruler_lengths:
            parts.append(f"--ruler-lengths {','.join(map(str, r.ruler_lengths))}")
        if r.ruler_tasks:
            parts.append(f"--ruler-tasks {','.join(r.ruler_tasks)}")
        if r.allow_longer:
            parts.append("--allow-longer")
        if "lm_eval" in r.tasks:
            parts.append(f"--lm-eval-include {r.lm_eval_include} --lm-eval-tasks {','.join(r.lm_eval_tasks)}")
        if r.swap_prefill_only:
            parts.append("--swap-prefill-only")
        if "ruler" in r.tasks and not r.ruler_generation:
            parts.append("--ruler-no-generation")
        return " ".join(parts)


def plan(runs: list[Run], st: Settings) -> list[Evaluation]:
    """Every evaluation the selected claims and then the table need, in the order they run."""
    from hybrid_lm.eval.suite import EvalRequest

    by_arch: dict[str, list[Run]] = {}
    for r in runs:
        by_arch.setdefault(r.arch, []).append(r)
    reference = evaluator_run(runs)
    fulls = [r for r in runs if r.group == REFERENCE]
    T = runs[0].seq_len
    W, L = st.window, st.ruler_length
    rt = tuple(st.ruler_tasks) if st.ruler_tasks else None
    out: list[Evaluation] = []

    def ruler(key, run, lengths, swaps=(), prefill=False):
        if L:
            out.append(Evaluation(key, run, EvalRequest(
                tasks=("ruler",), swaps=tuple(swaps), ruler_lengths=tuple(lengths), ruler_tasks=rt,
                samples=st.ruler_samples, allow_longer=any(n > run.seq_len for n in lengths),
                swap_prefill_only=prefill, ruler_generation=False, progress=False)))

    want = set(st.claims)

    def beyond(run):
        for k in st.beyond:
            out.append(Evaluation(f"loss@{k}T", run, EvalRequest(tasks=("loss",), seq_len=k * T, progress=False)))

    # the claims' own evaluations first (a call bounded by --max-minutes gets to the verdicts first) ...
    if "C2" in want:
        for run in fulls:
            for kind in ("sa", "swa"):
                out.append(Evaluation(f"c2/loss/{kind}", run, EvalRequest(
                    tasks=("loss",), swaps=(f"full={kind}:{W}",), progress=False)))
            for kind in ("sa", "swa"):
                ruler(f"c2/ruler/{kind}", run, (L,), (f"full={kind}:{W}",), prefill=True)
            if st.mc_context:  # the local multiple-choice task under the paper's protocol, and unswapped
                include = str(next_line_dir(run.dir.parent, st).resolve())
                for kind in ("sa", "swa"):
                    out.append(Evaluation(f"c2/mc/{kind}", run, EvalRequest(
                        tasks=("lm_eval",), swaps=(f"full={kind}:{W}",), swap_prefill_only=True,
                        lm_eval_tasks=(NEXT_LINE,), lm_eval_include=include, progress=False)))
                out.append(Evaluation("c2/mc/own", run, EvalRequest(
                    tasks=("lm_eval",), lm_eval_tasks=(NEXT_LINE,), lm_eval_include=include, progress=False)))
    if "C3" in want and by_arch.get("ssa"):
        for run in fulls:
            out.append(Evaluation("c3/full_sparse", run, EvalRequest(tasks=("loss",), swaps=(MOBA_SSA,), progress=False)))
        for run in by_arch["ssa"]:
            out.append(Evaluation("c3/ssa_sparse", run, EvalRequest(tasks=("loss",), swaps=(SSA_SPARSE,), progress=False)))
    c4_runs = fulls + by_arch.get("swa128", []) + by_arch.get("swa128_nope", []) if "C4" in want else []
    for run in c4_runs:
        beyond(run)
        for k in st.beyond:
            ruler(f"ruler@{k}L", run, (k * L,))
    if "C5" in want:
        for run in fulls + by_arch.get("swa128", []) + by_arch.get("swa512", []):
            out.append(Evaluation("heads", run, EvalRequest(tasks=("heads",), samples=st.heads_samples,
                                                            progress=False), steps="all"))
    # ... then the table's columns for every arm (C6 is LongPPL's column)
    for run in runs:
        if st.table and run not in c4_runs:
            beyond(run)
        if reference is not None and (st.table or "C6" in want):
            out.append(Evaluation("longppl", run, EvalRequest(
                tasks=("longppl",), evaluator=str(reference.dir.resolve()), trunc_len=max(1, T // 4),
                window=max(1, T // 8), longppl_docs=st.longppl_docs, progress=False)))
        if st.table:
            ruler("ruler@L", run, (L,))
    return out


NEXT_LINE = "next_line"


def next_line_dir(root: Path, st: Settings) -> Path:
    """C2(c)'s task folder, built by `claims` from the runs' store (``eval/next_line.py``) and named by its
    settings: lm-eval's rows name the folder, so other settings never read rows of these."""
    return Path(root) / f"{NEXT_LINE}_c{st.mc_context}_n{st.mc_items}"


def build_c2_task(root: Path, runs: list[Run], st: Settings) -> str | None:
    """Build (or find) C2(c)'s next_line task from the reference runs' val split; the reason when it
    cannot be built (the part is then not evaluated)."""
    from hybrid_lm.data.corpus import ensure_store
    from hybrid_lm.errors import DataError
    from hybrid_lm.eval.next_line import MAX_CHARS, ensure_next_line_task

    ref = next((r for r in runs if r.group == REFERENCE), None)
    if ref is None:
        return "no full run"
    d = json.loads((ref.dir / "config.json").read_text())["data"]
    T, C = ref.seq_len, st.mc_context
    try:
        ensure_next_line_task(ensure_store(d["source"], d.get("path"), d["tokenizer"]), d["tokenizer"],
                              next_line_dir(root, st), items=st.mc_items, context_tokens=C,
                              max_line_chars=MAX_CHARS, max_continuation_tokens=T - C)
    except (DataError, ConfigError, FileNotFoundError) as e:
        return " ".join(str(e).split())
    return None


def evaluator_run(runs: list[Run]) -> Run | None:
    """The LongPPL evaluator of every arm: the reference arm's first seed."""
    return next((r for r in runs if r.arch == REFERENCE), None)


# ----------------------------------------------------------------------------- running and reading rows

_ROWS: dict[tuple[str, int, int], list[dict]] = {}


def _current_rows(run_dir: Path) -> list[dict]:
    """``suite.current_rows`` of a run, parsed again only when its eval.jsonl changed (a claims call
    reads each run's rows for every evaluation, band and table cell)."""
    from hybrid_lm.eval.suite import current_rows

    path = Path(run_dir) / "eval.jsonl"
    try:
        st = path.stat()
    except OSError:
        return []
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _ROWS:
        _ROWS[key] = current_rows(run_dir)
    return _ROWS[key]


_PATH_SETTINGS = ("evaluator", "include_path")


def rows_for(ev: Evaluation) -> list[dict]:
    """The current ``eval.jsonl`` rows of ``ev``'s request (every task, each checkpoint it asks for)."""
    from hybrid_lm.eval.suite import eval_key, task_of

    keys = {t: eval_key(ev.request.config(t)) for t in ev.request.tasks}
    steps = ev.run.steps if ev.steps == "all" else ev.run.steps[-1:]
    rows = [r for r in _current_rows(ev.run.dir) if r.get("eval_key") == keys.get(task_of(r))
            and r.get("checkpoint_step") in steps]
    if rows:
        return rows
    # rows name the LongPPL evaluator and lm-eval's task folder by the paths they had: a study root moved or
    # copied (docs/results/study) still finds them by those folders' names, every other setting equal
    want = {t: json.loads(json.dumps(ev.request.config(t), default=str)) for t in ev.request.tasks}

    def same(k, a, b):
        return a == b or (k in _PATH_SETTINGS and isinstance(a, str) and isinstance(b, str)
                          and Path(a).name == Path(b).name)

    for r in _current_rows(ev.run.dir):
        conf, w = r.get("eval_config"), want.get(task_of(r))
        if isinstance(conf, dict) and w is not None and set(conf) == set(w) and r.get("checkpoint_step") in steps \
                and all(same(k, conf[k], w[k]) for k in w):
            rows.append(r)
    return rows


def is_done(ev: Evaluation) -> bool:
    """Rows exist for every checkpoint (and, for RULER, every length) the request asks for."""
    rows = rows_for(ev)
    steps = ev.run.steps if ev.steps == "all" else ev.run.steps[-1:]
    have = {(r.get("checkpoint_step"), r.get("length") if r.get("kind") == "ruler" else None) for r in rows}
    lengths = ev.request.ruler_lengths or (None,)
    return all((s, n) in have for s in steps for n in lengths)


def run_evaluations(evals: list[Evaluation], max_minutes: float | None = None, printer=print) -> dict:
    """Run the evaluations without rows, in order; stop starting new ones after ``max_minutes``. Returns
    ``{"done": n, "skipped": n, "left": n, "failed": {key@run: reason}}``."""
    from hybrid_lm.eval.suite import evaluate_run

    t0 = time.monotonic()
    stats = {"done": 0, "skipped": 0, "left": 0, "failed": {}}
    for i, ev in enumerate(evals):
        if is_done(ev):
            stats["skipped"] += 1
            continue
        if max_minutes is not None and time.monotonic() - t0 > max_minutes * 60:
            stats["left"] = sum(not is_done(e) for e in evals[i:])
            break
        printer(f"[{i + 1}/{len(evals)}] {ev.command()}")
        try:
            evaluate_run(ev.run.dir, ev.request, ev.steps, record=True, plots=False, printer=lambda *_: None)
            stats["done"] += 1
        except (ConfigError, WorkdirError, ValueError, FileNotFoundError) as e:  # recorded; the claim says why
            stats["failed"][f"{ev.key}@{ev.run.key}"] = " ".join(str(e).split())
            printer(f"  failed: {' '.join(str(e).split())}")
    return stats


# ----------------------------------------------------------------------------- numbers from files

def _src(run: Run, file: str, **what) -> dict:
    return {"run": run.key, "file": str(run.dir / file), **what}


def training_numbers(run: Run) -> dict:
    """Final val loss and bits/byte, median tokens/s and MFU over the train rows of the run's second
    half, and the device, each with its source (metrics.jsonl / provenance.json)."""
    from hybrid_lm.run.metrics import read_metrics

    rows = read_metrics(run.dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("loss"), (int, float))]
    train = [r for r in rows if r.get("kind") == "train" and isinstance(r.get("tokens_per_sec"), (int, float))]
    last = evals[-1] if evals else None
    half = [r for r in train if r["step"] > (train[-1]["step"] / 2 if train else 0)]
    med = (lambda key: statistics.median([r[key] for r in half if isinstance(r.get(key), (int, float))])
           if any(isinstance(r.get(key), (int, float)) for r in half) else None)
    try:
        prov = json.loads((run.dir / "provenance.json").read_text())
    except (OSError, ValueError):
        prov = {}
    return {
        "loss": last["loss"] if last else None, "bpb": last.get("bpb") if last else None,
        "loss_source": _src(run, "metrics.jsonl", kind="eval", step=last["step"]) if last else None,
        "tokens_per_sec": med("tokens_per_sec"), "mfu": med("mfu"),
        "speed_source": _src(run, "metrics.jsonl", kind="train", rule="median over steps > half the run",
                             rows=len(half)),
        "device": prov.get("device_kind") or (prov.get("devices") or [None])[0],
        "xla_flags": prov.get("xla_flags"),
    }


def number(evals: list[Evaluation], key: str, run: Run, field_: str = "loss", length: int | None = None,
           step: int | None = None, mean_over_tasks: bool = False) -> tuple[float | None, dict | None]:
    """``(value, source)`` of ``field_`` in the rows of the evaluation ``key`` on ``run`` (RULER: the mean
    over its tasks at ``length``); ``(None, None)`` when it was not evaluated."""
    ev = next((e for e in evals if e.key == key and e.run is run), None)
    if ev is None:
        return None, None
    rows = [r for r in rows_for(ev) if (length is None or r.get("length") == length)
            and (step is None or r.get("checkpoint_step") == step)]
    vals = [r.get(field_) for r in rows if isinstance(r.get(field_), (int, float))]
    if not vals:
        return None, None
    value = statistics.fmean(vals) if mean_over_tasks else vals[-1]
    src = _src(run, "eval.jsonl", eval_key=rows[0]["eval_key"], task=rows[0]["task"] if len(rows) == 1 else
               sorted({r["task"] for r in rows}), checkpoint_step=rows[0]["checkpoint_step"], field=field_,
               **({"length": length} if length else {}), **({"mean_over": len(vals)} if mean_over_tasks else {}))
    return value, src


# ----------------------------------------------------------------------------- claims

def sub(x, y):
    """x - y, or None when either is unknown."""
    return x - y if x is not None and y is not None else None


def _band(by_group: dict[str, list[float | None]]) -> float | None:
    """The noise band of a metric: the largest spread over the groups that have two or more values."""
    spreads = [s for s in (spread(v) for v in by_group.values()) if s is not None]
    return max(spreads) if spreads else None


def _part(name: str, statement: str, d, band, rule: str, numbers: dict, missing=(), note: str = "") -> dict:
    if missing:
        return {"part": name, "statement": statement, "verdict": NOT_EVALUATED,
                "why": f"not evaluated: {', '.join(missing)} missing", "numbers": numbers}
    if d is None:  # its evaluations have no rows (not run yet, or judged with --no-eval where they never ran)
        return {"part": name, "statement": statement, "verdict": NOT_EVALUATED,
                "why": "not evaluated: its evaluations are not recorded", "numbers": numbers}
    v = (verdict_greater if rule == "greater" else verdict_close)(d, band)
    why = ("no noise band: fewer than two replicates of one config" if band is None else
           f"d = {d:+.4f}, band {band:.4f} ({'d > band' if rule == 'greater' else '|d| <= band'} to reproduce)")
    return {"part": name, "statement": statement, "verdict": v, "d": d, "band": band, "rule": rule,
            "why": why + (f"; {note}" if note else ""), "numbers": numbers}


def evaluate_claims(roots: list[Path], runs: list[Run], evals: list[Evaluation], st: Settings,
                    no_task: str | None = None) -> dict:
    """Every claim's parts, verdicts, numbers and sources, plus the table and the noise (claims.json).

    ``runs`` may come from several study roots (``Run.study`` tells them apart): an arm's value is then
    the mean over the roots of its cell (the arm's first seed, one run per root), and each of its runs is
    a replicate of its group in the bands."""
    by_arch: dict[str, list[Run]] = {}
    for r in runs:
        by_arch.setdefault(r.arch, []).append(r)
    train = {r.key: training_numbers(r) for r in runs}
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    L, T = st.ruler_length, runs[0].seq_len
    evaluators = [evaluator_run([r for r in runs if r.study == s]) for s in dict.fromkeys(r.study for r in runs)]

    def band_of(fn) -> float | None:
        return _band({g: [fn(r) for r in rs] for g, rs in groups.items()})

    def loss(r):
        return train[r.key]["loss"]

    def first(arch) -> list[Run] | None:
        """The arm's cell: its first seed's run in each study root (one run when judging one root)."""
        rs = by_arch.get(arch)
        return [r for r in rs if r.seed == rs[0].seed] if rs else None

    def of(cell, fn):
        """``fn`` of a cell: the mean over its runs; None if any of them lacks the number."""
        if not cell:
            return None
        vals = [fn(r) for r in cell]
        return None if any(v is None for v in vals) else statistics.fmean(vals)

    used: dict[str, dict] = {}  # every evaluated number a claim reads -> its eval.jsonl row(s)

    def val(key, r, **kw):
        if r is None:
            return None
        value, src = number(evals, key, r, **kw)
        if src is not None:
            used[f"{key}@{r.key}" + (f"@{kw['length']}" if kw.get("length") else "")] = src
        return value

    def mean_group(arch, fn):
        vals = [fn(r) for r in runs if r.group == arch]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    def coverage(arch, fn) -> str:
        """A note when only some of the group's runs have the number (the mean is over those)."""
        rs = [r for r in runs if r.group == arch]
        have = sum(fn(r) is not None for r in rs)
        return f"mean over the {have} of {len(rs)} {arch} runs evaluated" if 0 < have < len(rs) else ""

    def need(*arms):
        return [a for a in arms if a not in by_arch]

    band_loss = band_of(loss)
    noise = {"loss": {"band": band_loss, "groups": {g: {r.key: loss(r) for r in rs} for g, rs in groups.items()
                                                  if len(rs) > 1}}}
    claims = {}
    want = set(st.claims)

    if "C1" in want:
        sa, swa, gated, full = (first(a) for a in ("sa128", "swa128", "sa_swa128", "full"))
        nums = {a: of(c, loss) for a, c in (("sa128", sa), ("swa128", swa), ("sa_swa128", gated), ("full", full))}
        parts = [
            _part("a", "pure SA-128 costs perplexity against SWA-128 (val loss)",
                  sub(of(sa, loss), of(swa, loss)), band_loss, "greater", nums,
                  need("sa128", "swa128")),
            _part("b", "gated SA+SWA-128 recovers it: below pure SA-128",
                  sub(of(sa, loss), of(gated, loss)), band_loss, "greater", nums,
                  need("sa128", "sa_swa128")),
            _part("c", "gated SA+SWA-128 matches full attention (val loss, the difference within the band)",
                  sub(of(gated, loss), of(full, loss)), band_loss, "close", nums,
                  need("sa_swa128", "full")),
        ]
        claims["C1"] = {"title": "SA, pretraining: pure SA costs perplexity; gated SA+SWA recovers it",
                        "parts": parts}

    if "C2" in want:
        fulls = [r for r in runs if r.group == REFERENCE]
        W = st.window

        def d_loss(r):
            return sub(val("c2/loss/swa", r), val("c2/loss/sa", r))

        def d_ruler(r):
            a = val("c2/ruler/swa", r, field_="answer_nll", length=L, mean_over_tasks=True)
            b = val("c2/ruler/sa", r, field_="answer_nll", length=L, mean_over_tasks=True)
            return sub(a, b)

        def d_mc(r):
            return sub(val("c2/mc/sa", r, field_="score"), val("c2/mc/swa", r, field_="score"))

        def _mc_part():
            statement = (f"the paper's protocol on a local multiple-choice task (next_line: {st.mc_items} items, "
                         f"contexts of {st.mc_context} tokens prefilled with SA-{W} or SWA-{W}, each choice scored by "
                         "full attention over the cache, through lm-eval); d = acc_norm(SA) - acc_norm(SWA)")
            if not st.mc_context or no_task:
                return {"part": "c", "statement": statement, "verdict": NOT_EVALUATED,
                        "why": f"not evaluated: {no_task or '--mc-context 0'}", "numbers": {}}
            mc = {r.key: {"acc_norm_sa_prefill": val("c2/mc/sa", r, field_="score"),
                           "acc_norm_swa_prefill": val("c2/mc/swa", r, field_="score"),
                           "acc_norm_own": val("c2/mc/own", r, field_="score")} for r in fulls}
            return _part("c", statement, mean_group(REFERENCE, d_mc), _band({REFERENCE: [d_mc(r) for r in fulls]}),
                         "greater", mc, miss, coverage(REFERENCE, d_mc))

        nums = {r.key: {"loss_swa": val("c2/loss/swa", r), "loss_sa": val("c2/loss/sa", r), "loss": loss(r),
                         "ruler_nll_swa_prefill": val("c2/ruler/swa", r, field_="answer_nll", length=L,
                                                      mean_over_tasks=True),
                         "ruler_nll_sa_prefill": val("c2/ruler/sa", r, field_="answer_nll", length=L,
                                                     mean_over_tasks=True)} for r in fulls}
        miss = need("full")
        parts = [
            _part("a", f"teacher forcing: full=sa:{W} loses less than full=swa:{W} on the full model (val loss; "
                       f"d = loss(SWA) - loss(SA), mean over the full replicates)",
                  mean_group(REFERENCE, d_loss), _band({REFERENCE: [d_loss(r) for r in fulls]}), "greater", nums, miss,
                  coverage(REFERENCE, d_loss)),
            _part("b", f"the paper's protocol: the RULER prompt prefilled with SA-{W} (or SWA-{W}), the answer scored "
                       f"by full attention over its cache; d = answer NLL(SWA) - answer NLL(SA), mean over tasks at "
                       f"{L} tokens", mean_group(REFERENCE, d_ruler),
                  _band({REFERENCE: [d_ruler(r) for r in fulls]}), "greater", nums,
                  miss or (["RULER (--ruler-length 0)"] if not L else []), coverage(REFERENCE, d_ruler)),
            _mc_part(),
        ]
        claims["C2"] = {"title": f"SA, training-free: on the full model SA-{W} in place of full attention loses less "
                                 f"than SWA-{W} (W << T = {T})", "parts": parts}

    if "C3" in want:
        fulls = [r for r in runs if r.group == REFERENCE]
        ssa = first("ssa")

        def deg_full(r):
            return sub(val("c3/full_sparse", r), loss(r))

        def deg_ssa(r):
            return sub(val("c3/ssa_sparse", r), loss(r))

        def deg(r):  # the degradation of either arm's runs: its band is their spread, not the loss's
            return deg_full(r) if r.group == REFERENCE else deg_ssa(r) if r.arch == "ssa" else None

        full_deg, ssa_deg = mean_group(REFERENCE, deg_full), of(ssa, deg_ssa)
        nums = {"full_sparse_minus_full": {r.key: deg_full(r) for r in fulls},
                "ssa_sparse_minus_ssa_full": {r.key: deg_ssa(r) for r in ssa or []},
                "ssa_full": of(ssa, loss), "full": of(first("full"), loss),
                "sparse_swap_of_full": MOBA_SSA, "ssa_sparse_swap": SSA_SPARSE}
        parts = [
            _part("a", "the full model evaluated block-sparse (MoBA, SSA's block 16 / top-16) loses more than the SSA "
                       "model evaluated sparse (d = degradation(full) - degradation(SSA), val loss)",
                  sub(full_deg, ssa_deg), band_of(deg), "greater", nums, need("full", "ssa"),
                  coverage(REFERENCE, deg_full)),
            _part("b", "the SSA model evaluated with full attention is close to the full model (val loss)",
                  sub(of(ssa, loss), of(first("full"), loss)), band_loss, "close", nums, need("full", "ssa")),
        ]
        claims["C3"] = {"title": "SSA: sparse evaluation hurts the full model more than the SSA model; SSA evaluated "
                                 "full is close to full", "parts": parts}

    if "C4" in want:
        swa, nope = first("swa128"), first("swa128_nope")
        miss = need("swa128", "swa128_nope")
        parts = [_part("a", f"NoPE costs about nothing at the training length T = {T} (val loss)",
                       sub(of(nope, loss), of(swa, loss)), band_loss, "close",
                       {"swa128": of(swa, loss), "swa128_nope": of(nope, loss)}, miss)]
        for k in st.beyond:
            f = (lambda r, k=k: val(f"loss@{k}T", r))
            parts.append(_part(f"loss@{k}T", f"NoPE helps at {k}T = {k * T} tokens (val loss; d = SWA-128 - NoPE)",
                               sub(of(swa, f), of(nope, f)), band_of(f), "greater",
                               {"swa128": of(swa, f), "swa128_nope": of(nope, f)}, miss))
            if L:
                g = (lambda r, k=k: val(f"ruler@{k}L", r, field_="answer_nll", length=k * L, mean_over_tasks=True))
                parts.append(_part(f"ruler@{k}L", f"NoPE helps RULER at {k * L} tokens (answer NLL, mean over tasks; "
                                                  "d = SWA-128 - NoPE)",
                                   sub(of(swa, g), of(nope, g)), band_of(g), "greater",
                                   {"swa128": of(swa, g), "swa128_nope": of(nope, g)}, miss))
        claims["C4"] = {"title": "Rethinking: NoPE on the full layers of the SWA-128 hybrid costs about nothing at the "
                                 "training length and helps beyond it", "parts": parts}

    if "C5" in want:
        def masses(r):
            ev = next((e for e in evals if e.key == "heads" and e.run is r), None)
            rows = rows_for(ev) if ev else []
            return {row["checkpoint_step"]: row.get("top_head_mass") for row in rows}

        def formation(r):
            m = {s: v for s, v in masses(r).items() if isinstance(v, (int, float))}
            if not m:
                return None
            top = max(m.values())
            return min(s for s, v in m.items() if v >= top / 2)

        s128, s512 = first("swa128"), first("swa512")
        nums = {r.key: {"top_head_mass": masses(r), "formation_step": formation(r)}
                for r in runs if r.arch in ("swa128", "swa512") or r.group == REFERENCE}
        f128, f512 = of(s128, formation), of(s512, formation)
        claims["C5"] = {"title": "retrieval heads form later with SWA-512 than with SWA-128 (large-window laziness)",
                        "parts": [_part("a", "formation step (first checkpoint whose top retrieval score reaches half "
                                             "the run's largest) of SWA-512 minus SWA-128, in steps",
                                        sub(f512, f128),
                                        band_of(lambda r: formation(r) if r.group == REFERENCE else None),
                                        "greater", nums, need("swa128", "swa512"))]}

    if "C6" in want:
        lp = {r.key: number(evals, "longppl", r, field_="longppl") for r in runs}
        claims["C6"] = {"title": "LongPPL of each arm, the full model (seed 0) as evaluator",
                        "parts": [{"part": "a", "statement": "reported, no direction claimed", "verdict": "reported",
                                   "band": band_of(lambda r: lp[r.key][0] if r not in evaluators else None),
                                   "numbers": {k: v[0] for k, v in lp.items()},
                                   "sources": {k: v[1] for k, v in lp.items()}}]}
    for c in claims.values():
        c["verdict"] = combine([p["verdict"] for p in c["parts"]]) if c["parts"][0]["verdict"] != "reported" \
            else "reported"

    table = []
    for r in runs:
        t = train[r.key]
        row = {"run": r.key, "study": r.study, "arch": r.arch, "seed": r.seed, **{k: t[k] for k in ("loss", "bpb", "tokens_per_sec",
                                                                                   "mfu", "device")}}
        row["longppl"] = number(evals, "longppl", r, field_="longppl")[0]
        row[f"ruler_nll@{L}"] = (number(evals, "ruler@L", r, field_="answer_nll", length=L, mean_over_tasks=True)[0]
                                 if L else None)
        for k in st.beyond:
            row[f"loss@{k * T}"] = number(evals, f"loss@{k}T", r)[0]
        row["sources"] = {"training": {k: t[k] for k in ("loss_source", "speed_source")},
                          "evals": {e.key: rows_for(e)[0]["eval_key"] for e in evals if e.run is r and rows_for(e)}}
        table.append(row)
    noise.update({"bands": {"loss": band_loss}})
    cells = []  # each arm and seed over the study roots: the mean val loss and its range
    for arch, seed in dict.fromkeys((r.arch, r.seed) for r in runs):
        rs = [r for r in runs if (r.arch, r.seed) == (arch, seed)]
        v = [loss(r) for r in rs if loss(r) is not None]
        cells.append({"arch": arch, "seed": seed, "runs": [r.key for r in rs],
                      "loss_mean": statistics.fmean(v) if v else None, "loss_min": min(v, default=None),
                      "loss_max": max(v, default=None)})
    return {"schema": SCHEMA, "root": " ".join(map(str, roots)), "roots": [str(r) for r in roots], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": dataclasses.asdict(st), "seq_len": T, "runs": [r.key for r in runs], "table": table, "cells": cells,
            "noise": noise, "claims": claims, "number_sources": used,
            "evaluations": [{"key": e.key, "run": e.run.key, "command": e.command(), "done": is_done(e)}
                            for e in evals],
            "rule": RULE}


RULE = ("Noise band of a metric: its largest spread (max - min) over the replicates of one config (full seeds 0 "
        "and 1, full_rerun = seed 0 again; any arm with several seeds). A claim part predicting d > 0 is reproduced "
        "when d > band, not reproduced when d < -band, else inconclusive at this scale; a part predicting d about 0 "
        "is reproduced when |d| <= band, else not reproduced. Without two replicates there is no band and every part "
        "is inconclusive. A claim is not reproduced if any part is, reproduced if all parts are, else inconclusive. "
        "Judged over several runs of the study (several roots), an arm's number is the mean over the roots of its "
        "run of that config and seed, and every run counts as a replicate in the bands.")


# ----------------------------------------------------------------------------- markdown

def _f(x, fmt="{:.4f}") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def format_markdown(doc: dict) -> str:
    """claims.md: the table, the noise and every claim's verdict with its numbers (judged over several
    study roots: a study column, and each arm's mean and range over them)."""
    T = doc["seq_len"]
    st = doc["settings"]
    L = st["ruler_length"]
    roots = doc.get("roots") or [doc["root"]]
    pooled = len(roots) > 1
    out = doc.get("out") or roots[0]
    command = f"hybrid-lm claims {' '.join(roots)}" + (f" --out {out}" if pooled or out != roots[0] else "")
    lines = [f"Generated by `{command}` ({doc['created']}); every number below comes from "
             f"`{out}/claims.json`, which names the results file row it was read from.", ""]
    beyond = [f"loss@{k * T}" for k in st["beyond"]]
    head = ["arch", "seed", "val loss", "bits/byte", "tokens/s", "MFU", "device", "LongPPL",
            f"RULER answer NLL @{L}", *[f"val loss @{k * T}" for k in st["beyond"]]]
    head = ["study", *head] if pooled else head
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["table"]:
        cells = [r["arch"], str(r["seed"]), _f(r["loss"]), _f(r["bpb"]), _f(r["tokens_per_sec"], "{:,.0f}"),
                 _f(r["mfu"] * 100 if r["mfu"] is not None else None, "{:.1f}%"), str(r["device"] or "—"),
                 _f(r["longppl"], "{:.3f}"), _f(r.get(f"ruler_nll@{L}")), *[_f(r[b]) for b in beyond]]
        cells = [r.get("study") or "", *cells] if pooled else cells
        lines.append("| " + " | ".join(cells) + " |")
    if pooled:
        lines += ["", f"Each arm over the {len(roots)} studies (a claim reads an arm's mean):", "",
                  "| arch | seed | runs | mean val loss | min | max | range |", "|---|---|---|---|---|---|---|"]
        for c in doc["cells"]:
            rng = c["loss_max"] - c["loss_min"] if c["loss_min"] is not None else None
            lines.append(f"| {c['arch']} | {c['seed']} | {len(c['runs'])} | {_f(c['loss_mean'])} | {_f(c['loss_min'])} "
                         f"| {_f(c['loss_max'])} | {_f(rng)} |")
    lines += ["", f"Noise band of the val loss: {_f(doc['noise']['bands']['loss'])} nats "
                  f"(spread over the replicates of one config)."]
    for g, vals in doc["noise"]["loss"]["groups"].items():
        lines.append(f"- {g}: " + ", ".join(f"{k} {_f(v)}" for k, v in vals.items()))
    lines += ["", "| claim | verdict | part | d | band | verdict of the part |", "|---|---|---|---|---|---|"]
    for name, c in doc["claims"].items():
        for i, p in enumerate(c["parts"]):
            statement = p["statement"].replace("|", "\\|")  # a cell's own bar would end it
            lines.append(f"| {name if i == 0 else ''} | {c['verdict'] if i == 0 else ''} | {p['part']}: "
                         f"{statement} | {_f(p.get('d'))} | {_f(p.get('band'))} | {p['verdict']} |")
    notes = [f"{name}{p['part']}: {p['why'].split('; ', 1)[1]}" for name, c in doc["claims"].items()
             for p in c["parts"] if "; " in (p.get("why") or "")]
    if notes:
        lines += ["", "Partly evaluated: " + "; ".join(notes) + "."]
    lines += ["", "Verdict rule: " + doc["rule"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the overview figure

def plot_overview(doc: dict, runs: list[Run], out_png: Path) -> Path:
    """``plots/study_loss.png``: every run's training loss (nats, the mean over each 1/40 of the run)
    against tokens seen, and each arm's final val loss as a bar with the reference arm's replicates'
    range (the noise band) shaded: where the arms stand and how far apart they must be to count. Judged
    over several study roots, an arm's curves share its colour (one line style per study) and its bar
    is the mean over the studies with their range as a whisker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from hybrid_lm.run.metrics import read_metrics

    colors = plt.get_cmap("tab20").colors  # 20 distinct colours: the study has 13 arms and seeds
    styles = ("-", "--", ":", "-.")
    studies = list(dict.fromkeys(r.study for r in runs))
    cells = list(dict.fromkeys((r.arch, r.seed) for r in runs))
    loss = {t["run"]: t["loss"] for t in doc["table"]}

    def label(cell):
        return cell[0] + (f" seed {cell[1]}" if cell[1] else "")

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    low, high = [], []
    for r in runs:
        i, k = cells.index((r.arch, r.seed)), studies.index(r.study)
        rows = [row for row in read_metrics(r.dir / "metrics.jsonl", "train") if "tokens" in row]
        x = np.array([row["tokens"] for row in rows], float) / 1e6
        y = np.array([row.get("loss") if row.get("loss") is not None else np.nan for row in rows], float)
        if len(x):  # the mean per 1/40 of the run: runs that log every step and every 26 look alike
            edges = np.linspace(0, x.max(), 41)
            which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, 39)
            keep = [b for b in range(40) if (which == b).any()]
            x = np.array([x[which == b].mean() for b in keep])
            y = np.array([np.nanmean(y[which == b]) for b in keep])
        ax.plot(x, y, lw=1.1, color=colors[i % 20], ls=styles[(k + i // 20) % len(styles)],
                label=label((r.arch, r.seed)) if k == 0 else None)
        finite = y[np.isfinite(y)]
        if len(finite):
            low.append(float(finite.min()))
            high.append(float(finite[len(finite) // 3]))  # a third of the way in: the early descent stays off the scale
    if len(studies) > 1:
        for k, name in enumerate(studies):
            ax.plot([], [], color="gray", ls=styles[k % len(styles)], label=name)
    if low:
        ax.set_ylim(min(low) - 0.05, max(high))
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("train loss (nats/token, mean over 1/40 of the run)")
    ax.set_title("training", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    shown = []  # (label, mean, min, max, colour) of each arm with a final val loss
    for i, cell in enumerate(cells):
        v = [loss[r.key] for r in runs if (r.arch, r.seed) == cell and loss.get(r.key) is not None]
        if v:
            shown.append((label(cell), float(np.mean(v)), min(v), max(v), colors[i % 20]))
    ys = np.arange(len(shown))[::-1]
    bx.barh(ys, [m for _, m, _, _, _ in shown], color=[c for *_, c in shown])
    if len(studies) > 1:
        bx.errorbar([m for _, m, _, _, _ in shown], ys, fmt="none", ecolor="black", elinewidth=1, capsize=2,
                    xerr=np.array([[m - lo, hi - m] for _, m, lo, hi, _ in shown]).T)
    for yy, (_, m, _, hi, _) in zip(ys, shown):
        bx.text(hi, yy, f" {m:.3f}", va="center", fontsize=7)
    bx.set_yticks(ys, [lab for lab, *_ in shown], fontsize=8)
    ref = [t["loss"] for t in doc["table"] if t["arch"].removesuffix("_rerun") == REFERENCE and t["loss"] is not None]
    band = doc["noise"]["bands"].get("loss")
    if len(ref) > 1 and band:  # the band is the widest spread of any config: the reference's, or another's
        width = max(ref) - min(ref)
        bx.axvspan(min(ref), max(ref), color="gray", alpha=0.2,
                   label=f"range of the {len(ref)} {REFERENCE} replicates, {width:.3f}"
                         + (": the noise band" if math.isclose(width, band) else f" (the noise band: {band:.3f})"))
        bx.legend(fontsize=7, loc="best")
    if shown:
        bx.set_xlim(min(lo for _, _, lo, _, _ in shown) - 0.1, max(hi for _, _, _, hi, _ in shown) + 0.12)
    bx.set_xlabel(f"val loss at T = {doc['seq_len']} (nats/token, lower is better)")
    bx.set_title("final val loss" + (f": mean over {len(studies)} studies, whisker: their range"
                                     if len(studies) > 1 else ""), fontsize=10)
    bx.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


# ----------------------------------------------------------------------------- the command

def study_labels(roots: list[Path]) -> list[str]:
    """Each root's label in a pooled claims.json: its directory name, or its path where two names clash."""
    names = [Path(r).name or str(r) for r in roots]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, roots)]


def pooled_runs(roots: list[Path], *, checkpoints: bool) -> list[list[Run]]:
    """The finished runs of each root, labelled by root when there are several. Roots pooled together must
    be replicates of one study: an arm and seed present in two roots has the same job name there (the name
    carries the run's config hash), and every run was trained at one length."""
    labels = study_labels(roots) if len(roots) > 1 else [""]
    per_root, names = [], {}
    for root, label in zip(roots, labels):
        if not (root / "sweep.json").exists():
            raise WorkdirError(f"{root} holds no sweep.json: launch the study first (hybrid-lm sweep "
                               "configs/sweeps/study.toml --launch local)")
        got = study_runs(root, checkpoints=checkpoints, study=label)
        if not got:
            raise WorkdirError(f"{root}: no finished run yet (sweep_done.json): finish the sweep first")
        for r in got:
            other = names.setdefault((r.arch, r.seed), (r.name, root))
            if other[0] != r.name:
                raise ConfigError(f"{root} and {other[1]} are not replicates of one study: {r.arch} seed {r.seed} is "
                                  f"{r.name} in one and {other[0]} in the other (another config)")
        per_root.append(got)
    lengths = {r.seq_len for rs in per_root for r in rs}
    if len(lengths) > 1:
        where = " and ".join(map(str, roots))
        raise ConfigError(f"{where}: runs trained at several lengths {sorted(lengths)}; the claims compare one T")
    return per_root


def run_claims(roots, settings: Settings | None = None, *, evaluate: bool = True, max_minutes: float | None = None,
               out: str | Path | None = None, printer=print) -> dict:
    """The whole command: plan, evaluate (unless ``evaluate=False``), judge, write claims.json / claims.md
    and plots/study_loss.png to ``out`` (default: the root). ``roots``: one study root, or several runs of
    the same study to judge together (``out`` then required)."""
    roots = [Path(r) for r in ([roots] if isinstance(roots, (str, Path)) else roots)]
    if not roots:
        raise ConfigError("claims: give a study root")
    if len(set(map(str, (r.resolve() for r in roots)))) < len(roots):
        raise ConfigError(f"claims: a study root is given twice ({' '.join(map(str, roots))})")
    if len(roots) > 1 and out is None:
        raise ConfigError("claims: several study roots need --out DIR for the pooled claims.json and claims.md")
    out = Path(out) if out is not None else roots[0]
    if max_minutes is not None and not max_minutes > 0:
        raise ConfigError(f"--max-minutes {max_minutes:g}: must be > 0")
    per_root = pooled_runs(roots, checkpoints=evaluate)
    runs = [r for rs in per_root for r in rs]
    st = (settings or Settings()).resolved(runs[0].seq_len)
    bad = [c for c in st.claims if c not in CLAIMS]
    if bad:
        raise ConfigError(f"--claims {','.join(st.claims)}: unknown {', '.join(bad)}; choose from {','.join(CLAIMS)}")
    evals, no_task = [], None
    for root, mine in zip(roots, per_root):  # each root's evaluations: its own LongPPL evaluator and next_line task
        ev = plan(mine, st)
        if evaluate and any(e.key.startswith("c2/mc/") for e in ev):
            # without evaluating, C2(c)'s rows are found as recorded (the task folder by name): nothing to build
            why = build_c2_task(root, mine, st)
            if why:
                printer(f"C2(c): no next_line task in {root}: {why}")
                no_task = no_task or why
                ev = [e for e in ev if not e.key.startswith("c2/mc/")]
        evals += ev
    if no_task:  # C2(c) pooled over the roots only where every root has its task
        evals = [e for e in evals if not e.key.startswith("c2/mc/")]
    if evaluate:
        stats = run_evaluations(evals, max_minutes, printer)
    else:  # judged from the rows there are; what was never evaluated is left, not complete
        left = sum(not is_done(e) for e in evals)
        stats = {"done": 0, "skipped": len(evals) - left, "left": left, "failed": {}}
    doc = evaluate_claims(roots, runs, evals, st, no_task=no_task)
    doc["out"] = str(out)
    doc["evaluation_stats"] = stats
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "claims.json", doc, indent=1, default=str)
    atomic_write_text(out / "claims.md", format_markdown(doc))
    try:
        plot_overview(doc, runs, out / "plots" / "study_loss.png")
    except (OSError, ValueError) as e:  # the verdicts are written; a figure that fails says so
        printer(f"plots/study_loss.png not drawn: {' '.join(str(e).split())}")
    return doc
