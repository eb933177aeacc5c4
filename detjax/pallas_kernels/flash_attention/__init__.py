from detjax.pallas_kernels.support import Problem, pow2_at_least


def supports(m) -> list[Problem]:
    """Flash attention loads whole heads: a power-of-two head_dim >= 16 (sequences that are not a multiple
    of 16, e.g. MTP attention blocks' L-1 rows, take the jnp path). The Mosaic GPU backend takes head_dim 64
    or 128 in bf16 (larger heads' accumulators do not fit a warpgroup's registers; mosaic.HEAD_DIMS)."""
    problems = pow2_at_least("model.head_dim", m.head_dim, 16, "flash attention")
    if m.flash_backend == "mosaic":
        if m.head_dim not in (64, 128):
            problems.append(
                (
                    "model.head_dim",
                    m.head_dim,
                    "the Mosaic GPU flash attention takes head_dim 64 or 128 (accumulators in registers)",
                    "use model.flash_backend=triton",
                )
            )
        if m.compute_dtype != "bfloat16":
            problems.append(
                (
                    "model.flash_backend",
                    m.flash_backend,
                    "the Mosaic GPU flash attention multiplies bf16 operands; model.compute_dtype is "
                    f"{m.compute_dtype}",
                    "use model.compute_dtype=bfloat16 or model.flash_backend=triton",
                )
            )
    return problems
