"""The one-GPU study's CPU-side parts (docs/RESULTS.md): the Python corpus builder, the sweep spec's
per-arch seeds and equal tokens, ``--max-minutes``'s checks, HYBRID_LM_DETERMINISTIC, and the claims
glue's verdict rule, on hand-made numbers and on hand-made result rows of a fake study root."""

import hashlib
import json
from pathlib import Path

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


@pytest.mark.parametrize("change, match", [
    ({"equal_tokens": "yes"}, "equal_tokens='yes' must be true or false"),
    ({"archs": {"a": {"seeds": []}}}, "archs.a.seeds must be a non-empty list of integers"),
    ({"archs": {"a": {"seeds": [0, True]}}}, "archs.a.seeds must be a non-empty list of integers"),
    ({"equal_tokens": True, "archs": {"a": {}}}, "equal_tokens needs the reference arch"),
])
def test_bad_spec_keys_are_one_line(change, match):
    from hybrid_lm.scaling.sweep import SweepError, spec_from_dict

    with pytest.raises(SweepError, match=match):
        spec_from_dict(_tiny_spec(**change))


def test_study_spec_parses_with_its_arms():
    from hybrid_lm.scaling.study import ARMS
    from hybrid_lm.scaling.sweep import load_spec

    spec = load_spec(REPO / "configs" / "sweeps" / "study.toml")
    assert tuple(spec.archs) == ARMS and spec.equal_tokens and not spec.branch and spec.budgets == [4]
    assert spec.archs["full"]["seeds"] == [0, 1] and spec.archs["full_rerun"]["seeds"] is None


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

def test_verdict_rule_on_hand_made_numbers():
    from hybrid_lm.scaling import study as S

    assert S.verdict_greater(0.05, 0.02) == S.REPRODUCED
    assert S.verdict_greater(-0.05, 0.02) == S.NOT_REPRODUCED
    assert S.verdict_greater(0.01, 0.02) == S.verdict_greater(-0.02, 0.02) == S.INCONCLUSIVE
    assert S.verdict_greater(0.5, None) == S.verdict_greater(None, 0.1) == S.INCONCLUSIVE
    assert S.verdict_close(0.01, 0.02) == S.REPRODUCED and S.verdict_close(-0.03, 0.02) == S.NOT_REPRODUCED
    assert S.verdict_close(0.0, None) == S.INCONCLUSIVE
    assert S.combine([S.REPRODUCED, S.REPRODUCED]) == S.REPRODUCED
    assert S.combine([S.REPRODUCED, S.INCONCLUSIVE]) == S.INCONCLUSIVE
    assert S.combine([S.REPRODUCED, S.NOT_REPRODUCED, S.INCONCLUSIVE]) == S.NOT_REPRODUCED
    assert S.combine([S.NOT_EVALUATED, S.REPRODUCED]) == S.REPRODUCED and S.combine([S.NOT_EVALUATED]) == S.NOT_EVALUATED
    assert S.spread([1.0, 1.5, 1.2]) == pytest.approx(0.5) and S.spread([1.0]) is None
    assert S.spread([1.0, None, float("nan")]) is None


def _fake_run(root: Path, name: str, arch: str, seed: int, loss: float, T: int = 32, steps=(8,)):
    d = root / name
    (d / "checkpoints").mkdir(parents=True)
    for s in steps:
        (d / "checkpoints" / str(s)).mkdir()
    (d / "sweep_done.json").write_text("{}")
    (d / "config.json").write_text(json.dumps({"data": {"seq_len": T}}))
    rows = [{"kind": "train", "step": s, "loss": 3.0, "tokens_per_sec": 1000.0 + s, "mfu": 0.3} for s in (2, 4, 6, 8)]
    rows.append({"kind": "eval", "step": steps[-1], "loss": loss, "bpb": loss / 2})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "provenance.json").write_text(json.dumps({"device_kind": "cpu", "xla_flags": ""}))
    return {"name": name, "kind": "independent", "arch": arch, "seed": seed}


