"""Faults and user mistakes: one-line errors, no silent damage."""
import json

import pytest

from hybrid_lm.cli import main
from hybrid_lm.config import CONFIGS_DIR
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.run.metrics import MetricsWriter, plot_loss_curve, read_metrics


@pytest.mark.parametrize("binding,match", [
    ("CheckpointConfig.keep = 0", r"CheckpointConfig.keep=0 must be an integer >= 1"),
    ("CheckpointConfig.keep = -1", r"CheckpointConfig.keep=-1 "),
    ("CheckpointConfig.every_steps = 0", r"CheckpointConfig.every_steps=0 "),
    ("CheckpointConfig.permanent_every = -5", r"CheckpointConfig.permanent_every=-5 must be an integer >= 0"),
    ("CheckpointConfig.interval_minutes = -1.0", r"CheckpointConfig.interval_minutes=-1.0 "),
    ("TrainConfig.log_every = 0", r"TrainConfig.log_every=0 "),
    ("TrainConfig.eval_every = 0", r"TrainConfig.eval_every=0 "),
    ("DataConfig.eval_windows = 0", r"DataConfig.eval_windows=0 "),
    ("TrainConfig.steps = 'abc'", r"TrainConfig.steps='abc' must be an integer"),
    ("TrainConfig.steps = 2.5", r"TrainConfig.steps=2.5 must be an integer"),
])
def test_bad_train_and_checkpoint_config(binding, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["quickstart.gin"], [binding])


def test_bad_config_fails_in_one_line_before_the_run_dir(tmp_path, capsys):
    workdir = tmp_path / "run"
    rc = main(["train", str(CONFIGS_DIR / "quickstart.gin"), "--gin_param", "CheckpointConfig.keep=0",
               "--workdir", str(workdir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "CheckpointConfig.keep=0" in err
    assert not workdir.exists()


def test_nonfinite_metrics_are_null_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write({"kind": "train", "step": 1, "tokens": 10, "loss": 5.0})
    w.write({"kind": "train", "step": 2, "tokens": 20, "loss": float("nan"), "grad_norm": float("inf")})
    w.write({"kind": "eval", "step": 2, "tokens": 20, "loss": float("nan"), "bpb": float("-inf")})
    w.close()
    with path.open("a") as fh:  # as older versions wrote it
        fh.write(json.dumps({"kind": "train", "step": 3, "tokens": 30, "loss": "nan"}) + "\n")
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    assert raw[0] == {"kind": "train", "step": 1, "tokens": 10, "loss": 5.0}
    assert raw[1]["loss"] is None and raw[1]["grad_norm"] is None and raw[1]["nonfinite"] is True
    assert raw[2]["bpb"] is None and raw[2]["nonfinite"] is True
    train = read_metrics(path, "train")
    assert [r["loss"] for r in train] == [5.0, None, None]
    assert [r.get("nonfinite", False) for r in train] == [False, True, True]
    out = plot_loss_curve(path, tmp_path / "loss_curve.png")
    assert out.stat().st_size > 0


def test_fit_prints_the_rows_it_dropped(tmp_path, capsys):
    table = tmp_path / "table.jsonl"
    rows = [{"run_id": f"r{n}-{k}", "arch": "a", "N": n, "D": n * k, "final": 1,
             "loss": 1.7 + 400 / n ** 0.33 + 1500 / (n * k) ** 0.3}
            for n in (2e7, 5e7, 1.2e8, 3e8, 7e8, 1.5e9) for k in (5, 10, 20, 40, 80)]
    rows += [{"run_id": "nan", "arch": "a", "N": 1e8, "D": 1e9, "final": 1, "loss": float("nan")},
             {"run_id": "inf", "arch": "a", "N": 1e8, "D": 1e9, "final": 1, "loss": float("inf")},
             {"run_id": "zeroN", "arch": "a", "N": 0, "D": 1e9, "final": 1, "loss": 3.0},
             {"run_id": "negD", "arch": "a", "N": 1e8, "D": -1, "final": 1, "loss": 3.0}]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "fit"
    rc = main(["fit", str(table), "--bootstrap", "0", "--no-plots", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "dropped 4 of 34 rows: 2 NaN or inf loss, 2 N or D missing or <= 0" in printed
    dropped = json.loads((out / "fit.json").read_text())["dropped_rows"]
    assert dropped["nonfinite_metric"] == 2 and dropped["nonpositive_N_or_D"] == 2


@pytest.mark.parametrize("before", [
    '{"kind": "train", "step": 5, "tokens": 50, "loss": 4.0}\n',
    '',  # the torn row is the file's only line
])
def test_torn_last_metrics_line_does_not_swallow_the_next_row(tmp_path, caplog, before):
    path = tmp_path / "metrics.jsonl"
    torn = '{"kind": "train", "step": 10, "tok'
    path.write_text(before + torn)
    with caplog.at_level("WARNING", logger="hybrid_lm.run.metrics"):
        w = MetricsWriter(path)
    w.write({"kind": "train", "step": 6, "tokens": 60, "loss": 3.5})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == ([5, 6] if before else [6])
    assert path.read_text() == before + '{"kind": "train", "step": 6, "tokens": 60, "loss": 3.5}\n'
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{len(torn)} bytes" in warned[0] and "torn" in warned[0]


def test_last_row_missing_only_its_newline_is_kept(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5, "tokens": 50, "loss": 4.0}')
    with caplog.at_level("WARNING", logger="hybrid_lm.run.metrics"):
        w = MetricsWriter(path)
    w.write({"kind": "train", "step": 6, "tokens": 60, "loss": 3.5})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [5, 6] and not caplog.records


def test_max_consecutive_skips_below_one_fails_in_one_line_before_the_run_dir(tmp_path, capsys):
    workdir = tmp_path / "run"
    rc = main(["train", str(CONFIGS_DIR / "quickstart.gin"), "--gin_param", "TrainConfig.max_consecutive_skips=0",
               "--workdir", str(workdir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("config error: TrainConfig.max_consecutive_skips=0 must be an integer >= 1 "
                               "(non-finite steps in a row that stop a nan_policy='skip' run)")
    assert not workdir.exists()


def test_init_from_a_missing_run_fails_in_one_line_before_the_run_dir(tmp_path, capsys):
    workdir = tmp_path / "run"
    rc = main(["train", str(CONFIGS_DIR / "quickstart.gin"), "--init-from", f"{tmp_path / 'gone'}@100",
               "--workdir", str(workdir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"error: --init-from {tmp_path / 'gone'}@100: no run directory {tmp_path / 'gone'}"
    assert not workdir.exists()
