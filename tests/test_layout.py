"""The layout tells the truth (issue 14, item 3): every library module lives in a named part, the
package imports itself one way only (relative imports), and the import graph between the parts
is one-way, as docs/ARCHITECTURE.md draws it:

    ref -> checkpoints -> torch_bridge -> apps,   ref -> cupy_kernels -> torch_bridge

(an arrow: the right side may import the left). The root holds the package's `__init__.py` and
`__main__.py` only: no re-export modules (issue 21). Between modules too the graph has no cycle.
Imports inside functions count too: a lazy import is still an edge of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("ref", "checkpoints", "cupy_kernels", "torch_bridge", "apps")
ALLOWED = {  # part -> the parts it may import (itself always)
    "ref": set(),
    "checkpoints": {"ref"},
    "cupy_kernels": {"ref"},
    "torch_bridge": {"ref", "checkpoints", "cupy_kernels"},
    "apps": {"ref", "checkpoints", "cupy_kernels", "torch_bridge"},
}
ROOT_MODULES = {"__init__.py", "__main__.py"}


def package_modules() -> list[Path]:
    return sorted(p for part in PARTS for p in (ROOT / part).rglob("*.py")) + sorted(ROOT / m for m in ROOT_MODULES)


def imported_parts(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, import text, part ("" for the package root), absolute?) of every import of the
    package in `path`."""
    rel = path.relative_to(ROOT)
    here = list(rel.parts[:-1])  # the package path of the module's folder, from the root
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}", (a.name.split(".") + [""])[1], True)
                      for a in node.names if a.name.split(".")[0] == "qpn"]
        elif isinstance(node, ast.ImportFrom):
            text = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            if node.level == 0:
                if (node.module or "").split(".")[0] == "qpn":
                    found.append((node.lineno, text, (node.module.split(".") + [""])[1], True))
                continue
            base = here[: len(here) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            if target:
                found.append((node.lineno, text, target[0], False))
            else:  # from .. import a, b: each name is a part or a root name (__version__)
                found += [(node.lineno, text, a.name if a.name in PARTS else "", False) for a in node.names]
    return found


def test_no_library_code_at_the_root():
    root_py = {p.name for p in ROOT.glob("*.py")}
    assert root_py == ROOT_MODULES, root_py ^ ROOT_MODULES


def test_no_module_only_re_exports_another():
    """No shims: a module whose body is a docstring and imports, or a name imported `as` itself with
    a "kept for imports" comment, is a second name for code that lives elsewhere."""
    shims = [str(p.relative_to(ROOT)) for p in package_modules() if p.name != "__init__.py"
             and all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr)) for n in ast.parse(p.read_text()).body)]
    kept = [f"{p.relative_to(ROOT)}:{i}" for p in package_modules()
            for i, line in enumerate(p.read_text().splitlines(), 1) if "kept for imports" in line]
    assert not shims and not kept, f"re-export modules {shims}, aliases {kept}"


def module_of(parts: list[str]) -> str | None:
    """The module a dotted path inside the package names: a .py file or a package's __init__.py."""
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return "/".join(parts) + ".py"
    if (path / "__init__.py").is_file():
        return "/".join(parts + ["__init__.py"]) if parts else "__init__.py"
    return None


def imported_modules(path: Path) -> set[str]:
    """The package's modules that `path` imports, at module level or inside functions (relative imports:
    `test_the_package_imports_itself_relatively` holds); `from . import x` names the module x."""
    here = list(path.relative_to(ROOT).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = module_of(base + [alias.name]) or module_of(base)
                if target is not None:
                    found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_module_graph_has_no_cycle():
    """A package's __init__ imports its modules, so an edge into a package goes to its __init__ only
    where no module of that name exists (`from .. import ref` is the package ref/)."""
    graph = {str(p.relative_to(ROOT)): imported_modules(p) for p in package_modules()}
    graph = {m: {t for t in targets if t != m} for m, targets in graph.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(map(" <-> ".join, cycles))


def test_the_benchmark_scripts_import_one_way():
    """benchmarks/ are scripts that import their siblings as package modules (`from qpn.benchmarks import
    bench_kernels as bk`, `from qpn.benchmarks.bench_decode import ...`: benchmarks/__init__.py)."""
    folder = ROOT / "benchmarks"
    scripts = {p.stem for p in folder.glob("*.py")} | {"ablate"}
    graph: dict[str, set[str]] = {}
    for name in scripts - {"ablate", "__init__"}:
        tree = ast.parse((folder / f"{name}.py").read_text())
        graph[name] = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "qpn.benchmarks"
                       for a in n.names} | \
            {n.module.removeprefix("qpn.benchmarks.") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and (n.module or "").startswith("qpn.benchmarks.")}
        graph[name] &= scripts - {name}
    assert graph["bench_decode"] == {"ablate", "bench_kernels"}  # the check reads the imports it guards
    assert import_cycles(graph) == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 70  # issue 21: rooms small enough to read whole


def test_modules_and_functions_stay_small():
    big_modules = [f"{p.relative_to(ROOT)}: {n}" for p in package_modules()
                   if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    big_functions = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                     for p in package_modules() for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not big_modules and not big_functions, f"modules {big_modules}, functions {big_functions}"


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_itself_relatively():
    absolute = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in package_modules()
                for line, text, _, absolute in imported_parts(p) if absolute]
    assert not absolute, "use relative imports inside the package:\n" + "\n".join(absolute)


def test_the_import_graph_is_one_way():
    wrong = []
    for p in package_modules():
        rel = p.relative_to(ROOT)
        part = rel.parts[0] if len(rel.parts) > 1 else None
        if part is None:
            continue  # the root's __init__ / __main__ / compatibility names
        for line, text, target, _ in imported_parts(p):
            if target not in ("", part) and target not in ALLOWED[part]:
                wrong.append(f"{rel}:{line}: {text}  ({part} -> {target})")
    assert not wrong, "imports against the graph of docs/ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_the_graph_check_sees_edges():
    """The checker itself: a relative import two levels up resolves to the right part."""
    found = imported_parts(ROOT / "torch_bridge" / "vllm" / "methods.py")
    assert any(part == "torch_bridge" for _, _, part, _ in found) and any(part == "ref" for _, _, part, _ in found)


def test_the_old_public_names_still_resolve_without_a_back_edge():
    """qpn.ref.load_checkpoint & co. (docs/DESIGN.md) stay public; importing the reference imports no
    checkpoint I/O (a fresh interpreter: nothing cached)."""
    import subprocess
    import sys

    code = (
        "import sys, qpn.ref as r\n"
        "assert not [m for m in sys.modules if m.startswith('qpn.checkpoints')], 'qpn.ref imported qpn.checkpoints'\n"
        "import qpn.checkpoints as c\n"
        "assert r.load_checkpoint is c.load_checkpoint and r.StoredTensor is c.StoredTensor\n"
        "try:\n    r.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
        "else:\n    raise AssertionError('qpn.ref invented an attribute')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
