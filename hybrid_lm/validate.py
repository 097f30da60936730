"""Config checks that need the mixer registry or the tokenizers (the layer above ``hybrid_lm.config``).

:func:`validate_experiment` runs before anything is allocated: ``load_config`` calls it (unless
``validate=False``), and so does every command that builds a model from a config. Its warnings
depend on the purpose: a config loaded to train (``train``, ``sweep``) gets all of them; ``info``
prints the vocabulary note as a line of its report; an eval of a trained run (``eval/swap.py``)
gets none about the training setup (warmup, vocabulary), which it cannot change.
"""

from __future__ import annotations

import dataclasses
import logging

from hybrid_lm.config import Config, MixerConfig, check_config, wsd_bounds
from hybrid_lm.data.tokenizer import Tokenizer, load_tokenizer
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.registry import MIXER_FIELDS, get_mixer

log = logging.getLogger(__name__)
_WARNED: set[str] = set()
VOCAB_MULTIPLE = 128  # a model vocab up to the tokenizer's rounded up to this is not warned about
PURPOSES = ("train", "info", "eval")


def validate_experiment(cfg: Config, purpose: str = "train") -> None:
    """Raise :class:`ConfigError` for a config that cannot run; log each warning of ``purpose``
    (:func:`config_warnings`) once per process."""
    check_config(cfg)
    m = cfg.model
    for slot, mc in (("full", m.full), ("efficient", m.efficient)):
        get_mixer(mc.kind).check_config(mc, slot)  # unknown kind, unread field or bad options
    if cfg.data.document_mask:  # every layer must mask documents (one-line refusal otherwise)
        from hybrid_lm.backends import check_document_mask
        check_document_mask(m, cfg.data.seq_len)
    check_tokenizer(load_tokenizer(cfg.data.tokenizer), m.vocab_size)
    for msg in config_warnings(cfg, purpose):
        if msg not in _WARNED:
            _WARNED.add(msg)
            log.warning(msg)


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (the usual embedding-table size)."""
    return -(-vocab_size // multiple) * multiple


def check_tokenizer(tok: Tokenizer, model_vocab: int) -> None:
    """Raise :class:`ConfigError` unless every id ``tok`` produces (its special ids included) has a
    row in a ``model_vocab`` embedding table."""
    if model_vocab < tok.vocab_size:
        raise ConfigError(f"ModelConfig.vocab_size={model_vocab} is smaller than the {tok.spec!r} tokenizer's "
                          f"{tok.vocab_size}: set ModelConfig.vocab_size to at least {tok.vocab_size} "
                          f"(e.g. {padded_vocab(tok.vocab_size)}, a multiple of {VOCAB_MULTIPLE})")
    for role in ("eos", "bos", "pad"):
        i = getattr(tok, f"{role}_id")
        if i is not None and not 0 <= i < model_vocab:
            raise ConfigError(f"the {tok.spec!r} tokenizer's {role} id {i} is not below "
                              f"ModelConfig.vocab_size={model_vocab}: raise ModelConfig.vocab_size above {i}")


def vocab_note(cfg: Config) -> str | None:
    """The model's embedding rows beyond the tokenizer's vocabulary (rounded up), or None."""
    tok = load_tokenizer(cfg.data.tokenizer)
    v, padded = cfg.model.vocab_size, padded_vocab(tok.vocab_size)
    if v <= padded:
        return None
    rounded = f" (rounded up to a multiple of {VOCAB_MULTIPLE}: {padded})" if padded != tok.vocab_size else ""
    return (f"ModelConfig.vocab_size={v} exceeds the {tok.spec!r} tokenizer's {tok.vocab_size} ids{rounded}: "
            f"{v - tok.vocab_size} embedding rows stand for ids the tokenizer never produces")


def config_warnings(cfg: Config, purpose: str = "train") -> list[str]:
    """Settings that run but are probably not what was meant. ``purpose``: ``train`` (all), ``info``
    (not the vocabulary note: info prints it), ``eval`` (nothing about the training setup)."""
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
    vocab = vocab_note(cfg) if purpose == "train" else None
    if vocab:
        out.append(vocab)
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
