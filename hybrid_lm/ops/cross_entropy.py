"""Next-token cross-entropy from the last hidden state, with and without whole logits.

``cross_entropy`` is the reference: it takes fp32 logits ``[..., V]``. ``chunked_cross_entropy`` takes
the final hidden state ``h [N, d]`` and the head matrix ``w [d, V]`` instead and never holds more than
``chunk`` rows of logits: one scan over token chunks computes the loss and its gradients together
(a custom VJP), so no logits are stored for the backward pass and none are recomputed. Peak memory
is a few ``chunk x V`` fp32 blocks plus the ``d x V`` head gradient, not ``N x V``. Both return ``(objective, ce)``: the mean cross-entropy in nats plus the z-loss term
``z_loss * mean(logsumexp**2)``, and the plain mean cross-entropy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, z_loss: float = 0.0):
    """Mean token cross-entropy (nats) of fp32 ``logits [..., V]``, with the optional z-loss term."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - tgt)
    loss = ce + z_loss * jnp.mean(lse ** 2) if z_loss else ce
    return loss, ce


def token_cross_entropy(logits, targets):
    """Each token's cross-entropy (nats) of fp32 ``logits [..., V]``: ``[...]``, forward only (eval)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def chunked_token_cross_entropy(h, w, targets, chunk: int = 8192):
    """:func:`token_cross_entropy` of ``head_logits(h, w)`` for ``h [N, d]``, ``targets [N]``: ``[N]``,
    ``chunk`` tokens of logits at a time (forward only: the eval's per-window losses)."""
    N = h.shape[0]
    hs, ts, _ = _chunk(h, targets, chunk)
    ce = jax.lax.map(lambda x: token_cross_entropy(head_logits(x[0], w), x[1]), (hs, ts))
    return ce.reshape(-1)[:N]


def head_logits(h, w):
    """fp32 logits ``h @ w`` in ``h``'s dtype, as the model's head computes them."""
    return (h @ w.astype(h.dtype)).astype(jnp.float32)


def chunked_cross_entropy(h, w, targets, z_loss: float = 0.0, chunk: int = 8192, kernel: str = "xla"):
    """:func:`cross_entropy` of ``head_logits(h, w)`` for ``h [N, d]``, ``targets [N]``, computed
    ``chunk`` tokens at a time.

    The gradient is computed in the same pass as the loss (a custom VJP): each chunk's logits give
    ``dlogits = softmax + 2 z lse softmax - onehot`` at once, then ``dh = dlogits w^T`` and ``dw +=
    h^T dlogits``. So the head's matmuls run three times per chunk, as for whole logits (one forward,
    two backward), with no recomputation, and the backward only scales the stored gradients.
    With a z-loss the returned ``ce`` carries no gradient (differentiate the objective).
    ``kernel`` runs the softmax pass between the matmuls: ``'xla'`` (:func:`softmax_xent_rows_reference`)
    or ``'pallas'`` (``hybrid_lm_kernels.softmax_xent_rows``: the logits read twice, not three times);
    ``hybrid_lm.backends.loss_kernel_backend`` picks it."""
    loss, ce = _fused(h, w, targets, float(z_loss), int(chunk), kernel)
    return loss, (jax.lax.stop_gradient(ce) if z_loss else ce)


def _chunk(h, targets, chunk: int):
    """``h``, ``targets`` and 0/1 weights padded to whole chunks and reshaped ``[n_chunks, chunk, ...]``."""
    N, d = h.shape
    chunk = max(1, min(chunk, N))
    n = -(-N // chunk)
    pad = n * chunk - N
    weight = jnp.concatenate([jnp.ones((N,), jnp.float32), jnp.zeros((pad,), jnp.float32)])
    h = jnp.concatenate([h, jnp.zeros((pad, d), h.dtype)]) if pad else h
    targets = jnp.concatenate([targets, jnp.zeros((pad,), targets.dtype)]) if pad else targets
    return h.reshape(n, chunk, d), targets.reshape(n, chunk), weight.reshape(n, chunk)


def softmax_xent_rows_reference(logits, targets, weights, z_loss: float = 0.0):
    """``(dlogits, lse, target_logit)`` of logits ``[N, V]``: each row's log-sum-exp and target logit
    (fp32), and ``weights * (softmax * (1 + 2 z_loss lse) - onehot(targets))`` in the logits' dtype,
    the gradient of ``weights * (lse - target_logit + z_loss lse**2)``. The reference of the Pallas
    kernel ``hybrid_lm_kernels.softmax_xent_rows``."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    tgt = jnp.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
    p = jnp.exp(x - lse[:, None])
    d = p * (1.0 + 2.0 * z_loss * lse)[:, None] - jax.nn.one_hot(targets, x.shape[-1], dtype=jnp.float32)
    return (d * weights[:, None]).astype(logits.dtype), lse, tgt


def _xent_rows(kernel: str):
    """The per-chunk softmax pass: ``'xla'`` (the reference, three XLA passes) or ``'pallas'`` (one
    kernel reading the logits twice; interpreted on the CPU)."""
    if kernel == "xla":
        return softmax_xent_rows_reference
    if kernel == "pallas":
        from hybrid_lm_kernels import softmax_xent_rows  # may not import here (backends.py picks xla then)
        return lambda logits, t, w, z: softmax_xent_rows(logits, t, w, z_loss=z)
    raise ValueError(f"loss kernel {kernel!r}: choose 'xla' or 'pallas'")


def _chunked_loss_and_grads(h, w, targets, z_loss: float, chunk: int, kernel: str = "xla"):
    """``(loss, ce, dloss/dh, dloss/dw)``, one scan over token chunks."""
    N = h.shape[0]
    hs, ts, ws = _chunk(h, targets, chunk)
    wc = w.astype(h.dtype)
    rows = _xent_rows(kernel)

    def body(carry, x):
        ce_sum, z_sum, dw = carry
        hc, tc, mc = x
        logits = hc @ wc  # in h's dtype, as head_logits; the softmax pass upcasts to fp32
        dlogits, lse, tgt = rows(logits, tc, mc / N, z_loss)
        dlogits = dlogits.astype(h.dtype)
        dh = (dlogits @ wc.T).astype(h.dtype)
        dw = dw + jnp.einsum("cd,cv->dv", hc, dlogits, preferred_element_type=jnp.float32)
        return (ce_sum + jnp.sum((lse - tgt) * mc), z_sum + jnp.sum(lse ** 2 * mc), dw), dh

    zero = jnp.zeros((), jnp.float32)
    (ce_sum, z_sum, dw), dh = jax.lax.scan(body, (zero, zero, jnp.zeros(w.shape, jnp.float32)), (hs, ts, ws))
    ce = ce_sum / N
    loss = ce + z_loss * (z_sum / N) if z_loss else ce
    return loss, ce, dh.reshape(-1, h.shape[1])[:N], dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(h, w, targets, z_loss, chunk, kernel):
    loss, ce, _, _ = _chunked_loss_and_grads(h, w, targets, z_loss, chunk, kernel)
    return loss, ce


def _fused_fwd(h, w, targets, z_loss, chunk, kernel):
    loss, ce, dh, dw = _chunked_loss_and_grads(h, w, targets, z_loss, chunk, kernel)
    return (loss, ce), (dh, dw, targets)


def _fused_bwd(z_loss, chunk, kernel, res, g):
    dh, dw, targets = res
    # without a z-loss ce is the loss; with one, ce is stop_gradient'ed by the caller (g_ce = 0)
    scale = g[0] + g[1]
    return (scale * dh).astype(dh.dtype), (scale * dw).astype(dw.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def logits_bytes(n_tokens: int, vocab: int) -> int:
    """Bytes of whole fp32 logits for ``n_tokens`` tokens (their gradient doubles it)."""
    return 4 * n_tokens * vocab
