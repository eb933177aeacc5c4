"""Mamba2 mixer: in_proj, causal depthwise conv1d, SSD chunked scan, gated RMSNorm, out_proj."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.config import MambaConfig
from detjax.model.layers import normal_init, proj
from detjax.model.ssd import ssd_chunked


def causal_conv(x_BLM: jax.Array, w_WM: jax.Array, b_M: jax.Array) -> jax.Array:
    """Depthwise causal conv as a fixed-order sum of shifted copies (no conv algorithm to choose)."""
    width = w_WM.shape[0]
    length = x_BLM.shape[1]
    xpad = jnp.pad(x_BLM, ((0, 0), (width - 1, 0), (0, 0)))
    out = jnp.broadcast_to(b_M.astype(x_BLM.dtype)[None, None, :], x_BLM.shape)
    for k in range(width):
        out = out + xpad[:, k : k + length] * w_WM[k].astype(x_BLM.dtype)[None, None, :]
    return out


def _dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1):
    u = jax.random.uniform(key, shape, dtype)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus


def _a_log_init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, dtype, minval=1.0, maxval=16.0))


class SSD(nn.Module):
    """The chunked SSD scan as its own module, so traces and fault injection can name it."""

    chunk: int

    @nn.compact
    def __call__(self, x_BLHP, a_BLH, b_BLN, c_BLN) -> jax.Array:
        return ssd_chunked(x_BLHP, a_BLH, b_BLN, c_BLN, self.chunk)


class Mamba2(nn.Module):
    d_model: int
    cfg: MambaConfig
    init_std: float
    norm_eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        c = self.cfg
        d_inner = c.expand * self.d_model
        heads, n = c.n_heads, c.d_state
        p = d_inner // heads
        conv_dim = d_inner + 2 * n
        init = normal_init(self.init_std)
        w_in_DM = self.param("w_in", init, (self.d_model, 2 * d_inner + 2 * n + heads), jnp.float32)
        w_conv_WM = self.param("w_conv", normal_init(1.0 / math.sqrt(c.d_conv)), (c.d_conv, conv_dim), jnp.float32)
        b_conv_M = self.param("b_conv", nn.initializers.zeros, (conv_dim,), jnp.float32)
        dt_bias_H = self.param("dt_bias", _dt_bias_init, (heads,), jnp.float32)
        a_log_H = self.param("a_log", _a_log_init, (heads,), jnp.float32)
        d_skip_H = self.param("d_skip", nn.initializers.ones, (heads,), jnp.float32)
        norm_I = self.param("norm_scale", nn.initializers.ones, (d_inner,), jnp.float32)
        w_out_ID = self.param("w_out", init, (d_inner, self.d_model), jnp.float32)

        zxbcdt_BLM = proj("bld,dm->blm", x_BLD, w_in_DM, self.dtype)
        z_BLI, xbc_BLM, dt_BLH = jnp.split(zxbcdt_BLM, [d_inner, d_inner + conv_dim], axis=-1)
        xbc_BLM = nn.silu(causal_conv(xbc_BLM.astype(jnp.float32), w_conv_WM, b_conv_M))
        x_BLI, b_BLN, c_BLN = jnp.split(xbc_BLM, [d_inner, d_inner + n], axis=-1)

        bsz, length = x_BLD.shape[:2]
        x_BLHP = x_BLI.reshape(bsz, length, heads, p)
        dt_BLH = nn.softplus(dt_BLH.astype(jnp.float32) + dt_bias_H[None, None, :])
        a_11H = -jnp.exp(a_log_H)[None, None, :]
        y_BLHP = SSD(c.chunk_size, name="ssd")(x_BLHP * dt_BLH[..., None], a_11H * dt_BLH, b_BLN, c_BLN)
        y_BLHP = y_BLHP + d_skip_H[None, None, :, None] * x_BLHP
        y_BLI = y_BLHP.reshape(bsz, length, d_inner) * nn.silu(z_BLI.astype(jnp.float32))
        y_BLI = (
            y_BLI
            * jax.lax.rsqrt(jnp.mean(y_BLI * y_BLI, axis=-1, keepdims=True) + self.norm_eps)
            * norm_I[None, None, :]
        )
        return proj("bli,id->bld", y_BLI, w_out_ID, self.dtype)
