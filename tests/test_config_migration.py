"""Run dirs written before mixers declared their fields keep resuming (config.json migrated once)."""

import json
import logging

import pytest

from hybrid_lm.config import config_from_dict
from hybrid_lm.experiment import config_record, load_config, run_id
from hybrid_lm.run.directory import accepted_run_ids, load_run_config, migrate_run_config
from hybrid_lm.train.rundir import prepare_run_dir

# quickstart + kind=moba under the old rules: base/quickstart's window (32) stayed in the record and the run id
OLD_ID = "8daad79730ce"


def _old_config_json(new):
    """config.json as the old code wrote it for ``new``: the unread window recorded, eval_batches present."""
    d = json.loads(json.dumps(config_record(new), default=str))
    d["model"]["efficient"]["window"] = 32
    d["train"]["eval_batches"] = 4
    return d


def test_old_rules_reproduced():
    new = load_config(["quickstart.gin"], ["efficient/MixerConfig.kind = 'moba'"])
    assert new.model.efficient.window is None and run_id(new) != OLD_ID
    assert run_id(config_from_dict(_old_config_json(new))) == OLD_ID  # the old run id hashed every field


def test_old_run_dir_is_migrated_once(tmp_path, caplog):
    new = load_config(["quickstart.gin"], ["efficient/MixerConfig.kind = 'moba'"])
    old = {**_old_config_json(new), "run_id": OLD_ID}
    old_text = json.dumps(old, indent=2)
    (tmp_path / "config.json").write_text(old_text)
    with caplog.at_level(logging.WARNING, logger="hybrid_lm.run.directory"):
        prepare_run_dir(new, tmp_path)  # no "different experiment" error
    lines = [r.getMessage() for r in caplog.records if r.name == "hybrid_lm.run.directory"]
    assert len(lines) == 1 and "model.efficient.window reset" in lines[0] and "train.eval_batches dropped" in lines[0]
    assert f"run id {OLD_ID} -> {run_id(new)}" in lines[0]
    assert (tmp_path / "config.json.bak").read_text() == old_text
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["run_id"] == run_id(new) and stored["previous_run_ids"] == [OLD_ID]
    assert stored["model"]["efficient"]["window"] is None and "eval_batches" not in stored["train"]
    assert accepted_run_ids(tmp_path) == {run_id(new), OLD_ID}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybrid_lm.run.directory"):
        prepare_run_dir(load_config(["quickstart.gin"], ["efficient/MixerConfig.kind = 'moba'",
                                                         "TrainConfig.steps = 999"]), tmp_path)
    assert not caplog.records and accepted_run_ids(tmp_path) == {run_id(new), OLD_ID}


def test_removed_field_alone_keeps_the_run_id(tmp_path):
    cfg = load_config(["quickstart.gin"])
    d = {**json.loads(json.dumps(config_record(cfg), default=str)), "run_id": run_id(cfg)}
    d["train"]["eval_batches"] = 4
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert config_from_dict(d) == cfg
    prepare_run_dir(cfg, tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert "eval_batches" not in stored["train"] and "previous_run_ids" not in stored
    assert accepted_run_ids(tmp_path) == {run_id(cfg)}


@pytest.mark.parametrize("dtype,same_id", [("float32", True), ("bfloat16", False)])
def test_a_config_json_with_param_dtype_reads_and_resumes(tmp_path, dtype, same_id):
    """ModelConfig.param_dtype is gone (read nowhere: parameters are float32). A config.json that holds it
    reads; with float32, the value every run had, the run id is the one it recorded (quickstart's golden id
    in test_config.py); with bfloat16, which had another id for the same computation, the recorded id is
    kept as a previous one, so the run's checkpoints resume."""
    cfg = load_config(["quickstart.gin"])
    d = json.loads(json.dumps(config_record(cfg), default=str))
    d["model"]["param_dtype"] = dtype
    recorded = run_id(cfg) if same_id else "0123456789ab"
    (tmp_path / "config.json").write_text(json.dumps({**d, "run_id": recorded}))
    assert run_id(load_run_config(tmp_path)) == run_id(cfg) == "bc91a0bd964d"
    migrate_run_config(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert "param_dtype" not in stored["model"] and stored["run_id"] == run_id(cfg)
    assert stored["previous_run_ids"] == ([] if same_id else [recorded])
    assert accepted_run_ids(tmp_path) == {run_id(cfg), recorded}


def test_a_current_run_dir_is_not_migrated(tmp_path):
    cfg = load_config(["quickstart.gin", "arch/moba.gin"])
    prepare_run_dir(cfg, tmp_path)
    prepare_run_dir(cfg, tmp_path)
    assert not (tmp_path / "config.json.bak").exists() and accepted_run_ids(tmp_path) == {run_id(cfg)}
    assert accepted_run_ids(tmp_path / "missing") == set()


@pytest.mark.integration
def test_checkpoint_of_an_old_run_resumes_without_force(tiny_params, tmp_path, caplog):
    from hybrid_lm.train.loop import train
    params = tiny_params + ["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.options = "
                            "{'block_size': 4, 'top_k': 2}", "TrainConfig.steps = 5", "TrainConfig.eval_every = 5"]
    new = load_config([], params)
    # train as the old code did: moba with a recorded (unread) window, so checkpoints carry the old run id
    old_cfg = config_from_dict(json.loads(json.dumps({**config_record(new), "model": {
        **config_record(new)["model"], "efficient": {**config_record(new)["model"]["efficient"], "window": 8}}}, default=str)))
    assert run_id(old_cfg) != run_id(new)
    train(old_cfg, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["train"]["eval_batches"] = 4
    (tmp_path / "config.json").write_text(json.dumps(d))
    longer = load_config([], params + ["TrainConfig.steps = 7"])
    with caplog.at_level(logging.WARNING):
        res = train(longer, tmp_path)
    assert res.resumed_from == 5 and res.step == 7
    assert not [r for r in caplog.records if "(forced)" in r.getMessage()]
    assert any("migrated" in r.getMessage() for r in caplog.records)
    assert accepted_run_ids(tmp_path) == {run_id(new), run_id(old_cfg)}
