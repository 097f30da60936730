"""MoBA-style block-sparse causal attention: pure-jnp reference (no parameters), O(T * top_k * block).

Keys are cut into blocks of ``block_size`` tokens (the last one may be partial). Every query token
selects ``top_k`` blocks, *counting its own block*, which is always selected and causally masked
inside; the other ``top_k - 1`` are the best-scoring complete past blocks (all of them if fewer).
The query then runs softmax attention over the tokens of its selected blocks only. Selection is per
query token (as in both reference implementations) and carries no gradient (integer indices).

Two gates score the past blocks, both against block-mean keys (after RoPE when the model uses it):

- ``gate="moba"``, official MoBA (``MoonshotAI/MoBA`` ``moba_naive.py``): raw ``q . mean(k_block)``
  in fp32, no softmax and no 1/sqrt(D), **per query head** (K/V are repeat-interleaved to the query
  heads, so each query head selects on its own).
- ``gate="ssa"``, SSA/NSA (``zhenyi4/ssa`` via ``fla-org/native-sparse-attention``
  ``parallel_nsa_kernel_topk``): per query head the softmax probability
  ``exp(scale * q . mean(k_c) - lse)``, with lse taken over the *complete* blocks
  ``c < (t + 1) // block``; the probabilities are **summed over the query heads of a GQA group**, so
  the group shares one selection; the current block is forced. SSA runs it at block 16, top-16.

``selection="block"`` (an option, not in either reference) lets every query *block* select once,
scored with the mean query of the preceding block (causal); all its tokens share the list. Block-granular lists are what the Pallas
kernel (``hybrid_lm_kernels.block_sparse_attention``) runs fastest; it runs per-token lists exactly too.

Causality is by token index (as both references); positions only enter through RoPE, upstream.
Slots left empty when fewer than ``top_k`` blocks exist are index -1 (as NSA) and are skipped.

Cost: the gate scores every query against every complete past block mean (``T * T / block`` dot
products, as MoBA's gate), and the attention gathers ``top_k * block`` keys per query and selection
head. Queries are processed in chunks under ``lax.map`` + ``jax.checkpoint`` so memory stays bounded
in the forward and the backward; no T x T array is ever built.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hybrid_lm.backends import topk_method

_NEG = -1e30  # finite "minus infinity" for masked scores (keeps padded query rows NaN-free)
GATES = ("moba", "ssa")
SELECTIONS = ("token", "block")  # who selects: every query token, or every query block
_CHUNK_ELEMENTS = 1 << 23  # rough per-chunk budget of gathered key elements (32 MiB in fp32)
# per-chunk budget of gate scores in select_blocks (256 MiB in fp32): at S5 (T = 16K, 10 heads,
# 1024 blocks, B = 2) 6 chunks instead of 41, so the top-k passes are fewer, larger kernels
_SELECT_CHUNK_ELEMENTS = 1 << 26


def _check(q, k, v, block_size: int, top_k: int, gate: str):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"expected q [B,T,H,D], k/v [B,T,K,D]: q{q.shape} k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if block_size < 1 or top_k < 1:
        raise ValueError(f"block_size={block_size} and top_k={top_k} must be >= 1")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: choose one of {GATES}")


def num_blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def selection_heads(gate: str, n_heads: int, n_kv_heads: int) -> int:
    """Heads with their own selection: every query head (moba) or every KV group (ssa)."""
    return n_heads if gate == "moba" else n_kv_heads


def block_means(k, block_size: int):
    """Mean key of each block ``[B, nb, K, D]`` (fp32), over the tokens the block really holds."""
    B, T, K, D = k.shape
    nb = num_blocks(T, block_size)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, nb * block_size - T), (0, 0), (0, 0)))
    counts = jnp.minimum(block_size, T - jnp.arange(nb) * block_size).astype(jnp.float32)
    return kp.reshape(B, nb, block_size, K, D).sum(2) / counts[None, :, None, None]


def block_importance(q, kbar, t, *, block_size: int, gate: str, scale: float):
    """Selection scores ``[B, Q, Hs, nb]`` of queries ``q [B, Q, H, D]`` at token indices ``t [Q]``.

    ``+inf`` for the query's own block, ``-inf`` for blocks it may not select (its own or later
    ones are never scored), the gate's score for complete past blocks ``c < t // block``.
    """
    B, Q, H, D = q.shape
    nb, K = kbar.shape[1], kbar.shape[2]
    G = H // K
    qg = q.astype(jnp.float32).reshape(B, Q, K, G, D)
    s = jnp.einsum("bqkgd,bckd->bqkgc", qg, kbar)  # [B, Q, K, G, nb]
    c = jnp.arange(nb)
    cur = (t // block_size)[:, None]  # [Q, 1]
    past = (c[None, :] < cur)[None, :, None, None, :]
    if gate == "moba":
        imp = jnp.where(past, s, -jnp.inf).reshape(B, Q, H, nb)
    else:
        s = s * scale
        complete = (c[None, :] < ((t + 1) // block_size)[:, None])[None, :, None, None, :]
        lse = jax.nn.logsumexp(jnp.where(complete, s, -jnp.inf), axis=-1, keepdims=True)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # no complete block yet (NSA stores 0)
        p = jnp.where(past, jnp.exp(jnp.where(past, s, 0.0) - lse), 0.0)
        imp = jnp.where(past[:, :, :, 0], p.sum(3), -jnp.inf)  # sum over the GQA group: [B, Q, K, nb]
    own = (c[None, :] == cur)[None, :, None, :]
    return jnp.where(own, jnp.inf, imp)


def top_k_by_passes(x, k: int):
    """``lax.top_k`` semantics (values descending, ties to the lower index) by ``k`` passes of one
    argmax over the last axis, each skipping what earlier passes took: O(k * n) reads and no sort.
    -0.0 and +0.0 tie here (``lax.top_k`` ranks +0.0 first). Entries left at -inf when fewer than ``k`` are finite may carry other indices than
    ``lax.top_k`` gives them (callers map -inf to "empty")."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    m = jnp.full(x.shape[:-1], jnp.inf, x.dtype)
    i = jnp.full(x.shape[:-1], -1, jnp.int32)
    vals, idxs = [], []
    for _ in range(k):
        # below the previous pick in (value descending, index ascending) order
        below = (x < m[..., None]) | ((x == m[..., None]) & (iota > i[..., None]))
        xm = jnp.where(below, x, -jnp.inf)
        i = jnp.argmax(xm, axis=-1).astype(jnp.int32)
        m = jnp.take_along_axis(xm, i[..., None], axis=-1)[..., 0]
        vals.append(m)
        idxs.append(i)
    return jnp.stack(vals, -1), jnp.stack(idxs, -1)


