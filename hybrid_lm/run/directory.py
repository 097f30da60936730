"""A run directory's files: where each lives, and the one reader of each.

A run directory holds ``config.json`` (the resolved config and its run id), ``checkpoints/`` (orbax,
``run/checkpoint.py``), ``metrics.jsonl`` (the trainer's rows, ``run/metrics.py``), ``eval.jsonl``
(``hybrid-lm eval``'s rows), ``provenance.json`` and ``operative.gin``. A Hugging Face model folder
(``hf:DIR``, ``run/hf.py``) is read wherever a run directory is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hybrid_lm.config import Config
from hybrid_lm.errors import ConfigError
from hybrid_lm.experiment import read_run_config
from hybrid_lm.model.architecture import arch_label, arch_spec
from hybrid_lm.run.hf import HFCheckpoint, hf_folder
from hybrid_lm.validate import read_fields_only

log = logging.getLogger(__name__)


def load_run_config(workdir: Path | str) -> Config:
    """The run's config in the current schema: a ``config.json`` written before mixers declared their
    fields is read as ``train/rundir.py`` migrates it (unread mixer fields reset), the file left as is.
    Raises ``FileNotFoundError`` without the file, :class:`ConfigError` (naming it) for one that does not read."""
    if hf_folder(workdir) is not None:
        return HFCheckpoint(workdir).config()
    path = Path(workdir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{workdir} is not a run directory: no config.json")
    return read_fields_only(read_run_config(path)[1])


def run_path(workdir: Path | str) -> Path:
    """The directory of a run spec: the folder of ``hf:DIR``, else the path itself."""
    return hf_folder(workdir) or Path(workdir)


def read_eval_rows(workdir: Path | str) -> list[dict]:
    path = run_path(workdir) / "eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_architecture(d: Path) -> tuple[str | None, dict | None]:
    """(label, spec) of the run's architecture (``model/architecture.py``) from its config.json, or
    (None, None) without one or when it does not load (logged: a sweep's arch name still labels the run)."""
    if not (d / "config.json").exists():
        return None, None
    try:
        spec = arch_spec(load_run_config(d).model)
    except ConfigError as e:
        log.warning("%s/config.json: no architecture spec (%s)", d, e)
        return None, None
    return arch_label(spec), spec


def find_run_dirs(paths: list[str | Path], include_stable: bool = False) -> list[Path]:
    """Run directories under ``paths`` (sweep roots, run dirs, or directories searched), each once; a
    sweep's stable WSD runs (``sweep_run.json`` kind ``stable``) only with ``include_stable``."""
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
                if (d / "metrics.jsonl").exists():
                    out.append(d)
        elif (p / "metrics.jsonl").exists():
            out.append(p)
        else:
            for m in sorted(p.rglob("metrics.jsonl")):
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
