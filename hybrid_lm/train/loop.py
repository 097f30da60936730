"""The training loop: any number of local devices or processes, one mesh, exact resume.

Order per step (Kauldron's rule): dispatch step s, fetch the *previous* step's metrics (so the host
never blocks dispatch), then evaluate / save "after step s" before pulling batch s+1. SIGTERM saves
and exits cleanly; SIGUSR1 (SLURM ``--signal``) saves, requeues and exits.

Continued pretraining (``init_from``, ``hybrid-lm train --init-from RUN_DIR[@STEP]``; its identity is
explained in ``train/rundir.py``): the source checkpoint's parameters are restored straight into this
run's layout, with a fresh optimizer state and the schedule from step 0. Once the run has
checkpoints of its own, it resumes from those and never reads the source again.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_lm.backends import recorded_backends
from hybrid_lm.config import Config, diff_experiments
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.eval.loss import evaluate
from hybrid_lm.train import distributed
from hybrid_lm.train import sharding as shd
from hybrid_lm.train.checkpoint import Checkpointer, abstract_with_shardings, params_fingerprint, saved_steps
from hybrid_lm.train.lock import workdir_lock
from hybrid_lm.train.logger import StepLogger, check_extras, startup_summary
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.train.rundir import (InitSource, accepted_run_ids, archive_run, prepare_run_dir,
                                    record_init_fingerprint, recorded_init_source, resolve_init_source)
from hybrid_lm.train.step import ModelFns, make_eval_step, make_init, make_train_step

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    workdir: Path
    step: int
    final_eval: dict | None
    wall_seconds: float
    resumed_from: int | None
    preempted: str | None = None  # "SIGTERM" / "SIGUSR1" when stopped by a signal
    skipped_steps: int = 0
    compile_seconds: float | None = None  # the train step's trace + compile (None: no step was run)
    init_from: str | None = None  # TrainConfig.init_from: "<source run id>@<step>" of a continued run


@dataclass
class Program:
    """A run's jitted functions and shardings on one mesh. The WSD bounds are a runtime input of the
    step: one compiled step (and one persistent-cache entry) serves every run length."""

    fns: ModelFns
    init: object  # seed -> state, sharded
    start: object  # params -> state with those parameters, a fresh optimizer state, step 0 (init_from)
    step: object  # (state, tokens, bounds) -> (state, stats)
    eval: object  # (params, tokens) -> mean CE
    state_shard: dict
    batch_shard: object
    n_batch_shards: int
    bounds: np.ndarray


def build_program(cfg: Config, mesh) -> Program:
    fns = ModelFns(cfg)
    optimizer_for = optimizer_for_bounds(cfg.optim, fns.axes)
    bounds = np.asarray(wsd_bounds(cfg.optim, cfg.train.steps), np.int32)
    tx, _ = optimizer_for(bounds)  # for the state's structure (independent of the bounds)
    n_batch = shd.n_batch_shards(mesh)
    micro = cfg.train.global_batch // cfg.train.microbatches
    if micro % n_batch:
        raise ValueError(f"micro-batch of {micro} sequences (global_batch {cfg.train.global_batch} / "
                         f"{cfg.train.microbatches}) is not divisible by the batch mesh axes ({n_batch})")
    # parameters are created directly in their sharded layout (never whole on one device)
    p_shard = shd.tree_shardings(fns.axes, fns.abstract_params, mesh, cfg.mesh.rules)
    abstract_opt = jax.eval_shape(tx.init, fns.abstract_params)
    repl = shd.replicated(mesh)
    opt_shard = shd.match_opt_shardings(abstract_opt, fns.abstract_params, p_shard,
                                        jax.tree.map(lambda _: repl, abstract_opt))
    state_shard = {"params": p_shard, "opt_state": opt_shard, "step": repl}
    batch_shard = shd.batch_sharding(mesh, cfg.mesh.rules)

    def fresh_state(params):  # make_init's state, around given parameters
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return Program(
        fns=fns, init=jax.jit(make_init(fns, tx), out_shardings=state_shard),
        start=jax.jit(fresh_state, in_shardings=(p_shard,), out_shardings=state_shard, donate_argnums=0),
        step=jax.jit(make_train_step(fns, optimizer_for), in_shardings=(state_shard, batch_shard, repl),
                     out_shardings=(state_shard, repl), donate_argnums=0),
        eval=jax.jit(make_eval_step(fns), in_shardings=(p_shard, batch_shard), out_shardings=repl),
        state_shard=state_shard, batch_shard=batch_shard, n_batch_shards=n_batch, bounds=bounds)


def init_or_restore(cfg: Config, prog: Program, ckpt: Checkpointer, source: InitSource | None = None):
    """``(state, resumed_from)``: the newest checkpoint that restores, else a fresh init (from a
    traced seed: with a constant key XLA constant-folds the whole random init at compile time), or,
    for a continued run, the parameters of ``source`` with a fresh optimizer state.
    Checkpoints that do not restore are moved aside; a workdir with metrics or checkpoints of which
    none restores is refused (``WorkdirError``) rather than silently trained from step 0."""
    seed = jnp.asarray(cfg.train.seed, jnp.uint32)
    abstract = abstract_with_shardings(jax.eval_shape(prog.init, seed), prog.state_shard)
    restored = ckpt.restore_latest(abstract, move_corrupt=True)
    if restored is None:
        _refuse_a_silent_restart(ckpt)
        if cfg.train.init_from:
            return prog.start(_source_params(source, prog)), None
        return prog.init(seed), None
    state, meta = restored
    if meta.get("run_id") not in {cfg.run_id(), *accepted_run_ids(ckpt.directory.parent)}:
        log.warning("resuming a checkpoint of run %s under run id %s (forced)", meta.get("run_id"), cfg.run_id())
    return state, int(meta["step"])


def _source_params(source: InitSource | None, prog: Program):
    """The parameters of the continued run's source checkpoint, in this run's sharded layout."""
    if source is None or source.cfg is None:
        raise WorkdirError(f"{source.spec if source else 'TrainConfig.init_from'}: the source run is not there "
                           "and this run has no checkpoint of its own to resume")
    ckpt = Checkpointer(source.workdir / "checkpoints", source.cfg.checkpoint, read_only=True)
    abstract = abstract_with_shardings(prog.fns.abstract_params, prog.state_shard["params"])
    try:
        params, _ = ckpt.restore_params(abstract, source.step)
    except Exception as e:  # a torn or corrupt source checkpoint: its step is part of the identity, no fallback
        cause = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise WorkdirError(f"--init-from {source.spec}: the checkpoint at step {source.step} in {source.workdir} "
                           f"does not restore ({cause}); name another step with @STEP (saved: "
                           f"{list(source.saved)})") from e
    finally:
        ckpt.close()
    return params


def check_init_shapes(source: InitSource, cfg: Config) -> None:
    """``ConfigError`` naming the first parameter whose shape or dtype differs between the source's
    model and ``cfg``'s: a continued run may change anything but the parameters (seq_len, the data,
    RoPE theta, windows...). Builds abstract models only (allocates nothing)."""
    if source.cfg is None:
        return
    theirs, ours = _param_specs(source.cfg), _param_specs(cfg)
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        if theirs.get(name) != ours.get(name):
            changed = [f for f in diff_experiments(source.cfg.to_dict(), cfg.to_dict()) if f.startswith("model.")]
            raise ConfigError(
                f"--init-from {source.spec}: parameter {name} is {theirs.get(name) or 'absent'} in the source "
                f"and {ours.get(name) or 'absent'} in this config"
                + (f" (model fields changed: {', '.join(changed)})" if changed else "")
                + "; a continued run keeps every parameter's shape and dtype")


def _param_specs(cfg: Config) -> dict[str, str]:
    """``"embed/table" -> "float32[256, 32]"`` for each parameter of ``cfg``'s model, in tree order."""
    leaves = jax.tree_util.tree_leaves_with_path(ModelFns(cfg).abstract_params)
    return {"/".join(str(getattr(k, "key", k)) for k in path): f"{x.dtype}{list(x.shape)}" for path, x in leaves}


