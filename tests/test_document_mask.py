"""Document masking (``DataConfig.document_mask``): attention stays inside each packed document and
positions restart per document.

The masked ops against their dense oracle (itself checked against each document run alone), the
model's real invariant (a packed document's logits equal that document's alone), the train and eval
steps on the dict batch, the unchanged behaviour with the mask off, and every one-line refusal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm import backends, describe
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError, DataError
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.model.transformer import HybridLM
from hybrid_lm.ops import attention as ops
from hybrid_lm.train.optim import optimizer_for_bounds, wsd_bounds
from hybrid_lm.step import ModelFns, StateInit, make_eval_step, make_train_step, split_batch

TOL = dict(rtol=2e-5, atol=2e-5)


def _segments(seed: int, batch: int, length: int, n_docs: int) -> jax.Array:
    """``[B, T]`` non-decreasing document ids from 0, ``n_docs`` documents per row at random cuts."""
    rng = np.random.default_rng(seed)
    rows = [np.searchsorted(np.sort(rng.choice(np.arange(1, length), n_docs - 1, replace=False)),
                            np.arange(length), side="right") for _ in range(batch)]
    return jnp.asarray(np.stack(rows), jnp.int32)


def _qkv(seed: int, B, T, H, K, D):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D)))


# ----------------------------------------------------------------------------- positions

def test_segment_positions_restart_at_each_document():
    seg = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(ops.segment_positions(seg),
                                  [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(ops.segment_positions(jnp.zeros((3, 5), jnp.int32)), ops.default_positions(3, 5))


# ----------------------------------------------------------------------------- ops vs the dense oracle

@pytest.mark.parametrize("window", [None, 3, 64])
def test_dense_oracle_is_each_document_run_alone(window):
    """The oracle itself: with segments it is plain (windowed) attention of every document alone."""
    B, T = 2, 24
    q, k, v = _qkv(0, B, T, 4, 2, 8)
    seg = _segments(1, B, T, 3)
    dense = jax.jit(ops.dense_attention, static_argnames="window")
    out = dense(q, k, v, window=window, segment_ids=seg)
    for b in range(B):
        for d in range(3):
            idx = np.flatnonzero(np.asarray(seg[b]) == d)
            s = slice(idx[0], idx[-1] + 1)
            alone = dense(q[b:b + 1, s], k[b:b + 1, s], v[b:b + 1, s], window=window)
            np.testing.assert_allclose(out[b:b + 1, s], alone, **TOL)


CASES = [  # B, T, H, K, D, window, block, docs per row
    (2, 32, 4, 2, 8, 8, None, 3),
    (1, 45, 2, 1, 16, 5, 16, 4),  # T not a multiple of the block
    (2, 40, 4, 4, 8, 64, 16, 2),  # window >= T
    (3, 17, 2, 2, 4, 1, 8, 5),  # the query only
]


def _grads(f, q, k, v):
    """``(f(q, k, v), its VJP against a random cotangent)``, jitted (eager dispatch is slow here)."""
    ct = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape[:3] + v.shape[3:]), jnp.float32)

    @jax.jit
    def run(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)
    return run(q, k, v, ct)


@pytest.mark.parametrize("B,T,H,K,D,window,block,docs", CASES)
def test_windowed_attention_with_segments_matches_dense(B, T, H, K, D, window, block, docs):
    q, k, v = _qkv(T, B, T, H, K, D)
    seg = _segments(T + 1, B, T, docs)
    got, g_got = _grads(lambda *a: ops.windowed_attention(*a, window, block_size=block, segment_ids=seg), q, k, v)
    want, g_want = _grads(lambda *a: ops.dense_attention(*a, window=window, segment_ids=seg), q, k, v)
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.integration
def test_windowed_attention_with_segments_in_a_permuted_order():
    """The mask is written for any given order: segment ids travel with their tokens."""
    B, T = 2, 33
    q, k, v = _qkv(5, B, T, 4, 2, 8)
    seg = _segments(6, B, T, 3)
    perm = jnp.asarray(np.stack([np.random.default_rng(7 + b).permutation(T) for b in range(B)]), jnp.int32)
    pos, sp = jnp.take_along_axis(ops.default_positions(B, T), perm, 1), jnp.take_along_axis(seg, perm, 1)
    for wr in (0, 4):
        got, g_got = _grads(lambda *a: ops.windowed_attention(*a, 6, positions=pos, window_right=wr, block_size=16,
                                                              segment_ids=sp), q, k, v)
        want, g_want = _grads(lambda *a: ops.dense_attention(*a, window=6, positions=pos, window_right=wr,
                                                             segment_ids=sp), q, k, v)
        np.testing.assert_allclose(got, want, **TOL)
        for a, b in zip(g_got, g_want):
            np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("B,T,H,K,docs", [(2, 32, 4, 2, 3), (1, 19, 2, 1, 6)])
def test_causal_attention_with_segments_matches_dense(B, T, H, K, docs):
    q, k, v = _qkv(T, B, T, H, K, 8)
    seg = _segments(T + 2, B, T, docs)
    got, g_got = _grads(lambda *a: ops.causal_attention(*a, segment_ids=seg), q, k, v)
    want, g_want = _grads(lambda *a: ops.dense_attention(*a, segment_ids=seg), q, k, v)
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, **TOL)
    with pytest.raises(ValueError, match="xla only"):
        ops.causal_attention(q, k, v, segment_ids=seg, implementation="cudnn")


# ----------------------------------------------------------------------------- the model

MODEL = ["DataConfig.seq_len = 48"]  # 2 layers: full, swa (window 8)


def _model(tiny_params, extra=(), document_mask=True):
    cfg = load_config([], tiny_params + MODEL + list(extra) + [f"DataConfig.document_mask = {document_mask}"])
    return cfg, HybridLM(cfg.model, rngs=nnx.Rngs(0))


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


@nnx.jit
def _masked(model, tokens, seg):
    return model(tokens, MixerContext(positions=ops.segment_positions(seg), segment_ids=seg))


def _masked_logits(model, tokens, seg):
    return _masked(model, tokens, jnp.asarray(seg, jnp.int32))


@pytest.mark.integration
def test_one_document_per_row_gives_the_unmasked_logits(tiny_params):
    _, model = _model(tiny_params)
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, 256)
    np.testing.assert_allclose(_masked_logits(model, tokens, jnp.zeros((2, 40))), _logits(model, tokens), **TOL)


@pytest.mark.integration
@pytest.mark.parametrize("extra", [
    [],  # full + swa (window 8, shorter than the documents)
    ["full/MixerConfig.kind = 'attention_sink'", "full/MixerConfig.options = {'horizon': 6}"],
    ["ModelConfig.layer_pattern = 'EF'", "efficient/swa/MixerConfig.rope = False"],  # NoPE SWA first
])
def test_a_packed_document_sees_only_itself(tiny_params, extra):
    """The invariant: each document's logits in a packed row equal those of that document alone."""
    _, model = _model(tiny_params, extra)
    a, b = 17, 23
    tokens = jax.random.randint(jax.random.key(1), (1, a + b), 0, 256)
    packed = _masked_logits(model, tokens, [[0] * a + [1] * b])
    np.testing.assert_allclose(packed[:, a:], _logits(model, tokens[:, a:]), **TOL)
    np.testing.assert_allclose(packed[:, :a], _logits(model, tokens[:, :a]), **TOL)
    assert not np.allclose(packed[:, a:], _logits(model, tokens)[:, a:], atol=1e-3)  # unmasked, the 2nd doc differs


