"""Optimizer and learning-rate schedule: AdamW with a WSD (warmup-stable-decay) schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hybrid_lm.config import OptimConfig

# A parameter with any of these logical axes gets no weight decay: norms, biases, and the per-head
# scalars of recurrent mixers (A_log, dt_bias, D use the "ssm_heads" axis).
NO_DECAY_AXIS_NAMES = {"norm", "bias", "ssm_heads"}


def wsd_schedule(o: OptimConfig, total_steps: int):
    """Linear warmup to ``lr``, constant, then the last ``decay_fraction`` of steps decays to ``min_lr_ratio``."""
    warm = max(o.warmup_steps, 1)
    decay = int(round(o.decay_fraction * total_steps))
    decay_start = total_steps - decay

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        w = jnp.minimum(1.0, (step + 1.0) / warm)
        t = jnp.clip((step - decay_start) / max(decay, 1), 0.0, 1.0)
        if o.decay_shape == "linear":
            shape = 1.0 - t
        elif o.decay_shape == "cosine":
            shape = 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        else:  # "1-sqrt"
            shape = 1.0 - jnp.sqrt(t)
        return o.lr * w * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * shape)

    return schedule


def decay_mask(axes_tree):
    return jax.tree.map(lambda axes: not (set(axes) & NO_DECAY_AXIS_NAMES), axes_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(o: OptimConfig, total_steps: int, axes_tree):
    if o.name != "adamw":
        raise ValueError(f"optimizer {o.name!r} is not available yet (adamw only)")
    schedule = wsd_schedule(o, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                    mask=decay_mask(axes_tree)),
    )
    return tx, schedule
