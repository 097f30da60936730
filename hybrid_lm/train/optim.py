"""Optimizers (AdamW; Muon for hidden matrices) and the WSD learning-rate schedule.

Routing is decided by each parameter's logical axes, never by its ndim:

- **Muon** (``optax.contrib.muon``) for hidden weight matrices: parameters whose axes are all
  "hidden" axes (embed, mlp, heads, kv_heads, head_dim, conv_dim, state, lowrank) and that have an
  ``embed`` axis on one side. ``[d, H, Dh]`` kernels are orthogonalised as ``[d, H*Dh]`` and
  ``[H, Dh, d]`` as ``[H*Dh, d]`` (``MuonDimensionNumbers``).
- **AdamW** for everything else: embeddings and LM head (``vocab`` axis), norms, biases, ``[d, H]``
  projections to per-head scalars (sigmoid gates, Mamba-2's dt, GDN's a and beta), short-conv taps
  (``conv_kernel``), ``A_log``/``dt_bias``/``D`` (``ssm_heads``).

Muon learning-rate rule: updates are rescaled to AdamW's RMS (``consistent_rms=0.2``, Moonlight,
arXiv 2502.16982), so Muon and AdamW share one peak LR and one schedule.

Weight decay 0.1 by default; none on parameters with a ``norm``, ``bias`` or ``ssm_heads`` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from hybrid_lm.config import OptimConfig, decay_steps, wsd_bounds  # noqa: F401 re-exported: the schedule's bounds

NO_DECAY_AXIS_NAMES = {"norm", "bias", "ssm_heads"}
_HIDDEN_AXES = {"embed", "mlp", "heads", "kv_heads", "head_dim", "conv_dim", "state", "lowrank"}
MUON_RMS = 0.2


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def wsd_lr(o: OptimConfig, step, decay_start, decay_steps):
    """Linear warmup to ``lr``, constant, then decay to ``min_lr_ratio`` over ``[decay_start,
    decay_start + decay_steps)``. The bounds may be traced: the run length is then a runtime input
    and one compiled step serves every run length (WSD branches, extended runs)."""
    warm = max(o.warmup_steps, 1)
    step = jnp.asarray(step, jnp.float32)
    w = jnp.minimum(1.0, (step + 1.0) / warm)
    t = jnp.clip((step - jnp.asarray(decay_start, jnp.float32)) /
                 jnp.maximum(jnp.asarray(decay_steps, jnp.float32), 1.0), 0.0, 1.0)
    if o.decay_shape == "linear":
        shape = 1.0 - t
    elif o.decay_shape == "cosine":
        shape = 0.5 * (1.0 + jnp.cos(jnp.pi * t))
    else:  # "1-sqrt"
        shape = 1.0 - jnp.sqrt(t)
    return o.lr * w * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * shape)


def wsd_schedule(o: OptimConfig, total_steps: int):
    """``step -> lr`` for a run of ``total_steps`` (see :func:`wsd_lr`)."""
    bounds = wsd_bounds(o, total_steps)
    return lambda step: wsd_lr(o, step, *bounds)


def decay_mask(axes_tree):
    return jax.tree.map(lambda axes: not (set(axes) & NO_DECAY_AXIS_NAMES), axes_tree, is_leaf=_is_axes)


def muon_dims(axes: tuple) -> MuonDimensionNumbers | None:
    """How Muon sees a parameter with these logical axes, or None to route it to AdamW."""
    if len(axes) < 2 or not set(axes) <= _HIDDEN_AXES or "embed" not in axes:
        return None
    if set(axes) - {"embed"} <= {"heads", "kv_heads"}:
        return None  # [d, H] projections to per-head scalars (gates, dt, beta): AdamW
    if axes[0] == "embed":  # input projection: embed -> everything else
        return MuonDimensionNumbers(reduction_axis=0, output_axis=tuple(range(1, len(axes))))
    if axes[-1] == "embed":  # output projection: everything else -> embed
        return MuonDimensionNumbers(reduction_axis=tuple(range(len(axes) - 1)), output_axis=len(axes) - 1)
    return None


def muon_routing(axes_tree):
    return jax.tree.map(muon_dims, axes_tree, is_leaf=_is_axes)


def decoupled_weight_decay(schedule, weight_decay: float, mask) -> optax.GradientTransformation:
    """``u <- u - lr(step) * wd * p`` on masked parameters (AdamW-style decoupled decay)."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

    def update(updates, state, params):
        lr = schedule(state.count)
        updates = jax.tree.map(lambda u, p, m: u - lr * weight_decay * p if m else u, updates, params, mask)
        return updates, optax.ScaleByScheduleState(count=state.count + 1)

    return optax.GradientTransformation(init, update)


def optimizer_for_bounds(o: OptimConfig, axes_tree):
    """``bounds -> (tx, schedule)``: the optimizer for WSD bounds ``[decay_start, decay_steps]``
    (int32, traced inside the train step or concrete). The optimizer state does not depend on them."""
    clip = optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity()
    mask = decay_mask(axes_tree)
    if o.name not in ("adamw", "muon"):
        raise ValueError(f"optimizer {o.name!r}: choose adamw or muon")

    def build(bounds):
        def schedule(step):
            return wsd_lr(o, step, bounds[0], bounds[1])

        if o.name == "adamw":
            tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
        else:
            # optax's muon applies its Adam branch's decay unmasked, so decay is applied here instead
            tx = optax.chain(
                optax.contrib.muon(schedule, beta=o.muon_beta, eps=o.eps, adam_b1=o.b1, adam_b2=o.b2,
                                   muon_weight_dimension_numbers=muon_routing(axes_tree),
                                   consistent_rms=MUON_RMS),
                decoupled_weight_decay(schedule, o.weight_decay, mask),
            )
        return optax.chain(clip, tx), schedule

    return build


def make_optimizer(o: OptimConfig, total_steps: int, axes_tree):
    """``(tx, schedule)`` with the run length fixed (compiled in); the trainer instead passes the
    bounds at run time (:func:`optimizer_for_bounds`, ``make_train_step(..., optimizer_for=...)``)."""
    return optimizer_for_bounds(o, axes_tree)(wsd_bounds(o, total_steps))
