"""Tokenizers: byte-level (the default), Hugging Face ``tokenizers`` JSON and SentencePiece; all local.

``DataConfig.tokenizer`` is a spec for :func:`load_tokenizer`:

- ``"byte"``: one token per UTF-8 byte, vocab 256, no special tokens (documents are separated by
  ``"\\n\\n"``);
- a local ``tokenizer.json`` (Hugging Face ``tokenizers``, as shipped with Llama / MiniCPM / GPT-2
  style models), with EOS/BOS/PAD from ``tokenizer_config.json`` / ``special_tokens_map.json``
  beside it, else from well-known special-token names;
- a local SentencePiece ``.model``;
- a directory holding one of them (``tokenizer.json`` preferred, then ``tokenizer.model``, then
  a single ``*.model``).

Nothing is ever downloaded. Every tokenizer has the same interface (:class:`Tokenizer`); its
``token_bytes`` makes bits/byte exact: the UTF-8 bytes of the text a run of ids decodes to are
``token_bytes[ids].sum()``. :func:`train_bpe` trains a byte-level BPE offline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from hybrid_lm.errors import ConfigError
from hybrid_lm.files import atomic_write_json, atomic_write_text
from hybrid_lm.optional import optional_import

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decode renders for an id outside the vocabulary
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
PAD_NAMES = ("<pad>", "<|pad|>")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece / HF byte-fallback pieces
_HF_SIDE_FILES = ("special_tokens_map.json", "tokenizer_config.json")  # later files win


class Tokenizer:
    """The interface every tokenizer has.

    Attributes: ``kind`` ('byte' | 'hf' | 'sentencepiece'), ``spec`` (as given to
    :func:`load_tokenizer`), ``vocab_size`` (every id it produces is below it), ``eos_id`` /
    ``bos_id`` / ``pad_id`` (int or None), ``separator`` (ids appended after every packed document),
    ``fingerprint`` (sha256 of the defining file; "byte" for bytes), ``token_bytes`` (int64
    [vocab_size], UTF-8 bytes each id adds to the decoded text; 0 for special and control tokens),
    ``dummy_prefix_bytes`` (what ``token_bytes`` over-counts per non-empty encoded text: the
    dummy-prefix space a SentencePiece-style tokenizer adds and decode drops; 0 when lossless).
    """

    kind: str
    spec: str
    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None
    pad_id: int | None = None
    dummy_prefix_bytes: int = 0
    separator: np.ndarray
    fingerprint: str
    token_bytes: np.ndarray
    _known: np.ndarray  # bool [vocab_size]: ids that name a token (False for holes in the id range)

    def encode(self, text: str) -> np.ndarray:
        """uint32 ids of ``text``; no special tokens are added (nor parsed out of the text)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text."""
        return [self.encode(t) for t in texts]

    def encode_parsing_specials(self, text: str) -> np.ndarray:
        """uint32 ids of ``text`` with special-token strings in it (``<|endoftext|>``) mapped to their
        ids, as transformers' tokenizers (and so lm-eval's HF backend) encode a prompt; :meth:`encode`
        keeps them text, so that a document never injects an EOS. Bytes have none; a SentencePiece
        model's control pieces (``</s>``) stay text here, where transformers' converted tokenizer would
        map them."""
        return self.encode(text)

    def _decode_known(self, ids: np.ndarray) -> str:
        raise NotImplementedError

    def decode(self, ids) -> str:
        """The text of ``ids``; special tokens render as nothing, ids outside the vocabulary as U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ok = (ids >= 0) & (ids < self.vocab_size)
        ok[ok] = self._known[ids[ok]]
        if ok.all():
            return self._decode_known(ids) if ids.size else ""
        parts, start = [], 0
        for bad in np.flatnonzero(~ok):
            if bad > start:
                parts.append(self._decode_known(ids[start:bad]))
            parts.append(REPLACEMENT)
            start = bad + 1
        if start < ids.size:
            parts.append(self._decode_known(ids[start:]))
        return "".join(parts)

    def describe(self) -> dict:
        """JSON-able identity for store manifests: kind, spec, vocab_size, eos/bos/pad ids, fingerprint."""
        return {"kind": self.kind, "spec": self.spec, "vocab_size": int(self.vocab_size),
                "eos_id": self.eos_id, "bos_id": self.bos_id, "pad_id": self.pad_id,
                "fingerprint": self.fingerprint}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only (loaded tokenizers are cached and shared)."""
    a.setflags(write=False)
    return a


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (vocab 256); exact bits/byte, no special tokens."""

    kind = "byte"
    bytes_per_token = 1.0  # exact for bytes (read by hybrid_lm/data/corpus.py)

    def __init__(self) -> None:
        self.spec = "byte"
        self.vocab_size = 256
        self.separator = _frozen(np.frombuffer(b"\n\n", dtype=np.uint8).astype(np.uint32))
        self.fingerprint = "byte"
        self.token_bytes = _frozen(np.ones(256, dtype=np.int64))
        self._known = _frozen(np.ones(256, dtype=bool))

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def _decode_known(self, ids: np.ndarray) -> str:
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON (``tokenizer.json``).

    ``token_bytes``: for a byte-level decoder (GPT-2 / Llama-3 style) each character of a piece is
    one byte, so it is exact. Otherwise each piece is decoded after an anchor piece (so Metaspace /
    Strip rules for the first token do not apply) and byte-fallback pieces ``<0xNN>`` count 1: exact
    away from the start of a text, where a dummy-prefix space is stripped by the decoder but counted
    here (``dummy_prefix_bytes`` per non-empty text too many). It measures the decoded text, which
    equals the input only for lossless tokenizers (no lowercasing or NFKC normalizer, no unknown
    token).
    """

    kind = "hf"

    def __init__(self, spec: str, path: Path, data: bytes):
        tk = optional_import("tokenizers")
        try:
            text = data.decode("utf-8")
            tok = tk.Tokenizer.from_str(text)
            spec_json = json.loads(text)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ConfigError(f"tokenizer {path}: not a Hugging Face tokenizers JSON ({_one_line(e)})") from None
        tok.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, never the EOS id
        tok.no_truncation()  # some shipped files truncate to e.g. 512 tokens: documents are encoded whole
        tok.no_padding()
        self._tok = tok
        self.spec = spec
        self.path = path
        self.fingerprint = hashlib.sha256(data).hexdigest()
        vocab = tok.get_vocab(with_added_tokens=True)  # piece -> id
        # get_vocab_size counts tokens; an id range with holes needs max id + 1 rows
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self.eos_id, self.bos_id, self.pad_id = _hf_special_ids(tok, path)
        if self.eos_id is None:
            raise ConfigError(
                f"tokenizer {path} has no end-of-sequence token, so packed documents cannot be separated: "
                f"add \"eos_token\": \"<its EOS piece>\" to {path.parent / 'tokenizer_config.json'} "
                f"(none of {', '.join(EOS_NAMES)} is in its vocabulary)")
        self.separator = _frozen(np.array([self.eos_id], dtype=np.uint32))
        specials = {int(t["id"]) for t in spec_json.get("added_tokens") or [] if t.get("special")}
        known = np.zeros(self.vocab_size, dtype=bool)
        known[list(vocab.values())] = True
        self._known = _frozen(known)
        self.token_bytes = _frozen(_hf_token_bytes(tok, tk, vocab, specials, self.vocab_size,
                                                   spec_json.get("decoder"), known))
        self.dummy_prefix_bytes = _dummy_prefix_bytes(self)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def encode_parsing_specials(self, text: str) -> np.ndarray:
        parsing = self.__dict__.get("_tok_parsing")
        if parsing is None:  # a second backend, so the shared one never changes its setting under a reader
            parsing = type(self._tok).from_str(self._tok.to_str())
            parsing.encode_special_tokens = False
            parsing.no_truncation()
            parsing.no_padding()
            self._tok_parsing = parsing
        return np.asarray(parsing.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def _decode_known(self, ids: np.ndarray) -> str:
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_tok_parsing"}  # rebuilt when used

    def __setstate__(self, state: dict) -> None:  # pickling drops encode_special_tokens
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model``.

    ``token_bytes``: '▁' counts as one space byte, ``<0xNN>`` byte-fallback pieces as one byte,
    control pieces (BOS/EOS/PAD) and the unknown piece as 0 (the bytes an unknown piece stands for
    are lost). Approximate at the start of a text when the model adds a dummy prefix: decode drops
    that leading space, ``token_bytes`` counts it (``dummy_prefix_bytes`` = 1 per non-empty encoded
    text too many). It measures the decoded text, which equals the input only with an
    identity normalizer that keeps whitespace (SentencePiece's default NFKC and whitespace folding
    do not).
    """

    kind = "sentencepiece"

    def __init__(self, spec: str, path: Path, data: bytes):
        spm = optional_import("sentencepiece")
        try:
            sp = spm.SentencePieceProcessor(model_proto=data)
        except Exception as e:  # RuntimeError from the C++ parser
            raise ConfigError(f"tokenizer {path}: not a SentencePiece model ({_one_line(e)})") from None
        self._sp = sp
        self.spec = spec
        self.path = path
        self.fingerprint = hashlib.sha256(data).hexdigest()
        self.vocab_size = sp.get_piece_size()
        self.eos_id, self.bos_id, self.pad_id = (i if i >= 0 else None for i in (sp.eos_id(), sp.bos_id(), sp.pad_id()))
        if self.eos_id is None:
            raise ConfigError(f"tokenizer {path} has no end-of-sequence piece (eos_id=-1), so packed documents "
                              "cannot be separated: train it with --eos_id=<id> (SentencePiece's default is 2)")
        self.separator = _frozen(np.array([self.eos_id], dtype=np.uint32))
        tb = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if sp.is_control(i) or sp.is_unknown(i):
                continue
            tb[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        self.token_bytes = _frozen(tb)
        self._known = _frozen(np.ones(self.vocab_size, dtype=bool))
        self.dummy_prefix_bytes = _dummy_prefix_bytes(self)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self._sp.encode(list(texts))]

    def _decode_known(self, ids: np.ndarray) -> str:
        return self._sp.decode(ids.tolist())


