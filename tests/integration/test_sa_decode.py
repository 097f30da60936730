"""Decode path of stochastic attention (sa, sa_swa): docs/STOCHASTIC_ATTENTION.md §9.

decode='permutation' (default): the keys a decoded token sees have the training mask's law at its
position (checked against every permutation and against the forward op's own mask), prefill + steps
equal the eval forward of the whole sequence, a window covering it is full causal attention; the draw
is per row, independent of the batch. decode='swa': SA at prefill, an SWA layer's decode after it.
Options parse through swap specs and leave existing run ids unchanged.
"""

import dataclasses
import functools
import itertools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.errors import ConfigError
from hybrid_lm.eval.generate import generate
from hybrid_lm.run.swap import apply_swaps
from hybrid_lm.model.attention import SlidingWindowAttention, attend
from hybrid_lm.model.registry import MixerContext, get_mixer
from hybrid_lm.model.stochastic import (GatedSASWA, SAOptions, StochasticAttention, permute_positions,
                                        sa_mean_visible_keys, sa_permutations, sa_window_right, write_cache)
from hybrid_lm.model.transformer import HybridLM
from hybrid_lm.ops import permutation as P

VOCAB, D = 97, 32


def _pos(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _eval_ctx(b, t, seed=0):
    return MixerContext(positions=_pos(b, t), attention_impl="xla", train=False, seed=seed)


def _random(build, seed=1, std=0.3):
    """``build()`` with random weights far from the 0.02 init (so attention is far from uniform and
    errors would show), norm scales 1; drawn with numpy, with no jax init to compile."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(std * rng.standard_normal(x.shape, np.float32)) if x.ndim >= 2 else jnp.ones(x.shape, x.dtype)
              for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _mixer(cls, window, layer=0, seed=1, **options):
    cfg = ModelConfig(d_model=D, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, compute_dtype="float32")
    return _random(lambda: cls(cfg, MixerConfig(kind="x", window=window, options=options), layer,
                               rngs=nnx.Rngs(0)), seed)


def _model(efficient: MixerConfig, seed=1) -> HybridLM:
    cfg = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      compute_dtype="float32", efficient=efficient, full=MixerConfig(kind="attention"))
    return _random(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)), seed)


# One jitted function per (model object, function): a model's graph definition holds its config's
# dicts, so it cannot be a static (hashed) jit argument (as in hybrid_lm/eval/generate.py).
_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jitted(model, fn, **static):
    per_model = _JITTED.setdefault(model, {})
    key = (fn, tuple(sorted(static.items())))
    if key not in per_model:
        per_model[key] = jax.jit(functools.partial(fn, nnx.graphdef(model), **static))
    return lambda *args: per_model[key](nnx.state(model), *args)


def _forward_fn(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens, _eval_ctx(*tokens.shape))


def _forward(model, tokens):
    """Eval-mode logits ``[B, T, vocab]``."""
    return _jitted(model, _forward_fn)(tokens)


def _decode_logits_fn(graphdef, state, tokens, *, prompt):
    m = nnx.merge(graphdef, state)
    logits, cache = m.prefill(tokens[:, :prompt], max_len=tokens.shape[1])

    def body(cache, token):
        out, cache = m.decode_step(token, cache)
        return cache, out
    _, rest = jax.lax.scan(body, cache, tokens[:, prompt:].T)
    return jnp.concatenate([logits, rest.transpose(1, 0, 2)], 1)


def _decode_logits(model, tokens, prompt):
    """Prefill logits of ``tokens[:, :prompt]``, then one decode step per remaining token (teacher
    forcing): ``[B, T, vocab]``, with ``max_len = T``."""
    return _jitted(model, _decode_logits_fn, prompt=prompt)(tokens)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _mixer_decode_jit(graphdef, state, x, prompt, ctx_seed):
    m = nnx.merge(graphdef, state)
    B, n = x.shape[:2]
    y, st = m.prefill(x[:, :prompt], _eval_ctx(B, prompt, ctx_seed), max_len=n)

    def body(st, x_t):
        y_t, st = m.step(x_t, st)
        return st, y_t
    st, rest = jax.lax.scan(body, st, x[:, prompt:].transpose(1, 0, 2))
    return jnp.concatenate([y, rest.transpose(1, 0, 2)], 1), st


@functools.partial(jax.jit, static_argnums=0)
def _mixer_forward_jit(graphdef, state, x):
    return nnx.merge(graphdef, state)(x, _eval_ctx(*x.shape[:2]))


def _mixer_decode(m, x, prompt, ctx_seed=0):
    """A mixer's prefill of ``x[:, :prompt]`` then steps over the rest of ``x [B, n, d]`` (max_len n):
    ``(y [B, n, d], final state)``."""
    return _mixer_decode_jit(*nnx.split(m), x, prompt, ctx_seed)


# ----------------------------------------------------------------------------- (a) the law of the keys

L_LAW, W_LAW, PROMPT_LAW, ROWS = 7, 3, 2, 3000


def _exact_count_pmf(t, w, wr):
    """pmf ``[t, t+1]`` of the visible keys (the query included) per position, over ALL t! permutations."""
    perms = np.array(list(itertools.permutations(range(t))), dtype=np.int8)  # slot -> position
    inv = np.argsort(perms, axis=1)  # position -> slot
    si, sj = inv[:, :, None], inv[:, None, :]
    idx = np.arange(t)
    counts = ((sj <= si + wr) & (sj > si - w) & (idx[None, None, :] <= idx[None, :, None])).sum(2)  # [t!, t]
    return np.stack([np.bincount(counts[:, p], minlength=t + 1) / len(perms) for p in range(t)])


def _pmf(counts, t):
    return np.stack([np.bincount(counts[:, p], minlength=t + 1) / len(counts) for p in range(t)])


def _probe(window, **options):
    """An ``sa`` layer whose output reads out its mask: q = 0 (uniform attention over the visible keys),
    v_j = e_j for the input e_j at position j, identity output projection. So ``y[t, j] > 0`` iff
    position t sees position j, whatever path (forward, prefill or step) computed it."""
    m = _random(lambda: StochasticAttention(ModelConfig(d_model=D, n_heads=1, n_kv_heads=1, head_dim=8, n_layers=2,
                                                        compute_dtype="float32"),
                                            MixerConfig(kind="sa", window=window, options=options), 0,
                                            rngs=nnx.Rngs(0)))
    eye = jnp.eye(D, 8)  # v_j = e_j (head_dim 8 >= L: RoPE needs it even)
    m.wq[...] = jnp.zeros_like(m.wq[...])
    m.wv[...] = eye[:, None, :]
    m.wo[...] = eye.T[None]
    return m


def _decode_masks(m, rows):
    """Visible-key masks ``[rows, L, L]`` of prefill (positions < PROMPT_LAW) and steps (the rest)."""
    y, _ = _mixer_decode(m, jnp.broadcast_to(jnp.eye(L_LAW, D), (rows, L_LAW, D)), PROMPT_LAW)
    return np.asarray(y[..., :L_LAW]) > 1e-6


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _training_masks(window, window_right, rows, step=7):
    """Training-mode masks ``[rows, L, L]`` in original order: the forward's own permutations
    (``sa_permutations``, train=True) and attention call (``attend(..., permuted=True)``) on
    one-hot values with q = k = 0 (uniform weights over the visible keys)."""
    opts = SAOptions(window_mode="symmetric" if window_right else "causal")
    ctx = MixerContext(positions=_pos(rows, L_LAW), attention_impl="xla", step=step,
                       example_ids=jnp.arange(rows, dtype=jnp.int32), train=True)
    ((perm, inv),) = sa_permutations(opts, ctx, 0, rows, L_LAW)
    onehot = jnp.broadcast_to(jnp.eye(L_LAW), (rows, L_LAW, L_LAW))[:, :, None, :]
    zeros = jnp.zeros_like(onehot)
    o = attend(zeros, zeros, P.permute(onehot, perm, inv), window=window, positions=permute_positions(ctx.positions, perm),
               impl="xla", permuted=True, window_right=window_right)
    return P.unpermute(o, perm, inv)[:, :, 0] > 1e-6


@pytest.mark.parametrize("mode", ["causal", "symmetric"])
def test_decoded_keys_have_the_training_masks_law_per_position(mode):
    """The acceptance test: per position, the number of keys a decoded token sees (prefill for the
    prompt, steps after it; ROWS independent draws) has the law of the training mask's count (mean,
    spread, whole pmf), which is exactly ``sa_mean_visible_keys`` in mean; and given the count, every
    earlier key is equally likely."""
    wr = sa_window_right(W_LAW, mode)
    exact = _exact_count_pmf(L_LAW, W_LAW, wr)  # [L, L+1]
    k = np.arange(L_LAW + 1)
    mean = exact @ k
    std = np.sqrt(exact @ k**2 - mean**2)
    np.testing.assert_allclose(mean, [sa_mean_visible_keys(L_LAW, W_LAW, p, wr) for p in range(L_LAW)], rtol=1e-12)

    dec = _decode_masks(_probe(W_LAW, window_mode=mode), ROWS)
    assert dec[:, np.arange(L_LAW), np.arange(L_LAW)].all() and not np.triu(dec, 1).any()  # itself; causal
    # the training masks themselves (one mode suffices: their law is the enumeration's, by construction)
    train = [np.asarray(_training_masks(W_LAW, wr, ROWS))] if mode == "causal" else []
    for masks in [dec] + train:
        counts = masks.sum(2)  # [rows, L]
        np.testing.assert_allclose(counts.mean(0), mean, atol=5 * std.max() / np.sqrt(ROWS) + 1e-9)
        np.testing.assert_allclose(counts.std(0), std, atol=0.06)
        tv = 0.5 * np.abs(_pmf(counts, L_LAW) - exact).sum(1)
        assert tv.max() < 0.04, tv
        rows, cols = np.tril_indices(L_LAW, -1)  # each earlier key j < t: seen at rate (E[count] - 1) / t
        np.testing.assert_allclose(masks.mean(0)[rows, cols], (mean[rows] - 1) / rows, atol=0.05)
    # power: independent inclusion with the same mean (a binomial count) is far from this law late on
    p = L_LAW - 1
    q = (mean[p] - 1) / p
    binom = np.array([math.comb(p, i) * q**i * (1 - q)**(p - i) for i in range(p + 1)])
    assert 0.5 * np.abs(np.concatenate([[0], binom]) - exact[p]).sum() > 0.15


# ----------------------------------------------------------------------------- consistency with the forward

@pytest.mark.parametrize("efficient", [
    MixerConfig(kind="sa", window=3),
    MixerConfig(kind="sa_swa", window=3, options={"shared_qkv": False, "gate": "channel", "eval_draws": 2,
                                                   "window_mode": "symmetric"}),
], ids=["sa", "sa_swa-separate-channel-2draws-symmetric"])
def test_decode_is_the_eval_forward_of_the_whole_sequence_and_generation_is_deterministic(efficient):
    """Prefill + steps give the eval forward's logits of the whole max_len sequence (the same
    permutations), deterministically; generate() repeats itself and each token is the argmax of that
    forward (generate() for sa_swa only: the same prefill + steps, a second compile)."""
    model = _model(efficient)
    for i, block in enumerate(model.blocks):
        block.check_decode(i)  # no NotImplementedError
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, VOCAB)
    got = _decode_logits(model, tokens, 4)
    np.testing.assert_allclose(got, _forward(model, tokens), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got, _decode_logits(model, tokens, 4))
    if efficient.kind == "sa_swa":
        out = generate(model, tokens[:, :4], 6)
        np.testing.assert_array_equal(out, generate(model, tokens[:, :4], 6))
        seq = jnp.concatenate([tokens[:, :4], out], 1)  # teacher-forcing the generated sequence: the same tokens
        np.testing.assert_array_equal(jnp.argmax(_forward(model, seq), -1)[:, 3:9], out)


def test_window_covering_everything_is_full_causal_attention_decode():
    """symmetric, w >= max_len: every earlier key is in the band, so each step is full attention's."""
    sa = _model(MixerConfig(kind="sa", window=16, options={"window_mode": "symmetric"}))
    full = _model(MixerConfig(kind="attention"), seed=2)
    nnx.update(full, nnx.state(sa))  # the same parameter tree (wq, wk, wv, wo)
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, VOCAB)
    # (full attention's own decode equals its forward: tests/test_generate.py)
    np.testing.assert_allclose(_decode_logits(sa, tokens, 3), _forward(full, tokens), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- decode='swa'

def test_decode_swa_is_sa_on_the_prompt_then_an_swa_layers_decode():
    w, T0, n = 3, 5, 9
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, n, D)), jnp.float32)
    swa = _mixer(SlidingWindowAttention, w)
    sa = _mixer(StochasticAttention, w, decode="swa")  # the same seed: the same weights as swa
    y, s_sa = _mixer_decode(sa, x, T0)
    y_swa, s_swa = _mixer_decode(swa, x, T0)
    prompt = _mixer_forward_jit(*nnx.split(sa), x[:, :T0])
    np.testing.assert_allclose(y[:, :T0], prompt, rtol=1e-5, atol=1e-6)  # SA's eval forward on the prompt
    assert not np.allclose(y[:, :T0], y_swa[:, :T0], atol=1e-3)  # (which is not SWA's)
    np.testing.assert_allclose(y[:, T0:], y_swa[:, T0:], rtol=1e-5, atol=1e-6)  # then SWA's steps
    assert set(s_sa) == set(s_swa) and s_sa["k"].shape[1] == w  # the same ring buffer of w slots
    np.testing.assert_array_equal(s_sa["slot_pos"], s_swa["slot_pos"])

    # gated, shared projections: Wo[(g_sa + g_swa) * SWA's heads]
    sg = _mixer(GatedSASWA, w, decode="swa")
    for name in ("wq", "wk", "wv", "wo"):
        getattr(swa, name)[...] = getattr(sg, name)[...]
    y_g, _ = _mixer_decode(sg, x, T0)
    _, s_w = _mixer_decode(swa, x, T0)  # its cache after the last token, which the last step read
    t, x1 = n - 1, x[:, n - 1:]
    heads = swa.read(swa.project_qkv(x1, jnp.full((2, 1), t))[0], dict(s_w, pos=jnp.int32(t)))
    manual = sg.project_out((sg.gate(x1, sg.w_gate_sa) + sg.gate(x1, sg.w_gate_swa)) * heads)[:, 0]
    np.testing.assert_allclose(y_g[:, t], manual, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- determinism per row

def test_the_draw_is_a_function_of_seed_layer_and_row_only():
    w, T0, n = 3, 4, 9
    x = jnp.asarray(np.random.default_rng(7).standard_normal((3, n, D)), jnp.float32)
    m = _mixer(StochasticAttention, w, layer=1)
    y3, s3 = _mixer_decode(m, x, T0)
    y1, s1 = _mixer_decode(m, x[:1], T0)
    np.testing.assert_array_equal(s1["inv"][:, 0], s3["inv"][:, 0])  # row 0's permutation: batch-size free
    np.testing.assert_allclose(y1[0], y3[0], rtol=1e-6, atol=1e-6)
    assert not np.array_equal(s3["inv"][0, 0], s3["inv"][0, 1])  # rows draw apart
    y_other, _ = _mixer_decode(m, x.at[1:].set(-x[1:]), T0)  # other rows' content never matters
    np.testing.assert_allclose(y_other[0], y3[0], rtol=1e-6, atol=1e-6)

    def inv_of(layer=1, seed=0, **opts):  # the draw of row 0, as the prefill makes it
        ctx = dataclasses.replace(_eval_ctx(1, n, seed), example_ids=jnp.zeros(1, jnp.int32))
        return np.asarray(P.invert(sa_permutations(SAOptions(**opts), ctx, layer, 1, n)[0][0]))

    np.testing.assert_array_equal(inv_of(), s1["inv"][0])  # the same (seed, layer, row): the same draw
    assert not np.array_equal(inv_of(layer=2), inv_of())
    assert not np.array_equal(inv_of(seed=1), inv_of())
    np.testing.assert_array_equal(inv_of(seed=1), inv_of(eval_seed=1))  # eval_seed replaces the run's seed


# ----------------------------------------------------------------------------- options and run ids

def test_decode_option_parses_through_swaps_and_keeps_run_ids(tiny_params):
    spec = get_mixer("sa")
    with pytest.raises(ConfigError, match="decode='greedy'"):
        spec.check_config(MixerConfig(kind="sa", window=8, options={"decode": "greedy"}), "efficient")
    cfg = load_config(["quickstart.gin", "arch/sa.gin"])
    swapped = apply_swaps(cfg.model, ["efficient=sa:16,decode=swa"])
    assert swapped.efficient.options == {"decode": "swa"} and swapped.efficient.window == 16
    assert apply_swaps(cfg.model, ["efficient=sa_swa:8,decode=swa"]).efficient.kind == "sa_swa"
    with pytest.raises(ConfigError, match="decode="):
        apply_swaps(cfg.model, ["efficient=sa:16,decode=sample"])
    assert {f.name: f.default for f in dataclasses.fields(spec.options)}["decode"] == "permutation"
    # run ids come from the config dicts: a new option with its default changes none of them
    # (computed by the code before the option existed)
    for files, expected_id in [(["quickstart.gin", "arch/sa.gin"], "fc86b6ba4c3a"),
                          (["quickstart.gin", "arch/sa_swa.gin"], "753d3a18b3d6"),
                          (["scale/s1.gin", "arch/sa.gin"], "ad11c89e462b"),
                          (["scale/s1.gin", "arch/sa_swa.gin"], "788f8714078b")]:
        assert run_id(load_config(files)) == expected_id, files
    eval_draws = load_config(["quickstart.gin", "arch/sa_swa.gin"], ["efficient/MixerConfig.options = {'eval_draws': 2}"])
    assert run_id(eval_draws) == "2ae60b66ced9"