def _refuse_foreign_checkpoints(cfg: Config, workdir: Path, source: InitSource) -> None:
    """A continued run starts from the source only in a workdir without checkpoints of another run."""
    steps = saved_steps(workdir / "checkpoints")
    if not steps or cfg.run_id() in accepted_run_ids(workdir):
        return
    rec = recorded_init_source(workdir)
    whose = f"a run initialised from {rec['identity']}" if rec else "a run not initialised from it"
    raise WorkdirError(f"{workdir} holds checkpoints of its own (steps {steps}, {whose}), so --init-from "
                       f"{source.spec} ({source.identity}) cannot start there: use another --workdir, or "
                       "--restart to archive them first")


def _refuse_a_silent_restart(ckpt: Checkpointer) -> None:
    workdir = ckpt.directory.parent
    metrics = workdir / "metrics.jsonl"
    has_rows = metrics.exists() and metrics.stat().st_size > 0
    if not (has_rows or ckpt.restore_failures):
        return
    if ckpt.restore_failures:
        what = "; ".join(f"step {s}: {why}" for s, why in ckpt.restore_failures)
        moved = f" (moved to {ckpt.directory / 'corrupt'})" if ckpt.moved_aside else ""
        found = f"no checkpoint restores{moved}: {what}"
    else:
        found = f"{metrics} holds rows but {ckpt.directory} holds no checkpoint"
    raise WorkdirError(f"{workdir}: {found}. Not starting over silently: rerun with --restart to archive "
                       "the old metrics and checkpoints and train from step 0, or use another --workdir")


