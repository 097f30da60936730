"""lm-evaluation-harness on a run's checkpoint: the ``hybrid_lm`` model of ``lm_eval`` (short-context benchmarks).

:func:`model_class` imports lm-eval (``pip install -e '.[lm_eval]'``; nothing here imports it before
that) and returns :class:`HybridLMEval`, an ``lm_eval.api.model.TemplateLM`` (an ``LM``) registered
as ``"hybrid_lm"``. Its ``model_args``:

    run=RUN_DIR (required)  step=N (default: the newest that restores)  batch_size=N|auto
    max_length=T (default: the run's seq_len)  max_gen_toks=N (default 256)
    swap=SLOT=KIND[:W] (as ``hybrid-lm eval --swap``; several separated by ';', or a list)
    swap_prefill_only=true (the SA paper's protocol, ``eval/prefill_swap.py``: each log-likelihood's
        context is prefilled by the swapped model and its continuation scored by the run's own layers
        over that context; log-likelihood requests only)
    attention_impl=auto|xla|cudnn|pallas|jla  progress=true|false

``batch_size`` in model_args wins over lm-eval's ``--batch_size`` (default 1: give one of them);
``auto`` = the trainer's tokens per step at each padded length. One process (lm-eval's rank 0).

What the three request types do, as lm-eval's HF model does them:

- ``loglikelihood``: context and continuation encoded together and split (trailing whitespace of the
  context moves into the continuation); an empty context is the run's separator token (below);
  ``context + continuation`` truncated from the left to ``max_length + 1`` tokens; the sum of the
  continuation's log-probs and whether every continuation token is the argmax (over the tokenizer's ids).
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows over ``max_length`` (the first one
  conditioned on the separator token, each later one on the tokens before it), summed.
- ``generate_until``: greedy on the model's decode cache (``HybridLM.prefill`` / ``decode_step``, as
  ``hybrid_lm/eval/generate.py``), the context truncated from the left to ``max_length -
  max_gen_toks``, stopped at the ``until`` strings, at the tokenizer's EOS id, or after
  ``max_gen_toks``. Sampling (``do_sample`` / ``temperature > 0``) is refused. A model with a mixer
  that has no decode path (``Block.check_decode``; e.g. attention_sink) cannot generate: such tasks are
  refused in one line.

Batching (the model calls are ``eval/lm_eval_calls.py``'s ``ModelCalls``): requests sorted longest first
(lm-eval's ``Collator``), rows right-padded to a few bucket lengths (``length_buckets``), a fixed number
of rows per bucket: the model compiles once per
bucket used. Right padding is exact for causal mixers (a token never sees a later one); ``sa`` draws
its permutation over the padded length, so its scores depend on the bucket (it is stochastic by
construction). Generation runs prompts of different lengths in one batch without padding them: the
batch is prefilled up to a bucket length at most its shortest prompt, then decoded one token at a
time, each row fed its own prompt tokens until they run out (teacher forcing), then its greedy
picks; host-side stop checks every ``DECODE_CHUNK`` steps end the batch early.

Tokens: the run's tokenizer (``RestoredRun.tokenizer``). The token before a document (empty
contexts, the first rolling window) is the last token of the tokenizer's separator, i.e. what
precedes every document in training: EOS for BPE / SentencePiece, ``"\\n"`` for bytes (whose
separator is ``"\\n\\n"``; bytes have no EOS, so generation stops only at ``until`` or the budget).
Special-token strings in a request (``<|endoftext|>``) become their ids, as lm-eval's HF backend's
transformers tokenizer makes them (``Tokenizer.encode_parsing_specials``); training data keeps them text.

Command line: lm-eval's own ``lm_eval`` script cannot see a model registered outside lm-eval
(0.4.13 looks models up in its own registry only: no entry points, no plugin import; its
``--include_path`` adds tasks), so::

    hybrid-lm lm-eval --model_args run=RUN_DIR,step=N --tasks hellaswag,arc_easy [any lm-eval option]
    python -m hybrid_lm.eval.lm_eval_model --model_args run=RUN_DIR --tasks ...

register the class and run lm-eval's CLI on the arguments (``--model hybrid_lm`` implied).
Python: ``lm_eval.simple_evaluate(model=model_class()(run=RUN_DIR), tasks=[...])``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.eval.lm_eval_calls import ModelCalls, bucket_up
from hybrid_lm.experiment import run_id
from hybrid_lm.optional import optional_import
from hybrid_lm.progress import bar_disabled
from hybrid_lm.run.directory import load_run_config
from hybrid_lm.run.restore import RestoredRun
from hybrid_lm.run.swap import swapped_config

log = logging.getLogger(__name__)

NAME = "hybrid_lm"  # lm-eval's --model
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF default
_IGNORED_ARGS = ("device", "max_batch_size", "trust_remote_code")  # passed by lm-eval to every model
_KNOWN_ARGS = ("run", "step", "batch_size", "max_length", "max_gen_toks", "swap", "swap_prefill_only",
               "attention_impl", "progress")


# ----------------------------------------------------------------------------- arguments

def parse_swaps(swap) -> list[str]:
    """``swap`` as lm-eval passes it: None, one spec, several separated by ';', or a list."""
    if swap is None or swap == "":
        return []
    if isinstance(swap, (list, tuple)):
        return [str(s).strip() for s in swap if str(s).strip()]
    return [s.strip() for s in str(swap).split(";") if s.strip()]


def _positive_int(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"hybrid_lm model_args: {name}={value!r} must be an integer") from None
    if n < 1 or n != float(value):
        raise ConfigError(f"hybrid_lm model_args: {name}={value!r} must be an integer >= 1")
    return n


def _batch_size(value):
    """None (the trainer's tokens per step at each length) for None / 'auto' / 'auto:N', else an int >= 1."""
    if value is None or (isinstance(value, str) and value.strip().lower().startswith("auto")):
        return None
    return _positive_int("batch_size", value)


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ConfigError(f"hybrid_lm model_args: {name}={value!r} must be true or false")


# ----------------------------------------------------------------------------- the model


class _HybridLMEvalImpl:
    """The body of :class:`HybridLMEval` (lm-eval's ``TemplateLM`` is added as a base by
    :func:`model_class`, so that this module imports without lm-eval)."""

    backend = "causal"

    def __init__(self, run=None, step=None, batch_size=None, max_length=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS,
                 swap=None, attention_impl=None, progress=True, restored=None, swap_prefill_only=False,
                 answer_cfg=None, **extra):
        """``restored``: ``(RestoredRun, Config)`` already in memory (``hybrid-lm eval --tasks lm_eval``:
        the suite's checkpoint and its swapped / constrained config); then ``run``, ``step``, ``swap``
        and ``attention_impl`` are not used, and ``answer_cfg`` (the run's own config at that length)
        scores the continuations of ``swap_prefill_only``."""
        super().__init__()

        unknown = sorted(k for k in extra if k not in _IGNORED_ARGS)
        if unknown:
            raise ConfigError(f"hybrid_lm model_args: unknown {', '.join(unknown)}; known: {', '.join(_KNOWN_ARGS)}")
        if extra.get("device"):
            log.info("hybrid_lm: device=%s ignored (JAX runs on its default devices)", extra["device"])
        if restored is not None:
            run = restored[0].workdir
        if run is None or str(run).strip() == "":
            raise ConfigError("hybrid_lm model_args: run=RUN_DIR is required (a run directory with checkpoints/)")
        step = None if step is None or str(step).lower() in ("", "latest", "none") else _positive_int("step", step)
        self.batch_size = _batch_size(batch_size)
        self.max_batch_size = _positive_int("max_batch_size", extra.get("max_batch_size"))
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks, allow_none=False)
        self.progress = _flag("progress", progress)
        self.swaps = parse_swaps(swap)
        try:
            trained = load_run_config(run)
        except FileNotFoundError as e:
            raise WorkdirError(str(e)) from None
        self.max_length = _positive_int("max_length", max_length) or trained.data.seq_len
        if self.max_length < 2:
            raise ConfigError(f"hybrid_lm model_args: max_length={self.max_length} must be >= 2")
        if self.max_length > trained.data.seq_len:
            log.warning("hybrid_lm: max_length %d exceeds the trained seq_len %d: positions beyond it were never "
                        "trained", self.max_length, trained.data.seq_len)
        seq_len = self.max_length if self.max_length != trained.data.seq_len else None
        if restored is not None:
            self.run, self.cfg = restored
        else:
            # checked before the restore: a bad swap fails in a second
            swapped_config(trained, self.swaps, seq_len=seq_len, attention_impl=attention_impl)
            try:
                self.run = RestoredRun(run, step=step)
            except FileNotFoundError as e:
                raise WorkdirError(f"{e}: train the run first, or give a step that was saved") from None
            self.cfg = self.run.task_config(self.swaps, seq_len=seq_len, attention_impl=attention_impl)
        self.prefill_only = _flag("swap_prefill_only", swap_prefill_only)
        if self.prefill_only:
            if self.cfg.model == self.run.cfg.model:
                raise ConfigError("hybrid_lm model_args: swap_prefill_only needs swap=...: the swap the contexts "
                                  "are prefilled with")
            answer_cfg = answer_cfg or self.run.task_config((), seq_len=seq_len, attention_impl=attention_impl)
        self.tokenizer = self.run.tokenizer
        self.calls = ModelCalls(self.run, self.cfg, vocab=self.tokenizer.vocab_size, max_length=self.max_length,
                                batch_size=self.batch_size, max_batch_size=self.max_batch_size,
                                answer_cfg=answer_cfg if self.prefill_only else None)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval's constructor call; ``model_args`` win over what lm-eval adds (its --batch_size,
        default 1, would otherwise collide with a ``batch_size`` in model_args)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string  # the [lm_eval] extra
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- what TemplateLM asks for

    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        return int(tok.eos_id) if tok.eos_id is not None else int(tok.separator[-1])

    @property
    def prefix_token_id(self) -> int:
        """The token before a document: the separator's last (EOS, or "\\n" for bytes)."""
        return int(self.tokenizer.separator[-1])

    @property
    def tokenizer_name(self) -> str:
        return f"hybrid_lm-{self.tokenizer.kind}-{self.tokenizer.fingerprint[:16]}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        # special-token strings in a prompt become their ids, as in lm-eval's HF backend
        return [int(t) for t in self.tokenizer.encode_parsing_specials(string)]

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def get_model_info(self) -> dict:
        """Added to lm-eval's results["config"]."""
        return {"hybrid_lm_run": str(self.run.workdir), "hybrid_lm_step": self.run.step,
                "hybrid_lm_run_id": run_id(self.run.cfg), "hybrid_lm_swaps": self.swaps,
                "hybrid_lm_swap_prefill_only": self.prefill_only,
                "hybrid_lm_max_length": self.max_length, "hybrid_lm_attention_impl": self.cfg.model.attention_impl,
                "hybrid_lm_tokenizer": self.tokenizer.describe()}

    def _refuse_under_prefill_only(self, requests, kind: str) -> None:
        if self.prefill_only and requests:
            raise ConfigError(f"swap_prefill_only scores log-likelihoods of a continuation after a context; this "
                              f"task asks for {kind}: run it without swap_prefill_only")

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``[(logprob, is_greedy)]`` of ``[(request strings or None, context ids, continuation ids)]``."""
        from lm_eval.models.utils import Collator  # the [lm_eval] extra


        def longest_first(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(requests, sort_fn=longest_first)
        ordered = [r for chunk in order.get_batched(n=0) for r in chunk]
        rows = []
        for _, ctx, cont in ordered:
            if not cont:
                raise ConfigError("lm-eval asked for the log-likelihood of an empty continuation")
            if len(cont) > self.max_length:
                raise ConfigError(f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}; "
                                  "raise max_length in --model_args")
            if self.prefill_only and len(ctx) + len(cont) > self.max_length + 1:
                raise ConfigError(f"swap_prefill_only: a context of {len(ctx)} and a continuation of {len(cont)} "
                                  f"tokens exceed max_length={self.max_length} + 1; cutting the context would change "
                                  "what is prefilled: use shorter contexts or raise max_length")
            full = (ctx + cont)[-(self.max_length + 1):]
            rows.append((np.asarray(full, np.int32), len(cont)))
        bar = tqdm(total=len(ordered), desc="hybrid_lm loglikelihood",
                   disable=bar_disabled(self.progress and not disable_tqdm))
        score = self.calls.prefill_only_loglikelihoods if self.prefill_only else self.calls.loglikelihoods
        res = score(rows, bar)
        bar.close()
        for (req_str, _, _), answer in zip(ordered, res):
            if req_str is not None:  # rolling windows are cached per document by loglikelihood_rolling
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows of ``max_length``."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # the [lm_eval] extra

        self._refuse_under_prefill_only(requests, "loglikelihood_rolling")

        windows, counts = [], []
        for (text,) in [req.args for req in requests]:
            pairs = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, ctx, cont) for ctx, cont in pairs]
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, start = [], 0
        for req, n in zip(requests, counts):
            total = float(sum(s for s, _ in scores[start:start + n]))
            start += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # -- generation

    def _stopped(self, gen: np.ndarray, until: list[str], budget: int) -> bool:
        eos = self.tokenizer.eos_id
        if len(gen) >= budget or (eos is not None and (gen == eos).any()):
            return True
        text = self.tok_decode(gen)
        return any(u and u in text for u in until)

    def _finish(self, gen: np.ndarray, until: list[str]) -> str:
        from lm_eval.models.utils import postprocess_generated_text  # the [lm_eval] extra

        eos = self.tokenizer.eos_id
        if eos is not None and (gen == eos).any():
            gen = gen[:int(np.argmax(gen == eos))]
        return postprocess_generated_text(self.tok_decode(gen), until, None)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, stopped at the request's ``until`` strings or ``max_gen_toks``."""
        from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs  # the [lm_eval] extra


        self._refuse_under_prefill_only(requests, "generate_until")
        if self.calls.no_decode and requests:
            raise ConfigError(f"generate_until needs token-by-token decoding, which this model lacks "
                              f"({self.calls.no_decode}); run its log-likelihood tasks only")

        def longest_first(req):
            return -len(self.tok_encode(req[0])), req[0]

        groups = Collator([req.args for req in requests], sort_fn=longest_first, group_by="gen_kwargs",
                          group_fn=lambda x: x[1])
        res = []
        bar = tqdm(total=len(requests), desc="hybrid_lm generate_until",
                   disable=bar_disabled(self.progress and not disable_tqdm))
        for chunk in groups.get_batched(n=0):  # one chunk per distinct gen_kwargs
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0:
                raise ConfigError(f"hybrid_lm generates greedily only; the task asks for sampling ({all_kwargs[0]})")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)  # EOS: stopped at its id
            budget = int(kwargs.pop("max_gen_toks"))
            max_ctx = self.max_length - budget
            if max_ctx < 1:
                raise ConfigError(f"max_gen_toks={budget} leaves no room for a context in max_length="
                                  f"{self.max_length}; raise max_length in --model_args")
            prompts = [self.tok_encode(c)[-max_ctx:] or [self.prefix_token_id] for c in contexts]
            i = 0
            while i < len(prompts):
                R = self.calls.rows(bucket_up(len(prompts[i]) + budget, self.calls.buckets), len(prompts))
                part = prompts[i:i + R]
                gens = self.calls.generate(part, budget, R, lambda gen: self._stopped(gen, until, budget))
                for context, gen in zip(contexts[i:i + R], gens):
                    text = self._finish(gen, until)
                    res.append(text)
                    self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                bar.update(len(part))
                i += len(part)
        bar.close()
        return groups.get_original(res)


