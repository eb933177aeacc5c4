"""Mamba2 mixer: in_proj, causal depthwise conv1d, SSD chunked scan, gated RMSNorm, out_proj."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.config import MambaConfig
from detjax.model.fp8 import scale_var
from detjax.model.layers import chunk_products, normal_init, param, proj, proj_many
from detjax.pallas_kernels.conv.kernel import usable as conv_kernel_usable
from detjax.pallas_kernels.conv.ops import conv_silu as conv_silu_kernel
from detjax.pallas_kernels.gated_norm.ops import gated_norm
from detjax.pallas_kernels.rmsnorm import takes_width
from detjax.pallas_kernels.rmsnorm.kernel import fits as rmsnorm_fits
from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
from detjax.pallas_kernels.ssd.ops import ssd
from detjax.pallas_kernels.ssd.reference import ssd_chunked
from detjax.sharding import canonical
from detjax.sharding import rules as ax
from detjax.sharding import tensor as tp_ops
from detjax.sharding.rules import constrain
from detjax.sharding.tensor import TensorSplit

# Whether the gated RMSNorm over the inner width (the mixer's last step before its out-projection; one device,
# no canonical tensor chunks) runs the Pallas RMSNorm kernel under model.kernels=pallas, writing the compute
# dtype straight from the kernel. On: a gpu_medium step 0.5 % faster with it than with XLA's reductions on an
# H100 (docs/BENCHMARKS.md, "Kernel switches in the gpu_medium step").
KERNEL_GATED_NORM = True

# Whether the skip term, the SiLU gate and the gated norm run as one Pallas kernel (pallas_kernels/gated_norm:
# the forward reads the scan's output, its input and the gate once and writes the normed output; the backward
# writes the scan's and the gate's gradients in one pass) where a kernel takes the gated norm; it takes
# precedence over KERNEL_GATED_NORM. On: 0.393 against 0.469 ms forward + backward at gpu_medium's shape, and a
# gpu_medium step 1.0 % faster, on an H100 (docs/BENCHMARKS.md, "The fused Mamba2 gate and the two-pass
# convolution backward").
KERNEL_GATE = True


# Whether the causal convolutions' and their SiLUs' backward (one device, no canonical tensor chunks) runs the
# Pallas kernel (pallas_kernels/conv) under model.kernels=pallas where it takes the shape; the forward
# stays this file's formula (which XLA may fuse differently behind the custom_vjp). On, in the kernel's
# two-pass form (conv.kernel.TILES["dx_in_kernel"] False): with KERNEL_GATE, the gpu_medium step 0.6 % faster
# synced and 0.1 % pipelined than with XLA's autodiff on an H100 (docs/BENCHMARKS.md, "The fused Mamba2 gate
# and the two-pass convolution backward"). The one-pass form was no faster than XLA's autodiff (0.243 against
# 0.241 ms forward + backward) and 0.7 ms slower in the step.
KERNEL_CONV = True


# Whether, where the fused gate's and the convolutions' kernels take the mixer (Mamba2._in_place), they read
# z, x and (where its width is whole channel blocks) B|C in place from the in-projection's one output (the gate
# kernel's z as the first columns of a wider array, conv_silu's col0) instead of from copies XLA slices out of
# it: two fewer (tokens x inner width) bf16 copies a layer, with the same values read, so the same bytes.
# Off: not yet timed on a GPU (docs/BENCHMARKS.md, "Where gpu_medium's step goes at `3bad40e`").
KERNEL_IN_PLACE = False


def conv_silu(x_BL_: jax.Array, w_W_: jax.Array, b_: jax.Array, kernels: str) -> jax.Array:
    """silu(causal_conv(x, w, b)) in float32, channels (...) flattened for the Pallas backward where
    KERNEL_CONV and kernels=pallas and it takes the shape (pallas_kernels.conv.kernel.usable)."""
    b, length = x_BL_.shape[:2]
    ch = b_.size
    if KERNEL_CONV and kernels == "pallas" and conv_kernel_usable(length, ch):
        y = conv_silu_kernel(x_BL_.reshape(b, length, ch), w_W_.reshape(w_W_.shape[0], ch), b_.reshape(ch))
        return y.reshape(x_BL_.shape)
    return nn.silu(causal_conv(x_BL_.astype(jnp.float32), w_W_, b_))


def gated_norm_kernel_fits(rows: int, width: int) -> bool:
    """Whether the Pallas RMSNorm takes the gated norm: its widths (rmsnorm.takes_width) and whole row blocks
    (rmsnorm.kernel.fits)."""
    return takes_width(width) and rmsnorm_fits(rows)


def causal_conv(x_BL_: jax.Array, w_W_: jax.Array, b_: jax.Array, pinned: bool = False) -> jax.Array:
    """Depthwise causal conv along L as a fixed-order sum of shifted copies (no conv algorithm to choose).

    x is (B, L, ...channels), w is (W, ...channels), b is (...channels). pinned: the weights' and bias's
    gradients by detjax.sharding.tensor.expand's pinned token tree (canonical tensor parallelism)."""
    width = w_W_.shape[0]
    length = x_BL_.shape[1]
    lead = (1, 1)
    xpad = jnp.pad(x_BL_, ((0, 0), (width - 1, 0)) + ((0, 0),) * (x_BL_.ndim - 2))

    def channels(v):  # a per-channel vector as the tokens see it
        v = v.astype(x_BL_.dtype)
        return tp_ops.expand(v, x_BL_.shape[:2]) if pinned else v.reshape(lead + b_.shape)

    out = channels(b_) if pinned else jnp.broadcast_to(channels(b_), x_BL_.shape)
    for k in range(width):
        out = out + xpad[:, k : k + length] * channels(w_W_[k])
    return out


