"""Tokenizers (hybrid_lm/data/tokenizer.py): byte-level, a byte-level BPE trained with train_bpe, a
Llama-2 style tokenizer.json (Metaspace + byte fallback), SentencePiece; the config checks in
hybrid_lm/validate.py; one-line errors for bad inputs."""

import copy
import hashlib
import io
import json
import pickle
import shutil

import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.data.sources import embedded_documents
from hybrid_lm.data.tokenizer import REPLACEMENT, get_tokenizer, load_tokenizer, train_bpe
from hybrid_lm.errors import ConfigError
from hybrid_lm.experiment import check_tokenizer, config_warnings

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, naïve café; Größe; 日本語のテキスト; Ελληνικά; עברית",
    "emoji 🎉🚀 family 👩‍👩‍👧 flag 🇫🇷 and a combining e\u0301",
    "tabs\tand\r\nnewlines\n\n  two spaces   three, trailing ",
    "a literal <|endoftext|> and <|pad|> inside a document stay text",
    "",
]


def corpus_text(n_bytes: int = 12_000) -> str:
    """A few KB of the embedded essays plus lines with non-ASCII text."""
    text = "\n\n".join(t for _, t in embedded_documents())[:n_bytes]
    return text + "\n" + "\n".join(SAMPLES[1:3]) * 3


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    text = corpus_text()
    out = tmp_path_factory.mktemp("bpe")
    path = train_bpe((text[i:i + 500] for i in range(0, len(text), 500)), 512, out)  # streamed
    assert path == out / "tokenizer.json"
    return out


# ----------------------------------------------------------------------------- byte-level

def test_byte_tokenizer_encode_values_round_trip_and_token_bytes():
    tok = load_tokenizer("byte")
    assert get_tokenizer("byte") is tok and tok.kind == "byte" and tok.vocab_size == 256
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids.dtype == np.uint32
        assert np.array_equal(ids, np.frombuffer(s.encode("utf-8"), dtype=np.uint8))  # the old values
        assert tok.decode(ids) == s
        assert tok.token_bytes[ids].sum() == len(s.encode("utf-8"))
    assert tok.separator.tolist() == [10, 10] and tok.eos_id is None and tok.pad_id is None
    assert tok.fingerprint == "byte" and tok.dummy_prefix_bytes == 0
    assert tok.describe() == {"kind": "byte", "spec": "byte", "vocab_size": 256, "eos_id": None, "bos_id": None,
                              "pad_id": None, "fingerprint": "byte"}
    assert tok.decode([104, 300, 105, -1]) == f"h{REPLACEMENT}i{REPLACEMENT}"
    assert [a.tolist() for a in tok.encode_batch(["ab", ""])] == [[97, 98], []]


# ----------------------------------------------------------------------------- byte-level BPE (train_bpe)

def test_bpe_round_trip_and_exact_token_bytes(bpe_dir):
    tok = load_tokenizer(str(bpe_dir / "tokenizer.json"))
    assert tok.kind == "hf" and tok.vocab_size == 512 and tok.dummy_prefix_bytes == 0
    text = corpus_text(4000)
    ids = tok.encode(text)
    assert ids.dtype == np.uint32 and len(ids) < len(text.encode()) / 2  # merges were learned
    for s in SAMPLES + [text]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert int(tok.token_bytes[ids].sum()) == len(s.encode("utf-8"))
        assert tok.eos_id not in ids.tolist() and tok.pad_id not in ids.tolist()  # literal specials are text
    batch = tok.encode_batch(SAMPLES)
    assert all(np.array_equal(b, tok.encode(s)) for b, s in zip(batch, SAMPLES))