def test_claims_from_hand_made_rows(tmp_path):
    """A fake study root with made-up losses: C1 and C2a follow the rule from exactly these numbers, every
    number names its row, arms that are missing make their claims 'not evaluated', and nothing runs."""
    from hybrid_lm.eval.suite import eval_key
    from hybrid_lm.scaling import study as S

    root = tmp_path / "study"
    jobs = [_fake_run(root, "full-0", "full", 0, 2.00), _fake_run(root, "full-1", "full", 1, 2.03),
            _fake_run(root, "full_rerun-0", "full_rerun", 0, 2.01), _fake_run(root, "swa-0", "swa128", 0, 2.10),
            _fake_run(root, "sa-0", "sa128", 0, 2.60), _fake_run(root, "gated-0", "sa_swa128", 0, 2.02)]
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    st = S.Settings(ruler_length=0, claims=("C1", "C2", "C3"), table=False, mc_context=0).resolved(32)
    runs = S.study_runs(root)
    assert [r.arch for r in runs] == ["full", "full", "full_rerun", "swa128", "sa128", "sa_swa128"]
    evals = S.plan(runs, st)
    assert {e.key for e in evals} == {"c2/loss/sa", "c2/loss/swa"}  # C3 needs the ssa arm; no RULER, no table
    assert st.window == 4 and all(e.request.swaps[0].endswith(":4") for e in evals)
    c2 = {("full-0", "sa"): 5.0, ("full-0", "swa"): 3.0, ("full-1", "sa"): 5.2, ("full-1", "swa"): 3.1,
          ("full_rerun-0", "sa"): 5.1, ("full_rerun-0", "swa"): 3.05}
    for e in evals:
        conf = e.request.config("loss")
        row = {"task": "loss", "kind": "loss", "checkpoint_step": 8, "eval_key": eval_key(conf), "eval_config": conf,
               "loss": c2[(e.run.name, e.key.rsplit("/", 1)[1])]}
        with (e.run.dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    doc = S.run_claims(root, S.Settings(ruler_length=0, claims=("C1", "C2", "C3"), table=False, mc_context=0))
    assert doc["evaluation_stats"] == {"done": 0, "skipped": 6, "left": 0, "failed": {}}
    band = 0.03  # full: 2.00, 2.03, 2.01
    assert doc["noise"]["bands"]["loss"] == pytest.approx(band)
    c1 = {p["part"]: p for p in doc["claims"]["C1"]["parts"]}
    assert c1["a"]["d"] == pytest.approx(0.5) and c1["a"]["verdict"] == S.REPRODUCED
    assert c1["b"]["d"] == pytest.approx(0.58) and c1["b"]["verdict"] == S.REPRODUCED
    assert c1["c"]["d"] == pytest.approx(0.02) and c1["c"]["verdict"] == S.REPRODUCED  # |0.02| <= 0.03
    assert doc["claims"]["C1"]["verdict"] == S.REPRODUCED
    c2a = doc["claims"]["C2"]["parts"][0]
    assert c2a["d"] == pytest.approx(-2.05) and c2a["band"] == pytest.approx(0.1)  # d per run: -2, -2.1, -2.05
    assert c2a["verdict"] == S.NOT_REPRODUCED and doc["claims"]["C2"]["verdict"] == S.NOT_REPRODUCED
    assert doc["claims"]["C2"]["parts"][1]["verdict"] == S.NOT_EVALUATED  # no RULER here
    src = doc["number_sources"]["c2/loss/sa@full-1"]  # every evaluated number names its row
    assert src["file"].endswith("full-1/eval.jsonl") and src["task"] == "loss" and src["checkpoint_step"] == 8
    assert doc["claims"]["C3"]["verdict"] == S.NOT_EVALUATED and "ssa missing" in doc["claims"]["C3"]["parts"][0]["why"]
    t = {r["run"]: r for r in doc["table"]}
    assert t["sa-0"]["loss"] == 2.60 and t["sa-0"]["tokens_per_sec"] == pytest.approx(1007.0)  # median of steps 6, 8
    src = t["sa-0"]["sources"]["training"]["loss_source"]
    assert src["file"].endswith("sa-0/metrics.jsonl") and src["step"] == 8
    on_disk = json.loads((root / "claims.json").read_text())
    assert on_disk["claims"]["C1"]["verdict"] == S.REPRODUCED
    md = (root / "claims.md").read_text()
    assert "| C1 | reproduced |" in md and "Verdict rule:" in md
    # a made-up spread that swallows C1a's difference makes it inconclusive
    (root / "full-1" / "metrics.jsonl").write_text((root / "full-1" / "metrics.jsonl").read_text()
                                                    .replace('"loss": 2.03', '"loss": 2.7'))
    doc = S.run_claims(root, S.Settings(ruler_length=0, claims=("C1",), table=False), evaluate=False)
    assert {p["part"]: p["verdict"] for p in doc["claims"]["C1"]["parts"]}["a"] == S.INCONCLUSIVE


def test_claims_bad_input_is_one_line(tmp_path, capsys):
    from hybrid_lm.cli import main

    rc = main(["claims", str(tmp_path)])
    assert rc == 2 and "holds no sweep.json" in capsys.readouterr().err
    root = tmp_path / "s"
    (root / "x").mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps({"jobs": [_fake_run(root, "r", "full", 0, 2.0)]}))
    rc = main(["claims", str(root), "--claims", "C9", "--no-eval"])
    assert rc == 2 and "unknown C9" in capsys.readouterr().err



