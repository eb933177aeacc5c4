"""Model FLOPs per training step, and MFU: the one definition every tool reports against.

Model FLOPs count the work the model needs, not what an implementation spends (no remat recompute, no
padding, no one-hot tricks): forward + backward = 3 x the forward, where the forward is

- every matmul with a weight: 2 x (active weight elements) per token. Active means: q/k/v/o, Mamba2 in/out
  projections, MLP gate/up/down, the MoE router, top_k routed experts and the shared expert, the MTP
  projection, and the LM head (once for the main head, once more with MTP). The embedding lookup is a
  gather, not counted; norms, activations and the depthwise conv are elementwise, not counted.
- causal attention: scores q.k and the p.v product, each 2 x L x head_dim per query head per token, halved
  by the causal mask: 2 x L x H x head_dim per token.
- the Mamba2 SSD scan with chunk C, state N, head dim P and H heads, per token and head: the chunk-local
  causal part (C^T B scores and their product with x, halved by the mask) C x N + C x P, and the state
  path (chunk state B^T x and its read-out C . state) 2 x N x P, each multiply-add 2 FLOPs.

MFU = model FLOPs per step / (step seconds x devices x peak); peak is 989 TFLOP/s, the H100/H200 SXM dense
bf16 figure (no sparsity), whatever dtype the run computes in.
"""

from __future__ import annotations

from detjax.config import Config, ModelConfig

PEAK_FLOPS_BF16 = 989e12  # per device: H100/H200 SXM, dense bf16


def _block_flops_per_token(m: ModelConfig, letter: str, seq_len: int) -> float:
    """Forward FLOPs per token of one block (see the module docstring)."""
    d = m.d_model
    if letter == "*":
        hq, kvq = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        weights = d * hq + 2 * d * kvq + hq * d
        return 2 * weights + 2 * seq_len * hq
    if letter == "-":
        return 2 * 3 * d * m.ffn_dim
    if letter == "E":
        e = m.moe
        experts = e.top_k + (1 if e.shared_expert else 0)
        return 2 * (d * e.n_experts + experts * 3 * d * e.ffn_dim)
    if letter == "M":
        s = m.mamba
        d_inner, n, c = s.expand * d, s.d_state, min(s.chunk_size, seq_len)
        p = d_inner // s.n_heads
        weights = d * (2 * d_inner + 2 * n + s.n_heads) + d_inner * d
        scan = s.n_heads * (c * n + c * p + 2 * 2 * n * p)
        return 2 * weights + scan
    raise ValueError(f"unknown block letter {letter!r}")


def model_flops_per_step(cfg: Config) -> float:
    """Model FLOPs (forward + backward) of one optimizer step of `cfg` over all devices."""
    m, t = cfg.model, cfg.train
    length = t.seq_len
    head = 2 * m.d_model * m.vocab_size
    per_token = head + sum(_block_flops_per_token(m, x, length) for x in m.pattern)
    mtp_tokens = 0.0
    if m.mtp.depth:
        mtp_per_token = 2 * 2 * m.d_model * m.d_model + head
        mtp_per_token += sum(_block_flops_per_token(m, x, length - 1) for x in m.mtp.pattern)
        mtp_tokens = t.global_batch * (length - 1) * mtp_per_token
    return 3.0 * (t.global_batch * length * per_token + mtp_tokens)


def peak_flops(device_kind: str) -> float | None:
    """The bf16 dense peak of one device of this kind, or None where none is known (the CPU: MFU is n/a)."""
    return PEAK_FLOPS_BF16 if any(k in device_kind for k in ("H100", "H200")) else None


def mfu(cfg: Config, step_seconds: float, n_devices: int, peak: float = PEAK_FLOPS_BF16) -> float:
    """Model FLOPs utilisation of one step that took `step_seconds` on `n_devices` devices."""
    return model_flops_per_step(cfg) / (step_seconds * n_devices * peak)
