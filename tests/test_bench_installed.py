"""`qpn bench` runs from any install (issue 38, item 6), and every flag of what it runs is checked by the parser.

It stopped with "the benchmark scripts ship with the source tree ...; clone the repository": it loaded
benchmarks/*.py by file path from the clone. benchmarks/ now installs as the package qpn.benchmarks, its
scripts import each other as package modules, and `qpn bench` imports them by module name.
- the modules `qpn bench` runs import as package modules in a fresh interpreter, without putting a folder on
  sys.path or a sibling (`bench_kernels`, `ablate`) into sys.modules under a top-level name;
- pyproject installs every package folder of benchmarks/ and the kernel source bench_kernels reads;
- `qpn bench model --tiny --device cpu` runs on a machine without a GPU (it exited 3: "needs a CUDA GPU");
- bad values of every numeric (and name) flag of the three scripts stop with one line and exit 2, before
  any GPU check (they gave tracebacks, KeyErrors, or ran).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qpn.apps import cli

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODULES = sorted(cli.BENCH_MODULES.values())


def test_the_modules_qpn_bench_runs_import_as_package_modules():
    code = (
        "import importlib, sys\n"
        f"path = list(sys.path)\n"
        f"for name in {BENCH_MODULES!r}:\n"
        "    module = importlib.import_module('qpn.benchmarks.' + name)\n"
        "    assert callable(module.build_parser) and callable(module.main), name\n"
        "assert sys.path == path, [p for p in sys.path if p not in path]\n"
        f"print(sorted(m for m in sys.modules if m in {BENCH_MODULES + ['ablate']!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"top-level benchmark modules were imported: {proc.stdout}"


def test_pyproject_installs_every_benchmark_package_and_the_kernel_source():
    text = (ROOT / "pyproject.toml").read_text()
    packages = [f"qpn.{p.parent.relative_to(ROOT).as_posix().replace('/', '.')}"
                for p in sorted((ROOT / "benchmarks").rglob("__init__.py"))]
    assert packages == ["qpn.benchmarks", "qpn.benchmarks.ablate"]
    for package in packages:
        assert f'"{package}"' in text.split("[tool.setuptools.package-dir]")[0], f"{package} is not installed"
    assert '"qpn.benchmarks" = "benchmarks"' in text
    assert '"qpn.benchmarks" = ["*.cu"]' in text and (ROOT / "benchmarks" / "ceiling.cu").is_file()


def test_bench_model_tiny_runs_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["bench", "model", "--tiny", "--device", "cpu", "--batches", "1", "--graphs", "manual",
                     "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads((tmp_path / "out" / "model_tiny.json").read_text())["sections"]["model"]["rows"]
    assert {row["format"] for row in rows} == {"fp16", "nvfp4", "fp8"}
    assert (tmp_path / "out" / "model_tiny.md").is_file()  # --tiny's own name: never the committed model_h200
    assert "wrote" in out and "Traceback" not in err


# (qpn bench arguments, what the one line must say): negative, zero, huge, not a number, and the other
# flags a run would have choked on later (an unknown section: a KeyError; a name with a folder in it)
BAD = [
    (["model", "--layers", "0"], "argument --layers: --layers must be an integer in [1, 256], got '0'"),
    (["model", "--layers", "-3"], "argument --layers: --layers must be an integer in [1, 256], got '-3'"),
    (["model", "--layers", "100000"], "argument --layers: --layers must be an integer in [1, 256], got '100000'"),
    (["model", "--layers", "two"], "argument --layers: --layers must be an integer in [1, 256], got 'two'"),
    (["model", "--batches", "1,0"], "argument --batches: every batch size must be an integer in [1, 4096]"),
    (["model", "--batches", "1,99999999999"], "argument --batches: every batch size must be an integer in [1, 4096]"),
    (["model", "--batches", "x"], "argument --batches: every batch size must be an integer in [1, 4096]"),
    (["model", "--compile-budget-s", "-1"], "argument --compile-budget-s: must be >= 0 (inf: no budget), got '-1'"),
    (["model", "--compile-budget-s", "nan"], "argument --compile-budget-s: must be >= 0 (inf: no budget), got 'nan'"),
    (["model", "--compile-budget-s", "soon"], "argument --compile-budget-s: must be a number of seconds, got 'soon'"),
    (["model", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["model", "--name", "../model"], "argument --name: must be a file name without a folder"),
    (["decode", "--shapes", "4096x0"], "argument --shapes: '4096x0': N and K must be an integer in [1, 131072], "
                                       "got '0'"),
    (["decode", "--shapes=-64x4096"], "argument --shapes: '-64x4096': N and K must be an integer in [1, 131072]"),
    (["decode", "--shapes", "4096x999999999"], "argument --shapes: '4096x999999999': N and K must be an integer"),
    (["decode", "--shapes", "4096x100"], "argument --shapes: '4096x100': K must be a multiple of 64 (QPN2), got 100"),
    (["decode", "--shapes", "4096"], "argument --shapes: '4096' is not N x K (e.g. 4096x4096)"),
    (["decode", "--sections", "decode,nope"], "argument --sections: choose one or more of ceiling,decode,"),
    (["decode", "--name", ""], "argument --name: must be a file name without a folder"),
    (["--sections", "ceiling,nope"], "argument --sections: choose one or more of ceiling,layouts,dense,sweep"),
    (["kernels", "--name", "a/b"], "argument --name: must be a file name without a folder"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_bench_flags_exit_2_with_one_line(argv, says, capsys):
    code = cli.main(["bench", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
