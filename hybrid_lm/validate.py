"""Config checks that need the mixer registry (the layer above ``hybrid_lm.model``).

:func:`validate_model` checks what the model can run: each slot's mixer (kind, the fields it reads,
its options) and document masking. :func:`model_warnings` lists settings that run but are probably
not what was meant. ``hybrid_lm.experiment`` adds the tokenizer's checks and runs both before
anything is allocated (``load_config``).
"""

from __future__ import annotations

import dataclasses

from hybrid_lm.config import Config, MixerConfig, check_config, wsd_bounds
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.attention import Attention
from hybrid_lm.model.registry import MIXER_FIELDS, check_document_mask, get_mixer

PURPOSES = ("train", "info", "eval")


def validate_model(cfg: Config) -> None:
    """Raise a one-line :class:`ConfigError` for a config whose model cannot run: the config's own
    checks, each slot's mixer (unknown kind, unread field, bad options) and document masking."""
    check_config(cfg)
    m = cfg.model
    for slot, mc in (("full", m.full), ("efficient", m.efficient)):
        get_mixer(mc.kind).check_config(mc, slot)
    if m.qk_norm:
        check_qk_norm(m)
    if cfg.data.document_mask:  # every layer must mask documents (one-line refusal otherwise)
        check_document_mask(m, cfg.data.seq_len)


def check_qk_norm(m) -> None:
    """``ModelConfig.qk_norm`` normalises the q and k of softmax attention (``model.attention.Attention``
    and the mixers built on it); a layer whose mixer has no such q and k refuses it in one line."""
    for t in dict.fromkeys(m.layer_types()):
        slot = {"F": "full", "E": "efficient"}[t]
        kind = m.mixer(t).kind
        if not issubclass(get_mixer(kind).cls, Attention):
            raise ConfigError(f"ModelConfig.qk_norm=True: {slot}/MixerConfig.kind={kind!r} has no softmax-attention "
                              "q and k to normalise (the attention mixers take it: attention, swa, sa, sa_swa, "
                              "moba, ssa, attention_sink)")


def model_warnings(cfg: Config, purpose: str = "train") -> list[str]:
    """Settings that run but are probably not what was meant (the tokenizer's are added by
    ``hybrid_lm.experiment.config_warnings``). ``purpose``: ``eval`` leaves out the training setup."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r}: one of {PURPOSES}")
    out = []
    o, t, T = cfg.optim, cfg.train, cfg.data.seq_len
    decay_start = wsd_bounds(o, t.steps)[0]
    if purpose != "eval" and o.warmup_steps > t.steps:
        out.append(f"OptimConfig.warmup_steps={o.warmup_steps} exceeds TrainConfig.steps={t.steps}: "
                   "the learning rate never reaches OptimConfig.lr")
    elif purpose != "eval" and o.warmup_steps > decay_start + 1:  # the peak would be at step warmup_steps - 1
        out.append(f"OptimConfig.warmup_steps={o.warmup_steps}: warmup ends at step {o.warmup_steps}, after the "
                   f"decay starts at step {decay_start} (the last OptimConfig.decay_fraction={o.decay_fraction} of "
                   f"TrainConfig.steps={t.steps}): the learning rate never reaches OptimConfig.lr")
    used = set(cfg.model.layer_types())
    for slot, letter in (("full", "F"), ("efficient", "E")):
        mc = cfg.model.mixer(letter)
        if letter not in used:
            continue
        spec = get_mixer(mc.kind)
        if "window" in spec.reads and mc.window is not None and mc.window >= T:
            out.append(f"{slot}/MixerConfig.window={mc.window} >= DataConfig.seq_len: mixer {mc.kind!r} "
                       f"sees every key at seq_len={T}")
        opts = spec.parse_options(mc)
        block, top_k = getattr(opts, "block_size", None), getattr(opts, "top_k", None)
        if block and top_k and block * top_k >= T:
            out.append(f"{slot}/MixerConfig.options block_size*top_k={block}*{top_k}={block * top_k} >= "
                       f"DataConfig.seq_len: mixer {mc.kind!r} sees every key at seq_len={T}")
    return out


def read_fields_only(cfg: Config) -> Config:
    """``cfg`` with every mixer field its mixer does not read reset to the ``MixerConfig`` default
    (how configs written before mixers declared their fields are migrated)."""
    blank = MixerConfig()

    def clean(mc: MixerConfig) -> MixerConfig:
        reads = get_mixer(mc.kind).reads
        return dataclasses.replace(mc, **{f: getattr(blank, f) for f in MIXER_FIELDS if f not in reads})

    model = dataclasses.replace(cfg.model, full=clean(cfg.model.full), efficient=clean(cfg.model.efficient))
    return dataclasses.replace(cfg, model=model)
