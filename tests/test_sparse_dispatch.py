"""Who runs MoBA / SSA's sparse stream on the pallas path: ``ModelConfig.sparse_impl`` (the union
or the per-token gather kernel) and ``ModelConfig.selection_impl`` reach the mixers, stay out of the
run id, and the gather path equals the reference end to end."""

import jax
import numpy as np
import pytest
from conftest import TINY

from hybrid_lm.experiment import load_config, run_id
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.moba import moba_attend, sparse_kernel_backend
from hybrid_lm.ops import block_sparse as ops


def test_sparse_kernel_rule():
    assert sparse_kernel_backend("auto", "token", "ssa")[0] == "gather"  # measured faster (docs/KERNELS.md)
    assert sparse_kernel_backend("auto", "token", "moba")[0] == "union"  # per-head lists
    assert sparse_kernel_backend("auto", "block", "ssa")[0] == "union"
    assert sparse_kernel_backend("union", "token", "moba")[0] == "union"
    assert sparse_kernel_backend("gather", "token", "ssa")[0] == "gather"
    with pytest.raises(ConfigError, match="gate='moba'"):  # per-head selection: not one list per group
        sparse_kernel_backend("gather", "token", "moba")
    with pytest.raises(ConfigError, match="selection='block'"):
        sparse_kernel_backend("gather", "block", "ssa")
    with pytest.raises(ConfigError, match="sparse_impl='fast'"):
        sparse_kernel_backend("fast", "token", "ssa")


def test_kernel_choices_are_not_the_experiment():
    base = load_config(["arch/ssa.gin"], TINY)
    other = load_config(["arch/ssa.gin"], TINY + ["ModelConfig.sparse_impl = 'gather'",
                                                  "ModelConfig.selection_impl = 'fused'"])
    assert (other.model.sparse_impl, other.model.selection_impl) == ("gather", "fused")
    assert run_id(other) == run_id(base)
    with pytest.raises(ConfigError, match="sparse_impl"):
        load_config(["arch/ssa.gin"], TINY + ["ModelConfig.sparse_impl = 'fast'"])


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
