"""Training-free attention swaps and the receptive-field constraint (horizon H + S sinks).

The op against an independent float64 oracle (forward, gradients, reach), the ``attention_sink``
mixer against ``attention`` / ``swa``, swap parsing and parameter checks, and evaluations of a tiny
trained 1:1 hybrid: the unswapped eval reproduces the trainer's, shrinking the full layers' context
raises the loss, a horizon covering the sequence changes nothing, and every row lands in eval.jsonl.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.experiment import load_config
from hybrid_lm.errors import ConfigError
from hybrid_lm.run.loss import paired_difference
from hybrid_lm.run.restore import RestoredRun, evaluate_checkpoint
from hybrid_lm.run.directory import read_eval_rows
from hybrid_lm.run.swap import SwapError, apply_swaps, parse_swap
from hybrid_lm.model.accounting import flops_per_token
from hybrid_lm.model.attention import FullAttention, SlidingWindowAttention
from hybrid_lm.model.constrained_attention import SinkAttention, sink_flops
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import causal_attention, windowed_attention
from hybrid_lm.ops.sink_attention import dense_sink_attention, mean_keys_per_query, sink_attention, sink_mask




def _qkv(seed, B, T, H, K, D, Dv=None):
    rng = np.random.default_rng(seed)  # numpy draws: eager jax.random compiles per shape (seconds)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32))
                 for s in ((B, T, H, D), (B, T, K, D), (B, T, K, Dv or D)))


def _np_oracle(q, k, v, horizon, sinks):
    """Independent float64 numpy oracle with the mask written out from the definition."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    mask = np.zeros((T, T), bool)
    for i in range(T):
        for j in range(i + 1):
            mask[i, j] = (i - j < horizon) or (j < sinks)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v), mask


# ----------------------------------------------------------------------------- the op

