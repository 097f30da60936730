"""An architecture's spec and short label, sizes aside: what ``hybrid-lm collect`` groups runs by and
what ``hybrid-lm eval-report`` names curves by (``full``, ``swa128``, ``moba16x16``, ``full-nope+swa128``)."""

from __future__ import annotations

import dataclasses
import json

from hybrid_lm.model.registry import get_mixer

# mixer options that change only speed or memory, never the function: left out of specs and labels
SPEED_ONLY_OPTIONS = frozenset({"chunk_size"})
# options shown in the short label even at their defaults, as "<kind><a>x<b>"
_LABEL_OPTIONS = {"moba": ("block_size", "top_k"), "ssa": ("block_size", "top_k"),
                  "attention_sink": ("horizon", "sinks")}


def _plain(v):
    """Options compare as JSON would store them (tuples as lists)."""
    return json.loads(json.dumps(v, default=str))


def arch_spec(model) -> dict:
    """The architecture of a ``ModelConfig``, sizes aside: the layer pattern and, for each slot the
    pattern uses, the mixer kind, its window and RoPE settings (where the mixer reads them), and every
    option set away from the mixer's default (speed-only options left out). Two runs have equal specs
    iff they train the same architecture family. Returns a JSON-ready dict."""
    types = set(model.layer_types())
    spec: dict = {"layer_pattern": model.layer_pattern}
    for slot, t in (("full", "F"), ("efficient", "E")):
        if t not in types:
            continue
        mc = getattr(model, slot)
        m = get_mixer(mc.kind)
        s: dict = {"kind": mc.kind}
        if "window" in m.reads:
            s["window"] = mc.window
        if "rope" in m.reads and not mc.rope:
            s["rope"] = False
        if "rope_theta" in m.reads and mc.rope and mc.rope_theta != 10000.0:
            s["rope_theta"] = mc.rope_theta
        if "rope_scaling" in m.reads and mc.rope and mc.rope_scaling:
            s["rope_scaling"] = dict(mc.rope_scaling)
        if m.options is not None:
            resolved = m.options(**mc.options)
            opts = {}
            for f in dataclasses.fields(m.options):
                if f.name in SPEED_ONLY_OPTIONS:
                    continue
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                value = getattr(resolved, f.name)
                if f.name in _LABEL_OPTIONS.get(mc.kind, ()) or _plain(value) != _plain(default):
                    opts[f.name] = _plain(value)
            if opts:
                s["options"] = opts
        spec[slot] = s
    return spec


def _slot_label(s: dict) -> str:
    kind = s["kind"]
    head = "full" if kind == "attention" else "sink" if kind == "attention_sink" else kind
    opts = dict(s.get("options", {}))
    if kind == "attention_sink":
        horizon, sinks = opts.pop("horizon"), opts.pop("sinks")
        head += f"{horizon}" + (f"s{sinks}" if sinks else "")
    elif kind in _LABEL_OPTIONS:
        head += "x".join(str(opts.pop(k)) for k in _LABEL_OPTIONS[kind])
    if s.get("window") is not None:
        head += str(s["window"])
    if s.get("rope") is False:
        head += "-nope"
    if "rope_theta" in s:
        head += f"-theta={s['rope_theta']:g}"
    if "rope_scaling" in s:
        head += f"-{s['rope_scaling']['rope_type']}x{s['rope_scaling']['factor']:g}"
    for k, v in opts.items():
        v = ",".join(map(str, v)) if isinstance(v, list) else v
        head += f"-{k}={v}"
    return head


def arch_label(spec: dict) -> str:
    """A short readable label of :func:`arch_spec`'s output: ``full`` (all full attention),
    ``swa128`` (a 1:1 hybrid with SWA-128), ``moba16x16`` (block x top-k), ``ssa16x16``,
    ``lightning_1to3`` (other patterns), ``full-nope+swa128`` (a non-default full slot), with options
    away from their defaults appended (``moba16x16-selection=block``)."""
    full, eff = spec.get("full"), spec.get("efficient")
    if eff is None:
        return _slot_label(full)
    label = _slot_label(eff)
    if full is not None and full != {"kind": "attention"}:
        label = f"{_slot_label(full)}+{label}"
    pattern = spec["layer_pattern"]
    if pattern.upper() not in ("1:1", "FE"):
        label += f"_{pattern.replace(':', 'to')}"
    return label
