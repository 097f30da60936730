"""The benchmarks (``experiments/bench_*.py``), their harness and the report generator, on the CPU.

Each script runs in-process at tiny shapes (``--quick``: the Pallas kernels in interpret mode, XLA in place of
cuDNN) and writes its JSON into a temporary folder; the test checks the file's common fields, that its
numbers are positive and that the report renders it. The generator is tested on result folders built here.
Numbers measured on the CPU mean nothing: no test compares a time with anything. No test reads
``experiments/results``."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import harness  # noqa: E402
import report  # noqa: E402

SCRIPTS = ["train", "attention", "sparse", "decode", "mixers", "kernels", "data", "eval"]
COMMON = {"bench", "command", "device", "device_kind", "devices", "platform", "jax", "date", "git", "wall_s",
          "anchor", "rows"}


def bench(name):
    return importlib.import_module(f"bench_{name}")


def run_quick(name, tmp_path, *args) -> dict:
    """``bench_<name>.py --quick ARGS`` in this process; returns its JSON after the common checks."""
    out = tmp_path / "results" / "cpu" / f"{name}.json"
    bench(name).main(["--quick", *args, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert COMMON <= set(doc), COMMON - set(doc)
    assert doc["bench"] == name and doc["device"] == "cpu" and doc["rows"]
    assert doc["command"] == " ".join(["python", f"experiments/bench_{name}.py", "--quick", *args])  # no --out
    assert "\n" not in "".join(report.RENDER[name](doc))  # the report renders it, one line per entry
    return doc


def positive(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        bench(name).main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def test_train(tmp_path):
    doc = run_quick("train", tmp_path, "--scale", "s1", "--arch", "full,moba")
    a = doc["anchor"]
    assert a["arch"] == "anchor_gpt" and a["status"] == "ok" and positive(a["tokens_per_sec"], a["mfu"])
    assert [(r["arch"], r["batch"], r["status"]) for r in doc["rows"]] == [("full", 1, "ok"), ("moba", 1, "ok")]
    for r in doc["rows"]:
        assert positive(r["ms_per_step"], r["tokens_per_sec"], r["mfu"], r["mfu_vs_anchor"], r["compile_s"],
                        r["peak_bytes"], r["init_compile_s"])
        assert r["attention_backends"] and r["remat"] == "none"  # the preset's policy
    assert doc["batch"] == "1" and positive(doc["peak_flops"])


def test_train_deadline_reports_what_did_not_run(tmp_path):
    """With no time left, nothing compiles: every variant is reported, none is timed."""
    out = tmp_path / "t.json"
    bench("train").main(["--quick", "--scale", "s1", "--arch", "full,swa", "--anchor-batch", "0",
                         "--deadline", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["anchor"] is None
    assert [(r["arch"], r["status"]) for r in doc["rows"]] == [("full", "not_compiled"), ("swa", "not_compiled")]


def test_anchor_gpt_trains_and_counts_flops():
    """The anchor: a plain-JAX GPT whose loss falls on a fixed batch, FLOPs counted as the hybrid stacks' are."""
    a = harness.AnchorGPT(128, 2, layers=2, d=64, heads=4, vocab=256)
    lowered, lower_s, backends = a.lower()
    compiled, compile_s, peak = a.compile(lowered, lower_s)
    row = a.run(compiled, 2)
    assert math.isfinite(row["loss"]) and row["loss"] < math.log(256) and positive(row["ms_per_step"], peak)
    # 2 layers x 12 d^2 + the head, times 6, plus causal attention 6 L T d
    assert a.flops_per_token() == 6 * (2 * 12 * 64 * 64 + 64 * 256) + 6 * 2 * 128 * 64
    # per block 12 d^2 + two norm gains, the final norm, the untied head
    assert row["non_embedding"] == 2 * (12 * 64 * 64 + 2 * 64) + 64 + 64 * 256


def test_attention(tmp_path):
    doc = run_quick("attention", tmp_path)
    tables = {(r["table"], r["impl"]) for r in doc["rows"]}
    assert {("windowed", "xla"), ("windowed", "pallas_swa"), ("windowed", "pallas_sa")} <= tables
    assert {("moba", "xla_full_causal"), ("moba", "pallas_block_lists"), ("moba", "moba_path")} <= tables
    assert all(positive(r["fwd_ms"], r["fwd_bwd_ms"], r["fwd_bwd_vs_anchor"]) for r in doc["rows"])
    assert all(r["fwd_bwd_vs_anchor"] == 1.0 for r in doc["rows"] if r["anchor"])


