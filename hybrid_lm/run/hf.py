"""Hugging Face transformers interop: hybrid_lm models as transformers checkpoints and back.

One mapping, used both ways (``docs/INTEROP.md`` has the table):

- **Config.** A hybrid_lm model is a stack of layers, each full or sliding-window softmax attention with
  RoPE or NoPE, tiled from two slots. transformers expresses that per layer, in four families:
  ``llama`` (every layer full, RoPE), ``ministral`` (``layer_types``: full / sliding, one
  ``sliding_window``), ``qwen3`` (per-head q/k RMSNorm: ``ModelConfig.qk_norm``; ``layer_types`` with
  ``use_sliding_window``) and ``smollm3`` (``no_rope_layers``: 1 = RoPE, 0 = NoPE; ``layer_types`` with
  ``use_sliding_window``). Export picks the first that fits: q/k norm -> qwen3, a NoPE layer ->
  smollm3, a sliding layer -> ministral, else llama. Import also reads ``mistral`` (every layer
  sliding when ``sliding_window`` is set; with ``layer_types`` it is read as ministral, as
  transformers' AutoConfig does). A window is the same number on both sides: transformers' sliding
  mask keeps keys ``k > q - sliding_window`` (``masking_utils.sliding_window_overlay``), our window
  counts the query itself.
- **Parameters.** ``nn.Linear`` holds ``[out, in]``; hybrid_lm's kernels are ``[in, out]`` with the
  heads split out (``wq [d, H, Dh]``, ``wo [H, Dh, d]``): each kernel is transposed (and its heads
  flattened, head-major as transformers' ``view(..., -1, head_dim)``), nothing else. RoPE is the
  rotate-half convention on both sides (``model/layers.py::apply_rope``, transformers'
  ``rotate_half``), so no row permutation; RMSNorm is ``w * x / rms(x)`` with eps inside the root on
  both sides. A tied head writes no ``lm_head.weight``.
- **Refusals.** A layer with no transformers counterpart (sa, sa_swa, moba, ssa, lightning, mamba2,
  gdn, attention_sink), a model_type or option hybrid_lm cannot express (RoPE scaling, biases, an
  activation other than SiLU, ...) is refused in one line naming the layer or field.

:class:`HFCheckpoint` reads a folder (``config.json`` and ``model.safetensors``, or the shards of
``model.safetensors.index.json``): its :class:`~hybrid_lm.config.Config`, its identity
(``hf:<sha256 of the weights>``) and its parameters in hybrid_lm's layout. :func:`write_hf_folder`
writes one (``hybrid-lm export --format hf``). ``hf:DIR`` names a folder wherever a run directory is
taken (``eval``, ``generate``, ``longppl``, ``ruler``, ``lm-eval``, ``train --init-from``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np

from hybrid_lm.config import (ROPE_SCALINGS, SLOT_DEFAULTS, Config, DataConfig, MixerConfig, ModelConfig, TrainConfig,
                              check_rope_scaling)
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.files import atomic_write_json
from hybrid_lm.compile_cache import OFF, user_cache_root
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.model.transformer import pattern_period
from hybrid_lm.optional import optional_import
from hybrid_lm.run.param_names import flatten_params, param_name

log = logging.getLogger(__name__)

PREFIX = "hf:"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
RECORD_KEY = "hybrid_lm"  # config.json entry of an export: the run, step and hybrid_lm's own config
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "ministral": "MinistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
FULL, SLIDING = "full_attention", "sliding_attention"

# transformers 5.17's config defaults (configuration_<family>.py) for the keys a config.json may leave out
_COMMON = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=None,
               hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
               attention_bias=False, mlp_bias=False, initializer_range=0.02)
FAMILY_DEFAULTS = {
    "llama": dict(_COMMON, intermediate_size=11008, num_key_value_heads=None, max_position_embeddings=2048),
    "mistral": dict(_COMMON, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072,
                    sliding_window=4096),
    "ministral": dict(_COMMON, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072,
                      sliding_window=4096, layer_types=None),
    "qwen3": dict(_COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  layer_types=None),
    "smollm3": dict(_COMMON, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=2e6,
                    use_sliding_window=False, sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4,
                    layer_types=None, tie_word_embeddings=True),
}

# why a mixer cannot be written as a transformers layer (export refuses it, naming the layer)
NO_COUNTERPART = {
    "sa": "stochastic attention attends in a random token order, which no transformers model does",
    "sa_swa": "gated SA + SWA mixes two gated attention branches, which no transformers model does",
    "moba": "MoBA's block-sparse top-k attention has no counterpart in Llama, Mistral, Qwen3 or SmolLM3",
    "ssa": "SSA's gated full + block-sparse streams have no transformers counterpart",
    "lightning": "lightning attention is a linear-attention recurrence, not softmax attention",
    "mamba2": "Mamba-2 is a state-space layer, which Llama, Mistral, Qwen3 and SmolLM3 do not have",
    "gdn": "Gated DeltaNet is a linear recurrence, which Llama, Mistral, Qwen3 and SmolLM3 do not have",
    "attention_sink": "transformers' sliding window keeps no sink tokens (with sinks=0 it is swa:H; swap it first)",
}

# hybrid_lm parameter name -> (transformers tensor name, how the array is laid out there)
_BLOCK_NAMES = {
    "mixer.wq": ("self_attn.q_proj.weight", "qkv"), "mixer.wk": ("self_attn.k_proj.weight", "qkv"),
    "mixer.wv": ("self_attn.v_proj.weight", "qkv"), "mixer.wo": ("self_attn.o_proj.weight", "out"),
    "mixer.q_norm.scale": ("self_attn.q_norm.weight", "same"), "mixer.k_norm.scale": ("self_attn.k_norm.weight", "same"),
    "mixer_norm.scale": ("input_layernorm.weight", "same"), "mlp_norm.scale": ("post_attention_layernorm.weight", "same"),
    "mlp.w_gate": ("mlp.gate_proj.weight", "linear"), "mlp.w_up": ("mlp.up_proj.weight", "linear"),
    "mlp.w_down": ("mlp.down_proj.weight", "linear"),
}
_TOP_NAMES = {"embed.table": ("model.embed_tokens.weight", "same"), "final_norm.scale": ("model.norm.weight", "same"),
              "lm_head": ("lm_head.weight", "linear")}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")  # buffers some older checkpoints saved


# ----------------------------------------------------------------------------- parameter names

def hf_tensor_name(name: str) -> tuple[str, str]:
    """``(transformers tensor name, layout)`` of hybrid_lm parameter ``name`` (``blocks.0.mixer.wq``);
    layout: ``same``, ``linear`` (transposed), ``qkv`` (heads flattened, transposed) or ``out``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        hf, layout = _BLOCK_NAMES[m.group(2)]
        return f"model.layers.{m.group(1)}.{hf}", layout
    raise ConfigError(f"parameter {name} has no transformers counterpart")