def _top_blocks(imp, top_k: int, method: str = "auto"):
    """Indices ``[..., min(top_k, nb)]`` of the best blocks; -1 where nothing selectable is left.
    ``method``: ``sort`` = ``lax.top_k``, ``passes`` = :func:`top_k_by_passes`, ``auto`` = the
    choice of ``hybrid_lm.backends.topk_method``."""
    k = min(top_k, imp.shape[-1])
    method, _ = topk_method(method, k, imp.shape[-1])
    vals, idx = (top_k_by_passes if method == "passes" else jax.lax.top_k)(imp, k)
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------- decode (one query)

def add_block_sums(sums, x, pos, block_size: int):
    """``sums [B, nb, h, D]`` (fp32) plus the tokens ``x [B, n, h, D]`` at positions ``pos ... pos+n-1``,
    each added to its block: the running block sums behind the decode-time gate."""
    if x.shape[1] == 1:  # a decode step: one block, updated in place (a scatter may copy all sums)
        b = jnp.asarray(pos, jnp.int32) // block_size
        row = jax.lax.dynamic_slice_in_dim(sums, b, 1, axis=1) + x.astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(sums, row, b, axis=1)
    blocks = (pos + jnp.arange(x.shape[1])) // block_size
    return sums.at[:, blocks].add(x.astype(jnp.float32))


def decode_select(q_t, kbar_sum, pos, *, block_size: int, top_k: int, gate: str, selection: str,
                  qbar_sum=None, scale: float | None = None):
    """The blocks ``[B, 1, Hs, S]`` that :func:`select_blocks` gives the query ``q_t [B, 1, H, D]`` at
    position ``pos``, from running block sums of the keys (and, for ``selection='block'``, of the
    queries) up to ``pos``: only complete past blocks are scored, so the sums are all it needs."""
    imp = decode_importance(q_t, kbar_sum, pos, block_size=block_size, gate=gate, selection=selection,
                            qbar_sum=qbar_sum, scale=scale)
    return decode_top_blocks(imp, top_k)


def decode_top_blocks(imp, top_k: int):
    """The selection from :func:`decode_importance`'s scores: the ``top_k`` best blocks, -1 = empty."""
    return _top_blocks(imp, min(top_k, imp.shape[-1]))


