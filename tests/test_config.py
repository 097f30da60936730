import json

import pytest

from hybrid_lm.config import config_from_dict, diff_experiments, expand_pattern, load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.train.rundir import prepare_run_dir


@pytest.mark.parametrize("pattern,n,expected", [
    ("FE", 4, "FEFE"), ("FEEE", 8, "FEEEFEEE"), ("1:1", 6, "FEFEFE"), ("1:3", 8, "FEEEFEEE"), ("F", 3, "FFF"),
    ("fe", 2, "FE"),
])
def test_expand_pattern(pattern, n, expected):
    assert "".join(expand_pattern(pattern, n)) == expected


@pytest.mark.parametrize("params,match", [
    (["ModelConfig.no_such_field = 3"], "doesn't have a parameter named 'no_such_field'"),
    (["NoSuchConfig.x = 3"], "No configurable matching 'NoSuchConfig'"),
    (["efficient/MixerConfig.window = 0"], "window must be >= 1"),
    (["full/MixerConfig.window = -4"], "window must be >= 1"),
    (["ModelConfig.d_model = 100", "ModelConfig.n_heads = 3"], "does not divide d_model"),
    (["ModelConfig.n_layers = 10", "ModelConfig.layer_pattern = 'FEE'"], "does not divide n_layers=10"),
    (["ModelConfig.layer_pattern = 'FXE'"], "use letters F"),
    (["ModelConfig.vocab_size = 100"], "smaller than the 'byte' tokenizer's 256"),
    (["efficient/MixerConfig.kind = 'nope'"], "unknown mixer kind 'nope'"),
    (["efficient/MixerConfig.options = {'x': 1}"], "takes no options"),
    (["ModelConfig.attention_impl = 'magic'"], "attention_impl"),
    (["ModelConfig.n_heads = 4", "ModelConfig.d_model = 128", "ModelConfig.n_kv_heads = 3"], "must divide n_heads"),
])
def test_bad_configs_raise_clear_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], params)


def test_window_at_least_seq_len_is_allowed():
    cfg = load_config([], ["efficient/MixerConfig.window = 100000", "DataConfig.seq_len = 64"])
    assert cfg.model.efficient.window == 100000


def test_nope_on_full_layers_is_one_line():
    cfg = load_config(["quickstart.gin"], ["full/MixerConfig.rope = False"])
    assert cfg.model.full.rope is False and cfg.model.efficient.rope is True


def test_run_id_ignores_logging_paths_cadence_and_steps():
    base = load_config(["quickstart.gin"])
    same = load_config(["quickstart.gin"], ["TrainConfig.log_every = 7", "CheckpointConfig.every_steps = 3",
                                            "DataConfig.path = '/elsewhere'", "TrainConfig.steps = 5000",
                                            "MeshConfig.data = 1"])
    other = load_config(["quickstart.gin"], ["TrainConfig.seed = 1"])
    other2 = load_config(["quickstart.gin"], ["OptimConfig.lr = 1e-4"])
    assert base.run_id() == same.run_id()
    assert len({base.run_id(), other.run_id(), other2.run_id()}) == 3


def test_config_json_round_trip():
    cfg = load_config(["quickstart.gin"], ["efficient/MixerConfig.window = 5"])
    d = json.loads(json.dumps(cfg.to_dict()))
    assert config_from_dict(d) == cfg
    assert diff_experiments(d, cfg.to_dict()) == []


def test_resume_refuses_a_different_experiment(tmp_path):
    cfg = load_config(["quickstart.gin"])
    prepare_run_dir(cfg, tmp_path)
    assert (tmp_path / "operative.gin").read_text().strip()
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert {"git", "packages", "devices", "xla_flags"} <= set(prov) and "sha" in prov["git"]
    prepare_run_dir(load_config(["quickstart.gin"], ["TrainConfig.steps = 10000"]), tmp_path)  # extending: ok
    changed = load_config(["quickstart.gin"], ["OptimConfig.lr = 1e-4", "ModelConfig.d_ff = 256"])
    with pytest.raises(ConfigError, match=r"model\.d_ff, optim\.lr"):
        prepare_run_dir(changed, tmp_path)
    prepare_run_dir(changed, tmp_path, force=True)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 1e-4


def test_optional_import_names_the_extra(monkeypatch):
    import importlib

    from hybrid_lm.optional import optional_import

    def missing(name, *a, **k):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tb\]'"):
        optional_import("tensorboardX")
