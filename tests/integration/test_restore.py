"""RestoredRun and Checkpointer.restore_params on a tiny trained run: the latest or a given step,
parameters only (bitwise the saved ones), fallback past a corrupt newest checkpoint, and a clear
error for a missing run dir, checkpoint or step."""

import shutil

import jax
import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.run.restore import RestoredRun

STEPS = 10  # checkpoints at 5 and 10 (TINY: every_steps = 5)




@pytest.fixture(scope="module")
def run(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("restore_run")
    res = train(load_config([], list(TINY) + [f"TrainConfig.steps = {STEPS}"]), wd)
    return wd, res


def _flat(tree) -> dict:
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _same(a, b) -> bool:
    a, b = _flat(a), _flat(b)
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _saved_params(wd, step):
    """The params saved at ``step``, read by orbax directly (whole state, saved layout)."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager((wd / "checkpoints").resolve(), item_names=("state", "meta"))
    try:
        return mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state["params"]
    finally:
        mgr.close()


def test_latest_and_explicit_step(run):
    wd, res = run
    latest = RestoredRun(wd)
    assert latest.step == STEPS == res.step
    assert _same(latest.params, _saved_params(wd, STEPS))
    five = RestoredRun(wd, step=5)
    assert five.step == 5 and _same(five.params, _saved_params(wd, 5))
    assert not _same(five.params, latest.params)
    assert _same(RestoredRun(wd, step=STEPS).params, latest.params)
    # what a task needs: the model, the tokenizer, the run's streams (built once per length)
    assert latest.tokenizer.decode(latest.tokenizer.encode("The ")) == "The "
    s = latest.streams()
    assert s is latest.streams(latest.cfg) and s.eval_batch.shape == (latest.cfg.data.eval_windows,
                                                                     latest.cfg.data.seq_len + 1)
    tokens = np.asarray(s.eval_batch[:2, :-1])
    assert latest.model()(tokens).shape == (2, latest.cfg.data.seq_len, latest.cfg.model.vocab_size)
    # the trainer's final eval, reproduced on the restored checkpoint by the shared evaluate()
    row = latest.evaluate(record=False)
    assert (row["loss"], row["bpb"], row["eval_windows"]) == (res.final_eval["loss"], res.final_eval["bpb"],
                                                              res.final_eval["eval_windows"])


def test_restore_params_on_the_checkpointer(run):
    from hybrid_lm.run.checkpoint import Checkpointer, abstract_with_shardings
    from hybrid_lm.step import ModelFns

    wd, _ = run
    ev = RestoredRun(wd)
    ck = Checkpointer(wd / "checkpoints", ev.cfg.checkpoint)
    try:
        abstract = abstract_with_shardings(ModelFns(ev.cfg).abstract_params, ev.p_shard)
        params, step = ck.restore_params(abstract)
        assert step == STEPS and _same(params, ev.params)
        params, step = ck.restore_params(abstract, 5)
        assert step == 5 and _same(params, _saved_params(wd, 5))
        with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 6; saved steps: \[5, 10\]"):
            ck.restore_params(abstract, 6)
    finally:
        ck.close()


def test_a_corrupt_newest_checkpoint_falls_back(run, tmp_path, caplog):
    wd, _ = run
    copy = tmp_path / "run"
    shutil.copytree(wd, copy)
    for f in (copy / "checkpoints" / str(STEPS) / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    ev = RestoredRun(copy)
    assert ev.step == 5 and _same(ev.params, _saved_params(wd, 5))
    assert f"checkpoint at step {STEPS}" in caplog.text and "does not restore" in caplog.text
    with pytest.raises(Exception):  # an explicit step does not fall back
        RestoredRun(copy, step=STEPS)


def test_missing_run_checkpoint_or_step_is_a_clear_error(run, tmp_path):
    wd, _ = run
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 7; saved steps: \\[5, 10\\]"):
        RestoredRun(wd, step=7)
    with pytest.raises(FileNotFoundError, match="not a run directory: no config.json"):
        RestoredRun(tmp_path / "nowhere")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(wd / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError, match="no checkpoints/ directory"):
        RestoredRun(bare)
    (bare / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        RestoredRun(bare)


def test_a_config_json_from_before_mixers_declared_their_fields(run, tmp_path):
    """An old record (a window on the full-attention slot, which does not read it) is read as the
    trainer migrates it, without rewriting the run dir; the checkpoint evaluates the same."""
    import json

    wd, res = run
    copy = tmp_path / "old"
    shutil.copytree(wd, copy)
    d = json.loads((copy / "config.json").read_text())
    d["model"]["full"]["window"] = 32
    old_text = json.dumps(d, indent=2)
    (copy / "config.json").write_text(old_text)
    ev = RestoredRun(copy)
    assert ev.cfg == RestoredRun(wd).cfg and ev.cfg.model.full.window is None
    assert ev.evaluate(record=False)["loss"] == res.final_eval["loss"]
    assert (copy / "config.json").read_text() == old_text