@pytest.mark.parametrize("T,H,K,horizon,sinks,block", [
    (37, 4, 2, 5, 3, 8),    # sinks outside the window for most queries
    (37, 2, 1, 1, 1, 8),    # horizon 1: the query itself plus one sink
    (37, 4, 2, 3, 6, 8),    # more sinks than the horizon: sinks inside the window must count once
    (29, 2, 2, 7, 0, 16),   # no sinks: SWA
    (29, 3, 1, 40, 4, 8),   # horizon beyond T: causal attention
    (21, 2, 1, 4, 30, 4),   # sinks beyond T: every key visible
])
def test_sink_attention_matches_the_oracle_forward_and_gradients(T, H, K, horizon, sinks, block):
    q, k, v = _qkv(T * 7 + horizon * 3 + sinks, 2, T, H, K, 8, Dv=6)
    op = jax.jit(lambda q, k, v: sink_attention(q, k, v, horizon, sinks, block_size=block))  # one compile
    out = op(q, k, v)
    ref, mask = _np_oracle(q, k, v, horizon, sinks)
    np.testing.assert_array_equal(sink_mask(T, horizon, sinks), mask)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert mean_keys_per_query(T, horizon, sinks) == pytest.approx(mask.sum() / T, abs=1e-12)

    proj = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape, np.float32))
    f_op = lambda *a: jnp.sum(op(*a) * proj)  # noqa: E731
    f_ref = lambda *a: jnp.sum(dense_sink_attention(*a, horizon, sinks) * proj)  # noqa: E731
    grads = jax.jit(jax.grad(f_op, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(f_ref, (0, 1, 2)))(q, k, v)
    for g1, g2 in zip(*grads):
        assert float(jnp.abs(g2).max()) > 1e-3
        np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


def test_gradients_reach_exactly_the_window_and_the_sinks():
    T, horizon, sinks = 20, 4, 3
    q, k, v = _qkv(1, 1, T, 2, 1, 8)
    jv = jax.jit(jax.jacrev(lambda v: sink_attention(q, k, v, horizon, sinks, block_size=8)))(v)  # [1,T,2,8,1,T,1,8]
    reach = np.abs(np.asarray(jv)).sum(axis=(0, 2, 3, 4, 6, 7)) > 0
    np.testing.assert_array_equal(reach, sink_mask(T, horizon, sinks))
    assert reach[T - 1, 0] and not reach[T - 1, sinks] and not reach[T - 1, T - 1 - horizon]


def test_limits_are_causal_attention_and_swa():
    q, k, v = _qkv(2, 2, 45, 4, 2, 16)
    causal = jax.jit(causal_attention)(q, k, v)
    for horizon, sinks in ((45, 0), (45, 7), (1000, 3)):
        np.testing.assert_allclose(jax.jit(sink_attention, static_argnums=(3, 4))(q, k, v, horizon, sinks), causal,
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(lambda *a: sink_attention(*a, 9, 0, block_size=16))(q, k, v),
                               jax.jit(lambda *a: windowed_attention(*a, 9, block_size=16))(q, k, v),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="horizon"):
        sink_attention(q, k, v, 0, 1)
    with pytest.raises(ValueError, match="sinks"):
        sink_attention(q, k, v, 4, -1)


def test_cost_is_linear_in_T():
    """No T x T intermediate: the largest array grows like T * (block + H + S)."""
    def largest(T):
        q, k, v = _qkv(0, 1, T, 2, 1, 8)
        jaxpr = jax.make_jaxpr(lambda a, b, c: sink_attention(a, b, c, 32, 4, block_size=32))(q, k, v)
        return max(np.prod(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars)
    assert largest(2048) < 2048 * 2048 / 8
    assert largest(4096) <= 2.2 * largest(2048)


# ----------------------------------------------------------------------------- the mixer

def _model_cfg():
    return ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, compute_dtype="float32")


def _randomized(cls, mc, seed=0):
    m = nnx.eval_shape(lambda: cls(_model_cfg(), mc, 0, rngs=nnx.Rngs(0)))  # no eager init compiles
    graphdef, state = nnx.split(m)
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    return nnx.merge(graphdef, jax.tree.unflatten(tree, [jnp.asarray(0.35 * rng.standard_normal(x.shape, np.float32))
                                                         for x in leaves]))


def test_sink_mixer_has_attention_parameters_and_reduces_to_attention_and_swa():
    T = 24
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, T, 32), np.float32))
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)), attention_impl="xla")

    def run(m):  # jitted (one compile per mixer instead of one per eager op)
        graphdef, state = nnx.split(m)
        return jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, ctx))(state, x)

    full = _randomized(FullAttention, MixerConfig(kind="attention"))
    y_full = run(full)
    for opts in ({"horizon": T, "sinks": 2}, {"horizon": 10 * T}):
        sink = _randomized(SinkAttention, MixerConfig(kind="attention_sink", options=opts))
        shapes = [jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param))) for m in (sink, full)]
        assert shapes[0] == shapes[1]  # wq, wk, wv, wo: a full-attention checkpoint loads unchanged
        np.testing.assert_array_equal(run(sink), y_full)  # the very same call: bitwise
    y_swa = run(_randomized(SlidingWindowAttention, MixerConfig(kind="swa", window=5)))
    np.testing.assert_array_equal(run(_randomized(SinkAttention, MixerConfig(kind="attention_sink",
                                                                             options={"horizon": 5}))), y_swa)
    sink = _randomized(SinkAttention, MixerConfig(kind="attention_sink", options={"horizon": 5, "sinks": 3}))
    q, k, v = sink.project_qkv(x, ctx.positions)
    ref, _ = _np_oracle(q, k, v, 5, 3)
    y = run(sink)
    np.testing.assert_allclose(y, sink.project_out(jnp.asarray(ref, jnp.float32)), rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(y - y_swa)).max() > 1e-3  # the sinks matter


def test_sink_mixer_options_and_flops(tiny_params):
    for bad in ("{}", "{'horizon': 0}", "{'horizon': 8, 'sinks': -1}", "{'horizon': 8, 'sink': 2}"):
        with pytest.raises(ConfigError):
            load_config([], tiny_params + ["full/MixerConfig.kind = 'attention_sink'",
                                           f"full/MixerConfig.options = {bad}"])
    cfg = load_config([], tiny_params + ["full/MixerConfig.kind = 'attention_sink'",
                                         "full/MixerConfig.options = {'horizon': 8, 'sinks': 2}"])
    T = cfg.data.seq_len
    f = sink_flops(cfg.model, cfg.model.full, T)
    m = cfg.model
    assert f["mixing"] == pytest.approx(4.0 * m.n_heads * m.resolved_head_dim * sink_mask(T, 8, 2).sum() / T)
    per = flops_per_token(cfg.model, T)["per_layer_type"]
    assert per["F:attention_sink"]["mixing"] < per["E:swa"]["mixing"] * 2  # ~10 keys vs 8: linear, not T^2


# ----------------------------------------------------------------------------- swap specs