def test_sparse(tmp_path):
    doc = run_quick("sparse", tmp_path)
    assert [(r["part"], r["impl"]) for r in doc["rows"]] == [
        ("attention", "xla_full_causal"), ("attention", "union"), ("attention", "gather"), ("path", "model_path"),
        ("selection", "xla"), ("selection", "kernel")]
    assert all(positive(r["fwd_ms"], r["fwd_vs_anchor"]) for r in doc["rows"])
    assert all(positive(r["fwd_bwd_ms"]) for r in doc["rows"] if r["part"] != "selection")


def test_decode(tmp_path):
    doc = run_quick("decode", tmp_path, "--layer-archs", "full,swa,ssa_sparse", "--model-archs", "full,moba")
    assert [(r["level"], r["arch"], r["status"]) for r in doc["rows"]] == [
        ("layer", "full", "ok"), ("layer", "swa", "ok"), ("layer", "ssa_sparse", "ok"),
        ("model", "full", "ok"), ("model", "moba", "ok")]
    assert all(positive(r["tokens_per_sec"], r["vs_full"], r["compile_s"]) for r in doc["rows"])
    assert [r["vs_full"] for r in doc["rows"] if r["arch"] == "full"] == [1.0, 1.0]


def test_mixers(tmp_path):
    doc = run_quick("mixers", tmp_path, "--archs", "full,sa,moba,mamba2")
    assert [(r["arch"], r["mixer"]) for r in doc["rows"]] == [
        ("full", "attention"), ("sa", "sa"), ("moba", "moba"), ("mamba2", "mamba2")]
    assert all(positive(r["fwd_ms"], r["fwd_bwd_ms"], r["fwd_bwd_vs_full"]) for r in doc["rows"])


def test_kernels(tmp_path):
    doc = run_quick("kernels", tmp_path)
    assert [(r["part"], r["impl"]) for r in doc["rows"]] == [
        ("loss pass", "xla"), ("loss pass", "pallas"), ("conv fwd+bwd", "xla"), ("conv fwd+bwd", "pallas")]
    assert all(positive(r["ms"], r["gb_per_s"], r["vs_anchor"]) for r in doc["rows"])


def test_data(tmp_path):
    doc = run_quick("data", tmp_path)
    assert [(r["part"], r.get("workers"), r.get("document_mask")) for r in doc["rows"]] == [
        ("prepare", 1, None), ("prepare", 2, None), ("loader", None, False), ("loader", None, True)]
    assert all(positive(r["tokens_per_sec"], r["vs_anchor"]) for r in doc["rows"])


def test_eval(tmp_path):
    doc = run_quick("eval", tmp_path, "--tasks", "loss,longppl")
    assert [r["task"] for r in doc["rows"]] == ["loss", "longppl", "all"]
    assert all(positive(r["wall_s"]) for r in doc["rows"]) and doc["train"]["steps"] == 10


# ----------------------------------------------------------------------------- harness


@pytest.mark.parametrize("kind,platform,name", [("NVIDIA H100 80GB HBM3", "gpu", "h100"), ("NVIDIA H200", "gpu", "h200"),
                                                ("NVIDIA A100-SXM4-80GB", "gpu", "a100"), ("cpu", "cpu", "cpu"),
                                                ("NVIDIA GH200 480GB", "gpu", "gh200")])
def test_device_name(kind, platform, name):
    assert harness.device_name(kind, platform) == name


def test_result_file_is_overwritten_and_names_its_command(tmp_path):
    out = tmp_path / "x.json"
    harness.write_result("data", str(out), ["--quick", "--out", str(out), "--steps", "2"], [{"a": 1}])
    harness.write_result("data", str(out), ["--out=" + str(out), "--quick"], [{"a": 2}], anchor="it")
    doc = json.loads(out.read_text())
    assert doc["rows"] == [{"a": 2}] and doc["anchor"] == "it"
    assert doc["command"] == "python experiments/bench_data.py --quick"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # written atomically, nothing left beside it
    assert harness.result_path("train") == harness.RESULTS / harness.device_name() / "train.json"