def to_hf(layout: str, a: np.ndarray) -> np.ndarray:
    """hybrid_lm's array -> transformers' (exact: transposes and reshapes only)."""
    if layout == "same":
        return np.ascontiguousarray(a)
    if layout == "linear":
        return np.ascontiguousarray(a.T)
    if layout == "qkv":  # [d, H, Dh] -> [H * Dh, d]
        return np.ascontiguousarray(a.reshape(a.shape[0], -1).T)
    if layout == "out":  # [H, Dh, d] -> [d, H * Dh]
        return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)
    raise ValueError(layout)


def hf_shape(layout: str, shape: tuple) -> tuple:
    """transformers' shape of a hybrid_lm parameter of ``shape``."""
    if layout == "same":
        return tuple(shape)
    if layout == "linear":
        return tuple(reversed(shape))
    if layout == "qkv":
        return (int(np.prod(shape[1:])), shape[0])
    return (shape[-1], int(np.prod(shape[:-1])))  # out


def from_hf(layout: str, t: np.ndarray, shape: tuple) -> np.ndarray:
    """transformers' array -> hybrid_lm's of ``shape`` (the inverse of :func:`to_hf`)."""
    if layout == "same":
        return np.ascontiguousarray(t)
    return np.ascontiguousarray(t.T.reshape(shape))


def params_to_hf(params, model: ModelConfig) -> dict[str, np.ndarray]:
    """transformers' state dict (numpy, each tensor contiguous) of hybrid_lm ``params`` (a nested tree of
    host arrays, e.g. ``jax.device_get`` of a checkpoint, or :func:`~hybrid_lm.run.param_names.flatten_params`
    of one). A tied head writes no ``lm_head.weight``."""
    out = {}
    for name, leaf in flatten_params(params).items():
        hf, layout = hf_tensor_name(name)
        out[hf] = to_hf(layout, np.asarray(leaf))
    return out


def expected_tensors(abstract) -> dict[str, tuple[str, str, tuple]]:
    """``{transformers name: (hybrid_lm name, layout, hybrid_lm shape)}`` of the parameters ``abstract``
    (a tree of shapes, e.g. ``ModelFns.abstract_params``)."""
    out = {}
    for name, leaf in flatten_params(abstract).items():
        hf, layout = hf_tensor_name(name)
        out[hf] = (name, layout, tuple(leaf.shape))
    return out


# ----------------------------------------------------------------------------- config: hybrid_lm -> transformers

def layer_kinds(model: ModelConfig) -> list[tuple[bool, bool]]:
    """``(sliding, rope)`` of each layer of an exportable model (:func:`check_exportable` first)."""
    return [(model.mixer(t).kind == "swa", model.mixer(t).rope) for t in model.layer_types()]


