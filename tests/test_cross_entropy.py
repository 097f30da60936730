"""Chunked cross-entropy equals the whole-logits reference (loss and gradients) and never holds whole logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.ops.cross_entropy import (chunked_cross_entropy, chunked_token_cross_entropy, cross_entropy, head_logits,
                                         logits_bytes, token_cross_entropy)


def _inputs(N, d, V, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (N, d), jnp.float32).astype(dtype)
    w = 0.2 * jax.random.normal(k[1], (d, V), jnp.float32)
    t = jax.random.randint(k[2], (N,), 0, V)
    return h, w, t


@pytest.mark.parametrize("N,d,V,chunk,z", [
    (256, 32, 512, 64, 0.0),     # chunks divide N
    (300, 16, 1000, 128, 1e-3),  # padded last chunk, z-loss
    (64, 8, 77, 1000, 0.0),      # one chunk larger than N
    (129, 24, 256, 1, 1e-2),     # one token per chunk
])
@pytest.mark.integration
def test_chunked_matches_reference_fp32(N, d, V, chunk, z):
    h, w, t = _inputs(N, d, V, jnp.float32, seed=N)

    def ref(h, w):
        return cross_entropy(head_logits(h, w), t, z)

    def chk(h, w):
        return chunked_cross_entropy(h, w, t, z, chunk=chunk)

    (lr, cr), (lc, cc) = ref(h, w), chk(h, w)
    np.testing.assert_allclose(float(lc), float(lr), rtol=1e-6)
    np.testing.assert_allclose(float(cc), float(cr), rtol=1e-6)
    gr = jax.grad(lambda h, w: ref(h, w)[0], argnums=(0, 1))(h, w)
    gc = jax.grad(lambda h, w: chk(h, w)[0], argnums=(0, 1))(h, w)
    for a, b in zip(gr, gc):
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.integration
def test_chunked_matches_reference_bf16():
    h, w, t = _inputs(512, 64, 1024, jnp.bfloat16, seed=3)
    lr = cross_entropy(head_logits(h, w), t)[0]
    lc = chunked_cross_entropy(h, w, t, chunk=128)[0]
    # same bf16 matmul per row, fp32 reductions in another order
    np.testing.assert_allclose(float(lc), float(lr), rtol=1e-5)
    gr = jax.grad(lambda w: cross_entropy(head_logits(h, w), t)[0])(w)
    gc = jax.grad(lambda w: chunked_cross_entropy(h, w, t, chunk=128)[0])(w)
    rel = float(jnp.linalg.norm(gc - gr) / jnp.linalg.norm(gr))
    assert rel < 1e-2, rel


@pytest.mark.parametrize("N,d,V,chunk", [(256, 32, 512, 64), (300, 16, 1000, 128), (64, 8, 77, 1000), (37, 8, 50, 1)])
def test_token_cross_entropy_matches_float64_and_the_mean(N, d, V, chunk):
    """Per-token CE (the eval's per-window losses): against a float64 numpy log-softmax, chunked equal to
    whole logits, and its mean equal to cross_entropy's ce."""
    h, w, t = _inputs(N, d, V, jnp.float32, seed=N + V)
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    m = logits.max(-1, keepdims=True)
    ref = (np.log(np.exp(logits - m).sum(-1)) + m[:, 0]) - logits[np.arange(N), np.asarray(t)]
    whole = np.asarray(token_cross_entropy(head_logits(h, w), t))
    chunked = np.asarray(jax.jit(lambda h: chunked_token_cross_entropy(h, w, t, chunk))(h))
    assert whole.shape == chunked.shape == (N,)
    np.testing.assert_allclose(whole, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(chunked.mean(), float(cross_entropy(head_logits(h, w), t)[1]), rtol=1e-6)


def test_chunked_token_cross_entropy_never_holds_whole_logits():
    N, d, V, chunk = 8192, 32, 4096, 256
    h, w, t = _inputs(N, d, V, jnp.float32)
    temp = jax.jit(lambda h: chunked_token_cross_entropy(h, w, t, chunk)).lower(h).compile()
    assert temp.memory_analysis().temp_size_in_bytes < 4 * logits_bytes(chunk, V) + 8 * N


def test_chunked_never_materialises_whole_logits():
    N, d, V, chunk = 8192, 32, 4096, 256
    h, w, t = _inputs(N, d, V, jnp.float32)
    grad_of = lambda f: jax.jit(jax.grad(f, argnums=(0, 1)))  # noqa: E731
    ref = grad_of(lambda h, w: cross_entropy(head_logits(h, w), t)[0])
    chk = grad_of(lambda h, w: chunked_cross_entropy(h, w, t, chunk=chunk)[0])
    whole = logits_bytes(N, V)
    temp_ref = ref.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    temp_chk = chk.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    assert temp_ref >= whole  # the reference holds the whole logits (and their gradient)
    # a few chunks of logits plus the fp32 head-gradient accumulator, far below the whole logits
    assert temp_chk < 4 * logits_bytes(chunk, V) + 4 * d * V * 4, (temp_chk, whole)
    assert temp_chk < whole / 8


@pytest.mark.integration
def test_train_loss_chunked_equals_full():
    """The train step's loss and gradients with loss_impl='chunked' equal loss_impl='full' (tiny model,
    z-loss on), and auto picks by the size of the whole logits."""
    from hybrid_lm.backends import CHUNKED_LOSS_MIN_BYTES, loss_backend
    from hybrid_lm.experiment import load_config
    from hybrid_lm.step import ModelFns

    assert loss_backend("auto", 4096, 256)[0] == "full"  # the quickstart: 4 MiB of logits
    assert loss_backend("auto", 131072, 73448)[0] == "chunked"  # 8 x 16K tokens at the presets' vocab
    at = -(-CHUNKED_LOSS_MIN_BYTES // 4000)  # tokens whose logits at vocab 1000 reach the threshold
    assert loss_backend("auto", at, 1000)[0] == "chunked" and loss_backend("auto", at - 1, 1000)[0] == "full"
    base = ["ModelConfig.vocab_size = 300", "ModelConfig.d_model = 32", "ModelConfig.n_heads = 2",
            "ModelConfig.n_kv_heads = 1", "ModelConfig.d_ff = 64", "ModelConfig.n_layers = 2",
            "ModelConfig.compute_dtype = 'float32'", "DataConfig.seq_len = 48", "OptimConfig.z_loss = 1e-3",
            "efficient/MixerConfig.window = 16"]
    out = {}
    for impl, tie in (("full", False), ("chunked", False), ("full", True), ("chunked", True)):
        cfg = load_config([], base + [f"ModelConfig.loss_impl = '{impl}'", "ModelConfig.loss_chunk = 40",
                                      f"ModelConfig.tie_embeddings = {tie}"])
        fns = ModelFns(cfg)
        params = fns.init(0)
        tokens = jax.random.randint(jax.random.key(1), (3, 49), 0, 300)
        (obj, aux), g = jax.value_and_grad(
            lambda p: fns.loss(p, tokens, jnp.int32(0), jnp.arange(3)), has_aux=True)(params)
        out[impl, tie] = (obj, aux["ce"], g)
    for tie in (False, True):
        (o1, c1, g1), (o2, c2, g2) = out["full", tie], out["chunked", tie]
        np.testing.assert_allclose(float(o2), float(o1), rtol=1e-6)
        np.testing.assert_allclose(float(c2), float(c1), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(a))))
