"""Stochastic attention (sa) and gated SA + SWA (sa_swa): permutations, masks, gradients, training."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import count_params, flops_per_token
from hybrid_lm.model.attention import FullAttention, SlidingWindowAttention, attend, mean_keys_per_query
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.stochastic import (GatedSASWA, StochasticAttention, sa_flops, sa_mean_band_keys,
                                        sa_mean_visible_keys, sa_permutations, sa_swa_flops)
from hybrid_lm.model.transformer import HybridLM
from hybrid_lm.ops import permutation as P
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics

B, T, D_MODEL, H, K, DH = 2, 19, 32, 4, 2, 8


def _cfg(**kw):
    return ModelConfig(d_model=D_MODEL, n_heads=H, n_kv_heads=K, head_dim=DH, n_layers=2, compute_dtype="float32",
                       **kw)


def _randomize(module, seed=0, std=0.35):
    """Large random weights: the default 0.02 init makes attention nearly uniform and tests weak."""
    graphdef, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(std * rng.standard_normal(x.shape, np.float32)) for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, new))


def _mixer(cls, window, layer=0, seed=0, **options):
    return _randomize(cls(_cfg(), MixerConfig(kind="x", window=window, options=options), layer, rngs=nnx.Rngs(0)), seed)


def _x(seed=1, b=B, t=T):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D_MODEL), np.float32))


def _pos(b=B, t=T):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _rand_perm(seed, b=B, t=T):
    rng = np.random.default_rng(seed)
    perm = jnp.asarray(np.stack([rng.permutation(t) for _ in range(b)]), jnp.int32)
    return perm, P.invert(perm)


def _sa_mask(inv, window, positions, window_right=0):
    """Dense [B, Tq, Tk] SA mask in ORIGINAL order: slots inv[i], inv[j] in the band, causal by position.
    window_right = window - 1 is window_mode='symmetric'."""
    si, sj = inv[:, :, None], inv[:, None, :]
    return (sj <= si + window_right) & (sj > si - window) & (positions[:, None, :] <= positions[:, :, None])


def _dense(q, k, v, mask):
    """O(T^2) masked GQA softmax attention, the oracle."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("bqkgd,blkd->bkgql", qg, k) / np.sqrt(d)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    o = jnp.einsum("bkgql,blkd->bqkgd", jax.nn.softmax(s, -1), v)
    return o.reshape(b, t, h, d)


def _value_and_grads(f, module, x, cot):
    """f(module, x) and the gradients of <f, cot> w.r.t. parameters and x (eager: the small ops are
    compiled once and shared by the tests, cheaper than one jit per test)."""
    graphdef, state = nnx.split(module)
    y, vjp = jax.vjp(lambda s, x: f(nnx.merge(graphdef, s), x), state, x)
    return y, vjp(cot)


def _assert_same(a, b, tol, gtol):
    """Outputs within tol, all gradients within gtol."""
    np.testing.assert_allclose(a[0], b[0], rtol=tol, atol=tol)
    _assert_trees_close(a[1], b[1], gtol)


def _assert_trees_close(a, b, tol):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for u, w in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=tol, atol=tol)


def _ctx(step=3, ids=None, train=True, b=B, t=T, seed=0):
    ids = jnp.arange(b, dtype=jnp.int32) + 100 if ids is None else jnp.asarray(ids, jnp.int32)
    return MixerContext(positions=_pos(b, t), attention_impl="xla", step=jnp.int32(step), seed=seed,
                        example_ids=ids, train=train)


# ----------------------------------------------------------------------------- permutations

def test_permute_round_trip_is_exact_and_vjp_is_the_inverse_gather():
    x = _x(2)
    perm, inv = _rand_perm(5)
    xp = P.permute(x, perm, inv)
    np.testing.assert_array_equal(xp, np.take_along_axis(np.asarray(x), np.asarray(perm)[:, :, None], 1))
    np.testing.assert_array_equal(P.unpermute(xp, perm, inv), x)  # bitwise
    np.testing.assert_array_equal(P.invert(inv), perm)
    cot = _x(3)
    g = jax.grad(lambda x: jnp.sum(P.permute(x, perm, inv) * cot))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jax.vmap(lambda a, p: a[p])(x, perm) * cot))(x)  # autodiff scatter-add
    np.testing.assert_array_equal(g, g_ref)


