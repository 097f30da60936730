"""A corpus of the Python sources found on this machine: one document per ``.py`` file, in JSON lines.

``hybrid-lm data python-corpus --out DIR`` (the one-GPU study's default corpus, docs/RESULTS.md):

- **roots**, in this order: the running interpreter's standard library (``sysconfig``'s ``stdlib``,
  without the ``site-packages`` / ``dist-packages`` folders inside it), then each package of
  ``--package`` (default ``torch``, ``transformers``, ``sympy``) found by ``importlib.util.find_spec``
  without importing it (a package that is not installed is listed as missing, not an error), then
  every ``--root DIR`` given;
- **files**: every ``*.py`` below a root (symlinks to files outside it and hidden folders skipped,
  ``__pycache__`` skipped), sorted by path relative to the root; a file reached from two roots is
  read once (the first); whitespace-only files are left out and counted;
- **out**: ``DIR/python.jsonl``, one ``{"text": ..., "path": "<root label>/<relative path>"}`` per file
  (bytes that are not UTF-8 replaced by U+FFFD, counted), and ``DIR/corpus.json``: the roots, the file
  count, the bytes, the missing packages and the **fingerprint**, the sha256 over every kept file's
  ``<label>/<relative path>``, a NUL, its raw bytes' sha256 and a newline, in order. It also records the
  Python version and each package root's installed version (``importlib.metadata``), outside the
  fingerprint. Two machines with the same Python and package versions give the same fingerprint;
  ``hybrid-lm data prepare --source text --path DIR/python.jsonl`` then tokenises it (the store's own
  fingerprint covers the tokens).

A rerun that finds the same files (same fingerprint) rewrites nothing. Bad input (no source found, an
output that cannot be written, a ``--root`` that is not a folder) is a one-line :class:`DataError`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from hybrid_lm.errors import DataError
from hybrid_lm.files import atomic_write, atomic_write_json
from hybrid_lm.progress import bar_disabled

DEFAULT_PACKAGES = ("torch", "transformers", "sympy")
JSONL = "python.jsonl"
META = "corpus.json"
SCHEMA = "hybrid_lm.python_corpus/1"
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass(frozen=True)
class Root:
    label: str  # the prefix of every document's path: stdlib, torch, ... or the folder's name
    path: Path


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it (None: not installed or a
    single-module distribution)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locs[0]).resolve() if locs else None


def package_version(name: str) -> str | None:
    """The installed distribution's version of package ``name`` (None: none by that name, e.g. a --root)."""
    try:
        return importlib.metadata.version(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def find_roots(packages=DEFAULT_PACKAGES, roots=(), stdlib: bool = True) -> tuple[list[Root], list[str]]:
    """``(roots, missing packages)``: the standard library (``stdlib``), each package of ``packages``
    that is installed, then each folder of ``roots`` (a path that is not a folder: DataError)."""
    out: list[Root] = []
    if stdlib:
        lib = Path(sysconfig.get_paths()["stdlib"]).resolve()
        if lib.is_dir():
            out.append(Root("stdlib", lib))
    missing = []
    for name in packages:
        d = package_dir(name)
        if d is None or not d.is_dir():
            missing.append(name)
        else:
            out.append(Root(name, d))
    for r in roots:
        p = Path(r).expanduser()
        if not p.is_dir():
            raise DataError(f"--root {r}: {'not a folder' if p.exists() else 'no such folder'}")
        out.append(Root(p.resolve().name or "root", p.resolve()))
    return out, missing


def python_files(root: Root) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every ``*.py`` below ``root``, sorted by relative path;
    hidden folders, ``__pycache__``, ``site-packages`` / ``dist-packages`` and links leaving the root
    are skipped."""
    base = root.path
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS
                             and not os.path.islink(os.path.join(dirpath, d)))
        for name in filenames:
            if not name.endswith(".py") or name.startswith("."):
                continue
            full = Path(dirpath, name)
            if full.is_symlink() and not os.path.realpath(full).startswith(str(base) + os.sep):
                continue
            found.append((full.relative_to(base).as_posix(), full))
    return sorted(found)


def build_python_corpus(out: str | Path, packages=DEFAULT_PACKAGES, roots=(), stdlib: bool = True,
                        progress: bool = False) -> dict:
    """Write ``out/python.jsonl`` and ``out/corpus.json`` (module docstring); returns corpus.json's dict
    with ``"skipped": True`` when the existing files already hold these sources."""
    out = Path(out)
    found, missing = find_roots(packages, roots, stdlib)
    entries = []  # (doc path, file path), in order, each real file once
    seen: set[str] = set()
    for root in found:
        for rel, full in python_files(root):
            real = os.path.realpath(full)
            if real not in seen:
                seen.add(real)
                entries.append((f"{root.label}/{rel}", full))
    if not entries:
        where = ", ".join(str(r.path) for r in found) or "no root (no standard library, package or --root found)"
        raise DataError(f"no .py files found in {where}: give --root DIR with Python sources"
                        + (f" (packages not installed: {', '.join(missing)})" if missing else ""))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK):
        raise DataError(f"--out {out}: the folder is not writable")



    h = hashlib.sha256()
    stats = {"files": 0, "bytes": 0, "empty_skipped": 0, "invalid_utf8_replaced": 0, "unreadable_skipped": 0}
    packages = set(packages)
    per_root: dict[str, dict] = {r.label: {"path": str(r.path), "files": 0, "bytes": 0} for r in found}
    for r in found:
        if r.label in packages:
            per_root[r.label]["version"] = package_version(r.label)
    docs: list[tuple[str, str]] = []
    for key, full in tqdm(entries, desc="python-corpus", unit=" files", disable=bar_disabled(progress)):
        try:
            data = full.read_bytes()
        except OSError:
            stats["unreadable_skipped"] += 1
            continue
        if not data.strip():
            stats["empty_skipped"] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            stats["invalid_utf8_replaced"] += 1
        h.update(key.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        stats["files"] += 1
        stats["bytes"] += len(data)
        label = key.split("/", 1)[0]
        per_root[label]["files"] += 1
        per_root[label]["bytes"] += len(data)
        docs.append((key, text))
    meta = {"schema": SCHEMA, "fingerprint": h.hexdigest(), **stats, "roots": per_root,
            "missing_packages": missing, "python": sys.version.split()[0], "jsonl": JSONL,
            "command": "hybrid-lm data python-corpus"}
    old = _read_meta(out / META)
    if old and old.get("fingerprint") == meta["fingerprint"] and (out / JSONL).exists():
        return {**old, "skipped": True}

    def write(fh):
        for key, text in docs:
            fh.write(json.dumps({"text": text, "path": key}) + "\n")  # ASCII: no U+2028 splits a line

    try:
        atomic_write(out / JSONL, write, text=True)
        atomic_write_json(out / META, meta, indent=1)
    except OSError as e:
        raise DataError(f"--out {out}: cannot write ({e.strerror or e})") from None
    return {**meta, "skipped": False}


def _read_meta(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("schema") == SCHEMA else None


def format_corpus(meta: dict, out: str | Path) -> list[str]:
    """The lines ``data python-corpus`` prints."""
    lines = [f"{'up to date' if meta.get('skipped') else 'wrote'} {Path(out) / JSONL}: {meta['files']:,} files, "
             f"{meta['bytes'] / 1e6:,.1f} MB, fingerprint {meta['fingerprint'][:16]} (full: {Path(out) / META})"]
    for label, r in meta["roots"].items():
        version = f"  ({label} {r['version']})" if r.get("version") else ""
        lines.append(f"  {label:<14} {r['files']:>7,} files {r['bytes'] / 1e6:>9,.1f} MB  {r['path']}{version}")
    if meta["missing_packages"]:
        lines.append(f"  not installed here (left out): {', '.join(meta['missing_packages'])}")
    skipped = {k: meta[k] for k in ("empty_skipped", "invalid_utf8_replaced", "unreadable_skipped") if meta.get(k)}
    if skipped:
        lines.append("  " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in skipped.items()))
    return lines
