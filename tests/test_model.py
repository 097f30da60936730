import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.experiment import load_config
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.model.attention import mean_keys_per_query
from hybrid_lm.model.transformer import HybridLM

PAPER_NON_EMBEDDING = {1: 14_999_424, 2: 31_470_080, 3: 64_901_760, 4: 104_427_264, 5: 476_852_480}


@pytest.mark.parametrize("scale", [1, 2, 3, 4, 5])
def test_scale_presets_match_released_non_embedding_counts(scale):
    cfg = load_config([f"scale/s{scale}.gin"])
    counts = count_params(cfg.model)
    assert counts["non_embedding"] == PAPER_NON_EMBEDDING[scale]
    assert counts["total"] == counts["non_embedding"] + 2 * 73448 * cfg.model.d_model  # untied


@pytest.mark.parametrize("pattern,n_layers,expected", [
    ("1:1", 4, ["attention", "swa", "attention", "swa"]),
    ("FEEE", 4, ["attention", "swa", "swa", "swa"]),
    ("1:3", 8, ["attention", "swa", "swa", "swa"] * 2),
    ("EF", 2, ["swa", "attention"]),
])
def test_layer_pattern_builds_the_right_layers(pattern, n_layers, expected, tiny_params):
    cfg = load_config([], tiny_params + [f"ModelConfig.layer_pattern = '{pattern}'", f"ModelConfig.n_layers = {n_layers}"])
    model = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
    assert [b.mixer_kind for b in model.blocks] == expected
    assert [type(b.mixer).__name__ for b in model.blocks] == [
        {"attention": "FullAttention", "swa": "SlidingWindowAttention"}[k] for k in expected]
    windows = [b.mixer.window for b in model.blocks]
    assert windows == [None if k == "attention" else 8 for k in expected]


def test_every_parameter_has_logical_axes(tiny_params):
    cfg = load_config([], tiny_params + ["ModelConfig.tie_embeddings = False"])
    model = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            axes = var.get_metadata().get("logical_axes")
            assert axes is not None and len(axes) == var.get_value().ndim, path


@pytest.mark.integration
def test_nope_full_layers_ignore_absolute_position(tiny_params):
    """NoPE on full layers: a full-attention-only NoPE model's output does not depend on position offsets;
    with RoPE it does not either (relative), but NoPE also ignores the *order-free* positions entirely."""
    from hybrid_lm.model.registry import MixerContext
    cfg = load_config([], tiny_params + ["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.rope = False"])
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    a = model(toks, MixerContext(positions=pos))
    b = model(toks, MixerContext(positions=pos * 7 + 3))  # positions unused by NoPE
    np.testing.assert_allclose(a, b, rtol=1e-6)
    cfg_r = load_config([], tiny_params + ["ModelConfig.layer_pattern = 'F'"])
    model_r = HybridLM(cfg_r.model, rngs=nnx.Rngs(0))
    assert not np.allclose(model_r(toks, MixerContext(positions=pos)), model_r(toks, MixerContext(positions=pos * 7)))


def test_attention_flops_terms_are_exact():
    assert mean_keys_per_query(8, None) == 4.5
    assert mean_keys_per_query(8, 3) == pytest.approx((1 + 2 + 3 * 6) / 8)
    assert mean_keys_per_query(8, 100) == 4.5
    cfg = load_config(["scale/s1.gin"])
    f = flops_per_token(cfg.model, 16384)
    full, swa = f["per_layer_type"]["F:attention"], f["per_layer_type"]["E:swa"]
    assert full["mixing"] == 4 * 3 * 128 * (16384 + 1) / 2
    assert swa["mixing"] == pytest.approx(4 * 3 * 128 * (128 * 129 / 2 + (16384 - 128) * 128) / 16384)
    assert full["mixer_matmul"] == swa["mixer_matmul"] == 2 * 393216
    assert f["train"] == 3 * f["forward"]


@pytest.mark.integration
def test_causality_future_tokens_do_not_change_past_logits(tiny_params):
    cfg = load_config([], tiny_params)
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(1), (1, 24), 0, 256)
    toks2 = toks.at[:, 15:].set((toks[:, 15:] + 1) % 256)
    np.testing.assert_allclose(model(toks)[:, :15], model(toks2)[:, :15], rtol=1e-5, atol=1e-5)
    assert not np.allclose(model(toks)[:, 15:], model(toks2)[:, 15:])


EVERY_EFFICIENT_MIXER = {  # tiny options; the full slot stays full attention
    "swa": (8, {}),
    "sa": (8, {}),
    "sa_symmetric": (8, {"window_mode": "symmetric"}),
    "sa_swa": (8, {}),
    "moba": (None, {"block_size": 4, "top_k": 2}),
    "moba_block": (None, {"block_size": 4, "top_k": 2, "selection": "block", "gate": "moba"}),
    "ssa": (None, {"block_size": 4, "top_k": 2, "eval_stream": "sparse"}),
    "ssa_block": (None, {"block_size": 4, "top_k": 2, "selection": "block", "eval_stream": "sparse"}),
    "attention_sink": (None, {"horizon": 6, "sinks": 2}),
    "lightning": (None, {"chunk_size": 8}),
    "mamba2": (None, {"chunk_size": 8, "d_state": 8, "head_dim": 16}),
    "gdn": (None, {"chunk_size": 8}),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(EVERY_EFFICIENT_MIXER))
@pytest.mark.parametrize("train", [True, False])
def test_every_mixer_is_causal(name, train):
    """Tokens after position t change no logit at positions <= t, for every mixer in the efficient
    slot, in training mode (SA permutations, SSA's sparse stream) and in eval mode."""
    from hybrid_lm.config import MixerConfig, ModelConfig
    from hybrid_lm.model.registry import MixerContext
    window, opts = EVERY_EFFICIENT_MIXER[name]
    kind = {"sa_symmetric": "sa", "moba_block": "moba", "ssa_block": "ssa"}.get(name, name)
    if kind == "ssa":  # the mixer holds both streams; it sits in the full slot
        full, eff = MixerConfig(kind="ssa", options=opts), MixerConfig(kind="swa", window=8)
    else:
        full, eff = MixerConfig(kind="attention"), MixerConfig(kind=kind, window=window, options=opts)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      compute_dtype="float32", full=full, efficient=eff)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    T, t = 24, 13
    toks = jax.random.randint(jax.random.key(1), (2, T), 0, 64)
    toks2 = toks.at[:, t + 1:].set((toks[:, t + 1:] + 7) % 64)
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)), train=train,
                       step=jnp.int32(3), seed=5, example_ids=jnp.arange(2, dtype=jnp.int32))  # SSA coin: sparse
    run = nnx.capture(model, nnx.Intermediate)  # as the trainer calls it (SSA sows its aux loss)
    a, b = run(toks, ctx)[0], run(toks2, ctx)[0]
    np.testing.assert_allclose(a[:, :t + 1], b[:, :t + 1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, t + 1:], b[:, t + 1:])
