"""MoBA block-sparse attention mixer (``moba``); the op is ``hybrid_lm/ops/block_sparse.py``.

Same parameters as full attention (GQA q/k/v/o, RoPE or NoPE): only the set of keys each query sees
changes. Selection runs on the RoPE'd q and k, as in both references (MoBA and SSA/NSA).

Backends (``attention_impl``): ``xla`` = the O(T*k*block) reference in ``ops/block_sparse.py``;
``pallas`` = the block-sparse kernel (``hybrid_lm_kernels.block_sparse_attention``, blocks that are
powers of two >= 16); ``auto`` = pallas on a GPU for those blocks, else xla
(``hybrid_lm.backends.moba_backend``). cuDNN and jla cannot express the mask.

Selection on the pallas path (:func:`selection_backend`): ``xla`` runs the reference
``ops.select_blocks``; ``split_bf16`` runs two kernels, the gate's importance
(``hybrid_lm_kernels.block_importance`` on bf16 operands, as NSA's top-k kernel) and then its rows'
top-k (``top_k_blocks``): ``auto``'s choice for per-token selection with the ssa gate. The kernels
give the reference's blocks up to near-ties of the scores (bf16 operands round the block means;
``tests/test_kernels_selection.py``). The sparse kernel (:func:`sparse_kernel_backend`): the union
kernel, or the per-token gather kernel where the selection is shared by a GQA group. The xla path
keeps the reference's chunked selection + attention. Neither choice is a config setting: ``auto``
decides, and tests and benchmarks pass the others to :func:`moba_attend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from hybrid_lm.backends import moba_backend, record_backend, sparse_decode_backend
from hybrid_lm.config import MixerConfig, ModelConfig
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.accounting import attention_mixing_flops
from hybrid_lm.model.attention import Attention, AttentionDecode, attention_projection_flops
from hybrid_lm.model.registry import MixerContext, register_mixer
from hybrid_lm.ops import block_sparse as ops


@dataclass(frozen=True)
class MobaOptions:
    """Defaults: SSA's from-scratch MoBA baseline (block 16, top-16, NSA-style gate), see the docs.

    The official MoBA recipe (raw per-head gate, block 4096, top-12) targets >= 32K contexts; at our
    sequence lengths it would be full attention (T <= block * top_k). Set ``gate='moba'`` and a
    block of 512+ for the official gate.
    """

    _mixer: ClassVar[str] = "moba"  # names the mixer in errors (SSAOptions extends this)
    block_size: int = 16  # tokens per key block
    top_k: int = 16  # selected blocks per query, counting its own (always selected, causal inside)
    gate: str = "ssa"  # ssa: softmax importance summed over the GQA group; moba: raw q.mean(k) per head
    selection: str = "token"  # token: every query token selects (the references); block: per query block

    def validate(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"{self._mixer} option block_size={self.block_size!r} must be an int >= 1")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"{self._mixer} option top_k={self.top_k!r} must be an int >= 1 "
                              "(it counts the own block)")
        if self.gate not in ops.GATES:
            raise ConfigError(f"{self._mixer} option gate={self.gate!r}: choose one of {ops.GATES}")
        if self.selection not in ops.SELECTIONS:
            raise ConfigError(f"{self._mixer} option selection={self.selection!r}: choose one of {ops.SELECTIONS}")


SELECTION_IMPLS = ("auto", "split_bf16", "xla")


def selection_backend(selection_impl: str, selection: str, gate: str = "ssa") -> tuple[str, str]:
    """``(split_bf16 | xla, reason)``: who selects the blocks on the pallas path.

    ``auto``, by measurement on the H200 (docs/KERNELS.md): ``split_bf16`` for per-token selection
    with the ``ssa`` gate (S5 selection alone, T = 16K, B = 2: 1.47 ms against 3.35 ms for the XLA
    reference), else the reference ``ops.select_blocks``. The kernels run per-token selection only
    (``selection='block'`` is refused)."""
    if selection_impl not in SELECTION_IMPLS:
        raise ValueError(f"selection_impl={selection_impl!r}: choose one of {SELECTION_IMPLS}")
    if selection_impl == "xla":
        return "xla", "selection_impl='xla' asked for"
    if selection_impl == "split_bf16":
        if selection != "token":
            raise ValueError("selection_impl='split_bf16' runs per-token selection only; selection='block' "
                             "uses the reference (ops.select_blocks)")
        return "split_bf16", "gate kernel (bf16 operands), then top-k kernel"
    if selection == "token" and gate == "ssa":
        return "split_bf16", ("auto: per-token ssa gate -> gate kernel on bf16 operands + top-k kernel (H200: "
                              "0.44x the XLA selection's time, docs/KERNELS.md)")
    if selection == "token":
        return "xla", "auto: the XLA selection for the per-head moba gate (the kernels are timed on the ssa gate)"
    return "xla", "auto: per-block selection scores nb rows (reference ops.select_blocks)"


SPARSE_IMPLS = ("auto", "union", "gather")


def sparse_kernel_backend(sparse_impl: str, selection: str, gate: str) -> tuple[str, str]:
    """``(union | gather, reason)``: the sparse kernel on the pallas path. ``union``
    (``kernels.block_sparse_attention``): a query tile visits the union of its rows' blocks, any
    selection. ``gather`` (``kernels.gather_sparse_attention``): one token's query heads of a GQA
    group over that token's own blocks only, so per-token selection shared by the group (the ``ssa``
    gate). ``auto`` picks ``gather`` wherever it applies (measured faster in a train step,
    docs/KERNELS.md), else ``union``."""
    if sparse_impl not in SPARSE_IMPLS:
        raise ValueError(f"sparse_impl={sparse_impl!r}: choose one of {SPARSE_IMPLS}")
    gather_applies = selection == "token" and gate == "ssa"  # one list per token and GQA group
    if sparse_impl == "gather":
        if not gather_applies:
            raise ValueError("sparse_impl='gather' runs per-token selection shared by a GQA group (selection="
                              f"'token', gate='ssa'); got selection={selection!r}, gate={gate!r}: use union")
        return "gather", "sparse_impl='gather': per-token gather kernel"
    if sparse_impl == "union":
        return "union", "sparse_impl='union' asked for"
    if gather_applies:
        return "gather", ("auto: per-token selection shared by the GQA group -> the gather kernel (H200, S5 "
                          "train step: arch/moba.gin 0.72x, arch/ssa.gin 0.65x the union kernel's, docs/KERNELS.md)")
    return "union", "auto: the union kernel (per-block selection or per-head gate)"


def moba_attend(q, k, v, *, block_size: int, top_k: int, gate: str, selection: str, impl: str,
                label: str = "moba", selection_impl: str = "auto", sparse_impl: str = "auto",
                interpret: bool = False):
    """Selection + block-sparse causal attention on the chosen backend (shared by moba and ssa),
    recorded as ``"{label} block={block_size}"``. On the pallas path ``selection_impl`` picks the
    selection (:func:`selection_backend`) and ``sparse_impl`` the kernel
    (:func:`sparse_kernel_backend`); ``interpret`` runs the Pallas kernels in interpret mode (CPU
    tests)."""
    impl, reason = moba_backend(impl, block_size)
    if impl == "pallas":
        sel_impl, sel_reason = selection_backend(selection_impl, selection, gate)
        kernel, kernel_reason = sparse_kernel_backend(sparse_impl, selection, gate)
        record_backend(f"{label} block={block_size}", impl if kernel == "union" else "pallas-gather",
                       f"{reason}; selection: {sel_reason}; kernel: {kernel_reason}")
        try:
            import hybrid_lm_kernels as kernels  # may not import here (backends.py picks xla then)
        except ImportError as e:
            raise ConfigError(f"attention_impl='pallas' needs the Pallas kernels (hybrid_lm_kernels): {e}") from None
        if sel_impl == "split_bf16":
            kbar = ops.block_means(jax.lax.stop_gradient(k), block_size)
            idx = kernels.select_blocks_split(q, kbar, block_size=block_size, top_k=top_k, gate=gate,
                                              interpret=interpret, dot_dtype="bfloat16")
        else:  # the reference, kept beside the kernel
            idx = ops.select_blocks(q, k, block_size=block_size, top_k=top_k, gate=gate, selection=selection)
        idx = checkpoint_name(idx, "sparse_selection")  # remat 'dots_attn' keeps it (model/transformer.py)
        if kernel == "gather":
            return kernels.gather_sparse_attention(q, k, v, idx, block_size=block_size, interpret=interpret)
        return kernels.block_sparse_attention(q, k, v, idx, block_size=block_size, interpret=interpret)
    record_backend(f"{label} block={block_size}", impl, reason)
    return ops.moba_attention(q, k, v, block_size=block_size, top_k=top_k, gate=gate, selection=selection)


def moba_mean_keys(seq_len: int, block_size: int, top_k: int) -> float:
    """Exact mean over query positions of the keys a query attends to.

    Query t sees ``t % b + 1`` keys of its own block plus ``b * min(top_k - 1, t // b)`` keys of
    complete past blocks.
    """
    T, b = seq_len, block_size
    total = 0
    for c in range(-(-T // b)):  # queries of block c: n of them, own-block counts 1..n
        n = min(b, T - c * b)
        total += n * (n + 1) // 2 + n * b * min(top_k - 1, c)
    return total / T


def moba_gate_dots(seq_len: int, block_size: int, selection: str = "token") -> float:
    """Mean number of block-mean dot products per query token and head for the gate (complete past
    blocks): every token scores its past blocks (``token``), or every query block once (``block``)."""
    T, b = seq_len, block_size
    if selection == "block":
        nb = -(-T // b)
        return nb * (nb - 1) / 2 / T
    q, r = divmod(T, b)  # sum over t < T of t // b
    return (b * q * (q - 1) // 2 + r * q) / T


def moba_gate_flops(cfg: ModelConfig, seq_len: int, block_size: int, selection: str) -> float:
    """The gate's dot products against block means, per token (moba and ssa)."""
    return 2.0 * cfg.n_heads * cfg.resolved_head_dim * moba_gate_dots(seq_len, block_size, selection)


def moba_flops(cfg: ModelConfig, mc: MixerConfig, seq_len: int) -> dict:
    """Attention over the selected keys (visible pairs; the causal own block is half-filled on average,
    as for full attention) plus the gate's dot products against block means."""
    o = MobaOptions(**mc.options)
    keys = moba_mean_keys(seq_len, o.block_size, o.top_k)
    return {"matmul": attention_projection_flops(cfg),
            "mixing": attention_mixing_flops(cfg, keys) + moba_gate_flops(cfg, seq_len, o.block_size, o.selection)}


# Why MoBA and SSA's sparse stream refuse DataConfig.document_mask
MOBA_DOCUMENT_MASK = ("its gate would pick key blocks of other documents (then masked: fewer than top_k "
                      "useful blocks) and blocks straddle document starts; a document-aware selection "
                      "and kernel are not implemented")


@register_mixer("moba", flops=moba_flops, reads=("rope", "rope_theta", "rope_scaling", "options"), options=MobaOptions,
                description="MoBA block-sparse causal attention: top-k key blocks per query (own block "
                            "included), official per-head gate or SSA/NSA group gate",
                document_mask=MOBA_DOCUMENT_MASK, decode="a KV cache with running block sums for its gate")
class MobaAttention(AttentionDecode, Attention):
    def __init__(self, cfg: ModelConfig, mc: MixerConfig, layer_idx: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, mc, layer_idx, rngs=rngs, window=None)
        self.opts = MobaOptions(**mc.options)

    def attend_prompt(self, q, k, v, ctx: MixerContext):
        return moba_attend(q, k, v, block_size=self.opts.block_size, top_k=self.opts.top_k, gate=self.opts.gate,
                           selection=self.opts.selection, impl=ctx.attention_impl)

    def __call__(self, x, ctx: MixerContext):
        q, k, v = self.project_qkv(x, ctx.positions)
        return self.project_out(self.attend_prompt(q, k, v, ctx))

    # -- decode: the full KV cache plus running block sums of the keys (and queries) for the gate

    def extend_state(self, state: dict, q, k, pos) -> dict:
        return moba_extend_state(state, q, k, pos, self.opts)

    def read(self, q_t, state: dict):
        return moba_read(q_t, state, self.opts)


def moba_extend_state(state: dict, q, k, pos, opts) -> dict:
    """The decode state's block sums (``kbar_sum``, and ``qbar_sum`` for ``selection='block'``) after
    the tokens at ``pos ...`` (shared by moba and ssa's sparse stream)."""
    nb = -(-state["k"].shape[1] // opts.block_size)
    out = dict(state)
    names = [("kbar_sum", k)] + ([("qbar_sum", q)] if opts.selection == "block" else [])
    for name, x in names:
        sums = state.get(name, jnp.zeros((x.shape[0], nb) + x.shape[2:], jnp.float32))
        out[name] = ops.add_block_sums(sums, x, pos, opts.block_size)
    return out


def moba_read(q_t, state: dict, opts):
    """One query's MoBA attention over the decode cache (selection as in the forward pass), on the
    backend of :func:`hybrid_lm.backends.sparse_decode_backend`: on a GPU the selection's top-k runs
    as the top-k kernel. Either way the attention gathers only the selected blocks of the cache, in
    XLA (a one-kernel gather was slower at S5, 128K, batch 8: docs/KERNELS.md)."""
    impl, reason = sparse_decode_backend()
    record_backend(f"moba decode block={opts.block_size}", impl, reason)
    imp = ops.decode_importance(q_t, state["kbar_sum"], state["pos"], block_size=opts.block_size, gate=opts.gate,
                                selection=opts.selection, qbar_sum=state.get("qbar_sum"))
    if impl == "xla":
        idx = ops.decode_top_blocks(imp, opts.top_k)
    else:
        import hybrid_lm_kernels as kernels  # may not import here (backends.py picks xla then)
        idx = kernels.top_k_blocks(imp, opts.top_k)
    return ops.decode_attend(q_t, state["k"], state["v"], idx, state["pos"], block_size=opts.block_size)
