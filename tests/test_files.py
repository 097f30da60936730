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


# ----------------------------------------------------------------------------- a full disk

# `python -c LIMITED BYTES CODE`: CODE run under a file size limit (SIGXFSZ ignored: a write past it fails with
# EFBIG, as one on a full disk fails with ENOSPC)
LIMITED = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
           "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))\nexec(sys.argv[2])\n")


def _limited(limit: int, code: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", LIMITED, str(limit), code], capture_output=True, text=True, timeout=120)


def test_a_write_that_fails_names_its_file_and_keeps_the_old_one(tmp_path):
    """A full disk's error names the file being written (Python's own names none), and the old file stays whole."""
    target = tmp_path / "fit.json"
    target.write_text("old")
    r = _limited(1024, f"from hybrid_lm.files import atomic_write_text\natomic_write_text({str(target)!r}, 'x' * 4096)")
    assert r.returncode != 0 and f"File too large: '{target}'" in r.stderr.strip().splitlines()[-1], r.stderr[-1000:]
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["fit.json"]
    rows = tmp_path / "metrics.jsonl"
    r = _limited(1024, "from hybrid_lm.run.metrics import MetricsWriter\n"
                       f"w = MetricsWriter({str(rows)!r})\nfor i in range(100): w.write({{'kind': 'train', 'step': i}})")
    assert r.returncode != 0 and f"File too large: '{rows}'" in r.stderr.strip().splitlines()[-1], r.stderr[-1000:]


def test_figures_are_written_whole_or_not_at_all(tmp_path):
    """loss_curve.png (and the fit's figures, report.md, the sbatch scripts: the same helpers) replace the old
    file only once the new one is complete."""
    rows = tmp_path / "metrics.jsonl"
    rows.write_text("".join(json.dumps({"kind": "train", "step": s, "tokens": 10 * s, "loss": 5.0 - 0.1 * s}) + "\n"
                            for s in range(1, 20)))
    png = tmp_path / "loss_curve.png"
    png.write_bytes(b"old")
    r = _limited(2048, f"from pathlib import Path\nfrom hybrid_lm.run.metrics import plot_loss_curve\n"
                       f"plot_loss_curve(Path({str(rows)!r}), Path({str(png)!r}))")
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr[-1000:]
    assert png.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "metrics.jsonl"]
