"""RULER-offline: items are pure functions of their key, exactly ``length`` tokens with the answer,
needles at the requested depths, and every answer recoverable from the decoded prompt by a regex
oracle written independently of the generators; the scoring functions on hand-made continuations;
the cache; bad inputs; and ``hybrid-lm ruler`` end to end on a tiny trained run (slow)."""

import collections
import json
import re
import shutil

import numpy as np
import pytest

from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import ConfigError
from hybrid_lm.eval import ruler as R, ruler_items as RI
from hybrid_lm.eval.ruler_report import format_table

BYTE = load_tokenizer("byte")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from hybrid_lm.data.tokenizer import train_bpe
    path = train_bpe([text for _, text in RI.essay_texts()[:5]], 512, tmp_path_factory.mktemp("bpe"))
    return load_tokenizer(str(path))


@pytest.fixture(params=["byte", "bpe"])
def tok(request, bpe):
    return BYTE if request.param == "byte" else bpe


def _item(task, length, tok, seed=0, index=0, haystack="essays", **kw):
    return RI.make_item(task, length, seed, index, tok, RI.haystack_for(haystack, tok), **kw)


# ----------------------------------------------------------------------------- the oracle


def _main(text: str) -> str:
    """The prompt after RULER's one-shot example (vt, cwe), whole otherwise."""
    for start in ("\nMemorize and track", "\nBelow is a numbered list"):
        if start in text:
            return text[text.rindex(start) + 1:]
    return text


def _region(text: str) -> str:
    """The task's content: after the first line (the instruction), before the question."""
    return _main(text).split("\n", 1)[1].rsplit("\nQuestion:", 1)[0]


def oracle(task: str, text: str) -> dict:
    """What a careful reader of ``text`` answers: ``answers`` in the gold order and ``wrong``, the
    strings a distractor is made of (they must not be answers)."""
    if task.startswith("niah"):
        found = collections.defaultdict(list)
        for key, value in re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", text):
            found[key].append(value)
        query = re.search(r"\nWhat (?:is|are all) the special magic numbers? for (.+?) mentioned in the provided "
                          r"text\? The", text).group(1)
        keys = re.split(r", (?:and )?", query)
        return {"answers": [v for k in keys for v in found[k]],
                "wrong": {v for k, vs in found.items() if k not in keys for v in vs}}
    if task == "vt":
        value_of = {}
        for name, ref, number in re.findall(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))", _main(text)):
            value_of[name] = number or value_of[ref]  # a chain is listed in order
        asked = re.search(r"assigned the value (\d+) in the text above", _main(text)).group(1)
        return {"answers": [n for n, v in value_of.items() if v == asked],
                "wrong": {n for n, v in value_of.items() if v != asked}}
    if task == "cwe":
        entries = re.findall(r"(\d+)\. ([a-z]*)", _region(text))
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))  # numbered in order
        counts = collections.Counter(w for _, w in entries if w)
        n = int(re.search(r"What are the (\d+) most common words", _main(text)).group(1))
        ranked = counts.most_common()
        assert ranked[n - 1][1] > ranked[n][1], "the common words must be strictly more frequent"
        top = {w for w, _ in ranked[:n]}
        first = [w for _, w in entries if w in top]
        return {"answers": list(dict.fromkeys(first)), "wrong": {w for w, _ in ranked[n:]}}
    if task == "fwe":
        region = text.split("coded words. ", 1)[1].rsplit("\nQuestion:", 1)[0]
        counts = collections.Counter(w for w in region.split() if not re.fullmatch(r"\.+", w))
        ranked = counts.most_common()
        assert ranked[2][1] > ranked[3][1] and ranked[0][1] > ranked[1][1] > ranked[2][1]
        return {"answers": [w for w, _ in ranked[:3]], "wrong": {w for w, _ in ranked[3:]}}
    raise AssertionError(task)