def test_gpu_scripts_parse():
    for script in ("gpu.sh", "study.sh", "wheels.sh", "determinism.sh"):
        assert subprocess.run(["bash", "-n", str(EXPERIMENTS / script)]).returncode == 0, script


# ----------------------------------------------------------------------------- the report


def _train_doc(device_kind="NVIDIA H100 80GB HBM3", date="2030-01-02T03:04:05Z"):
    def row(arch, tps, status="ok"):
        if status != "ok":
            return {"scale": "s5", "arch": arch, "batch": 2, "seq_len": 16384, "status": status, "error": "late"}
        return {"scale": "s5", "arch": arch, "batch": 2, "seq_len": 16384, "status": "ok", "ms_per_step": 32768e3 / tps,
                "tokens_per_sec": tps, "mfu": tps * 1e-6, "peak_bytes": 40 * 2 ** 30, "compile_s": 50.0}
    anchor = dict(row("anchor_gpt", 50000.0), scale="anchor", batch=4, non_embedding=369e6)
    return {"bench": "train", "command": "python experiments/bench_train.py --scale s5", "device": "h100",
            "device_kind": device_kind, "devices": 1, "platform": "gpu", "jax": "0.11.2", "date": date, "git": "abc1234",
            "wall_s": 400.0, "anchor": anchor, "batch": "rule", "peak_flops": 989e12,
            "rows": [row("full", 60000.0), row("moba", 50000.0), row("ssa", 40000.0), row("gdn", 1, "not_compiled")]}


def _decode_doc():
    rows = [{"level": "model", "arch": a, "scale": "s5", "context": 131072, "batch": 8, "dtype": "bfloat16",
             "status": "ok", "ms_per_step": 8 / t * 1e3, "tokens_per_sec": t, "vs_full": t / 1000.0}
            for a, t in (("full", 1000.0), ("ssa_sparse", 3000.0))]
    return {"bench": "decode", "command": "python experiments/bench_decode.py --layer-contexts none", "device": "h100",
            "device_kind": "NVIDIA H100 80GB HBM3", "devices": 1, "platform": "gpu", "jax": "0.11.2",
            "date": "2030-01-02T03:10:00Z", "git": "abc1234", "wall_s": 100.0, "anchor": "full", "rows": rows}


def _write(folder: Path, device: str, bench_name: str, doc: dict):
    (folder / device).mkdir(parents=True, exist_ok=True)
    (folder / device / f"{bench_name}.json").write_text(json.dumps(doc))


def test_report_from_a_results_folder(tmp_path):
    results = tmp_path / "results"
    _write(results, "h100", "train", _train_doc())
    _write(results, "h100", "decode", _decode_doc())
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.BEGIN}\nold numbers\n{report.END}\nafter\n")
    md = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(results), "--out", str(md), "--readme", str(readme)]) == 0
    text = md.read_text()
    assert len(text.splitlines()) <= report.MAX_LINES
    assert "## H100 (NVIDIA H100 80GB HBM3)" in text
    assert "`python experiments/bench_train.py --scale s5` on NVIDIA H100 80GB HBM3, 2030-01-02 03:04 UTC" in text
    assert "| **anchor GPT** | 4 | 655.4 | 50.0K | 5.0% | 1.00 | — | 40.0 | 50.0 |" in text
    assert "| full attention | 2 | 546.1 | 60.0K | 6.0% | 1.20 | 1.00 | 40.0 | 50.0 |" in text
    assert "| MoBA hybrid | 2 | 655.4 | 50.0K | 5.0% | 1.00 | 1.20 | 40.0 | 50.0 |" in text
    assert "s5 gdn not_compiled (late)" in text
    assert "a plain-JAX GPT of 369M non-embedding parameters at B = 4" in text
    (missing,) = [x for x in text.splitlines() if x.startswith("Not measured yet on this device: ")]
    assert "Attention kernels against cuDNN (`bash experiments/gpu.sh bench attention`)" in missing
    assert "### Attention kernels" not in text and "Decoding" not in missing
    block = readme.read_text()
    assert block.startswith("# x\n\nbefore\n" + report.BEGIN + "\nS5 train step on one NVIDIA H100 80GB HBM3 (2030-01-02")
    assert block.endswith(report.END + "\nafter\n") and "old numbers" not in block
    assert "Step time per token against full attention: MoBA hybrid 1.20x, SSA 1.50x." in block
    assert "| SSA (sparse stream) | 3,000 | 3.00 |" in block
    # a rerun leaves the files as they are
    before = (md.read_text(), readme.read_text())
    report.main(["--results", str(results), "--out", str(md), "--readme", str(readme)])
    assert (md.read_text(), readme.read_text()) == before


