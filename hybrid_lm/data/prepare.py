"""``hybrid-lm data prepare``: a document source -> a token store (:mod:`hybrid_lm.data.store`).

- Streaming: documents are read, encoded and written in bounded chunks, so memory does not grow
  with the corpus (the doc-length index of the open shard is the only per-document state). One
  document is encoded whole, so a document over ``PrepareSettings.max_document_bytes`` (64 MiB,
  ``--max-document-mb``) is skipped with a warning, unread where its size is known first
  (``data/sources.py``): the peak memory is then bounded by about 16 bytes per byte of that limit.
- Several encoder processes (``workers``); the order of documents is kept, so the store is the
  same whatever the worker count.
- Split by document: document ``i`` (in source order) goes to val when ``i % val_every ==
  val_every - 1``. A corpus with fewer than ``val_every`` documents gives its last document to
  val; a corpus of one document gives val the last ``1 / val_every`` of its tokens.
- Atomic and resumable: the store is built in ``.<name>.partial-<settings>/`` beside ``out`` and
  renamed into place when complete (a re-prepare swaps all of a store's files at once). Every
  closed train shard is a resume point (``progress.json``); a killed prepare run again with the same
  settings continues from the last one and drops anything written after it.
- Idempotent: the same source, tokenizer and settings as the store at ``out`` do nothing; other
  settings fail with the fields that differ unless ``overwrite``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hybrid_lm.data import store as st
from hybrid_lm.data.sources import MAX_DOCUMENT_BYTES, open_source
from hybrid_lm.data.stats import write_stats
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import DataError, WorkdirError
from hybrid_lm.files import atomic_write_json
from hybrid_lm.lock import WorkdirLock
from hybrid_lm.progress import bar_disabled

CHUNK_BYTES = 1 << 20  # text per encode task
CHUNK_DOCS = 1024
DEFAULT_SHARD_TOKENS = 1 << 25


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    tokenizer: str = "byte"
    val_every: int = 10
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    max_document_bytes: int = MAX_DOCUMENT_BYTES  # a longer document is skipped with a warning

    def check(self) -> None:
        if self.max_document_bytes < 1:
            raise DataError(f"--max-document-mb {self.max_document_bytes / (1 << 20):g}: must be > 0 (the largest "
                            f"document read, in MiB; default {MAX_DOCUMENT_BYTES >> 20})")
        if self.val_every < 2:
            raise DataError(f"val_every={self.val_every}: must be >= 2 (one document in val_every goes to val)")
        if self.shard_tokens < 1024:
            raise DataError(f"shard_tokens={self.shard_tokens}: must be >= 1024")


@dataclasses.dataclass
class PrepareResult:
    path: Path
    manifest: dict
    stats: dict
    skipped: bool  # the store was already up to date


def settings_record(source_spec, tok, settings: PrepareSettings) -> dict:
    """What defines a store's content: the format, the input, the tokenizer and the split/shard settings."""
    record = {"format": st.FORMAT, "source": source_spec.describe(), "tokenizer": tok.describe(),
              "val_every": settings.val_every, "shard_tokens": settings.shard_tokens}
    if settings.max_document_bytes != MAX_DOCUMENT_BYTES:  # (the default keeps earlier stores' settings hash)
        record["max_document_bytes"] = settings.max_document_bytes
    return record


def _hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------- encoding workers

_WORKER_TOK = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOK
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker: workers are the parallelism
    _WORKER_TOK = load_tokenizer(spec)


def _encode_chunk(texts: list[str]) -> list[tuple[np.ndarray, int]]:
    ids = _WORKER_TOK.encode_batch(texts)
    return [(np.asarray(a, dtype=np.uint32), len(t.encode("utf-8"))) for a, t in zip(ids, texts)]


def _chunks(docs, skip: int):
    """Lists of texts of about CHUNK_BYTES, after dropping the first ``skip`` documents (resume)."""
    buf, size = [], 0
    for i, doc in enumerate(docs):
        if i < skip:
            continue
        buf.append(doc.text)
        size += len(doc.text)
        if size >= CHUNK_BYTES or len(buf) >= CHUNK_DOCS:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


