"""``hybrid-lm eval RUN_DIR --tasks ... --steps ...``: every evaluation task over a run's checkpoints.

One entry point for the tasks of ``docs/EVAL.md``. Each task is a function of a restored checkpoint
(:class:`~hybrid_lm.run.restore.RestoredRun`) and the config it runs (the run's, or the run's with
``--swap`` / ``--horizon`` applied by :meth:`RestoredRun.task_config`), and returns rows:

=========== ============================================== =====================================
task        what                                           module
=========== ============================================== =====================================
loss        val loss and bits/byte (the trainer's eval)    ``restore.RestoredRun.evaluate``
longppl     LongPPL on key tokens                          ``longppl.py``
ruler       RULER-offline (NIAH, VT, CWE, FWE)             ``ruler.py``
probe       layerwise NIAH probing (logistic regression)   ``probe.py``
heads       retrieval heads: needle mass, H(t), d_QK(t)    ``heads.py``
influence   gradient influence G(d)                        ``influence.py``
lm_eval     lm-evaluation-harness benchmarks               ``lm_eval_model.py``
=========== ============================================== =====================================

Every row carries ``task``, ``checkpoint_step``, ``tokens_seen``, ``eval_config`` (the settings that
define it: swaps, horizon, seq_len, data, task options) with its short hash ``eval_key``, and the
``attention_backends`` the task's model resolved to. ``eval.jsonl`` is append-only; a later row of
the same (task, eval_key, checkpoint_step) supersedes an earlier one (:func:`current_rows`), like
the trainer's metrics rows. Plots go to ``RUN_DIR/eval/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, get_args

from tqdm import tqdm

from hybrid_lm.backends import recorded_backends
from hybrid_lm.config import AttentionImpl
from hybrid_lm.describe import describe_layers
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.eval import ruler
from hybrid_lm.eval.heads import require_attention
from hybrid_lm.eval.introspect import PROMPTS
from hybrid_lm.eval.longppl import (INPUTS, KeyTokenRule, MAX_TOKENS, MIN_TOKENS, check_evaluator_tokenizer,
                                    longppl_of_run)
from hybrid_lm.eval.probe import check_samples
from hybrid_lm.eval.ruler import check_request, parse_lengths, tokens_seen
from hybrid_lm.eval.ruler_items import HAYSTACKS
from hybrid_lm.eval.ruler_report import format_table, plot_ruler
from hybrid_lm.experiment import run_id
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import checkpoint_steps, load_run_config, read_eval_rows, run_path
from hybrid_lm.run.loss import format_se
from hybrid_lm.run.restore import RestoredRun, check_data_choice, record_rows
from hybrid_lm.run.swap import swapped_config

log = logging.getLogger(__name__)

TASKS = ("loss", "longppl", "ruler", "probe", "heads", "influence", "lm_eval")
# the number each task is compared by across checkpoints and runs (eval-report), and which way is better
HEADLINES = {"loss": ("bpb", "lower"), "longppl": ("longppl", "lower"), "ruler": ("exact_match", "higher"),
             "probe": (None, "higher"), "heads": (None, "higher"), "influence": (None, None),
             "lm_eval": ("score", "higher")}


def check_tasks(tasks: tuple[str, ...]) -> None:
    """``--tasks`` of ``hybrid-lm eval`` and ``eval-report``: known task names (``TASKS``), at least one."""
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ConfigError(f"--tasks {','.join(tasks)}: unknown {', '.join(bad) or 'empty list'}; "
                          f"choose from {','.join(TASKS)}")


def split_csv(text: str | None) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``."""
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def _ruler_tasks(text: str) -> tuple[str, ...] | None:
    return split_csv(text) or None  # none named: all seven


def _ruler_lengths(text: str) -> tuple[int, ...]:
    return tuple(parse_lengths(text, "--ruler-lengths"))


