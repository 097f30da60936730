"""One evaluation of next-token loss on fixed windows, shared by the trainer and ``hybrid-lm eval``.

The batching rule lives here only: batches of ``per`` rows (the global batch, rounded down to a
multiple of the batch shards, at least one row per shard) and whole batches only, so the trainer's
eval and an unswapped ``hybrid-lm eval`` of the same checkpoint give the same number.
"""

from __future__ import annotations

import numpy as np

from hybrid_lm.data.corpus import bits_per_byte
from hybrid_lm.sharding import put_batch


def eval_batching(n_windows: int, global_batch: int, n_batch_shards: int) -> tuple[int, int]:
    """``(per, n)``: rows per eval batch and the number of windows evaluated (a multiple of ``per``;
    0 when the windows cannot fill one batch)."""
    per = max(n_batch_shards, (min(global_batch, n_windows) // n_batch_shards) * n_batch_shards)
    return per, (n_windows // per) * per


def window_count(windows) -> int:
    """How many eval windows ``windows`` holds (an array ``[N, T+1]`` or a dict of them)."""
    return (windows["tokens"] if isinstance(windows, dict) else windows).shape[0]


def _rows(windows, start: int, stop: int):
    """Rows ``[start, stop)`` of the eval windows (an array, or each array of a dict)."""
    if isinstance(windows, dict):
        return {k: a[start:stop] for k, a in windows.items()}
    return windows[start:stop]


def evaluate(eval_fn, params, windows, batch_shard, *, global_batch: int, n_batch_shards: int,
             bytes_per_token: float) -> dict:
    """``{"loss", "bpb", "eval_windows"}`` of ``eval_fn(params, batch) -> mean CE`` over ``windows``
    ``[N, T+1]`` (or a dict of such arrays, ``{"tokens", "segment_ids"}``, cut into batches row-wise
    together): the mean of the per-batch losses (nats/token) and bits/byte.

    ``eval_fn`` is jitted with ``batch_shard`` as its token sharding; call under the mesh
    (``jax.set_mesh``). Raises ``ValueError`` when the windows cannot fill one batch.
    """
    n_windows = window_count(windows)
    per, n = eval_batching(n_windows, global_batch, n_batch_shards)
    if n == 0:
        raise ValueError(f"{n_windows} eval windows cannot fill one batch of {per} rows on "
                         f"{n_batch_shards} batch shards; use a shorter seq_len or more eval windows")
    losses = [float(eval_fn(params, put_batch(_rows(windows, i, i + per), batch_shard))) for i in range(0, n, per)]
    ce = float(np.mean(losses))
    return {"loss": ce, "bpb": bits_per_byte(ce, bytes_per_token), "eval_windows": n}
