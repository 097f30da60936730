"""Tiny models of each transformers family that hybrid_lm maps (``hybrid_lm/run/hf.py``), shared by the
CPU tests (``tests/test_hf_interop.py``: round trip, mapping, refusals) and the parity check against
transformers (``tests/gpu/test_gpu_hf_parity.py``).

- :data:`OURS`: hybrid_lm models, each with the family ``hybrid-lm export --format hf`` must write;
- :data:`THEIRS`: transformers config classes' keyword arguments (a small model of each family) and the
  hybrid_lm layers they must import as: ``(layer types, slot kinds)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hybrid_lm.config import Config, MixerConfig, ModelConfig

BASE = dict(vocab_size=320, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=96, norm_eps=1e-5,
            compute_dtype="float32", attention_impl="xla")
WINDOW = 5  # every sliding layer's window: shorter than the test sequences, so it masks
# Llama 3.1's RoPE scaling at a length where head_dim 16 and theta 5e5 put one frequency in each of its
# three bands (kept, interpolated, divided by factor): wavelengths 6.3, 32.5, 169, ... against 64/8 and 64/1
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 64}
# YaRN as Qwen3 enables it for long contexts, at a length where head_dim 24 and theta 1e6 keep frequencies
# 0-2, ramp 3-5 and divide 6-11 by the factor; its attention factor (0.1 ln 4 + 1) scales q and k
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}

# name -> (the family export writes, ModelConfig fields besides BASE)
OURS = {
    "llama": ("llama", dict(layer_pattern="F")),  # GQA, untied head
    "llama_tied": ("llama", dict(layer_pattern="F", n_kv_heads=1, tie_embeddings=True, head_dim=24)),  # MQA, tied
    "llama31": ("llama", dict(layer_pattern="F", full=MixerConfig(kind="attention", rope_theta=5e5, rope_scaling=LLAMA3))),
    "ministral": ("ministral", dict(layer_pattern="1:1", full=MixerConfig(kind="attention", rope_theta=5e5),
                                    efficient=MixerConfig(kind="swa", window=WINDOW, rope_theta=5e5))),
    "qwen3": ("qwen3", dict(layer_pattern="1:1", qk_norm=True, head_dim=24, tie_embeddings=True,
                            full=MixerConfig(kind="attention", rope_theta=1e6),
                            efficient=MixerConfig(kind="swa", window=WINDOW, rope_theta=1e6))),
    "qwen3_yarn": ("qwen3", dict(layer_pattern="1:1", qk_norm=True, head_dim=24, tie_embeddings=True,
                                 full=MixerConfig(kind="attention", rope_theta=1e6, rope_scaling=YARN),
                                 efficient=MixerConfig(kind="swa", window=WINDOW, rope_theta=1e6, rope_scaling=YARN))),
    "smollm3": ("smollm3", dict(layer_pattern="1:3", tie_embeddings=True, full=MixerConfig(kind="attention", rope=False),
                                efficient=MixerConfig(kind="attention", rope_theta=2e6))),
    "smollm3_swa": ("smollm3", dict(layer_pattern="1:1", full=MixerConfig(kind="attention", rope=False),
                                    efficient=MixerConfig(kind="swa", window=WINDOW))),
}

HF_BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
FULL, SLIDING = "full_attention", "sliding_attention"
NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # SmolLM3's default ids exceed vocab 320

# name -> (model_type, config kwargs besides HF_BASE, expected layer types, expected {slot: (kind, window, rope)})
THEIRS = {
    "llama": ("llama", dict(rope_theta=5e5), "FFFF", {"full": ("attention", None, True)}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=24),
                   "FFFF", {"full": ("attention", None, True)}),
    "llama31": ("llama", dict(rope_theta=5e5, rope_scaling={k: v for k, v in LLAMA3.items()}),
                "FFFF", {"full": ("attention", None, True)}),
    "mistral": ("mistral", dict(sliding_window=WINDOW), "EEEE", {"efficient": ("swa", WINDOW, True)}),
    "ministral": ("ministral", dict(sliding_window=WINDOW, layer_types=[FULL, SLIDING, SLIDING, FULL]),
                  "FEEF", {"full": ("attention", None, True), "efficient": ("swa", WINDOW, True)}),
    "qwen3": ("qwen3", dict(head_dim=24, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                            tie_word_embeddings=True),
              "FFEE", {"full": ("attention", None, True), "efficient": ("swa", WINDOW, True)}),
    "qwen3_yarn": ("qwen3", dict(head_dim=24, rope_theta=1e6, rope_scaling=dict(YARN), tie_word_embeddings=True),
                   "FFFF", {"full": ("attention", None, True)}),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, tie_word_embeddings=False, **NO_SPECIALS),
                "EFEF", {"full": ("attention", None, False), "efficient": ("attention", None, True)}),
    "smollm3_swa": ("smollm3", dict(no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=WINDOW,
                                    layer_types=[SLIDING, FULL, SLIDING, FULL], **NO_SPECIALS),
                    "EFEF", {"full": ("attention", None, False), "efficient": ("swa", WINDOW, True)}),
}


def tiny_model(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**BASE, **OURS[name][1], **overrides})


def hf_dict(name: str) -> dict:
    """The config.json contents of :data:`THEIRS` ``name`` (what the config class would write, short of its
    defaults)."""
    model_type, kw, _, _ = THEIRS[name]
    return {"model_type": model_type, **HF_BASE, **kw}


def random_params(model: ModelConfig, seed: int = 0) -> dict:
    """Random fp32 host parameters of ``model`` (matrices N(0, 0.1^2) x 1/sqrt(fan-in) x 3, embeddings N(0, 1),
    norm scales U(0.5, 1.5)), never the init's ones and zeros."""
    import jax

    from hybrid_lm.step import ModelFns

    abstract = ModelFns(Config(model=model)).abstract_params
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if name.endswith("scale"):
            return rng.uniform(0.5, 1.5, leaf.shape).astype(np.float32)
        if name.startswith("embed"):
            return rng.standard_normal(leaf.shape).astype(np.float32)
        fan_in = leaf.shape[0] if not name.endswith(".wo") else leaf.shape[0] * leaf.shape[1]
        return (rng.standard_normal(leaf.shape) * 0.3 / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def logits(model: ModelConfig, params, tokens) -> np.ndarray:
    """fp32 logits ``[B, T, vocab]`` of hybrid_lm's forward pass (eval mode, XLA attention)."""
    import jax
    import jax.numpy as jnp

    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions
    from hybrid_lm.step import ModelFns

    fns = ModelFns(Config(model=dataclasses.replace(model, attention_impl="xla")))

    @jax.jit
    def run(p, t):
        B, T = t.shape
        return fns.model(p)(t, MixerContext(positions=default_positions(B, T), attention_impl="xla", train=False))

    with jax.default_matmul_precision("highest"):
        return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


def layer_summary(model: ModelConfig) -> tuple[str, dict]:
    """``(layer types, {slot: (kind, window, rope)})`` of the slots the layers use."""
    types = "".join(model.layer_types())
    slots = {s: (model.mixer(t).kind, model.mixer(t).window, model.mixer(t).rope)
             for s, t in (("full", "F"), ("efficient", "E")) if t in types}
    return types, slots