def _dummy_prefix_bytes(tok: Tokenizer) -> int:
    """Bytes ``token_bytes`` counts for "a" beyond the one "a" decodes to (the dummy prefix), >= 0."""
    ids = tok.encode("a")
    return max(int(tok.token_bytes[ids].sum()) - len(tok.decode(ids).encode("utf-8")), 0)


# ----------------------------------------------------------------------------- Hugging Face details

def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _hf_special_ids(tok, path: Path) -> tuple[int | None, int | None, int | None]:
    """(eos, bos, pad) ids: named in tokenizer_config.json / special_tokens_map.json beside ``path``
    when present (a name that is not in the vocabulary is an error), else well-known names."""
    named: dict[str, tuple[str, Path]] = {}
    for name in _HF_SIDE_FILES:
        f = path.parent / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{f}: not readable JSON ({_one_line(e)}); fix or remove it") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{f}: expected a JSON object with eos_token / bos_token / pad_token")
        for role in ("eos", "bos", "pad"):
            v = cfg.get(f"{role}_token")
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str) and v:
                named[role] = (v, f)
    ids = []
    for role, names in (("eos", EOS_NAMES), ("bos", BOS_NAMES), ("pad", PAD_NAMES)):
        if role in named:
            content, f = named[role]
            i = tok.token_to_id(content)
            if i is None:
                raise ConfigError(f"{f}: {role}_token {content!r} is not in the vocabulary of {path}")
        else:
            i = next((j for j in map(tok.token_to_id, names) if j is not None), None)
        ids.append(i)
    return tuple(ids)