def test_a_refused_mixer_never_ignores_the_segments(tiny_params):
    cfg = load_config([], tiny_params + ["efficient/MixerConfig.kind = 'sa'", "DataConfig.document_mask = True"],
                      validate=False)
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="'sa' cannot mask documents"):
        _masked_logits(model, jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8)))


# ----------------------------------------------------------------------------- train and eval steps

def _step(cfg):
    fns = ModelFns(cfg)
    build = optimizer_for_bounds(cfg.optim, fns.axes)
    bounds = np.asarray(wsd_bounds(cfg.optim, 10), np.int32)
    return fns, StateInit(fns, build(bounds)[0])(0), jax.jit(make_train_step(fns, build)), bounds


@pytest.mark.integration
@pytest.mark.parametrize("micro", [1, 2])
def test_train_step_takes_the_dict_batch(tiny_params, micro):
    cfg = load_config([], tiny_params + ["DataConfig.document_mask = True", f"TrainConfig.microbatches = {micro}"])
    fns, state, step, bounds = _step(cfg)
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 256)
    seg = _segments(3, 4, 33, 3)
    new, stats = step(state, {"tokens": tokens, "segment_ids": seg}, bounds)
    assert bool(stats["finite"]) and np.isfinite(float(stats["loss"]))
    # the mask acts: one document per row is another loss
    _, other = step(state, {"tokens": tokens, "segment_ids": jnp.zeros_like(seg)}, bounds)
    assert float(other["loss"]) != float(stats["loss"])
    ce = make_eval_step(fns)(new["params"], {"tokens": tokens, "segment_ids": seg})
    assert ce.shape == (4,) and np.isfinite(np.asarray(ce)).all()


