"""Typed, frozen config tree: YAML + dotted key=value overrides; unknown keys are errors.

This module imports no JAX so that `detjax.train` can set XLA flags before JAX initialises. It is one file on
purpose: it is the whole schema, one small dataclass per section with its own validation, so that every key a
user can set, its default and its comment are read in one place. The rules that read several sections are in
detjax.config_checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from detjax.config_checks import (  # noqa: F401 (the checks' public names are config's)
    auto_canonical_leaf,
    auto_flash_backend,
    canonical_notes,
    canonical_problems,
    canonical_tensor_problems,
    cross_section_problems,
    expert_dispatch,
    fp8_problems,
    leaf_note,
    with_canonical_leaf,
    with_flash_backend,
)
from detjax.pallas_kernels import support_problems
from detjax.sharding.checks import layout_problems

BLOCK_LETTERS = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent."""


def _fail(key: str, value: Any, problem: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"config key '{key}' = {value!r}: {problem}. Fix: {fix}")


@dataclass(frozen=True)
class MambaConfig:
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    n_heads: int = 4
    chunk_size: int = 16

    def validate(self, d_model: int) -> None:
        for name in ("d_state", "d_conv", "expand", "n_heads", "chunk_size"):
            if getattr(self, name) <= 0:
                _fail(f"model.mamba.{name}", getattr(self, name), "must be positive", "use a value >= 1")
        d_inner = self.expand * d_model
        if d_inner % self.n_heads:
            _fail(
                "model.mamba.n_heads",
                self.n_heads,
                f"must divide d_inner = expand*d_model = {d_inner}",
                "choose n_heads dividing d_inner",
            )


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 4
    top_k: int = 2
    ffn_dim: int = 64
    router: Literal["softmax", "sigmoid"] = "softmax"
    shared_expert: bool = True
    aux_loss_coef: float = 0.01
    # "gather" = permutation + gather + fixed-order sum (deterministic); "scatter_add" = the usual fast
    # combine through scatter-add, whose GPU result depends on atomic arrival order (refused in strict mode).
    combine: Literal["gather", "scatter_add"] = "gather"
    # the experts' grouped matmuls: "auto" follows model.kernels (XLA's ragged_dot, or the Pallas gmm);
    # "ragged_dot" / "pallas" pick one whatever model.kernels says
    experts_impl: Literal["auto", "ragged_dot", "pallas"] = "auto"

    def experts_kernels(self, kernels: str) -> str:
        """The grouped matmuls' kernels under model.kernels = `kernels`: "pallas" or "reference"."""
        return {"auto": kernels, "ragged_dot": "reference", "pallas": "pallas"}[self.experts_impl]

    def validate(self) -> None:
        if self.n_experts < 1:
            _fail("model.moe.n_experts", self.n_experts, "must be >= 1", "use at least one expert")
        if not 1 <= self.top_k <= self.n_experts:
            _fail(
                "model.moe.top_k",
                self.top_k,
                f"must be between 1 and n_experts = {self.n_experts}",
                f"set model.moe.top_k <= {self.n_experts}",
            )
        if self.ffn_dim < 1:
            _fail("model.moe.ffn_dim", self.ffn_dim, "must be >= 1", "use a positive width")


@dataclass(frozen=True)
class MTPConfig:
    depth: int = 1
    pattern: str = "-"
    loss_coef: float = 0.3

    def validate(self) -> None:
        if self.depth not in (0, 1):
            _fail("model.mtp.depth", self.depth, "only depth 0 (off) or 1 is supported", "use 0 or 1")
        _check_pattern("model.mtp.pattern", self.pattern)