def test_parse_and_apply_swaps(tiny_params):
    s = parse_swap("efficient=sa:64,eval_draws=4,per_example=False,gate='x'")
    assert (s.slot, s.kind, s.size) == ("efficient", "sa", 64)
    assert dict(s.options) == {"eval_draws": 4, "per_example": False, "gate": "x"}
    model = load_config([], tiny_params).model  # 1:1, full attention + swa(8)
    m = apply_swaps(model, ["full=swa:4", "E=sa:16"])
    assert (m.full.kind, m.full.window, m.efficient.kind, m.efficient.window) == ("swa", 4, "sa", 16)
    assert m.full.rope == model.full.rope and m.n_layers == model.n_layers
    m = apply_swaps(model, ["full=moba:32,block_size=8"])
    assert m.full.options == {"block_size": 8, "top_k": 4} and m.full.window is None
    m = apply_swaps(model, [], horizon=16, sinks=2)
    assert m.full.kind == "attention_sink" and m.full.options == {"horizon": 16, "sinks": 2}
    assert m.efficient == model.efficient
    bad = [
        (["full=swa"], "needs a window"), (["middle=swa:4"], "slot"), (["full=swa:x"], "integer"),
        (["full=attention:8"], "takes no window"), (["full=moba:30,block_size=8"], "multiple"),
        (["full=moba:32,block_size=8,top_k=2"], "contradicts"), (["full=nope:4"], "unknown mixer"),
        (["full=swa:4", "full=sa:4"], "two swaps"), (["full=sa:4,bogus=1"], "unknown options"),
    ]
    for swaps, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            apply_swaps(model, swaps)
    with pytest.raises(SwapError, match="needs a horizon"):
        apply_swaps(model, [], sinks=2)
    with pytest.raises(SwapError, match="full slot is 'swa'"):
        apply_swaps(model, ["full=swa:4"], horizon=8)
    with pytest.raises(SwapError, match="no full layers"):
        apply_swaps(load_config([], tiny_params + ["ModelConfig.layer_pattern = '0:1'"]).model, ["full=swa:4"])


# ----------------------------------------------------------------------------- a trained tiny 1:1 hybrid

STEPS = 60  # enough for the full layer to use its context (at 40 steps the model is still ~unigram)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("swap_run")
    cfg = load_config([], list(TINY) + [f"TrainConfig.steps = {STEPS}", f"TrainConfig.eval_every = {STEPS}",
                                        "TrainConfig.global_batch = 16", "OptimConfig.lr = 1e-2",
                                        "CheckpointConfig.every_steps = 1000"])
    assert cfg.model.layer_types() == ["F", "E"]
    res = train(cfg, wd)
    return wd, res.final_eval, RestoredRun(wd)


def test_unswapped_eval_reproduces_the_trainer(trained):
    wd, final, ev = trained
    assert ev.step == STEPS
    r = ev.evaluate()
    assert r["loss"] == final["loss"] and r["bpb"] == final["bpb"] and r["eval_windows"] == final["eval_windows"]
    assert r["delta_loss"] == 0.0 and r["trained_eval_loss"] == final["loss"]
    assert r["delta_loss_se"] == 0.0 and r["loss_se"] == final["loss_se"] > 0  # paired: the same windows
    assert r["window_losses"] == final["window_losses"] and len(r["window_losses"]) == r["eval_windows"]
    assert r["attention_backends"] == {"full": "xla", "swa w=8": "xla"}  # what each call resolved to
    assert final["loss"] < 3.0  # the model learnt context (uniform: 5.55; unigram: ~3.1 nats)


def test_shrinking_the_full_layers_context_raises_the_loss(trained):
    _, final, ev = trained
    base = final["loss"]
    w1, w2, w4 = (ev.evaluate([f"full=swa:{w}"])["loss"] for w in (1, 2, 4))
    assert w1 > w2 > base + 0.02, (w1, w2, base)  # less context, higher loss
    assert w4 > base
    # paired over the same windows, the difference is known far better than either loss
    swapped = ev.evaluate(["full=swa:4"], record=False)
    d, se = paired_difference(swapped["window_losses"], final["window_losses"])
    assert abs(d - (w4 - base)) < 1e-5 and 0 < se < np.hypot(swapped["loss_se"], final["loss_se"])
    # the constraint without sinks is SWA of window H (the same call), and a horizon >= seq_len is
    # no constraint at all: exactly the unswapped numbers
    assert ev.evaluate(horizon=4)["loss"] == w4
    for horizon, sinks in ((32, 0), (32, 4), (1000, 2)):
        r = ev.evaluate(horizon=horizon, sinks=sinks)
        assert r["loss"] == base, (horizon, sinks)
        assert (r["horizon"], r["sinks"]) == (horizon, sinks) and r["mixers"]["full"]["kind"] == "attention_sink"
    assert ev.evaluate(horizon=2, sinks=1)["loss"] > base + 0.02