def check_exportable(model: ModelConfig) -> None:
    """Raise a one-line :class:`ConfigError` unless every layer of ``model`` is a transformers layer."""
    slots = {"F": "full", "E": "efficient"}
    for i, t in enumerate(model.layer_types()):
        kind = model.mixer(t).kind
        if kind not in ("attention", "swa"):
            why = NO_COUNTERPART.get(kind, "it is not full or sliding-window softmax attention, the layers transformers' "
                                           "Llama / Mistral / Qwen3 / SmolLM3 have")
            raise ConfigError(f"--format hf: layer {i} ({slots[t]} slot) is {kind!r}: {why}; export it with --format "
                              "safetensors (hybrid_lm's own names) instead")
    used = [model.mixer(t) for t in dict.fromkeys(model.layer_types())]
    thetas = {mc.rope_theta for mc in used if mc.rope}
    if len(thetas) > 1:
        raise ConfigError(f"--format hf: the RoPE layers use different rope_theta ({', '.join(map(str, sorted(thetas)))}); "
                          "transformers' Llama / Mistral / Qwen3 / SmolLM3 take one rope_theta for every layer")
    if len({json.dumps(mc.rope_scaling, sort_keys=True) for mc in used if mc.rope}) > 1:
        raise ConfigError("--format hf: the RoPE layers use different rope_scaling; transformers' Llama / Mistral / "
                          "Qwen3 / SmolLM3 take one rope_parameters for every layer")
    windows = {mc.window for mc in used if mc.kind == "swa"}
    if len(windows) > 1:
        raise ConfigError(f"--format hf: the sliding-window layers use different windows ({sorted(windows)}); "
                          "transformers' families take one sliding_window for every sliding layer")
    if model.qk_norm and not all(mc.rope for mc in used):
        raise ConfigError("--format hf: qk_norm with NoPE layers: Qwen3 (q/k norm) has no NoPE layers and SmolLM3 "
                          "(NoPE layers) no q/k norm")


def export_family(model: ModelConfig) -> str:
    """The transformers family an exportable model is written as (module docstring)."""
    kinds = layer_kinds(model)
    if model.qk_norm:
        return "qwen3"
    if not all(rope for _, rope in kinds):
        return "smollm3"
    if any(sliding for sliding, _ in kinds):
        return "ministral"
    return "llama"


def hf_config(model: ModelConfig, *, max_position_embeddings: int, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, dtype: str = "float32", record: dict | None = None) -> dict:
    """transformers' ``config.json`` of ``model`` (refused in one line if it has no counterpart).
    ``record`` goes in as the ``hybrid_lm`` entry (transformers keeps unknown keys as attributes)."""
    check_exportable(model)
    family = export_family(model)
    kinds = layer_kinds(model)
    used = [model.mixer(t) for t in dict.fromkeys(model.layer_types())]
    roped = [mc for mc in used if mc.rope]
    theta = float((roped or used)[0].rope_theta)
    scaling = dict(roped[0].rope_scaling) if roped else {}
    if scaling.get("rope_type") == "yarn":  # YaRN's context: transformers warns unless it is factor x original
        max_position_embeddings = max(int(max_position_embeddings),
                                      int(scaling["factor"] * scaling["original_max_position_embeddings"]))
    window = next((mc.window for mc in used if mc.kind == "swa"), None)
    sliding = any(s for s, _ in kinds)
    d = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": model.vocab_size,
         "hidden_size": model.d_model, "intermediate_size": model.d_ff, "num_hidden_layers": model.n_layers,
         "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads,
         "head_dim": model.resolved_head_dim, "hidden_act": "silu", "max_position_embeddings": int(max_position_embeddings),
         "rms_norm_eps": model.norm_eps, "initializer_range": model.init_std,
         "tie_word_embeddings": model.tie_embeddings,
         "rope_parameters": {"rope_type": "default", "rope_theta": theta, **scaling},
         "rope_theta": theta,  # the same value under the key transformers 4.x reads
         "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
         "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
         "dtype": dtype, "torch_dtype": dtype}
    layer_types = [SLIDING if s else FULL for s, _ in kinds]
    if scaling:  # transformers 4.x reads the scaling here (5.x, finding it, takes it over rope_parameters)
        d["rope_scaling"] = scaling
    if family in ("llama", "smollm3"):
        d["mlp_bias"] = False
    if family == "ministral":
        d.update(sliding_window=window, layer_types=layer_types)
    if family == "qwen3":
        # transformers reads layer_types; engines that derive the sliding layers from max_window_layers
        # (layers from that index on slide) agree where the full layers come first, as in Qwen's own configs
        full = layer_types.index(SLIDING) if SLIDING in layer_types else model.n_layers
        prefix = all(t == SLIDING for t in layer_types[full:])
        d.update(use_sliding_window=sliding, sliding_window=window, max_window_layers=full if prefix else model.n_layers,
                 layer_types=layer_types)
    if family == "smollm3":
        d.update(no_rope_layers=[int(r) for _, r in kinds], use_sliding_window=sliding, sliding_window=window,
                 layer_types=layer_types)
    if record is not None:
        d[RECORD_KEY] = record
    return d


# ----------------------------------------------------------------------------- config: transformers -> hybrid_lm