def test_permutations_are_keyed_by_seed_step_layer_and_global_example_id():
    ids = jnp.array([7, 3, 9, 1000003], jnp.int32)
    p = P.draw_permutations(0, jnp.int32(5), 2, ids, 64)
    assert p.shape == (4, 64) and p.dtype == jnp.int32
    np.testing.assert_array_equal(np.sort(p, axis=1), np.broadcast_to(np.arange(64), (4, 64)))
    np.testing.assert_array_equal(p, P.draw_permutations(0, 5, 2, ids, 64))  # same key, same draw
    jitted = jax.jit(lambda s, e: P.draw_permutations(0, s, 2, e, 64))(jnp.int32(5), ids)  # traced step and ids
    np.testing.assert_array_equal(p, jitted)
    for other in (P.draw_permutations(0, 6, 2, ids, 64), P.draw_permutations(0, 5, 3, ids, 64),
                  P.draw_permutations(1, 5, 2, ids, 64)):
        assert all(not np.array_equal(p[i], other[i]) for i in range(4))
    assert len({tuple(r) for r in np.asarray(p)}) == 4  # one permutation per example
    # sharding independence: a row's permutation depends on its global id, not on its row or batch
    sub = P.draw_permutations(0, 5, 2, ids[jnp.array([2, 0])], 64)
    np.testing.assert_array_equal(sub, p[jnp.array([2, 0])])
    shared = P.draw_permutations(0, 5, 2, ids, 64, per_example=False)
    assert (shared == shared[0]).all()
    np.testing.assert_array_equal(shared[:2], P.draw_permutations(0, 5, 2, jnp.array([1, 2]), 64, per_example=False))


# ----------------------------------------------------------------------------- SA against the dense oracle

@pytest.mark.integration
@pytest.mark.parametrize("window,mode", [(1, "causal"), (4, "causal"), (3 * T, "causal"), (4, "symmetric")])
def test_sa_mixer_matches_dense_oracle_forward_and_gradients(window, mode):
    """Permute x -> project with RoPE at permuted original positions -> attend -> un-permute equals
    projecting in the original order and attending with the SA mask (the two orders commute)."""
    m = _mixer(StochasticAttention, window, window_mode=mode)
    x, pos, cot = _x(), _pos(), _x(9)
    perm, inv = _rand_perm(11)
    wr = window - 1 if mode == "symmetric" else 0
    assert m.window_right == wr

    def sa(m, x):
        return m.attend_permuted(x, pos, perm, inv, "xla")

    def oracle(m, x):
        q, k, v = m.project_qkv(x, pos)
        return m.project_out(_dense(q, k, v, _sa_mask(inv, window, pos, wr)))

    _assert_same(_value_and_grads(sa, m, x, cot), _value_and_grads(oracle, m, x, cot), 2e-5, 1e-4)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["causal", "symmetric"])
def test_sa_gradients_reach_exactly_the_visible_keys(mode):
    """d out_i / d v_j != 0 iff j is visible to i; d out_i / d k_j != 0 iff visible and i sees >= 2 keys."""
    t, w = 24, 4
    wr = w - 1 if mode == "symmetric" else 0
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((1, t, 2, 8), (1, t, 1, 8), (1, t, 1, 8)))
    pos = _pos(1, t)
    perm, inv = _rand_perm(21, 1, t)

    def sa(q, k, v):  # the mixer's composition, on q/k/v directly
        pp = jnp.take_along_axis(pos, perm, 1)
        qp, kp, vp = (P.permute(a, perm, inv) for a in (q, k, v))
        return P.unpermute(attend(qp, kp, vp, window=w, positions=pp, impl="xla", permuted=True, window_right=wr),
                           perm, inv)

    mask = np.asarray(_sa_mask(inv, w, pos, wr)[0])  # [Tq, Tk]
    jk = jax.jacrev(sa, argnums=1)(q, k, v)  # [1, t, 2, 8, 1, t, 1, 8]
    jv = jax.jacrev(sa, argnums=2)(q, k, v)
    reach_k = np.abs(np.asarray(jk)).sum(axis=(0, 2, 3, 4, 6, 7)) > 0  # [Tq, Tk]
    reach_v = np.abs(np.asarray(jv)).sum(axis=(0, 2, 3, 4, 6, 7)) > 0
    np.testing.assert_array_equal(reach_v, mask)
    np.testing.assert_array_equal(reach_k, mask & (mask.sum(1, keepdims=True) >= 2))
    i, j = np.nonzero(mask)
    assert (j < i - w).any()  # SA reaches keys far outside the original-order window
    assert (~mask[np.tril_indices(t)]).any()  # and misses some causal keys inside it


