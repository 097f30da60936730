"""Exceptions shared across layers (no jax import)."""


class ConfigError(ValueError):
    """A config that cannot run; the message says which field and why."""
