"""The functional train and eval steps.

The model is ``nnx.split`` once; parameters and optimizer state travel as plain pytrees through
``jax.jit`` and ``nnx.merge`` happens inside, so the hot loop has no NNX Python overhead.

A batch is a token array ``[B, T+1]`` or a dict ``{"tokens": [B, T+1], "segment_ids": [B, T+1]}``
(``segment_ids`` only with ``DataConfig.document_mask``); :func:`split_batch` is the one place that
reads either form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import Config
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.backends import loss_backend, loss_kernel_backend
from hybrid_lm.model.transformer import HybridLM, ParamInit
from hybrid_lm.errors import DataError
from hybrid_lm.ops.attention import default_positions, segment_positions
from hybrid_lm.ops.cross_entropy import (chunked_cross_entropy, chunked_token_cross_entropy, cross_entropy,
                                         token_cross_entropy)


def split_batch(batch, document_mask: bool) -> tuple[jax.Array, jax.Array | None]:
    """``(tokens [B, T+1], segment_ids [B, T+1] or None)`` of a batch: a token array, or a dict with
    ``"tokens"`` and, exactly when ``document_mask`` (``DataConfig.document_mask``), ``"segment_ids"``
    (each token's document index in its window, non-decreasing along a row)."""
    if not isinstance(batch, dict):
        batch = {"tokens": batch}
    unknown = set(batch) - {"tokens", "segment_ids"}
    if "tokens" not in batch or unknown:
        raise DataError(f"a batch dict has keys 'tokens' and (with DataConfig.document_mask) 'segment_ids', "
                        f"got {sorted(batch)}")
    tokens, segment_ids = batch["tokens"], batch.get("segment_ids")
    if document_mask != (segment_ids is not None):
        raise DataError("DataConfig.document_mask=True needs batches with 'segment_ids'" if document_mask else
                        "the batch has 'segment_ids' but DataConfig.document_mask is False: the data "
                        "loader and the config disagree")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
        raise DataError(f"segment_ids {segment_ids.shape} must have the shape of tokens {tokens.shape}")
    return tokens, segment_ids


class ModelFns:
    """Pure functions around one model definition: init, apply, loss and the logical-axes tree.

    ``step_stats``: names of sown stats that some layer's mixer asks to be logged every step (a
    mixer class's ``step_stats`` attribute, e.g. SSA's stream choice).
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
        self.graphdef, self._abstract_state = nnx.split(abstract, nnx.Param)
        self.param_init = ParamInit(cfg.model)
        self.abstract_params = nnx.to_pure_dict(self._abstract_state)
        axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], self._abstract_state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.axes = nnx.to_pure_dict(axes)
        self.step_stats = frozenset(name for t in set(cfg.model.layer_types())
                                    for name in getattr(get_mixer(cfg.model.mixer(t).kind).cls, "step_stats", ()))

    def init(self, seed):
        """Parameters from an int seed (a Python int or an integer scalar, traced or not): those of
        ``HybridLM(cfg, rngs=nnx.Rngs(params=jax.random.key(seed)))`` under ``jax.jit``, built by
        :class:`ParamInit` with one compiled program per kind of part."""
        return self.param_init(seed)

    def model(self, params) -> HybridLM:
        state = jax.tree.map(lambda x: x, self._abstract_state)  # fresh copy, then fill in
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def _context(self, B: int, T: int, segment_ids, *, step, example_ids, train: bool, micro_index=0) -> MixerContext:
        """The mixers' context for inputs ``[B, T]`` (``segment_ids [B, T+1]`` or None)."""
        seg = None if segment_ids is None else segment_ids[:, :-1]
        return MixerContext(positions=default_positions(B, T) if seg is None else segment_positions(seg),
                            attention_impl=self.cfg.model.attention_impl, step=step, seed=self.cfg.train.seed,
                            example_ids=example_ids, train=train, micro_index=micro_index, segment_ids=seg)

    def loss(self, params, tokens, step, example_ids, *, segment_ids=None, micro_index=0, train: bool = True):
        """(objective, aux) of next-token prediction on ``tokens [B, T+1]``.

        ``segment_ids [B, T+1]`` (document masking) or None: the inputs' part goes to the model,
        whose attention then stays inside each document and whose positions restart per document.

        ``aux`` holds ``ce`` (mean cross-entropy, nats) and the sums over layers of values mixers sow
        as ``nnx.Intermediate`` (e.g. SSA's ``ssa_align``); sown ``aux_loss`` terms join the objective.
        ``example_ids [B]`` are global example indices: per-example randomness (SA permutations)
        depends on them, never on a row's device-local position. ``micro_index`` (the micro-batch
        within the step) keys per-micro-batch randomness.
        """
        cfg = self.cfg
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        B, T = inputs.shape
        ctx = self._context(B, T, segment_ids, step=step, example_ids=example_ids, train=train, micro_index=micro_index)
        model = self.model(params)
        z_loss = cfg.optim.z_loss if train else 0.0
        if loss_backend(cfg.model.loss_impl, B * T, cfg.model.vocab_size)[0] == "chunked":  # never more than loss_chunk tokens of logits at a time
            h, sown = nnx.capture(model, nnx.Intermediate)(inputs, ctx, features=True)
            obj, ce = chunked_cross_entropy(h.reshape(B * T, -1), model.head_matrix(), targets.reshape(-1),
                                            z_loss, chunk=cfg.model.loss_chunk,
                                            kernel=loss_kernel_backend()[0])
        else:
            logits, sown = nnx.capture(model, nnx.Intermediate)(inputs, ctx)
            obj, ce = cross_entropy(logits, targets, z_loss)
        aux = {"ce": ce}
        totals: dict[str, jax.Array] = {}
        for path, value in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(sown)):
            name = next(str(p.key) for p in reversed(path) if isinstance(getattr(p, "key", None), str))
            totals[name] = totals.get(name, 0.0) + value
        if "aux_loss" in totals:
            obj = obj + totals.pop("aux_loss")
        aux.update(totals)
        return obj, aux

    def window_losses(self, params, tokens, *, segment_ids=None):
        """Each row's mean next-token cross-entropy (nats) on ``tokens [B, T+1]``: ``[B]`` fp32, the
        eval's per-window losses (no z-loss, eval mode; whole logits or chunks as :meth:`loss` picks)."""
        cfg = self.cfg
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        B, T = inputs.shape
        ctx = self._context(B, T, segment_ids, step=jnp.zeros((), jnp.int32), example_ids=jnp.arange(B, dtype=jnp.int32),
                            train=False)
        model = self.model(params)
        if loss_backend(cfg.model.loss_impl, B * T, cfg.model.vocab_size)[0] == "chunked":
            h, _ = nnx.capture(model, nnx.Intermediate)(inputs, ctx, features=True)
            ce = chunked_token_cross_entropy(h.reshape(B * T, -1), model.head_matrix(), targets.reshape(-1),
                                             cfg.model.loss_chunk)
        else:
            logits, _ = nnx.capture(model, nnx.Intermediate)(inputs, ctx)
            ce = token_cross_entropy(logits, targets)
        return jnp.mean(ce.reshape(B, T), axis=1)