@pytest.mark.integration
def test_sa_identity_permutation_is_swa_and_full_window_identity_is_causal_attention():
    x, pos, cot = _x(4), _pos(), _x(5)
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    for window, ref_cls in ((5, SlidingWindowAttention), (T, FullAttention)):
        sa = _mixer(StochasticAttention, window, seed=2)
        ref = _randomize(ref_cls(_cfg(), MixerConfig(kind="x", window=window), 0, rngs=nnx.Rngs(0)), 2)
        f_sa = lambda m, x: m.attend_permuted(x, pos, ident, ident, "xla")  # noqa: E731
        f_ref = lambda m, x: m(x, _ctx())  # noqa: E731
        _assert_same(_value_and_grads(f_sa, sa, x, cot), _value_and_grads(f_ref, ref, x, cot), 1e-5, 1e-4)


@pytest.mark.integration  # a whole model
def test_sa_window_covering_the_sequence_sees_keys_before_it_in_both_orders():
    """With w >= T the band is no restriction, but a query still sees only the keys that precede it in
    the permuted order: about half its causal past, so SA(w >= T) is NOT full causal attention."""
    x = _x(6)
    perm, inv = _rand_perm(8)
    a = _mixer(StochasticAttention, T).attend_permuted(x, _pos(), perm, inv, "xla")
    b = _mixer(StochasticAttention, 5 * T).attend_permuted(x, _pos(), perm, inv, "xla")
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    full = _randomize(FullAttention(_cfg(), MixerConfig(kind="x"), 0, rngs=nnx.Rngs(0)), 0)(x, _ctx())
    assert np.abs(np.asarray(a - full)).max() > 1e-2


def _jit_value_and_grads(f, module, x, cot):
    """As `_value_and_grads`, jitted (one compile beats eager autodiff of the blocked reference)."""
    graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, x):
        y, vjp = jax.vjp(lambda s, x: f(nnx.merge(graphdef, s), x), state, x)
        return y, vjp(cot)
    return run(state, x)


@pytest.mark.integration
def test_sa_symmetric_window_covering_the_sequence_equals_causal_full_attention():
    """The issue's "SA with w >= T equals causal full attention" holds for window_mode='symmetric'
    (|i - j| < w in permuted order, causal by position), for a random permutation: forward and the
    gradients w.r.t. x and every parameter, through the mixer (xla reference path)."""
    x, cot = _x(12), _x(13)
    perm, inv = _rand_perm(14)
    full = _randomize(FullAttention(_cfg(), MixerConfig(kind="x"), 0, rngs=nnx.Rngs(0)), 3)
    want = _jit_value_and_grads(lambda m, x: m(x, _ctx()), full, x, cot)
    for window in (T, 2 * T):
        sa = _mixer(StochasticAttention, window, seed=3, window_mode="symmetric")
        got = _jit_value_and_grads(lambda m, x: m.attend_permuted(x, _pos(), perm, inv, "xla"), sa, x, cot)
        _assert_same(got, want, 2e-5, 1e-4)
    # and through __call__ (the mixer's own per-example permutations)
    sa = _mixer(StochasticAttention, T, seed=3, window_mode="symmetric")
    np.testing.assert_allclose(sa(x, _ctx(step=5)), want[0], rtol=2e-5, atol=2e-5)


def test_sa_symmetric_identity_permutation_is_swa():
    x, pos, cot = _x(15), _pos(), _x(16)
    ident = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    sa = _mixer(StochasticAttention, 5, seed=4, window_mode="symmetric")
    ref = _randomize(SlidingWindowAttention(_cfg(), MixerConfig(kind="x", window=5), 0, rngs=nnx.Rngs(0)), 4)
    got = _jit_value_and_grads(lambda m, x: m.attend_permuted(x, pos, ident, ident, "xla"), sa, x, cot)
    _assert_same(got, _jit_value_and_grads(lambda m, x: m(x, _ctx()), ref, x, cot), 1e-5, 1e-4)


# ----------------------------------------------------------------------------- randomness through the mixer

