"""``hybrid-lm data prepare|inspect|verify|train-tokenizer`` as a new user runs them: one-line
errors with exit 2, the default store location, and a BPE tokenizer trained and used end to end."""

import gzip
import json

import numpy as np
import pytest

from hybrid_lm.cli import main
from hybrid_lm.experiment import load_config
from hybrid_lm.data.corpus import default_dir
from hybrid_lm.data.pipeline import DataStreams
from hybrid_lm.data.store import TokenStore

from tests.test_store import write_jsonl


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(capsys, *argv) -> str:
    rc, _, err = run(capsys, *argv)
    lines = [x for x in err.strip().splitlines() if x]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_prepare_inputs_are_one_line_errors(capsys, tmp_path):
    assert "given no files" in one_line_error(capsys, "data", "prepare", "--text")
    assert "no such file" in one_line_error(capsys, "data", "prepare", "--text", str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    msg = one_line_error(capsys, "data", "prepare", "--text", str(bad), "--out", str(tmp_path / "s"), "--no-progress")
    assert "bad.jsonl" in msg and ("line 2" in msg or ":2" in msg)
    assert not (tmp_path / "s").exists()
    assert "no token store" in one_line_error(capsys, "data", "verify", str(tmp_path / "s"))
    assert "x.json" in one_line_error(capsys, "data", "prepare", "--tokenizer", str(tmp_path / "x.json"),
                                      "--out", str(tmp_path / "t"))


def test_a_folder_of_jsonl_gz_and_text_prepares_where_tokens_source_looks(capsys, tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    texts = write_jsonl(folder / "a.jsonl", 30)
    with gzip.open(folder / "sub" / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"gz doc {i} " * 20}) + "\n" for i in range(20)))
    (folder / "c.txt").write_text("one whole file as a document " * 10)
    rc, out, _ = run(capsys, "data", "prepare", "--text", str(folder), "--no-progress", "--workers", "2")
    assert rc == 0 and "prepared" in out and "DataConfig.source='tokens'" in out
    store = TokenStore(default_dir("tokens"))
    assert sum(store.manifest["splits"][s]["documents"] for s in ("train", "val")) == 51
    rc, out, _ = run(capsys, "data", "prepare", "--text", str(folder), "--no-progress")
    assert rc == 0 and "up to date" in out
    cfg = load_config([], ["DataConfig.source='tokens'", "DataConfig.seq_len=64", "TrainConfig.global_batch=4"])
    assert DataStreams(cfg).batch(0).shape == (4, 65)
    rc, out, _ = run(capsys, "data", "inspect", str(default_dir("tokens")), "--windows", "2", "--seq-len", "40")
    assert rc == 0 and "documents" in out and out.count("--- tokens [") == 2
    rc, out, _ = run(capsys, "data", "verify", str(default_dir("tokens")), "--no-progress")
    assert rc == 0 and "OK" in out
    shard = default_dir("tokens") / "train-00000.bin"
    good = shard.read_bytes()
    data = bytearray(good)
    data[4] ^= 1  # token 2's low byte: still a byte id, but not what was written
    shard.write_bytes(bytes(data))
    assert "does not match its manifest hash" in one_line_error(capsys, "data", "verify", str(default_dir("tokens")),
                                                                "--no-progress")
    data[5] ^= 0x40  # token 2's high byte: an id beyond the vocabulary, named with its shard and offset
    shard.write_bytes(bytes(data))
    assert "train-00000.bin offset 2 holds id" in one_line_error(capsys, "data", "verify", str(default_dir("tokens")),
                                                                 "--no-progress")
    assert texts  # the JSONL texts went in as documents, not as raw JSON
    assert b'{"text"' not in np.asarray(store.split("train").read(0, store.n_tokens("train")), np.uint8).tobytes()


def test_train_tokenizer_then_prepare_and_load_with_it(capsys, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 200)
    rc, out, _ = run(capsys, "data", "train-tokenizer", "--corpus", str(tmp_path / "a.jsonl"), "--vocab", "320",
                     "--out", str(tmp_path / "tok"), "--no-progress")
    assert rc == 0 and "byte-level BPE" in out
    tj = tmp_path / "tok" / "tokenizer.json"
    assert "exists" in one_line_error(capsys, "data", "train-tokenizer", "--corpus", str(tmp_path / "a.jsonl"),
                                      "--vocab", "320", "--out", str(tmp_path / "tok"))
    rc, out, _ = run(capsys, "data", "prepare", "--text", str(tmp_path / "a.jsonl"), "--tokenizer", str(tj),
                     "--out", str(tmp_path / "s"), "--no-progress")
    assert rc == 0
    store = TokenStore(tmp_path / "s")
    assert store.tokenizer["kind"] == "hf" and store.stats()["bytes_per_token"] > 1.5
    cfg = load_config([], ["DataConfig.source='tokens'", f"DataConfig.path='{tmp_path / 's'}'",
                           f"DataConfig.tokenizer='{tj}'", "ModelConfig.vocab_size=384", "DataConfig.seq_len=32",
                           "TrainConfig.global_batch=2"])
    data = DataStreams(cfg)
    assert data.batch(0).max() < 320
    # exact bits/byte: the eval windows' targets decode to this many bytes per token
    tok = data.tokenizer
    targets = data.eval_tokens[:, 1:]
    assert data.bytes_per_token == pytest.approx(sum(len(tok.decode(r).encode()) for r in targets) / targets.size,
                                                 rel=0.02)
    with pytest.raises(Exception, match="prepared with tokenizer"):
        DataStreams(load_config([], ["DataConfig.source='tokens'", f"DataConfig.path='{tmp_path / 's'}'",
                                     "DataConfig.seq_len=32"]))
