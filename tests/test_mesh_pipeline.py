"""Pipeline cells on 8 CPU devices (GPipe, 1F1B, interleaved), each with a single-device reference."""

import pytest
from _cells import CELLS, Reference, check_cell

PIPELINE = [c for c, m in CELLS.items() if m.get("pipeline", 1) > 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("ref"))


# Default: dp2-tp2-pp2 (pipeline with data and tensor parallelism). pp2 alone, tp2-pp2 and the 4-chunk
# schedules (pp4, interleaved pp2-vpp2) are `pytest -m extended`; every cell's shardings are pinned by the
# golden files in test_mesh.py.
EXTENDED = {"pp2", "pp4", "pp2-vpp2", "tp2-pp2"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "cell", [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c for c in PIPELINE]
)
def test_cell_repeats_bitwise_and_tracks_single_device(cell, tmp_path, reference):
    check_cell(cell, tmp_path, reference)