def test_sa_swap_runs_and_rows_are_recorded(trained):
    wd, final, ev = trained
    n0 = len(read_eval_rows(wd))
    r = ev.evaluate(["efficient=sa:8"])
    assert np.isfinite(r["loss"]) and r["loss"] != final["loss"] and abs(r["loss"] - final["loss"]) < 0.5
    rows = read_eval_rows(wd)
    assert len(rows) == n0 + 1 and rows[-1] == json.loads(json.dumps(r))
    last = rows[-1]
    assert last["swaps"] == ["efficient=sa:8"] and last["checkpoint_step"] == STEPS and last["horizon"] is None
    assert last["mixers"]["efficient"]["kind"] == "sa" and last["mixers"]["efficient"]["window"] == 8
    assert last["trained_mixers"]["efficient"] == {"kind": "swa", "window": 8, "options": {}, "rope": True}
    assert last["seq_len"] == 32 and last["layer_types"] == "FE"


def test_a_swap_that_changes_the_parameters_is_refused_before_restoring(trained):
    wd = trained[0]
    with pytest.raises(SwapError, match=r"(?s)changes the parameters.*w_gate_sa.*not in the checkpoint"):
        evaluate_checkpoint(wd, ["efficient=sa_swa:8"])
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 7"):
        RestoredRun(wd, step=7)