def test_report_readme_device_is_the_newest_gpu(tmp_path):
    results = tmp_path / "results"
    _write(results, "h100", "train", _train_doc())
    _write(results, "h200", "train", dict(_train_doc("NVIDIA H200", "2030-02-01T00:00:00Z"), device="h200"))
    _write(results, "cpu", "train", dict(_train_doc("cpu", "2031-01-01T00:00:00Z"), device="cpu"))
    data = report.load(results)
    assert report.readme_device(data, None) == "h200"
    assert "on one NVIDIA H100 80GB HBM3" in report.readme_table(data, "h100")
    assert "Decoding at 128K: not measured yet on this device" in report.readme_table(data, "h200")
    text = report.benchmarks_md(data, results)
    assert text.index("## H100") < text.index("## H200") < text.index("## CPU")
    assert "## CPU (cpu)" in text and text.count("Not measured yet on this device") == 2  # GPU devices only


def test_report_without_results_names_the_commands(tmp_path):
    md, readme = tmp_path / "B.md", tmp_path / "R.md"
    readme.write_text(f"{report.BEGIN}\n{report.END}\n")
    report.main(["--results", str(tmp_path / "none"), "--out", str(md), "--readme", str(readme)])
    text = md.read_text()
    assert "No results yet" in text and "`bash experiments/gpu.sh readme`" in text
    assert all(f"`{cmd}`" in text for _, _, cmd in report.BENCHES.values())
    assert "Not measured yet: run `bash experiments/gpu.sh readme` on one GPU" in readme.read_text()


def test_report_refuses_more_than_40_result_files(tmp_path):
    results = tmp_path / "results"
    for i in range(report.MAX_FILES + 1):
        _write(results, f"d{i % 3}", f"b{i}", _train_doc())
    with pytest.raises(SystemExit, match="41 result files, more than 40"):
        report.main(["--results", str(results), "--out", str(tmp_path / "B.md"), "--readme", "none"])


def _determinism_runs(root: Path) -> None:
    """determinism.sh's runs in small: ``full`` and ``ssa``, two runs per mode, a train row every 5 steps to 60.
    Deterministic runs repeat their numbers; the default's second run differs from step 15 (``full``) or 5
    (``ssa``). tokens/s: 10 before step 20 (left out), then deterministic 550, default 1000 and 1200."""
    for model, differs in (("full", 15), ("ssa", 5)):
        for mode in ("deterministic", "default"):
            backend = "jla" if mode == "deterministic" else "cudnn"
            for i in (1, 2):
                run = root / f"{model}-{mode}{i}"
                run.mkdir(parents=True)
                rows = [{"kind": "eval", "step": 0, "loss": 5.8}]
                for step in range(5, 65, 5):
                    off = 1e-3 if mode == "default" and i == 2 and step >= differs else 0.0
                    speed = 10.0 if step < 20 else 550.0 if mode == "deterministic" else 1000.0 + 200 * (i - 1)
                    rows.append({"kind": "train", "step": step, "loss": 4.0 - step / 100 + off, "grad_norm": 2.0,
                                 "tokens_per_sec": speed, "attention_backends": {"full": backend}})
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                log = run / "train.log" if i == 1 else root / f"{run.name}.log"  # kept inside, or beside
                log.write_text(f"step 0\ncompiled in {12.0 + i} s\n")
                (run / "provenance.json").write_text(json.dumps({
                    "device_kind": "NVIDIA H100 80GB HBM3", "packages": {"jax": "0.11.2"}, "git": {"sha": "f" * 40}}))


