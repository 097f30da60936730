"""A run's checkpoint restored for inference, shared by ``hybrid-lm eval``, ``generate`` and ``longppl``.

``RestoredRun(workdir, step=None)`` reads the run directory's ``config.json``, restores the parameters
(no optimizer state) of ``step`` or of the newest checkpoint that restores
(:meth:`~hybrid_lm.run.checkpoint.Checkpointer.restore_params`), laid out on a mesh of this host's
devices (the run's mesh, else data-parallel), and holds the ``ModelFns``; the tokenizer and the data
streams (fixed eval windows, bytes per token) are built on first use. :meth:`RestoredRun.evaluate` is
the trainer's eval on the checkpoint, optionally with attention swaps or a receptive-field constraint
(``hybrid_lm/run/swap.py`` rewrites the config); its rows are appended to ``<workdir>/eval.jsonl``.

Python: ``RestoredRun(workdir).evaluate(swaps=['full=swa:128'], horizon=..., sinks=...)`` restores once
and evaluates any number of settings; CLI: ``hybrid-lm eval WORKDIR --swap full=swa:128``.

A Hugging Face model folder (``hf:DIR``, or a path to one) is taken wherever a run directory is: its
config comes from ``config.json`` and its one set of weights (step 0) from its safetensors
(``hybrid_lm/run/hf.py``), and the rows and plots go into DIR (``--no-record`` writes nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax

from hybrid_lm import sharding as shd
from hybrid_lm.backends import recorded_backends
from hybrid_lm.config import Config
from hybrid_lm.data.identity import data_label
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.data.tokenizer import get_tokenizer
from hybrid_lm.experiment import run_id
from hybrid_lm.run.directory import (check_recorded_paths, checkpoint_dir, config_path, eval_rows_path, load_run_config,
                                     metrics_path)
from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.files import append_jsonl
from hybrid_lm.run import loss
from hybrid_lm.run.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.run.hf import HFCheckpoint, hf_folder
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.run.swap import SwapError, describe, parse_swap, swapped_config
from hybrid_lm.step import ModelFns, make_eval_step

log = logging.getLogger(__name__)


EMBEDDED = "embedded"  # --data embedded: the embedded essays, asked for by name


def scored_on(d) -> str:
    """What an eval row's loss was computed on: the data (``data.identity.data_label``), its val split and a
    tokenizer other than bytes."""
    return f"{data_label(d)} val split" + (f", tokenizer {d.tokenizer}" if d.tokenizer != "byte" else "")


def check_data_choice(spec, data) -> None:
    """A Hugging Face folder that brings its own tokenizer has no data of its own: scoring it without ``--data``
    would give the embedded essays through that tokenizer, which it was not trained on (``ConfigError``)."""
    folder = hf_folder(spec)
    if data is not None or folder is None:
        return
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        raise ConfigError(f"{spec} brings its own tokenizer and no data: say what to score it on, --data STORE (a "
                          f"token store prepared with that tokenizer: `hybrid-lm data prepare --tokenizer {folder} "
                          "--out STORE ...`) or --data embedded (the embedded essays through its tokenizer)")


class RestoredRun:
    """``workdir``'s config, the restored ``step`` and its ``params`` on ``mesh``, and the ``fns``.

    Raises ``FileNotFoundError`` (with the reason) when ``workdir`` is not a run directory, has no
    checkpoint, has none at ``step``, or none restores. ``workdir`` may be a Hugging Face folder
    (``hf:DIR``): its weights are step 0 (``self.hf`` is its :class:`~hybrid_lm.run.hf.HFCheckpoint`).
    """

    def __init__(self, workdir: Path | str, *, step: int | None = None, devices=None):
        self.hf = None
        if hf_folder(workdir) is not None:
            self.hf = HFCheckpoint(workdir)
            if step not in (None, 0):
                raise FileNotFoundError(f"{self.hf.spec} holds one set of weights (step 0), not step {step}")
            self.workdir = self.hf.dir
            self.cfg = self.hf.config()
        else:
            self.workdir = Path(workdir)
            self.cfg = load_run_config(self.workdir)
        directory = checkpoint_dir(self.workdir)
        if self.hf is None and not directory.is_dir():
            raise FileNotFoundError(f"{self.workdir} has no checkpoints/ directory")
        try:
            self.mesh = shd.make_mesh(self.cfg.mesh, devices)
        except ConfigError as e:  # trained on another topology: evaluate data-parallel on what is here
            log.warning("the run's mesh does not fit these devices (%s); evaluating data-parallel", e)
            self.mesh = shd.make_mesh(dataclasses.replace(self.cfg.mesh, data=-1, fsdp=1, tensor=1), devices)
        self.rules = self.cfg.mesh.rules
        self.fns = ModelFns(self.cfg)
        self.p_shard = shd.tree_shardings(self.fns.axes, self.fns.abstract_params, self.mesh, self.rules)
        self.batch_shard = shd.batch_sharding(self.mesh, self.rules)
        self.n_batch_shards = shd.n_batch_shards(self.mesh)
        if self.hf is not None:
            self.params, self.step = self.hf.read_params(self.fns.abstract_params, self.p_shard), 0
        else:
            ckpt = Checkpointer(directory, self.cfg.checkpoint)
            try:
                self.params, self.step = ckpt.restore_params(
                    abstract_with_shardings(self.fns.abstract_params, self.p_shard), step)
            finally:
                ckpt.close()
        self._streams = {}
        self._tokenizer = None

    # ------------------------------------------------------------------------- what a task needs

    def model(self, cfg: Config | None = None):
        """The restored :class:`~hybrid_lm.model.transformer.HybridLM` (an NNX module); with ``cfg``
        (e.g. :meth:`task_config`'s swapped config) that config's model on the same parameters."""
        if cfg is None or cfg.model == self.cfg.model:
            return self.fns.model(self.params)
        return ModelFns(cfg).model(self.params)

    def task_config(self, swaps=(), horizon: int | None = None, sinks: int = 0, *, seq_len: int | None = None,
                    attention_impl: str | None = None) -> Config:
        """The run's config with attention swaps / a receptive-field constraint applied
        (``hybrid_lm/run/swap.py``): what every eval task runs on (``--swap``, ``--horizon``)."""
        swaps = [parse_swap(s) if isinstance(s, str) else s for s in swaps]
        return swapped_config(self.cfg, swaps, horizon, sinks, seq_len=seq_len, attention_impl=attention_impl)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(self.cfg.data.tokenizer)
        return self._tokenizer

    def streams(self, cfg: Config | None = None):
        """The :class:`~hybrid_lm.data.pipeline.DataStreams` of ``cfg`` (default: the run's), one per
        (seq_len, eval_windows)."""
        cfg = cfg or self.cfg
        d = cfg.data
        key = (d.seq_len, d.eval_windows, d.source, d.path, tuple(map(tuple, d.mixture or ())))
        if key not in self._streams:
            if self.hf is None:
                check_recorded_paths(cfg, config_path(self.workdir))
            self._streams[key] = DataStreams(cfg)
        return self._streams[key]

    def trained_eval(self, seq_len: int) -> dict | None:
        """The trainer's eval row at the restored step (same windows), if metrics.jsonl has it."""
        path = metrics_path(self.workdir)
        if seq_len != self.cfg.data.seq_len or not path.exists():
            return None
        rows = [r for r in read_metrics(path, "eval") if r["step"] == self.step]
        return rows[-1] if rows else None

    def record(self, row: dict) -> None:
        """Append ``row`` to ``<workdir>/eval.jsonl`` (process 0 only)."""
        if jax.process_index() == 0:
            append_jsonl(eval_rows_path(self.workdir), [row])  # after cutting a torn last line

    # ------------------------------------------------------------------------- the trainer's eval

    def with_data(self, cfg: Config, store: str | Path | None) -> Config:
        """``cfg`` reading its eval windows from the prepared token ``store`` (its val split) instead of
        the run's data (``"embedded"``: the embedded essays, through the run's tokenizer); the store must be
        tokenised with the run's tokenizer (checked when opened)."""
        if store is None:
            return cfg
        if str(store) == EMBEDDED:
            return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="embedded", path=None,
                                                                     mixture=()))
        path = Path(store)
        if not (path / "manifest.json").is_file():
            raise DataError(f"--data {store}: no prepared token store there (manifest.json missing); build one "
                            f"with `hybrid-lm data prepare --out {store} ...` using the run's tokenizer "
                            f"{self.cfg.data.tokenizer!r}")
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="tokens", path=str(path),
                                                                 mixture=()))

    def evaluate(self, swaps=(), horizon: int | None = None, sinks: int = 0, *, seq_len: int | None = None,
                 eval_windows: int | None = None, attention_impl: str | None = None, data: str | None = None,
                 record: bool = True) -> dict:
        """Loss (nats/token) and bits/byte on the run's fixed eval windows (or those of the token store
        ``data``'s val split), batched as the trainer does (``run/loss.py``), of the swapped /
        constrained model; appends a row to eval.jsonl."""
        t0 = time.time()
        swaps = [parse_swap(s) if isinstance(s, str) else s for s in swaps]
        cfg = swapped_config(self.cfg, swaps, horizon, sinks, seq_len=seq_len, eval_windows=eval_windows,
                             attention_impl=attention_impl)
        cfg = self.with_data(cfg, data)
        model, data = cfg.model, cfg.data
        streams = self.streams(cfg)
        windows = streams.eval_batch
        per, n = loss.eval_batching(loss.window_count(windows), cfg.train.global_batch, self.n_batch_shards)
        if n == 0:
            raise SwapError(f"{loss.window_count(windows)} eval windows of {data.seq_len} tokens cannot fill one batch of "
                            f"{per} rows on {self.n_batch_shards} batch shards; use a shorter seq_len or more "
                            f"eval windows")
        fns = ModelFns(cfg)
        recorded_backends(clear=True)  # filled by the eval step's trace
        with jax.set_mesh(self.mesh):
            eval_fn = jax.jit(make_eval_step(fns), in_shardings=(self.p_shard, self.batch_shard),
                              out_shardings=shd.replicated(self.mesh))
            metrics = loss.evaluate(eval_fn, self.params, windows, self.batch_shard,
                                    global_batch=cfg.train.global_batch, n_batch_shards=self.n_batch_shards,
                                    bytes_per_token=streams.bytes_per_token)
        ce, n = metrics["loss"], metrics["eval_windows"]
        row = {"kind": "swap_eval", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": self.step,
               "checkpoint_step": self.step, "run_id": run_id(self.cfg),
               "swaps": [s.spec or s.to_dict() for s in swaps], "horizon": horizon,
               "sinks": sinks if horizon is not None else None,
               "seq_len": data.seq_len, "trained_seq_len": self.cfg.data.seq_len, "eval_windows": n,
               "data": (EMBEDDED if data.source == "embedded" and not data.path else data.path)
               if data.path != self.cfg.data.path or data.source != self.cfg.data.source else None,
               "scored_on": scored_on(data),
               "loss": ce, "loss_se": metrics["loss_se"], "bpb": metrics["bpb"], "bpb_se": metrics["bpb_se"],
               "layer_types": "".join(model.layer_types()), "mixers": describe(model),
               "trained_mixers": describe(self.cfg.model), "attention_impl": model.attention_impl,
               "attention_backends": recorded_backends(), "devices": int(self.mesh.devices.size),
               "wall_s": round(time.time() - t0, 3)}
        ref = self.trained_eval(data.seq_len) if row["data"] is None else None
        if ref is not None and ref.get("eval_windows", n) == n:
            row["trained_eval_loss"] = ref["loss"]
            row["delta_loss"] = ce - ref["loss"]
        row["window_losses"] = loss.row_window_losses(metrics["window_losses"])
        if ref is not None and ref.get("eval_windows", n) == n and len(ref.get("window_losses") or ()) == n:
            row["delta_loss_se"] = loss.paired_difference(row["window_losses"], ref["window_losses"])[1]  # same windows
        if record:
            self.record(row)
        return row