def decode_importance(q_t, kbar_sum, pos, *, block_size: int, gate: str, selection: str, qbar_sum=None,
                      scale: float | None = None):
    """The block importance ``[B, 1, Hs, nb]`` behind :func:`decode_select` (its top-k is the selection)."""
    D = q_t.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kbar = kbar_sum / block_size
    if selection == "block":  # the preceding block's mean query, as select_blocks
        b = pos // block_size
        prev = jax.lax.dynamic_index_in_dim(qbar_sum, jnp.maximum(b - 1, 0), axis=1) / block_size
        q_t, t = jnp.where(b >= 1, prev, 0.0), (b * block_size)[None]
    else:
        t = jnp.asarray(pos)[None]
    return block_importance(q_t, kbar, t, block_size=block_size, gate=gate, scale=scale)


def decode_attend(q_t, k_cache, v_cache, idx, pos, *, block_size: int, scale: float | None = None):
    """Attention of ``q_t [B, 1, H, D]`` at ``pos`` over its selected blocks ``idx [B, 1, Hs, S]`` of a
    KV cache ``[B, C, K, D]`` indexed by position (keys after ``pos`` are masked)."""
    scale = 1.0 / math.sqrt(q_t.shape[-1]) if scale is None else scale
    return _attend_selected(q_t, jnp.asarray(pos)[None], k_cache, v_cache, idx, block_size=block_size,
                            scale=scale)


