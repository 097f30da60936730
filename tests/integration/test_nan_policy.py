"""The NaN policy: 'stop' saves the state before the bad step and exits 2 in one line naming the step
and what was not finite; 'skip' stops after TrainConfig.max_consecutive_skips in a row; the closing
summary and a summary row count the skipped steps; a SIGTERM after the last step lets the run finish.

Non-finite steps are injected into chosen steps' batches (:func:`_inject`), or come from an exploding
learning rate."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from hybrid_lm.cli import main
from hybrid_lm.experiment import load_config
from hybrid_lm.train import loop, nonfinite
from hybrid_lm import step as step_mod
from hybrid_lm.run.metrics import read_metrics
from resume_check import compare_runs, final_state


def _inject(monkeypatch, bad: dict[int, str]) -> None:
    """Make step ``done`` (1-based) in ``bad`` non-finite: "loss" (NaN loss and gradient) or "grad" (a
    finite loss, an inf gradient norm). The fault rides on the batch, as a data-borne one would: the
    batch of that step has a marker in its first token, and the wrapped step.py step returns for
    it what it returns for any non-finite step (parameters and optimizer state unchanged, the counter
    advanced, ``finite`` False)."""
    from hybrid_lm.data.pipeline import DataStreams

    marker = {"loss": -1, "grad": -2}
    batch_of = DataStreams.batch

    def batch(self, step, rows=None):
        b = batch_of(self, step, rows)
        if step + 1 in bad:
            tokens = np.array(b["tokens"] if isinstance(b, dict) else b)
            tokens[0, 0] = marker[bad[step + 1]]
            b = {**b, "tokens": tokens} if isinstance(b, dict) else tokens
        return b

    def make(fns, optimizer_for):
        inner = step_mod.make_train_step(fns, optimizer_for)

        def train_step(state, batch, bounds):
            first = (batch["tokens"] if isinstance(batch, dict) else batch)[0, 0]
            nan_loss, inf_grad = first == marker["loss"], first == marker["grad"]
            new, stats = inner(state, batch, bounds)
            hit = nan_loss | inf_grad
            keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(hit, y, x), a, b)  # noqa: E731
            new = {"params": keep(new["params"], state["params"]), "opt_state": keep(new["opt_state"], state["opt_state"]),
                   "step": new["step"]}
            nan = jnp.float32(jnp.nan)
            stats = {**stats, "finite": stats["finite"] & ~hit,
                     "loss": jnp.where(nan_loss, nan, stats["loss"]),
                     "objective": jnp.where(nan_loss, nan, stats["objective"]),
                     "grad_norm": jnp.where(nan_loss, nan, jnp.where(inf_grad, jnp.inf, stats["grad_norm"]))}
            return new, stats
        return train_step

    monkeypatch.setattr(DataStreams, "batch", batch)
    monkeypatch.setattr(nonfinite, "make_train_step", make)


def _cli(workdir, params, capsys):
    args = ["train", "base.gin", "--workdir", str(workdir)]
    for p in params:
        args += ["--gin_param", p]
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err.strip()


def _ckpt_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_an_update_without_a_finite_norm_stops_at_its_own_step(tmp_path, capsys):
    # lr 1e30: step 1's update is finite element-wise but its norm overflows, so the step is not
    # applied and the saved state is the initial one (no parameters at ~1e30)
    params = TINY + ["OptimConfig.lr = 1e30", "OptimConfig.warmup_steps = 1", "TrainConfig.steps = 6"]
    rc, _, err = _cli(tmp_path, params, capsys)
    assert rc == 2 and err.startswith("error: non-finite loss or gradient at step 1: the update is not finite"), err
    assert "(step 0) is saved now" in err and _ckpt_steps(tmp_path) == [0]


def test_the_message_names_the_step_and_what_was_not_finite(tmp_path):
    stop = load_config([], TINY).train
    skip = load_config([], TINY + ["TrainConfig.nan_policy = 'skip'", "TrainConfig.max_consecutive_skips = 3"]).train

    def msg(tc, stats, done=7, streak=1):
        return nonfinite.Halt(done, streak, {"loss": 1.0, "objective": 1.0, "grad_norm": 1.0, **stats}).message(
            tc, done - 1, True, tmp_path, 2)

    both = msg(stop, {"loss": float("nan"), "objective": float("nan"), "grad_norm": float("nan")})
    assert both.startswith("non-finite loss or gradient at step 7: the loss and the gradient are not finite "
                           "(loss=nan, grad_norm=nan). The state before step 7 (step 6) is saved now in ")
    assert "nan_policy='skip'" in both and "\n" not in both
    assert "at step 7: the loss is not finite (loss=inf, grad_norm=2.0)" in msg(
        stop, {"loss": float("inf"), "objective": float("inf"), "grad_norm": 2.0})
    assert "at step 7: the gradient is not finite (loss=1.0, grad_norm=inf)" in msg(stop, {"grad_norm": float("inf")})
    many = msg(skip, {"grad_norm": float("inf")}, done=9, streak=3)
    assert many.startswith("non-finite loss or gradient at 3 steps in a row, steps 7-9 "
                           "(TrainConfig.max_consecutive_skips=3); at step 9 the gradient is not finite")
    assert "2 steps skipped in this run" in many and "(step 8)" in many


def test_stop_saves_the_state_before_the_bad_step_and_resumes_exactly(tmp_path, monkeypatch, capsys, xla_optimized):
    # xla_optimized: the stopped run's step program wraps the straight run's (the fault injection); under
    # the suite's unoptimised CPU compiles the two programs' losses differ in the last bits
    params = TINY + ["TrainConfig.steps = 8", "TrainConfig.log_every = 1"]  # checkpoints every 5 steps
    assert _cli(tmp_path / "straight", params, capsys)[0] == 0
    with monkeypatch.context() as m:
        _inject(m, {7: "loss"})
        rc, _, err = _cli(tmp_path / "stopped", params, capsys)
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert err.startswith("error: non-finite loss or gradient at step 7: the loss and the gradient are not finite "
                          f"(loss=nan, grad_norm=nan). The state before step 7 (step 6) is saved now in "
                          f"{(tmp_path / 'stopped' / 'checkpoints').resolve()}"), err
    wd = tmp_path / "stopped"
    assert _ckpt_steps(wd) == [5, 6]
    rows = read_metrics(wd / "metrics.jsonl", "train")
    assert rows[-1]["step"] == 7 and rows[-1]["halted"] and not rows[-1]["skipped"] and rows[-1]["loss"] is None
    summary = read_metrics(wd / "metrics.jsonl", "summary")[-1]
    assert summary == {"kind": "summary", "step": 6, "status": "stopped: non-finite", "skipped_steps": 0}
    assert (wd / "loss_curve.png").exists() and not (wd / ".lock").exists()
    # the saved state is exactly the state after step 6: resumed without the fault, the run equals the
    # straight one bitwise (losses, parameters, optimizer state)
    rc, out, _ = _cli(wd, params, capsys)
    assert rc == 0 and "(resumed from step 6)" in out
    cmp = compare_runs(tmp_path / "straight", wd)
    assert cmp["steps"] == 8 and cmp["loss_equal"] and cmp["state_equal"], cmp


def test_skip_stops_after_max_consecutive_skips(tmp_path, monkeypatch, capsys):
    params = TINY + ["TrainConfig.steps = 8", "TrainConfig.nan_policy = 'skip'", "TrainConfig.max_consecutive_skips = 3",
                     "CheckpointConfig.every_steps = 2"]
    _inject(monkeypatch, {3: "grad", 4: "grad", 5: "grad"})
    rc, _, err = _cli(tmp_path, params, capsys)
    assert rc == 2 and "\n" not in err
    assert err.startswith("error: non-finite loss or gradient at 3 steps in a row, steps 3-5 "
                          "(TrainConfig.max_consecutive_skips=3); at step 5 the gradient is not finite "
                          "(loss="), err
    assert "grad_norm=inf); 2 steps skipped in this run. The state before step 5 (step 4) is already saved" in err
    assert _ckpt_steps(tmp_path) == [2, 4]
    # steps 3 and 4 were skipped: the state at step 4 holds the parameters and optimizer state of step 2
    at2, at4 = (final_state_at(tmp_path, s) for s in (2, 4))
    assert at2.keys() == at4.keys()
    for k in at2:
        if "['step']" not in k:
            np.testing.assert_array_equal(at2[k], at4[k], err_msg=k)
    summary = read_metrics(tmp_path / "metrics.jsonl", "summary")[-1]
    assert summary["status"] == "stopped: non-finite" and summary["skipped_steps"] == 2 and summary["step"] == 4


def final_state_at(workdir, step):
    """Flattened arrays of the checkpoint at ``step``."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager((workdir / "checkpoints").resolve(), item_names=("state", "meta"))
    try:
        restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    finally:
        mgr.close()
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(restored.state)}