def evaluate_checkpoint(workdir: Path | str, swaps=(), horizon: int | None = None, sinks: int = 0, *,
                        seq_len: int | None = None, step: int | None = None, eval_windows: int | None = None,
                        attention_impl: str | None = None, record: bool = True) -> dict:
    """One :meth:`RestoredRun.evaluate` of ``workdir``'s checkpoint (``step`` or the latest). The
    settings are checked before the checkpoint is restored."""
    settings = dict(seq_len=seq_len, eval_windows=eval_windows, attention_impl=attention_impl)
    swapped_config(load_run_config(workdir), swaps, horizon, sinks, **settings)
    return RestoredRun(workdir, step=step).evaluate(swaps, horizon, sinks, **settings, record=record)


__all__ = ["RestoredRun", "evaluate_checkpoint"]


def record_rows(run, rows, quiet: bool = False) -> None:
    """Append ``rows`` to the run's eval.jsonl; an unwritable workdir is one line (the result is printed)."""
    try:
        for r in rows:
            run.record(r)
    except OSError as e:
        raise WorkdirError(f"the result is printed above, but it could not be appended to "
                           f"{run.workdir / 'eval.jsonl'} ({e.strerror or e}); rerun with --no-record, or make "
                           "the run dir writable") from e
    if not quiet:
        print(f"recorded in {run.workdir / 'eval.jsonl'}")
