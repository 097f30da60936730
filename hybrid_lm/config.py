"""Typed, frozen experiment config, bound through gin.

The dataclasses below are the schema and the defaults; gin files (``configs/*.gin``) are sparse
overrides. Mixer settings are scoped by layer slot: ``full/MixerConfig.*`` for the full-attention
layers and ``efficient/MixerConfig.*`` for the efficient layers, e.g. NoPE on the full layers only::

    full/MixerConfig.rope = False

Slot defaults live in :data:`SLOT_DEFAULTS` (full: ``attention``; efficient: ``swa`` at window 128).
A binding scoped by slot and kind is a default for that kind only, e.g. the quickstart's SWA window::

    efficient/swa/MixerConfig.window = 32   # used while the efficient slot holds swa

Plain slot bindings (``efficient/MixerConfig.window = 64``) win over kind-scoped ones. Each mixer
declares the ``MixerConfig`` fields it reads; setting one it does not read is a ``ConfigError``
(checked in :mod:`hybrid_lm.validate`), so the run id only varies with fields the mixer reads.

Fields whose metadata says ``run_id=False`` (logging, paths, checkpoint cadence, mesh, run length)
do not define the experiment and are left out of the run id. Extending ``TrainConfig.steps`` on
resume is allowed; other experiment-defining changes need ``--force``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import re
import tokenize
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import gin

from hybrid_lm.errors import ConfigError  # noqa: F401  (re-exported)

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def _meta(run_id: bool = True, **kw):
    return {"run_id": run_id, **kw}


def _not_in_run_id(default, **kw):
    """A field that does not define the experiment (left out of the run id)."""
    return field(default=default, metadata=_meta(False), **kw)


def _in_run_id_when_set(default=dataclasses.MISSING, **kw):
    """An experiment-defining field that enters the run id only when set to a non-default value, so the
    ids of the configs that leave it alone are those computed before the field existed."""
    return field(default=default, metadata=_meta(True, omit_default=True), **kw)


# RoPE frequency scalings a MixerConfig.rope_scaling may name (transformers' ``rope_parameters`` names):
# each kind's required keys, then its optional ones with transformers' defaults. llama3 is Llama 3.1+'s
# long-context rescaling of the inverse frequencies; linear divides them by ``factor``; yarn (YaRN, Qwen's
# and DeepSeek's long-context setting) blends divided and kept frequencies by wavelength and scales q and k
# by an attention factor (``model/layers.py::rope_attention_factor``).
ROPE_SCALINGS = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
    "linear": (("factor",), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None, "mscale_all_dim": None,
              "truncate": True}),
}


def check_rope_scaling(scaling, where: str) -> dict:
    """``scaling`` (``MixerConfig.rope_scaling``: ``{}`` for plain RoPE, or a dict, or its items) as a
    dict, refused in one line unless it is empty or names a known ``rope_type`` with every key it needs
    and no key it does not take."""
    d = dict(scaling or {})
    if not d:
        return d
    kind = d.get("rope_type")
    if kind not in ROPE_SCALINGS:
        raise ConfigError(f"{where}: rope_type={kind!r}: hybrid_lm scales RoPE by "
                          f"{', '.join(map(repr, ROPE_SCALINGS))} only")
    need, optional = ROPE_SCALINGS[kind]
    missing, extra = [k for k in need if k not in d], sorted(set(d) - set(need) - set(optional) - {"rope_type"})
    if missing or extra:
        takes = ", ".join(need) + (f" (and optionally {', '.join(optional)})" if optional else "")
        raise ConfigError(f"{where}: rope_type {kind!r} takes {takes}"
                          + (f"; missing {', '.join(missing)}" if missing else "")
                          + (f"; unknown {', '.join(extra)}" if extra else ""))
    for k in [*need, *optional]:
        v = d.get(k)
        if k == "truncate":  # null: no truncation, as transformers' `if truncate` reads it
            if k in d and not isinstance(v, bool) and v is not None:
                raise ConfigError(f"{where}: rope_type {kind!r}: truncate={v!r} must be true or false")
        elif (k in need or v is not None) and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ConfigError(f"{where}: rope_type {kind!r}: {k}={v!r} must be a positive number")
    if kind == "llama3" and not d["low_freq_factor"] < d["high_freq_factor"]:
        raise ConfigError(f"{where}: rope_type {kind!r}: low_freq_factor={d['low_freq_factor']} must be below "
                          f"high_freq_factor={d['high_freq_factor']}")
    # a null number means transformers' default (it reads them with `or`), kept out of the config
    return {k: (False if k == "truncate" and v is None else v) for k, v in d.items()
            if not (k in optional and k != "truncate" and v is None)}


@gin.configurable
@dataclass(frozen=True)
class MixerConfig:
    """Token mixer of one layer slot. ``kind`` names an entry of the mixer registry."""

    kind: str | None = None  # None: the slot's default ("attention" for full, "swa" for efficient)
    window: int | None = None  # window size for windowed mixers; counts the query itself
    rope: bool = True  # False = NoPE
    rope_theta: float = 10000.0
    # RoPE's frequencies rescaled for a longer context, as transformers' ``rope_parameters`` spells it:
    # {} (plain RoPE) or {"rope_type": "llama3" | "linear" | "yarn", "factor", ...} with the keys of
    # ROPE_SCALINGS (Llama 3.1+, linear interpolation, YaRN; hybrid_lm/model/layers.py::rope_frequencies)
    rope_scaling: dict = _in_run_id_when_set(default_factory=dict)
    options: dict = field(default_factory=dict)  # mixer-specific; checked against the mixer's Options


# Backend settings that no longer exist, and what decides instead (ModelConfig accepts and ignores them).
REMOVED_MODEL_SETTINGS = {
    "sparse_impl": "MoBA / SSA pick the gather kernel where the selection is shared by a GQA group, else the union kernel",
    "selection_impl": "MoBA / SSA select with the split bf16 kernels for the ssa gate on a GPU, else the XLA reference",
    "loss_kernel": "the chunked loss's softmax pass runs the Pallas kernel on one GPU, else XLA",
    "norm_kernel": "RMSNorm runs plain jnp (its kernel gave no train-step gain)",
    "conv_kernel": "the short convs' backward runs the Pallas kernel on one GPU, else jnp",
    "gated_norm_kernel": "GDN's gated output norm runs plain jnp (its kernel gave no train-step gain)",
}
_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger(__name__).warning(msg)


# The mixer of each layer slot when the config names none; the other fields apply while the slot
# holds that kind (a moba efficient slot has no window).
SLOT_DEFAULTS = {"full": MixerConfig(kind="attention"), "efficient": MixerConfig(kind="swa", window=128)}

AttentionImpl = Literal["auto", "xla", "cudnn", "pallas", "jla"]  # resolved in hybrid_lm/backends.py
LinearImpl = Literal["auto", "xla", "jla"]  # resolved in hybrid_lm/backends.py
Remat = Literal["none", "full", "dots", "dots_attn"]
DType = Literal["float32", "bfloat16", "float16"]
Source = Literal["embedded", "tokens"]  # tokens: a prepared token store (hybrid_lm/data/store.py) at DataConfig.path
Optimizer = Literal["adamw", "muon"]  # muon: Muon for hidden matrices, AdamW for the rest (train/optim.py)
DecayShape = Literal["linear", "cosine", "1-sqrt"]
LossImpl = Literal["auto", "full", "chunked"]  # resolved in hybrid_lm/backends.py (loss_backend)
NanPolicy = Literal["stop", "skip"]  # a non-finite loss/gradient never reaches the state


@gin.configurable
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 384
    n_layers: int = 10
    n_heads: int = 3
    n_kv_heads: int = 1
    head_dim: int | None = None  # default d_model // n_heads
    d_ff: int = 960
    layer_pattern: str = "1:1"  # "FE", "FEEE", "1:3", ... tiled over the layers (F = full, E = efficient)
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    # RMSNorm of each head's q and k (a learned scale of head_dim, eps norm_eps) before RoPE, as Qwen3;
    # every softmax-attention mixer takes it (hybrid_lm/model/attention.py), the other mixers refuse it
    qk_norm: bool = _in_run_id_when_set(False)
    init_std: float = 0.02
    compute_dtype: DType = "bfloat16"  # parameters are float32 (model/layers.py); compute runs in this dtype
    attention_impl: AttentionImpl = "auto"
    # linear-attention ops of lightning/mamba2/gdn: auto | xla | jla (hybrid_lm/ops/linear_attention_gpu.py).
    # An execution detail (same math up to rounding), so not part of the run id; recorded in config.json.
    linear_impl: LinearImpl = _not_in_run_id("auto")
    remat: Remat = "none"
    # next-token loss: whole fp32 logits, or chunks of loss_chunk tokens (hybrid_lm/ops/cross_entropy.py);
    # the same math up to float rounding, so not part of the run id
    loss_impl: LossImpl = _not_in_run_id("auto")
    loss_chunk: int = _not_in_run_id(8192)
    scan_layers: bool = _not_in_run_id(False)  # lax.scan over repeated layer groups (same params; hybrid_lm/model/transformer.py)
    full: MixerConfig = field(default_factory=lambda: SLOT_DEFAULTS["full"])
    efficient: MixerConfig = field(default_factory=lambda: SLOT_DEFAULTS["efficient"])
    # Removed backend settings (docs/KERNELS.md, "Removed settings"): still accepted, so that gin files
    # that bind them keep loading; a binding is ignored with a warning. Not fields: not in config.json.
    sparse_impl: InitVar[str | None] = None
    selection_impl: InitVar[str | None] = None
    loss_kernel: InitVar[str | None] = None
    norm_kernel: InitVar[str | None] = None
    conv_kernel: InitVar[str | None] = None
    gated_norm_kernel: InitVar[str | None] = None

    def __post_init__(self, *removed):
        for name, value in zip(REMOVED_MODEL_SETTINGS, removed):
            if value is not None:
                _warn_once(f"ModelConfig.{name}={value!r} is no longer a setting and is ignored: "
                           f"{REMOVED_MODEL_SETTINGS[name]}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def layer_types(self) -> list[str]:
        """'F'/'E' per layer, counting from layer 1."""
        return expand_pattern(self.layer_pattern, self.n_layers)

    def mixer(self, layer_type: str) -> MixerConfig:
        return {"F": self.full, "E": self.efficient}[layer_type]


@gin.configurable
@dataclass(frozen=True)
class DataConfig:
    source: Source = "embedded"
    path: str | None = field(default=None, metadata=_meta(False))  # the store; default: data_cache/<source>
    tokenizer: str = "byte"  # 'byte', or a local tokenizer.json / SentencePiece .model (hybrid_lm/data/tokenizer.py)
    seq_len: int = 256
    eval_windows: int = field(default=64, metadata=_meta(False))  # fixed held-out windows for eval
    # several stores mixed by weight, e.g. (('data_cache/web', 0.7), ('data_cache/code', 0.3));
    # when set it replaces source/path (hybrid_lm/data/pipeline.py)
    mixture: tuple = _in_run_id_when_set(())
    # long/short mixing: documents of >= long_min_tokens tokens are "long"; long_fraction of the
    # training tokens come from them, the rest from the other documents (0: off, plain packing)
    long_min_tokens: int = _in_run_id_when_set(0)
    long_fraction: float = _in_run_id_when_set(0.5)
    # attention never crosses a document boundary and positions restart per document
    document_mask: bool = _in_run_id_when_set(False)


@gin.configurable
@dataclass(frozen=True)
class OptimConfig:
    name: Optimizer = "adamw"
    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # WSD: final fraction of the run spent decaying
    decay_shape: DecayShape = "linear"
    min_lr_ratio: float = 0.0
    z_loss: float = 0.0
    muon_beta: float = 0.95


@gin.configurable
@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=1000, metadata=_meta(False))  # run length; extending it on resume is allowed
    global_batch: int = 16  # sequences per optimizer step
    # the model's randomness: parameter init and the stochastic mixers' draws (SA's permutations, SSA's
    # stream coin); also the order of the training windows unless data_seed is set
    seed: int = 0
    # the order of the training windows (and of a mixture's blocks); None: `seed`. Set it to vary the
    # initialisation and the data order apart (a value equal to `seed` is the same experiment as None)
    data_seed: int | None = _in_run_id_when_set(None)
    log_every: int = _not_in_run_id(10)
    eval_every: int = _not_in_run_id(200)
    progress: bool = _not_in_run_id(True)
    tensorboard: bool = _not_in_run_id(False)  # mirror metrics to <workdir>/tb (needs the [tb] extra)
    wandb: bool = _not_in_run_id(False)  # mirror metrics to Weights & Biases (needs the [wandb] extra; WANDB_MODE=offline works)
    # Gradient accumulation: the global batch is split into this many equal micro-batches. It is an
    # execution detail (same math as the large batch), so it is not part of the run id.
    microbatches: int = _not_in_run_id(1)
    # continued pretraining: start from another run's parameters, with a fresh optimizer state and
    # schedule. `hybrid-lm train --init-from RUN_DIR[@STEP]` sets it to "<source run id>@<step>"
    # (the identity: train/rundir.py; the path is in provenance.json)
    init_from: str | None = _in_run_id_when_set(None)
    nan_policy: NanPolicy = _not_in_run_id("stop")
    max_consecutive_skips: int = _not_in_run_id(10)  # under nan_policy='skip', this many in a row stop the run (train/loop.py)
    profile_start: int = _not_in_run_id(-1)  # trace steps [profile_start, profile_start + profile_steps) (-1: off)
    profile_steps: int = _not_in_run_id(5)

    def __post_init__(self):
        if self.data_seed is not None and not isinstance(self.data_seed, bool) and self.data_seed == self.seed:
            object.__setattr__(self, "data_seed", None)  # one experiment, one run id

    @property
    def data_order_seed(self) -> int:
        """The seed of the training windows' order: ``data_seed``, else ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed


