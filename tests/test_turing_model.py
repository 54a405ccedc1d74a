"""The Turing performance model (benchmarks/turing_model.py), on the CPU.

- The SASS parser, the steady-state loop rule and the classifier on fixed nvdisasm snippets: the
  full batch and the fast path, `BRA.DIV` and `@!PT` never taken, guards known from the launch
  (SR_TID.X of each warp) followed their one way; the integer evaluator's opcodes.
- The projections: a bound of a known loop, the fp16x2-on-tensor option, an estimate capped by GDDR6.
- The GEMM loops as they run (x staging included): QPN2 131 and QPN8 129.5 sm_75 instructions per
  group-tile, the independent recount of issue 25.
- CI guard: no registered decode kernel's, GEMM build's or MoE expert build's sm_75 K loop may grow past the
  counts recorded in
  tests/fixtures/turing_loop_counts.json, nor shrink below them or outlive its variant (a stale record;
  `python benchmarks/turing_model.py --record tests/fixtures/turing_loop_counts.json` after a
  deliberate change). Skips, with the reason, only
  without NVRTC (cuda-bindings, nvidia-cuda-nvrtc) or nvdisasm (nvidia-cuda-nvdisasm): all three
  are in the [test] extra, so CI runs it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from qpn.cupy_kernels import gemm, linear, moe, mxfp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # a tool, not the runtime package
import turing_model as tm  # noqa: E402

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


# Guards the loop rule must not take: `@!PT BRA` (never true) into a longer HMMA loop, which the old
# rule took as the K loop; and an x-staging block behind `tid > 255` (never true for 8 warps, true for
# warps 8-15 of 16) that holds no load, so only the launch's tid can keep it in the count.
#   0x000-0x010  tid; 0x020 `@!PT BRA` to 0x1a0 (a decoy loop of 8 HMMA, spanning more)
#   0x030-0x160  the K loop: head 0x030; 0x040 the guard; 0x060-0x0b0 the staging (6 instructions)
#   0x0c0-0x150  one group (weight load, HMMA, counter); 0x160 the backward branch
GUARDS = """
\t.section\t.text.g,"ax",@progbits
        .global         g
g:
.text.g:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, RZ ;
        /*0020*/              @!PT BRA `(.L_x_9) ;
.L_x_0:
        /*0030*/                   S2R R5, SR_TID.X ;
        /*0040*/                   ISETP.GT.AND P1, PT, R5, 0xff, PT ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   LEA R6, R5, RZ, 0x4 ;
        /*0070*/                   STS.128 [R6], RZ ;
        /*0080*/                   IADD3 R7, R5, 0x100, RZ ;
        /*0090*/                   STS.128 [R6+0x1000], RZ ;
        /*00a0*/                   NOP ;
        /*00b0*/                   BAR.SYNC 0x0 ;
.L_x_1:
        /*00c0*/                   LDG.E.EF.64.SYS R8, [R10.64] ;
        /*00d0*/                   HMMA.1688.F32 R16, R8, R12, R16 ;
        /*00e0*/                   HMMA.1688.F32 R16, R8, R12, R16 ;
        /*00f0*/                   HMMA.1688.F32 R16, R8, R12, R16 ;
        /*0100*/                   HMMA.1688.F32 R16, R8, R12, R16 ;
        /*0110*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0120*/                   IADD3 R10, P0, R10, 0x100, RZ ;
        /*0130*/                   IADD3.X R11, RZ, R11, RZ, P0, !PT ;
        /*0140*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0150*/                   NOP ;
        /*0160*/              @!P0 BRA `(.L_x_0) ;
        /*0170*/                   EXIT ;