@dataclasses.dataclass(frozen=True)
class Option:
    """The ``hybrid-lm eval`` option of an :class:`EvalRequest` field (its metadata ``option``): the
    flags, help, ``type``, ``choices``, ``metavar`` and ``action`` as argparse takes them. ``parse``
    turns the option's text into the field's value (the option not given, or given empty, leaves the
    field's default); without it the parsed value is the field's. ``without_tasks``: an option of the
    model, also read by ``hybrid-lm eval`` without ``--tasks``. ``key``: the field's key in
    :meth:`EvalRequest.config` where it is not the field's name, ``task`` the task whose config holds it
    there where two fields share a key."""

    flags: tuple[str, ...]
    help: str | None = None
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    action: str | None = None
    parse: Callable | None = None
    without_tasks: bool = False
    key: str | None = None
    task: str | None = None


def _option(default, *flags: str, **kw):
    """A field of :class:`EvalRequest` with ``default`` and its command-line :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(flags, **kw)})


def options() -> list[tuple[dataclasses.Field, Option]]:
    """``(field, Option)`` of every :class:`EvalRequest` field that ``hybrid-lm eval`` sets, in field order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(EvalRequest) if "option" in f.metadata]


def config_option(task: str, key: str) -> Option | None:
    """The option that sets ``key`` of ``task``'s :meth:`EvalRequest.config`, or None where none does."""
    found = {opt.task: opt for f, opt in options() if (opt.key or f.name) == key}
    return found.get(task) or found.get(None)


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What ``hybrid-lm eval`` was asked for; every field that changes a result is in :meth:`config`.
    A field's ``option`` metadata is its command-line option (``eval/cli.py`` generates them)."""

    tasks: tuple[str, ...] = _option(
        ("loss",), "--tasks", metavar="T1,T2", parse=split_csv,
        help=f"{','.join(TASKS)} (without --tasks: the loss of the swapped model, as before)")
    swaps: tuple[str, ...] = _option((), "--swap", action="append", metavar="SLOT=KIND[:W]", parse=tuple,
                                     without_tasks=True, help="switch a slot's mixer (repeatable, one per slot)")
    horizon: int | None = _option(None, "--horizon", type=int, metavar="H", without_tasks=True,
                                  help="limit the full-attention layers to the last H tokens (the query included)")
    sinks: int = _option(0, "--sinks", type=int, metavar="S", without_tasks=True,
                         help="with --horizon: the first S positions stay visible to every query (default 0)")
    seq_len: int | None = _option(
        None, "--seq-len", "--seq_len", type=int, metavar="T", without_tasks=True,
        help="evaluate at T tokens: the loss windows, the probe's nominal length, the heads prompts and G(d)'s "
             "documents (default: the run's seq_len; heads and G(d): 8192 at most)")
    eval_windows: int | None = _option(
        None, "--eval-windows", type=int, without_tasks=True,
        help="number of fixed validation windows (default: the run's DataConfig.eval_windows)")
    attention_impl: str | None = _option(None, "--attention-impl", choices=get_args(AttentionImpl), without_tasks=True)
    data: str | None = _option(  # a prepared token store for loss / longppl / influence (its val split)
        None, "--data", metavar="STORE",
        help="a prepared token store (hybrid-lm data prepare, the run's tokenizer): loss and bits/byte on its val "
             "split, LongPPL and G(d) on its val documents (default: the run's own store)")
    samples: int | None = _option(  # items per task; None: each task's own default (probe 10000, heads 500, ...)
        None, "--samples", type=int,
        help="items per task, one number for every task of --tasks (default: each task's own, the papers': ruler "
             "8, probe 10000 (at least 40), heads 500, influence 1000)")
    seed: int = _option(0, "--seed", type=int, help="item seed (default 0)")
    batch_size: int | None = _option(None, "--batch-size", type=int, help="rows per forward pass")
    # longppl
    evaluator: str | None = _option(
        None, "--evaluator",
        help="longppl: who marks the key tokens: a run directory, 'newest' (default: the run's newest checkpoint, "
             "the same for every checkpoint) or 'self' (each checkpoint itself)")
    evaluator_step: int | None = _option(None, "--evaluator-step", type=int)
    longppl_length: int | None = _option(
        None, "--longppl-length", type=int, key="length", task="longppl",
        help="longppl: tokens a document is cut to (default: 32767, at most the run's seq_len + 1)")
    longppl_min_tokens: int | None = _option(
        None, "--longppl-min-tokens", type=int, key="min_tokens",
        help="longppl: documents shorter than this are left out (default 16384, at most the length)")
    longppl_inputs: str = _option(
        "documents", "--longppl-inputs", choices=INPUTS, key="inputs", task="longppl",
        help="longppl: whole val documents (default) or the run's eval windows, which cross documents")
    longppl_docs: int | None = _option(  # None: 50 documents (inputs documents), 8 windows (inputs windows)
        None, "--docs", type=int, key="docs",
        help="longppl: documents (default 50; 8 windows with --longppl-inputs windows)")
    trunc_len: int = _option(4096, "--trunc-len", type=int, help="longppl: K, the short context")
    window: int = _option(1024, "--window", type=int, help="longppl: W, targets per short-context pass")
    alpha: float = 2.0
    beta: float = -2.0
    # ruler
    ruler_tasks: tuple[str, ...] | None = _option(None, "--ruler-tasks", parse=_ruler_tasks, key="tasks", task="ruler",
                                                  help="ruler: tasks (default all seven)")
    ruler_lengths: tuple[int, ...] | None = _option(None, "--ruler-lengths", metavar="L1,L2", parse=_ruler_lengths,
                                                    key="lengths", help="ruler: lengths")
    haystack: str | None = _option(  # None: each task's official haystack
        None, "--haystack", choices=HAYSTACKS,
        help="ruler, probe, heads: filler text of the needle prompts (default: each task's official one: RULER's "
             "per task (essays for niah, noise for vt), noise for the probe, essays for heads)")
    allow_longer: bool = _option(False, "--allow-longer", action="store_true",
                                 help="ruler: lengths beyond the run's seq_len")
    # the swaps prefill the prompt only; the answer is scored by the run's own layers (eval/prefill_swap.py)
    swap_prefill_only: bool = _option(
        False, "--swap-prefill-only", action="store_true",
        help="ruler, lm_eval: the --swap applies to the prompt (lm-eval: each log-likelihood's context) only; the "
             "answer is scored by the run's own layers over the swapped prompt's cache (the SA paper's "
             "training-free protocol; no generation). docs/EVAL.md")
    ruler_generation: bool = _option(  # False: RULER's log-likelihood scores only (no greedy generation)
        True, "--ruler-no-generation", action="store_false", key="generation",
        help="ruler: the log-likelihood scores only (answer NLL, gold against distractors), no greedy generation: "
             "exact_match is null")
    # probe
    probe_prompt: str = _option(
        "official", "--probe-prompt", choices=PROMPTS, key="prompt",
        help="probe: the official recipe at the nominal --seq-len (default), or prompts of exactly --seq-len tokens")
    # heads
    reference_step: int | None = _option(
        None, "--reference-step", type=int, help="heads: the checkpoint d_QK is measured against (default: the run's last)")
    # influence
    influence_inputs: str = _option(
        "documents", "--influence-inputs", choices=("documents", "windows"), key="inputs", task="influence",
        help="influence: whole val documents after a BOS (default) or the run's eval windows")
    # lm_eval
    lm_eval_tasks: tuple[str, ...] = _option(
        (), "--lm-eval-tasks", metavar="T1,T2", parse=split_csv, key="tasks", task="lm_eval",
        help="lm_eval: lm-evaluation-harness tasks, e.g. hellaswag,arc_easy (datasets must be available)")
    lm_eval_limit: int | None = _option(None, "--lm-eval-limit", type=int, key="limit", help="lm_eval: items per task")
    lm_eval_fewshot: int | None = _option(None, "--num-fewshot", type=int, key="num_fewshot",
                                          help="lm_eval: few-shot examples")
    lm_eval_include: str | None = _option(  # a folder of lm-eval task YAMLs (local tasks)
        None, "--lm-eval-include", metavar="DIR", key="include_path",
        help="lm_eval: a folder of task YAMLs (local tasks), added to lm-eval's own")
    progress: bool = True

    def check(self) -> None:
        check_tasks(self.tasks)
        if self.data is not None and not {"loss", "longppl", "influence"} & set(self.tasks):
            raise ConfigError("--data applies to the loss, longppl and influence tasks: add one of them to --tasks")
        for f, opt in options():
            value = getattr(self, f.name)
            if opt.choices and value is not None and value not in opt.choices:
                raise ConfigError(f"{opt.flags[0]} {value}: choose one of {', '.join(opt.choices)}")
        if "lm_eval" in self.tasks and not self.lm_eval_tasks:
            raise ConfigError("--tasks lm_eval needs --lm-eval-tasks, e.g. --lm-eval-tasks hellaswag,arc_easy")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"--samples {self.samples}: must be >= 1")
        if self.swap_prefill_only:
            if not self.swaps:
                raise ConfigError("--swap-prefill-only needs --swap: the swap the prompt is prefilled with")
            other = [t for t in self.tasks if t not in ("ruler", "lm_eval")]
            if other:
                raise ConfigError(f"--swap-prefill-only applies to --tasks ruler and lm_eval (answer log-likelihoods "
                                  f"after a context), not {','.join(other)}: run those in a call without it")

    def check_options(self, base, cfg) -> None:
        """Every task's option constraints, checked before any task runs (nothing built, nothing recorded):
        ``base`` is the run's config, ``cfg`` the one the tasks run on (``--swap`` ... applied).
        ``--samples`` is one number for every task that takes it."""
        if "probe" in self.tasks and self.samples is not None:
            try:
                check_samples(self.samples)
            except ConfigError as e:
                raise ConfigError(f"{e}; --samples applies to every task of --tasks: run the probe in a "
                                  "`hybrid-lm eval --tasks probe` of its own") from None
        if "ruler" in self.tasks:
            check_request(cfg, self.ruler_tasks, self.ruler_lengths, self.haystack, self.allow_longer,
                          1 if self.samples is None else self.samples, lengths_flag="--ruler-lengths")
        if "longppl" in self.tasks:
            n = self.longppl_length or (base.data.seq_len + 1 if self.longppl_inputs == "windows" else
                                        min(MAX_TOKENS, base.data.seq_len + 1))
            shortest = n if self.longppl_inputs == "windows" else (self.longppl_min_tokens or min(MIN_TOKENS, n))
            try:
                KeyTokenRule(self.trunc_len, self.window, self.alpha, self.beta).validate(shortest)
            except ValueError as e:
                raise ConfigError(f"longppl: {e} (--longppl-length, --longppl-min-tokens, --trunc-len)") from None
            if self.evaluator is not None:
                try:
                    check_evaluator_tokenizer(load_run_config(self.evaluator), base)
                except FileNotFoundError as e:
                    raise WorkdirError(f"--evaluator: {e}") from None
                except ValueError as e:
                    raise ConfigError(f"--evaluator {self.evaluator}: {e}") from None
        if "heads" in self.tasks:
            require_attention(cfg)

    def config(self, task: str) -> dict:
        """The settings that define ``task``'s rows (the model's, then the task's own)."""
        c = {"swaps": list(self.swaps), "horizon": self.horizon, "sinks": self.sinks if self.horizon else None,
             "seq_len": self.seq_len, "attention_impl": self.attention_impl}
        if task == "loss":
            c.update(data=self.data, eval_windows=self.eval_windows)
        elif task == "longppl":
            c.update(data=self.data, evaluator=self.evaluator or "newest", evaluator_step=self.evaluator_step,
                     length=self.longppl_length, docs=self.longppl_docs, inputs=self.longppl_inputs,
                     min_tokens=self.longppl_min_tokens, trunc_len=self.trunc_len,
                     window=self.window, alpha=self.alpha, beta=self.beta)
        elif task == "ruler":
            c.update(tasks=list(self.ruler_tasks or ()), lengths=list(self.ruler_lengths or ()),
                     haystack=self.haystack, samples=self.samples, seed=self.seed, generator=2)
            if self.swap_prefill_only:  # only when set: the eval keys of earlier rows stay as they were
                c.update(swap_prefill_only=True)
            if not self.ruler_generation:
                c.update(generation=False)
        elif task in ("probe", "heads", "influence"):
            c.update(samples=self.samples, seed=self.seed, definition="official")
            if task in ("probe", "heads"):
                c.update(haystack=self.haystack)
            if task == "probe":
                c.update(prompt=self.probe_prompt)
            if task == "heads":
                c.update(reference_step=self.reference_step)
            if task == "influence":
                c.update(inputs=self.influence_inputs, data=self.data)
        elif task == "lm_eval":
            c.update(tasks=list(self.lm_eval_tasks), limit=self.lm_eval_limit, num_fewshot=self.lm_eval_fewshot,
                     include_path=self.lm_eval_include)
            if self.swap_prefill_only:  # only when set: the eval keys of earlier rows stay as they were
                c.update(swap_prefill_only=True)
        return c