@dataclass(frozen=True)
class Fp8Config:
    """FP8 with delayed scaling (detjax/model/fp8.py): e4m3 activations and weights, e5m2 gradients, for the
    dense projections (attention, MLP, Mamba2 in/out, shared expert, MTP projection) and the routed experts'
    grouped matmuls. The router and the norms stay in bf16 / fp32; the LM head too unless lm_head is set."""

    enabled: bool = False
    amax_history_len: int = 16  # steps of amax history behind each scale
    margin: int = 0  # scale = fp8 max / amax / 2^margin
    # the LM head (and the MTP head, which shares its weight and its scale set) in fp8 too; off: bf16, the
    # usual recipe (docs/DETERMINISM.md "FP8")
    lm_head: bool = False

    def validate(self) -> None:
        if not 1 <= self.amax_history_len <= 1024:
            _fail("model.fp8.amax_history_len", self.amax_history_len, "must be in 1..1024", "use e.g. 16")
        if not 0 <= self.margin <= 16:
            _fail("model.fp8.margin", self.margin, "must be in 0..16", "use 0")
        if self.lm_head and not self.enabled:
            _fail("model.fp8.lm_head", True, "does nothing with model.fp8.enabled=false", "enable fp8 or drop lm_head")


def _check_pattern(key: str, pattern: str) -> None:
    if not pattern:
        _fail(key, pattern, "is empty", "give at least one block letter")
    bad = sorted({c for c in pattern if c not in BLOCK_LETTERS})
    if bad:
        _fail(
            key,
            pattern,
            f"unknown block letter(s) {bad}",
            "use only M (Mamba2), * (attention), E (MoE), - (MLP)",
        )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 264
    d_model: int = 64
    pattern: str = "M*E-"
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    ffn_dim: int = 128
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # "reference": as model.kernels says; "xla" / "cudnn": jax.nn.dot_product_attention with that
    # implementation (fast, nondeterministic backward; refused in strict mode)
    attention_impl: Literal["reference", "xla", "cudnn"] = "reference"
    # the embedding table's gradient: "fixed" = a fixed-order sum (one-hot contraction, or the Pallas sorted
    # segment sum); "scatter_add" = the gather's own transpose, an atomic scatter-add (fast, nondeterministic
    # on GPU; refused in strict mode)
    embed_grad: Literal["fixed", "scatter_add"] = "fixed"
    # "pallas": RMSNorm, embedding gradient, causal flash attention, the Mamba2 SSD scan, the MoE grouped
    # matmuls and every dense projection (the pinned-tile matmul) run as fixed-order Pallas kernels
    # (detjax/pallas_kernels); "reference": plain JAX/XLA
    kernels: Literal["reference", "pallas"] = "reference"
    # the fixed-order flash attention under kernels=pallas: "triton" (every GPU, any power-of-two head_dim),
    # "mosaic" (Hopper's TMA + wgmma through Pallas' Mosaic GPU backend; head_dim 64 or 128, bf16, seq_len a
    # multiple of 128; on an H100 its forward + backward took 1.50 ms against Triton's 2.05 at head_dim 128,
    # docs/BENCHMARKS.md "Flash attention") or "auto": mosaic where it applies on a Hopper GPU, else triton
    # (config_checks.auto_flash_backend). Each is deterministic with bits of its own: a run records the backend
    # auto chose and keeps the one it started with on resume
    flash_backend: Literal["auto", "triton", "mosaic"] = "auto"
    # Activation checkpointing: "none" keeps every activation for the backward; "block" keeps only each
    # block's input and recomputes the block in the backward (less memory, ~1/3 more compute). Deterministic
    # either way, but a trajectory of its own: XLA may fuse the recomputed elementwise ops differently (the
    # bits equal "none" on the CPU with kernels=pallas (tested for an attention block), not on the H200)
    remat: Literal["none", "block"] = "none"
    mamba: MambaConfig = field(default_factory=MambaConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)

    def validate(self) -> None:
        _check_pattern("model.pattern", self.pattern)
        if self.vocab_size < 1:
            _fail("model.vocab_size", self.vocab_size, "must be >= 1", "use the tokenizer's vocabulary size")
        for name in ("d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) <= 0:
                _fail(f"model.{name}", getattr(self, name), "must be positive", "use a value >= 1")
        if self.n_heads % self.n_kv_heads:
            _fail(
                "model.n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads = {self.n_heads} (grouped-query attention)",
                "choose n_kv_heads dividing n_heads",
            )
        if self.head_dim % 2:
            _fail("model.head_dim", self.head_dim, "RoPE needs an even head_dim", "use an even head_dim")
        if self.kernels == "pallas":  # what each Pallas kernel takes lives beside the kernel (supports())
            for problem in support_problems(self):
                _fail(*problem)
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", self.dropout, "must be in [0, 1)", "use e.g. 0.0 or 0.1")
        if not 0 < self.norm_eps < 1:
            _fail("model.norm_eps", self.norm_eps, "must be in (0, 1): RMSNorm divides by sqrt(mean + eps)", "use 1e-5")
        if not 0 < self.init_std < float("inf"):
            _fail("model.init_std", self.init_std, "must be a positive, finite number", "use e.g. 0.02")
        self.mamba.validate(self.d_model)
        self.moe.validate()
        self.mtp.validate()
        self.fp8.validate()


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 100
    global_batch: int = 8
    micro_batch: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    decay_steps: int = 0  # the cosine schedule's horizon; 0: train.steps, recorded as that number when a run starts
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    # A step with a non-finite loss, gradient or updated parameter: "stop" the run (exit 3, nothing of that
    # state saved), or "skip_step": keep the old parameters and optimizer state, advance the step and the data,
    # and record `"skipped": true` in that step's fingerprint (deterministic: decided on device).
    on_nonfinite: Literal["stop", "skip_step"] = "stop"
    # The gradient accumulation fusion: with model.kernels=pallas on one device (no fp8, canonical numerics or
    # pipeline), each microbatch's weight gradients of the fused projections are added to the running sum by
    # the dw kernel itself instead of by a pass of their own (detjax.step.Trainer.fuses_accumulation). The same
    # bits either way; 2.9 % of a step on an H100 (docs/BENCHMARKS.md, "The gradient accumulation fusion at
    # the d 4096 cell").
    grad_accumulation_fusion: bool = True

    @property
    def n_micro(self) -> int:
        return self.global_batch // self.micro_batch

    def warnings(self) -> list[str]:
        """Legal but probably unintended settings (the trainer prints them; a short smoke run of a long
        config is a real use, so they are not errors)."""
        if self.warmup_steps > self.steps:
            return [
                f"train.warmup_steps = {self.warmup_steps} > train.steps = {self.steps}: the learning rate never "
                f"reaches train.lr = {self.lr}"
            ]
        return []

    def validate(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len"):
            if getattr(self, name) <= 0:
                _fail(f"train.{name}", getattr(self, name), "must be positive", "use a value >= 1")
        if self.global_batch % self.micro_batch:
            _fail(
                "train.global_batch",
                self.global_batch,
                f"is not divisible by train.micro_batch = {self.micro_batch}",
                "make global_batch a multiple of micro_batch",
            )
        if not 0 < self.lr < float("inf"):
            _fail("train.lr", self.lr, "must be a positive, finite number", "use e.g. 3e-4")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]", "use e.g. 0.1")
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", getattr(self, name), "must be >= 0", "use a non-negative count")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"train.{name}", getattr(self, name), "must be in [0, 1)", "use e.g. b1=0.9, b2=0.95")
        if not 0 < self.eps < float("inf"):
            _fail("train.eps", self.eps, "must be a positive, finite number", "use e.g. 1e-8")
        if not 0 <= self.weight_decay < float("inf"):
            _fail("train.weight_decay", self.weight_decay, "must be >= 0 and finite", "use e.g. 0.1")
        if not 0 < self.clip_norm < float("inf"):
            _fail("train.clip_norm", self.clip_norm, "must be a positive, finite norm", "use e.g. 1.0")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["builtin", "arrayrecord"] = "builtin"
    path: str = ""  # the directory `python -m detjax.data.prepare` wrote (meta.json + ArrayRecord shards)
    builtin_sentences: int = 20000
    # The tokenizer the prepared corpus was written with (sha256, from its meta.json). Empty: filled in at a
    # run's first start, so it is part of the config hash; a set value must match the data.
    tokenizer_sha256: str = ""

    def validate(self) -> None:
        if self.builtin_sentences < 1:
            _fail("data.builtin_sentences", self.builtin_sentences, "must be >= 1", "use e.g. 20000")

        if self.source == "arrayrecord" and not self.path:
            _fail(
                "data.path",
                self.path,
                "data.source is 'arrayrecord' but no path was given",
                "set data.path to the directory written by `python -m detjax.data.prepare`",
            )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: every `every` steps (0: never) the LM loss over `steps` fixed batches of the eval
    split (train.global_batch rows each, the same batches every time), after that step's update. Reported as
    eval_loss / eval_ppl in metrics.jsonl and as `eval` (loss and a digest of the batch sums) in the fingerprints."""

    every: int = 0
    steps: int = 2
    builtin_sentences: int = 2000  # data.source=builtin: the held-out text (another seed of its generator)

    def validate(self) -> None:
        if self.builtin_sentences < 1:
            _fail("eval.builtin_sentences", self.builtin_sentences, "must be >= 1", "use e.g. 2000")
        if self.every < 0:
            _fail("eval.every", self.every, "must be >= 0", "use 0 (off) or a step interval, e.g. 100")
        if self.steps < 1:
            _fail("eval.steps", self.steps, "must be >= 1", "use e.g. 4")


@dataclass(frozen=True)
class DeterminismConfig:
    mode: Literal["off", "strict"] = "strict"
    # How strict mode gets deterministic kernels:
    #   "xla_flags": XLA's --xla_gpu_deterministic_ops (deterministic scatter, no run-time autotuning);
    #   "kernels":   detjax's fixed-order Pallas kernels (needs model.kernels=pallas), every GEMM included,
    #                with tiles pinned in code; no XLA deterministic flag and XLA autotuning off; the step
    #                is checked for ops with no deterministic path (scatter, select-and-scatter) and for
    #                GEMMs left to XLA (only tiny ones pass), and refused otherwise.
    strategy: Literal["xla_flags", "kernels"] = "xla_flags"
    # "canonical" (strict mode): every sum over tokens is a fixed pair tree over leaves of sequences in global
    # order (detjax.sharding.canonical), so the data, fsdp, expert and pipeline degrees do not change the bits,
    # and a run may resume on another such mesh. It also turns XLA's excess precision off
    # (determinism.CANONICAL_XLA_FLAGS). Each device runs its leaves one at a time, so train.micro_batch
    # changes neither the bits nor the schedule there. With the Pallas grouped matmuls (model.kernels=pallas or
    # model.moe.experts_impl=pallas) and no pipeline axis, `expert` splits the experts: each leaf's
    # rows travel to their experts' devices by all-to-all, and each owner keeps one weight gradient per source
    # device (expert_dispatch below); otherwise it shards the expert weights and their optimizer state only and
    # each device runs every expert on its own leaves. Either way it splits the batch like fsdp. Under pipeline
    # parallelism each microbatch is one leaf (train.micro_batch must equal canonical_leaf), each batch shard
    # pipelines its own block of leaves, and the state keeps the one-device layout. Tensor parallelism needs
    # max_tensor below.
    numerics: Literal["default", "canonical"] = "default"
    # Canonical numerics: sequences per leaf of the gradient tree (a power of two dividing train.global_batch).
    # A leaf is one batch-`canonical_leaf` program (its tokens reduced inside the kernels, its aux loss one
    # load-balancing group, one dropout key), so it is part of the trajectory; data x fsdp x expert may be at
    # most global_batch / canonical_leaf. 1 = one sequence per leaf (least memory, most mesh freedom); larger
    # leaves run bigger products (faster on a GPU: one sequence per leaf cost +62 % on gpu_medium, the
    # microbatch +5 %). 0 = auto, resolved when a run starts (and recorded in its config): train.micro_batch, at
    # most global_batch / (data x fsdp x expert) of the mesh it starts on (config_checks.auto_canonical_leaf).
    canonical_leaf: int = 0
    # Canonical numerics: the largest tensor degree the run may use (a power of two). With max_tensor = M > 1
    # every dimension tensor parallelism splits (heads, MLP and expert widths, vocabulary) is cut into M fixed
    # chunks and every sum over it is the chunk tree of detjax.sharding.tensor, on one device as on M, so
    # mesh.tensor may be any divisor of M. Part of the trajectory (M = 1, the default, runs no chunks and
    # refuses tensor parallelism; a larger M costs more, smaller products).
    max_tensor: int = 1

    @property
    def canonical(self) -> bool:
        return self.mode == "strict" and self.numerics == "canonical"

    def validate(self) -> None:
        if self.max_tensor != 1 and self.numerics != "canonical":
            _fail(
                "determinism.max_tensor",
                self.max_tensor,
                "applies only under determinism.numerics=canonical",
                "remove it, or set determinism.numerics=canonical",
            )
        if self.canonical_leaf not in (0, 1) and self.numerics != "canonical":
            _fail(
                "determinism.canonical_leaf",
                self.canonical_leaf,
                "applies only under determinism.numerics=canonical",
                "remove it, or set determinism.numerics=canonical",
            )


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    out_dir: str = "runs"
    log_every: int = 10
    fingerprints: bool = True
    progress: bool = True
    save_final_params: bool = True
    stop_after: int = 0  # >0: stop (with a checkpoint) once the state has this many steps; 0: run to train.steps
    # "A-B": a jax.profiler trace of steps A..B-1 in <run>/profile/ (open with xprof / TensorBoard); "" = off
    profile_steps: str = ""
    # Metric sinks beside metrics.jsonl: TensorBoard event files in <run>/tensorboard (tensorboardX), and
    # Weights & Biases when this names a project (needs `pip install wandb`).
    tensorboard: bool = True
    wandb_project: str = ""

    def validate(self) -> None:
        import importlib.util

        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            _fail(
                "run.tensorboard",
                self.tensorboard,
                "tensorboardX is not installed",
                "pip install tensorboardX (a detjax dependency), or set run.tensorboard=false",
            )
        if self.wandb_project:
            if importlib.util.find_spec("wandb") is None:
                _fail("run.wandb_project", self.wandb_project, "W&B is not installed", "pip install wandb, or unset it")
        if self.stop_after < 0:
            _fail("run.stop_after", self.stop_after, "must be >= 0", "use 0 to run to train.steps")
        self.profile_range()

    def profile_range(self) -> tuple[int, int] | None:
        """(first step, end step) of the profiler trace, or None."""
        if not self.profile_steps:
            return None
        try:
            a, b = (int(x) for x in self.profile_steps.split("-"))
        except ValueError:
            a, b = 0, -1
        if not 0 <= a < b:
            _fail("run.profile_steps", self.profile_steps, "must be 'A-B' with 0 <= A < B", "use e.g. 5-8")
        return a, b


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True  # false: no checkpoints at all (throwaway runs); no resume, no save on SIGTERM
    dir: str = ""  # "" = <run dir>/checkpoints
    every: int = 0  # save every N steps; 0 = only at the end, at run.stop_after and on SIGTERM/SIGINT
    keep: int = 3
    async_save: bool = True
    resume: bool = False  # resume from the latest complete checkpoint (same as --resume)

    def validate(self) -> None:
        if self.every < 0:
            _fail("ckpt.every", self.every, "must be >= 0", "use 0 to save only at the end")
        if self.keep < 1:
            _fail("ckpt.keep", self.keep, "must keep at least one checkpoint", "use keep >= 1")
        if not self.enabled and (self.resume or self.every):
            what = "ckpt.resume=true" if self.resume else f"ckpt.every={self.every}"
            _fail("ckpt.enabled", False, f"checkpoints are off but {what} asks for them", "set ckpt.enabled=true")


@dataclass(frozen=True)
class TraceConfig:
    """First-divergence capture (docs/TRACING.md). Capture never changes the trajectory."""

    level: Literal["none", "phase", "module", "op"] = "none"
    steps: str = ""  # comma-separated steps to capture, e.g. "3" or "3,4"
    scope: str = ""  # regex searched in module paths / op scopes; "" = everything

    def step_list(self) -> list[int]:
        try:
            return sorted({int(s) for s in self.steps.split(",") if s.strip()})
        except ValueError:
            _fail("trace.steps", self.steps, "must be comma-separated step numbers", "write e.g. trace.steps=3,4")

    def validate(self) -> None:
        steps = self.step_list()
        if self.level != "none" and not steps:
            _fail("trace.steps", self.steps, f"trace.level={self.level} needs steps to capture", "set trace.steps=N")
        _check_regex("trace.scope", self.scope)


@dataclass(frozen=True)
class InjectConfig:
    scope: str = ""  # module-path regex (e.g. "layer_1/mixer$") or "optimizer"; "" = off
    step: int = -1


@dataclass(frozen=True)
class DebugConfig:
    # Fault injection for testing the tracer: perturbs the output of the matching module(s) at `step` by one
    # ulp at a position drawn from os.urandom, so two runs differ there and only there.
    inject_nondeterminism: InjectConfig = field(default_factory=InjectConfig)
    allow_injection_in_strict: bool = False

    def validate(self) -> None:
        inj = self.inject_nondeterminism
        _check_regex("debug.inject_nondeterminism.scope", inj.scope)
        if inj.scope and inj.step < 0:
            _fail("debug.inject_nondeterminism.step", inj.step, "injection needs a step", "set step: N (N >= 0)")


def _check_regex(key: str, pattern: str) -> None:
    import re

    try:
        re.compile(pattern)
    except re.error as e:
        _fail(key, pattern, f"is not a valid regular expression ({e})", "escape special characters")


@dataclass(frozen=True)
class MeshConfig:
    """Degrees of the five mesh axes (product = device count; one -1 is filled from the device count).

    Dense layers see `expert` as one more data-parallel axis (Megatron folds expert parallelism into the
    data-parallel group the same way): the batch is split over data x fsdp x expert.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    pipeline_virtual: int = 1  # interleaved virtual stages per pipeline rank
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    sequence_parallel: bool = False  # residual stream split over `tensor` along the sequence between blocks
    devices: int = 0  # how many devices the mesh spans: 0 = every device of every process; N = the first N

    AXES = ("data", "fsdp", "tensor", "pipeline", "expert")

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in self.AXES}

    def validate(self) -> None:
        fills = [a for a, d in self.degrees().items() if d == -1]
        if len(fills) > 1:
            _fail(f"mesh.{fills[1]}", -1, f"only one axis may be -1 (also {fills[0]})", "give explicit degrees")
        for a, d in self.degrees().items():
            if d == 0 or d < -1:
                _fail(f"mesh.{a}", d, "must be a positive degree or -1 (fill)", "use e.g. 1, 2, 4 or -1")
        if self.devices < 0:
            _fail("mesh.devices", self.devices, "must be >= 0", "use 0 for all devices or a count")
        if self.pipeline_virtual < 1:
            _fail("mesh.pipeline_virtual", self.pipeline_virtual, "must be >= 1", "use 1 (no interleaving)")
        if self.pipeline_virtual > 1 and self.pipeline == 1:
            _fail(
                "mesh.pipeline_virtual",
                self.pipeline_virtual,
                "interleaved virtual stages need mesh.pipeline > 1",
                "set mesh.pipeline >= 2 or pipeline_virtual=1",
            )


