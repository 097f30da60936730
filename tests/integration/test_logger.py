"""What a run shows: start-up summary, compile time, plain log lines, sinks, the loss curve."""

import io
import subprocess
import sys

import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.train.logger import StepLogger
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics

STATS = {"loss": 2.5, "objective": 2.5, "lr": 1e-3, "grad_norm": 1.0, "param_norm": 3.0, "update_norm": 0.1,
         "finite": True}


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _logger(cfg, tmp_path, stream):
    logger = StepLogger(cfg, tmp_path, main=True, start=0, n_devices=1, stream=stream)
    logger.compiling()
    logger.compiled(0)
    return logger


def test_plain_log_line_per_log_every_when_not_a_tty(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["TrainConfig.progress = True", "TrainConfig.steps = 10"])
    out = io.StringIO()
    logger = _logger(cfg, tmp_path, out)
    for done in range(1, 11):
        logger.train_row(done, STATS)
        logger.advance()
    logger.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["5/10", "10/10"]
    assert "loss 2.5000" in lines[0] and "lr 0.001" in lines[0] and "tok/s" in lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == [5, 10]


def test_a_tty_gets_the_bar_and_no_plain_lines(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["TrainConfig.progress = True", "TrainConfig.steps = 10"])
    out = _Tty()
    logger = _logger(cfg, tmp_path, out)
    for done in range(1, 11):
        logger.train_row(done, STATS)
        logger.advance()
    logger.close()
    assert not [ln for ln in out.getvalue().replace("\r", "\n").splitlines() if ln.startswith("step 5/10")]
    assert "train" in out.getvalue()  # tqdm's bar


def _result(loss: float, bpb: float) -> dict:
    """An eval result as ``run/loss.py::evaluate`` returns it, for 8 windows."""
    windows = np.full(8, loss)
    return {"loss": loss, "loss_se": 0.01, "bpb": bpb, "bpb_se": 0.01, "eval_windows": 8, "window_losses": windows,
            "eval_s": 0.1}


def test_loss_curve_is_refreshed_at_every_eval(tiny_params, tmp_path):
    cfg = load_config([], tiny_params)
    logger = _logger(cfg, tmp_path, io.StringIO())
    png = tmp_path / "loss_curve.png"
    logger.eval_row(0, _result(5.0, 7.0))
    first = png.read_bytes()
    logger.train_row(5, STATS)
    logger.eval_row(5, _result(3.0, 4.0))
    assert png.read_bytes() != first  # redrawn with the new points
    logger.close()


def test_missing_extra_fails_before_the_run_dir_exists(tiny_params, tmp_path, monkeypatch):
    for module, flag, extra in (("tensorboardX", "tensorboard", "tb"), ("wandb", "wandb", "wandb")):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
        cfg = load_config([], tiny_params + [f"TrainConfig.{flag} = True"])
        with pytest.raises(ImportError, match=rf"\[{extra}\]"):
            train(cfg, tmp_path / module)
        assert not (tmp_path / module).exists()


def test_wandb_sink_offline(tiny_params, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config([], tiny_params + ["TrainConfig.wandb = True"])
    logger = _logger(cfg, tmp_path, io.StringIO())
    logger.train_row(5, STATS)
    logger.eval_row(5, _result(3.0, 4.0))
    logger.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))  # written locally, nothing sent
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2  # the JSONL stays the record


def test_startup_summary_compile_time_and_first_row_speed(tiny_params, tmp_path, capsys):
    cfg = load_config([], tiny_params + ["TrainConfig.steps = 4", "TrainConfig.log_every = 2",
                                         "TrainConfig.progress = True"])
    res = train(cfg, tmp_path)
    out = capsys.readouterr().out
    for head in ("model ", "params ", "backend ", "data ", "mesh ", "compiling…", "compiled in"):
        assert head in out
    assert out.index("mesh ") < out.index("compiling…") < out.index("compiled in") < out.index("step 2/4")
    assert "\r" not in out  # captured stdout is not a TTY: plain lines
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert res.compile_seconds and res.compile_seconds > 0 and rows[0]["step_time"] > 0
    assert (tmp_path / "loss_curve.png").exists()  # the window's arithmetic: tests/test_step_window.py


def test_order0_comparison_is_honest_about_worse_than_unigram():
    from hybrid_lm.train.cli import order0_comparison

    assert order0_comparison(3.0, 4.0) == "25.0% below the order-0 entropy"
    assert order0_comparison(6.0, 4.0).startswith("50.0% above the order-0 entropy")
    assert "below" not in order0_comparison(6.0, 4.0)


def test_sweep_worker_log_lines_name_the_run(tmp_path):
    from hybrid_lm.scaling.launch import _PrefixedLog

    log = _PrefixedLog(tmp_path / "w.log", "run-a")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('one'); print('two', file=sys.stderr)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.pump(proc.stdout)
    proc.wait()
    log.close()
    assert sorted((tmp_path / "w.log").read_text().splitlines()) == ["[run-a] one", "[run-a] two"]
