"""Sharded training on 8 simulated CPU devices and across 2 processes (each in subprocesses, so the
other tests stay on one device)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY

TESTS = str(Path(__file__).resolve().parents[1])  # the subprocesses import resume_check from here
PARAMS = TINY + ["TrainConfig.steps = 4", "TrainConfig.log_every = 1", "TrainConfig.global_batch = 8",
                 "ModelConfig.tie_embeddings = False", "ModelConfig.n_heads = 4", "ModelConfig.n_kv_heads = 2"]

MESHES_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train
    from hybrid_lm.run.metrics import read_metrics
    params, out = json.loads(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, sys.argv[3])
    from resume_check import final_state  # test tooling in tests/
    result = {}
    for name, mesh, devs in [("one", (1, 1, 1), jax.devices()[:1]), ("data", (8, 1, 1), None),
                             ("fsdp", (1, 8, 1), None), ("mixed", (2, 2, 2), None)]:
        cfg = load_config([], params + [f"MeshConfig.data = {mesh[0]}", f"MeshConfig.fsdp = {mesh[1]}",
                                        f"MeshConfig.tensor = {mesh[2]}"])
        res = train(cfg, f"{out}/{name}", devices=devs)
        state = final_state(res.workdir)
        np.savez(f"{out}/{name}.npz", **{k: v for k, v in state.items()})
        result[name] = [r["loss"] for r in read_metrics(res.workdir / "metrics.jsonl", "train")]
    # cross-topology restore: the 8-device (2x2x2) checkpoint resumes on 1 device and on 4 (fsdp=4)
    for name, mesh, devs in [("restore1", (1, 1, 1), jax.devices()[:1]), ("restore4", (1, 4, 1), jax.devices()[:4])]:
        import shutil
        shutil.copytree(f"{out}/mixed", f"{out}/{name}")
        cfg = load_config([], params + [f"MeshConfig.data = {mesh[0]}", f"MeshConfig.fsdp = {mesh[1]}",
                                        f"MeshConfig.tensor = {mesh[2]}", "TrainConfig.steps = 6"])
        res = train(cfg, f"{out}/{name}", devices=devs)
        assert res.resumed_from == 4 and res.step == 6, (res.resumed_from, res.step)
        result[name] = [r["loss"] for r in read_metrics(res.workdir / "metrics.jsonl", "train")]
    cfg = load_config([], params + ["TrainConfig.steps = 6"])
    res = train(cfg, f"{out}/one6", devices=jax.devices()[:1])
    result["one6"] = [r["loss"] for r in read_metrics(res.workdir / "metrics.jsonl", "train")]
    # the sharding of every parameter under the mixed mesh, for the golden table
    from hybrid_lm.step import ModelFns
    from hybrid_lm import sharding as shd
    cfg = load_config([], params + ["MeshConfig.data = 2", "MeshConfig.fsdp = 2", "MeshConfig.tensor = 2"])
    fns = ModelFns(cfg)
    mesh = shd.make_mesh(cfg.mesh)
    specs = shd.tree_shardings(fns.axes, fns.abstract_params, mesh, cfg.mesh.rules)
    result["specs"] = {jax.tree_util.keystr(p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(specs)}
    print("RESULT", json.dumps(result))
""")

GOLDEN_MIXED = {  # logical axes -> (data=2, fsdp=2, tensor=2) under the default rules
    "['embed']['table']": "P('tensor', 'fsdp')",                 # (vocab, embed)
    "['lm_head']": "P('fsdp', 'tensor')",                        # (embed, vocab)
    "['blocks'][0]['mixer']['wq']": "P('fsdp', 'tensor', None)",  # (embed, heads, head_dim)
    "['blocks'][0]['mixer']['wk']": "P('fsdp', None, None)",      # (embed, kv_heads, head_dim)
    "['blocks'][0]['mixer']['wo']": "P('tensor', None, 'fsdp')",  # (heads, head_dim, embed)
    "['blocks'][1]['mlp']['w_gate']": "P('fsdp', 'tensor')",      # (embed, mlp)
    "['blocks'][1]['mlp']['w_down']": "P('tensor', 'fsdp')",      # (mlp, embed)
    "['blocks'][1]['mixer_norm']['scale']": "P(None,)",           # (norm,)
    "['final_norm']['scale']": "P(None,)",
}


def _env(n_devices):
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}", JAX_PLATFORMS="cpu")


def _result(out):
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_data_fsdp_tensor_parallel_match_one_device_and_restore_across_topologies(tmp_path):
    out = subprocess.run([sys.executable, "-c", MESHES_SCRIPT, json.dumps(PARAMS), str(tmp_path), TESTS],
                         env=_env(8), capture_output=True, text=True, timeout=900)
    res = _result(out)
    ref = np.load(tmp_path / "one.npz")
    for name in ("data", "fsdp", "mixed"):
        np.testing.assert_allclose(res[name], res["one"], rtol=2e-5, err_msg=name)
        other = np.load(tmp_path / f"{name}.npz")
        assert set(other.files) == set(ref.files)
        for k in ref.files:
            np.testing.assert_allclose(other[k], ref[k], rtol=1e-4, atol=2e-6, err_msg=f"{name} {k}")
    # a checkpoint saved on 8 devices resumes on 1 and on 4 and continues like an uninterrupted run
    for name in ("restore1", "restore4"):
        np.testing.assert_allclose(res[name], res["one6"], rtol=2e-5, err_msg=name)
    for path, spec in GOLDEN_MIXED.items():
        assert res["specs"][path] == spec, (path, res["specs"][path])


PROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train
    from hybrid_lm.run.metrics import read_metrics
    import jax
    params, out = json.loads(sys.argv[1]), sys.argv[2]
    res = train(load_config([], params), out)
    if jax.process_index() == 0:
        rows = read_metrics(res.workdir / "metrics.jsonl", "train")
        print("RESULT", json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                                    "losses": [r["loss"] for r in rows]}))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_together_like_one(tmp_path):
    one = _result(subprocess.run([sys.executable, "-c", PROCESS_SCRIPT, json.dumps(PARAMS), str(tmp_path / "one")],
                                 env=_env(2), capture_output=True, text=True, timeout=600))
    port = _free_port()
    procs = []
    for pid in range(2):
        env = _env(1)
        env.update(HYBRID_LM_COORDINATOR=f"127.0.0.1:{port}", HYBRID_LM_NUM_PROCESSES="2",
                   HYBRID_LM_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-c", PROCESS_SCRIPT, json.dumps(PARAMS), str(tmp_path / "two")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    two = json.loads([l for l in outs[0][0].splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert one["devices"] == 2 and two["processes"] == 2 and two["devices"] == 2
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=2e-5)
    assert (tmp_path / "two" / "checkpoints" / "4").exists()
