"""Sweeps: expansion and deterministic run ids, dry-run numbers, parameter matching, clear errors, SLURM
scripts, and a CPU end-to-end run (launch -> collect -> fit -> report; idempotent; partial runs resume;
a WSD branch equals the independent run bitwise; the one-job-per-GPU pool)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_lm.scaling import launch as L
from hybrid_lm.experiment import run_id
from hybrid_lm.run.directory import checkpoint_steps
from hybrid_lm.scaling.sweep import (
    MFU_H200_MEASURED,
    PEAK_FLOPS,
    SweepError,
    decay_start,
    expand,
    format_plan,
    load_spec,
    spec_from_dict,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "sweeps" / "tiny_cpu.toml"
RETHINKING = REPO / "configs" / "sweeps" / "rethinking.toml"
RELEASED_N = {"S1": 14_999_424, "S2": 31_470_080, "S3": 64_901_760, "S4": 104_427_264}


def _spec_dict(path):
    import tomllib
    return tomllib.loads(Path(path).read_text())


# ----------------------------------------------------------------------------- expansion

def test_expansion_is_deterministic_and_budgets_are_exact():
    spec = load_spec(TINY)
    a, b = expand(spec, root="/tmp/x"), expand(load_spec(TINY), root="/tmp/y")
    assert [j.name for j in a.jobs] == [j.name for j in b.jobs]
    assert len(a.jobs) == 2 * 2 * 3  # 2 scales x 2 archs x (1 stable + 2 branches)
    assert len({j.name for j in a.jobs}) == len(a.jobs)
    for j in a.jobs:
        assert j.tokens_per_step == 4 * 32
        if j.kind == "branch":
            assert j.steps == max(1, round(j.budget * j.N / 128)) and j.D == j.steps * 128
            assert j.branch_from["step"] == decay_start(j.steps, 0.25) == j.steps - round(0.25 * j.steps)
            st = a.job(j.branch_from["run"])
            assert st.kind == "stable" and j.name in st.branches and j.branch_from["step"] in st.branch_points
            assert st.steps == max(st.branch_points) and "OptimConfig.decay_fraction = 0.0" in st.gin_params
            assert j.trained_flops == pytest.approx((j.steps - j.branch_from["step"]) * 128 * j.flops_per_token)
    n = {j.scale: j.N for j in a.jobs}
    assert n == {"t1": 4688, "t2": 10488}
    # any experiment-defining change gives new ids; a change outside the run id (logging) does not
    raw = _spec_dict(TINY)
    raw["params"] = raw["params"] + ["OptimConfig.lr = 1e-3"]
    c = expand(spec_from_dict(raw), root="/tmp/z")
    assert not {j.name for j in c.jobs} & {j.name for j in a.jobs}
    raw = _spec_dict(TINY)
    raw["params"] = raw["params"] + ["TrainConfig.log_every = 3"]
    assert [j.name for j in expand(spec_from_dict(raw), root="/tmp/z").jobs] == [j.name for j in a.jobs]
    # --only adds the stable run a selected branch needs
    sel = L.select_jobs(a.jobs, r"t2-swa8-dn0\.5")
    assert [j.kind for j in sel] == ["stable", "branch"]
    with pytest.raises(SweepError, match="matches no job"):
        L.select_jobs(a.jobs, "nothing-like-this")


def test_rethinking_dry_run_numbers():
    plan = expand(load_spec(RETHINKING), root="/tmp/rethinking")
    jobs = plan.jobs
    assert len(jobs) == 4 * 9 * 7  # 36 stable + 216 budget runs
    branches = [j for j in jobs if j.kind == "branch"]
    assert len(branches) == 216 and {j.budget for j in branches} == {100, 200, 300, 400, 500, 1000}
    assert {j.arch for j in jobs} == {"full", "swa128", "swa512", "swa2048", "lightning", "mamba2", "gdn", "sa128",
                                      "sa_swa128"}
    for j in jobs:
        if j.arch in ("full", "swa128", "swa512", "swa2048", "sa128"):
            assert j.N == RELEASED_N[j.scale], (j.name, j.N)
        assert j.mfu == MFU_H200_MEASURED
        assert j.gpu_hours == pytest.approx(j.trained_flops / (0.385 * PEAK_FLOPS) / 3600)
        assert j.train_flops == pytest.approx(j.D * j.flops_per_token)
    s1 = next(j for j in branches if j.scale == "S1" and j.arch == "full" and j.budget == 100)
    assert s1.tokens_per_step == 32 * 16384 and abs(s1.D - 100 * s1.N) <= s1.tokens_per_step / 2
    # full attention at 16K costs more FLOPs per token than a 1:1 SWA-128 hybrid of the same N
    swa = next(j for j in branches if j.scale == "S1" and j.arch == "swa128" and j.budget == 100)
    assert s1.flops_per_token > swa.flops_per_token > 6 * s1.N
    s = plan.summary
    # saving of branching with a 20% decay: 1 - (0.8 max + 0.2 sum) / sum over {100..1000}
    expect = 1 - (0.8 * 1000 + 0.2 * 2500) / 2500
    assert s["branching_saving"] == pytest.approx(expect, abs=0.01)
    assert s["planned_flops"] == pytest.approx(sum(j.trained_flops for j in jobs))
    text = format_plan(plan)
    assert "saving" in text and s1.name in text and "GPU-h" in text
    # independent runs: no stable runs, the same budget runs, and the saving is still shown
    ind = expand(dataclasses.replace(load_spec(RETHINKING), branch=False), root="/tmp/rethinking")
    assert {j.kind for j in ind.jobs} == {"independent"} and len(ind.jobs) == 216
    assert ind.summary["planned_flops"] == pytest.approx(ind.summary["independent_flops"])
    assert ind.summary["branching_saving"] == pytest.approx(s["branching_saving"], abs=1e-3)


def test_dry_run_cli():
    r = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "sweep", str(TINY), "--dry-run"], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    plan = expand(load_spec(TINY), root="/tmp/x")
    assert f"saving {plan.summary['branching_saving']:.1%}" in r.stdout
    for j in plan.jobs:
        assert j.name in r.stdout


def test_parameter_matching_equalises_N():
    raw = _spec_dict(RETHINKING)
    raw["scales"] = {k: raw["scales"][k] for k in ("S1", "S2")}
    raw["archs"] = {k: raw["archs"][k] for k in ("full", "swa128", "mamba2", "gdn", "lightning")}
    raw["param_match"] = {"enabled": True, "reference": "full", "d_ff_multiple": 1}
    plan = expand(spec_from_dict(raw), root="/tmp/pm")
    for j in plan.jobs:
        ref = RELEASED_N[j.scale]
        pm = j.param_match
        if j.arch == "full":
            assert pm is None and j.N == ref
            continue
        slope = 3 * {"S1": 384, "S2": 512}[j.scale] * {"S1": 10, "S2": 12}[j.scale]  # SwiGLU params per unit d_ff
        assert abs(j.N - ref) <= slope / 2, (j.name, j.N, ref)
        assert pm["target_N"] == ref and pm["N_after"] == j.N and abs(pm["rel_diff"]) < 1e-3
        if j.arch == "swa128":
            assert j.d_ff == pm["d_ff_before"]  # same N already
        else:
            assert j.d_ff < pm["d_ff_before"] and pm["N_before"] > ref  # these mixers are larger than attention
            assert f"ModelConfig.d_ff = {j.d_ff}" in j.gin_params
    # a mixer larger than the whole reference layer cannot be matched: a clear error
    raw = _spec_dict(TINY)
    raw["archs"]["mamba2"] = {"gin": ["arch/mamba2.gin"], "params": [
        "efficient/MixerConfig.options = {'d_state': 128, 'expand': 2, 'head_dim': 8, 'n_groups': 1}"]}
    raw["param_match"] = {"enabled": True, "reference": "full"}
    raw["scales"] = {"t1": raw["scales"]["t1"]}
    with pytest.raises(SweepError, match="parameter matching"):
        expand(spec_from_dict(raw), root="/tmp/pm2")


def test_clear_errors():
    raw = _spec_dict(TINY)
    raw["archs"]["moba_big"] = {"gin": ["arch/no_such_mixer.gin"]}
    with pytest.raises(SweepError, match=r"arch 'moba_big' needs gin file 'arch/no_such_mixer.gin'"):
        expand(spec_from_dict(raw), root="/tmp/e")
    raw = _spec_dict(TINY)
    raw["budget"] = [1]
    with pytest.raises(SweepError, match=r"unknown key\(s\) \['budget'\]"):
        spec_from_dict(raw)
    raw = _spec_dict(TINY)
    raw["archs"]["bad"] = {"params": ["efficient/MixerConfig.kind = 'nope'"]}
    with pytest.raises(SweepError, match="arch 'bad'.*unknown mixer kind"):
        expand(spec_from_dict(raw), root="/tmp/e")
    raw = _spec_dict(TINY)
    raw["archs"]["mamba2"] = {"gin": ["arch/mamba2.gin"]}  # head_dim 64 does not fit d_model 16
    with pytest.raises(SweepError, match="arch 'mamba2'.*head_dim=64 does not divide"):
        expand(spec_from_dict(raw), root="/tmp/e")
    raw = _spec_dict(TINY)
    raw["param_match"] = {"enabled": True, "reference": "missing"}
    with pytest.raises(SweepError, match="param_match.reference"):
        spec_from_dict(raw)


def test_slurm_scripts_and_submission(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "sbatch_calls.txt"
    (fake / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho $((RANDOM + 1000))\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    plan = expand(load_spec(TINY), root=tmp_path / "root")
    out = L.write_slurm(plan, submit=True)
    assert out["phase1"] == 4 and out["phase2"] == 8 and out["submitted"] is True
    p1 = (tmp_path / "root" / "slurm" / "phase1.sbatch").read_text()
    assert "#SBATCH --array=0-3" in p1 and "#SBATCH --signal=B:USR1@120" in p1 and "--requeue" in p1
    assert "-m hybrid_lm.scaling.launch --root" in p1 and "source .venv/bin/activate" in p1
    names = (tmp_path / "root" / "slurm" / "phase1.txt").read_text().split()
    assert all("-stable-" in n for n in names)
    lines = calls.read_text().splitlines()
    assert lines[0].endswith("phase1.sbatch")  # then one branch array per stable run, after that run's task
    p1 = lines[1].split("afterany:")[1].split("_")[0]
    assert [x.split("--parsable ")[1] for x in lines[1:]] == [
        f"--dependency=afterany:{p1}_{k} branches-{k}.sbatch" for k in range(4)]
    assert json.loads((tmp_path / "root" / "sweep.json").read_text())["name"] == "tiny_cpu"


def test_a_running_job_is_locked(tmp_path):
    plan = expand(load_spec(TINY), root=tmp_path)
    job = plan.jobs[1]
    with L.job_lock(tmp_path / job.name):
        with pytest.raises(SweepError, match="being run by another process"):
            L.run_job(tmp_path, job)
    assert L.job_state(tmp_path, job) == "new"
    with pytest.raises(SweepError, match="is not seeded"):  # unlocked now; a branch still needs its seed
        L.run_job(tmp_path, job)


def test_launcher_applies_the_microbatch_rule(tmp_path, monkeypatch):
    """Each run's TrainConfig.microbatches comes from the measured table for its global batch on the
    run's mesh, is recorded in sweep_run.json, and leaves the run id (the directory) unchanged."""
    from hybrid_lm.train import microbatch as mb

    table = tmp_path / "mb.json"
    table.write_text(json.dumps({"best": {"t1/swa/32": 2}}))  # tiny_cpu: global batch 4, seq_len 32
    monkeypatch.setattr(mb, "TABLE", table)
    monkeypatch.setitem(mb.SCALES, (16, 2), "t1")
    plan = expand(load_spec(TINY), root=tmp_path)
    t1 = next(j for j in plan.jobs if j.scale == "t1" and j.arch == "swa8" and j.kind == "branch")
    cfg = L._load(t1)
    assert cfg.train.microbatches == 2 and run_id(cfg) == t1.config_run_id
    assert L.microbatch_plan(cfg)[0] is cfg  # already set: kept
    L._write_run_meta(tmp_path, t1)
    meta = json.loads((tmp_path / t1.name / L.RUN_META).read_text())
    assert meta["microbatches"] == 2 and "measured best 2 x 32 tokens per device (t1/swa" in meta["microbatch_reason"]
    t2 = next(j for j in plan.jobs if j.scale == "t2" and j.arch == "swa8")  # not in the table
    assert L._load(t2).train.microbatches == 1
    explicit = dataclasses.replace(t1, gin_params=t1.gin_params + ["TrainConfig.microbatches = 4"])
    assert L._load(explicit).train.microbatches == 4  # a configured value wins


