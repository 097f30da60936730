"""``hybrid-lm eval``: the evaluation suite over a run's checkpoints (``--tasks``, ``eval/suite.py``), or
without ``--tasks`` the loss of a swapped / constrained model; ``hybrid-lm eval-report``: runs overlaid;
``hybrid-lm generate``: text continued by a run's checkpoint; ``hybrid-lm longppl``: LongPPL;
``hybrid-lm ruler``: RULER-offline; ``hybrid-lm export`` and ``hybrid-lm lm-eval`` (``docs/EVAL.md``).

    hybrid-lm eval WORKDIR --tasks loss,longppl,ruler,probe,heads,influence,lm_eval --steps latest|all|S1,S2
                           [--swap ...] [--horizon H --sinks S] [--seq-len T] [--data STORE]
    hybrid-lm eval WORKDIR [--swap full=swa:128] [--swap efficient=sa:128] [--horizon H --sinks S]
                           [--seq-len T] [--step N] [--baseline]
    hybrid-lm eval-report SWEEP_ROOT|RUN_DIRS... [--tasks ...] [--out DIR]
    hybrid-lm generate WORKDIR --prompt TEXT [--max-new N] [--temperature T --top-k K --seed S] [--step N]
    hybrid-lm longppl WORKDIR [--evaluator RUN] [--length T --docs N] [--trunc-len K --window W]

Registered by ``add_eval_commands(sub)`` in ``hybrid_lm/cli.py``. Each restores the checkpoint as a
``hybrid_lm/run/restore.py`` ``RestoredRun``; the work is ``RestoredRun.evaluate`` (swaps parsed by
``hybrid_lm/run/swap.py``), ``hybrid_lm/eval/generate.py`` and ``hybrid_lm/eval/longppl.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import jax
import numpy as np

from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.eval import ruler, suite
from hybrid_lm.eval.generate import generate
from hybrid_lm.eval.lm_eval_model import add_lm_eval_command
from hybrid_lm.eval.longppl import KeyTokenRule, evaluate_longppl
from hybrid_lm.eval.report import eval_report
from hybrid_lm.eval.ruler import parse_lengths
from hybrid_lm.eval.ruler_items import HAYSTACKS, TASKS as RULER_TASKS
from hybrid_lm.eval.ruler_report import format_table
from hybrid_lm.model.registry import registered_mixers
from hybrid_lm.run.directory import load_run_config
from hybrid_lm.run.export import add_export_command
from hybrid_lm.run.restore import RestoredRun, check_data_choice, record_rows
from hybrid_lm.run.loss import format_se, paired_difference
from hybrid_lm.run.swap import swapped_config


def _fmt(row: dict) -> str:
    what = ", ".join(row["swaps"]) or "no swap"
    if row.get("horizon") is not None:
        what += f"; full attention limited to {row['horizon']} tokens + {row['sinks']} sinks"
    line = (f"step {row['checkpoint_step']}  seq_len {row['seq_len']}  windows {row['eval_windows']}  "
            f"[{what}]  val loss {row['loss']:.4f}{format_se(row.get('loss_se'))} nats  {row['bpb']:.4f} bits/byte  "
            f"on {row['scored_on']}")
    if "delta_loss" in row:
        line += f"  ({row['delta_loss']:+.4f}{format_se(row.get('delta_loss_se'))} vs the trainer's eval)"
    return line


def cmd_eval(args) -> int:
    if args.swap_prefill_only and args.tasks is None:
        raise ConfigError("--swap-prefill-only applies to --tasks ruler and lm_eval (answer log-likelihoods after a "
                          "context); the loss without --tasks scores every token, so it has no prompt to prefill")
    if args.tasks is not None or args.steps is not None or args.data is not None:
        return _suite(args)
    try:
        return _run(args)
    except FileNotFoundError as e:  # not a run dir, no checkpoint, no such step: a message, not a traceback
        print(f"eval error: {e}", file=sys.stderr)
        return 2


def cmd_generate(args) -> int:
    try:
        return _generate(args)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:  # a message, not a traceback
        print(f"generate error: {e}", file=sys.stderr)
        return 2


def cmd_longppl(args) -> int:
    check_data_choice(args.workdir, args.data)  # a folder with its own tokenizer names its data
    try:
        row = evaluate_longppl(args.workdir, evaluator=args.evaluator, length=args.length, docs=args.docs,
                               rule=KeyTokenRule(args.trunc_len, args.window, args.alpha, args.beta),
                               step=args.step, evaluator_step=args.evaluator_step, record=not args.no_record,
                               data=args.data, inputs=args.inputs, min_tokens=args.min_tokens)
    except (FileNotFoundError, ValueError) as e:
        print(f"longppl error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    lp = "—" if row["longppl"] is None else f"{row['longppl']:.3f}"
    print(f"step {row['checkpoint_step']}  {row['docs']} documents of up to {row['length']} tokens  evaluator "
          f"{row['evaluator']} (step {row['evaluator_step']})  LongPPL {lp}  PPL {row['ppl']:.3f}  key tokens "
          f"{row['n_key']} of {row['n_token']} ({100 * row['key_rate']:.2f}%)")
    if row["self_evaluator"]:
        print("this checkpoint is its own evaluator: key tokens have NLL < -beta, so LongPPL < e^-beta by "
              "construction; earlier checkpoints are scored on its key tokens (the default evaluator is the run's "
              "newest checkpoint), and a stronger run can be named with --evaluator")
    return 0


def _generate(args) -> int:
    run = RestoredRun(args.workdir, step=args.step)
    tok = run.tokenizer
    ids = tok.encode(args.prompt)
    if len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one character")
    trained = run.cfg.data.seq_len
    if len(ids) + args.max_new > trained:
        logging.getLogger("hybrid_lm.generate").warning(
            "the prompt (%d tokens) + %d new tokens = %d exceeds the trained context (seq_len %d): positions "
            "beyond %d were never trained, expect the continuation to degrade there", len(ids), args.max_new,
            len(ids) + args.max_new, trained, trained)
    out = generate(run.model(), np.asarray(ids)[None], args.max_new,
                   temperature=args.temperature, top_k=args.top_k, key=jax.random.key(args.seed),
                   attention_impl=args.attention_impl or run.cfg.model.attention_impl, vocab_limit=tok.vocab_size)
    tokens = np.asarray(out[0]).tolist()
    text = tok.decode(tokens)
    if args.json:
        print(json.dumps({"checkpoint_step": run.step, "prompt": args.prompt, "continuation": text,
                          "tokens": tokens, "temperature": args.temperature, "top_k": args.top_k,
                          "seed": args.seed}, indent=2))
    else:
        print(args.prompt + text)
    return 0


def _suite(args) -> int:
    """``hybrid-lm eval RUN --tasks ... --steps ...``: ``hybrid_lm/eval/suite.py``."""
    if args.step is not None and args.steps is not None:
        raise ConfigError("give --step N or --steps S1,S2, not both")
    if args.baseline:
        raise ConfigError("--baseline applies without --tasks (the loss of the swapped and unswapped model); "
                          "with --tasks, run the suite once without --swap for the baseline")
    req = request_from_args(args)
    steps = str(args.step) if args.step is not None else args.steps
    printer = (lambda *_: None) if args.json else print
    rows = suite.evaluate_run(args.workdir, req, steps, record=not args.no_record, plots=not args.no_plots,
                              printer=printer)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    return 0


def request_from_args(args) -> suite.EvalRequest:
    """The :class:`~hybrid_lm.eval.suite.EvalRequest` of ``hybrid-lm eval``'s parsed ``args``: each field
    from its generated option (:func:`add_request_options`), the progress bars off with ``--json``."""
    values = {}
    for f, opt in suite.options():
        raw = getattr(args, f.name)
        if opt.parse is None:
            values[f.name] = raw
        elif raw not in (None, "", []):
            values[f.name] = opt.parse(raw)
    return suite.EvalRequest(**values, progress=not args.json)


def add_request_options(parser, keep) -> None:
    """``parser``'s options generated from the fields of :class:`~hybrid_lm.eval.suite.EvalRequest` that
    ``keep(field, option)`` selects, in field order. Each option's value is its field's (``dest``),
    defaulting to the field's default; an option with a ``parse`` keeps its text (None when not given)
    for :func:`request_from_args`."""
    for f, opt in suite.options():
        if not keep(f, opt):
            continue
        kw = {k: v for k, v in (("type", opt.type), ("choices", opt.choices), ("action", opt.action)) if v is not None}
        if opt.metavar or not (opt.choices or opt.action in ("store_true", "store_false")):
            kw["metavar"] = opt.metavar or opt.flags[0].lstrip("-").replace("-", "_").upper()  # as argparse names it
        kw["default"] = [] if opt.action == "append" else None if opt.parse else f.default
        parser.add_argument(*opt.flags, dest=f.name, help=opt.help, **kw)


def cmd_eval_report(args) -> int:
    eval_report(args.runs, out_dir=args.out, tasks=suite.split_csv(args.tasks) or None)
    return 0


def _run(args) -> int:
    check_data_choice(args.workdir, None)  # a folder with its own tokenizer: --data, before restoring anything
    overrides = dict(seq_len=args.seq_len, eval_windows=args.eval_windows, attention_impl=args.attention_impl)
    # check the settings before restoring anything: a bad swap fails in a second, not after a restore
    swapped_config(load_run_config(args.workdir), args.swaps, args.horizon, args.sinks, **overrides)
    ev = RestoredRun(args.workdir, step=args.step)
    rows = []
    if args.baseline:
        rows.append(ev.evaluate((), None, 0, **overrides, record=False))
    rows.append(ev.evaluate(args.swaps, args.horizon, args.sinks, **overrides, record=False))
    if args.json:
        print(json.dumps(rows if args.baseline else rows[0], indent=2))
    else:
        for r in rows:
            print(_fmt(r))
        if args.baseline:
            d, se = paired_difference(rows[1]["window_losses"], rows[0]["window_losses"])
            print(f"swap - baseline: {d:+.4f}{format_se(se)} nats/token (paired over the same windows), "
                  f"{rows[1]['bpb'] - rows[0]['bpb']:+.4f} bits/byte")
    if not args.no_record:  # after printing: a workdir that cannot be written loses nothing
        record_rows(ev, rows, quiet=args.json)
    return 0


def cmd_ruler(args) -> int:
    """``hybrid-lm ruler``: RULER-offline on a checkpoint; the table is printed before the rows are recorded."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    lengths = parse_lengths(args.lengths) if args.lengths else None
    try:
        cfg = load_run_config(args.workdir)
    except FileNotFoundError as e:
        raise WorkdirError(str(e)) from None
    # checked before restoring anything: a bad task or length fails in a second
    tasks, lengths = ruler.check_request(cfg, tasks, lengths, args.haystack, args.allow_longer, args.samples)
    try:
        run = RestoredRun(args.workdir, step=args.step)
    except FileNotFoundError as e:
        raise WorkdirError(f"{e}: train the run first, or give a --step that was saved") from None
    rows, skipped = ruler.evaluate_ruler(run, tasks=tasks, lengths=lengths, samples=args.samples,
                                         haystack=args.haystack, seed=args.seed, allow_longer=args.allow_longer,
                                         batch_size=args.batch_size, progress=not args.json)
    if args.json:
        print(json.dumps({"rows": rows, "skipped": skipped}, indent=2))
    else:
        print(format_table(rows, skipped))
    if not rows:
        raise ConfigError(f"every requested (task, length) is too short for its task ({skipped[0]['reason']}): "
                          "use longer --lengths (with --allow-longer beyond the run's seq_len)")
    if not args.no_record:  # after printing: a workdir that cannot be written loses nothing
        record_rows(run, rows, quiet=args.json)
    return 0