def _query_chunks(T: int, per_query: int, B: int, query_chunk: int | None, budget: int = _CHUNK_ELEMENTS) -> int:
    """Queries per chunk: ``query_chunk``, or as many as fit ``budget`` elements."""
    return min(T, query_chunk or max(1, budget // max(1, B * per_query)))


def _map_query_chunks(fn, q, Qc: int):
    """``fn(q_chunk, token_indices)`` over query chunks of ``Qc`` (lax.map + checkpoint), re-joined
    along time and cut back to T."""
    B, T = q.shape[:2]
    n = -(-T // Qc)
    if n == 1:
        return fn(q, jnp.arange(T))
    qp = jnp.pad(q, ((0, 0), (0, n * Qc - T)) + ((0, 0),) * (q.ndim - 2))
    qp = qp.reshape(B, n, Qc, *q.shape[2:]).swapaxes(0, 1)
    tp = jnp.arange(n * Qc).reshape(n, Qc)
    out = jax.lax.map(lambda xs: jax.checkpoint(fn)(xs[0], xs[1]), (qp, tp))  # [n, B, Qc, ...]
    return out.swapaxes(0, 1).reshape(B, n * Qc, *out.shape[3:])[:, :T]


def select_blocks(q, k, *, block_size: int, top_k: int, gate: str = "moba", scale: float | None = None,
                  selection: str = "token", query_chunk: int | None = None, topk: str = "auto"):
    """Selected blocks (int32, -1 = empty slot), no gradient.

    ``selection='token'``: ``[B, T, Hs, min(top_k, nb)]``, every query token selects (MoBA, NSA).
    ``selection='block'``: ``[B, nb, Hs, min(top_k, nb)]``, every query block selects once, scored
    with the mean query of the *preceding* block, as if it stood at the block's first token (past =
    earlier blocks). Causal: no token's selection depends on a later token (the block's own mean
    query would leak its later tokens into the choice of its earlier ones).
    ``topk``: the top-k method of :func:`_top_blocks` (``auto``, ``sort``, ``passes``).
    The fused kernel ``hybrid_lm_kernels.select_blocks`` returns the same for ``selection='token'``.
    """
    _check(q, k, k, block_size, top_k, gate)
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}: choose one of {SELECTIONS}")
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    kbar = block_means(k, block_size)
    nb = kbar.shape[1]
    S = min(top_k, nb)
    if selection == "block":
        # each block ranks with the mean query of the block before it: the mean over its own queries
        # would let a token's selection depend on later tokens of its block (a causality leak)
        qbar = block_means(q, block_size)  # [B, nb, H, D]
        qprev = jnp.concatenate([jnp.zeros_like(qbar[:, :1]), qbar[:, :-1]], axis=1)  # block 0: no past
        t = jnp.arange(nb) * block_size
        return _top_blocks(block_importance(qprev, kbar, t, block_size=block_size, gate=gate, scale=scale), S, topk)

    def chunk(qc, tc):
        return _top_blocks(block_importance(qc, kbar, tc, block_size=block_size, gate=gate, scale=scale), S, topk)

    return _map_query_chunks(chunk, q, _query_chunks(T, H * nb, B, query_chunk, _SELECT_CHUNK_ELEMENTS))


def _attend_selected(q, t, k, v, idx, *, block_size: int, scale: float):
    """Attention of queries ``q [B, Q, H, D]`` at ``t [Q]`` over their selected blocks.

    ``k, v [B, T, K, D]``; ``idx [B, Q, Hs, S]``: selection head h reads KV head h // (Hs / K) and
    serves query heads ``[h * H/Hs, (h + 1) * H/Hs)``. Only the selected keys are gathered.
    """
    B, Q, H, D = q.shape
    T, K = k.shape[1], k.shape[2]
    Hs, S = idx.shape[2], idx.shape[3]
    tok = idx[..., None] * block_size + jnp.arange(block_size)  # [B, Q, Hs, S, bs]
    valid = (idx[..., None] >= 0) & (tok <= t[None, :, None, None, None]) & (tok < T)
    tok = jnp.clip(tok, 0, T - 1).transpose(0, 2, 1, 3, 4).reshape(B, Hs, Q * S * block_size)
    rows = jnp.arange(B)[:, None, None]
    kv_head = (jnp.arange(Hs) // (Hs // K))[None, :, None]
    kg = k[rows, tok, kv_head].reshape(B, Hs, Q, S * block_size, D)
    vg = v[rows, tok, kv_head].reshape(B, Hs, Q, S * block_size, v.shape[-1])
    qg = q.astype(jnp.float32).reshape(B, Q, Hs, H // Hs, D)
    s = jnp.einsum("bqhgd,bhqld->bqhgl", qg, kg.astype(jnp.float32)) * scale
    mask = valid.reshape(B, Q, Hs, 1, S * block_size)
    p = jax.nn.softmax(jnp.where(mask, s, _NEG), axis=-1)
    o = jnp.einsum("bqhgl,bhqld->bqhgd", p, vg.astype(jnp.float32))
    return o.reshape(B, Q, H, v.shape[-1])


def random_token_selection(key, B: int, T: int, K: int, *, block_size: int, top_k: int):
    """A random valid per-token selection ``[B, T, K, min(top_k, nb)]`` for tests and benchmarks: the
    top-k of random block scores per token, own block forced, later blocks excluded (as the gates);
    -1 where fewer blocks exist."""
    nb = num_blocks(T, block_size)
    imp = jax.random.normal(key, (B, T, K, nb))
    c = jnp.arange(nb)[None, :]
    own = (jnp.arange(T) // block_size)[:, None]
    imp = jnp.where((c > own)[None, :, None, :], -jnp.inf, imp)
    imp = jnp.where((c == own)[None, :, None, :], jnp.inf, imp)
    vals, idx = jax.lax.top_k(imp, min(top_k, nb))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def block_sparse_attention(q, k, v, block_idx, *, block_size: int, scale: float | None = None):
    """Causal attention over given per-token blocks ``block_idx [B, T, Hs, S]`` (-1 = empty).

    ``Hs`` is the number of selection heads: a multiple of the KV heads dividing the query heads.
    Unchunked: memory O(T * Hs * S * block * D). Use :func:`moba_attention` for long sequences.
    """
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = _attend_selected(q, jnp.arange(T), k, v, block_idx, block_size=block_size, scale=scale)
    return o.astype(q.dtype)


def moba_attention(q, k, v, *, block_size: int, top_k: int, gate: str = "moba", scale: float | None = None,
                   query_chunk: int | None = None, selection: str = "token"):
    """MoBA block-sparse causal attention (selection + attention), chunked over queries.

    q ``[B, T, H, D]``, k/v ``[B, T, K, D]`` (GQA). ``top_k`` counts the query's own block;
    ``top_k >= ceil(T / block_size)`` is exactly causal full attention. ``selection``: per query
    ``token`` (the references) or per query ``block`` (see :func:`select_blocks`). ``query_chunk``
    queries are processed at a time (default: as many as fit ``_CHUNK_ELEMENTS`` gathered keys).
    """
    _check(q, k, v, block_size, top_k, gate)
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}: choose one of {SELECTIONS}")
    B, T, H, D = q.shape
    K = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    nb = num_blocks(T, block_size)
    S = min(top_k, nb)
    Hs = selection_heads(gate, H, K)
    kbar = jax.lax.stop_gradient(block_means(k, block_size))
    per_block_idx = None
    if selection == "block":
        per_block_idx = select_blocks(q, k, block_size=block_size, top_k=top_k, gate=gate, scale=scale,
                                      selection="block")

    def chunk(qc, tc):
        if per_block_idx is not None:
            idx = per_block_idx[:, jnp.minimum(tc // block_size, nb - 1)]
        else:
            imp = block_importance(jax.lax.stop_gradient(qc), kbar, tc, block_size=block_size, gate=gate,
                                   scale=scale)
            idx = _top_blocks(imp, S)
        return _attend_selected(qc, tc, k, v, idx, block_size=block_size, scale=scale)

    per_query = Hs * S * block_size * max(D, v.shape[-1]) + H * nb
    return _map_query_chunks(chunk, q, _query_chunks(T, per_query, B, query_chunk)).astype(q.dtype)
