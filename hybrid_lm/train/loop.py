"""The training loop: any number of local devices or processes, one mesh, exact resume.

Order per step (Kauldron's rule): dispatch step s, fetch the *previous* step's metrics (so the host
never blocks dispatch), then evaluate / save "after step s" before pulling batch s+1. SIGTERM saves
and exits cleanly; SIGUSR1 (SLURM ``--signal``) saves, requeues and exits.
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
from tqdm.auto import tqdm

from hybrid_lm.config import Config
from hybrid_lm.data.corpus import bits_per_byte
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.model.accounting import PEAK_FLOPS_H200_BF16, count_params, flops_per_token
from hybrid_lm.model.registry import recorded_backends
from hybrid_lm.train import distributed
from hybrid_lm.train import sharding as shd
from hybrid_lm.train.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.train.metrics import MetricsWriter, plot_loss_curve
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.train.rundir import accepted_run_ids, prepare_run_dir
from hybrid_lm.train.step import ModelFns, make_eval_step, make_train_step

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


def local_rows(sharding, global_shape) -> slice:
    """The contiguous rows of a batch-sharded global array that this process feeds."""
    idx = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [(i[0].start or 0) for i in idx]
    stops = [(i[0].stop if i[0].stop is not None else global_shape[0]) for i in idx]
    return slice(min(starts), max(stops))


def put_batch(batch: np.ndarray, sharding):
    rows = local_rows(sharding, batch.shape)
    return jax.make_array_from_process_local_data(sharding, batch[rows], batch.shape)


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def train(cfg: Config, workdir: Path | str | None = None, *, force: bool = False, devices=None) -> TrainResult:
    t_start = time.time()
    distributed.maybe_initialize()
    main = jax.process_index() == 0
    workdir = Path(workdir) if workdir else Path("runs") / cfg.run_id()
    if main:
        prepare_run_dir(cfg, workdir, force=force)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("run dir ready")

    mesh = shd.make_mesh(cfg.mesh, devices)
    rules = cfg.mesh.rules
    data = DataStreams(cfg)
    fns = ModelFns(cfg)
    # the WSD bounds are a runtime input of the step: one compiled step (and one persistent-cache
    # entry) serves every run length, so WSD branches and extended runs do not recompile
    optimizer_for = optimizer_for_bounds(cfg.optim, fns.axes)
    bounds = np.asarray(wsd_bounds(cfg.optim, cfg.train.steps), np.int32)
    tx, _ = optimizer_for(bounds)  # for the state's structure (independent of the bounds)
    n_batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.train.global_batch // cfg.train.microbatches
    if micro % n_batch_shards:
        raise ValueError(f"micro-batch of {micro} sequences (global_batch {cfg.train.global_batch} / "
                         f"{cfg.train.microbatches}) is not divisible by the batch mesh axes ({n_batch_shards})")

    # ---- shardings; parameters are created directly in their sharded layout (never whole on one device)
    p_shard = shd.tree_shardings(fns.axes, fns.abstract_params, mesh, rules)
    abstract_opt = jax.eval_shape(tx.init, fns.abstract_params)
    opt_shard = _match_opt_shardings(abstract_opt, fns.abstract_params, p_shard,
                                     jax.tree.map(lambda _: shd.replicated(mesh), abstract_opt))
    state_shard = {"params": p_shard, "opt_state": opt_shard, "step": shd.replicated(mesh)}
    batch_shard = shd.batch_sharding(mesh, rules)
    repl = shd.replicated(mesh)

    def init_state(seed):
        # the seed is a traced argument: with a constant key XLA constant-folds the whole random
        # init at compile time (7+ minutes for S5 on an H200)
        params = fns.init(seed)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    with jax.set_mesh(mesh):
        seed0 = jnp.asarray(cfg.train.seed, jnp.uint32)
        init_fn = jax.jit(init_state, out_shardings=state_shard)
        step_fn = jax.jit(make_train_step(fns, None, None, optimizer_for=optimizer_for),
                          in_shardings=(state_shard, batch_shard, repl), out_shardings=(state_shard, repl),
                          donate_argnums=0)
        eval_fn = jax.jit(make_eval_step(fns), in_shardings=(p_shard, batch_shard), out_shardings=repl)

        ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
        abstract_state = abstract_with_shardings(jax.eval_shape(init_state, seed0), state_shard)
        restored = ckpt.restore_latest(abstract_state)
        if restored is not None:
            state, meta = restored
            start = resumed_from = int(meta["step"])
            if meta.get("run_id") not in {cfg.run_id(), *accepted_run_ids(workdir)}:
                log.warning("resuming a checkpoint of run %s under run id %s (forced)", meta.get("run_id"),
                            cfg.run_id())
        else:
            state = init_fn(seed0)
            start, resumed_from = 0, None

        counts = count_params(cfg.model)
        flops = flops_per_token(cfg.model, cfg.data.seq_len)
        tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        on_gpu = jax.default_backend() == "gpu"
        n_dev = mesh.devices.size
        metrics = MetricsWriter(workdir / "metrics.jsonl", tensorboard=cfg.train.tensorboard) if main else None
        entropy0 = data.meta.get("val_order0_entropy_bits")

        def write(row):
            if metrics is not None:
                metrics.write(row)

        def run_eval(step: int) -> dict:
            eb = data.eval_batch
            per = max(n_batch_shards, (min(cfg.train.global_batch, eb.shape[0]) // n_batch_shards) * n_batch_shards)
            n = (eb.shape[0] // per) * per
            losses = [float(eval_fn(state["params"], put_batch(eb[i:i + per], batch_shard))) for i in range(0, n, per)]
            ce = float(np.mean(losses))
            row = {"kind": "eval", "step": step, "tokens": step * tokens_per_step, "loss": ce,
                   "bpb": bits_per_byte(ce, data.bytes_per_token), "order0_entropy_bits": entropy0,
                   "eval_windows": n}
            write(row)
            return row

        final_eval, preempted, skipped = None, None, 0
        window = {"t": time.time(), "step": start}
        bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps), desc=f"train {workdir.name}",
                   disable=not (cfg.train.progress and main), dynamic_ncols=True)

        def handle_stats(done: int, stats) -> None:
            """Host-side bookkeeping of a finished step (called one step late)."""
            nonlocal skipped
            stats = jax.device_get(stats)
            loss = float(stats["loss"])
            if not bool(stats["finite"]):
                if cfg.train.nan_policy == "stop":
                    raise FloatingPointError(
                        f"non-finite loss or gradient at step {done} (loss={loss}, grad_norm="
                        f"{float(stats['grad_norm'])}); the state was not updated by that step. "
                        "Set TrainConfig.nan_policy='skip' to skip such steps instead.")
                skipped += 1
                log.warning("step %d: non-finite loss/gradient, update skipped (%d so far)", done, skipped)
            every_step = "ssa_sparse" in stats  # SSA: log the stream each step used
            if done % cfg.train.log_every == 0 or done == cfg.train.steps or not bool(stats["finite"]) or every_step:
                now = time.time()
                n_steps = max(done - window["step"], 1)
                step_time = (now - window["t"]) / n_steps
                tps = tokens_per_step / max(step_time, 1e-9)
                window.update(t=now, step=done)
                row = {"kind": "train", "step": done, "tokens": done * tokens_per_step, "loss": loss,
                       "objective": float(stats["objective"]), "lr": float(stats["lr"]),
                       "grad_norm": float(stats["grad_norm"]), "param_norm": float(stats["param_norm"]),
                       "update_norm": float(stats["update_norm"]), "step_time": step_time,
                       "tokens_per_sec": tps, "skipped": not bool(stats["finite"]), "skipped_total": skipped,
                       "attention_impl": cfg.model.attention_impl,
                       "attention_backends": recorded_backends()}
                row.update({k: float(v) for k, v in stats.items() if k not in row and k != "finite"})
                if on_gpu:
                    row["mfu"] = tps * flops["train"] / (PEAK_FLOPS_H200_BF16 * n_dev)
                write(row)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")

        recorded_backends(clear=True)  # the first trace of the step fills it (attention_backends)
        pending = None
        profiling = False
        try:
            with distributed.PreemptionFlag() as flag:
                if start == 0:
                    run_eval(0)  # the curve starts at the untrained model
                window["t"] = time.time()
                for step in range(start, cfg.train.steps):
                    if step == cfg.train.profile_start and main:
                        jax.profiler.start_trace(str(workdir / "profile"))
                        profiling = True
                    tokens = put_batch(data.batch(step), batch_shard)
                    state, stats = step_fn(state, tokens, bounds)
                    done = step + 1
                    if pending is not None:
                        handle_stats(*pending)
                    pending = (done, stats)
                    if profiling and done >= cfg.train.profile_start + cfg.train.profile_steps:
                        jax.block_until_ready(state)
                        jax.profiler.stop_trace()
                        profiling = False
                    if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
                        handle_stats(*pending)
                        pending = None
                        final_eval = run_eval(done)
                        if main:
                            bar.write(f"step {done}: val loss {final_eval['loss']:.4f} nats, "
                                      f"{final_eval['bpb']:.3f} bits/byte")
                    stop = _any_process(flag.requested)
                    if stop or ckpt.should_save(done) or done == cfg.train.steps:
                        ckpt.save(done, state, {"step": done, "data_position": done,
                                                "tokens_seen": done * tokens_per_step, "run_id": cfg.run_id()},
                                  force=stop)
                    bar.update(1)
                    if stop:
                        preempted = signal.Signals(flag.signal).name if flag.signal else "signal"
                        break
                if pending is not None:
                    handle_stats(*pending)
                    pending = None
                if final_eval is None and preempted is None:  # nothing left to train: report the model
                    final_eval = run_eval(int(jax.device_get(state["step"])))
        finally:
            if profiling:
                jax.profiler.stop_trace()
            bar.close()
            ckpt.close()
            if metrics is not None:
                metrics.close()

        if preempted == "SIGUSR1":
            distributed.requeue_if_slurm()
        if main and preempted is None:
            plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss_curve.png",
                            title=f"{workdir.name}: {counts['non_embedding']:,} non-embedding params")
    return TrainResult(workdir=workdir, step=int(jax.device_get(state["step"])), final_eval=final_eval,
                       wall_seconds=time.time() - t_start, resumed_from=resumed_from, preempted=preempted,
                       skipped_steps=skipped)


def _match_opt_shardings(abstract_opt, abstract_params, p_shard, default):
    """Optimizer leaves whose path ends in a parameter's path (moments) take that parameter's sharding;
    the rest (step counts) keep ``default``."""
    by_path = {}
    for (path, leaf), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(p_shard)):
        by_path[tuple(map(str, path))] = (leaf.shape, s)

    def pick(path, leaf, dflt):
        keys = tuple(map(str, path))
        for i in range(len(keys)):
            hit = by_path.get(keys[i:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return dflt

    return jax.tree_util.tree_map_with_path(pick, abstract_opt, default)
