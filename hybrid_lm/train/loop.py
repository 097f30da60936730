"""The training loop: any number of local devices or processes, one mesh, exact resume.

:func:`train` prepares the run (continued pretraining's source, the workdir lock, the run dir, the
mesh, the data and the jitted program, the newest checkpoint) and runs :func:`_run_steps`. Each step,
in this order: **batch** (a pure function of the step) -> **step** (dispatched, not awaited) ->
**log** the *previous* step's metrics (fetched one step late, so the host never blocks dispatch; the
NaN policy's halt is seen here, ``train/nonfinite.py``) -> **eval** -> **checkpoint** -> **signals**
(``signals.py``, caught from the start of :func:`train`: SIGTERM and a first Ctrl-C save and exit
cleanly; SIGUSR1, SLURM's ``--signal``, saves, requeues and exits; one that arrives during start-up
stops the run before its first step, one after the last step lets the run finish its epilogue: final
checkpoint, loss curve). A step's metrics are fetched before the state after it is evaluated or saved.

Nothing is written to the workdir before the config and the data are checked (mesh, data streams,
program); a multi-process run tells its other processes when one fails (``train/distributed.py``).

Continued pretraining (``--init-from``) is ``train/continued.py``; the run dir and its identity
check ``train/rundir.py``; checkpoints ``run/checkpoint.py``.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from hybrid_lm.backends import recorded_backends
from hybrid_lm.config import Config
from hybrid_lm.experiment import run_id
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.errors import WorkdirError
from hybrid_lm.run.loss import evaluate
from hybrid_lm.train import distributed
from hybrid_lm import sharding as shd
from hybrid_lm.train import continued, nonfinite
from hybrid_lm import signals
from hybrid_lm.run.checkpoint import (Checkpointer, abstract_with_shardings, committed_path, params_fingerprint,
                                      read_committed)
from hybrid_lm.train.continued import InitSource
from hybrid_lm.lock import workdir_lock
from hybrid_lm.train.memory import check_step_fits
from hybrid_lm.train.logger import StepLogger, check_extras, startup_summary
from hybrid_lm.train.nonfinite import NonFiniteError  # noqa: F401  (raised by train(); part of its API)
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.train.rundir import RECORDS_BESIDE_CHECKPOINTS, archive_run, prepare_run_dir, record_init_fingerprint
from hybrid_lm.run.directory import accepted_run_ids, checkpoint_dir, checkpoint_steps, metrics_path
from hybrid_lm.step import ModelFns, StateInit, make_eval_step

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    workdir: Path
    step: int
    final_eval: dict | None
    wall_seconds: float
    resumed_from: int | None
    preempted: str | None = None  # "SIGTERM" / "SIGUSR1" / "SIGINT" when stopped by a signal
    skipped_steps: int = 0  # non-finite steps skipped in the whole run (earlier sessions included)
    compile_seconds: float | None = None  # the train step's trace + compile (None: no step was run)
    init_from: str | None = None  # TrainConfig.init_from: "<source run id>@<step>" of a continued run
    late_signal: str | None = None  # a SIGTERM / SIGUSR1 that arrived after the last step (run finished)
    before_training: bool = False  # stopped by a signal during start-up: nothing trained, nothing saved
    requeued: str | None = None  # SIGUSR1: what `scontrol requeue` did, in one line (process 0)


@dataclass
class Program:
    """A run's jitted functions and shardings on one mesh. The WSD bounds are a runtime input of the
    step: one compiled step (and one persistent-cache entry) serves every run length."""

    fns: ModelFns
    init: object  # seed -> state, sharded
    start: object  # params -> state with those parameters, a fresh optimizer state, step 0 (init_from)
    step: object  # (state, batch, bounds, guard) -> (state, stats, guard); see nonfinite.with_nan_guard
    eval: object  # (params, batch) -> mean CE
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

    def fresh_state(params):  # StateInit's state, around given parameters
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return Program(
        fns=fns, init=StateInit(fns, tx, state_shard),
        start=jax.jit(fresh_state, in_shardings=(p_shard,), out_shardings=state_shard, donate_argnums=0),
        step=jax.jit(nonfinite.with_nan_guard(fns, optimizer_for, cfg.train),
                     in_shardings=(state_shard, batch_shard, repl, repl), out_shardings=(state_shard, repl, repl),
                     donate_argnums=0),
        eval=jax.jit(make_eval_step(fns), in_shardings=(p_shard, batch_shard), out_shardings=repl),
        state_shard=state_shard, batch_shard=batch_shard, n_batch_shards=n_batch, bounds=bounds)


def init_or_restore(cfg: Config, prog: Program, ckpt: Checkpointer, source: InitSource | None = None,
                    main: bool = True):
    """``(state, resumed_from)``: the newest checkpoint that restores, else a fresh init (from a
    traced seed: with a constant key XLA constant-folds the whole random init at compile time), or,
    for a continued run, the parameters of ``source`` with a fresh optimizer state.
    Checkpoints that do not restore are moved aside; a workdir with checkpoints of which none restores
    is refused (``WorkdirError``) rather than silently trained from step 0. A workdir with metrics rows
    but no checkpoint ever committed (a run killed before its first save) has its rows archived, with
    a warning, and trains from step 0 (on process 0: ``main``)."""
    seed = jnp.asarray(cfg.train.seed, jnp.uint32)
    abstract = abstract_with_shardings(jax.eval_shape(prog.init, seed), prog.state_shard)
    restored = ckpt.restore_latest(abstract, move_corrupt=True)
    if restored is None:
        _nothing_restored(ckpt, main)
        if cfg.train.init_from:
            return prog.start(continued.source_params(source, prog.fns.abstract_params, prog.state_shard["params"])), None
        return prog.init(seed), None
    state, meta = restored
    _newest_committed_gone(ckpt, int(meta["step"]), main)
    if meta.get("run_id") not in {run_id(cfg), *accepted_run_ids(ckpt.directory.parent)}:
        log.warning("resuming a checkpoint of run %s under run id %s (forced)", meta.get("run_id"), run_id(cfg))
    return state, int(meta["step"])


def _nothing_restored(ckpt: Checkpointer, main: bool) -> None:
    """No checkpoint restored. Checkpoints exist (or were moved aside) and none restores: refuse. None
    was ever committed but metrics rows exist (killed before the first save): nothing can be lost, so
    archive the rows (as ``--restart`` does) and train from step 0."""
    workdir = ckpt.directory.parent
    metrics = metrics_path(workdir)
    has_rows = metrics.exists() and metrics.stat().st_size > 0
    corrupt = ckpt.directory / "corrupt"
    moved = sorted(p.name for p in corrupt.iterdir()) if corrupt.is_dir() else []
    if ckpt.restore_failures:
        what = "; ".join(f"step {s}: {why}" for s, why in ckpt.restore_failures)
        where = f" (moved to {corrupt})" if ckpt.moved_aside else ""
        found = f"no checkpoint restores{where}: {what}"
    elif moved:
        found = (f"{metrics if has_rows else workdir} holds {'rows' if has_rows else 'a run'} but {ckpt.directory} "
                 f"holds no checkpoint that restores (those that did not are in {corrupt}: {', '.join(moved)})")
    elif read_committed(ckpt.directory):
        steps = read_committed(ckpt.directory)
        found = (f"its committed checkpoints (steps {', '.join(map(str, steps))}, recorded in "
                 f"{committed_path(ckpt.directory)}) are gone from {ckpt.directory}: deleted after they were "
                 "committed; restore them if you can")
    else:
        if has_rows:
            if main:
                archive_run(workdir, RECORDS_BESIDE_CHECKPOINTS,
                            why=f"no checkpoint was committed before the run in {workdir} stopped")
            _sync("records of a run without checkpoints archived")
        return
    raise WorkdirError(f"{workdir}: {found}. Not starting over silently: rerun with --restart to archive "
                       "the old metrics and checkpoints and train from step 0, or use another --workdir")


def _newest_committed_gone(ckpt: Checkpointer, restored: int, main: bool) -> None:
    """One warning when checkpoints recorded as committed, newer than the one restored, are gone (deleted after
    their commit, not moved aside as corrupt)."""
    failed = {s for s, _ in ckpt.restore_failures}
    gone = [s for s in read_committed(ckpt.directory) if s > restored and s not in failed]
    if gone and main:
        log.warning("the checkpoint%s at step %s, recorded as committed in %s, %s gone from %s (deleted after the "
                    "commit); resuming from step %d", "s" * (len(gone) > 1), ", ".join(map(str, gone)),
                    committed_path(ckpt.directory), "are" if len(gone) > 1 else "is", ckpt.directory, restored)


def train(cfg: Config, workdir: Path | str | None = None, *, force: bool = False, restart: bool = False,
          init_from: str | Path | None = None, devices=None) -> TrainResult:
    """Train in ``workdir`` (default ``runs/<run id>``), resuming its newest checkpoint; process 0
    holds the workdir lock throughout. ``restart``: first move the workdir's metrics and checkpoints
    to ``archive/<UTC time>/`` and train from step 0.

    ``init_from`` (``RUN_DIR[@STEP]``; default ``cfg.train.init_from``): a continued run from that
    checkpoint's parameters (fresh optimizer state and schedule); ``cfg.train.init_from`` becomes
    ``"<source run id>@<step>"``. A bad source, a step that was not saved, parameter shapes that
    differ or a workdir holding another run's checkpoints fail in one line (``WorkdirError`` /
    ``ConfigError``) before the run dir is touched. Raises :class:`NonFiniteError` when the NaN
    policy stopped the run.

    SIGTERM, SIGUSR1 and SIGINT are caught from the start (``signals.py``); one that arrives
    before the first step returns a result with ``before_training`` set. SIGUSR1 requeues the SLURM
    job (``requeued``)."""
    t_start = time.time()
    with signals.catching() as flag:
        check_extras(cfg.train)  # a missing [tb] / [wandb] extra fails before the run dir exists
        distributed.maybe_initialize(flag)
        main = jax.process_index() == 0
        try:
            cfg, source = continued.resolve(cfg, init_from, workdir)  # checked before the run dir is touched
            workdir = Path(workdir) if workdir else Path("runs") / run_id(cfg)
            if source is not None and not restart:
                continued.refuse_foreign_checkpoints(cfg, workdir, source)
            try:
                res = _train(cfg, workdir, force, restart, devices, main, t_start, source, flag)
            except _Stopped as stop:
                saved = checkpoint_steps(workdir, missing_ok=True)
                res = TrainResult(workdir=workdir, step=saved[-1] if saved else 0, final_eval=None,
                                  wall_seconds=time.time() - t_start, resumed_from=None, preempted=stop.name,
                                  before_training=True)
        except BaseException as e:
            err = distributed.failed(e, f" from {workdir}'s newest checkpoint" if isinstance(workdir, Path) else "")
            if err is e:
                raise
            raise err from e
        if res.preempted == "SIGUSR1":
            signals.expect_requeue()
            if main:  # once for the whole job; SLURM then ends it (SIGTERM, caught) and starts it again
                res.requeued = signals.requeue()
        return res


class _Stopped(Exception):
    """A stop signal agreed by every process before the first step."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name


