"""Packing and mixing (hybrid_lm/data/pipeline.py): windows over documents, segment ids, no token
lost or duplicated in an epoch, the long/short ratio, store mixtures, step-indexed rows, and the
loader's bad-input errors."""

import json

import numpy as np
import pytest

from hybrid_lm.experiment import load_config
from hybrid_lm.data import store as st
from hybrid_lm.data.pipeline import DataStreams, Mixture, mix_counts
from hybrid_lm.data.prepare import PrepareSettings, prepare
from hybrid_lm.data.sources import SourceSpec
from hybrid_lm.errors import DataError

from tests.test_store import write_jsonl


def make_store(tmp_path, name="s", n_docs=200, seed=0, lengths=None, shard_tokens=4096):
    f = tmp_path / f"{name}.jsonl"
    if lengths is None:
        write_jsonl(f, n_docs, seed=seed)
    else:
        rng = np.random.default_rng(seed)
        f.write_text("".join(json.dumps({"text": "".join(rng.choice(list("abcdefgh"), n))}) + "\n" for n in lengths))
    spec = SourceSpec(kind="text", paths=(str(f),))
    return prepare(spec, tmp_path / name, PrepareSettings(shard_tokens=shard_tokens), progress=False).path


def cfg_for(path, *extra, seq_len=32, batch=8, validate=True):
    return load_config([], validate=validate, gin_params=[f"DataConfig.source='tokens'", f"DataConfig.path='{path}'", f"DataConfig.seq_len={seq_len}",
                            f"TrainConfig.global_batch={batch}", "DataConfig.eval_windows=4", *extra])


def test_an_epoch_covers_every_window_once_and_windows_tile_the_stream(tmp_path):
    path = make_store(tmp_path)
    data = DataStreams(cfg_for(path))
    comp = data.components[0]
    seen = sorted(data.sample(g)[1] for g in range(len(comp)))
    assert seen == list(range(len(comp)))  # a permutation: nothing lost or repeated
    body = np.concatenate([comp[i][:-1] for i in range(len(comp))])
    view = st.TokenStore(path).split("train")
    assert np.array_equal(body, view.read(0, len(comp) * 32))  # crosses several shards
    assert all(np.array_equal(comp[i][-1:], comp[i + 1][:1]) for i in range(len(comp) - 1))


def test_segment_ids_and_positions_follow_document_starts(tmp_path):
    path = make_store(tmp_path)
    data = DataStreams(cfg_for(path, "DataConfig.document_mask=True"))
    b = data.batch(3)
    assert set(b) == {"tokens", "segment_ids"} and b["tokens"].shape == b["segment_ids"].shape == (8, 33)
    starts = st.TokenStore(path).split("train").doc_starts
    for row, (c, i) in enumerate(data.sample(3 * 8 + r) for r in range(8)):
        seg = b["segment_ids"][row]
        assert seg[0] == 0 and np.all(np.diff(seg) >= 0)
        first = i * 32
        inside = starts[(starts > first) & (starts < first + 33)] - first  # document starts in the window
        assert np.array_equal(np.flatnonzero(np.diff(seg)) + 1, inside)
        assert all(b["tokens"][row][k - 1] == 10 and b["tokens"][row][k - 2] == 10 for k in inside)  # "\n\n"
    assert data.eval_batch["segment_ids"].shape == data.eval_batch["tokens"].shape


def test_batches_are_a_pure_function_of_config_and_step_and_rows_split_across_hosts(tmp_path):
    path = make_store(tmp_path)
    a, b = DataStreams(cfg_for(path)), DataStreams(cfg_for(path))
    for step in (0, 7, 1000):
        full = a.batch(step)
        assert np.array_equal(full, b.batch(step))
        halves = [b.batch(step, rows=slice(0, 4)), b.batch(step, rows=slice(4, 8))]
        assert np.array_equal(np.concatenate(halves), full)
    assert not np.array_equal(a.batch(0), a.batch(1))
    other_seed = DataStreams(cfg_for(path, "TrainConfig.seed=1"))
    assert not np.array_equal(other_seed.batch(0), a.batch(0))


def test_data_seed_sets_the_order_alone_and_the_val_windows_never_move(tmp_path):
    path = make_store(tmp_path)
    base = DataStreams(cfg_for(path))
    init_only = DataStreams(cfg_for(path, "TrainConfig.seed=1", "TrainConfig.data_seed=0"))
    data_only = DataStreams(cfg_for(path, "TrainConfig.data_seed=1"))
    both = DataStreams(cfg_for(path, "TrainConfig.seed=1"))
    for step in (0, 3):
        assert np.array_equal(init_only.batch(step), base.batch(step))  # another init, the same order
        assert np.array_equal(data_only.batch(step), both.batch(step))  # data_seed 1 = seed 1's order
    assert not np.array_equal(data_only.batch(0), base.batch(0))
    for other in (init_only, data_only, both):  # one fixed val set for every seed
        assert np.array_equal(other.eval_tokens, base.eval_tokens)