def test_determinism_runs_become_a_result_file(tmp_path, monkeypatch, capsys):
    """`determinism.py ROOT` summarises determinism.sh's runs (built here): bitwise equality from every logged
    loss and gradient norm, tokens/s against the default mode; `report.py --determinism ROOT` turns the rows
    into <device>/determinism.json and its table."""
    import determinism

    src = tmp_path / "runs"
    _determinism_runs(src)
    rows = {(r["model"], r["mode"]): r for r in determinism.summary(src)}
    assert set(rows) == {(m, mode) for m in ("full", "ssa") for mode in ("deterministic", "default")}
    for model, differs in (("full", 15), ("ssa", 5)):
        det, default = rows[(model, "deterministic")], rows[(model, "default")]
        assert det["bitwise_equal"] and det["first_difference"] is None and det["final_loss"][0] == det["final_loss"][1]
        assert not default["bitwise_equal"] and default["first_difference"] == differs
        assert det["tokens_per_sec"] == 550.0 and default["tokens_per_sec"] == 1100.0  # steps >= 20, two runs' mean
        assert det["vs_default"] == pytest.approx(0.5) and default["vs_default"] == 1.0
        assert det["compile_s"] == [13.0, 14.0] and det["steps"] == 60  # read from each run's log, inside or beside
        assert det["attention"] == {"full": "jla"}
    # a pair that differs at one logged step only is not bitwise equal, and says which step
    path = src / "full-deterministic2" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if json.loads(line).get("step") == 30)
    row = json.loads(lines[i])
    row["grad_norm"] = math.nextafter(row["grad_norm"], math.inf)
    path.write_text("\n".join(lines[:i] + [json.dumps(row)] + lines[i + 1:]) + "\n")
    changed = {(r["model"], r["mode"]): r for r in determinism.summary(src, ["full"])}[("full", "deterministic")]
    assert not changed["bitwise_equal"] and changed["first_difference"] == 30
    assert determinism.main([str(src), "ssa"]) == 0
    assert "ssa        deterministic / default tokens/s: 0.500" in capsys.readouterr().out
    for bad in ([str(tmp_path / "none")], [str(src), "nope"], []):
        assert determinism.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("HYBRID_LM_COMMIT", "0eec293")
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--determinism", str(src), "--results", str(tmp_path / "r"), "--out", str(out),
                        "--readme", "none"]) == 0
    doc = json.loads((tmp_path / "r" / "h100" / "determinism.json").read_text())
    assert doc["device_kind"] == "NVIDIA H100 80GB HBM3" and doc["git"] == "0eec293" and len(doc["rows"]) == 4
    assert doc["jax"] == "0.11.2" and doc["steps"] == 60
    md = out.read_text()
    assert "### Deterministic GPU training: its cost" in md and "| ssa | deterministic | yes | — | 550 | 0.500 |" in md


def test_eval_cost_from_the_rows(tmp_path, capsys):
    """experiments/eval_cost.py: an eval's cost is its row's eval_s, else what the log interval holding it
    took beyond the run's median interval; a run with only a final eval is skipped; no run is one line."""
    import eval_cost

    run = tmp_path / "r1"
    run.mkdir()
    tps = 1000.0  # tokens/s; 10 steps of 100 tokens per interval: 1 s
    rows = [{"kind": "train", "step": s, "tokens": 100 * s, "tokens_per_sec": tps} for s in range(10, 60, 10)]
    rows[2]["tokens_per_sec"] = tps / 3  # the interval (20, 30] took 3 s: the eval at step 20 cost 2 s
    rows.insert(2, {"kind": "eval", "step": 20, "eval_windows": 8})
    rows.append({"kind": "eval", "step": 40, "eval_windows": 8, "eval_s": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    c = eval_cost.run_cost(run)
    assert c["eval_s"] == pytest.approx([2.0, 0.5]) and c["windows"] == 8 and c["train_s"] == pytest.approx(4.0)
    only_final = tmp_path / "r2"
    only_final.mkdir()
    (only_final / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[3:5]) +
                                              json.dumps({"kind": "eval", "step": 50}) + "\n")
    assert eval_cost.run_cost(only_final) is None
    assert eval_cost.main([str(tmp_path)]) == 0 and "2 evals: median 1.25 s" in capsys.readouterr().out
    assert eval_cost.main([str(tmp_path / "r2")]) == 2
    assert capsys.readouterr().err.startswith("error: no run with eval and train rows")
