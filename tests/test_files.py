"""hybrid_lm.files: atomic writes replace the target whole, or leave it as it was."""

import json

import numpy as np
import pytest

from hybrid_lm.files import atomic_write, atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_replace_the_target_and_leave_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_text(p, "old")
    assert atomic_write_json(p, {"x": 1}, indent=2) == p
    assert json.loads(p.read_text()) == {"x": 1}
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    ids = np.arange(5, dtype=np.uint16)
    atomic_write(tmp_path / "c.bin", ids.tofile)
    assert (np.fromfile(tmp_path / "c.bin", dtype=np.uint16) == ids).all()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.json", "b.bin", "c.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "old")

    def fail(fh):
        fh.write("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(p, fail, text=True)
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["a.txt"]


# ----------------------------------------------------------------------------- JSONL records

def test_an_append_after_a_torn_tail_cuts_it_and_readers_skip_one_with_one_warning(tmp_path, caplog):
    from hybrid_lm.files import append_jsonl, read_jsonl

    path = tmp_path / "eval.jsonl"
    torn = '{"kind": "loss", "step": 10, "lo'
    path.write_text('{"kind": "loss", "step": 5}\n' + torn)
    assert read_jsonl(path) == [{"kind": "loss", "step": 5}]
    assert read_jsonl(path) == [{"kind": "loss", "step": 5}]  # read again: warned once only
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "line 2" in warned[0] and str(path) in warned[0], warned
    caplog.clear()
    append_jsonl(path, [{"kind": "loss", "step": 10}])
    assert path.read_text() == '{"kind": "loss", "step": 5}\n{"kind": "loss", "step": 10}\n'
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{len(torn)} bytes" in warned[0] and "torn" in warned[0], warned
    assert read_jsonl(path) == [{"kind": "loss", "step": 5}, {"kind": "loss", "step": 10}]
    # a whole row that lost only its newline is kept
    path.write_text('{"kind": "loss", "step": 5}')
    append_jsonl(path, [{"kind": "loss", "step": 6}])
    assert [r["step"] for r in read_jsonl(path)] == [5, 6]
    assert read_jsonl(tmp_path / "none.jsonl") == []