@pytest.mark.integration
def test_document_mask_off_is_unchanged(tiny_params):
    """Off: the dict ``{"tokens"}`` and the plain array give bitwise the same step and eval."""
    cfg = load_config([], tiny_params)
    fns, state, step, bounds = _step(cfg)
    tokens = jax.random.randint(jax.random.key(4), (4, 33), 0, 256)
    s1, st1 = step(state, tokens, bounds)
    s2, st2 = step(state, {"tokens": tokens}, bounds)
    for a, b in zip(jax.tree.leaves((s1, st1)), jax.tree.leaves((s2, st2))):
        np.testing.assert_array_equal(a, b)
    ev = jax.jit(make_eval_step(fns))
    np.testing.assert_array_equal(ev(s1["params"], tokens), ev(s1["params"], {"tokens": tokens}))


@pytest.mark.integration
def test_evaluate_and_put_batch_take_the_dict_windows(tiny_params):
    from hybrid_lm.config import MeshConfig
    from hybrid_lm.run.loss import evaluate, window_count
    from hybrid_lm import sharding as shd

    mesh = shd.make_mesh(MeshConfig())
    shard = shd.batch_sharding(mesh, MeshConfig().rules)
    windows = np.asarray(jax.random.randint(jax.random.key(5), (8, 33), 0, 256), np.int32)
    seg = np.asarray(_segments(6, 8, 33, 2))
    placed = shd.put_batch({"tokens": windows, "segment_ids": seg}, shard)
    assert set(placed) == {"tokens", "segment_ids"} and placed["segment_ids"].sharding == shard
    assert window_count({"tokens": windows}) == window_count(windows) == 8
    kw = dict(global_batch=4, n_batch_shards=1, bytes_per_token=1.0)
    rows = []
    for document_mask, batch in [(False, windows), (False, {"tokens": windows}),
                                 (True, {"tokens": windows, "segment_ids": seg})]:
        cfg = load_config([], tiny_params + [f"DataConfig.document_mask = {document_mask}"])
        fns = ModelFns(cfg)
        with jax.set_mesh(mesh):
            ev = jax.jit(make_eval_step(fns), in_shardings=(None, shard))
            rows.append(evaluate(ev, fns.init(0), batch, shard, **kw))
    assert rows[0]["loss"] == rows[1]["loss"] and rows[2]["eval_windows"] == 8 and rows[2]["loss"] != rows[0]["loss"]
    np.testing.assert_array_equal(rows[0]["window_losses"], rows[1]["window_losses"])


def test_the_batch_form_must_match_the_config():
    t = jnp.zeros((2, 9), jnp.int32)
    assert split_batch(t, False)[1] is None and split_batch({"tokens": t}, False)[0] is t
    with pytest.raises(DataError, match="needs batches with 'segment_ids'"):
        split_batch(t, True)
    with pytest.raises(DataError, match="disagree"):
        split_batch({"tokens": t, "segment_ids": t}, False)
    with pytest.raises(DataError, match="shape of tokens"):
        split_batch({"tokens": t, "segment_ids": t[:, :-1]}, True)
    with pytest.raises(DataError, match="got \\['segments', 'tokens'\\]"):
        split_batch({"tokens": t, "segments": t}, True)


