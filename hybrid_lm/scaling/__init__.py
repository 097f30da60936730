"""Scaling sweeps and L(N, D) fits (docs/SCALING.md).

``sweep`` (spec -> jobs, WSD branching, cost), ``launch`` (local / GPU pool / SLURM, idempotent),
``collect`` (run dirs -> table), ``table`` (CSV/JSONL), ``fit`` (no JAX), ``report``, ``cli``.
"""