def test_cli_eval(trained, capsys):
    from hybrid_lm.cli import main

    wd, final, _ = trained
    n0 = len(read_eval_rows(wd))
    assert main(["eval", str(wd), "--swap", "full=swa:2", "--baseline", "--json"]) == 0
    base, swapped = json.loads(capsys.readouterr().out)
    assert base["loss"] == final["loss"] and swapped["loss"] > base["loss"] and swapped["swaps"] == ["full=swa:2"]
    assert main(["eval", str(wd), "--seq-len", "64", "--horizon", "8", "--sinks", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 tokens + 2 sinks" in out and "bits/byte" in out
    rows = read_eval_rows(wd)
    assert len(rows) == n0 + 3
    assert rows[-1]["seq_len"] == 64 and rows[-1]["horizon"] == 8 and "trained_eval_loss" not in rows[-1]
    assert main(["eval", str(wd), "--swap", "efficient=gdn"]) == 2  # parameters differ: a message, code 2
    assert "changes the parameters" in capsys.readouterr().err
    assert main(["eval", str(wd / "nowhere")]) == 2


def test_cli_generate(trained, capsys):
    """`hybrid-lm generate` on the trained run: greedy is reproducible, sampling follows the seed, and
    the continuation equals generate() on the restored parameters."""
    from hybrid_lm.cli import main
    from hybrid_lm.eval.generate import generate
    from hybrid_lm.step import ModelFns
    wd, _, ev = trained
    capsys.readouterr()
    assert main(["generate", str(wd), "--prompt", "The ", "--max-new", "12", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["checkpoint_step"] == STEPS and len(row["tokens"]) == 12 and row["prompt"] == "The "
    want = generate(ModelFns(ev.cfg).model(ev.params), jnp.asarray([[84, 104, 101, 32]]), 12)
    assert row["tokens"] == np.asarray(want[0]).tolist()
    assert main(["generate", str(wd), "--prompt", "The ", "--max-new", "5", "--temperature", "0.8",
                 "--top-k", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("The ")
    assert main(["generate", str(wd), "--prompt", "", "--max-new", "5"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", str(wd / "nowhere"), "--prompt", "x"]) == 2


def test_longppl_on_the_trained_run(trained, capsys):
    """Thresholds that make every token past K key turn LongPPL into the perplexity of those tokens
    (checked against the model's own forward pass); a fixed evaluator marks keys that score the
    evaluated run; the CLI prints and records a row."""
    from hybrid_lm.cli import main
    from hybrid_lm.eval.longppl import KeyTokenRule, evaluate_longppl, nll_per_token
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.step import ModelFns
    wd, _, ev = trained
    everything = KeyTokenRule(trunc_len=16, window=8, alpha=-1e9, beta=-1e9)
    row = evaluate_longppl(wd, length=48, docs=3, rule=everything, record=False, progress=False, inputs="windows")
    assert row["self_evaluator"] and row["n_token"] == 3 * 48 and row["n_scored"] == 3 * 47 and row["n_key"] == 3 * 32
    docs = jnp.asarray(ev.streams(swapped_config(ev.cfg, seq_len=47, eval_windows=3)).eval_batch)
    model = ModelFns(ev.cfg).model(ev.params)
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(47), (3, 47)), train=False)
    nll = np.asarray(nll_per_token(lambda x: model(x, ctx), docs))  # positions 1 .. 47
    assert row["longppl"] == pytest.approx(float(np.exp(nll[:, 15:].mean())), rel=1e-4)
    assert row["ppl"] == pytest.approx(float(np.exp(nll.mean())), rel=1e-4)
    # the default inputs: whole val documents of the run's store, their first 48 tokens
    from hybrid_lm.data.store import TokenStore
    whole = evaluate_longppl(wd, length=48, docs=3, rule=everything, record=False, progress=False)
    assert whole["documents"] == "store val documents" and whole["doc_lengths"] == [48] * 3
    assert whole["evaluator"] == "newest" and whole["self_evaluator"]
    val = TokenStore(whole["store"]).split("val")
    first = np.flatnonzero(val.doc_lengths - len(ev.tokenizer.separator) >= 48)[:3]
    rows = jnp.asarray(np.stack([val.read(int(val.doc_starts[i]), 48) for i in first]).astype(np.int32))
    ctx = MixerContext(positions=jnp.broadcast_to(jnp.arange(47), (3, 47)), train=False)
    nll = np.asarray(nll_per_token(lambda x: model(x, ctx), rows))
    assert whole["longppl"] == pytest.approx(float(np.exp(nll[:, 15:].mean())), rel=1e-4)
    paper = evaluate_longppl(wd, length=48, docs=3, rule=KeyTokenRule(trunc_len=16, window=8),
                             record=False, progress=False)
    assert paper["longppl"] is None or paper["longppl"] < math.exp(2)  # self-LongPPL < e^2 by construction
    # a separate evaluator run (here a copy of the same checkpoint: the same keys and value)
    import shutil
    judge = wd.parent / "longppl_judge"
    shutil.copytree(wd, judge, dirs_exist_ok=True)
    fixed = evaluate_longppl(wd, evaluator=judge, length=48, docs=3, rule=KeyTokenRule(trunc_len=16, window=8,
                             alpha=0.2, beta=-3), record=False, progress=False)
    same = evaluate_longppl(wd, length=48, docs=3, rule=KeyTokenRule(trunc_len=16, window=8, alpha=0.2, beta=-3),
                            record=False, progress=False)
    assert not fixed["self_evaluator"] and fixed["evaluator"] == str(judge)
    assert (fixed["n_key"], fixed["longppl"]) == pytest.approx((same["n_key"], same["longppl"]), rel=1e-5)
    # the evaluator's keys are cached in its run dir and reused; a torn cache is recomputed
    again = evaluate_longppl(wd, evaluator=judge, length=48, docs=3, rule=KeyTokenRule(trunc_len=16, window=8,
                             alpha=0.2, beta=-3), record=False, progress=False)
    assert not fixed["keys_cached"] and again["keys_cached"] and again["key_cache"] == fixed["key_cache"]
    assert (again["n_key"], again["longppl"]) == (fixed["n_key"], fixed["longppl"])
    Path(fixed["key_cache"]).write_bytes(b"torn")
    third = evaluate_longppl(wd, evaluator=judge, length=48, docs=3, rule=KeyTokenRule(trunc_len=16, window=8,
                             alpha=0.2, beta=-3), record=False, progress=False)
    assert not third["keys_cached"] and third["n_key"] == fixed["n_key"]
    # a copy of the evaluator's results without its checkpoints (a study part landed earlier): its step named,
    # the cached keys score the run as the evaluator itself did; without the cache it says what is missing
    landed = wd.parent / "longppl_judge_landed"
    shutil.copytree(judge, landed, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
    rule = KeyTokenRule(trunc_len=16, window=8, alpha=0.2, beta=-3)
    copied = evaluate_longppl(wd, evaluator=landed, evaluator_step=ev.step, length=48, docs=3, rule=rule,
                              record=False, progress=False)
    assert copied["keys_cached"] and (copied["n_key"], copied["longppl"]) == (fixed["n_key"], fixed["longppl"])
    shutil.rmtree(landed / "longppl_keys")
    with pytest.raises(FileNotFoundError):
        evaluate_longppl(wd, evaluator=landed, evaluator_step=ev.step, length=48, docs=3, rule=rule, record=False,
                         progress=False)
    capsys.readouterr()
    assert main(["longppl", str(wd), "--evaluator", str(wd), "--length", "48", "--docs", "2",
                 "--trunc-len", "16", "--window", "8", "--alpha", "0.5"]) == 0
    assert "LongPPL" in capsys.readouterr().out
    assert read_eval_rows(wd)[-1]["kind"] == "longppl"
    assert main(["longppl", str(wd), "--length", "10", "--trunc-len", "16"]) == 2
    assert "no token beyond" in capsys.readouterr().err
