"""Mesh construction from `mesh:` in config; impossible layouts fail here, before anything compiles."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from detjax.config import Config, ConfigError, MeshConfig
from detjax.sharding.rules import Layout

MESH_AXES = MeshConfig.AXES  # the one list of mesh axes, in mesh order


def resolve_degrees(cfg: Config, n_devices: int) -> dict[str, int]:
    """Mesh degrees with the -1 axis filled; errors name the axis and the numbers."""
    deg = cfg.mesh.degrees()
    known = math.prod(d for d in deg.values() if d != -1)
    fill = [a for a, d in deg.items() if d == -1]
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"mesh: the fixed degrees { ({a: d for a, d in deg.items() if d != -1}) } multiply to {known}, "
                f"which does not divide the {n_devices} devices, so mesh.{fill[0]}=-1 cannot be filled. "
                "Fix: choose degrees whose product divides the device count"
            )
        deg[fill[0]] = n_devices // known
    elif known != n_devices:
        raise ConfigError(
            f"mesh: degrees {deg} multiply to {known} but {n_devices} devices are present. "
            "Fix: make the product equal the device count, or set one axis (e.g. mesh.data) to -1"
        )
    batch_ways = deg["data"] * deg["fsdp"] * deg["expert"]
    mb = cfg.train.micro_batch
    if mb % batch_ways and not cfg.determinism.canonical:  # canonical numerics runs one leaf at a time
        raise ConfigError(
            f"config key 'train.micro_batch' = {mb}: a microbatch is split over data x fsdp x expert = "
            f"{deg['data']} x {deg['fsdp']} x {deg['expert']} = {batch_ways} devices and must be divisible by it. "
            f"Fix: use a micro_batch that is a multiple of {batch_ways}"
        )
    return deg


def build_layout(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Layout:
    """The mesh over `devices` (default: all devices of all processes) and the rules switches for cfg."""
    if devices is None:
        devices = jax.devices()
        n = cfg.mesh.devices or len(devices)
        if n > len(devices):
            raise ConfigError(
                f"config key 'mesh.devices' = {n}: only {len(devices)} devices are present. "
                "Fix: use 0 (all devices) or a smaller count"
            )
        if n < len(devices) and jax.process_count() > 1:
            raise ConfigError(
                f"config key 'mesh.devices' = {n}: a multi-process run must span all {len(devices)} devices. "
                "Fix: set mesh.devices=0"
            )
        devices = devices[:n]
    devices = list(devices)
    if cfg.model.attention_impl == "cudnn" and devices[0].platform != "gpu":
        raise ConfigError(
            f"config key 'model.attention_impl' = 'cudnn': cuDNN's fused attention needs an NVIDIA GPU, and "
            f"these devices are {devices[0].platform}. Fix: use model.attention_impl=reference on this machine"
        )
    cc = getattr(devices[0], "compute_capability", "")
    mosaic_flash = cfg.model.kernels == "pallas" and cfg.model.flash_backend == "mosaic"
    if mosaic_flash and devices[0].platform == "gpu" and cc != "9.0":
        raise ConfigError(
            f"config key 'model.flash_backend' = 'mosaic': the Mosaic GPU flash attention needs a Hopper GPU "
            f"(compute capability 9.0); this one has {cc or 'an unknown one'}. Fix: use model.flash_backend=triton"
        )
    # Under canonical numerics the model runs inside shard_map, one leaf per device at a time with whole
    # weights, so each kernel sees one device's arrays; elsewhere the partitioner would have to split them.
    if cfg.model.kernels == "pallas" and len(devices) > 1 and not cfg.determinism.canonical:
        raise ConfigError(
            f"config key 'model.kernels' = 'pallas': the Pallas kernels run on a single-device mesh, or on data, "
            f"fsdp and expert meshes under canonical numerics; this mesh has {len(devices)} devices. Fix: set "
            "mesh.devices=1, determinism.numerics=canonical, or model.kernels=reference"
        )
    deg = resolve_degrees(cfg, len(devices))
    # Row-major over (data, fsdp, tensor, pipeline, expert): the last axis varies fastest, so expert
    # neighbours are adjacent device ids, pipeline neighbours are `expert` ids apart and tensor neighbours
    # `pipeline * expert` ids apart; a process's contiguous block of device ids covers whole trailing axes.
    grid = np.array(devices, dtype=object).reshape([deg[a] for a in MESH_AXES])
    mesh = Mesh(grid, MESH_AXES)
    mesh_cfg = dataclasses.replace(cfg.mesh, **deg)
    return Layout(mesh, mesh_cfg, replicate_kv=cfg.model.n_kv_heads % deg["tensor"] != 0)


def single_device_mesh() -> Mesh:
    """All axes of degree 1 on the first local device."""
    return Mesh(np.array(jax.local_devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
