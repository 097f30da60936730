"""Faults around the run directory: the workdir lock, a failing checkpoint save, and refusing a
silent restart when nothing restores."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from hybrid_lm.run.directory import load_run_config
from hybrid_lm.errors import WorkdirError
from hybrid_lm.lock import WorkdirLock
from resume_check import make_unwritable




def test_a_second_lock_on_a_workdir_refuses_naming_the_holder(tmp_path):
    first = WorkdirLock(tmp_path).acquire()
    with pytest.raises(WorkdirError, match=f"in use by another trainer \\(host {socket.gethostname()} "
                                           f"pid {os.getpid()} since"):
        WorkdirLock(tmp_path).acquire()
    code = ("import sys; from hybrid_lm.lock import WorkdirLock\n"
            "try: WorkdirLock(sys.argv[1]).acquire()\n"
            "except Exception as e: print(type(e).__name__, e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 3 and "WorkdirError" in out.stdout and f"pid {os.getpid()}" in out.stdout
    first.release()
    assert not (tmp_path / ".lock").exists()
    WorkdirLock(tmp_path).acquire().release()


def _write_lock(path, **record):
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                                "started_utc": "then", "token": "x", **record}))


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    _write_lock(tmp_path / ".lock", pid=int(dead))
    lock = WorkdirLock(tmp_path).acquire()
    assert "taking over the stale lock" in caplog.text and f"pid {dead} is not running" in caplog.text
    assert json.loads((tmp_path / ".lock").read_text())["token"] == lock.record["token"]
    lock.release()
    # another host's lock: stale only by age
    _write_lock(tmp_path / ".lock", host="elsewhere", pid=1, started=time.time() - 7200)
    with pytest.raises(WorkdirError, match="host elsewhere pid 1"):
        WorkdirLock(tmp_path).acquire()
    monkeypatch.setenv("HYBRID_LM_LOCK_STALE_HOURS", "1")
    WorkdirLock(tmp_path).acquire().release()
    assert not list(tmp_path.glob(".lock*"))


def test_a_live_trainers_lock_is_kept_however_old(tmp_path, caplog, monkeypatch):
    """A lock whose pid runs on this host is never taken over by age (runs last days); a pid that now runs a
    process started after the lock (reused) is not the holder."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _write_lock(tmp_path / ".lock", pid=holder.pid, started=time.time())
        monkeypatch.setenv("HYBRID_LM_LOCK_STALE_HOURS", "0")  # every lock is older than that
        with pytest.raises(WorkdirError, match=f"in use by another trainer \\(host {socket.gethostname()} "
                                               f"pid {holder.pid} since"):
            WorkdirLock(tmp_path).acquire()
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid
        monkeypatch.delenv("HYBRID_LM_LOCK_STALE_HOURS")
        _write_lock(tmp_path / ".lock", pid=holder.pid, started=time.time() - 3600)  # before the process began
        WorkdirLock(tmp_path).acquire().release()
        assert f"its pid {holder.pid} now runs a process started after the lock was taken" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_train_refuses_a_locked_workdir_in_one_line(tmp_path, capsys):
    from hybrid_lm.cli import main
    from hybrid_lm.config import CONFIGS_DIR

    lock = WorkdirLock(tmp_path).acquire()
    try:
        rc = main(["train", str(CONFIGS_DIR / "quickstart.gin"), "--workdir", str(tmp_path)])
    finally:
        lock.release()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "in use by another trainer" in err and "\n" not in err


# --- a failing checkpoint save -------------------------------------------------------------------

def _tiny(tiny_params, *extra):
    return [p for p in tiny_params if "every_steps" not in p and "async_save" not in p] + \
        ["CheckpointConfig.every_steps = 2", *extra]


def _cli_train(workdir, params, timeout=240):
    args = [sys.executable, "-m", "hybrid_lm.cli", "train", "base.gin", "--workdir", str(workdir)]
    for p in params:
        args += ["--gin_param", p]
    t = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t


