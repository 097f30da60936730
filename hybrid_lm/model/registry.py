"""Mixer registry: one file per mixer family registers its layers here.

A mixer is an ``nnx.Module`` built as ``cls(model_cfg, mixer_cfg, layer_idx, rngs=rngs)`` and called
as ``mixer(x, ctx)`` with ``x: [B, T, d_model]`` in the compute dtype and a :class:`MixerContext`.
Adding a mixer: docs/MIXERS.md, "Adding a mixer" (a template of one file, in your own package or in
``hybrid_lm/model/``; a gin file selects it with ``import your_module`` and
``efficient/MixerConfig.kind = 'name'``).

Document masking (``DataConfig.document_mask``): a mixer that honours ``MixerContext.segment_ids``
says so with ``register_mixer(..., document_mask=True)``; otherwise it is refused with that flag on
(``False``: not implemented; a string: why not; a function of ``(mixer_cfg, seq_len)``: the reason
for this config, or None). :func:`check_document_mask` reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax

from hybrid_lm.backends import attention_backend
from hybrid_lm.config import MixerConfig, ModelConfig, check_rope_scaling
from hybrid_lm.errors import ConfigError


@dataclass(frozen=True)
class MixerContext:
    """Per-call information a mixer may need besides its input."""

    positions: jax.Array  # [B, T] original token positions
    attention_impl: str = "xla"  # ModelConfig.attention_impl; each call resolves "auto" itself
    step: Any = 0  # optimizer step (traced int), for per-step randomness (SA permutations)
    seed: int = 0
    example_ids: Any = None  # [B] global example indices (never device-local)
    train: bool = True
    micro_index: Any = 0  # micro-batch index within the step (traced int), for per-micro-batch randomness
    layer: Any = None  # absolute layer index (traced int) under ModelConfig.scan_layers; None: the mixer's own
    # [B, T] document index of each token (DataConfig.document_mask); None: no document masking.
    # With it, ``positions`` restart at 0 per document (hybrid_lm.ops.attention.segment_positions).
    segment_ids: Any = None


# forward FLOPs per token of one layer: (model_cfg, mixer_cfg, seq_len) -> {"matmul": .., "mixing": ..}
FlopsFn = Callable[[ModelConfig, MixerConfig, int], dict]


# DataConfig.document_mask support: True, False (not implemented), a reason string, or
# (mixer_cfg, seq_len) -> reason | None
DocumentMask = bool | str | Callable[[MixerConfig, int], str | None]

# MixerConfig fields besides ``kind`` that a mixer may read; the ones it does not read must stay unset
MIXER_FIELDS = ("window", "rope", "rope_theta", "rope_scaling", "options")
_UNSET = MixerConfig()


@dataclass(frozen=True)
class MixerSpec:
    name: str
    cls: type
    flops: FlopsFn
    reads: tuple[str, ...]  # the MixerConfig fields (of MIXER_FIELDS) the mixer uses
    options: type | None = None  # dataclass of mixer-specific options (MixerConfig.options keys)
    description: str = ""
    document_mask: DocumentMask = False
    decode: str = ""  # the decode state, for help texts (e.g. "a KV cache"); decoding needs prefill + step

    @property
    def decodes(self) -> bool:
        """Whether the mixer has a decode path (``prefill`` and ``step``: ``hybrid-lm generate``, RULER)."""
        return callable(getattr(self.cls, "prefill", None)) and callable(getattr(self.cls, "step", None))

    def document_mask_refusal(self, mc: MixerConfig, seq_len: int) -> str | None:
        """Why this mixer cannot run with ``DataConfig.document_mask`` at ``seq_len``; None if it can."""
        dm = self.document_mask
        if dm is True:
            return None
        if dm is False:
            return "it does not implement document masking"
        return dm if isinstance(dm, str) else dm(mc, seq_len)

    @property
    def needs_window(self) -> bool:
        return "window" in self.reads

    def parse_options(self, mc: MixerConfig):
        if self.options is None:
            if mc.options:
                raise ConfigError(f"mixer {self.name!r} takes no options, got {sorted(mc.options)}")
            return None
        known = {f.name for f in dataclasses.fields(self.options)}
        unknown = set(mc.options) - known
        if unknown:
            raise ConfigError(f"mixer {self.name!r}: unknown options {sorted(unknown)}; known: {sorted(known)}")
        return self.options(**mc.options)

    def check_config(self, mc: MixerConfig, slot: str) -> None:
        if self.needs_window and mc.window is None:
            raise ConfigError(f"{slot}/MixerConfig.window must be set for mixer {self.name!r}")
        for f in MIXER_FIELDS:
            if f != "options" and f not in self.reads and getattr(mc, f) != getattr(_UNSET, f):
                raise ConfigError(f"{slot}/MixerConfig.{f}={getattr(mc, f)!r} is set, but mixer {self.name!r} "
                                  f"does not read {f} (it reads: {', '.join(self.reads) or 'nothing'})")
        if mc.rope_scaling and "rope_scaling" in self.reads:
            check_rope_scaling(mc.rope_scaling, f"{slot}/MixerConfig.rope_scaling")
            if not mc.rope:
                raise ConfigError(f"{slot}/MixerConfig.rope_scaling is set, but {slot}/MixerConfig.rope = False "
                                  "(NoPE): there is no RoPE to scale")
        opts = self.parse_options(mc)  # options for a mixer without any: "takes no options"
        check = getattr(opts, "validate", None)
        if check is not None:
            check()


_REGISTRY: dict[str, MixerSpec] = {}


def register_mixer(name: str, *, flops: FlopsFn, reads: tuple[str, ...], options: type | None = None,
                   description: str = "", document_mask: DocumentMask = False, decode: str = ""):
    """Register a mixer class; ``reads`` names the ``MixerConfig`` fields it uses ("options" iff it has
    an ``options`` dataclass); ``document_mask``: whether it honours ``MixerContext.segment_ids``
    (module docstring); ``decode``: its decode state in words, for the help texts."""
    if set(reads) - set(MIXER_FIELDS) or ("options" in reads) != (options is not None):
        raise ValueError(f"mixer {name!r}: reads={reads} must be drawn from {MIXER_FIELDS} and name "
                         "'options' exactly when an options dataclass is given")

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"mixer {name!r} registered twice")
        _REGISTRY[name] = MixerSpec(name, cls, flops, tuple(reads), options, description, document_mask, decode)
        return cls
    return deco


def _load_builtin_mixers() -> None:
    # Importing a family's module registers its mixers.
    from hybrid_lm.model import mixers  # noqa: F401  (the mixer modules import this one)


def get_mixer(name: str | None) -> MixerSpec:
    _load_builtin_mixers()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown mixer kind {name!r}; registered: {sorted(_REGISTRY)} (a mixer of your own: "
                          "`import your_module` in the gin file, docs/MIXERS.md 'Adding a mixer')")
    return _REGISTRY[name]


def registered_mixers() -> dict[str, MixerSpec]:
    _load_builtin_mixers()
    return dict(_REGISTRY)


# ----------------------------------------------------------------------------- document masking

SLOTS = {"F": "full", "E": "efficient"}  # layer type -> config slot


def check_document_mask(model_cfg: ModelConfig, seq_len: int) -> None:
    """Raise a one-line :class:`ConfigError` unless every layer of ``model_cfg`` can run with
    ``DataConfig.document_mask`` at ``seq_len``: each used slot's mixer declares support
    (``register_mixer(document_mask=...)``), then the attention backend takes segment ids."""
    for t in dict.fromkeys(model_cfg.layer_types()):
        msg = document_mask_error(model_cfg.mixer(t), SLOTS[t], seq_len)
        if msg is not None:
            raise ConfigError(msg)
    # every mixer that takes a document mask today is softmax attention through model.attention.attend
    attention_backend(model_cfg.attention_impl, permuted=False, segments=True)


def document_mask_error(mc: MixerConfig, slot: str, seq_len: int) -> str | None:
    """The one-line refusal of mixer config ``mc`` (in ``slot``) under ``DataConfig.document_mask``;
    None when its mixer masks documents."""
    why = get_mixer(mc.kind).document_mask_refusal(mc, seq_len)
    if why is None:
        return None
    return (f"DataConfig.document_mask=True: {slot}/MixerConfig.kind={mc.kind!r} cannot mask documents: {why}; "
            "turn document_mask off or use attention / swa (docs/MIXERS.md, 'Document masking')")