.L_x_9:
        /*0180*/                   NOP ;
        /*0190*/                   NOP ;
        /*01a0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*01b0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*01c0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*01d0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*01e0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*01f0*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*0200*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*0210*/                   HMMA.1688.F32 R20, R8, R12, R20 ;
        /*0220*/                   BRA `(.L_x_0) ;
"""


def test_never_taken_branches_and_guards_known_from_the_launch():
    ins = tm.parse_sass(GUARDS)["g"]
    assert ins[tm.find_loop(ins)[0]].addr == 0x30  # not the decoy behind `@!PT BRA`
    staged = [0x30 + 0x10 * i for i in range(0x14)]  # 0x030-0x160, staging included
    skipped = [a for a in staged if not 0x60 <= a <= 0xB0]
    assert [x.addr for x in tm.steady_loop(ins, tm.WarpLaunch(7, 8))] == staged  # tid <= 255: staging runs
    assert [x.addr for x in tm.steady_loop(ins, tm.WarpLaunch(8, 16))] == skipped  # tid 256-287: it does not
    assert [x.addr for x in tm.steady_loop(ins)] == skipped  # tid unknown: the shortest way


@pytest.mark.parametrize(
    ("line", "reg", "want"),
    [("IADD3 R4, -R1, 0xff, R2 ;", 4, 0xFF - 5 + 7),
     ("IMNMX R4, RZ, R1, !PT ;", 4, 5),  # !PT: max
     ("IMNMX R4, R1, R2, PT ;", 4, 5),  # PT: min
     ("LEA.HI R4, R3, 0x1, RZ, 0x18 ;", 4, 1 + (0x300 >> 8)),  # b + (c:a >> (32 - s))
     ("LEA R4, R1, R2, 0x8 ;", 4, (5 << 8) + 7),
     ("LOP3.LUT R4, R1, R2, RZ, 0xfc, !PT ;", 4, 5 | 7),  # 0xfc = a | b
     ("LOP3.LUT R4, R1, 0x3, RZ, 0xc0, !PT ;", 4, 5 & 3),  # 0xc0 = a & b
     ("SHF.R.S32.HI R4, RZ, 0x1f, R6 ;", 4, 0xFFFFFFFF),  # sign of a negative value
     ("SHF.L.U32 R4, R1, 0x4, RZ ;", 4, 5 << 4),
     ("IMAD R4, R1, 0x100, R2 ;", 4, 5 * 256 + 7)],
)
def test_evaluator(line, reg, want):
    warp = tm._Warp(tm.WarpLaunch(0, 8))
    for r, value in ((1, 5), (2, 7), (3, 0x300), (6, 0x80000000)):
        warp.regs[r] = (value,) * 32
    warp.execute(tm.parse_sass(f"\t.section\t.text.e,\"ax\",@progbits\n/*0000*/ {line}")["e"][0])
    assert warp.regs[reg] == (want,) * 32


def test_evaluator_forgets_what_it_cannot_model():
    warp = tm._Warp(tm.WarpLaunch(1, 8))
    sass = ("\t.section\t.text.e,\"ax\",@progbits\n"
            "/*0000*/ S2R R1, SR_TID.X ;\n/*0010*/ ISETP.GT.AND P1, PT, R1, 0x3f, PT ;\n"
            "/*0020*/ LDG.E.128.SYS R0, [R8.64] ;\n/*0030*/ @P2 IMAD.MOV.U32 R9, RZ, RZ, 0x1 ;\n")
    for x in tm.parse_sass(sass)["e"]:
        warp.execute(x)
    assert warp.preds["P1"] == (False,) * 32  # tid 32-63 > 63: no
    assert 1 not in warp.regs and 9 not in warp.regs  # overwritten by the 128-bit load; may or may not run


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
    cycles, ALU 25; DRAM 288 / (320 x 0.90) ns; 25 / (40 x 1.59) ns is well under it, so the bound is
    GDDR6's 90 % of the spec, not 100 %."""
    stats = tm.LoopStats("k", "sm_75", 1, 400, 4, Counter({"int": 200, "other": 184, "hmma": 16}), 4 * 288, ())
    p = tm.project(stats, tm.T4, 1)
    assert p.cycles["issue"] == 25.0 and p.cycles["alu"] == 25.0 and p.cycles["hmma"] == 8.0
    assert tm.STREAM_EFFICIENCY == tm.GDDR6_STREAM_EFFICIENCY[1] == 0.90 and tm.T4.stream_efficiency == 0.90
    assert p.ns["dram"] == pytest.approx(288 / (320 * 0.90))
    assert p.limit == "dram" and p.pct == 100.0 and p.spec_pct == pytest.approx(90.0)
    # the sustained clock: compute limits scale with it, DRAM does not
    q = tm.project(stats, tm.T4_SUSTAINED, 1)
    assert tm.T4_SUSTAINED.ghz == 1.25 and q.ns["issue"] == pytest.approx(p.ns["issue"] * 1.59 / 1.25)


def test_fp16x2_on_the_tensor_port():
    """24 fp16x2 of 32 fp and 16 HMMA per group-tile: on the FMA pipe (32 + 8 imad) / 2 = 20 cycles,
    HMMA 16 x 1024 / 512 = 32; sharing the tensor port, FMA (8 + 8) / 2 = 8, HMMA 32 + 24 / 2 = 44."""
    stats = tm.LoopStats("k", "sm_75", 4, 100, 1, Counter({"fp": 32, "imad": 8, "hmma": 16, "int": 44}), 288, (),
                         fp16=24)
    off = tm.pipe_cycles(stats, tm.T4)
    on = tm.pipe_cycles(stats, replace(tm.T4, fp16_on_tensor=True))
    assert (off["fma"], off["hmma"]) == (20.0, 32.0) and (on["fma"], on["hmma"]) == (8.0, 44.0)
    assert tm.compute_cycles(stats, replace(tm.T4, fp16_on_tensor=True)) == 44.0


def test_estimate_is_a_range_capped_by_gddr6():
    """An H200 rate moved to the T4 by the models' compute-cycle ratio, x 40 SMs x 1.25 GHz / 320 GB/s,
    capped at 80-90 % of spec: a fast loop is DRAM-capped at both ends, a slow one is not."""
    loop = tm.LoopStats("k", "sm_75", 1, 80, 1, Counter({"int": 40, "other": 36, "hmma": 4}), 288, ())
    est = tm.estimate_t4(loop, replace(loop, arch="sm_90"), (8.0, 8.0))
    ratio = tm.compute_cycles(loop, tm.H200) / tm.compute_cycles(loop, tm.T4_SUSTAINED)
    assert est.card[1] == pytest.approx(8.0 * ratio) and (est.lo, est.hi, est.limit) == (80.0, 90.0, "dram")
    slow = tm.estimate_t4(loop, replace(loop, arch="sm_90"), (2.0, 3.0))
    assert slow.limit == "compute" and slow.hi == pytest.approx(100 * 3.0 * ratio * 40 * 1.25 / 320)
    assert tm.needed_rate(tm.T4) == pytest.approx(5.03, abs=0.005)
    assert tm.needed_rate(tm.T4_SUSTAINED) == pytest.approx(6.4)


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


@pytest.fixture(scope="module")
def sm75_loops(toolchain):
    nvrtc, nvdisasm = toolchain
    jobs = [(v, "sm_75") for v in (*linear.DECODE_VARIANTS, *mxfp4.QPNMX_LINEAR.values(), *gemm.KERNEL_VARIANTS,
                                   *moe.EXPERT_DECODE.values())]
    return tm.measure_all(jobs, nvrtc, nvdisasm)["sm_75"]


def test_no_decode_gemm_or_moe_loop_grew(sm75_loops):
    recorded = json.loads(RECORD.read_text())["loops"]
    measured = {v.label: s.instructions for v, s in sm75_loops.items()}
    assert not grown_loops(recorded, measured), "\n".join(grown_loops(recorded, measured))
    # the loop unit the model divides by: QPN_UNROLL x tiles group-tiles, none of them without weights
    assert all(s.group_tiles >= 1 and s.stream_bytes for s in sm75_loops.values())


def test_gemm_loops_count_what_runs(sm75_loops):
    """The independent recount (issue 25): the GEMM loops as they run, x staging included, are 131 (QPN2)
    and 129.5 (QPN8) sm_75 instructions per group-tile -- not the 119.5 / 107.5 of a rule that took the
    never-taken staging guard -- and every GEMM build's loop streams its full weight bytes (the gated
    QPN8 build's was 0: the rule took the partial batch's branches round its loads)."""
    per_gt = {key: sm75_loops[v].per_gt() for key, v in
              (("qpn2", gemm.QPN2_GEMM[False]), ("qpn8", gemm.QPN8_GEMM[False, False]))}
    assert per_gt["qpn2"] == pytest.approx(131, abs=SLACK / 2) and per_gt["qpn8"] == pytest.approx(129.5, abs=SLACK / 2)
    # per group-tile (32 columns x 16 k): QPN2 256 code bytes + 32 e4m3 scales, MXFP4 the codes + 16 e8m0 (one per
    # 32 k), QPN8 512 code bytes (its scales per column, outside the loop)
    for v in gemm.KERNEL_VARIANTS:
        s = sm75_loops[v]
        want = 512 if v.source.startswith("qpn8") else 272 if dict(v.defines).get("QPN_MX") == "1" else 288
        assert s.stream_bytes / s.group_tiles == want, v.label
    # the decode loops the recount confirmed: QPN2 80, QPN8 75 at M <= 8
    assert sm75_loops[linear.QPN2_LINEAR[1, False]].per_gt() == 80
    assert sm75_loops[linear.QPN8_LINEAR[1, False, False]].per_gt() == 75
