"""The decode kernels' stage ablations live in benchmarks/ablate, not in the shipping kernels.

- The shipping sources (cupy_kernels/*.cu, *.cuh) hold no benchmark-only switch.
- Every ablation bench_decode.py's "ablate" section runs applies to today's kernel text, compiles
  for sm_75 (CPU NVRTC, the compile check's rules: no spills, no local arrays, Turing PTX only)
  with the shipped M <= 8 macros, and really leaves its stage out: the PTX instruction that
  stage issues is rarer than in the shipped build.
- A transform whose anchor moved fails with the ablation and the anchor named.
Skips (with the reason) only when the NVRTC wheels are absent, as tests/test_turing_compile.py.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from qpn.cupy_kernels import compile_check, linear, loader

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
# Names that only the ablations use (the ablation switch, its sink, the "never ship" exact-path switch, the
# warp-specialised GEMM's scratch switch: results/gemm_ws_h200/ablations.patch).
BENCHMARK_ONLY = ("QPN_ABLATE", "ablate_sink", "QPN2_EXACT_PATH", "QPN_WS_ABLATE")
# (format, ablation) -> the PTX instruction of the stage it leaves out
STAGE_INSTRUCTION = {
    ("qpn2", "loads only"): "mma.sync",
    ("qpn2", "no exchange"): "prmt.b32",
    ("qpn2", "no decode"): "fma.rn.f16x2",
    ("qpn2", "no mma"): "mma.sync",
    ("qpn8", "loads only"): "mma.sync",
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """bench_decode.py, loaded from its file (it imports `ablate` as qpn.benchmarks.ablate)."""
    return _load("qpn_bench_decode_test", BENCH / "bench_decode.py")


@pytest.fixture(scope="module")
def ablate(bench):
    return sys.modules["qpn.benchmarks.ablate"]


@pytest.fixture(scope="module")
def shipped_ptx(nvrtc, bench):
    """format -> PTX of the shipped build the ablations start from (M <= 8, channel scales)."""
    out = {}
    for fmt in ("qpn2", "qpn8"):
        name, text = loader.read_source(f"{fmt}_linear.cu")
        out[fmt] = loader.compile_text(nvrtc, text, name, "sm_75", bench.shipped_macros(fmt, 1)).ptx.decode()
    return out


def _count(ptx: str, instruction: str) -> int:
    return len(re.findall(rf"^\s*{re.escape(instruction)}", re.sub(r"//[^\n]*", "", ptx), re.MULTILINE))


@pytest.mark.parametrize("path", sorted([*loader.KERNEL_DIR.glob("*.cu"), *loader.KERNEL_DIR.glob("*.cuh")]),
                         ids=lambda p: p.name)
def test_shipping_kernels_hold_no_benchmark_switch(path):
    text = path.read_text()
    assert not [name for name in BENCHMARK_ONLY if name in text]


def test_the_ablate_section_runs_every_ablation(bench, ablate):
    assert set(STAGE_INSTRUCTION) == set(ablate.ABLATIONS)
    assert [row for row in bench.ABLATIONS if row[1] != "full"] == list(ablate.ABLATIONS)
    assert [row for row in bench.ABLATIONS if row[1] == "full"] == [("qpn2", "full"), ("qpn8", "full")]


@pytest.mark.parametrize("fmt, label", sorted(STAGE_INSTRUCTION))
def test_ablation_applies_compiles_and_leaves_its_stage_out(nvrtc, bench, ablate, shipped_ptx, fmt, label):
    text = ablate.ablated_source(fmt, label)
    name = ablate.kernel_source(fmt)
    defines = bench.shipped_macros(fmt, 1)
    kernel = f"{fmt}_linear"
    reports = compile_check.check_module(nvrtc, text, name, [(label, kernel, linear.FALLBACK_STACK_BYTES)], defines)
    assert [r.problems for r in reports] == [[]], compile_check.format_table(reports)
    ptx = loader.compile_text(nvrtc, text, name, "compute_75", defines).ptx.decode()
    instruction = STAGE_INSTRUCTION[fmt, label]
    assert _count(ptx, instruction) < _count(shipped_ptx[fmt], instruction), (fmt, label, instruction)


def test_a_moved_anchor_names_the_ablation_and_the_anchor(ablate):
    _, text = loader.read_source("qpn2_linear.cu")
    edits = ablate.ABLATIONS["qpn2", "no mma"]
    moved = text.replace("qpn_take_group(acc, a, xf, xs, u, tt);", "qpn_take_group(acc, a, xf, xs, u, tt );")
    with pytest.raises(ablate.TransformError, match=r"ablation qpn2 'no mma': anchor "
                       r"'qpn_take_group\(acc, a, xf, xs, u, tt\);' occurs 0 times"):
        ablate.apply_edits(moved, edits, "qpn2 'no mma'")
    with pytest.raises(ablate.TransformError, match="occurs 2 times"):
        ablate.apply_edits(text + text, edits, "qpn2 'no mma'")
    decode = ablate.ABLATIONS["qpn2", "no decode"]
    with pytest.raises(ablate.TransformError, match=r"no 'qpn_take_group\(acc, a, xf, xs, u, tt\);' after"):
        ablate.apply_edits(moved, decode, "qpn2 'no decode'")
    with pytest.raises(ValueError, match="no ablation 'qpn8' 'no mma'"):
        ablate.ablated_source("qpn8", "no mma")


def test_write_source_names_the_file_by_its_text(ablate, tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    path = ablate.write_source("qpn2", "no mma")
    assert path.parent == tmp_path / "ablate" and path.read_text() == ablate.ablated_source("qpn2", "no mma")
    assert ablate.write_source("qpn2", "no mma") == path
    other = ablate.write_source("qpn2", "no decode")
    assert other != path and sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, other.name])


def test_the_parts_section_forces_parts_and_keeps_every_group(bench):
    """section_parts' split (bench_decode._split_with_parts): the forced parts, every group in exactly one slice of
    whole load batches, and split_k's own answer where the forced parts are its choice."""
    from qpn.cupy_kernels.linear import SLICE_MULTIPLE, split_k
    from qpn.ref.formats import QPN2

    for n, k in bench.PARTS_SHAPES:
        groups, multiple = k // 16, SLICE_MULTIPLE[QPN2.key]  # 64-k load batches
        shipped = split_k(n // 32, groups, multiple, 132)
        for parts in bench.PARTS:
            got_parts, split, per_warp = bench._split_with_parts(split_k, parts)(n // 32, groups, multiple, 132)
            assert got_parts == parts and per_warp % multiple == 0, (n, k, parts)
            assert (got_parts * split - 1) * per_warp < groups <= got_parts * split * per_warp, (n, k, parts)
            if parts == shipped[0]:
                assert (got_parts, split, per_warp) == shipped
