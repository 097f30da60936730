"""A run directory's files: where each lives, and the one reader of each.

A run directory holds ``config.json`` (the resolved config and its run id: :func:`read_run_config`,
:func:`write_run_config`), ``checkpoints/`` (orbax, ``run/checkpoint.py``; their steps:
:func:`checkpoint_steps`), ``metrics.jsonl`` (the trainer's rows, ``run/metrics.py``), ``eval.jsonl``
(``hybrid-lm eval``'s rows), ``provenance.json`` and ``operative.gin`` (``train/rundir.py`` writes
them). A Hugging Face model folder (``hf:DIR``, ``run/hf.py``) is read wherever a run directory is:
its config from its ``config.json``, one checkpoint (step 0) from its safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import get_type_hints

import orbax.checkpoint as ocp

from hybrid_lm.config import (REMOVED_FIELDS, RUN_CONFIG_SECTIONS, CheckpointConfig, Config, MixerConfig,
                              config_from_dict)
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.experiment import config_record, diff_experiments, import_mixer_modules, run_id
from hybrid_lm.files import atomic_write_json, atomic_write_text, read_jsonl
from hybrid_lm.model.architecture import arch_label, arch_spec
from hybrid_lm.run.checkpoint import Checkpointer
from hybrid_lm.run.hf import HFCheckpoint, hf_folder
from hybrid_lm.validate import read_fields_only

log = logging.getLogger(__name__)

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EVAL_ROWS = "eval.jsonl"
PROVENANCE = "provenance.json"
OPERATIVE_GIN = "operative.gin"


def config_path(workdir: Path | str) -> Path:
    return Path(workdir) / CONFIG


def checkpoint_dir(workdir: Path | str) -> Path:
    return Path(workdir) / CHECKPOINTS


def metrics_path(workdir: Path | str) -> Path:
    return Path(workdir) / METRICS


def provenance_path(workdir: Path | str) -> Path:
    return Path(workdir) / PROVENANCE


def run_path(workdir: Path | str) -> Path:
    """The directory of a run spec: the folder of ``hf:DIR``, else the path itself."""
    return hf_folder(workdir) or Path(workdir)


def eval_rows_path(workdir: Path | str) -> Path:
    """``eval.jsonl`` of a run spec (a run directory, or the folder of ``hf:DIR``)."""
    return run_path(workdir) / EVAL_ROWS


# ----------------------------------------------------------------------------- config.json

def read_run_config(path: str | Path) -> tuple[dict, Config]:
    """A run directory's ``config.json`` (``path``): its contents and the :class:`Config` they define.

    The one reader of that file. A file that is not JSON, not an object, lacks a section or holds a
    field this version does not know raises :class:`ConfigError` naming the file and what is wrong;
    the file is left as it is."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e}): fix or restore the run's config, as `hybrid-lm train` "
                          "wrote it") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not the object `hybrid-lm train` writes")
    missing = [s for s in RUN_CONFIG_SECTIONS if not isinstance(d.get(s), dict)]
    if missing:
        raise ConfigError(f"{path}: missing section{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}: "
                          "not a run config as `hybrid-lm train` writes it")
    import_mixer_modules(d.get("mixer_modules", []), str(path))
    types = get_type_hints(Config)
    tables = [(sec, d[sec], types[sec]) for sec in RUN_CONFIG_SECTIONS]
    tables += [(f"model.{slot}", d["model"][slot], MixerConfig) for slot in ("full", "efficient")
               if isinstance(d["model"].get(slot), dict)]
    unknown = [f"{where}.{k}" for where, table, cls in tables for k in table
               if k not in {f.name for f in dataclasses.fields(cls)} | set(REMOVED_FIELDS.get(where, ()))]
    if unknown:
        raise ConfigError(f"{path}: unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)} (not a field of "
                          "this version's config; remove it, or use the version that wrote the run)")
    try:
        return d, config_from_dict(d)
    except KeyError as e:
        raise ConfigError(f"{path}: missing field {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


def write_run_config(workdir: Path | str, record: dict) -> None:
    """``config.json`` of ``workdir``: ``record`` (``experiment.config_record`` with ``run_id`` and, for a
    migrated run, ``previous_run_ids``), written atomically."""
    atomic_write_json(config_path(workdir), record, indent=2, default=str)


def load_run_config(workdir: Path | str) -> Config:
    """The run's config in the current schema: a ``config.json`` written before mixers declared their
    fields is read as :func:`migrate_run_config` migrates it (unread mixer fields reset), the file left as
    is. Raises ``FileNotFoundError`` without the file, :class:`ConfigError` (naming it) for one that does
    not read."""
    if hf_folder(workdir) is not None:
        return HFCheckpoint(workdir).config()
    path = config_path(workdir)
    if not path.exists():
        raise FileNotFoundError(f"{workdir} is not a run directory: no config.json")
    return read_fields_only(read_run_config(path)[1])


def check_recorded_paths(cfg: Config, where: Path) -> None:
    """(Called where a restored run's data is opened; reading its config needs none.) A relative data path in a run's config.json (runs record absolute ones) resolves against the directory the
    run was started in, not necessarily this one: say so in one line when it does not resolve here."""
    d = cfg.data
    named = [("DataConfig.path", d.path), *[("DataConfig.mixture", p) for p, _ in d.mixture or ()]]
    if d.tokenizer != "byte" and any(c in d.tokenizer for c in "/\\."):  # a file, not a name
        named.append(("DataConfig.tokenizer", d.tokenizer))
    for field, p in named:
        if p and not Path(p).expanduser().is_absolute() and not Path(p).expanduser().exists():
            raise WorkdirError(f"{where} records {field}={p!r}, a path relative to the directory the run was started "
                               f"in: {Path.cwd() / p} does not exist; run from that directory, or write the absolute "
                               f"path into {where}")


def accepted_run_ids(workdir: Path | str) -> set[str]:
    """Run ids whose checkpoints ``workdir`` resumes: its own and those it was migrated from."""
    path = config_path(workdir)
    if not path.exists():
        return set()
    d = read_run_config(path)[0]
    return {i for i in [d.get("run_id"), *d.get("previous_run_ids", [])] if i}


def migrate_run_config(workdir: Path | str) -> dict:
    """``workdir/config.json`` in the current schema. A file written before mixers declared their
    fields (a moba run recording base.gin's window) or with a removed field (``eval_batches``) is
    rewritten, the old file kept as ``config.json.bak`` and its run id added to ``previous_run_ids``."""
    path = config_path(workdir)
    old, as_read = read_run_config(path)  # drops the removed fields; the run id is computed as before
    current = read_fields_only(as_read)
    dropped = [f"{sec}.{k}" for sec, ks in REMOVED_FIELDS.items() for k in ks if k in old.get(sec, {})]
    if current == as_read and not dropped:
        return old
    new = json.loads(json.dumps(config_record(current), default=str))
    old_id = old.get("run_id") or run_id(as_read)
    previous = [*old.get("previous_run_ids", []), *([old_id] if old_id != run_id(current) else [])]
    atomic_write_text(path.with_name("config.json.bak"), path.read_text())
    write_run_config(workdir, {**new, "run_id": run_id(current), "previous_run_ids": previous})
    changes = [f"{f} reset (its mixer does not read it)" for f in diff_experiments(old, new)]
    changes += [f"{f} dropped (no longer a field)" for f in dropped]
    log.warning("migrated %s to the current config schema: %s; run id %s -> %s; old file kept as config.json.bak",
                path, ", ".join(changes), old_id, run_id(current))
    return {**new, "run_id": run_id(current), "previous_run_ids": previous}


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_steps(workdir: Path | str, *, missing_ok: bool = False) -> list[int]:
    """The steps a run can be restored at, ascending: its finished checkpoints (orbax's step list; a
    save still being written or moved aside as corrupt is not one); a Hugging Face folder has one, step 0.

    The one list of a run's steps. A run directory without ``checkpoints/`` raises :class:`WorkdirError`
    (it never trained), or gives ``[]`` with ``missing_ok``; nothing is created."""
    if hf_folder(workdir) is not None:
        return [0]
    d = checkpoint_dir(workdir)
    if not d.is_dir():
        if missing_ok:
            return []
        raise WorkdirError(f"{workdir} has no checkpoints/ directory: train the run first")
    return sorted(ocp.utils.checkpoint_steps(d))


def checkpoint_meta(workdir: Path | str, step: int) -> dict:
    """The ``meta`` item saved with the checkpoint at ``step`` (step, data position, ``tokens_seen``,
    run id), read through orbax; raises ``FileNotFoundError`` when there is no checkpoint at ``step``."""
    if step not in checkpoint_steps(workdir, missing_ok=True) or hf_folder(workdir) is not None:
        raise FileNotFoundError(f"{workdir} has no checkpoint at step {step}")
    ckpt = Checkpointer(checkpoint_dir(workdir), CheckpointConfig(), read_only=True)
    try:
        return ckpt.restore_meta(step)
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------- eval rows, many runs

def read_eval_rows(workdir: Path | str) -> list[dict]:
    """The rows of a run's eval.jsonl (``[]`` without one); a torn line is skipped with one warning."""
    return read_jsonl(eval_rows_path(workdir))


def run_architecture(d: Path) -> tuple[str | None, dict | None]:
    """(label, spec) of the run's architecture (``model/architecture.py``) from its config.json, or
    (None, None) without one or when it does not load (logged: a sweep's arch name still labels the run)."""
    if not config_path(d).exists():
        return None, None
    try:
        spec = arch_spec(load_run_config(d).model)
    except ConfigError as e:
        log.warning("%s/config.json: no architecture spec (%s)", d, e)
        return None, None
    return arch_label(spec), spec


def find_run_dirs(paths: list[str | Path], include_stable: bool = False) -> list[Path]:
    """Run directories under ``paths`` (sweep roots, run dirs, or directories searched for
    ``metrics.jsonl``), each once; a sweep's stable WSD runs (``sweep_run.json`` kind ``stable``) only
    with ``include_stable``."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        if (p / "sweep.json").exists():
            man = json.loads((p / "sweep.json").read_text())
            for j in man["jobs"]:
                if j["kind"] == "stable" and not include_stable:
                    continue
                d = p / j["name"]
                if metrics_path(d).exists():
                    out.append(d)
        elif metrics_path(p).exists():
            out.append(p)
        else:
            for m in sorted(p.rglob(METRICS)):
                meta = m.parent / "sweep_run.json"
                if meta.exists() and not include_stable and json.loads(meta.read_text()).get("kind") == "stable":
                    continue
                out.append(m.parent)
    seen, uniq = set(), []
    for d in out:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(d)
    return uniq
