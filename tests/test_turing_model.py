"""The Turing performance model (cupy_kernels/turing_model.py), on the CPU.

- The SASS parser, the steady-state loop rule and the classifier on a fixed nvdisasm snippet.
- CI guard: no registered decode kernel's sm_75 K loop may grow past the counts recorded in
  tests/fixtures/turing_loop_counts.json, nor shrink below them or outlive its variant (a stale record;
  `python -m qpn.cupy_kernels.turing_model --record tests/fixtures/turing_loop_counts.json` after a
  deliberate change). Skips, with the reason, only
  without NVRTC (cuda-bindings, nvidia-cuda-nvrtc) or nvdisasm (nvidia-cuda-nvdisasm): all three
  are in the [test] extra, so CI runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qpn.cupy_kernels import linear
from qpn.cupy_kernels import turing_model as tm

RECORD = Path(__file__).parent / "fixtures" / "turing_loop_counts.json"
# One instruction of slack per loop iteration: ptxas of another NVRTC 13.x (the [test] pin allows
# any) may place one MOV / NOP differently, while one more instruction per group-tile -- the
# smallest real regression -- adds QPN_UNROLL x tiles >= 2 per iteration (4 for every M <= 16 build).
SLACK = 1

# A K loop in nvdisasm -c form, built to exercise every rule:
#   0x020-0x050  a loop without HMMA (the scale table): not the K loop
#   0x060-0x1a0  the K loop: head 0x060, backward branch 0x1a0
#                hot path: full batch 0x080-0x0f0 (13 instructions round the loop)
#                cold path: partial batch 0x100-0x180 (predicated loads, I2F: 14 round the loop)
#   0x1c0-       the shuffle fallback, reached only through BRA.DIV: its backward branch (0x210 ->
#                0x0c0) spans more instructions than the K loop and holds HMMA, yet must be ignored
SNIPPET = """
\t.section\t.text.k,"ax",@progbits
\t.sectioninfo\t@"SHI_REGISTERS=32"
        .global         k
k:
.text.k:
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   STS [R0], RZ ;
        /*0030*/                   IADD3 R0, R0, 0x20, RZ ;
        /*0040*/                   ISETP.GE.AND P0, PT, R0, 0x100, PT ;
        /*0050*/              @!P0 BRA `(.L_x_0) ;
.L_x_3:
        /*0060*/                   ISETP.GT.AND P0, PT, R2, R3, PT ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   LDG.E.EF.64.SYS R4, [R6.64] ;
        /*0090*/                   LDG.E.EF.U8.SYS R8, [R6.64+0x100] ;
        /*00a0*/                   LDG.E.64.CONSTANT.SYS R10, [R12] ;
        /*00b0*/                   BRA.DIV `(.L_x_4) ;
.L_x_5:
        /*00c0*/                   SHFL.IDX PT, R9, R8, RZ, 0x1f ;
        /*00d0*/                   HFMA2 R14, R4, R9.H0_H0, RZ ;
        /*00e0*/                   HMMA.1688.F32 R16, R14, R10, R16 ;
        /*00f0*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0100*/               @P1 LDG.E.EF.64.SYS R4, [R6.64] ;
        /*0110*/               @P1 LDG.E.EF.U8.SYS R8, [R6.64+0x100] ;
        /*0120*/               @P1 LDG.E.64.CONSTANT.SYS R10, [R12] ;
        /*0130*/                   SHFL.IDX PT, R9, R8, RZ, 0x1f ;
        /*0140*/                   I2F R20, R9 ;
        /*0150*/                   IMAD R21, R20, 0x2, RZ ;
        /*0160*/                   LOP3.LUT R22, R21, 0xff, RZ, 0xc0, !PT ;
        /*0170*/                   HFMA2 R14, R4, R9.H0_H0, RZ ;
        /*0180*/                   HMMA.1688.F32 R16, R14, R10, R16 ;
.L_x_2:
        /*0190*/                   IADD3 R2, R2, 0x4, RZ ;
        /*01a0*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*01b0*/              @!P0 BRA `(.L_x_3) ;
        /*01c0*/                   STG.E [R22.64], R16 ;
        /*01d0*/                   EXIT ;
.L_x_4:
        /*01e0*/                   WARPSYNC 0xffffffff ;
        /*01f0*/                   CALL.REL.NOINC `(.L_x_6) ;
        /*0200*/                   NOP ;
        /*0210*/                   NOP ;
        /*0220*/                   NOP ;
        /*0230*/                   BRA `(.L_x_5) ;
.L_x_6:
        /*0240*/                   SHFL.IDX P0, R9, R8, RZ, 0x1f ;
        /*0250*/                   RET.REL.NODEC R20 `(k) ;
.L_x_7:
        /*0260*/                   BRA `(.L_x_7) ;
"""
HOT_PATH = (0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0, 0x190, 0x1A0, 0x1B0)


def test_parser_resolves_labels_and_predicates():
    fns = tm.parse_sass(SNIPPET)
    assert list(fns) == ["k"]
    ins = fns["k"]
    assert len(ins) == 39 and ins[0].addr == 0 and ins[-1].addr == 0x260
    back = next(x for x in ins if x.addr == 0x1B0)
    assert (back.pred, back.op, back.target) == ("@!P0", "BRA", 0x60)
    assert next(x for x in ins if x.addr == 0xB0).target == 0x1E0  # BRA.DIV -> the fallback
    assert next(x for x in ins if x.addr == 0x250).target == 0  # RET's `(k)`: the function label


def test_steady_loop_is_the_shortest_way_round_the_hmma_loop():
    loop = tm.steady_loop(tm.parse_sass(SNIPPET)["k"])
    assert tuple(x.addr for x in loop) == HOT_PATH
    counts = tm.class_counts(loop)
    assert counts == {"int": 3, "control": 4, "mem": 3, "shfl": 1, "fp": 1, "hmma": 1}
    assert tm.stream_bytes(loop) == 32 * (8 + 1)  # the two evict-first loads; the CONSTANT (x) load is not weight


def test_steady_loop_refuses_code_without_an_hmma_loop():
    no_mma = SNIPPET.replace("HMMA.1688.F32", "FFMA")
    with pytest.raises(ValueError, match="no backward branch around HMMA"):
        tm.steady_loop(tm.parse_sass(no_mma)["k"])


@pytest.mark.parametrize(
    ("op", "cls"),
    [("IMAD.WIDE.U32", "imad"), ("LOP3.LUT", "int"), ("PRMT", "int"), ("SHF.R.U32.HI", "int"), ("HFMA2.MMA", "fp"),
     ("FFMA", "fp"), ("F2F.F16.F32", "conv"), ("I2F.U32", "conv"), ("HMMA.1688.F32", "hmma"), ("SHFL.BFLY", "shfl"),
     ("LDS.U", "mem"), ("LDSM.16.M88.4", "mem"), ("BRA.DIV", "control"), ("ULDC.64", "uniform"), ("XYZZY", "other")],
)
def test_classify(op, cls):
    assert tm.classify(op) == cls


def test_projection_of_a_known_loop():
    """100 instructions per group-tile of which 50 int, 288 weight bytes, on the T4: issue 25 SM
    cycles, ALU 25; DRAM 288 / (320 x 0.93) ns; 25 / (40 x 1.59) ns is well under it."""
    from collections import Counter

    stats = tm.LoopStats("k", "sm_75", 1, 400, 4, Counter({"int": 200, "other": 184, "hmma": 16}), 4 * 288, ())
    p = tm.project(stats, tm.CARDS[0], 1)
    assert p.cycles["issue"] == 25.0 and p.cycles["alu"] == 25.0 and p.cycles["hmma"] == 8.0
    assert p.ns["dram"] == pytest.approx(288 / (320 * tm.STREAM_EFFICIENCY))
    assert p.limit == "dram" and p.pct == 100.0


# ----------------------------------------------------------------------------- the CI guard


def grown_loops(recorded: dict, measured: dict[str, int], slack: int = SLACK) -> list[str]:
    """Loops longer than recorded + slack, registered variants with no record, and stale records:
    loops shorter than recorded - slack and recorded labels no longer registered (a stale record
    would let a later regression back up to the old count pass)."""
    rerecord = f"re-record with --record {RECORD.relative_to(RECORD.parents[2])}"
    problems = [f"{label}: recorded but no longer registered ({rerecord})"
                for label in sorted(recorded.keys() - measured.keys())]
    for label, count in measured.items():
        if label not in recorded:
            problems.append(f"{label}: not recorded ({rerecord})")
            continue
        was = recorded[label]["instructions"]
        if count > was + slack:
            problems.append(f"{label}: {count} instructions per loop iteration, recorded {was}")
        elif count < was - slack:
            problems.append(f"{label}: {count} instructions per loop iteration, shorter than the recorded {was} "
                            f"({rerecord})")
    return problems


def test_grown_loops_flags_growth_beyond_the_slack():
    recorded = {"a": {"instructions": 100}, "b": {"instructions": 50}}
    assert grown_loops(recorded, {"a": 101, "b": 49}) == []
    assert len(grown_loops(recorded, {"a": 102, "b": 50})) == 1
    assert "not recorded" in grown_loops({}, {"c": 1})[0]


def test_grown_loops_flags_stale_records():
    recorded = {"a": {"instructions": 100}, "b": {"instructions": 50}}
    shorter = grown_loops(recorded, {"a": 100, "b": 48})
    assert len(shorter) == 1 and "b: 48" in shorter[0] and "re-record with --record" in shorter[0]
    gone = grown_loops(recorded, {"a": 100})
    assert len(gone) == 1 and "b: recorded but no longer registered" in gone[0] and "re-record with --record" in gone[0]


@pytest.fixture(scope="module")
def toolchain(nvrtc):
    nvdisasm = tm.find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm is unavailable; pip install 'nvidia-cuda-nvdisasm>=13,<14' (in the [test] extra)")
    return nvrtc, nvdisasm


def test_no_decode_loop_grew(toolchain):
    nvrtc, nvdisasm = toolchain
    recorded = json.loads(RECORD.read_text())["loops"]
    stats = tm.measure_all([(v, "sm_75") for v in linear.DECODE_VARIANTS], nvrtc, nvdisasm)["sm_75"]
    measured = {v.label: s.instructions for v, s in stats.items()}
    assert not grown_loops(recorded, measured), "\n".join(grown_loops(recorded, measured))
    # the loop unit the model divides by: QPN_UNROLL x tiles group-tiles, none of them empty
    assert all(s.group_tiles >= 1 and s.stream_bytes for s in stats.values())
