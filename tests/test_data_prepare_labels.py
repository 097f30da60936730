"""What ``hybrid-lm data prepare`` says and leaves: the store is named by its --out (not "val"), only the
files the manifest lists are left, an unwritable --out names the path given, and the "train on it with:"
line, followed as printed, passes the config's tokenizer and vocabulary checks."""

import json
import shlex

import pytest

from hybrid_lm.cli import main
from hybrid_lm.data.store import TokenStore
from hybrid_lm.experiment import load_config

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


def _titles(monkeypatch) -> list[str]:
    """The axes titles of every figure saved from now on."""
    from matplotlib.figure import Figure

    titles, save = [], Figure.savefig

    def savefig(fig, *a, **k):
        titles.extend(ax.get_title() for ax in fig.axes)
        return save(fig, *a, **k)
    monkeypatch.setattr(Figure, "savefig", savefig)
    return titles


def test_a_prepared_store_is_named_by_its_out_and_holds_only_listed_files(capsys, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", 60)
    titles = _titles(monkeypatch)
    out = tmp_path / "mystore"
    rc, text, _ = run(capsys, "data", "prepare", "--text", str(tmp_path / "a.jsonl"), "--out", str(out),
                      "--no-progress", "--workers", "1")
    assert rc == 0
    assert text.splitlines()[1].startswith("store mystore ")  # the header line after "prepared ..."
    assert json.loads((out / "stats.json").read_text())["store"] == "mystore"
    assert len(titles) == 1 and titles[0].startswith("mystore: ") and "val" not in titles[0]
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {r[k] for s in manifest["splits"].values() for r in s["shards"] for k in ("file", "index")}
    files = {f.name for f in out.iterdir()}
    assert files == listed | {"manifest.json", "stats.json", "doc_lengths.png"}
    assert all((out / f).stat().st_size > 0 for f in files)
    assert TokenStore(out).verify(progress=False)


def test_following_the_train_hint_passes_the_vocabulary_check(capsys, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 200)
    rc, _, _ = run(capsys, "data", "train-tokenizer", "--corpus", str(tmp_path / "a.jsonl"), "--vocab", "320",
                   "--out", str(tmp_path / "tok"), "--no-progress")
    assert rc == 0
    tj = tmp_path / "tok" / "tokenizer.json"
    rc, text, _ = run(capsys, "data", "prepare", "--text", str(tmp_path / "a.jsonl"), "--tokenizer", str(tj),
                      "--out", str(tmp_path / "s"), "--no-progress", "--workers", "1")
    assert rc == 0
    hint = next(line for line in text.splitlines() if line.startswith("train on it with:"))
    words = shlex.split(hint.split(":", 1)[1])
    params = [w for flag, w in zip(words[::2], words[1::2]) if flag == "--gin_param"]
    assert len(params) == len(words) // 2 == 4 and "ModelConfig.vocab_size=320" in params
    cfg = load_config(["quickstart.gin"], params + ["DataConfig.seq_len = 32"])  # the checks pass as printed
    assert cfg.model.vocab_size == 320 and cfg.data.path == str(tmp_path / "s")
    with pytest.raises(Exception, match="smaller than"):  # what the hint without vocab_size ran into
        load_config(["quickstart.gin"], [p for p in params if not p.startswith("ModelConfig.vocab_size")])


def test_an_unwritable_out_names_the_path_given(capsys, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("not a directory")
    bad = tmp_path / "afile" / "store"
    msg = one_line_error(capsys, "data", "prepare", "--out", str(bad), "--no-progress", "--workers", "1")
    assert msg == f"data error: cannot write --out {bad}: Not a directory (in {bad.parent}); choose another --out"
    assert ".lock" not in msg and "partial" not in msg

    import hybrid_lm.lock as lock
    real_open = lock.os.open

    def denied(path, *a, **k):  # a read-only directory (root can write anywhere, so it is simulated)
        if ".lock" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(lock.os, "open", denied)
    ro = tmp_path / "ro" / "store"
    msg = one_line_error(capsys, "data", "prepare", "--out", str(ro), "--no-progress", "--workers", "1")
    assert msg == (f"data error: cannot write --out {ro}: Permission denied (in {ro.parent}); choose another --out")
