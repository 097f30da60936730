"""SLURM's one-process-per-GPU layout on a real GPU: a task bound to its GPU (``--gpus-per-task=1``: its only
visible device is ordinal 0) with ``SLURM_LOCALID=1``. JAX's own SLURM detection asks for ordinal
``SLURM_LOCALID`` = 1, which does not exist there; ``train/distributed.py`` gives the task its one visible
GPU. The CPU twins (device ids of every layout, two processes training) are ``tests/test_slurm.py`` and
``tests/integration/test_cluster.py``.

Run on a machine with one GPU (two tasks share it here, each told it is bound to it):
``JAX_PLATFORMS=cuda,cpu JAX_DISABLE_MOST_OPTIMIZATIONS=0 .venv/bin/python -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu/test_gpu_slurm.py``
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from gpu_util import GPU

pytestmark = GPU

TASK = r"""
import json, sys, jax, jax.numpy as jnp
from jax._src import xla_bridge as xb
from hybrid_lm.train import distributed
launch = distributed.maybe_initialize()
devs = jax.local_devices()
total = float(jax.device_put(jnp.arange(8.0), devs[0]).sum())  # a computation on this task's GPU
from jax._src import distributed as jd
jd.global_state.client.wait_at_barrier("both tasks computed", 60_000)  # through the coordinator, no NCCL
print("RESULT", json.dumps({"process": jax.process_index(), "local": [d.platform for d in devs],
                            "global": jax.device_count(), "cuda_visible": xb.CUDA_VISIBLE_DEVICES.value,
                            "ids": launch.local_device_ids, "layout": launch.layout, "sum": total}), flush=True)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HYBRID_LM_COORDINATOR"))}
    env.update(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false", CUDA_VISIBLE_DEVICES="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jax_alone_asks_a_bound_task_for_a_gpu_it_does_not_have():
    """What JAX's detection does for SLURM_LOCALID=1 (jax_cuda_visible_devices = '1') on a task whose
    only visible GPU is ordinal 0."""
    code = "import jax; jax.config.update('jax_cuda_visible_devices', '1'); print(jax.devices())"
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and ("invalid device ordinal" in out.lower() or "INVALID_DEVICE" in out), out[-3000:]


def test_a_task_bound_to_its_gpu_with_local_id_1_drives_it():
    port = _port()
    procs = []
    for i in range(2):
        env = _env(SLURM_JOB_ID=4242, SLURM_NTASKS=2, SLURM_PROCID=i, SLURM_LOCALID=i, SLURM_NODEID=0,
                   SLURM_STEP_ID=0, SLURM_STEP_NODELIST="127.0.0.1", SLURM_STEP_TASKS_PER_NODE=2,
                   SLURM_GPUS_PER_TASK=1, JAX_COORDINATOR_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-c", TASK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    res = [json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]) for out in outs]
    for i, r in enumerate(res):
        assert r["process"] == i and r["local"] == ["gpu"] and r["global"] == 2, r
        assert r["cuda_visible"] == "all" and r["ids"] is None and "bound" in r["layout"] and r["sum"] == 28.0, r
