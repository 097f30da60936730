"""Layerwise probing (hybrid_lm/eval/probe.py) and its items and features (eval/introspect.py): the
classifier on oracle features (class-encoding: 1.0; noise: chance), the needle items (deterministic,
balanced, the number where the span says, depth 25-75% for exact prompts), the residual stream equal to
the model's own forward pass, right padding that changes nothing, and evaluate/format/plot end to end
on a tiny trained run. tests/test_eval_fidelity.py checks the definitions against the official code."""

import json

import numpy as np
import pytest

from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import introspect as I
from hybrid_lm.eval import probe as P
from hybrid_lm.eval import ruler_items as RI

BYTE = load_tokenizer("byte")


# ----------------------------------------------------------------------------- the classifier (pure)


def test_probe_separates_class_encoding_features_perfectly():
    rng = np.random.default_rng(0)
    labels = np.arange(200) % 8
    feats = rng.normal(size=(200, 3, 16))
    feats[:, 1, :8] += 8.0 * np.eye(8)[labels]  # layer 1: the one-hot class plus noise
    feats[:, 2] = np.eye(8)[labels] @ rng.normal(size=(8, 16))  # layer 2: a random code per class, no noise
    acc = P.probe_accuracy(feats, labels, seed=0)
    assert acc.shape == (3,)
    assert acc[1] == 1.0 and acc[2] == 1.0
    assert acc[0] < 0.35  # layer 0: noise


def test_probe_on_noise_is_at_chance():
    """400 items, 80 held out: one layer's accuracy on noise features has standard deviation
    sqrt(1/8 * 7/8 / 80) = 0.037, the mean over 4 independent layers 0.018, so |mean - 1/8| < 0.1 is
    more than 5 standard deviations (and each layer < 0.3 more than 4.7)."""
    rng = np.random.default_rng(1)
    labels = np.arange(400) % 8
    acc = P.probe_accuracy(rng.normal(size=(400, 4, 32)), labels, seed=3)
    assert abs(acc.mean() - P.CHANCE) < 0.1 and np.all(acc < 0.3)


def test_probe_split_is_seeded_and_checked():
    rng = np.random.default_rng(2)
    labels = np.arange(80) % 8
    feats = rng.normal(size=(80, 2, 8))
    feats[:, 0, 0] += 0.8 * labels
    a, b = P.probe_accuracy(feats, labels, seed=5), P.probe_accuracy(feats, labels, seed=5)
    np.testing.assert_array_equal(a, b)
    assert np.all((0 <= a) & (a <= 1))
    with pytest.raises(ValueError, match=r"\[N, L, d\]"):
        P.probe_accuracy(feats[:, 0], labels)


# ----------------------------------------------------------------------------- items


def test_items_are_deterministic_balanced_and_hold_the_number():
    hay = RI.haystack_for("essays", BYTE)
    items = I.needle_items(BYTE, 512, 16, 7, hay)
    again = I.needle_items(BYTE, 512, 16, 7, hay)
    other = I.needle_items(BYTE, 512, 16, 8, hay)
    for a, b in zip(items, again):
        np.testing.assert_array_equal(a.ids, b.ids)
        assert a.needle_spans == b.needle_spans and a.answers == b.answers
    assert any(not np.array_equal(a.ids, c.ids) for a, c in zip(items, other))
    assert [I.item_label(it) for it in items] == [i % 8 for i in range(16)]
    for it in items:
        assert len(it.ids) == 512
        s, e = it.needle_spans[0]
        needle = BYTE.decode(it.ids[s:e])
        assert needle.lstrip().startswith("One of the special magic numbers for ") and needle.endswith(f"is: {it.answers[0]}.")
        key = needle.split(" for ")[1].split(" is:")[0]
        text = BYTE.decode(it.ids)
        assert text.endswith(f"The special magic number for {key} mentioned in the provided text is")
        assert text.count(it.answers[0]) == 1 and 31415920 <= int(it.answers[0]) <= 31415927
    # exact prompts: the needle at 25-75% of the haystack's units (noise lines)
    noise = RI.haystack_for("noise", BYTE)
    depths = [it.depths[0] for it in I.needle_items(BYTE, 8192, 16, 0, noise)]
    assert min(depths) > 0.24 and max(depths) < 0.76 and max(depths) - min(depths) > 0.2
    with_answer = I.needle_item(512, 7, 3, BYTE, hay, gen_tokens=9)
    assert len(with_answer.ids) == 512 - 9 and with_answer.answers == items[3].answers
    with pytest.raises(ConfigError, match="too short"):
        I.needle_item(64, 0, 0, BYTE, hay)
    # the official recipe (tests/test_eval_fidelity.py checks its text): a nominal length, balanced classes
    official = I.needle_items(BYTE, 16000, 16, 0, noise, prompt="official")
    assert [I.item_label(it) for it in official] == [i % 8 for i in range(16)]
    sizes = [len(it.ids) for it in official]
    assert max(sizes) - min(sizes) < 40  # the keys' lengths differ: the probe right-pads
    assert 160 * 90 < len(official[0].ids) < 160 * 93  # 160 noise lines of 91 bytes, the needle, the template


