"""What each layer of a model runs on this platform, and why (``hybrid-lm info CONFIG --backends``).

Each slot's mixer is traced abstractly (a training forward through ``jax.eval_shape``: no compute,
no allocation) and the backends its calls record (``hybrid_lm.backends.record_backend``) are read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.backends import record_backend, recorded_backends, recorded_reasons
from hybrid_lm.model.registry import SLOTS, MixerContext, document_mask_error, get_mixer
from hybrid_lm.ops.attention import default_positions, segment_positions


def _trace_mixer(cfg, mc, layer_idx: int, seq_len: int, batch: int,
                 document_mask: bool = False) -> dict[str, tuple[str | None, str]]:
    """``{op: (backend, reason)}`` one training forward of this mixer records, traced abstractly; an
    error while tracing (say an explicit backend that cannot run here) ends it as op ``"error"``, and
    so does a mixer that cannot mask documents under ``document_mask``."""
    cls = get_mixer(mc.kind).cls
    if document_mask and (msg := document_mask_error(mc, SLOTS[cfg.layer_types()[layer_idx]], seq_len)):
        return {"error": (None, msg)}

    def forward(x):
        mixer = cls(cfg, mc, layer_idx, rngs=nnx.Rngs(0))
        if document_mask:  # one document per row: the same dispatch as any packing
            seg = jnp.zeros((batch, seq_len), jnp.int32)
            ctx = MixerContext(positions=segment_positions(seg), attention_impl=cfg.attention_impl, segment_ids=seg)
        else:
            ctx = MixerContext(positions=default_positions(batch, seq_len), attention_impl=cfg.attention_impl)
        return mixer(x, ctx)

    saved_reasons = recorded_reasons()
    saved = recorded_backends(clear=True)  # this trace's record alone, the caller's put back after it
    try:
        error = None
        try:
            jax.eval_shape(forward, jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), jnp.dtype(cfg.compute_dtype)))
        except Exception as e:  # reported in the table, after what resolved before it
            error = f"{type(e).__name__}: {e}"
        reasons = recorded_reasons()
        out = {op: (b, reasons.get(op, "")) for op, b in recorded_backends().items()}
        if error is not None:
            out["error"] = (None, error)
        return out
    finally:
        recorded_backends(clear=True)
        for op, backend in saved.items():
            record_backend(op, backend, saved_reasons.get(op, ""))


def describe_layers(model_cfg, seq_len: int, *, batch: int = 1, document_mask: bool = False) -> list[dict]:
    """What each layer's ops resolve to on this platform for ``[batch, seq_len]`` inputs in the
    compute dtype: one row per layer and op, ``{"layer", "slot", "kind", "window", "block", "op",
    "backend", "reason"}`` (``op``/``backend`` ``None`` for a mixer that dispatches nothing; op
    ``"error"`` with the message as reason where tracing failed). Each slot's mixer is traced once
    (training forward, no compute; with segment ids under ``document_mask``, i.e.
    ``DataConfig.document_mask``) and its record read."""
    traced: dict[str, dict] = {}
    rows = []
    for i, t in enumerate(model_cfg.layer_types()):
        mc = model_cfg.mixer(t)
        if t not in traced:
            traced[t] = _trace_mixer(model_cfg, mc, i, seq_len, batch, document_mask)
        block = getattr(get_mixer(mc.kind).parse_options(mc), "block_size", None)
        base = {"layer": i, "slot": SLOTS[t], "kind": mc.kind, "window": mc.window, "block": block}
        if not traced[t]:
            rows.append({**base, "op": None, "backend": None, "reason": "no dispatched op"})
        for op, (backend, reason) in traced[t].items():
            rows.append({**base, "op": op, "backend": backend, "reason": reason})
    return rows


def format_layers(rows: list[dict]) -> list[str]:
    """:func:`describe_layers` rows as aligned text lines (a header, then one line per row)."""
    def span(r):
        parts = ([f"w={r['window']}"] if r["window"] is not None else []) + (
            [f"block={r['block']}"] if r["block"] is not None else [])
        return " ".join(parts) or "-"
    table = [("layer", "slot", "mixer", "window/block", "op", "backend", "reason")]
    table += [(str(r["layer"]), r["slot"], r["kind"], span(r), r["op"] or "-", r["backend"] or "-", r["reason"])
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6] for row in table]
