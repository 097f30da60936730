"""Orbax checkpoints: one checkpoint per saved step holding the train state and a JSON ``meta`` item
(step, data position, tokens seen, run id), so model and data position can never disagree.

Retention: the newest ``keep`` checkpoints, plus every step divisible by ``permanent_every``
(orbax ``keep_period``), plus temporary saves every ``interval_minutes`` that rotate out like the
rolling ones. Orbax writes into a temporary directory and renames it when complete, and deletes old
checkpoints only after a newer one is finalised, so the last good checkpoint is never deleted first.
A checkpoint that fails to restore (torn, corrupt) is skipped with a warning, falling back to the
previous one; the trainer moves it aside to ``checkpoints/corrupt/<step>``, so it takes no keep slot
and a new save at its step is written.

A failed save raises :class:`CheckpointSaveError` naming the directory and the cause; no wait on orbax
is unbounded (``HYBRID_LM_SAVE_TIMEOUT_S``, default 600), so a failing save never hangs the trainer.

:func:`params_fingerprint` names a parameter tree in 16 hex digits, equal on any topology (provenance of
a continued run's starting parameters).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from hybrid_lm.config import CheckpointConfig
from hybrid_lm.errors import WorkdirError

log = logging.getLogger(__name__)
# orbax warns whenever it opens a directory read-only, which Checkpointer(read_only=True) asks for
logging.getLogger("absl").addFilter(lambda r: not r.getMessage().startswith("Given directory is read only"))


class CheckpointSaveError(WorkdirError):
    """A checkpoint save that failed or did not finish in time; earlier checkpoints are kept."""


def save_timeout_s() -> float:
    return float(os.environ.get("HYBRID_LM_SAVE_TIMEOUT_S", "600"))


def _bounded(fn, what: str, directory: Path) -> None:
    """Run ``fn`` (a blocking orbax call) for at most ``save_timeout_s()``; any failure becomes one
    :class:`CheckpointSaveError`."""
    box: dict = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = e

    t = threading.Thread(target=target, name=f"hybrid_lm {what}", daemon=True)
    t.start()
    t.join(save_timeout_s())
    if t.is_alive():
        raise CheckpointSaveError(f"{what} in {directory} did not finish within {save_timeout_s():g} s "
                                  "(HYBRID_LM_SAVE_TIMEOUT_S); earlier checkpoints are kept")
    if "error" in box:
        raise _save_error(what, directory, box["error"]) from box["error"]


def _save_error(what: str, directory: Path, e: BaseException) -> CheckpointSaveError:
    cause = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return CheckpointSaveError(f"{what} in {directory} failed ({cause}); earlier checkpoints are kept")


class Checkpointer:
    """The checkpoints of one run dir. ``read_only``: only list and restore (another run's checkpoints,
    e.g. the source of a continued run); nothing is created, saved or deleted."""

    def __init__(self, directory: Path, cc: CheckpointConfig, *, read_only: bool = False):
        self.directory = Path(directory).resolve()
        self.cc = cc
        retention = {"save_interval_steps": 0} if read_only else {  # (orbax warns about retention when read-only)
            "max_to_keep": cc.keep, "keep_period": cc.permanent_every or None}
        options = ocp.CheckpointManagerOptions(
            **retention, enable_async_checkpointing=cc.async_save, create=not read_only, read_only=read_only,
            # the step directory is made on the calling thread, so a read-only checkpoints/ fails
            # the save call itself rather than stranding background threads
            async_options=ocp.AsyncOptions(timeout_secs=max(1, int(save_timeout_s())),
                                           create_directories_asynchronously=False))
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._last_save = time.monotonic()
        self._failed = False  # a save error was raised: close() only shuts down
        self.restore_failures: list[tuple[int, str]] = []
        self.moved_aside: list[Path] = []

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Save ``step`` (in the background when async); raises :class:`CheckpointSaveError` when this
        save, or the previous background one, fails."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.wait()  # the previous save's error, if any, surfaces here (bounded)
        try:
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:
            self._failed = True
            raise _save_error(f"saving the checkpoint at step {step}", self.directory, e) from e
        self._last_save = time.monotonic()
        return saved

    def should_save(self, step: int) -> bool:
        """Step cadence, or the wall-clock interval (decided on process 0 and shared)."""
        due = step % self.cc.every_steps == 0 or step % (self.cc.permanent_every or step + 1) == 0
        if not due and self.cc.interval_minutes > 0:
            due = time.monotonic() - self._last_save >= 60.0 * self.cc.interval_minutes
            if jax.process_count() > 1:
                due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state, move_corrupt: bool = False):
        """(state, meta) of the newest checkpoint that restores, falling back to older ones; else None.

        ``abstract_state`` is a tree of ``jax.ShapeDtypeStruct`` with shardings: arrays are restored
        directly into that layout (any topology: the saved sharding does not matter). Each checkpoint
        that failed is in ``restore_failures`` as (step, reason); ``move_corrupt`` moves those aside
        to ``corrupt/<step>`` (``moved_aside``).
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        found = self._restore_newest(self.all_steps(), args)
        if move_corrupt and self.restore_failures:
            self._move_aside([s for s, _ in self.restore_failures])
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
            try:
                return self.manager.restore(step, args=args).state["params"], int(step)
            except Exception as e:  # a torn or corrupt checkpoint: name it, no 600-line traceback
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                others = [s for s in steps if s != step]
                raise WorkdirError(f"the checkpoint at step {step} in {self.directory} does not restore ({why})"
                                   + (f"; other saved steps: {others}" if others else "")) from e
        found = self._restore_newest(steps, args)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory} restores")
        restored, s = found
        return restored.state["params"], s

    def restore_meta(self, step: int) -> dict:
        """The ``meta`` item of the checkpoint at ``step`` (step, data position, tokens seen, run id); the
        state stays on disk."""
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore_as_saved(self, step: int):
        """(state, meta) of the checkpoint at ``step``, each array in the layout it was saved with (on this
        process's devices): what :meth:`save` takes to write the same checkpoint elsewhere."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, dict(restored.meta)

    def _restore_newest(self, steps, args):
        """(restored, step) of the newest of ``steps`` that restores with ``args``, else None."""
        self.restore_failures = []
        for step in sorted(steps, reverse=True):
            try:
                return self.manager.restore(step, args=args), int(step)
            except Exception as e:  # a torn or corrupt checkpoint: warn and fall back
                why = f"{type(e).__name__}: {str(e)[:300]}"
                self.restore_failures.append((int(step), why.splitlines()[0]))
                log.warning("checkpoint at step %d in %s does not restore (%s); trying an older one",
                            step, self.directory, why)
        return None

    def _move_aside(self, steps: list[int]) -> None:
        """Move the step dirs ``steps`` to ``corrupt/<step>`` (process 0; all processes then re-read)."""
        if jax.process_index() == 0:
            for step in steps:
                dest = self.directory / "corrupt" / str(step)
                n = 0
                while dest.exists():
                    n += 1
                    dest = self.directory / "corrupt" / f"{step}.{n}"
                dest.parent.mkdir(exist_ok=True)
                os.rename(self.directory / str(step), dest)
                self.moved_aside.append(dest)
                log.warning("moved the checkpoint at step %d, which does not restore, to %s", step, dest)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("corrupt checkpoints moved aside")
        self.manager.reload()

    def wait(self) -> None:
        """Wait (bounded) for a background save; raises :class:`CheckpointSaveError` if it failed."""
        try:
            _bounded(self.manager.wait_until_finished, "a background checkpoint save", self.directory)
        except CheckpointSaveError:
            self._failed = True
            raise

    def close(self) -> None:
        """Finish (bounded) and close. Raises a save error not raised before; after one, only shuts down."""
        failed_before = self._failed
        try:
            self.wait()
        except CheckpointSaveError:
            if not failed_before:
                raise
        finally:
            try:
                _bounded(self.manager.close, "closing the checkpoint manager", self.directory)
            except CheckpointSaveError as e:
                log.debug("%s", e)


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def params_fingerprint(params) -> str:
    """16 hex digits of sha256 over each parameter's path, shape, dtype and two wrapping uint32 sums of
    its bits (plain and position-weighted), reduced on the devices: the same on any mesh or process
    count, cheap at any size (one pass, no host copy). A checksum for provenance, not a cryptographic
    hash: it tells restored parameters apart, it does not authenticate them."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sums = jax.device_get(_bit_sums([x for _, x in leaves]))
    h = hashlib.sha256()
    for (path, x), (plain, weighted) in zip(leaves, sums):
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(x.shape)}|{x.dtype}|{int(plain)}|{int(weighted)};".encode())
    return h.hexdigest()[:16]


@jax.jit
def _bit_sums(xs):
    """Per array: (sum of its bits as uint32, sum of bits x (index * odd constant + 1)), both mod 2**32
    (integer sums wrap, so any reduction order gives the same value)."""
    out = []
    for x in xs:
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32).reshape(-1)
        weight = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        out.append((jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)))
    return out
