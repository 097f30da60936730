"""Run directories: resolved config, operative gin, provenance, and the resume identity check."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jax

from hybrid_lm.config import Config, diff_experiments, operative_gin
from hybrid_lm.errors import ConfigError
from hybrid_lm.files import atomic_write_json, atomic_write_text

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
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        changed = diff_experiments(old, new)
        if changed and not force:
            raise ConfigError(
                f"{workdir} holds a different experiment; differing fields: {', '.join(changed)}. "
                "Use another --workdir, or --force to resume anyway.")
        if changed:
            atomic_write_json(workdir / f"config.forced-{len(list(workdir.glob('config.forced-*')))}.json",
                              old, indent=2, default=str)
    atomic_write_json(cfg_path, {**new, "run_id": cfg.run_id()}, indent=2, default=str)
    atomic_write_text(workdir / "operative.gin", operative_gin())
    atomic_write_json(workdir / "provenance.json", provenance(), indent=2)
    return workdir
