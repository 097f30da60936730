"""The evaluation suite's time: ``hybrid-lm eval --tasks ...`` on one checkpoint, each task's wall time and the
whole call's (restore, compiles and plots included).

    python experiments/bench_eval.py                         # GPU: trains a short S1 run at 16K, then times it
    python experiments/bench_eval.py --run runs/s1 --tasks loss,longppl,ruler
    python experiments/bench_eval.py --quick                 # a tiny CPU run and small task settings

Without ``--run`` a run is trained first into a temporary directory (``--scale``, ``--train-steps`` steps of
``--global-batch`` x ``--seq-len`` tokens of the embedded corpus, a checkpoint at the end; ``--keep DIR`` trains
into DIR and keeps it, with the suite's plots in ``DIR/eval/``; ``--train-only`` stops there, so that a later
``--run DIR`` times the suite alone). Then every task of ``--tasks`` runs on its
latest checkpoint in one ``hybrid-lm eval`` call with the tasks' own defaults, the papers' (docs/EVAL.md), as a
user runs it; each task's wall time is the suite's own record (``task_wall_s`` in ``eval.jsonl``), and ``all``
is the whole call. No anchor: the numbers are seconds a user waits.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import load_config  # noqa: E402

BENCH = "eval"
TASKS = "loss,longppl,ruler,probe,heads,influence"
# the task settings of the GPU run (a 16K S1 checkpoint: every task's default, the papers') and of --quick
# (a tiny CPU run at seq_len 32: small samples, prompts of exactly 512 tokens, RULER at 1K)
EVAL_ARGS = ""
QUICK_EVAL_ARGS = ("--seq-len 512 --allow-longer --samples 40 --probe-prompt exact --ruler-tasks niah_single "
                   "--ruler-lengths 1K --trunc-len 8 --window 8 --docs 2")
QUICK_TRAIN = ["ModelConfig.d_model = 32", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 2",
               "ModelConfig.n_kv_heads = 1", "ModelConfig.d_ff = 64", "ModelConfig.compute_dtype = 'float32'",
               "efficient/swa/MixerConfig.window = 8", "DataConfig.seq_len = 32", "TrainConfig.global_batch = 4",
               "DataConfig.eval_windows = 8", "OptimConfig.warmup_steps = 5", "OptimConfig.lr = 3e-3"]


def train_run(workdir: Path, scale: str | None, steps: int, seq_len: int, batch: int, quick: bool) -> float:
    """Train the run to evaluate; returns its seconds."""
    from hybrid_lm.train.loop import train

    common = [f"TrainConfig.steps = {steps}", f"CheckpointConfig.every_steps = {steps}",
              f"TrainConfig.eval_every = {steps}", "TrainConfig.progress = False",
              "CheckpointConfig.async_save = False"]
    if quick:
        cfg = load_config([], QUICK_TRAIN + common)
    else:
        cfg = load_config([f"scale/{scale}.gin"], [f"DataConfig.seq_len = {seq_len}",
                                                   f"TrainConfig.global_batch = {batch}", "DataConfig.eval_windows = 2",
                                                   "OptimConfig.warmup_steps = 10", *common])
    t0 = time.time()
    train(cfg, workdir)
    return time.time() - t0


def main(argv=None) -> dict:
    ap = harness.parser(BENCH, __doc__)
    ap.add_argument("--run", default=None, help="run directory to evaluate (default: train one first)")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--eval-args", default=None, help=f"more hybrid-lm eval arguments (default {EVAL_ARGS!r}; "
                                                      f"--quick: {QUICK_EVAL_ARGS!r})")
    ap.add_argument("--scale", default="s1")
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--keep", default=None, metavar="DIR", help="train into DIR and keep it (default: a temporary "
                                                                "directory, removed at the end)")
    ap.add_argument("--train-only", action="store_true",
                    help="with --keep: train and stop (time the suite later with --run DIR)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args(argv)
    if args.train_only and (args.run or not args.keep):
        raise SystemExit("--train-only needs --keep DIR (the run to time later with --run DIR), not --run")
    eval_args = shlex.split(args.eval_args if args.eval_args is not None else
                            (QUICK_EVAL_ARGS if args.quick else EVAL_ARGS))
    from hybrid_lm.cli import main as cli
    from hybrid_lm.eval.suite import current_rows

    t_start = time.time()
    tmp = None
    extra = {}
    if args.run:
        run = Path(args.run)
    else:
        if args.keep:
            run = Path(args.keep)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="bench_eval_")
            run = Path(tmp.name) / "run"
        steps = min(args.train_steps, 10) if args.quick else args.train_steps
        extra["train"] = dict(scale=None if args.quick else args.scale, steps=steps,
                              seconds=train_run(run, args.scale, steps, args.seq_len, args.global_batch, args.quick))
    if args.train_only:
        print(f"trained {run} in {extra['train']['seconds']:.0f} s; time the suite with --run {run}")
        return {"rows": []}
    since = time.strftime("%Y-%m-%dT%H:%M:%S")  # the suite's row time: this call's rows are the ones since
    t0 = time.time()
    rc = cli(["eval", str(run), "--tasks", args.tasks, "--steps", "latest", *eval_args])
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"hybrid-lm eval exited {rc}")
    new = [r for r in current_rows(run) if r.get("time", "") >= since and "task" in r]
    step = max((r.get("checkpoint_step", 0) for r in new), default=None)
    rows = []
    for task in args.tasks.split(","):
        walls = [r["task_wall_s"] for r in new if r.get("task_wall_s") is not None
                 and (r["task"] == task or str(r["task"]).startswith(task + "/"))]
        rows.append({"task": task, "wall_s": max(walls) if walls else None, "rows": len(walls)})
    rows.append({"task": "all", "wall_s": wall, "rows": len(new)})
    harness.print_table(["task", "wall s", "rows"], [[r["task"], harness.fmt(r["wall_s"], ".1f"), r["rows"]]
                                                     for r in rows])
    path = harness.write_result(BENCH, args.out, argv, rows, started=t_start, checkpoint_step=step,
                                eval_args=eval_args, **extra)
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()
    return {"rows": rows}


if __name__ == "__main__":
    main()
