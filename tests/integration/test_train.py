import contextlib
import json
import math
import signal

import jax
import numpy as np
import pytest

from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.run.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.train.distributed import PreemptionFlag
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics


def _cfg(tiny_params, *extra):
    return load_config([], tiny_params + list(extra))


def test_loss_decreases_and_run_dir_is_complete(tiny_params, tmp_path):
    cfg = _cfg(tiny_params, "TrainConfig.steps = 40", "TrainConfig.log_every = 5", "TrainConfig.eval_every = 20")
    res = train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert rows[0]["loss"] > rows[-1]["loss"] + 0.5, [r["loss"] for r in rows]
    assert rows[0]["loss"] == pytest.approx(math.log(256), abs=0.3)  # starts near uniform
    ev = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert [r["step"] for r in ev] == [0, 20, 40] and ev[-1]["bpb"] < ev[0]["bpb"]
    assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_sec"} <= set(rows[-1])
    assert rows[-1]["tokens"] == 40 * 4 * 32
    # the backend each attention call resolved to (attention_impl=auto -> xla on the CPU)
    assert rows[0]["attention_impl"] == "auto"
    assert rows[0]["attention_backends"] == {"full": "xla", "swa w=8": "xla"}, rows[0]
    for f in ("config.json", "operative.gin", "provenance.json", "metrics.jsonl", "loss_curve.png"):
        assert (tmp_path / f).exists(), f
    assert json.loads((tmp_path / "config.json").read_text())["run_id"] == run_id(cfg)
    assert res.step == 40 and res.final_eval["step"] == 40


def test_resume_continues_and_a_finished_run_ends_at_once(tiny_params, tmp_path):
    cfg = _cfg(tiny_params, "TrainConfig.steps = 10")
    train(cfg, tmp_path)
    again = train(cfg, tmp_path)
    assert again.resumed_from == 10 and again.step == 10
    longer = train(_cfg(tiny_params, "TrainConfig.steps = 15"), tmp_path)  # extending steps is allowed
    assert longer.resumed_from == 10 and longer.step == 15
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 15


@contextlib.contextmanager
def _stop_after(steps: int):
    """The training loop sees a SIGTERM request after ``steps`` steps (what the signal handler sets)."""
    orig = PreemptionFlag.requested
    calls = []

    def requested(flag):
        calls.append(1)
        if len(calls) == steps:
            flag._handle(signal.SIGTERM, None)
        return orig.fget(flag)

    PreemptionFlag.requested = property(requested)
    try:
        yield
    finally:
        PreemptionFlag.requested = orig


def test_save_restore_round_trip_and_a_stopped_run_resume_bitwise(tiny_params, tmp_path):
    cfg = _cfg(tiny_params, "TrainConfig.steps = 7")
    train(cfg, tmp_path)
    ck = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
    assert ck.latest_step() == 7
    from hybrid_lm.step import ModelFns
    from hybrid_lm.train.optim import make_optimizer
    fns = ModelFns(cfg)
    tx, _ = make_optimizer(cfg.optim, cfg.train.steps, fns.axes)
    abstract = {"params": fns.abstract_params, "opt_state": jax.eval_shape(tx.init, fns.abstract_params),
                "step": jax.ShapeDtypeStruct((), np.int32)}
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state, meta = ck.restore_latest(abstract_with_shardings(abstract, jax.tree.map(lambda _: dev, abstract)))
    assert meta["step"] == 7 and meta["data_position"] == 7
    # save the restored state again and restore it: bitwise identical params and optimizer state
    ck2 = Checkpointer(tmp_path / "copy", cfg.checkpoint)
    ck2.save(7, state, meta)
    ck2.wait()
    state2, _ = ck2.restore_latest(abstract_with_shardings(abstract, jax.tree.map(lambda _: dev, abstract)))
    leaves1, leaves2 = jax.tree.leaves(state), jax.tree.leaves(state2)
    assert len(leaves1) == len(leaves2) > 10
    for a, b in zip(leaves1, leaves2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and a run stopped after step 3 (the SIGTERM path: save, exit) and resumed ends with the same
    # parameters and optimizer state, bitwise
    with _stop_after(3):
        stopped = train(cfg, tmp_path / "stopped")
    assert stopped.preempted == "SIGTERM" and stopped.step == 3
    res = train(cfg, tmp_path / "stopped")
    assert res.resumed_from == 3 and res.step == 7
    ck3 = Checkpointer(tmp_path / "stopped" / "checkpoints", cfg.checkpoint)
    state3, _ = ck3.restore_latest(abstract_with_shardings(abstract, jax.tree.map(lambda _: dev, abstract)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state3)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_corrupt_latest_checkpoint_falls_back(tiny_params, tmp_path, caplog):
    cfg = _cfg(tiny_params, "TrainConfig.steps = 10")
    train(cfg, tmp_path)
    latest = tmp_path / "checkpoints" / "10" / "state"
    for f in latest.rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    res = train(cfg, tmp_path)
    assert res.resumed_from == 5 and res.step == 10
    assert "does not restore" in caplog.text
