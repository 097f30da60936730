"""An experiment: a config together with what it is run on, checked and identified.

The layer above the model and the data: it parses a config (``hybrid_lm.config``), checks the model
(``hybrid_lm.validate``) and the tokenizer against it, and gives the run id, which hashes the
experiment-defining fields together with the data's identity (content fingerprints read from disk,
``hybrid_lm.data.identity``). ``config.json`` of a run dir is written from :func:`config_record` (and
read by ``run/directory.py``).

Warnings depend on the purpose: a config loaded to train (``train``, ``sweep``) gets all of them;
``info`` prints the vocabulary note as a line of its report; an eval of a trained run
(``run/swap.py``) gets none about the training setup (warmup, vocabulary), which it cannot change.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from hybrid_lm.config import Config, config_from_dict, experiment_fields, parse_config, run_id_of
from hybrid_lm.data.identity import data_identity
from hybrid_lm.data.tokenizer import VOCAB_MULTIPLE, check_tokenizer, load_tokenizer, padded_vocab
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.registry import get_mixer
from hybrid_lm.validate import PURPOSES, model_warnings, validate_model

log = logging.getLogger(__name__)
_WARNED: set[str] = set()

__all__ = ["check_tokenizer", "config_record", "config_warnings", "diff_experiments", "load_config",
           "run_id", "validate_experiment", "vocab_note"]


def load_config(gin_files: list[str] | tuple[str, ...] = (), gin_params: list[str] | tuple[str, ...] = (),
                validate: bool = True) -> Config:
    """Parse gin files and ``k=v`` bindings into a :class:`Config`, validated (:func:`validate_experiment`)
    unless ``validate=False``. Allocates nothing."""
    cfg = parse_config(gin_files, gin_params)
    if validate:
        validate_experiment(cfg)
    return cfg


def validate_experiment(cfg: Config, purpose: str = "train") -> None:
    """Raise :class:`ConfigError` for a config that cannot run (the model's checks, then the tokenizer
    against ``ModelConfig.vocab_size``); log each warning of ``purpose`` (:func:`config_warnings`)
    once per process."""
    validate_model(cfg)
    check_tokenizer(load_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size)
    for msg in config_warnings(cfg, purpose):
        if msg not in _WARNED:
            _WARNED.add(msg)
            log.warning(msg)


def config_warnings(cfg: Config, purpose: str = "train") -> list[str]:
    """Settings that run but are probably not what was meant. ``purpose``: ``train`` (all), ``info``
    (not the vocabulary note: info prints it), ``eval`` (nothing about the training setup)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r}: one of {PURPOSES}")
    out = model_warnings(cfg, purpose)
    vocab = vocab_note(cfg) if purpose == "train" else None
    if vocab:  # after the optimizer's notes, before the mixers'
        n_optim = sum(w.startswith("OptimConfig.") for w in out)
        out.insert(n_optim, vocab)
    return out


def vocab_note(cfg: Config) -> str | None:
    """The model's embedding rows beyond the tokenizer's vocabulary (rounded up), or None."""
    tok = load_tokenizer(cfg.data.tokenizer)
    v, padded = cfg.model.vocab_size, padded_vocab(tok.vocab_size)
    if v <= padded:
        return None
    rounded = f" (rounded up to a multiple of {VOCAB_MULTIPLE}: {padded})" if padded != tok.vocab_size else ""
    return (f"ModelConfig.vocab_size={v} exceeds the {tok.spec!r} tokenizer's {tok.vocab_size} ids{rounded}: "
            f"{v - tok.vocab_size} embedding rows stand for ids the tokenizer never produces")


# ----------------------------------------------------------------------------- identity

def run_id(cfg: Config) -> str:
    """The run id: the experiment-defining fields and the data's identity (resolved now), hashed."""
    return run_id_of(cfg, data_identity(cfg.data))


def config_record(cfg: Config) -> dict:
    """What ``config.json`` holds: the fields, plus ``data_identity`` (what the data contributes to the
    run id, resolved from the store and tokenizer files now), so that resume compares contents, and
    ``mixer_modules`` when a layer's mixer comes from outside the package (imported again on read)."""
    record = {**cfg.fields_dict(), "data_identity": data_identity(cfg.data)}
    modules = mixer_modules(cfg)
    return {**record, "mixer_modules": modules} if modules else record


def mixer_modules(cfg: Config) -> list[str]:
    """The modules outside ``hybrid_lm`` that register the mixers ``cfg``'s layers use."""
    used = {cfg.model.mixer(t).kind for t in cfg.model.layer_types()}
    return sorted({m for m in (get_mixer(k).cls.__module__ for k in used) if not m.startswith("hybrid_lm.")})


MIXER_MODULES_ENV = "HYBRID_LM_MIXER_MODULES"  # modules a run's config.json may import (comma-separated)


def allowed_mixer_modules() -> set[str]:
    """The mixer modules the user named (``hybrid-lm --mixer-module NAME`` or ``$HYBRID_LM_MIXER_MODULES``)."""
    return {m.strip() for m in os.environ.get(MIXER_MODULES_ENV, "").split(",") if m.strip()}


def allow_mixer_modules(names) -> None:
    """Add ``names`` to ``$HYBRID_LM_MIXER_MODULES`` (inherited by the processes this one starts)."""
    os.environ[MIXER_MODULES_ENV] = ",".join(sorted(allowed_mixer_modules() | set(names)))


def import_mixer_modules(modules, where: str) -> None:
    """Import the mixer modules a run recorded (their ``@register_mixer`` runs); one line if one is gone.

    A run folder may come from anywhere, and importing a module runs its code (``python -m`` imports from
    the current directory first): a module not imported yet (a gin file's ``import`` imports it) is
    imported only when the user named it (:func:`allowed_mixer_modules`), else refused in one line."""
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"{where}: mixer_modules must be a list of module names, not {modules!r}")
    for name in modules:
        if name not in sys.modules and name not in allowed_mixer_modules():
            raise ConfigError(f"{where} uses mixers from module {name!r}; opening a run imports no code it names "
                              f"unless asked: if you trust that module, rerun as `hybrid-lm --mixer-module {name} "
                              f"...` (or set {MIXER_MODULES_ENV}={name})")
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{where} uses mixers from module {name!r}, which does not import ({e}): put it "
                              "on PYTHONPATH (docs/MIXERS.md, 'Adding a mixer')") from None


def _fields(cfg: Config, recorded: dict | None) -> dict:
    return experiment_fields(cfg, data_identity(cfg.data) if recorded is None else recorded)


def diff_experiments(old: dict, new: dict) -> list[str]:
    """Fields (``section.field``) whose experiment-defining values differ between two config dicts."""
    a = _fields(config_from_dict(old), old.get("data_identity"))
    b = _fields(config_from_dict(new), new.get("data_identity"))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
