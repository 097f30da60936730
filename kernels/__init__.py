"""Pallas GPU kernels for hybrid_lm (import name ``hybrid_lm_kernels``; never imports hybrid_lm).

- `windowed_attention`: SWA / permuted (SA) windowed attention with a position-id mask, forward and
  backward (custom VJP), Pallas with the Triton lowering; ``interpret=True`` runs it on the CPU.
"""

from .windowed_triton import BlockSizes, default_block_sizes, windowed_attention

__all__ = ["BlockSizes", "default_block_sizes", "windowed_attention"]
