"""Multi-process start-up, SLURM detection, preemption signals and requeue.

Launch shapes (see README):
- one process per host driving all its GPUs (``srun --ntasks-per-node=1``), or
- one process per GPU (``srun --ntasks-per-node=<gpus>``); JAX's SLURM detection picks the local GPU.
Explicit clusters set ``HYBRID_LM_COORDINATOR=host:port``, ``HYBRID_LM_NUM_PROCESSES`` and
``HYBRID_LM_PROCESS_ID`` (optionally ``HYBRID_LM_LOCAL_DEVICE_IDS=0,1``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import jax

log = logging.getLogger(__name__)


def in_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def maybe_initialize() -> bool:
    """Start ``jax.distributed`` when the environment asks for several processes. True if started."""
    if jax.distributed.is_initialized():
        return True
    coord = os.environ.get("HYBRID_LM_COORDINATOR")
    if coord:
        local = os.environ.get("HYBRID_LM_LOCAL_DEVICE_IDS")
        if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coord,
            num_processes=int(os.environ["HYBRID_LM_NUM_PROCESSES"]),
            process_id=int(os.environ["HYBRID_LM_PROCESS_ID"]),
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
        return True
    if in_slurm():
        jax.distributed.initialize()  # JAX's SLURM cluster detection fills in the rest
        return True
    return False


class PreemptionFlag:
    """Set by SIGTERM (save and exit) or SIGUSR1 (SLURM ``--signal``: save, requeue, exit)."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame):
        del frame
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


def requeue_if_slurm() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if job and jax.process_index() == 0:
        try:
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
            log.warning("requeued SLURM job %s", job)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("could not requeue SLURM job %s: %s", job, e)
