"""ModelConfig.scan_layers: the scanned stack equals the unrolled one (parameters, logical axes,
checkpoints, logits, loss and gradients), and the traced program holds one group instead of every layer."""

import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.transformer import HybridLM, pattern_period
from hybrid_lm.ops.attention import default_positions
from hybrid_lm import compile_cache
from hybrid_lm.run.checkpoint import Checkpointer, abstract_with_shardings
from hybrid_lm.train.loop import train
from hybrid_lm.step import ModelFns

NO_WINDOW = "efficient/MixerConfig.window = None"
ARCHS = {
    "swa": ["efficient/MixerConfig.kind = 'swa'", "efficient/MixerConfig.window = 8"],
    "sa": ["efficient/MixerConfig.kind = 'sa'", "efficient/MixerConfig.window = 8"],  # permutation per layer
    "lightning": ["efficient/MixerConfig.kind = 'lightning'", NO_WINDOW,  # decay per layer
                  "efficient/MixerConfig.options = {'chunk_size': 8}"],
    "ssa": ["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.kind = 'ssa'",  # sows aux_loss per layer
            "full/MixerConfig.options = {'block_size': 8, 'top_k': 2, 'align_weight': 10.0}"],
}


def _cfgs(tiny_params, arch, *extra):
    common = tiny_params + ARCHS[arch] + ["ModelConfig.n_layers = 4", *extra]
    return (load_config([], common + ["ModelConfig.scan_layers = False"]),
            load_config([], common + ["ModelConfig.scan_layers = True"]))


