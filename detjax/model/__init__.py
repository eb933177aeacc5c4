"""The hybrid Mamba2 / attention / MoE language model.

Dimension legend for tensor names and einsum strings:
  B batch      L length (query)   S length (key)     D model width     V vocab
  H heads      K kv heads         G queries per kv   Q head dim        F ffn width
  E experts    X top-k slot       T tokens (B*L)     N ssm state       P ssm head dim
  I ssm inner (expand*D)          C chunks           W conv width      M mixer in-proj width
"""

from detjax.model.lm import HybridLM

__all__ = ["HybridLM"]