def _get(hf: dict, family: str, key: str):
    return hf[key] if key in hf else FAMILY_DEFAULTS[family].get(key)


def _rope(hf: dict, family: str, where: str) -> tuple[float, dict]:
    """``(rope_theta, rope_scaling)`` of a config (``rope_parameters``, or 4.x's ``rope_theta`` /
    ``rope_scaling``): the scaling as ``MixerConfig.rope_scaling`` takes it ({} for plain RoPE);
    refuses the scalings hybrid_lm does not implement and partial rotary embeddings."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{where}: rope_parameters={rp!r} is not an object")
    per_type = {k: v for k, v in rp.items() if k in (FULL, SLIDING)}
    if per_type:  # one dict per layer type: hybrid_lm takes them when they agree
        if len({json.dumps(v, sort_keys=True) for v in per_type.values()}) > 1:
            raise ConfigError(f"{where}: rope_parameters differ between layer types ({', '.join(per_type)}); "
                              "hybrid_lm maps one rope_theta")
        rp = next(iter(per_type.values()))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial}: hybrid_lm rotates every dimension of a head")
    theta = float(rp.get("rope_theta", hf.get("rope_theta", FAMILY_DEFAULTS[family]["rope_theta"])))
    if rope_type == "default":
        return theta, {}
    if rope_type not in ROPE_SCALINGS:
        raise ConfigError(f"{where}: rope_parameters rope_type={rope_type!r}: hybrid_lm has plain RoPE (rope_type "
                          f"'default') and {', '.join(map(repr, ROPE_SCALINGS))} scaling, no {rope_type} scaling")
    scaling = {"rope_type": rope_type, **{k: v for k, v in rp.items()
                                          if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}}
    if rope_type == "yarn" and scaling.get("original_max_position_embeddings") is None \
            and hf.get("max_position_embeddings"):  # transformers' fallback: the context the config states
        scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
    return theta, check_rope_scaling(scaling, f"{where}: rope_parameters")


def hf_layers(hf: dict, family: str, where: str) -> tuple[list[tuple[bool, bool]], int | None]:
    """``([(sliding, rope)] per layer, sliding_window)`` as transformers' eager / sdpa masks compute them."""
    n = int(_get(hf, family, "num_hidden_layers"))
    window = _get(hf, family, "sliding_window")
    types, rope = hf.get("layer_types"), [True] * n
    if family == "llama":
        types, window = [FULL] * n, None
    elif family == "mistral":
        types = [SLIDING if window is not None else FULL] * n
    elif family == "ministral":
        types = types or [SLIDING if window is not None else FULL] * n
    elif family == "qwen3":
        if not _get(hf, family, "use_sliding_window"):
            window = None
        first = _get(hf, family, "max_window_layers")
        types = types or [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    elif family == "smollm3":
        no_rope = hf.get("no_rope_layers")
        if no_rope is None:
            every = int(_get(hf, family, "no_rope_layer_interval"))
            no_rope = [int((i + 1) % every != 0) for i in range(n)]
        if len(no_rope) < n:
            raise ConfigError(f"{where}: no_rope_layers has {len(no_rope)} entries for {n} layers")
        rope = [bool(r) for r in no_rope[:n]]
        use = bool(_get(hf, family, "use_sliding_window"))
        if types is None:
            types = [SLIDING if use and window is not None and not rope[i] else FULL for i in range(n)]
        elif SLIDING in types and not use:
            raise ConfigError(f"{where}: layer_types names sliding_attention layers but use_sliding_window=false "
                              "(transformers' eager / sdpa masks would slide them, its flash attention not)")
    if len(types) != n:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    odd = sorted(set(types) - {FULL, SLIDING})
    if odd:
        raise ConfigError(f"{where}: layer_types {odd[0]!r}: hybrid_lm maps full_attention and sliding_attention layers only")
    if SLIDING in types and window is None:
        raise ConfigError(f"{where}: layer_types names sliding_attention layers but sliding_window is null"
                          + (" (use_sliding_window=false)" if family == "qwen3" else ""))
    if SLIDING in types and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_window={window!r} must be an integer >= 1")
    return [(t == SLIDING, r) for t, r in zip(types, rope)], (window if SLIDING in types else None)


def _check_supported(hf: dict, family: str, where: str) -> None:
    act = _get(hf, family, "hidden_act")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r}: hybrid_lm's MLP is SwiGLU with SiLU")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true: hybrid_lm's projections have no bias")
    if hf.get("quantization_config"):
        raise ConfigError(f"{where}: quantization_config is set: hybrid_lm imports unquantised weights only")


def _slot_of(kind: tuple[bool, bool], mc: MixerConfig) -> bool:
    return (mc.kind == "swa") == kind[0] and mc.rope == kind[1] and mc.kind in ("attention", "swa")


