"""Layout checks: the mesh degrees against the model, at config load (no JAX; the device count is checked
when the mesh is built, in detjax.sharding.mesh). Each check returns the first problem as a (key, value,
problem, fix) tuple; the config turns it into an error."""

from __future__ import annotations

from typing import Any

Problem = tuple[str, Any, str, str]


def layout_problems(cfg: Any) -> list[Problem]:
    """Mesh degrees against the model: what each axis splits must divide (the device count is checked
    when the mesh is built)."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    tp = mesh.tensor
    if tp > 1:
        splits = {
            "model.n_heads": m.n_heads,
            "model.mamba.n_heads": m.mamba.n_heads if "M" in m.pattern + m.mtp.pattern else tp,
            "model.ffn_dim": m.ffn_dim,
            "model.moe.ffn_dim": m.moe.ffn_dim,
            "model.vocab_size": m.vocab_size,
        }
        for key, n in splits.items():
            if n % tp:
                return [(key, n, f"is not divisible by mesh.tensor = {tp}", f"make {key} a multiple of {tp}")]
        if m.n_kv_heads % tp and tp % m.n_kv_heads:
            return [
                (
                    "model.n_kv_heads",
                    m.n_kv_heads,
                    f"neither divides nor is divided by mesh.tensor = {tp} (kv heads are split, or replicated "
                    "when fewer than the tensor degree)",
                    "choose n_kv_heads dividing n_heads and dividing or divisible by the tensor degree",
                )
            ]
        if mesh.sequence_parallel and t.seq_len % tp:
            return [
                (
                    "train.seq_len",
                    t.seq_len,
                    f"sequence parallel needs it divisible by tensor = {tp}",
                    f"use a multiple of {tp}",
                )
            ]
    elif mesh.sequence_parallel:
        return [("mesh.sequence_parallel", True, "needs mesh.tensor > 1", "set mesh.tensor >= 2 or turn it off")]
    if mesh.expert > 1:
        has_moe = "E" in m.pattern + (m.mtp.pattern if m.mtp.depth else "")
        if not has_moe:
            return [("mesh.expert", mesh.expert, "the pattern has no MoE block (E)", "set mesh.expert=1")]
        if m.moe.n_experts % mesh.expert:
            return [
                (
                    "model.moe.n_experts",
                    m.moe.n_experts,
                    f"is not divisible by mesh.expert = {mesh.expert}",
                    f"use a multiple of {mesh.expert} experts",
                )
            ]
        if m.moe.combine != "gather":
            return [("model.moe.combine", m.moe.combine, "expert parallel uses the ordered combine", "use gather")]
    if mesh.fsdp > 1 and m.d_model % mesh.fsdp:
        return [("model.d_model", m.d_model, f"is not divisible by mesh.fsdp = {mesh.fsdp}", "change fsdp or d_model")]
    if mesh.pipeline > 1:
        return _pipeline_problems(cfg)
    return []


def _pipeline_problems(cfg: Any) -> list[Problem]:
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    chunks = mesh.pipeline * mesh.pipeline_virtual
    if len(m.pattern) % chunks:
        return [
            (
                "model.pattern",
                m.pattern,
                f"{len(m.pattern)} layers cannot be split into pipeline x pipeline_virtual = {chunks} stages",
                f"use a layer count that is a multiple of {chunks}",
            )
        ]
    n = len(m.pattern) // chunks
    parts = [m.pattern[i * n : (i + 1) * n] for i in range(chunks)]
    if len(set(parts)) > 1:
        return [
            (
                "model.pattern",
                m.pattern,
                f"pipeline stages must hold the same block sequence (stacked over the pipeline axis), got {parts}",
                f"repeat one sub-pattern {chunks} times, e.g. '{parts[0] * chunks}'",
            )
        ]
    if mesh.expert > 1 and not cfg.determinism.canonical:  # canonical: expert shards storage only
        return [
            (
                "mesh.expert",
                mesh.expert,
                "expert parallel inside pipeline stages is not supported yet (under canonical numerics it is "
                "storage sharding and allowed)",
                "use mesh.pipeline=1 or mesh.expert=1",
            )
        ]
    if mesh.pipeline_virtual > 1 and t.n_micro % mesh.pipeline:
        return [
            (
                "train.global_batch",
                t.global_batch,
                f"the interleaved schedule needs the microbatch count ({t.n_micro}) divisible by "
                f"mesh.pipeline = {mesh.pipeline}",
                "change global_batch or micro_batch",
            )
        ]
    if cfg.trace.level != "none" or cfg.debug.inject_nondeterminism.scope:
        return [
            (
                "trace.level",
                cfg.trace.level,
                "phase/module/op capture and fault injection do not run inside pipeline stages yet",
                "trace with mesh.pipeline=1 (fingerprints still run), or trace.level=none",
            )
        ]
    return []
