"""The scaling table: one row per (run, checkpoint), read and written as CSV or JSONL. No JAX.

Columns written by ``hybrid-lm collect`` (docs/SCALING.md lists them all): ``run_id, arch, scale, N,
D`` first, then the row columns (``final``, ``converged``, ``step``, ``phase``, ``source_run``, ...),
the metric columns (``loss``, ``log_longppl``, ...) and bookkeeping (``seed``, ``kind``, ``steps``,
``C``, ``arch_spec``, ...). ``fit`` needs only ``N``, ``D`` and the metric column; ``arch`` groups the
fits, ``source_run`` / ``run_id`` cluster the bootstrap and deduplicate rows, ``final`` and
``converged`` select rows and ``C`` (training FLOPs) calibrates compute-optimal allocations.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from hybrid_lm.files import atomic_write

LEAD_COLUMNS = ("run_id", "arch", "scale", "N", "D")
# per row, after the lead: which rows a fit may use (docs/SCALING.md section 7)
ROW_COLUMNS = ("final", "converged", "status", "step", "phase", "source_run")
# last: what the row is and where it came from
BOOKKEEPING = ("seed", "kind", "budget", "steps", "tokens_per_step", "N_non_embedding", "N_total", "C",
               "flops_per_token", "arch_spec", "run_dir")
# numeric columns that are not metrics (``fit --metric`` lists the others)
NON_METRIC_COLUMNS = frozenset(LEAD_COLUMNS + ROW_COLUMNS + BOOKKEEPING)


def _num(v):
    """CSV cell -> int / float / str / None."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    s = str(v).strip()
    if s == "" or s.lower() in ("none", "null"):
        return None
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        return s


def read_table(path: str | Path) -> list[dict]:
    """Rows of a ``.csv`` or ``.jsonl``/``.json`` table, numbers parsed."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"table {path} does not exist (make one with `hybrid-lm collect`)")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as fh:
            for i, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON object ({e})") from None
        return rows
    with path.open(newline="") as fh:
        return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(fh)]


def ordered_columns(rows: list[dict]) -> list[str]:
    """``LEAD_COLUMNS`` first, then the others in order of first appearance."""
    seen: dict[str, None] = {c: None for c in LEAD_COLUMNS}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def _plain(v):
    """numpy scalars -> Python scalars (their repr is not a number)."""
    return v.item() if hasattr(v, "item") and not isinstance(v, (list, dict, str)) else v


def _cell(v):
    v = _plain(v)
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def write_table(rows: list[dict], path: str | Path) -> Path:
    """Write CSV (``.csv``) or JSONL (anything else); nested values are JSON in CSV cells."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = ordered_columns(rows)

    def write(fh):
        if path.suffix == ".csv":
            w = csv.writer(fh)
            w.writerow(cols)
            for r in rows:
                w.writerow([_cell(r.get(c)) for c in cols])
        else:
            for r in rows:
                fh.write(json.dumps({c: _plain(r.get(c)) for c in cols}) + "\n")
    return atomic_write(path, write, text=True)
