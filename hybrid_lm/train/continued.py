"""Continued pretraining: a run that starts from another run's parameters (``hybrid-lm train
--init-from RUN_DIR[@STEP]``, ``TrainConfig.init_from``), with a fresh optimizer state and schedule.

A Hugging Face model folder is a source too (``--init-from hf:DIR``): the model comes from its
config.json (``hybrid_lm/run/hf.py``; what the gin sets must agree where it fixes a parameter's
shape, the rest it sets is kept and named in one warning), the tokenizer from the folder unless the
gin names one, and the identity is ``hf:<sha256 of the weights>``.

Identity. ``TrainConfig.init_from`` of the continued run is ``"<source run id>@<step>"``: the source's
run id (the experiment that made the parameters, itself including its own ``init_from`` when it was
continued) and a concrete step ('latest' is resolved to a number at start). The path is left out on
purpose: moving or copying the source directory does not change what the parameters are, so it must
not change the new run's id (and a rerun with the moved path resumes the same run). The path, the
step as asked and a fingerprint of the restored parameters are in ``provenance.json`` under
``init_from``. The fingerprint also tells apart two sources of one run id (runs of different lengths
share it, ``TrainConfig.steps`` not being part of it), which the id alone cannot.

Order. :func:`resolve` checks everything before the run dir is touched (a bad source, a step that
was not saved, parameter shapes that differ, a workdir holding another run's checkpoints: one line
each). The train loop then restores the source's parameters straight into this run's sharded
layout (:func:`source_params`) only when the run has no checkpoint of its own: once it has, it
resumes from those and never reads the source again.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import jax

from hybrid_lm.config import Config, bound_model_fields, gin_binds
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.experiment import config_record, diff_experiments, run_id, validate_experiment
from hybrid_lm.run.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.run.directory import load_run_config
from hybrid_lm.run.hf import HFCheckpoint, hf_folder, merge_model
from hybrid_lm.run.directory import accepted_run_ids, checkpoint_dir, checkpoint_steps
from hybrid_lm.train.rundir import recorded_init_source
from hybrid_lm.step import ModelFns

log = logging.getLogger(__name__)


def resolve(cfg: Config, init_from: str | Path | None, workdir: Path | str | None) -> tuple[Config, "InitSource | None"]:
    """``(cfg with TrainConfig.init_from = the source's identity, the source)`` for ``--init-from``
    (``init_from``, else ``cfg.train.init_from``); ``(cfg, None)`` for a run from scratch. ``workdir``:
    the new run's directory as given (a rerun keeps its recorded source step). Raises a one-line
    :class:`ConfigError` / :class:`WorkdirError` before anything is written."""
    spec = init_from if init_from is not None else cfg.train.init_from
    if spec is None:
        return cfg, None

    if hf_folder(spec) is not None:
        if init_from is not None and cfg.train.init_from not in (None, str(init_from)):
            raise ConfigError(f"TrainConfig.init_from={cfg.train.init_from!r} and --init-from {init_from} disagree; "
                              "set one of them")
        cfg, source = resolve_hf_source(cfg, str(spec))
        check_init_shapes(source, cfg)
        return cfg, source
    source = resolve_init_source(str(spec), Path(workdir) if workdir else None)
    if init_from is not None and cfg.train.init_from not in (None, str(init_from), source.identity):
        raise ConfigError(f"TrainConfig.init_from={cfg.train.init_from!r} and --init-from {init_from} disagree; "
                          "set one of them")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=source.identity))
    check_init_shapes(source, cfg)
    return cfg, source


@dataclass(frozen=True)
class InitSource:
    """The parameters a continued run starts from: checkpoint ``step`` of the run in ``workdir``.

    ``cfg`` is the source's config; it is None only when the source is no longer there and the new
    run's own workdir, which recorded it, resumes from its own checkpoints (the source is not needed).
    """

    workdir: Path  # absolute
    run_id: str
    step: int
    spec: str  # as given: RUN_DIR[@STEP]
    cfg: Config | None = None
    saved: tuple[int, ...] = ()  # the source's checkpoint steps at start
    kind: str = "run"  # "hf": a Hugging Face folder (run_id is then its hf:<sha256>, step 0)

    @property
    def identity(self) -> str:
        """``TrainConfig.init_from`` of the continued run (see the module docstring)."""
        return self.run_id if self.kind == "hf" else f"{self.run_id}@{self.step}"

    def record(self) -> dict:
        """The ``init_from`` entry of the new run's provenance.json (the fingerprint is added once the
        parameters are restored, ``rundir.record_init_fingerprint``)."""
        rec = {"identity": self.identity, "source_dir": str(self.workdir), "source_run_id": self.run_id,
               "step": self.step, "requested": self.spec, "source_steps": list(self.saved)}
        return {**rec, "kind": "hf"} if self.kind == "hf" else rec


def resolve_hf_source(cfg: Config, spec: str) -> tuple[Config, InitSource]:
    """``cfg`` with the model of the Hugging Face folder ``spec`` (``hf.merge_model``), its tokenizer
    unless the gin names one, and ``TrainConfig.init_from`` = the folder's identity; and the source.
    One-line errors for a folder that is missing, unreadable or holds what hybrid_lm cannot express."""
    try:
        ck = HFCheckpoint(spec)
    except WorkdirError as e:
        raise WorkdirError(f"--init-from {e} (its config.json defines the model, so the folder must stay "
                           "while the run is resumed)") from None
    imported = ck.config()
    model, kept = merge_model(cfg.model, imported.model, bound_model_fields(), ck.spec)
    data = cfg.data
    theirs = imported.data.tokenizer
    if theirs != "byte" and data.tokenizer != theirs:
        if data.tokenizer == "byte" and not gin_binds("", "tokenizer", "DataConfig"):
            data = dataclasses.replace(data, tokenizer=theirs)
        else:
            kept.append(f"DataConfig.tokenizer={data.tokenizer!r} (the folder's: {theirs!r})")
    if kept:
        log.warning("--init-from %s: the gin's %s differ from the folder and are kept (a continued run may "
                    "change them)", ck.spec, "; ".join(kept))
    cfg = dataclasses.replace(cfg, model=model, data=data,
                              train=dataclasses.replace(cfg.train, init_from=ck.identity))
    validate_experiment(cfg)
    return cfg, InitSource(ck.dir.resolve(), ck.identity, 0, spec, imported, (0,), kind="hf")


def parse_init_spec(spec: str) -> tuple[Path, int | None]:
    """``(run dir, step or None for the newest)`` of ``RUN_DIR[@STEP]`` (STEP: an integer or 'latest')."""
    head, sep, tail = str(spec).rpartition("@")
    if sep and (tail.isdigit() or tail == "latest"):
        return Path(head), None if tail == "latest" else int(tail)
    return Path(spec), None


def resolve_init_source(spec: str, workdir: Path | None = None) -> InitSource:
    """The source of ``--init-from spec``, its step resolved to a number; reads, writes nothing.

    ``workdir``: the new run's directory when given. If it already holds checkpoints of a continued
    run whose recorded source matches ``spec`` (the same directory, or the same source run id), that
    run's step is kept when ``spec`` names none, so a rerun of the same command resumes the run even
    after the source saved newer checkpoints, or was deleted. Raises :class:`WorkdirError` (one
    line) for a missing source, a directory without config.json or checkpoints, or a step that was
    not saved (listing the saved ones).
    """
    path, step = parse_init_spec(spec)
    src = path.expanduser().resolve()
    kept = recorded_init_source(workdir) if workdir is not None and checkpoint_steps(workdir, missing_ok=True) else None
    if kept and step in (None, kept["step"]) and not src.exists() and (
            kept["source_dir"] == str(src) or kept["identity"] == str(spec)):
        log.warning("--init-from %s: the source is gone; %s resumes from its own checkpoints (initialised "
                    "from %s)", spec, workdir, kept["identity"])
        return InitSource(Path(kept["source_dir"]), kept["source_run_id"], int(kept["step"]), str(spec))
    if not src.is_dir():
        raise WorkdirError(f"--init-from {spec}: no run directory {src}")
    try:
        cfg = load_run_config(src)
    except FileNotFoundError as e:
        raise WorkdirError(f"--init-from {spec}: {e}") from None
    src_id = run_id(cfg)
    saved = tuple(checkpoint_steps(src, missing_ok=True))
    if step is None and kept and kept["source_run_id"] == src_id:
        step = int(kept["step"])
        if saved and saved[-1] != step:
            log.warning("--init-from %s: %s was initialised from step %d and keeps it (the source's newest "
                        "checkpoint is now step %d)", spec, workdir, step, saved[-1])
    elif step is None:
        if not saved:
            raise WorkdirError(f"--init-from {spec}: {src / 'checkpoints'} holds no checkpoint")
        step = saved[-1]
    if step not in saved and not (kept and kept["identity"] == f"{src_id}@{step}"):
        raise WorkdirError(f"--init-from {spec}: {src} has no checkpoint at step {step}; saved steps: "
                           f"{list(saved) or 'none'}")
    return InitSource(src, src_id, step, str(spec), cfg, saved)


def source_params(source: InitSource | None, abstract_params, shardings):
    """The parameters of the continued run's source checkpoint, in this run's sharded layout."""
    if source is None or source.cfg is None:
        raise WorkdirError(f"{source.spec if source else 'TrainConfig.init_from'}: the source run is not there "
                           "and this run has no checkpoint of its own to resume")
    if source.kind == "hf":
        ck = HFCheckpoint(source.workdir)
        if ck.identity != source.run_id:
            raise WorkdirError(f"--init-from {source.spec}: the folder's weights changed since the run started "
                               f"({ck.identity} is not {source.run_id})")
        return ck.read_params(abstract_params, shardings)
    ckpt = Checkpointer(checkpoint_dir(source.workdir), source.cfg.checkpoint, read_only=True)
    abstract = abstract_with_shardings(abstract_params, shardings)
    try:
        params, _ = ckpt.restore_params(abstract, source.step)
    except Exception as e:  # a torn or corrupt source checkpoint: its step is part of the identity, no fallback
        cause = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise WorkdirError(f"--init-from {source.spec}: the checkpoint at step {source.step} in {source.workdir} "
                           f"does not restore ({cause}); name another step with @STEP (saved: "
                           f"{list(source.saved)})") from e
    finally:
        ckpt.close()
    return params


def check_init_shapes(source: InitSource, cfg: Config) -> None:
    """``ConfigError`` naming the first parameter whose shape or dtype differs between the source's
    model and ``cfg``'s: a continued run may change anything but the parameters (seq_len, the data,
    RoPE theta, windows...). Builds abstract models only (allocates nothing)."""
    if source.cfg is None:
        return
    theirs, ours = _param_specs(source.cfg), _param_specs(cfg)
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        if theirs.get(name) != ours.get(name):
            changed = [f for f in diff_experiments(config_record(source.cfg), config_record(cfg)) if f.startswith("model.")]
            raise ConfigError(
                f"--init-from {source.spec}: parameter {name} is {theirs.get(name) or 'absent'} in the source "
                f"and {ours.get(name) or 'absent'} in this config"
                + (f" (model fields changed: {', '.join(changed)})" if changed else "")
                + "; a continued run keeps every parameter's shape and dtype")


def _param_specs(cfg: Config) -> dict[str, str]:
    """``"embed/table" -> "float32[256, 32]"`` for each parameter of ``cfg``'s model, in tree order."""
    leaves = jax.tree_util.tree_leaves_with_path(ModelFns(cfg).abstract_params)
    return {"/".join(str(getattr(k, "key", k)) for k in path): f"{x.dtype}{list(x.shape)}" for path, x in leaves}


def refuse_foreign_checkpoints(cfg: Config, workdir: Path, source: InitSource) -> None:
    """A continued run starts from the source only in a workdir without checkpoints of another run."""
    steps = checkpoint_steps(workdir, missing_ok=True)
    if not steps or run_id(cfg) in accepted_run_ids(workdir):
        return
    rec = recorded_init_source(workdir)
    whose = f"a run initialised from {rec['identity']}" if rec else "a run not initialised from it"
    raise WorkdirError(f"{workdir} holds checkpoints of its own (steps {steps}, {whose}), so --init-from "
                       f"{source.spec} ({source.identity}) cannot start there: use another --workdir, or "
                       "--restart to archive them first")


