"""The micro-batch rule (hybrid_lm/train/microbatch.py)."""

import json

import pytest

from hybrid_lm.config import load_config
from hybrid_lm.train import microbatch as mb


@pytest.mark.parametrize("global_batch,per_device,shards,want", [
    (16, 16, 1, 1),   # fits in one micro-batch
    (16, 4, 1, 4),
    (16, 3, 1, 8),    # 16/4 = 4 > 3 sequences: the next divisor, 8 micro-batches of 2
    (64, 2, 8, 4),    # 8 devices x 2 sequences = 16 per micro-batch
    (24, 1, 8, 3),    # one sequence per device
    (12, 5, 2, 2),    # micro 6 = 3 per device <= 5
])
def test_fewest_microbatches_that_fit(global_batch, per_device, shards, want):
    M = mb.microbatches_for(global_batch, per_device, shards)
    assert M == want
    micro = global_batch // M
    assert global_batch % M == 0 and micro % shards == 0 and micro <= per_device * shards
    # no smaller M satisfies the rule
    assert not any(global_batch % m == 0 and (global_batch // m) % shards == 0
                   and global_batch // m <= per_device * shards for m in range(1, M))


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="not divisible by the 8 batch shards"):
        mb.microbatches_for(12, 2, 8)
    with pytest.raises(ValueError, match=">= 1"):
        mb.microbatches_for(8, 0, 1)


def test_rule_reads_the_measured_table(tmp_path):
    table = tmp_path / "mb.json"
    table.write_text(json.dumps({"best": {"s1/swa/16384": 4, "s1/full/16384": 8}}))
    cfg = load_config(["scale/s1.gin"], ["DataConfig.seq_len = 16384", "TrainConfig.global_batch = 32"])
    assert (mb.scale_name(cfg.model), mb.arch_name(cfg.model)) == ("s1", "swa")
    M, why = mb.rule_for(cfg, batch_shards=2, table=table)
    assert M == 4 and "measured best 4" in why  # 32 / 4 = 8 sequences = 4 per device on 2 devices
    full = load_config(["scale/s1.gin"], ["DataConfig.seq_len = 16384", "TrainConfig.global_batch = 32",
                                          "ModelConfig.layer_pattern = 'F'"])
    assert mb.rule_for(full, batch_shards=1, table=table)[0] == 4
    other = load_config(["scale/s1.gin"], ["DataConfig.seq_len = 8192"])
    assert mb.rule_for(other, 1, table=table) == (other.train.microbatches,
                                                  "not measured: TrainConfig.microbatches as configured")
    assert mb.arch_name(load_config(["scale/s1.gin", "arch/ssa.gin"]).model) == "ssa"
    assert mb.arch_name(load_config(["scale/s1.gin", "arch/mamba2.gin"]).model) == "mamba2"
