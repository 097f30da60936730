"""Pallas GPU kernels for hybrid_lm (import name ``hybrid_lm_kernels``; never imports hybrid_lm).

- `windowed_attention`: SWA / permuted (SA) windowed attention with a position-id mask, forward and
  backward (custom VJP), Pallas with the Triton lowering; ``interpret=True`` runs it on the CPU.
- `block_sparse_attention`: MoBA block-sparse causal attention over selected key blocks (per query
  token or per query block), forward and backward, same backend.
"""

from .block_sparse_pallas import SparseBlockSizes, block_sparse_attention
from .windowed_pallas import BlockSizes, default_block_sizes, windowed_attention

__all__ = ["BlockSizes", "SparseBlockSizes", "block_sparse_attention", "default_block_sizes",
           "windowed_attention"]
