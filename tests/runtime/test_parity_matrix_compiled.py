"""The parity matrix's compile column (tests/parity_matrix.py), a file of its own: its cells compile for
minutes, and `--dist loadfile` gives a file to one worker, so with the other columns they held one worker
while the other sat idle at the end of the suite."""

from __future__ import annotations

import pytest

from parity_matrix import CELLS, check_cell


@pytest.mark.parametrize("cell", [c for c in CELLS if c.mode == "compile"], ids=str)
def test_the_cell_gives_the_oracles_tokens(cell, exports):
    check_cell(cell, exports)