def eval_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- checkpoints

def parse_steps(spec: str | None, available: list[int]) -> list[int]:
    """``latest`` (default), ``all``, or comma-separated steps (each must be saved)."""
    if not available:
        raise WorkdirError("the run has no finalised checkpoint: train it first")
    if spec in (None, "", "latest"):
        return [available[-1]]
    if spec == "all":
        return list(available)
    try:
        steps = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--steps {spec!r}: give latest, all, or comma-separated step numbers") from None
    missing = [s for s in steps if s not in available]
    if missing or not steps:
        raise ConfigError(f"--steps {spec}: no checkpoint at step {missing[0] if missing else '(none given)'}; "
                          f"saved steps: {','.join(map(str, available))}")
    return sorted(set(steps))


# ----------------------------------------------------------------------------- the tasks

def _task_loss(run, cfg, req: EvalRequest) -> list[dict]:
    row = run.evaluate(req.swaps, req.horizon, req.sinks, seq_len=req.seq_len, eval_windows=req.eval_windows,
                       attention_impl=req.attention_impl, data=req.data, record=False)
    return [row]


def _task_longppl(run, cfg, req: EvalRequest) -> list[dict]:
    rule = KeyTokenRule(req.trunc_len, req.window, req.alpha, req.beta)
    return [longppl_of_run(run, cfg, evaluator=req.evaluator, evaluator_step=req.evaluator_step,
                           length=req.longppl_length, docs=req.longppl_docs, rule=rule, data=req.data,
                           progress=req.progress, inputs=req.longppl_inputs, min_tokens=req.longppl_min_tokens)]


