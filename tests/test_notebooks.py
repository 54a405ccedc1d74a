"""The layout notebooks (notebooks/*.ipynb): committed executed, figures included, and kept fresh.

A reader on GitHub sees the committed outputs, so they are committed (issue 20, item 6), written by
`python notebooks/execute.py`: a fresh kernel from the first cell to the last, each code cell stamped
with the sha256 of its source (`metadata.qpn.source_sha256`), the notebook with one hash over all
its code cells. Here:
- the committed files carry every stamp, and each stamp matches its cell (no cell edited, added,
  removed or moved since), with no error and no stderr among the outputs, and figures;
- each notebook is executed again: it draws with matplotlib (the inline backend renders with Agg:
  no display needed) and ends with a cell of assertions about what it showed, so executing it is
  the test; and what it prints must be what the committed outputs say (figures are compared by
  count only: their PNG bytes depend on the matplotlib version).
Run on CPU; the three together take about 30 s on the 2-core CI machine (the numerics notebook
loads all-MiniLM-L6-v2 and dequantizes its 10.8 M weights four ways). No timing is asserted; the
timeouts (notebooks/execute.py) are generous for a loaded machine.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
_spec = importlib.util.spec_from_file_location("qpn_notebooks_execute", NOTEBOOK_DIR / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

NOTEBOOKS = list(execute.NOTEBOOKS)
FIX = f"run `{execute.COMMAND}` and commit the notebooks"


def read(name: str):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def test_the_notebook_folder_holds_exactly_the_three_notebooks():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_executed_with_figures_and_stamped_with_their_sources(name):
    nb = read(name)
    nbformat.validate(nb)
    code = execute.code_cells(nb)
    assert any("from qpn" in cell.source for cell in code)
    assert nb.cells[-1].cell_type == "code" and "assert " in nb.cells[-1].source
    problems = execute.problems(nb)
    assert not problems, f"notebook {name} is stale: {FIX}.\n  " + "\n  ".join(problems)
    assert execute.figures(nb) > 0, f"notebook {name} is committed without its figures: {FIX}"
    assert "all checks passed" in "".join(output.get("text", "") for output in nb.cells[-1].outputs), FIX


def test_the_staleness_check_sees_an_edit_a_missing_stamp_a_moved_cell_and_an_error():
    nb = read("qpn2_layout.ipynb")
    assert execute.problems(nb) == []

    edited = copy.deepcopy(nb)
    execute.code_cells(edited)[1].source += "\n"
    assert any("code cell 2" in p and "edited" in p for p in execute.problems(edited))

    unstamped = copy.deepcopy(nb)
    del execute.code_cells(unstamped)[0].metadata[execute.STAMP]
    assert any("code cell 1" in p and "no stamp" in p for p in execute.problems(unstamped))

    moved = copy.deepcopy(nb)  # each cell keeps its own stamp; the notebook's hash sees the order
    first, second = (moved.cells.index(cell) for cell in execute.code_cells(moved)[1:3])
    moved.cells[first], moved.cells[second] = moved.cells[second], moved.cells[first]
    assert any("moved" in p for p in execute.problems(moved))

    failed = copy.deepcopy(nb)
    execute.code_cells(failed)[0].outputs.append(
        nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[]))
    assert any("ValueError: boom" in p for p in execute.problems(failed))

    cleared = copy.deepcopy(nb)  # the state this test suite enforced before: no outputs
    for cell in execute.code_cells(cleared):
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop(execute.STAMP)
    assert len(execute.problems(cleared)) >= len(execute.code_cells(cleared))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_its_assertions_hold_and_it_prints_what_is_committed(name):
    committed = read(name)
    nb = execute.stamp(execute.execute(copy.deepcopy(committed)))  # raises CellExecutionError on failure
    assert execute.figures(nb) > 0, "the notebook drew no picture"
    assert "all checks passed" in "".join(output.get("text", "") for output in nb.cells[-1].outputs)
    fresh, stored = execute.text_outputs(nb), execute.text_outputs(committed)
    stale = [f"code cell {i}:\n    committed {old}\n    now       {new}"
             for i, (old, new) in enumerate(zip(stored, fresh, strict=True), start=1) if old != new]
    assert not stale, f"notebook {name} is stale (its code now prints other outputs): {FIX}.\n  " + "\n  ".join(stale)
