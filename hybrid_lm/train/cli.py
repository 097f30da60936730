"""``hybrid-lm train`` and ``hybrid-lm info`` (registered by :func:`add_train_commands`)."""

from __future__ import annotations

import argparse
import json
import sys

from hybrid_lm import backends, describe, signals
from hybrid_lm.experiment import load_config, run_id, validate_experiment, vocab_note
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.train.loop import NonFiniteError, train
from hybrid_lm.train.microbatch import measured_per_device, rule_for


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="+", help="gin file(s), applied in order")
    p.add_argument("--gin_param", "--gin-param", action="append", default=[], metavar="K=V",
                   help="extra gin binding, e.g. TrainConfig.steps=100 (repeatable)")


def order0_comparison(bpb: float, h0: float) -> str:
    """How a model's bits/byte compares with the order-0 (unigram) entropy ``h0``."""
    rel = 100 * (bpb - h0) / h0
    if rel <= 0:
        return f"{-rel:.1f}% below the order-0 entropy"
    return f"{rel:.1f}% above the order-0 entropy: worse than a unigram model"


def cmd_train(args) -> int:
    # SIGTERM, SIGUSR1 and Ctrl-C are caught from here to the end: one during start-up stops the run
    # cleanly rather than killing it (signals.py)
    with signals.catching():
        cfg = load_config(args.config, args.gin_param)
        try:
            res = train(cfg, args.workdir, force=args.force, restart=args.restart, init_from=args.init_from)
        except NonFiniteError as e:  # the NaN policy stopped the run (the last good state is saved)
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _report_train(res)


def _report_train(res) -> int:
    skipped = f"   skipped steps {res.skipped_steps}"
    if res.preempted:
        requeued = f"; {res.requeued}" if res.requeued else ""
        if res.before_training:
            newest = f"its newest checkpoint is step {res.step}" if res.step else "it has no checkpoint yet"
            print(f"\n{res.preempted} before training started: nothing new to save ({newest}); run the same "
                  f"command to resume{requeued}")
        else:
            print(f"\n{res.preempted}: saved a checkpoint at step {res.step} in {res.workdir} and stopped; "
                  f"run the same command to resume ({skipped.strip()}){requeued}")
        return 0
    ev = res.final_eval or {}
    print(f"\nrun dir: {res.workdir}   step {res.step}   wall {res.wall_seconds:.1f} s{skipped}"
          + (f"   (resumed from step {res.resumed_from})" if res.resumed_from is not None else "")
          + (f"   (initialised from {res.init_from})" if res.init_from and res.resumed_from is None else ""))
    if res.late_signal:
        print(f"{res.late_signal} arrived after the last step: the run finished first (final checkpoint, loss curve)")
    if ev:
        h0 = ev.get("order0_entropy_bits")
        line = f"val bits/byte {ev['bpb']:.3f}"
        if h0:
            line += f"   val order-0 entropy {h0:.3f} bits/byte   ({order0_comparison(ev['bpb'], h0)})"
        print(line)
    return 0


