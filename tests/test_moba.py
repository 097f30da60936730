"""MoBA block-sparse attention: reference op vs a dense masked oracle, both gates, gradients, mixer, training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import flops_per_token
from hybrid_lm.model.attention import FullAttention
from hybrid_lm.model.moba import MobaAttention, moba_gate_dots, moba_mean_keys
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops import block_sparse as bs
from hybrid_lm.ops.attention import dense_attention
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics


def _qkv(seed, b, t, h, kv, d):
    rng = np.random.default_rng(seed)
    # a shared offset in k makes block means informative (raw MoBA gates are otherwise near-random)
    q, k, v, off = (rng.standard_normal(s, np.float32) for s in ((b, t, h, d), (b, t, kv, d), (b, t, kv, d), (kv, d)))
    return jnp.asarray(q), jnp.asarray(k + off), jnp.asarray(v)


def _oracle_selection(q, k, block, top_k, gate):
    """Selected blocks as a dense bool [B, T, Hs, nb], straight from the two papers' definitions (float64)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    nb = -(-T // block)
    kbar = np.stack([k[:, c * block:(c + 1) * block].mean(1) for c in range(nb)], 1)  # [B, nb, K, D]
    s = np.einsum("bthd,bchd->bthc", q, np.repeat(kbar, G, axis=2))  # per query head
    Hs = H if gate == "moba" else K
    sel = np.zeros((B, T, Hs, nb), bool)
    for t in range(T):
        cur = t // block
        past = np.arange(cur)
        if gate == "moba":
            imp = s[:, t, :, :cur]  # raw q . mean(k), per query head
        else:
            complete = (t + 1) // block  # NSA normalises over the complete blocks only
            z = s[:, t] / np.sqrt(D)
            lse = np.log(np.exp(z[..., :complete]).sum(-1, keepdims=True)) if complete else 0.0
            imp = np.exp(z[..., :cur] - lse).reshape(B, K, G, cur).sum(2)  # summed over the GQA group
        sel[:, t, :, cur] = True
        if cur and top_k > 1:
            best = np.argsort(-imp, axis=-1)[..., :top_k - 1]
            np.put_along_axis(sel[:, t], past[best], True, axis=-1)
    return sel


def _oracle_mask(sel, block, n_heads):
    """Token mask [B, H, Tq, Tk]: key j in a selected block of query t, and j <= t."""
    B, T, Hs, nb = sel.shape
    tok = np.repeat(sel, block, axis=-1)[..., :T]  # [B, Tq, Hs, Tk]
    tok &= np.tril(np.ones((T, T), bool))[None, :, None, :]
    return np.repeat(tok.transpose(0, 2, 1, 3), n_heads // Hs, axis=1)


def _dense_masked(q, k, v, mask):
    B, T, H, D = q.shape
    kr, vr = (jnp.repeat(x, H // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr)


def _vjp(f, *args):
    """f(q, k, v) and the gradients of <f, cot> w.r.t. q, k, v; ``args = (q, k, v, [mask,] cot)``."""
    *inputs, cot = args
    o, vjp = jax.vjp(f, *inputs)
    return o, vjp(cot)[:3]


@jax.jit
def _oracle_vjp(q, k, v, mask, cot):
    return _vjp(_dense_masked, q, k, v, mask, cot)


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "gate", "query_chunk"))
def _moba_vjp(q, k, v, cot, **kw):
    return _vjp(lambda *a: bs.moba_attention(*a, **kw), q, k, v, cot)


def _assert_close(a, b, tol=1e-5, gtol=1e-4):
    (oa, ga), (ob, gb) = a, b
    np.testing.assert_allclose(oa, ob, rtol=tol, atol=tol)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=gtol, atol=tol)


CASES = [  # (T, block, top_k): partial last blocks, k below and at the block count
    (37, 4, 3), (64, 16, 2), (50, 7, 4),
]