def _parts(task: str, answer: str) -> list[str]:
    """The strings of a gold or distractor continuation, in order."""
    if task == "cwe":
        return re.findall(r"\d+\. (\S+)", answer)
    if task == "vt":
        return answer.split()
    return answer.strip(" .").split(", ")


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("task", RI.TASKS)
def test_items_are_pure_functions_of_their_key(task, tok):
    a, b = _item(task, 2048, tok), _item(task, 2048, tok)
    assert a.to_json() == b.to_json()
    other_seed, other_index = _item(task, 2048, tok, seed=1), _item(task, 2048, tok, index=1)
    assert not np.array_equal(a.ids, other_seed.ids) and a.answers != other_seed.answers
    assert not np.array_equal(a.ids, other_index.ids)
    back = RI.Item.from_json(json.loads(json.dumps(a.to_json())))
    assert back.to_json() == a.to_json() and np.array_equal(back.ids, a.ids) and back.ids.dtype == np.int32


@pytest.mark.parametrize("task", RI.TASKS)
@pytest.mark.parametrize("length", [2048, 4096])
def test_length_in_tokens_and_the_regex_oracle(task, length, tok):
    for seed in (0, 3):
        item = _item(task, length, tok, seed=seed, haystack="noise" if seed else "essays")
        assert len(item.ids) + item.gen_tokens == length and item.ids.dtype == np.int32
        text = tok.decode(item.ids)
        # pieces are encoded apart: the text's own encoding is within 2% of the prompt
        assert abs(len(tok.encode(text)) - len(item.ids)) <= 0.02 * len(item.ids) + 2
        want = oracle(task, text)
        assert list(item.answers) == want["answers"], (task, seed)
        assert _parts(task, item.gold) == want["answers"]
        for d in item.distractors:  # made of wrong strings only, encodable within the answer budget
            parts = _parts(task, d)
            assert set(parts) <= want["wrong"] and parts != list(item.answers)
        assert max(len(tok.encode(x)) for x in (item.gold, *item.distractors)) <= item.gen_tokens
        assert len(item.distractors) == {"niah_multikey": 3, "cwe": 3, "fwe": 3}.get(task, 0)
        assert bool(item.distractors) == (task in RI.LL_TASKS)  # what a study's RULER metric may use


@pytest.mark.parametrize("haystack,length", [("noise", 2048), ("essays", 8192)])
def test_needles_sit_at_the_requested_depth(haystack, length, tok):
    """A needle at depth d goes before haystack unit ``int(n_units * d)`` (RULER's sentence index;
    tests/test_eval_fidelity.py checks the default depths against RULER's code)."""
    hay = RI.haystack_for(haystack, tok)
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        item = _item("niah_single", length, tok, haystack=haystack, depths=[depth])
        (start, end), = item.needle_spans
        assert re.fullmatch(r"\s?One of the special magic numbers for \S+ is: \d+\.", tok.decode(item.ids[start:end]))
        text = tok.decode(item.ids)
        prefix = len(tok.encode(text[:text.index("\n") + 1]))
        question = len(tok.encode(text[text.rindex("\nWhat is"):]))
        n_units = hay.count(len(item.ids) - prefix - question - (end - start))
        before = tok.decode(item.ids[prefix:start])
        units = [hay.texts[i % len(hay.texts)] for i in range(n_units)]
        whole = [k for k in range(n_units) if before == hay.sep.join(units[:k])]
        # after the last unit (cut at its end to fill the length), or before unit k
        (k,) = whole or [n_units for _ in [0] if hay.sep.join(units).startswith(before) and len(before) > 0]
        assert k == int(n_units * depth) and item.depths[0] == pytest.approx(k / n_units)
    # default: several needles at distinct depths, in text order
    multi = _item("niah_multikey", length, tok, haystack=haystack)
    assert list(multi.depths) == sorted(multi.depths) and len(multi.needle_spans) == 4
    assert [s for s, _ in multi.needle_spans] == sorted(s for s, _ in multi.needle_spans)
    assert len(_item("vt", length, tok, haystack=haystack).needle_spans) == 5


