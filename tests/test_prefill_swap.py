"""``--swap-prefill-only`` (eval/prefill_swap.py): the context prefilled with a swap, the answer scored by
the run's own layers over it, against a dense oracle: the run's model with every attention layer
replaced by plain softmax attention under the protocol's mask (context rows: the swap's; answer rows:
causal over everything)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.eval.prefill_swap import split_answer_nll_fn
from hybrid_lm.run.swap import swapped_config
from hybrid_lm.experiment import load_config
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.step import ModelFns

L, SPAN, W = 24, 7, 3
P = L - SPAN


def _setup(n_layers: int = 3, swap: str = f"full=swa:{W}"):
    cfg = load_config([], ["ModelConfig.d_model = 32", f"ModelConfig.n_layers = {n_layers}", "ModelConfig.n_heads = 4",
                           "ModelConfig.n_kv_heads = 2", "ModelConfig.head_dim = 8", "ModelConfig.d_ff = 64",
                           "ModelConfig.layer_pattern = 'F'", "ModelConfig.compute_dtype = 'float32'",
                           "ModelConfig.attention_impl = 'xla'", "DataConfig.seq_len = 32"])
    fns = ModelFns(cfg)
    params = fns.init(0)
    leaves, tree = jax.tree.flatten(params)  # larger than init, so attention is far from uniform
    keys = jax.random.split(jax.random.key(7), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
                                       for k, x in zip(keys, leaves)])
    swapped = swapped_config(cfg, [swap])
    tokens = jax.random.randint(jax.random.key(3), (2, L), 0, 256)
    return cfg, fns, swapped, ModelFns(swapped), params, tokens


def _dense_nll(model, tokens, visible):
    """NLL of tokens[:, P:] from the model run with dense attention under ``visible [n, n]`` on tokens[:, :-1]."""
    inp = tokens[:, :-1]
    B, n = inp.shape
    pos = default_positions(B, n)
    x = model.embed(inp, jnp.float32)
    for block in model.blocks:
        h = block.mixer_norm(x)
        q, k, v = block.mixer.project_qkv(h, pos)
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(visible[None, None], s, -jnp.inf), axis=-1)
        x = x + block.mixer.project_out(jnp.einsum("bhqk,bkhd->bqhd", p, v))
        x = x + block.mlp(block.mlp_norm(x))
    logits = model.logits(x)[:, P - 1:]
    target = tokens[:, P:]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]


@pytest.mark.integration  # whole models
def test_swa_prefill_then_full_answer_equals_the_dense_oracle():
    cfg, fns, swapped, sfns, params, tokens = _setup()
    got = np.asarray(split_answer_nll_fn(fns, sfns, cfg, swapped, SPAN)(params, tokens))
    i, j = np.arange(L - 1)[:, None], np.arange(L - 1)[None, :]
    protocol = (j <= i) & ((i - j < W) | (i >= P))  # context rows: SWA-W; answer rows: every earlier key
    want = np.asarray(_dense_nll(fns.model(params), tokens, jnp.asarray(protocol)))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    # and it is neither the full model's nor the SWA model's teacher-forced NLL
    full = np.asarray(_dense_nll(fns.model(params), tokens, jnp.asarray(j <= i)))
    swa = np.asarray(_dense_nll(fns.model(params), tokens, jnp.asarray((j <= i) & (i - j < W))))
    assert np.abs(got - full).max() > 1e-2 and np.abs(got - swa).max() > 1e-2


@pytest.mark.integration  # whole models
def test_no_swap_equals_the_teacher_forced_answer_nll():
    from hybrid_lm.eval.ruler import _answer_nll_fn

    cfg, fns, _, _, params, tokens = _setup()
    got = np.asarray(split_answer_nll_fn(fns, fns, cfg, cfg, SPAN)(params, tokens))
    want = np.asarray(_answer_nll_fn(fns, cfg, SPAN)(params, tokens))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.integration  # whole models
def test_sa_prefill_draws_its_permutations_for_the_context_alone():
    """One layer: the answer rows' keys are embeddings whatever the swap, so answer tokens 1.. score as in
    the full model; answer token 0 is predicted by the SA model run on the context alone (its eval
    permutation of P positions)."""
    from hybrid_lm.eval.introspect import eval_context

    cfg, fns, swapped, sfns, params, tokens = _setup(n_layers=1, swap=f"full=sa:{W}")
    got = np.asarray(split_answer_nll_fn(fns, sfns, cfg, swapped, SPAN)(params, tokens))
    i, j = np.arange(L - 1)[:, None], np.arange(L - 1)[None, :]
    full = np.asarray(_dense_nll(fns.model(params), tokens, jnp.asarray(j <= i)))
    np.testing.assert_allclose(got[:, 1:], full[:, 1:], atol=2e-4, rtol=1e-4)
    logits = sfns.model(params)(tokens[:, :P], eval_context(swapped, 2, P))[:, -1]
    first = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, P, None], -1)[:, 0]
    np.testing.assert_allclose(got[:, 0], np.asarray(first), atol=2e-4, rtol=1e-4)
    assert np.abs(got[:, 0] - full[:, 0]).max() > 1e-3  # SA-3 over 17 tokens is not full attention


def test_context_must_hold_a_token():
    cfg, fns, swapped, sfns, params, tokens = _setup()
    with pytest.raises(ValueError, match="at least one token"):
        split_answer_nll_fn(fns, sfns, cfg, swapped, L)(params, tokens)


def test_swap_prefill_only_is_checked_before_anything_runs():
    from hybrid_lm.errors import ConfigError
    from hybrid_lm.eval.suite import EvalRequest

    with pytest.raises(ConfigError, match="needs --swap"):
        EvalRequest(tasks=("ruler",), swap_prefill_only=True).check()
    with pytest.raises(ConfigError, match="applies to --tasks ruler and lm_eval"):
        EvalRequest(tasks=("ruler", "loss"), swaps=("full=sa:8",), swap_prefill_only=True).check()
    req = EvalRequest(tasks=("ruler",), swaps=("full=sa:8",), swap_prefill_only=True)
    req.check()
    assert req.config("ruler")["swap_prefill_only"] is True
    assert "swap_prefill_only" not in EvalRequest(tasks=("ruler",)).config("ruler")  # earlier rows' keys unchanged
    assert "generation" not in EvalRequest(tasks=("ruler",)).config("ruler")
    assert EvalRequest(tasks=("ruler",), ruler_generation=False).config("ruler")["generation"] is False
