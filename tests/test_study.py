"""The one-GPU study's CPU-side parts (docs/RESULTS.md): the Python corpus builder, the sweep spec's
per-arch seeds, budgets and equal tokens, ``--max-minutes``'s checks, HYBRID_LM_DETERMINISTIC, and the claims
engine: the verdict rule on hand-made numbers, the claims file's bad input, the rows found after a move."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from hybrid_lm.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the Python corpus

def _tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def test_python_corpus_one_document_per_file_in_order_with_a_fingerprint(tmp_path):
    from hybrid_lm.data.pycorpus import build_python_corpus

    src = _tree(tmp_path / "pkg", {"b.py": "x = 1\n", "a/z.py": "def f():\n    return 2\n", "a/__init__.py": "",
                                   "c.txt": "not python", "__pycache__/a.py": "cached", ".hidden/h.py": "h = 1",
                                   "site-packages/other/o.py": "o = 1", "bad.py": b"s = '\xff'\n"})
    out = tmp_path / "out"
    meta = build_python_corpus(out, packages=(), roots=[src], stdlib=False)
    lines = [json.loads(x) for x in (out / "python.jsonl").read_text().splitlines()]
    assert [d["path"] for d in lines] == ["pkg/a/z.py", "pkg/b.py", "pkg/bad.py"]  # sorted, empty __init__ left out
    assert lines[0]["text"] == "def f():\n    return 2\n" and "\ufffd" in lines[2]["text"]
    assert meta["files"] == 3 and meta["empty_skipped"] == 1 and meta["invalid_utf8_replaced"] == 1
    assert meta["bytes"] == sum(len((src / p.removeprefix("pkg/")).read_bytes()) for p in (d["path"] for d in lines))
    h = hashlib.sha256()
    for d in lines:
        h.update(d["path"].encode() + b"\0" + hashlib.sha256((src / d["path"][4:]).read_bytes()).hexdigest().encode()
                 + b"\n")
    assert meta["fingerprint"] == h.hexdigest() == json.loads((out / "corpus.json").read_text())["fingerprint"]
    # a rerun on the same files writes nothing; a changed file changes the fingerprint
    mtime = (out / "python.jsonl").stat().st_mtime_ns
    assert build_python_corpus(out, packages=(), roots=[src], stdlib=False)["skipped"] is True
    assert (out / "python.jsonl").stat().st_mtime_ns == mtime
    (src / "b.py").write_text("x = 3\n")
    again = build_python_corpus(out, packages=(), roots=[src], stdlib=False)
    assert again["skipped"] is False and again["fingerprint"] != meta["fingerprint"]


def test_python_corpus_reads_this_pythons_stdlib_and_lists_missing_packages(tmp_path):
    from hybrid_lm.data.pycorpus import find_roots, python_files

    roots, missing = find_roots(packages=("json", "no_such_package_xyz"), stdlib=True)
    assert [r.label for r in roots] == ["stdlib", "json"] and missing == ["no_such_package_xyz"]
    files = python_files(roots[0])
    rels = [rel for rel, _ in files]
    assert "os.py" in rels and rels == sorted(rels)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__") for rel in rels for part in rel.split("/"))


def test_python_corpus_records_each_packages_version(tmp_path):
    import importlib.metadata

    from hybrid_lm.data.pycorpus import build_python_corpus, format_corpus

    src = _tree(tmp_path / "pkg", {"a.py": "a = 1\n"})
    meta = build_python_corpus(tmp_path / "out", packages=("tqdm",), roots=[src], stdlib=False)
    version = importlib.metadata.version("tqdm")
    assert meta["roots"]["tqdm"]["version"] == version and meta["roots"]["tqdm"]["files"] > 10
    assert "version" not in meta["roots"]["pkg"]  # a --root has no installed version
    assert json.loads((tmp_path / "out" / "corpus.json").read_text())["roots"]["tqdm"]["version"] == version
    assert any(line.strip().startswith("tqdm") and line.endswith(f"(tqdm {version})")
               for line in format_corpus(meta, tmp_path / "out"))


def test_python_corpus_bad_input_is_one_line(tmp_path, capsys):
    from hybrid_lm.cli import main
    from hybrid_lm.data.pycorpus import build_python_corpus

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .py files found"):
        build_python_corpus(tmp_path / "o", packages=("no_such_package_xyz",), roots=[empty], stdlib=False)
    with pytest.raises(DataError, match="no such folder"):
        build_python_corpus(tmp_path / "o", packages=(), roots=[tmp_path / "missing"], stdlib=False)
    src = _tree(tmp_path / "src", {"a.py": "a = 1\n"})
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(DataError, match="cannot create the folder"):
        build_python_corpus(blocker / "out", packages=(), roots=[src], stdlib=False)
    rc = main(["data", "python-corpus", "--out", str(blocker / "out"), "--package", "none", "--no-stdlib",
               "--root", str(src), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("data error: --out") and "\n" not in err
    rc = main(["data", "python-corpus", "--out", str(tmp_path / "ok"), "--package", "none", "--no-stdlib",
               "--root", str(src), "--no-progress"])
    assert rc == 0 and "1 files" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the sweep spec

def _tiny_spec(**extra):
    import tomllib
    raw = tomllib.loads((REPO / "configs" / "sweeps" / "tiny_cpu.toml").read_text())
    raw["scales"] = {"t1": raw["scales"]["t1"]}
    raw["wsd"] = {"branch": False}
    raw["budgets"] = [20]
    raw["archs"] = {"full": {"params": ["ModelConfig.layer_pattern = 'F'"], "seeds": [0, 1]},
                    "full_rerun": {"params": ["ModelConfig.layer_pattern = 'F'"]},
                    "gated": {"params": ["efficient/MixerConfig.kind = 'sa_swa'", "efficient/MixerConfig.window = 8"]}}
    raw.update(extra)
    return raw


def test_per_arch_seeds_and_equal_tokens():
    from hybrid_lm.scaling.sweep import expand, spec_from_dict

    plain = expand(spec_from_dict(_tiny_spec()), root="/tmp/s1")
    assert [(j.arch, j.seed) for j in plain.jobs] == [("full", 0), ("full", 1), ("full_rerun", 0), ("gated", 0)]
    by = {(j.arch, j.seed): j for j in plain.jobs}
    assert by[("full", 0)].config_run_id == by[("full_rerun", 0)].config_run_id  # a repeat of one config
    assert by[("full", 0)].name != by[("full_rerun", 0)].name
    assert by[("gated", 0)].N > by[("full", 0)].N and by[("gated", 0)].steps > by[("full", 0)].steps
    eq = expand(spec_from_dict(_tiny_spec(equal_tokens=True)), root="/tmp/s2")
    assert len({j.steps for j in eq.jobs}) == 1 and eq.jobs[0].steps == by[("full", 0)].steps
    assert len({j.D for j in eq.jobs}) == 1


def test_per_scale_seeds_yield_to_an_archs_own():
    """A scale's seeds repeat that scale's cells (the L(N, D) sweep's replicated size); an arch that sets its
    own seeds keeps them; the other scales keep the top-level list; the dry run says the cells differ."""
    import tomllib

    from hybrid_lm.scaling.sweep import expand, format_plan, spec_from_dict

    raw = _tiny_spec()
    raw["scales"] = tomllib.loads((REPO / "configs" / "sweeps" / "tiny_cpu.toml").read_text())["scales"]
    first, second = list(raw["scales"])
    raw["scales"][first]["seeds"] = [0, 1, 2]
    plan = expand(spec_from_dict(raw), root="/tmp/s4")
    seeds = {}
    for j in plan.jobs:
        seeds.setdefault((j.scale, j.arch), []).append(j.seed)
    assert seeds[(first, "gated")] == [0, 1, 2] and seeds[(first, "full_rerun")] == [0, 1, 2]
    assert seeds[(first, "full")] == [0, 1] and seeds[(second, "full")] == [0, 1]  # the arch's own
    assert seeds[(second, "gated")] == [0]  # the top-level list
    assert "x 3 seed(s) (some cells 1)" in format_plan(plan).splitlines()[0]


def test_per_arch_budgets_with_wsd_branching():
    from hybrid_lm.scaling.sweep import expand, spec_from_dict

    raw = _tiny_spec(wsd={"branch": True, "decay_fraction": 0.2})
    raw["archs"]["full"]["budgets"] = [10, 20, 40]
    plan = expand(spec_from_dict(raw), root="/tmp/s3")
    full0 = [j for j in plan.jobs if (j.arch, j.seed) == ("full", 0)]
    assert [(j.kind, j.budget) for j in full0] == [("stable", None), ("branch", 10), ("branch", 20), ("branch", 40)]
    assert full0[0].steps == max(j.branch_from["step"] for j in full0[1:])  # one stable run to the last branch point
    assert {j.budget for j in plan.jobs if j.arch == "gated" and j.kind == "branch"} == {20}  # the top-level list


@pytest.mark.parametrize("change, match", [
    ({"equal_tokens": "yes"}, "equal_tokens='yes' must be true or false"),
    ({"archs": {"a": {"budgets": [4, -1]}}}, "archs.a.budgets"),
    ({"archs": {"a": {"seeds": []}}}, "archs.a.seeds must be a non-empty list of integers"),
    ({"archs": {"a": {"seeds": [0, True]}}}, "archs.a.seeds must be a non-empty list of integers"),
    ({"scales": {"t1": {"seeds": []}}}, "scales.t1.seeds must be a non-empty list of integers"),
    ({"scales": {"t1": {"seeds": ["0"]}}}, "scales.t1.seeds must be a non-empty list of integers"),
    ({"equal_tokens": True, "archs": {"a": {}}}, "equal_tokens needs the reference arch"),
])
def test_bad_spec_keys_are_one_line(change, match):
    from hybrid_lm.scaling.sweep import SweepError, spec_from_dict

    with pytest.raises(SweepError, match=match):
        spec_from_dict(_tiny_spec(**change))


def test_study_spec_parses_with_its_arms():
    from hybrid_lm.scaling.sweep import load_spec

    spec = load_spec(REPO / "configs" / "sweeps" / "study.toml")
    assert spec.equal_tokens and spec.branch and spec.budgets == [12] and spec.seeds == [0, 1]
    assert spec.archs["full"]["seeds"] == [0, 1, 2, 3] and spec.archs["full"]["budgets"] == [4, 12]


def test_max_minutes_checks(tmp_path, capsys):
    from hybrid_lm.cli import main
    from hybrid_lm.scaling import launch as L
    from hybrid_lm.scaling.sweep import SweepError, expand, spec_from_dict

    plan = expand(spec_from_dict(_tiny_spec()), root=tmp_path / "r")
    with pytest.raises(SweepError, match="--max-minutes 0: must be > 0"):
        L.launch_local(plan, max_minutes=0)
    rc = main(["sweep", str(REPO / "configs" / "sweeps" / "tiny_cpu.toml"), "--dry-run", "--max-minutes", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-minutes applies to --launch local" in err


# ----------------------------------------------------------------------------- determinism

def test_deterministic_env_adds_the_xla_flag_once():
    from hybrid_lm import determinism as D

    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert D.apply(env) is False and env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    env[D.ENV] = "1"
    assert D.apply(env) is True and env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + D.FLAG
    D.apply(env)
    assert env["XLA_FLAGS"].count("xla_gpu_deterministic_ops") == 1
    env = {D.ENV: "true", "XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    D.apply(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"  # the user's own setting wins
    with pytest.raises(ConfigError, match="HYBRID_LM_DETERMINISTIC='maybe'"):
        D.apply({D.ENV: "maybe"})


def test_deterministic_ops_are_read_from_xla_flags():
    from hybrid_lm import determinism as D

    assert not D.active({}) and not D.active({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert D.active({"XLA_FLAGS": D.FLAG}) and D.active({"XLA_FLAGS": "--a=1 --xla_gpu_deterministic_ops"})
    assert D.active({"XLA_FLAGS": "--xla_gpu_deterministic_ops=1 --b"})
    assert not D.active({"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"})
    assert not D.active({"XLA_FLAGS": "--xla_gpu_deterministic_ops_other=true"})
    # the last mention wins, as in XLA's parser
    assert not D.active({"XLA_FLAGS": f"{D.FLAG} --xla_gpu_deterministic_ops=false"})
    env = {D.ENV: "1"}
    D.apply(env)
    assert D.active(env)


# ----------------------------------------------------------------------------- the verdict rule

def test_verdict_rule():
    from hybrid_lm.study import verdict as V

    assert V.verdict(0.05, 0.02, "greater", 2.0, 0.0) == V.REPRODUCED
    assert V.verdict(0.039, 0.02, "greater", 2.0, 0.0) == V.INCONCLUSIVE
    assert V.verdict(-0.05, 0.02, "greater", 2.0, 0.0) == V.NOT_REPRODUCED
    assert V.verdict(0.005, 0.005, "close", 2.0, 0.02) == V.REPRODUCED  # 0.005 + 0.01 <= 0.02
    assert V.verdict(0.015, 0.005, "close", 2.0, 0.02) == V.INCONCLUSIVE  # the interval crosses the margin
    assert V.verdict(-0.05, 0.005, "close", 2.0, 0.02) == V.NOT_REPRODUCED  # 0.05 - 0.01 > 0.02
    assert V.combine([V.REPRODUCED, V.REPRODUCED]) == V.REPRODUCED
    assert V.combine([V.REPRODUCED, V.INCONCLUSIVE]) == V.INCONCLUSIVE
    assert V.combine([V.REPRODUCED, V.NOT_REPRODUCED, V.INCONCLUSIVE]) == V.NOT_REPRODUCED
    assert V.combine([V.NOT_EVALUATED, V.REPRODUCED]) == V.INCONCLUSIVE and V.combine([V.NOT_EVALUATED]) == V.NOT_EVALUATED
    assert V.combine([V.NOT_EVALUATED, V.NOT_REPRODUCED]) == V.NOT_REPRODUCED


def _values(rng, arms: dict, n_windows: int = 400):
    """values[arm][seed]['loss'] with per-window losses: a shared window profile (what the windows share),
    an arm offset, a seed offset and a little per-window noise."""
    from hybrid_lm.study.runs import Value

    profile = rng.normal(2.0, 0.5, n_windows)
    out = {}
    for arm, (offset, seeds) in arms.items():
        out[arm] = {}
        for s in seeds:
            w = profile + offset + rng.normal(0, 0.02) + rng.normal(0, 0.01, n_windows)
            out[arm][s] = {"loss": Value(float(w.mean()), list(w), float(w.std(ddof=1) / np.sqrt(n_windows)))}
    return out


def test_judge_pools_the_seed_variance_and_pairs_the_windows():
    from hybrid_lm.study import verdict as V

    rng = np.random.default_rng(0)
    values = _values(rng, {"a": (0.1, [0, 1]), "b": (0.0, [0, 1]), "c": (0.05, [0, 1, 2])})
    j = V.judge(((1.0, "a", "loss"), (-1.0, "b", "loss")), values)
    mean = lambda arm: np.mean([v["loss"].value for v in values[arm].values()])  # noqa: E731
    assert j.d == pytest.approx(mean("a") - mean("b"))
    # the seed variance pooled over the three arms: dof (2 - 1) + (2 - 1) + (3 - 1)
    ss = sum(np.var([v["loss"].value for v in values[a].values()], ddof=1) * (len(values[a]) - 1) for a in values)
    assert j.seed_dof == 4 and j.se_seed == pytest.approx(np.sqrt(ss / 4 * (1 / 2 + 1 / 2)))
    # paired over the windows: far below either arm's own error over windows (0.5 / sqrt(400) = 0.025)
    dw = np.mean([v["loss"].windows for v in values["a"].values()], 0) - np.mean([v["loss"].windows for v in values["b"].values()], 0)
    assert j.paired and j.se_val == pytest.approx(dw.std(ddof=1) / np.sqrt(dw.size)) and j.se_val < 0.005
    assert j.se == pytest.approx(np.hypot(j.se_seed, j.se_val))
    # one half of the seeds: each arm's first seed, the variance still pooled over all
    first, second = V.halves(values, ("a", "b"))
    assert first == {"a": [0], "b": [0]} and second == {"a": [1], "b": [1]}
    h = V.judge(((1.0, "a", "loss"), (-1.0, "b", "loss")), values, first)
    assert h.d == pytest.approx(values["a"][0]["loss"].value - values["b"][0]["loss"].value)
    assert h.se_seed == pytest.approx(np.sqrt(ss / 4 * 2))
    # windows of another count (a loss at 2T against one at T): not paired, each term's own error adds
    values["b"][0]["loss"].windows = values["b"][0]["loss"].windows[:200]
    u = V.judge(((1.0, "a", "loss"), (-1.0, "b", "loss")), values)
    assert not u.paired and u.se_val > 5 * j.se_val
    assert V.judge(((1.0, "missing", "loss"),), values) is None


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace('budget = 12', 'budget = -1'), "budget = -1: must be a number > 0"),
    (lambda t: t.replace('["ssa"],', '["ssa", "sa128"],'), "arm 'sa128' is in two parts: name its seeds in each"),
    (lambda t: t.replace('["mamba2", "gdn"],', '["mamba2"],'), "parts must hold the sweep's arms exactly: missing gdn"),
    (lambda t: t.replace('["full:3", "swa128"],', '["full:2", "swa128"],'), "a seed of 'full' is in two parts"),
    (lambda t: t.replace('["full:3", "swa128"],', '["swa128"],'), "'full' seed 3 of the sweep is in no part"),
    (lambda t: t.replace('["full:3", "swa128"],', '["full:x", "swa128"],'), "a part member is an arm"),
    (lambda t: t.replace('d = "sa128.loss - swa128.loss"', 'd = "sa128.loss -- swa128.loss"'), "cannot read it from"),
    (lambda t: t.replace('d = "sa128.loss - swa128.loss"', 'd = "sa128.nothing - swa128.loss"'), "no metric 'nothing'"),
    (lambda t: t.replace('d = "sa128.loss - swa128.loss"', 'd = "sa128.sa_swap - swa128.loss"'),
     "metric 'sa_swap' is not recorded on 'sa128'"),
    (lambda t: t.replace('arms = ["full:3"]', 'arms = ["nobody"]', 1), r"metrics\.\w+\.arms: 'nobody' is in no part"),
    (lambda t: t.replace('predict = "greater"}', 'predict = "bigger"}', 1), "predict = 'bigger': choose greater or close"),
    (lambda t: t.replace('eval = {task = "loss", seq_len = 8192}', 'eval = {task = "loss", seq_len = 0}'),
     "eval.seq_len = 0: must be an integer >= 1"),
    (lambda t: t.replace('eval = {task = "loss", seq_len = 8192}', 'eval = {task = "probe"}'), "task must be one of"),
    (lambda t: t.replace('tasks = ["niah_multikey"]', 'tasks = ["niah_single"]'),
     "niah_single's items have no distractors"),
    (lambda t: t.replace('tasks = ["niah_multikey"]', 'tasks = ["haystack"]'), "unknown RULER task 'haystack'"),
    (lambda t: t.replace('untested = ', 'report = "loss"\nuntested = '), "give exactly one of parts, untested, report"),
    (lambda t: t + "\n[extra]\n", "unknown key 'extra'"),
    (lambda t: t + "\n[[", "not TOML"),
])
def test_claims_file_bad_input_is_one_line(tmp_path, edit, match):
    from hybrid_lm.scaling.sweep import load_spec
    from hybrid_lm.study.spec import load_claims

    f = tmp_path / "study.claims.toml"
    f.write_text(edit((REPO / "configs" / "sweeps" / "study.claims.toml").read_text()))
    sweep = load_spec(REPO / "configs" / "sweeps" / "study.toml")
    arms = {a: d["seeds"] or sweep.seeds for a, d in sweep.archs.items()}
    with pytest.raises(ConfigError, match=match) as e:
        load_claims(f, arms)
    assert "\n" not in str(e.value)


def test_the_studys_swaps_resolve_on_its_configs():
    """The swaps of the claims file are valid on the study's S1 configs at T = 4096 (checked without a
    checkpoint: the rewritten config takes the same parameters)."""
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.experiment import load_config
    from hybrid_lm.study.spec import load_claims

    spec = load_claims(REPO / "configs" / "sweeps" / "study.claims.toml")
    common = ["scale/s1.gin"], ["ModelConfig.vocab_size = 256", "DataConfig.seq_len = 4096"]
    cfgs = {"full": load_config(["base.gin", *common[0]], common[1] + ["ModelConfig.layer_pattern = 'F'"]),
            "ssa": load_config(["base.gin", *common[0], "arch/ssa.gin"], common[1])}
    checked = 0
    for m in spec.metrics.values():
        for swap in (m.eval or {}).get("swaps", []):
            for arm, _ in m.arms:
                cfg = swapped_config(cfgs[arm], [swap])
                assert cfg.model.full.kind == swap.split("=")[1].split(":")[0].split(",")[0]
                checked += 1
    assert checked == 6
    moba = swapped_config(cfgs["full"], [spec.metrics["sparse_swap"].eval["swaps"][0]])
    assert moba.model.full.options == {"block_size": 16, "gate": "ssa", "top_k": 16}
    assert cfgs["ssa"].model.full.options["eval_stream"] == "full"  # evaluated with full attention by default
    assert swapped_config(cfgs["ssa"], spec.metrics["sparse_stream"].eval["swaps"]).model.full.options["eval_stream"] == "sparse"


def test_rows_are_found_after_the_study_root_moved(tmp_path):
    """LongPPL's rows name the evaluator by its path at evaluation time; a moved copy of the results
    (docs/results/study) finds them through the evaluator run's directory name, and a row of other settings
    is not the metric's."""
    import dataclasses

    from hybrid_lm.eval.suite import EvalRequest, eval_key
    from hybrid_lm.study.evaluations import Evaluation, rows_for
    from hybrid_lm.study.runs import Run

    run = Run("full-1", "full", 1, 12.0, tmp_path / "full-1", 32, [8], False)
    run.dir.mkdir()
    req = EvalRequest(tasks=("longppl",), evaluator=str(tmp_path / "moved" / "full-0"), evaluator_step=8,
                      trunc_len=8, window=4, progress=False)
    old = dataclasses.replace(req, evaluator="/gpu-machine/runs/study/full-0").config("longppl")
    other = dataclasses.replace(req, evaluator="/gpu-machine/runs/study/full-0", longppl_docs=7).config("longppl")
    rows = [{"task": "longppl", "kind": "longppl", "checkpoint_step": 8, "eval_key": eval_key(c), "eval_config": c,
             "longppl": v} for c, v in ((other, 99.0), (old, 40.0))]
    (run.dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = rows_for(Evaluation("longppl", run, req))
    assert [r["longppl"] for r in found] == [40.0]
    assert rows_for(Evaluation("longppl", run, dataclasses.replace(req, evaluator_step=4))) == []


def test_row_values_of_each_task(tmp_path):
    """What a metric reads from a task's row: a loss with its windows, lm-eval's acc_norm and RULER's
    log-likelihood accuracy with their binomial errors, LongPPL; nothing from a row without the number."""
    from hybrid_lm.study.runs import Run, row_value

    run = Run("r", "full", 0, 12.0, tmp_path, 32, [8], False)
    v = row_value(run, [{"loss": 2.0, "loss_se": 0.01, "window_losses": [1.9, 2.1], "eval_key": "k"}], "loss")
    assert (v.value, v.se, v.windows) == (2.0, 0.01, [1.9, 2.1]) and v.source["eval_key"] == "k"
    v = row_value(run, [{"score": 0.75, "n_samples": {"original": 200, "effective": 200}}], "next_line")
    assert v.value == 0.75 and v.se == pytest.approx(np.sqrt(0.75 * 0.25 / 200))
    v = row_value(run, [{"ll_chance": 0.25, "per_item": {"win": [True, False, True, True]}},
                        {"ll_chance": 0.25, "per_item": {"win": [False, None]}}], "ruler")
    assert v.value == pytest.approx(3 / 5) and v.source["chance"] == 0.25 and v.source["items"] == 5
    assert row_value(run, [{"longppl": 12.5}], "longppl").value == 12.5
    assert row_value(run, [{"longppl": None}], "longppl") is None and row_value(run, [], "loss") is None
    assert row_value(run, [{"score": None}], "next_line") is None
