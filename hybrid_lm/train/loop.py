"""Single-host training loop on a device mesh (``data`` axis by default).

The step is functional: the model is ``nnx.split`` once; parameters and optimizer state travel as
plain pytrees through ``jax.jit`` with explicit in/out shardings, and ``nnx.merge`` happens inside.
Order per step (Kauldron's rule): run step s, then save "after step s" before pulling batch s+1.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from hybrid_lm.config import Config
from hybrid_lm.data.corpus import bits_per_byte
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.model.accounting import PEAK_FLOPS_H200_BF16, count_params, flops_per_token
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.transformer import HybridLM, cross_entropy
from hybrid_lm.train import sharding as shd
from hybrid_lm.train.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.train.metrics import MetricsWriter, plot_loss_curve
from hybrid_lm.train.optim import make_optimizer
from hybrid_lm.train.rundir import prepare_run_dir

log = logging.getLogger(__name__)


class ModelFns:
    """Pure functions around one model definition: init, apply and the logical-axes tree."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
        self.graphdef, abstract_state = nnx.split(abstract, nnx.Param)
        self._abstract_state = abstract_state
        self.abstract_params = nnx.to_pure_dict(abstract_state)
        axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], abstract_state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.axes = nnx.to_pure_dict(axes)

    def init(self, seed: int):
        model = HybridLM(self.cfg.model, rngs=nnx.Rngs(params=seed))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def model(self, params) -> HybridLM:
        state = jax.tree.map(lambda x: x, self._abstract_state)  # fresh copy, then fill in
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def loss(self, params, tokens, step, *, train: bool = True):
        """Mean cross-entropy of next-token prediction on ``tokens [B, T+1]``."""
        cfg = self.cfg
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        B, T = inputs.shape
        # global example index of each row: independent of how the batch is sharded
        example_ids = step * cfg.train.global_batch + jnp.arange(B, dtype=jnp.int32)
        ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                           attention_impl=cfg.model.attention_impl, step=step, seed=cfg.train.seed,
                           example_ids=example_ids, train=train)
        logits = self.model(params)(inputs, ctx)
        return cross_entropy(logits, targets, cfg.optim.z_loss if train else 0.0)


@dataclass
class TrainResult:
    workdir: Path
    step: int
    final_eval: dict | None
    wall_seconds: float
    resumed_from: int | None


