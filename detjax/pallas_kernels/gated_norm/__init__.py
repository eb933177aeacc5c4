"""The Mamba2 mixer's gate and gated RMSNorm in one Pallas kernel (kernel.py), its op (ops.py) and its jnp
oracle (reference.py)."""
