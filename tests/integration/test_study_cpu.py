"""The one-GPU study on the CPU: the study spec's dry run (13 runs of S1 at T = 4096, equal tokens), and a
tiny version of it end to end: `sweep --max-minutes` stops and the same command continues, a finished
sweep launches nothing, `hybrid-lm claims` evaluates, judges by the rule from the recorded rows, and a
rerun evaluates nothing."""

import json
from pathlib import Path

import pytest

from hybrid_lm.cli import main

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EMBEDDED = ["--gin_param", "DataConfig.source = 'embedded'", "--gin_param", "DataConfig.path = None",
            "--gin_param", "DataConfig.tokenizer = 'byte'", "--gin_param", "ModelConfig.vocab_size = 256"]


def test_study_spec_dry_run(capsys):
    rc = main(["sweep", str(REPO / "configs" / "sweeps" / "study.toml"), "--dry-run", "--json", *EMBEDDED])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    jobs = plan["jobs"]
    assert [(j["arch"], j["seed"]) for j in jobs] == [
        ("full", 0), ("full", 1), ("full_rerun", 0), ("swa128", 0), ("swa512", 0), ("swa128_nope", 0), ("sa128", 0),
        ("sa_swa128", 0), ("moba", 0), ("ssa", 0), ("mamba2", 0), ("gdn", 0), ("lightning", 0)]
    assert {j["steps"] for j in jobs} == {458} and {j["D"] for j in jobs} == {458 * 32 * 4096}  # equal tokens
    assert {j["kind"] for j in jobs} == {"independent"} and jobs[0]["N"] == 14_999_424
    assert jobs[0]["config_run_id"] == jobs[2]["config_run_id"] != jobs[1]["config_run_id"]
    assert all("DataConfig.seq_len = 4096" in j["gin_params"] for j in jobs)
    assert plan["summary"]["planned_gpu_hours"] * 60 < 30  # the estimate the spec's comment quotes


TINY_STUDY = """
name = "tiny_study"
gin = ["base.gin"]
params = ["ModelConfig.vocab_size = 256", "ModelConfig.n_kv_heads = 1", "ModelConfig.compute_dtype = 'float32'",
          "DataConfig.source = 'embedded'", "DataConfig.seq_len = 32", "DataConfig.eval_windows = 8",
          "TrainConfig.global_batch = 4", "TrainConfig.log_every = 2", "TrainConfig.eval_every = 100",
          "TrainConfig.progress = False", "OptimConfig.lr = 3e-3", "OptimConfig.warmup_steps = 2",
          "CheckpointConfig.every_steps = 8", "CheckpointConfig.async_save = False",
          "ModelConfig.d_model = 16", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 2",
          "ModelConfig.head_dim = 8", "ModelConfig.d_ff = 32"]
budgets = [0.25]
equal_tokens = true
[wsd]
branch = false
[scales.t1]
# arm names as in configs/sweeps/study.toml (the claims find the arms by name); windows scaled to T = 32
[archs.full]
params = ["ModelConfig.layer_pattern = 'F'"]
seeds = [0, 1]
[archs.swa128]
params = ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 4"]
[archs.sa128]
params = ["efficient/MixerConfig.kind = 'sa'", "efficient/MixerConfig.window = 4"]
"""


