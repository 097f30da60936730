"""transformers interop without torch (``hybrid_lm/run/hf.py``): export -> import is bitwise, the config
mapping both ways for each family (hand-written config.json files of transformers' documented defaults
included), every refusal in one line, and bad folders. The logits against transformers itself are
``tests/gpu/test_gpu_hf_parity.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np
import pytest
from hf_families import LLAMA3, OURS, THEIRS, WINDOW, YARN, hf_dict, layer_summary, random_params, tiny_model

from hybrid_lm.config import Config, MixerConfig, ModelConfig, run_id_of
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.run.hf import (HFCheckpoint, check_exportable, hf_config, hf_folder, merge_model,
                               model_config_from_hf, params_to_hf, write_hf_folder)
from hybrid_lm.step import ModelFns


def _forward(model: ModelConfig):
    """One jitted fp32 forward pass of ``model``: ``(params, tokens) -> logits``."""
    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    fns = ModelFns(Config(model=model))
    return jax.jit(lambda p, t: fns.model(p)(t, MixerContext(positions=default_positions(*t.shape),
                                                             attention_impl="xla", train=False)))


def _export(tmp_path, model, params, record=True, name="hf"):
    out = tmp_path / name
    out.mkdir()
    rec = {"model": dataclasses.asdict(model), "data": {"tokenizer": "byte", "seq_len": 32}} if record else None
    cfg = write_hf_folder(out, model, params, tokenizer="byte", seq_len=32, record=rec)
    return out, cfg


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- export -> import

@pytest.mark.parametrize("name", list(OURS))
def test_export_then_import_is_bitwise(tmp_path, name):
    model = tiny_model(name)
    params = random_params(model)
    out, cfg = _export(tmp_path, model, params)
    assert cfg["model_type"] == OURS[name][0]
    ck = HFCheckpoint(f"hf:{out}")
    assert ck.model_config() == model
    back = ck.read_params(ModelFns(Config(model=model)).abstract_params)
    for a, b in zip(_leaves(params), _leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    fwd = _forward(model)
    tokens = np.random.default_rng(1).integers(0, model.vocab_size, (2, 16)).astype(np.int32)
    assert np.array_equal(np.asarray(fwd(params, tokens)), np.asarray(fwd(back, tokens)))


@pytest.mark.parametrize("name", list(OURS))
def test_config_maps_back_without_the_export_record(name):
    """transformers' fields alone give the same layers, slots and shapes (the record adds only what
    transformers does not hold: dtypes, init, kernels, the layer pattern's spelling)."""
    model = tiny_model(name)
    back = model_config_from_hf(hf_config(model, max_position_embeddings=32, dtype="float32"))
    assert layer_summary(back) == layer_summary(model)
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "qk_norm",
              "norm_eps", "compute_dtype"):
        assert getattr(back, f) == getattr(model, f), f
    assert back.resolved_head_dim == model.resolved_head_dim
    for field in ("rope_theta", "rope_scaling"):
        assert {json.dumps(getattr(back.mixer(t), field)) for t in "FE" if back.mixer(t).rope and t in back.layer_types()} \
            == {json.dumps(getattr(model.mixer(t), field)) for t in "FE" if model.mixer(t).rope and t in model.layer_types()}