def test_progress_bars_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    """`sweep --launch local > log 2>&1` gets no tqdm bars (nor does `data prepare`): a bar is drawn only
    when stderr is a terminal; the log gets a plain line naming each job as it starts and ends."""
    import io

    from hybrid_lm.data.prepare import prepare
    from hybrid_lm.data.sources import SourceSpec

    monkeypatch.setattr(L, "run_job", lambda root, job, jobs=None: {"status": "done", "job": job.name})
    plan = expand(load_spec(TINY), root=tmp_path / "r", progress=True)
    stable, *branches = L.select_jobs(plan.jobs, "t1-swa8")
    assert L.launch_local(plan, only="t1-swa8", progress=True)["jobs"] == 3
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [f"job 1/3 {stable.name}: started", lines[1]], lines
    assert re.fullmatch(rf"job 1/3 {stable.name}: done in \d+\.\d s", lines[1]), lines
    # the fake run_job seeds nothing: the branches cannot start, and the log says so
    assert lines[2:] == [f"job {b.name}: not started (its stable run {stable.name} did not seed it)"
                         for b in branches], lines
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a few words"}) + "\n")
    prepare(SourceSpec("text", paths=(str(tmp_path / "docs.jsonl"),)), tmp_path / "store", progress=True)
    assert capsys.readouterr().err == ""

    def fail(root, job, jobs=None):
        raise SweepError("boom")

    monkeypatch.setattr(L, "run_job", fail)
    L.launch_local(plan, only="t1-swa8", progress=True)
    out, err = capsys.readouterr()
    assert err.splitlines()[:2] == [f"job 1/3 {stable.name}: started", f"job 1/3 {stable.name}: failed "
                                    f"(SweepError: boom), log: {tmp_path / 'r' / stable.name / 'sweep_error.txt'}"]
    assert out == ""  # said once, in the log's line

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(L, "run_job", lambda root, job, jobs=None: {"status": "done", "job": job.name})
    monkeypatch.setattr(sys, "stderr", Terminal())
    L.launch_local(plan, only="t1-swa8", progress=True)
    assert "sweep tiny_cpu: 100%" in sys.stderr.getvalue() and "job 1/3" not in sys.stderr.getvalue()


