"""The eval's per-window losses: each window's loss does not depend on the batch it is evaluated in,
their mean is the val loss, and the standard errors (plain and paired) are the textbook ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.config import MeshConfig
from hybrid_lm.run.loss import evaluate, format_se, paired_difference, row_window_losses, standard_error
from hybrid_lm.experiment import load_config
from hybrid_lm.ops.cross_entropy import cross_entropy
from hybrid_lm import sharding as shd
from hybrid_lm.step import ModelFns, make_eval_step


@pytest.fixture(scope="module")
def model():
    from conftest import TINY
    cfg = load_config([], list(TINY) + ["ModelConfig.layer_pattern = 'FE'"])
    fns = ModelFns(cfg)
    return fns, fns.init(3)


@pytest.mark.parametrize("n,global_batch", [(12, 4), (10, 4), (5, 8)])
def test_window_losses_are_per_window_and_their_mean_is_the_loss(model, n, global_batch):
    fns, params = model
    windows = np.asarray(jax.random.randint(jax.random.key(n), (n, 33), 0, 256), np.int32)
    mesh = shd.make_mesh(MeshConfig())
    shard = shd.batch_sharding(mesh, MeshConfig().rules)
    with jax.set_mesh(mesh):
        ev = jax.jit(make_eval_step(fns), in_shardings=(None, shard))
        res = evaluate(ev, params, windows, shard, global_batch=global_batch, n_batch_shards=1, bytes_per_token=2.0)
    per = min(global_batch, n)
    used = (n // per) * per  # whole batches only
    assert res["eval_windows"] == used and res["window_losses"].shape == (used,)
    # each window alone, through the model's logits and the reference cross-entropy
    for i in (0, used - 1):
        ctx = fns._context(1, 32, None, step=jnp.zeros((), jnp.int32), example_ids=jnp.arange(1), train=False)
        logits = fns.model(params)(windows[i:i + 1, :-1], ctx)
        alone = float(cross_entropy(logits, windows[i:i + 1, 1:])[1])
        np.testing.assert_allclose(res["window_losses"][i], alone, rtol=2e-6)
    w = res["window_losses"]
    np.testing.assert_allclose(res["loss"], w.mean(), rtol=1e-12)
    np.testing.assert_allclose(res["loss_se"], w.std(ddof=1) / np.sqrt(used), rtol=1e-12)
    np.testing.assert_allclose(res["bpb_se"] / res["bpb"], res["loss_se"] / res["loss"], rtol=1e-12)


def test_standard_errors():
    rng = np.random.default_rng(0)
    a = rng.normal(2.0, 0.3, 4000)
    b = a + rng.normal(0.05, 0.01, 4000)  # b shares a's window-to-window variation
    assert standard_error([1.0]) is None and standard_error([]) is None
    np.testing.assert_allclose(standard_error(a), 0.3 / np.sqrt(4000), rtol=0.05)
    d, se = paired_difference(b, a)
    np.testing.assert_allclose(d, 0.05, atol=1e-3)
    np.testing.assert_allclose(se, 0.01 / np.sqrt(4000), rtol=0.05)
    assert se < standard_error(a) / 10  # what the windows share cancels
    assert paired_difference(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError, match="two equal 1-d lists"):
        paired_difference(a, a[:-1])
    assert row_window_losses(np.array([1.23456789, 2.0])) == [1.234568, 2.0]
    assert format_se(None) == "" and format_se(0.01234) == " ± 0.0123"
