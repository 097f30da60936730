"""Signals at any moment of a run, Ctrl-C, a kill before the first checkpoint, and a failed start: each
ends in one line and a rerun of the same command finishes bitwise equal to an uninterrupted run.

Signals are sent by the trainer to itself from a hook at an exact point (a step's row, a checkpoint
save, the restore during start-up: ``cluster_sim.HOOKED``), so each case tests what it names whatever
the machine's speed.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from cluster_sim import HOOKED, base_env, fake_slurm_bin, slurm_env
from conftest import TINY
from resume_check import compare_runs, write_gin

STEPS = 8
PARAMS = [p for p in TINY if "every_steps" not in p and "log_every" not in p] + [
    f"TrainConfig.steps = {STEPS}", "TrainConfig.log_every = 1", "CheckpointConfig.every_steps = 4"]

def _train(workdir, gin, hook=None, env=None, timeout=300):
    env = dict(env or base_env())
    if hook:
        env["HOOK"] = json.dumps(hook)
    cmd = [sys.executable, "-c", HOOKED] if hook else [sys.executable, "-m", "hybrid_lm.cli"]
    r = subprocess.run([*cmd, "train", str(gin), "--workdir", str(workdir)], env=env, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _lines(out):
    return [x for x in out.splitlines() if x.strip()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("signals")
    gin = write_gin(d / "run.gin", PARAMS)
    rc, out = _train(d / "straight", gin)
    assert rc == 0, out[-3000:]
    return d, gin


def _bitwise(d, workdir):
    cmp = compare_runs(d / "straight", workdir)
    assert cmp["steps"] == STEPS and cmp["loss_equal"] and cmp["state_equal"], cmp


@pytest.mark.parametrize("where,at,saved", [("row", 1, 2),   # before the first checkpoint (step 4)
                                            ("save", 4, 5),  # during a save
                                            ("row", 5, 6)])  # after one
def test_ctrl_c_saves_in_one_line_and_the_rerun_ends_bitwise(setup, tmp_path, where, at, saved):
    d, gin = setup
    rc, out = _train(tmp_path / "run", gin, {"where": where, "at": at, "signals": [signal.SIGINT]})
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    assert _lines(out)[-1] == (f"SIGINT: saved a checkpoint at step {saved} in {tmp_path / 'run'} and stopped; run the "
                               "same command to resume (skipped steps 0)")
    assert not (tmp_path / "run" / ".lock").exists()
    rc, out = _train(tmp_path / "run", gin)
    assert rc == 0 and f"resumed from step {saved}" in out, out[-3000:]
    _bitwise(d, tmp_path / "run")


def test_a_second_ctrl_c_during_a_save_exits_at_once(setup, tmp_path):
    """The save of step 4 (the first) never finishes: the second Ctrl-C ends the process from the signal
    thread; the rerun finds rows and no checkpoint, archives the rows and ends bitwise."""
    d, gin = setup
    rc, out = _train(tmp_path / "run", gin, {"where": "save", "at": 4, "signals": [signal.SIGINT, signal.SIGINT],
                                             "sleep": 600}, timeout=120)
    assert rc == 130 and "Traceback" not in out and "terminate called" not in out, out[-3000:]
    assert _lines(out)[-1].startswith("interrupted again: exiting now without saving")
    assert not (tmp_path / "run" / ".lock").exists()
    rc, out = _train(tmp_path / "run", gin)
    assert rc == 0 and "no checkpoint was committed before the run" in out, out[-3000:]
    _bitwise(d, tmp_path / "run")


def test_kill_before_the_first_checkpoint_reruns_from_step_0_bitwise(setup, tmp_path):
    d, gin = setup
    rc, out = _train(tmp_path / "run", gin, {"where": "row", "at": 2, "signals": [signal.SIGKILL]})
    assert rc == -signal.SIGKILL
    rows = (tmp_path / "run" / "metrics.jsonl").read_text()
    rc, out = _train(tmp_path / "run", gin)
    assert rc == 0, out[-3000:]
    warned = [x for x in _lines(out) if "no checkpoint was committed before the run" in x]
    assert len(warned) == 1 and warned[0].startswith("WARNING") and "training from step 0" in warned[0]
    (archive,) = (tmp_path / "run" / "archive").iterdir()
    assert (archive / "metrics.jsonl").read_text() == rows
    _bitwise(d, tmp_path / "run")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_during_start_up_stops_before_training_in_one_line(setup, tmp_path, sig):
    """SIGTERM, SIGUSR1 and Ctrl-C during the start-up (here: right after the restore) stop the run before
    its first step with nothing to save; SIGUSR1 requeues only this array task. (Before, SIGUSR1 here
    killed the trainer: exit 138, no requeue, the lock left behind.)"""
    d, gin = setup
    bin_dir, calls = fake_slurm_bin(tmp_path / "bin")
    env = base_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SCONTROL_LOG=calls,
                   **slurm_env(700, array_task=0))
    rc, out = _train(tmp_path / "run", gin, {"where": "restore", "signals": [sig]}, env=env)
    name = signal.Signals(sig).name
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    last = _lines(out)[-1]
    assert last.startswith(f"{name} before training started: nothing new to save (it has no checkpoint yet); "
                           "run the same command to resume"), last
    assert not (tmp_path / "run" / ".lock").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    if sig == signal.SIGUSR1:
        # the array task (SLURM_JOB_ID equals SLURM_ARRAY_JOB_ID here, as for one task of every array):
        # `scontrol requeue 700` would requeue the whole array
        assert last.endswith("; requeued SLURM job 700_0") and calls.read_text() == "requeue 700_0\n"
    else:
        assert not calls.exists()
    if sig == signal.SIGINT:
        rc, out = _train(tmp_path / "run", gin)
        assert rc == 0, out[-3000:]
        _bitwise(d, tmp_path / "run")


def test_a_failed_start_writes_nothing_and_a_corrected_config_is_taken(setup, tmp_path):
    """A mistyped data path fails before the workdir is written; a workdir that never trained (only the
    files of an earlier failed start) takes the corrected config without --force."""
    d, gin = setup
    bad = write_gin(tmp_path / "bad.gin", PARAMS + ["DataConfig.source = 'tokens'",
                                                     f"DataConfig.path = '{tmp_path / 'no_such_store'}'"])
    rc, out = _train(tmp_path / "run", bad)
    assert rc == 2 and _lines(out)[-1].startswith("data error: no token store at"), out[-2000:]
    assert not (tmp_path / "run").exists()
    # what an earlier version left after that failed start: the run files of the wrong config
    (tmp_path / "run").mkdir()
    for name in ("config.json", "operative.gin", "provenance.json"):
        (tmp_path / "run" / name).write_text((d / "straight" / name).read_text())
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg["data"]["seq_len"] = 64
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    rc, out = _train(tmp_path / "run", gin)
    assert rc == 0 and "replacing the config of a run that never trained" in out, out[-3000:]
    _bitwise(d, tmp_path / "run")