def train(cfg: Config, workdir: Path | str | None = None, *, force: bool = False, devices=None) -> TrainResult:
    t_start = time.time()
    workdir = Path(workdir) if workdir else Path("runs") / cfg.run_id()
    prepare_run_dir(cfg, workdir, force=force)
    mesh = shd.make_mesh(cfg.mesh, devices)
    rules = cfg.mesh.rules
    data = DataStreams(cfg)
    fns = ModelFns(cfg)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, fns.axes)

    n_dev = mesh.devices.size
    if cfg.train.global_batch % (mesh.shape["data"] * mesh.shape["fsdp"]):
        raise ValueError(f"global_batch={cfg.train.global_batch} is not divisible by the batch mesh axes "
                         f"{mesh.shape['data']}x{mesh.shape['fsdp']}")

    # ---- shardings; parameters are created directly in their sharded layout (never whole on one device)
    p_shard = shd.tree_shardings(fns.axes, fns.abstract_params, mesh, rules)
    abstract_opt = jax.eval_shape(tx.init, fns.abstract_params)
    opt_shard = _match_opt_shardings(abstract_opt, fns.abstract_params, p_shard,
                                     jax.tree.map(lambda _: shd.replicated(mesh), abstract_opt))
    state_shard = {"params": p_shard, "opt_state": opt_shard, "step": shd.replicated(mesh)}
    batch_shard = shd.batch_sharding(mesh, rules)
    repl = shd.replicated(mesh)

    def init_state():
        params = fns.init(cfg.train.seed)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def train_step(state, tokens):
        (loss, ce), grads = jax.value_and_grad(lambda p: fns.loss(p, tokens, state["step"]), has_aux=True)(
            state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        stats = {"loss": ce, "objective": loss, "grad_norm": _global_norm(grads), "lr": schedule(state["step"])}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, stats

    def eval_loss(params, tokens):
        return fns.loss(params, tokens, jnp.zeros((), jnp.int32), train=False)[1]

    with jax.set_mesh(mesh):
        init_fn = jax.jit(init_state, out_shardings=state_shard)
        step_fn = jax.jit(train_step, in_shardings=(state_shard, batch_shard), out_shardings=(state_shard, repl),
                          donate_argnums=0)
        eval_fn = jax.jit(eval_loss, in_shardings=(p_shard, batch_shard), out_shardings=repl)

        ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
        abstract_state = abstract_with_shardings(jax.eval_shape(init_state), state_shard)
        restored = ckpt.restore_latest(abstract_state)
        if restored is not None:
            state, meta = restored
            start = int(meta["step"])
            resumed_from = start
            if meta.get("run_id") != cfg.run_id():
                log.warning("resuming a checkpoint of run %s under run id %s (forced)", meta.get("run_id"),
                            cfg.run_id())
        else:
            state = init_fn()
            start, resumed_from = 0, None

        counts = count_params(cfg.model)
        flops = flops_per_token(cfg.model, cfg.data.seq_len)
        tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        on_gpu = jax.default_backend() == "gpu"
        metrics = MetricsWriter(workdir / "metrics.jsonl", tensorboard=cfg.train.tensorboard)
        entropy0 = data.meta.get("val_order0_entropy_bits")

        def run_eval(step: int) -> dict:
            losses = []
            eb = data.eval_batch
            per = max(1, min(cfg.train.global_batch, eb.shape[0]))
            per -= per % (mesh.shape["data"] * mesh.shape["fsdp"]) or 0
            per = max(per, mesh.shape["data"] * mesh.shape["fsdp"])
            n = (eb.shape[0] // per) * per
            for i in range(0, n, per):
                losses.append(float(eval_fn(state["params"], jax.device_put(eb[i:i + per], batch_shard))))
            ce = float(np.mean(losses))
            row = {"kind": "eval", "step": step, "tokens": step * tokens_per_step, "loss": ce,
                   "bpb": bits_per_byte(ce, data.bytes_per_token), "order0_entropy_bits": entropy0,
                   "eval_windows": n}
            metrics.write(row)
            return row

        final_eval = None
        bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps), desc=f"train {workdir.name}",
                   disable=not cfg.train.progress, dynamic_ncols=True)
        if start == 0:
            run_eval(0)  # the curve starts at the untrained model
        t_last, step_last = time.time(), start
        try:
            for step in range(start, cfg.train.steps):
                tokens = jax.device_put(data.batch(step), batch_shard)
                state, stats = step_fn(state, tokens)
                done = step + 1
                if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    stats = jax.device_get(stats)
                    now = time.time()
                    tps = (done - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                    t_last, step_last = now, done
                    loss = float(stats["loss"])
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"non-finite loss {loss} at step {done}")
                    row = {"kind": "train", "step": done, "tokens": done * tokens_per_step, "loss": loss,
                           "lr": float(stats["lr"]), "grad_norm": float(stats["grad_norm"]),
                           "tokens_per_sec": tps, "attention_impl": cfg.model.attention_impl}
                    if on_gpu:
                        row["mfu"] = tps * flops["train"] / (PEAK_FLOPS_H200_BF16 * n_dev)
                    metrics.write(row)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
                if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
                    final_eval = run_eval(done)
                    bar.write(f"step {done}: val loss {final_eval['loss']:.4f} nats, "
                              f"{final_eval['bpb']:.3f} bits/byte")
                if ckpt.should_save(done) or done == cfg.train.steps:
                    ckpt.save(done, state, {"step": done, "data_position": done, "tokens_seen": done * tokens_per_step,
                                            "run_id": cfg.run_id()})
                bar.update(1)
            if final_eval is None:  # nothing left to train: report the restored model
                final_eval = run_eval(int(jax.device_get(state["step"])))
        finally:
            bar.close()
            ckpt.close()
            metrics.close()

        plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss_curve.png",
                        title=f"{workdir.name}: {counts['non_embedding']:,} non-embedding params")
    return TrainResult(workdir=workdir, step=int(jax.device_get(state["step"])), final_eval=final_eval,
                       wall_seconds=time.time() - t_start, resumed_from=resumed_from)


def _global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


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
