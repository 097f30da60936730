"""Who runs MoBA / SSA's sparse stream on the pallas path (the union or the per-token gather kernel,
decided by the selection), the removed ``ModelConfig.sparse_impl`` / ``selection_impl`` settings
(accepted, ignored with a warning, run ids unchanged), and the gather path against the reference end
to end."""

import jax
import numpy as np
import pytest
from conftest import TINY

from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.model.moba import moba_attend, sparse_kernel_backend
from hybrid_lm.ops import block_sparse as ops


def test_sparse_kernel_rule():
    assert sparse_kernel_backend("auto", "token", "ssa")[0] == "gather"  # measured faster (docs/KERNELS.md)
    assert sparse_kernel_backend("auto", "token", "moba")[0] == "union"  # per-head lists
    assert sparse_kernel_backend("auto", "block", "ssa")[0] == "union"
    assert sparse_kernel_backend("union", "token", "moba")[0] == "union"
    assert sparse_kernel_backend("gather", "token", "ssa")[0] == "gather"
    with pytest.raises(ValueError, match="gate='moba'"):  # per-head selection: not one list per group
        sparse_kernel_backend("gather", "token", "moba")
    with pytest.raises(ValueError, match="selection='block'"):
        sparse_kernel_backend("gather", "block", "ssa")
    with pytest.raises(ValueError, match="sparse_impl='fast'"):
        sparse_kernel_backend("fast", "token", "ssa")


REMOVED = ["ModelConfig.sparse_impl = 'gather'", "ModelConfig.selection_impl = 'fused'",
           "ModelConfig.loss_kernel = 'jla'", "ModelConfig.norm_kernel = 'pallas'",
           "ModelConfig.conv_kernel = 'xla'", "ModelConfig.gated_norm_kernel = 'pallas'"]


def test_removed_backend_settings_still_load_and_are_ignored(caplog):
    """Gin files written for the removed backend settings keep loading: each binding is ignored with
    one warning naming what decides instead; the config, its record and its run id are unchanged."""
    import logging

    from hybrid_lm.experiment import config_record

    base = load_config(["arch/ssa.gin"], TINY)
    with caplog.at_level(logging.WARNING, logger="hybrid_lm.config"):
        other = load_config(["arch/ssa.gin"], TINY + REMOVED)
    assert other == base and run_id(other) == run_id(base) and config_record(other) == config_record(base)
    for binding in REMOVED:
        name = binding.split("=")[0].strip()
        assert sum(name in r.getMessage() and "is no longer a setting" in r.getMessage()
                   for r in caplog.records) <= 1  # once per process
    assert not any(k in config_record(other)["model"] for k in ("sparse_impl", "norm_kernel", "loss_kernel"))


def test_run_dir_naming_removed_settings_keeps_resuming(tmp_path):
    """A config.json written with the removed fields reads back as the same config (no migration
    warning beyond the dropped fields, same run id)."""
    import json

    from hybrid_lm.experiment import config_record
    from hybrid_lm.run.directory import read_run_config

    cfg = load_config(["arch/ssa.gin"], TINY)
    old = json.loads(json.dumps(config_record(cfg), default=str))
    old["model"].update(sparse_impl="auto", selection_impl="auto", loss_kernel="auto", norm_kernel="auto",
                        conv_kernel="auto", gated_norm_kernel="auto")
    (tmp_path / "config.json").write_text(json.dumps({**old, "run_id": run_id(cfg)}))
    _, back = read_run_config(tmp_path / "config.json")
    assert back == cfg and run_id(back) == run_id(cfg)


@pytest.mark.integration  # the kernel path end to end
@pytest.mark.parametrize("H,K,T", [(4, 2, 80), (10, 1, 64)])
def test_moba_attend_gather_kernel_end_to_end(H, K, T):
    """The pallas path with the gather kernel equals the reference moba_attention (xla) in o, dq, dk, dv."""
    B, D, block, top_k = 1, 16, 16, 3
    ks = jax.random.split(jax.random.key(5), 4)
    q, k, v, do = (jax.random.normal(kk, s) for kk, s in zip(ks, [(B, T, H, D), (B, T, K, D), (B, T, K, D),
                                                                (B, T, H, D)]))

    def fwd_bwd(fn):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    got = jax.jit(lambda: fwd_bwd(lambda q, k, v: moba_attend(
        q, k, v, block_size=block, top_k=top_k, gate="ssa", selection="token", impl="pallas",
        sparse_impl="gather", interpret=True)))()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda: fwd_bwd(lambda q, k, v: ops.moba_attention(
            q, k, v, block_size=block, top_k=top_k, gate="ssa")))()
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        err = np.linalg.norm(np.asarray(g) - np.asarray(r)) / np.linalg.norm(np.asarray(r))
        assert err < 2e-5, (name, err)