def _text_store(path: Path, n_docs: int, words: int) -> Path:
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec

    path.mkdir(parents=True)
    (path / "docs.jsonl").write_text("".join(json.dumps({"text": "word " * words}) + "\n" for _ in range(n_docs)))
    prepare(SourceSpec("text", paths=(str(path / "docs.jsonl"),)), path / "store", PrepareSettings(), progress=False)
    return path / "store"


def test_dry_run_states_the_passes_over_the_training_data(tmp_path):
    """Each job's passes = D / the training split's tokens: the embedded corpus counted from its essays
    (equal to a prepared store's manifest), a prepared store's manifest, a mixture's most repeated store;
    '?' when the store is not prepared; one warning line above PASSES_WARN."""
    from hybrid_lm.data.corpus import embedded_byte_train_tokens
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec
    from hybrid_lm.scaling.sweep import PASSES_WARN

    embedded = prepare(SourceSpec(kind="embedded"), tmp_path / "embedded", PrepareSettings(), progress=False)
    n_embedded = embedded_byte_train_tokens()
    assert n_embedded == embedded.manifest["splits"]["train"]["tokens"]
    plan = expand(load_spec(TINY), root=tmp_path / "r")
    for j in plan.jobs:
        assert j.train_data["stores"][0][2] == n_embedded and j.passes == pytest.approx(j.D / n_embedded)
    text = format_plan(plan)
    assert f"{n_embedded:,} training-split tokens" in text and "passes" in text and "warning" not in text

    raw = _spec_dict(TINY)
    raw["budgets"] = [2000]  # t2: 2000 x 10,488 tokens, ~36 passes over the embedded corpus
    plan = expand(spec_from_dict(raw), root=tmp_path / "r")
    worst = max(plan.jobs, key=lambda j: j.passes)
    assert worst.passes > PASSES_WARN and worst.scale == "t2"
    warnings = [x for x in format_plan(plan).splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and f"{sum(j.passes > PASSES_WARN for j in plan.jobs)} of {len(plan.jobs)} jobs" \
        in warnings[0] and worst.name in warnings[0] and "DataConfig.path" in warnings[0]

    store = _text_store(tmp_path / "a", 30, 40)
    small = _text_store(tmp_path / "b", 20, 10)
    tokens = {s: json.loads((s / "manifest.json").read_text())["splits"]["train"]["tokens"] for s in (store, small)}
    raw = _spec_dict(TINY)
    raw["params"] += ["DataConfig.source = 'tokens'", f"DataConfig.path = '{store}'"]
    for j in expand(spec_from_dict(raw), root=tmp_path / "r").jobs:
        assert j.passes == pytest.approx(j.D / tokens[store])
    raw = _spec_dict(TINY)
    raw["params"] += [f"DataConfig.mixture = (('{store}', 3.0), ('{small}', 1.0))"]
    for j in expand(spec_from_dict(raw), root=tmp_path / "r").jobs:
        assert j.passes == pytest.approx(max(0.75 * j.D / tokens[store], 0.25 * j.D / tokens[small]))
    raw = _spec_dict(TINY)
    raw["params"] += ["DataConfig.source = 'tokens'", f"DataConfig.path = '{tmp_path / 'not_prepared'}'"]
    plan = expand(spec_from_dict(raw), root=tmp_path / "r")
    assert all(j.passes is None for j in plan.jobs)
    text = format_plan(plan)
    assert "size unknown" in text and "warning" not in text


def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path):
    """`hybrid-lm sweep SPEC --dry-run | head -1`: output into a closed pipe ends the command with status
    141 (128 + SIGPIPE, as `cat` ends) and nothing on stderr, not `error: [Errno 32] Broken pipe`."""
    r, w = os.pipe()
    os.close(r)  # the reader left before the first line
    try:
        p = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "sweep", str(TINY), "--dry-run", "--root",
                            str(tmp_path / "r")], stdout=w, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")


