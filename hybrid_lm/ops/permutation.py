"""Token permutations for stochastic attention (SA): draw, apply, invert. No parameters.

Randomness is deterministic, resumable and independent of how the batch is sharded: the permutation
of one example is drawn from

    fold_in(fold_in(fold_in(fold_in(key(seed), step), layer), example_id))

where ``example_id`` is the example's *global* index (never a device-local row). With
``per_example=False`` the last fold is skipped and every row shares one permutation.

Conventions: ``perm [B, T]`` lists, for each permuted slot s, the original index ``perm[s]``;
``inv = invert(perm)`` satisfies ``inv[perm[s]] = s``. Gathering by ``perm`` permutes, gathering by
``inv`` restores the original order exactly (gathers copy values, so the round trip is bitwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# At eval, SA draws from ``key(seed) -> fold_in(EVAL_STREAM + draw)`` instead of a training step, so
# the eval permutations do not depend on the checkpoint being evaluated. Training steps stay far below.
EVAL_STREAM = 2**31


def permutation_key(seed, step, layer: int, example_id=None):
    """The SA key of one (seed, step, layer[, example]); all arguments may be traced ints."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), layer)
    return key if example_id is None else jax.random.fold_in(key, example_id)


def draw_permutations(seed, step, layer: int, example_ids, length: int, *, per_example: bool = True):
    """Uniform random permutations ``[B, T]`` (int32), one per example id (or one shared, tiled)."""
    example_ids = jnp.asarray(example_ids)
    if per_example:
        keys = jax.vmap(lambda e: permutation_key(seed, step, layer, e))(example_ids)
        perm = jax.vmap(lambda k: jax.random.permutation(k, length))(keys)
    else:
        perm = jax.random.permutation(permutation_key(seed, step, layer), length)[None]
        perm = jnp.broadcast_to(perm, (example_ids.shape[0], length))
    return perm.astype(jnp.int32)


def invert(perm):
    """Inverse permutations ``[B, T]``: a scatter of ``arange`` (O(T), no sort)."""
    B, T = perm.shape
    rows = jnp.arange(B)[:, None]
    return jnp.zeros_like(perm).at[rows, perm].set(jnp.broadcast_to(jnp.arange(T, dtype=perm.dtype), (B, T)))


def _gather(x, idx):
    return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0))(x, idx)


@jax.custom_vjp
def permute(x, perm, inv):
    """``x[b, perm[b, s]]`` for ``x [B, T, ...]``.

    The VJP of a gather is a scatter-add; for a permutation it is exactly the gather by the inverse,
    which is cheaper on accelerators, so the backward pass gathers by ``inv``.
    """
    return _gather(x, perm)


def _permute_fwd(x, perm, inv):
    return _gather(x, perm), (perm, inv)


def _permute_bwd(res, g):
    perm, inv = res
    return _gather(g, inv), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def unpermute(y, perm, inv):
    """Inverse of :func:`permute`: ``unpermute(permute(x, perm, inv), perm, inv) == x`` bitwise."""
    return permute(y, inv, perm)
