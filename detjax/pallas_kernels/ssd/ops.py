"""ssd(x, a, b, c, chunk): the Mamba2 SSD scan as a Pallas kernel with a fixed-order backward.

Same contract as ssd.reference.ssd_chunked: x (B, L, H, P) already multiplied by dt, a = A*dt (B, L, H),
B and C (B, L, N) shared by all heads; float32 out (B, L, H, P).

The kernel holds a head in power-of-two blocks. A head dim P that is not a power of two (96 = expand 2 x 1536 /
32 heads; 160, 192, 320, ...) is split into k = P / p sub-heads of its largest power-of-two divisor p (>= 16):
the P columns of a head are independent channels sharing the head's decay a, so a sub-head is a head of its
own with a copy of a. Nothing is padded or wasted; in the backward the k sub-heads' da are added in ascending
order, and dB / dC take the sub-heads as heads (their slots are added in ascending head order anyway).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.ssd.kernel import ssd_bwd, ssd_fwd, sum_heads, sum_heads_usable

# Whether the backward adds the per-head dB / dC slots with the Pallas kernel (kernel.sum_heads) instead of XLA's
# fused chain of adds: the same adds in the same order, so the same bits. XLA's chain read the slots at about
# 0.8 TB/s on an H100 (2.72 ms a gpu_medium step, `scripts/profile_step.py --source-lines`); with the kernel the
# gpu_medium step took 131.26 against 132.75 ms pipelined, on the same digest (docs/BENCHMARKS.md, "The SSD
# backward's head sum and term order").
KERNEL_SUM_HEADS = True


def _heads_first(x_BLH_):
    b, length, h = x_BLH_.shape[:3]
    return jnp.moveaxis(x_BLH_, 2, 1).reshape(b * h, length, *x_BLH_.shape[3:])


def _heads_last(x_G__, b, h):
    return jnp.moveaxis(x_G__.reshape(b, h, *x_G__.shape[1:]), 1, 2)


def _sum_heads_in_order(slots_GLN, b, h):
    """Add the per-head slots in ascending head order (one fixed order, whatever the hardware)."""
    s = slots_GLN.reshape(b, h, *slots_GLN.shape[1:])
    acc = s[:, 0]
    for k in range(1, h):
        acc = acc + s[:, k]
    return acc


def sub_heads(p: int) -> int:
    """How many sub-heads a head of dim p runs as: p / (its largest power-of-two divisor)."""
    return p // (p & -p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def ssd(x_BLHP, a_BLH, b_BLN, c_BLN, chunk: int) -> jax.Array:
    return _fwd(x_BLHP, a_BLH, b_BLN, c_BLN, chunk)[0]


def _fwd(x_BLHP, a_BLH, b_BLN, c_BLN, chunk):
    bsz, length, heads, p = x_BLHP.shape
    k = sub_heads(p)
    h = heads * k  # the kernel's heads: each head's k sub-heads side by side, in column order
    x = x_BLHP.astype(jnp.float32).reshape(bsz, length, heads * p)  # the kernel reads heads in place
    a = jnp.repeat(a_BLH.astype(jnp.float32), k, axis=2) if k > 1 else a_BLH.astype(jnp.float32)
    arow = _heads_first(a).reshape(bsz * h, 1, length)
    b, c = b_BLN.astype(jnp.float32), c_BLN.astype(jnp.float32)
    y, states, decays = ssd_fwd(x, arow, b, c, h=h, chunk=chunk, interpret=interpret_mode())
    return y.reshape(bsz, length, heads, p), (x, arow, b, c, states, decays)


def _bwd(chunk, res, dy_BLHP):
    x, arow, b, c, states, decays = res
    bsz, length, heads, p = dy_BLHP.shape
    k = sub_heads(p)
    h = heads * k
    dy = dy_BLHP.astype(jnp.float32).reshape(bsz, length, heads * p)
    dx, da, db_slots, dc_slots = ssd_bwd(
        x, arow, b, c, states, decays, dy, h=h, chunk=chunk, interpret=interpret_mode()
    )
    da_BLhk = _heads_last(da.reshape(bsz * h, length), bsz, h).reshape(bsz, length, heads, k)
    da_BLH = da_BLhk[..., 0]
    for j in range(1, k):  # the sub-heads' da in ascending order
        da_BLH = da_BLH + da_BLhk[..., j]
    n = db_slots.shape[-1]
    if KERNEL_SUM_HEADS and sum_heads_usable(h, length, n):
        db, dc = sum_heads(db_slots, dc_slots, h=h, interpret=interpret_mode())
    else:
        db, dc = _sum_heads_in_order(db_slots, bsz, h), _sum_heads_in_order(dc_slots, bsz, h)
    return dx.reshape(bsz, length, heads, p), da_BLH, db, dc


ssd.defvjp(_fwd, _bwd)
