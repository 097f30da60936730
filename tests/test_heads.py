"""Retrieval-head tracking (hybrid_lm/eval/heads.py, eval/introspect.py's attention weights): the
recomputed attention reproduces the layer's own output (RoPE, NoPE, GQA, a horizon with sinks);
hand-built oracles (zero queries: uniform attention, entropy 1, score = answer / (q + 1); a horizon
that hides the answer: score 0); d_QK (0 against itself, exact on scaled heads, GQA groups); and
evaluate/format/plot end to end on a tiny run with two checkpoints. tests/test_eval_fidelity.py checks
the definitions against the official scripts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import heads as HD
from hybrid_lm.eval import introspect as I


def _one_layer(*extra):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.step import ModelFns

    cfg = load_config([], list(TINY) + ["ModelConfig.n_layers = 1", "ModelConfig.layer_pattern = 'F'",
                                        "ModelConfig.n_heads = 4", "ModelConfig.n_kv_heads = 2", *extra])
    return cfg, ModelFns(cfg)


def _constrained(cfg, horizon, sinks):
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.step import ModelFns

    cfg = swapped_config(cfg, (), horizon, sinks)
    return cfg, ModelFns(cfg)


@pytest.mark.parametrize("case", ["rope", "nope", "horizon"])
def test_attention_weights_reproduce_the_layers_output(case):
    cfg, fns = _one_layer(*(["full/MixerConfig.rope = False"] if case == "nope" else []))
    if case == "horizon":
        cfg, fns = _constrained(cfg, 6, 2)
    params = fns.init(0)
    mixer = params["blocks"][0]["mixer"]
    mixer["wq"], mixer["wk"] = mixer["wq"] * 40.0, mixer["wk"] * 40.0  # peaked, far from uniform
    B, T = 2, 24
    tokens = np.random.default_rng(0).integers(0, 256, (B, T)).astype(np.int32)

    def both(params, tokens):
        model = fns.model(params)
        (layer,) = I.attention_layers(model)
        block = model.blocks[0]
        ctx = I.eval_context(cfg, B, T)
        x = model.embed(tokens, jnp.float32)
        qpos = jnp.broadcast_to(jnp.arange(T), (B, T))
        p = I.head_attention(block, x, ctx.positions, qpos, layer.horizon, layer.sinks)  # [B, H, T, T]
        _, _, v = block.mixer.project_qkv(block.mixer_norm(x), ctx.positions)
        v = jnp.repeat(v, p.shape[1] // v.shape[2], axis=2)
        mine = block.mixer.project_out(jnp.einsum("bhat,bthd->bahd", p, v))
        return mine, block.mixer(block.mixer_norm(x), ctx), p

    mine, layers_own, p = (np.asarray(a) for a in jax.jit(both)(params, tokens))
    np.testing.assert_allclose(mine, layers_own, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    if case == "horizon":  # query 20 sees keys 0, 1 (sinks) and 15..20 only
        assert np.all(p[:, :, 20, 2:15] == 0) and np.all(p[:, :, 20, [0, 1, 15, 20]] > 0)
    assert np.all(p[:, :, 5, 6:] == 0)  # causal


def _stats(cfg, fns, params, tokens, lengths, needle):
    def stats(params, tokens, lengths, needle):
        model = fns.model(params)
        return I.retrieval_stats(model, tokens, I.eval_context(cfg, *tokens.shape), lengths, needle,
                                 I.attention_layers(model))
    return [np.asarray(a) for a in jax.jit(stats)(params, tokens, lengths, needle)]


def _mask(T, *spans):
    m = np.zeros((len(spans), T), bool)
    for r, (a, b) in enumerate(spans):
        m[r, a:b] = True
    return m


def test_zero_queries_attend_uniformly():
    """wq = 0: every score is 0, so each query spreads evenly over its q + 1 visible keys: the score
    (the query at len - 2) is |answer| / (q + 1) exactly and the entropy of the last 4 queries 1; with
    a horizon of 8 (no sinks) the answer is out of sight and the entropy is log 8 / log(q + 1) (the
    official normalisation counts every causal key)."""
    cfg, fns = _one_layer()
    params = fns.init(1)
    params["blocks"][0]["mixer"]["wq"] = jnp.zeros_like(params["blocks"][0]["mixer"]["wq"])
    tokens = np.random.default_rng(1).integers(0, 256, (2, 48)).astype(np.int32)
    lengths = np.array([[34], [43]], np.int32)  # row 0 padded after 34 tokens, row 1 after 43
    needle = _mask(48, (5, 12), (0, 20))
    mass, entropy, uniform = _stats(cfg, fns, params, tokens, lengths, needle)
    want = np.array([7 / 33, 20 / 42])  # queries 32 and 41
    assert mass.shape == entropy.shape == (2, 1, 4) and uniform.shape == (2, 1)
    np.testing.assert_allclose(mass[:, 0], np.repeat(want[:, None], 4, 1), rtol=1e-5)
    np.testing.assert_allclose(entropy, 1.0, rtol=1e-5)
    np.testing.assert_allclose(uniform[:, 0], want, rtol=1e-5)
    cfg8, fns8 = _constrained(cfg, 8, 0)
    mass, entropy, uniform = _stats(cfg8, fns8, params, tokens, lengths, needle)
    assert np.all(mass == 0) and np.all(uniform == 0)
    tail = [np.mean([np.log(8) / np.log(q + 1) for q in range(n - 4, n)]) for n in (34, 43)]
    np.testing.assert_allclose(entropy[:, 0], np.repeat(np.array(tail)[:, None], 4, 1), rtol=1e-4)
    cfg_s, fns_s = _constrained(cfg, 8, 4)  # 4 sinks: keys 0..3 of row 1's answer [0, 20) are visible
    mass, _, _ = _stats(cfg_s, fns_s, params, tokens, lengths, needle)
    np.testing.assert_allclose(mass[1, 0], 4 / 12, rtol=1e-5)
    assert np.all(mass[0] == 0)


def test_a_head_locked_on_one_token_puts_its_score_on_the_answer():
    """NoPE; token 255 alone has embedding direction e_0, and every head's q and k read only e_0:
    the query (a 255 at len - 2, RMS-normed to sqrt(32) e_0) scores the 255 keys 32 c^2 / sqrt(head_dim
    8) and every other key 0, so with the answer holding four 255s and the query's own key the fifth,
    the score -> 4/5."""
    cfg, fns = _one_layer("full/MixerConfig.rope = False")
    params = fns.init(2)
    table = np.asarray(params["embed"]["table"]).copy()
    table[:, 0] = 0.0
    table[255] = 0.0
    table[255, 0] = 1.0
    params["embed"]["table"] = jnp.asarray(table)
    mixer = params["blocks"][0]["mixer"]
    for name in ("wq", "wk"):
        w = np.zeros(mixer[name].shape, np.float32)
        w[0, :, 0] = 3.0  # c = 3: a score of 102, so the 255 keys take all but e^-100 of the mass
        mixer[name] = jnp.asarray(w)
    tokens = np.random.default_rng(2).integers(0, 200, (1, 40)).astype(np.int32)
    tokens[0, 10:14] = tokens[0, 38] = 255
    mass, entropy, _ = _stats(cfg, fns, params, tokens, np.array([[40]], np.int32), _mask(40, (8, 16)))
    np.testing.assert_allclose(mass, 4 / 5, rtol=1e-5)
    # the last 4 queries: 36, 37, 39 hold no 255 (uniform, 1), 38 spreads over 5 keys (log 5 / log 39)
    np.testing.assert_allclose(entropy, (3 + np.log(5) / np.log(39)) / 4, rtol=1e-4)


def test_qk_distance():
    rng = np.random.default_rng(0)
    wq, wk = rng.normal(size=(16, 4, 8)), rng.normal(size=(16, 2, 8))
    np.testing.assert_array_equal(I.qk_distance(wq, wk, wq, wk), 0.0)
    d = I.qk_distance(2 * wq, wk, wq, wk)  # the query part doubled: rel(Q) = 1, rel(K) = 0
    np.testing.assert_allclose(d, 1.0, rtol=1e-12)
    d = I.qk_distance(2 * wq, 3 * wk, wq, wk)  # rel(Q) + rel(K), not the joint norm
    np.testing.assert_allclose(d, 3.0, rtol=1e-12)
    moved = wk.copy()
    moved[:, 1] += 1.0  # kv head 1 serves query heads 2 and 3 (GQA groups of 2)
    d = I.qk_distance(wq, moved, wq, wk)
    assert np.all(d[:2] == 0) and np.all(d[2:] > 0)


# ----------------------------------------------------------------------------- on a trained run


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run(10)  # TINY, 10 steps (conftest.py): checkpoints at 5 and 10


@pytest.mark.integration  # a model's whole eval task
def test_evaluate_heads_end_to_end(run_dir, tmp_path):
    from hybrid_lm.run.restore import RestoredRun

    early, last = RestoredRun(run_dir, step=5), RestoredRun(run_dir)
    kw = dict(samples=6, seq_len=512, progress=False, batch_size=4)
    (row,) = HD.evaluate_heads(early, **kw)
    json.dumps(row)
    assert row["task"] == "heads" and row["checkpoint_step"] == 5 and row["reference_step"] == 10
    assert row["layers"] == [0] and row["layer_kinds"] == ["attention"] and row["n_heads"] == 2
    mass, ent, dqk = (np.asarray(row[k]) for k in ("mass", "entropy", "d_qk"))
    assert mass.shape == ent.shape == dqk.shape == (1, 2)
    assert np.all((0 <= mass) & (mass <= 1)) and np.all((0 <= ent) & (ent <= 1 + 1e-6)) and np.all(dqk > 0)
    assert 0 < row["uniform_mass"][0] < 1 and row["prompt_tokens"] == 512 and row["score_samples"] == 6
    assert row["target_heads"] == [h["head"] for h in row["top_heads"][:4]]
    top = row["top_heads"]
    assert [h["mass"] for h in top] == sorted((h["mass"] for h in top), reverse=True)
    assert {h["head"] for h in top} == {"L0H0", "L0H1"} and row["top_head"] == top[0]["head"]
    assert row[HD.HEADLINE] == top[0]["mass"] == mass.max()
    (final,) = HD.evaluate_heads(last, **kw)
    assert final["checkpoint_step"] == 10 and np.all(np.asarray(final["d_qk"]) == 0)
    # another reference: a step, or parameters; against itself d_QK is 0
    (own,) = HD.evaluate_heads(early, **kw, reference_step=5)
    assert own["reference_step"] == 5 and np.all(np.asarray(own["d_qk"]) == 0) and own["mass"] == row["mass"]
    (given,) = HD.evaluate_heads(early, **kw, reference_params=last.params)
    assert given["reference_step"] is None and given["d_qk"] == row["d_qk"]
    with pytest.raises(ConfigError, match="not both"):
        HD.evaluate_heads(early, **kw, reference_step=5, reference_params=last.params)
    with pytest.raises(ConfigError, match="no checkpoint at step 7"):
        HD.evaluate_heads(early, **kw, reference_step=7)
    # a receptive-field constraint is applied; a model without full attention is refused
    (short,) = HD.evaluate_heads(early, early.task_config(horizon=16, sinks=2), **kw)
    assert short["layer_kinds"] == ["attention_sink"] and short["constraints"] == [{"horizon": 16, "sinks": 2}]
    assert short["uniform_mass"][0] < row["uniform_mass"][0]
    with pytest.raises(ConfigError, match="heads: .* too short: use a longer seq_len"):
        HD.evaluate_heads(early, samples=2, progress=False)  # the trained 32 tokens
    with pytest.raises(ConfigError, match="no full-attention layer"):
        HD.evaluate_heads(early, early.task_config(["full=swa:8"]), **kw)
    text = HD.format_heads([row, final])
    assert "L0H0" in text and "d_QK against step 10" in text and "step 5" in text
    paths = HD.plot_heads([final, row], tmp_path / "plots")
    assert [p.name for p in paths] == ["heads_entropy_dqk.png", "heads_mass.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
