"""Orbax checkpoints: one checkpoint per saved step holding the train state and a JSON ``meta`` item
(step, data position, tokens seen, run id), so model and data position can never disagree.

Retention: the newest ``keep`` checkpoints, plus every step divisible by ``permanent_every``
(orbax ``keep_period``), plus temporary saves every ``interval_minutes`` that rotate out like the
rolling ones. Orbax writes into a temporary directory and renames it when complete, and deletes old
checkpoints only after a newer one is finalised, so the last good checkpoint is never deleted first.
A checkpoint that fails to restore (torn, corrupt) is skipped with a warning, falling back to the
previous one; the trainer moves it aside to ``checkpoints/corrupt/<step>``, so it takes no keep slot
and a new save at its step is written.

The trainer records the committed steps beside ``checkpoints/``, in ``committed_checkpoints.json``
(:func:`read_committed`), after each save is known to be committed, so a run can tell checkpoints deleted
after their commit (a scratch purge) from checkpoints never written.

A failed save raises :class:`CheckpointSaveError` naming the directory and the cause; no wait on orbax
is unbounded (``HYBRID_LM_SAVE_TIMEOUT_S``, default 600), so a failing save never hangs the trainer.

Integrity: each save puts in ``meta`` the checksums of what it saves (:func:`tree_digest` of the whole
state and of its parameters: sha256 over every array's path, shape, dtype and two wrapping sums of its
bits, computed on the devices), committed atomically with the arrays. A restore recomputes them on what
it read; a checkpoint whose arrays do not match (damaged on disk in a way that still decodes: a flipped
bit) is a checkpoint that does not restore, so the trainer falls back and moves it aside as above.
Checkpoints written without checksums restore unverified. What is detected is damage to what the project
wrote, not a filesystem that returns other data consistently for the same file (the checksums travel
with the checkpoint they describe).

:func:`params_fingerprint` names a parameter tree in 16 hex digits, equal on any topology (provenance of
a continued run's starting parameters).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
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
from hybrid_lm.files import atomic_write_json

log = logging.getLogger(__name__)
# orbax warns whenever it opens a directory read-only, which Checkpointer(read_only=True) asks for
logging.getLogger("absl").addFilter(lambda r: not r.getMessage().startswith("Given directory is read only"))


def _orbax_failure_traceback(record: logging.LogRecord) -> bool:
    """Whether ``record`` is orbax's own report of a failing background save (a traceback per thread, then
    asyncio's "exception was never retrieved" for each write): the failure reaches the trainer, which
    reports it in one line (``--debug`` / ``HYBRID_LM_DEBUG=1`` keeps them)."""
    if os.environ.get("HYBRID_LM_DEBUG") == "1":
        return False
    msg = record.getMessage()
    if record.name == "asyncio":
        return "exception was never retrieved" in msg and ("orbax" in msg or "OCDBT" in msg)
    return record.levelno >= logging.ERROR and (record.exc_info is not None or "background save thread" in msg
                                                or "Save Finalize thread" in msg) and "orbax" in record.pathname


for _name in ("absl", "asyncio"):
    logging.getLogger(_name).addFilter(lambda r: not _orbax_failure_traceback(r))


def _closed_loop_callback(exc_type, exc, tb) -> bool:
    """Whether an uncaught exception is TensorStore completing a write of a failed orbax save after orbax
    closed that save's event loop (``RuntimeError: Event loop is closed`` in ``call_soon_threadsafe``)."""
    if exc_type is not RuntimeError or str(exc) != "Event loop is closed" or os.environ.get("HYBRID_LM_DEBUG") == "1":
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == "_check_closed"


_unraisablehook = sys.unraisablehook


