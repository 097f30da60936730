"""Gradient influence G(d) (hybrid_lm/eval/influence.py): summaries, the receptive-field oracle (zero
beyond a horizon-constrained model's reach, nonzero at its edge), a finite-difference check of the
official target (tests/test_eval_fidelity.py checks it against the official code), the whole-document
inputs, and the rows, table and plot on a tiny trained run."""

import json

import numpy as np
import pytest

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import influence as I

W = 8  # TINY's swa window
N_LAYERS = 4  # '1:1' -> F E F E


def test_summaries():
    g = np.array([4.0, 2.0, 1.0, 0.5, 0.005, 0.0039, 0.0, 0.0])  # 1e-3 max = 0.004: d = 4 is the last above
    s = I.summarize(g)
    assert s["g_max"] == 4.0 and s["g_sum"] == pytest.approx(7.5089)
    assert s["reach"] == 4 and not s["reach_saturated"]
    assert I.summarize(g * 10)["reach"] == 4  # scale-free
    assert s["mean_distance"] == pytest.approx((2 + 2 + 1.5 + 4 * 0.005 + 5 * 0.0039) / 7.5089)
    assert [(b["lo"], b["hi"]) for b in s["bins"]] == [(0, 0), (1, 1), (2, 3), (4, 7)]
    assert s["bins"][2]["mean"] == pytest.approx(0.75) and sum(b["mass"] for b in s["bins"]) == pytest.approx(1.0)
    assert I.summarize(np.ones(5))["reach_saturated"] is True
    z = I.summarize(np.zeros(3))
    assert z["reach"] is None and z["mean_distance"] is None and z["bins"][0]["mass"] is None
    assert I.log2_bins(20)[-1] == (16, 19) and I.log2_bins(1) == [(0, 0)]
    assert I.HEADLINE in s


# ----------------------------------------------------------------------------- on a trained run


