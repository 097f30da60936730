"""Config checks that need the mixer registry or the tokenizers (the layer above ``hybrid_lm.config``).

:func:`validate_experiment` runs before anything is allocated: ``load_config`` calls it (unless
``validate=False``), and so does every command that builds a model from a config.
"""

from __future__ import annotations

import dataclasses
import logging

from hybrid_lm.config import Config, MixerConfig, check_config
from hybrid_lm.data.tokenizer import get_tokenizer
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.registry import MIXER_FIELDS, get_mixer

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def validate_experiment(cfg: Config) -> None:
    """Raise :class:`ConfigError` for a config that cannot run; log each warning once per process."""
    check_config(cfg)
    m = cfg.model
    for slot, mc in (("full", m.full), ("efficient", m.efficient)):
        get_mixer(mc.kind).check_config(mc, slot)  # unknown kind, unread field or bad options
    tok = get_tokenizer(cfg.data.tokenizer)
    if m.vocab_size < tok.vocab_size:
        raise ConfigError(f"vocab_size={m.vocab_size} is smaller than the {cfg.data.tokenizer!r} "
                          f"tokenizer's {tok.vocab_size}")
    for msg in config_warnings(cfg):
        if msg not in _WARNED:
            _WARNED.add(msg)
            log.warning(msg)


def config_warnings(cfg: Config) -> list[str]:
    """Settings that run but are probably not what was meant."""
    out = []
    o, t, T = cfg.optim, cfg.train, cfg.data.seq_len
    if o.warmup_steps > t.steps:
        out.append(f"OptimConfig.warmup_steps={o.warmup_steps} exceeds TrainConfig.steps={t.steps}: "
                   "the learning rate never reaches OptimConfig.lr")
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