@pytest.mark.integration
def test_sa_mixer_randomness_is_per_step_layer_and_global_example():
    m = _mixer(StochasticAttention, 4)
    x = _x(7, b=3)
    y = m(x, _ctx(step=3, ids=[10, 11, 12], b=3))
    np.testing.assert_array_equal(y, m(x, _ctx(step=3, ids=[10, 11, 12], b=3)))  # deterministic
    assert all(np.abs(np.asarray(y - m(x, _ctx(step=4, ids=[10, 11, 12], b=3))))[r].max() > 1e-3 for r in range(3))
    other_layer = _mixer(StochasticAttention, 4, layer=1)  # same weights (same seed), different layer
    assert np.abs(np.asarray(y - other_layer(x, _ctx(step=3, ids=[10, 11, 12], b=3)))).max() > 1e-3
    # a row's output depends on its global example id, not on its row in the (sharded) batch
    sub = m(x[jnp.array([2, 0])], _ctx(step=3, ids=[12, 10], b=2))
    np.testing.assert_allclose(sub, y[jnp.array([2, 0])], rtol=1e-5, atol=1e-5)
    same_rows = jnp.broadcast_to(x[:1], x.shape)
    per_ex = m(same_rows, _ctx(ids=[10, 11, 12], b=3))
    assert np.abs(np.asarray(per_ex[0] - per_ex[1])).max() > 1e-3
    shared = _mixer(StochasticAttention, 4, per_example=False)(same_rows, _ctx(ids=[10, 11, 12], b=3))
    np.testing.assert_allclose(shared[0], shared[1], rtol=1e-6, atol=1e-6)


def test_sa_eval_uses_fixed_draws_independent_of_the_step_and_can_average():
    x = _x(8)
    m1 = _mixer(StochasticAttention, 4)
    e = m1(x, _ctx(step=0, train=False))
    np.testing.assert_array_equal(e, m1(x, _ctx(step=777, train=False)))  # same for every checkpoint
    assert np.abs(np.asarray(e - m1(x, _ctx(step=0)))).max() > 1e-3  # its own stream, not step 0's
    assert np.abs(np.asarray(e - _mixer(StochasticAttention, 4, eval_seed=99)(x, _ctx(train=False)))).max() > 1e-3
    m3 = _mixer(StochasticAttention, 4, eval_draws=3)
    draws = sa_permutations(m3.opts, _ctx(train=False), 0, B, T)
    assert len(draws) == 3 and len({tuple(np.asarray(p[0]).tolist()) for p, _ in draws}) == 3
    manual = sum(m3.attend_permuted(x, _pos(), p, i, "xla") for p, i in draws) / 3
    np.testing.assert_allclose(m3(x, _ctx(train=False)), manual, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m3(x, _ctx(train=False))[:, :1], e[:, :1], rtol=1e-6, atol=1e-6)  # query 0: self only


def _visible_per_position(t, w, wr):
    """Mean visible keys (the query included) per original position over ALL t! permutations, exactly."""
    perms = np.array(list(itertools.permutations(range(t))), dtype=np.int8)  # slot -> position
    inv = np.argsort(perms, axis=1)  # position -> slot
    si, sj = inv[:, :, None], inv[:, None, :]
    idx = np.arange(t)
    band = (sj <= si + wr) & (sj > si - w)
    return (band & (idx[None, None, :] <= idx[None, :, None])).sum(2).mean(0)


def test_mean_visible_keys_formula_matches_all_permutations():
    t, w = 8, 3
    per_pos = _visible_per_position(t, w, 0)
    expected = np.array([sa_mean_visible_keys(t, w, p) for p in range(t)])
    np.testing.assert_allclose(per_pos, expected, rtol=1e-12)
    assert per_pos[-1] == pytest.approx(mean_keys_per_query(t, w), rel=1e-12)  # the last token sees m
    assert sa_mean_visible_keys(t, w) == pytest.approx(expected.mean())
    assert sa_mean_visible_keys(t, 10 * t, t - 1) == pytest.approx(1 + (t - 1) / 2)  # w >= T: half the past


