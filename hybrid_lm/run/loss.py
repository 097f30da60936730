"""One evaluation of next-token loss on fixed windows, shared by the trainer and ``hybrid-lm eval``.

The batching rule lives here only: batches of ``per`` rows (the global batch, rounded down to a
multiple of the batch shards, at least one row per shard) and whole batches only, so the trainer's
eval and an unswapped ``hybrid-lm eval`` of the same checkpoint give the same number.
"""

from __future__ import annotations

import time

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
    """The loss of ``eval_fn(params, batch) -> [rows]`` (each window's mean CE, nats/token) over
    ``windows`` ``[N, T+1]`` (or a dict of such arrays, ``{"tokens", "segment_ids"}``, cut into batches
    row-wise together): ``{"loss", "loss_se", "bpb", "bpb_se", "eval_windows", "window_losses", "eval_s"}``
    (``eval_s``: its wall time, the first call's compile included).

    ``loss`` is the mean over the windows (every window has T targets, so it is the mean over tokens);
    ``loss_se`` its standard error over windows (:func:`standard_error`); bits/byte and its error from the
    bytes of all evaluated targets; ``window_losses`` each window's loss (float64 array), for paired
    differences between models on the same windows (:func:`paired_difference`).

    ``eval_fn`` is jitted with ``batch_shard`` as its token sharding; call under the mesh
    (``jax.set_mesh``). Raises ``ValueError`` when the windows cannot fill one batch.
    """
    t0 = time.perf_counter()
    n_windows = window_count(windows)
    per, n = eval_batching(n_windows, global_batch, n_batch_shards)
    if n == 0:
        raise ValueError(f"{n_windows} eval windows cannot fill one batch of {per} rows on "
                         f"{n_batch_shards} batch shards; use a shorter seq_len or more eval windows")
    # every batch dispatched before the first is read back: the host never waits between batches
    outs = [eval_fn(params, put_batch(_rows(windows, i, i + per), batch_shard)) for i in range(0, n, per)]
    losses = np.concatenate([np.asarray(o, np.float64).reshape(-1) for o in outs])
    ce, se = float(np.mean(losses)), standard_error(losses)
    return {"loss": ce, "loss_se": se, "bpb": bits_per_byte(ce, bytes_per_token),
            "bpb_se": None if se is None else bits_per_byte(se, bytes_per_token), "eval_windows": n,
            "window_losses": losses, "eval_s": time.perf_counter() - t0}


def standard_error(values) -> float | None:
    """The standard error of the mean of ``values`` (sample standard deviation / sqrt(n)); None for
    fewer than two. Windows are treated as independent draws of the held-out text."""
    v = np.asarray(values, np.float64)
    return float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size >= 2 else None


def paired_difference(a, b) -> tuple[float, float | None]:
    """``(mean(a - b), its standard error)`` of two models' per-window losses on the same windows (the
    paired difference: what the windows share cancels, so it is far smaller than either loss's error)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired windows need two equal 1-d lists of window losses, got {a.shape} and {b.shape}")
    return float(np.mean(a - b)), standard_error(a - b)


def row_window_losses(losses) -> list[float]:
    """Per-window losses as stored in a results row: a JSON list, rounded to 1e-6 nats."""
    return [round(float(x), 6) for x in losses]


def format_se(se: float | None, digits: int = 4) -> str:
    """`` ± 0.0012`` for a printed loss, or nothing without an error."""
    return "" if se is None else f" ± {se:.{digits}f}"