# ----------------------------------------------------------------------------- refusals

REFUSED = [
    (["efficient/MixerConfig.kind = 'sa'"], "'sa' cannot mask documents: its random order"),
    (["efficient/MixerConfig.kind = 'sa_swa'"], "'sa_swa' cannot mask documents: its SA branch"),
    (["efficient/MixerConfig.kind = 'moba'"], "'moba' cannot mask documents: its gate"),
    (["ModelConfig.layer_pattern = 'F'", "full/MixerConfig.kind = 'ssa'"], "'ssa' cannot mask documents: its sparse"),
    (["efficient/MixerConfig.kind = 'lightning'"], "'lightning' cannot mask documents: its recurrent state"),
    (["efficient/MixerConfig.kind = 'mamba2'"], "'mamba2' cannot mask documents: its recurrent state"),
    (["efficient/MixerConfig.kind = 'gdn'"], "'gdn' cannot mask documents: its recurrent state"),
    (["full/MixerConfig.kind = 'attention_sink'", "full/MixerConfig.options = {'horizon': 8, 'sinks': 2}"],
     "'attention_sink' cannot mask documents: its sinks"),
    (["ModelConfig.attention_impl = 'cudnn'"], "attention_impl='cudnn' cannot mask documents"),
    (["ModelConfig.attention_impl = 'pallas'"], "attention_impl='pallas' cannot mask documents"),
    (["ModelConfig.attention_impl = 'jla'"], "attention_impl='jla' cannot mask documents"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=[m.split(" cannot")[0] for _, m in REFUSED])
def test_every_refusal_is_one_line_before_allocation(tiny_params, extra, message):
    with pytest.raises(ConfigError) as e:
        load_config([], tiny_params + extra + ["DataConfig.document_mask = True"])
    assert message in str(e.value) and "\n" not in str(e.value)
    load_config([], tiny_params + extra, validate=False)  # the same config without the mask is not refused here


@pytest.mark.parametrize("options", ["{'horizon': 8}", "{'horizon': 64, 'sinks': 2}"])
def test_sinks_run_where_they_are_attention_or_swa(tiny_params, options):
    load_config([], tiny_params + ["full/MixerConfig.kind = 'attention_sink'", f"full/MixerConfig.options = {options}",
                                   "DataConfig.document_mask = True"])


def test_auto_resolves_to_xla_on_a_gpu_and_info_shows_it(tiny_params, monkeypatch):
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    s = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
    for window in (None, 32):
        b, why = backends.attention_backend("auto", permuted=False, window=window, qkv=(s, s, s), segments=True)
        assert b == "xla" and why.startswith("auto: document_mask: only the XLA reference")
    assert backends.attention_backend("auto", permuted=False, window=None, qkv=(s, s, s))[0] == "cudnn"
    cfg = load_config([], tiny_params + ["DataConfig.document_mask = True", "ModelConfig.compute_dtype = 'bfloat16'"])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len, document_mask=True)
    assert {(r["op"], r["backend"]) for r in rows} == {("full", "xla"), ("swa w=8", "xla")}
    assert all("document_mask" in r["reason"] for r in rows)
    plain = describe.describe_layers(cfg.model, cfg.data.seq_len)
    assert {r["backend"] for r in plain if r["op"] == "full"} == {"cudnn"}


def test_info_reports_a_refused_layer(tiny_params):
    cfg = load_config([], tiny_params + ["efficient/MixerConfig.kind = 'mamba2'"])
    rows = describe.describe_layers(cfg.model, cfg.data.seq_len, document_mask=True)
    errors = [r for r in rows if r["op"] == "error"]
    assert errors and all(r["kind"] == "mamba2" and "cannot mask documents" in r["reason"] for r in errors)