def _layer_scans(jaxpr, groups: int, stream_shape) -> int:
    """Scans over ``groups`` steps that carry the residual stream, found through pjit/remat/custom-vjp
    sub-jaxprs (not inside other scans: a mixer's own chunk scan is not a layer scan)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            n += eqn.params["length"] == groups and any(v.aval.shape == stream_shape for v in eqn.outvars)
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _layer_scans(sub, groups, stream_shape)
    return n


def _loss_and_grads(fns, params, tokens):
    ids = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda p: fns.loss(p, tokens, jnp.int32(3), ids), has_aux=True))
    return f(params)


def _assert_trees_close(a, b, rtol, atol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_pattern_period():
    assert pattern_period(list("FEFEFE")) == 2
    assert pattern_period(list("FFFF")) == 1
    assert pattern_period(list("FEEEFEEE")) == 4
    assert pattern_period(list("FEEF")) == 4


# The scan stacks any block's variables alike; what differs by mixer is reading the layer index at call
# time (sa's permutation, lightning's decay) and sowing values per layer (ssa). The other mixers'
# forward and backward are checked unrolled in their own files.
SCAN_CASES = ["sa", "lightning", "ssa"]


@pytest.mark.integration
@pytest.mark.parametrize("arch", SCAN_CASES)
def test_scanned_stack_equals_unrolled(tiny_params, arch):
    cfg_u, cfg_s = _cfgs(tiny_params, arch)
    assert run_id(cfg_u) == run_id(cfg_s)  # an execution detail
    fns_u, fns_s = ModelFns(cfg_u), ModelFns(cfg_s)
    # the same parameter tree, logical axes (sharding names) and shapes
    assert fns_u.axes == fns_s.axes
    assert jax.tree.map(lambda a: (a.shape, a.dtype), fns_u.abstract_params) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), fns_s.abstract_params)
    params = fns_u.init(0)
    jax.tree.map(np.testing.assert_array_equal, params, fns_s.init(0))

    model = fns_s.model(params)
    period, reason = model.scan_plan()
    assert reason is None and period == (1 if arch == "ssa" else 2)

    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg_u.model.vocab_size)
    ids = jnp.arange(4, dtype=jnp.int32)
    trace = lambda fns: jax.make_jaxpr(lambda p: fns.loss(p, tokens, jnp.int32(3), ids))(params)  # noqa: E731
    n_groups, stream = 4 // period, (4, 32, cfg_u.model.d_model)
    assert _layer_scans(trace(fns_s).jaxpr, n_groups, stream) == 1
    assert _layer_scans(trace(fns_u).jaxpr, n_groups, stream) == 0

    # logits are bitwise equal in the forward pass
    ctx = MixerContext(positions=default_positions(4, 32), step=jnp.int32(3), seed=0, example_ids=ids)
    fwd = lambda fns: jax.jit(lambda p: fns.model(p)(tokens[:, :-1], ctx))(params)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(fwd(fns_u)), np.asarray(fwd(fns_s)))

    # loss, sown aux terms (SSA) and gradients: XLA fuses the loop body differently from the unrolled
    # program, so gradients may differ in the last bits (fp32)
    (obj_u, aux_u), g_u = _loss_and_grads(fns_u, params, tokens)
    (obj_s, aux_s), g_s = _loss_and_grads(fns_s, params, tokens)
    assert set(aux_u) == set(aux_s)
    if arch == "ssa":
        assert {"ssa_align", "ssa_sparse"} <= set(aux_s)
    _assert_trees_close((obj_u, aux_u), (obj_s, aux_s), rtol=1e-6, atol=1e-7)
    _assert_trees_close(g_u, g_s, rtol=1e-5, atol=1e-8)


@pytest.mark.integration
def test_scan_with_remat(tiny_params):
    cfg_u, cfg_s = _cfgs(tiny_params, "sa", "ModelConfig.remat = 'full'")
    fns_u, fns_s = ModelFns(cfg_u), ModelFns(cfg_s)
    params = fns_u.init(0)
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, cfg_u.model.vocab_size)
    (obj_u, _), g_u = _loss_and_grads(fns_u, params, tokens)
    (obj_s, _), g_s = _loss_and_grads(fns_s, params, tokens)
    np.testing.assert_allclose(obj_u, obj_s, rtol=1e-6)
    _assert_trees_close(g_u, g_s, rtol=1e-5, atol=1e-8)


def test_single_group_falls_back_to_unrolled(tiny_params, caplog):
    _, cfg = _cfgs(tiny_params, "swa", "ModelConfig.n_layers = 2")  # one (F, E) group
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    period, reason = model.scan_plan()
    assert period == 2 and "single group" in reason
    tokens = jnp.zeros((2, 16), jnp.int32)
    with caplog.at_level(logging.WARNING, logger="hybrid_lm.model.transformer"):
        jaxpr = jax.make_jaxpr(lambda t: model(t))(tokens)
    assert _layer_scans(jaxpr.jaxpr, 1, (2, 16, cfg.model.d_model)) == 0 and "unrolled" in caplog.text


def _n_eqns(jaxpr) -> int:
    return sum(1 + sum(_n_eqns(sub) for sub in jax.extend.core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


@pytest.mark.integration  # a whole model across the mixers
def test_traced_program_is_smaller_under_scan(tiny_params):
    """The compile-time claim in a CPU-checkable form: the gradient of a 6-layer '1:1' loss traces to
    one scanned (F, E) group, well under half the unrolled program, and lowers to less text (JAX
    already lowers repeated jitted calls, e.g. attention, to shared functions)."""
    cfg_u, cfg_s = _cfgs(tiny_params, "swa", "ModelConfig.n_layers = 6")
    params = ModelFns(cfg_u).init(0)
    tokens = jnp.zeros((4, 33), jnp.int32)
    ids = jnp.arange(4, dtype=jnp.int32)
    sizes = {}
    for name, cfg in (("unrolled", cfg_u), ("scan", cfg_s)):
        fns = ModelFns(cfg)
        f = jax.value_and_grad(lambda p: fns.loss(p, tokens, jnp.int32(0), ids)[0])
        sizes[name] = (_n_eqns(jax.make_jaxpr(f)(params).jaxpr), len(jax.jit(f).lower(params).as_text()))
    assert sizes["scan"][0] < sizes["unrolled"][0] / 2, sizes
    assert sizes["scan"][1] < 0.9 * sizes["unrolled"][1], sizes


@pytest.mark.integration
def test_unrolled_checkpoint_restores_and_trains_scanned(tiny_params, tmp_path):
    cfg_u, cfg_s = _cfgs(tiny_params, "sa", "TrainConfig.steps = 5")
    train(cfg_u, tmp_path)  # checkpoint at step 5 (every_steps = 5), written unrolled
    fns_u, fns_s = ModelFns(cfg_u), ModelFns(cfg_s)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = abstract_with_shardings(fns_s.abstract_params, jax.tree.map(lambda _: dev, fns_s.abstract_params))
    params, step = Checkpointer(tmp_path / "checkpoints", cfg_s.checkpoint).restore_params(abstract)
    assert step == 5
    tokens = jax.random.randint(jax.random.key(4), (4, 33), 0, cfg_u.model.vocab_size)
    ids = jnp.arange(4, dtype=jnp.int32)
    loss = lambda fns: jax.jit(lambda p: fns.loss(p, tokens, jnp.int32(5), ids)[0])(params)  # noqa: E731
    np.testing.assert_allclose(loss(fns_u), loss(fns_s), rtol=1e-6)
    # the same run (scan_layers is not in the run id) resumes from it and trains on, scanned
    res = train(load_config([], tiny_params + ARCHS["sa"] + ["ModelConfig.n_layers = 4", "TrainConfig.steps = 7",
                                                              "ModelConfig.scan_layers = True"]), tmp_path)
    assert res.resumed_from == 5 and res.step == 7


def test_compilation_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    for off in ("off", "", "0"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.cache_dir() is None and compile_cache.enable_compilation_cache() is None
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "hybrid_lm" / "jax"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))  # JAX's own variable wins
    assert compile_cache.cache_dir() is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    old = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable_compilation_cache() == tmp_path / "mine"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