def cmd_info(args) -> int:
    cfg = load_config(args.config, args.gin_param, validate=False)
    validate_experiment(cfg, purpose="info")  # the vocabulary note is a line of the report, not a warning
    if args.backends:
        return _info_backends(cfg, args.json)
    counts = count_params(cfg.model)
    flops = flops_per_token(cfg.model, cfg.data.seq_len)

    micro, why = rule_for(cfg, batch_shards=1)
    info = {"run_id": run_id(cfg), "layer_types": "".join(cfg.model.layer_types()),
            "seq_len": cfg.data.seq_len, "params": counts, "flops_per_token": flops,
            "microbatch": {"measured_per_device": measured_per_device(cfg), "microbatches_on_one_device": micro,
                           "reason": why, "applied_by": "hybrid-lm sweep",
                           "configured": cfg.train.microbatches},
            "vocab_note": vocab_note(cfg)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = cfg.model
    print(f"run id {info['run_id']}   layers {m.n_layers} ({info['layer_types']})   d_model {m.d_model}   "
          f"heads {m.n_heads} (kv {m.n_kv_heads}) x {m.resolved_head_dim}   d_ff {m.d_ff}   vocab {m.vocab_size}")
    if info["vocab_note"]:
        print(f"note: {info['vocab_note']} (`train` warns about it)")
    print(f"\n{'parameters':<28}{'count':>16}{'millions':>12}")
    for k in ("total", "non_embedding", "embedding", "head"):
        print(f"{k:<28}{counts.get(k, 0):>16,}{counts.get(k, 0) / 1e6:>12.1f}")
    print(f"\n{'layer type':<22}{'layers':>7}{'mixer':>14}{'mlp':>14}{'norms':>10}")
    for t, c in counts["per_layer_type"].items():
        print(f"{t:<22}{c['layers']:>7}{c.get('mixer', 0):>14,}{c.get('mlp', 0):>14,}{c.get('norms', 0):>10,}")
    print(f"\nforward FLOPs per token at seq_len {cfg.data.seq_len:,} (2 per MAC):")
    print(f"{'layer type':<22}{'layers':>7}{'projections':>14}{'attention/mix':>15}{'mlp':>14}{'per layer':>14}")
    for t, f in flops["per_layer_type"].items():
        print(f"{t:<22}{f['layers']:>7}{f['mixer_matmul']:>14.4g}{f['mixing']:>15.4g}{f['mlp']:>14.4g}"
              f"{f['per_layer']:>14.4g}")
    print(f"{'lm head':<29}{flops['head']:>14.4g}")
    print(f"total forward {flops['forward']:.4g}   train (3x) {flops['train']:.4g} FLOPs/token")
    print(f"\nmicro-batches for global_batch {cfg.train.global_batch} on one device: {micro} ({why})")
    if "; peak " in why:
        print(f"  a device with less memory takes fewer sequences per micro-batch: `hybrid-lm sweep` fits the "
              f"entry to each device's limit (train.microbatch.fit_to_memory)")
    if micro != cfg.train.microbatches:  # the sweep launcher applies the rule; a plain train takes the config
        print(f"  applied by `hybrid-lm sweep`; `hybrid-lm train` uses TrainConfig.microbatches = "
              f"{cfg.train.microbatches} as configured (add --gin_param \"TrainConfig.microbatches = {micro}\")")
    return 0


def _info_backends(cfg, as_json: bool) -> int:
    m = cfg.model
    rows = describe.describe_layers(m, cfg.data.seq_len, document_mask=cfg.data.document_mask)
    head = {"platform": backends.current_platform(), "seq_len": cfg.data.seq_len, "compute_dtype": m.compute_dtype,
            "attention_impl": m.attention_impl, "linear_impl": m.linear_impl}
    if as_json:
        print(json.dumps({**head, "layers": rows}, indent=2))
        return 0
    print("   ".join(f"{k} {v}" for k, v in head.items()))
    print("\n".join(describe.format_layers(rows)))
    return 0


def add_train_commands(sub) -> None:
    """Add ``train`` and ``info`` to the ``hybrid-lm`` subparsers."""
    p = sub.add_parser("train", help="train (resumes from the latest checkpoint in --workdir)",
                       epilog="Signals: SIGTERM or Ctrl-C saves a checkpoint after the current step and stops (a "
                              "second Ctrl-C exits at once, keeping the newest checkpoint); SIGUSR1 (SLURM --signal) "
                              "also requeues the job. Several processes, SLURM and requeue: docs/CLUSTERS.md")
    _add_config_args(p)
    p.add_argument("--workdir", default=None, help="run directory (default runs/<run id>)")
    p.add_argument("--force", action="store_true", help="resume even if the workdir holds a different experiment")
    p.add_argument("--restart", action="store_true",
                   help="archive the workdir's metrics and checkpoints to archive/<UTC time>/ and train from step 0")
    p.add_argument("--init-from", default=None, metavar="RUN_DIR[@STEP]|hf:DIR",
                   help="continued pretraining: a new run from that run's parameters at STEP (default: its newest "
                        "checkpoint), with a fresh optimizer state and schedule; seq_len, data and RoPE theta may "
                        "change, parameter shapes may not. hf:DIR: a Hugging Face folder (Llama, Mistral, "
                        "Ministral, Qwen3, SmolLM3), whose config.json gives the model (docs/INTEROP.md). A rerun "
                        "of the same command resumes the new run")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("info", help="parameter counts and FLOPs per token per layer type")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--backends", action="store_true",
                   help="instead: the backend each layer's ops resolve to on this platform, and why")
    p.set_defaults(fn=cmd_info)