@gin.configurable
@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = _not_in_run_id(200)  # rolling saves, the newest `keep` are kept
    keep: int = _not_in_run_id(3)
    permanent_every: int = _not_in_run_id(0)  # steps divisible by this are never deleted (0: off)
    interval_minutes: float = _not_in_run_id(0.0)  # extra temporary saves on a wall-clock interval (0: off)
    async_save: bool = _not_in_run_id(True)


@gin.configurable
@dataclass(frozen=True)
class MeshConfig:
    data: int = _not_in_run_id(-1)  # -1: all remaining devices
    fsdp: int = _not_in_run_id(1)
    tensor: int = _not_in_run_id(1)
    # logical axis -> mesh axis (or None = replicated); pure data parallelism by default
    rules: tuple = _not_in_run_id((
        ("batch", ("data", "fsdp")),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", None),
        ("head_dim", None),
        ("norm", None),
        ("bias", None),
        ("ssm_heads", None),  # per-head scalars of recurrent mixers: A_log, dt_bias, D
        ("conv_kernel", None),  # short causal conv taps
        ("conv_dim", "tensor"),  # short conv channels
        ("state", None),
        ("lowrank", None),
    ))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def fields_dict(self) -> dict:
        """The fields as plain containers (``dataclasses.asdict``). ``config.json`` adds the resolved
        data identity (``hybrid_lm.experiment.config_record``)."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- layer patterns

def expand_pattern(pattern: str, n_layers: int) -> list[str]:
    """"FE"/"FEEE" strings or "a:b" ratios (a full layers, then b efficient ones), tiled."""
    p = pattern.strip().upper()
    if ":" in p:
        try:
            a, b = (int(x) for x in p.split(":"))
        except ValueError:
            raise ConfigError(f"layer_pattern {pattern!r}: a ratio must look like '1:1' or '1:3'") from None
        if a < 0 or b < 0 or a + b == 0:
            raise ConfigError(f"layer_pattern {pattern!r}: ratio parts must be >= 0 and not both 0")
        if n_layers % (a + b):
            raise ConfigError(
                f"layer_pattern {pattern!r}: a ratio a:b repeats a group of a full then b efficient layers, and "
                f"a + b = {a + b} does not divide n_layers={n_layers}; ratios that fit {n_layers} layers: "
                f"{', '.join(repr(r) for r in _ratios_for(n_layers)) or 'none (use a tiled string)'}")
        p = "F" * a + "E" * b
    if not p or set(p) - {"F", "E"}:
        raise ConfigError(f"layer_pattern {pattern!r}: use letters F (full) and E (efficient), or a ratio 'a:b'")
    if n_layers % len(p):
        raise ConfigError(
            f"layer_pattern {pattern!r} has length {len(p)}, which does not divide n_layers={n_layers}: a tiled "
            f"string's length must divide n_layers (or give a ratio such as "
            f"{' or '.join(repr(r) for r in _ratios_for(n_layers)[:2]) or '1:1'})")
    return list(p * (n_layers // len(p)))


def _ratios_for(n_layers: int, most: int = 6) -> list[str]:
    """Ratios 'a:b' (a, b >= 1, in lowest terms) whose group of a + b layers divides ``n_layers``, fewest
    layers per group first."""
    out = [f"{a}:{n - a}" for n in range(2, n_layers + 1) if n_layers % n == 0
           for a in range(1, n) if math.gcd(a, n - a) == 1]
    return out[:most]


# ----------------------------------------------------------------------------- gin loading

_CONFIGURABLES = (MixerConfig, ModelConfig, DataConfig, OptimConfig, TrainConfig, CheckpointConfig, MeshConfig)


def parse_config(gin_files: list[str] | tuple[str, ...] = (), gin_params: list[str] | tuple[str, ...] = ()) -> Config:
    """Parse gin files and ``k=v`` bindings into a :class:`Config`, unchecked (allocates nothing).
    ``hybrid_lm.experiment.load_config`` parses and validates."""
    gin.clear_config()
    gin.add_config_file_search_path(str(CONFIGS_DIR))
    gin.add_config_file_search_path(str(CONFIGS_DIR.parent))
    for f in gin_files:
        if not Path(f).exists() and not (CONFIGS_DIR / f).exists():
            raise ConfigError(f"gin file not found: {f}")
        gin.add_config_file_search_path(str(Path(f).resolve().parent))
    files = [str(f if Path(f).exists() else CONFIGS_DIR / f) for f in gin_files]
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL)  # gin logs an ERROR for every search path an include is not in
    try:
        gin.parse_config_files_and_bindings(files, list(gin_params), finalize_config=False)
    except (ValueError, ImportError, SyntaxError, OSError, tokenize.TokenError) as e:
        raise _binding_error(e, list(gin_params)) from None
    finally:
        root.setLevel(level)
    return Config(model=ModelConfig(full=_slot_mixer("full"), efficient=_slot_mixer("efficient")),
                  data=DataConfig(), optim=OptimConfig(), train=TrainConfig(), checkpoint=CheckpointConfig(),
                  mesh=MeshConfig())


_NO_PARAMETER = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_NO_CONFIGURABLE = re.compile(r"No configurable matching '([\w./]+)'")
_GIN_WHERE = re.compile(r'In (?:bindings string line (\d+)|file "(.*?)", line (\d+))\s*(.*)$')


def _did_you_mean(word: str, choices) -> str | None:
    """The choice closest to ``word`` (case aside), or None when none is close (difflib's 0.6 ratio)."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def _binding_index(bindings: list[str], line: int) -> int | None:
    """The index in ``bindings`` of line ``line`` (1-based) of gin's bindings string (the bindings joined by
    newlines)."""
    end = 0
    for i, b in enumerate(bindings):
        end += b.count("\n") + 1
        if line <= end:
            return i
    return None


def _unknown_name(text: str) -> str | None:
    """A misspelt field or configurable in gin's message, said with the closest name ("did you mean")
    or the names there are."""
    m = _NO_PARAMETER.search(text)
    if m:
        cls = {c.__name__: c for c in _CONFIGURABLES}.get(m.group(1).split(".")[-1])
        if cls is None:
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        near = _did_you_mean(m.group(2), names)
        return (f"{cls.__name__} has no field {m.group(2)!r}; "
                + (f"did you mean {near!r}?" if near else f"its fields: {', '.join(names)}"))
    m = _NO_CONFIGURABLE.search(text)
    if m:
        names = [c.__name__ for c in _CONFIGURABLES]
        near = _did_you_mean(m.group(1).split("/")[-1], names)
        return (f"no configurable named {m.group(1)!r}; "
                + (f"did you mean {near!r}?" if near else f"the configurables: {', '.join(names)}"))
    return None


def _binding_error(e: Exception, bindings: list[str]) -> ConfigError:
    """gin's parse error as one line. A misspelt name gets "did you mean"; the error carries
    ``binding`` (the index in ``bindings`` of the binding at fault, None when a gin file holds it),
    ``binding_text`` and ``reason`` (the message without the binding), so that a caller that merged
    bindings from several places (a sweep spec) can name where the bad one came from."""
    text = " ".join(str(e).split())
    where = _GIN_WHERE.search(text)
    unknown = _unknown_name(text)
    index = None
    if where and where.group(1):
        index = _binding_index(bindings, int(where.group(1)))
    elif isinstance(e, SyntaxError) and not getattr(e, "filename", None) and getattr(e, "lineno", None):
        index = _binding_index(bindings, int(e.lineno))
    if unknown and where:
        binding = where.group(4).strip()
        place = f"binding {index + 1}" if index is not None else f"{where.group(2)}, line {where.group(3)}"
        err = ConfigError(f"bad gin binding {binding!r} ({place}): {unknown}")
        err.reason, err.binding_text = unknown, binding
    else:
        said = _gin_error(e)
        err = ConfigError(f"bad gin binding: {said}")
        if index is not None:  # the binding is named by the caller: drop gin's quote of it and its line
            said = re.sub(r"\s*\(line \d+\)$", "", re.sub(r"^'.*?' \(line \d+\): ", "", said))
        err.reason, err.binding_text = said, (bindings[index] if index is not None else None)
    err.binding = index
    return err


def _gin_error(e: Exception) -> str:
    """gin's parse error without the Python object it could not read (``<ast.Name object at 0x..>``); a
    bare word as a value gets the hint that strings need quotes."""
    if isinstance(e, tokenize.TokenError):  # e.g. an unclosed bracket: ('unexpected EOF ...', (1, 0))
        return f"{e.args[0]} (an unclosed bracket or quote?)"
    text = " ".join(str(e).split())
    token = re.search(r"Failed to parse token '(.*?)'", text)
    if not token:
        return text
    where = re.search(r"\(([^()]*line \d+)\)$", text)
    binding = " ".join((getattr(e, "text", None) or "").split())
    key = binding.split("=")[0].strip() if "=" in binding else "ModelConfig.field"
    return (f"{binding!r}{f' ({where.group(1)})' if where else ''}: cannot read the value {token.group(1)}; "
            f"strings need quotes, e.g. {key} = '{token.group(1)}'")


def gin_binds(scope: str, name: str, configurable: str = "MixerConfig") -> bool:
    """Whether the current gin config binds `[scope/]configurable.name`."""
    try:
        gin.query_parameter(f"{scope}/{configurable}.{name}" if scope else f"{configurable}.{name}")
        return True
    except ValueError:
        return False


def _slot_mixer(slot: str) -> MixerConfig:
    """The slot's mixer: slot bindings, else ``slot/kind`` bindings, else the slot's default for that kind."""
    if gin_binds("", "kind"):  # it would make every layer that kind, the full-attention ones too
        raise ConfigError("MixerConfig.kind is bound without a slot, which sets every layer's mixer; write "
                          "efficient/MixerConfig.kind (the efficient layers) or full/MixerConfig.kind")
    with gin.config_scope(slot):
        plain = MixerConfig()
    kind = plain.kind or SLOT_DEFAULTS[slot].kind
    with gin.config_scope(f"{slot}/{kind}"):
        kinded = MixerConfig()
    base = SLOT_DEFAULTS[slot] if kind == SLOT_DEFAULTS[slot].kind else MixerConfig()
    values = {"kind": kind}
    for f in dataclasses.fields(MixerConfig):
        if f.name == "kind":
            continue
        if gin_binds(slot, f.name) or gin_binds("", f.name):
            values[f.name] = getattr(plain, f.name)
        elif gin_binds(f"{slot}/{kind}", f.name):
            values[f.name] = getattr(kinded, f.name)
        else:
            values[f.name] = getattr(base, f.name)
    if kinded.kind not in (None, kind):
        raise ConfigError(f"{slot}/{kind}/MixerConfig.kind={kinded.kind!r}: a kind-scoped binding "
                          "cannot change the kind")
    return MixerConfig(**values)


def bound_model_fields() -> set[str]:
    """The ``ModelConfig`` fields that the gin config parsed last binds; ``full`` / ``efficient`` when a
    ``MixerConfig`` field of that slot is bound (scoped by the slot, by the slot and a kind, or not
    scoped). Empty when nothing was parsed (a config built in Python)."""
    out = set()
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("full", "efficient") and gin_binds("", f.name, "ModelConfig"):
            out.add(f.name)
    names = [f.name for f in dataclasses.fields(MixerConfig)]
    for slot in ("full", "efficient"):
        kinds = {"attention", "swa", SLOT_DEFAULTS[slot].kind}
        scopes = [slot, ""] + [f"{slot}/{k}" for k in kinds]
        if any(gin_binds(scope, n) for scope in scopes for n in names):
            out.add(slot)
    return out


def operative_gin() -> str:
    return gin.config_str()


# Fields older versions wrote to config.json that no longer exist: read and dropped.
REMOVED_FIELDS = {"train": ("eval_batches",), "model": (*REMOVED_MODEL_SETTINGS, "param_dtype")}
# Removed fields that entered the run id, at the one value they had in every run: they stay in the hashed
# fields, so the run ids of earlier runs hold. ModelConfig.param_dtype (parameters are always float32) was
# validated and hashed but read nowhere.
FIXED_RUN_ID_FIELDS = {"model.param_dtype": "float32"}
RUN_CONFIG_SECTIONS = ("model", "data", "optim", "train", "checkpoint", "mesh")


def wsd_bounds(o: OptimConfig, total_steps: int) -> tuple[int, int]:
    """``(decay_start, decay_steps)`` of a run of ``total_steps``: the last ``decay_fraction`` decays (the
    schedule itself is ``train.optim.wsd_lr``; here, without jax, for the config checks too)."""
    decay = decay_steps(o.decay_fraction, total_steps)
    return total_steps - decay, decay


def decay_steps(decay_fraction: float, total_steps: int) -> int:
    return int(round(decay_fraction * total_steps))


def config_from_dict(d: dict) -> Config:
    """A :class:`Config` from ``config.json`` contents (extra top-level keys such as ``run_id`` are ignored)."""
    d = {sec: {k: v for k, v in d[sec].items() if k not in REMOVED_FIELDS.get(sec, ())}
         for sec in ("model", "data", "optim", "train", "checkpoint", "mesh")}
    m = d["model"]
    m["full"], m["efficient"] = MixerConfig(**m["full"]), MixerConfig(**m["efficient"])
    mesh = d["mesh"]
    mesh["rules"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in mesh["rules"])
    d["data"]["mixture"] = tuple(tuple(e) for e in d["data"].get("mixture", ()))
    return Config(model=ModelConfig(**m), data=DataConfig(**d["data"]), optim=OptimConfig(**d["optim"]),
                  train=TrainConfig(**d["train"]), checkpoint=CheckpointConfig(**d["checkpoint"]),
                  mesh=MeshConfig(**mesh))


# ----------------------------------------------------------------------------- validation

def check_choices(obj) -> None:
    """Every ``Literal``-typed field of a config dataclass (and the ones nested in it) holds one of its choices."""
    hints = get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            check_choices(v)
            continue
        choices = _literal_choices(hints[f.name])
        if choices and v not in choices:
            raise ConfigError(f"{type(obj).__name__}.{f.name}={v!r}: choose one of {', '.join(map(str, choices))}")


def _literal_choices(tp) -> tuple:
    if get_origin(tp) is Literal:
        return get_args(tp)
    return tuple(c for a in get_args(tp) for c in _literal_choices(a))  # Literal[...] | None


def check_config(cfg: Config) -> None:
    """The checks that need nothing beyond the config; :func:`hybrid_lm.experiment.validate_experiment`
    adds the mixer registry's and the tokenizer's."""
    check_choices(cfg)
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(f"n_heads={m.n_heads} does not divide d_model={m.d_model}")
    if m.n_kv_heads < 1 or m.n_heads % m.n_kv_heads:
        raise ConfigError(f"n_kv_heads={m.n_kv_heads} must divide n_heads={m.n_heads}")
    if min(m.d_model, m.n_layers, m.d_ff, m.vocab_size) < 1:
        raise ConfigError("d_model, n_layers, d_ff and vocab_size must be >= 1")
    m.layer_types()  # raises on a bad pattern
    if m.loss_chunk < 1:
        raise ConfigError(f"ModelConfig.loss_chunk={m.loss_chunk} must be >= 1 (tokens per loss chunk)")
    for slot, mc in (("full", m.full), ("efficient", m.efficient)):
        if mc.window is not None and mc.window < 1:
            raise ConfigError(f"{slot}/MixerConfig.window={mc.window}: a window must be >= 1 "
                              "(a window >= seq_len is allowed and means causal full attention)")
    o = cfg.optim
    if not 0.0 <= o.decay_fraction <= 1.0:
        raise ConfigError(f"decay_fraction={o.decay_fraction} must be in [0, 1]")
    if o.lr <= 0:
        raise ConfigError(f"lr={o.lr} must be > 0")
    t = cfg.train
    for name, v in (("TrainConfig.steps", t.steps), ("TrainConfig.global_batch", t.global_batch)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name}={v!r} must be an integer")
    for name, v in (("TrainConfig.seed", t.seed), ("TrainConfig.data_seed", t.data_seed)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{name}={v!r} must be an integer >= 0")
    if t.steps < 1 or t.global_batch < 1:
        raise ConfigError("train steps and global_batch must be >= 1")
    if t.microbatches < 1 or t.global_batch % t.microbatches:
        raise ConfigError(f"microbatches={t.microbatches} must divide global_batch={t.global_batch}")
    if cfg.data.seq_len < 2:
        raise ConfigError(f"seq_len={cfg.data.seq_len} must be >= 2")
    c = cfg.checkpoint
    for name, v, lo in (("TrainConfig.log_every", t.log_every, 1), ("TrainConfig.eval_every", t.eval_every, 1),
                        ("DataConfig.eval_windows", cfg.data.eval_windows, 1),
                        ("CheckpointConfig.every_steps", c.every_steps, 1), ("CheckpointConfig.keep", c.keep, 1),
                        ("CheckpointConfig.permanent_every", c.permanent_every, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
    check_data_config(cfg.data)
    v = t.max_consecutive_skips
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"TrainConfig.max_consecutive_skips={v!r} must be an integer >= 1 (non-finite steps "
                          "in a row that stop a nan_policy='skip' run)")
    im = c.interval_minutes
    if isinstance(im, bool) or not isinstance(im, (int, float)) or not im >= 0 or im == float("inf"):
        raise ConfigError(f"CheckpointConfig.interval_minutes={im!r} must be a finite number >= 0 (0: off)")


def check_data_config(d: DataConfig) -> None:
    if isinstance(d.long_min_tokens, bool) or not isinstance(d.long_min_tokens, int) or d.long_min_tokens < 0:
        raise ConfigError(f"DataConfig.long_min_tokens={d.long_min_tokens!r} must be an integer >= 0 (0: off)")
    if not 0.0 < d.long_fraction < 1.0:
        raise ConfigError(f"DataConfig.long_fraction={d.long_fraction!r} must be in (0, 1): the share of "
                          "training tokens from long documents")
    if not isinstance(d.mixture, tuple):
        raise ConfigError(f"DataConfig.mixture={d.mixture!r} must be a tuple of (store path, weight) pairs")
    for e in d.mixture:
        if not (isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], (int, float)) and not isinstance(e[1], bool) and e[1] > 0):
            raise ConfigError(f"DataConfig.mixture entry {e!r} must be a (store path, weight > 0) pair")


# ----------------------------------------------------------------------------- run identity

def experiment_fields(cfg: Config, data_identity: dict) -> dict[str, Any]:
    """Flat ``section.field -> value`` of the fields that define the experiment. The data enter by
    content (``data.identity``: store fingerprints and the tokenizer's hash, resolved from disk by
    :mod:`hybrid_lm.data.identity`), not by path."""
    out: dict[str, Any] = {"data.identity": data_identity} if data_identity else {}
    out.update(FIXED_RUN_ID_FIELDS)
    for sec in dataclasses.fields(cfg):
        obj = getattr(cfg, sec.name)
        for f in dataclasses.fields(obj):
            if not f.metadata.get("run_id", True):
                continue
            v = getattr(obj, f.name)
            if f.metadata.get("omit_default") and v == _field_default(f):
                continue
            if data_identity and sec.name == "data" and f.name in ("tokenizer", "mixture"):
                continue  # paths: their contents are in data.identity
            if dataclasses.is_dataclass(v):
                for sf in dataclasses.fields(v):
                    if sf.metadata.get("omit_default") and getattr(v, sf.name) == _field_default(sf):
                        continue
                    out[f"{sec.name}.{f.name}.{sf.name}"] = _jsonable(getattr(v, sf.name))
            else:
                out[f"{sec.name}.{f.name}"] = _jsonable(v)
    return out


def _field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _jsonable(v):
    return json.loads(json.dumps(v, default=str))


def run_id_of(cfg: Config, data_identity: dict) -> str:
    """The experiment's id: a hash of :func:`experiment_fields` (``hybrid_lm.experiment.run_id``
    resolves the data identity from disk)."""
    blob = json.dumps(experiment_fields(cfg, data_identity), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
