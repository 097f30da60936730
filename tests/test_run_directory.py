"""The run directory's one step list and the checkpoint's meta item, both through orbax's API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.config import CheckpointConfig
from hybrid_lm.errors import WorkdirError
from hybrid_lm.run.checkpoint import Checkpointer
from hybrid_lm.run.directory import checkpoint_dir, checkpoint_meta, checkpoint_steps


def _state(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"params": {"w": jax.random.normal(k1, (8, 4)), "b": jax.random.normal(k2, (3,)).astype(jnp.bfloat16)},
            "opt_state": [{"mu": jax.random.normal(k2, (8, 4))}], "step": jnp.int32(3)}


def _save(workdir, step: int, state, meta: dict) -> None:
    ckpt = Checkpointer(checkpoint_dir(workdir), CheckpointConfig(async_save=False))
    try:
        ckpt.save(step, state, meta, force=True)
    finally:
        ckpt.close()


def test_steps_and_meta_of_a_run(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(WorkdirError, match="has no checkpoints/ directory"):
        checkpoint_steps(run)
    assert checkpoint_steps(run, missing_ok=True) == []
    for step, seen in ((3, 1234), (7, 5678)):  # tokens_seen unlike step x batch x seq_len of any config
        _save(run, step, _state(step), {"step": step, "tokens_seen": seen, "run_id": "r"})
    (checkpoint_dir(run) / "corrupt" / "5").mkdir(parents=True)  # moved aside: not a step
    assert checkpoint_steps(run) == [3, 7]
    assert checkpoint_meta(run, 3) == {"step": 3, "tokens_seen": 1234, "run_id": "r"}
    with pytest.raises(FileNotFoundError):
        checkpoint_meta(run, 5)


def test_a_checkpoint_saved_again_elsewhere_is_bitwise_the_same(tmp_path):
    state = _state(0)
    _save(tmp_path / "a", 3, state, {"step": 3, "run_id": "a"})
    src = Checkpointer(checkpoint_dir(tmp_path / "a"), CheckpointConfig(), read_only=True)
    try:
        again, meta = src.restore_as_saved(3)
    finally:
        src.close()
    _save(tmp_path / "b", 3, again, {**meta, "run_id": "b"})
    shard = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard), state)
    dst = Checkpointer(checkpoint_dir(tmp_path / "b"), CheckpointConfig(), read_only=True)
    try:
        back, meta_b = dst.restore_latest(abstract)
    finally:
        dst.close()
    assert meta_b == {"step": 3, "run_id": "b"}
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                                                     np.asarray(y).reshape(-1).view(np.uint8))


def test_the_checksum_follows_the_arrays_not_their_containers():
    """A WSD branch is seeded from the checkpoint as saved (dicts) and restored into the optimizer's named
    tuples: the same arrays give the same digest; one flipped bit another."""
    import collections

    from hybrid_lm.run.checkpoint import tree_digest

    State = collections.namedtuple("State", "count mu")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    as_tuples = {"opt": (State(np.int32(3), {"w": w}),), "params": {"w": w + 1}}
    as_dicts = {"params": {"w": w + 1}, "opt": ({"mu": {"w": w}, "count": np.int32(3)},)}
    assert tree_digest(as_tuples) == tree_digest(as_dicts)
    flipped = w.copy()
    flipped.view(np.uint32)[1, 2] ^= 1
    assert tree_digest({**as_dicts, "opt": ({"mu": {"w": flipped}, "count": np.int32(3)},)}) != tree_digest(as_dicts)