@pytest.mark.timeout(300)
def test_a_failed_save_is_fatal_fast_and_keeps_the_previous_checkpoint(tmp_path, tiny_params):
    params = _tiny(tiny_params, "CheckpointConfig.async_save = True")
    out, _ = _cli_train(tmp_path, params + ["TrainConfig.steps = 2"])
    assert out.returncode == 0, out.stderr[-2000:]
    ckdir = tmp_path / "checkpoints"
    undo = make_unwritable(ckdir)
    if undo is None:
        pytest.skip("neither chmod nor chattr makes a directory read-only here")
    try:
        out, _ = _cli_train(tmp_path, params + ["TrainConfig.steps = 4"])  # a hang fails on the timeout
    finally:
        undo()
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2, out.stderr[-2000:]
    assert last.startswith("error: saving the checkpoint at step 4 in ") and str(ckdir) in last
    assert "PermissionError" in last and "earlier checkpoints are kept" in last
    assert not (tmp_path / ".lock").exists()
    from hybrid_lm.run.restore import RestoredRun
    assert RestoredRun(tmp_path).step == 2


def test_a_background_save_error_is_one_clear_error(tmp_path, monkeypatch):
    from hybrid_lm.config import CheckpointConfig
    from hybrid_lm.run import checkpoint as ck

    c = ck.Checkpointer(tmp_path / "checkpoints", CheckpointConfig())

    def fail():
        raise PermissionError(13, "Permission denied", str(tmp_path / "checkpoints" / "4"))

    monkeypatch.setattr(c.manager, "wait_until_finished", fail)
    with pytest.raises(ck.CheckpointSaveError, match="a background checkpoint save in .*checkpoints failed "
                                                     "\\(PermissionError: .*Permission denied"):
        c.save(4, {"x": np.zeros(2)}, {"step": 4})
    c.close()  # after a reported failure: shuts down without raising it again

    def hang():
        time.sleep(30)

    c = ck.Checkpointer(tmp_path / "other", CheckpointConfig())
    monkeypatch.setattr(c.manager, "wait_until_finished", hang)
    monkeypatch.setenv("HYBRID_LM_SAVE_TIMEOUT_S", "0.5")
    t = time.monotonic()
    with pytest.raises(ck.CheckpointSaveError, match="did not finish within 0.5 s"):
        c.wait()
    assert time.monotonic() - t < 5
    c.close()


# --- no silent restart ---------------------------------------------------------------------------

STEPS = 10  # checkpoints at 5 and 10 (TINY: every_steps = 5)


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("done_run")
    train(load_config([], list(TINY) + [f"TrainConfig.steps = {STEPS}"]), wd)
    return wd


def _copy(done_run, tmp_path):
    import shutil
    wd = tmp_path / "run"
    shutil.copytree(done_run, wd)
    return wd


def _corrupt(wd, step):
    for f in (wd / "checkpoints" / str(step) / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")


def _cfg(steps=STEPS):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    return load_config([], list(TINY) + [f"TrainConfig.steps = {steps}"])


def _train_steps(wd):
    return [r["step"] for r in map(json.loads, (wd / "metrics.jsonl").read_text().splitlines()) if "loss" in r
            and "bpb" not in r]


def test_all_checkpoints_corrupt_refuses_listing_each(done_run, tmp_path):
    from hybrid_lm.train.loop import train

    wd = _copy(done_run, tmp_path)
    _corrupt(wd, 5)
    _corrupt(wd, 10)
    rows = (wd / "metrics.jsonl").read_text()
    with pytest.raises(WorkdirError, match=r"no checkpoint restores \(moved to .*corrupt\): step 10: .*; "
                                           r"step 5: .*--restart") as e:
        train(_cfg(), wd)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (wd / "checkpoints" / "corrupt").iterdir()) == ["10", "5"]
    assert (wd / "metrics.jsonl").read_text() == rows and not (wd / ".lock").exists()
    with pytest.raises(WorkdirError, match="holds rows but .*checkpoints holds no checkpoint"):
        train(_cfg(), wd)  # the next attempt: metrics, and only the moved-aside checkpoints


