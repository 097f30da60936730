"""``HYBRID_LM_DETERMINISTIC=1``: reproducible GPU runs, at a cost to be measured (docs/TRAINING.md).

XLA's GPU backend reorders floating-point reductions between runs where it uses atomics (scatter-adds,
some reductions) and cuDNN's flash-attention backward splits its dQ accumulation across thread blocks
by default: two runs of one config on one GPU then differ in the last bits, and the difference grows
over training. XLA's ``--xla_gpu_deterministic_ops=true`` makes both deterministic (XLA chooses
deterministic algorithms and asks cuDNN >= 9.2's frontend for its deterministic flash-attention backward,
openxla/xla#14125). The project's own Pallas kernels need nothing: their backward passes use no atomics
(docs/KERNELS.md). The CPU backend is deterministic already.

The flag must be in ``XLA_FLAGS`` before the XLA backend starts (the first device use), so it is an
environment setting rather than a config field: :func:`apply` adds it when ``HYBRID_LM_DETERMINISTIC`` is
``1``/``true``/``yes``, and the ``hybrid-lm`` command calls it first thing. ``provenance.json`` records
``XLA_FLAGS`` for every run; the setting is not part of the run id (it changes rounding, not the
experiment). No jax import here.

Under the flag, attention's ``auto`` dispatch keeps cuDNN out (``hybrid_lm.backends``): the first S1
training step with cuDNN's attention backward under ``--xla_gpu_deterministic_ops`` ended the process
on an H200 (jaxlib 0.11.2; the failure matches openxla/xla#46500, a compile-cache defect with several
identical fused-attention backward calls), so jla's kernel (deterministic "ranged" backward) or ours
runs instead.
"""

from __future__ import annotations

import os
import re

from hybrid_lm.errors import ConfigError

ENV = "HYBRID_LM_DETERMINISTIC"
FLAG = "--xla_gpu_deterministic_ops=true"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def requested(environ=None) -> bool:
    """Whether ``HYBRID_LM_DETERMINISTIC`` asks for deterministic GPU ops (a bad value: ConfigError)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ConfigError(f"{ENV}={env.get(ENV)!r}: use 1 (deterministic GPU ops, docs/TRAINING.md) or 0")


def apply(environ=None) -> bool:
    """Add :data:`FLAG` to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``) when requested and absent;
    returns whether deterministic ops are on."""
    env = os.environ if environ is None else environ
    if not requested(env):
        return False
    flags = env.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        env["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    return True


def active(environ=None) -> bool:
    """Whether ``XLA_FLAGS`` in ``environ`` (default ``os.environ``) turns XLA's deterministic GPU ops on,
    by :func:`apply` or by hand (``--xla_gpu_deterministic_ops`` alone or ``=true``/``=1``; the last
    mention wins, as in XLA's flag parser)."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    values = re.findall(r"--xla_gpu_deterministic_ops(?:=(\S*))?(?:\s|$)", flags)
    return bool(values) and values[-1].lower() in ("", "true", "1")
