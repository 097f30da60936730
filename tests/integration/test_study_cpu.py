"""The one-GPU study on the CPU: the study spec's dry run, and a tiny version of it end to end through
experiments/study.sh's steps: parts trained by `sweep --only`, `hybrid-lm claims --part` recording each
part's evaluations, `--next-part`, a rerun that evaluates nothing, and the verdicts read back from the
results files alone (`--no-eval`), equal to the numbers in the rows."""

import json
import shutil
from pathlib import Path

import numpy as np
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
    jobs = [j for j in plan["jobs"] if j["kind"] == "branch"]
    full = [j for j in jobs if j["arch"] == "full"]
    assert sorted({(j["seed"], j["budget"]) for j in full}) == [(s, b) for s in (0, 1, 2, 3) for b in (4, 12)]
    others = [j for j in jobs if j["arch"] != "full"]
    assert {(j["seed"], j["budget"]) for j in others} == {(0, 12), (1, 12)} and len(others) == 20
    at12 = [j for j in jobs if j["budget"] == 12]
    assert {j["steps"] for j in at12} == {1373} and {j["D"] for j in at12} == {1373 * 32 * 4096}  # equal tokens
    assert full[0]["N"] == 14_999_424
    assert all("DataConfig.seq_len = 4096" in j["gin_params"] for j in plan["jobs"])
    assert all(j["branch_from"]["step"] == round(0.8 * j["steps"]) for j in jobs)


