"""The trainer on a mesh of 4 simulated CPU devices (in a subprocess, so other tests stay on one device)."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import TINY

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from hybrid_lm.config import load_config
    from hybrid_lm.train.loop import train
    from hybrid_lm.train.metrics import read_metrics
    params = json.loads(sys.argv[1])
    cfg = load_config([], params)
    res = train(cfg, sys.argv[2])
    rows = read_metrics(res.workdir / "metrics.jsonl", "train")
    print("RESULT", json.dumps({"devices": jax.device_count(), "losses": [r["loss"] for r in rows]}))
""")


def _run(tmp_path, n_devices, name):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}", JAX_PLATFORMS="cpu")
    params = TINY + ["TrainConfig.steps = 10", "TrainConfig.log_every = 2"]
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(params), str(tmp_path / name)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_data_parallel_on_4_devices_matches_1(tmp_path):
    one = _run(tmp_path, 1, "one")
    four = _run(tmp_path, 4, "four")
    assert one["devices"] == 1 and four["devices"] == 4
    # same data, same init; only the reduction order differs across devices
    for a, b in zip(one["losses"], four["losses"]):
        assert abs(a - b) < 2e-3 * max(1.0, abs(a)), (one["losses"], four["losses"])