def test_export_config_per_family():
    S, F = "sliding_attention", "full_attention"
    c = hf_config(tiny_model("llama"), max_position_embeddings=32)
    assert c["architectures"] == ["LlamaForCausalLM"] and "layer_types" not in c
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and c["head_dim"] == 16
    assert "rope_scaling" not in c
    c = hf_config(tiny_model("llama31"), max_position_embeddings=32)  # 5.x's rope_parameters, 4.x's rope_scaling
    assert c["rope_parameters"] == {"rope_theta": 5e5, **LLAMA3} and c["rope_scaling"] == LLAMA3
    c = hf_config(tiny_model("qwen3_yarn"), max_position_embeddings=32)
    assert c["rope_parameters"] == {"rope_theta": 1e6, **YARN} and c["rope_scaling"] == YARN
    assert c["max_position_embeddings"] == 4 * 4096  # YaRN's own context, as transformers 5.x expects it
    c = hf_config(tiny_model("llama_tied"), max_position_embeddings=32)
    assert (c["tie_word_embeddings"], c["num_key_value_heads"], c["head_dim"]) == (True, 1, 24)
    c = hf_config(tiny_model("ministral"), max_position_embeddings=32)
    assert (c["model_type"], c["sliding_window"], c["layer_types"]) == ("ministral", WINDOW, [F, S, F, S])
    c = hf_config(tiny_model("qwen3"), max_position_embeddings=32)
    assert (c["use_sliding_window"], c["sliding_window"], c["layer_types"]) == (True, WINDOW, [F, S, F, S])
    assert c["max_window_layers"] == 4  # interleaved: no prefix of full layers says it; layer_types does
    prefix = tiny_model("qwen3", layer_pattern="FFEE")  # full layers first, as Qwen's configs have them
    c = hf_config(prefix, max_position_embeddings=32)
    assert c["max_window_layers"] == 2 and c["layer_types"] == [F, F, S, S]
    # an engine that reads max_window_layers alone sees the same layers
    engine = model_config_from_hf({k: v for k, v in c.items() if k != "layer_types"})
    assert layer_summary(engine) == layer_summary(prefix)
    c = hf_config(tiny_model("smollm3"), max_position_embeddings=32)
    assert (c["no_rope_layers"], c["use_sliding_window"], c["layer_types"]) == ([0, 1, 1, 1], False, [F] * 4)
    assert c["rope_parameters"]["rope_theta"] == 2e6
    c = hf_config(tiny_model("smollm3_swa"), max_position_embeddings=32)
    assert (c["no_rope_layers"], c["use_sliding_window"], c["layer_types"]) == ([0, 1, 0, 1], True, [F, S, F, S])


def test_a_tied_head_writes_no_lm_head_and_names_are_transformers():
    model = tiny_model("llama_tied")
    sd = params_to_hf(random_params(model), model)
    assert "lm_head.weight" not in sd
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)  # [H * Dh, d]
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 24)
    assert sd["model.layers.3.mlp.down_proj.weight"].shape == (64, 96)
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= set(sd)
    q = random_params(tiny_model("qwen3"))
    assert "model.layers.1.self_attn.q_norm.weight" in params_to_hf(q, tiny_model("qwen3"))


def test_q_heads_are_flattened_head_major():
    """q_proj row h * Dh + k is hybrid_lm's wq[:, h, k] (transformers' view(..., -1, head_dim))."""
    model = tiny_model("llama")
    params = random_params(model)
    q = params_to_hf(params, model)["model.layers.2.self_attn.q_proj.weight"]
    wq = np.asarray(params["blocks"][2]["mixer"]["wq"])
    np.testing.assert_array_equal(q[3 * 16 + 5], wq[:, 3, 5])


# ----------------------------------------------------------------------------- transformers -> hybrid_lm

@pytest.mark.parametrize("name", list(THEIRS))
def test_transformers_configs_import(name):
    _, _, types, slots = THEIRS[name]
    m = model_config_from_hf(hf_dict(name))
    assert layer_summary(m) == (types, slots)
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.norm_eps) == (64, 4, 4, 96, 1e-5)


# config.json files as released checkpoints write them (values from their model cards' configs)
TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
             "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "vocab_size": 32000, "hidden_act": "silu", "max_position_embeddings": 2048}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
              "vocab_size": 32000, "max_position_embeddings": 32768}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
             "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
             "tie_word_embeddings": True, "use_sliding_window": False, "max_window_layers": 28,
             "vocab_size": 151936, "attention_bias": False, "max_position_embeddings": 40960}
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "head_dim": 64,
              "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "vocab_size": 128256, "hidden_act": "silu", "max_position_embeddings": 131072, "mlp_bias": False}
SMOLLM3_3B = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
              "intermediate_size": 11008, "num_attention_heads": 16, "num_hidden_layers": 36,
              "num_key_value_heads": 4, "rope_theta": 5000000.0, "no_rope_layer_interval": 4,
              "use_sliding_window": False, "sliding_window": None, "vocab_size": 128256}


