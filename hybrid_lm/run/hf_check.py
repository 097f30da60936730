"""``hybrid-lm export --format hf --check``: does transformers compute the same logits as hybrid_lm?

The exported folder is loaded by ``transformers.AutoModelForCausalLM.from_pretrained`` (fp32, eager
attention, torch on the CPU unless ``HYBRID_LM_CHECK_TORCH_DEVICE`` names another device); a prompt,
encoded with the run's tokenizer, goes through it and through hybrid_lm's own forward pass (fp32, XLA
attention) on the parameters as exported (rounded to the export's dtype). The result is one line: the
relative error ``max |ours - theirs| / max |theirs|`` over the logits, against a bound (1e-4 by default,
as ``tests/gpu/test_gpu_hf_parity.py``); past the bound the command exits 1.

It needs torch and transformers (the GPU image has torch 2.11 and transformers 5.17; a CPU install may
not): :func:`require` refuses in one line, before anything is exported, where they do not import.
Nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from hybrid_lm.config import Config
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.registry import MixerContext
from hybrid_lm.ops.attention import default_positions
from hybrid_lm.step import ModelFns

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times."
DEFAULT_BOUND = 1e-4


def require() -> None:
    """Raise :class:`ConfigError` (one line) where torch or transformers does not import."""
    missing = []
    for name in ("torch", "transformers"):
        try:
            __import__(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    if missing:
        raise ConfigError(f"--check needs torch and transformers, which do not import here ({'; '.join(missing)}): "
                          "install them (pip install torch transformers), or export without --check and check on a "
                          "machine that has them (the GPU image does)")


def hybrid_lm_logits(model_cfg, params, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits ``[B, T, vocab]`` of hybrid_lm's forward pass (eval mode, XLA attention)."""
    fns = ModelFns(Config(model=dataclasses.replace(model_cfg, compute_dtype="float32", attention_impl="xla")))
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)

    @jax.jit
    def forward(p, t):
        b, n = t.shape
        return fns.model(p)(t, MixerContext(positions=default_positions(b, n), attention_impl="xla", train=False))

    return np.asarray(forward(params, tokens), np.float32)


def transformers_logits(folder: Path, tokens: np.ndarray) -> tuple[np.ndarray, str, str]:
    """(fp32 logits, the model class, transformers' version) of the folder through transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing is downloaded
    import torch  # the optional check's own dependencies (not on CPU installs)
    import transformers

    device = os.environ.get("HYBRID_LM_CHECK_TORCH_DEVICE", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager")
    model = model.to(device).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long, device=device)).logits
    return out.float().cpu().numpy(), type(model).__name__, transformers.__version__


def check_export(folder: Path, model_cfg, params, tokenizer, seq_len: int, prompt: str = DEFAULT_PROMPT,
                 bound: float = DEFAULT_BOUND) -> tuple[bool, str]:
    """(within the bound, the line to print) for the exported ``folder`` of ``params`` (host arrays, as
    exported) of ``model_cfg``; ``prompt`` is encoded with ``tokenizer`` and cut to ``seq_len`` tokens."""
    ids = np.asarray(tokenizer.encode(prompt), np.int32)[:seq_len]
    if ids.size == 0:
        raise ConfigError("--check-prompt is empty: give at least one character")
    tokens = ids[None]
    ours = hybrid_lm_logits(model_cfg, params, tokens)
    theirs, arch, version = transformers_logits(folder, tokens)
    if theirs.shape != ours.shape:
        return False, (f"check FAILED: transformers {version} {arch} gives logits of shape {list(theirs.shape)}, "
                       f"hybrid_lm {list(ours.shape)}")
    err = float(np.max(np.abs(ours.astype(np.float64) - theirs)) / max(float(np.max(np.abs(theirs))), 1e-30))
    ok = err <= bound
    return ok, (f"check transformers {version} {arch} (eager, fp32) against hybrid_lm (xla, fp32) on {ids.size} prompt "
                f"tokens: logits rel err {err:.2e}, bound {bound:.0e}: "
                + ("OK" if ok else "past the bound: transformers does not compute what hybrid_lm does"))
