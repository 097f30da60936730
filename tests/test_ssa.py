import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.ssa import SSAAttention, alignment_loss, smooth_l1, ssa_coin
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics


def test_alignment_terms_send_gradients_only_where_the_stop_gradients_allow():
    kf, ks = jax.random.split(jax.random.key(0))
    full = jax.random.normal(kf, (2, 5, 3, 4)) * 2
    sparse = jax.random.normal(ks, (2, 5, 3, 4)) * 2
    sparsity = lambda f, s: smooth_l1(f, jax.lax.stop_gradient(s))  # noqa: E731
    commitment = lambda f, s: smooth_l1(jax.lax.stop_gradient(f), s)  # noqa: E731
    gf, gs = jax.grad(sparsity, (0, 1))(full, sparse)
    assert np.abs(gf).sum() > 0 and np.all(gs == 0)  # sparsity term moves only the full stream
    gf, gs = jax.grad(commitment, (0, 1))(full, sparse)
    assert np.all(gf == 0) and np.abs(gs).sum() > 0  # commitment term moves only the sparse stream
    # the sum: each stream's gradient equals its own term's, and matches Huber(beta=1) analytically
    gf, gs = jax.grad(alignment_loss, (0, 1))(full, sparse)
    d = np.asarray(full - sparse)
    expected = np.clip(d, -1, 1) / d.size
    np.testing.assert_allclose(gf, expected, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(gs, -expected, rtol=1e-5, atol=1e-8)
    assert float(alignment_loss(full, sparse)) == pytest.approx(2 * float(smooth_l1(full, sparse)), rel=1e-6)


def test_coin_is_deterministic_per_step_and_microbatch_and_balanced():
    a = [bool(ssa_coin(0, s, m)) for s in range(200) for m in range(2)]
    assert a == [bool(ssa_coin(0, s, m)) for s in range(200) for m in range(2)]
    assert 0.4 < np.mean(a) < 0.6
    assert a != [bool(ssa_coin(1, s, m)) for s in range(200) for m in range(2)]


def _layer_and_inputs():
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, d_ff=64, layer_pattern="F",
                      full=MixerConfig(kind="ssa", options={"block_size": 4, "top_k": 2}), compute_dtype="float32")
    layer = SSAAttention(cfg, cfg.full, 0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    return layer, x, pos


@pytest.mark.integration
def test_chosen_stream_feeds_the_output_and_the_other_only_the_alignment():
    layer, x, pos = _layer_and_inputs()
    graphdef, params = nnx.split(layer)

    def run(params, x, sparse: bool, train: bool = True):
        m = nnx.merge(graphdef, params)
        step = next(s for s in range(100) if bool(ssa_coin(0, s, 0)) == sparse)  # SSA draws its own coin
        return nnx.capture(m, nnx.Intermediate)(x, MixerContext(positions=pos, step=step, train=train))

    y_full, inter = run(params, x, False)
    y_sparse, _ = run(params, x, True)
    y_eval_full, _ = run(params, x, False, train=False)
    np.testing.assert_allclose(y_full, y_eval_full, rtol=1e-5, atol=1e-6)  # train/full == eval/full
    assert not np.allclose(y_full, y_sparse)  # top-2 blocks of 4 out of 6: the streams differ
    assert float(inter["aux_loss"][0]) == pytest.approx(10 * float(inter["ssa_align"][0]), rel=1e-6)
    # the output of the full-stream step does not depend on the sparse stream's selection: a
    # cotangent on y reaches the parameters only through the full stream (the gate is shared)
    g_y = jax.grad(lambda p: jnp.sum(run(p, x, False)[0] ** 2))(params)
    g_y_eval = jax.grad(lambda p: jnp.sum(run(p, x, False, train=False)[0] ** 2))(params)
    for a, b in zip(jax.tree.leaves(g_y), jax.tree.leaves(g_y_eval)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_ssa_trains_and_logs_ce_align_and_stream(tiny_params, tmp_path):
    cfg = load_config(["arch/ssa.gin"], tiny_params + ["full/MixerConfig.options = {'block_size': 4, 'top_k': 2}",
                                                       "TrainConfig.steps = 24", "TrainConfig.log_every = 6"])
    train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert len(rows) == 24  # SSA logs every step
    assert {"loss", "objective", "ssa_align", "ssa_sparse"} <= set(rows[0])
    streams = [r["ssa_sparse"] for r in rows]
    assert set(streams) == {0.0, 1.0}
    assert all(r["objective"] == pytest.approx(r["loss"] + 10 * r["ssa_align"], rel=1e-4) for r in rows)
    assert np.mean([r["loss"] for r in rows[-4:]]) < rows[0]["loss"] - 0.5
