"""Step-indexed training data (Levanter-style) over token stores, read through grain.

Packing: a split (or a subset of its documents) is one token sequence, documents back to back,
each followed by the tokenizer's separator. It is cut into windows of ``seq_len + 1`` tokens at
stride ``seq_len``; window ``i`` starts at token ``i * seq_len``. With
``DataConfig.document_mask`` each window also carries ``segment_ids`` (which document each token
belongs to, from 0 in each row); positions restart per document in the model.

Mixing: the components are the stores of ``DataConfig.mixture`` (or the one store), each split into
long (>= ``long_min_tokens``) and short documents when long/short mixing is on, weighted by
``long_fraction``. Every window has ``seq_len + 1`` tokens, so a ratio of windows is a ratio of
tokens. The component of global sample ``g`` is fixed per block of :data:`MIX_BLOCK` samples: the
block holds each component's share (largest remainder) in a seeded random order, so the token ratio
is exact to 1 / MIX_BLOCK over any whole block.

Step indexing: sample ``g = step * global_batch + row``; within a component, windows are shuffled
by grain (``MapDataset.source(w).shuffle(seed).repeat()``: a new order each epoch, no window
repeated or lost within one). The batch of step ``s`` is a pure function of (config, s), and a
process reads only its own rows (``rows=``), so resume is exact on any number of hosts. Tokens seen
are ``steps * global_batch * seq_len`` exactly: windows are never padded.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import grain
import numpy as np

from hybrid_lm.config import Config
from hybrid_lm.data import store as st
from hybrid_lm.data.corpus import ensure_store
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import DataError

MIX_BLOCK = 4096


class DocSubset:
    """Some documents of a split, as one virtual token sequence (same interface as ``SplitView``)."""

    def __init__(self, view: st.SplitView, docs: np.ndarray, name: str):
        self.view, self.docs, self.name = view, np.asarray(docs, np.int64), name
        self.src_starts = view.doc_starts[self.docs]
        self.doc_starts = np.concatenate([[0], np.cumsum(view.doc_lengths[self.docs])]).astype(np.int64)
        self.n_tokens = int(self.doc_starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        out, pos, end = [], start, start + length
        k = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        while pos < end:
            n = min(end, self.doc_starts[k + 1]) - pos
            out.append(self.view.read(int(self.src_starts[k] + pos - self.doc_starts[k]), int(n)))
            pos += n
            k += 1
        return np.concatenate(out)

    def locate(self, offset: int) -> tuple[str, int]:
        k = int(np.searchsorted(self.doc_starts, offset, side="right")) - 1
        return self.view.locate(int(self.src_starts[k] + offset - self.doc_starts[k]))


class PackedWindows(grain.sources.RandomAccessDataSource):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over a token sequence."""

    def __init__(self, stream, seq_len: int, name: str):
        self.stream, self.seq_len, self.name = stream, seq_len, name
        self.n = (stream.n_tokens - 1) // seq_len
        if self.n < 1:
            raise DataError(f"{name} has {stream.n_tokens:,} tokens: too few for one window of seq_len + 1 = "
                            f"{seq_len + 1:,} (prepare more data or lower DataConfig.seq_len)")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.stream.read(i * self.seq_len, self.seq_len + 1).astype(np.int32)

    def segments(self, i: int) -> np.ndarray:
        """Document index of each token of window ``i``, counted from 0 within the window."""
        first, starts = int(i) * self.seq_len, self.stream.doc_starts
        lo, hi = np.searchsorted(starts, [first, first + self.seq_len], side="right")
        seg = np.zeros(self.seq_len + 1, np.int32)
        seg[starts[lo:hi] - first] = 1  # documents starting inside the window
        return np.cumsum(seg, dtype=np.int32)

    def locate(self, i: int, col: int) -> tuple[str, int]:
        return self.stream.locate(int(i) * self.seq_len + int(col))

    def __repr__(self) -> str:
        return f"PackedWindows({self.name}, seq_len={self.seq_len}, n={self.n})"