class StateInit:
    """``init(seed) -> state`` (``params``, ``opt_state``, ``step``): the parameters part by part
    (:class:`ParamInit`), then the optimizer state and step in one more program. ``state_shard``
    (the state's tree of ``NamedSharding``) creates every array in its layout, or None. Pass the seed
    as an array or a Python int: it is a program argument, never a constant (a constant key makes XLA
    fold the whole random init at compile time). ``compile(seed)`` compiles every program ahead of
    the first call."""

    def __init__(self, fns: ModelFns, tx, state_shard=None):
        if state_shard is None:
            self.params = fns.param_init
            kw = {}
        else:
            self.params = ParamInit(fns.cfg.model, state_shard["params"])
            kw = dict(in_shardings=(state_shard["params"],), out_shardings=(state_shard["opt_state"], state_shard["step"]))
        self._rest = jax.jit(lambda params: (tx.init(params), jnp.zeros((), jnp.int32)), **kw)

    def __call__(self, seed) -> dict:
        params = self.params(seed)
        opt_state, step = self._rest(params)
        return {"params": params, "opt_state": opt_state, "step": step}

    def compile(self, seed) -> None:
        self.params.compile(seed)
        self._rest.lower(jax.eval_shape(self.params, seed)).compile()


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(fns: ModelFns, optimizer_for):
    """``step(state, batch, bounds) -> (state, stats)`` with gradient accumulation and a non-finite guard.

    ``batch``: a token array ``[B, T+1]`` or a dict (:func:`split_batch`).

    ``optimizer_for`` (``train.optim.optimizer_for_bounds``) maps the WSD bounds
    ``[decay_start, decay_steps]`` (int32, a runtime input) to ``(tx, schedule)``: the optimizer is
    built inside the step, so the run length is not compiled in.

    The global batch is split into ``TrainConfig.microbatches`` equal parts whose gradients are
    averaged in fp32 (equal to the large batch up to float rounding). A step whose loss or gradient
    is not finite leaves parameters and optimizer state unchanged (``stats['finite'] = False``);
    the host then skips it or stops, per ``TrainConfig.nan_policy``.
    """
    cfg = fns.cfg
    M = cfg.train.microbatches
    B = cfg.train.global_batch

    def grads_of(params, tokens, segment_ids, step, example_ids, micro_index):
        (obj, aux), g = jax.value_and_grad(
            lambda p: fns.loss(p, tokens, step, example_ids, segment_ids=segment_ids, micro_index=micro_index),
            has_aux=True)(params)
        return obj, aux, g

    def train_step(state, batch, bounds):
        tokens, segment_ids = split_batch(batch, cfg.data.document_mask)
        tx, schedule = optimizer_for(bounds)
        params, step = state["params"], state["step"]
        ids = step * B + jnp.arange(B, dtype=jnp.int32)
        if M == 1:
            obj, aux, grads = grads_of(params, tokens, segment_ids, step, ids, 0)
        else:
            def micro(x):  # [B, T+1] -> [M, B/M, T+1]; None (no segments) stays None
                return None if x is None else x.reshape(M, B // M, x.shape[-1])
            mb, mseg = micro(tokens), micro(segment_ids)
            mids = ids.reshape(M, B // M)
            aux_shape = jax.eval_shape(
                lambda: grads_of(params, mb[0], None if mseg is None else mseg[0], step, mids[0], 0)[1])

            def body(carry, xs):
                g_acc, o_acc, a_acc = carry
                o, a, g = grads_of(params, xs[0], xs[1], step, xs[2], xs[3])
                g_acc = jax.tree.map(lambda x, y: x + y.astype(jnp.float32), g_acc, g)
                return (g_acc, o_acc + o, jax.tree.map(jnp.add, a_acc, a)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
            (gsum, osum, asum), _ = jax.lax.scan(body, (zeros, 0.0, aux0), (mb, mseg, mids, jnp.arange(M)))
            grads = jax.tree.map(lambda g: g / M, gsum)
            obj, aux = osum / M, jax.tree.map(lambda a: a / M, asum)
        ce = aux.pop("ce")
        gnorm = global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        unorm = global_norm(updates)  # an update that overflows is caught at its own step, not the next
        finite = jnp.isfinite(obj) & jnp.isfinite(gnorm) & jnp.isfinite(unorm)
        new_params = jax.tree.map(lambda p, u: p + u, params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = {"params": keep(new_params, params), "opt_state": keep(opt_state, state["opt_state"]),
                     "step": step + 1}
        stats = {"loss": ce, "objective": obj, "grad_norm": gnorm, "param_norm": global_norm(params),
                 "update_norm": unorm, "lr": schedule(step), "finite": finite, **aux}
        return new_state, stats

    return train_step


def make_eval_step(fns: ModelFns):
    """``eval_losses(params, batch) -> [B]``: each window's mean CE (``batch`` as :func:`make_train_step`'s)."""
    def eval_losses(params, batch):
        tokens, segment_ids = split_batch(batch, fns.cfg.data.document_mask)
        return fns.window_losses(params, tokens, segment_ids=segment_ids)
    return eval_losses
