"""The hybrid stack: a pattern string of pre-norm residual blocks, LM head and MTP head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.config import ModelConfig
from detjax.model.attention import Attention
from detjax.model.layers import DTYPES, MLP, Embed, RMSNorm, normal_init, proj
from detjax.model.mamba2 import Mamba2
from detjax.model.moe import MoE


class Block(nn.Module):
    """Pre-norm residual block; `letter` picks the mixer (M, *, E, -). Returns (h, aux loss)."""

    cfg: ModelConfig
    letter: str

    @nn.compact
    def __call__(self, h_BLD: jax.Array, train: bool) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        dtype = DTYPES[c.compute_dtype]
        x_BLD = RMSNorm(c.norm_eps, c.kernels, name="norm")(h_BLD).astype(dtype)
        aux = jnp.zeros((), jnp.float32)
        if self.letter == "M":
            y = Mamba2(c.d_model, c.mamba, c.init_std, c.norm_eps, dtype, name="mixer")(x_BLD)
        elif self.letter == "*":
            y = Attention(
                c.d_model,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.rope_theta,
                c.init_std,
                dtype,
                c.attention_impl,
                c.kernels,
                name="mixer",
            )(x_BLD)
        elif self.letter == "E":
            y, aux = MoE(c.d_model, c.moe, c.init_std, dtype, name="mixer")(x_BLD)
        elif self.letter == "-":
            y = MLP(c.d_model, c.ffn_dim, c.init_std, dtype, name="mixer")(x_BLD)
        else:
            raise ValueError(f"unknown block letter {self.letter!r}")
        y = nn.Dropout(c.dropout, deterministic=not train)(y)
        return h_BLD + y.astype(jnp.float32), aux


class HybridLM(nn.Module):
    """Returns (logits B×L×V, MTP logits B×(L-1)×V or None, summed MoE aux loss)."""

    cfg: ModelConfig

    def setup(self) -> None:
        c = self.cfg
        self.embed = Embed(c.vocab_size, c.d_model, c.init_std, c.kernels)
        self.layers = [Block(c, letter, name=f"layer_{i}") for i, letter in enumerate(c.pattern)]
        self.final_norm = RMSNorm(c.norm_eps, c.kernels)
        self.w_head_DV = self.param("w_head", normal_init(c.init_std), (c.d_model, c.vocab_size), jnp.float32)
        if c.mtp.depth:
            self.mtp_norm_h = RMSNorm(c.norm_eps, c.kernels)
            self.mtp_norm_e = RMSNorm(c.norm_eps, c.kernels)
            self.w_mtp_2DD = self.param("w_mtp_proj", normal_init(c.init_std), (2, c.d_model, c.d_model), jnp.float32)
            self.mtp_layers = [Block(c, letter, name=f"mtp_layer_{i}") for i, letter in enumerate(c.mtp.pattern)]
            self.mtp_final_norm = RMSNorm(c.norm_eps, c.kernels)

    def head(self, h_BLD: jax.Array) -> jax.Array:
        return proj("bld,dv->blv", h_BLD, self.w_head_DV, DTYPES[self.cfg.compute_dtype]).astype(jnp.float32)

    def __call__(self, ids_BL: jax.Array, train: bool = False):
        c = self.cfg
        h_BLD = self.embed(ids_BL)
        aux = jnp.zeros((), jnp.float32)
        for layer in self.layers:
            h_BLD, a = layer(h_BLD, train)
            aux = aux + a
        logits_BLV = self.head(self.final_norm(h_BLD))
        mtp_logits = None
        if c.mtp.depth:
            # depth-1 MTP: position t combines h_t with the embedding of token t+1 to predict token t+2
            e_BLD = self.embed(ids_BL[:, 1:])
            hn, en = self.mtp_norm_h(h_BLD[:, :-1]), self.mtp_norm_e(e_BLD)
            dtype = DTYPES[c.compute_dtype]
            m_BLD = (
                proj("bld,de->ble", hn, self.w_mtp_2DD[0], dtype) + proj("bld,de->ble", en, self.w_mtp_2DD[1], dtype)
            ).astype(jnp.float32)
            for layer in self.mtp_layers:
                m_BLD, a = layer(m_BLD, train)
                aux = aux + a
            mtp_logits = self.head(self.mtp_final_norm(m_BLD))
        return logits_BLV, mtp_logits, aux
