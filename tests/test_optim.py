import numpy as np
import pytest

from hybrid_lm.config import OptimConfig
from hybrid_lm.train.optim import decay_mask, wsd_schedule


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_schedule_phases(shape):
    o = OptimConfig(lr=1.0, warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.1)
    f = wsd_schedule(o, total_steps=100)
    lrs = np.array([float(f(s)) for s in range(101)])
    np.testing.assert_allclose(lrs[:10], (np.arange(10) + 1) / 10, rtol=1e-6)  # linear warmup
    np.testing.assert_allclose(lrs[10:81], 1.0)  # stable until the decay starts at step 80
    assert np.all(np.diff(lrs[80:]) < 0) and lrs[100] == pytest.approx(0.1)  # decays to min_lr_ratio
    t = 0.5  # step 90
    expected = {"linear": 1 - t, "cosine": 0.5 * (1 + np.cos(np.pi * t)), "1-sqrt": 1 - np.sqrt(t)}[shape]
    assert lrs[90] == pytest.approx(0.1 + 0.9 * expected, rel=1e-5)


def test_no_weight_decay_on_norms():
    mask = decay_mask({"norm": {"scale": ("norm",)}, "w": ("embed", "mlp")})
    assert mask == {"norm": {"scale": False}, "w": True}


def test_no_weight_decay_on_recurrent_scalars_and_biases():
    mask = decay_mask({"A_log": ("ssm_heads",), "b": ("embed", "bias"), "conv": ("conv_kernel", "conv_dim")})
    assert mask == {"A_log": False, "b": False, "conv": True}
