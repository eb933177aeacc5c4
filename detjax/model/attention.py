"""Causal grouped-query attention with RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.model.fp8 import scale_var
from detjax.model.layers import chunk_products, normal_init, param, proj, proj_many
from detjax.pallas_kernels.flash_attention.ops import flash_attention, flash_fits, resolve_backend
from detjax.pallas_kernels.flash_attention.reference import attention_reference
from detjax.pallas_kernels.rope import ops as rope_ops
from detjax.pallas_kernels.rope.reference import rope
from detjax.sharding import rules as ax
from detjax.sharding import tensor as tp_ops
from detjax.sharding.rules import constrain
from detjax.sharding.tensor import TensorSplit


class Attention(nn.Module):
    """Causal GQA with RoPE. `impl` is the one switch: "reference" (jnp), "xla" / "cudnn"
    (jax.nn.dot_product_attention with that implementation; refused in strict mode) or "pallas" (the
    fixed-order flash attention kernel, and the Pallas matmul for the projections)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    init_std: float
    dtype: jnp.dtype
    impl: str = "reference"
    layout: ax.Layout | None = None
    fp8: bool = False  # model.fp8.enabled: the projections in fp8 with delayed scaling
    tp: TensorSplit | None = None  # canonical tensor parallelism: heads in fixed chunks (q/k/v column, o row)
    out_f32: bool = False  # may return the result widened to float32 (layers.proj's out_f32; the same values)
    flash_backend: str = "auto"  # model.flash_backend: which fixed-order flash attention "pallas" runs

    def _backend(self, length: int) -> str:
        return resolve_backend(self.flash_backend, length, self.head_dim, self.dtype)

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        init = normal_init(self.init_std)
        d, h, k, q, tp = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.tp
        w_q_DHQ = param(self, "w_q", init, (d, h, q), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), tp)
        w_k_DKQ = param(self, "w_k", init, (d, k, q), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), tp)
        w_v_DKQ = param(self, "w_v", init, (d, k, q), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), tp)
        w_o_HQD = param(self, "w_o", init, (h, q, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), tp)
        if tp is not None:
            # one loop body per head chunk (query heads c H/M.. and their kv heads c K/M..; K divisible by M):
            # projections, attention and the output product's partial, added over chunks by the chunk tree
            dtype, theta = self.dtype, self.rope_theta
            kernels = "pallas" if self.impl == "pallas" else "reference"
            backend = self._backend(x_BLD.shape[1])
            flash = self.impl == "pallas" and flash_fits(x_BLD.shape[1], q, backend)

            n = tp.local
            scales = [tp_ops.max_copies(tp, scale_var(self, nm, True), n) for nm in ("qkv", "o") if self.fp8]

            def chunk(x_BLD, w_q_DHQ, w_k_DKQ, w_v_DKQ, w_o_HQD, *s):
                s_qkv, s_o = s or (None, None)
                specs = ["bld,dhq->blhq", "bld,dkq->blkq", "bld,dkq->blkq"]
                q_BLHQ, k_BLKQ, v_BLKQ = (
                    y.astype(dtype)
                    for y in chunk_products(specs, dtype, kernels, x_BLD, [w_q_DHQ, w_k_DKQ, w_v_DKQ], s_qkv)
                )
                q_BLHQ, k_BLKQ = rope(q_BLHQ, theta), rope(k_BLKQ, theta)
                if flash:
                    o_BLHQ = flash_attention(q_BLHQ, k_BLKQ, v_BLKQ, backend)
                else:
                    o_BLHQ = attention_reference(q_BLHQ, k_BLKQ, v_BLKQ)
                return chunk_products(["blhq,hqd->bld"], dtype, kernels, o_BLHQ, [w_o_HQD], s_o)[0]

            w_c = [tp_ops.chunked(w, 1, n) for w in (w_q_DHQ, w_k_DKQ, w_v_DKQ)] + [tp_ops.chunked(w_o_HQD, 0, n)]
            parts = tp_ops.per_chunk(chunk, tp_ops.fanout(tp, x_BLD), *w_c, *scales)
            return tp_ops.combine_piece(tp, parts).astype(dtype)
        kernels = "pallas" if self.impl == "pallas" else "reference"  # the projections' matmul
        lay, q_names, kv_names = (
            self.layout,
            (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, None),
            (ax.BATCH, ax.LENGTH, ax.ACT_KV_HEADS, None),
        )
        bsz, length = x_BLD.shape[:2]
        # with the Pallas kernels, RoPE's backward runs in one kernel with the q/k/v product's gradient (rope_ops)
        fused_rope = kernels == "pallas" and rope_ops.fits(bsz * length, length, h, k, q)
        q_BLHQ, k_BLKQ, v_BLKQ = proj_many(
            ["bld,dhq->blhq", "bld,dkq->blkq", "bld,dkq->blkq"],
            x_BLD,
            [w_q_DHQ, w_k_DKQ, w_v_DKQ],
            self.dtype,
            kernels,
            scale_var(self, "qkv", self.fp8),
            (self, ("w_q", "w_k", "w_v")),
            ((bsz, length, h, k, q), self.rope_theta) if fused_rope else None,
        )
        if not fused_rope:
            q_BLHQ, k_BLKQ = rope(q_BLHQ, self.rope_theta), rope(k_BLKQ, self.rope_theta)
        q_BLHQ = constrain(q_BLHQ, lay, q_names, "attn_q")
        k_BLKQ = constrain(k_BLKQ, lay, kv_names, "attn_k")
        v_BLKQ = constrain(v_BLKQ, lay, kv_names)
        backend = self._backend(x_BLD.shape[1])
        if self.impl in ("xla", "cudnn"):
            o_BLHQ = jax.nn.dot_product_attention(q_BLHQ, k_BLKQ, v_BLKQ, is_causal=True, implementation=self.impl)
        elif self.impl == "pallas" and flash_fits(x_BLD.shape[1], q, backend):  # (MTP: L-1 rows)
            o_BLHQ = flash_attention(q_BLHQ, k_BLKQ, v_BLKQ, backend)
        else:
            o_BLHQ = attention_reference(q_BLHQ, k_BLKQ, v_BLKQ)
        o_BLHQ = constrain(o_BLHQ, lay, q_names, "attn_out")
        o_fp8 = scale_var(self, "o", self.fp8)
        return proj("blhq,hqd->bld", o_BLHQ, w_o_HQD, self.dtype, kernels, o_fp8, (self, ("w_o",)), self.out_f32)