def test_launch_states_the_passes_first(tmp_path, monkeypatch, capsys):
    """`sweep --launch` prints each selected job's D and passes, and the warning, before it launches."""
    from hybrid_lm.cli import main

    raw = _spec_dict(TINY)
    raw["budgets"] = [2000]
    spec = tmp_path / "big.json"
    spec.write_text(json.dumps(raw))
    launched = []

    def fake_launch(plan, gpus=None, only=None):
        launched.append(capsys.readouterr().out)
        return {"jobs": 0, "skipped": 0, "launched": 0, "done": [], "failed": {}, "blocked": [], "preempted": None}

    monkeypatch.setattr(L, "launch_local", fake_launch)
    assert main(["sweep", str(spec), "--launch", "local", "--only", "t1-swa8", "--root", str(tmp_path / "r")]) == 0
    plan = expand(spec_from_dict(raw), root=tmp_path / "r")
    sel = L.select_jobs(plan.jobs, "t1-swa8")
    (out,) = launched
    for j in sel:
        assert re.search(rf"^{re.escape(j.name)} .* {j.passes:.3g}$", out, re.M), out
    assert sum(x.startswith("warning:") for x in out.splitlines()) == 1 and f"of {len(sel)} jobs" in out


# ----------------------------------------------------------------------------- end to end on the CPU

