"""Tokenizers. The embedded default is byte-level: one token per UTF-8 byte, so bits/byte is exact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int = 256
    bytes_per_token: float = 1.0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str):
    if name not in _TOKENIZERS:
        from hybrid_lm.errors import ConfigError
        raise ConfigError(f"unknown tokenizer {name!r}; known: {sorted(_TOKENIZERS)}")
    return _TOKENIZERS[name]()