def _dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1):
    u = jax.random.uniform(key, shape, dtype)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus


@jax.custom_vjp
def decay_times_dt(a_H: jax.Array, dt_BLH: jax.Array) -> jax.Array:
    """a * dt per token and head. Its backward sums a's gradient over the tokens as a fixed pair tree of
    products rounded first (an optimization barrier between product and sum): left to XLA, the reduce could
    be fused with the products into FMAs differently in different programs, and the same sequence's a_log
    gradient came out 1-4 ulp apart inside and outside a loop (canonical numerics needs one program's bits
    in every context; tests/test_canonical.py)."""
    return a_H[None, None, :] * dt_BLH


def _decay_fwd(a_H, dt_BLH):
    return decay_times_dt(a_H, dt_BLH), (a_H, dt_BLH)


def _decay_bwd(res, g_BLH):
    a_H, dt_BLH = res
    prod_BLH = jax.lax.optimization_barrier(g_BLH * dt_BLH)
    return canonical.pair_sum(prod_BLH.reshape(-1, prod_BLH.shape[-1]), 0), g_BLH * a_H[None, None, :]


decay_times_dt.defvjp(_decay_fwd, _decay_bwd)


def _a_log_init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, dtype, minval=1.0, maxval=16.0))


class SSD(nn.Module):
    """The chunked SSD scan as its own module, so traces and fault injection can name it."""

    chunk: int
    kernels: str = "reference"

    @nn.compact
    def __call__(self, x_BLHP, a_BLH, b_BLN, c_BLN) -> jax.Array:
        if self.kernels == "pallas":
            return ssd(x_BLHP, a_BLH, b_BLN, c_BLN, self.chunk)
        return ssd_chunked(x_BLHP, a_BLH, b_BLN, c_BLN, self.chunk)


