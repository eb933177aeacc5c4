"""Test setup. XLA reads XLA_FLAGS once, so they are set here, before anything imports jax."""

import os
import sys
from pathlib import Path

_FLAGS = [
    "--xla_force_host_platform_device_count=8",
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
    # canonical numerics' flag (detjax.determinism.CANONICAL_XLA_FLAGS): canonical tests run in this process
    "--xla_allow_excess_precision=false",
]
if os.environ.get("DETJAX_TEST_GPU") != "1":
    # CPU codegen at LLVM -O0: the tests' shapes are tiny, so compiling dominates and running is cheap
    # (-O0 cuts a mesh cell by about a third). Every test compares runs made under these same flags (subprocesses
    # inherit them), so no bitwise comparison mixes programs built with different codegen settings.
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
_have = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_have + [f for f in _FLAGS if f not in _have])
os.environ.setdefault("JAX_PLATFORMS", "cpu") if os.environ.get("DETJAX_TEST_GPU") != "1" else None
# On a GPU the tests' processes allocate as they go: a subprocess (the scatter-add control) cannot get memory when
# this process has already preallocated most of the card.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false") if os.environ.get("DETJAX_TEST_GPU") == "1" else None
# Compilation dominates the suite. A persistent compilation cache in the checkout (git-ignored) lets the
# test subprocesses (CLI runs, resume stops, the mesh sweep) and the two xdist workers load a program that
# another process already compiled, instead of compiling it again; a fresh clone starts with it empty.
# Loading an executable gives the same program XLA would compile, so no determinism test is weakened.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


# The README runs two xdist workers with --dist loadfile: each takes whole files, in collection order, as it
# frees up. Longest files first (summed test time per file, 2 cores, jax 0.12.0.1, the compilation cache warm,
# 2026-12-06: pallas 187 s, fp8 138, ckpt 119, mesh 114, canonical 96, matmul 84, train 51, trace 34, step 34,
# flash_mosaic 29, mesh_cells 24; 1018 s in all), so that no heavy file starts last and runs alone.
HEAVY_FIRST = (
    "test_pallas",
    "test_fp8",
    "test_ckpt",
    "test_mesh",
    "test_canonical",
    "test_matmul",
    "test_train",
    "test_trace",
    "test_step",
    "test_flash_mosaic",
    "test_mesh_cells",
    "test_mesh_pipeline",
)


def _file_rank(item) -> int:
    stem = Path(str(item.fspath)).stem
    return HEAVY_FIRST.index(stem) if stem in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: the order inside each file is kept
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with DETJAX_TEST_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return TINY


@pytest.fixture(scope="module")
def python() -> str:
    return sys.executable
