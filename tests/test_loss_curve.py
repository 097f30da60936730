"""``loss_curve.png`` plots one unit for train and val (bits per token; the val curve also in bits per
byte on a labelled right axis where a token is not one byte) and marks where a session resumed. The
plotted series are read back from the figure and checked against the rows and their units."""

import io
import json
import math

import numpy as np
import pytest

from hybrid_lm.run.metrics import loss_curve_figure, loss_curve_series

LN2 = math.log(2)
TOKENS_PER_STEP = 64


def _rows(bytes_per_token: float, resume_at: int | None = None) -> list[dict]:
    """A run's rows: train loss in nats per token, val loss in nats per token with its bits per byte."""
    rows = []
    for s in range(10, 101, 10):
        rows.append({"kind": "train", "step": s, "tokens": s * TOKENS_PER_STEP, "loss": 6.0 - s / 40})
        if s % 50 == 0:
            loss = 6.1 - s / 40
            rows.append({"kind": "eval", "step": s, "tokens": s * TOKENS_PER_STEP, "loss": loss,
                         "bpb": loss / LN2 / bytes_per_token, "order0_entropy_bits": 4.4})
    if resume_at is not None:  # a second session restored step resume_at and wrote its rows again
        rows.append({"kind": "train", "step": resume_at + 10, "tokens": (resume_at + 10) * TOKENS_PER_STEP,
                     "loss": 6.0 - (resume_at + 10) / 40, "resumed_from": resume_at})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _lines(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_train_and_val_share_one_unit_and_the_val_curve_reads_in_bits_per_byte(tmp_path):
    import matplotlib.pyplot as plt

    rows = _rows(bytes_per_token=3.3, resume_at=60)
    path = _write(tmp_path / "metrics.jsonl", rows)
    fig = loss_curve_figure(path, "bpe run")
    ax = fig.axes[0]
    lines = _lines(ax)
    train = [r for r in rows if r["kind"] == "train"]
    train = {r["step"]: r for r in train}  # the last row per step, as readers keep it
    ev = [r for r in rows if r["kind"] == "eval"]
    assert ax.get_ylabel() == "bits per token"
    # train: loss (nats/token) / ln 2; val: the same unit, not its bits per byte
    np.testing.assert_allclose(lines["train"].get_ydata(), [r["loss"] / LN2 for _, r in sorted(train.items())])
    np.testing.assert_allclose(lines["train"].get_xdata(), [r["tokens"] for _, r in sorted(train.items())])
    val = next(line for label, line in lines.items() if label.startswith("val ("))
    assert val.get_label() == f"val (last: {ev[-1]['bpb']:.3f} bits/byte)"
    np.testing.assert_allclose(val.get_ydata(), [r["loss"] / LN2 for r in ev])
    # the train-val gap is that of the losses, not a factor of bytes per token
    assert abs(val.get_ydata()[-1] - lines["train"].get_ydata()[-1]) == pytest.approx(0.1 / LN2)
    # the order-0 entropy (bits per byte in the row) drawn in bits per token
    np.testing.assert_allclose(lines["val order-0 entropy"].get_ydata(), [4.4 * 3.3] * 2)
    # the right axis: the same curves in bits per byte, at the val set's bytes per token
    (right,) = ax.child_axes
    assert right.get_ylabel() == "val bits per byte (3.3 bytes per token)"
    lo, hi = ax.get_ylim()
    np.testing.assert_allclose(right.get_ylim(), (lo / 3.3, hi / 3.3))
    np.testing.assert_allclose(val.get_ydata() / 3.3, [r["bpb"] for r in ev])
    # the resume point: a dotted line at the tokens of the restored step
    resumed = lines["resumed from a checkpoint"]
    np.testing.assert_allclose(resumed.get_xdata(), [60 * TOKENS_PER_STEP] * 2)
    plt.close(fig)


def test_byte_level_runs_say_the_two_units_are_one(tmp_path):
    import matplotlib.pyplot as plt

    path = _write(tmp_path / "metrics.jsonl", _rows(bytes_per_token=1.0))
    fig = loss_curve_figure(path)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bits per token = bits per byte (1 byte per token)" and not ax.child_axes
    assert "resumed from a checkpoint" not in _lines(ax)
    plt.close(fig)
    s = loss_curve_series(path)
    assert s["unit"] == "bits/token" and s["bytes_per_token"] == pytest.approx(1.0) and s["resumes"] == []
    np.testing.assert_allclose(s["val"]["bits_per_token"], s["val"]["bits_per_byte"])


def test_a_run_without_eval_rows_plots_train_in_bits_per_token(tmp_path):
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(3.3) if r["kind"] == "train"]
    rows[3]["loss"] = None  # a non-finite value is a gap
    fig = loss_curve_figure(_write(tmp_path / "metrics.jsonl", rows))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bits per token" and not ax.child_axes
    y = _lines(ax)["train"].get_ydata()
    assert math.isnan(y[3]) and y[0] == pytest.approx(rows[0]["loss"] / LN2)
    plt.close(fig)


def test_the_first_row_of_a_resumed_session_says_where_it_resumed(tmp_path):
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.logger import StepLogger
    from hybrid_lm.run.metrics import read_metrics

    cfg = load_config(["quickstart.gin"], ["TrainConfig.log_every = 5", "TrainConfig.progress = False"],
                      validate=False)
    stats = {"finite": True, "loss": 2.0, "objective": 2.0, "lr": 1e-3, "grad_norm": 1.0, "param_norm": 1.0,
             "update_norm": 0.1}
    for start, steps in ((0, (5, 10)), (10, (15, 20)), (15, (20,))):
        logger = StepLogger(cfg, tmp_path, main=True, start=start, n_devices=1, stream=io.StringIO())
        for s in range(start + 1, steps[-1] + 1):
            logger.train_row(s, stats)
        logger.record.close()
    rows = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl", "train")}
    assert {s: r.get("resumed_from") for s, r in rows.items()} == {5: None, 10: None, 15: 10, 20: 15}
    assert [r["step"] for r in loss_curve_series(tmp_path / "metrics.jsonl")["resumes"]] == [10, 15]