def model_config_from_hf(hf: dict, where: str = "config.json", record: dict | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of transformers' ``config.json`` contents ``hf`` (refused in one line when
    hybrid_lm cannot express it). ``record``: an export's ``hybrid_lm`` entry; its model settings that
    transformers does not hold (dtypes, init, kernels, the slot order, an unused slot) are taken from it.
    Without one, the checkpoint's ``dtype`` (float32 / bfloat16 / float16) is the compute dtype."""
    family = hf.get("model_type")
    if family == "mistral" and "layer_types" in hf:
        family = "ministral"  # as transformers' AutoConfig reads it
    if family not in FAMILY_DEFAULTS:
        raise ConfigError(f"{where}: model_type {family!r} is not supported: hybrid_lm imports "
                          f"{', '.join(FAMILY_DEFAULTS)}")
    _check_supported(hf, family, where)
    theta, scaling = _rope(hf, family, where)
    kinds, window = hf_layers(hf, family, where)
    combos = list(dict.fromkeys(kinds))
    if len(combos) > 2:
        raise ConfigError(f"{where}: the layers are of {len(combos)} kinds (full / sliding x RoPE / NoPE), and "
                          "hybrid_lm tiles two layer slots")
    old = None
    if isinstance(record, dict) and isinstance(record.get("model"), dict):
        try:
            m = dict(record["model"])
            old = ModelConfig(**{**m, "full": MixerConfig(**m["full"]), "efficient": MixerConfig(**m["efficient"])})
        except (TypeError, KeyError):
            old = None
    # which slot holds which kind of layer: the export's own order when it fits, else full / NoPE in F
    letter = None
    if old is not None:
        guess = {}
        try:
            for k, t in zip(kinds, old.layer_types() if old.n_layers == len(kinds) else []):
                guess.setdefault(k, set()).add(t)
        except ConfigError:
            guess = {}
        if (len(guess) == len(combos) and all(len(v) == 1 and _slot_of(k, old.mixer(next(iter(v))))
                                              for k, v in guess.items())
                and len({next(iter(v)) for v in guess.values()}) == len(guess)):
            letter = {k: next(iter(v)) for k, v in guess.items()}
    if letter is None:
        if len(combos) == 1:
            letter = {combos[0]: "E" if combos[0][0] else "F"}
        else:
            a, b = combos
            first = (a if not a[0] else b) if a[0] != b[0] else (a if not a[1] else b)
            letter = {first: "F", (b if first == a else a): "E"}
    types = [letter[k] for k in kinds]

    pattern = "".join(types[:pattern_period(types)])
    if old is not None and old.n_layers == len(types):
        try:
            if old.layer_types() == types:
                pattern = old.layer_pattern
        except ConfigError:
            pass
    slots = {}
    for k, t in letter.items():
        slot = "full" if t == "F" else "efficient"
        base = getattr(old, slot) if old is not None else None
        slots[slot] = MixerConfig(kind="swa" if k[0] else "attention", window=window if k[0] else None, rope=k[1],
                                  rope_theta=theta if k[1] or base is None else base.rope_theta,
                                  rope_scaling=scaling if k[1] else {})
    for slot in ("full", "efficient"):
        slots.setdefault(slot, getattr(old, slot) if old is not None else SLOT_DEFAULTS[slot])
    hidden, heads = int(_get(hf, family, "hidden_size")), int(_get(hf, family, "num_attention_heads"))
    head_dim = _get(hf, family, "head_dim") or hidden // heads
    kv = _get(hf, family, "num_key_value_heads") or heads
    arch = dict(vocab_size=int(_get(hf, family, "vocab_size")), d_model=hidden, n_layers=len(kinds), n_heads=heads,
                n_kv_heads=int(kv), head_dim=None if head_dim == hidden // heads else int(head_dim),
                d_ff=int(_get(hf, family, "intermediate_size")), layer_pattern=pattern,
                tie_embeddings=bool(_get(hf, family, "tie_word_embeddings")),
                norm_eps=float(_get(hf, family, "rms_norm_eps")), qk_norm=family == "qwen3", **slots)
    if old is not None:
        if old.resolved_head_dim == int(head_dim) and old.d_model == hidden and old.n_heads == heads:
            arch["head_dim"] = old.head_dim
        return dataclasses.replace(old, **arch)
    declared = hf.get("dtype") or hf.get("torch_dtype")  # the checkpoint's dtype: our compute dtype
    extra = {"compute_dtype": declared} if declared in ("float32", "bfloat16", "float16") else {}
    return ModelConfig(**arch, init_std=float(_get(hf, family, "initializer_range") or 0.02), **extra)


# ----------------------------------------------------------------------------- a gin config meets a folder

SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "tie_embeddings",
                "qk_norm")
BEHAVIOUR_FIELDS = ("norm_eps", "layer_pattern", "full", "efficient")


