"""Token stores and ``data prepare``: layout, split rule, idempotence, atomic re-prepare, resume
after a kill, and the bad inputs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid_lm.data import store as st
from hybrid_lm.data.prepare import PrepareSettings, prepare
from hybrid_lm.data.sources import SourceSpec
from hybrid_lm.errors import DataError

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def write_jsonl(path: Path, n_docs: int, seed: int = 0, min_words: int = 5, max_words: int = 60) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, rng.integers(min_words, max_words))) + f" #{i}" for i in range(n_docs)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def text_spec(*paths) -> SourceSpec:
    return SourceSpec(kind="text", paths=tuple(str(p) for p in paths))


def read_split_docs(store: st.TokenStore, split: str) -> list[bytes]:
    v = store.split(split)
    return [v.read(int(a), int(b - a)).astype(np.uint8).tobytes() for a, b in zip(v.doc_starts[:-1], v.doc_starts[1:])]


def test_store_layout_split_rule_and_contents(tmp_path):
    texts = write_jsonl(tmp_path / "a.jsonl", 35)
    res = prepare(text_spec(tmp_path / "a.jsonl"), tmp_path / "store", progress=False)
    store = st.TokenStore(res.path)
    assert store.dtype == np.uint16 and store.manifest["splits"]["val"]["documents"] == 3  # docs 9, 19, 29
    want_val = [(texts[i] + "\n\n").encode() for i in (9, 19, 29)]
    want_train = [(t + "\n\n").encode() for i, t in enumerate(texts) if i % 10 != 9]
    assert read_split_docs(store, "val") == want_val and read_split_docs(store, "train") == want_train
    s = res.stats
    assert s["documents"] == 35 and s["splits"]["train"]["decoded_bytes"] == store.n_tokens("train")
    assert s["splits"]["train"]["text_bytes"] == sum(len(t.encode()) for i, t in enumerate(texts) if i % 10 != 9)
    assert (res.path / "doc_lengths.png").stat().st_size > 1000 and (res.path / "stats.json").is_file()
    assert store.verify()["train"]["documents"] == 32
    assert not list(tmp_path.glob(".store.partial-*"))


def test_small_corpora_always_have_a_val_split(tmp_path):
    (tmp_path / "one.txt").write_text("a single document " * 50)
    one = st.TokenStore(prepare(text_spec(tmp_path / "one.txt"), tmp_path / "s1", progress=False).path)
    assert one.manifest["splits"]["val"]["documents"] == 1 and one.n_tokens("val") > 50
    assert one.n_tokens("train") + one.n_tokens("val") == len("a single document " * 50) + 4  # 2 separators
    for n in (2, 5, 9):
        write_jsonl(tmp_path / f"d{n}.jsonl", n)
        s = st.TokenStore(prepare(text_spec(tmp_path / f"d{n}.jsonl"), tmp_path / f"s{n}", progress=False).path)
        assert s.manifest["splits"]["val"]["documents"] == 1 and s.manifest["splits"]["train"]["documents"] == n - 1


def test_rerun_is_a_no_op_and_other_settings_fail_or_overwrite(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 40)
    spec = text_spec(tmp_path / "a.jsonl")
    first = prepare(spec, tmp_path / "s", progress=False)
    mtime = (tmp_path / "s" / st.MANIFEST).stat().st_mtime_ns
    again = prepare(spec, tmp_path / "s", progress=False)
    assert again.skipped and (tmp_path / "s" / st.MANIFEST).stat().st_mtime_ns == mtime
    with pytest.raises(DataError, match="other settings.*val_every"):
        prepare(spec, tmp_path / "s", PrepareSettings(val_every=5), progress=False)
    assert st.TokenStore(tmp_path / "s").fingerprint == first.manifest["fingerprint"]
    third = prepare(spec, tmp_path / "s", PrepareSettings(val_every=5), overwrite=True, progress=False)
    assert third.manifest["splits"]["val"]["documents"] == 8 and not list(tmp_path.glob(".s.*"))


def test_fingerprint_is_content_not_path_and_workers_do_not_change_it(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 300)
    spec = text_spec(tmp_path / "a.jsonl")
    one = prepare(spec, tmp_path / "w1", PrepareSettings(shard_tokens=4096), progress=False)
    two = prepare(spec, tmp_path / "w2", PrepareSettings(shard_tokens=4096), workers=2, progress=False)
    assert one.manifest["fingerprint"] == two.manifest["fingerprint"]
    assert len(one.manifest["splits"]["train"]["shards"]) > 3  # several shards, read across boundaries
    (tmp_path / "w1").rename(tmp_path / "moved")
    assert st.TokenStore(tmp_path / "moved").fingerprint == one.manifest["fingerprint"]


def test_a_failed_re_prepare_leaves_the_old_store_whole(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 30)
    good = prepare(text_spec(tmp_path / "a.jsonl"), tmp_path / "s", progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl.*2"):
        prepare(text_spec(tmp_path / "a.jsonl", bad), tmp_path / "s", overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    assert st.TokenStore(tmp_path / "s").fingerprint == good.manifest["fingerprint"]


def test_truncated_or_corrupt_shards_are_named_at_open_and_by_verify(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 50)
    path = prepare(text_spec(tmp_path / "a.jsonl"), tmp_path / "s", progress=False).path
    shard = path / "train-00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 600])  # 0.17% of it
    with pytest.raises(DataError, match="train-00000.bin has .* bytes, the manifest says"):
        st.TokenStore(path)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # same size, one bit flipped
    st.TokenStore(path)  # sizes agree
    with pytest.raises(DataError, match="train-00000.bin content does not match"):
        st.TokenStore(path).verify()
    (path / st.MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        st.TokenStore(path)


def test_old_format_and_missing_store_messages(tmp_path):
    with pytest.raises(DataError, match="no token store at .*data prepare"):
        st.TokenStore(tmp_path / "nothing")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "meta.json").write_text("{}")
    with pytest.raises(DataError, match="old train.bin/meta.json format"):
        st.TokenStore(tmp_path / "old")


def test_empty_and_unusable_sources(tmp_path):
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n{"text": "   "}\n')
    with pytest.raises(DataError, match="no usable documents.*empty"):
        prepare(text_spec(tmp_path / "e.jsonl"), tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f.txt").write_text("x")
    with pytest.raises(DataError, match="exists and is not a token store"):
        prepare(text_spec(tmp_path / "e.jsonl"), tmp_path / "x", progress=False)


def test_uint32_for_large_vocabularies():
    assert st.dtype_for_vocab(256) == np.uint16 and st.dtype_for_vocab(65536) == np.uint16
    assert st.dtype_for_vocab(65537) == np.uint32 and st.dtype_for_vocab(73448) == np.uint32


@pytest.mark.integration
def test_a_killed_prepare_resumes_to_the_same_store(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 20000, max_words=40)
    cmd = [sys.executable, "-m", "hybrid_lm.cli", "data", "prepare", "--source", "text", "--path",
           str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "s"), "--shard-tokens", "2048", "--workers", "1",
           "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    progress = None
    while time.time() < deadline and proc.poll() is None:
        hits = list(tmp_path.glob(".s.partial-*/progress.json"))
        if hits and json.loads(hits[0].read_text())["docs_consumed"] > 3000:
            progress = hits[0]
            break
        time.sleep(0.01)
    assert progress is not None, "prepare finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "s").exists()  # nothing half-written is in place
    done = json.loads(progress.read_text())["docs_consumed"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    clean = prepare(text_spec(tmp_path / "a.jsonl"), tmp_path / "clean", PrepareSettings(shard_tokens=2048),
                    progress=False)
    assert st.TokenStore(tmp_path / "s").fingerprint == clean.manifest["fingerprint"] and done < 20000


def test_every_source_kind_prepares(tmp_path):
    """TFDS (mock data), parquet and a datasets save_to_disk folder all reach a store."""
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=30, policy=tfds.testing.MockPolicy.USE_CODE):
        r = prepare(SourceSpec(kind="tfds", name="lm1b"), tmp_path / "tfds", progress=False)
    assert r.manifest["splits"]["train"]["documents"] + r.manifest["splits"]["val"]["documents"] == 30
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": ["first doc", None, "third doc", "fourth"] * 5}), tmp_path / "a.parquet")
    r = prepare(SourceSpec(kind="parquet", paths=(str(tmp_path / "a.parquet"),), text_field="content"),
                tmp_path / "pq", progress=False)
    assert r.stats["documents"] == 15 and r.stats["skipped"]["null_skipped"] == 5
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"hf document {i}" for i in range(12)]}).save_to_disk(str(tmp_path / "hf"))
    r = prepare(SourceSpec(kind="hf", paths=(str(tmp_path / "hf"),)), tmp_path / "hfstore", progress=False)
    assert r.stats["documents"] == 12


@pytest.mark.integration
def test_prepare_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of a prepare of 60 MB of JSONL is within 40 MB of that of 6 MB (the old prepare
    held about 11x its input)."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of pytest would report pytest's
    script = ("import sys; from hybrid_lm.data.prepare import prepare, PrepareSettings; "
              "from hybrid_lm.data.sources import SourceSpec; "
              "prepare(SourceSpec(kind='text', paths=(sys.argv[1],)), sys.argv[2], PrepareSettings(shard_tokens=1 << 22),"
              " progress=False); "
              "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    peaks = []
    for mb in (6, 60):
        f = tmp_path / f"c{mb}.jsonl"
        line = json.dumps({"text": "word " * 2000}) + "\n"
        f.write_text(line * (mb * 1_000_000 // len(line)))
        r = subprocess.run([sys.executable, "-c", script, str(f), str(tmp_path / f"s{mb}")], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
        assert r.returncode == 0, r.stderr
        peaks.append(int(r.stdout.split()[-1]) / 1024)  # MB
    assert peaks[1] - peaks[0] < 20, peaks