def _fake_study(root: Path, losses: dict, T: int = 32) -> Path:
    """A study root whose runs are named ``<arch>-<seed>`` with the given final val losses."""
    jobs = [_fake_run(root, f"{arch}-{seed}", arch, seed, loss, T) for (arch, seed), loss in losses.items()]
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    return root


def test_claims_pooled_over_two_study_roots(tmp_path):
    """Two runs of one study judged together: an arm's number is its mean over the roots, every run is a
    replicate in the band, the table names each run's study, and the pooled files go to --out."""
    from hybrid_lm.cli import main
    from hybrid_lm.scaling import study as S

    one = {("full", 0): 2.00, ("full", 1): 2.03, ("full_rerun", 0): 2.01, ("swa128", 0): 2.10, ("sa128", 0): 2.60,
           ("sa_swa128", 0): 2.02}
    two = {("full", 0): 2.10, ("full", 1): 2.05, ("full_rerun", 0): 2.04, ("swa128", 0): 2.20, ("sa128", 0): 2.40,
           ("sa_swa128", 0): 2.08}
    a, b = _fake_study(tmp_path / "h100" / "study", one), _fake_study(tmp_path / "h200" / "study", two)
    st = S.Settings(ruler_length=0, claims=("C1",), table=False)
    alone = S.run_claims(a, st, evaluate=False)  # one root: its own numbers, written into the root
    assert {p["part"]: p["d"] for p in alone["claims"]["C1"]["parts"]} == pytest.approx({"a": 0.5, "b": 0.58, "c": 0.02})
    out = tmp_path / "pooled"
    doc = S.run_claims([a, b], st, evaluate=False, out=out)
    # every arm is now replicated: the band is the widest spread, sa128's 2.40 .. 2.60 (full's is 0.10)
    assert doc["noise"]["bands"]["loss"] == pytest.approx(0.20)
    c1 = {p["part"]: p for p in doc["claims"]["C1"]["parts"]}
    assert c1["a"]["d"] == pytest.approx((2.60 + 2.40) / 2 - (2.10 + 2.20) / 2)  # 0.35
    assert c1["b"]["d"] == pytest.approx(2.50 - 2.05) and c1["c"]["d"] == pytest.approx(2.05 - 2.05)
    assert c1["a"]["band"] == pytest.approx(0.20) and c1["a"]["verdict"] == S.REPRODUCED
    assert c1["a"]["numbers"]["sa128"] == pytest.approx(2.50)
    # labelled by their directories; two roots named alike are told apart by their paths
    assert S.study_labels([a, b]) == [str(a), str(b)] and S.study_labels([a, tmp_path / "x"]) == ["study", "x"]
    assert doc["runs"][0] == f"{a}/full-0" and {t["study"] for t in doc["table"]} == {str(a), str(b)}
    cell = next(c for c in doc["cells"] if (c["arch"], c["seed"]) == ("sa128", 0))
    assert cell["loss_mean"] == pytest.approx(2.50) and (cell["loss_min"], cell["loss_max"]) == (2.40, 2.60)
    assert len(cell["runs"]) == 2
    md = (out / "claims.md").read_text()
    assert md.startswith(f"Generated by `hybrid-lm claims {a} {b} --out {out}`") and "| study | arch |" in md
    assert "| sa128 | 0 | 2 | 2.5000 | 2.4000 | 2.6000 | 0.2000 |" in md
    assert (out / "plots" / "study_loss.png").stat().st_size > 0
    assert json.loads((out / "claims.json").read_text())["roots"] == [str(a), str(b)]
    # evaluations are planned per root (each its own rows) and read back pooled: C2a over all six full runs
    from hybrid_lm.eval.suite import eval_key

    st2 = S.Settings(ruler_length=0, claims=("C2",), table=False, mc_context=0)
    evals = [e for rs in S.pooled_runs([a, b], checkpoints=True) for e in S.plan(rs, st2.resolved(32))]
    assert len(evals) == 12 and {e.run.study for e in evals} == {str(a), str(b)}
    for e in evals:  # d = loss(SWA) - loss(SA) per run: -1.0 on the first root, -2.0 on the second
        conf = e.request.config("loss")
        sa = e.key.endswith("/sa")
        loss = 3.0 + (sa * (1.0 if e.run.study == str(a) else 2.0))
        with (e.run.dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps({"task": "loss", "kind": "loss", "checkpoint_step": 8, "eval_key": eval_key(conf),
                                 "eval_config": conf, "loss": loss}) + "\n")
    doc = S.run_claims([a, b], st2, out=tmp_path / "c2")
    assert doc["evaluation_stats"] == {"done": 0, "skipped": 12, "left": 0, "failed": {}}
    c2a = doc["claims"]["C2"]["parts"][0]
    assert c2a["d"] == pytest.approx(-1.5) and c2a["band"] == pytest.approx(1.0) and "runs evaluated" not in c2a["why"]
    # through the command line
    assert main(["claims", str(a), str(b), "--no-eval", "--claims", "C1", "--no-table", "--ruler-length", "0",
                 "--out", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli" / "claims.json").read_text())["claims"]["C1"]["parts"][0]["d"] == \
        pytest.approx(0.35)


def test_claims_pooled_bad_input_is_one_line(tmp_path, capsys):
    from hybrid_lm.cli import main

    losses = {("full", 0): 2.0, ("full", 1): 2.1}
    a, b = _fake_study(tmp_path / "a", losses), _fake_study(tmp_path / "b", losses)
    for args, match in [([a, b], "several study roots need --out DIR"),
                        ([a, a, "--out", tmp_path / "o"], "a study root is given twice"),
                        ([a, tmp_path / "none", "--out", tmp_path / "o"], "none holds no sweep.json")]:
        assert main(["claims", *map(str, args), "--no-eval"]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
    other = tmp_path / "c"  # the same arm and seed under another name: another config, not a replicate
    _fake_run(other, "full-0-deadbeef", "full", 0, 2.0)
    (other / "sweep.json").write_text(json.dumps({"jobs": [_fake_run(other, "full-1", "full", 1, 2.1),
                                                           {"name": "full-0-deadbeef", "kind": "independent",
                                                            "arch": "full", "seed": 0}]}))
    assert main(["claims", str(a), str(other), "--no-eval", "--out", str(tmp_path / "o")]) == 2
    assert "are not replicates of one study: full seed 0 is full-0-deadbeef" in capsys.readouterr().err
    longer = _fake_study(tmp_path / "d", losses, T=64)
    assert main(["claims", str(a), str(longer), "--no-eval", "--out", str(tmp_path / "o")]) == 2
    assert "runs trained at several lengths [32, 64]" in capsys.readouterr().err


def test_the_studys_swaps_resolve_on_its_configs():
    """The swaps `hybrid-lm claims` asks for are valid on the study's S1 configs at T = 4096 (checked without a
    checkpoint: the rewritten config takes the same parameters)."""
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.experiment import load_config
    from hybrid_lm.scaling.study import MOBA_SSA, SSA_SPARSE

    common = ["scale/s1.gin"], ["ModelConfig.vocab_size = 256", "DataConfig.seq_len = 4096"]
    full = load_config(["base.gin", *common[0]], common[1] + ["ModelConfig.layer_pattern = 'F'"])
    for swap in ("full=sa:128", "full=swa:128", MOBA_SSA):
        cfg = swapped_config(full, [swap])
        assert cfg.model.full.kind == swap.split("=")[1].split(":")[0]
    assert swapped_config(full, [MOBA_SSA]).model.full.options == {"block_size": 16, "gate": "ssa", "top_k": 16}
    ssa = load_config(["base.gin", *common[0], "arch/ssa.gin"], common[1])
    assert ssa.model.full.options["eval_stream"] == "full"  # evaluated with full attention by default
    assert swapped_config(ssa, [SSA_SPARSE]).model.full.options["eval_stream"] == "sparse"


def test_c3_band_is_the_spread_of_the_degradation(tmp_path):
    """C3a compares degradations (sparse minus own loss): its band is their spread over the full replicates,
    not the spread of the val loss, as for every other metric."""
    from hybrid_lm.eval.suite import eval_key
    from hybrid_lm.scaling import study as S

    root = tmp_path / "study"
    jobs = [_fake_run(root, "full-0", "full", 0, 2.00), _fake_run(root, "full-1", "full", 1, 2.30),
            _fake_run(root, "full_rerun-0", "full_rerun", 0, 2.05), _fake_run(root, "ssa-0", "ssa", 0, 2.10)]
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    st = S.Settings(ruler_length=0, claims=("C3",), table=False)
    runs = S.study_runs(root)
    sparse = {"full-0": 2.10, "full-1": 2.42, "full_rerun-0": 2.16, "ssa-0": 2.12}  # degradations .10 .12 .11 / .02
    for e in S.plan(runs, st.resolved(32)):
        conf = e.request.config("loss")
        row = {"task": "loss", "kind": "loss", "checkpoint_step": 8, "eval_key": eval_key(conf), "eval_config": conf,
               "loss": sparse[e.run.name]}
        with (e.run.dir / "eval.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    a, b = S.run_claims(root, st)["claims"]["C3"]["parts"]
    assert a["d"] == pytest.approx(0.11 - 0.02) and a["band"] == pytest.approx(0.02)  # not the loss band, 0.30
    assert a["verdict"] == S.REPRODUCED
    assert b["d"] == pytest.approx(0.10) and b["band"] == pytest.approx(0.30) and b["verdict"] == S.REPRODUCED


def test_longppl_rows_are_found_after_the_study_root_moved(tmp_path):
    """LongPPL's rows name the evaluator by its path at evaluation time; judging a moved copy of the
    results (docs/results/study) finds them through the evaluator run's directory name."""
    import dataclasses

    from hybrid_lm.eval.suite import eval_key
    from hybrid_lm.scaling import study as S

    root = tmp_path / "moved"
    jobs = [_fake_run(root, "full-0", "full", 0, 2.00), _fake_run(root, "full-1", "full", 1, 2.30)]
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    st = S.Settings(ruler_length=0, claims=("C6",), table=False)
    runs = S.study_runs(root)
    for e, lp in zip(S.plan(runs, st.resolved(32)), (3.0, 40.0)):
        old = dataclasses.replace(e.request, evaluator="/gpu-machine/runs/study/full-0").config("longppl")
        row = {"task": "longppl", "kind": "longppl", "checkpoint_step": 8, "eval_key": eval_key(old),
               "eval_config": old, "longppl": lp}
        (e.run.dir / "eval.jsonl").write_text(json.dumps(row) + "\n")
    doc = S.run_claims(root, st, evaluate=False)
    assert doc["claims"]["C6"]["parts"][0]["numbers"] == {"full-0": 3.0, "full-1": 40.0}
    assert all(e["done"] for e in doc["evaluations"])
    other = dataclasses.replace(S.plan(runs, st.resolved(32))[1].request, evaluator="/gpu-machine/runs/study/full-0",
                                longppl_docs=7).config("longppl")  # a row of other settings is not the claim's
    (root / "full-1" / "eval.jsonl").write_text(json.dumps(
        {"task": "longppl", "kind": "longppl", "checkpoint_step": 8, "eval_key": eval_key(other), "eval_config": other,
         "longppl": 40.0}) + "\n")
    assert S.run_claims(root, st, evaluate=False)["claims"]["C6"]["parts"][0]["numbers"]["full-1"] is None


def test_c2c_settings_are_checked():
    from hybrid_lm.scaling import study as S

    assert S.Settings().resolved(4096).mc_context == 2048 and S.Settings(mc_context=0).resolved(64).mc_context == 0
    with pytest.raises(ConfigError, match="--mc-items 0: must be >= 1"):
        S.Settings(mc_items=0).resolved(64)
    with pytest.raises(ConfigError, match="--mc-context 64: must be below the trained length 64"):
        S.Settings(mc_context=64).resolved(64)
