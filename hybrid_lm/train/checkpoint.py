"""Orbax checkpoints: one checkpoint per saved step holding the train state and a JSON ``meta`` item
(step, data position, tokens seen, run id), so model and data position can never disagree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from hybrid_lm.config import CheckpointConfig

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: Path, cc: CheckpointConfig):
        self.directory = Path(directory).resolve()
        self.cc = cc
        options = ocp.CheckpointManagerOptions(max_to_keep=cc.keep, enable_async_checkpointing=cc.async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self.manager.save(step, args=args, force=force)

    def should_save(self, step: int) -> bool:
        return step % self.cc.every_steps == 0

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, abstract_state):
        """(state, meta) of the newest checkpoint that restores, falling back to older ones; else None.

        ``abstract_state`` is a tree of ``jax.ShapeDtypeStruct`` with shardings: arrays are restored
        directly into that layout.
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                          meta=ocp.args.JsonRestore())
                restored = self.manager.restore(step, args=args)
                return restored.state, dict(restored.meta)
            except Exception as e:  # a torn or corrupt checkpoint: warn and fall back
                log.warning("checkpoint at step %d in %s does not restore (%s: %s); trying an older one",
                            step, self.directory, type(e).__name__, e)
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
