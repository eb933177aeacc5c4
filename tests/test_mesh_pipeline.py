"""Pipeline cells on 8 CPU devices (GPipe, 1F1B, interleaved), each with a single-device reference."""

import pytest
from _cells import CELLS, Reference, check_cell

PIPELINE = [c for c, m in CELLS.items() if m.get("pipeline", 1) > 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("ref"))


@pytest.mark.slow
# pp4 is covered in kind by pp2-vpp2 (four stage chunks, the interleaved schedule): `pytest -m extended`
@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.extended) if c == "pp4" else c for c in PIPELINE])
def test_cell_repeats_bitwise_and_tracks_single_device(cell, tmp_path, reference):
    check_cell(cell, tmp_path, reference)
