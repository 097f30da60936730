"""Atomic file writes: write a temporary file beside the target, then ``os.replace`` it.

A crash or kill mid-write leaves the old file (or none), never a torn one. The temporary name
carries the process id, so concurrent writers never share one. No jax here.

JSONL records (``metrics.jsonl``, ``eval.jsonl``) are appended to instead, so a kill can tear their last
line: :func:`cut_torn_tail` cuts it off before the next append (one warning), and :func:`read_jsonl`
skips a line that is not a JSON object with one warning per file and process.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any, Callable, Iterable

log = logging.getLogger(__name__)


def named(e: OSError, path: str | Path) -> OSError:
    """``e`` with ``path`` as its file name where it names none (a write on a full disk names no file)."""
    if isinstance(e, OSError) and e.filename is None and e.errno is not None:
        return type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path))
    return e


def atomic_write(path: str | Path, write: Callable[[IO], Any], *, text: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary file (binary, or UTF-8 text), then rename it onto ``path``. An OS
    error names ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with (open(tmp, "w", encoding="utf-8", newline="") if text else open(tmp, "wb")) as fh:
            write(fh)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        err = named(e, path)
        if err is e:
            raise
        raise err from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_savefig(fig, path: str | Path, **savefig_kwargs) -> Path:
    """``fig.savefig`` written atomically (the format from ``path``'s suffix)."""
    path = Path(path)
    return atomic_write(path, lambda fh: fig.savefig(fh, format=path.suffix.lstrip(".") or "png", **savefig_kwargs))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda fh: fh.write(text), text=True)


def atomic_write_json(path: str | Path, obj, **dumps_kwargs) -> Path:
    """``json.dumps(obj, **dumps_kwargs)``, written atomically."""
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs))


def cut_torn_tail(path: str | Path, chunk: int = 1 << 16) -> None:
    """A file not ending in a newline ends in a row torn by a kill: cut it off, so the next row starts its
    own line (a tail that is a whole JSON object, missing only its newline, gets the newline instead)."""
    path = Path(path)
    with path.open("r+b") as fh:
        end = fh.seek(0, os.SEEK_END)
        if end == 0:
            return
        fh.seek(end - 1)
        if fh.read(1) == b"\n":
            return
        start = end
        while start > 0:  # the last newline, searched backwards a chunk at a time
            lo = max(0, start - chunk)
            fh.seek(lo)
            nl = fh.read(start - lo).rfind(b"\n")
            if nl >= 0:
                start = lo + nl + 1
                break
            start = lo
        fh.seek(start)
        tail = fh.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            fh.write(b"\n")
            return
        fh.truncate(start)
    log.warning("%s: dropped a torn last line, %d bytes: %r", path, end - start,
                tail[:60] + (b"..." if len(tail) > 60 else b""))


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append ``rows`` to the JSONL file ``path``, one line each, after cutting a torn last line."""
    path = Path(path)
    if path.exists():
        cut_torn_tail(path)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    try:
        with path.open("a", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        err = named(e, path)
        if err is e:
            raise
        raise err from e


_WARNED: set[tuple[str, tuple[int, ...]]] = set()  # (file, its skipped lines) already warned about


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of ``path``, one a line (``[]`` when it does not exist); a line that is not one (torn
    by a kill) is skipped, with one warning per file and process naming the lines."""
    path = Path(path)
    if not path.exists():
        return []
    rows, bad = [], []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            if isinstance(r, dict):
                rows.append(r)
            else:
                bad.append(i)
    key = (str(path.resolve()), tuple(bad))
    if bad and key not in _WARNED:
        _WARNED.add(key)
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        log.warning("%s: skipped %d line(s) that are not JSON rows (torn by a kill?): line %s", path, len(bad), shown)
    return rows