def _samples(req: EvalRequest) -> dict:
    return {} if req.samples is None else {"samples": req.samples}


def _task_ruler(run, cfg, req: EvalRequest) -> list[dict]:
    answer_cfg = None
    if req.swap_prefill_only:  # the run's own layers (constraint and seq_len kept), the swaps on the prompt only
        answer_cfg = run.task_config((), req.horizon, req.sinks, seq_len=req.seq_len, attention_impl=req.attention_impl)

    rows, skipped = ruler.evaluate_ruler(run, tasks=list(req.ruler_tasks) if req.ruler_tasks else None,
                                         lengths=list(req.ruler_lengths) if req.ruler_lengths else None,
                                         **_samples(req), haystack=req.haystack, seed=req.seed,
                                         allow_longer=req.allow_longer, batch_size=req.batch_size, cfg=cfg,
                                         progress=req.progress, lengths_flag="--ruler-lengths", answer_cfg=answer_cfg,
                                         generate_answers=req.ruler_generation)
    for s in skipped:
        log.warning("ruler %s at %d tokens skipped: %s", s["task"], s["length"], s["reason"])
    if not rows:
        raise ConfigError("ruler: every requested (task, length) is too short for its task: use longer "
                          "--ruler-lengths (with --allow-longer beyond the run's seq_len)")
    return rows


