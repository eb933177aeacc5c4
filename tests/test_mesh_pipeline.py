"""Pipeline cells on 8 CPU devices (GPipe, 1F1B, interleaved), each with a single-device reference."""

import pytest
from _cells import CELLS, Reference, check_cell

PIPELINE = [c for c, m in CELLS.items() if m.get("pipeline", 1) > 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("ref"))


# Every pipeline cell is `pytest -m extended` (dp2-tp2-pp2 took 177 s of the default run). The default run
# still executes the dp2-tp2-pp2 pipeline: test_mesh.py's two-process test runs it as 2 processes x 4
# devices and as 1 x 8 and requires byte-equal fingerprints; every cell's shardings are pinned by the golden
# files in test_mesh.py.
EXTENDED = {"dp2-tp2-pp2", "pp2", "pp4", "pp2-vpp2", "tp2-pp2"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "cell", [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c for c in PIPELINE]
)
def test_cell_repeats_bitwise_and_tracks_single_device(cell, tmp_path, reference):
    check_cell(cell, tmp_path, reference)