def merge_model(user: ModelConfig, imported: ModelConfig, bound: set[str], where: str) -> tuple[ModelConfig, list[str]]:
    """The model of ``train --init-from hf:DIR``: ``imported`` (the folder's config.json) with what the
    gin sets (``bound``: the fields it binds, plus those that differ from hybrid_lm's defaults). A set
    field that fixes a parameter's shape must agree with the folder (else one-line ConfigError naming
    each); one that does not (norm eps, layer pattern, slot mixers: a continued run may change them)
    is kept and returned as a note. The fields transformers does not hold (dtypes, kernels, init)
    are the gin's."""
    default = ModelConfig()
    bound = set(bound) | {f.name for f in dataclasses.fields(ModelConfig)
                          if getattr(user, f.name) != getattr(default, f.name)}
    out, wrong, kept = {}, [], []
    for f in SHAPE_FIELDS + BEHAVIOUR_FIELDS:
        u, h = getattr(user, f), getattr(imported, f)
        if f == "head_dim":
            same = (u or user.d_model // user.n_heads) == imported.resolved_head_dim
        elif f == "layer_pattern":
            try:
                same = dataclasses.replace(imported, layer_pattern=u).layer_types() == imported.layer_types()
            except ConfigError:
                same = False
        else:
            same = u == h
        if same or f not in bound:
            out[f] = h
        elif f in SHAPE_FIELDS:
            wrong.append(f"{f}={u!r} (config.json: {h!r})")
        else:
            out[f] = u
            kept.append(f"{f}={u!r} (config.json: {h!r})")
    if wrong:
        raise ConfigError(f"--init-from {where}: the gin sets {'; '.join(wrong)}; these fix the parameters' shapes, "
                          "which come from the folder's config.json: drop them from the gin or match them")
    return dataclasses.replace(user, **out), kept


# ----------------------------------------------------------------------------- a folder

def hf_folder(spec) -> Path | None:
    """The folder of ``hf:DIR``, or of a path that is a transformers model folder (a ``config.json`` with a
    ``model_type`` and no run sections); None for anything else (a run directory)."""
    text = str(spec)
    if text.startswith(PREFIX):
        return Path(text[len(PREFIX):]).expanduser()
    p = Path(text).expanduser()
    cfg = p / CONFIG
    if not cfg.is_file() or (p / "checkpoints").exists():
        return None
    try:
        d = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return p if isinstance(d, dict) and "model_type" in d and "model" not in d else None


_SHA: dict[tuple, str] = {}  # this process's weight hashes, by the files' (path, size, mtime, inode)
# The hashes across processes: a JSON file (``off`` turns it off), by default
# ``~/.cache/hybrid_lm/weights_sha256.json`` (``$XDG_CACHE_HOME/hybrid_lm/...`` when that is set). A
# 16 GB checkpoint then is read once, not at every command's start; a file rewritten in place keeps
# its hash only if its size, mtime and inode all stay the same.
SHA_CACHE_ENV = "HYBRID_LM_WEIGHTS_SHA_CACHE"
_SHA_CACHE_ENTRIES = 256  # the newest kept


def _sha_cache_file() -> Path | None:
    value = os.environ.get(SHA_CACHE_ENV)
    if value is not None:
        value = value.strip()
        return None if value.lower() in OFF else Path(value).expanduser()
    return user_cache_root() / "weights_sha256.json"


def _sha_cache_read(path: Path | None) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}  # unreadable or torn by hand: hashed again and rewritten
    return d if isinstance(d, dict) else {}


def _weights_sha256(files: list[Path]) -> str:
    """sha256 of ``files``' bytes in order, through :data:`_SHA` and the cache file."""
    key = tuple((str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino) for f in files for st in [f.stat()])
    if key in _SHA:
        return _SHA[key]
    path, name = _sha_cache_file(), json.dumps(key)
    known = _sha_cache_read(path)
    if isinstance(known.get(name), str):
        _SHA[key] = known[name]
        return _SHA[key]
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    _SHA[key] = h.hexdigest()
    if path is not None:
        known = _sha_cache_read(path)  # again: another process may have added entries meanwhile
        known.pop(name, None)
        known[name] = _SHA[key]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, dict(list(known.items())[-_SHA_CACHE_ENTRIES:]))
        except OSError as e:  # a read-only home: the hash still holds for this process
            log.debug("weights sha256 not cached in %s: %s", path, e)
    return _SHA[key]


