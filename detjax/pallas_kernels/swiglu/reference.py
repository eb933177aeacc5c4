"""Oracle for the fused SwiGLU MLP: the same math in plain jnp (float32 accumulation, gate and up rounded to
the compute dtype as the kernel rounds them)."""

import jax.numpy as jnp


def swiglu_mlp_ref(x_MD, w_gate_DF, w_up_DF, w_down_FD):
    dt = x_MD.dtype
    g = jnp.dot(x_MD, w_gate_DF.astype(dt), preferred_element_type=jnp.float32).astype(dt).astype(jnp.float32)
    u = jnp.dot(x_MD, w_up_DF.astype(dt), preferred_element_type=jnp.float32).astype(dt).astype(jnp.float32)
    h = (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(dt)
    return jnp.dot(h, w_down_FD.astype(dt), preferred_element_type=jnp.float32).astype(dt)