def test_study_claims_file_matches_the_sweep():
    from hybrid_lm.scaling.sweep import load_spec
    from hybrid_lm.study.spec import load_claims

    sweep = load_spec(REPO / "configs" / "sweeps" / "study.toml")
    spec = load_claims(REPO / "configs" / "sweeps" / "study.claims.toml",
                       {a: d["seeds"] or sweep.seeds for a, d in sweep.archs.items()})
    assert spec.sweep.resolve() == (REPO / "configs" / "sweeps" / "study.toml").resolve()
    assert spec.budget == 12 and all(spec.budget in (sweep.archs[a]["budgets"] or sweep.budgets) for a in sweep.archs)
    assert spec.parts[0] == (("full", (0, 1, 2)),) and set(spec.claims) == {"C1", "C2", "C3", "C4", "C5", "C6", "C7", "retrieval"}
    # every metric a claim part reads is recorded on some run of each arm it names
    for c in spec.claims.values():
        for p in c.parts:
            assert all(spec.metrics[m].on(a) for _, a, m in p.terms)


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
seeds = [0, 1]
budgets = [0.25]
equal_tokens = true
[wsd]
branch = true
decay_fraction = 0.25
[scales.t1]
[archs.full]
params = ["ModelConfig.layer_pattern = 'F'"]
budgets = [0.125, 0.25]
[archs.swa]
params = ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 4"]
[archs.sa]
params = ["efficient/MixerConfig.kind = 'sa'", "efficient/MixerConfig.window = 4"]
"""

TINY_CLAIMS = """
sweep = "tiny_study.toml"
budget = 0.25
k = 2.0
margin = 0.5
parts = [["full:0,1"], ["swa", "sa"]]
[metrics.loss]
what = "val loss"
[metrics.sa_swap]
what = "SA-4 swapped in"
eval = {task = "loss", swaps = ["full=sa:4"]}
arms = ["full"]
[metrics.swa_swap]
what = "SWA-4 swapped in"
eval = {task = "loss", swaps = ["full=swa:4"]}
arms = ["full"]
[metrics.loss_2T]
what = "val loss at 64 tokens"
eval = {task = "loss", seq_len = 64}
arms = "all"
[claims.C1]
title = "SA costs perplexity against SWA; SWA is close to full"
parts = [
  {part = "a", statement = "SA above SWA", d = "sa.loss - swa.loss", predict = "greater"},
  {part = "c", statement = "SWA close to full", d = "swa.loss - full.loss", predict = "close"},
  {part = "2T", statement = "full above SWA at 2T", d = "full.loss_2T - swa.loss_2T", predict = "greater"},
]
[claims.C2]
title = "swaps on the full model"
parts = [{part = "a", statement = "SA swap loses less", d = "full.swa_swap - full.sa_swap", predict = "greater"}]
[claims.C5]
title = "not here"
untested = "no heads at this size"
"""


def test_tiny_study_in_parts(tmp_path, capsys):
    from hybrid_lm.study import verdict as V

    spec = tmp_path / "tiny_study.toml"
    spec.write_text(TINY_STUDY)
    claims_file = tmp_path / "tiny_study.claims.toml"
    claims_file.write_text(TINY_CLAIMS)
    root = tmp_path / "study"
    claims = ["claims", str(root), "--claims-file", str(claims_file)]
    assert main(claims + ["--next-part"]) == 0 and capsys.readouterr().out.strip() == "1"  # nothing launched yet
    sweep = ["sweep", str(spec), "--launch", "local", "--root", str(root)]
    only = main(claims + ["--part-jobs", "1"]) == 0 and capsys.readouterr().out.strip()
    assert only == "^[^-]+-(full-[^-]+-seed(0|1))-[0-9a-f]{8}$"
    assert main(sweep + ["--only", only]) == 0  # part 1: full, two seeds, two budgets
    capsys.readouterr()
    assert main(claims + ["--next-part"]) == 0 and capsys.readouterr().out.strip() == "1"  # not evaluated yet
    assert main(claims + ["--part", "1"]) == 0
    out = capsys.readouterr().out
    assert "evaluations: 6 run now, 0 already recorded, 0 not recorded" in out  # 3 metrics x 2 seeds of full
    assert main(claims + ["--next-part"]) == 0 and capsys.readouterr().out.strip() == "2"
    doc = json.loads((root / "claims.json").read_text())
    assert doc["claims"]["C1"]["verdict"] == V.NOT_EVALUATED and doc["claims"]["C5"]["verdict"] == V.NOT_TESTED
    c2a = doc["claims"]["C2"]["parts"][0]
    assert c2a["verdict"] in (V.REPRODUCED, V.NOT_REPRODUCED, V.INCONCLUSIVE) and c2a["paired_windows"]
    # d is the mean over the seeds of the two swaps' difference, read from the rows
    rows = {}
    for run in (root / n for n in doc["runs"] if "-full-" in n):
        got = {tuple(r["eval_config"]["swaps"]): r for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())
               if r["task"] == "loss" and r["eval_config"]["seq_len"] is None}
        rows[run.name] = got[("full=swa:4",)]["loss"] - got[("full=sa:4",)]["loss"]
    assert c2a["d"] == pytest.approx(np.mean(list(rows.values())), abs=1e-12)
    assert [n["budget"] for n in doc["noise"]] == [0.125, 0.25] and len(doc["noise"][1]["loss"]) == 2

    assert main(sweep) == 0  # part 2 (the sweep skips part 1's finished runs)
    capsys.readouterr()
    assert main(claims + ["--part", "2"]) == 0
    assert "evaluations: 4 run now, 0 already recorded, 0 not recorded" in capsys.readouterr().out
    assert main(claims + ["--next-part"]) == 0 and capsys.readouterr().out.strip() == "0"
    eval_files = {p: p.read_bytes() for p in root.glob("*/eval.jsonl")}
    assert main(claims) == 0  # everything recorded: nothing is evaluated again
    assert "evaluations: 0 run now, 10 already recorded" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in root.glob("*/eval.jsonl")} == eval_files
    doc = json.loads((root / "claims.json").read_text())
    c1 = doc["claims"]["C1"]
    loss = {(t["arch"], t["seed"]): t["loss"] for t in doc["table"]}
    a = c1["parts"][0]
    assert a["d"] == pytest.approx(np.mean([loss["sa", s] - loss["swa", s] for s in (0, 1)]), abs=1e-12)
    assert a["verdict"] == V.verdict(a["d"], a["se"], "greater", 2.0, 0.5)
    assert a["se_seed"] > 0 and a["se_val"] > 0 and a["seed_dof"] == 3  # pooled over the three arms' two seeds
    assert len(a["halves"]) == 2 and a["halves"][0]["seeds"] == {"sa": [0], "swa": [0]}
    assert not c1["parts"][2]["paired_windows"] or c1["parts"][2]["se_val"] > 0
    for png in ("study_loss.png", "noise.png"):
        assert (root / "plots" / png).stat().st_size > 10_000
    md = (root / "claims.md").read_text()
    assert "| C1 |" in md and "not tested at this scale" in md and "first half / second half" in md

    # the results files alone (no checkpoints/, as docs/results/study): --no-eval judges the same
    copy = tmp_path / "results_only"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("checkpoints"))
    for cfg_file in copy.glob("*/config.json"):  # a store recorded where the runs trained, absent here
        record = json.loads(cfg_file.read_text())
        record["data"].update(source="tokens", path="data_cache/study/store")
        cfg_file.write_text(json.dumps(record))
    assert main(["claims", str(copy), "--claims-file", str(claims_file), "--no-eval"]) == 0
    again = json.loads((copy / "claims.json").read_text())
    assert {k: c["verdict"] for k, c in again["claims"].items()} == {k: c["verdict"] for k, c in doc["claims"].items()}
    assert again["claims"]["C2"]["parts"][0]["d"] == doc["claims"]["C2"]["parts"][0]["d"]
    assert main(["claims", str(copy), "--claims-file", str(claims_file), "--next-part"]) == 0
    assert capsys.readouterr().out.strip().endswith("0")


def test_lnd_spec_dry_run(capsys):
    """configs/sweeps/lnd.toml, the L(N, D) sweep: three sizes by the presets' rule (S1's and two below it),
    each size x arch one stable run with a branch per budget, three seeds at the smallest size only."""
    rc = main(["sweep", str(REPO / "configs" / "sweeps" / "lnd.toml"), "--dry-run", "--json", *EMBEDDED])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    full = {j["scale"]: j["N"] for j in plan["jobs"] if j["arch"] == "full"}
    assert full == {"S1h": 4_132_096, "S1s": 8_999_808, "S1": 14_999_424}  # 9.5 d^2 + 258 d per layer, + d
    cells = {}
    for j in plan["jobs"]:
        if j["kind"] == "branch":
            cells.setdefault((j["scale"], j["arch"]), set()).add((j["seed"], j["budget"]))
    assert set(cells) == {(s, a) for s in ("S1h", "S1s", "S1") for a in ("full", "swa128", "gdn")}
    for (s, a), got in cells.items():
        seeds = (0, 1, 2) if s == "S1h" else (0,)
        budgets = (10, 20, 30) if s == "S1" else (10, 20, 40)
        assert got == {(x, b) for x in seeds for b in budgets}, (s, a)
    stable = [j for j in plan["jobs"] if j["kind"] == "stable"]
    assert len(stable) == 15 and all(j["seed"] == 0 for j in stable if j["scale"] != "S1h")
    for j in plan["jobs"]:
        if j["kind"] == "branch":  # the smallest budget's run still takes 600+ steps
            assert j["steps"] >= 600 and j["branch_from"]["step"] == round(0.8 * j["steps"]), j["name"]
