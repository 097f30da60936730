"""The S5 preset's 73,448-id vocabulary end to end on the CPU: a byte-level BPE of that size trained
with ``data train-tokenizer``, a uint32 store holding ids above 65,535, and train steps of the S5
preset with its full 73,448-id embedding and head (2 of its 30 layers at width 256 instead of 1,280, so
CI's memory and time suffice: the vocabulary is what this tests; the full width cost ~60 s more).

The essays alone give only ~17K BPE merges, so the corpus adds generated pseudo-words (120K
distinct syllable strings) to reach 73,448 ids: a real tokenizer of the preset's size, on text made
for the purpose."""

import json

import numpy as np
import pytest

from hybrid_lm.cli import main
from hybrid_lm.data.store import TokenStore

VOCAB = 73448


def pseudo_word_corpus(path, n_words=120_000, n_docs=700, seed=0):
    rng = np.random.default_rng(seed)
    syllables = np.array([a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"])
    words = np.array(["".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(n_words)])
    with open(path, "w") as f:  # words as an array: rng.choice on a list converts all 120K each call
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n")


def test_s5_vocabulary_prepares_a_uint32_store_and_trains(tmp_path, capsys):
    corpus = tmp_path / "words.jsonl"
    pseudo_word_corpus(corpus)
    tok_dir = tmp_path / "tok"
    assert main(["data", "train-tokenizer", "--corpus", str(corpus), "--vocab", str(VOCAB), "--out", str(tok_dir),
                 "--no-progress"]) == 0
    assert f"{VOCAB:,} ids (asked {VOCAB:,})" in capsys.readouterr().out
    tj = str(tok_dir / "tokenizer.json")
    assert main(["data", "prepare", "--text", str(corpus), "--tokenizer", tj, "--out", str(tmp_path / "store"),
                 "--no-progress", "--workers", "2"]) == 0
    store = TokenStore(tmp_path / "store")
    assert store.dtype == np.uint32 and store.max_id > 65535
    store.verify()
    rc = main(["train", "configs/scale/s5.gin", "--workdir", str(tmp_path / "run"),
               "--gin_param", "DataConfig.source='tokens'", "--gin_param", f"DataConfig.path='{tmp_path / 'store'}'",
               "--gin_param", f"DataConfig.tokenizer='{tj}'", "--gin_param", "ModelConfig.n_layers=2",
               "--gin_param", "ModelConfig.compute_dtype='float32'", "--gin_param", "DataConfig.seq_len=64",
               "--gin_param", "ModelConfig.d_model=256", "--gin_param", "ModelConfig.n_heads=2",
               "--gin_param", "ModelConfig.d_ff=512",
               "--gin_param", "TrainConfig.global_batch=2", "--gin_param", "TrainConfig.steps=2",
               "--gin_param", "TrainConfig.eval_every=2", "--gin_param", "DataConfig.eval_windows=2",
               "--gin_param", "TrainConfig.progress=False", "--gin_param", "CheckpointConfig.async_save=False",
               "--gin_param", "OptimConfig.warmup_steps=1"])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert evals and np.isfinite(evals[-1]["loss"]) and evals[-1]["loss"] < np.log(VOCAB) + 1