def _quiet_unraisablehook(unraisable) -> None:  # TensorStore reports them through PyErr_WriteUnraisable
    if not _closed_loop_callback(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
        _unraisablehook(unraisable)


sys.unraisablehook = _quiet_unraisablehook


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


_OS_ERROR = re.compile(r'"([^"]+)": Failed to write .*?: ([^:\[]+?) \[os_error_code=.?(\d+)')


def _save_error(what: str, directory: Path, e: BaseException) -> CheckpointSaveError:
    """One line: what failed, where, and the cause (an OS error: its message and the file, e.g. a full disk)."""
    text = " ".join(str(e).split())
    m = _OS_ERROR.search(text)  # TensorStore's message ends with the OS error of the file it wrote
    if m:
        cause = f"{m.group(2).strip()} (errno {m.group(3)}) writing {m.group(1)}"
    elif isinstance(e, OSError) and e.strerror:
        cause = f"{type(e).__name__}: {e.strerror}" + (f": {e.filename}" if e.filename else "")
    else:
        cause = f"{type(e).__name__}: {text}"[:300]
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
        self._record = not read_only  # keep committed_checkpoints.json (process 0)
        self._unwaited = False  # a background save was started and not waited for since
        self.restore_failures: list[tuple[int, str]] = []
        self.moved_aside: list[Path] = []

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Save ``step`` (in the background when async), with the state's checksums in ``meta``; raises
        :class:`CheckpointSaveError` when this save, or the previous background one, fails."""
        meta = {**meta, CHECKSUMS: state_checksums(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.wait()  # the previous save's error, if any, surfaces here (bounded)
        try:
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:
            self._failed = True
            raise _save_error(f"saving the checkpoint at step {step}", self.directory, e) from e
        self._last_save = time.monotonic()
        self._unwaited = bool(saved) and self.cc.async_save
        if not self.cc.async_save:
            self._record_committed()
        return saved

    def _record_committed(self) -> None:
        """Write the steps in ``checkpoints/`` now to ``committed_checkpoints.json`` (after a commit is known)."""
        if not self._record or jax.process_index() != 0:
            return
        self.manager.reload()
        steps = self.all_steps()
        if steps and steps != read_committed(self.directory):
            try:
                atomic_write_json(committed_path(self.directory), {"steps": steps})
            except OSError as e:  # the save itself was written: the record only lags
                log.debug("could not record the committed checkpoints: %s", e)

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
        found = self._restore_newest(self.all_steps(), args, warn=not move_corrupt)
        if move_corrupt and self.restore_failures:
            self._move_aside(self.restore_failures)
        if found is None:
            return None
        restored, _ = found
        return restored.state, _meta(restored)

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
                                                               partial_restore=True), meta=ocp.args.JsonRestore())
        if step is not None:
            try:
                return self._verified(step, args, "params").state["params"], int(step)
            except Exception as e:  # a torn or corrupt checkpoint: name it, no 600-line traceback
                why = _one_line(e)
                others = [s for s in steps if s != step]
                raise WorkdirError(f"the checkpoint at step {step} in {self.directory} does not restore ({why})"
                                   + (f"; other saved steps: {others}" if others else "")) from e
        found = self._restore_newest(steps, args, "params")
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory} restores")
        restored, s = found
        return restored.state["params"], s

    def restore_meta(self, step: int) -> dict:
        """The ``meta`` item of the checkpoint at ``step`` (step, data position, tokens seen, run id); the
        state stays on disk."""
        return _meta(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())))

    def restore_as_saved(self, step: int):
        """(state, meta) of the checkpoint at ``step``, each array in the layout it was saved with (on this
        process's devices): what :meth:`save` takes to write the same checkpoint elsewhere."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, _meta(restored)

    def _verified(self, step: int, args, part: str):
        """``manager.restore(step, args)``, its arrays checked against the checksums saved with them (``part``:
        "state" or "params"); raises :class:`ChecksumMismatch` when they differ."""
        restored = self.manager.restore(step, args=args)
        saved = (dict(restored.meta or {}).get(CHECKSUMS) or {}).get(part)
        if saved is not None:
            tree = restored.state if part == "state" else restored.state["params"]
            if tree_digest(tree) != saved:
                raise ChecksumMismatch("its arrays do not match the checksums saved with them (damaged on disk)")
        return restored

    def _restore_newest(self, steps, args, part: str = "state", warn: bool = True):
        """(restored, step) of the newest of ``steps`` that restores intact with ``args``, else None; each that
        does not is in ``restore_failures`` (with a warning line unless ``warn`` is off)."""
        self.restore_failures = []
        for step in sorted(steps, reverse=True):
            try:
                return self._verified(step, args, part), int(step)
            except Exception as e:  # a torn, corrupt or damaged checkpoint: warn and fall back
                why = _one_line(e)
                self.restore_failures.append((int(step), why))
                if warn:
                    log.warning("checkpoint at step %d in %s does not restore (%s); trying an older one",
                                step, self.directory, why)
        return None

    def _move_aside(self, failures: list[tuple[int, str]]) -> None:
        """Move the step dirs of ``failures`` ((step, why) each) to ``corrupt/<step>``, one warning line
        each (process 0; all processes then re-read)."""
        if jax.process_index() == 0:
            for step, why in failures:
                dest = self.directory / "corrupt" / str(step)
                n = 0
                while dest.exists():
                    n += 1
                    dest = self.directory / "corrupt" / f"{step}.{n}"
                dest.parent.mkdir(exist_ok=True)
                os.rename(self.directory / str(step), dest)
                self.moved_aside.append(dest)
                log.warning("moved the checkpoint at step %d, which does not restore (%s), to %s; resuming from "
                            "an older one", step, why, dest)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("corrupt checkpoints moved aside")
        self.manager.reload()

    def check(self) -> None:
        """Without waiting: raise :class:`CheckpointSaveError` if a background save has failed (the trainer
        asks after every step, so a failed save stops the run at once, not at the next save)."""
        if self._failed or not self._unwaited or self.manager.is_saving_in_progress():
            return
        self.wait()  # the save has ended: this returns at once, raising its error if it failed

    def wait(self) -> None:
        """Wait (bounded) for a background save; raises :class:`CheckpointSaveError` if it failed."""
        try:
            _bounded(self.manager.wait_until_finished, "a background checkpoint save", self.directory)
        except CheckpointSaveError:
            self._failed = True
            raise
        if self._unwaited:
            self._unwaited = False
            self._record_committed()

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


CHECKSUMS = "checksums"  # the meta entry: {"state": tree_digest(state), "params": tree_digest(params)}


def _meta(restored) -> dict:
    """A restored checkpoint's ``meta`` item as the run wrote it (the checksums, checked on restore, left out)."""
    return {k: v for k, v in dict(restored.meta or {}).items() if k != CHECKSUMS}


class ChecksumMismatch(ValueError):
    """A checkpoint whose restored arrays differ from the checksums saved with them."""


def _one_line(e: BaseException) -> str:
    """``Type: message``, on one line and at most 200 characters (TensorStore errors dump their spec)."""
    text = " ".join(str(e).split())
    if isinstance(e, ChecksumMismatch):
        return text
    return f"{type(e).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}" if text else type(e).__name__


def state_checksums(state) -> dict:
    """The checksums a save puts in ``meta``: :func:`tree_digest` of the whole state and of its parameters."""
    out = {"state": tree_digest(state)}
    if isinstance(state, dict) and "params" in state:
        out["params"] = tree_digest(state["params"])
    return out


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


COMMITTED = "committed_checkpoints.json"


def committed_path(directory: Path) -> Path:
    """Where the trainer records the committed steps of the checkpoints in ``directory``: beside it."""
    return Path(directory).parent / COMMITTED


def read_committed(directory: Path) -> list[int]:
    """The steps last recorded as committed in ``directory`` (``[]`` without a readable record)."""
    try:
        steps = json.loads(committed_path(directory).read_text()).get("steps", [])
    except (OSError, ValueError, AttributeError):
        return []
    return sorted(int(x) for x in steps if isinstance(x, int)) if isinstance(steps, list) else []


def params_fingerprint(params) -> str:
    """16 hex digits of sha256 over each parameter's path, shape, dtype and two wrapping uint32 sums of
    its bits (plain and position-weighted), reduced on the devices: the same on any mesh or process
    count, cheap at any size (one pass, no host copy). A checksum for provenance, not a cryptographic
    hash: it tells restored parameters apart, it does not authenticate them."""
    return tree_digest(params)[:16]


def tree_digest(tree) -> str:
    """sha256 (hex) over each array of ``tree``: its path, shape, dtype and :func:`_bit_sums` (see
    :func:`params_fingerprint`). Paths are written plainly (``opt_state/0/mu/w``) and sorted, so a tree
    restored with dicts where it was saved with named tuples (a WSD branch seeded from the checkpoint as
    saved) has the same digest."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = jax.device_get(_bit_sums([x for _, x in leaves])) if leaves else []
    entries = sorted(f"{jax.tree_util.keystr(path, simple=True, separator='/')}|{tuple(x.shape)}|{x.dtype}|"
                     f"{int(plain)}|{int(weighted)};" for (path, x), (plain, weighted) in zip(leaves, sums))
    return hashlib.sha256("".join(entries).encode()).hexdigest()


@jax.jit
def _bit_sums(xs):
    """Per array: (sum of its bits as uint32, sum of bits x (index * odd constant + 1)), both mod 2**32
    (integer sums wrap, so any reduction order gives the same value)."""
    out = []
    for x in xs:
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        x = x if x.dtype != jnp.bool_ else x.astype(jnp.uint8)
        bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32).reshape(-1)  # 8 bytes: two uint32
        weight = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        out.append((jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)))
    return out
