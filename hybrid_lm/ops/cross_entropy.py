"""Next-token cross-entropy from the last hidden state, with and without whole logits.

``cross_entropy`` is the reference: it takes fp32 logits ``[..., V]``. ``chunked_cross_entropy`` takes
the final hidden state ``h [N, d]`` and the head matrix ``w [d, V]`` instead and never holds more than
``chunk`` rows of logits: a scan over token chunks whose body is rematerialised, so the backward pass
recomputes each chunk's logits instead of storing them. Peak memory is ``chunk x V`` fp32, not
``N x V``. Both return ``(objective, ce)``: the mean cross-entropy in nats plus the z-loss term
``z_loss * mean(logsumexp**2)``, and the plain mean cross-entropy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, z_loss: float = 0.0):
    """Mean token cross-entropy (nats) of fp32 ``logits [..., V]``, with the optional z-loss term."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - tgt)
    loss = ce + z_loss * jnp.mean(lse ** 2) if z_loss else ce
    return loss, ce


def head_logits(h, w):
    """fp32 logits ``h @ w`` in ``h``'s dtype, as the model's head computes them."""
    return (h @ w.astype(h.dtype)).astype(jnp.float32)


def chunked_cross_entropy(h, w, targets, z_loss: float = 0.0, chunk: int = 8192):
    """:func:`cross_entropy` of ``head_logits(h, w)`` for ``h [N, d]``, ``targets [N]``, computed
    ``chunk`` tokens at a time. Rows past ``N`` in the last chunk are padding with weight 0."""
    N, d = h.shape
    chunk = max(1, min(chunk, N))
    n_chunks = -(-N // chunk)
    pad = n_chunks * chunk - N
    weight = jnp.ones((N,), jnp.float32)
    if pad:
        h = jnp.concatenate([h, jnp.zeros((pad, d), h.dtype)])
        targets = jnp.concatenate([targets, jnp.zeros((pad,), targets.dtype)])
        weight = jnp.concatenate([weight, jnp.zeros((pad,), jnp.float32)])
    xs = (h.reshape(n_chunks, chunk, d), targets.reshape(n_chunks, chunk), weight.reshape(n_chunks, chunk))

    @jax.checkpoint
    def sums(w, hc, tc, wc):
        logits = head_logits(hc, w)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return jnp.sum((lse - tgt) * wc), jnp.sum(lse ** 2 * wc)

    def body(carry, x):
        ce_sum, z_sum = sums(w, *x)
        return (carry[0] + ce_sum, carry[1] + z_sum), None

    (ce_sum, z_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), xs)
    ce = ce_sum / N
    loss = ce + z_loss * (z_sum / N) if z_loss else ce
    return loss, ce


def logits_bytes(n_tokens: int, vocab: int) -> int:
    """Bytes of whole fp32 logits for ``n_tokens`` tokens (their gradient doubles it)."""
    return 4 * n_tokens * vocab
