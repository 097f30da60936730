"""A swap applied to the context only: the SA paper's training-free protocol.

``hybrid-lm eval RUN --tasks ruler --swap full=sa:128 --swap-prefill-only``: the context (the RULER
prompt) is prefilled by the *swapped* model, and the answer is scored by the run's *own* layers
attending over that context's cache, as a model that prefills with SA and then decodes with full
attention over the cache would score it (Stochastic Attention, training-free inference).

**How.** A decoded answer token attends, in every layer, to the cached keys and values of the context
(projections of the context's hidden states, which the swapped model computed) and to the answer's
earlier tokens. Block by block, with ``x_c`` the context's residual stream under the swapped model and
``x_a`` the answer's::

    x_a <- own_block_i([x_c ; x_a])[context length:]     # own layer, causal over context + answer
    x_c <- swapped_block_i(x_c)                           # the context through the swapped layer

The own block sees the concatenation, so an answer row attends to keys projected from ``x_c`` (the
swapped context's states: the cache) and from the earlier answer rows; the context rows of that pass
are discarded. The first answer token is predicted from the last context position of the swapped
model (the prefill's last logits), the others from the answer rows. This equals a prefill of the
context with the swap followed by teacher-forced decoding with the run's own mixers over a full
cache of the context, and costs two forward passes (context, context + answer) per block instead of
a prefill and one decode step per answer token. Any swap of ``run/swap.py`` works (``sa``, ``swa``,
``moba``, ...); the own layers are the run's (its full attention, and its efficient layers as trained).

Checked against a dense oracle in ``tests/test_prefill_swap.py``: with a SWA-w swap on a full-attention
model, the answer NLL equals the run's model with every attention layer replaced by dense attention
under the mask "context rows: causal within w; answer rows: causal over everything".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions


def split_answer_nll_fn(own_fns, swapped_fns, own_cfg, swapped_cfg, span: int, vocab: int | None = None):
    """Jitted ``(params, tokens [B, L]) -> [B, span]``: the NLL of the last ``span`` tokens (the answer),
    the first ``L - span`` (the context) prefilled by the swapped model (``swapped_fns`` / ``swapped_cfg``)
    and the answer scored by the run's own model (``own_fns`` / ``own_cfg``) over that context. Both
    configs take the same parameters (``run/swap.py`` checks it). With ``vocab``, also ``[B, span]``
    whether each answer token is the argmax over the first ``vocab`` ids (lm-eval's ``is_greedy``)."""
    def ctx_of(cfg, B, L, ids):
        return MixerContext(positions=default_positions(B, L), attention_impl=cfg.model.attention_impl,
                            seed=cfg.train.seed, example_ids=ids, train=False)

    def nll(params, tokens, example_ids=None):
        """``example_ids`` [B] (optional): each row's id for SA's permutation (rows that share one see the
        same permuted context); without them a row's permutation follows its place in the batch."""
        B, L = tokens.shape
        P = L - span
        if P < 1:
            raise ValueError(f"the context must hold at least one token: length {L}, answer span {span}")
        own, swapped = own_fns.model(params), swapped_fns.model(params)
        dtype = jnp.dtype(own_cfg.model.compute_dtype)
        ctx_c, ctx_ca = ctx_of(swapped_cfg, B, P, example_ids), ctx_of(own_cfg, B, L - 1, example_ids)
        x_c = swapped.embed(tokens[:, :P], dtype)
        x_a = own.embed(tokens[:, P:L - 1], dtype)  # the answer's inputs: its tokens but the last
        for own_block, swapped_block in zip(own.blocks, swapped.blocks):
            x_a = own_block(jnp.concatenate([x_c, x_a], axis=1), ctx_ca)[:, P:]
            x_c = swapped_block(x_c, ctx_c)
        h = jnp.concatenate([swapped.final_norm(x_c[:, -1:]), own.final_norm(x_a)], axis=1)  # [B, span, d]
        logits = (h @ own.head_matrix().astype(h.dtype)).astype(jnp.float32)
        target = tokens[:, P:]
        out = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]
        if vocab is None:
            return out
        return out, jnp.argmax(logits[..., :vocab], -1) == target

    return jax.jit(nll)