@pytest.mark.parametrize("w,wr", [(3, 2), (4, 1), (10, 9)], ids=["symmetric", "asymmetric", "symmetric-w>T"])
def test_mean_visible_keys_two_sided_band_matches_all_permutations(w, wr):
    """The FLOPs' counts for a band reaching wr slots right of the query (window_mode='symmetric' is
    wr = w - 1): mean band size and visible keys per position, both counted exactly."""
    t = 8
    per_pos = _visible_per_position(t, w, wr)
    expected = np.array([sa_mean_visible_keys(t, w, p, window_right=wr) for p in range(t)])
    np.testing.assert_allclose(per_pos, expected, rtol=1e-12)
    idx = np.arange(t)
    s, r = idx[:, None], idx[None, :]
    assert sa_mean_band_keys(t, w, wr) == pytest.approx(((r <= s + wr) & (r > s - w)).sum() / t)  # exact
    assert sa_mean_visible_keys(t, w, window_right=wr) == pytest.approx(expected.mean())
    if wr == w - 1:  # symmetric: 2m - 1 band slots, and as many visible keys on average as SWA-w sees
        m = mean_keys_per_query(t, w)
        assert sa_mean_band_keys(t, w, wr) == pytest.approx(2 * m - 1)
        assert sa_mean_visible_keys(t, w, window_right=wr) == pytest.approx(m)
    if w >= t:  # symmetric covering the sequence: exactly causal attention, p + 1 keys
        np.testing.assert_allclose(per_pos, idx + 1)
        np.testing.assert_allclose(expected, idx + 1)


# ----------------------------------------------------------------------------- gated SA + SWA

@pytest.mark.parametrize("gate,shared,mode", [("head", True, "causal"), ("channel", True, "causal"),
                                              ("head", False, "causal"), ("head", True, "symmetric")])
@pytest.mark.integration
def test_sa_swa_matches_manual_gated_combination(gate, shared, mode):
    w = 4
    m = _mixer(GatedSASWA, w, gate=gate, shared_qkv=shared, window_mode=mode)
    wr = w - 1 if mode == "symmetric" else 0  # the SA branch only; SWA stays one-sided
    x, pos, cot, ctx = _x(10), _pos(), _x(11), _ctx(step=9)
    (perm, inv), = sa_permutations(m.opts, ctx, 0, B, T)

    def manual(m, x):
        q, k, v = m.project_qkv(x, pos)
        o_swa = _dense(q, k, v, _sa_mask(jnp.broadcast_to(jnp.arange(T), (B, T)), w, pos))
        if not shared:
            q, k, v = m.sa_qkv(x, pos)
        o_sa = _dense(q, k, v, _sa_mask(inv, w, pos, wr))
        g_sa = jax.nn.sigmoid(jnp.einsum("btd,d...->bt...", x, m.w_gate_sa[...]))
        g_swa = jax.nn.sigmoid(jnp.einsum("btd,d...->bt...", x, m.w_gate_swa[...]))
        if gate == "head":
            g_sa, g_swa = g_sa[..., None], g_swa[..., None]
        return m.project_out(g_sa * o_sa + g_swa * o_swa)

    mixer = lambda m, x: m(x, ctx)  # noqa: E731
    got = _value_and_grads(mixer, m, x, cot)
    _assert_same(got, _value_and_grads(manual, m, x, cot), 2e-5, 1e-4)
    g_state = got[1][0]
    assert float(jnp.abs(g_state["w_gate_sa"][...]).max()) > 0 and float(jnp.abs(g_state["w_gate_swa"][...]).max()) > 0


