"""The GPU benchmark scripts run end to end on the CPU (tiny shapes, Pallas interpret mode), so that a
broken script is caught here rather than in a device call. Their numbers are meaningless here."""

import json
import os
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("xla_optimized")  # interpret-mode kernels: running outweighs compiling (75 -> 53 s)
def test_bench_attention_parallel_workers_merge(tmp_path):
    """--parallel: one worker per shape and one for MoBA, GPU turns under a file lock, one merged
    table and JSON."""
    out = tmp_path / "attention.json"
    stdout = _run(["experiments/bench_attention.py", "--interpret", "--parallel", "--moba",
                   "--shapes", "64x1,32x2", "--windows", "16", "--impls", "pallas_sa",
                   "--reps", "1", "--inner", "1", "--moba-T", "256", "--moba-block", "64",
                   "--moba-configs", "m64", "--out", str(out)], tmp_path)
    assert "failed: none" in stdout
    r = json.loads(out.read_text())
    assert [(row["T"], row["B"]) for row in r["rows"]] == [(64, 1), (32, 2)]
    assert all(row["pallas_sa"]["fwd_bwd"] is not None for row in r["rows"])
    assert r["moba"]["rows"]["pallas_block[m64]"]["fwd_bwd"] is not None


@pytest.mark.slow
def test_bench_selection(tmp_path):
    out = tmp_path / "selection.json"
    _run(["experiments/bench_selection.py", "--cases", "256:16:4:ssa", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["selection"] for r in rows] == ["block", "token"] and all(r["ms"] > 0 for r in rows)


TINY = ["ModelConfig.vocab_size = 256", "ModelConfig.d_model = 64", "ModelConfig.n_heads = 2",
        "ModelConfig.d_ff = 128", "ModelConfig.n_layers = 2", "ModelConfig.compute_dtype = 'float32'"]
TINY_ARGS = [a for b in TINY for a in ("--gin_param", b)]


@pytest.mark.slow
def test_bench_decode_check_and_tables(tmp_path):
    """bench_decode: the decode == forward check passes, and both tables (layer, model) are written."""
    out = tmp_path / "decode.json"
    _run(["experiments/bench_decode.py", "--check", "--check-archs", "full,ssa_sparse", "--dtype", "float32",
          "--out", str(out)], tmp_path)
    # one dense and the sparse decode path (every mixer's decode == forward: tests/test_generate.py)
    assert [r["arch"] for r in json.loads(out.read_text())["check"]] == ["full", "ssa_sparse"]
    assert all(r["ok"] for r in json.loads(out.read_text())["check"])
    _run(["experiments/bench_decode.py", "--scale", "s1", "--contexts", "256", "--batch", "2",
          "--layer-archs", "full,swa,ssa_sparse,mamba2", "--model-archs", "full,ssa_sparse",
          "--model-contexts", "256", "--steps", "2", "--reps", "1", "--dtype", "float32", "--parts",
          "--out", str(out), *TINY_ARGS], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    tables = [r for r in rows if r["level"] != "part"]
    assert [(r["level"], r["arch"]) for r in tables] == [
        ("layer", "full"), ("layer", "swa"), ("layer", "ssa_sparse"), ("layer", "mamba2"),
        ("model", "full"), ("model", "ssa_sparse")]
    assert all(r["tokens_per_sec"] > 0 and r["vs_full"] > 0 for r in tables)
    assert {r["part"] for r in rows if r["level"] == "part"} == {
        "gate scores", "top-k sort", "top-k passes", "attend selected", "block-sum update"}
    prof = tmp_path / "prof"
    _run(["experiments/bench_decode.py", "--scale", "s1", "--contexts", "256", "--batch", "2", "--steps", "2",
          "--dtype", "float32", "--profile", "moba", "--profile-dir", str(prof), "--out", str(out), *TINY_ARGS],
         tmp_path)
    (p,) = json.loads(out.read_text())["profiles"]
    assert p["arch"] == "moba" and p["steps"] == 2  # the CPU trace has no GPU stream lines to sum
    assert "while" in (prof / "decode_moba_256.hlo.txt").read_text()
    assert (prof / "trace_decode_moba_256.json.gz").stat().st_size > 0


def test_bench_train_compile_only(tmp_path):
    """bench_train --compile-only: compiled, never run; the program's size is counted; scan is smaller."""
    out = tmp_path / "compile.json"
    _run(["experiments/bench_train.py", "--scale", "s1", "--arch", "gdn,gdn+scan", "--seq-len", "64", "--batch", "1",
          "--compile-alone", "--compile-only", "--out", str(out),
          *TINY_ARGS, "--gin_param", "ModelConfig.n_layers = 4"], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["status"]) for r in rows] == [("gdn", "compiled"), ("gdn+scan", "compiled")]
    assert all("ms_per_step" not in r and r["compile_s"] > 0 for r in rows)
    assert rows[1]["fusions"] < rows[0]["fusions"]  # one scanned (full, GDN) pair instead of two


@pytest.mark.slow
def test_bench_train_sweep_microbatch(tmp_path):
    """bench_train --sweep-microbatch --accumulate: every variant compiles and runs, the best table is written."""
    out, table = tmp_path / "train.json", tmp_path / "mb.json"
    _run(["experiments/bench_train.py", "--scale", "s1", "--arch", "full,sa@dots_attn", "--seq-len", "64",
          "--sweep-microbatch", "1,2", "--accumulate", "2", "--steps", "1", "--compile-workers", "2",
          "--time-after-compiles", "--out", str(out), "--table-out", str(table), "--save-primitive",
          "custom_partitioning", *TINY_ARGS], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    # two micro-batches of `batch` sequences per step, gradients accumulated
    assert all(r["accumulate"] == 2 and r["tokens_per_step"] == 2 * r["batch"] * 64 for r in rows)
    assert all(r["save_primitive"] == ["custom_partitioning"] for r in rows)
    assert [(r["arch"], r["batch"], r["status"], r["remat"]) for r in rows] == [
        (a, b, "ok", remat) for a, remat in (("full", "dots"), ("sa@dots_attn", "dots_attn")) for b in (1, 2)]
    assert all(r["peak_bytes"] > 0 and r["compile_s"] > 0 for r in rows)
    assert all(r["init_compile_s"] > 0 and r["warmup_s"] > 0 for r in rows)  # the phases apart from compile_s
    assert rows[2]["attention_backends"].get("sa w=128") == "xla"
    table = json.loads(table.read_text())  # the sweep's policy (dots) is the new table's; sa's keeps its own
    assert set(table["best"]) == {"s1/full/64", "s1/sa/64@dots_attn"} and table["remat"] == "dots"


def test_compile_ops_times_each_recorded_call(tmp_path):
    """compile_ops: the model's linear-attention calls are recorded from a trace and compiled alone."""
    out = tmp_path / "ops.json"
    _run(["experiments/compile_ops.py", "--scale", "s1", "--arch", "mamba2", "--seq-len", "128", "--batch", "1",
          "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["pass_"]) for r in rows] == [("simple_gla", "fwd"), ("simple_gla", "fwd+bwd")]
    assert all(r["compile_s"] > 0 and r["shapes"][0][:2] == [1, 128] for r in rows)


@pytest.mark.usefixtures("xla_optimized")  # it times compiles of the real init; optimised: 22.8 -> 18.2 s
def test_compile_init_compares_parts_with_the_whole_model(tmp_path):
    """compile_init: ParamInit's programs and the whole-model program are timed, their values equal."""
    out = tmp_path / "init.json"
    stdout = _run(["experiments/compile_init.py", "--scale", "s1", "--arch", "swa", "--whole", "swa",
                   "--out", str(out)], tmp_path)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["equal"] is True and row["programs"] == 5  # embed, full block, SWA block, final norm, head
    assert row["parts_compile_s"] > 0 and row["whole_compile_s"] > 0
    assert "True" in stdout


@pytest.mark.slow
def test_bench_selection_fused_check(tmp_path):
    """bench_selection --check: fused == reference selections (interpret mode) and the fused table."""
    out = tmp_path / "selection_fused.json"
    _run(["experiments/bench_selection.py", "--check", "--check-T", "64", "--T", "128", "--fused-cases", "16:4:ssa",
          "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert r["check"] and all(row["ok"] for row in r["check"])
    assert [(row["T"], row["gate"]) for row in r["fused"]] == [(128, "ssa")]
    assert r["fused"][0]["fused_ms"] > 0 and r["fused"][0]["attend_fused_sel_ms"] > 0


@pytest.mark.slow
def test_bench_selection_split_check_and_table(tmp_path):
    """bench_selection --split: the split kernels' selections == the reference (interpret mode), then
    the launch sweep and the table of the selection's parts."""
    out = tmp_path / "selection_split.json"
    _run(["experiments/bench_selection.py", "--split", "--check-T", "64", "--T", "128", "--B", "1",
          "--check-impls", "split,split@bf16", "--sweep", "q16c16w4s2h", "--sweep-topk", "r8w4",
          "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert [(x["kernel"], x["fastest"]) for x in r["sweep"]] == [("block_importance", True), ("top_k_blocks", True)]
    assert all(x["ms"] > 0 for x in r["sweep"])
    assert {row["impl"] for row in r["check"]} == {"split", "split@bf16"} and all(row["ok"] for row in r["check"])
    (row,) = r["split"]
    assert row["T"] == 128 and all(row[k] > 0 for k in ("xla_select_ms", "split_tf32_ms", "split_bf16_ms",
                                                         "kernel_topk_rows8_ms"))


@pytest.mark.slow
def test_bench_loss_check_and_tables(tmp_path):
    """bench_loss: the kernel's check against the reference (interpret mode) passes; the tables are written."""
    out = tmp_path / "loss.json"
    _run(["experiments/bench_loss.py", "--tokens", "300", "--chunk", "128", "--vocab", "333", "--d", "16,24",
          "--launches", "1:128:4,2:64:4", "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    from hybrid_lm.backends import jla_available

    res = json.loads(out.read_text())
    assert res["ok"]
    parts = [r["part"] for r in res["rows"]]
    n = 2 if jla_available() else 1  # pallas, and jla's fused loss (its plain-JAX form here) when installed
    assert parts.count("check_rows") == 2 and parts.count("check_loss") == n
    assert parts.count("pass") == 3 and parts.count("loss") == 2 * (1 + n)  # reference + 2 launches; 2 widths


def test_bench_norm_check_and_table(tmp_path):
    """bench_norm: the kernels' check against the references (interpret mode) passes; the table is written."""
    out = tmp_path / "norm.json"
    _run(["experiments/bench_norm.py", "--tokens", "70", "--d", "24,40", "--launches", "2:4:3",
          "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert res["ok"]
    parts = [r["part"] for r in res["rows"]]
    assert parts.count("check_kernels") == 1 and parts.count("check_vjp") == 1
    assert parts.count("time") == 6  # xla, xla closed form, 1 launch; 2 widths


def test_bench_conv_check_and_table(tmp_path):
    """bench_conv: the conv backward kernel's check against the jnp backward (interpret mode) passes; the
    table is written."""
    out = tmp_path / "conv.json"
    _run(["experiments/bench_conv.py", "--batch", "2", "--seq", "40", "--channels", "24", "--launches", "8:16:4:2",
          "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert res["ok"]
    parts = [r["part"] for r in res["rows"]]
    assert parts.count("check_kernel") == 2 and parts.count("check_vjp") == 1  # 1 launch, without and with a bias
    assert parts.count("time") == 3  # autodiff, jnp vjp, 1 launch


def test_bench_gated_norm_check_and_table(tmp_path):
    """bench_gated_norm: the gated-norm kernels' check against the references (interpret mode) passes on
    padded rows; the table is written."""
    out = tmp_path / "gated_norm.json"
    _run(["experiments/bench_gated_norm.py", "--rows", "96", "--d", "24", "--width", "32", "--launches", "4:4:3",
          "--reps", "1", "--inner", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert res["ok"]
    parts = [r["part"] for r in res["rows"]]
    assert parts.count("check_kernels") == 1 and parts.count("check_vjp") == 1
    assert all(r["pad_grad_zero"] for r in res["rows"] if r["part"] == "check_kernels")
    assert [r["impl"] for r in res["rows"] if r["part"] == "time"] == ["xla", "xla padded", "pallas 4:4:3"]


def _profile_train():
    """experiments/profile_train.py as a module (the experiments folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_train", ROOT / "experiments" / "profile_train.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    return prof


def test_profile_parts_come_from_source_frames():
    """profile_train's breakdown reads each HLO instruction's source frames: the chunked loss's ops
    are the loss part, RMSNorm's the norms part."""
    import jax
    import jax.numpy as jnp

    from hybrid_lm.model.layers import RMSNorm
    from hybrid_lm.ops.cross_entropy import chunked_cross_entropy

    prof = _profile_train()
    norm = RMSNorm(16)
    pnorm = RMSNorm(16, impl="pallas")  # its kernels' instructions are norms too

    def f(h, w, t):
        return chunked_cross_entropy(norm(pnorm(h)), w, t, chunk=32)[0]

    args = (jnp.ones((64, 16)), jnp.ones((16, 40)), jnp.zeros((64,), jnp.int32))
    src = prof.hlo_sources(jax.jit(jax.grad(f)).lower(*args).compile().as_text())
    parts = {prof.part_of(s["frames"]) for s in src.values() if s["frames"]}
    assert {"loss", "norms"} <= parts, parts
    dots = [s for s in src.values() if s["shape"].startswith("f32[32,40]") and s["frames"]]  # a chunk's logits
    assert dots and all(prof.part_of(s["frames"]) == "loss" for s in dots)


def test_compile_trace_host_phases(tmp_path):
    """profile_train --compile-trace: self time excludes nested events on the same thread, inclusive
    sums over threads, wall is the union over threads (two overlapping workers count once); GPU lines
    are left out."""
    import gzip

    prof = _profile_train()
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    x = [("compile", 1, 0, 100), ("passes", 1, 10, 30), ("codegen", 1, 50, 40),  # main thread
         ("codegen", 2, 60, 40), ("codegen", 3, 200, 10),  # workers: one overlaps the main thread's
         ("kernel", None, 0, 500)]  # a device event
    events = meta + [{"ph": "X", "name": n, "pid": 2 if t is None else 1, "tid": t or 0, "ts": ts * 1e6,
                      "dur": d * 1e6} for n, t, ts, d in x]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    got = {p["name"]: p for p in prof.host_phases(path)["phases"]}
    assert "kernel" not in got
    assert got["compile"]["self_s"] == pytest.approx(30) and got["compile"]["inclusive_s"] == pytest.approx(100)
    assert got["codegen"]["self_s"] == pytest.approx(90) and got["codegen"]["count"] == 3
    assert got["codegen"]["wall_s"] == pytest.approx(60)  # [50, 100) and [200, 210)
    assert got["passes"]["wall_s"] == pytest.approx(30)
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_train.py"), "--compile-trace",
                        "--summarize", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "does not read a saved trace" in r.stderr.strip().splitlines()[-1]


def test_profile_summary_warns_on_a_nonfinite_loss(capsys):
    """A profile of steps whose loss is NaN is flagged: NaN data runs faster than real data on the H200."""
    prof = _profile_train()
    s = {"busy_fraction": None, "device_ms_per_step": 1.0, "kinds": {}, "kernels": []}
    prof.print_summary(dict(s, loss=10.5))
    assert "WARNING" not in capsys.readouterr().out
    prof.print_summary(dict(s, loss=float("nan")))
    assert "WARNING: loss nan" in capsys.readouterr().out


def test_bench_data_power_table_and_bad_kinds(tmp_path, capsys):
    """bench_data_power times one GEMM per operand kind (no nvidia-smi here: no clock or power) and refuses
    an unknown kind in one line."""
    import importlib.util

    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("bench_data_power", ROOT / "experiments" / "bench_data_power.py")
    bdp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bdp)
    out = tmp_path / "dp.json"
    bdp.main(["--size", "64", "--seconds", "0.05", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == list(bdp.KINDS) and rows[0]["vs_normal"] == 1.0
    assert all(r["ms"] > 0 for r in rows)
    a, b = bdp.operands("nan", 4)
    assert bool(jnp.isnan(a).all()) and a.dtype.name == "bfloat16"
    with pytest.raises(SystemExit):
        bdp.main(["--kinds", "normal,ones"])
    assert "not in" in capsys.readouterr().err



def test_gpu_sampler_reads_nvidia_smi_and_is_inert_without_it(tmp_path, monkeypatch):
    """timing.GpuSampler averages nvidia-smi's clock / power lines after the first quarter, skips partial or N/A
    lines, and gives None without nvidia-smi; bench_train prints the clock beside a GPU row only."""
    import time

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_train
    from timing import GpuSampler

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    with GpuSampler() as smp:
        pass
    assert smp.means() == {"sm_clock_mhz": None, "power_w": None, "smi_samples": 0}
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '900, 100\\n1500, 690\\n1500, 690\\n1480, 700\\n[N/A], 1\\n'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with GpuSampler() as smp:
        time.sleep(0.5)
    m = smp.means()
    assert m["smi_samples"] == 3 and abs(m["sm_clock_mhz"] - 1493.33) < 0.01 and abs(m["power_w"] - 693.33) < 0.01
    assert bench_train._clock(dict(sm_clock_mhz=1487.2, power_w=690.6)) == "  SM 1487 MHz 691 W"
    assert bench_train._clock({"sm_clock_mhz": None}) == ""