def test_tiny_study_end_to_end(tmp_path, capsys):
    spec = tmp_path / "tiny_study.toml"
    spec.write_text(TINY_STUDY)
    root = tmp_path / "study"
    sweep = ["sweep", str(spec), "--launch", "local", "--root", str(root)]
    # a deadline that has passed before the first step: the part stops cleanly, nothing is lost
    assert main(sweep + ["--max-minutes", "0.0001"]) == 0
    out = capsys.readouterr().out
    assert "stopped at --max-minutes 0.0001" in out and "run the same command to continue" in out
    assert not list(root.glob("*/sweep_done.json"))
    assert main(sweep) == 0
    assert "4 jobs, 0 already done, 4 launched, 4 finished now" in capsys.readouterr().out
    done = sorted(root.glob("*/sweep_done.json"))
    assert len(done) == 4
    def stamps():  # sweep.json, the plan, is rewritten by every launch (as in test_scaling_sweep.py)
        return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p != root / "sweep.json"}

    before = stamps()
    assert main(sweep) == 0  # a finished study launches nothing and touches no run
    assert "4 jobs, 4 already done, 0 launched" in capsys.readouterr().out
    assert stamps() == before

    claims = ["claims", str(root), "--claims", "C1,C2", "--no-table", "--ruler-length", "0", "--mc-items", "2",
              "--mc-context", "8"]
    assert main(claims) == 0
    out = capsys.readouterr().out
    assert "evaluations: 10 run now, 0 already recorded, 0 left, 0 failed" in out and "claims complete" in out
    doc = json.loads((root / "claims.json").read_text())
    from hybrid_lm.scaling import study as S

    full = [r for r in doc["table"] if r["arch"] == "full"]
    band = abs(full[0]["loss"] - full[1]["loss"])
    assert doc["noise"]["bands"]["loss"] == pytest.approx(band)
    loss = {r["arch"]: r["loss"] for r in doc["table"] if r["seed"] == 0}
    c1a = doc["claims"]["C1"]["parts"][0]
    assert c1a["d"] == pytest.approx(loss["sa128"] - loss["swa128"])
    assert c1a["verdict"] == S.verdict_greater(c1a["d"], band)
    assert doc["claims"]["C1"]["parts"][1]["verdict"] == S.NOT_EVALUATED  # no sa_swa128 arm here
    c2a = doc["claims"]["C2"]["parts"][0]
    per_run = [n["loss_swa"] - n["loss_sa"] for n in c2a["numbers"].values()]
    assert c2a["d"] == pytest.approx(sum(per_run) / 2) and c2a["band"] == pytest.approx(abs(per_run[0] - per_run[1]))
    assert c2a["verdict"] == S.verdict_greater(c2a["d"], c2a["band"])
    c2c = doc["claims"]["C2"]["parts"][2]  # the next_line task through lm-eval, contexts prefilled with the swap
    per_run = [n["acc_norm_sa_prefill"] - n["acc_norm_swa_prefill"] for n in c2c["numbers"].values()]
    assert len(per_run) == 2 and c2c["d"] == pytest.approx(sum(per_run) / 2)
    assert all(0 <= n["acc_norm_own"] <= 1 for n in c2c["numbers"].values())  # the model unswapped, for scale
    assert c2c["verdict"] == S.verdict_greater(c2c["d"], c2c["band"])
    assert len((root / "next_line_c8_n2" / "next_line.jsonl").read_text().splitlines()) == 2
    for r in (root / n for n in doc["runs"] if "-full-" in n):  # the swaps' rows, as `hybrid-lm eval` records them
        rows = [json.loads(x) for x in (r / "eval.jsonl").read_text().splitlines()]
        assert sorted(x["eval_config"]["swaps"][0] for x in rows if x["task"] == "loss") == ["full=sa:4", "full=swa:4"]
        mc = [x for x in rows if x["task"] == "lm_eval/next_line"]
        assert sorted(tuple(x["eval_config"]["swaps"]) for x in mc) == [(), ("full=sa:4",), ("full=swa:4",)]
        assert [x["eval_config"]["swap_prefill_only"] for x in mc if x["eval_config"]["swaps"]] == [True, True]
    eval_files = {p: p.read_bytes() for p in root.glob("*/eval.jsonl")}
    assert main(claims) == 0  # everything recorded: nothing is evaluated again
    assert "evaluations: 0 run now, 10 already recorded" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in root.glob("*/eval.jsonl")} == eval_files
    assert (root / "plots" / "study_loss.png").stat().st_size > 10_000  # the overview figure

    # the results files alone (no checkpoints/, as docs/results/study): --no-eval judges the same
    import shutil

    copy = tmp_path / "results_only"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("checkpoints"))
    assert main(["claims", str(copy), "--no-eval", "--claims", "C1,C2", "--no-table", "--ruler-length", "0",
                 "--mc-items", "2", "--mc-context", "8"]) == 0
    again = json.loads((copy / "claims.json").read_text())
    assert {k: c["verdict"] for k, c in again["claims"].items()} == {k: c["verdict"] for k, c in doc["claims"].items()}
    assert again["claims"]["C2"]["parts"][0]["d"] == c2a["d"]
    assert again["claims"]["C2"]["parts"][2]["d"] == c2c["d"]  # lm-eval's rows name the task folder's old path
    # a copy whose full replicates were never evaluated: C2 is judged not evaluated, and not complete
    for n in doc["runs"]:
        if "-full-" in n:
            (copy / n / "eval.jsonl").unlink()
    capsys.readouterr()
    assert main(["claims", str(copy), "--no-eval", "--claims", "C2", "--no-table", "--ruler-length", "0",
                 "--mc-items", "2", "--mc-context", "8"]) == 0
    out = capsys.readouterr().out
    assert "evaluations: 0 run now, 0 already recorded, 10 left" in out and "10 evaluation(s) not recorded" in out
    assert "claims complete" not in out
    part = json.loads((copy / "claims.json").read_text())["claims"]["C2"]["parts"][0]
    assert part["verdict"] == S.NOT_EVALUATED and "not recorded" in part["why"]
    assert main(["claims", str(copy), "--claims", "C1"]) == 2  # evaluating needs the checkpoints
    assert "has no checkpoints/ directory" in capsys.readouterr().err


def test_ruler_with_the_swap_on_the_prompt_only(tiny_run, capsys):
    """`eval --tasks ruler --swap ... --swap-prefill-only` records answer log-likelihoods scored over the swapped
    prompt (no generation); without --tasks the flag is a one-line error."""
    run = tiny_run(5)  # TINY (conftest.py): full + SWA-8 hybrid, seq_len 32
    rc = main(["eval", str(run), "--swap", "full=swa:4", "--swap-prefill-only"])
    assert rc == 2 and "--swap-prefill-only applies to --tasks ruler and lm_eval" in capsys.readouterr().err
    rc = main(["eval", str(run), "--tasks", "ruler", "--swap", "full=swa:4", "--swap-prefill-only", "--ruler-tasks",
               "niah_single", "--ruler-lengths", "1K", "--allow-longer", "--samples", "2", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["task"] == "ruler/niah_single"]
    assert row["eval_config"]["swap_prefill_only"] is True and row["eval_config"]["swaps"] == ["full=swa:4"]
    assert row["exact_match"] is None and "swap-prefill-only" in row["generation"]
    assert row["answer_scoring"].startswith("prefill with the swap") and 0 < row["answer_nll"] < 20
