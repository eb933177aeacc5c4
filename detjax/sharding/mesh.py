"""Mesh construction. The axis names are fixed; degrees come from config once meshes land (issue 3)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "pipeline", "expert")


def single_device_mesh() -> Mesh:
    """All axes of degree 1 on the first local device."""
    return Mesh(np.array(jax.local_devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
