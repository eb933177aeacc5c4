"""The vocabulary of the kernels' `supports(model_cfg)` checks (no JAX: the config calls them)."""

from __future__ import annotations

from typing import Any

Problem = tuple[str, Any, str, str]  # config key, value, what is wrong, the fix


def pow2_at_least(key: str, value: int, low: int, kernel: str) -> list[Problem]:
    if value >= low and value & (value - 1) == 0:
        return []
    return [(key, value, f"the Pallas {kernel} needs a power of two >= {low}", "change it, or model.kernels=reference")]
