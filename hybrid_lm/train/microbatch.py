"""The micro-batch rule: how many gradient-accumulation steps a global batch needs on this mesh.

The fastest micro-batch that fits one device was measured per (scale, arch, seq_len) by
``experiments/bench_train.py --sweep-microbatch`` and stored in ``configs/microbatch_h200.json``
(sequences per device). For a run, :func:`microbatches_for` picks the fewest micro-batches ``M`` that
divide the global batch, keep each micro-batch divisible by the batch mesh axes, and put at most the
measured number of sequences on each device. Unmeasured configs keep ``TrainConfig.microbatches``.
Remat changes what fits, so the table names the policy its plain keys were measured under
(``"remat"``, e.g. ``dots_attn``); a sweep under another policy adds keys ending in ``@POLICY``
(``s1/full/16384@none``), which a run under that policy reads first. A run whose policy has no entry
of its own gets the plain key, and its reason says under which policy it was measured. Every plain
S1–S4 entry also fits without remat (the presets' ``ModelConfig.remat = 'none'``: at most 101 GiB of an
H200 at 16 x 16K). Every S1–S5 arch of the table, and MoBA / SSA at S1–S4, has an ``@none`` entry
(measured without remat); at S5 the plain entries (8) do not fit without remat for Mamba-2 / GDN.
:func:`apply_rule` returns the config with that ``M`` set; the sweep launcher
(``hybrid_lm/scaling/launch.py``) applies it to every run, and ``hybrid-lm info`` states it.

What fits depends on the device's memory. The table holds each entry's compiled peak (``peak_gib``) and the
memory limit it was measured under (``memory_limit_gib``: an H200 with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``).
On a device whose limit is smaller (an H100's 80 GB, or an H200 at JAX's default fraction of 0.75), an entry
whose peak exceeds :data:`MEMORY_MARGIN` of the limit gets the most sequences whose estimated peak fits
(:func:`fit_to_memory`): the presets' S4 entries (remat none, 16 x 16K but Mamba-2's 8) need 78-127 GiB; the six
at 16 ran out of memory on an H100 (docs/PERFORMANCE.md, "Memory").
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path

import jax

from hybrid_lm.config import CONFIGS_DIR, Config, ModelConfig
from hybrid_lm.model.accounting import count_params

TABLE = CONFIGS_DIR / "microbatch_h200.json"

# (d_model, n_layers) of the scale presets (configs/scale/s*.gin)
SCALES = {(384, 10): "s1", (512, 12): "s2", (640, 16): "s3", (768, 18): "s4", (1280, 30): "s5"}


def scale_name(m: ModelConfig) -> str | None:
    return SCALES.get((m.d_model, m.n_layers))


def arch_name(m: ModelConfig) -> str:
    """``full`` for an all-full-attention stack, ``ssa`` for SSA, else the efficient slot's mixer kind."""
    kinds = {m.mixer(t).kind for t in set(m.layer_types())}
    if kinds == {"attention"}:
        return "full"
    if "ssa" in kinds:
        return "ssa"
    return m.efficient.kind


# A micro-batch scaled to a smaller device may take at most this fraction of its memory limit (estimated).
MEMORY_MARGIN = 0.95


@lru_cache(maxsize=4)
def _load_table(path: str) -> dict:
    p = Path(path)
    t = json.loads(p.read_text()) if p.exists() else {}
    for k, v in t.get("peak_gib", {}).items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{p.name}: peak_gib[{k!r}] = {v!r}: need a positive number of GiB")
    return t


def _measured(cfg: Config, table: str | Path) -> tuple[int | None, str | None, float | None]:
    """``(sequences per device, the remat policy it was measured under, its compiled peak in GiB)`` for
    this config, if any."""
    scale = scale_name(cfg.model)
    if scale is None:
        return None, None, None
    t = _load_table(str(table))
    key, best, peaks = f"{scale}/{arch_name(cfg.model)}/{cfg.data.seq_len}", t.get("best", {}), t.get("peak_gib", {})
    if f"{key}@{cfg.model.remat}" in best:
        key, remat = f"{key}@{cfg.model.remat}", cfg.model.remat
    else:
        remat = t.get("remat")
    return best.get(key), remat, peaks.get(key)


def device_memory_limit(device=None) -> int | None:
    """Bytes JAX's allocator may take on ``device`` (default: the first device): the card's memory times
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``. None where the backend reports none (the CPU)."""
    if device is None:
        device = jax.devices()[0]
    return (device.memory_stats() or {}).get("bytes_limit")