def _encoded(chunks, spec: str, workers: int):
    """(ids, utf-8 bytes) per document, in order; at most 2 * workers chunks in flight."""
    if workers <= 1:
        _init_worker(spec)
        for c in chunks:
            yield from _encode_chunk(c)
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending = collections.deque()
        for c in chunks:
            pending.append(pool.apply_async(_encode_chunk, (c,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


# ----------------------------------------------------------------------------- shard writing

class _ShardWriter:
    def __init__(self, directory: Path, split: str, index: int, dtype: np.dtype):
        self.file, self.index = st.shard_names(split, index)
        self.path, self.dtype = directory, dtype
        self.fh = open(directory / self.file, "wb")
        self.sha, self.starts, self.n, self.max_id, self.nbytes = hashlib.sha256(), [0], 0, -1, 0

    def add(self, ids: np.ndarray, nbytes: int) -> None:
        arr = ids.astype(self.dtype)
        b = arr.tobytes()
        self.fh.write(b)
        self.sha.update(b)
        self.n += arr.size
        self.starts.append(self.n)
        self.max_id = max(self.max_id, int(arr.max()))
        self.nbytes += nbytes

    @property
    def documents(self) -> int:
        return len(self.starts) - 1

    def close(self) -> dict | None:
        """Flush to disk; the shard record, or None (files removed) for an empty shard."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if not self.documents:
            (self.path / self.file).unlink()
            return None
        np.asarray(self.starts, dtype=np.int64).tofile(self.path / self.index)
        return {"file": self.file, "index": self.index, "tokens": self.n, "documents": self.documents,
                "sha256": self.sha.hexdigest(), "max_id": self.max_id, "text_bytes": self.nbytes}


class _Builder:
    """The partial store: open shard writers, closed shard records and the resume point."""

    def __init__(self, tmp: Path, dtype: np.dtype, settings_hash: str, resume: dict | None):
        self.tmp, self.dtype, self.settings_hash = tmp, dtype, settings_hash
        self.shards = {s: list((resume or {}).get("shards", {}).get(s, [])) for s in st.SPLITS}
        self.docs_consumed = int((resume or {}).get("docs_consumed", 0))
        self.no_tokens = int((resume or {}).get("no_tokens", 0))
        keep = {r[k] for recs in self.shards.values() for r in recs for k in ("file", "index")}
        for f in tmp.iterdir():  # anything written after the last resume point
            if f.name not in keep and f.name != "progress.json":
                f.unlink()
        self.writers = {s: self._new_writer(s) for s in st.SPLITS}

    def _new_writer(self, split: str) -> _ShardWriter:
        return _ShardWriter(self.tmp, split, len(self.shards[split]), self.dtype)

    def checkpoint(self, last: bool = False) -> None:
        """Close the open shards of both splits and record the resume point; unless ``last``, open the
        next shards (the last checkpoint opens none, so no empty shard file is left behind)."""
        for s in st.SPLITS:
            rec = self.writers[s].close()
            if rec:
                self.shards[s].append(rec)
            if not last:
                self.writers[s] = self._new_writer(s)
        atomic_write_json(self.tmp / "progress.json", {
            "settings_hash": self.settings_hash, "docs_consumed": self.docs_consumed,
            "no_tokens": self.no_tokens, "shards": self.shards})

    def val_documents(self) -> int:
        return sum(r["documents"] for r in self.shards["val"]) + self.writers["val"].documents


def _find_partial(out: Path, settings_hash: str) -> tuple[Path, dict | None]:
    tmp = out.parent / f".{out.name}.partial-{settings_hash[:16]}"
    prog = tmp / "progress.json"
    if prog.is_file():
        try:
            p = json.loads(prog.read_text())
            if p.get("settings_hash") == settings_hash:
                return tmp, p
        except json.JSONDecodeError:
            pass
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp, None


def _check_existing(out: Path, settings_hash: str, record: dict, overwrite: bool) -> bool:
    """True if ``out`` already holds this store; raise if it holds another and ``overwrite`` is off."""
    if not out.exists():
        return False
    if not st.is_store(out):
        if out.is_dir() and not any(out.iterdir()):
            return False
        if (out / "meta.json").exists() and overwrite:
            return False
        raise DataError(f"--out {out} exists and is not a token store: choose another --out"
                        + (" or pass --overwrite (it holds a corpus in the old train.bin format)"
                           if (out / "meta.json").exists() else ""))
    old = json.loads((out / st.MANIFEST).read_text())
    if old.get("settings_hash") == settings_hash:
        return True
    if overwrite:
        return False
    prev = old.get("settings", {})
    diff = sorted(k for k in set(prev) | set(record) if prev.get(k) != record.get(k))
    raise DataError(f"{out} holds a store prepared with other settings (differs in: {', '.join(diff) or 'format'}): "
                    "choose another --out, or pass --overwrite to replace it")


class PrepareBusy(DataError):
    """Another process holds the prepare lock of the same ``out`` (``corpus.ensure_store`` waits for it)."""


def prepare(source_spec, out: str | Path, settings: PrepareSettings = PrepareSettings(), *, workers: int = 1,
            overwrite: bool = False, progress: bool = True) -> PrepareResult:
    """Build (or confirm) the token store at ``out`` from ``source_spec``; see the module docstring.
    One prepare at a time per ``out`` (a lock beside it)."""
    out = Path(out)
    lock_dir = out.parent / f".{out.name}.lock"
    try:
        lock = WorkdirLock(lock_dir).acquire()
    except OSError as e:
        raise _unwritable(out, e) from None
    except WorkdirError as e:
        if isinstance(e.__cause__, OSError):  # the lock beside --out cannot be written: --out cannot either
            raise _unwritable(out, e.__cause__) from None
        raise PrepareBusy(f"another `data prepare` is writing {out}: {e}") from None
    try:
        return _prepare(source_spec, out, settings, workers=workers, overwrite=overwrite, progress=progress)
    finally:
        lock.release()
        with contextlib.suppress(OSError):
            lock_dir.rmdir()


def _unwritable(out: Path, e: OSError) -> DataError:
    """--out cannot be written: the path given and the cause, not the hidden lock or partial dir beside it."""
    return DataError(f"cannot write --out {out}: {e.strerror or type(e).__name__} (in {out.parent}); choose "
                     "another --out")


def _prepare(source_spec, out: Path, settings: PrepareSettings, *, workers: int, overwrite: bool,
             progress: bool) -> PrepareResult:

    settings.check()
    if workers < 1:
        raise DataError(f"workers={workers}: must be >= 1")
    tok = load_tokenizer(settings.tokenizer)
    record = settings_record(source_spec, tok, settings)
    shash = _hash(record)
    if _check_existing(out, shash, record, overwrite):
        store = st.TokenStore(out)
        return PrepareResult(out, store.manifest, store.stats(), skipped=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, resume = _find_partial(out, shash)
    tmp.mkdir(exist_ok=True)
    dtype = st.dtype_for_vocab(tok.vocab_size)
    b = _Builder(tmp, dtype, shash, resume)
    sep = np.asarray(tok.separator, dtype=np.uint32)
    source = open_source(source_spec)
    source.max_document_bytes = settings.max_document_bytes
    t0 = time.perf_counter()
    start = b.docs_consumed
    pending = None  # the latest train document, held back so a corpus without a val document can give it
    bar = tqdm(desc=f"prepare {out.name}", unit=" docs", disable=bar_disabled(progress), initial=start)
    tokens = 0
    for i, (ids, nbytes) in enumerate(_encoded(_chunks(source.iter_documents(), start), settings.tokenizer, workers),
                                      start=start):
        b.docs_consumed = i + 1
        bar.update(1)
        if ids.size == 0:
            b.no_tokens += 1
            continue
        doc = (np.concatenate([ids, sep]), nbytes)
        tokens += doc[0].size
        if i % settings.val_every == settings.val_every - 1:
            b.writers["val"].add(*doc)
        else:
            if pending is not None:
                b.writers["train"].add(*pending)
            pending = doc
        if b.writers["train"].n >= settings.shard_tokens and b.val_documents():
            if pending is not None:  # val is not empty, so the held document belongs to train
                b.writers["train"].add(*pending)
                pending = None
            b.checkpoint()
        if i % 256 == 0:
            bar.set_postfix(tokens=f"{tokens:,}")
    bar.close()
    _place_held(b, pending, settings.val_every, sep)
    b.checkpoint(last=True)
    n_docs = sum(r["documents"] for recs in b.shards.values() for r in recs)
    if not n_docs:
        over = (f"; documents over {settings.max_document_bytes / (1 << 20):g} MiB are skipped "
                "(--max-document-mb)") if source.stats.oversize_skipped else ""
        raise DataError(f"the source yielded no usable documents ({_skip_summary(source.stats, b.no_tokens)}{over}); "
                        "nothing was written")
    manifest = {
        "format": st.FORMAT, "settings": record, "settings_hash": shash, "tokenizer": tok.describe(),
        "dtype": dtype.name, "source": source_spec.describe(),
        "splits": {s: {"tokens": sum(r["tokens"] for r in b.shards[s]),
                       "documents": sum(r["documents"] for r in b.shards[s]), "shards": b.shards[s]}
                   for s in st.SPLITS},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest["fingerprint"] = st.content_fingerprint(tok.fingerprint, dtype.name, manifest["splits"])
    atomic_write_json(tmp / st.MANIFEST, manifest, indent=2)
    stats = write_stats(st.TokenStore(tmp), tok, source.stats, b.no_tokens, time.perf_counter() - t0, out.name)
    (tmp / "progress.json").unlink()
    _swap_into_place(tmp, out)
    return PrepareResult(out, manifest, stats, skipped=False)


def _place_held(b: _Builder, pending, val_every: int, sep: np.ndarray) -> None:
    """The held-back document goes to train, or to val when val would otherwise be empty (and with a
    single document, val gets its last 1/val_every of tokens)."""
    if pending is None:
        return
    train_docs = sum(r["documents"] for r in b.shards["train"]) + b.writers["train"].documents
    if b.val_documents():
        b.writers["train"].add(*pending)
    elif train_docs:
        b.writers["val"].add(*pending)
    else:
        ids, nbytes = pending
        body = ids[: ids.size - sep.size]
        if body.size < 2:
            raise DataError(f"the source holds one document of {body.size} token(s): too short to split into "
                            "train and val")
        cut = max(1, min(body.size - 1, round(body.size * (1 - 1 / val_every))))
        frac = cut / body.size
        b.writers["train"].add(np.concatenate([body[:cut], sep]), round(nbytes * frac))
        b.writers["val"].add(np.concatenate([body[cut:], sep]), nbytes - round(nbytes * frac))


def _skip_summary(stats, no_tokens: int) -> str:
    d = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
    parts = [f"{k} {v}" for k, v in d.items() if isinstance(v, int) and v and k != "documents"]
    if no_tokens:
        parts.append(f"no_tokens {no_tokens}")
    return ", ".join(parts) or "the source is empty"


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished store into place; an old one is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{int(time.time())}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