def _stop_point(flag: signals.PreemptionFlag) -> None:
    sig = _agreed_signal(flag.signal)
    if sig is not None:
        raise _Stopped(sig)


def _train(cfg: Config, workdir: Path, force: bool, restart: bool, devices, main: bool,
           t_start: float, source: InitSource | None, flag: signals.PreemptionFlag) -> TrainResult:
    _stop_point(flag)  # a signal during start-up
    # the config and the data are checked before anything is written to the workdir (a failed start leaves
    # nothing behind); process 0 prepares the embedded corpus on first use, the others then open it
    mesh = shd.make_mesh(cfg.mesh, devices)
    check_step_fits(cfg, mesh)  # a global batch that cannot fit: one line, nothing allocated
    data = distributed.main_first(lambda: DataStreams(cfg), "data ready")
    prog = build_program(cfg, mesh)
    with workdir_lock(workdir, enabled=main):
        if main:
            if restart:
                archive_run(workdir)
            prepare_run_dir(cfg, workdir, force=force, init_record=source.record() if source else None)
        _sync("run dir ready")
        with jax.set_mesh(mesh):
            ckpt = Checkpointer(checkpoint_dir(workdir), cfg.checkpoint)
            try:
                state, resumed_from = init_or_restore(cfg, prog, ckpt, source, main)
                _stop_point(flag)  # before the first step (and its compile)
            except BaseException:
                ckpt.close()
                raise
            return _train_steps(cfg, workdir, main, t_start, source, flag, mesh, data, prog, ckpt, state,
                                resumed_from)


