"""Atomic file writes: write a temporary file beside the target, then ``os.replace`` it.

A crash or kill mid-write leaves the old file (or none), never a torn one. The temporary name
carries the process id, so concurrent writers never share one. No jax here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any, Callable


def atomic_write(path: str | Path, write: Callable[[IO], Any], *, text: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary file (binary, or UTF-8 text), then rename it onto ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with (open(tmp, "w", encoding="utf-8", newline="") if text else open(tmp, "wb")) as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda fh: fh.write(text), text=True)


def atomic_write_json(path: str | Path, obj, **dumps_kwargs) -> Path:
    """``json.dumps(obj, **dumps_kwargs)``, written atomically."""
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs))
