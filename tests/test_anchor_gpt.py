"""The benchmark anchor (experiments/anchor_gpt.py): a plain-JAX GPT that trains, with FLOPs counted
as bench_train counts them."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import anchor_gpt  # noqa: E402


def test_anchor_trains_and_counts_flops():
    row = anchor_gpt.main(["--tiny"])
    # a fixed random batch is memorised: after warm-up + 2 AdamW steps the loss is below log(vocab)
    assert math.isfinite(row["final_loss"]) and row["final_loss"] < math.log(256)
    assert row["ms_step"] > 0 and 0 < row["mfu"] < 1
    # 2 layers x 12 d^2 + the head, times 6, plus causal attention 6 L T d
    assert anchor_gpt.flops_per_token(layers=2, d=64, vocab=256, seq_len=128) == 6 * (2 * 12 * 64 * 64 + 64 * 256) \
        + 6 * 2 * 128 * 64
    # per block 12 d^2 + two norm gains, the final norm, the untied head
    assert row["params_non_embedding"] == 2 * (12 * 64 * 64 + 2 * 64) + 64 + 64 * 256