class Mamba2(nn.Module):
    """Projections are split per role so that every head-indexed weight can be split over `tensor` by heads;
    B and C (one group) are shared by all heads and stay whole."""

    d_model: int
    cfg: MambaConfig
    init_std: float
    norm_eps: float
    dtype: jnp.dtype
    layout: ax.Layout | None = None
    kernels: str = "reference"
    fp8: bool = False  # model.fp8.enabled: the projections in fp8 with delayed scaling
    tp: TensorSplit | None = None  # canonical tensor parallelism: heads in fixed chunks (detjax.sharding.tensor)

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        c, tp = self.cfg, self.tp
        d, d_inner = self.d_model, c.expand * self.d_model
        heads, n, w = c.n_heads, c.d_state, c.d_conv
        p = d_inner // heads
        init, conv_init = normal_init(self.init_std), normal_init(1.0 / math.sqrt(w))
        hp = (ax.SSM_HEADS, ax.HEAD_DIM)
        w_z_DHP = param(self, "w_in_z", init, (d, heads, p), (ax.EMBED, *hp), tp)
        w_x_DHP = param(self, "w_in_x", init, (d, heads, p), (ax.EMBED, *hp), tp)
        w_bc_DJN = param(self, "w_in_bc", init, (d, 2, n), (ax.EMBED, None, ax.SSM_STATE), tp)
        w_dt_DH = param(self, "w_in_dt", init, (d, heads), (ax.EMBED, ax.SSM_HEADS), tp)
        w_conv_x_WHP = param(self, "w_conv_x", conv_init, (w, heads, p), (ax.CONV, *hp), tp)
        b_conv_x_HP = param(self, "b_conv_x", nn.initializers.zeros, (heads, p), hp, tp)
        w_conv_bc_WJN = param(self, "w_conv_bc", conv_init, (w, 2, n), (ax.CONV, None, ax.SSM_STATE), tp)
        b_conv_bc_JN = param(self, "b_conv_bc", nn.initializers.zeros, (2, n), (None, ax.SSM_STATE), tp)
        dt_bias_H = param(self, "dt_bias", _dt_bias_init, (heads,), (ax.SSM_HEADS,), tp)
        a_log_H = param(self, "a_log", _a_log_init, (heads,), (ax.SSM_HEADS,), tp)
        d_skip_H = param(self, "d_skip", nn.initializers.ones, (heads,), (ax.SSM_HEADS,), tp)
        norm_HP = param(self, "norm_scale", nn.initializers.ones, (heads, p), hp, tp)
        w_out_HPD = param(self, "w_out", init, (heads, p, d), (*hp, ax.EMBED), tp)

        if tp is not None:
            return self._tensor_chunks(
                x_BLD,
                (w_z_DHP, w_x_DHP, w_dt_DH, w_conv_x_WHP, b_conv_x_HP, dt_bias_H, a_log_H, d_skip_H),
                (w_bc_DJN, w_conv_bc_WJN, b_conv_bc_JN),
                norm_HP,
                w_out_HPD,
            )
        lay, names = self.layout, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, None)
        in_proj = (
            ["bld,dhp->blhp", "bld,dhp->blhp", "bld,djn->bljn", "bld,dh->blh"],
            x_BLD,
            [w_z_DHP, w_x_DHP, w_bc_DJN, w_dt_DH],
            self.dtype,
            self.kernels,
        )
        copy = (self, ("w_in_z", "w_in_x", "w_in_bc", "w_in_dt"))
        b, length = x_BLD.shape[:2]
        if self._in_place(b * length, length):
            # the in-projection's one output, its blocks read where they lie: z by the gate's kernel, x (and B|C
            # where the kernel takes their width) by the convolutions' backward kernel, dt by XLA's fusions
            (y_MN,) = proj_many(*in_proj, copy=copy, whole=True)
            y_BLN = y_MN.reshape(b, length, -1)
            hp = heads * p
            x_BLHP = conv_silu_kernel(y_BLN, w_conv_x_WHP.reshape(w, hp), b_conv_x_HP.reshape(hp), hp)
            x_BLHP = x_BLHP.reshape(b, length, heads, p)
            if conv_kernel_usable(length, 2 * n):
                bc = conv_silu_kernel(y_BLN, w_conv_bc_WJN.reshape(w, 2 * n), b_conv_bc_JN.reshape(2 * n), 2 * hp)
                bc_BLJN = bc.reshape(b, length, 2, n)
            else:
                bc_BLJN = y_BLN[:, :, 2 * hp : 2 * hp + 2 * n].reshape(b, length, 2, n)
                bc_BLJN = conv_silu(bc_BLJN, w_conv_bc_WJN, b_conv_bc_JN, self.kernels)
            dt_BLH = y_BLN[:, :, 2 * hp + 2 * n : 2 * hp + 2 * n + heads]
            z_MZ = y_MN  # z: its first hp columns
        else:
            z_BLHP, x_BLHP, bc_BLJN, dt_BLH = proj_many(*in_proj, scale_var(self, "in_proj", self.fp8), copy)
            z_BLHP = constrain(z_BLHP, lay, names, "ssm_z")
            x_BLHP = constrain(x_BLHP, lay, names)
            x_BLHP = conv_silu(x_BLHP, w_conv_x_WHP, b_conv_x_HP, self.kernels)
            bc_BLJN = conv_silu(bc_BLJN, w_conv_bc_WJN, b_conv_bc_JN, self.kernels)
            z_MZ = z_BLHP.reshape(b * length, heads * p)
        b_BLN, c_BLN = bc_BLJN[:, :, 0], bc_BLJN[:, :, 1]

        dt_BLH = nn.softplus(dt_BLH.astype(jnp.float32) + dt_bias_H[None, None, :])
        adt_BLH = decay_times_dt(-jnp.exp(a_log_H), dt_BLH)
        y_BLHP = SSD(c.chunk_size, self.kernels, name="ssd")(x_BLHP * dt_BLH[..., None], adt_BLH, b_BLN, c_BLN)
        if KERNEL_GATE and self._norm_kernel(y_BLHP):
            flat = [v.reshape(b * length, heads * p) for v in (y_BLHP, x_BLHP)]
            d_D, w_D = jnp.repeat(d_skip_H, p), norm_HP.reshape(-1)
            y_ND = gated_norm(*flat, z_MZ, d_D, w_D, self.norm_eps, self._norm_dtype())
            y_BLHP = constrain(y_ND.reshape(b, length, heads, p), lay, names, "ssm_y")
        else:
            y_BLHP = y_BLHP + d_skip_H[None, None, :, None] * x_BLHP
            y_BLHP = constrain(y_BLHP * nn.silu(z_BLHP.astype(jnp.float32)), lay, names, "ssm_y")
            y_BLHP = self._gated_norm(y_BLHP, norm_HP)
        out_fp8 = scale_var(self, "out_proj", self.fp8)
        return proj("blhp,hpd->bld", y_BLHP, w_out_HPD, self.dtype, self.kernels, out_fp8, (self, ("w_out",)))

    def _in_place(self, rows: int, length: int) -> bool:
        """Whether the kernels read the in-projection's blocks in place (KERNEL_IN_PLACE): model.kernels=pallas
        without fp8 on one device, the fused gate's kernel (KERNEL_GATE, _norm_kernel) and the convolutions'
        backward kernel (KERNEL_CONV) taking the inner width (so x's block starts at a whole channel block)."""
        hp = self.cfg.expand * self.d_model
        return (
            KERNEL_IN_PLACE
            and KERNEL_GATE
            and KERNEL_CONV
            and not self.fp8
            and (self.layout is None or self.layout.trivial)
            and self.kernels == "pallas"
            and gated_norm_kernel_fits(rows, hp)
            and conv_kernel_usable(length, hp)  # (hp in whole channel blocks)
        )

    def _norm_kernel(self, y_BLHP: jax.Array) -> bool:
        """Whether a Pallas kernel may take the gated norm of y (B, L, H, P): model.kernels=pallas and the
        RMSNorm kernel's widths and row blocks (gated_norm_kernel_fits)."""
        b, length, h, p = y_BLHP.shape
        return self.kernels == "pallas" and gated_norm_kernel_fits(b * length, h * p)

    def _norm_dtype(self):
        """The gated norm's output dtype from a kernel: the compute dtype the out-projection reads (float32 for
        an fp8 projection, which rounds its float32 input itself)."""
        return jnp.float32 if self.fp8 else jnp.dtype(self.dtype)

    def _gated_norm(self, y_BLHP: jax.Array, norm_HP: jax.Array) -> jax.Array:
        """RMSNorm over the whole inner width (all heads): jnp in float32, or with KERNEL_GATED_NORM the Pallas
        kernel, which writes the compute dtype the out-projection reads (float32 for an fp8 projection, which
        rounds its float32 input itself)."""
        b, length, h, p = y_BLHP.shape
        if KERNEL_GATED_NORM and self._norm_kernel(y_BLHP):
            y_ND = rmsnorm(y_BLHP.reshape(-1, h * p), norm_HP.reshape(-1), self.norm_eps, self._norm_dtype())
            return y_ND.reshape(y_BLHP.shape)
        ms_BL11 = jnp.mean(y_BLHP * y_BLHP, axis=(-2, -1), keepdims=True)
        return y_BLHP * jax.lax.rsqrt(ms_BL11 + self.norm_eps) * norm_HP[None, None]

    def _tensor_chunks(self, x_BLD, head_params, bc_params, norm_HP, w_out_HPD) -> jax.Array:
        """The mixer under canonical tensor parallelism (detjax.sharding.tensor): B and C (one group, every
        head's) computed whole on every device; each head chunk's projections, convolution, scan and gate in
        one loop body, with its own copy of B and C (so their gradient over the heads is the chunk tree); the
        gated norm's mean square and the output product's partials added over chunks by the chunk tree. The
        per-head parameters' token sums are pinned (tensor.expand)."""
        tp, dtype, chunk_size, eps, kernels = self.tp, self.dtype, self.cfg.chunk_size, self.norm_eps, self.kernels
        scan = ssd if kernels == "pallas" else ssd_chunked
        n = tp.local
        # fp8: the in-projection's scale set serves the chunks and the whole B/C product (one copy each), the
        # out-projection's the chunks; their amaxes leave as the maximum over the copies
        s_in = s_out = None
        if self.fp8:
            s_in = tp_ops.max_copies(tp, scale_var(self, "in_proj", True), n + 1)
            s_out = tp_ops.max_copies(tp, scale_var(self, "out_proj", True), n)
        w_bc_DJN, w_conv_bc_WJN, b_conv_bc_JN = bc_params
        bc_BLJN = proj("bld,djn->bljn", x_BLD, w_bc_DJN, dtype, kernels, None if s_in is None else s_in[n])
        bc_BLJN = nn.silu(causal_conv(bc_BLJN.astype(jnp.float32), w_conv_bc_WJN, b_conv_bc_JN, True))
        tokens = x_BLD.shape[:2]

        def scan_chunk(x_BLD, w_z, w_x, w_dt, w_conv_x, b_conv_x, dt_bias, a_log, d_skip, b_BLN, c_BLN, *s):
            specs = ["bld,dhp->blhp", "bld,dhp->blhp", "bld,dh->blh"]
            z_BLHP, x_BLHP, dt_BLH = (
                y.astype(dtype)
                for y in chunk_products(specs, dtype, kernels, x_BLD, [w_z, w_x, w_dt], s[0] if s else None)
            )
            x_BLHP = nn.silu(causal_conv(x_BLHP.astype(jnp.float32), w_conv_x, b_conv_x, True))
            dt_BLH = nn.softplus(dt_BLH.astype(jnp.float32) + tp_ops.expand(dt_bias, tokens))
            adt_BLH = decay_times_dt(-jnp.exp(a_log), dt_BLH)
            y_BLHP = scan(x_BLHP * dt_BLH[..., None], adt_BLH, b_BLN, c_BLN, chunk_size)
            y_BLHP = y_BLHP + tp_ops.expand(d_skip, tokens)[..., None] * x_BLHP
            y_BLHP = y_BLHP * nn.silu(z_BLHP.astype(jnp.float32))
            return y_BLHP, jnp.sum(y_BLHP * y_BLHP, axis=(-2, -1))

        heads = [tp_ops.chunked(w, 1, n) for w in head_params[:4]] + [tp_ops.chunked(v, 0, n) for v in head_params[4:]]
        b_cBLN, c_cBLN = (tp_ops.fanout(tp, v) for v in (bc_BLJN[:, :, 0], bc_BLJN[:, :, 1]))
        s_chunks = () if s_in is None else (s_in[:n],)
        y_cBLHP, sq_cBL = tp_ops.per_chunk(scan_chunk, tp_ops.fanout(tp, x_BLD), *heads, b_cBLN, c_cBLN, *s_chunks)
        # gated RMSNorm over the whole inner width: its scale reaches each chunk through fanout
        width = self.cfg.n_heads * y_cBLHP.shape[-1]
        r_cBL = tp_ops.fanout(tp, jax.lax.rsqrt(tp_ops.combine(tp, sq_cBL) / width + eps))

        def out_chunk(y_BLHP, r_BL, norm_HP, w_out_HPD, *s):
            y_BLHP = y_BLHP * r_BL[..., None, None] * tp_ops.expand(norm_HP, tokens)
            return chunk_products(["blhp,hpd->bld"], dtype, kernels, y_BLHP, [w_out_HPD], s[0] if s else None)[0]

        parts = tp_ops.per_chunk(
            out_chunk,
            y_cBLHP,
            r_cBL,
            tp_ops.chunked(norm_HP, 0, n),
            tp_ops.chunked(w_out_HPD, 0, n),
            *(() if s_out is None else (s_out,)),
        )
        return tp_ops.combine_piece(tp, parts).astype(dtype)
