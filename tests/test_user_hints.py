"""The hints in one-line errors say what to do, in a form that works: a misspelt gin name gets the closest
name, a sweep spec's bad binding is named by its file and key, a layer ratio that does not fit says which
ones do, and the refusal to shorten a run names the eval option that exists."""

import dataclasses
import shlex
from pathlib import Path

import pytest

from hybrid_lm.config import ConfigError, Config, expand_pattern, parse_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("binding,message", [
    ("TrainConfig.stpes = 5",
     "bad gin binding 'TrainConfig.stpes = 5' (binding 1): TrainConfig has no field 'stpes'; did you mean 'steps'?"),
    ("efficient/MixerConfig.windw = 5",
     "bad gin binding 'efficient/MixerConfig.windw = 5' (binding 1): MixerConfig has no field 'windw'; "
     "did you mean 'window'?"),
    ("TrainConfg.steps = 5",
     "bad gin binding 'TrainConfg.steps = 5' (binding 1): no configurable named 'TrainConfg'; "
     "did you mean 'TrainConfig'?"),
    ("trainconfig.steps = 5",
     "bad gin binding 'trainconfig.steps = 5' (binding 1): no configurable named 'trainconfig'; "
     "did you mean 'TrainConfig'?"),
])
def test_a_misspelt_gin_name_gets_the_closest_one(binding, message):
    with pytest.raises(ConfigError) as e:
        parse_config(["quickstart.gin"], [binding])
    assert str(e.value) == message
    assert e.value.binding == 0 and e.value.binding_text == binding


def test_an_unknown_gin_name_with_nothing_close_lists_the_names():
    with pytest.raises(ConfigError, match=r"TrainConfig has no field 'zzzz'; its fields: steps, global_batch, "):
        parse_config([], ["TrainConfig.steps = 3", "TrainConfig.zzzz = 3"])
    with pytest.raises(ConfigError) as e:
        parse_config([], ["Foo.bar = 3"])
    assert str(e.value).endswith("no configurable named 'Foo'; the configurables: MixerConfig, ModelConfig, "
                                 "DataConfig, OptimConfig, TrainConfig, CheckpointConfig, MeshConfig")


def test_the_binding_at_fault_is_found_among_several(tmp_path):
    bindings = ["TrainConfig.steps = 3", "ModelConfig.d_model = 64", "ModelConfig.n_layres = 2"]
    with pytest.raises(ConfigError) as e:
        parse_config([], bindings)
    assert e.value.binding == 2 and "(binding 3)" in str(e.value) and "did you mean 'n_layers'?" in str(e.value)
    with pytest.raises(ConfigError) as e:  # an unquoted string: the binding is found from gin's line
        parse_config([], ["TrainConfig.steps = 3", "DataConfig.source = tokens"])
    assert e.value.binding == 1 and e.value.reason.startswith("cannot read the value tokens; strings need quotes")
    gin = tmp_path / "bad.gin"
    gin.write_text("TrainConfig.steps = 3\nTrainConfig.stpes = 5\n")
    with pytest.raises(ConfigError) as e:  # in a gin file: the file and line, no binding index
        parse_config([str(gin)], [])
    assert str(e.value) == (f"bad gin binding 'TrainConfig.stpes = 5' ({gin}, line 2): TrainConfig has no field "
                            "'stpes'; did you mean 'steps'?")
    assert e.value.binding is None