_CLASS = None


def model_class():
    """:class:`HybridLMEval` (lm-eval's ``TemplateLM`` with the body above), registered as ``"hybrid_lm"``.
    Imports lm-eval: ImportError with the install line if it is missing."""
    global _CLASS
    if _CLASS is None:
        optional_import("lm_eval")
        # the [lm_eval] extra; the built-in models, which get_model imports only into an empty registry
        import lm_eval.models  # noqa: F401
        from lm_eval.api.model import TemplateLM  # the [lm_eval] extra
        from lm_eval.api.registry import register_model  # the [lm_eval] extra

        doc = "A hybrid_lm checkpoint as an lm-eval model (``--model hybrid_lm``); see the module docstring."
        cls = type("HybridLMEval", (_HybridLMEvalImpl, TemplateLM), {"__module__": __name__, "__doc__": doc})
        _CLASS = register_model(NAME)(cls)
    return _CLASS


# the metric a task's row is ranked by (eval-report), in this order of preference
_SCORE_METRICS = ("acc_norm", "acc", "exact_match", "f1", "bits_per_byte", "word_perplexity")


def evaluate_lm_eval(run, cfg=None, *, tasks, limit=None, num_fewshot=None, batch_size=None, include_path=None,
                     progress: bool = True, answer_cfg=None) -> list[dict]:
    """``hybrid-lm eval --tasks lm_eval --lm-eval-tasks T1,T2``: lm-eval's ``simple_evaluate`` on the
    restored checkpoint ``run`` with ``cfg``'s model (swaps and horizon included). A row per lm-eval
    task: ``task: lm_eval/<name>``, every metric lm-eval reports, and ``score`` (the first of
    ``acc_norm, acc, exact_match, f1, bits_per_byte, word_perplexity`` the task has). ``answer_cfg``
    (``--swap-prefill-only``): ``cfg`` prefills the contexts, ``answer_cfg`` scores the continuations."""

    lm_eval = optional_import("lm_eval")
    from lm_eval.tasks import TaskManager  # the [lm_eval] extra

    t0 = time.time()
    lm = model_class()(restored=(run, cfg or run.cfg), batch_size=batch_size, progress=progress,
                       max_length=(cfg or run.cfg).data.seq_len, swap_prefill_only=answer_cfg is not None,
                       answer_cfg=answer_cfg)
    if include_path:  # lm-eval indexes its ~14k task files unless every task asked for is a local one
        local = {p.stem for p in Path(include_path).rglob("*.yaml")}
        tm = TaskManager(include_path=str(include_path), include_defaults=not set(tasks) <= local)
    else:
        tm = TaskManager()
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
                                  task_manager=tm, bootstrap_iters=0)
    rows = []
    for name, res in sorted(out["results"].items()):
        metrics = {k: float(v) for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        score_key = next((f"{m},none" for m in _SCORE_METRICS if f"{m},none" in metrics), None)
        rows.append({"kind": "lm_eval", "task": f"lm_eval/{name}", "checkpoint_step": run.step,
                     "metrics": metrics, "score": metrics.get(score_key), "score_metric": score_key,
                     "n_samples": (out.get("n-samples") or {}).get(name), "limit": limit,
                     "num_fewshot": num_fewshot, "max_length": lm.max_length,
                     **({"answer_scoring": "prefill with the swap, answer with the run's own layers over its cache"}
                        if answer_cfg is not None else {}),
                     "wall_s": round(time.time() - t0, 3)})
    return rows


def format_lm_eval(rows: list[dict]) -> str:
    lines = [f"{'lm-eval task':<28}{'step':>8}  score"]
    for r in rows:
        sc = "—" if r["score"] is None else f"{r['score']:.4f} ({r['score_metric']})"
        lines.append(f"{r['task']:<28}{r['checkpoint_step']:>8}  {sc}")
    return "\n".join(lines)


def __getattr__(name: str):
    if name == "HybridLMEval":
        return model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- command line

_LM_EVAL_COMMANDS = ("run", "ls", "validate")


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's argv for ``args``: the ``run`` subcommand unless another is named, ``--model
    hybrid_lm`` unless a model is given."""
    args = list(args)
    if not args or args[0] not in _LM_EVAL_COMMANDS:
        args = ["run"] + args
    if args[0] == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
        args[1:1] = ["--model", NAME]
    return args


def run_lm_eval_cli(args: list[str]) -> int:
    """lm-eval's own command line on ``args`` with the ``hybrid_lm`` model registered; its exit code."""
    model_class()
    from lm_eval.__main__ import cli_evaluate  # the [lm_eval] extra

    saved = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv(args)]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse errors and --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ValueError as e:  # lm-eval's own input errors (no such task, bad arguments): one line; --debug: the traceback
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"lm-eval: {e}") from e
    finally:
        sys.argv = saved
    return 0


