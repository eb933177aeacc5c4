"""Tensor, expert, FSDP and data-parallel cells on 8 CPU devices (pipeline cells: test_mesh_pipeline.py)."""

import pytest
from _cells import CELLS, Reference, check_cell

DENSE = [c for c, m in CELLS.items() if m.get("pipeline", 1) == 1]
HEAVY = {"tp2-ep4", "fsdp8-ep4"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.slow) if c in HEAVY else c for c in DENSE])
def test_cell_repeats_bitwise_and_tracks_single_device(cell, tmp_path, reference):
    check_cell(cell, tmp_path, reference)