@dataclass(frozen=True)
class DistConfig:
    """Multi-process (multi-controller) start-up. Empty coordinator: read SLURM / the JAX env, else 1 process."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 1
    process_id: int = 0
    cpu_collectives: Literal["gloo", "mpi", "none"] = "gloo"  # CPU cross-process collectives (tests, CI)

    def validate(self) -> None:
        if self.num_processes < 1:
            _fail("dist.num_processes", self.num_processes, "must be >= 1", "use 1 for a single process")
        if not 0 <= self.process_id < self.num_processes:
            _fail(
                "dist.process_id",
                self.process_id,
                f"must be in [0, num_processes = {self.num_processes})",
                "number processes 0..N-1",
            )
        if self.num_processes > 1 and not self.coordinator:
            _fail(
                "dist.coordinator",
                self.coordinator,
                "several processes need the coordinator address",
                "set dist.coordinator=host:port (process 0's host)",
            )


# Sections that may change between a save and a resume: they never touch the trajectory.
RESUME_MUTABLE_SECTIONS = ("run", "ckpt", "trace", "dist", "eval")
# Keys that no longer exist, with the one value they may still carry in older run directories' config.yaml
# (loading drops them) and in the trajectory hash (so those runs keep their hash and resume).
RETIRED = {"debug.nonfinite_guard": True}  # the guard is always on; scripts/det_tax.py's `+noguard` prices it


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        self.mesh.validate()
        self.dist.validate()
        self.trace.validate()
        self.debug.validate()
        self.model.validate()
        self.train.validate()
        self.data.validate()
        self.eval.validate()
        self.run.validate()
        self.ckpt.validate()
        self.determinism.validate()
        for problem in cross_section_problems(self):
            _fail(*problem)
        for problem in layout_problems(self):
            _fail(*problem)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def trajectory_dict(self) -> dict[str, Any]:
        """The fields that define the trajectory (bookkeeping sections removed). train.steps is not one of them:
        it only says where the run stops. The schedule's horizon is (train.decay_steps, or train.steps when that
        is 0), so a run extended with a larger train.steps and the same horizon keeps its hash."""
        d = self.to_dict()
        for s in RESUME_MUTABLE_SECTIONS:
            d.pop(s)
        t = d["train"]
        t["decay_steps"] = t["decay_steps"] or t.pop("steps")
        t.pop("steps", None)
        t.pop("grad_accumulation_fusion")  # speed only: the same bits either way (tests/test_step.py)
        if self.determinism.canonical:  # mesh and microbatch size are schedule choices there, not numerics
            d.pop("mesh")
            t.pop("micro_batch")
        if not self.model.fp8.lm_head:  # added later: absent means off, so older configs keep their hash
            d["model"]["fp8"].pop("lm_head")
        if self.model.flash_backend == "triton":  # added later: absent means triton, older configs keep their hash
            d["model"].pop("flash_backend")
        if not self.determinism.canonical:  # the leaf is not part of default numerics; 1 keeps older hashes
            d["determinism"]["canonical_leaf"] = 1
        for dotted, value in RETIRED.items():
            section, key = dotted.split(".")
            d[section][key] = value
        return d

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.trajectory_dict(), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and "off" in allowed and not value:
            value = "off"  # YAML 1.1 reads a bare `off` as false
        if value not in allowed or isinstance(value, bool):
            _fail(key, value, f"is not one of {list(allowed)}", f"use one of {list(allowed)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, value, "must be a bool", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, f"must be an int, got {type(value).__name__}", "write a whole number")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e6` (no dot) as a string; a number is what was meant
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, value, f"must be a float, got {type(value).__name__}", "write a number such as 3e-4")
        return float(value)
    if tp is str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # YAML reads `steps: 3` or `name: 7` as an int
        if not isinstance(value, str):
            _fail(key, value, f"must be a string, got {type(value).__name__}", "quote the value")
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(prefix or "<root>", data, "must be a mapping", "write `key: value` lines under it")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if full in RETIRED and value == RETIRED[full]:  # an older run directory's config: same meaning
            continue
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean '{prefix + '.' if prefix else ''}{near[0]}'?" if near else f"valid: {names}"
            raise ConfigError(f"unknown config key '{full}'. Fix: remove it or rename it; {hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, full)
        else:
            kwargs[key] = _coerce(full, tp, value)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section. Fix: check the key path")
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        node[parts[-1]] = raw  # not YAML (e.g. a pattern starting with '*'): the plain string; types still checked


def _yaml_problem(e: Exception) -> str:
    """A YAML parse error in one line: where (1-based line, column) and what."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load YAML (or defaults when path is None), then apply `a.b=value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file '{p}' is a directory. Fix: pass a YAML file, e.g. configs/tiny.yaml")
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist. Fix: pass an existing YAML file")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            problem = _yaml_problem(e)
            raise ConfigError(f"config file '{p}' is not valid YAML: {problem}. Fix: correct the syntax") from e
        if loaded is None:
            raise ConfigError(
                f"config file '{p}' is empty. Fix: give at least one section, e.g. copy configs/tiny.yaml"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at top level, got {type(loaded).__name__}")
        tree = loaded
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not key=value. Fix: write e.g. train.steps=50")
        k, v = ov.split("=", 1)
        _set_dotted(tree, k.strip(), v.strip())
    return _build(Config, tree, "")


def config_from_dict(d: dict[str, Any]) -> Config:
    return _build(Config, d, "")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