def test_a_sweep_specs_bad_binding_is_named_by_file_and_key(tmp_path):
    from hybrid_lm.scaling.sweep import SweepError, expand, load_spec

    text = (REPO / "configs/sweeps/tiny_cpu.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('"ModelConfig.n_layers = 2"', '"ModelConfig.n_layres = 2"', 1))
    with pytest.raises(SweepError) as e:
        expand(load_spec(bad), root=tmp_path / "root")
    assert str(e.value) == (f"sweep tiny_cpu: {bad}, scales.t1.params, item 2 'ModelConfig.n_layres = 2': "
                            "ModelConfig has no field 'n_layres'; did you mean 'n_layers'?")
    bad.write_text(text.replace('"efficient/MixerConfig.kind = \'swa\'"', '"efficient/MixerConfig.knd = \'swa\'"'))
    with pytest.raises(SweepError, match=r"bad\.toml, archs\.swa8\.params, item 1 \"efficient/MixerConfig\.knd = "
                                         r"'swa'\": MixerConfig has no field 'knd'; did you mean 'kind'\?$"):
        expand(load_spec(bad), root=tmp_path / "root")
    bad.write_text(text.replace('"DataConfig.seq_len = 32"', '"DataConfig.seq_len = 32", "OptimConfig.lrr = 1"'))
    with pytest.raises(SweepError, match=r"bad\.toml, params, item 7 'OptimConfig\.lrr = 1': .*did you mean 'lr'"):
        expand(load_spec(bad), root=tmp_path / "root")
    with pytest.raises(SweepError, match=r"^sweep tiny_cpu: --gin_param 'TrainConfig.sed = 1': TrainConfig has no "
                                         r"field 'sed'; did you mean 'seed'\?$"):
        expand(load_spec(REPO / "configs/sweeps/tiny_cpu.toml"), root=tmp_path / "root",
               extra_params=["TrainConfig.sed = 1"])


def test_a_layer_ratio_that_does_not_fit_says_which_do():
    with pytest.raises(ConfigError) as e:
        expand_pattern("1:2", 4)
    assert str(e.value) == ("layer_pattern '1:2': a ratio a:b repeats a group of a full then b efficient layers, "
                            "and a + b = 3 does not divide n_layers=4; ratios that fit 4 layers: '1:1', '1:3', '3:1'")
    with pytest.raises(ConfigError, match=r"ratios that fit 10 layers: '1:1', '1:4', '2:3', '3:2', '4:1', '1:9'$"):
        expand_pattern("1:3", 10)
    with pytest.raises(ConfigError, match=r"^layer_pattern 'FEE' has length 3, which does not divide n_layers=4: a "
                                         r"tiled string's length must divide n_layers \(or give a ratio such as "
                                         r"'1:1' or '1:3'\)$"):
        expand_pattern("FEE", 4)
    # what worked keeps working, with the same layers and run ids
    assert expand_pattern("1:1", 4) == list("FEFE") and expand_pattern("1:3", 8) == list("FEEEFEEE")
    assert expand_pattern("1:2", 6) == list("FEEFEE") and expand_pattern("FEEE", 4) == list("FEEE")


def test_layer_patterns_keep_their_run_ids():
    from hybrid_lm.experiment import run_id

    # the ids of these configs as published before the ratio message changed
    ids = {p: run_id(parse_config(["quickstart.gin"], [f"ModelConfig.layer_pattern = '{p}'",
                                                      "ModelConfig.n_layers = 4"]))
           for p in ("1:1", "1:3", "FE", "FEEE")}
    assert len(set(ids.values())) == 4
    assert ids["1:1"] == run_id(parse_config(["quickstart.gin"], ["ModelConfig.n_layers = 4"]))


def test_refusing_to_shorten_a_run_names_the_eval_option_that_exists(tmp_path, monkeypatch):
    import argparse

    from hybrid_lm.errors import WorkdirError
    from hybrid_lm.eval.cli import add_eval_commands
    from hybrid_lm.train import rundir
    from hybrid_lm.train.rundir import check_run_length

    monkeypatch.setattr(rundir, "checkpoint_steps", lambda workdir, missing_ok=False: [5, 10])
    cfg = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, steps=7))
    with pytest.raises(WorkdirError) as e:
        check_run_length(tmp_path, 10, cfg)
    hint = str(e.value).split("`")[1]
    assert hint == f"hybrid-lm eval {tmp_path} --step STEP"
    parser = argparse.ArgumentParser(prog="hybrid-lm")
    add_eval_commands(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(shlex.split(hint.replace("STEP", "5"))[1:])  # the hint parses as written
    assert args.cmd == "eval" and args.step == 5