_GENERATE_HELP = ("Tokenise PROMPT with the run's tokenizer, run it through WORKDIR's checkpoint in eval mode "
                  "(prefill), then decode one token at a time from each layer's cache. Prints the prompt "
                  "followed by the decoded continuation.")


def _generate_description() -> str:
    """``generate``'s description, each registered mixer on the side of its decode path."""
    mixers = registered_mixers().values()
    decodes = "; ".join(f"{m.name}: {m.decode or 'its decode state'}" for m in mixers if m.decodes)
    refused = ", ".join(m.name for m in mixers if not m.decodes)
    text = (f"Tokenise PROMPT with the run's tokenizer, run it through WORKDIR's checkpoint in eval mode "
            f"(prefill), then decode one token at a time from each layer's cache ({decodes}).")
    if refused:
        text += (f" {refused} layers have no decode path: a model with such a layer is refused (score it with "
                 "`hybrid-lm eval`).")
    return text + " Prints the prompt followed by the decoded continuation."


def _fill_from_registry(parser, describe) -> None:
    """Build ``parser``'s description with ``describe()`` only when its help is shown: the registry
    imports every mixer (JAX, Flax), which the other commands' start-up need not pay for."""
    shown = parser.format_help

    def format_help():
        parser.description = describe()
        return shown()

    parser.format_help = format_help


