"""The structure numbers of issue 21 (not a speed benchmark): how often the code asks a weight which
format it is, and how the rooms are cut. Run on a checkout (default: this one) or a commit:

    python benchmarks/structure_counts.py [--commit REV]

Counted in the package (ref, checkpoints, cupy_kernels, torch_bridge, apps and the root modules;
tests, benchmarks and notebooks left out):
- format branches: lines that test which format a weight is (`is QPN2`, `is not QPN8_BLOCK`,
  `== QPN2.format`, `fmt == ...`, `== "nvfp4"`, isinstance with a format-named class);
- format-named functions in cupy_kernels/ and torch_bridge/: a def whose name holds nvfp4 / fp8 /
  qpn2 / qpn8 / mxfp4;
- op registrations (custom_op, register_kernel, register_fake) and `*_trusted` functions;
- parameters named `fmt`, and the places that choose a linear's path (a def that reads a threshold:
  decode_threshold / gemm_threshold / FUSED_MAX_M / GEMM_MAX_M) outside the tables that define them;
- import cycles between modules (function-level imports included; tests/test_layout.py's graph);
- the largest function and module.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import test_layout  # noqa: E402  (the module graph and the cycle finder of the layout test)

FORMAT_BRANCH = re.compile(
    r"\bis(?: not)?\s+(?:QPN2|QPN8|QPN8_BLOCK|MXFP4)\b"
    r"|==\s*(?:QPN2|QPN8|QPN8_BLOCK|MXFP4)\.(?:format|key)\b"
    r"|\bfmt\s*[!=]="
    r"|[!=]=\s*[\"'](?:nvfp4|fp8|qpn2|qpn8|qpn8_block|mxfp4)[\"']"
    r"|isinstance\([^)]*(?:NVFP4|FP8|MXFP4)\w*"
)
FORMAT_NAME = re.compile(r"nvfp4|fp8|qpn2|qpn8|mxfp4", re.IGNORECASE)
DISPATCH_NAMES = ("decode_threshold", "gemm_threshold", "FUSED_MAX_M", "GEMM_MAX_M")


def modules(root: Path) -> list[Path]:
    test_layout.ROOT = root
    return sorted(set(test_layout.package_modules()) | set(root.glob("*.py")))


def _defs(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def counts(root: Path) -> dict[str, object]:
    paths = modules(root)
    trees = {p: ast.parse(p.read_text()) for p in paths}
    rel = {p: str(p.relative_to(root)) for p in paths}
    kernel_side = [p for p in paths if rel[p].startswith(("cupy_kernels/", "torch_bridge/"))]
    branches = sum(len(FORMAT_BRANCH.findall(line)) for p in paths for line in p.read_text().splitlines()
                   if not line.lstrip().startswith("#"))
    named = [f.name for p in kernel_side for f in _defs(trees[p]) if FORMAT_NAME.search(f.name)]
    text = "\n".join(p.read_text() for p in paths)
    registrations = len(re.findall(r"@torch\.library\.custom_op|\.register_kernel\(|\.register_fake\b", text))
    trusted = [f.name for p in paths for f in _defs(trees[p]) if f.name.endswith("_trusted")]
    fmt_params = [f"{rel[p]}:{f.name}" for p in paths for f in _defs(trees[p])
                  if any(a.arg == "fmt" for a in f.args.args + f.args.kwonlyargs)]
    dispatch = sorted({f"{rel[p]}:{f.name}" for p in paths for f in _defs(trees[p])
                       if f.name not in DISPATCH_NAMES
                       and any(isinstance(n, ast.Name | ast.Attribute) and (getattr(n, "id", None) or
                               getattr(n, "attr", None)) in DISPATCH_NAMES for n in ast.walk(f))})
    graph = {rel[p]: {t for t in test_layout.imported_modules(p) if t != rel[p]} for p in paths}
    functions = [(f.end_lineno - f.lineno + 1, f"{rel[p]}:{f.name}") for p in paths for f in _defs(trees[p])]
    biggest_module = max((len(p.read_text().splitlines()), rel[p]) for p in paths)
    return {
        "format branches": branches,
        "format-named functions (cupy_kernels/, torch_bridge/)": len(named),
        "op registrations": registrations,
        "*_trusted functions": len(trusted),
        "functions with a parameter named fmt": len(fmt_params),
        "functions that read a path threshold": f"{len(dispatch)} ({', '.join(dispatch)})",
        "import cycles": f"{len(test_layout.import_cycles(graph))} "
                         f"{[' <-> '.join(c) for c in test_layout.import_cycles(graph)]}",
        "largest function": "{} lines, {}".format(*max(functions)),
        "largest module": "{} lines, {}".format(*biggest_module),
        "modules": len(paths),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", help="count this commit of the repository (a temporary worktree)")
    args = parser.parse_args(argv)
    root = HERE.parent
    if args.commit is None:
        result = counts(root)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "-C", str(root), "worktree", "add", "-q", "--detach", tmp, args.commit], check=True)
            try:
                result = counts(Path(tmp))
            finally:
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", tmp], check=True)
    for name, value in result.items():
        print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