def _train_steps(cfg: Config, workdir: Path, main: bool, t_start: float, source: InitSource | None,
                 flag: signals.PreemptionFlag, mesh, data: DataStreams, prog: Program, ckpt: Checkpointer, state,
                 resumed_from: int | None) -> TrainResult:
    tc = cfg.train
    start = resumed_from or 0
    logger = StepLogger(cfg, workdir, main=main, start=start, n_devices=mesh.devices.size,
                        every_step=bool(prog.fns.step_stats))
    if main:
        logger.summary(startup_summary(cfg, data, mesh))
    if tc.init_from and resumed_from is None:
        fingerprint = params_fingerprint(state["params"])
        if main:
            record_init_fingerprint(workdir, fingerprint)
        what = (f"the Hugging Face folder {source.workdir} ({source.run_id}" if source.kind == "hf" else
                f"{source.workdir} at step {source.step} (run {source.run_id}")
        logger.say(f"init     parameters of {what}, fingerprint {fingerprint}); fresh optimizer state, schedule "
                   "from step 0")
    recorded_backends(clear=True)  # the first trace of the step fills it (attention_backends)
    profile = _Profiler(tc, workdir, main)
    # signals are caught up to the end of the epilogue: one after the last step never kills the run
    try:
        out = _run_steps(cfg, prog, data, ckpt, logger, profile, flag, state, start)
        status = "stopped: non-finite" if out.halt else "preempted" if out.preempted else "finished"
        logger.closing_row(out.step, status)
    except BaseException:
        for close in (profile.close, logger.close, ckpt.close):  # a full disk fails these too: not the error told
            try:
                close()
            except Exception as e:  # noqa: BLE001
                log.debug("while stopping: %s", e)
        raise
    profile.close()
    logger.close()
    ckpt.close()
    if flag.signal and out.preempted is None and out.halt is None:
        out.late_signal = signal.Signals(flag.signal).name
    if out.halt is not None:
        raise nonfinite.NonFiniteError(out.halt.message(tc, out.step, out.saved_last_good, ckpt.directory, logger.skipped))
    return TrainResult(workdir=workdir, step=out.step, final_eval=out.final_eval,
                       wall_seconds=time.time() - t_start, resumed_from=resumed_from, preempted=out.preempted,
                       skipped_steps=logger.skipped, compile_seconds=logger.compile_seconds,
                       init_from=tc.init_from, late_signal=out.late_signal)