def test_released_configs_import():
    m = model_config_from_hf(TINYLLAMA)
    assert (m.layer_types(), m.full.kind, m.full.rope_theta, m.n_kv_heads, m.head_dim, m.compute_dtype) == (
        ["F"] * 22, "attention", 10000.0, 4, None, "bfloat16")
    m = model_config_from_hf(MISTRAL_7B)
    assert m.layer_types() == ["E"] * 32 and (m.efficient.kind, m.efficient.window) == ("swa", 4096)
    m = model_config_from_hf(QWEN3_06B)
    assert (m.qk_norm, m.head_dim, m.tie_embeddings, m.full.rope_theta, m.layer_types()) == (
        True, 128, True, 1e6, ["F"] * 28)
    m = model_config_from_hf(LLAMA32_1B)  # transformers 4.x's rope_scaling beside rope_theta
    assert (m.full.rope_theta, m.full.rope_scaling) == (5e5, LLAMA32_1B["rope_scaling"])
    five = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_scaling", "rope_theta")}  # 5.x: one dict
    assert model_config_from_hf({**five, "rope_parameters": {"rope_theta": 5e5, **LLAMA32_1B["rope_scaling"]}}) == m
    # Qwen3's model card enables YaRN for 131,072 tokens with this entry (4.x's rope_scaling; its "type" key
    # as older cards write it): the scaling goes to every RoPE slot, nulls mean transformers' defaults
    card = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    m = model_config_from_hf({**QWEN3_06B, "rope_scaling": card})
    assert m.full.rope_scaling == card and m.full.rope_theta == 1e6
    older = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": None}
    assert model_config_from_hf({**QWEN3_06B, "rope_scaling": older}) == m
    five = {k: v for k, v in QWEN3_06B.items() if k not in ("rope_scaling", "rope_theta")}
    assert model_config_from_hf({**five, "rope_parameters": {"rope_theta": 1e6, **card}}) == m
    # without original_max_position_embeddings, transformers takes the config's max_position_embeddings
    m = model_config_from_hf({**QWEN3_06B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert m.full.rope_scaling["original_max_position_embeddings"] == 40960
    m = model_config_from_hf(SMOLLM3_3B)  # NoPE every 4th layer (3, 7, ...): the full slot; tied by default
    assert m.layer_pattern == "EEEF" and m.full == MixerConfig(kind="attention", rope=False, rope_theta=5e6)
    assert (m.efficient.kind, m.efficient.rope, m.efficient.rope_theta, m.tie_embeddings) == ("attention", True, 5e6, True)


def test_transformers_defaults_fill_missing_keys():
    m = model_config_from_hf({"model_type": "qwen3"})
    assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.d_ff) == (
        151936, 4096, 32, 32, 32, 128, 22016)
    assert model_config_from_hf({"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16}).head_dim == 128
    m = model_config_from_hf({"model_type": "smollm3", "num_hidden_layers": 8})
    assert m.full.rope_theta == 2e6 and m.tie_embeddings and "".join(m.layer_types()) == "EEEFEEEF"
    m = model_config_from_hf({"model_type": "llama", "num_hidden_layers": 2, "num_key_value_heads": None})
    assert m.n_kv_heads == 32
    m = model_config_from_hf({"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert m.full.rope_theta == 7.0
    m = model_config_from_hf({"model_type": "mistral", "sliding_window": None, "num_hidden_layers": 2})
    assert m.layer_types() == ["F", "F"]
    m = model_config_from_hf({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8,
                              "layer_types": ["full_attention", "sliding_attention"]})  # read as ministral
    assert m.layer_pattern == "FE" and m.efficient.window == 8


# ----------------------------------------------------------------------------- refusals

SLOT_KINDS = {
    "sa": ("efficient", MixerConfig(kind="sa", window=8)),
    "sa_swa": ("efficient", MixerConfig(kind="sa_swa", window=8)),
    "moba": ("efficient", MixerConfig(kind="moba")),
    "ssa": ("full", MixerConfig(kind="ssa")),
    "lightning": ("efficient", MixerConfig(kind="lightning")),
    "mamba2": ("efficient", MixerConfig(kind="mamba2")),
    "gdn": ("efficient", MixerConfig(kind="gdn")),
    "attention_sink": ("full", MixerConfig(kind="attention_sink", options={"horizon": 8, "sinks": 2})),
}


@pytest.mark.parametrize("kind", list(SLOT_KINDS))
def test_export_refuses_layers_without_a_transformers_counterpart(kind):
    slot, mc = SLOT_KINDS[kind]
    model = ModelConfig(layer_pattern="1:1", n_layers=2, **{slot: mc})
    with pytest.raises(ConfigError) as e:
        check_exportable(model)
    layer = 0 if slot == "full" else 1
    msg = str(e.value)
    assert f"layer {layer} ({slot} slot) is {kind!r}" in msg and "--format safetensors" in msg and "\n" not in msg


@pytest.mark.parametrize("fields,said", [
    (dict(full=MixerConfig(kind="attention", rope_theta=1e4), efficient=MixerConfig(kind="swa", window=8, rope_theta=1e6)),
     "different rope_theta"),
    (dict(full=MixerConfig(kind="swa", window=4), efficient=MixerConfig(kind="swa", window=8)), "different windows"),
    (dict(qk_norm=True, full=MixerConfig(kind="attention", rope=False)), "qk_norm with NoPE layers"),
])
def test_export_refuses_what_one_transformers_config_cannot_hold(fields, said):
    with pytest.raises(ConfigError, match=said) as e:
        check_exportable(ModelConfig(layer_pattern="1:1", n_layers=2, **fields))
    assert "\n" not in str(e.value)


def test_export_of_a_run_refuses_before_restoring(tmp_path):
    """``hybrid-lm export RUN --format hf`` of an SA run fails on its config, before the checkpoint (here: none)."""
    from hybrid_lm.run.export import export_checkpoint
    from hybrid_lm.experiment import config_record

    run = tmp_path / "run"
    run.mkdir()
    cfg = Config(model=ModelConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, efficient=MixerConfig(kind="sa", window=8)))
    (run / "config.json").write_text(json.dumps(config_record(cfg)))
    with pytest.raises(ConfigError, match=r"layer 1 \(efficient slot\) is 'sa': stochastic attention"):
        export_checkpoint(str(run), fmt="hf")
    with pytest.raises(WorkdirError, match="holds no checkpoint"):  # the other formats get that far
        export_checkpoint(str(run))


def _llama(**kw):
    return {"model_type": "llama", "num_hidden_layers": 2, **kw}


@pytest.mark.parametrize("hf,said", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported: hybrid_lm imports llama, mistral"),
    ({"model_type": "qwen2"}, "model_type 'qwen2' is not supported"),
    ({}, "model_type None is not supported"),
    (_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3' takes factor.*; missing low_freq_factor"),
    (_llama(rope_scaling={**LLAMA3, "attention_factor": 1.0}), "unknown attention_factor"),
    (_llama(rope_scaling={**LLAMA3, "factor": 0}), "factor=0 must be a positive number"),
    (_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), "no dynamic scaling"),
    (_llama(rope_scaling={"type": "longrope", "factor": 2.0}), "rope_type='longrope'"),
    (_llama(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),  # nor max_position_embeddings
     "'yarn' takes factor, original_max_position_embeddings .*; missing original_max_position_embeddings"),
    (_llama(rope_scaling={**YARN, "truncate": "yes"}), "truncate='yes' must be true or false"),
    (_llama(rope_scaling={**YARN, "beta_fast": 0}), "beta_fast=0 must be a positive number"),
    (_llama(rope_scaling={**YARN, "low_freq_factor": 1.0}), "'yarn' takes .*; unknown low_freq_factor"),
    (_llama(attention_bias=True), "attention_bias=true"),
    (_llama(mlp_bias=True), "mlp_bias=true"),
    (_llama(hidden_act="gelu_pytorch_tanh"), "hidden_act='gelu_pytorch_tanh'"),
    (_llama(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (_llama(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ({"model_type": "smollm3", "num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 1], "use_sliding_window": True,
      "sliding_window": 8, "layer_types": ["sliding_attention"] + ["full_attention"] * 3}, "of 3 kinds"),
    ({"model_type": "ministral", "num_hidden_layers": 2, "layer_types": ["chunked_attention"] * 2},
     "layer_types 'chunked_attention'"),
    ({"model_type": "ministral", "num_hidden_layers": 2, "sliding_window": None,
      "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window is null"),
    ({"model_type": "qwen3", "num_hidden_layers": 2, "use_sliding_window": False,
      "layer_types": ["full_attention", "sliding_attention"]}, r"sliding_window is null \(use_sliding_window=false\)"),
    ({"model_type": "smollm3", "num_hidden_layers": 2, "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention"]}, "use_sliding_window=false"),
    ({"model_type": "ministral", "num_hidden_layers": 3, "layer_types": ["full_attention"] * 2},
     "2 entries for num_hidden_layers=3"),
    (_llama(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "differ between layer types"),
])
def test_import_refuses_what_hybrid_lm_cannot_express(hf, said):
    with pytest.raises(ConfigError, match=said) as e:
        model_config_from_hf(hf, "x/config.json")
    assert str(e.value).startswith("x/config.json: ") and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- folders

def test_bad_folders_fail_in_one_line(tmp_path):
    with pytest.raises(WorkdirError, match="no such directory"):
        HFCheckpoint(f"hf:{tmp_path / 'nope'}")
    with pytest.raises(WorkdirError, match="no config.json, so not a Hugging Face model folder"):
        HFCheckpoint(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        HFCheckpoint(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps(_llama()))
    with pytest.raises(WorkdirError, match=r"no model.safetensors or model.safetensors.index.json$"):
        HFCheckpoint(f"hf:{tmp_path}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WorkdirError, match="it has pytorch_model.bin: save it as safetensors"):
        HFCheckpoint(f"hf:{tmp_path}")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        HFCheckpoint(f"hf:{tmp_path}")


def _rewrite(folder, drop=(), add=None, config=None):
    """Rewrite an exported folder's weights (drop / add tensors) or config.json keys."""
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    for k in drop:
        sd.pop(k)
    sd.update(add or {})
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config:
        d = json.loads((folder / "config.json").read_text())
        d.update(config)
        (folder / "config.json").write_text(json.dumps(d))


def test_tensors_are_checked(tmp_path):
    model = tiny_model("llama")
    abstract = ModelFns(Config(model=model)).abstract_params
    out, _ = _export(tmp_path, model, random_params(model), record=False)
    _rewrite(out, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ConfigError, match="tensor model.layers.1.mlp.up_proj.weight is missing"):
        HFCheckpoint(out).read_params(abstract)
    out, _ = _export(tmp_path, model, random_params(model), record=False, name="b")
    _rewrite(out, add={"model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32),
                       "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})  # the buffer is ignored
    with pytest.raises(ConfigError, match=r"tensors hybrid_lm cannot express: model.layers.0.self_attn.q_proj.bias$"):
        HFCheckpoint(out).read_params(abstract)
    out, _ = _export(tmp_path, model, random_params(model), record=False, name="c")
    _rewrite(out, config={"intermediate_size": 80})
    with pytest.raises(ConfigError, match=r"down_proj.weight has shape \[64, 96\] in model.safetensors's header, the config "
                                          r"needs \[64, 80\]"):
        ck = HFCheckpoint(out)
        ck.read_params(ModelFns(Config(model=ck.model_config())).abstract_params)


def test_tied_checkpoints_may_carry_an_equal_head(tmp_path):
    model = tiny_model("llama_tied")
    params = random_params(model)
    abstract = ModelFns(Config(model=model)).abstract_params
    out, _ = _export(tmp_path, model, params)
    table = np.asarray(params["embed"]["table"])
    _rewrite(out, add={"lm_head.weight": table})
    back = HFCheckpoint(out).read_params(abstract)
    assert np.array_equal(back["embed"]["table"], table)
    _rewrite(out, add={"lm_head.weight": table + 1})
    with pytest.raises(ConfigError, match="lm_head.weight differs from model.embed_tokens.weight"):
        HFCheckpoint(out).read_params(abstract)


def test_sharded_folders_load(tmp_path):
    """A sharded checkpoint (model.safetensors.index.json, as released models ship) reads as the single file."""
    from safetensors.numpy import load_file, save_file

    model = tiny_model("qwen3")
    params = random_params(model)
    out, _ = _export(tmp_path, model, params)
    sd = load_file(str(out / "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(out / f), metadata={"format": "pt"})
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    ck = HFCheckpoint(f"hf:{out}")
    back = ck.read_params(ModelFns(Config(model=model)).abstract_params)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(back)))
    h = hashlib.sha256()
    for f in sorted(shards):
        h.update((out / f).read_bytes())
    assert ck.identity == "hf:" + h.hexdigest()
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WorkdirError, match="shard model-00002-of-00002.safetensors named in model.safetensors.index.json"):
        HFCheckpoint(f"hf:{out}")


def test_the_weights_hash_is_kept_across_processes_until_a_file_changes(tmp_path, monkeypatch):
    """A second process reads the weights' sha256 from the cache file instead of the weights: shown by
    bytes rewritten in place with size and mtime restored (the cached, now stale, hash comes back); a
    new mtime hashes again. Off, or a torn cache file, changes nothing but the time it takes."""
    import os

    from hybrid_lm.run import hf

    out, _ = _export(tmp_path, tiny_model("llama"), random_params(tiny_model("llama")))
    weights = out / "model.safetensors"
    real = "hf:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    cache = tmp_path / "cache" / "weights_sha256.json"
    monkeypatch.setenv(hf.SHA_CACHE_ENV, str(cache))
    monkeypatch.setattr(hf, "_SHA", {})  # a fresh process
    assert HFCheckpoint(out).identity == real and cache.is_file()
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    with weights.open("r+b") as fh:  # in place: the same inode
        fh.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(hf, "_SHA", {})
    assert HFCheckpoint(out).identity == real  # from the cache file: the weights were not read
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    monkeypatch.setattr(hf, "_SHA", {})
    changed = "hf:" + hashlib.sha256(bytes(data)).hexdigest()
    assert HFCheckpoint(out).identity == changed and len(json.loads(cache.read_text())) == 2
    cache.write_text("{torn")
    monkeypatch.setattr(hf, "_SHA", {})
    assert HFCheckpoint(out).identity == changed and len(json.loads(cache.read_text())) == 1
    monkeypatch.setenv(hf.SHA_CACHE_ENV, "off")
    cache.unlink()
    monkeypatch.setattr(hf, "_SHA", {})
    assert HFCheckpoint(out).identity == changed and not cache.exists()


def test_a_folder_is_a_run_everywhere(tmp_path):
    """``hf:DIR`` (or the folder's path) restores as a run: step 0, its weights, a run id naming the weights."""
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.run.directory import load_run_config, run_path
    from hybrid_lm.run.directory import checkpoint_steps

    model = tiny_model("ministral")
    params = random_params(model)
    out, _ = _export(tmp_path, model, params)
    assert hf_folder(out) == out and hf_folder(f"hf:{out}") == out and run_path(f"hf:{out}") == out
    cfg = load_run_config(f"hf:{out}")
    assert cfg.model == model and cfg.data.seq_len == 32 and cfg.data.tokenizer == "byte"
    assert cfg.train.init_from == HFCheckpoint(out).identity
    assert checkpoint_steps(f"hf:{out}") == [0]
    run = RestoredRun(f"hf:{out}")
    assert run.step == 0 and run.workdir == out
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(jax.device_get(run.params))))
    with pytest.raises(FileNotFoundError, match=r"one set of weights \(step 0\), not step 5"):
        RestoredRun(f"hf:{out}", step=5)
    other = tmp_path / "other"  # other weights, same config: another run id
    other.mkdir()
    write_hf_folder(other, model, random_params(model, seed=3), tokenizer="byte", seq_len=32)
    assert run_id_of(load_run_config(other), {}) != run_id_of(cfg, {})


def test_a_run_directory_is_not_a_folder(tmp_path):
    from hybrid_lm.experiment import config_record

    (tmp_path / "config.json").write_text(json.dumps(config_record(Config())))
    assert hf_folder(tmp_path) is None


def test_swaps_work_on_an_imported_qwen3(tmp_path):
    """The SA paper's training-free protocol on a pretrained model: ``--swap full=sa:W`` keeps its q/k norms."""
    from hybrid_lm.run.directory import load_run_config
    from hybrid_lm.run.swap import swapped_config

    model = tiny_model("qwen3", full=MixerConfig(kind="attention"), efficient=MixerConfig(kind="swa", window=WINDOW))
    out, _ = _export(tmp_path, model, random_params(model), record=False)
    cfg = load_run_config(f"hf:{out}")
    assert cfg.model.qk_norm
    swapped = swapped_config(cfg, ["full=sa:4", "efficient=sa:4"])
    assert (swapped.model.full.kind, swapped.model.efficient.kind) == ("sa", "sa")
    with pytest.raises(ConfigError, match="qk_norm=True: efficient/MixerConfig.kind='lightning'"):
        swapped_config(cfg, ["efficient=lightning"])


# ----------------------------------------------------------------------------- train --init-from hf:DIR

def test_a_gin_config_meets_the_folder():
    imported = model_config_from_hf(hf_dict("ministral"))
    merged, kept = merge_model(ModelConfig(), imported, set(), "hf:x")  # nothing set: the folder's model
    for f in ("vocab_size", "d_model", "n_layers", "layer_pattern", "full", "efficient", "norm_eps"):
        assert getattr(merged, f) == getattr(imported, f)
    assert kept == [] and merged.compute_dtype == "bfloat16"  # what transformers does not hold: the gin's
    with pytest.raises(ConfigError) as e:
        merge_model(ModelConfig(d_model=32, n_heads=4), imported, set(), "hf:x")
    assert "the gin sets d_model=32 (config.json: 64)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"n_layers=10 \(config.json: 4\)"):  # bound, even at the default
        merge_model(ModelConfig(), imported, {"n_layers"}, "hf:x")
    swa = MixerConfig(kind="swa", window=3)
    merged, kept = merge_model(ModelConfig(layer_pattern="1:1", efficient=swa), imported,
                               {"layer_pattern", "efficient"}, "hf:x")
    assert merged.layer_pattern == "1:1" and merged.efficient == swa and merged.d_model == 64
    assert [k.split("=")[0] for k in kept] == ["layer_pattern", "efficient"]


def test_qk_norm_enters_the_run_id_only_when_set():
    assert run_id_of(Config(model=ModelConfig(qk_norm=False)), {}) == run_id_of(Config(), {})
    assert run_id_of(Config(model=ModelConfig(qk_norm=True)), {}) != run_id_of(Config(), {})


def test_the_runs_tokenizer_goes_with_the_export(tmp_path):
    """A BPE run's tokenizer.json is copied as is, with the tokenizer_config.json transformers'
    AutoTokenizer reads (class, special tokens), and the ids in config.json / generation_config.json."""
    from hybrid_lm.data.tokenizer import load_tokenizer, train_bpe

    texts = [f"the {w} of the {v} is in the {w}{v}." for w in ("cat", "dog", "sun") for v in ("red", "big")] * 20
    tok_path = train_bpe(texts, 300, tmp_path / "tok")
    tok = load_tokenizer(str(tok_path))
    model = tiny_model("llama", vocab_size=tok.vocab_size)
    out = tmp_path / "hf"
    out.mkdir()
    cfg = write_hf_folder(out, model, random_params(model), tokenizer=str(tok_path), seq_len=32)
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["tokenizer_class"], tc["eos_token"], tc["pad_token"], tc["model_max_length"]) == (
        "PreTrainedTokenizerFast", "<|endoftext|>", "<|pad|>", 32)
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["bos_token_id"]) == (tok.eos_id, tok.pad_id, None)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    ck = HFCheckpoint(out)
    assert ck.tokenizer_spec() == str(out) and load_tokenizer(ck.tokenizer_spec()).fingerprint == tok.fingerprint


def test_bf16_checkpoints_read_into_fp32_parameters(tmp_path):
    """Released checkpoints are bf16: read exactly (bf16 -> fp32 is exact), the dtype is the compute dtype."""
    import ml_dtypes

    model = tiny_model("smollm3")
    params = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), random_params(model))
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_folder(out, model, params, tokenizer="byte", seq_len=32, dtype="bfloat16")
    ck = HFCheckpoint(out)
    assert ck.model_config().compute_dtype == "bfloat16"
    back = ck.read_params(ModelFns(Config(model=model)).abstract_params)
    for a, b in zip(_leaves(params), _leaves(back)):
        assert b.dtype == np.float32 and np.array_equal(a.astype(np.float32), b)
