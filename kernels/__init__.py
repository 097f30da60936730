"""Pallas GPU kernels for hybrid_lm (import name ``hybrid_lm_kernels``; never imports hybrid_lm).

- `windowed_attention`: SWA / permuted (SA) windowed attention with a position-id mask, forward and
  backward (custom VJP), Pallas with the Triton lowering; ``interpret=True`` runs it on the CPU.
- `block_sparse_attention`: MoBA block-sparse causal attention over selected key blocks (per query
  token or per query block), forward and backward, same backend.
- `gather_sparse_attention`: the same attention for per-token selections shared by a GQA group
  (SSA / NSA), one program per token and KV head over only that token's blocks, same backend.
- `softmax_xent_rows`: the chunked loss's softmax pass over rows of logits (log-sum-exp, target logit
  and the gradient, the logits read twice), same backend.
- `short_conv_bwd`: the backward of a short causal depthwise conv (+ SiLU) in one pass (x and dy read
  once for dx and the weight / bias sums), same backend.
- `select_blocks_split`: MoBA / SSA per-token block selection in two kernels, `block_importance` (the
  gate's scores; the ssa gate's per-head scores never reach HBM) and `top_k_blocks` (each row's top-k),
  same backend.
"""

from .block_sparse_pallas import SparseBlockSizes, block_sparse_attention
from .cross_entropy_pallas import softmax_xent_rows
from .gather_sparse_pallas import gather_sparse_attention
from .selection_pallas import SelectionBlockSizes, block_importance, select_blocks_split, top_k_blocks
from .short_conv_pallas import short_conv_bwd
from .windowed_pallas import BlockSizes, default_block_sizes, windowed_attention

__all__ = ["BlockSizes", "SelectionBlockSizes", "SparseBlockSizes", "block_importance", "block_sparse_attention",
           "default_block_sizes", "gather_sparse_attention", "select_blocks_split", "short_conv_bwd",
           "softmax_xent_rows", "top_k_blocks", "windowed_attention"]