# ----------------------------------------------------------------------------- on a trained run


@pytest.fixture(scope="module")
def run(tiny_run):
    from hybrid_lm.run.restore import RestoredRun

    return RestoredRun(tiny_run(5))  # TINY, 5 steps (conftest.py)


@pytest.mark.integration  # a trained run
def test_features_of_right_padded_prompts_are_those_of_the_prompts_alone(run):
    """Prompts of different lengths share a batch, right-padded: a causal model's state at the last real
    token does not see the padding."""
    import jax

    tokens = np.random.default_rng(1).integers(0, 256, (2, 30)).astype(np.int32)
    short = tokens[1, :17]

    def feats(params, tokens, last):
        model = run.fns.model(params)
        return I.hidden_states(model, tokens, I.eval_context(run.cfg, *tokens.shape), last)
    padded = np.asarray(jax.jit(feats)(run.params, tokens, np.array([[29], [16]], np.int32)))
    alone = np.asarray(jax.jit(feats)(run.params, short[None], np.array([[16]], np.int32)))
    np.testing.assert_allclose(padded[1], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.integration  # a trained run
def test_residual_stream_is_the_models_forward_pass(run):
    import jax

    def both(params, tokens):
        model = run.fns.model(params)
        ctx = I.eval_context(run.cfg, *tokens.shape)
        states = I.run_layers(model, tokens, ctx)
        return (model.final_norm(states[-1]), model(tokens, ctx, features=True), states[1],
                I.last_token_states(model, tokens, ctx))

    tokens = np.random.default_rng(0).integers(0, 256, (2, 40)).astype(np.int32)
    mine, models, after_0, last = (np.asarray(x) for x in jax.jit(both)(run.params, tokens))
    np.testing.assert_allclose(mine, models, rtol=1e-5, atol=1e-5)
    assert last.shape == (2, run.cfg.model.n_layers + 1, 32) and last.dtype == np.float32
    np.testing.assert_allclose(last[:, 1], after_0[:, -1], rtol=1e-6)


@pytest.mark.integration  # a whole model across the mixers
def test_evaluate_probe_end_to_end(run, tmp_path):
    (row,) = P.evaluate_probe(run, samples=48, seq_len=512, prompt="exact", progress=False, batch_size=16)
    json.dumps(row)
    assert row["task"] == "probe" and row["checkpoint_step"] == run.step == 5
    assert row["layers"] == ["L0", "L1"] and len(row["accuracy"]) == 2 and row["layer_types"] == "FE"
    assert all(0.0 <= a <= 1.0 for a in row["accuracy"]) and row["chance"] == 0.125
    assert row["best_accuracy"] == max(row["accuracy"]) == row[P.HEADLINE]
    assert row["accuracy"][row["layers"].index(row["best_layer"])] == row["best_accuracy"]
    assert row["samples"] == 48 and row["seq_len"] == 512 and row["test_samples"] == 10
    assert row["prompt"] == "exact" and row["prompt_tokens"] == [512, 512] and row["haystack"] == "noise"
    assert len(row["depths"]) == 48 and all(0.0 <= d <= 1.0 for d in row["depths"])
    # the same features again (jitted once per model config): identical accuracies
    (again,) = P.evaluate_probe(run, samples=48, seq_len=512, prompt="exact", progress=False)
    assert again["accuracy"] == row["accuracy"]
    text = P.format_probe([row, {**row, "checkpoint_step": 10}])
    assert "L0(F)" in text and "L1(E)" in text and "best" in text and text.count("\n") == 3
    paths = P.plot_probe([row, {**row, "checkpoint_step": 10, "accuracy": [0.5, 0.9]}], tmp_path / "plots")
    assert [p.name for p in paths] == ["probe_heatmap.png", "probe_accuracy.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    with pytest.raises(ConfigError, match="at least 40"):
        P.evaluate_probe(run, samples=16, seq_len=512, prompt="exact", progress=False)
    with pytest.raises(ConfigError, match="probe: magic_number needs at least .* too short: use a longer seq_len"):
        P.evaluate_probe(run, samples=40, prompt="exact", progress=False)  # the trained 32 tokens hold no prompt
    with pytest.raises(ConfigError, match="prompt='nominal'"):
        P.evaluate_probe(run, samples=40, prompt="nominal", progress=False)


@pytest.mark.integration  # a model's whole eval task
def test_probe_runs_on_a_swapped_config(run):
    cfg = run.task_config(["efficient=sa:8"])
    (row,) = P.evaluate_probe(run, cfg, samples=40, seq_len=512, prompt="exact", progress=False)
    assert row["mixers"]["efficient"]["kind"] == "sa" and len(row["accuracy"]) == 2