class HFCheckpoint:
    """A transformers model folder: ``config.json`` plus ``model.safetensors`` or sharded safetensors
    (``model.safetensors.index.json``). Raises :class:`WorkdirError` (one line) for a missing folder,
    config or weight file, :class:`ConfigError` for a config hybrid_lm cannot express."""

    def __init__(self, path):
        folder = hf_folder(path)
        self.dir = Path(folder if folder is not None else str(path)).expanduser()
        self.spec = f"{PREFIX}{self.dir}"
        if not self.dir.is_dir():
            raise WorkdirError(f"{self.spec}: no such directory")
        cfg = self.dir / CONFIG
        if not cfg.is_file():
            raise WorkdirError(f"{self.spec}: no {CONFIG}, so not a Hugging Face model folder")
        try:
            self.hf = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{cfg}: not readable JSON ({e})") from None
        if not isinstance(self.hf, dict):
            raise ConfigError(f"{cfg}: expected a JSON object")
        rec = self.hf.get(RECORD_KEY)
        self.record = rec if isinstance(rec, dict) else None
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        """``{tensor name: file name}`` over the single file or the shards."""
        optional_import("safetensors")
        from safetensors import safe_open  # the [eval] extra

        single, index = self.dir / WEIGHTS, self.dir / INDEX
        if not single.is_file() and index.is_file():
            try:
                wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                assert isinstance(wm, dict) and all(isinstance(v, str) for v in wm.values())
            except (OSError, ValueError, KeyError, TypeError, AssertionError):
                raise ConfigError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' of "
                                  "tensor -> file)") from None
            missing = sorted({f for f in wm.values() if not (self.dir / f).is_file()})
            if missing:
                raise WorkdirError(f"{self.spec}: shard {missing[0]} named in {INDEX} is missing"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            return dict(wm)
        if not single.is_file():
            other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (self.dir / n).exists()]
            hint = (f" (it has {other[0]}: save it as safetensors, e.g. transformers' "
                    "save_pretrained(..., safe_serialization=True))") if other else ""
            raise WorkdirError(f"{self.spec}: no {WEIGHTS} or {INDEX}{hint}")
        try:
            with safe_open(str(single), framework="np") as f:
                return {k: WEIGHTS for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise ConfigError(f"{single}: not a safetensors file ({str(e).splitlines()[0][:200]})") from None

    @property
    def files(self) -> list[Path]:
        return [self.dir / f for f in sorted(set(self.weight_map.values()))]

    @property
    def family(self) -> str:
        """The model_type as hybrid_lm reads it (a mistral config with layer_types is ministral)."""
        mt = self.hf.get("model_type")
        return "ministral" if mt == "mistral" and "layer_types" in self.hf else str(mt)

    def model_config(self) -> ModelConfig:
        return model_config_from_hf(self.hf, str(self.dir / CONFIG), self.record)

    @property
    def identity(self) -> str:
        """``hf:<sha256>`` of the weight files' bytes, in file-name order (one file: that file's sha256)."""
        return PREFIX + _weights_sha256(self.files)

    def tokenizer_spec(self) -> str:
        """``DataConfig.tokenizer``: the folder when it holds a tokenizer.json / tokenizer.model, else 'byte'."""
        if (self.dir / "tokenizer.json").is_file() or (self.dir / "tokenizer.model").is_file():
            return str(self.dir)
        said = ((self.record or {}).get("data") or {}).get("tokenizer")
        if said != "byte":
            log.warning("%s has no tokenizer.json or tokenizer.model: the byte tokenizer stands in for it", self.spec)
        return "byte"

    def config(self) -> Config:
        """The folder as a hybrid_lm :class:`Config`: the model from config.json, the folder's tokenizer,
        ``DataConfig.seq_len`` = ``max_position_embeddings`` (the trained context, as lm-eval's HF
        backend takes it; an export's own seq_len), and ``TrainConfig.init_from`` = :attr:`identity`
        (so the run id names the weights)."""
        model = self.model_config()  # checks model_type first
        if not getattr(self, "_headers_checked", False):  # the headers' shapes before the weights are hashed
            from hybrid_lm.model.accounting import abstract_params
            self.check_tensors(abstract_params(model))
            self._headers_checked = True
        data = (self.record or {}).get("data") or {}
        seq_len = int(data.get("seq_len") or _get(self.hf, self.family, "max_position_embeddings"))
        return Config(model=model, data=DataConfig(tokenizer=self.tokenizer_spec(), seq_len=seq_len),
                      train=TrainConfig(init_from=self.identity))

    # -- parameters

    def check_tensors(self, abstract) -> dict[str, tuple[str, str, tuple]]:
        """The expected tensors (:func:`expected_tensors`) after checking the folder holds exactly them."""
        want = expected_tensors(abstract)
        have = {k for k in self.weight_map if not _IGNORED_TENSORS.fullmatch(k)}
        missing = sorted(set(want) - have)
        if missing:
            raise ConfigError(f"{self.spec}: tensor {missing[0]} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + " for the model its config.json describes")
        extra = sorted(have - set(want) - ({"lm_head.weight"} if "lm_head" not in abstract else set()))
        if extra:
            raise ConfigError(f"{self.spec}: tensors hybrid_lm cannot express: {', '.join(extra[:3])}"
                              + (f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""))
        self._check_header_shapes(want)
        return want

    def _check_header_shapes(self, want: dict) -> None:
        """Each tensor's shape in the safetensors headers against what config.json needs, before any tensor
        is read (a header may declare any size: reading it first could take the machine's memory)."""
        from safetensors import safe_open

        need = {hf: hf_shape(layout, shape) for hf, (_, layout, shape) in want.items()}
        if "lm_head.weight" in self.weight_map and "lm_head.weight" not in need:  # a tied head, saved as well
            need["lm_head.weight"] = need.get("model.embed_tokens.weight")
        for file in sorted(set(self.weight_map.values())):
            try:
                with safe_open(str(self.dir / file), framework="np") as f:  # reads the header only
                    shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if need.get(k) is not None}
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise ConfigError(f"{self.dir / file}: not a safetensors file ({str(e).splitlines()[0][:200]})") from None
            for k, shape in shapes.items():
                if self.weight_map.get(k) == file and shape != tuple(need[k]):
                    raise ConfigError(f"{self.spec}: tensor {k} has shape {list(shape)} in {file}'s header, the "
                                      f"config needs {list(need[k])} (config.json and the weights disagree)")

    def read_params(self, abstract, shardings=None):
        """The parameters in hybrid_lm's layout, cast to ``abstract``'s dtypes: numpy arrays, or with
        ``shardings`` (a tree like ``abstract`` of shardings) jax arrays laid out on them."""
        from safetensors import safe_open  # the [eval] extra


        want = self.check_tensors(abstract)
        by_name = {name: (hf, layout) for hf, (name, layout, _) in want.items()}
        with contextlib.ExitStack() as stack:
            handles: dict[str, object] = {}

            def read(hf: str) -> np.ndarray:
                f = self.weight_map[hf]
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(self.dir / f), framework="np"))
                return handles[f].get_tensor(hf)

            tied_head = "lm_head" not in abstract and "lm_head.weight" in self.weight_map
            if tied_head and not np.array_equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
                raise ConfigError(f"{self.spec}: tie_word_embeddings=true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")

            def load(path, leaf, sharding=None):
                hf, layout = by_name[param_name(path)]
                t = read(hf)
                if tuple(t.shape) != hf_shape(layout, leaf.shape):
                    raise ConfigError(f"{self.spec}: tensor {hf} has shape {list(t.shape)}, the config needs "
                                      f"{list(hf_shape(layout, leaf.shape))}")
                a = from_hf(layout, t, tuple(leaf.shape)).astype(leaf.dtype)
                if sharding is None:
                    return a
                return jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx])

            if shardings is None:
                return jax.tree_util.tree_map_with_path(load, abstract)
            return jax.tree_util.tree_map_with_path(load, abstract, shardings)


