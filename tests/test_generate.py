"""Decode path: prefill + one token at a time equals the forward pass (eval mode), for every mixer
with a decode state (full attention, SWA with a ring buffer shorter than the sequence, MoBA with
both selections, SSA's full or sparse eval stream, lightning, mamba2, gdn), and generate() on top."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.eval.generate import generate
from hybrid_lm.model.transformer import HybridLM

T, PROMPT, VOCAB = 13, 5, 97
FULL = MixerConfig(kind="attention")
EFFICIENT = {
    "swa": MixerConfig(kind="swa", window=4),  # ring buffer of 4 < T: wraps several times
    # MoBA: blocks of 3 (T = 13 ends mid-block), both selections and gates
    "moba": MixerConfig(kind="moba", options={"block_size": 3, "top_k": 2, "gate": "moba"}),
    "moba_ssa_gate_block": MixerConfig(kind="moba", options={"block_size": 3, "top_k": 2, "gate": "ssa",
                                                             "selection": "block"}),
    "lightning": MixerConfig(kind="lightning", options={"chunk_size": 4}),
    "mamba2": MixerConfig(kind="mamba2", options={"chunk_size": 4, "d_state": 8, "head_dim": 16, "n_groups": 2}),
    "gdn": MixerConfig(kind="gdn", options={"chunk_size": 4}),
}


SSA = {  # SSA in the full slot, decoding its eval stream
    "ssa_full_stream": MixerConfig(kind="ssa", options={"block_size": 3, "top_k": 2}),
    "ssa_sparse_stream": MixerConfig(kind="ssa", options={"block_size": 3, "top_k": 2, "eval_stream": "sparse"}),
    "ssa_sparse_block": MixerConfig(kind="ssa", options={"block_size": 3, "top_k": 2, "eval_stream": "sparse",
                                                          "selection": "block", "gate": "moba"}),
}


def _model(kind: str, seed: int = 0, **kw) -> HybridLM:
    slots = dict(full=SSA[kind], efficient=EFFICIENT["swa"]) if kind in SSA else dict(efficient=EFFICIENT[kind])
    slots.update(kw)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=64, compute_dtype="float32", **slots)
    model = HybridLM(cfg, rngs=nnx.Rngs(seed))
    # larger than init weights, so that attention is far from uniform and errors would show
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _eval_ctx(tokens):
    from hybrid_lm.model.registry import MixerContext
    B, n = tokens.shape
    return MixerContext(positions=jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n)), train=False)


def _tokens(seed: int, B: int = 2, n: int = T):
    return jax.random.randint(jax.random.key(seed), (B, n), 0, VOCAB)


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SCALINGS = {"llama3": LLAMA3, "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("kind,rope_full", [(k, True) for k in sorted(EFFICIENT)] + [("swa", False)]  # NoPE full layers
                         + [("swa", "llama3"), ("swa", "yarn")]  # Llama 3.1's, YaRN's RoPE scaling on the full layers
                         + [(k, True) for k in sorted(SSA)])  # SSA sits in the full slot
@pytest.mark.integration
def test_prefill_then_steps_equal_the_forward_pass(kind, rope_full):
    if kind in SSA:
        model = _model(kind)
    else:  # NoPE or scaled RoPE on the full layers too
        model = _model(kind, full=MixerConfig(kind="attention", rope=rope_full is not False,
                                              rope_scaling=SCALINGS.get(rope_full, {})))
    tokens = _tokens(3)
    want = jax.jit(lambda tok: model(tok, _eval_ctx(tok)))(tokens)
    logits, cache = jax.jit(lambda tok: model.prefill(tok, max_len=T))(tokens[:, :PROMPT])
    np.testing.assert_allclose(logits, want[:, :PROMPT], rtol=1e-4, atol=1e-4)
    step = jax.jit(lambda tok, cache: model.decode_step(tok, cache))
    for t in range(PROMPT, T):
        got, cache = step(tokens[:, t], cache)
        np.testing.assert_allclose(got, want[:, t], rtol=1e-4, atol=1e-4, err_msg=f"position {t}")


@pytest.mark.integration
def test_generate_greedy_equals_argmax_of_the_forward_pass():
    model = _model("swa")
    prompt = _tokens(5, n=PROMPT)
    got = generate(model, prompt, 6)
    seq = prompt
    for _ in range(6):  # the slow way: a full forward pass per new token
        seq = jnp.concatenate([seq, jnp.argmax(model(seq)[:, -1], -1)[:, None].astype(seq.dtype)], 1)
    np.testing.assert_array_equal(got, seq[:, PROMPT:])
    assert got.dtype == jnp.int32 and got.shape == (2, 6)


@pytest.mark.integration
def test_sampling():
    model = _model("gdn")
    prompt = _tokens(6, n=PROMPT)
    a = generate(model, prompt, 5, temperature=1.0, key=jax.random.key(1))
    b = generate(model, prompt, 5, temperature=1.0, key=jax.random.key(1))
    c = generate(model, prompt, 5, temperature=1.0, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)  # same key, same tokens
    assert not np.array_equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < VOCAB
    # top_k = 1 keeps only the argmax: sampling is then greedy
    np.testing.assert_array_equal(generate(model, prompt, 5, temperature=1.0, top_k=1, key=jax.random.key(3)),
                                  generate(model, prompt, 5))


@pytest.mark.integration
def test_ids_beyond_the_tokenizer_vocabulary_are_never_picked():
    """A model vocabulary padded beyond the tokenizer's (here 97 > 40): generation keeps to the ids
    the tokenizer can decode, greedy and sampled."""
    model = _model("swa")
    prompt = _tokens(8, n=PROMPT) % 40
    for kw in ({}, {"temperature": 2.0, "key": jax.random.key(4)}):
        free = generate(model, prompt, 12, **kw)
        limited = generate(model, prompt, 12, vocab_limit=40, **kw)
        assert int(limited.max()) < 40
    assert int(free.max()) >= 40  # the limit mattered: unrestricted sampling picks ids past 40


@pytest.mark.integration
def test_bad_requests_say_what_is_wrong():
    model = _model("swa")
    prompt = _tokens(7, n=PROMPT)
    with pytest.raises(ValueError, match="exceeds max_len"):
        generate(model, prompt, 4, max_len=8)
    with pytest.raises(ValueError, match="PRNG key"):
        generate(model, prompt, 2, temperature=0.5)
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        generate(model, prompt.at[0, 0].set(VOCAB), 2)
    with pytest.raises(ValueError, match="T0 >= 1"):
        generate(model, prompt[:, :0], 2)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      compute_dtype="float32", efficient=EFFICIENT["swa"],
                      full=MixerConfig(kind="attention_sink", options={"horizon": 4, "sinks": 1}))
    with pytest.raises(NotImplementedError, match="layer 0: mixer 'attention_sink' has no decode path"):
        generate(HybridLM(cfg, rngs=nnx.Rngs(0)), prompt, 2)


@pytest.mark.integration
def test_generate_help_names_the_mixers_with_a_decode_path(capsys):
    """`hybrid-lm generate --help` lists every registered mixer on the side of its decode path."""
    import re

    from hybrid_lm.cli import main
    from hybrid_lm.model.registry import registered_mixers

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    decodes, refused = text.split("decode one token at a time")[1].split("have no decode path")[0].rsplit(".", 1)
    for kind, spec in registered_mixers().items():
        has = callable(getattr(spec.cls, "prefill", None)) and callable(getattr(spec.cls, "step", None))
        word = rf"\b{kind}\b"
        assert bool(re.search(word, decodes)) == has and bool(re.search(word, refused)) != has, kind
