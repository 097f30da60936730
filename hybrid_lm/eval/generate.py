"""Autoregressive generation from a :class:`~hybrid_lm.model.transformer.HybridLM`.

The prompt runs through the model's ``prefill`` (the eval-mode forward pass on every layer, which
also leaves each layer's decode state: a KV cache of ``window`` slots for SWA, of ``max_len`` slots
for full attention, MoBA and SSA (plus running block sums of keys and queries for MoBA's gate; SSA
decodes its ``eval_stream``), of ``max_len`` slots plus the eval permutations of every position for
SA and gated SA + SWA (``decode='permutation'``; ``'swa'``: a ring buffer as SWA), the recurrent state
for lightning / mamba2 / gdn), then one
``decode_step`` per new token inside a ``lax.scan``. Greedy with ``temperature=0``; otherwise
sampling from ``softmax(logits / temperature)``, optionally restricted to the ``top_k`` most likely
tokens. Mixers without a decode path (attention_sink) raise ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx


def generate(model, prompt, max_new: int, *, temperature: float = 0.0, top_k: int | None = None,
             key=None, attention_impl: str = "auto", max_len: int | None = None, vocab_limit: int | None = None):
    """``max_new`` tokens ``[B, max_new]`` (int32) continuing ``prompt [B, T0]`` (T0 >= 1).

    ``max_len`` (default ``T0 + max_new``) sizes the full-attention caches; it must cover the prompt
    and the new tokens. ``key`` is required when ``temperature > 0``. ``vocab_limit`` (the
    tokenizer's vocabulary, when the model's embedding is padded beyond it) keeps ids the tokenizer
    cannot decode from ever being picked.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, T0] token ids with T0 >= 1, got shape {prompt.shape}")
    if max_new < 1:
        raise ValueError(f"max_new must be >= 1, got {max_new}")
    T0 = prompt.shape[1]
    max_len = T0 + max_new if max_len is None else int(max_len)
    if T0 + max_new > max_len:
        raise ValueError(f"prompt ({T0}) + max_new ({max_new}) exceeds max_len={max_len}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    vocab = model.cfg.vocab_size
    if int(jnp.max(prompt)) >= vocab or int(jnp.min(prompt)) < 0:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    key = jax.random.key(0) if key is None else key
    graphdef, state = nnx.split(model)
    limit = None if vocab_limit is None or vocab_limit >= vocab else int(vocab_limit)
    run = _runner(model, graphdef, max_new=max_new, max_len=max_len, temperature=float(temperature),
                  top_k=top_k, attention_impl=attention_impl, vocab_limit=limit)
    return run(state, prompt, key)


# One compiled runner per (model object, settings): the graph definition holds the config's dicts,
# so it cannot be a static (hashed) jit argument; the parameters are passed as arguments each call.
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _runner(model, graphdef, **settings):
    per_model = _RUNNERS.setdefault(model, {})
    key = tuple(sorted(settings.items()))
    if key not in per_model:
        per_model[key] = jax.jit(functools.partial(_run, graphdef, **settings))
    return per_model[key]


def _pick(logits, key, temperature: float, top_k: int | None, vocab_limit: int | None = None):
    if vocab_limit is not None:  # ids past the tokenizer's vocabulary are never picked
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _run(graphdef, state, prompt, key, *, max_new, max_len, temperature, top_k, attention_impl, vocab_limit):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(prompt, max_len, attention_impl)
    keys = jax.random.split(key, max_new)
    first = _pick(logits[:, -1], keys[0], temperature, top_k, vocab_limit)

    def body(carry, key_t):
        token, cache = carry
        logits_t, cache = model.decode_step(token, cache)
        return (_pick(logits_t, key_t, temperature, top_k, vocab_limit), cache), token

    (last, _), tokens = jax.lax.scan(body, (first, cache), keys[1:])
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)