def test_skipped_steps_are_counted_in_the_summary_across_a_resume(tmp_path, monkeypatch, capsys):
    params = TINY + ["TrainConfig.nan_policy = 'skip'", "TrainConfig.max_consecutive_skips = 2"]
    _inject(monkeypatch, {2: "loss", 4: "grad", 6: "loss"})
    rc, out, _ = _cli(tmp_path, params + ["TrainConfig.steps = 5"], capsys)
    assert rc == 0 and "skipped steps 2" in out
    rc, out, _ = _cli(tmp_path, params + ["TrainConfig.steps = 7"], capsys)  # resumes at 5, skips step 6
    assert rc == 0 and "skipped steps 3" in out and "(resumed from step 5)" in out
    summaries = read_metrics(tmp_path / "metrics.jsonl", "summary")
    assert [(r["step"], r["skipped_steps"], r["status"]) for r in summaries] == [(5, 2, "finished"), (7, 3, "finished")]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl", "train")}
    assert [s for s, r in rows.items() if r["skipped"]] == [2, 4, 6] and rows[7]["skipped_total"] == 3


def test_an_exploding_learning_rate_stops_with_a_finite_last_good_state(tmp_path, capsys):
    # step 1 moves the parameters to ~1e15 (finite, with a finite update norm); step 2's loss overflows
    params = TINY + ["OptimConfig.lr = 1e15", "OptimConfig.warmup_steps = 1", "TrainConfig.steps = 6"]
    rc, _, err = _cli(tmp_path, params, capsys)
    assert rc == 2 and "\n" not in err, err
    assert err.startswith("error: non-finite loss or gradient at step 2: ") and "(step 1) is saved now" in err, err
    assert _ckpt_steps(tmp_path) == [1]
    state = final_state(tmp_path)
    assert int(state["['step']"]) == 1
    assert all(np.all(np.isfinite(v)) for v in state.values() if v.dtype.kind == "f")


