"""Mixer registry: one file per mixer family registers its layers here.

A mixer is an ``nnx.Module`` built as ``cls(model_cfg, mixer_cfg, layer_idx, rngs=rngs)`` and called
as ``mixer(x, ctx)`` with ``x: [B, T, d_model]`` in the compute dtype and a :class:`MixerContext`.
Adding a mixer is one file with ``@register_mixer("name", ...)`` plus one config line
(``efficient/MixerConfig.kind = 'name'``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax

from hybrid_lm.config import MixerConfig, ModelConfig
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


# forward FLOPs per token of one layer: (model_cfg, mixer_cfg, seq_len) -> {"matmul": .., "mixing": ..}
FlopsFn = Callable[[ModelConfig, MixerConfig, int], dict]


# MixerConfig fields besides ``kind`` that a mixer may read; the ones it does not read must stay unset
MIXER_FIELDS = ("window", "rope", "rope_theta", "options")
_UNSET = MixerConfig()


@dataclass(frozen=True)
class MixerSpec:
    name: str
    cls: type
    flops: FlopsFn
    reads: tuple[str, ...]  # the MixerConfig fields (of MIXER_FIELDS) the mixer uses
    options: type | None = None  # dataclass of mixer-specific options (MixerConfig.options keys)
    description: str = ""

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
        opts = self.parse_options(mc)  # options for a mixer without any: "takes no options"
        check = getattr(opts, "validate", None)
        if check is not None:
            check()


_REGISTRY: dict[str, MixerSpec] = {}


def register_mixer(name: str, *, flops: FlopsFn, reads: tuple[str, ...], options: type | None = None,
                   description: str = ""):
    """Register a mixer class; ``reads`` names the ``MixerConfig`` fields it uses ("options" iff it has
    an ``options`` dataclass)."""
    if set(reads) - set(MIXER_FIELDS) or ("options" in reads) != (options is not None):
        raise ValueError(f"mixer {name!r}: reads={reads} must be drawn from {MIXER_FIELDS} and name "
                         "'options' exactly when an options dataclass is given")

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"mixer {name!r} registered twice")
        _REGISTRY[name] = MixerSpec(name, cls, flops, tuple(reads), options, description)
        return cls
    return deco


def _load_builtin_mixers() -> None:
    # Importing a family's module registers its mixers.
    from hybrid_lm.model import mixers  # noqa: F401


def get_mixer(name: str | None) -> MixerSpec:
    _load_builtin_mixers()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown mixer kind {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_mixers() -> dict[str, MixerSpec]:
    _load_builtin_mixers()
    return dict(_REGISTRY)
