"""Every JSONL file the project appends to (metrics.jsonl, eval.jsonl) survives a torn last line: the next
append cuts it off (one warning), and readers skip a torn line with one warning instead of failing."""

import json

from hybrid_lm.cli import main


def test_eval_after_a_torn_eval_jsonl_keeps_its_row_and_eval_report_reads_it(tiny_run, capsys, caplog, tmp_path):
    run = tiny_run(5)
    torn = '{"kind": "swap_eval", "task": "loss", "checkpoint_st'
    (run / "eval.jsonl").write_text(torn)
    assert main(["eval", str(run), "--tasks", "loss"]) == 0
    capsys.readouterr()
    lines = (run / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["task"] == "loss"  # the torn tail cut, the row on its own line
    assert sum("torn" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with (run / "eval.jsonl").open("a") as fh:  # torn again after the last row: readers skip it
        fh.write(torn)
    assert main(["eval-report", str(run), "--out", str(tmp_path / "rep"), "--tasks", "loss"]) == 0
    assert "loss" in capsys.readouterr().out
    warned = [r.getMessage() for r in caplog.records if "eval.jsonl" in r.getMessage()]
    assert len(warned) == 1 and "line 2" in warned[0], warned
