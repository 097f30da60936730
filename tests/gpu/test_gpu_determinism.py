"""``HYBRID_LM_DETERMINISTIC=1`` on a GPU: an S1 full-attention model (ten identical layers, the case where
cuDNN's fused attention under ``--xla_gpu_deterministic_ops`` ended the run at its first step) trains, runs
no cuDNN attention, and two runs log bitwise-equal losses and gradient norms. The throughput cost is
``experiments/determinism.sh``'s (longer runs); the CPU twin of the dispatch is
``tests/test_backends.py::test_deterministic_ops_keep_cudnn_out_of_attention``.

``JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu/test_gpu_determinism.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_util import GPU

pytestmark = GPU

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["configs/base.gin", "configs/scale/s1.gin",
        "--gin_param", "ModelConfig.layer_pattern = 'F'", "--gin_param", "ModelConfig.vocab_size = 256",
        "--gin_param", "DataConfig.source = 'embedded'", "--gin_param", "DataConfig.tokenizer = 'byte'",
        "--gin_param", "DataConfig.seq_len = 2048", "--gin_param", "TrainConfig.global_batch = 8",
        "--gin_param", "TrainConfig.steps = 12", "--gin_param", "TrainConfig.log_every = 1",
        "--gin_param", "TrainConfig.eval_every = 1000", "--gin_param", "CheckpointConfig.every_steps = 1000"]


def _train(workdir: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(HYBRID_LM_DETERMINISTIC="1", HYBRID_LM_COMPILATION_CACHE="off", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    r = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "train", *ARGS, "--workdir", str(workdir)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in rows if x.get("kind") == "train"]


def test_deterministic_runs_are_bitwise_equal_without_cudnn_attention(tmp_path):
    a, b = _train(tmp_path / "a"), _train(tmp_path / "b")
    assert len(a) == len(b) == 12
    assert {x["attention_backends"]["full"] for x in a} <= {"jla", "pallas"}, a[0]["attention_backends"]
    assert [(x["loss"], x["grad_norm"]) for x in a] == [(x["loss"], x["grad_norm"]) for x in b]
