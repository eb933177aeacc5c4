"""The hybrid stack: a pattern string of pre-norm residual blocks, LM head and MTP head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.config import ModelConfig
from detjax.model.attention import Attention
from detjax.model.ce import TokenCE, token_ce_of
from detjax.model.fp8 import fp8_head_ce, fused_head_ce, scale_var
from detjax.model.layers import DTYPES, MLP, Embed, RMSNorm, copy_of, normal_init, param, proj
from detjax.model.mamba2 import Mamba2
from detjax.model.moe import MoE
from detjax.sharding import rules as ax
from detjax.sharding import tensor as tp_ops
from detjax.sharding.expert import ExpertSplit
from detjax.sharding.rules import constrain
from detjax.sharding.tensor import TensorSplit


class Block(nn.Module):
    """Pre-norm residual block; `letter` picks the mixer (M, *, E, -). Returns (h, aux loss).

    With sequence parallelism (`tp.sequence`) `h` is this device's piece of the sequence: the block gathers
    the whole sequence, runs as without it and returns its own piece (detjax.sharding.tensor).

    Dropout takes an explicit key (the model derives one per layer index), so a block's mask does not
    depend on where the block sits in the module tree — a pipeline stage applying it alone draws the same.
    """

    cfg: ModelConfig
    letter: str
    layout: ax.Layout | None = None
    tp: TensorSplit | None = None  # canonical tensor parallelism (detjax.sharding.tensor)
    ep: ExpertSplit | None = None  # canonical expert dispatch (detjax.sharding.expert)

    @nn.compact
    def __call__(self, h_BLD: jax.Array, train: bool, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        c, lay, tp = self.cfg, self.layout, self.tp
        dtype = DTYPES[c.compute_dtype]
        h_BlD = h_BLD  # with sequence parallelism, this device's piece of the stream; else the whole of it
        if tp is not None and tp.sequence:
            h_BLD = tp_ops.gather_sequence(tp, h_BlD)
        norm = RMSNorm(c.norm_eps, c.kernels, dtype, tp is not None, name="norm")
        if tp is None:  # the stream passed through the norm: its backward adds the residual's cotangent
            h_BLD, x_BLD = norm(h_BLD, stream=True)
        else:
            x_BLD = norm(h_BLD)
        x_BLD = constrain(x_BLD, lay, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED), "block_in")
        aux = jnp.zeros((), jnp.float32)
        # the mixer may hand y over in float32 (the same values) where nothing rounds it in the compute dtype
        # before the residual add: with fp8, its last product then takes the stream's float32 gradient
        widen = tp is None and not (train and c.dropout > 0.0)
        if self.letter == "M":
            y_BLD = Mamba2(
                c.d_model, c.mamba, c.init_std, c.norm_eps, dtype, lay, c.kernels, c.fp8.enabled, tp, name="mixer"
            )(x_BLD)
        elif self.letter == "*":
            y_BLD = Attention(
                d_model=c.d_model,
                n_heads=c.n_heads,
                n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim,
                rope_theta=c.rope_theta,
                init_std=c.init_std,
                dtype=dtype,
                impl=c.kernels if c.attention_impl == "reference" else c.attention_impl,
                layout=lay,
                fp8=c.fp8.enabled,
                tp=tp,
                out_f32=widen,
                flash_backend=c.flash_backend,
                name="mixer",
            )(x_BLD)
        elif self.letter == "E":
            moe = MoE(c.d_model, c.moe, c.init_std, dtype, lay, c.kernels, c.fp8.enabled, tp, self.ep, name="mixer")
            y_BLD, aux = moe(x_BLD)
        elif self.letter == "-":
            y_BLD = MLP(
                c.d_model, c.ffn_dim, c.init_std, dtype, lay, c.kernels, c.fp8.enabled, tp, widen, name="mixer"
            )(x_BLD)
        else:
            raise ValueError(f"unknown block letter {self.letter!r}")
        # sequence parallelism: attention, the MLP and Mamba2 end in tensor.combine_piece (a reduce-scatter), so
        # y is already this device's piece of the sequence; the MoE block's y is whole
        piece = tp is not None and tp.sequence and self.letter != "E"
        if train and c.dropout > 0.0:
            if key is None:
                raise ValueError("training with dropout needs a dropout key")
            if piece:
                y_BLD = tp_ops.dropout_piece(tp, c.dropout, key, y_BLD)
            else:
                y_BLD = nn.Dropout(c.dropout, deterministic=False)(y_BLD, rng=key)
        y_BLD = y_BLD.astype(jnp.float32)
        if tp is not None and tp.sequence:
            return h_BlD + (y_BLD if piece else tp_ops.scatter_sequence(tp, y_BLD)), aux
        h_BLD = h_BLD + y_BLD
        return constrain(h_BLD, lay, (ax.BATCH, ax.SEQ, ax.ACT_EMBED), "residual"), aux


def block_class(cfg: ModelConfig) -> type[Block]:
    """Block, or Block under activation checkpointing (`model.remat`: "block" recomputes it in the backward)."""
    if cfg.remat == "block":
        return nn.remat(Block, static_argnums=(2,))  # (self, h, train, key): `train` is static
    return Block


def layer_key(key: jax.Array | None, index: int) -> jax.Array | None:
    """The dropout key of layer `index` (MTP layers follow the main stack's indices)."""
    return None if key is None else jax.random.fold_in(key, index)


class HybridLM(nn.Module):
    """Returns (logits B×L×V, MTP logits B×(L-1)×V or None, summed MoE aux loss). With `tp` (canonical tensor
    parallelism: this device's share of every split dimension) the logits are this device's vocabulary chunks,
    c×B×L×(V/M), for detjax.sharding.tensor.ce_sum. With `ep` (canonical expert dispatch, inside the trainer's
    shard_map) the routed experts' weights are this device's experts, one copy per source device.

    The pieces are also methods so a pipeline can run them apart: `embed_ids` (first stage), the blocks
    (stacked per stage, see detjax.sharding.pipeline), `outputs` (last stage: LM head and MTP head).
    """

    cfg: ModelConfig
    layout: ax.Layout | None = None
    tp: TensorSplit | None = None
    ep: ExpertSplit | None = None

    def setup(self) -> None:
        c, lay, tp, ep = self.cfg, self.layout, self.tp, self.ep
        self.embed = Embed(c.vocab_size, c.d_model, c.init_std, c.kernels, lay, c.embed_grad, tp)
        block = block_class(c)
        self.layers = [block(c, letter, lay, tp, ep, name=f"layer_{i}") for i, letter in enumerate(c.pattern)]
        pinned = tp is not None
        self.final_norm = RMSNorm(c.norm_eps, c.kernels, pinned=pinned)
        self.w_head_DV = param(
            self, "w_head", normal_init(c.init_std), (c.d_model, c.vocab_size), (ax.EMBED, ax.VOCAB), tp
        )
        self.head_fp8 = scale_var(self, "head", c.fp8.enabled and c.fp8.lm_head)
        if c.mtp.depth:
            self.mtp_norm_h = RMSNorm(c.norm_eps, c.kernels, pinned=pinned)
            self.mtp_norm_e = RMSNorm(c.norm_eps, c.kernels, pinned=pinned)
            self.w_mtp_2DD = param(
                self, "w_mtp_proj", normal_init(c.init_std), (2, c.d_model, c.d_model), (None, ax.EMBED, None)
            )
            # the MTP stream (L - 1 positions) stays whole: L - 1 need not split over the tensor degree
            mtp_tp = dataclasses.replace(tp, sequence=False) if tp is not None else None
            self.mtp_layers = [
                block(c, letter, lay, mtp_tp, ep, name=f"mtp_layer_{i}") for i, letter in enumerate(c.mtp.pattern)
            ]
            self.mtp_final_norm = RMSNorm(c.norm_eps, c.kernels, pinned=pinned)
            self.mtp_fp8_h = scale_var(self, "mtp_proj_h", c.fp8.enabled)
            self.mtp_fp8_e = scale_var(self, "mtp_proj_e", c.fp8.enabled)

    def head(
        self, h_BLD: jax.Array, fp8_scale: jax.Array | None = None, targets_BL: jax.Array | None = None
    ) -> jax.Array | TokenCE:
        """Logits of the normed stream; fp8_scale: the head's scale set (model.fp8.lm_head), one use's copy.
        With `targets_BL` (training) under model.kernels=pallas, the per-token loss instead, as TokenCE: from
        the compute-dtype logits (ce.token_ce_of, whose backward writes their gradient in that dtype), or with
        an fp8 head on the Mosaic path (fp8.fused_head_ce) the head and its cross-entropy as one fp8 operation
        (fp8.fp8_head_ce). model.kernels=reference returns the logits widened to float32 and the loss
        differentiates ce.token_ce as plain JAX would; tensor-parallel chunks always return logits (their loss
        is tensor.ce_sum)."""
        dtype = DTYPES[self.cfg.compute_dtype]
        w_DV, kernels = self.w_head_DV, self.cfg.kernels
        if targets_BL is not None and fp8_scale is not None and self.tp is None and fused_head_ce(w_DV, kernels):
            (b, length, d), wq = h_BLD.shape, copy_of((self, ("w_head",)))
            x_MD = h_BLD.astype(dtype).reshape(b * length, d)  # as the unfused product takes it (ops.dense_many)
            ce = fp8_head_ce(x_MD, w_DV, wq, fp8_scale, targets_BL.reshape(-1), dtype, kernels)
            return TokenCE(ce.reshape(b, length))
        if self.tp is not None:  # this device's vocabulary chunks, c x B x L x V/M (rounded as below)
            w_cDV = tp_ops.chunked(self.w_head_DV, 1, self.tp.local)
            kernels = self.cfg.kernels

            def chunk(h_BLD, w_DV):
                return tp_ops.chunk_product("bld,dv->blv", dtype, kernels, h_BLD, w_DV)

            logits_cBLV = tp_ops.per_chunk(chunk, tp_ops.fanout(self.tp, h_BLD), w_cDV)
            return logits_cBLV.astype(dtype).astype(jnp.float32)
        if targets_BL is not None and fp8_scale is None and kernels == "pallas":  # the loss's backward in dtype
            logits_BLV = proj("bld,dv->blv", h_BLD, w_DV, dtype, kernels, None, (self, ("w_head",)))
            logits_BLV = constrain(logits_BLV, self.layout, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB), "logits")
            return TokenCE(token_ce_of(logits_BLV, targets_BL))
        logits_BLV = proj("bld,dv->blv", h_BLD, w_DV, dtype, kernels, fp8_scale, (self, ("w_head",)), out_f32=True)
        return constrain(logits_BLV, self.layout, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB), "logits")

    def embed_ids(self, ids_BL: jax.Array) -> jax.Array:
        return self.embed(ids_BL)

    def outputs(
        self,
        h_BLD: jax.Array,
        ids_BL: jax.Array,
        train: bool = False,
        key: jax.Array | None = None,
        e_BLD: jax.Array | None = None,
        targets_BL: jax.Array | None = None,
    ):
        """Final hidden state -> (logits, MTP logits or None, MTP blocks' aux loss). `e_BLD`: the MTP's
        embedding of ids[:, 1:], computed by the caller (a canonical pipeline's first stage takes its gradient).
        `targets_BL` (ids shifted by one): lets a fused head return TokenCE in place of logits (`head`)."""
        c = self.cfg
        aux = jnp.zeros((), jnp.float32)
        head_scales = [None, None]
        if self.head_fp8 is not None:  # one scale set for both heads: its amaxes the max over the two uses
            head_scales = list(tp_ops.max_copies(TensorSplit(1), self.head_fp8, 2 if c.mtp.depth else 1))
        logits_BLV = self.head(self.final_norm(h_BLD), head_scales[0], targets_BL)
        mtp_logits_BLV = None
        if c.mtp.depth:
            # depth-1 MTP: position t combines h_t with the embedding of token t+1 to predict token t+2
            e_BLD = self.embed(ids_BL[:, 1:]) if e_BLD is None else e_BLD
            hn, en = self.mtp_norm_h(h_BLD[:, :-1]), self.mtp_norm_e(e_BLD)
            dtype = DTYPES[c.compute_dtype]
            m_BLD = (
                proj("bld,de->ble", hn, self.w_mtp_2DD[0], dtype, c.kernels, self.mtp_fp8_h)
                + proj("bld,de->ble", en, self.w_mtp_2DD[1], dtype, c.kernels, self.mtp_fp8_e)
            ).astype(jnp.float32)
            for i, layer in enumerate(self.mtp_layers):
                m_BLD, a = layer(m_BLD, train, layer_key(key, len(c.pattern) + i))
                aux = aux + a
            mtp_targets = None if targets_BL is None else targets_BL[:, 1:]
            mtp_logits_BLV = self.head(self.mtp_final_norm(m_BLD), head_scales[1], mtp_targets)
        return logits_BLV, mtp_logits_BLV, aux

    def __call__(
        self, ids_BL: jax.Array, train: bool = False, key: jax.Array | None = None, targets_BL: jax.Array | None = None
    ):
        h_BLD = self.embed(ids_BL)
        sequence = self.tp is not None and self.tp.sequence
        if sequence:  # the stream between blocks: this device's piece of the sequence
            h_BLD = tp_ops.scatter_sequence(self.tp, h_BLD)
        aux = jnp.zeros((), jnp.float32)
        for i, layer in enumerate(self.layers):
            h_BLD, a = layer(h_BLD, train, layer_key(key, i))
            aux = aux + a
        if sequence:
            h_BLD = tp_ops.gather_sequence(self.tp, h_BLD)
        logits_BLV, mtp_logits_BLV, mtp_aux = self.outputs(h_BLD, ids_BL, train, key, targets_BL=targets_BL)
        return logits_BLV, mtp_logits_BLV, aux + mtp_aux
