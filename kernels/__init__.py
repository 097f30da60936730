"""Pallas GPU kernels for hybrid_lm (import name ``hybrid_lm_kernels``; never imports hybrid_lm).

- `windowed_attention`: SWA / permuted (SA) windowed attention with a position-id mask, forward and
  backward (custom VJP), Pallas with the Triton lowering; ``interpret=True`` runs it on the CPU.
- `block_sparse_attention`: MoBA block-sparse causal attention over selected key blocks (per query
  token or per query block), forward and backward, same backend.
- `gather_sparse_attention`: the same attention for per-token selections shared by a GQA group
  (SSA / NSA), one program per token and KV head over only that token's blocks, same backend;
  `gather_decode_attention` is its one-query decoding step over a KV cache (forward only).
- `softmax_xent_rows`: the chunked loss's softmax pass over rows of logits (log-sum-exp, target logit
  and the gradient, the logits read twice), same backend.
- `rms_norm_fwd`, `rms_norm_bwd`: RMSNorm's forward and backward, each one pass over the rows (the
  backward reads x and dy once for dx and the scale's gradient), same backend.
- `gated_rms_norm_fwd`, `gated_rms_norm_bwd`: Gated DeltaNet's output norm (norm, scale, then the SiLU
  gate), each one pass over head rows read from the linear-attention kernel's padded width, same backend.
- `short_conv_bwd`: the backward of a short causal depthwise conv (+ SiLU) in one pass (x and dy read
  once for dx and the weight / bias sums), same backend.
- `select_blocks`: MoBA / SSA per-token block selection (gate scores + running top-k fused in one
  kernel; the score matrix never reaches HBM), same backend; `select_blocks_split` does it in two
  kernels, `block_importance` (the gate) and `top_k_blocks` (the top-k of each row).
"""

from .block_sparse_pallas import SparseBlockSizes, block_sparse_attention
from .cross_entropy_pallas import softmax_xent_rows
from .gated_norm_pallas import gated_rms_norm_bwd, gated_rms_norm_fwd
from .gather_sparse_pallas import decode_kernel_reason, gather_decode_attention, gather_sparse_attention
from .rms_norm_pallas import rms_norm_bwd, rms_norm_fwd
from .selection_pallas import (SelectionBlockSizes, block_importance, select_blocks, select_blocks_split,
                               top_k_blocks)
from .short_conv_pallas import short_conv_bwd
from .windowed_pallas import BlockSizes, default_block_sizes, windowed_attention

__all__ = ["BlockSizes", "SelectionBlockSizes", "SparseBlockSizes", "block_importance", "block_sparse_attention",
           "decode_kernel_reason", "default_block_sizes", "gated_rms_norm_bwd", "gated_rms_norm_fwd", "gather_decode_attention", "gather_sparse_attention",
           "rms_norm_bwd", "rms_norm_fwd", "select_blocks",
           "select_blocks_split", "short_conv_bwd", "softmax_xent_rows", "top_k_blocks", "windowed_attention"]
