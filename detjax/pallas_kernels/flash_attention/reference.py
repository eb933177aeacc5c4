"""Oracle: causal GQA attention in plain jnp (the model's reference path)."""

from detjax.model.attention import attention_reference as flash_attention_ref

__all__ = ["flash_attention_ref"]