def cmd_lm_eval(args) -> int:
    return run_lm_eval_cli(args.lm_eval_args)


_DESCRIPTION = ("Run lm-evaluation-harness on WORKDIR's checkpoint: every argument goes to lm-eval's `run` "
                "command with --model hybrid_lm implied (see `hybrid-lm lm-eval --help` for lm-eval's options). "
                "model_args: run=RUN_DIR (required), step=N, batch_size=N|auto, max_length=T, max_gen_toks=N, "
                "swap=SLOT=KIND[:W] (';' between several), attention_impl=IMPL, progress=false.")
_EXAMPLE = ("hybrid-lm lm-eval --model_args run=runs/quickstart,step=1000 --tasks hellaswag,arc_easy "
            "--num_fewshot 0 --batch_size auto --output_path results/")


def add_lm_eval_command(sub) -> None:
    """Add ``lm-eval`` to the ``hybrid-lm`` subparsers: the rest of the command line passes through
    to lm-eval unparsed (no option prefix chars here, so ``--tasks`` and ``--help`` reach lm-eval)."""
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness benchmarks (hellaswag, arc_easy, ...) on a checkpoint",
                       description=_DESCRIPTION, epilog=f"example: {_EXAMPLE}", add_help=False, prefix_chars="\x00")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval options")
    p.set_defaults(fn=cmd_lm_eval)


def main(argv=None) -> int:
    """``python -m hybrid_lm.eval.lm_eval_model [lm-eval options]``; errors in one line (exit 2)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_lm_eval_cli(sys.argv[1:] if argv is None else list(argv))
    except (ConfigError, WorkdirError, DataError, ImportError) as e:
        print(f"lm-eval error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


__all__ = ["NAME", "add_lm_eval_command", "lm_eval_argv", "main", "model_class", "parse_swaps", "run_lm_eval_cli"]


if __name__ == "__main__":  # through the package module: one class, registered once, whichever way it is imported
    from hybrid_lm.eval.lm_eval_model import main as _main
    sys.exit(_main())