def test_metrics_but_no_checkpoint_ever_committed_archives_and_trains_from_zero(done_run, tmp_path, caplog):
    """A run killed before its first save left rows and no checkpoint: nothing can be lost, so the rerun
    archives the rows (one warning line) and trains from step 0, to the same losses."""
    import shutil
    from hybrid_lm.train.loop import train
    from hybrid_lm.run.metrics import read_metrics

    wd = _copy(done_run, tmp_path)
    rows = (wd / "metrics.jsonl").read_text()
    shutil.rmtree(wd / "checkpoints")
    (wd / "committed_checkpoints.json").unlink()  # a run killed before its first save never recorded one
    (wd / "checkpoints").mkdir()
    res = train(_cfg(), wd)
    assert res.resumed_from is None and res.step == STEPS
    (archive,) = (wd / "archive").iterdir()
    assert (archive / "metrics.jsonl").read_text() == rows and not (archive / "checkpoints").exists()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([m for m in said if "no checkpoint was committed before the run" in m]) == 1, said
    again = [(r["step"], r["loss"]) for r in read_metrics(wd / "metrics.jsonl", "train")]
    assert again == [(r["step"], r["loss"]) for r in read_metrics(archive / "metrics.jsonl", "train")]


def test_restart_archives_and_trains_from_zero(done_run, tmp_path, tiny_params):
    from hybrid_lm.cli import main

    wd = _copy(done_run, tmp_path)
    _corrupt(wd, 5)
    _corrupt(wd, 10)
    old_rows = (wd / "metrics.jsonl").read_text()
    args = ["train", "base.gin", "--workdir", str(wd), "--restart"]
    for p in tiny_params + ["TrainConfig.steps = 5"]:
        args += ["--gin_param", p]
    assert main(args) == 0
    (archive,) = (wd / "archive").iterdir()
    assert (archive / "metrics.jsonl").read_text() == old_rows
    assert sorted(p.name for p in (archive / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "5"]
    assert _train_steps(wd) == [5] and (wd / "checkpoints" / "5").is_dir()


def test_a_corrupt_newest_is_moved_aside_and_its_step_saved_again(done_run, tmp_path, caplog):
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.train.loop import train

    wd = _copy(done_run, tmp_path)
    _corrupt(wd, 10)
    res = train(_cfg(), wd)
    assert res.resumed_from == 5 and res.step == STEPS
    assert "moved the checkpoint at step 10" in caplog.text
    said = [r.getMessage() for r in caplog.records if "checkpoint at step 10" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and len(said[0]) < 600, said  # not TensorStore's spec dump
    assert (wd / "checkpoints" / "corrupt" / "10").is_dir()
    assert RestoredRun(wd).step == STEPS  # the new save at step 10 replaced the corrupt one


# --- damaged checkpoint data ----------------------------------------------------------------------

def _largest_file(wd, step):
    return max((f for f in (wd / "checkpoints" / str(step)).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_bytes(path, how: str) -> None:
    """XOR 0xFF into 3 x 16 bytes at a quarter, half and three quarters of ``path`` ("bytes"), or flip one
    bit in its middle ("bit")."""
    data = bytearray(path.read_bytes())
    if how == "bit":
        data[len(data) // 2] ^= 0x10
    else:
        for at in (len(data) // 4, len(data) // 2, 3 * len(data) // 4):
            data[at:at + 16] = bytes(b ^ 0xFF for b in data[at:at + 16])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bytes", "bit"])
def test_a_byte_flip_in_the_newest_checkpoint_is_moved_aside_and_resume_is_bitwise_that_of_the_one_before(
        done_run, tmp_path, caplog, how):
    """3 x 16 bytes XOR 0xFF, or one bit, in the checkpoint's largest file (compressed array data: damage that
    mostly still decodes, caught by the checksums saved with the checkpoint): one warning naming the step moved
    aside, and the run resumes from the newest intact checkpoint, ending bitwise equal to a clean resume from it."""
    import shutil

    from hybrid_lm.train.loop import train
    from resume_check import compare_runs

    wd = _copy(done_run, tmp_path)
    clean = tmp_path / "clean"
    shutil.copytree(done_run, clean)
    shutil.rmtree(clean / "checkpoints" / str(STEPS))
    flip_bytes(_largest_file(wd, STEPS), how)
    caplog.clear()
    res = train(_cfg(), wd)
    assert res.resumed_from == 5 and res.step == STEPS
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and f"step {STEPS}" in r.getMessage()]
    assert len(said) == 1 and "moved" in said[0] and "\n" not in said[0], said  # a checksum, or a decoder, caught it
    assert (wd / "checkpoints" / "corrupt" / str(STEPS)).is_dir()
    assert train(_cfg(), clean).resumed_from == 5
    cmp = compare_runs(clean, wd)
    assert cmp["loss_equal"] and cmp["state_equal"], cmp


def test_eval_of_a_checkpoint_whose_parameters_were_damaged_names_it_in_one_line(done_run, tmp_path, caplog):
    """One bit of one parameter differs from what was saved (written back through orbax with the original
    meta, so it decodes: damage that no format check sees); eval restores only the parameters and checks
    them against their own checksum."""
    import shutil

    import orbax.checkpoint as ocp

    from hybrid_lm.run.restore import RestoredRun

    wd = _copy(done_run, tmp_path)
    mgr = ocp.CheckpointManager((wd / "checkpoints").resolve(), item_names=("state", "meta"))
    old = mgr.restore(STEPS, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    state = jax.tree.map(np.array, old.state)
    state["params"]["embed"]["table"].view(np.uint32).flat[7] ^= 1 << 4
    shutil.rmtree(wd / "checkpoints" / str(STEPS))
    mgr.reload()
    mgr.save(STEPS, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(old.meta))))
    mgr.wait_until_finished()
    mgr.close()
    assert RestoredRun(wd).step == 5  # the newest that restores intact
    with pytest.raises(WorkdirError, match=f"the checkpoint at step {STEPS} .* does not restore \\(its arrays do not "
                                           "match the checksums saved with them"):
        RestoredRun(wd, step=STEPS)
    from hybrid_lm.train.loop import train  # and the trainer, which checks the whole state, moves it aside

    res = train(_cfg(), wd)
    assert res.resumed_from == 5 and (wd / "checkpoints" / "corrupt" / str(STEPS)).is_dir()
    assert f"moved the checkpoint at step {STEPS}, which does not restore (its arrays do not match the checksums" \
        in caplog.text


# --- checkpoints deleted after they were committed --------------------------------------------------

def test_checkpoints_deleted_after_they_were_committed_are_refused_naming_restart(done_run, tmp_path, caplog):
    """A scratch purge emptied checkpoints/ of a run that had committed steps 5 and 10: the rerun refuses in
    one line naming --restart (it does not archive the rows and train from step 0); a newest one deleted
    alone is one warning, and the run resumes from the one before."""
    import shutil

    from hybrid_lm.train.loop import train

    wd = _copy(done_run, tmp_path)
    rows = (wd / "metrics.jsonl").read_text()
    shutil.rmtree(wd / "checkpoints")
    with pytest.raises(WorkdirError, match=r"committed checkpoints \(steps 5, 10, recorded in .*\) are gone .*--restart") as e:
        train(_cfg(), wd)
    assert "\n" not in str(e.value) and "no checkpoint was committed" not in caplog.text
    assert (wd / "metrics.jsonl").read_text() == rows and not (wd / "archive").exists()
    res = train(_cfg(), wd, restart=True)
    assert res.resumed_from is None and res.step == STEPS
    wd = _copy(done_run, tmp_path / "b")
    shutil.rmtree(wd / "checkpoints" / str(STEPS))
    caplog.clear()
    assert train(_cfg(), wd).resumed_from == 5
    said = [r.getMessage() for r in caplog.records if "committed" in r.getMessage()]
    assert len(said) == 1 and f"step {STEPS}" in said[0] and "resuming from step 5" in said[0], said


# --- a failed background save ----------------------------------------------------------------------

# `python -c FSIZE ARGS...`: the hybrid-lm command line, where the save of step $FAIL_AT runs under a file size
# limit of 16 KiB (SIGXFSZ ignored: the write fails with EFBIG, as on a full disk), so its background writes
# fail; after step $PAUSE_AT's row the trainer pauses 3 s, so that failure has happened by then
FSIZE = r"""
import os, resource, signal, sys, time
from hybrid_lm.run import checkpoint
from hybrid_lm.train import logger
save, row = checkpoint.Checkpointer.save, logger.StepLogger.train_row
def hooked_save(self, step, *a, **k):
    if step == int(os.environ["FAIL_AT"]):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
    return save(self, step, *a, **k)
def train_row(self, done, *a, **k):
    row(self, done, *a, **k)
    if done == int(os.environ["PAUSE_AT"]):
        time.sleep(3)
checkpoint.Checkpointer.save, logger.StepLogger.train_row = hooked_save, train_row
from hybrid_lm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_background_save_stops_training_at_the_failure_in_one_line(tmp_path, tiny_params):
    params = _tiny(tiny_params, "CheckpointConfig.async_save = True", "TrainConfig.log_every = 1")
    out, _ = _cli_train(tmp_path, params + ["TrainConfig.steps = 4"])  # a checkpoint at step 4 (every 2, async)
    assert out.returncode == 0, out.stderr[-2000:]
    args = [sys.executable, "-c", FSIZE, "train", "base.gin", "--workdir", str(tmp_path)]
    for p in params + ["TrainConfig.steps = 40", "CheckpointConfig.every_steps = 6"]:
        args += ["--gin_param", p]
    env = {**os.environ, "FAIL_AT": "6", "PAUSE_AT": "7", "HYBRID_LM_COMPILATION_CACHE": "off"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert err[-1].startswith("error: a background checkpoint save in ") and "File too large" in err[-1], err[-3:]
    assert "earlier checkpoints are kept" in err[-1] and "Traceback" not in r.stderr, r.stderr[-3000:]
    from hybrid_lm.run.metrics import read_metrics
    assert max(x["step"] for x in read_metrics(tmp_path / "metrics.jsonl", "train")) <= 8  # not to step 40
    from hybrid_lm.run.restore import RestoredRun
    assert RestoredRun(tmp_path).step == 4


# --- paths recorded by a run -------------------------------------------------------------------------

def test_relative_data_paths_are_recorded_absolute_and_an_old_relative_one_is_named(tmp_path, monkeypatch):
    """A run started with DataConfig.path='store' (relative to where it was started) records the absolute path,
    so eval from another directory finds the store; a config.json that still holds a relative path that does not
    resolve here says so in one line."""
    from conftest import TINY
    from hybrid_lm.data.prepare import prepare
    from hybrid_lm.data.sources import SourceSpec
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train
    from tests.test_store import write_jsonl

    write_jsonl(tmp_path / "docs.jsonl", 40, seed=3)
    prepare(SourceSpec(kind="text", paths=(str(tmp_path / "docs.jsonl"),)), tmp_path / "store", progress=False)
    monkeypatch.chdir(tmp_path)
    train(load_config([], list(TINY) + ["TrainConfig.steps = 2", "DataConfig.source = 'tokens'",
                                        "DataConfig.path = 'store'"]), "run")
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["data"]["path"] == str(tmp_path / "store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = RestoredRun(tmp_path / "run")
    assert run.step == 2 and run.streams().store.path == tmp_path / "store"
    record["data"]["path"] = "store"  # as a run recorded it before
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    with pytest.raises(WorkdirError, match=r"DataConfig.path='store', a path relative to the directory the run was "
                                           r"started in: .*elsewhere/store does not exist") as e:
        RestoredRun(tmp_path / "run").streams()  # when its data is opened: judging its rows needs none
    assert "\n" not in str(e.value)
    assert load_run_config(tmp_path / "run").data.path == "store"