def train(cfg: Config, workdir: Path | str | None = None, *, force: bool = False, restart: bool = False,
          init_from: str | Path | None = None, devices=None) -> TrainResult:
    """Train in ``workdir`` (default ``runs/<run id>``), resuming its newest checkpoint; process 0
    holds the workdir lock throughout. ``restart``: first move the workdir's metrics and checkpoints
    to ``archive/<UTC time>/`` and train from step 0.

    ``init_from`` (``RUN_DIR[@STEP]``; default ``cfg.train.init_from``): a continued run from that
    checkpoint's parameters (fresh optimizer state and schedule); ``cfg.train.init_from`` becomes
    ``"<source run id>@<step>"``. A bad source, a step that was not saved, parameter shapes that
    differ or a workdir holding another run's checkpoints fail in one line (``WorkdirError`` /
    ``ConfigError``) before the run dir is touched."""
    t_start = time.time()
    check_extras(cfg.train)  # a missing [tb] / [wandb] extra fails before the run dir exists
    distributed.maybe_initialize()
    main = jax.process_index() == 0
    source = None
    spec = init_from if init_from is not None else cfg.train.init_from
    if spec is not None:
        source = resolve_init_source(str(spec), workdir)
        if init_from is not None and cfg.train.init_from not in (None, str(init_from), source.identity):
            raise ConfigError(f"TrainConfig.init_from={cfg.train.init_from!r} and --init-from {init_from} disagree; "
                              "set one of them")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=source.identity))
        check_init_shapes(source, cfg)
    workdir = Path(workdir) if workdir else Path("runs") / cfg.run_id()
    if source is not None and not restart:
        _refuse_foreign_checkpoints(cfg, workdir, source)
    with workdir_lock(workdir, enabled=main):
        return _train(cfg, workdir, force, restart, devices, main, t_start, source)


