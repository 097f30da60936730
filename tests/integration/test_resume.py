"""Exact resume: a run killed from outside (SIGKILL, SIGTERM) and resumed equals an uninterrupted run,
bitwise, in its loss curve and its final parameters and optimizer state."""

import signal

import pytest

from conftest import TINY
from resume_check import compare_runs, train_subprocess, write_gin

PARAMS = TINY + ["TrainConfig.steps = 20", "TrainConfig.log_every = 1", "CheckpointConfig.every_steps = 3",
                 "CheckpointConfig.async_save = True"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    gin = write_gin(d / "run.gin", PARAMS)
    r = train_subprocess(gin, d / "straight")
    assert r["returncode"] == 0, r["output"][-3000:]
    return gin, d


@pytest.mark.parametrize("sig,kill_at", [(signal.SIGKILL, 8), (signal.SIGTERM, 11)])
def test_killed_and_resumed_run_is_bitwise_equal(straight, sig, kill_at):
    gin, d = straight
    work = d / f"killed_{sig.name}"
    r = train_subprocess(gin, work, kill_at=kill_at, sig=sig)
    assert r["killed_at"] is not None, r["output"][-3000:]
    if sig == signal.SIGTERM:
        assert r["returncode"] == 0 and "SIGTERM: saved a checkpoint" in r["output"], r["output"][-3000:]
    else:
        assert r["returncode"] == -signal.SIGKILL
    r2 = train_subprocess(gin, work)
    assert r2["returncode"] == 0 and "resumed from step" in r2["output"], r2["output"][-3000:]
    cmp = compare_runs(d / "straight", work)
    assert cmp["steps"] == 20 and cmp["loss_equal"] and cmp["state_equal"], cmp
