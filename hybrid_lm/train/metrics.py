"""Metrics: JSONL is the record (one JSON object per row; ``kind`` is ``train`` or ``eval``).

After a resume, rows past the restored step are written again: readers keep the *last* row for each
(kind, step), which :func:`read_metrics` does.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` (the mirrors to TensorBoard / W&B live in ``train/logger.py``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_torn_tail(self.path)
        self._fh = self.path.open("a", buffering=1)  # line-buffered: a kill loses at most one row

    def write(self, row: dict) -> None:
        self._fh.write(json.dumps(clean_row(row)) + "\n")

    def close(self) -> None:
        self._fh.close()


def _drop_torn_tail(path: Path, chunk: int = 1 << 16) -> None:
    """A file not ending in a newline ends in a row torn by a kill: cut it off, so the next row starts its
    own line (a tail that is a whole row, missing only its newline, gets the newline instead)."""
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


_NONFINITE = ("nan", "inf", "-inf")  # how older versions wrote a non-finite value


def clean_row(row: dict) -> dict:
    """Numbers stay numbers: a NaN or inf value becomes ``null`` and the row gets ``"nonfinite": true``."""
    out = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    if any(out[k] is None and row[k] is not None for k in row):
        out["nonfinite"] = True
    return out


def _read_row(r: dict) -> dict:
    old = [k for k, v in r.items() if isinstance(v, str) and v in _NONFINITE]
    if old:
        r = {**{k: None if k in old else v for k, v in r.items()}, "nonfinite": True}
    return r


def read_metrics(path: Path, kind: str | None = None) -> list[dict]:
    """Rows sorted by step, keeping the last row written for each (kind, step). A non-finite value is
    ``None`` (the row has ``"nonfinite": true``)."""
    rows: dict[tuple, dict] = {}
    with Path(path).open() as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a row torn by a kill
            if kind is None or r.get("kind") == kind:
                rows[(r.get("kind"), r["step"])] = _read_row(r)
    return [rows[k] for k in sorted(rows, key=lambda k: (str(k[0]), k[1]))]


def plot_loss_curve(metrics_path: Path, out_png: Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = read_metrics(metrics_path, "train")
    ev = read_metrics(metrics_path, "eval")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:  # a null (non-finite) value is a gap in the curve
        ax.plot([r["tokens"] for r in train], [_num(r.get("loss")) / math.log(2) for r in train], lw=1.2,
                label="train (bits/token)")
    if ev:
        ax.plot([r["tokens"] for r in ev], [_num(r.get("bpb")) for r in ev], "o-", label="val bits/byte")
        if ev[-1].get("order0_entropy_bits") is not None:
            ax.axhline(ev[-1]["order0_entropy_bits"], color="gray", ls="--", lw=1, label="val order-0 entropy")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("bits")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def _num(v) -> float:
    return float("nan") if v is None else float(v)
