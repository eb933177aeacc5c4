"""Oracle for the Pallas matmul: XLA's dot with the same operand dtype and float32 accumulation."""

import jax
import jax.numpy as jnp


def matmul_ref(x_MK, w_KN, out_dtype=jnp.float32):
    prec = jax.lax.Precision.HIGHEST  # float32 operands: IEEE products, as the kernel (XLA's GPU default is TF32)
    return jnp.dot(x_MK, w_KN.astype(x_MK.dtype), precision=prec, preferred_element_type=jnp.float32).astype(out_dtype)
