"""The NaN policy (``TrainConfig.nan_policy``): a step whose loss, gradient or update is not finite
never changes the parameters (``step.py``'s own guard). A guard on the device counts such steps
in a row and halts the run at the first one under 'stop', at the ``max_consecutive_skips``-th under
'skip'. The halting step and every step dispatched after it return their input state unchanged, so
when the host sees the halt (one step late, :func:`finish_step`) it still holds the state before the
halting step: the train loop saves it and stops with :class:`NonFiniteError` (one line in the CLI,
exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp

from hybrid_lm.config import TrainConfig
from hybrid_lm.step import ModelFns, make_train_step


class NonFiniteError(FloatingPointError):
    """The NaN policy stopped the run; the state before the halting step was saved first."""


def with_nan_guard(fns: ModelFns, optimizer_for, tc: TrainConfig):
    """The train step with the NaN policy's device side: ``(state, batch, bounds, guard) -> (state,
    stats, guard)``. ``guard`` (int32[2]) holds the non-finite steps in a row and whether the run has
    halted; the run halts when that count reaches 1 ('stop') or ``max_consecutive_skips`` ('skip').
    A halting step, and every step after it, returns its input state, step counter included. The
    stats gain ``halted`` and ``nonfinite_streak``.

    The state is held by ``step.py``'s own non-finite guard: a halting step is non-finite, and
    a step after it gets a NaN objective (:class:`_HeldLoss`). A second select over the whole state
    here would cost XLA temporaries the size of the parameters and optimizer state."""
    limit = 1 if tc.nan_policy == "stop" else tc.max_consecutive_skips

    def step(state, batch, bounds, guard):
        new, stats = make_train_step(_HeldLoss(fns, guard[1] > 0), optimizer_for)(state, batch, bounds)
        streak = jnp.where(stats["finite"], 0, guard[0] + 1).astype(jnp.int32)
        halted = (guard[1] > 0) | (streak >= limit)
        new = {**new, "step": jnp.where(halted, state["step"], new["step"])}
        return (new, {**stats, "halted": halted, "nonfinite_streak": streak},
                jnp.stack([streak, halted.astype(jnp.int32)]))

    return step


class _HeldLoss:
    """``fns`` whose objective is NaN while ``held`` (a traced bool): the train step then keeps the
    state as for any non-finite step. The gradient is not touched (the NaN is a constant term)."""

    def __init__(self, fns: ModelFns, held):
        self._fns, self._held = fns, held

    def __getattr__(self, name):
        return getattr(self._fns, name)

    def loss(self, *args, **kwargs):
        obj, aux = self._fns.loss(*args, **kwargs)
        return obj + jnp.where(self._held, jnp.nan, 0.0).astype(obj.dtype), aux


class Halt(Exception):
    """The device guard halted the run at step ``done`` (raised by :func:`finish_step`)."""

    def __init__(self, done: int, streak: int, stats: dict):
        super().__init__(done)
        self.done, self.streak, self.stats = done, streak, stats

    def message(self, tc: TrainConfig, last_good: int, saved_now: bool, ckpt_dir: Path, skipped: int) -> str:
        """The one-line error: the step(s), which of loss / gradient was not finite, where the last
        good state is and what to do."""
        loss, obj, gnorm = (float(self.stats[k]) for k in ("loss", "objective", "grad_norm"))
        bad_loss, bad_grad = not (math.isfinite(loss) and math.isfinite(obj)), not math.isfinite(gnorm)
        if not bad_loss and not bad_grad:  # the update overflowed (its norm is not finite)
            what = (f"the update is not finite (loss={loss}, grad_norm={gnorm}, "
                    f"update_norm={float(self.stats.get('update_norm', float('nan')))})")
        else:
            what = ("the loss and the gradient are" if bad_loss and bad_grad else
                    "the loss is" if bad_loss else "the gradient is") + f" not finite (loss={loss}, grad_norm={gnorm})"
        if tc.nan_policy == "stop":
            head = f"non-finite loss or gradient at step {self.done}: {what}"
            fix = "lower OptimConfig.lr (or set TrainConfig.nan_policy='skip')"
        else:
            head = (f"non-finite loss or gradient at {self.streak} steps in a row, steps {self.done - self.streak + 1}"
                    f"-{self.done} (TrainConfig.max_consecutive_skips={tc.max_consecutive_skips}); at step "
                    f"{self.done} {what}; {skipped} steps skipped in this run")
            fix = "lower OptimConfig.lr (or raise TrainConfig.max_consecutive_skips)"
        where = "saved now" if saved_now else "already saved"
        return (f"{head}. The state before step {self.done} (step {last_good}) is {where} in {ckpt_dir}: {fix} "
                "and rerun to resume from it")


def finish_step(logger, pending: tuple[int, dict] | None) -> None:
    """Host-side bookkeeping of a finished step ``(done, stats)`` (called one step late): its row, then
    the NaN policy (raises :class:`Halt` when the device guard halted the run at that step). Returns
    None, the new ``pending``."""
    if pending is None:
        return None
    done, stats = pending
    stats = jax.device_get(stats)
    halted, streak = bool(stats.pop("halted")), int(stats.pop("nonfinite_streak"))
    logger.train_row(done, stats, halted=halted)
    if halted:
        raise Halt(done, streak, stats)
    return None