def fit_to_memory(per_device: int, peak_gib: float | None, memory_limit: int | None, fixed_gib: float = 0.0,
                  measured_limit_gib: float | None = None) -> tuple[int, str]:
    """``(sequences per device, note)``: ``per_device`` as measured where its peak fits within
    :data:`MEMORY_MARGIN` of ``memory_limit`` (bytes), where the device has at least the measuring device's
    limit (``measured_limit_gib``), or where either is unknown; else the most sequences whose estimated
    peak fits. The estimate keeps ``fixed_gib`` (parameters and optimizer state) and scales the rest of the
    peak (activations) with the micro-batch; the sweeps' peaks at two micro-batches fit such a line."""
    if memory_limit is None or peak_gib is None:
        return per_device, ""
    limit_gib = memory_limit / 2 ** 30
    budget = MEMORY_MARGIN * limit_gib
    if peak_gib <= budget or (measured_limit_gib is not None and round(limit_gib, 1) >= measured_limit_gib):
        return per_device, ""
    fixed = fixed_gib if 0 <= fixed_gib < peak_gib else 0.0
    per_sequence = (peak_gib - fixed) / per_device
    scaled = int((budget - fixed) / per_sequence) if budget > fixed else 0
    note = (f"; scaled from {per_device} to {max(scaled, 1)} for this device: its peak {peak_gib:.1f} GiB exceeds "
            f"{MEMORY_MARGIN:.0%} of {limit_gib:.1f} GiB")
    if scaled < 1:
        note += f" (one sequence, estimated {fixed + per_sequence:.1f} GiB, may not fit either)"
    return max(scaled, 1), note


# Bytes per parameter that do not grow with the micro-batch: fp32 parameter, gradient and two AdamW moments.
STATE_BYTES_PER_PARAM = 16


def _fitted(cfg: Config, table: str | Path, memory_limit: int | None):
    """``(measured, remat, peak_gib, fitted, note)`` of this config's entry on a device of ``memory_limit`` bytes."""
    per, remat, peak = _measured(cfg, table)
    if per is None:
        return None, remat, peak, None, ""
    measured_limit = _load_table(str(table)).get("memory_limit_gib")
    fitted, note = fit_to_memory(per, peak, memory_limit, 0.0, measured_limit)
    if fitted != per:  # whether to scale does not depend on the held state: count the parameters only then

        fixed = STATE_BYTES_PER_PARAM * count_params(cfg.model)["total"] / 2 ** 30
        fitted, note = fit_to_memory(per, peak, memory_limit, fixed, measured_limit)
    return per, remat, peak, fitted, note


def measured_per_device(cfg: Config, table: str | Path | None = None, memory_limit: int | None = None) -> int | None:
    """The measured best sequences per device for this config's scale, arch, seq_len and remat policy
    (else the table's own policy), if any (``table`` defaults to :data:`TABLE`), fitted to
    ``memory_limit`` bytes per device when given (:func:`fit_to_memory`)."""
    return _fitted(cfg, TABLE if table is None else table, memory_limit)[3]


def microbatches_for(global_batch: int, per_device: int, batch_shards: int) -> int:
    """The fewest ``M`` dividing ``global_batch`` with ``global_batch / M`` divisible by
    ``batch_shards`` and at most ``per_device * batch_shards`` sequences per micro-batch."""
    if global_batch < 1 or per_device < 1 or batch_shards < 1:
        raise ValueError(f"need global_batch, per_device and batch_shards >= 1, got "
                         f"{global_batch}, {per_device}, {batch_shards}")
    if global_batch % batch_shards:
        raise ValueError(f"global_batch={global_batch} is not divisible by the {batch_shards} batch shards")
    for M in range(1, global_batch + 1):
        micro = global_batch // M
        if global_batch % M == 0 and micro % batch_shards == 0 and micro <= per_device * batch_shards:
            return M
    return global_batch // batch_shards  # one sequence per device


def rule_for(cfg: Config, batch_shards: int, table: str | Path | None = None,
             memory_limit: int | None = None) -> tuple[int, str]:
    """``(microbatches, reason)`` for ``cfg`` on ``batch_shards`` devices along the batch axes, each with
    ``memory_limit`` bytes (None: as measured)."""
    path = TABLE if table is None else table
    per, remat, peak, fitted, note = _fitted(cfg, path, memory_limit)
    if per is None:
        return cfg.train.microbatches, "not measured: TrainConfig.microbatches as configured"
    M = microbatches_for(cfg.train.global_batch, fitted, batch_shards)
    under = "" if remat is None else f" under remat {remat}" + (
        "" if remat == cfg.model.remat else f"; this run's remat is {cfg.model.remat}")
    t = _load_table(str(path))
    where = "" if peak is None or "memory_limit_gib" not in t else (
        f"; peak {peak:.1f} GiB of the {t.get('device', 'measuring device')}'s {t['memory_limit_gib']:.1f}")
    return M, (f"measured best {per} x {cfg.data.seq_len} tokens per device "
               f"({scale_name(cfg.model)}/{arch_name(cfg.model)}, {Path(path).name}{under}{where}){note}")


def apply_rule(cfg: Config, batch_shards: int, table: str | Path | None = None,
               memory_limit: int | None = None) -> tuple[Config, str]:
    """``(cfg with TrainConfig.microbatches set by the rule, reason)``. A config that already sets
    ``microbatches > 1`` keeps it (an explicit choice wins); an unmeasured one is returned as it is.
    ``memory_limit``: bytes per device (:func:`device_memory_limit`), to fit the measured entry to it.
    ``microbatches`` is not part of the run id, so the run's directory does not change."""
    if cfg.train.microbatches != 1:
        return cfg, f"TrainConfig.microbatches = {cfg.train.microbatches} as configured"
    M, why = rule_for(cfg, batch_shards, table, memory_limit)
    if M == cfg.train.microbatches:
        return cfg, why
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=M)), why