# ----------------------------------------------------------------------------- writing a folder

def _tokenizer_files(spec: str, out: Path, seq_len: int) -> dict:
    """Copy the run's tokenizer (``DataConfig.tokenizer``) into ``out`` for transformers'
    ``AutoTokenizer``; returns its special ids ``{"bos_token_id", "eos_token_id", "pad_token_id"}``."""
    tok = load_tokenizer(spec)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    if tok.kind == "byte":
        return ids
    src = Path(tok.path)
    side = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = src.parent / name
        if f.is_file():
            side[name] = json.loads(f.read_text(encoding="utf-8"))
    if tok.kind == "hf":
        shutil.copyfile(src, out / "tokenizer.json")
        import tokenizers  # the [tokenizers] extra

        pieces = tokenizers.Tokenizer.from_file(str(src))
        tc = dict(side.get("tokenizer_config.json") or {})
        tc.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for role in ("bos", "eos", "pad"):
            i = getattr(tok, f"{role}_id")
            if i is not None and f"{role}_token" not in tc:
                tc[f"{role}_token"] = pieces.id_to_token(int(i))
        tc.setdefault("model_max_length", int(seq_len))
        side["tokenizer_config.json"] = tc
    else:  # SentencePiece: transformers converts it itself
        shutil.copyfile(src, out / "tokenizer.model")
    for name, d in side.items():
        (out / name).write_text(json.dumps(d, indent=2, ensure_ascii=False))
    return ids


def write_hf_folder(out: Path, model: ModelConfig, params, *, tokenizer: str, seq_len: int, dtype: str = "float32",
                    record: dict | None = None) -> dict:
    """Write ``out/config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files
    (``tokenizer`` = the run's ``DataConfig.tokenizer``; 'byte' writes none) of ``model`` with ``params``
    (host arrays, already in ``dtype``). Returns the config written."""
    optional_import("safetensors")
    from safetensors.numpy import save_file  # the [eval] extra

    check_exportable(model)
    out = Path(out)
    ids = _tokenizer_files(tokenizer, out, seq_len)
    cfg = hf_config(model, max_position_embeddings=seq_len, dtype=dtype, record=record, **ids)
    save_file(params_to_hf(params, model), str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(cfg, indent=2))
    gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    (out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2))
    return cfg


__all__ = ["ARCHITECTURES", "FAMILY_DEFAULTS", "HFCheckpoint", "NO_COUNTERPART", "check_exportable", "export_family",
           "expected_tensors", "from_hf", "hf_config", "hf_folder", "hf_layers", "hf_shape", "hf_tensor_name",
           "merge_model", "model_config_from_hf", "params_to_hf", "to_hf", "write_hf_folder"]