def _add_eval(sub) -> None:
    """``hybrid-lm eval``: the suite's options generated from :class:`~hybrid_lm.eval.suite.EvalRequest`."""
    p = sub.add_parser(
        "eval", help="evaluate a run's checkpoints: --tasks loss,longppl,ruler,probe,heads,influence,lm_eval",
        description="With --tasks: run each task on each of --steps (latest, all, or S1,S2) of WORKDIR, print a "
                    "table per task, append rows to WORKDIR/eval.jsonl (a rerun supersedes) and draw the plots "
                    "into WORKDIR/eval/ (docs/EVAL.md). --swap / --horizon / --sinks / --seq-len apply to every "
                    "task. Without --tasks: the val loss and bits/byte of WORKDIR's checkpoint with its "
                    "attention layers swapped and/or its full-attention layers limited to the last H tokens "
                    "plus S sinks, without retraining (--baseline: also unswapped).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="swap spec: SLOT=KIND[:W][,key=value...]; SLOT is full or efficient; W is the window (swa, sa), "
               "the key budget top_k*block_size (moba), or the horizon (attention_sink).\n"
               "examples: --swap full=swa:128   --swap efficient=sa:128,eval_draws=4   "
               "--swap full=moba:256,block_size=32,gate=moba   --horizon 2048 --sinks 4")
    p.add_argument("workdir", help="run directory (config.json + checkpoints/)")
    add_request_options(p, lambda f, opt: opt.without_tasks)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest that restores)")
    p.add_argument("--baseline", action="store_true", help="also evaluate the unswapped model and print the difference")
    p.add_argument("--no-record", dest="no_record", action="store_true", help="do not append to eval.jsonl")
    p.add_argument("--json", action="store_true", help="print the row(s) as JSON")
    g = p.add_argument_group("evaluation suite (hybrid_lm/eval/suite.py, docs/EVAL.md)")
    add_request_options(g, lambda f, opt: f.name == "tasks")
    g.add_argument("--steps", default=None, metavar="latest|all|S1,S2",
                   help="checkpoints to evaluate (default latest); plots over them go to WORKDIR/eval/")
    add_request_options(g, lambda f, opt: not opt.without_tasks and f.name != "tasks")
    g.add_argument("--no-plots", dest="no_plots", action="store_true", help="do not draw WORKDIR/eval/*.png")
    p.set_defaults(fn=cmd_eval)


