"""Continued pretraining (`hybrid-lm train --init-from RUN_DIR[@STEP]`): a new run from another run's
parameters, with a fresh optimizer state and schedule, at another seq_len and RoPE theta; its identity
(source run id + concrete step, not the path), provenance, resume, and the one-line errors."""

import json
import shutil

import jax
import numpy as np
import pytest

from conftest import TINY
from hybrid_lm.cli import main
from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.run.restore import RestoredRun
from hybrid_lm.run.directory import load_run_config
from hybrid_lm.train import loop
from hybrid_lm.run.checkpoint import params_fingerprint
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.train.optim import wsd_schedule
from hybrid_lm.train.continued import resolve_init_source


SOURCE = TINY + ["DataConfig.seq_len = 128", "TrainConfig.steps = 4", "CheckpointConfig.every_steps = 2"]
# the continued run: 4x the context and another RoPE theta (no parameter changes shape)
CONTINUED = TINY + ["DataConfig.seq_len = 512", "MixerConfig.rope_theta = 500000.0", "TrainConfig.log_every = 1",
                    "CheckpointConfig.every_steps = 2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory, _data_dir):
    """A pretrained run at seq_len 128 with checkpoints at steps 2 and 4."""
    wd = tmp_path_factory.mktemp("source") / "run"
    loop.train(load_config([], SOURCE), wd)
    return wd


def _train_cli(workdir, init_from, params):
    args = ["train", "base.gin", "--workdir", str(workdir)] + (["--init-from", str(init_from)] if init_from else [])
    for p in params:
        args += ["--gin_param", p]
    return main(args)


def _as_numpy(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


@pytest.fixture
def starts(monkeypatch):
    """What each train() started from: ``(numpy copy of the state, resumed_from)``."""
    seen = []
    original = loop.init_or_restore

    def spy(*args, **kwargs):
        state, resumed_from = original(*args, **kwargs)
        seen.append((_as_numpy(state), resumed_from))
        return state, resumed_from

    monkeypatch.setattr(loop, "init_or_restore", spy)
    return seen


def test_a_continued_run_starts_from_the_source_and_resumes_its_own(source, tmp_path, starts, capsys):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    work = tmp_path / "continued"
    params = CONTINUED + ["TrainConfig.steps = 2"]
    assert _train_cli(work, src, params) == 0  # no @STEP: the newest checkpoint, step 4

    # the first step's parameters are the source's at step 4; the optimizer state and the step are fresh
    (state, resumed_from), = starts
    expected = _as_numpy(RestoredRun(src, step=4).params)
    assert resumed_from is None and int(state["step"]) == 0
    flat, want = jax.tree_util.tree_leaves_with_path(state["params"]), jax.tree.leaves(expected)
    assert len(flat) == len(want) > 5
    for (path, a), b in zip(flat, want):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    opt = jax.tree.leaves(state["opt_state"])
    assert opt and all(not np.any(x) for x in opt)  # zero moments, zero counts

    # identity: the source's run id and the concrete step; provenance holds the source
    src_id = run_id(load_run_config(src))
    record = json.loads((work / "config.json").read_text())
    assert record["train"]["init_from"] == f"{src_id}@4" and record["data"]["seq_len"] == 512
    assert record["model"]["full"]["rope_theta"] == 500000.0
    assert record["run_id"] != run_id(load_config([], params))  # the same config without --init-from
    prov = json.loads((work / "provenance.json").read_text())["init_from"]
    assert prov["source_dir"] == str(src.resolve()) and prov["source_run_id"] == src_id and prov["step"] == 4
    assert prov["requested"] == str(src) and prov["source_steps"] == [2, 4]
    assert prov["params_fingerprint"] == params_fingerprint(RestoredRun(src, step=4).params)
    out = capsys.readouterr().out
    assert f"parameters of {src.resolve()} at step 4" in out and f"(initialised from {src_id}@4)" in out

    # the schedule restarts at step 0 (warm-up) and the optimizer counts only this run's updates
    rows = read_metrics(work / "metrics.jsonl", "train")
    schedule = wsd_schedule(load_config([], params).optim, 2)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["lr"] for r in rows] == pytest.approx([float(schedule(0)), float(schedule(1))])
    assert read_metrics(work / "metrics.jsonl", "summary")[-1]["status"] == "finished"

    # the source saves a newer checkpoint: a rerun of the same command resumes the continued run from
    # its own checkpoint, keeping the step it was initialised from (no re-initialisation)
    shutil.copytree(src / "checkpoints" / "4", src / "checkpoints" / "6")
    assert _train_cli(work, src, CONTINUED + ["TrainConfig.steps = 3"]) == 0
    state, resumed_from = starts[-1]
    assert resumed_from == 2 and int(state["step"]) == 2
    counts = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
              if "count" in jax.tree_util.keystr(p)]
    assert counts and all(int(c) == 2 for c in counts)  # the optimizer counted this run's 2 updates only
    assert json.loads((work / "config.json").read_text())["run_id"] == record["run_id"]
    assert "resumed from step 2" in capsys.readouterr().out

    # moving the source does not change the identity: the moved path resumes the same run ...
    moved = tmp_path / "elsewhere" / "src"
    moved.parent.mkdir()
    src.rename(moved)
    assert _train_cli(work, f"{moved}@4", CONTINUED + ["TrainConfig.steps = 3"]) == 0
    assert starts[-1][1] == 3
    assert json.loads((work / "config.json").read_text())["run_id"] == record["run_id"]
    # ... and once the run has checkpoints of its own, the same command resumes it with the source gone
    shutil.rmtree(moved)
    assert _train_cli(work, src, CONTINUED + ["TrainConfig.steps = 3"]) == 0
    assert starts[-1][1] == 3
    assert json.loads((work / "config.json").read_text())["run_id"] == record["run_id"]