def mix_counts(weights: np.ndarray, block: int = MIX_BLOCK) -> np.ndarray:
    """Samples per component in one block: ``block * w / sum(w)`` rounded by largest remainder."""
    share = block * np.asarray(weights, np.float64) / np.sum(weights)
    counts = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - counts), kind="stable")
    counts[order[: block - counts.sum()]] += 1
    return counts


class Mixture:
    """Global sample index -> (component, index within it), deterministic from the seed."""

    def __init__(self, weights, seed: int, block: int = MIX_BLOCK):
        self.counts, self.seed, self.block = mix_counts(weights, block), seed, block
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int):
        if b not in self._cache:
            rng = np.random.default_rng([self.seed, b, 0x6D6978])
            comp = rng.permutation(np.repeat(np.arange(self.counts.size), self.counts))
            rank = np.zeros_like(comp)
            for c in range(self.counts.size):
                m = comp == c
                rank[m] = np.arange(m.sum())
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[b] = (comp, rank)
        return self._cache[b]

    def __call__(self, g: int) -> tuple[int, int]:
        b, j = divmod(int(g), self.block)
        comp, rank = self._block(b)
        c = int(comp[j])
        return c, b * int(self.counts[c]) + int(rank[j])


class DataStreams:
    """Training batches by step, and fixed evaluation windows."""

    def __init__(self, cfg: Config):
        d, self.cfg = cfg.data, cfg

        self.tokenizer = load_tokenizer(d.tokenizer)
        entries = d.mixture or ((None, 1.0),)
        self.stores = [self._open(ensure_store(d.source, d.path, d.tokenizer) if path is None else Path(path))
                       for path, _ in entries]
        self.components: list[PackedWindows] = []
        weights = []
        for store, (_, w) in zip(self.stores, entries):
            view = store.split("train")
            label = f"{store.path} train split"
            if d.long_min_tokens:
                lengths = view.doc_lengths
                long = np.flatnonzero(lengths >= d.long_min_tokens)
                short = np.flatnonzero(lengths < d.long_min_tokens)
                if not long.size or not short.size:
                    raise DataError(
                        f"{label}: long/short mixing at long_min_tokens={d.long_min_tokens:,} found "
                        f"{long.size:,} long and {short.size:,} short documents (longest {int(lengths.max()):,} "
                        "tokens): both kinds are needed; change long_min_tokens or set it to 0")
                self.components += [PackedWindows(DocSubset(view, long, "long"), d.seq_len, f"{label} (long)"),
                                    PackedWindows(DocSubset(view, short, "short"), d.seq_len, f"{label} (short)")]
                weights += [w * d.long_fraction, w * (1 - d.long_fraction)]
            else:
                self.components.append(PackedWindows(view, d.seq_len, label))
                weights.append(w)
        self.weights = np.asarray(weights, np.float64) / np.sum(weights)
        seed = cfg.train.data_order_seed
        # window order per component: grain's index shuffle, a new permutation each epoch
        self._indices = [grain.MapDataset.range(len(c)).shuffle(seed=seed + 7919 * k).repeat()
                         for k, c in enumerate(self.components)]
        self.mixture = Mixture(self.weights, seed) if len(self.components) > 1 else None
        self.global_batch = cfg.train.global_batch
        self.val_windows = PackedWindows(self.stores[0].split("val"), d.seq_len, f"{self.stores[0].path} val split")
        n_eval = min(d.eval_windows, len(self.val_windows))
        idx = np.linspace(0, len(self.val_windows) - 1, n_eval).round().astype(int)  # spread over val
        self._eval_idx = idx
        self.eval_tokens = np.stack([self.val_windows[i] for i in idx])
        self._check_ids(self.eval_tokens, lambda r, c: self.val_windows.locate(idx[r], c))

    # ------------------------------------------------------------------ stores
    def _open(self, path: Path) -> st.TokenStore:
        d = self.cfg.data
        store = st.TokenStore(path)
        fp = store.tokenizer.get("fingerprint")
        if fp != self.tokenizer.fingerprint:
            raise DataError(f"token store {store.path} was prepared with tokenizer {store.tokenizer.get('spec')!r} "
                            f"(fingerprint {str(fp)[:12]}), the config uses {d.tokenizer!r} "
                            f"({self.tokenizer.fingerprint[:12]}): prepare the store with this tokenizer")
        store.check_vocab(self.cfg.model.vocab_size)
        return store

    @property
    def store(self) -> st.TokenStore:
        return self.stores[0]

    @cached_property
    def meta(self) -> dict:
        """What the logger and the run's provenance record about the data."""
        s = self.store.stats()
        val = s.get("splits", {}).get("val", {})
        return {"stores": [str(x.path) for x in self.stores], "fingerprints": [x.fingerprint for x in self.stores],
                "train_tokens": sum(x.n_tokens("train") for x in self.stores),
                "weights": self.weights.tolist(), "components": [c.name for c in self.components],
                "val_order0_entropy_bits": val.get("order0_entropy_bits_per_byte")}

    # ------------------------------------------------------------------ batches
    def sample(self, g: int) -> tuple[int, int]:
        """(component, window index) of global sample ``g``."""
        if self.mixture is None:
            return 0, int(self._indices[0][g])
        c, k = self.mixture(g)
        return c, int(self._indices[c][k])

    def batch(self, step: int, rows: slice | None = None):
        """Rows ``rows`` (default all) of the global batch of optimizer step ``step``: int32
        ``[rows, seq_len + 1]`` tokens, or with ``document_mask`` a dict with ``segment_ids`` too."""
        lo, hi, _ = (rows or slice(0, self.global_batch)).indices(self.global_batch)
        picks = [self.sample(step * self.global_batch + r) for r in range(lo, hi)]
        tokens = np.stack([self.components[c][i] for c, i in picks])
        self._check_ids(tokens, lambda r, col: self.components[picks[r][0]].locate(picks[r][1], col))
        if not self.cfg.data.document_mask:
            return tokens
        seg = np.stack([self.components[c].segments(i) for c, i in picks])
        return {"tokens": tokens, "segment_ids": seg}

    @property
    def eval_batch(self):
        if not self.cfg.data.document_mask:
            return self.eval_tokens
        return {"tokens": self.eval_tokens,
                "segment_ids": np.stack([self.val_windows.segments(i) for i in self._eval_idx])}

    def _check_ids(self, tokens: np.ndarray, locate) -> None:
        vocab = self.cfg.model.vocab_size
        if tokens.size and tokens.max() >= vocab:
            r, col = (int(x[0]) for x in np.nonzero(tokens >= vocab))
            shard, off = locate(r, col)
            raise DataError(f"token id {int(tokens[r, col])} >= vocab_size {vocab} in shard {shard} at offset "
                            f"{off:,}: the store does not match its manifest (run `hybrid-lm data verify`)")

    @property
    def n_train_windows(self) -> int:
        """Windows of all training components together."""
        return sum(len(c) for c in self.components)

    @cached_property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per evaluated target token, counted over the eval windows (exact bits/byte):
        the bytes each target id decodes to, less a SentencePiece-style dummy-prefix space at each
        document start among the targets."""
        targets = self.eval_tokens[:, 1:]
        tb = np.asarray(self.tokenizer.token_bytes, np.int64)
        n_bytes = int(tb[targets].sum())
        prefix = int(getattr(self.tokenizer, "dummy_prefix_bytes", 0))
        if prefix:
            starts = sum(int((np.diff(self.val_windows.segments(i)) > 0).sum()) for i in self._eval_idx)
            n_bytes -= prefix * starts
        return n_bytes / targets.size
