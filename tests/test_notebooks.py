"""The layout notebooks (notebooks/*.ipynb): committed without outputs, executed here end to end.

Each notebook imports qpn, draws with matplotlib (the inline backend renders with Agg: no display
needed) and ends with a cell of assertions about what it showed, so executing it is the test.
Run on CPU; the three together take about 25 s on the 2-core CI machine (the numerics notebook
loads all-MiniLM-L6-v2 and dequantizes its 10.8 M weights four ways).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ["qpn2_layout.ipynb", "qpn8_layout.ipynb", "numerics.ipynb"]
CELL_TIMEOUT_S = 180  # per cell; the slowest cell (numerics: 37 layers x 4 dequantizations) takes about 8 s


def read(name: str):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def test_the_notebook_folder_holds_exactly_the_three_notebooks():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs_importing_qpn_and_ending_with_assertions(name):
    nb = read(name)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), "clear the outputs"
    assert any("from qpn" in cell.source for cell in code)
    assert nb.cells[-1].cell_type == "code" and "assert " in nb.cells[-1].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_assertions_hold(name, tmp_path):
    nb = read(name)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises CellExecutionError on failure
    outputs = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs), "the notebook drew no picture"
    assert "all checks passed" in "".join(output.get("text", "") for output in nb.cells[-1].outputs)
