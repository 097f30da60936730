"""Faults around the run directory: the workdir lock, a failing checkpoint save, and refusing a
silent restart when nothing restores."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hybrid_lm.errors import WorkdirError
from hybrid_lm.train.lock import WorkdirLock


def test_a_second_lock_on_a_workdir_refuses_naming_the_holder(tmp_path):
    first = WorkdirLock(tmp_path).acquire()
    with pytest.raises(WorkdirError, match=f"in use by another trainer \\(host {socket.gethostname()} "
                                           f"pid {os.getpid()} since"):
        WorkdirLock(tmp_path).acquire()
    code = ("import sys; from hybrid_lm.train.lock import WorkdirLock\n"
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