def test_long_short_ratio_by_tokens(tmp_path):
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(5, 60, 300), rng.integers(200, 400, 60)])
    rng.shuffle(lengths)
    path = make_store(tmp_path, lengths=lengths.tolist())
    for frac in (0.5, 0.25):
        data = DataStreams(cfg_for(path, "DataConfig.long_min_tokens=150", f"DataConfig.long_fraction={frac}"))
        assert [c.name.split("(")[-1] for c in data.components] == ["long)", "short)"]
        picks = [data.sample(g)[0] for g in range(5000)]
        share = picks.count(0) / len(picks)  # equal-size windows: a share of windows is a share of tokens
        assert abs(share - frac) <= 0.02 * frac
        long_docs = set(np.flatnonzero(data.components[0].stream.view.doc_lengths >= 150))
        assert set(data.components[0].stream.docs) == long_docs


def test_store_mixture_by_weight(tmp_path):
    a, b = make_store(tmp_path, "a", seed=1), make_store(tmp_path, "b", seed=2)
    cfg = cfg_for(a, f"DataConfig.mixture=(('{a}', 3.0), ('{b}', 1.0))")
    data = DataStreams(cfg)
    picks = [data.sample(g)[0] for g in range(8192)]
    assert picks.count(0) == 3 * 2048
    assert np.array_equal(data.batch(5), DataStreams(cfg).batch(5))


def test_mixture_blocks_are_exact():
    assert mix_counts([1, 1]).tolist() == [2048, 2048] and mix_counts([2, 1], block=10).tolist() == [7, 3]
    m = Mixture([0.3, 0.7], seed=0, block=100)
    picks = [m(g) for g in range(300)]
    assert sum(c == 0 for c, _ in picks) == 90
    assert sorted(k for c, k in picks if c == 0) == list(range(90))  # each component indexed 0, 1, 2, ...


def test_bits_per_byte_counts_bytes_not_tokens(tmp_path):
    data = DataStreams(cfg_for(make_store(tmp_path)))
    assert data.bytes_per_token == 1.0  # byte-level: every target is one byte


def test_loader_errors_name_the_problem(tmp_path):
    path = make_store(tmp_path, n_docs=12)
    with pytest.raises(DataError, match=r"has [\d,]+ tokens: too few for one window of seq_len \+ 1 = 4,097"):
        DataStreams(cfg_for(path, seq_len=4096))
    with pytest.raises(DataError, match="long/short mixing .* 0 long"):
        DataStreams(cfg_for(path, "DataConfig.long_min_tokens=100000"))
    # vocab_size below the tokenizer's is a config error first (hybrid_lm/validate.py); the store
    # checks stand behind it for stores whose content does not match their tokenizer
    with pytest.raises(DataError, match="holds id .* not below the model's vocab_size 100"):
        DataStreams(cfg_for(path, "ModelConfig.vocab_size=100", validate=False))
    mf = json.loads((path / st.MANIFEST).read_text())
    for split in ("train", "val"):
        for s in mf["splits"][split]["shards"]:
            s["max_id"] = 50  # a manifest that lies: caught when windows are read, with shard and offset
    (path / st.MANIFEST).write_text(json.dumps(mf))
    with pytest.raises(DataError, match=r"token id \d+ >= vocab_size 100 in shard val-00000.bin at offset"):
        DataStreams(cfg_for(path, "ModelConfig.vocab_size=100", validate=False))
    with pytest.raises(DataError, match="no token store"):
        DataStreams(cfg_for(tmp_path / "missing"))


def test_bits_per_byte_is_exact_for_sentencepiece_and_bpe(tmp_path):
    """With eval windows tiling the whole val split, bytes per eval token equal the val text's UTF-8
    bytes per token (up to the untiled tail): token bytes are counted, the dummy prefix removed."""
    from tests.test_tokenizers import train_sentencepiece

    from hybrid_lm.data.tokenizer import train_bpe

    sp = tmp_path / "sp.model"
    sp.write_bytes(train_sentencepiece())
    texts = write_jsonl(tmp_path / "a.jsonl", 400)
    bpe = train_bpe(iter(texts), 300, tmp_path / "bpe")
    for tok_path in (sp, bpe):
        out = tmp_path / f"s_{tok_path.stem}"
        res = prepare(SourceSpec(kind="text", paths=(str(tmp_path / "a.jsonl"),)), out,
                      PrepareSettings(tokenizer=str(tok_path)), progress=False)
        val = res.stats["splits"]["val"]
        data = DataStreams(cfg_for(out, f"DataConfig.tokenizer='{tok_path}'", "ModelConfig.vocab_size=512",
                                   "DataConfig.eval_windows=100000", seq_len=16))
        assert len(data._eval_idx) == len(data.val_windows)  # every window: the targets tile the split
        assert data.bytes_per_token == pytest.approx(val["text_bytes"] / val["tokens"], rel=0.01)
        assert data.bytes_per_token > 1.1  # not one byte per token
