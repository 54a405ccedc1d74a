"""Execute the notebooks in place, outputs and figures included, and stamp them.

    python notebooks/execute.py                     # all three
    python notebooks/execute.py numerics.ipynb      # some
    python notebooks/execute.py --check             # only say which are stale (no kernel, instant)

The notebooks are committed executed, so that a reader on GitHub sees their figures. Each code
cell carries `metadata.qpn.source_sha256`, the sha256 of its source when it was executed, and the
notebook carries `metadata.qpn.code_sha256` over all its code cells in order. tests/test_notebooks.py
fails when a stamp is missing or no longer matches (a cell edited, added, removed or moved without
re-running this script), when an output is an error or on stderr, and when re-executing the
notebook prints other text than the committed outputs hold (figures are compared by count only:
their PNG bytes depend on the matplotlib version).

Every run is a fresh kernel (the `python3` kernel of this interpreter) from the first cell to the
last, in a temporary folder; a notebook whose cell raises is left untouched. What varies between
two runs of the same code is removed: execution timings are not recorded, execution counts are
1, 2, ... in cell order, and the notebook's `language_info` is reduced to the language name (the
kernel reports its interpreter version there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent
NOTEBOOKS = ("qpn2_layout.ipynb", "qpn8_layout.ipynb", "numerics.ipynb")
COMMAND = "python notebooks/execute.py"
KERNEL = "python3"
# Generous: the slowest cell (numerics: 37 layers x 4 dequantizations) takes about 8 s on an idle
# 2-core machine, a kernel starts in about 2 s; a loaded machine must not turn that into a failure.
CELL_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 300
STAMP = "qpn"  # the metadata key of the stamps, in each code cell and in the notebook


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def code_sha256(nb) -> str:
    """One hash over the code cells' sources in order: catches a code cell added, removed or moved."""
    return sha256(json.dumps([cell.source for cell in code_cells(nb)]))


def execute(nb, cwd: str | Path | None = None):
    """Run `nb` (in place) in a fresh kernel from a clean slate; raises CellExecutionError if a cell raises."""
    for cell in code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    with tempfile.TemporaryDirectory() as scratch:
        NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, startup_timeout=STARTUP_TIMEOUT_S,
                       record_timing=False, resources={"metadata": {"path": str(cwd or scratch)}}).execute()
    return nb


def stamp(nb):
    """Strip what varies from run to run and stamp each code cell with its source's hash (in place)."""
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata[STAMP] = {"code_sha256": code_sha256(nb)}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    for count, cell in enumerate(code_cells(nb), start=1):
        cell.execution_count = count
        for output in cell.outputs:
            if output.output_type == "execute_result":
                output.execution_count = count
        cell.metadata[STAMP] = {"source_sha256": sha256(cell.source)}
    return nb


def problems(nb) -> list[str]:
    """Why `nb` is not a fresh, clean, stamped execution of its own code ([] when it is)."""
    found = []
    if nb.metadata.get(STAMP, {}).get("code_sha256") != code_sha256(nb):
        found.append("its code cells were added, removed, moved or edited after it was executed")
    if nb.metadata.get("language_info") != {"name": "python"}:
        found.append("its metadata.language_info holds more than the language name")
    for count, cell in enumerate(code_cells(nb), start=1):
        first_line = (cell.source.strip().splitlines() or [""])[0]
        where = f"code cell {count} ({first_line[:50]!r})"
        recorded = cell.metadata.get(STAMP, {}).get("source_sha256")
        if recorded is None:
            found.append(f"{where} has no stamp (metadata.{STAMP}.source_sha256): never executed by {COMMAND}")
        elif recorded != sha256(cell.source):
            found.append(f"{where} was edited after it was executed")
        if cell.execution_count != count:
            found.append(f"{where} has execution count {cell.execution_count}, not {count}")
        if "execution" in cell.metadata:
            found.append(f"{where} holds execution timings")
        for output in cell.outputs:
            if output.output_type == "error":
                found.append(f"{where} ended in {output.ename}: {output.evalue}")
            elif output.output_type == "stream" and output.name == "stderr":
                found.append(f"{where} wrote to stderr: {output.text.strip()[:200]!r}")
    return found


def text_outputs(nb) -> list[list[tuple]]:
    """Per code cell, what its outputs say: stdout text, each result's or display's text/plain and MIME
    types. Figures count by their MIME type only (their PNG bytes vary with the matplotlib version);
    stderr is left out (warnings of the environment: problems() keeps it out of the committed files)."""
    said = []
    for cell in code_cells(nb):
        items = []
        for output in cell.outputs:
            if output.output_type == "stream":
                if output.name == "stdout":
                    items.append(("stdout", output.text))
            elif output.output_type in ("display_data", "execute_result"):
                items.append((output.output_type, tuple(sorted(output.data)), output.data.get("text/plain", "")))
            else:
                items.append((output.output_type, output.get("ename", ""), output.get("evalue", "")))
        said.append(items)
    # consecutive stdout chunks: how a print is split into messages is the kernel's business
    merged = []
    for items in said:
        cell: list[tuple] = []
        for item in items:
            if item[0] == "stdout" and cell and cell[-1][0] == "stdout":
                cell[-1] = ("stdout", cell[-1][1] + item[1])
            else:
                cell.append(item)
        merged.append(cell)
    return merged


def figures(nb) -> int:
    return sum("image/png" in output.get("data", {}) for cell in code_cells(nb) for output in cell.outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help=f"names in notebooks/ (default: {' '.join(NOTEBOOKS)})")
    parser.add_argument("--check", action="store_true", help="only report stale notebooks; exit 1 if any")
    args = parser.parse_args(argv)
    names = [Path(name).name for name in args.notebooks] or list(NOTEBOOKS)
    unknown = sorted(set(names) - set(NOTEBOOKS))
    if unknown:
        parser.error(f"not one of {', '.join(NOTEBOOKS)}: {', '.join(unknown)}")
    failed = False
    for name in names:
        path = NOTEBOOK_DIR / name
        nb = nbformat.read(path, as_version=4)
        if args.check:
            found = problems(nb)
            print(f"{name}: " + ("up to date" if not found else "stale:\n  " + "\n  ".join(found)))
            failed |= bool(found)
            continue
        print(f"{name}: executing ...", flush=True)
        try:
            stamp(execute(nb))
        except Exception as exc:  # CellExecutionError, a dead or slow kernel: the file stays as it was
            print(f"{name}: FAILED, left unchanged\n{exc}", file=sys.stderr)
            failed = True
            continue
        tmp = path.with_name(f".{path.name}.tmp")  # a whole notebook or the old one, never half of one
        nbformat.write(nb, tmp)
        os.replace(tmp, path)
        found = problems(nb)
        print(f"{name}: written, {figures(nb)} figures, {path.stat().st_size / 1e3:.0f} kB"
              + ("" if not found else "; but the tests will reject it:\n  " + "\n  ".join(found)))
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
