"""experiments/fault_stress.py tests what each case names whatever the machine's speed: the second trainer
really overlaps the first (paused mid-run, holding the lock), a kill during a save happens before that
checkpoint is committed, and a kill before the first save is rerun from step 0 without --restart."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_fault_harness_cases_hit_what_they_name(tmp_path):
    out = tmp_path / "faults.json"
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "fault_stress.py"), "--faults", "3", "--seed", "3",
                        "--kinds", "second_trainer,kill_during_save,sigkill", "--steps", "8", "--timeout", "240",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = {x["kind"]: x for x in json.loads(out.read_text())["rows"]}
    second = rows["second_trainer"]
    assert second["overlapped"] and second["second_rc"] == 2 and "in use by another trainer" in second["error"]
    assert second["first_rc"] == 0 and second["bitwise_equal"]
    save = rows["kill_during_save"]
    assert save["kill_rc"] == -9 and save["kill_at"] not in save["checkpoints_at_kill"] and save["bitwise_equal"]
    assert all(x["ok"] for x in rows.values())
