"""Backend dispatch: which backend runs an op on this platform, and why.

Also the record of the backends the traced model's calls resolved to (``attention_impl=auto`` picks
per call), filled while tracing and read by the train loop into the run's metrics.
"""

from __future__ import annotations

# Backends the traced model's calls resolved to, e.g. {"full": "cudnn", "swa w=128": "jla",
# "moba block=128": "pallas"}.
_BACKENDS: dict[str, str] = {}


def record_backend(op: str, backend: str) -> None:
    _BACKENDS[op] = backend


def recorded_backends(clear: bool = False) -> dict[str, str]:
    """The backends recorded since the last clear (a copy); ``clear=True`` empties the record."""
    out = dict(_BACKENDS)
    if clear:
        _BACKENDS.clear()
    return out
