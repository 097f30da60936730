"""Metrics: JSONL is the record (one JSON object per row; ``kind`` is ``train`` or ``eval``).

After a resume, rows past the restored step are written again: readers keep the *last* row for each
(kind, step), which :func:`read_metrics` does.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from hybrid_lm.files import atomic_savefig, cut_torn_tail, named, read_jsonl

log = logging.getLogger(__name__)

# what each metric a results row or a fit table holds measures, in its unit (the label of a plot's axis)
METRIC_LABELS = {
    "loss": "val loss (nats/token)",
    "bpb": "val bits/byte",
    "longppl": "LongPPL (perplexity)",
    "log_longppl": "log LongPPL (nats/token)",
    "ppl": "perplexity",
    "answer_nll": "answer NLL (nats/token)",
    "exact_match": "exact match (share of items)",
    "ll_accuracy": "gold above distractors (share of items)",
    "score": "score (share of items)",
}


def metric_label(name: str) -> str:
    """``name``'s axis label with its unit (``METRIC_LABELS``; a loss-like name ``loss@8192`` or
    ``loss_2T`` is a val loss at that length); an unknown metric keeps its name."""
    if name in METRIC_LABELS:
        return METRIC_LABELS[name]
    base, sep, at = name.replace("_", "@", 1).partition("@")
    if sep and base in METRIC_LABELS:
        return f"{METRIC_LABELS[base]} at {at}"
    return name


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` (the mirrors to TensorBoard / W&B live in ``train/logger.py``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            cut_torn_tail(self.path)
        self._fh = self.path.open("a", buffering=1)  # line-buffered: a kill loses at most one row

    def write(self, row: dict) -> None:
        try:
            self._fh.write(json.dumps(clean_row(row)) + "\n")
        except OSError as e:  # a full disk: the error names the file
            err = named(e, self.path)
            if err is e:
                raise
            raise err from e

    def close(self) -> None:
        self._fh.close()


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
    ``None`` (the row has ``"nonfinite": true``); a torn line is skipped with one warning."""
    rows: dict[tuple, dict] = {}
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist")
    for r in read_jsonl(path):  # a row torn by a kill is skipped with one warning
        if kind is None or r.get("kind") == kind:
            rows[(r.get("kind"), r["step"])] = _read_row(r)
    return [rows[k] for k in sorted(rows, key=lambda k: (str(k[0]), k[1]))]


def loss_curve_series(metrics_path: Path) -> dict:
    """What ``loss_curve.png`` plots, each series with its unit (the function the figure is drawn from).

    One unit for the curves: bits per token, train (``loss`` / ln 2) and val (its ``loss`` / ln 2) alike,
    and the val set's order-0 entropy converted to it. ``bytes_per_token`` is the val set's (val
    ``loss`` / ln 2 / ``bpb``: exact for the val curve), which the figure's right axis uses to read the
    val curve in bits per byte; ``None`` without an eval row. ``resumes``: the steps and tokens at which
    a session restored a checkpoint (train rows' ``resumed_from``)."""
    train = read_metrics(metrics_path, "train")
    ev = read_metrics(metrics_path, "eval")
    ln2 = math.log(2)
    ratios = [r["loss"] / ln2 / r["bpb"] for r in ev
              if _finite(r.get("loss")) and _finite(r.get("bpb")) and r["bpb"] > 0]
    bpt = ratios[-1] if ratios else None
    h0 = ev[-1].get("order0_entropy_bits") if ev else None
    per_step = next((r["tokens"] / r["step"] for r in train + ev if r.get("step")), 0.0)
    resumes = sorted({int(r["resumed_from"]) for r in train if r.get("resumed_from")})
    return {
        "unit": "bits/token",
        "train": {"tokens": [r["tokens"] for r in train], "bits_per_token": [_num(r.get("loss")) / ln2 for r in train]},
        "val": {"tokens": [r["tokens"] for r in ev], "bits_per_token": [_num(r.get("loss")) / ln2 for r in ev],
                "bits_per_byte": [_num(r.get("bpb")) for r in ev]},
        "bytes_per_token": bpt,
        "order0_bits_per_token": h0 * bpt if h0 is not None and bpt is not None else None,
        "resumes": [{"step": s, "tokens": s * per_step} for s in resumes],
    }


def loss_curve_figure(metrics_path: Path, title: str = ""):
    """The loss curve as a matplotlib figure: train and val in bits per token on the left axis, the same
    val curve in bits per byte on the right (where a token is not one byte), resume points as dotted lines."""
    import matplotlib  # plots only (a slow import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plots only (a slow import)

    s = loss_curve_series(metrics_path)
    bpt = s["bytes_per_token"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if s["train"]["tokens"]:  # a null (non-finite) value is a gap in the curve
        ax.plot(s["train"]["tokens"], s["train"]["bits_per_token"], lw=1.2, label="train")
    if s["val"]["tokens"]:
        last = s["val"]["bits_per_byte"][-1]
        ax.plot(s["val"]["tokens"], s["val"]["bits_per_token"], "o-",
                label="val" + (f" (last: {last:.3f} bits/byte)" if math.isfinite(last) else ""))
    if s["order0_bits_per_token"] is not None:
        ax.axhline(s["order0_bits_per_token"], color="gray", ls="--", lw=1, label="val order-0 entropy")
    for i, r in enumerate(s["resumes"]):
        ax.axvline(r["tokens"], color="tab:red", ls=":", lw=1, label="resumed from a checkpoint" if i == 0 else None)
    ax.set_xlabel("tokens seen")
    if bpt is not None and abs(bpt - 1.0) > 1e-6:
        ax.set_ylabel("bits per token")
        right = ax.secondary_yaxis("right", functions=(lambda y, k=bpt: y / k, lambda y, k=bpt: y * k))
        right.set_ylabel(f"val bits per byte ({bpt:.3g} bytes per token)")
    else:
        ax.set_ylabel("bits per token" + (" = bits per byte (1 byte per token)" if bpt is not None else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_loss_curve(metrics_path: Path, out_png: Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt  # plots only (a slow import)

    fig = loss_curve_figure(metrics_path, title)
    try:
        atomic_savefig(fig, out_png, dpi=120)  # a kill or a full disk leaves the old figure whole
    finally:
        plt.close(fig)
    return out_png


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _num(v) -> float:
    return float("nan") if v is None else float(v)
