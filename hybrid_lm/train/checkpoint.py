"""Orbax checkpoints: one checkpoint per saved step holding the train state and a JSON ``meta`` item
(step, data position, tokens seen, run id), so model and data position can never disagree.

Retention: the newest ``keep`` checkpoints, plus every step divisible by ``permanent_every``
(orbax ``keep_period``), plus temporary saves every ``interval_minutes`` that rotate out like the
rolling ones. Orbax writes into a temporary directory and renames it when complete, and deletes old
checkpoints only after a newer one is finalised, so the last good checkpoint is never deleted first.
A checkpoint that fails to restore (torn, corrupt) is skipped with a warning, falling back to the
previous one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from hybrid_lm.config import CheckpointConfig

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: Path, cc: CheckpointConfig):
        self.directory = Path(directory).resolve()
        self.cc = cc
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cc.keep, keep_period=cc.permanent_every or None,
            enable_async_checkpointing=cc.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._last_save = time.monotonic()

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        saved = self.manager.save(step, args=args, force=force)
        self._last_save = time.monotonic()
        return saved

    def should_save(self, step: int) -> bool:
        """Step cadence, or the wall-clock interval (decided on process 0 and shared)."""
        due = step % self.cc.every_steps == 0 or step % (self.cc.permanent_every or step + 1) == 0
        if not due and self.cc.interval_minutes > 0:
            due = time.monotonic() - self._last_save >= 60.0 * self.cc.interval_minutes
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils
                due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state):
        """(state, meta) of the newest checkpoint that restores, falling back to older ones; else None.

        ``abstract_state`` is a tree of ``jax.ShapeDtypeStruct`` with shardings: arrays are restored
        directly into that layout (any topology: the saved sharding does not matter).
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        found = self._restore_newest(self.all_steps(), args)
        if found is None:
            return None
        restored, _ = found
        return restored.state, dict(restored.meta)

    def restore_params(self, abstract_params, step: int | None = None):
        """(params, step): only the parameters (the optimizer state stays on disk) of ``step``, or of
        the newest checkpoint that restores. ``abstract_params`` as ``restore_latest``'s state.

        Raises ``FileNotFoundError`` when there is no checkpoint, no checkpoint at ``step``, or none
        restores; a given ``step`` that fails to restore raises its own error (no fallback).
        """
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"{self.directory} holds no checkpoint")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"{self.directory} has no checkpoint at step {step}; saved steps: {steps}")
        abstract = {"params": abstract_params}
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args,
                                                               partial_restore=True))
        if step is not None:
            return self.manager.restore(step, args=args).state["params"], int(step)
        found = self._restore_newest(steps, args)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory} restores")
        restored, s = found
        return restored.state["params"], s

    def _restore_newest(self, steps, args):
        """(restored, step) of the newest of ``steps`` that restores with ``args``, else None."""
        for step in sorted(steps, reverse=True):
            try:
                return self.manager.restore(step, args=args), int(step)
            except Exception as e:  # a torn or corrupt checkpoint: warn and fall back
                log.warning("checkpoint at step %d in %s does not restore (%s: %s); trying an older one",
                            step, self.directory, type(e).__name__, str(e)[:300])
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
