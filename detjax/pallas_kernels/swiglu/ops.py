"""swiglu_mlp(x, w_gate, w_up, w_down) = (silu(x @ w_gate) * (x @ w_up)) @ w_down through the Pallas matmul,
with the backward's elementwise pass inside the down projection's dx kernel (kernel.py), which writes the
gate/up cotangent directly. The forward has the bits of the unfused MLP (the same products and silu * up);
the backward keeps d h in float32. Masters are float32, cast to x's dtype at use; the weight gradients leave
the matmul kernel in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.matmul.kernel import matmul_kernel
from detjax.pallas_kernels.swiglu.kernel import BLOCK, deinterleave, down_dx_silu_bwd, interleave


def swiglu_fits(d_model: int, ffn_dim: int) -> bool:
    return ffn_dim % BLOCK == 0 and d_model % 64 == 0


@jax.custom_vjp
def swiglu_mlp(x_MD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array) -> jax.Array:
    return _fwd(x_MD, w_gate_DF, w_up_DF, w_down_FD)[0]


def _fwd(x_MD, w_gate_DF, w_up_DF, w_down_FD):
    dt, interp = x_MD.dtype, interpret_mode()
    w_gu = interleave(w_gate_DF.astype(dt), w_up_DF.astype(dt))
    gu = matmul_kernel(x_MD, w_gu, kind="fwd", out_dtype=dt, interpret=interp)
    gate, up = deinterleave(gu)
    h = jax.nn.silu(gate) * up
    y = matmul_kernel(h, w_down_FD.astype(dt), kind="fwd", out_dtype=dt, interpret=interp)
    return y, (x_MD, w_gu, w_down_FD, gu, h)


def _bwd(res, dy_MD):
    x_MD, w_gu, w_down_FD, gu, h = res
    dt, interp = x_MD.dtype, interpret_mode()
    dy = dy_MD.astype(dt)
    dgu = down_dx_silu_bwd(dy, w_down_FD.astype(dt), gu, interpret=interp)
    dw_down = matmul_kernel(h, dy, kind="dw", out_dtype=jnp.float32, interpret=interp)
    dx = matmul_kernel(dgu, w_gu, kind="dx", out_dtype=dt, interpret=interp)
    dw_gate, dw_up = deinterleave(matmul_kernel(x_MD, dgu, kind="dw", out_dtype=jnp.float32, interpret=interp))
    return dx, dw_gate, dw_up, dw_down


swiglu_mlp.defvjp(_fwd, _bwd)
