"""Parameter counts and FLOPs per token, per layer type, from the config alone (nothing allocated).

Conventions (as MaxText): FLOPs count 2 per multiply-add; training FLOPs = 3 x forward.
"Non-embedding" parameters are everything but the token embedding and the LM head.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from hybrid_lm.config import ModelConfig
from hybrid_lm.model.registry import get_mixer
from hybrid_lm.model.transformer import HybridLM

PEAK_FLOPS_H200_BF16 = 989e12  # dense bf16 spec, the MFU denominator


def attention_mixing_flops(cfg: ModelConfig, keys_per_query: float) -> float:
    """Softmax attention over ``keys_per_query`` keys: QK^T and PV, 2 FLOPs per MAC, per head and key.

    The one home of this term: every attention mixer's ``flops`` function calls it."""
    return 4.0 * cfg.n_heads * cfg.resolved_head_dim * keys_per_query


def abstract_params(cfg: ModelConfig):
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def count_params(cfg: ModelConfig) -> dict:
    """Counts: total, embedding, head, non_embedding, per layer type (mixer / mlp / norms)."""
    tree = abstract_params(cfg)
    types = cfg.layer_types()
    out = defaultdict(int)
    per_type = defaultdict(lambda: defaultdict(int))
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        n = int(np.prod(leaf.shape))
        out["total"] += n
        if keys[0] == "embed":
            out["embedding"] += n
        elif keys[0] == "lm_head":
            out["head"] += n
        else:
            out["non_embedding"] += n
            if keys[0] == "blocks":
                t = types[int(keys[1])]
                part = {"mixer": "mixer", "mlp": "mlp"}.get(keys[2], "norms")
                kind = cfg.mixer(t).kind
                per_type[f"{t}:{kind}"][part] += n
                per_type[f"{t}:{kind}"]["layers"] += 0
            else:
                out["final_norm"] += n
    for t in types:
        per_type[f"{t}:{cfg.mixer(t).kind}"]["layers"] += 1
    out["per_layer_type"] = {k: dict(v) for k, v in per_type.items()}
    return dict(out)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Forward FLOPs per token, per layer type, plus head; ``train`` = 3 x forward total."""
    mlp = 2.0 * 3 * cfg.d_model * cfg.d_ff
    per_type: dict[str, dict] = {}
    total = 0.0
    for t in cfg.layer_types():
        mc = cfg.mixer(t)
        key = f"{t}:{mc.kind}"
        if key not in per_type:
            f = get_mixer(mc.kind).flops(cfg, mc, seq_len)
            per_type[key] = {"layers": 0, "mixer_matmul": f["matmul"], "mixing": f["mixing"], "mlp": mlp,
                             "per_layer": f["matmul"] + f["mixing"] + mlp}
        per_type[key]["layers"] += 1
        total += per_type[key]["per_layer"]
    head = 2.0 * cfg.d_model * cfg.vocab_size
    total += head
    return {"per_layer_type": per_type, "head": head, "forward": total, "train": 3.0 * total}


def mfu(tokens_per_sec: float, train_flops_per_token: float, n_devices: int,
        peak: float = PEAK_FLOPS_H200_BF16) -> float:
    return tokens_per_sec * train_flops_per_token / (peak * n_devices)
