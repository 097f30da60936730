"""A run directory prepared for training: its config.json (migrated when written by an earlier version:
``run/directory.py``), operative gin, provenance, the resume identity check, the run length check and
``--restart``'s archive (``train/continued.py`` records a continued run's source in the provenance)."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import jax

from hybrid_lm.config import Config, operative_gin
from hybrid_lm.data.identity import data_identity
from hybrid_lm.experiment import config_record, diff_experiments, run_id
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.files import atomic_write_json, atomic_write_text
from hybrid_lm.lock import LOCK_NAME
from hybrid_lm.run.checkpoint import COMMITTED
from hybrid_lm.run.directory import (CHECKPOINTS, EVAL_ROWS, METRICS, OPERATIVE_GIN, checkpoint_dir, checkpoint_steps,
                                     config_path, metrics_path, migrate_run_config, provenance_path, write_run_config)
from hybrid_lm.train.optim import wsd_schedule

log = logging.getLogger(__name__)

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "gin-config", "numpy", "hybrid_lm")


def git_info() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                                    check=True).stdout.strip())
        return {"sha": sha, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"sha": None, "dirty": None}


def provenance() -> dict:
    versions = {}
    for p in _PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    return {
        "git": git_info(),
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argv": sys.argv,
    }


# What hybrid-lm puts in a run dir before its config.json: the trainer's lock, --restart's archive, the
# run records, a sweep job's files (scaling/launch.py: its lock and metadata, a branch's seeded checkpoint).
_OWN_FILES = {LOCK_NAME, "archive", METRICS, CHECKPOINTS, COMMITTED, "sweep_run.json", ".sweep.lock", "branch.json",
              "sweep_error.txt", "sweep_done.json"}


def prepare_run_dir(cfg: Config, workdir: Path, force: bool = False, init_record: dict | None = None) -> Path:
    """Create or re-open ``workdir``; refuse a config that defines a different experiment.

    ``init_record`` (:meth:`InitSource.record`) goes to ``provenance.json`` as ``init_from``; a resumed
    continued run keeps the record of its first start (where its parameters came from)."""
    workdir = Path(workdir)
    cfg_path = config_path(workdir)
    if workdir.is_dir() and not cfg_path.exists():  # not a run dir (yet): say so if it holds other things
        others = [p for p in workdir.iterdir() if p.name not in _OWN_FILES]
        if others:
            log.warning("%s is not a run directory and already holds %d file(s) (e.g. %s): writing the run "
                        "into it anyway", workdir, len(others), sorted(others)[0].name)
    workdir.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    prov["data_identity"] = data_identity(cfg.data)  # store fingerprints and tokenizer hash ({} = embedded, byte)
    if cfg.train.init_from:
        kept = recorded_init_source(workdir)
        prov["init_from"] = kept if kept and kept.get("identity") == cfg.train.init_from else init_record
    new = config_record(absolute_data_paths(cfg))  # readable from any directory (eval elsewhere)
    previous: list[str] = []
    if cfg_path.exists():
        old = migrate_run_config(workdir)
        previous = old.get("previous_run_ids", [])
        changed = diff_experiments(old, new)
        if changed and not force and not has_trained(workdir):  # a start that failed: nothing to protect
            log.warning("%s: replacing the config of a run that never trained (no checkpoint, no metrics row); "
                        "differing fields: %s", workdir, ", ".join(changed))
            changed, previous = [], []
        if changed and not force:
            raise ConfigError(
                f"{workdir} holds a different experiment; differing fields: {', '.join(changed)}. "
                "Use another --workdir, or --force to resume anyway.")
        check_run_length(workdir, old.get("train", {}).get("steps"), cfg)  # before anything is written
        if changed:
            atomic_write_json(workdir / f"config.forced-{len(list(workdir.glob('config.forced-*')))}.json",
                              old, indent=2, default=str)
    record = {**new, "run_id": run_id(cfg)}
    if previous:
        record["previous_run_ids"] = previous
    write_run_config(workdir, record)
    atomic_write_text(workdir / OPERATIVE_GIN, operative_gin())
    atomic_write_json(provenance_path(workdir), prov, indent=2)
    return workdir


def absolute_data_paths(cfg: Config) -> Config:
    """``cfg`` with its relative data paths (the store, the mixture's stores, a tokenizer file) made absolute,
    as config.json records them: they were relative to the directory the run was started in. The run id is
    the same (the data is identified by content)."""
    import dataclasses

    def absolute(p):
        return str(Path(p).expanduser().resolve()) if p and not Path(p).expanduser().is_absolute() else p

    d = cfg.data
    tokenizer = absolute(d.tokenizer) if d.tokenizer != "byte" and Path(d.tokenizer).expanduser().exists() else d.tokenizer
    mixture = tuple((absolute(p), w) for p, w in d.mixture) if d.mixture else d.mixture
    return dataclasses.replace(cfg, data=dataclasses.replace(d, path=absolute(d.path), tokenizer=tokenizer,
                                                             mixture=mixture))


def has_trained(workdir: Path) -> bool:
    """Whether ``workdir`` holds a record of training: a metrics row or a checkpoint (finished, or moved
    aside as corrupt)."""
    workdir = Path(workdir)
    metrics = metrics_path(workdir)
    corrupt = checkpoint_dir(workdir) / "corrupt"
    return ((metrics.exists() and metrics.stat().st_size > 0) or bool(checkpoint_steps(workdir, missing_ok=True))
            or (corrupt.is_dir() and any(corrupt.iterdir())))


def check_run_length(workdir: Path, old_steps: int | None, cfg: Config) -> None:
    """A run may be extended, never shortened below its newest checkpoint: its record would then say
    fewer steps than it trained (``WorkdirError``). Extending a run whose LR decay had begun restarts the
    decay from the constant LR, which is said in a warning (WSD studies branch instead: ``hybrid-lm sweep``)."""
    saved = checkpoint_steps(workdir, missing_ok=True)
    if not saved:
        return
    at, steps = saved[-1], cfg.train.steps
    if at > steps:
        raise WorkdirError(f"{workdir} has trained to step {at} (its newest checkpoint), past TrainConfig.steps={steps}: "
                           f"its record would say {steps}. Evaluate an earlier step with `hybrid-lm eval {workdir} "
                           "--step STEP`, or train in another --workdir")
    if old_steps and at >= 1 and steps > old_steps:
        last = float(wsd_schedule(cfg.optim, old_steps)(at - 1))  # the LR of the last trained step
        nxt = float(wsd_schedule(cfg.optim, steps)(at))
        if nxt > last * 1.01:
            log.warning("TrainConfig.steps %d -> %d at step %d: the LR decay had begun (lr %.3g at step %d); the new "
                        "schedule goes back to %.3g. A WSD study branches runs instead (hybrid-lm sweep)",
                        old_steps, steps, at, last, at - 1, nxt)


_RUN_RECORDS = (METRICS, CHECKPOINTS, COMMITTED, "loss_curve.png", EVAL_ROWS, "tb", "wandb_id", "profile")
RECORDS_BESIDE_CHECKPOINTS = tuple(n for n in _RUN_RECORDS if n != CHECKPOINTS)  # a run that never saved


def archive_run(workdir: Path, names=_RUN_RECORDS, why: str = "--restart") -> Path | None:
    """Move ``workdir``'s metrics, checkpoints and what was derived from them (``names``) to
    ``workdir/archive/<UTC time>/`` (nothing is deleted); the archive dir, or None if nothing was there.
    ``why`` starts the warning line."""
    workdir = Path(workdir)
    present = [n for n in names if (workdir / n).exists()]
    if not present:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest, n = workdir / "archive" / stamp, 0
    while dest.exists():
        n += 1
        dest = workdir / "archive" / f"{stamp}.{n}"
    dest.mkdir(parents=True)
    for name in present:
        os.rename(workdir / name, dest / name)
    log.warning("%s: moved %s of %s to %s; training from step 0", why, ", ".join(present), workdir, dest)
    return dest


# ----------------------------------------------------------------------------- a continued run's source

def recorded_init_source(workdir: Path | None) -> dict | None:
    """The ``init_from`` entry of ``workdir``'s provenance.json (a continued run), else None."""
    path = provenance_path(workdir or "")
    if workdir is None or not path.exists():
        return None
    try:
        rec = json.loads(path.read_text()).get("init_from")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and {"identity", "source_dir", "source_run_id", "step"} <= set(rec) else None


def record_init_fingerprint(workdir: Path, fingerprint: str) -> None:
    """Add the restored parameters' fingerprint to the ``init_from`` entry of ``workdir``'s provenance."""
    path = provenance_path(workdir)
    prov = json.loads(path.read_text())
    prov["init_from"]["params_fingerprint"] = fingerprint
    atomic_write_json(path, prov, indent=2)
