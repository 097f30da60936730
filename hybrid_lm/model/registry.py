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

from hybrid_lm.backends import record_backend, recorded_backends  # noqa: F401  (moved; re-exported)
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
    ssa_sparse: Any = None  # SSA: traced bool, True = the block-sparse stream feeds the residual path


# forward FLOPs per token of one layer: (model_cfg, mixer_cfg, seq_len) -> {"matmul": .., "mixing": ..}
FlopsFn = Callable[[ModelConfig, MixerConfig, int], dict]


@dataclass(frozen=True)
class MixerSpec:
    name: str
    cls: type
    flops: FlopsFn
    options: type | None = None  # dataclass of mixer-specific options (MixerConfig.options keys)
    needs_window: bool = False
    description: str = ""

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
        opts = self.parse_options(mc)
        check = getattr(opts, "validate", None)
        if check is not None:
            check()


_REGISTRY: dict[str, MixerSpec] = {}


def register_mixer(name: str, *, flops: FlopsFn, options: type | None = None, needs_window: bool = False,
                   description: str = ""):
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"mixer {name!r} registered twice")
        _REGISTRY[name] = MixerSpec(name, cls, flops, options, needs_window, description)
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