def _decoder_types(d) -> set[str]:
    """Types of a decoder spec and of the decoders in it (tokenizer.json's "decoder")."""
    if not isinstance(d, dict):
        return set()
    return {d.get("type")} | {t for sub in d.get("decoders") or [] for t in _decoder_types(sub)}


def _hf_token_bytes(tok, tk, vocab: dict[str, int], specials: set[int], vocab_size: int, decoder,
                    known: np.ndarray) -> np.ndarray:
    """int64 [vocab_size]: UTF-8 bytes each id adds to the decoded text (see :class:`HFTokenizer`)."""
    out = np.zeros(vocab_size, dtype=np.int64)
    types = _decoder_types(decoder)
    if "ByteLevel" in types:  # each alphabet character is one byte; others pass through as UTF-8
        alphabet = set(tk.pre_tokenizers.ByteLevel.alphabet())
        for piece, i in vocab.items():
            if i not in specials:
                out[i] = sum(1 if c in alphabet else len(c.encode("utf-8")) for c in piece)
        return out
    anchor = next((tok.token_to_id(a) for a in "xaeo" if tok.token_to_id(a) is not None), None)
    ids = [int(i) for i in np.flatnonzero(known) if int(i) not in specials]
    if anchor is None:
        texts, base = tok.decode_batch([[i] for i in ids], skip_special_tokens=True), 0
    else:
        texts = tok.decode_batch([[anchor, i] for i in ids], skip_special_tokens=True)
        base = len(tok.decode([anchor]).encode("utf-8"))
    byte_fallback = "ByteFallback" in types
    id_to_piece = {i: p for p, i in vocab.items()}
    for i, t in zip(ids, texts):
        if byte_fallback and _BYTE_PIECE.fullmatch(id_to_piece[i]):
            out[i] = 1
        else:
            out[i] = max(len(t.encode("utf-8")) - base, 0)
    return out


