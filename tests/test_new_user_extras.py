"""What a new user following the README in a clone needs besides qpn itself (issue 38, item 8).

- The README's vLLM example writes ./tiny-llama-nvfp4 in the clone: git ignores it (it was left untracked).
- The notebooks: an extra `notebooks` installs what opens them (JupyterLab, nbconvert), runs them (every
  third-party module their cells import) and refreshes them (what notebooks/execute.py imports), and the
  README says how to install it and open them.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
OWN = {"qpn", "numpy", "torch"}  # qpn and its own dependencies (each import name is its distribution's here)


def top_level_imports(source: str) -> set[str]:
    tree = ast.parse(source)
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
              and n.module}
    return names


def extra(name: str) -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert name in extras, f"pyproject.toml has no [{name}] extra: {sorted(extras)}"
    return [re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in extras[name]]


def test_the_notebooks_extra_opens_runs_and_refreshes_them():
    packages = extra("notebooks")
    assert {"jupyter", "nbconvert", "ipykernel"} <= set(packages), packages
    cells = {m for path in NOTEBOOKS.glob("*.ipynb") for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"
             for m in top_level_imports("\n".join(line for line in "".join(cell["source"]).splitlines()
                                                  if not line.lstrip().startswith(("%", "!"))))}
    script = top_level_imports((NOTEBOOKS / "execute.py").read_text())
    needed = {m for m in cells | script if m not in sys.stdlib_module_names} - OWN - {"__future__"}
    assert {"matplotlib", "nbclient", "nbformat"} <= needed, needed  # the check sees what it guards
    missing = needed - set(packages)
    assert not missing, f"imported by the notebooks or execute.py, not in the [notebooks] extra: {missing}"


def test_the_readme_says_how_to_open_the_notebooks():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[notebooks]"' in readme and "jupyter lab notebooks/" in readme


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_ignores_the_readme_examples_tiny_llama():
    proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", "tiny-llama-nvfp4/model.safetensors"], cwd=ROOT)
    assert proc.returncode == 0, "the README's `python -m qpn.apps.tiny_llama ./tiny-llama-nvfp4` leaves a folder"
