"""Exceptions shared across layers (no jax import)."""


class ConfigError(ValueError):
    """A config that cannot run; the message says which field and why."""


class WorkdirError(RuntimeError):
    """A run directory that cannot be used as asked (locked by another trainer, nothing restores, a
    checkpoint that cannot be saved); the message names the path and what to do."""


class DataError(ValueError):
    """Input data that cannot be used (a source, a token store, a tokenizer file); the message names
    the file and the line, shard or offset, and what to do."""