@pytest.fixture(scope="module")
def run(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("influence_run")
    train(load_config([], list(TINY) + ["TrainConfig.steps = 5", f"ModelConfig.n_layers = {N_LAYERS}"]), wd)
    return RestoredRun(wd)


def _bound(horizon: int, last: int) -> int:
    """The largest distance the last ``last`` outputs can see: each full layer at horizon H reaches H-1
    back, each swa layer W-1, and the earliest output is ``last - 1`` before the last token."""
    return last - 1 + (N_LAYERS // 2) * (horizon - 1) + (N_LAYERS // 2) * (W - 1)


@pytest.mark.parametrize("horizon,last,seq_len", [(4, 20, 64), (3, 4, 32)])
def test_zero_beyond_the_receptive_field(run, horizon, last, seq_len):
    cfg = run.task_config(horizon=horizon, seq_len=seq_len)
    (row,) = I.evaluate_influence(run, cfg, last=last, samples=4, progress=False)
    g = np.asarray(row["g"])
    b = _bound(horizon, last)
    assert len(g) == seq_len and b + 1 < seq_len
    assert np.all(g[b + 1:] == 0.0), g[b + 1:]  # exactly: masked weights and their gradients are 0
    assert g[b] > 0 and np.all(g[:b + 1] > 0)  # the farthest reachable token still counts
    assert row["reach"] <= b and row["mixers"]["full"]["kind"] == "attention_sink"


def test_matches_finite_differences_and_batching(run):
    import jax
    import jax.numpy as jnp

    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    T, last, n = run.cfg.data.seq_len, 5, 4
    windows = np.asarray(run.streams().eval_batch)[:n, :T]
    (whole,) = I.evaluate_influence(run, windows=windows, samples=n, last=last, progress=False)
    (padded,) = I.evaluate_influence(run, windows=windows, samples=n, last=last, batch_size=3, progress=False)
    np.testing.assert_allclose(padded["g"], whole["g"], rtol=1e-5)  # 2 passes, the second one padded
    assert whole["inputs"] == "given" and whole["samples"] == n

    # central differences of s along every embedding coordinate at distance d, all windows in one batch
    model = run.model()
    dm, eps = run.cfg.model.d_model, 1e-2
    e0 = np.asarray(model.embed(jnp.asarray(windows), jnp.float32))  # [n, T, dm]

    @jax.jit
    def s_rows(e):  # s of each row of a batch of embeddings
        ctx = MixerContext(positions=default_positions(e.shape[0], T), train=False)
        return model.logits(model.run_blocks(e, ctx))[:, T - last:].mean(1).sum(-1)  # the official logit_sum

    for d in (0, 12):
        bump = np.zeros((2 * dm, T, dm), np.float32)
        bump[np.arange(dm), T - 1 - d, np.arange(dm)] = eps
        bump[dm + np.arange(dm), T - 1 - d, np.arange(dm)] = -eps
        values = np.asarray(s_rows(jnp.asarray((e0[:, None] + bump[None]).reshape(-1, T, dm))), np.float64)
        values = values.reshape(n, 2, dm)
        grad = (values[:, 0] - values[:, 1]) / (2 * eps)  # [n, dm]
        assert whole["g"][d] == pytest.approx(np.linalg.norm(grad, axis=1).mean(), rel=3e-2)


def test_documents_are_whole_val_documents_after_a_bos(run):
    """The default inputs: the val split's documents of at least T tokens (less the BOS), each its
    first T - 1 tokens after the separator, drawn by the seed; the same G(d) as those rows given."""
    from hybrid_lm.data.store import TokenStore

    T = run.cfg.data.seq_len
    (row,) = I.evaluate_influence(run, samples=3, seed=2, progress=False)
    sep = [int(x) for x in run.tokenizer.separator]
    assert row["inputs"] == "documents" and row["bos"] == sep and row["seq_len"] == T and row["samples"] == 3
    val = TokenStore(run.streams().store.path).split("val")
    content = val.doc_lengths - len(sep)
    ok = np.flatnonzero(content >= T - len(sep))
    assert row["documents_available"] == len(ok) > 3
    picked = np.sort(np.random.default_rng(2).choice(ok, 3, replace=False))
    rows = np.stack([np.r_[sep, val.read(int(val.doc_starts[i]), T - len(sep))] for i in picked]).astype(np.int32)
    (given,) = I.evaluate_influence(run, windows=rows, samples=3, progress=False)
    np.testing.assert_allclose(row["g"], given["g"], rtol=1e-6)
    (windows,) = I.evaluate_influence(run, samples=3, inputs="windows", progress=False)
    assert windows["inputs"] == "windows" and windows["bos"] is None and windows["g"] != row["g"]
    with pytest.raises(ConfigError, match="inputs='pages'"):
        I.evaluate_influence(run, inputs="pages", progress=False)
    with pytest.raises(ValueError, match="no val document has 99999 tokens.*T = 100001 tokens.*--influence-inputs windows"):
        I.evaluate_influence(run, seq_len=100001, progress=False)


def test_rows_table_plot(run, tmp_path):
    rows = I.evaluate_influence(run, samples=3, seed=1, progress=True)
    rows += I.evaluate_influence(run, run.task_config(horizon=4), samples=3, seed=1, progress=False)
    json.dumps(rows)  # JSON-serialisable
    for r in rows:
        assert r["task"] == "influence" and r["checkpoint_step"] == run.step == 5 and r["last"] == 20
        assert r["samples"] == 3 and r["seq_len"] == 32 and len(r["g"]) == 32
        assert all(np.isfinite(x) and x >= 0 for x in r["g"]) and r[I.HEADLINE] > 0
        assert r["attention_backends"]
    assert all(x > 0 for x in rows[0]["g"])  # full attention: even the first token counts
    assert rows[1]["mean_distance"] < rows[0]["mean_distance"]  # the horizon shortens the influence
    text = I.format_influence(rows)
    assert "mean distance" in text and "16-31" in text and "attention_sink(horizon=4,sinks=0)" in text
    (path,) = I.plot_influence(rows, tmp_path / "plots")
    assert path.name == "influence.png" and path.stat().st_size > 5000
    assert I.plot_influence([], tmp_path) == [] and I.format_influence([]) == "no influence results"


def test_bad_inputs(run):
    with pytest.raises(ConfigError, match="last=0"):
        I.evaluate_influence(run, last=0, progress=False)
    with pytest.raises(ConfigError, match="last=33"):
        I.evaluate_influence(run, last=33, progress=False)
    with pytest.raises(ConfigError, match="samples"):
        I.evaluate_influence(run, samples=0, progress=False)
    with pytest.raises(ConfigError, match=r"\[N, T\]"):
        I.evaluate_influence(run, windows=np.zeros(8, np.int32), progress=False)
    with pytest.raises(ConfigError, match="vocab_size"):
        I.evaluate_influence(run, windows=np.full((1, 8), 10**6), progress=False)
    with pytest.raises(ConfigError, match="seq_len=16"):
        I.evaluate_influence(run, windows=np.zeros((1, 8), np.int32), seq_len=16, progress=False)


def test_a_run_trained_with_remat_gives_the_same_g(run):
    """A remat policy is a training-memory setting: G(d) is computed without it (nnx.remat inside the
    gradient once raised a TraceContextError on an S1 run trained with remat='dots_attn')."""
    import dataclasses

    cfg = run.task_config()
    plain = I.evaluate_influence(run, cfg, samples=2, progress=False)[0]["g"]
    remat = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="dots_attn"))
    assert I.evaluate_influence(run, remat, samples=2, progress=False)[0]["g"] == plain