def test_the_identity_is_the_source_run_id_and_a_concrete_step(source, tmp_path):
    src_id = run_id(load_run_config(source))
    assert resolve_init_source(f"{source}@2").identity == f"{src_id}@2"
    assert resolve_init_source(f"{source}@latest").identity == f"{src_id}@4"
    assert resolve_init_source(str(source)).identity == f"{src_id}@4"  # 'latest' is resolved to a number
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert resolve_init_source(f"{copy}@2").identity == f"{src_id}@2"  # the path is not part of it

    def id_of(spec):
        import dataclasses
        cfg = load_config([], CONTINUED)
        if spec is None:
            return run_id(cfg)
        return run_id(dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, init_from=resolve_init_source(spec).identity)))

    ids = {id_of(None), id_of(f"{source}@2"), id_of(f"{source}@4")}
    assert len(ids) == 3 and id_of(f"{copy}@4") == id_of(f"{source}@4")


@pytest.mark.parametrize("case,match", [
    ("missing", "--init-from {src}-nope: no run directory {src}-nope"),
    ("not_a_run", "--init-from {tmp}/empty: {tmp}/empty is not a run directory: no config.json"),
    ("step", "--init-from {src}@3: {src} has no checkpoint at step 3; saved steps: [2, 4]"),
    ("vocab", "--init-from {src}: parameter embed/table is float32[256, 32] in the source and "
              "float32[512, 32] in this config (model fields changed: model.efficient.rope_theta, "
              "model.full.rope_theta, model.vocab_size); a continued run keeps"),
    ("own_checkpoints", "{src} holds checkpoints of its own (steps [2, 4], a run not initialised from it), so "
                        "--init-from {src}@2 ("),
])
def test_errors_are_one_line_before_the_run_dir(source, tmp_path, capsys, case, match):
    (tmp_path / "empty").mkdir()
    spec, workdir, params = {
        "missing": (f"{source}-nope", tmp_path / "new", CONTINUED),
        "not_a_run": (tmp_path / "empty", tmp_path / "new", CONTINUED),
        "step": (f"{source}@3", tmp_path / "new", CONTINUED),
        "vocab": (source, tmp_path / "new", CONTINUED + ["ModelConfig.vocab_size = 512"]),
        "own_checkpoints": (f"{source}@2", source, CONTINUED),  # the source's own dir: it has checkpoints
    }[case]
    rows_before = (source / "metrics.jsonl").read_text()
    assert _train_cli(workdir, spec, params + ["TrainConfig.steps = 2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match.format(src=source.resolve(), tmp=tmp_path) in err, err
    assert case == "own_checkpoints" or not workdir.exists()
    assert (source / "metrics.jsonl").read_text() == rows_before
