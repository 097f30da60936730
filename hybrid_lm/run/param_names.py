"""Flat parameter names: ``"blocks.0.mixer.wq"`` for a parameter tree's paths, the names of hybrid_lm's
own export (``run/export.py``) and the keys of the transformers mapping (``run/hf.py``)."""

from __future__ import annotations

import jax


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", k)))


def param_name(path) -> str:
    """``"blocks.0.mixer.wq"`` of a parameter's tree path (the export's and the HF mapping's names)."""
    return ".".join(_key(k) for k in path)


def flatten_params(tree) -> dict:
    """``{"blocks.0.mixer.wq": leaf, ...}`` of a nested parameter tree (NNX pure dict); a dict already
    flat under these names comes back as it is."""
    return {param_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def unflatten_params(flat: dict) -> dict:
    """The nested tree of :func:`flatten_params`'s names (all-digit parts are list indices, as ints)."""
    tree: dict = {}
    for name, leaf in flat.items():
        node = tree
        *parents, last = [int(p) if p.isdigit() else p for p in name.split(".")]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree
