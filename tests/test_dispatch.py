"""The one dispatch policy (torch_bridge/dispatch.py, issue 21): candidates say what they can run, the
measured table of the device family says what each costs, the least cost wins; without a table the
rule the kernels were tuned for. Host arithmetic: these run on the CPU with tables written here or
the committed ones."""

from __future__ import annotations

import json

import pytest
import torch

from qpn.ref.formats import QPN2, QPN8, QPN8_BLOCK
from qpn.torch_bridge import dispatch


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A private table folder; the caches are cleared before and after."""
    monkeypatch.setattr(dispatch, "TABLES", tmp_path)
    dispatch.table.cache_clear()
    dispatch._choose.cache_clear()
    yield tmp_path
    dispatch.table.cache_clear()
    dispatch._choose.cache_clear()


def write(folder, family, rows):
    (folder / f"{family}.json").write_text(json.dumps({"family": family, "rows": [
        {"layout": layout, "n": n, "k": k, "gated": gated, "m": m, "us": us} for layout, n, k, gated, m, us in rows]}))


def test_the_cheapest_measured_path_wins_and_costs_interpolate(tables):
    write(tables, "sm_90", [
        ("qpn2", 4096, 4096, False, 32, {"decode": 10.0, "gemm": 40.0, "dense": 30.0}),
        ("qpn2", 4096, 4096, False, 64, {"gemm": 60.0, "dense": 32.0}),
        ("qpn2", 4096, 4096, False, 512, {"gemm": 200.0, "dense": 160.0}),
        ("qpn2", 28672, 8192, False, 64, {"gemm": 100.0, "dense": 130.0}),
    ])
    costs = dispatch.costs("sm_90", QPN2, 48, 4096, 4096, False)
    assert costs == pytest.approx({"decode": 15.0, "gemm": 50.0, "dense": 31.0})  # decode: 10 * 48 / 32
    assert dispatch._choose("sm_90", "qpn2", 32, 4096, 4096, False) == "decode"
    assert dispatch._choose("sm_90", "qpn2", 48, 4096, 4096, False) == "dense"  # decode cannot run 48
    assert dispatch._choose("sm_90", "qpn2", 64, 28672, 8192, False) == "gemm"  # the nearest shape's row
    assert dispatch._choose("sm_90", "qpn2", 64, 14336, 8192, False) == "gemm"  # nearer 28672x8192
    # beyond the last measured M a cost grows with M; a larger layer scales it by N*K
    assert dispatch.costs("sm_90", QPN2, 1024, 4096, 4096, False)["dense"] == pytest.approx(320.0)
    assert dispatch.costs("sm_90", QPN2, 64, 8192, 4096, False)["dense"] == pytest.approx(64.0)


def test_block_scales_and_gated_fall_back_to_the_plain_layouts_rows(tables):
    write(tables, "sm_90", [("qpn8", 4096, 4096, False, 64, {"gemm": 20.0, "dense": 30.0}),
                            ("qpn8", 4096, 4096, True, 64, {"gemm": 50.0, "dense": 30.0})])
    assert dispatch._choose("sm_90", QPN8_BLOCK.key, 64, 4096, 4096, False) == "gemm"
    assert dispatch._choose("sm_90", QPN8.key, 64, 4096, 4096, True) == "dense"  # its own gated rows
    assert dispatch.costs("sm_90", QPN2, 64, 4096, 4096, False) == {}  # no QPN2 rows: nothing measured


def test_without_a_table_the_rule_decides(tables, monkeypatch):
    import qpn.cupy_kernels.gemm as gemm

    monkeypatch.setattr(gemm, "_device", lambda: (40, 7))  # a T4: the Turing model's GEMM range
    assert [dispatch._choose("sm_75", "qpn2", m, 4096, 4096, False) for m in (1, 32, 33, 512, 513)] == \
        ["decode", "decode", "gemm", "gemm", "dense"]
    assert [dispatch._choose("cpu", "qpn8", m, 4096, 4096, False) for m in (8, 9)] == ["cpu_fused", "cpu_blas"]


def test_candidates_never_run_outside_their_range(tables):
    write(tables, "sm_90", [("qpn2", 4096, 4096, False, 1, {"decode": 1.0, "gemm": 5.0, "dense": 9.0})])
    assert dispatch._choose("sm_90", "qpn2", 33, 4096, 4096, False) == "gemm"  # decode measured cheapest
    assert not dispatch.CANDIDATES[0].can_implement("cpu", 1) and dispatch.CANDIDATES[0].can_implement("cuda", 32)


def test_the_committed_cpu_table_matches_the_measured_crossover():
    """dispatch_tables/cpu.json (bench_dispatch.py --device cpu): fused up to M = 8, decode-then-BLAS from 12."""
    dispatch.table.cache_clear()
    dispatch._choose.cache_clear()
    assert dispatch.table("cpu"), "the CPU table is committed"
    for wf in (QPN2, QPN8):
        picks = [dispatch.choose(torch.device("cpu"), wf, m, 4096, 4096, False) for m in (1, 4, 8, 12, 32, 64)]
        assert picks == ["cpu_fused"] * 3 + ["cpu_blas"] * 3, (wf.key, picks)


def test_describe_prints_the_choices():
    text = dispatch.describe("cpu", QPN2)
    assert "dispatch_tables/cpu.json" in text and "4096x4096: M=1: cpu_fused" in text
    assert "no measured table for sm_75" in dispatch.describe("sm_75", QPN2)


def test_the_committed_h200_table_picks_the_fastest_measured_path():
    """dispatch_tables/sm_90.json (bench_dispatch.py on the H200, CUDA-graph timings): at M = 48-64 the
    dense path on 4096x4096 and 6144x4096 (the GEMM took 56-73 us there, dense 23-34 us: 2.2-2.9x),
    the GEMM on the large layers (28672x8192: 195-205 us vs dense 274-304), decode at M <= 16."""
    dispatch.table.cache_clear()
    dispatch._choose.cache_clear()
    rows = dispatch.table("sm_90")
    assert rows, "the H200 table is committed"
    for key in ("qpn2", "qpn8"):
        for n, k in ((4096, 4096), (6144, 4096)):
            assert {dispatch._choose("sm_90", key, m, n, k, False) for m in (48, 56, 64)} == {"dense"}
        assert {dispatch._choose("sm_90", key, m, 28672, 8192, False) for m in (48, 64)} == {"gemm"}
        assert {dispatch._choose("sm_90", key, m, 4096, 4096, False) for m in (1, 8, 16)} == {"decode"}
    for r in rows:  # at every measured point the choice is the measured minimum among the paths that can run
        able = {p: t for p, t in r.us.items() if p != "decode" or r.m <= dispatch.DECODE_MAX_M}
        assert dispatch._choose("sm_90", r.layout, r.m, r.n, r.k, r.gated) == min(able, key=able.get)


def test_qpn_inspect_dispatch_prints_the_choices(capsys):
    """`qpn inspect --dispatch` (issue 21: the choice is inspectable): the committed H200 table's picks,
    at a checkpoint's own layer shapes when given one; without PATH or --dispatch, exit 2."""
    from pathlib import Path

    from qpn.apps import cli

    assert cli.main(["inspect", "--dispatch", "--family", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "dispatch for QPN2 on sm_90: measured table" in out and "dispatch for QPN8 on sm_90" in out
    assert "4096x4096: M=1: decode" in out and "M=48: dense" in out
    fixture = Path(__file__).parent / "fixtures" / "modelopt" / "fp8_block"
    assert cli.main(["inspect", str(fixture), "--dispatch", "--family", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dispatch for QPN8 with 128x128 block scales on cpu") and "M=1: cpu_fused" in out
    assert cli.main(["inspect"]) == 2
    assert "qpn inspect needs PATH" in capsys.readouterr().err
