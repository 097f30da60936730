"""ParamInit: the part-by-part parameter init equals the whole-model build under ``jax.jit`` bit for
bit (every mixer kind, tied and untied heads), compiles one program per kind of part, and
StateInit's ahead-of-time compile leaves nothing to compile at the first call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.model.transformer import ParamInit, init_params_reference
from hybrid_lm.train.optim import optimizer_for_bounds
from hybrid_lm.step import ModelFns, StateInit

NO_WINDOW = "efficient/MixerConfig.window = None"
KINDS = {
    "full": [],
    "swa": ["efficient/MixerConfig.kind = 'swa'"],
    "sa_swa": ["efficient/MixerConfig.kind = 'sa_swa'"],
    "moba": ["efficient/MixerConfig.kind = 'moba'", NO_WINDOW,
             "efficient/MixerConfig.options = {'block_size': 8, 'top_k': 2}"],
    "ssa": ["full/MixerConfig.kind = 'ssa'", "full/MixerConfig.options = {'block_size': 8, 'top_k': 2}"],
    "lightning": ["efficient/MixerConfig.kind = 'lightning'", NO_WINDOW],
    "mamba2": ["efficient/MixerConfig.kind = 'mamba2'", NO_WINDOW,
               "efficient/MixerConfig.options = {'d_state': 8, 'head_dim': 16}"],
    "gdn": ["efficient/MixerConfig.kind = 'gdn'", NO_WINDOW],
}


def _cfg(tiny_params, kind, *extra):
    return load_config([], tiny_params + KINDS[kind] + ["ModelConfig.n_layers = 4", *extra])


def _whole(cfg):
    """The reference: the whole model built in one jitted program (the trainer's init before ParamInit)."""
    return jax.jit(lambda s: init_params_reference(cfg.model, s))


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_part_by_part_equals_the_whole_model_build(tiny_params, kind):
    cfg = _cfg(tiny_params, kind)
    init, whole = ParamInit(cfg.model), _whole(cfg)
    for seed in (0, 7):
        _assert_bitwise(init(seed), whole(jnp.uint32(seed)))
    # one program per kind of part: embed, a block per layer type, final norm, head
    kinds = {k[0] for k in init._programs}
    assert kinds == {"embed", "final_norm", "lm_head", *(f"block/{t}" for t in set(cfg.model.layer_types()))}
    assert len(init._programs) == len(kinds)


def test_tied_head_and_seeds(tiny_params):
    cfg = _cfg(tiny_params, "lightning", "ModelConfig.tie_embeddings = True")
    init = ParamInit(cfg.model)
    a, b = init(3), init(jnp.asarray(3, jnp.uint32))
    _assert_bitwise(a, b)  # a Python int seed and an array seed draw the same values
    _assert_bitwise(a, _whole(cfg)(jnp.uint32(3)))
    assert "lm_head" not in a
    c = init(4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)):  # random leaves differ between seeds
        if np.std(np.asarray(x)) > 0:
            assert not np.array_equal(np.asarray(x), np.asarray(y))
    # every block's draw comes from its own stream position: no two same-shape blocks alike
    blocks = a["blocks"]
    assert not np.array_equal(np.asarray(blocks[0]["mlp"]["w_up"]), np.asarray(blocks[2]["mlp"]["w_up"]))


def test_state_init_compiles_ahead_and_traces(tiny_params):
    cfg = _cfg(tiny_params, "swa")
    fns = ModelFns(cfg)
    bounds = np.asarray([5, 5], np.int32)
    tx = optimizer_for_bounds(cfg.optim, fns.axes)(bounds)[0]
    init = StateInit(fns, tx)
    seed = jnp.asarray(0, jnp.uint32)
    abstract = jax.eval_shape(init, seed)  # traceable: the parts are jitted functions
    init.compile(seed)
    compiles = []

    def listen(event, secs, **kw):
        compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        state = init(seed)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert "/jax/core/compile/backend_compile_duration" not in compiles, compiles  # nothing compiled again
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    _assert_bitwise(state["params"], _whole(cfg)(seed))
    _assert_bitwise(state["opt_state"], jax.jit(tx.init)(state["params"]))
    assert int(state["step"]) == 0
