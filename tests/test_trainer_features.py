import jax
import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.run.checkpoint import Checkpointer
from hybrid_lm.train.loop import train
from hybrid_lm.run.metrics import read_metrics
from hybrid_lm.train.optim import make_optimizer, muon_routing, optimizer_for_bounds, wsd_bounds
from hybrid_lm.step import ModelFns, StateInit, make_train_step
from resume_check import final_state  # test tooling in tests/


@pytest.mark.integration
def test_gradient_accumulation_equals_the_large_batch(tiny_params):
    cfg1 = load_config([], tiny_params + ["TrainConfig.global_batch = 8"])
    cfg4 = load_config([], tiny_params + ["TrainConfig.global_batch = 8", "TrainConfig.microbatches = 4"])
    outs = []
    for cfg in (cfg1, cfg4):
        fns = ModelFns(cfg)
        build = optimizer_for_bounds(cfg.optim, fns.axes)
        bounds = np.asarray(wsd_bounds(cfg.optim, 10), np.int32)
        state = StateInit(fns, build(bounds)[0])(0)
        tokens = jax.random.randint(jax.random.key(3), (8, 33), 0, 256)
        step = jax.jit(make_train_step(fns, build))
        for _ in range(3):
            state, stats = step(state, tokens, bounds)
        outs.append((state, stats))
    (s1, st1), (s4, st4) = outs
    assert float(st1["loss"]) == pytest.approx(float(st4["loss"]), rel=1e-5)
    assert float(st1["grad_norm"]) == pytest.approx(float(st4["grad_norm"]), rel=1e-4)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam amplifies fp rounding


@pytest.mark.integration
def test_muon_routes_by_logical_axes_and_trains(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["OptimConfig.name = 'muon'", "ModelConfig.tie_embeddings = False",
                                         "TrainConfig.steps = 25", "OptimConfig.lr = 0.01"])
    routing = muon_routing(ModelFns(cfg).axes)
    blk = routing["blocks"][0]
    assert blk["mixer"]["wq"].output_axis == (1, 2) and blk["mixer"]["wq"].reduction_axis == 0  # [d,H,Dh] as [d,H*Dh]
    assert blk["mixer"]["wo"].reduction_axis == (0, 1) and blk["mixer"]["wo"].output_axis == 2
    assert blk["mlp"]["w_up"] is not None and blk["mixer_norm"]["scale"] is None
    assert routing["embed"]["table"] is None and routing["lm_head"] is None  # vocab axes -> AdamW
    from hybrid_lm.train.optim import muon_dims
    assert muon_dims(("embed", "heads")) is None and muon_dims(("ssm_heads",)) is None  # gates, A_log
    assert muon_dims(("embed", "conv_dim")) is not None and muon_dims(("conv_kernel", "conv_dim")) is None
    train(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl", "train")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_policy(tiny_params, tmp_path, policy):
    cfg = load_config([], tiny_params + ["OptimConfig.lr = 1e30", "OptimConfig.grad_clip = 0.0",
                                         "OptimConfig.warmup_steps = 1", "TrainConfig.steps = 12",
                                         f"TrainConfig.nan_policy = '{policy}'",
                                         "TrainConfig.max_consecutive_skips = 100"])  # every step after 1 is non-finite
    if policy == "stop":
        with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step \d+"):
            train(cfg, tmp_path)
        return
    res = train(cfg, tmp_path)
    assert res.skipped_steps > 0 and res.step == 12
    state = final_state(tmp_path)
    assert all(np.all(np.isfinite(v)) for v in state.values() if v.dtype.kind == "f")


@pytest.mark.integration
def test_retention_keeps_newest_and_permanent(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["TrainConfig.steps = 24", "CheckpointConfig.every_steps = 2",
                                         "CheckpointConfig.keep = 2", "CheckpointConfig.permanent_every = 10"])
    train(cfg, tmp_path)
    steps = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint).all_steps()
    assert steps == [10, 20, 22, 24], steps


