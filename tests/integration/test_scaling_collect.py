"""``hybrid-lm collect``: eval.jsonl rows joined to the table by step (LongPPL, swaps; superseded rows,
tagged settings, counted skips), architecture labels from the trained config for every arch file,
the WSD row rules of ``fit --rows`` (no un-decayed rows, no double counting), and the end-to-end CPU
workflow: tiny sweep -> longppl on every run -> collect -> fit --metric log_longppl, plus every
next-step command the sweep prints."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid_lm.scaling import fit as F, fit_table as FT, law
from hybrid_lm.model.architecture import arch_label, arch_spec
from hybrid_lm.scaling.collect import collect, eval_column_names, eval_settings, parse_label_overrides
from hybrid_lm.scaling.table import read_table
from hybrid_lm.experiment import config_record, run_id

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "sweeps" / "tiny_cpu.toml"

# a law for synthetic runs: log LongPPL = A / N^alpha + B / D^beta (the no-E form, thunlp's)
LAW = {"E": None, "A": 30.0, "B": 80.0, "alpha": 0.25, "beta": 0.35}


def _fake_run(root: Path, name: str, *, arch="swa8", scale="s1", N=1000, steps=20, tps=100, branch=None,
              decay_fraction=0.25, kind="branch", done=True, eval_every=5, losses=None, eval_rows=(),
              copied_until=None):
    """A run directory as a sweep writes it: sweep_run.json, metrics.jsonl (eval rows every
    ``eval_every`` steps), sweep_done.json, and ``eval_rows`` appended to eval.jsonl."""
    d = root / name
    d.mkdir(parents=True)
    meta = {"name": name, "kind": kind, "scale": scale, "arch": arch, "seed": 0, "budget": steps * tps / N,
            "steps": steps, "tokens_per_step": tps, "N": N, "N_non_embedding": N, "N_total": 2 * N,
            "flops_per_token": 6.0 * N, "decay_fraction": decay_fraction, "branch_from": branch}
    (d / "sweep_run.json").write_text(json.dumps(meta))
    rows = []
    for s in range(0, steps + 1, eval_every):
        loss = losses(s) if losses else 5.0 - s / (10 * steps)
        row = {"kind": "eval", "step": s, "loss": loss, "bpb": loss / math.log(2)}
        if copied_until is not None and s <= copied_until:
            row["copied_from"] = branch["run"]
        rows.append(row)
        rows.append({"kind": "train", "step": s, "loss": loss + 0.1})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (d / "sweep_done.json").write_text(json.dumps({"final_eval": rows[-2]}))
    if eval_rows:
        (d / "eval.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in eval_rows))
    return d


def _longppl_row(step, value, length=129, evaluator="self", **kw):
    return {"kind": "longppl", "time": "t", "checkpoint_step": step, "run_id": "x", "evaluator": evaluator,
            "evaluator_step": step, "self_evaluator": evaluator == "self", "length": length, "docs": 8,
            "trunc_len": 64, "window": 32, "alpha": 2.0, "beta": -2.0, "longppl": value,
            "key_nll": None if value is None else math.log(value), "ppl": 20.0, "nll": 3.0, "n_key": 10,
            "n_token": 100, "key_rate": 0.1, "keys_cached": False, "key_cache": "k", "wall_s": 1.0, **kw}


# ----------------------------------------------------------------------------- eval.jsonl

def test_eval_rows_join_the_table_by_step_and_the_last_row_wins(tmp_path):
    swap = {"kind": "swap_eval", "step": 20, "checkpoint_step": 20, "swaps": ["full=swa:16"], "horizon": None,
            "sinks": None, "seq_len": 32, "eval_windows": 8, "loss": 5.5, "bpb": 7.9, "delta_loss": 0.6,
            "trained_eval_loss": 4.9, "devices": 1}
    _fake_run(tmp_path, "r1", eval_rows=[
        _longppl_row(20, 9.0), _longppl_row(20, 8.0),  # run again: the later row supersedes
        _longppl_row(10, 12.0),  # an earlier checkpoint: on the step-10 row (with --intermediate)
        swap, '{"kind": "longppl", "checkpoint_st',  # a torn last line: skipped and counted
    ])
    rows, stats = collect([tmp_path], tmp_path / "t.csv", progress=False)
    (r,) = rows
    assert r["step"] == 20 and r["longppl"] == 8.0 and r["log_longppl"] == pytest.approx(math.log(8.0))
    assert r["longppl_ppl"] == 20.0 and r["longppl_key_rate"] == 0.1 and "log_longppl_ppl" not in r
    assert r["swap_eval_loss"] == 5.5 and r["swap_eval_delta_loss"] == 0.6 and "swap_eval_devices" not in r
    ev = stats["eval_rows"]
    assert ev == {"read": 4, "superseded": 1, "bad_lines": 1, "unplaced": 1}  # the step-10 row: no table row
    assert stats["eval_columns"] == ["longppl", "swap_eval"]
    # with --intermediate the step-10 LongPPL lands on the step-10 row, tied to the tokens seen then
    rows, stats = collect([tmp_path], None, intermediate=True, progress=False)
    by_step = {x["step"]: x for x in rows}
    assert by_step[10]["longppl"] == 12.0 and by_step[10]["D"] == 10 * 100 and by_step[15]["longppl"] is None
    assert stats["eval_rows"]["unplaced"] == 0
    assert read_table(tmp_path / "t.csv")[0]["log_longppl"] == pytest.approx(math.log(8.0))


def test_eval_settings_that_differ_get_tagged_columns(tmp_path):
    _fake_run(tmp_path, "a", eval_rows=[_longppl_row(20, 8.0, length=129), _longppl_row(20, 6.0, length=257)])
    _fake_run(tmp_path, "b", eval_rows=[_longppl_row(20, 7.0, length=129), _longppl_row(20, None, length=257)])
    rows, stats = collect([tmp_path], None, progress=False)
    a, b = sorted(rows, key=lambda r: r["run_id"])
    assert a["longppl[length=129]"] == 8.0 and a["longppl[length=257]"] == 6.0
    assert a["log_longppl[length=129]"] == pytest.approx(math.log(8.0)) and "longppl" not in a
    assert b["longppl[length=257]"] is None and b["log_longppl[length=257]"] is None  # no key tokens: no value
    assert b["longppl[length=257]_ppl"] == 20.0
    # a fixed evaluator's checkpoint is part of the settings; a self-evaluator's is not
    s1 = eval_settings(_longppl_row(20, 1.0, evaluator="/runs/judge", evaluator_step=100))
    s2 = eval_settings(_longppl_row(20, 1.0, evaluator="/runs/judge", evaluator_step=200))
    assert s1 != s2 and eval_settings(_longppl_row(10, 1.0)) == eval_settings(_longppl_row(20, 1.0))
    # each run's newest checkpoint as the evaluator (the suite's default) is one setting across a sweep
    newest = [eval_settings(_longppl_row(10, 1.0, evaluator="newest", evaluator_step=n, self_evaluator=False))
              for n in (100, 200)]
    assert newest[0] == newest[1] != s1
    names = eval_column_names({"longppl": {s1, s2}})
    assert set(names.values()) == {"longppl[evaluator_step=100]", "longppl[evaluator_step=200]"}


def _suite_rows(step, arch, exact, nll, cache):
    """eval.jsonl rows of the suite's other tasks, as hybrid_lm.eval writes them: results, per-item lists,
    curves and cache paths beside the settings (a newer per-arch field, ``generation``, too)."""
    mix = {"efficient": {"kind": arch}}
    ruler = [{"kind": "ruler", "task": f"ruler/{t}", "step": step, "checkpoint_step": step, "run_id": arch,
              "seed": 0, "samples": 4, "trained_seq_len": 128, "generation": "greedy" if arch == "sa" else "unavailable",
              "layer_types": "FE", "mixers": mix, "attention_impl": "auto", "devices": 1, "time": "t",
              "length": 1024, "prompt_tokens": 1000, "gen_tokens": 24, "haystack": "essays" if t == "niah_single" else None,
              "exact_match": exact if arch == "sa" else None, "answer_nll": nll, "ll_accuracy": None, "ll_chance": None,
              "distractors": 0, "per_item": {"depth": [[0.1], [0.6]], "nll": [nll, nll]}, "items_cache": f"{cache}/{t}.jsonl",
              "wall_s": 1.0, "attention_backends": {}} for t in ("niah_single", "vt")]
    influence = {"kind": "influence", "task": "influence", "step": step, "checkpoint_step": step, "run_id": arch,
                 "seq_len": 64, "samples": 8, "last": 16, "seed": 0, "windows": "eval", "document_mask": False,
                 "g": [3.0 * nll, 2.0, 1.0], "g_max": 3.0 * nll, "g_sum": 6.0, "reach": 2, "reach_threshold": 1e-3,
                 "reach_saturated": True, "mean_distance": 0.7, "bins": [{"lo": 0, "hi": 0, "mean": 3.0, "mass": 0.5}],
                 "layer_types": "FE", "mixers": mix, "attention_impl": "auto", "devices": 1, "wall_s": 2.0}
    probe = {"kind": "probe", "task": "probe", "step": step, "checkpoint_step": step, "samples": 40, "seq_len": 256,
             "seed": 0, "haystack": "essays", "depths": [0.2, 0.4], "layers": ["emb", "L0"], "accuracy": [0.2, 0.5],
             "best_layer": "L0", "best_accuracy": 0.5, "chance": 0.1, "mixers": mix, "wall_s": 3.0}
    lm_eval = {"kind": "lm_eval", "task": "lm_eval/arc_easy", "checkpoint_step": step, "metrics": {"acc,none": 0.3},
               "score": 0.3, "score_metric": "acc,none", "n_samples": {"original": 10}, "limit": 10, "num_fewshot": 0,
               "max_length": 128, "wall_s": 4.0}
    return [*ruler, influence, probe, lm_eval]


def test_suite_tasks_get_one_short_column_per_task_shared_across_runs(tmp_path):
    """RULER, influence, probe and lm-eval rows: one column per (sub)task and metric, the same for every
    run, whatever per-item results, curves, cache paths and per-arch fields the rows hold."""
    _fake_run(tmp_path, "sa", eval_rows=_suite_rows(20, "sa", 0.75, 1.5, "/tmp/cache_a"))
    _fake_run(tmp_path, "gdn", eval_rows=_suite_rows(20, "gdn", 0.5, 2.5, "/tmp/cache_b"))
    rows, stats = collect([tmp_path], None, progress=False)
    cols = set(stats["eval_columns"])
    assert cols == {"ruler/niah_single", "ruler/vt", "influence", "probe", "lm_eval/arc_easy"}
    sa, gdn = sorted(rows, key=lambda r: r["run_id"], reverse=True)
    assert sa["ruler/niah_single_exact_match"] == 0.75 and gdn["ruler/niah_single_exact_match"] is None
    assert sa["ruler/vt_answer_nll"] == 1.5 and gdn["ruler/vt_answer_nll"] == 2.5
    assert gdn["influence_g_max"] == 7.5 and gdn["influence_reach"] == 2 and gdn["probe_best_accuracy"] == 0.5
    assert gdn["lm_eval/arc_easy_score"] == 0.3
    assert max(len(k) for k in set(sa) | set(gdn)) < 40
    # settings that do differ still split a task's columns, named by what differs
    _fake_run(tmp_path, "sa2", eval_rows=[dict(r, samples=8) for r in _suite_rows(20, "sa", 0.5, 1.0, "/c")
                                          if r["kind"] == "ruler"])
    _, stats = collect([tmp_path], None, progress=False)
    assert "ruler/vt[samples=8]" in stats["eval_columns"] and "ruler/vt[samples=4]" in stats["eval_columns"]


def test_fit_log_longppl_from_collected_eval_rows_recovers_the_law(tmp_path):
    """Synthetic runs whose LongPPL follows a known law: collect -> fit --metric log_longppl recovers it,
    and a metric that is not in the table is an error listing the metric columns that are."""
    for n in (1e4, 3e4, 1e5):
        for r in (5, 10, 20, 40):
            steps = int(n * r / 100)
            value = math.exp(law.predict(LAW, n, steps * 100))
            _fake_run(tmp_path / "runs", f"n{n:.0e}-r{r}", N=int(n), steps=steps, eval_every=steps,
                      eval_rows=[_longppl_row(steps, value)])
    _, stats = collect([tmp_path / "runs"], tmp_path / "table.csv", progress=False)
    assert stats["finished"] == 12
    doc = FT.fit_table(read_table(tmp_path / "table.csv"), metric="log_longppl", form="no-E", n_boot=0,
                      holdout="none", plots=False, progress=False)
    e = doc["fits"]["swa8"]
    for k in ("A", "B", "alpha", "beta"):
        assert e["params"][k] == pytest.approx(LAW[k], rel=1e-3), k
    assert e["valid"] and e["compute_optimal"]["valid"]
    with pytest.raises(F.FitError, match=r"'log_ruler' is not in the table; its metric columns are: "
                                         r"loss, bpb, loss_train.*log_longppl"):
        FT.fit_table(read_table(tmp_path / "table.csv"), metric="log_ruler", plots=False, progress=False)


# ----------------------------------------------------------------------------- WSD rows

def _wsd_sweep(root: Path):
    """A stable run (to step 15) with two branches: b20 decays from 15 to 20; b13 branched at 10 and
    stopped at 10 (partial: killed before it decayed). Evals every 5 steps."""
    st = {"run": "stable", "step": None}
    _fake_run(root, "stable", kind="stable", steps=15, decay_fraction=0.0, done=True)
    _fake_run(root, "b20", steps=20, branch={**st, "step": 15}, copied_until=15, N=1000)
    _fake_run(root, "b13", steps=13, branch={**st, "step": 10}, copied_until=10, N=1000, done=False)
    return root


def test_rows_all_uses_converged_rows_and_never_double_counts_a_stable_row(tmp_path):
    rows, _ = collect([_wsd_sweep(tmp_path)], None, intermediate=True, include_stable=True, progress=False)
    by = {(r["run_id"], r["step"]): r for r in rows}
    assert by[("b20", 10)]["phase"] == "stable" and by[("b20", 10)]["source_run"] == "stable"
    assert by[("b20", 20)]["phase"] == "decay" and by[("b20", 20)]["converged"] == 1
    assert by[("b13", 10)]["converged"] == 0 and by[("stable", 15)]["final"] == 0
    assert all(r["converged"] == 0 for r in rows if r["run_id"] == "stable")
    # all: the end of each decay only (the last row of b13 is its step-10 eval: not at its end, step 13)
    used, dropped = FT.select_rows(rows, "loss", "all")
    assert [(r["run_id"], r["step"]) for r in used] == [("b20", 20)]
    assert dropped["not_converged"] == len(rows) - 1
    # intermediate: every row, but each stable row once (trained once by the stable run, listed by 3 runs)
    used, dropped = FT.select_rows(rows, "loss", "intermediate")
    keys = [(r["source_run"], r["step"]) for r in used]
    assert len(keys) == len(set(keys)) and ("stable", 5) in keys
    assert dropped["duplicate"] == sum(1 for r in rows if r["source_run"] == "stable") - 3  # steps 5, 10, 15
    # a table from before the converged column: its stable-phase rows are still left out by --rows all
    old = [{k: v for k, v in r.items() if k != "converged"} for r in rows]
    assert all(r["phase"] != "stable" for r in FT.select_rows(old, "loss", "all")[0])


def test_fit_table_clusters_stable_rows_by_the_run_that_trained_them(tmp_path):
    """--rows intermediate: the stable rows are resampled with the stable run that trained them."""
    for g, n in (("g1", 1000), ("g2", 3000)):
        _fake_run(tmp_path, f"{g}-b20", N=n, steps=20, branch={"run": f"{g}-stable", "step": 15}, copied_until=15,
                  losses=lambda s, n=n: math.exp(law.predict(LAW, n, max(s, 1) * 100)))
    rows, _ = collect([tmp_path], None, intermediate=True, progress=False)
    assert {r["source_run"] for r in rows} == {"g1-stable", "g1-b20", "g2-stable", "g2-b20"}
    doc = FT.fit_table(rows, form="no-E", which="intermediate", bounds={"alpha": (0.25, 0.25)}, n_boot=20,
                      holdout="none", plots=False, progress=False)
    e = doc["fits"]["swa8"]
    assert doc["undecayed_rows_used"] == 6 and e["n_points"] == 8
    assert e["n_runs"] == 4 and e["free_parameters"] == ["a", "b", "beta"] and e["ci"]["resample"] == "run"


# ----------------------------------------------------------------------------- labels

ARCH_LABELS = {None: "swa128", "gdn.gin": "gdn", "lightning.gin": "lightning", "mamba2.gin": "mamba2",
               "moba.gin": "moba16x16", "sa.gin": "sa128", "sa_swa.gin": "sa_swa128", "ssa.gin": "ssa16x16"}


def test_labels_for_every_arch_file():
    from hybrid_lm.experiment import load_config

    files = {p.name for p in (REPO / "configs" / "arch").glob("*.gin")}
    assert files == set(ARCH_LABELS) - {None}, "a new arch file needs its expected label here"
    seen = {}
    for f, want in ARCH_LABELS.items():
        cfg = load_config(["base.gin", "scale/s1.gin"] + ([f"arch/{f}"] if f else []))
        spec = arch_spec(cfg.model)
        assert arch_label(spec) == want, (f, spec)
        seen[want] = spec
    assert len({json.dumps(s, sort_keys=True) for s in seen.values()}) == len(seen)
    assert seen["ssa16x16"] == {"layer_pattern": "F", "full": {"kind": "ssa", "options": {"block_size": 16,
                                                                                           "top_k": 16}}}
    full = load_config(["base.gin", "scale/s1.gin"], ["ModelConfig.layer_pattern = 'F'"])
    assert arch_label(arch_spec(full.model)) == "full"
    # mixer options that change the architecture change the label; speed-only ones do not
    variants = {
        "efficient/MixerConfig.options = {'block_size': 32, 'top_k': 8, 'gate': 'ssa'}": "moba32x8",
        "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'selection': 'block'}":
            "moba16x16-selection=block",
        "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'gate': 'moba'}": "moba16x16-gate=moba",
    }
    for binding, want in variants.items():
        cfg = load_config(["base.gin", "scale/s1.gin", "arch/moba.gin"], [binding])
        assert arch_label(arch_spec(cfg.model)) == want
    cases = [(["arch/sa.gin"], ["efficient/MixerConfig.window = 64"], "sa64"),
             (["arch/sa.gin"], ["efficient/MixerConfig.options = {'window_mode': 'symmetric'}"],
              "sa128-window_mode=symmetric"),
             (["arch/ssa.gin"], ["full/MixerConfig.options = {'block_size': 16, 'top_k': 16, 'eval_stream': 'sparse'}"],
              "ssa16x16-eval_stream=sparse"),
             (["arch/mamba2.gin"], ["efficient/MixerConfig.options = {'chunk_size': 128}"], "mamba2"),
             ([], ["ModelConfig.layer_pattern = '1:4'", "full/MixerConfig.rope = False"], "full-nope+swa128_1to4"),
             ([], ["full/MixerConfig.rope_theta = 5e5", "full/MixerConfig.rope_scaling = {'rope_type': 'llama3', "
                   "'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
                   "'original_max_position_embeddings': 1024}"], "full-theta=500000-llama3x8+swa128")]
    for files_, params, want in cases:
        cfg = load_config(["base.gin", "scale/s1.gin", *files_], params)
        assert arch_label(arch_spec(cfg.model)) == want, (params, arch_spec(cfg.model))


def test_collect_labels_runs_outside_a_sweep_from_their_config(tmp_path):
    """No sweep_run.json: the label comes from config.json (an SSA run is not 'full', two MoBA variants
    differ); --label overrides it; fit refuses to pool two architectures under one label."""
    from hybrid_lm.experiment import load_config

    configs = {"ssa": (["arch/ssa.gin"], []), "moba_a": (["arch/moba.gin"], []),
               "moba_b": (["arch/moba.gin"], ["efficient/MixerConfig.options = {'block_size': 8, 'top_k': 4}"])}
    tiny = ["ModelConfig.d_model = 32", "ModelConfig.n_layers = 2", "ModelConfig.n_heads = 2",
            "ModelConfig.d_ff = 64", "DataConfig.seq_len = 256", "TrainConfig.steps = 10"]
    for name, (files, params) in configs.items():
        d = _fake_run(tmp_path, name, N=1000)
        (d / "sweep_run.json").unlink()
        cfg = load_config(["base.gin", *files], tiny + params)
        (d / "config.json").write_text(json.dumps({**config_record(cfg), "run_id": run_id(cfg)}, default=str))
    rows, _ = collect([tmp_path], None, progress=False)
    labels = {r["run_id"]: r["arch"] for r in rows}
    assert labels == {"ssa": "ssa16x16", "moba_a": "moba16x16", "moba_b": "moba8x4"}
    assert all(r["arch_spec"] and r["N"] > 0 and r["final"] == 1 for r in rows)
    rows, _ = collect([tmp_path], None, labels=["moba_.*=moba"], progress=False)
    assert sorted(r["arch"] for r in rows) == ["moba", "moba", "ssa16x16"]
    with pytest.raises(F.FitError, match="arch 'moba' holds runs of 2 different architectures.*--label"):
        FT.fit_table(rows, form="no-E", plots=False, progress=False)
    with pytest.raises(Exception, match="REGEX=LABEL"):
        parse_label_overrides(["no-equals-sign"])


# ----------------------------------------------------------------------------- next steps

def test_next_steps_pick_a_form_the_design_can_identify(tmp_path):
    import dataclasses

    from hybrid_lm.scaling.sweep import expand, load_spec, next_steps

    spec = load_spec(TINY)  # 2 scales x 2 budgets: 4 points per arch
    plan = expand(spec, root=tmp_path)
    assert next_steps(plan) == [
        f"hybrid-lm collect {tmp_path}",
        "# 4 distinct (N, D) points per arch: too few for with-E (5 parameters), so no-E; with exactly 4 no degree "
        "of freedom is left and the fit is marked not valid",
        f"hybrid-lm fit {tmp_path / 'table.csv'} --form no-E --out {tmp_path / 'fit'}",
        f"hybrid-lm report {tmp_path / 'fit'} --sweep {tmp_path}"]
    # 6 runs: every form has degrees of freedom left, but fit's run bootstrap marks them not valid (too few
    # runs to resample), so no-E without the bootstrap
    three = expand(dataclasses.replace(spec, budgets=[0.25, 0.5, 0.75]), root=tmp_path)
    lines = next_steps(three)
    assert lines[1].startswith("# no-E without a bootstrap (no CIs): a bootstrap over 6 runs per arch marks every "
                               "form not valid (236 of 1000 bootstrap resamples (24%) drew fewer distinct")
    assert lines[1].endswith("About 7 runs per arch at distinct (N, D) give no-E CIs, 9 with-E")
    assert lines[2] == f"hybrid-lm fit {tmp_path / 'table.csv'} --form no-E --bootstrap 0 --out {tmp_path / 'fit'}"
    four = expand(dataclasses.replace(spec, budgets=[0.25, 0.5, 0.75, 1.0]), root=tmp_path)  # 8 runs: no-E
    lines = next_steps(four)
    assert lines[1].startswith("# 8 distinct (N, D) points from 8 runs per arch: with-E would not be valid (163 of "
                               "1000 bootstrap resamples") and lines[1].endswith(", so no-E")
    assert lines[2] == f"hybrid-lm fit {tmp_path / 'table.csv'} --form no-E --out {tmp_path / 'fit'}"
    five = expand(dataclasses.replace(spec, budgets=[0.25, 0.5, 0.75, 1.0, 1.25]), root=tmp_path)  # 10: with-E
    assert next_steps(five)[1] == f"hybrid-lm fit {tmp_path / 'table.csv'} --out {tmp_path / 'fit'}"
    one_size = dataclasses.replace(spec, budgets=[0.25, 0.5, 0.75, 1.0, 1.25], scales={"t1": spec.scales["t1"]})
    assert next_steps(expand(one_size, root=tmp_path))[1] == (
        "# 5 distinct (N, D) points per arch, but at one model size: no L(N, D) form can be fitted; add scales to "
        "the spec")
    one = dataclasses.replace(spec, budgets=[0.25])
    lines = next_steps(expand(one, root=tmp_path))
    assert len(lines) == 2 and lines[1].startswith("# 2 distinct (N, D) points per arch: too few for any")
    t1 = [j for j in plan.jobs if j.scale == "t1"]  # what a --only selection launched
    assert "too few for any" in next_steps(plan, t1)[-1]


# ----------------------------------------------------------------------------- end to end

def _cli(args, env, timeout=900):
    return subprocess.run([sys.executable, "-m", "hybrid_lm.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


def test_tiny_sweep_longppl_collect_fit_and_the_printed_next_steps(tmp_path, tiny_sweep):
    import shutil

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the test run's compilation cache (conftest.py)
    # `hybrid-lm sweep TINY --only swa8 --launch local --root SHARED`, run once per test run for this
    # test and test_scaling_sweep.py (conftest.py tiny_sweep); this test works on its own copy of SHARED
    shared, stdout = tiny_sweep
    root = tmp_path / "tiny"
    shutil.copytree(shared, root)
    steps = [line.strip() for line in stdout.split("next:", 1)[1].splitlines() if line.strip()]
    assert steps[0] == f"hybrid-lm collect {shared}" and any(s.startswith("hybrid-lm fit") for s in steps)

    # every next-step command the sweep printed succeeds, in order (on the copy: SHARED -> root)
    out = {}
    for line in steps:
        if line.startswith("#"):
            continue
        assert str(shared) in line, line
        args = line.replace(str(shared), str(root)).split()
        assert args[0] == "hybrid-lm", line
        r = _cli(args[1:], env)
        assert r.returncode == 0, (line, (r.stdout + r.stderr)[-3000:])
        out[args[1]] = r.stdout
    assert set(out) == {"collect", "fit", "report"}
    doc = json.loads((root / "fit" / "fit.json").read_text())
    e = doc["fits"]["swa8"]
    assert e["n_points"] == 4 and e["valid"] is False and e["compute_optimal"]["valid"] is False
    assert any("no degree of freedom is left" in x for x in e["guardrails"]["reasons"])
    assert "swa8: NOT VALID" in out["fit"]  # the fit runs, and says it cannot be trusted
    assert "No ranking" in (root / "fit" / "report.md").read_text()

    # longppl on every run, then collect -> fit --metric log_longppl
    man = json.loads((root / "sweep.json").read_text())
    branches = [j["name"] for j in man["jobs"] if j["arch"] == "swa8" and j["kind"] == "branch"]
    assert len(branches) == 4
    code = ("import sys; from hybrid_lm.eval.longppl import KeyTokenRule, evaluate_longppl\n"
            "for d in sys.argv[1:]:\n"
            "    evaluate_longppl(d, docs=4, rule=KeyTokenRule(8, 8, 0.0, -8.0), progress=False)\n")
    r = subprocess.run([sys.executable, "-c", code, *[str(root / b) for b in branches]], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(["collect", str(root)], env)
    assert r.returncode == 0 and "eval.jsonl: 4 rows" in r.stdout, (r.stdout + r.stderr)[-3000:]
    rows = read_table(root / "table.csv")
    assert all(x["log_longppl"] > 0 for x in rows) and len(rows) == 4
    r = _cli(["fit", str(root / "table.csv"), "--metric", "log_longppl", "--form", "no-E", "--bootstrap", "50",
              "--out", str(root / "fit_longppl")], env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads((root / "fit_longppl" / "fit.json").read_text())
    assert doc["metric"] == "log_longppl" and doc["fits"]["swa8"]["n_points"] == 4
    assert re.search(r"swa8: NOT VALID", r.stdout)  # 4 points, 4 parameters: flagged, never silently trusted


def test_collect_cli_refuses_a_missing_path_and_an_empty_tree_in_one_line(tmp_path, capsys):
    from hybrid_lm.cli import main

    assert main(["collect", str(tmp_path / "nope")]) == 2  # the missing path first, not the --out rule
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} does not exist"
    (tmp_path / "empty").mkdir()
    assert main(["collect", str(tmp_path / "empty"), "--out", str(tmp_path / "t.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no run dirs under") and "\n" not in err and not (tmp_path / "t.csv").exists()
    _fake_run(tmp_path / "empty", "r1")
    assert main(["collect", str(tmp_path / "empty"), "--out", str(tmp_path / "t.csv")]) == 0
    assert "1 run dirs -> 1 rows" in capsys.readouterr().out