def _add_eval_report(sub) -> None:
    """``hybrid-lm eval-report``."""
    p = sub.add_parser(
        "eval-report", help="overlay runs' eval results: one curve per architecture against tokens seen",
        description="Read eval.jsonl of every run under SWEEP_ROOT (or of the RUN_DIRs given) and plot, per task "
                    "and eval config, each task's headline number against tokens seen, one curve per "
                    "architecture (and model size). Prints the table; plots go to --out.")
    p.add_argument("runs", nargs="+", help="a sweep root or run directories")
    p.add_argument("--tasks", default=None, metavar="T1,T2",
                   help="only these tasks, of loss,longppl,ruler,probe,heads,influence,lm_eval (default: every "
                        "task found)")
    p.add_argument("--out", default=None, help="plot directory (default: <first path>/eval_report)")
    p.set_defaults(fn=cmd_eval_report)


def _add_generate(sub) -> None:
    """``hybrid-lm generate``."""
    p = sub.add_parser(
        "generate", help="continue a prompt with a run's checkpoint (greedy or sampled)",
        description=_GENERATE_HELP)
    _fill_from_registry(p, _generate_description)  # the mixers' decode states: from the registry, when shown
    p.add_argument("workdir", help="run directory (config.json + checkpoints/)")
    p.add_argument("--prompt", required=True, help="text to continue (at least one token)")
    p.add_argument("--max-new", "--max_new", dest="max_new", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy, the argmax (default 0)")
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=None,
                   help="with --temperature > 0: sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, with --temperature > 0 (default 0)")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the latest that restores)")
    p.add_argument("--attention-impl", dest="attention_impl", default=None,
                   choices=("auto", "xla", "cudnn", "pallas", "jla"),
                   help="attention kernel of the prefill (default: the run's ModelConfig.attention_impl)")
    p.add_argument("--json", action="store_true",
                   help="print checkpoint step, prompt, continuation, token ids and sampling settings as JSON")
    p.set_defaults(fn=cmd_generate)