def _train(cfg: Config, workdir: Path, force: bool, restart: bool, devices, main: bool,
           t_start: float, source: InitSource | None) -> TrainResult:
    if main:
        if restart:
            archive_run(workdir)
        prepare_run_dir(cfg, workdir, force=force, init_record=source.record() if source else None)
    _sync("run dir ready")
    mesh = shd.make_mesh(cfg.mesh, devices)
    data, prog, tc = DataStreams(cfg), build_program(cfg, mesh), cfg.train
    tokens_per_step = tc.global_batch * cfg.data.seq_len
    with jax.set_mesh(mesh):
        ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
        state, resumed_from = init_or_restore(cfg, prog, ckpt, source)
        start = resumed_from or 0
        logger = StepLogger(cfg, workdir, main=main, start=start, n_devices=mesh.devices.size,
                            every_step=bool(prog.fns.step_stats))
        if main:
            logger.summary(startup_summary(cfg, data, mesh))
        if tc.init_from and resumed_from is None:
            fingerprint = params_fingerprint(state["params"])
            if main:
                record_init_fingerprint(workdir, fingerprint)
            logger.say(f"init     parameters of {source.workdir} at step {source.step} (run {source.run_id}, "
                       f"fingerprint {fingerprint}); fresh optimizer state, schedule from step 0")
        recorded_backends(clear=True)  # the first trace of the step fills it (attention_backends)
        final_eval, preempted, pending = None, None, None
        profile = _Profiler(tc, workdir, main)
        try:
            with distributed.PreemptionFlag() as flag:
                if start < tc.steps:
                    logger.compiling()
                if start == 0:
                    _eval(logger, prog, data, state, 0)  # the curve starts at the untrained model
                for step in range(start, tc.steps):
                    profile.before(step)
                    state, stats = prog.step(state, shd.put_batch(data.batch(step), prog.batch_shard), prog.bounds)
                    if step == start:
                        logger.compiled(step)  # jit compiled synchronously inside that first call
                    done = step + 1
                    if pending is not None:
                        _finish_step(logger, *pending)
                    pending = (done, stats)
                    profile.after(done, state)
                    if done % tc.eval_every == 0 or done == tc.steps:
                        _finish_step(logger, *pending)
                        pending, final_eval = None, _eval(logger, prog, data, state, done)
                    stop = _any_process(flag.requested)
                    if stop or ckpt.should_save(done) or done == tc.steps:
                        ckpt.save(done, state, {"step": done, "data_position": done,
                                                "tokens_seen": done * tokens_per_step, "run_id": cfg.run_id()},
                                  force=stop)
                    logger.advance()
                    if stop:
                        preempted = signal.Signals(flag.signal).name if flag.signal else "signal"
                        break
                if pending is not None:
                    _finish_step(logger, *pending)
                if final_eval is None and preempted is None:  # nothing left to train: report the model
                    final_eval = _eval(logger, prog, data, state, int(jax.device_get(state["step"])))
        finally:
            profile.close()
            logger.close()
            ckpt.close()
    if preempted == "SIGUSR1":
        distributed.requeue_if_slurm()
    return TrainResult(workdir=workdir, step=int(jax.device_get(state["step"])), final_eval=final_eval,
                       wall_seconds=time.time() - t_start, resumed_from=resumed_from, preempted=preempted,
                       skipped_steps=logger.skipped, compile_seconds=logger.compile_seconds,
                       init_from=tc.init_from)


def _eval(logger: StepLogger, prog: Program, data: DataStreams, state, step: int) -> dict:
    result = evaluate(prog.eval, state["params"], data.eval_batch, prog.batch_shard,
                      global_batch=logger.cfg.train.global_batch, n_batch_shards=prog.n_batch_shards,
                      bytes_per_token=data.bytes_per_token)
    return logger.eval_row(step, result, data.meta.get("val_order0_entropy_bits"))


def _finish_step(logger: StepLogger, done: int, stats) -> None:
    """Host-side bookkeeping of a finished step (called one step late): the NaN policy, then its row."""
    stats = jax.device_get(stats)
    if not bool(stats["finite"]) and logger.cfg.train.nan_policy == "stop":
        raise FloatingPointError(
            f"non-finite loss or gradient at step {done} (loss={float(stats['loss'])}, grad_norm="
            f"{float(stats['grad_norm'])}); the state was not updated by that step. "
            "Set TrainConfig.nan_policy='skip' to skip such steps instead.")
    logger.train_row(done, stats)


class _Profiler:
    """A jax.profiler trace of steps [profile_start, profile_start + profile_steps) on process 0."""

    def __init__(self, tc, workdir: Path, main: bool):
        self.tc, self.dir, self.main, self.on = tc, workdir / "profile", main, False

    def before(self, step: int) -> None:
        if step == self.tc.profile_start and self.main:
            jax.profiler.start_trace(str(self.dir))
            self.on = True

    def after(self, done: int, state) -> None:
        if self.on and done >= self.tc.profile_start + self.tc.profile_steps:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