# ----------------------------------------------------------------------------- loading

_BYTE = ByteTokenizer()
_CACHE: dict[tuple, Tokenizer] = {}


def _resolve(spec: str) -> Path:
    """The tokenizer file ``spec`` names (a file, or the one in a directory)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return (p / name).resolve()
        models = sorted(p.glob("*.model"))
        if len(models) == 1:
            return models[0].resolve()
        several = f" (several .model files: {', '.join(m.name for m in models)}; name one)" if models else ""
        raise ConfigError(f"tokenizer directory {p} holds no tokenizer.json or SentencePiece .model{several}")
    if p.is_file():
        if p.suffix in (".json", ".model"):
            return p.resolve()
        raise ConfigError(f"tokenizer {p}: expected a Hugging Face tokenizer.json, a SentencePiece .model, "
                          "or a directory holding one")
    raise ConfigError(f"tokenizer {spec!r}: no such file or directory (DataConfig.tokenizer is 'byte' or a local "
                      "tokenizer.json, SentencePiece .model, or a directory holding one; nothing is downloaded)")


def _stat_key(path: Path) -> tuple:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (str(path), None)
    return (str(path), st.st_mtime_ns, st.st_size)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names ('byte', or a local file or directory; see the module docstring).

    Loaded tokenizers are cached per (spec, resolved path, mtime, size) of the file (and of the
    tokenizer_config.json / special_tokens_map.json beside a tokenizer.json). Raises
    :class:`ConfigError` in one line naming the path for a missing, unreadable or malformed file.
    """
    if spec == "byte":
        return _BYTE
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"DataConfig.tokenizer={spec!r}: give 'byte' or a local tokenizer path")
    path = _resolve(spec)
    hf = path.suffix == ".json"
    key = (spec, _stat_key(path)) + tuple(_stat_key(path.parent / n) for n in _HF_SIDE_FILES if hf)
    if key in _CACHE:
        return _CACHE[key]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"tokenizer {path}: cannot read it ({e.strerror or e})") from None
    tok = HFTokenizer(spec, path, data) if hf else SentencePieceTokenizer(spec, path, data)
    for k in [k for k in _CACHE if k[0] == spec]:
        del _CACHE[k]  # an older version of the file
    _CACHE[key] = tok
    return tok