def test_params_logical_axes_and_flops(tiny_params):
    base = tiny_params + ["ModelConfig.n_heads = 4", "ModelConfig.n_kv_heads = 2"]
    counts = {}
    for name, extra in (("swa", []), ("sa", []), ("sa_swa", []),
                        ("ch", ["efficient/MixerConfig.options = {'gate': 'channel'}"]),
                        ("sep", ["efficient/MixerConfig.options = {'shared_qkv': False}"])):
        kind = {"ch": "sa_swa", "sep": "sa_swa"}.get(name, name)
        cfg = load_config([], base + [f"efficient/MixerConfig.kind = '{kind}'"] + extra)
        counts[name] = count_params(cfg.model)["non_embedding"]
        model = nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0)))
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param):
                assert len(var.get_metadata()["logical_axes"]) == var.get_value().ndim, path
    d, h, kv, dh = 32, 4, 2, 8
    assert counts["sa"] == counts["swa"]  # SA is parameter-free over SWA
    assert counts["sa_swa"] - counts["swa"] == 2 * d * h  # two per-head gates, one efficient layer
    assert counts["ch"] - counts["swa"] == 2 * d * h * dh
    assert counts["sep"] - counts["sa_swa"] == d * (h + 2 * kv) * dh
    cfg = load_config(["scale/s1.gin", "arch/sa.gin"])
    f = flops_per_token(cfg.model, 16384)["per_layer_type"]
    swa = load_config(["scale/s1.gin"]).model
    f_swa = flops_per_token(swa, 16384)["per_layer_type"]
    assert f["E:sa"]["mixing"] == f_swa["E:swa"]["mixing"]  # the computed band, as SWA
    f_sa = sa_flops(cfg.model, cfg.model.efficient, 16384)
    assert f_sa["mixing_visible"] == pytest.approx(4 * 3 * 128 * sa_mean_visible_keys(16384, 128))
    assert f_sa["mixing_visible"] < 0.51 * f_sa["mixing"]
    g = flops_per_token(load_config(["scale/s1.gin", "arch/sa_swa.gin"]).model, 16384)["per_layer_type"]["E:sa_swa"]
    assert g["mixing"] == 2 * f["E:sa"]["mixing"] and g["mixer_matmul"] == f["E:sa"]["mixer_matmul"] + 4 * 384 * 3
    # window_mode='symmetric': the kernel computes the 2m - 1 band; about m keys are visible (as SWA)
    sym = ["efficient/MixerConfig.options = {'window_mode': 'symmetric'}"]
    cs = load_config(["scale/s1.gin", "arch/sa.gin"], sym)
    m = mean_keys_per_query(16384, 128)
    f_sym = sa_flops(cs.model, cs.model.efficient, 16384)
    assert f_sym["mixing"] == pytest.approx(4 * 3 * 128 * (2 * m - 1))
    assert f_sym["mixing_visible"] == pytest.approx(4 * 3 * 128 * m)
    assert flops_per_token(cs.model, 16384)["per_layer_type"]["E:sa"]["mixing"] == pytest.approx(f_sym["mixing"])
    cg = load_config(["scale/s1.gin", "arch/sa_swa.gin"], sym)
    g_sym = sa_swa_flops(cg.model, cg.model.efficient, 16384)
    assert g_sym["mixing"] == pytest.approx(4 * 3 * 128 * (m + 2 * m - 1))
    assert g_sym["mixing_visible"] == pytest.approx(4 * 3 * 128 * 2 * m)


def test_options_are_validated(tiny_params):
    for kind, opts in (("sa", "{'eval_draws': 0}"), ("sa", "{'per_sample': True}"), ("sa_swa", "{'gate': 'token'}"),
                       ("sa_swa", "{'shared_qkv': 'yes'}"), ("sa", "{'window_mode': 'two_sided'}"),
                       ("sa_swa", "{'window_mode': 'both'}")):
        with pytest.raises(ConfigError):
            load_config([], tiny_params + [f"efficient/MixerConfig.kind = '{kind}'",
                                           f"efficient/MixerConfig.options = {opts}"])
    with pytest.raises(ConfigError):
        load_config([], tiny_params + ["efficient/MixerConfig.kind = 'sa'", "efficient/MixerConfig.window = None"])
    with pytest.raises(ConfigError, match="window_mode"):
        _mixer(StochasticAttention, 4, window_mode="two_sided")
    for kind in ("sa", "sa_swa"):
        load_config([], tiny_params + [f"efficient/MixerConfig.kind = '{kind}'",
                                       "efficient/MixerConfig.options = {'window_mode': 'symmetric'}"])


# ----------------------------------------------------------------------------- training

@pytest.mark.integration
def test_tiny_hybrid_with_sa_and_sa_swa_trains(tiny_params, tmp_path):
    """Both mixers in one tiny hybrid (sa_swa in the full slot, sa in the efficient slot): one compile."""
    cfg = load_config([], tiny_params + ["full/MixerConfig.kind = 'sa_swa'", "full/MixerConfig.window = 8",
                                         "efficient/MixerConfig.kind = 'sa'", "TrainConfig.steps = 25",
                                         "TrainConfig.eval_every = 25"])
    res = train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert rows[0]["loss"] > rows[-1]["loss"] + 0.3, [r["loss"] for r in rows]
    assert np.isfinite(res.final_eval["loss"]) and res.final_eval["loss"] < rows[0]["loss"]