def _add_longppl(sub) -> None:
    """``hybrid-lm longppl``."""
    p = sub.add_parser(
        "longppl", help="LongPPL: perplexity on the key tokens that need long context (Fang et al. 2025)",
        description="Mark key tokens of the run's validation documents with an evaluator run (long context "
                    "lowers their NLL by more than alpha, and their full-context NLL is below -beta), then "
                    "report exp(mean NLL) of WORKDIR's checkpoint on them. Appends to WORKDIR/eval.jsonl.")
    p.add_argument("workdir", help="run directory of the evaluated checkpoint")
    p.add_argument("--evaluator", default=None,
                   help="run directory of the evaluator, 'newest' (default: the run's newest checkpoint) or 'self'")
    p.add_argument("--evaluator-step", dest="evaluator_step", type=int, default=None)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest that restores)")
    p.add_argument("--length", type=int, default=None,
                   help="tokens a document is cut to (default: 32767, at most the run's seq_len + 1)")
    p.add_argument("--min-tokens", dest="min_tokens", type=int, default=None,
                   help="documents shorter than this are left out (default 16384, at most the length)")
    p.add_argument("--data", default=None, metavar="STORE",
                   help="a prepared token store whose val documents are read (default: the run's own)")
    p.add_argument("--inputs", default="documents", choices=("documents", "windows"),
                   help="whole val documents (default) or the run's eval windows, which cross documents")
    p.add_argument("--docs", type=int, default=None,
                   help="number of documents (default 50; 8 windows with --inputs windows)")
    p.add_argument("--trunc-len", dest="trunc_len", type=int, default=4096, help="K, the short context")
    p.add_argument("--window", type=int, default=1024, help="W, targets per short-context pass")
    p.add_argument("--alpha", type=float, default=2.0)
    p.add_argument("--beta", type=float, default=-2.0)
    p.add_argument("--no-record", dest="no_record", action="store_true", help="do not append to eval.jsonl")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_longppl)


def _add_ruler(sub) -> None:
    """``hybrid-lm ruler``."""
    p = sub.add_parser(
        "ruler", help="RULER-offline: needle, variable-tracking and word-extraction tasks at long lengths",
        description="Generate RULER's synthetic tasks (deterministic from the seed, cached under data_cache/ruler/, "
                    "no download) at each length in tokens of the run's tokenizer, and score WORKDIR's checkpoint "
                    "by exact match of greedy generation (a mixer without a decode path, attention_sink, gets "
                    "log-likelihood scores only) and by the gold answer's NLL under teacher forcing, against the "
                    "distractors where the task has them. Prints a task x length table, then appends a row per "
                    "(task, length) to WORKDIR/eval.jsonl. See docs/EVAL.md.",
        epilog=f"tasks: {', '.join(RULER_TASKS)}.  example: hybrid-lm ruler runs/quickstart --lengths 512,1K "
               "--allow-longer --samples 4")
    p.add_argument("workdir", help="run directory (config.json + checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest that restores)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: all seven)")
    p.add_argument("--lengths", default=None, metavar="L1,L2",
                   help="prompt + answer lengths in tokens, e.g. 4K,8K (default: 4K, 8K, 16K, 32K up to the run's "
                        "seq_len, else the seq_len)")
    p.add_argument("--allow-longer", dest="allow_longer", action="store_true",
                   help="allow lengths beyond the run's seq_len")
    p.add_argument("--samples", type=int, default=8, help="items per (task, length) (default 8)")
    p.add_argument("--haystack", default=None, choices=HAYSTACKS,
                   help="filler text of the needle tasks: the embedded essays, the run's corpus (val split), or "
                        "RULER's repeated noise line (default: RULER's per task: essays for niah, noise for vt)")
    p.add_argument("--seed", type=int, default=0, help="item seed (default 0)")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=None,
                   help="rows per forward pass (default: the trainer's tokens per step at each length)")
    p.add_argument("--no-record", dest="no_record", action="store_true", help="do not append to eval.jsonl")
    p.add_argument("--json", action="store_true", help="print the rows (and skipped pairs) as JSON")
    p.set_defaults(fn=cmd_ruler)


def add_eval_commands(sub) -> None:
    """Add ``eval``, ``eval-report``, ``generate``, ``longppl``, ``ruler``, ``export`` and ``lm-eval`` to the
    ``hybrid-lm`` subparsers."""
    _add_eval(sub)
    _add_eval_report(sub)
    _add_generate(sub)
    _add_longppl(sub)
    _add_ruler(sub)
    add_export_command(sub)
    add_lm_eval_command(sub)
