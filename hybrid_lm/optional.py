"""Lazy imports of optional packages, with the install line in the error."""

from __future__ import annotations

import importlib

_EXTRAS = {
    "tensorboardX": "tb",
    "wandb": "wandb",
    "tensorflow_datasets": "tfds",
    "tokenizers": "tokenizers",
    "sentencepiece": "sentencepiece",
    "pyarrow": "parquet",
    "datasets": "datasets",
    "sklearn": "eval",
    "safetensors": "eval",
    "lm_eval": "lm_eval",
}


def optional_import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = _EXTRAS.get(module)
        hint = f"pip install -e '.[{extra}]'" if extra else f"pip install {module}"
        raise ImportError(f"{module} is needed for this feature but is not installed ({e}); run: {hint}") from None