def test_the_haystack_fills_exactly_from_its_first_unit():
    hay = RI.haystack_for("noise", BYTE)
    assert [BYTE.decode(u) for u in hay.units] == ["\n" + " ".join(RI.NOISE_SENTENCES)]
    assert [BYTE.decode(u) for u in hay.bare] == [RI.NOISE_LINE]
    for n in (1, 7, 91, 92, 93, 500):
        parts = hay.fill(n)
        assert sum(map(len, parts)) == n
        assert (BYTE.decode(np.concatenate(parts)) + "\n").startswith(RI.NOISE_LINE[:n])
    essays = RI.haystack_for("essays", BYTE)
    raw = bytes(np.concatenate(essays.fill(4000)).astype(np.uint8))
    assert len(raw) == 4000 and raw[:2000] == " ".join(essays.texts).encode()[:2000]


def test_corpus_haystack_reads_the_val_documents(tmp_path):
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec
    from hybrid_lm.data.store import TokenStore

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text(f"Document {i} says hello. It has a second sentence {i}!")
    prepare(SourceSpec("text", paths=(str(docs),)), tmp_path / "store", PrepareSettings(val_every=2), progress=False)
    store = TokenStore(tmp_path / "store")
    hay = RI.corpus_haystack(BYTE, store)
    texts = [BYTE.decode(u) for u in hay.units]
    assert texts and all(t.startswith(" ") for t in texts) and texts == [" " + t for t in hay.texts]
    assert {t for t in texts} <= {f" Document {i} says hello." for i in range(4)} | {
        f" It has a second sentence {i}!" for i in range(4)}
    assert hay.identity == f"corpus:{store.fingerprint[:16]}"
    item = RI.make_item("niah_single", 800, 0, 0, BYTE, hay)
    assert oracle("niah_single", BYTE.decode(item.ids))["answers"] == list(item.answers)


def test_short_lengths_are_refused_with_what_they_need():
    with pytest.raises(RI.TooShort, match="needs at least"):
        _item("niah_multiquery", 512, BYTE)
    with pytest.raises(RI.TooShort, match="fwe at 512 tokens"):
        _item("fwe", 512, BYTE)
    with pytest.raises(ConfigError, match="unknown RULER task"):
        _item("qa", 4096, BYTE)
    assert RI.cwe_setting(BYTE, 32768)[:3] == (10, 30, 3)  # RULER's at long lengths
    assert RI.cwe_setting(BYTE, 3000)[:3] != (10, 30, 3)  # below 4K RULER's short setting at most


# ----------------------------------------------------------------------------- cache and scoring


def test_cache_reuses_extends_and_repairs(tmp_path):
    hay = RI.haystack_for("noise", BYTE)
    items, path = RI.load_items("niah_multikey", 1024, 5, 2, BYTE, hay, root=tmp_path)
    assert path.is_file() and len(path.read_text().splitlines()) == 3
    again, same = RI.load_items("niah_multikey", 1024, 5, 2, BYTE, hay, root=tmp_path)
    assert same == path and all(np.array_equal(a.ids, b.ids) and a.answers == b.answers for a, b in zip(items, again))
    more, _ = RI.load_items("niah_multikey", 1024, 5, 3, BYTE, hay, root=tmp_path)  # extended, first two kept
    assert len(more) == 3 and np.array_equal(more[1].ids, items[1].ids)
    assert np.array_equal(more[2].ids, RI.make_item("niah_multikey", 1024, 5, 2, BYTE, hay).ids)
    path.write_text(path.read_text()[:500])  # torn: generated again
    fixed, _ = RI.load_items("niah_multikey", 1024, 5, 3, BYTE, hay, root=tmp_path)
    assert np.array_equal(fixed[2].ids, more[2].ids)
    other = RI.cache_path(RI.cache_key("niah_multikey", 1024, 6, BYTE, hay), tmp_path)
    assert other != path  # the seed is in the key


def test_string_match_all_counts_each_expected_string():
    assert R.string_match_all(" 1234567.\nThe next", ["1234567"]) == 1.0
    assert R.string_match_all(" 1234567 and 7654321", ["1234567", "2345678"]) == 0.5
    assert R.string_match_all(" pieil, vdiuh", ["PIEIL", "VDIUH", "QIXRI", "XXXXX"]) == 0.5  # case-insensitive
    assert R.string_match_all("", ["a"]) == 0.0
    # generation is cut at the task's budget and at EOS (the separator for bytes) before matching
    assert R.continuation(BYTE, BYTE.encode(" 1234567\n\n 7654321"), "niah_multivalue") == "1234567"
    assert R.continuation(BYTE, BYTE.encode("x" * 49 + " 1234567"), "fwe") == "x" * 49


def test_answer_scores_and_summary():
    s = R.answer_scores([1.0, 3.0])
    assert s == {"nll": 2.0, "win": None}
    assert R.answer_scores([1.0, 3.0], [[2.0, 2.5], [5.0]])["win"] is True  # 4.0 < 4.5 and < 5.0
    assert R.answer_scores([1.0, 3.0], [[4.0], [9.0]])["win"] is False  # a tie is not a win
    items = [_item("niah_multikey", 1024, BYTE, index=i) for i in range(2)]
    summary = R.summarize(items, [1.0, 0.0], [{"nll": 1.0, "win": True}, {"nll": 3.0, "win": False}])
    assert summary["exact_match"] == 0.5 and summary["answer_nll"] == 2.0
    assert summary["ll_accuracy"] == 0.5 and summary["ll_chance"] == 0.25 and summary["distractors"] == 3
    assert R.summarize(items, None, [{"nll": 1.0, "win": None}] * 2)["exact_match"] is None


def test_request_checks():
    from hybrid_lm.experiment import load_config
    cfg = load_config([], ["DataConfig.seq_len = 8192"])
    assert R.check_request(cfg) == (list(RI.TASKS), [4096, 8192])
    assert R.check_request(load_config([], ["DataConfig.seq_len = 512"]))[1] == [512]
    with pytest.raises(ConfigError, match="unknown RULER task"):
        R.check_request(cfg, ["niah_single", "nope"])
    with pytest.raises(ConfigError, match="exceed the run's seq_len 8192.*--allow-longer"):
        R.check_request(cfg, None, [16384])
    assert R.check_request(cfg, None, [16384], allow_longer=True)[1] == [16384]
    with pytest.raises(ConfigError, match="--haystack"):
        R.check_request(cfg, haystack="pg19")
    assert R.parse_lengths("4K, 8192,16k") == [4096, 8192, 16384]
    with pytest.raises(ConfigError, match="--lengths"):
        R.parse_lengths("4x")
    # `hybrid-lm eval --tasks ruler` takes them as --ruler-lengths: the errors name the flag typed
    with pytest.raises(ConfigError, match=r"^--ruler-lengths: '1Q' is not a positive length"):
        R.parse_lengths("1Q", flag="--ruler-lengths")
    with pytest.raises(ConfigError, match=r"^--ruler-lengths: give at least one length"):
        R.parse_lengths(",", flag="--ruler-lengths")
    with pytest.raises(ConfigError, match="use shorter --ruler-lengths, or --allow-longer"):
        R.check_request(cfg, None, [16384], lengths_flag="--ruler-lengths")


# ----------------------------------------------------------------------------- on a trained run


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run(5)  # TINY, 5 steps (conftest.py)


