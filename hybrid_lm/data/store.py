"""Token stores: a prepared corpus as random-access shards of token ids, verified when opened.

Layout of a store directory (written by :mod:`hybrid_lm.data.prepare`, atomically as a whole)::

    manifest.json     format, tokenizer, dtype, source, settings, and per split its shards
                      (file, tokens, documents, sha256, max_id); the content fingerprint
    stats.json        documents, tokens, bytes per token, skipped documents and why, length histogram
    doc_lengths.png   the document-length histogram
    train-00000.bin   token ids (uint16, or uint32 for vocabularies over 65,536), documents back to
                      back, each followed by the tokenizer's separator (EOS, or "\\n\\n" for bytes)
    train-00000.idx   int64 [documents + 1]: where each document starts in the shard; the last
                      entry is the shard's token count

Shards are memory-mapped, so reading any window is O(1) in the store's size. Opening a store checks
every shard's file size and index against the manifest (a truncated shard is named at open time);
:meth:`TokenStore.verify` also checks content hashes, ids against the vocabulary, and the index.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybrid_lm.errors import DataError
from hybrid_lm.progress import bar_disabled

FORMAT = "hybrid_lm.token_store/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_names(split: str, index: int) -> tuple[str, str]:
    stem = f"{split}-{index:05d}"
    return f"{stem}.bin", f"{stem}.idx"


def content_fingerprint(tokenizer_fingerprint: str, dtype: str, splits: dict) -> str:
    """sha256 over the tokenizer and every shard's content hash, in order: the store's identity,
    independent of where it lives."""
    h = hashlib.sha256(f"{FORMAT}|{tokenizer_fingerprint}|{dtype}".encode())
    for split in SPLITS:
        for s in splits.get(split, {}).get("shards", []):
            h.update(f"|{split}:{s['tokens']}:{s['documents']}:{s['sha256']}".encode())
    return h.hexdigest()


def read_chunks(path: Path, dtype: np.dtype, n_tokens: int, chunk: int):
    """Consecutive arrays of at most ``chunk`` tokens from a shard file."""
    with open(path, "rb") as f:
        for lo in range(0, n_tokens, chunk):
            yield np.fromfile(f, dtype=dtype, count=min(chunk, n_tokens - lo))


def is_store(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class SplitView:
    """One split of a store as a single virtual token sequence over its shards."""

    def __init__(self, store: "TokenStore", split: str):
        self.store, self.split = store, split
        self.shards = store.manifest["splits"][split]["shards"]
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.n_tokens = int(self.shard_starts[-1])
        self._tokens = [np.memmap(store.path / s["file"], dtype=store.dtype, mode="r") if s["tokens"] else
                        np.zeros(0, store.dtype) for s in self.shards]

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """int64 [documents + 1]: global token offsets of the document starts (last = n_tokens)."""
        parts = [np.fromfile(self.store.path / s["index"], dtype=np.int64)[:-1] + base
                 for s, base in zip(self.shards, self.shard_starts)]
        return np.concatenate(parts + [np.array([self.n_tokens], np.int64)])

    @property
    def n_docs(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.doc_starts)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"{self.split}: tokens [{start}, {start + length}) outside [0, {self.n_tokens})")
        out, pos, end = [], start, start + length
        k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while pos < end:
            lo = pos - self.shard_starts[k]
            n = min(end, self.shard_starts[k + 1]) - pos
            out.append(self._tokens[k][lo: lo + n])
            pos += n
            k += 1
        return np.concatenate(out).astype(np.int64) if len(out) != 1 else out[0].astype(np.int64)

    def iter_chunks(self, tokens: int = 1 << 20):
        """The split's tokens in order, ``tokens`` at a time, read from the files (not mapped, so a
        full pass holds one chunk in memory and leaves the resident set alone)."""
        for s in self.shards:
            yield from read_chunks(self.store.path / s["file"], self.store.dtype, s["tokens"], tokens)

    def locate(self, offset: int) -> tuple[str, int]:
        """(shard file, offset within it) of global token ``offset``."""
        k = int(np.searchsorted(self.shard_starts, offset, side="right")) - 1
        return self.shards[k]["file"], int(offset - self.shard_starts[k])


class TokenStore:
    """A prepared store, opened read-only. Cheap checks against the manifest run at open time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mf = self.path / MANIFEST
        if not mf.is_file():
            hint = ("it holds a corpus in the old train.bin/meta.json format: prepare it again"
                    if (self.path / "meta.json").exists() else "run `hybrid-lm data prepare --out " f"{self.path}`")
            raise DataError(f"no token store at {self.path} ({MANIFEST} missing): {hint}")
        try:
            self.manifest = json.loads(mf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{mf} is not valid JSON ({e}): prepare the store again") from None
        if self.manifest.get("format") != FORMAT:
            raise DataError(f"{mf}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self._check_files()

    def _check_files(self) -> None:
        for split in SPLITS:
            for s in self.manifest["splits"][split]["shards"]:
                for key, want in (("file", s["tokens"] * self.dtype.itemsize), ("index", (s["documents"] + 1) * 8)):
                    f = self.path / s[key]
                    if not f.is_file():
                        raise DataError(f"token store {self.path}: shard file {s[key]} is missing")
                    got = f.stat().st_size
                    if got != want:
                        raise DataError(f"token store {self.path}: shard {s[key]} has {got:,} bytes, the manifest "
                                        f"says {want:,} (truncated or replaced): prepare the store again")

    # ------------------------------------------------------------------ what the manifest says
    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def max_id(self) -> int:
        return max((s["max_id"] for sp in SPLITS for s in self.manifest["splits"][sp]["shards"]), default=-1)

    def n_tokens(self, split: str) -> int:
        return int(self.manifest["splits"][split]["tokens"])

    def stats(self) -> dict:
        f = self.path / "stats.json"
        return json.loads(f.read_text()) if f.is_file() else {}

    def split(self, name: str) -> SplitView:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; a store has {SPLITS}")
        return SplitView(self, name)

    def check_vocab(self, vocab_size: int) -> None:
        """Every id the manifest records is below ``vocab_size``; otherwise name the shard."""
        for split in SPLITS:
            for s in self.manifest["splits"][split]["shards"]:
                if s["max_id"] >= vocab_size:
                    raise DataError(f"token store {self.path}: shard {s['file']} holds id {s['max_id']}, not below "
                                    f"the model's vocab_size {vocab_size} (prepared with another tokenizer?)")

    # ------------------------------------------------------------------ full verification
    def verify(self, progress: bool = False) -> dict:
        """Hash every shard and check its ids and index; raise :class:`DataError` naming the first
        bad shard (and offset). Returns per-split token and document counts."""

        vocab = int(self.tokenizer["vocab_size"])
        total = sum(s["tokens"] for sp in SPLITS for s in self.manifest["splits"][sp]["shards"])
        bar = tqdm(total=total, unit="tok", unit_scale=True, disable=bar_disabled(progress), desc="verify")
        for split in SPLITS:
            for s in self.manifest["splits"][split]["shards"]:
                h, lo = hashlib.sha256(), 0
                for part in read_chunks(self.path / s["file"], self.dtype, s["tokens"], 1 << 22):
                    h.update(part.tobytes())
                    bad = np.flatnonzero(part >= vocab)
                    if bad.size:
                        off = lo + int(bad[0])
                        raise DataError(f"token store {self.path}: shard {s['file']} offset {off:,} holds id "
                                        f"{int(part[bad[0]])} >= the tokenizer's vocab_size {vocab}")
                    bar.update(part.size)
                    lo += part.size
                if h.hexdigest() != s["sha256"]:
                    raise DataError(f"token store {self.path}: shard {s['file']} content does not match its "
                                    "manifest hash (corrupt or modified): prepare the store again")
                idx = np.fromfile(self.path / s["index"], dtype=np.int64)
                if idx[0] != 0 or idx[-1] != s["tokens"] or np.any(np.diff(idx) <= 0):
                    raise DataError(f"token store {self.path}: index {s['index']} is not increasing from 0 to "
                                    f"{s['tokens']} (corrupt)")
        bar.close()
        return {sp: {"tokens": self.n_tokens(sp), "documents": self.manifest["splits"][sp]["documents"]}
                for sp in SPLITS}