def _task_module(name: str):
    return importlib.import_module({"probe": "hybrid_lm.eval.probe", "heads": "hybrid_lm.eval.heads",
                                    "influence": "hybrid_lm.eval.influence",
                                    "lm_eval": "hybrid_lm.eval.lm_eval_model"}[name])


def _task_probe(run, cfg, req: EvalRequest) -> list[dict]:
    return _task_module("probe").evaluate_probe(run, cfg, **_samples(req), seq_len=req.seq_len, seed=req.seed,
                                                progress=req.progress, batch_size=req.batch_size,
                                                haystack=req.haystack, prompt=req.probe_prompt)


def _task_heads(run, cfg, req: EvalRequest) -> list[dict]:
    return _task_module("heads").evaluate_heads(run, cfg, **_samples(req), seq_len=req.seq_len, seed=req.seed,
                                                progress=req.progress, batch_size=req.batch_size,
                                                haystack=req.haystack, reference_step=req.reference_step)


def _task_influence(run, cfg, req: EvalRequest) -> list[dict]:
    return _task_module("influence").evaluate_influence(run, cfg, **_samples(req), seq_len=req.seq_len,
                                                        seed=req.seed, progress=req.progress,
                                                        batch_size=req.batch_size, inputs=req.influence_inputs,
                                                        data=req.data)