get_tokenizer = load_tokenizer  # the older name


# ----------------------------------------------------------------------------- training

def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path, *, min_frequency: int = 2,
              special_tokens: Sequence[str] = ("<|endoftext|>", "<|pad|>")) -> Path:
    """Train a byte-level BPE offline on ``texts`` (streamed) and write ``out_dir/tokenizer.json``
    plus ``out_dir/tokenizer_config.json`` (eos_token = special_tokens[0], pad_token =
    special_tokens[1] if given). Every byte is in the initial alphabet, so any text is encodable
    and round-trips exactly. Returns the tokenizer.json path.

    A corpus too small for ``vocab_size`` merges gives a smaller vocabulary: it is still written,
    with a logged warning, and tokenizer_config.json records both sizes under "hybrid_lm"
    (``load_tokenizer(path).vocab_size`` is the actual size).
    """
    specials = list(special_tokens)
    if not specials or len(set(specials)) != len(specials) or not all(isinstance(s, str) and s for s in specials):
        raise ConfigError(f"train_bpe: special_tokens={tuple(specials)!r} must be distinct non-empty strings, "
                          "the first being the EOS")
    need = 256 + len(specials)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < need:
        raise ConfigError(f"train_bpe: vocab_size={vocab_size!r} must be an integer >= {need} "
                          f"(256 byte tokens + {len(specials)} special tokens)")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ConfigError(f"train_bpe: min_frequency={min_frequency!r} must be an integer >= 1")
    tk = optional_import("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    actual = tok.get_vocab_size(with_added_tokens=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[0],
              "hybrid_lm": {"trainer": "train_bpe", "vocab_size": actual, "vocab_size_requested": vocab_size,
                            "min_frequency": min_frequency}}
    if len(specials) > 1:
        config["pad_token"] = specials[1]
    # the config first: tokenizer.json appearing is what makes the directory a tokenizer
    atomic_write_json(out_dir / "tokenizer_config.json", config, indent=2)
    path = atomic_write_text(out_dir / "tokenizer.json", tok.to_str(pretty=True))
    if actual < vocab_size:
        log.warning(f"train_bpe: the corpus gave {actual} tokens, fewer than vocab_size={vocab_size} "
                    f"(too little text for more merges at min_frequency={min_frequency}); wrote {path}")
    return path


# ----------------------------------------------------------------------------- against a model

VOCAB_MULTIPLE = 128  # a model vocab up to the tokenizer's rounded up to this is not warned about


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (the usual embedding-table size)."""
    return -(-vocab_size // multiple) * multiple


def check_tokenizer(tok: Tokenizer, model_vocab: int) -> None:
    """Raise :class:`ConfigError` unless every id ``tok`` produces (its special ids included) has a
    row in a ``model_vocab`` embedding table."""
    if model_vocab < tok.vocab_size:
        raise ConfigError(f"ModelConfig.vocab_size={model_vocab} is smaller than the {tok.spec!r} tokenizer's "
                          f"{tok.vocab_size}: set ModelConfig.vocab_size to at least {tok.vocab_size} "
                          f"(e.g. {padded_vocab(tok.vocab_size)}, a multiple of {VOCAB_MULTIPLE})")
    for role in ("eos", "bos", "pad"):
        i = getattr(tok, f"{role}_id")
        if i is not None and not 0 <= i < model_vocab:
            raise ConfigError(f"the {tok.spec!r} tokenizer's {role} id {i} is not below "
                              f"ModelConfig.vocab_size={model_vocab}: raise ModelConfig.vocab_size above {i}")