SIGTERM_IN_THE_EPILOGUE = """
import os, signal, sys
from hybrid_lm.run import checkpoint
close = checkpoint.Checkpointer.close
def close_after_a_sigterm(self):  # the signal arrives while the final checkpoint is being finished
    os.kill(os.getpid(), signal.SIGTERM)
    return close(self)
checkpoint.Checkpointer.close = close_after_a_sigterm
from hybrid_lm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_after_the_last_step_lets_the_run_finish(tmp_path):
    args = [sys.executable, "-c", SIGTERM_IN_THE_EPILOGUE, "train", "base.gin", "--workdir", str(tmp_path)]
    for p in TINY + ["TrainConfig.steps = 4", "CheckpointConfig.async_save = True", "CheckpointConfig.every_steps = 2"]:
        args += ["--gin_param", p]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SIGTERM arrived after the last step: the run finished first" in out.stdout
    assert (tmp_path / "loss_curve.png").stat().st_size > 0 and not (tmp_path / ".lock").exists()
    from hybrid_lm.run.restore import RestoredRun
    assert RestoredRun(tmp_path).step == 4  # the final checkpoint is complete
    summary = read_metrics(tmp_path / "metrics.jsonl", "summary")[-1]
    assert summary["status"] == "finished" and summary["step"] == 4


def test_the_device_guard_costs_no_memory():
    """The halting guard holds the state through step.py's own non-finite select: the compiled
    step needs no more temporary memory than the bare step (a second select over the state would add
    about the size of the parameters and optimizer state)."""
    from hybrid_lm import sharding as shd
    from hybrid_lm.train.optim import optimizer_for_bounds

    cfg = load_config([], TINY + ["ModelConfig.d_model = 128", "ModelConfig.d_ff = 512"])
    mesh = shd.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        prog = loop.build_program(cfg, mesh)
        state = jax.eval_shape(prog.init, jnp.uint32(0))
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jnp.int32)
        guard = jax.ShapeDtypeStruct((2,), jnp.int32)
        guarded = prog.step.lower(state, batch, prog.bounds, guard).compile().memory_analysis()
        bare = jax.jit(step_mod.make_train_step(prog.fns, optimizer_for_bounds(cfg.optim, prog.fns.axes)),
                       donate_argnums=0).lower(state, batch, prog.bounds).compile().memory_analysis()
    state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert guarded.temp_size_in_bytes <= bare.temp_size_in_bytes + 4096, (guarded, bare)
    assert state_bytes > 100_000  # large enough for a second select to show

