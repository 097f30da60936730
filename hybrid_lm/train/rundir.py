"""Run directories: resolved config, operative gin, provenance, and the resume identity check."""

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

from hybrid_lm.config import REMOVED_FIELDS, Config, config_from_dict, diff_experiments, operative_gin
from hybrid_lm.errors import ConfigError
from hybrid_lm.files import atomic_write_json, atomic_write_text
from hybrid_lm.validate import read_fields_only

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
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argv": sys.argv,
    }


def prepare_run_dir(cfg: Config, workdir: Path, force: bool = False) -> Path:
    """Create or re-open ``workdir``; refuse a config that defines a different experiment."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "config.json"
    new = cfg.to_dict()
    previous: list[str] = []
    if cfg_path.exists():
        old = migrate_run_config(workdir)
        previous = old.get("previous_run_ids", [])
        changed = diff_experiments(old, new)
        if changed and not force:
            raise ConfigError(
                f"{workdir} holds a different experiment; differing fields: {', '.join(changed)}. "
                "Use another --workdir, or --force to resume anyway.")
        if changed:
            atomic_write_json(workdir / f"config.forced-{len(list(workdir.glob('config.forced-*')))}.json",
                              old, indent=2, default=str)
    record = {**new, "run_id": cfg.run_id()}
    if previous:
        record["previous_run_ids"] = previous
    atomic_write_json(cfg_path, record, indent=2, default=str)
    atomic_write_text(workdir / "operative.gin", operative_gin())
    atomic_write_json(workdir / "provenance.json", provenance(), indent=2)
    return workdir


_RUN_RECORDS = ("metrics.jsonl", "checkpoints", "loss_curve.png", "eval.jsonl", "tb", "wandb_id", "profile")


def archive_run(workdir: Path) -> Path | None:
    """Move ``workdir``'s metrics, checkpoints and what was derived from them to
    ``workdir/archive/<UTC time>/`` (nothing is deleted); the archive dir, or None if nothing was there."""
    workdir = Path(workdir)
    present = [n for n in _RUN_RECORDS if (workdir / n).exists()]
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
    log.warning("--restart: moved %s of %s to %s; training from step 0", ", ".join(present), workdir, dest)
    return dest


def accepted_run_ids(workdir: Path) -> set[str]:
    """Run ids whose checkpoints ``workdir`` resumes: its own and those it was migrated from."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return set()
    d = json.loads(path.read_text())
    return {i for i in [d.get("run_id"), *d.get("previous_run_ids", [])] if i}


def migrate_run_config(workdir: Path) -> dict:
    """``workdir/config.json`` in the current schema. A file written before mixers declared their
    fields (a moba run recording base.gin's window) or with a removed field (``eval_batches``) is
    rewritten, the old file kept as ``config.json.bak`` and its run id added to ``previous_run_ids``."""
    path = Path(workdir) / "config.json"
    old = json.loads(path.read_text())
    as_read = config_from_dict(old)  # drops the removed fields; the run id is computed as before
    current = read_fields_only(as_read)
    dropped = [f"{sec}.{k}" for sec, ks in REMOVED_FIELDS.items() for k in ks if k in old.get(sec, {})]
    if current == as_read and not dropped:
        return old
    new = json.loads(json.dumps(current.to_dict(), default=str))
    old_id = old.get("run_id") or as_read.run_id()
    previous = [*old.get("previous_run_ids", []), *([old_id] if old_id != current.run_id() else [])]
    atomic_write_text(path.with_name("config.json.bak"), path.read_text())
    atomic_write_json(path, {**new, "run_id": current.run_id(), "previous_run_ids": previous}, indent=2,
                      default=str)
    changes = [f"{f} reset (its mixer does not read it)" for f in diff_experiments(old, new)]
    changes += [f"{f} dropped (no longer a field)" for f in dropped]
    log.warning("migrated %s to the current config schema: %s; run id %s -> %s; old file kept as config.json.bak",
             path, ", ".join(changes), old_id, current.run_id())
    return {**new, "run_id": current.run_id(), "previous_run_ids": previous}
