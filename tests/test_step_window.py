"""The step-time window of the train logger, on an injected clock: the first window starts when the
train step has compiled, so the compile never counts as step time."""

import io
import json

import numpy as np

from hybrid_lm.experiment import load_config
from hybrid_lm.train.logger import StepLogger


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _stats(loss=2.0):
    return {"finite": True, "loss": np.float32(loss), "objective": np.float32(loss), "lr": np.float32(1e-3),
            "grad_norm": np.float32(1.0), "param_norm": np.float32(10.0), "update_norm": np.float32(0.01)}


def test_compile_time_and_step_times_come_from_the_clock(tmp_path):
    cfg = load_config([], ["TrainConfig.steps = 6", "TrainConfig.log_every = 2", "TrainConfig.progress = False"])
    clock = Clock()
    log = StepLogger(cfg, tmp_path, main=True, start=0, n_devices=1, stream=io.StringIO(), clock=clock)
    log.compiling()
    clock.now += 40.0  # the first step's call compiles
    log.compiled(0)
    assert log.compile_seconds == 40.0
    clock.now += 1.0  # two steps of 0.5 s after the compile
    log.train_row(1, _stats())
    log.train_row(2, _stats())
    clock.now += 3.0  # then two of 1.5 s
    log.train_row(3, _stats())
    log.train_row(4, _stats())
    log.close()
    rows = [r for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in r]
    times = [json.loads(r)["step_time"] for r in rows]
    assert times == [0.5, 1.5]
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert json.loads(rows[0])["tokens_per_sec"] == tokens / 0.5
