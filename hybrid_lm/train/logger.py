"""What a run reports: the start-up summary, one metrics row per log point, and a progress display.

``metrics.jsonl`` is the record; TensorBoard (``[tb]`` extra) and Weights & Biases (``[wandb]``
extra; ``WANDB_MODE=offline`` writes under the run dir) mirror its scalars. On a terminal the
progress is a tqdm bar; otherwise (a log file) one plain line per ``log_every``.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
from tqdm.auto import tqdm

from hybrid_lm import backends
from hybrid_lm.describe import describe_layers
from hybrid_lm.run.loss import format_se, row_window_losses
from hybrid_lm.config import Config, TrainConfig
from hybrid_lm.model.accounting import PEAK_FLOPS_H200_BF16, count_params, flops_per_token
from hybrid_lm.optional import optional_import
from hybrid_lm.run.directory import metrics_path
from hybrid_lm.run.metrics import MetricsWriter, plot_loss_curve, read_metrics
from hybrid_lm.experiment import config_record, run_id
from hybrid_lm.data.identity import data_label

if TYPE_CHECKING:
    from hybrid_lm.data.pipeline import DataStreams

log = logging.getLogger(__name__)


def check_extras(tc: TrainConfig) -> None:
    """Import what the configured sinks need, so a missing extra fails before anything is created."""
    if tc.tensorboard:
        optional_import("tensorboardX")
    if tc.wandb:
        optional_import("wandb")


def _scalars(row: dict):
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "resumed_from")}


class TensorBoardSink:
    def __init__(self, logdir: Path):
        self._w = optional_import("tensorboardX").SummaryWriter(str(logdir))

    def write(self, row: dict) -> None:
        for k, v in _scalars(row).items():
            self._w.add_scalar(f"{row.get('kind', 'train')}/{k}", v, row["step"])

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """One W&B run per run dir (its id is kept in ``<workdir>/wandb_id``, so a resume continues it).
    The project is ``$WANDB_PROJECT`` (default ``hybrid_lm``); ``$WANDB_MODE`` is honoured."""

    def __init__(self, cfg: Config, workdir: Path):
        wandb = optional_import("wandb")
        id_file = workdir / "wandb_id"
        wandb_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(wandb_id + "\n")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hybrid_lm"), name=workdir.name, id=wandb_id,
                               resume="allow", dir=str(workdir), config={**config_record(cfg), "run_id": run_id(cfg)},
                               mode=os.environ.get("WANDB_MODE") or None)

    def write(self, row: dict) -> None:
        kind = row.get("kind", "train")
        self._run.log({f"{kind}/{k}": v for k, v in _scalars(row).items()}, step=row["step"])

    def close(self) -> None:
        self._run.finish()


class StepLogger:
    """Rows of finished steps and evals (written by process 0 only), the progress display, and the
    step-time window: the first window starts when the train step has compiled (:meth:`compiled`)."""

    def __init__(self, cfg: Config, workdir: Path, *, main: bool, start: int, n_devices: int,
                 every_step: bool = False, stream=None, clock=time.time):
        self.cfg, self.workdir, self.main = cfg, Path(workdir), main
        self.clock = clock  # seconds; tests inject their own
        self.every_step = every_step  # a mixer asked for its stats every step (ModelFns.step_stats)
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.train_flops = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
        self.peak = PEAK_FLOPS_H200_BF16 * n_devices if backends.on_gpu() else None
        self.skipped = _skipped_before(metrics_path(self.workdir), start) if main else 0  # in the whole run
        self.stream = stream if stream is not None else sys.stdout
        show = cfg.train.progress and main
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain = show and not tty  # one plain line per log_every instead of a bar
        self.bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps), desc=f"train {self.workdir.name}",
                        disable=not (show and tty), dynamic_ncols=True, file=self.stream)
        self.record = MetricsWriter(metrics_path(self.workdir)) if main else None
        self.sinks = []
        if main and cfg.train.tensorboard:
            self.sinks.append(TensorBoardSink(self.workdir / "tb"))
        if main and cfg.train.wandb:
            self.sinks.append(WandbSink(cfg, self.workdir))
        self._window = (self.clock(), start)
        self._t_compile = self.clock()
        self._title = f"{self.workdir.name}: {count_params(cfg.model)['non_embedding']:,} non-embedding params"
        self.compile_seconds: float | None = None
        self._unplotted = False  # rows written since loss_curve.png was drawn
        # the first train row of a session that restored a checkpoint says from which step (loss_curve.png marks it)
        self._resumed_from = start if start > 0 else None

    # -- text

    def say(self, text: str) -> None:
        if self.main:
            tqdm.write(text, file=self.stream)
            self.stream.flush()

    def summary(self, lines: list[str]) -> None:
        for line in lines:
            self.say(line)

    def compiling(self) -> None:
        self.say("compiling…")
        self._t_compile = self.clock()

    def compiled(self, step: int) -> None:
        """The first train step has been dispatched (jit compiles synchronously): start the window."""
        now = self.clock()
        self.compile_seconds = now - self._t_compile
        self.say(f"compiled in {self.compile_seconds:.1f} s")
        self._window = (now, step)

    # -- rows

    def _write(self, row: dict) -> None:
        if self.record is not None:
            self.record.write(row)
            self._unplotted |= row["kind"] != "summary"
            for sink in self.sinks:
                sink.write(row)

    def train_row(self, done: int, stats: dict, *, halted: bool = False) -> None:
        """Host-side stats (``jax.device_get``'d) of finished step ``done``; writes a row when due.
        A non-finite step is counted as skipped, unless it ``halted`` the run (NaN policy): then
        the run stops before it, and its row says ``"halted": true``."""
        tc = self.cfg.train
        finite = bool(stats["finite"])
        if not finite and not halted:
            self.skipped += 1
            log.warning("step %d: non-finite loss/gradient, update skipped (%d so far)", done, self.skipped)
        due = done % tc.log_every == 0 or done == tc.steps
        if not (due or not finite or halted or self.every_step):
            return
        now = self.clock()
        t0, s0 = self._window
        step_time = (now - t0) / max(done - s0, 1)
        tps = self.tokens_per_step / max(step_time, 1e-9)
        self._window = (now, done)
        loss = float(stats["loss"])
        row = {"kind": "train", "step": done, "tokens": done * self.tokens_per_step, "loss": loss,
               "objective": float(stats["objective"]), "lr": float(stats["lr"]),
               "grad_norm": float(stats["grad_norm"]), "param_norm": float(stats["param_norm"]),
               "update_norm": float(stats["update_norm"]), "step_time": step_time,
               "tokens_per_sec": tps, "skipped": not (finite or halted), "skipped_total": self.skipped,
               "attention_impl": self.cfg.model.attention_impl, "attention_backends": backends.recorded_backends()}
        row.update({k: float(v) for k, v in stats.items() if k not in row and k != "finite"})
        if halted:
            row["halted"] = True
        if self._resumed_from is not None:
            row["resumed_from"], self._resumed_from = self._resumed_from, None
        if self.peak is not None:
            row["mfu"] = tps * self.train_flops / self.peak
        self._write(row)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        if self.plain and due:
            self.say(f"step {done}/{tc.steps}  loss {loss:.4f}  lr {row['lr']:.3g}  {tps:,.0f} tok/s")

    def eval_row(self, step: int, result: dict, order0_entropy_bits=None) -> dict:
        """An eval row from :func:`hybrid_lm.run.loss.evaluate`'s result; refreshes ``loss_curve.png``."""
        row = {"kind": "eval", "step": step, "tokens": step * self.tokens_per_step, "loss": result["loss"],
               "loss_se": result["loss_se"], "bpb": result["bpb"], "bpb_se": result["bpb_se"],
               "order0_entropy_bits": order0_entropy_bits, "eval_windows": result["eval_windows"],
               "eval_s": round(result["eval_s"], 3),
               "window_losses": row_window_losses(result["window_losses"])}
        self._write(row)
        if self.record is not None:
            self.say(f"step {step}: val loss {row['loss']:.4f}{format_se(row['loss_se'])} nats, {row['bpb']:.3f} bits/byte "
                     f"({row['eval_windows']} windows)")
            self._plot()
        return row

    def closing_row(self, step: int, status: str) -> None:
        """The run's last row: ``{"kind": "summary", "step", "status", "skipped_steps"}`` (status:
        finished, preempted, stopped: non-finite; skipped steps of the whole run)."""
        self._write({"kind": "summary", "step": step, "status": status, "skipped_steps": self.skipped})

    def _plot(self) -> None:
        plot_loss_curve(self.record.path, self.workdir / "loss_curve.png", title=self._title)
        self._unplotted = False

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar, the record and the sinks; ``loss_curve.png`` is redrawn if rows came after it."""
        self.bar.close()
        if self.record is not None:
            self.record.close()
            if self._unplotted:
                self._plot()
        for sink in self.sinks:
            sink.close()


def _skipped_before(metrics: Path, start: int) -> int:
    """Skipped steps recorded up to step ``start`` (a resumed run counts its earlier sessions')."""
    if start == 0 or not metrics.exists():
        return 0
    return sum(1 for r in read_metrics(metrics, "train") if r["step"] <= start and r.get("skipped"))


def startup_summary(cfg: Config, data: DataStreams, mesh) -> list[str]:
    """The lines printed before compiling: model, params, backends per layer, data, mesh."""
    m, counts = cfg.model, count_params(cfg.model)
    slots = [f"{s}={mc.kind}" + (f" w={mc.window}" if mc.window else "") + (f" {dict(mc.options)}" if mc.options else "")
             for s, mc in (("F", m.full), ("E", m.efficient)) if s in m.layer_types()]
    uses: dict[tuple, list[int]] = {}
    for r in describe_layers(m, cfg.data.seq_len):
        uses.setdefault((r["kind"], r["op"], r["backend"], r["reason"]), []).append(r["layer"])
    lines = [f"model    {m.n_layers} layers, pattern {m.layer_pattern!r} = {''.join(m.layer_types())}, "
             f"{', '.join(slots)}, d_model {m.d_model}",
             f"params   {counts['total']:,} total, {counts['non_embedding']:,} non-embedding"]
    for (kind, op, backend, why), layers in uses.items():
        use = f"{op} -> {backend}" + (f" ({why})" if why else "") if op is not None else why
        lines.append(f"backend  layer {','.join(map(str, layers))} {kind}: {use}")
    micro = cfg.train.global_batch // cfg.train.microbatches * cfg.data.seq_len
    loss, why = backends.loss_backend(m.loss_impl, micro, m.vocab_size)
    if loss == "chunked":
        kernel, kwhy = backends.loss_kernel_backend()
        why += f"; softmax pass {kernel}: {kwhy}"
    lines.append(f"backend  loss: {loss} ({why}; {micro:,} tokens per micro-batch)")
    if any(mc.kind in ("mamba2", "gdn") for mc in (m.full, m.efficient)):
        lines.append("backend  short convs' backward: {} ({})".format(*backends.conv_kernel_backend()))
    train_tokens = data.meta.get("train_tokens")
    lines += [f"data     {data_label(cfg.data)}: " + (f"{train_tokens:,} train tokens, " if train_tokens else "")
              + f"{data.n_train_windows:,} train windows of {cfg.data.seq_len} tokens, "
              f"{len(data.eval_tokens)} eval windows; {cfg.train.global_batch} x {cfg.data.seq_len} tokens/step",
              f"mesh     {dict(mesh.shape)} on {mesh.devices.size} {jax.default_backend()} device(s), "
              f"{jax.process_count()} process(es)"]
    return lines