@dataclass
class _Outcome:
    state: dict
    step: int  # the state's step
    final_eval: dict | None = None
    preempted: str | None = None
    late_signal: str | None = None
    halt: nonfinite.Halt | None = None
    saved_last_good: bool = False  # halted: the state before the halting step was saved by this run now


def _run_steps(cfg: Config, prog: Program, data: DataStreams, ckpt: Checkpointer, logger: StepLogger,
               profile: _Profiler, flag: signals.PreemptionFlag, state, start: int) -> _Outcome:
    """Steps ``start .. steps`` (batch -> step -> log -> eval -> checkpoint -> signals); stops early on
    a signal or a NaN-policy halt."""
    tc = cfg.train
    final_eval, preempted, pending, last_saved = None, None, None, None
    guard = jax.device_put(np.zeros(2, np.int32), prog.state_shard["step"])
    batch_shape = (tc.global_batch, cfg.data.seq_len + 1)
    rows = shd.local_rows(prog.batch_shard, batch_shape)  # this process reads only its rows of each batch
    finish = nonfinite.finish_step  # a step's row, then the NaN policy (raises Halt); returns None
    try:
        if start < tc.steps:
            logger.compiling()
        if start == 0:
            _eval(logger, prog, data, state, 0)  # the curve starts at the untrained model
        for step in range(start, tc.steps):
            profile.before(step)
            batch = shd.put_local_batch(data.batch(step, rows), prog.batch_shard, batch_shape)  # batch
            state, stats, guard = prog.step(state, batch, prog.bounds, guard)  # step (dispatched)
            ckpt.check()  # a background save that failed stops the run here, not at the next save
            if step == start:
                logger.compiled(step)  # jit compiled synchronously inside that first call
            done = step + 1
            pending = finish(logger, pending)  # log: the previous step's row
            pending = (done, stats)
            profile.after(done, state)
            if done % tc.eval_every == 0 or done == tc.steps:  # eval
                pending = finish(logger, pending)
                final_eval = _eval(logger, prog, data, state, done)
            agreed = _agreed_signal(flag.signal if flag.requested else None)  # signals, agreed by every process
            stop = agreed is not None
            if stop or ckpt.should_save(done) or done == tc.steps:  # checkpoint
                pending = finish(logger, pending)  # never save a step the NaN policy halted at
                ckpt.save(done, state, _ckpt_meta(cfg, done), force=stop)
                last_saved = done
            logger.advance()
            if stop and done < tc.steps:
                preempted = signal.Signals(agreed).name
                break
        finish(logger, pending)
    except nonfinite.Halt as halt:
        last_good = int(jax.device_get(state["step"]))  # held by the guard: the state before the halting step
        fresh = last_good != last_saved and last_good not in ckpt.all_steps()
        if fresh:
            ckpt.save(last_good, state, {**_ckpt_meta(cfg, last_good), "stopped": "non-finite"}, force=True)
        return _Outcome(state, last_good, final_eval, halt=halt, saved_last_good=fresh)
    step = int(jax.device_get(state["step"]))
    if final_eval is None and preempted is None:  # nothing left to train: report the model
        final_eval = _eval(logger, prog, data, state, step)
    return _Outcome(state, step, final_eval, preempted)


def _ckpt_meta(cfg: Config, step: int) -> dict:
    return {"step": step, "data_position": step, "tokens_seen": step * cfg.train.global_batch * cfg.data.seq_len,
            "run_id": run_id(cfg)}


def _eval(logger: StepLogger, prog: Program, data: DataStreams, state, step: int) -> dict:
    result = evaluate(prog.eval, state["params"], data.eval_batch, prog.batch_shard,
                      global_batch=logger.cfg.train.global_batch, n_batch_shards=prog.n_batch_shards,
                      bytes_per_token=data.bytes_per_token)
    return logger.eval_row(step, result, data.meta.get("val_order0_entropy_bits"))


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
        multihost_utils.sync_global_devices(name)


def _agreed_signal(sig: int | None) -> int | None:
    """The stop signal every process acts on: the most urgent one any process received (SIGUSR1, then
    SIGTERM, then SIGINT), or None."""
    if jax.process_count() == 1:
        return sig
    return signals.most_urgent(np.ravel(multihost_utils.process_allgather(np.asarray(sig or 0, np.int32))))
