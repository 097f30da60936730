"""A run: its directory (config.json, checkpoints, metrics files) and what is restored from it.

``directory.py`` names each file of a run directory and is the one reader of its config.json and of
its checkpoint steps; ``checkpoint.py`` saves and restores through orbax's ``CheckpointManager``;
``metrics.py`` writes and reads ``metrics.jsonl``; ``restore.py`` restores a run (or a Hugging Face
folder, ``hf.py``) for inference; ``swap.py`` rewrites its config with attention swaps; ``loss.py`` is
the eval loss the trainer and ``hybrid-lm eval`` share; ``export.py`` writes its parameters out.
"""