def _task_lm_eval(run, cfg, req: EvalRequest) -> list[dict]:
    answer_cfg = None
    if req.swap_prefill_only:  # as for RULER: the swaps on the contexts, the run's own layers on the answers
        answer_cfg = run.task_config((), req.horizon, req.sinks, seq_len=req.seq_len, attention_impl=req.attention_impl)
    return _task_module("lm_eval").evaluate_lm_eval(run, cfg, tasks=list(req.lm_eval_tasks), limit=req.lm_eval_limit,
                                                    num_fewshot=req.lm_eval_fewshot, batch_size=req.batch_size,
                                                    include_path=req.lm_eval_include, progress=req.progress,
                                                    answer_cfg=answer_cfg)


_RUNNERS = {"loss": _task_loss, "longppl": _task_longppl, "ruler": _task_ruler, "probe": _task_probe,
            "heads": _task_heads, "influence": _task_influence, "lm_eval": _task_lm_eval}


def run_tasks(run, req: EvalRequest, cfg=None) -> list[dict]:
    """Every requested task on one restored checkpoint: rows with the common fields filled in."""
    cfg = cfg or run.task_config(req.swaps, req.horizon, req.sinks, seq_len=req.seq_len,
                                 attention_impl=req.attention_impl)
    seen = tokens_seen(run)
    out = []
    for task in req.tasks:
        t0 = time.time()
        recorded_backends(clear=True)
        rows = _RUNNERS[task](run, cfg, req)
        backends = recorded_backends() or _resolved_backends(cfg)  # a cached jit traces nothing the 2nd time
        conf = req.config(task)
        for r in rows:
            r.setdefault("kind", task)
            sub = r.get("task")
            r["task"] = task if sub is None or not str(sub).startswith(task) else sub
            r.update(checkpoint_step=run.step, tokens_seen=seen, eval_config=conf, eval_key=eval_key(conf),
                     run_id=run_id(run.cfg), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            r.setdefault("step", run.step)
            if not r.get("attention_backends"):
                r["attention_backends"] = backends
            r.setdefault("task_wall_s", round(time.time() - t0, 3))
        out.extend(rows)
    return out


def _resolved_backends(cfg) -> dict[str, str]:
    """``{op: backend}`` each layer of ``cfg`` resolves to at its seq_len on this platform (the record
    a first trace would have written)."""
    return {r["op"]: r["backend"] for r in describe_layers(cfg.model, cfg.data.seq_len) if r["op"] not in (None, "error")}


# ----------------------------------------------------------------------------- rows on disk

def task_of(row: dict) -> str:
    """The task family of an eval.jsonl row (rows before the suite have only ``kind``)."""
    t = row.get("task") or {"swap_eval": "loss"}.get(row.get("kind"), row.get("kind", "?"))
    return str(t).split("/")[0]


def current_rows(workdir: Path | str) -> list[dict]:
    """eval.jsonl with superseded rows dropped: the last row per (task, eval_key, checkpoint_step), and
    per length for RULER (one request writes a row per task and length)."""
    latest: dict = {}
    for r in read_eval_rows(workdir):
        length = r.get("length") if task_of(r) == "ruler" else None
        latest[(r.get("task") or task_of(r), r.get("eval_key"), r.get("checkpoint_step"), length)] = r
    return list(latest.values())


def headline(row: dict) -> float | None:
    """The row's headline number (``HEADLINES``; the task module's ``HEADLINE`` where it has one)."""
    fam = task_of(row)
    key = HEADLINES.get(fam, (None, None))[0]
    if key is None and fam in ("probe", "heads", "influence"):
        try:
            key = _task_module(fam).HEADLINE
        except ImportError:
            return None
    v = row.get(key) if key else None
    return float(v) if isinstance(v, (int, float)) else None


# ----------------------------------------------------------------------------- tables and plots

def format_rows(task: str, rows: list[dict]) -> str:
    """A printable table of one task's rows (the task module's own format where it has one)."""
    if task == "ruler":
        return "\n\n".join(format_table([r for r in rows if r["checkpoint_step"] == s])
                           for s in sorted({r["checkpoint_step"] for r in rows}))
    if task in ("probe", "heads", "influence", "lm_eval"):
        fmt = getattr(_task_module(task), f"format_{task}", None)
        if fmt is not None:
            return fmt(rows)
    lines = []
    for r in rows:
        if task == "loss":
            lines.append(f"loss      step {r['checkpoint_step']:>7}  tokens {r['tokens_seen']:>14,}  seq_len "
                         f"{r['seq_len']}  windows {r['eval_windows']}  val loss {r['loss']:.4f}{format_se(r.get('loss_se'))} nats  "
                         f"{r['bpb']:.4f} bits/byte  on {r.get('scored_on') or r.get('data') or 'the run data'}")
        elif task == "longppl":
            lp = "—" if r["longppl"] is None else f"{r['longppl']:.3f}"
            judge = r["evaluator"] + (f" (step {r['evaluator_step']})" if r["evaluator"] in ("newest", "self") else "")
            lines.append(f"longppl   step {r['checkpoint_step']:>7}  tokens {r['tokens_seen']:>14,}  {r['docs']} docs x "
                         f"<= {r['length']}  evaluator {judge}  LongPPL {lp}  PPL {r['ppl']:.3f}  key "
                         f"{r['n_key']}/{r['n_token']}")
        else:
            lines.append(json.dumps({k: r[k] for k in ("task", "checkpoint_step") if k in r}))
    return "\n".join(lines)


def plot_task(task: str, rows: list[dict], out_dir: Path) -> list[Path]:
    """The task's plots over checkpoints into ``out_dir`` (the task module's own, else its headline
    number against tokens seen)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if task in ("probe", "heads", "influence"):
        return list(getattr(_task_module(task), f"plot_{task}")(rows, out_dir))
    if task == "ruler":
        return plot_ruler(rows, out_dir)
    series: dict = {}
    for r in rows:
        v = headline(r)
        if v is not None:
            name = "longppl (key tokens)" if task == "longppl" else str(r.get("task", task))
            series.setdefault(name, []).append((r["tokens_seen"], v))
        if task == "longppl":  # PPL beside LongPPL (which is undefined while no token is key)
            series.setdefault("ppl (all tokens)", []).append((r["tokens_seen"], r["ppl"]))
    if not series:
        return []
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    key, better = HEADLINES[task]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel(f"{key} ({better} is better)")
    title = f"{task} over training"
    if task == "longppl":
        from matplotlib.ticker import FuncFormatter  # plots only (a slow import)
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))
        has_key = any(name != "ppl (all tokens)" for name in series)
        ax.set_ylabel("perplexity (lower is better)")
        if not has_key:
            title = "PPL on all tokens: the evaluator found no key tokens, so no LongPPL"
        else:
            title = "LongPPL (key tokens) and PPL (all tokens) over training"
    if len({p[0] for pts in series.values() for p in pts}) == 1:  # one checkpoint: no 10% span around it
        x = next(iter(series.values()))[0][0]
        ax.set_xscale("log")
        ax.set_xlim(x / 2, x * 2)
        ax.set_xticks([x], [f"{x:,}"])
        ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    if len(series) > 1 or task == "longppl":
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = out_dir / f"{task}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


# ----------------------------------------------------------------------------- the command

def evaluate_run(workdir: Path | str, req: EvalRequest, steps: str | None = None, *, record: bool = True,
                 plots: bool = True, printer=print) -> list[dict]:
    """``req``'s tasks on each of ``steps`` (latest | all | S1,S2) of ``workdir``: prints a table per
    task and checkpoint, appends the rows to eval.jsonl (after printing), then draws each task's plots
    over every current row of its eval config into ``workdir/eval/``. Returns the new rows."""

    req.check()
    if {"loss", "longppl"} & set(req.tasks):
        check_data_choice(workdir, req.data)  # a folder with its own tokenizer names its data
    spec, workdir = workdir, run_path(workdir)  # hf:DIR -> DIR, where its rows and plots go
    try:
        base = load_run_config(spec)
    except FileNotFoundError as e:
        raise WorkdirError(str(e)) from None
    # bad swaps and task options fail before a restore, an item built or a row recorded
    req.check_options(base, swapped_config(base, req.swaps, req.horizon, req.sinks, seq_len=req.seq_len,
                                           attention_impl=req.attention_impl))
    todo = parse_steps(steps, checkpoint_steps(workdir))
    new = []
    for step in tqdm(todo, desc="checkpoints", unit="ckpt", disable=bar_disabled(req.progress and len(todo) > 1)):
        try:
            run = RestoredRun(workdir, step=step)
        except FileNotFoundError as e:
            raise WorkdirError(f"{e}") from None
        rows = run_tasks(run, req)
        for task in req.tasks:
            mine = [r for r in rows if task_of(r) == task]
            if mine:
                printer(format_rows(task, mine))
        if record:
            record_rows(run, rows, quiet=True)
        new.extend(rows)
    if plots and record:
        keys = {(task_of(r), r["eval_key"]) for r in new}
        current = [r for r in current_rows(workdir) if (task_of(r), r.get("eval_key")) in keys]
        for task in req.tasks:
            mine = [r for r in current if task_of(r) == task]
            if mine:
                for p in plot_task(task, mine, workdir / "eval"):
                    printer(f"plot: {p}")
    if record:
        printer(f"recorded {len(new)} rows in {workdir / 'eval.jsonl'}")
    return new