@pytest.mark.integration
@pytest.mark.parametrize("gate", ["moba", "ssa"])
@pytest.mark.parametrize("t,block,top_k", CASES)
def test_moba_matches_dense_oracle_forward_and_gradients(t, block, top_k, gate):
    q, k, v = _qkv(t * block + top_k, 2, t, 4, 2, 8)
    sel = _oracle_selection(q, k, block, top_k, gate)
    idx = np.asarray(jax.jit(lambda q, k: bs.select_blocks(q, k, block_size=block, top_k=top_k, gate=gate))(q, k))
    got = np.zeros_like(sel)
    b_, t_, h_, s_ = np.nonzero(idx >= 0)
    got[b_, t_, h_, idx[b_, t_, h_, s_]] = True
    np.testing.assert_array_equal(got, sel)
    count = np.minimum(top_k, np.arange(t) // block + 1)[None, :, None]  # own block + min(k-1, #past) blocks
    np.testing.assert_array_equal(got.sum(-1), np.broadcast_to(count, got.shape[:3]))
    mask = jnp.asarray(_oracle_mask(sel, block, 4))
    cot = jax.random.normal(jax.random.key(1), q.shape)
    _assert_close(_moba_vjp(q, k, v, cot, block_size=block, top_k=top_k, gate=gate), _oracle_vjp(q, k, v, mask, cot))


def test_the_two_gates_select_differently_and_ssa_shares_selection_per_group():
    q, k, _ = _qkv(0, 2, 64, 4, 2, 8)
    moba = bs.select_blocks(q, k, block_size=8, top_k=3, gate="moba")
    ssa = bs.select_blocks(q, k, block_size=8, top_k=3, gate="ssa")
    assert moba.shape == (2, 64, 4, 3) and ssa.shape == (2, 64, 2, 3)  # per query head vs per KV group
    s_moba = _oracle_selection(q, k, 8, 3, "moba")
    s_ssa = _oracle_selection(q, k, 8, 3, "ssa")
    assert (s_moba[:, :, ::2] != s_ssa).any()  # the oracles (hence the tests above) tell the gates apart
    assert (s_moba[:, :, 0] != s_moba[:, :, 1]).any()  # heads of one group select on their own under moba


@pytest.mark.integration  # a long sequence
def test_large_blocks_and_chunked_queries():
    """Block 512 on a 1100-token sequence (partial last block; the default chunking splits the queries),
    and an explicit small query chunk, against the dense oracle; gradients through the chunked map."""
    q, k, v = _qkv(5, 1, 1100, 2, 1, 8)
    for gate in ("moba", "ssa"):
        mask = jnp.asarray(_oracle_mask(_oracle_selection(q, k, 512, 2, gate), 512, 2))
        got = jax.jit(lambda *a: bs.moba_attention(*a, block_size=512, top_k=2, gate=gate))(q, k, v)
        np.testing.assert_allclose(got, jax.jit(_dense_masked)(q, k, v, mask), rtol=1e-5, atol=1e-5)
    q, k, v = _qkv(6, 2, 37, 4, 2, 8)
    cot = jax.random.normal(jax.random.key(2), q.shape)
    _assert_close(_moba_vjp(q, k, v, cot, block_size=4, top_k=3, gate="ssa", query_chunk=5),
                  _moba_vjp(q, k, v, cot, block_size=4, top_k=3, gate="ssa"))


@pytest.mark.integration
@pytest.mark.parametrize("t,block,gate", [(37, 4, "moba"), (37, 16, "ssa"), (40, 64, "moba")])
def test_top_k_covering_all_blocks_is_causal_full_attention(t, block, gate):
    q, k, v = _qkv(t + block, 2, t, 4, 2, 8)
    cot = jax.random.normal(jax.random.key(3), q.shape)
    full = jnp.asarray(np.tril(np.ones((t, t), bool)))[None, None]
    _assert_close(_moba_vjp(q, k, v, cot, block_size=block, top_k=-(-t // block), gate=gate),
                  _oracle_vjp(q, k, v, full, cot))
    np.testing.assert_allclose(_oracle_vjp(q, k, v, full, cot)[0], dense_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_given_blocks_attention_and_top1_is_block_diagonal():
    q, k, v = _qkv(7, 1, 24, 2, 1, 8)
    own = (jnp.arange(24) // 8)[None, :, None, None].astype(jnp.int32)  # each query: only its own block
    block_diag = np.tril(np.ones((24, 24), bool)) & (np.arange(24)[:, None] // 8 == np.arange(24)[None] // 8)
    ref = _dense_masked(q, k, v, jnp.asarray(block_diag)[None, None])
    got = jax.jit(lambda *a: bs.block_sparse_attention(*a, own, block_size=8))(q, k, v)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for gate in ("moba", "ssa"):
        got = jax.jit(lambda *a: bs.moba_attention(*a, block_size=8, top_k=1, gate=gate))(q, k, v)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_flops_terms_are_exact():
    for t, block, top_k in [(37, 4, 3), (50, 7, 4), (64, 16, 2), (64, 16, 99)]:
        q, k, _ = _qkv(0, 1, t, 2, 2, 8)
        mask = _oracle_mask(_oracle_selection(q, k, block, top_k, "moba"), block, 2)
        assert moba_mean_keys(t, block, top_k) == pytest.approx(mask[0, 0].sum() / t)
        assert moba_gate_dots(t, block) == pytest.approx(np.mean(np.arange(t) // block))
    assert moba_mean_keys(64, 16, 99) == pytest.approx(65 / 2)  # full causal: (T + 1) / 2
    cfg = load_config(["scale/s1.gin", "arch/moba.gin"])
    f = flops_per_token(cfg.model, 8192)["per_layer_type"]["E:moba"]
    assert f["mixing"] == pytest.approx(4 * 3 * 128 * moba_mean_keys(8192, 16, 16) + 2 * 3 * 128 * (8192 / 16 - 1) / 2)


def test_options_are_validated(tiny_params):
    for opts in ("{'block_size': 0}", "{'top_k': 0}", "{'gate': 'nsa'}", "{'chunk': 4}", "{'selection': 'row'}"):
        with pytest.raises(ConfigError):
            load_config([], tiny_params + ["efficient/MixerConfig.kind = 'moba'",
                                           f"efficient/MixerConfig.options = {opts}"])


@pytest.mark.integration
@pytest.mark.parametrize("selection", ["token", "block"])
def test_moba_mixer_with_all_blocks_equals_full_attention_mixer(selection):
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, compute_dtype="float32")
    opts = {"block_size": 8, "top_k": 3, "selection": selection}
    moba = MobaAttention(cfg, MixerConfig(kind="moba", options=opts), 0, rngs=nnx.Rngs(0))
    full = FullAttention(cfg, MixerConfig(kind="attention"), 0, rngs=nnx.Rngs(0))  # same init draws
    x = jax.random.normal(jax.random.key(4), (2, 20, 32))
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(20), (2, 20)))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x, ctx))(moba, x), nnx.jit(lambda m, x: m(x, ctx))(full, x),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_tiny_hybrid_with_moba_trains(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["efficient/MixerConfig.kind = 'moba'", "TrainConfig.steps = 25",
                                         "efficient/MixerConfig.options = {'block_size': 4, 'top_k': 3}",
                                         "TrainConfig.eval_every = 25"])
    res = train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert rows[0]["loss"] > rows[-1]["loss"] + 0.3, [r["loss"] for r in rows]
    assert np.isfinite(res.final_eval["loss"]) and res.final_eval["loss"] < rows[0]["loss"]


@pytest.mark.integration
def test_block_selection_ranks_by_the_previous_blocks_mean_query_and_shares_lists():
    """selection='block': one list per query block, ranked by the preceding block's mean query
    . mean(k_c) (moba gate), own block forced; moba_attention with it equals the given-blocks
    attention on the broadcast lists."""
    T, block, top_k = 50, 8, 3
    q, k, v = _qkv(11, 2, T, 4, 2, 8)
    idx = np.asarray(bs.select_blocks(q, k, block_size=block, top_k=top_k, gate="moba", selection="block"))
    nb = -(-T // block)
    assert idx.shape == (2, nb, 4, top_k)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    kbar = np.stack([kn[:, c * block:(c + 1) * block].mean(1) for c in range(nb)], 1)  # [B, nb, K, D]
    qbar = np.stack([qn[:, c * block:(c + 1) * block].mean(1) for c in range(nb)], 1)  # [B, nb, H, D]
    score = np.einsum("bchd,behd->bche", qbar, np.repeat(kbar, 2, axis=2))  # [B, nb(query), H, nb(key)]
    assert set(idx[0, 0, 1][idx[0, 0, 1] >= 0].tolist()) == {0}
    for c in range(1, nb):
        want = {c} | set(np.argsort(-score[0, c - 1, 1, :c])[:top_k - 1].tolist())
        assert set(idx[0, c, 1][idx[0, c, 1] >= 0].tolist()) == want
    tok = jnp.asarray(idx)[:, jnp.arange(T) // block]
    cot = jax.random.normal(jax.random.key(5), q.shape)
    got = _vjp(lambda *a: bs.moba_attention(*a, block_size=block, top_k=top_k, gate="moba", selection="block"),
               q, k, v, cot)
    want = _vjp(lambda *a: bs.block_sparse_attention(*a, tok, block_size=block), q, k, v, cot)
    _assert_close(got, want)
    full = jnp.asarray(np.tril(np.ones((T, T), bool)))[None, None]
    _assert_close(_vjp(lambda *a: bs.moba_attention(*a, block_size=block, top_k=nb, gate="ssa", selection="block"),
                       q, k, v, cot), _oracle_vjp(q, k, v, full, cot))


def test_moba_impl_dispatch(monkeypatch):
    from hybrid_lm import backends

    def resolve_moba_impl(impl, block_size):
        return backends.moba_backend(impl, block_size)[0]
    assert resolve_moba_impl("auto", 128) == "xla"  # CPU
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    assert resolve_moba_impl("auto", 128) == "pallas" and resolve_moba_impl("auto", 64) == "pallas"
    # SSA's block 16 too (measured ~100x faster than the reference); non-powers of two: reference
    assert resolve_moba_impl("auto", 16) == "pallas" and resolve_moba_impl("auto", 96) == "xla"
    monkeypatch.undo()
    assert resolve_moba_impl("pallas", 16) == "pallas"
    for impl in ("cudnn", "jla"):
        with pytest.raises(ConfigError, match=impl):
            resolve_moba_impl(impl, 128)
    with pytest.raises(ConfigError, match="power of two"):
        resolve_moba_impl("pallas", 48)


def test_top_k_by_passes_matches_lax_top_k():
    """The GPU selection's top-k: same values and indices as lax.top_k, ties to the lower index,
    and rows with fewer finite entries than k map to the same -1 slots."""
    from hybrid_lm.ops.block_sparse import _top_blocks, top_k_by_passes
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 40)).astype(np.float32)
    x[0, 0, [3, 7, 9]] = 1.5  # exact ties
    x[1, 2, :] = np.round(x[1, 2, :]) + 0.0  # many ties (+ 0.0: no -0.0, which sort ranks below +0.0)
    x[2, 1, :] = -np.inf
    x[2, 1, [5, 11]] = [0.3, np.inf]  # fewer finite entries than k
    x = jnp.asarray(x)
    for k in (1, 4, 16, 40):
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = top_k_by_passes(x, k)
        np.testing.assert_array_equal(got_v, want_v)
        finite = np.isfinite(np.asarray(want_v)) | (np.asarray(want_v) > 0)
        np.testing.assert_array_equal(np.asarray(got_i)[finite], np.asarray(want_i)[finite])
        np.testing.assert_array_equal(_top_blocks(x, k, "passes"), _top_blocks(x, k, "sort"))
    with pytest.raises(ValueError, match="method"):
        _top_blocks(x, 2, "heap")


def test_top_k_method_auto_follows_the_measured_rule(monkeypatch):
    """auto: passes on a GPU for top-16 of 1024 (measured 5x faster), sort for top-32 of 256
    (measured 1.3x faster) and on the CPU."""
    from hybrid_lm import backends
    from hybrid_lm.ops import block_sparse as bs
    used = []
    real = bs.top_k_by_passes
    monkeypatch.setattr(bs, "top_k_by_passes", lambda x, k: used.append((x.shape[-1], k)) or real(x, k))
    x = jnp.zeros((2, 1024))
    bs._top_blocks(x, 16)
    assert used == []  # CPU: sort
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    bs._top_blocks(x, 16)
    bs._top_blocks(jnp.zeros((2, 256)), 32)
    assert used == [(1024, 16)]


@pytest.mark.integration
@pytest.mark.parametrize("selection", ["token", "block"])
@pytest.mark.parametrize("gate", ["moba", "ssa"])
def test_moba_is_causal(selection, gate):
    """Changing tokens after position t changes no output at positions <= t (selection included:
    a block's choice must not read its later queries)."""
    T, block, top_k, t = 48, 8, 3, 27  # t in the middle of block 3
    q, k, v = _qkv(21, 1, T, 4, 2, 8)
    q2, k2, v2 = (x.at[:, t + 1:].set(jax.random.normal(jax.random.key(i), x[:, t + 1:].shape))
                  for i, x in enumerate((q, k, v)))
    f = lambda q, k, v: bs.moba_attention(q, k, v, block_size=block, top_k=top_k, gate=gate, selection=selection)
    np.testing.assert_allclose(f(q, k, v)[:, :t + 1], f(q2, k2, v2)[:, :t + 1], rtol=1e-6, atol=1e-6)
