"""A floor on one train step's memory per device, from the config alone: a global batch that cannot fit is
refused in one line before anything is allocated or written (``train`` calls :func:`check_step_fits`
after making the mesh, before the data, the program and the run dir).

The floor counts only what any step must hold at once, whatever the remat policy or the kernels:

- each layer's input for the backward pass (``n_layers x tokens x d_model`` in the compute dtype: full
  remat keeps exactly these), plus one layer's widest intermediate (``tokens x max(d_ff, d_model)``), for
  one micro-batch's tokens on one device;
- the parameters and their gradients (``2 x parameters x 4 bytes``: both fp32), divided over the ``fsdp`` and
  ``tensor`` axes.

It leaves out the logits, attention, the optimizer's moments and XLA's scratch, so a config over it
cannot run, and one under it may still not: this check refuses only the impossible (a global batch of
65,536 quickstart sequences needs 28 GiB for the layer inputs alone). The memory compared against is
JAX's ``bytes_limit`` on an accelerator, and on the CPU the machine's RAM and swap shared by its devices.
"""

from __future__ import annotations

import os

import numpy as np

from hybrid_lm.config import Config
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import count_params

PARAM_BYTES = 4  # parameters and their gradients are fp32

GiB = 1 << 30


def step_memory_floor(cfg: Config, batch_shards: int = 1, param_shards: int = 1, n_params: int | None = None) -> int:
    """Bytes per device that one train step of ``cfg`` needs at least (module docstring)."""
    m, t = cfg.model, cfg.train
    rows = -(-(t.global_batch // t.microbatches) // batch_shards)
    tokens = rows * cfg.data.seq_len
    act = np.dtype(m.compute_dtype).itemsize
    activations = tokens * (m.n_layers * m.d_model + max(m.d_ff, m.d_model)) * act
    if n_params is None:
        n_params = count_params(m)["total"]
    return activations + 2 * n_params * PARAM_BYTES // param_shards


def device_memory(device) -> tuple[int | None, str]:
    """(bytes one device of this kind may use, its description); the CPU's devices share the machine's RAM
    and swap. None where unknown."""
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None, "cpu"
        swap = 0
        try:
            with open("/proc/meminfo") as fh:
                swap = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("SwapTotal:")), 0)
        except OSError:
            pass
        import jax
        n = max(1, jax.local_device_count("cpu"))
        return (total + swap) // n, f"the machine's RAM and swap ({(total + swap) / GiB:.1f} GiB) over {n} cpu device(s)"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return limit, f"this {device.device_kind}'s memory limit"


def check_step_fits(cfg: Config, mesh) -> None:
    """Refuse (``ConfigError``, one line) a config whose train step cannot fit one device's memory."""
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    param_shards = mesh.shape["fsdp"] * mesh.shape["tensor"]
    memory, where = device_memory(mesh.devices.flat[0])
    if memory is None:
        return
    floor = step_memory_floor(cfg, batch_shards, param_shards)
    if floor <= memory:
        return
    t = cfg.train
    rows = -(-(t.global_batch // t.microbatches) // batch_shards)
    raise ConfigError(
        f"TrainConfig.global_batch={t.global_batch} cannot fit: a micro-batch puts {rows:,} sequences of "
        f"{cfg.data.seq_len} tokens on each device, whose layer inputs and parameters alone need "
        f"{floor / GiB:,.1f} GiB, more than {memory / GiB:,.1f} GiB ({where}); raise TrainConfig.microbatches "
        f"(now {t.microbatches}) or lower TrainConfig.global_batch")
