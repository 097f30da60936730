"""Training-free attention swaps and receptive-field constraints: parsing and config rewriting.

A trained run's config is rewritten, without retraining, with

- its attention layers switched to another attention mixer: a slot (``full`` or ``efficient``)
  becomes ``swa`` / ``sa`` at window w, ``moba`` at a key budget w (= top_k x block_size), full
  ``attention``, or ``attention_sink``. These mixers all hold exactly the parameters of
  :class:`hybrid_lm.model.attention.Attention` (wq, wk, wv, wo), so the checkpoint loads unchanged.
  Every swap is checked against the checkpoint's parameter tree before anything is restored: a swap
  whose parameters differ (e.g. to or from ``sa_swa``, which adds gates, or a recurrent mixer) is
  refused with a :class:`SwapError` naming the layers and parameters;
- its full-attention layers limited to the last H tokens plus S sink tokens (the Rethinking paper's
  receptive-field constraint, ``eval_sliding_window`` / ``eval_attention_sink_size``): the full slot
  becomes ``attention_sink`` with ``{'horizon': H, 'sinks': S}`` (``model/constrained_attention.py``).

:func:`swapped_config` applies swaps, constraint and eval overrides (``seq_len``, ``eval_windows``,
``attention_impl``) to a run's config and validates them; nothing is restored or allocated. The
evaluation on the checkpoint is :meth:`hybrid_lm.run.restore.RestoredRun.evaluate`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import dataclass

import jax

from hybrid_lm.config import Config, MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.experiment import validate_experiment
from hybrid_lm.model.registry import get_mixer
from hybrid_lm.step import ModelFns

SLOTS = {"full": "full", "f": "full", "efficient": "efficient", "e": "efficient"}
SLOT_LETTER = {"full": "F", "efficient": "E"}


class SwapError(ConfigError):
    """A swap or constraint that cannot be applied to this checkpoint; the message says why."""


# ----------------------------------------------------------------------------- swap specs

@dataclass(frozen=True)
class Swap:
    """``SLOT=KIND[:W][,key=value...]``, e.g. ``full=swa:128``, ``efficient=sa:64,eval_draws=4``,
    ``full=moba:256,block_size=32,gate=moba``, ``full=attention_sink:512,sinks=4``.

    W is the window for windowed mixers (``swa``, ``sa``, ...), the key budget ``top_k * block_size``
    for block-sparse ones (``moba``: top_k = W / block_size), the horizon for ``attention_sink``; full
    ``attention`` takes none. ``key=value`` pairs are mixer options (values parsed as Python/JSON
    literals, else kept as strings).
    """

    slot: str
    kind: str
    size: int | None = None
    options: tuple = ()  # ((key, value), ...) in the order given
    spec: str = ""

    def to_dict(self) -> dict:
        return {"slot": self.slot, "kind": self.kind, "size": self.size, "options": dict(self.options),
                "spec": self.spec}


def _literal(text: str):
    for parse in (ast.literal_eval, json.loads):
        try:
            return parse(text)
        except (ValueError, SyntaxError, json.JSONDecodeError):
            pass
    return text


def parse_swap(spec: str) -> Swap:
    if not isinstance(spec, str) or "=" not in spec:
        raise SwapError(f"swap {spec!r}: expected SLOT=KIND[:W][,key=value...], e.g. full=swa:128")
    slot_text, rest = spec.split("=", 1)
    slot = SLOTS.get(slot_text.strip().lower())
    if slot is None:
        raise SwapError(f"swap {spec!r}: slot {slot_text!r} must be 'full' or 'efficient'")
    head, *pairs = [p.strip() for p in rest.split(",")]
    kind, _, size_text = head.partition(":")
    kind = kind.strip()
    if not kind:
        raise SwapError(f"swap {spec!r}: no mixer kind after '{slot_text}='")
    size = None
    if size_text:
        try:
            size = int(size_text)
        except ValueError:
            raise SwapError(f"swap {spec!r}: W={size_text!r} must be an integer") from None
        if size < 1:
            raise SwapError(f"swap {spec!r}: W={size} must be >= 1")
    options = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise SwapError(f"swap {spec!r}: option {pair!r} must look like key=value")
        options.append((key.strip(), _literal(value.strip())))
    return Swap(slot, kind, size, tuple(options), spec)


def _size_meaning(kind: str) -> str | None:
    """What W means for a mixer kind: 'window', 'budget', 'horizon' or None (takes no W)."""
    if kind == "attention":
        return None
    if kind == "attention_sink":
        return "horizon"
    opts = get_mixer(kind).options
    names = {f.name for f in dataclasses.fields(opts)} if opts is not None else set()
    if {"block_size", "top_k"} <= names:
        return "budget"
    return "window"


def swapped_mixer(old: MixerConfig, swap: Swap) -> MixerConfig:
    """The slot's mixer config after the swap. RoPE / NoPE settings are kept (same parameters, same
    positional encoding); options start from the trained ones only when the kind is unchanged."""
    spec = get_mixer(swap.kind)  # unknown kind -> ConfigError listing the registered ones
    options = dict(old.options) if swap.kind == old.kind else {}
    options.update(dict(swap.options))
    window = old.window if swap.kind == old.kind else None
    meaning = _size_meaning(swap.kind)
    if swap.size is not None:
        if meaning is None:
            raise SwapError(f"swap {swap.spec!r}: {swap.kind!r} takes no window or budget; drop ':{swap.size}'")
        if meaning == "window":
            window = swap.size
        elif meaning == "horizon":
            options["horizon"] = swap.size
        else:  # budget = top_k * block_size
            block = options.get("block_size", getattr(spec.options(), "block_size"))
            if not isinstance(block, int) or block < 1 or swap.size % block:
                raise SwapError(f"swap {swap.spec!r}: the key budget {swap.size} must be a positive multiple "
                                f"of block_size={block!r} (budget = top_k * block_size)")
            top_k = swap.size // block
            if "top_k" in dict(swap.options) and dict(swap.options)["top_k"] != top_k:
                raise SwapError(f"swap {swap.spec!r}: top_k={dict(swap.options)['top_k']} contradicts the "
                                f"budget {swap.size} / block_size {block} = {top_k}")
            options["top_k"] = top_k
    if meaning == "window" and window is None and spec.needs_window:
        raise SwapError(f"swap {swap.spec!r}: {swap.kind!r} needs a window: {swap.slot}={swap.kind}:W")
    if meaning != "window":
        window = None
    mc = dataclasses.replace(old, kind=swap.kind, window=window, options=options)
    spec.check_config(mc, swap.slot)  # bad options -> ConfigError
    return mc


def apply_swaps(model: ModelConfig, swaps=(), horizon: int | None = None, sinks: int = 0) -> ModelConfig:
    """The model config with the swaps and the receptive-field constraint applied (validated)."""
    swaps = [parse_swap(s) if isinstance(s, str) else s for s in swaps]
    types = set(model.layer_types())
    slots = {}
    for s in swaps:
        if s.slot in slots:
            raise SwapError(f"two swaps for the {s.slot} slot: {slots[s.slot].spec!r} and {s.spec!r}")
        if SLOT_LETTER[s.slot] not in types:
            raise SwapError(f"swap {s.spec!r}: the model has no {s.slot} layers (layer pattern "
                            f"{model.layer_pattern!r} = {''.join(model.layer_types())})")
        slots[s.slot] = s
    new = {slot: swapped_mixer(getattr(model, slot), s) for slot, s in slots.items()}
    model = dataclasses.replace(model, **new)
    if sinks and horizon is None:
        raise SwapError(f"sinks={sinks} needs a horizon: the sinks are kept in addition to the last H tokens")
    if horizon is not None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise SwapError(f"horizon={horizon!r} must be an int >= 1 (it counts the query itself)")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise SwapError(f"sinks={sinks!r} must be an int >= 0")
        if "F" not in types:
            raise SwapError(f"--horizon constrains the full-attention layers, and layer pattern "
                            f"{model.layer_pattern!r} has none")
        if model.full.kind != "attention":
            how = f"after swap {slots['full'].spec!r}" if "full" in slots else "in this run"
            raise SwapError(f"--horizon constrains full-attention layers, but the full slot is "
                            f"{model.full.kind!r} {how}; for an explicit setting use "
                            f"--swap full=attention_sink:H,sinks=S")
        full = dataclasses.replace(model.full, kind="attention_sink", window=None,
                                   options={"horizon": horizon, "sinks": sinks})
        get_mixer("attention_sink").check_config(full, "full")
        model = dataclasses.replace(model, full=full)
    return model


# ----------------------------------------------------------------------------- parameter check

def _flat_shapes(tree) -> dict[str, tuple]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = tuple(leaf.shape)
    return out


def check_params_match(trained: Config, swapped: Config) -> None:
    """Raise :class:`SwapError` unless the swapped model's parameters are the checkpoint's (same
    paths, shapes and dtypes)."""
    a = _flat_shapes(ModelFns(trained).abstract_params)
    b = _flat_shapes(ModelFns(swapped).abstract_params)
    if a == b:
        return
    problems = []
    for p in sorted(set(a) - set(b)):
        problems.append(f"{p}: in the checkpoint, not taken by the swapped model")
    for p in sorted(set(b) - set(a)):
        problems.append(f"{p}: needed by the swapped model, not in the checkpoint")
    for p in sorted(set(a) & set(b)):
        if a[p] != b[p]:
            problems.append(f"{p}: shape {a[p]} in the checkpoint, {b[p]} in the swapped model")
    tm, sm = trained.model, swapped.model
    kinds = ", ".join(f"{slot} {getattr(tm, slot).kind} -> {getattr(sm, slot).kind}"
                      for slot in ("full", "efficient") if getattr(tm, slot).kind != getattr(sm, slot).kind)
    shown = "\n  ".join(problems[:12]) + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else "")
    raise SwapError(f"the swap ({kinds or 'options only'}) changes the parameters, so the checkpoint cannot "
                    f"be loaded unchanged; training-free swaps are between mixers with attention's "
                    f"parameters (attention, swa, sa, moba, attention_sink):\n  {shown}")


# ----------------------------------------------------------------------------- the run's config

def swapped_config(cfg: Config, swaps=(), horizon: int | None = None, sinks: int = 0, *,
                   seq_len: int | None = None, eval_windows: int | None = None,
                   attention_impl: str | None = None) -> Config:
    """The run's config with swaps, constraint and eval overrides applied, validated, and checked to
    take the checkpoint's parameters unchanged (nothing is restored or allocated)."""
    model = apply_swaps(cfg.model, swaps, horizon, sinks)
    if attention_impl is not None:
        model = dataclasses.replace(model, attention_impl=attention_impl)
    data = cfg.data
    if seq_len is not None:
        data = dataclasses.replace(data, seq_len=int(seq_len))
    if eval_windows is not None:
        data = dataclasses.replace(data, eval_windows=int(eval_windows))
    new = dataclasses.replace(cfg, model=model, data=data)
    validate_experiment(new, purpose="eval")  # no warnings about how the run was trained
    check_params_match(cfg, new)
    return new


def describe(model: ModelConfig) -> dict:
    return {slot: {"kind": mc.kind, "window": mc.window, "options": dict(mc.options), "rope": mc.rope}
            for slot, mc in (("full", model.full), ("efficient", model.efficient))}


__all__ = ["Swap", "SwapError", "apply_swaps", "check_params_match", "describe", "parse_swap", "swapped_config",
           "swapped_mixer"]