def _cli(args, env, timeout=900):
    r = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", *args], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=timeout)
    return r


def _final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "sweep_done.json").read_text())["final_eval"]["loss"]


def _snapshot(root: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and "slurm" not in p.parts}


def test_tiny_sweep_end_to_end(tmp_path, tiny_sweep):
    import shutil

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the test run's compilation cache (conftest.py)
    root = tmp_path / "tiny"
    launch = ["sweep", str(TINY), "--only", "swa8", "--launch", "local", "--root", str(root)]

    # 1. launch: 2 stable runs (trained in segments to each branch point) and 4 branches; the same
    #    command as `launch`, run once per test run for this test and test_scaling_collect.py
    #    (conftest.py tiny_sweep); this test works on its own copy of the sweep root
    shared, stdout = tiny_sweep
    assert "6 jobs, 0 already done, 6 launched, 6 finished now, 0 failed" in stdout
    shutil.copytree(shared, root)
    man = json.loads((root / "sweep.json").read_text())
    jobs = {j["name"]: j for j in man["jobs"] if j["arch"] == "swa8"}
    assert len(jobs) == 6
    for name, j in jobs.items():
        d = root / name
        assert (d / "sweep_done.json").exists() and (d / "sweep_run.json").exists()
        if j["kind"] == "branch":
            assert json.loads((d / "branch.json").read_text())["step"] == j["branch_from"]["step"]
            from hybrid_lm.run.metrics import read_metrics
            rows = read_metrics(d / "metrics.jsonl")
            copied = [x for x in rows if x.get("copied_from") == j["branch_from"]["run"]]
            assert copied and max(x["step"] for x in copied) == j["branch_from"]["step"]
            assert read_metrics(d / "metrics.jsonl", "eval")[-1]["step"] == j["steps"]
            assert json.loads((d / "sweep_done.json").read_text())["resumed_from"] == j["branch_from"]["step"]
        else:
            assert sorted(json.loads((d / "sweep_done.json").read_text())["seeded"]) == sorted(j["branches"])

    # 2. re-running launches nothing and touches no file
    before = _snapshot(root)
    r = _cli(launch, env)
    assert r.returncode == 0 and "6 jobs, 6 already done, 0 launched" in r.stdout, r.stdout[-2000:]
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if k != str(root / "sweep.json")} == \
        {k: v for k, v in before.items() if k != str(root / "sweep.json")}

    # 3. a WSD branch is the same computation as an independent run of the same length (bitwise)
    #    (t1 at D/N 0.5: its stable run trained two segments, 0-7 and 7-14, then the branch decayed 14-18)
    t1 = next(n for n, j in jobs.items() if j["scale"] == "t1" and j["budget"] == 0.5)
    r = _cli(["sweep", str(TINY), "--only", r"t1-swa8-dn0\.5", "--no-branch", "--launch", "local",
              "--root", str(tmp_path / "independent")], env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (ind,) = [p for p in (tmp_path / "independent").iterdir() if (p / "sweep_done.json").exists()]
    assert json.loads((ind / "sweep_run.json").read_text())["steps"] == jobs[t1]["steps"]
    assert _final_loss(ind) == _final_loss(root / t1)
    big = next(n for n, j in jobs.items() if j["scale"] == "t2" and j["budget"] == 0.5)

    # 4. a partial run resumes: drop the newest checkpoint and the done marker of a branch; and a deleted
    #    branch is seeded again by its (finished) stable run, which still holds the checkpoint at 14
    d = root / big
    loss, t1_loss = _final_loss(d), _final_loss(root / t1)
    ckpts = checkpoint_steps(d)
    assert ckpts[-1] == jobs[big]["steps"] and len(ckpts) == 2
    shutil.rmtree(d / "checkpoints" / str(ckpts[-1]))
    (d / "sweep_done.json").unlink()
    shutil.rmtree(root / t1)
    r = _cli(launch, env)
    assert r.returncode == 0 and "6 jobs, 3 already done, 3 launched, 3 finished now" in r.stdout, r.stdout[-3000:]
    done = json.loads((d / "sweep_done.json").read_text())
    assert done["resumed_from"] == ckpts[-2] and done["final_eval"]["loss"] == loss
    assert _final_loss(root / t1) == t1_loss

    # 5. collect: one table that fit reads directly
    r = _cli(["collect", str(root), "--intermediate"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    from hybrid_lm.scaling.table import read_table
    header = (root / "table.csv").read_text().splitlines()[0].split(",")
    assert header[:5] == ["run_id", "arch", "scale", "N", "D"] and "loss" in header and "loss_at_50" in header
    rows = read_table(root / "table.csv")
    final = [x for x in rows if x["final"] == 1]
    assert len(final) == 4 and {x["run_id"] for x in final} == {n for n, j in jobs.items() if j["kind"] == "branch"}
    for x in final:
        j = jobs[x["run_id"]]
        assert x["D"] == j["steps"] * 128 and x["N"] == j["N"] and x["step"] == j["steps"]
        assert x["loss_stable"] > x["loss"] > 0 and x["C"] == pytest.approx(j["flops_per_token"] * x["D"])
    assert len(rows) > 4 and all(x["D"] > 0 for x in rows)
    assert len(read_table(root / "table.jsonl")) == len(rows)
    from hybrid_lm.scaling.collect import collect
    with_stable, _ = collect([root], include_stable=True, progress=False)
    stable_rows = [x for x in with_stable if x["kind"] == "stable"]
    assert len(stable_rows) == 2 and all(x["final"] == 0 and x["phase"] == "stable" for x in stable_rows)

    # 6. fit (all rows, bootstrap by run) and 7. report
    r = _cli(["fit", str(root / "table.csv"), "--rows", "all", "--form", "no-E", "--bootstrap", "30",
              "--out", str(root / "fit")], env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((root / "fit" / "fit.json").read_text())
    e = doc["fits"]["swa8"]
    # --rows all: the 4 decayed rows only (stable-phase rows never count, nor twice)
    assert e["n_points"] == 4 and e["n_runs"] == 4 and e["ci"]["resample"] == "run"
    assert doc["dropped_rows"]["not_converged"] == len(rows) - 4 and e["valid"] is False
    assert "fewer than 2 distinct N" in e["holdout"]["skipped"]
    assert (root / "fit" / "fit.png").exists() and (root / "fit" / "frontier.png").exists()
    r = _cli(["report", str(root / "fit"), "--sweep", str(root)], env)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = (root / "fit" / "report.md").read_text()
    assert "## Sweep `tiny_cpu`" in rep and "| t2 | 2/2 |" in rep and "| parameter | swa8 |" in rep

    # 8. one job per "GPU" in subprocesses (CUDA_VISIBLE_DEVICES; the CPU ignores it): branches start once
    #    their stable run seeded them, and the runs equal the in-process ones
    pool = tmp_path / "pool"
    r = _cli(["sweep", str(TINY), "--only", "t1-swa8", "--launch", "local", "--gpus", "0,1", "--root", str(pool)],
             env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "3 jobs, 0 already done, 3 launched, 3 finished now" in r.stdout
    for n in (n for n, j in jobs.items() if j["scale"] == "t1"):  # stderr is a pipe: a plain line per job
        assert re.search(rf"^job [1-3]/3 {re.escape(n)}: started on GPU [01]$", r.stderr, re.M), r.stderr[-3000:]
        assert re.search(rf"^job [1-3]/3 {re.escape(n)}: done in [\d.]+ s$", r.stderr, re.M), r.stderr[-3000:]
    for n, j in jobs.items():
        if j["scale"] == "t1" and j["kind"] == "branch":
            assert _final_loss(pool / n) == _final_loss(root / n)
            assert (pool / "logs" / f"{n}.log").exists()

    # 9. a deleted branch whose seed checkpoint was rotated away by the stable run: a clear error, nothing trained
    st = next(n for n, j in jobs.items() if j["kind"] == "stable" and j["scale"] == "t1")
    small = next(n for n, j in jobs.items() if j["scale"] == "t1" and j["budget"] == 0.25)
    shutil.rmtree(root / small)
    from hybrid_lm.scaling.sweep import manifest_jobs
    mj = {j.name: j for j in manifest_jobs(root)}
    with pytest.raises(SweepError, match=r"is past step 7 .* has no checkpoint there"):
        L.run_job(root, mj[st], mj)
    assert not (root / small / "checkpoints").exists()