@pytest.mark.integration
def test_remat_gives_the_same_loss_and_gradients(tiny_params):
    losses = []
    params = None
    for remat in ("none", "full", "dots", "dots_attn"):
        cfg = load_config([], tiny_params + [f"ModelConfig.remat = '{remat}'"])
        fns = ModelFns(cfg)
        params = fns.init(0) if params is None else params  # remat does not change the parameters
        tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, 256)
        ids = jax.numpy.arange(2)
        (loss, _), g = jax.jit(jax.value_and_grad(lambda p: fns.loss(p, tokens, 0, ids), has_aux=True))(params)
        losses.append((float(loss), g))
    for loss, g in losses[1:]:
        assert loss == pytest.approx(losses[0][0], rel=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(losses[0][1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dots_attn_saves_the_attention_kernels_outputs():
    """remat 'dots_attn' keeps a kernel's output and softmax statistics for the backward pass ('dots'
    recomputes the kernel's forward there): checked on the Pallas windowed kernel in interpret mode."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    import hybrid_lm_kernels as kernels
    from hybrid_lm.model.transformer import _REMAT_POLICIES

    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))

    def saved(policy):
        buf = io.StringIO()
        f = jax.checkpoint(lambda x: (kernels.windowed_attention(x, x, x, None, 16) ** 2).sum(), policy=policy)
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(f, q)
        # the kernel's residuals (the entry point is jitted, so they are named after it)
        return [line for line in buf.getvalue().splitlines() if "pallas_call" in line or "windowed_attention" in line]

    assert saved(_REMAT_POLICIES["dots"]) == []
    kept = saved(_REMAT_POLICIES["dots_attn"])
    assert len(kept) == 2 and any("f32[1,2,64]" in line for line in kept), kept  # output + statistics


def test_dots_attn_saves_the_sparse_selection():
    """remat 'dots_attn' keeps the selected blocks of a MoBA/SSA layer ('dots' reruns the whole
    selection, gate scores and top-k passes, in the backward pass)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from hybrid_lm.model.moba import moba_attend
    from hybrid_lm.model.transformer import _REMAT_POLICIES

    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
    kv = jax.random.normal(jax.random.key(1), (1, 64, 1, 16))

    def saved(policy, sparse_impl):
        def loss(x):
            o = moba_attend(x, kv, kv, block_size=16, top_k=2, gate="ssa", selection="token", impl="pallas",
                            sparse_impl=sparse_impl, interpret=True)
            return (o ** 2).sum()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(jax.checkpoint(loss, policy=policy), q)
        return [line for line in buf.getvalue().splitlines() if "sparse_selection" in line]

    for sparse_impl in ("union", "gather"):
        assert saved(_REMAT_POLICIES["dots"], sparse_impl) == []
        kept = saved(_REMAT_POLICIES["dots_attn"], sparse_impl)
        assert len(kept) == 1 and "i32[1,64,1,2]" in kept[0], kept


@pytest.mark.integration
def test_profiler_traces_a_window(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["TrainConfig.steps = 6", "TrainConfig.profile_start = 2",
                                         "TrainConfig.profile_steps = 2"])
    train(cfg, tmp_path)
    assert any((tmp_path / "profile").rglob("*.xplane.pb"))


@pytest.mark.integration
def test_time_interval_saves_temporary_checkpoints(tiny_params, tmp_path):
    cfg = load_config([], tiny_params + ["TrainConfig.steps = 6", "CheckpointConfig.every_steps = 1000",
                                         "CheckpointConfig.interval_minutes = 1e-6", "CheckpointConfig.keep = 10"])
    train(cfg, tmp_path)
    steps = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint).all_steps()
    assert steps == [1, 2, 3, 4, 5, 6], steps  # the step cadence alone would save only the final step


@pytest.mark.integration
def test_z_loss_joins_the_objective_but_not_the_logged_loss(tiny_params):
    base = load_config([], tiny_params)
    zl = load_config([], tiny_params + ["OptimConfig.z_loss = 1e-2"])
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, 256)
    ids = jax.numpy.arange(2)
    o0, a0 = ModelFns(base).loss(ModelFns(base).init(0), tokens, 0, ids)
    fns = ModelFns(zl)
    o1, a1 = fns.loss(fns.init(0), tokens, 0, ids)
    assert float(a0["ce"]) == pytest.approx(float(a1["ce"]), rel=1e-6) and float(o0) == pytest.approx(float(a0["ce"]))
    logits = fns.model(fns.init(0))(tokens[:, :-1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    assert float(o1) == pytest.approx(float(a1["ce"]) + 1e-2 * float(jax.numpy.mean(lse ** 2)), rel=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_run_length_is_a_runtime_input_of_the_step(tiny_params, optimizer):
    """One compiled step serves every run length (WSD bounds passed at run time) and equals the
    step with the run length compiled in, for a run in its decay phase and one still stable."""
    cfg = load_config([], tiny_params + ["TrainConfig.global_batch = 4", f"OptimConfig.name = '{optimizer}'",
                                         "ModelConfig.tie_embeddings = False", "OptimConfig.warmup_steps = 1"])
    fns = ModelFns(cfg)
    build = optimizer_for_bounds(cfg.optim, fns.axes)
    runtime_step = jax.jit(make_train_step(fns, build))
    tokens = jax.random.randint(jax.random.key(4), (4, 33), 0, 256)
    last_lr = {}
    for total in (10, 400):  # decaying over the last 2 of 10 steps / constant
        tx, sched = make_optimizer(cfg.optim, total, fns.axes)
        params = fns.init(0)
        s_fixed = s_run = {"params": params, "opt_state": tx.init(params), "step": jax.numpy.zeros((), jax.numpy.int32)}
        fixed_step = jax.jit(make_train_step(fns, lambda _bounds, fixed=(tx, sched): fixed))  # run length compiled in
        bounds = np.asarray(wsd_bounds(cfg.optim, total), np.int32)
        for _ in range(10):
            s_fixed, st_fixed = fixed_step(s_fixed, tokens, bounds)
            s_run, st_run = runtime_step(s_run, tokens, bounds)
            assert float(st_run["lr"]) == pytest.approx(float(st_fixed["lr"]), rel=1e-6)
        for a, b in zip(jax.tree.leaves(s_fixed), jax.tree.leaves(s_run)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        last_lr[total] = float(st_run["lr"])
    assert last_lr[10] < last_lr[400]  # the bounds really differ between the two runs
    assert runtime_step._cache_size() == 1  # and one compiled step served both


@pytest.mark.integration
def test_model_on_the_loss_kernel_equals_xla(monkeypatch):
    """ModelFns.loss and its gradients with the chunked loss's softmax pass on the Pallas kernel
    (interpreted on the CPU; what ``auto`` runs on one GPU) equal the XLA pass (fp32, 2 layers,
    vocabulary 300, a z-loss and a tail chunk): loss to 1e-6, gradients to 1e-4."""
    import jax.numpy as jnp
    from conftest import TINY

    from hybrid_lm import step as step_mod

    base = TINY + ["ModelConfig.vocab_size = 300", "DataConfig.seq_len = 48", "ModelConfig.loss_impl = 'chunked'",
                   "ModelConfig.loss_chunk = 40", "OptimConfig.z_loss = 1e-3"]
    tokens = jax.random.randint(jax.random.key(1), (3, 49), 0, 300)
    out = {}
    for kern in ("xla", "pallas"):
        monkeypatch.setattr(step_mod, "loss_kernel_backend", lambda kern=kern: (kern, "test"))
        fns = ModelFns(load_config([], base))
        out[kern] = jax.value_and_grad(lambda p: fns.loss(p, tokens, jnp.int32(0), jnp.arange(3))[0])(fns.init(0))
    kernel = "pallas"
    (lx, gx), (lp, gp) = out["xla"], out[kernel]
    np.testing.assert_allclose(float(lp), float(lx), rtol=1e-6)
    assert jax.tree.structure(gx) == jax.tree.structure(gp)
    for a, b in zip(jax.tree.leaves(gx), jax.tree.leaves(gp)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(a))))
