"""The hybrid Mamba2 / attention / MoE language model.

Dimension legend for tensor names and einsum strings:
  B batch      L length (query)   S length (key)     D model width     V vocab
  H heads      K kv heads         G queries per kv   Q head dim        F ffn width
  E experts    X top-k slot       T tokens (B*L)     N ssm state       P ssm head dim
  I ssm inner (expand*D)          C chunks           W conv width      M mixer in-proj width
  R (token, slot) rows (T*X)      Z chunk boundaries (C+1, SSD recurrence)
  J the B/C pair of the Mamba2 in-projection (2)
Each letter means one thing in model and sharding code. Kernel code (detjax/pallas_kernels) uses GEMM
letters instead: M rows, K contraction, N output columns, R reduction rows.

The stack is detjax.model.lm.HybridLM. This package file imports nothing, so that
detjax.sharding.expert can import detjax.model.dispatch without loading the model (no import cycle).
"""
