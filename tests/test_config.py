import json

import pytest

from hybrid_lm.config import CONFIGS_DIR, config_from_dict, expand_pattern, experiment_fields
from hybrid_lm.experiment import config_record, diff_experiments, load_config, run_id
from hybrid_lm.errors import ConfigError
from hybrid_lm.train.rundir import prepare_run_dir


@pytest.mark.parametrize("pattern,n,expected", [
    ("FE", 4, "FEFE"), ("FEEE", 8, "FEEEFEEE"), ("1:1", 6, "FEFEFE"), ("1:3", 8, "FEEEFEEE"), ("F", 3, "FFF"),
    ("fe", 2, "FE"),
])
def test_expand_pattern(pattern, n, expected):
    assert "".join(expand_pattern(pattern, n)) == expected


@pytest.mark.parametrize("params,match", [
    (["ModelConfig.no_such_field = 3"], "ModelConfig has no field 'no_such_field'"),
    (["NoSuchConfig.x = 3"], "no configurable named 'NoSuchConfig'"),
    (["efficient/MixerConfig.window = 0"], "window must be >= 1"),
    (["full/MixerConfig.window = -4"], "window must be >= 1"),
    (["ModelConfig.d_model = 100", "ModelConfig.n_heads = 3"], "does not divide d_model"),
    (["ModelConfig.n_layers = 10", "ModelConfig.layer_pattern = 'FEE'"], "does not divide n_layers=10"),
    (["ModelConfig.layer_pattern = 'FXE'"], "use letters F"),
    (["ModelConfig.vocab_size = 100"], "smaller than the 'byte' tokenizer's 256"),
    (["efficient/MixerConfig.kind = 'nope'"], "unknown mixer kind 'nope'"),
    (["MixerConfig.kind = 'mamba2'"], "MixerConfig.kind is bound without a slot, which sets every layer's mixer"),
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
    assert run_id(base) == run_id(same)
    assert len({run_id(base), run_id(other), run_id(other2)}) == 3


def test_data_seed_enters_the_run_id_only_when_it_differs_from_seed():
    base = load_config(["quickstart.gin"])
    assert "train.data_seed" not in experiment_fields(base, {}) and base.train.data_order_seed == 0
    same = load_config(["quickstart.gin"], ["TrainConfig.seed = 3", "TrainConfig.data_seed = 3"])
    assert same.train.data_seed is None and run_id(same) == run_id(load_config(["quickstart.gin"], ["TrainConfig.seed = 3"]))
    init_only = load_config(["quickstart.gin"], ["TrainConfig.seed = 1", "TrainConfig.data_seed = 0"])
    data_only = load_config(["quickstart.gin"], ["TrainConfig.data_seed = 1"])
    both = load_config(["quickstart.gin"], ["TrainConfig.seed = 1"])
    assert len({run_id(base), run_id(init_only), run_id(data_only), run_id(both)}) == 4
    assert (init_only.train.data_order_seed, data_only.train.data_order_seed) == (0, 1)
    assert config_from_dict(config_record(init_only)).train.data_seed == 0


@pytest.mark.parametrize("binding", ["TrainConfig.data_seed = -1", "TrainConfig.data_seed = 1.5",
                                     "TrainConfig.data_seed = True", "TrainConfig.seed = -2"])
def test_bad_seeds_are_one_line(binding):
    with pytest.raises(ConfigError, match="must be an integer >= 0") as e:
        load_config(["quickstart.gin"], [binding])
    assert "\n" not in str(e.value)


def test_config_json_round_trip():
    cfg = load_config(["quickstart.gin"], ["efficient/MixerConfig.window = 5"])
    d = json.loads(json.dumps(config_record(cfg)))
    assert config_from_dict(d) == cfg
    assert diff_experiments(d, config_record(cfg)) == []


def test_resume_refuses_a_different_experiment(tmp_path):
    cfg = load_config(["quickstart.gin"])
    prepare_run_dir(cfg, tmp_path)
    assert (tmp_path / "operative.gin").read_text().strip()
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert {"git", "packages", "devices", "xla_flags"} <= set(prov) and "sha" in prov["git"]
    prepare_run_dir(load_config(["quickstart.gin"], ["TrainConfig.steps = 10000"]), tmp_path)  # extending: ok
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')  # it has trained
    changed = load_config(["quickstart.gin"], ["OptimConfig.lr = 1e-4", "ModelConfig.d_ff = 256"])
    with pytest.raises(ConfigError, match=r"model\.d_ff, optim\.lr"):
        prepare_run_dir(changed, tmp_path)
    prepare_run_dir(changed, tmp_path, force=True)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 1e-4


@pytest.mark.integration  # trains a run
def test_a_run_is_never_shortened_below_its_checkpoints_and_a_late_extension_warns(tiny_run, caplog):
    """A trained run's workdir refuses a TrainConfig.steps below its newest checkpoint (its record would
    say fewer steps than it trained) and keeps config.json; extending after the LR decay began warns."""
    from conftest import TINY
    from hybrid_lm.errors import WorkdirError

    run = tiny_run(10)  # checkpoints at 5 and 10; warmup 5, the last 2 steps decay
    record = (run / "config.json").read_text()
    with pytest.raises(WorkdirError, match=r"has trained to step 10 .* past TrainConfig.steps=7"):
        prepare_run_dir(load_config([], list(TINY) + ["TrainConfig.steps = 7"]), run)
    assert (run / "config.json").read_text() == record
    prepare_run_dir(load_config([], list(TINY) + ["TrainConfig.steps = 10"]), run)  # the same length: quiet
    assert "LR decay had begun" not in caplog.text
    prepare_run_dir(load_config([], list(TINY) + ["TrainConfig.steps = 20"]), run)
    assert "TrainConfig.steps 10 -> 20 at step 10: the LR decay had begun" in caplog.text
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 20


def test_optional_import_names_the_extra(monkeypatch):
    import importlib

    from hybrid_lm.optional import optional_import

    def missing(name, *a, **k):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tb\]'"):
        optional_import("tensorboardX")


@pytest.mark.integration
def test_importing_config_pulls_in_no_jax():
    import subprocess
    import sys
    code = "import hybrid_lm.config, sys; assert not any(m=='jax' or m.startswith('jax.') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# run ids computed by the code before mixers declared their fields: existing default runs keep resuming
@pytest.mark.parametrize("files,expected_id", [
    (["quickstart.gin"], "bc91a0bd964d"),
    (["scale/s4.gin"], "b8611841d379"),
    (["base.gin", "scale/s4.gin"], "b8611841d379"),
    (["quickstart.gin", "arch/moba.gin"], "98f6984bef6f"),
    (["quickstart.gin", "arch/mamba2.gin"], "8d8c32e3448e"),
    (["quickstart.gin", "arch/sa.gin"], "fc86b6ba4c3a"),
    (["scale/s1.gin", "arch/gdn.gin"], "fcf084f91e2d"),
])
def test_run_ids_are_unchanged(files, expected_id):
    assert run_id(load_config(files)) == expected_id


@pytest.mark.parametrize("binding,field,choices", [
    ("ModelConfig.attention_impl = 'magic'", "ModelConfig.attention_impl='magic'", "auto, xla, cudnn, pallas, jla"),
    ("ModelConfig.linear_impl = 'magic'", "ModelConfig.linear_impl='magic'", "auto, xla, jla"),
    ("ModelConfig.remat = 'all'", "ModelConfig.remat='all'", "none, full, dots, dots_attn"),
    ("ModelConfig.compute_dtype = 'fp8'", "ModelConfig.compute_dtype='fp8'", "float32, bfloat16, float16"),
    ("DataConfig.source = 'web'", "DataConfig.source='web'", "embedded, tokens"),
    ("OptimConfig.name = 'sgd'", "OptimConfig.name='sgd'", "adamw, muon"),
    ("OptimConfig.decay_shape = 'exp'", "OptimConfig.decay_shape='exp'", "linear, cosine, 1-sqrt"),
    ("TrainConfig.nan_policy = 'ignore'", "TrainConfig.nan_policy='ignore'", "stop, skip"),
])
def test_literal_choices_are_checked_from_the_annotations(binding, field, choices):
    with pytest.raises(ConfigError) as e:
        load_config([], [binding])
    assert str(e.value) == f"{field}: choose one of {choices}"


def test_every_literal_default_is_one_of_its_choices():
    from hybrid_lm.config import Config, check_choices
    check_choices(Config())


def test_slot_defaults_live_in_config_py():
    from hybrid_lm.config import SLOT_DEFAULTS, ModelConfig
    assert "MixerConfig" not in (CONFIGS_DIR / "base.gin").read_text()
    assert not [p for p in CONFIGS_DIR.rglob("*.gin") if "window = None" in p.read_text()]
    assert ModelConfig().full == SLOT_DEFAULTS["full"] == load_config([]).model.full
    assert ModelConfig().efficient == SLOT_DEFAULTS["efficient"] == load_config([]).model.efficient
    assert load_config([], ["efficient/MixerConfig.kind = 'swa'"]).model.efficient.window == 128


def test_arch_files_work_in_either_order():
    for arch in ("moba", "mamba2", "sa", "lightning"):
        a = load_config(["quickstart.gin", f"arch/{arch}.gin"])
        b = load_config([f"arch/{arch}.gin", "quickstart.gin"])
        assert a == b and a.model.efficient.kind == arch
        assert a.model.efficient.window == (128 if arch == "sa" else None)


def test_kind_scoped_binding_is_a_default_for_that_kind():
    assert load_config(["quickstart.gin"]).model.efficient.window == 32  # efficient/swa/MixerConfig.window
    assert load_config(["quickstart.gin"], ["efficient/MixerConfig.window = 5"]).model.efficient.window == 5
    sa = load_config(["quickstart.gin"], ["efficient/MixerConfig.kind = 'sa'", "efficient/sa/MixerConfig.window = 16"])
    assert sa.model.efficient.window == 16
    with pytest.raises(ConfigError, match="window must be set for mixer 'sa'"):
        load_config(["quickstart.gin"], ["efficient/MixerConfig.kind = 'sa'"])  # the swa window is not inherited


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


@pytest.mark.parametrize("params,match", [
    (["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.window = 64"],
     r"efficient/MixerConfig.window=64 is set, but mixer 'moba' does not read window"),
    (["efficient/moba/MixerConfig.window = 64", "efficient/MixerConfig.kind = 'moba'"],
     r"efficient/MixerConfig.window=64 is set, but mixer 'moba' does not read window"),
    (["full/MixerConfig.window = 64"], r"full/MixerConfig.window=64 is set, but mixer 'attention' does not read"),
    (["MixerConfig.window = 64"], r"full/MixerConfig.window=64 is set, but mixer 'attention'"),
    (["efficient/MixerConfig.kind = 'mamba2'", "efficient/MixerConfig.rope = False"],
     r"efficient/MixerConfig.rope=False is set, but mixer 'mamba2' does not read rope \(it reads: options\)"),
    (["efficient/MixerConfig.kind = 'gdn'", "efficient/MixerConfig.rope_theta = 5e5"],
     r"efficient/MixerConfig.rope_theta=500000.0 is set, but mixer 'gdn'"),
    (["efficient/MixerConfig.kind = 'lightning'", f"efficient/MixerConfig.rope_scaling = {LLAMA3!r}"],
     r"efficient/MixerConfig.rope_scaling=\{'rope_type': 'llama3'.* is set, but mixer 'lightning' does not read"),
])
def test_a_field_the_mixer_does_not_read_is_an_error(params, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["quickstart.gin"], params)


@pytest.mark.parametrize("scaling,extra,match", [
    ({"rope_type": "dynamic", "factor": 4.0}, [], r"full/MixerConfig.rope_scaling: rope_type='dynamic': hybrid_lm "
                                                  r"scales RoPE by 'llama3', 'linear', 'yarn' only"),
    ({"rope_type": "yarn", "factor": 4.0}, [], r"'yarn' takes factor, original_max_position_embeddings \(and "
                                               r"optionally beta_fast, .*\); missing original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}, [],
     r"'linear' takes factor; unknown original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": -1}, [],
     r"attention_factor=-1 must be a positive number"),
    ({"factor": 4.0}, [], r"rope_type=None"),
    ({**LLAMA3, "beta_fast": 32}, [], r"rope_type 'llama3' takes factor, .*; unknown beta_fast"),
    ({"rope_type": "llama3", "factor": 8.0}, [], r"missing low_freq_factor, high_freq_factor, original_max"),
    ({**LLAMA3, "factor": -1.0}, [], r"factor=-1.0 must be a positive number"),
    ({**LLAMA3, "original_max_position_embeddings": "8k"}, [], r"original_max_position_embeddings='8k' must be"),
    ({**LLAMA3, "low_freq_factor": 4.0}, [], r"low_freq_factor=4.0 must be below high_freq_factor=4.0"),
    (LLAMA3, ["full/MixerConfig.rope = False"], r"rope_scaling is set, but full/MixerConfig.rope = False \(NoPE\)"),
])
def test_bad_rope_scaling_is_one_line(scaling, extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(["quickstart.gin"], [f"full/MixerConfig.rope_scaling = {scaling!r}"] + extra)
    assert "\n" not in str(e.value)


def test_rope_scaling_enters_the_run_id_only_when_set():
    base = load_config(["quickstart.gin"])
    scaled = load_config(["quickstart.gin"], [f"full/MixerConfig.rope_scaling = {LLAMA3!r}"])
    assert scaled.model.full.rope_scaling == LLAMA3 and scaled.model.efficient.rope_scaling == {}
    assert run_id(scaled) != run_id(base)
    assert "model.full.rope_scaling" not in experiment_fields(base, {})
    assert config_from_dict(config_record(scaled)).model.full.rope_scaling == LLAMA3


def test_mixers_declare_what_they_read():
    from hybrid_lm.model.registry import MIXER_FIELDS, register_mixer, registered_mixers
    specs = registered_mixers()
    assert specs["attention"].reads == ("rope", "rope_theta", "rope_scaling")
    assert specs["swa"].reads == ("window", "rope", "rope_theta", "rope_scaling")
    assert specs["moba"].reads == ("rope", "rope_theta", "rope_scaling", "options")
    # every mixer that rotates q and k takes the scaling of its frequencies too
    assert all(("rope_theta" in s.reads) == ("rope_scaling" in s.reads) for s in specs.values())
    assert specs["mamba2"].reads == ("options",)
    for spec in specs.values():
        assert set(spec.reads) <= set(MIXER_FIELDS) and ("options" in spec.reads) == (spec.options is not None)
        assert spec.needs_window == ("window" in spec.reads)
    with pytest.raises(ValueError, match="exactly when an options dataclass"):
        register_mixer("bad", flops=lambda *a: {}, reads=("options",))
    with pytest.raises(ValueError, match="must be drawn from"):
        register_mixer("bad", flops=lambda *a: {}, reads=("kind",))


@pytest.mark.parametrize("files,params,expected", [
    (["quickstart.gin"], [], []),
    (["quickstart.gin"], ["TrainConfig.steps = 40"],
     ["OptimConfig.warmup_steps=50 exceeds TrainConfig.steps=40"]),
    (["quickstart.gin"], ["TrainConfig.steps = 60"],  # decay (the last 18 steps) starts before warmup ends
     ["OptimConfig.warmup_steps=50: warmup ends at step 50, after the decay starts at step 42 (the last "
      "OptimConfig.decay_fraction=0.3 of TrainConfig.steps=60): the learning rate never reaches OptimConfig.lr"]),
    (["quickstart.gin"], ["TrainConfig.steps = 50"], ["OptimConfig.warmup_steps=50: warmup ends at step 50, after "
                                                      "the decay starts at step 35"]),
    (["quickstart.gin"], ["TrainConfig.steps = 70"], []),  # the peak at step 49, the decay from step 49 on
    (["quickstart.gin"], ["TrainConfig.steps = 50", "OptimConfig.decay_fraction = 0.0"], []),
    (["quickstart.gin", "arch/sa.gin"], [],
     ["efficient/MixerConfig.window=128 >= DataConfig.seq_len: mixer 'sa' sees every key at seq_len=128"]),
    (["quickstart.gin", "arch/sa_swa.gin"], ["DataConfig.seq_len = 256"], []),
    (["quickstart.gin"], ["efficient/MixerConfig.window = 128"],
     ["efficient/MixerConfig.window=128 >= DataConfig.seq_len: mixer 'swa' sees every key"]),
    (["quickstart.gin", "arch/moba.gin"], [],
     ["efficient/MixerConfig.options block_size*top_k=16*16=256 >= DataConfig.seq_len: mixer 'moba' sees every "
      "key at seq_len=128"]),
    (["quickstart.gin", "arch/moba.gin"], ["DataConfig.seq_len = 512"], []),
    (["quickstart.gin", "arch/ssa.gin"], [], ["full/MixerConfig.options block_size*top_k=16*16=256"]),
    (["quickstart.gin"], ["ModelConfig.layer_pattern = 'F'", "efficient/MixerConfig.window = 500"], []),  # unused
])
def test_config_warnings(files, params, expected):
    from hybrid_lm.experiment import config_warnings
    got = config_warnings(load_config(files, params))
    assert len(got) == len(expected) and all(g.startswith(e) for g, e in zip(got, expected)), got


def test_warnings_are_logged_once_at_validation(caplog, monkeypatch):
    from hybrid_lm import experiment as validate
    monkeypatch.setattr(validate, "_WARNED", set())
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        load_config(["quickstart.gin"], ["TrainConfig.steps = 10"])
        load_config(["quickstart.gin"], ["TrainConfig.steps = 10"])
        load_config(["quickstart.gin"], ["TrainConfig.steps = 10"], validate=False)
    assert [r.getMessage() for r in caplog.records] == [
        "OptimConfig.warmup_steps=50 exceeds TrainConfig.steps=10: the learning rate never reaches OptimConfig.lr"]


@pytest.mark.integration
def test_an_eval_does_not_repeat_the_training_setup_warnings(caplog, monkeypatch, tmp_path):
    """warmup > steps and the vocabulary note are warned about where a run is configured to train
    (load_config: train, sweep), not each time `hybrid-lm eval` loads a run's config."""
    from hybrid_lm import experiment as validate
    from hybrid_lm.cli import main

    cfg = load_config(["quickstart.gin"], ["TrainConfig.steps = 10", "ModelConfig.vocab_size = 1024"])
    assert [w.split("=")[0] for w in validate.config_warnings(cfg)] == ["OptimConfig.warmup_steps",
                                                                         "ModelConfig.vocab_size"]
    assert validate.config_warnings(cfg, "eval") == []
    overlap = load_config(["quickstart.gin"], ["TrainConfig.steps = 60"], validate=False)
    assert [w.split(":")[0] for w in validate.config_warnings(overlap, "info")] == ["OptimConfig.warmup_steps=50"]
    assert validate.config_warnings(overlap, "eval") == []
    (tmp_path / "config.json").write_text(json.dumps(config_record(cfg)))
    monkeypatch.setattr(validate, "_WARNED", set())
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        assert main(["eval", str(tmp_path), "--tasks", "loss"]) == 2  # no checkpoints: after the config checks
    assert not caplog.records
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        load_config(["quickstart.gin"], ["TrainConfig.steps = 10", "ModelConfig.vocab_size = 1024"])
    assert len(caplog.records) == 2


@pytest.mark.integration
def test_info_states_the_vocabulary_note_as_a_line_not_a_warning(caplog, capsys, monkeypatch):
    """`hybrid-lm info` of a scale preset (vocab 73,448 on the byte tokenizer) prints the note once in
    its report instead of logging a warning; warmup > steps stays a warning; training still warns."""
    from hybrid_lm import experiment as validate
    from hybrid_lm.cli import main

    monkeypatch.setattr(validate, "_WARNED", set())
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        assert main(["info", "configs/scale/s1.gin"]) == 0
    out = capsys.readouterr().out
    assert not caplog.records
    notes = [x for x in out.splitlines() if x.startswith("note: ")]
    assert len(notes) == 1 and "ModelConfig.vocab_size=73448 exceeds the 'byte' tokenizer's 256" in notes[0]
    assert main(["info", "configs/scale/s1.gin", "--json"]) == 0
    assert "73192 embedding rows" in json.loads(capsys.readouterr().out)["vocab_note"]
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        assert main(["info", "configs/scale/s1.gin", "--gin_param", "TrainConfig.steps = 10"]) == 0
    assert [r.getMessage().split("=")[0] for r in caplog.records] == ["OptimConfig.warmup_steps"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybrid_lm.validate"):
        load_config(["scale/s1.gin"])
    assert [r.getMessage().split("=")[0] for r in caplog.records] == ["ModelConfig.vocab_size"]


@pytest.mark.parametrize("binding,expected", [
    ("ModelConfig.d_model=abc", "bad gin binding: 'ModelConfig.d_model=abc' (line 1): cannot read the value abc; "
                                "strings need quotes, e.g. ModelConfig.d_model = 'abc'"),
    ("ModelConfig.d_model = [1,", "bad gin binding: unexpected EOF in multi-line statement (an unclosed "
                                  "bracket or quote?)"),
])
def test_an_unreadable_gin_value_is_one_clean_line(binding, expected):
    with pytest.raises(ConfigError) as e:
        load_config(["quickstart.gin"], [binding])
    assert str(e.value) == expected


def test_the_vocabulary_note_mentions_rounding_only_when_there_was_some(monkeypatch):
    from types import SimpleNamespace

    from hybrid_lm import experiment as validate

    cfg = load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 1024"], validate=False)
    assert validate.vocab_note(cfg) == ("ModelConfig.vocab_size=1024 exceeds the 'byte' tokenizer's 256 ids: 768 "
                                        "embedding rows stand for ids the tokenizer never produces")
    monkeypatch.setattr(validate, "load_tokenizer", lambda spec: SimpleNamespace(spec="bpe300", vocab_size=300))
    assert validate.vocab_note(cfg) == ("ModelConfig.vocab_size=1024 exceeds the 'bpe300' tokenizer's 300 ids "
                                        "(rounded up to a multiple of 128: 384): 724 embedding rows stand for ids "
                                        "the tokenizer never produces")


def test_a_workdir_holding_unrelated_files_gets_a_notice_not_a_refusal(tmp_path, caplog):
    cfg = load_config(["quickstart.gin"])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    (notes / "data").mkdir()
    (notes / ".lock").write_text("{}")  # the trainer's own lock is not counted
    with caplog.at_level("WARNING", logger="hybrid_lm.train.rundir"):
        prepare_run_dir(cfg, notes)
    assert [r.getMessage() for r in caplog.records] == [
        f"{notes} is not a run directory and already holds 2 file(s) (e.g. data): writing the run into it anyway"]
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "config.json").exists()
    caplog.clear()
    sweep_job = tmp_path / "sweep_job"  # what a sweep writes before training: no notice
    sweep_job.mkdir()
    (sweep_job / "sweep_run.json").write_text("{}")
    with caplog.at_level("WARNING", logger="hybrid_lm.train.rundir"):
        prepare_run_dir(cfg, notes)  # now a run dir
        prepare_run_dir(cfg, tmp_path / "new")
        prepare_run_dir(cfg, sweep_job)
    assert not caplog.records
