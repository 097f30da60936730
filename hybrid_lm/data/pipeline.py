"""Step-indexed data (Levanter-style), read through grain.

A corpus is cut into fixed windows of ``seq_len + 1`` tokens (stride ``seq_len``). The training
stream is ``MapDataset.source(windows).shuffle(seed).repeat().batch(global_batch)``: the batch of
step ``s`` is simply ``dataset[s]``. Resume is exact, the data position is the step, and the
tokens seen are ``steps * global_batch * seq_len``.
"""

from __future__ import annotations

from pathlib import Path

import grain
import numpy as np

from hybrid_lm.config import Config
from hybrid_lm.data.corpus import ensure_prepared, load_meta


class TokenWindows(grain.sources.RandomAccessDataSource):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a memory-mapped token file."""

    def __init__(self, path: Path, seq_len: int):
        self.path = Path(path)
        self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (self.tokens.size - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"{self.path} has {self.tokens.size} tokens: too few for one window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(i)
        s = i * self.seq_len
        return np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int32)

    def __repr__(self) -> str:
        return f"TokenWindows({self.path}, seq_len={self.seq_len}, n={self.n})"


class DataStreams:
    """Training batches by step, and fixed evaluation windows."""

    def __init__(self, cfg: Config):
        d = cfg.data
        self.dir = ensure_prepared(d.source, d.path, d.tokenizer)
        self.meta = load_meta(self.dir)
        self.train_windows = TokenWindows(self.dir / "train.bin", d.seq_len)
        self.val_windows = TokenWindows(self.dir / "val.bin", d.seq_len)
        self.global_batch = cfg.train.global_batch
        self.train = (grain.MapDataset.source(self.train_windows).shuffle(seed=cfg.train.seed).repeat()
                      .batch(self.global_batch, drop_remainder=True))
        n_eval = min(d.eval_windows, len(self.val_windows))
        idx = np.linspace(0, len(self.val_windows) - 1, n_eval).round().astype(int)  # spread over val
        self.eval_batch = np.stack([self.val_windows[i] for i in idx])

    def batch(self, step: int) -> np.ndarray:
        """Global batch ``[global_batch, seq_len + 1]`` (int32) for optimizer step ``step``."""
        return self.train[step]

    @property
    def bytes_per_token(self) -> float:
        return float(self.meta["bytes_per_token"])