def _one_line_error(capsys, *argv) -> str:
    from hybrid_lm.cli import main
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip() and not x.startswith("WARNING")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.mark.integration
def test_hybrid_lm_ruler_end_to_end(run_dir, tmp_path, capsys):
    from hybrid_lm.cli import main
    from hybrid_lm.run.directory import read_eval_rows

    wd = tmp_path / "run"
    shutil.copytree(run_dir, wd)
    tasks = "niah_single,niah_multikey,vt,cwe,fwe"
    rc = main(["ruler", str(wd), "--tasks", tasks, "--lengths", "1K,2K", "--allow-longer", "--samples", "2",
               "--haystack", "corpus", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "exact match (greedy)" in out and "answer NLL" in out and "short: vt needs at least" in out
    assert "gold beats distractors: the share of items" in " ".join(out.split())
    rows = read_eval_rows(wd)
    assert sorted((r["task"], r["length"]) for r in rows) == sorted(
        [(f"ruler/{t}", n) for t in tasks.split(",") for n in (1024, 2048) if (t, n) not in (("vt", 1024),
                                                                                             ("cwe", 1024))])
    for r in rows:
        assert r["kind"] == "ruler" and r["checkpoint_step"] == 5 and r["tokens_seen"] == 5 * 4 * 32
        assert r["seed"] == 3 and r["samples"] == 2 and r["generation"].startswith("greedy, stopped at EOS")
        assert r["haystack"] == ("corpus" if r["task"] in ("ruler/niah_single", "ruler/niah_multikey", "ruler/vt")
                                 else None)
        assert 0 <= r["exact_match"] <= 1 and 0 < r["answer_nll"] < 20
        assert r["prompt_tokens"] + r["gen_tokens"] == r["length"]
        assert (r["ll_accuracy"] is None) == (r["task"] in ("ruler/niah_single", "ruler/vt"))
        assert r["attention_backends"] and len(r["per_item"]["nll"]) == 2
    # bad inputs: one line each, nothing restored
    assert "unknown RULER task" in _one_line_error(capsys, "ruler", str(wd), "--tasks", "niah_single,qa")
    assert "--allow-longer" in _one_line_error(capsys, "ruler", str(wd), "--lengths", "1K")
    empty = tmp_path / "untrained"
    empty.mkdir()
    shutil.copy(wd / "config.json", empty / "config.json")
    assert "no checkpoints" in _one_line_error(capsys, "ruler", str(empty), "--lengths", "32")
    assert "no config.json" in _one_line_error(capsys, "ruler", str(tmp_path / "nothing"))
    assert "too short" in _one_line_error(capsys, "ruler", str(wd), "--lengths", "32", "--no-record")
    n = len(read_eval_rows(wd))
    one = ["ruler", str(wd), "--tasks", "niah_single", "--lengths", "1K", "--allow-longer", "--samples", "1"]
    assert main(one + ["--no-record"]) == 0 and len(read_eval_rows(wd)) == n
    capsys.readouterr()
    from resume_check import make_unwritable
    locked = tmp_path / "locked"
    shutil.copytree(run_dir, locked)  # no eval.jsonl yet: appending needs a new entry
    undo = make_unwritable(locked)
    if undo is None:
        return
    try:
        rc = main([one[0], str(locked), *one[2:]])
    finally:
        undo()
    out = capsys.readouterr()  # the table first, then one line
    assert rc == 2 and "niah_single" in out.out and "could not be appended to" in out.err and "--no-record" in out.err


@pytest.mark.integration
def test_scores_are_computed_on_the_right_tokens(run_dir, monkeypatch):
    """Generation returning the gold answer scores 1, anything else 0; the answer NLL is the full
    forward pass's NLL of the answer tokens (batch padding and the logits span are right)."""
    import jax.numpy as jnp

    from hybrid_lm.eval.longppl import _nll_fn
    from hybrid_lm.run.restore import RestoredRun

    run = RestoredRun(run_dir)
    items, _ = RI.load_items("niah_multikey", 768, 0, 3, run.tokenizer, RI.haystack_for("noise", run.tokenizer))
    gold = {items[i].ids.tobytes(): RI.encode(run.tokenizer, items[i].gold) for i in range(3)}

    def fake_generate(model, prompt, max_new, **kw):
        rows = [np.resize(gold.get(np.asarray(p, np.int32).tobytes(), [0]), max_new) for p in np.asarray(prompt)]
        return jnp.asarray(np.stack(rows))
    monkeypatch.setattr(R, "generate", fake_generate)  # the name ruler.py calls
    kw = dict(tasks=["niah_multikey"], lengths=[768], samples=3, haystack="noise", allow_longer=True, batch_size=2,
              progress=False)
    (row,), _ = R.evaluate_ruler(run, **kw)
    assert row["exact_match"] == 1.0
    monkeypatch.setattr(R, "generate", lambda model, prompt, max_new, **k: jnp.zeros((prompt.shape[0], max_new),
                                                                                        jnp.int32))
    (zero,), _ = R.evaluate_ruler(run, **kw)
    assert zero["exact_match"] == 0.0 and zero["answer_nll"] == row["answer_nll"]
    full = _nll_fn(run)  # [B, n-1] NLL of every token given its prefix
    want = []
    for it in items:
        answer = RI.encode(run.tokenizer, it.gold)
        seq = np.concatenate([it.ids, answer])[None]
        want.append(float(np.mean(np.asarray(full(seq))[0, len(it.ids) - 1:])))
    np.testing.assert_allclose(row["per_item"]["nll"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.integration
def test_mixers_without_a_decode_path_get_log_likelihood_scores_only(run_dir):
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.step import ModelFns

    run = RestoredRun(run_dir)
    assert R.decode_unavailable(run.model()) is None
    cfg = swapped_config(run.cfg, horizon=16, sinks=2)  # full layers -> attention_sink: no decode path
    assert "has no decode path" in R.decode_unavailable(ModelFns(cfg).model(run.params))
    (row,), skipped = R.evaluate_ruler(run, cfg=cfg, tasks=["niah_multikey"], lengths=[768], samples=2,
                                       haystack="noise", allow_longer=True, progress=False)
    assert not skipped and row["exact_match"] is None and row["generation"].startswith("unavailable")
    assert 0 < row["answer_nll"] < 20 and row["ll_accuracy"] in (0.0, 0.5, 1.0)
    assert row["mixers"]["full"]["kind"] == "attention_sink"
    assert "—" in format_table([row])


@pytest.mark.integration
def test_sa_layers_are_scored_by_generation_too(run_dir):
    """SA decodes (docs/STOCHASTIC_ATTENTION.md §9): exact match as well as the log-likelihood scores."""
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.run.swap import swapped_config
    from hybrid_lm.step import ModelFns

    run = RestoredRun(run_dir)
    for spec in ("efficient=sa:8", "efficient=sa:8,decode=swa"):
        cfg = swapped_config(run.cfg, [spec])
        assert R.decode_unavailable(ModelFns(cfg).model(run.params)) is None
        (row,), skipped = R.evaluate_ruler(run, cfg=cfg, tasks=["niah_multikey"], lengths=[768], samples=2,
                                           haystack="noise", allow_longer=True, progress=False)
        assert not skipped and row["generation"].startswith("greedy") and 0 <= row["exact_match"] <= 1
        assert 0 < row["answer_nll"] < 20 and row["mixers"]["efficient"]["kind"] == "sa"


class _NeedleOracle:
    """A hand-built "model" for RULER's NIAH tasks on the byte tokenizer: it reads the question's key
    at the end of the prompt and the needle sentences among the last ``horizon`` prompt tokens.
    Generation writes the needle's value when it sees it, else a 7-digit guess; the answer NLL is 0
    per token for a candidate it sees as the key's value, else a random number (a seeded draw per
    candidate): what a model that cannot see the needle can do, so gold beats the distractors at
    chance. Patched in for ``generate`` and ``_answer_nll_fn``; the harness around them is real."""

    NEEDLE = re.compile(r"magic numbers? for ([\w-]+) is: (\d+)\.")
    QUERY = re.compile(r"The special magic number for ([\w-]+) mentioned in the provided text is$")

    def __init__(self, horizon=None):
        self.horizon = horizon
        self.rng = np.random.default_rng(0)

    def _seen(self, prompt) -> dict:
        ids = np.asarray(prompt)
        visible = ids if self.horizon is None else ids[-self.horizon:]
        text = bytes(int(t) for t in visible).decode("utf-8", "replace")
        return dict(self.NEEDLE.findall(text)), self.QUERY.search(bytes(int(t) for t in ids).decode()).group(1)

    def generate(self, model, prompts, n_new, **_):
        out = np.zeros((prompts.shape[0], n_new), np.int32)
        for r, p in enumerate(np.asarray(prompts)):
            seen, key = self._seen(p)
            value = seen.get(key) or "".join(str(d) for d in self.rng.integers(0, 10, 7))
            text = f" {value}.".encode()[:n_new]
            out[r, :len(text)] = list(text)
        return out

    def nll_fn(self, fns, cfg, span):
        def nll(params, tokens, example_ids=None):  # an oracle: no permutation
            tokens = np.asarray(tokens)
            out = np.zeros((tokens.shape[0], span), np.float32)
            for r, row in enumerate(tokens):
                prompt, answer = row[:-span], row[-span:]
                seen, key = self._seen(prompt)
                cand = bytes(int(t) for t in answer if t).decode().strip(" .")
                out[r] = 0.0 if seen.get(key) == cand else self.rng.uniform(1.0, 2.0)
            return out
        return nll


@pytest.mark.integration
@pytest.mark.parametrize("horizon", [None, 48])
def test_niah_oracle_scores_one_when_it_sees_the_needle_and_chance_when_it_cannot(run_dir, monkeypatch, horizon):
    """Acceptance oracles: a model that sees the needle scores 1 on NIAH (exact match and gold beats
    the distractors); one whose receptive field (the last 48 tokens) ends before every needle scores
    exact match 0 and gold-beats-distractors at chance (1/4 for niah_multikey's 3 distractors)."""
    from hybrid_lm.eval import ruler
    from hybrid_lm.run.restore import RestoredRun

    oracle = _NeedleOracle(horizon)
    monkeypatch.setattr(ruler, "generate", oracle.generate)  # the name ruler.py calls
    monkeypatch.setattr(ruler, "_answer_nll_fn", oracle.nll_fn)
    run = RestoredRun(run_dir)
    samples = 96 if horizon else 16
    rows, skipped = ruler.evaluate_ruler(run, tasks=["niah_single", "niah_multikey"], lengths=[1024],
                                         samples=samples, haystack="noise", allow_longer=True, progress=False,
                                         cache_root=None)
    assert not skipped
    by = {r["task"]: r for r in rows}
    if horizon is None:
        assert by["ruler/niah_single"]["exact_match"] == 1.0 and by["ruler/niah_multikey"]["exact_match"] == 1.0
        assert by["ruler/niah_multikey"]["ll_accuracy"] == 1.0
        return
    # every needle sits at a depth <= 100% of ~950 haystack tokens, more than 48 tokens before the end
    assert by["ruler/niah_single"]["exact_match"] == 0.0 and by["ruler/niah_multikey"]["exact_match"] == 0.0
    mk = by["ruler/niah_multikey"]
    assert mk["ll_chance"] == 0.25
    sd = (0.25 * 0.75 / samples) ** 0.5  # binomial: 0.044 at 96 items
    assert abs(mk["ll_accuracy"] - 0.25) < 3.5 * sd, mk["ll_accuracy"]