def test_bpe_special_ids_separator_and_describe(bpe_dir):
    tok = load_tokenizer(str(bpe_dir))
    raw = json.loads((bpe_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in raw["added_tokens"]}
    assert tok.eos_id == ids["<|endoftext|>"] and tok.pad_id == ids["<|pad|>"] and tok.bos_id is None
    assert tok.separator.tolist() == [tok.eos_id]
    assert tok.token_bytes[tok.eos_id] == 0 and tok.token_bytes[tok.pad_id] == 0
    assert tok.decode([tok.encode("a")[0], tok.eos_id, tok.encode("b")[0]]) == "ab"  # specials render as nothing
    assert tok.decode([tok.encode("a")[0], 10**6, -3]) == "a" + 2 * REPLACEMENT
    d = tok.describe()
    assert json.loads(json.dumps(d)) == d and d["kind"] == "hf" and d["spec"] == str(bpe_dir)
    cfg = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["pad_token"] == "<|pad|>"
    assert cfg["hybrid_lm"]["vocab_size"] == cfg["hybrid_lm"]["vocab_size_requested"] == 512


def test_special_token_strings_are_text_in_data_and_ids_in_prompts(bpe_dir):
    """``encode`` keeps "<|endoftext|>" text (a document never injects an EOS); ``encode_parsing_specials``
    maps it to its id as transformers' tokenizers do, the text around it encoded as it would be alone."""
    tok = load_tokenizer(str(bpe_dir))
    text = "one <|endoftext|>two<|pad|> three"
    assert tok.eos_id not in tok.encode(text) and tok.pad_id not in tok.encode(text)
    want = [*tok.encode("one "), tok.eos_id, *tok.encode("two"), tok.pad_id, *tok.encode(" three")]
    assert tok.encode_parsing_specials(text).tolist() == want
    assert tok.eos_id not in tok.encode(text)  # the shared backend's setting is unchanged
    assert np.array_equal(tok.encode_parsing_specials(SAMPLES[0]), tok.encode(SAMPLES[0]))
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode_parsing_specials(text).tolist() == want and tok.eos_id not in clone.encode(text)
    byte = get_tokenizer("byte")
    assert np.array_equal(byte.encode_parsing_specials(text), byte.encode(text))


def test_bpe_reload_from_directory_fingerprint_cache_and_pickle(bpe_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(bpe_dir, d)
    by_dir, by_file = load_tokenizer(str(d)), load_tokenizer(str(d / "tokenizer.json"))
    assert load_tokenizer(str(d)) is by_dir  # cached
    assert by_dir.fingerprint == by_file.fingerprint == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert np.array_equal(by_dir.encode(SAMPLES[2]), by_file.encode(SAMPLES[2]))
    # the same tokenizer written differently is another file: a new fingerprint, and the cache sees it
    (d / "tokenizer.json").write_text(json.dumps(json.loads((d / "tokenizer.json").read_text())))
    again = load_tokenizer(str(d))
    assert again is not by_dir and again.fingerprint != by_dir.fingerprint
    assert np.array_equal(again.encode(SAMPLES[2]), by_dir.encode(SAMPLES[2]))
    clone = pickle.loads(pickle.dumps(again))  # (data-loader workers)
    assert np.array_equal(clone.encode(SAMPLES[4]), again.encode(SAMPLES[4])) and clone.eos_id not in clone.encode(SAMPLES[4])


def test_hf_file_truncation_and_padding_settings_are_ignored(bpe_dir, tmp_path):
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    raw.enable_truncation(8)
    raw.enable_padding(length=64, pad_id=1, pad_token="<|pad|>")
    (tmp_path / "tokenizer.json").write_text(raw.to_str())
    tok = load_tokenizer(str(tmp_path))
    text = corpus_text(2000)
    assert np.array_equal(tok.encode(text), load_tokenizer(str(bpe_dir)).encode(text)) and len(tok.encode(text)) > 64
    assert tok.encode("a").tolist() == load_tokenizer(str(bpe_dir)).encode("a").tolist()


def test_train_bpe_small_corpus_gives_smaller_vocab_visibly(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="hybrid_lm.data.tokenizer"):
        path = train_bpe(["hello hello world"] * 3, 2000, tmp_path)
    tok = load_tokenizer(str(path))
    assert 258 <= tok.vocab_size < 2000
    assert tok.decode(tok.encode("ünïcode 🎉 never seen")) == "ünïcode 🎉 never seen"  # every byte encodable
    rec = json.loads((tmp_path / "tokenizer_config.json").read_text())["hybrid_lm"]
    assert rec == {"trainer": "train_bpe", "vocab_size": tok.vocab_size, "vocab_size_requested": 2000,
                   "min_frequency": 2}
    assert any(f"gave {tok.vocab_size} tokens, fewer than vocab_size=2000" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kwargs,match", [
    ({"vocab_size": 257}, r"vocab_size=257 must be an integer >= 258"),
    ({"vocab_size": 300, "special_tokens": ()}, "special_tokens"),
    ({"vocab_size": 300, "special_tokens": ("<e>", "<e>")}, "distinct"),
    ({"vocab_size": 300, "min_frequency": 0}, "min_frequency=0"),
])
def test_train_bpe_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        train_bpe(["some text"], out_dir=tmp_path, **kwargs)
    one_line_error(e)
    assert not (tmp_path / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- Llama-2 style tokenizer.json

def write_llama_style(d):
    """Metaspace-style BPE with byte fallback and the Llama-2 decoder, as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in list("\u2581abcdefghijklmnopqrstuvwxyz.,") + ["\u2581t", "he", "\u2581the"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "t"), ("h", "e"), ("\u2581t", "he")],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def test_llama_style_tokenizer_json(tmp_path):
    d = write_llama_style(tmp_path / "llama")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    tok = load_tokenizer(str(d))
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (2, 1, None, 291)
    assert tok.dummy_prefix_bytes == 1
    for s in ["the cat, the dog.", "the 🎉 ü Zürich"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        # exact but for the dummy-prefix space, which decode strips from the start
        assert int(tok.token_bytes[ids].sum()) == len(s.encode()) + tok.dummy_prefix_bytes
    assert tok.token_bytes[[0, 1, 2]].tolist() == [0, 0, 0] and tok.token_bytes[3 + 0xF0] == 1


# ----------------------------------------------------------------------------- SentencePiece

def train_sentencepiece(**kwargs) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    lines = [line for line in corpus_text(8000).splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2, **kwargs)
    return buf.getvalue()


@pytest.mark.integration
def test_sentencepiece_model_round_trip_and_token_bytes(tmp_path):
    path = tmp_path / "sp.model"
    path.write_bytes(train_sentencepiece())
    tok = load_tokenizer(str(path))
    assert load_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
    assert tok.kind == "sentencepiece" and tok.vocab_size == 400
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, None) and tok.separator.tolist() == [2]
    for s in SAMPLES[:4]:
        ids = tok.encode(s)
        assert ids.dtype == np.uint32 and tok.decode(ids) == s
    ascii_text = "The quick brown fox jumps over the lazy dog, and then over it again."
    ids = tok.encode(ascii_text)
    assert tok.dummy_prefix_bytes == 1  # the model adds a leading '\u2581' that decode drops
    assert int(tok.token_bytes[ids].sum()) == len(ascii_text) + 1
    emoji = "x 🎉 y"  # byte-fallback pieces count one byte each
    assert int(tok.token_bytes[tok.encode(emoji)].sum()) == len(emoji.encode()) + 1
    assert tok.token_bytes[[tok.eos_id, tok.bos_id, 0]].tolist() == [0, 0, 0]  # control pieces and unk
    assert tok.decode([ids[0], 10**6]) == tok.decode([ids[0]]) + REPLACEMENT
    assert all(np.array_equal(b, tok.encode(s)) for b, s in zip(tok.encode_batch(SAMPLES), SAMPLES))


@pytest.mark.integration
def test_sentencepiece_without_eos_is_refused(tmp_path):
    path = tmp_path / "noeos.model"
    path.write_bytes(train_sentencepiece(eos_id=-1))
    with pytest.raises(ConfigError, match="no end-of-sequence piece") as e:
        load_tokenizer(str(path))
    assert str(path) in one_line_error(e)


# ----------------------------------------------------------------------------- bad inputs

def test_bad_tokenizer_paths_are_one_line_errors(tmp_path):
    (tmp_path / "notatok.json").write_text('{"hello": "world"}')
    (tmp_path / "garbage.model").write_bytes(b"\x00not a model")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing" / "tokenizer.json", "no such file or directory"),
        ("gpt2", "nothing is downloaded"),
        (tmp_path / "notatok.json", "not a Hugging Face tokenizers JSON"),
        (tmp_path / "garbage.model", "not a SentencePiece model"),
        (tmp_path / "vocab.txt", "expected a Hugging Face tokenizer.json"),
        (tmp_path / "empty", "holds no tokenizer.json"),
    ]
    for spec, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            load_tokenizer(str(spec))
        assert str(spec) in one_line_error(e)


def test_hf_tokenizer_without_eos_is_refused(tmp_path):
    d = tmp_path / "noeos"
    train_bpe([corpus_text(2000)], 300, d, special_tokens=("<|custom_end|>",))
    assert load_tokenizer(str(d)).eos_id is not None  # named by tokenizer_config.json
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="has no end-of-sequence token") as e:
        load_tokenizer(str(d))
    msg = one_line_error(e)
    assert str(d / "tokenizer.json") in msg and "tokenizer_config.json" in msg and "eos_token" in msg
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_there|>"}))
    with pytest.raises(ConfigError, match="'<|not_there|>' is not in the vocabulary") as e:
        load_tokenizer(str(d))
    assert str(d / "tokenizer_config.json") in one_line_error(e)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON") as e:
        load_tokenizer(str(d))
    one_line_error(e)


# ----------------------------------------------------------------------------- config checks (validate.py)

def test_model_vocab_against_tokenizer_through_load_config(bpe_dir):
    spec = f"DataConfig.tokenizer = '{bpe_dir}'"
    with pytest.raises(ConfigError, match="vocab_size=100 is smaller than the .* tokenizer's 512") as e:
        load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 100", spec])
    assert str(bpe_dir) in one_line_error(e)
    cfg = load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 512", spec])
    assert cfg.data.tokenizer == str(bpe_dir) and config_warnings(cfg) == []
    cfg = load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 1024", spec])
    assert [w for w in config_warnings(cfg) if w.startswith("ModelConfig.vocab_size=1024 exceeds")] == [
        f"ModelConfig.vocab_size=1024 exceeds the '{bpe_dir}' tokenizer's 512 ids: 512 embedding rows stand for "
        "ids the tokenizer never produces"]


def test_eos_id_beyond_model_vocab(bpe_dir, tmp_path):
    # a tokenizer.json whose EOS sits far above the rest of its ids: the vocabulary spans it
    raw = json.loads((bpe_dir / "tokenizer.json").read_text())
    eos = next(t for t in raw["added_tokens"] if t["content"] == "<|endoftext|>")
    old = eos["id"]
    eos["id"] = 1000
    raw["model"]["vocab"] = {p: (1000 if i == old else i) for p, i in raw["model"]["vocab"].items()}
    d = tmp_path / "holes"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(raw))
    tok = load_tokenizer(str(d))
    assert tok.eos_id == 1000 and tok.vocab_size == 1001 and tok.separator.tolist() == [1000]
    assert tok.decode([old]) == REPLACEMENT  # the hole left behind is not a token
    with pytest.raises(ConfigError, match="vocab_size=512 is smaller than .* tokenizer's 1001") as e:
        load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 512", f"DataConfig.tokenizer = '{d}'"])
    one_line_error(e)
    # the id check on its own: a tokenizer whose special id is beyond its own vocab_size
    odd = copy.copy(load_tokenizer(str(bpe_dir)))
    odd.eos_id = 600
    check_tokenizer(odd, 640)
    with pytest.raises(ConfigError, match=r"eos id 600 is not below ModelConfig.vocab_size=512") as e:
        check_tokenizer(odd, 512)
    assert str(bpe_dir) in one_line_error(e)


def test_byte_tokenizer_config_check_unchanged():
    with pytest.raises(ConfigError, match="smaller than the 'byte' tokenizer's 256"):
        load_config([], ["ModelConfig.vocab_size = 100"])
    assert config_warnings(load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 256"])) == []
    assert [w for w in config_warnings(load_config(["quickstart.gin"], ["ModelConfig.vocab_size = 384"]))
            if w.startswith("ModelConfig.vocab_size=384 exceeds the 'byte' tokenizer's 256")]
