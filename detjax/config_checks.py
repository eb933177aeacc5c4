"""The config rules that read more than one section: canonical numerics' shapes, fp8's limits, and the rest.

Each returns (key, value, what is wrong, the fix) tuples; detjax.config raises the first as a ConfigError.
Like detjax.config, this module imports no JAX.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Config = Any  # a detjax.config.Config (not imported: detjax.config imports this module)
Problem = tuple[str, Any, str, str]  # config key, value, what is wrong, the fix


def cross_section_problems(cfg: Config) -> Iterator[Problem]:
    """Rules that read more than one section, in the order they are checked (a generator: the config stops at
    the first, so a later rule may assume the earlier ones hold)."""
    m, t, d = cfg.model, cfg.train, cfg.determinism
    if t.seq_len % m.mamba.chunk_size and "M" in m.pattern:
        yield (
            "model.mamba.chunk_size",
            m.mamba.chunk_size,
            f"must divide train.seq_len = {t.seq_len}",
            "choose a chunk_size dividing seq_len",
        )
    if cfg.data.source == "builtin" and m.vocab_size < 259:  # a prepared corpus: checked against its meta
        yield (
            "model.vocab_size",
            m.vocab_size,
            "the byte tokenizer needs 256 bytes + BOS/EOS/PAD = 259 ids",
            "use vocab_size >= 259 (264 is a multiple of 8)",
        )
    if d.mode == "strict" and d.strategy == "kernels" and m.kernels != "pallas":
        yield (
            "determinism.strategy",
            "kernels",
            "strict mode without XLA's deterministic flag relies on detjax's fixed-order Pallas kernels",
            "set model.kernels=pallas, or determinism.strategy=xla_flags",
        )
    yield from canonical_problems(cfg)
    yield from fp8_problems(cfg)
    if cfg.eval.every and (cfg.mesh.pipeline > 1 or d.canonical):
        yield (
            "eval.every",
            cfg.eval.every,
            "held-out evaluation does not run under pipeline parallelism or canonical numerics yet",
            "set eval.every=0 for this run, or evaluate a checkpoint of it on another mesh",
        )
    if m.mtp.depth and t.seq_len < 3:
        yield ("train.seq_len", t.seq_len, "the MTP head needs seq_len >= 3", "raise seq_len or mtp.depth=0")


def canonical_problems(cfg: Config) -> list[Problem]:
    """What canonical numerics cannot (yet) make mesh-invariant, and the shapes its trees need."""
    d, t, mesh = cfg.determinism, cfg.train, cfg.mesh
    if d.numerics != "canonical":
        return []
    if d.mode != "strict":
        return [("determinism.numerics", "canonical", "needs determinism.mode=strict", "set determinism.mode=strict")]
    tensor_problems = canonical_tensor_problems(cfg)
    if tensor_problems:
        return tensor_problems
    if mesh.pipeline > 1 and d.canonical_leaf and t.micro_batch != d.canonical_leaf:
        return [
            (
                "train.micro_batch",
                t.micro_batch,
                f"a canonical pipeline's microbatches are the leaves of the gradient tree: it must equal "
                f"determinism.canonical_leaf = {d.canonical_leaf}",
                f"set train.micro_batch={d.canonical_leaf}",
            )
        ]
    if cfg.trace.level != "none" or cfg.debug.inject_nondeterminism.scope:
        what = "debug.inject_nondeterminism" if cfg.debug.inject_nondeterminism.scope else "trace.level"
        return [
            (
                what,
                cfg.trace.level if what == "trace.level" else cfg.debug.inject_nondeterminism.scope,
                "the tracer's capture and fault injection are not built for canonical numerics' per-leaf tree yet",
                "trace or inject with determinism.numerics=default",
            )
        ]
    if t.global_batch & (t.global_batch - 1):
        return [
            (
                "train.global_batch",
                t.global_batch,
                "must be a power of two under canonical numerics (the gradient tree over sequences is balanced)",
                "use 8, 16, 32, ... sequences per step",
            )
        ]
    leaf = d.canonical_leaf
    if leaf < 0 or leaf and (leaf & (leaf - 1) or t.global_batch % leaf):
        return [
            (
                "determinism.canonical_leaf",
                leaf,
                f"must be a power of two dividing train.global_batch = {t.global_batch} (the leaves of the "
                "gradient tree are whole, equal blocks of sequences)",
                "use 1, 2, 4, ... up to train.global_batch, or 0 (auto)",
            )
        ]
    return []


def auto_canonical_leaf(cfg: Config, batch_shards: int) -> int:
    """determinism.canonical_leaf = 0 (auto) on a mesh whose batch is split `batch_shards` ways (data x fsdp x
    expert): the microbatch (rounded down to a power of two), at most global_batch / batch_shards, so every
    device holds whole leaves. Under pipeline parallelism a leaf is a microbatch."""
    t = cfg.train
    if cfg.mesh.pipeline > 1:
        return t.micro_batch
    leaf = 1 << (max(t.micro_batch, 1).bit_length() - 1)
    return max(1, min(leaf, t.global_batch // max(batch_shards, 1)))


def with_canonical_leaf(cfg: Config, degrees: dict[str, int]) -> Config:
    """cfg with an auto canonical leaf resolved for a mesh of these degrees (a layout's; {} for one device),
    unchanged when the leaf is set or the numerics are not canonical."""
    import dataclasses
    import math

    d = cfg.determinism
    if not d.canonical or d.canonical_leaf:
        return cfg
    leaf = auto_canonical_leaf(cfg, math.prod(degrees.get(a, 1) for a in ("data", "fsdp", "expert")))
    return dataclasses.replace(cfg, determinism=dataclasses.replace(d, canonical_leaf=leaf))


def auto_flash_backend(cfg: Config, platform: str, compute_capability: str) -> str:
    """model.flash_backend = "auto" on a device of this platform and compute capability: "mosaic" where the
    run uses the Pallas kernels on a Hopper GPU (9.0) and the Mosaic GPU kernels take its attention (head_dim
    64 or 128, bf16, seq_len a multiple of 128; flash_attention.ops.resolve_backend), else "triton". The
    hardware and the shape decide, never a measurement."""
    from detjax.pallas_kernels.flash_attention.ops import resolve_backend

    m = cfg.model
    if m.kernels != "pallas":
        return "triton"
    hopper = platform == "gpu" and compute_capability == "9.0"
    return resolve_backend("auto", cfg.train.seq_len, m.head_dim, m.compute_dtype, hopper)


def with_flash_backend(cfg: Config, device: Any = None) -> Config:
    """cfg with model.flash_backend = "auto" resolved for `device` (None: this process's first device),
    unchanged when the backend is set."""
    import dataclasses

    if cfg.model.flash_backend != "auto":
        return cfg
    if device is None:
        import jax

        device = jax.devices()[0]
    backend = auto_flash_backend(cfg, device.platform, getattr(device, "compute_capability", ""))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, flash_backend=backend))


def leaf_note(cfg: Config) -> str:
    """What the resolved canonical leaf keeps invariant (the trainer prints it when the leaf was auto)."""
    leaf, gb = cfg.determinism.canonical_leaf, cfg.train.global_batch
    return (
        f"canonical numerics: leaves of {leaf} sequences (determinism.canonical_leaf=0: auto). The trajectory is "
        f"the same on every mesh whose data x fsdp x expert degree divides {gb // leaf}, with any tensor degree "
        f"dividing determinism.max_tensor; to keep it when train.micro_batch or the mesh changes beyond that, set "
        f"determinism.canonical_leaf={leaf} (a resume adopts the leaf its run started with)"
    )


def canonical_tensor_problems(cfg: Config) -> list[Problem]:
    """Canonical tensor parallelism's rules (determinism.max_tensor and the chunked dimensions)."""
    d, mesh, m = cfg.determinism, cfg.mesh, cfg.model
    big = d.max_tensor
    if big < 1 or big & (big - 1):
        return [("determinism.max_tensor", big, "must be a power of two", "use 1, 2, 4 or 8")]
    if mesh.tensor > 1 and (mesh.tensor & (mesh.tensor - 1) or big % mesh.tensor):
        return [
            (
                "mesh.tensor",
                mesh.tensor,
                f"canonical numerics split each tensor-parallel dimension into determinism.max_tensor = {big} "
                "fixed chunks, and a device must hold a whole number of them",
                f"set determinism.max_tensor={max(mesh.tensor, 2)} or larger (a power of two; part of the "
                "trajectory), or use a mesh.tensor that divides it",
            )
        ]
    if mesh.tensor > 1 and mesh.sequence_parallel and mesh.pipeline > 1:
        return [
            (
                "mesh.sequence_parallel",
                True,
                "canonical sequence parallelism is not built inside pipeline stages yet (the stages pass the "
                "whole residual stream)",
                "set mesh.sequence_parallel=false, or mesh.pipeline=1",
            )
        ]
    if big == 1:
        return []
    letters = set(m.pattern) | (set(m.mtp.pattern) if m.mtp.depth else set())
    dims = [("model.vocab_size", m.vocab_size)]
    if "*" in letters:
        dims += [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)]
    if "-" in letters:
        dims.append(("model.ffn_dim", m.ffn_dim))
    if "E" in letters:
        dims.append(("model.moe.ffn_dim", m.moe.ffn_dim))
    if "M" in letters:
        dims.append(("model.mamba.n_heads", m.mamba.n_heads))
    for key, size in dims:
        if size % big:
            return [
                (
                    key,
                    size,
                    f"must be divisible by determinism.max_tensor = {big} (it is cut into that many fixed chunks)",
                    f"use a multiple of {big}, or a smaller determinism.max_tensor",
                )
            ]
    if m.moe.experts_kernels(m.kernels) == "pallas" and "E" in letters and (m.moe.ffn_dim // big) % 16:
        return [
            (
                "model.moe.ffn_dim",
                m.moe.ffn_dim,
                f"the Pallas grouped matmul takes each of the determinism.max_tensor = {big} chunks of the experts' "
                "width, and a chunk must be a multiple of 16",
                f"use a multiple of {16 * big}, or a smaller determinism.max_tensor",
            )
        ]
    return []


def expert_dispatch(cfg: Config) -> bool:
    """Whether canonical numerics sends each leaf's rows to the devices owning their experts on this config's
    mesh (detjax.sharding.expert.canonical_expert_moe) rather than sharding the experts' storage only: an
    `expert` axis, the Pallas grouped matmuls (a group's weight gradient is the same at any row offset), and no
    pipeline parallelism (there `expert` shards storage only)."""
    m, mesh = cfg.model, cfg.mesh
    return (
        cfg.determinism.canonical
        and mesh.expert > 1
        and mesh.pipeline == 1
        and "E" in m.pattern
        and m.moe.experts_kernels(m.kernels) == "pallas"
    )


def canonical_notes(cfg: Config) -> list[str]:
    """What canonical numerics does differently from default numerics on this mesh (the trainer prints them)."""
    if not cfg.determinism.canonical or cfg.mesh.expert <= 1 or expert_dispatch(cfg):
        return []
    return [
        f"canonical numerics: mesh.expert = {cfg.mesh.expert} shards the expert weights and their optimizer "
        "state and splits the batch like fsdp; each device runs every expert on its own sequences (no "
        "all-to-all token dispatch: canonical expert dispatch needs the Pallas grouped matmuls, "
        "model.kernels=pallas, and no pipeline axis)"
    ]


def fp8_problems(cfg: Config) -> list[Problem]:
    """Where model.fp8 has no deterministic path yet (each with the fix)."""
    if not cfg.model.fp8.enabled:
        return []
    off = "or set model.fp8.enabled=false"
    if cfg.model.fp8.lm_head and cfg.determinism.max_tensor > 1:
        return [
            (
                "model.fp8.lm_head",
                True,
                "the vocabulary-chunked LM head of determinism.max_tensor > 1 has no fp8 path yet",
                "set model.fp8.lm_head=false or determinism.max_tensor=1",
            )
        ]
    if cfg.trace.level != "none":
        key, value, why, fix = "trace.level", cfg.trace.level, "the tracer's instrumented steps", "trace without fp8"
    elif cfg.debug.inject_nondeterminism.scope:
        key, value = "debug.inject_nondeterminism.scope", cfg.debug.inject_nondeterminism.scope
        why, fix = "fault injection's instrumented steps", "inject faults without fp8"
    else:
        return []
    return [
        (
            key,
            value,
            f"with model.fp8 enabled: the fp8 scales and amaxes are not carried through {why} yet",
            f"{fix}, {off}",
        )
    ]
