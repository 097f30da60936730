"""LongPPL: the short-context windows score every target with K .. K+W-1 tokens of context, key
tokens follow the two thresholds, and the corpus value is the key-token-weighted mean
(tests/test_eval_fidelity.py checks them against PKU-ML/LongPPL's code)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.eval.longppl import KeyTokenRule, key_tokens, longppl, nll_per_token, short_context_nll


def _context_length_nll(tokens):
    """A fake evaluator whose NLL of a target is the length of the context it was given."""
    B, n = tokens.shape
    return jnp.broadcast_to(jnp.arange(1, n, dtype=jnp.float32), (B, n - 1))


@pytest.mark.parametrize("T,K,W", [(40, 8, 4), (41, 8, 5), (17, 4, 16), (30, 1, 1)])
def test_short_windows_give_every_target_k_to_k_plus_w_minus_1_tokens(T, K, W):
    tokens = jnp.zeros((2, T), jnp.int32)
    short = short_context_nll(_context_length_nll, tokens, KeyTokenRule(trunc_len=K, window=W))
    assert np.isnan(short[:, :K + (K == 0)]).all()
    got = short[0, K:] if K else short[0, 1:]
    assert np.isfinite(got).all(), got
    assert got.min() >= K and got.max() <= K + W - 1
    # the windows start at 0, W, 2W, ...: target i sees i - floor((i - K) / W) * W tokens
    i = np.arange(max(K, 1), T)
    np.testing.assert_array_equal(got, i - (i - K) // W * W)


def test_key_tokens_follow_both_thresholds():
    T, K, W = 24, 6, 3
    rng = np.random.default_rng(0)
    full_nll = rng.uniform(0, 4, (1, T - 1)).astype(np.float32)
    short_nll = full_nll + rng.uniform(0, 4, (1, T - 1)).astype(np.float32)

    def nll_fn(tokens):  # full context (the whole document) or a short window, told apart by length
        n = tokens.shape[1]
        if n == T:
            return jnp.asarray(full_nll)
        s = int(tokens[0, 0])  # the window's start, encoded in the tokens below
        return jnp.asarray(short_nll[:, s:s + n - 1])

    tokens = jnp.broadcast_to(jnp.arange(T), (1, T))
    rule = KeyTokenRule(trunc_len=K, window=W, alpha=1.5, beta=-2.5)
    key, full = key_tokens(nll_fn, tokens, rule)
    lsd = short_nll[0] - full_nll[0]  # of positions 1 .. T-1
    want = (lsd > 1.5) & (full_nll[0] < 2.5)
    want[:K - 1] = False  # positions < K never key
    np.testing.assert_array_equal(key[0, 1:], want)
    assert not key[0, 0] and np.isnan(full[0, 0])


def test_longppl_is_the_key_weighted_mean_and_reports_counts():
    nll = np.array([[np.nan, 1.0, 2.0, 3.0], [np.nan, 0.5, 4.0, 1.0]])
    key = np.array([[False, True, False, True], [False, False, True, False]])
    r = longppl(nll, key)
    # perplexity.py's counts: n_token is every token of a document, the first (unscored) one included
    assert r["n_key"] == 3 and r["n_token"] == 8 and r["n_scored"] == 6 and r["key_rate"] == 3 / 8
    assert r["longppl"] == pytest.approx(math.exp((1 + 3 + 4) / 3))
    assert r["ppl"] == pytest.approx(math.exp(11.5 / 6))
    assert longppl(nll, np.zeros_like(key))["longppl"] is None


def test_nll_per_token_is_cross_entropy_and_rules_are_checked():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    got = nll_per_token(lambda x: logits[:, :x.shape[1]], jnp.array([[0, 1, 1]]))
    np.testing.assert_allclose(got, [[-math.log(0.25), -math.log(0.8)]], rtol=1e-6)
    with pytest.raises(ValueError, match="no token beyond"):
        key_tokens(_context_length_nll, jnp.zeros((1, 9), jnp.int32), KeyTokenRule(trunc_len=8, window=2))
