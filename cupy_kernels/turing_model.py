"""Turing performance model of the decode kernels, read from their SASS on the CPU (issue 13, part 2).

Run: `python -m qpn.cupy_kernels.turing_model [--out FILE.md] [--record FILE.json]` (no GPU, no CuPy;
NVRTC from the `nvidia-cuda-nvrtc` wheel as for the compile check, `nvdisasm` from the
`nvidia-cuda-nvdisasm` wheel; `cuobjdump -sass` would only run that same nvdisasm).

Method (every step reads the compiled code, nothing about the loop is hard-coded):

1. Build: every decode variant the `linear` wrapper registers (`linear.DECODE_VARIANTS`) is
   compiled for sm_75 with `loader.compile_text`, the compile check's path and options, and the
   cubin is disassembled with `nvdisasm -c`.
2. The steady-state loop (`steady_loop`). Control flow: a `BRA.DIV` is never taken (it leads to
   the fallback of a shuffle for diverged warps; the kernels shuffle only in warp-uniform code),
   any other predicated branch may go either way, an unpredicated BRA / EXIT ends its block. The
   K loop is the backward branch (target at or before it), reachable from the entry, whose body
   holds HMMA and spans the most instructions (the scale-table and split-K reduction loops hold
   no HMMA). Its steady state is the SHORTEST way round it, in instructions: the full batch (not
   the slice's partial last batch) and QPN2's fast decode (not the exact path of blocks with
   |S| < 2^-13) -- the cold paths are the longer ones.
3. Unit: the group-tile, 16 k x 32 columns = 512 weights, one warp's work per group and tile.
   Group-tiles per iteration = HMMA / (4 * QPN_NB): an m16n8k8 HMMA multiplies 16 columns x 8 k
   of weights by one 8-token block, so a group-tile is 4 HMMA per 8-token block. It must equal
   QPN_UNROLL x tiles per block from the variant's macros (checked: a mismatch is an error).
4. Pipes (`PIPES_*`): instructions per group-tile by class, cycles per SM at each pipe's rate,
   plus issue (one warp-instruction per clock per SM sub-partition, 4 per SM).
5. Bytes per group-tile: the weight stream = the loop's evict-first loads (`LDG...EF`, the
   kernels' `ld.global.cs`), lane width x 32 lanes; x = 32 * M bytes (16 k x 2 bytes per token
   row), read again for every tile (qpn_load_x_group), counted as L2-to-SM traffic.

The GEMM builds (cupy_kernels/gemm.py, M > 32) are measured the same way and projected per call
(`project_gemm`: ceil(M / 64) passes over the weight) against the card's fp16 tensor-core and
bandwidth floors.

Assumptions (the model is an upper bound; the H200 check in the report measures how far off):
latency perfectly hidden (enough resident warps, whatever the registers allow), no split-K /
prologue / epilogue cost (large layers), L1 hits on x not counted (all x bytes from L2; ncu on the
H200 saw 76 % of that at M = 32, 27-31 % at M <= 8), DRAM streams at STREAM_EFFICIENCY of its
spec (the H200's measured read ceiling / spec; GDDR6 unmeasured), boost clocks held (a T4 at its
70 W cap may clock lower: compute-bound rows scale with the clock).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import gemm, loader
from .variants import KernelVariant

# ----------------------------------------------------------------------------- the machines

# Instruction classes (`classify`) -> SASS opcodes (the part before the first '.').
CLASSES = {
    "int": ("IADD3", "IADD", "LOP3", "LOP", "SHF", "PRMT", "ISETP", "LEA", "SEL", "IMNMX", "IABS", "ISCADD",
            "MOV", "FSEL", "FSETP", "FMNMX", "PLOP3", "P2R", "R2P", "SGXT", "BMSK", "CS2R", "F2FP", "VOTE", "LEPC"),
    "imad": ("IMAD", "IMUL", "IDP", "IMADSP"),
    "fp": ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "HSETP2", "HSET2", "HMNMX2"),
    "conv": ("F2F", "F2I", "I2F", "I2I", "FRND", "MUFU", "POPC", "FLO", "BREV"),
    "hmma": ("HMMA",),
    "shfl": ("SHFL",),
    "mem": ("LDG", "STG", "LDS", "STS", "LDSM", "LD", "ST", "LDL", "STL", "LDC", "ATOM", "ATOMS", "ATOMG", "RED",
            "MEMBAR", "CCTL"),
    "control": ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "BMOV", "WARPSYNC",
                "NOP", "BAR", "YIELD", "S2R", "NANOSLEEP", "KILL", "DEPBAR", "ERRBAR", "R2UR", "S2UR", "VOTEU"),
}
CLASS_ORDER = (*CLASSES, "uniform", "other")
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}

# Pipe limits: name -> (classes sharing the pipe, warp-instructions per clock per SM). The rates are
# the CUDA C++ Programming Guide's "Throughput of Native Arithmetic Instructions" (Performance
# Guidelines > Maximize Instruction Throughput > Arithmetic Instructions, section 5.4.1 of the 12.x
# guide), in results per clock per SM, / 32 lanes. Compute capability 7.5: 32-bit integer add /
# shift / compare / bitwise 64, 32-bit integer multiply-add 64, fp32 add / mul / fma 64, fp16
# add / mul / fma 128 results = 64 HFMA2 lanes, warp shuffle 32, type conversions ("all other")
# 16, special functions 16. Pipes, per Nsight Compute's pipeline list: IMAD runs on the FMA pipe on
# Volta / Turing (hence `imad` with `fp`), the rest of integer / logic on the ALU pipe; each is 16
# lanes per sub-partition, i.e. half the issue rate. Loads / stores: 4 LD/ST units per SM
# sub-partition (Turing whitepaper, SM diagram) = 16 lanes per clock per SM (assumed; the guide
# lists no rate). HMMA is per card (tensor-core rate: CARDS). Uniform-datapath (U*) and control
# instructions count against issue only.
ISSUE_PER_SM = 4.0  # one warp-instruction per clock per scheduler, 4 schedulers per SM (7.5 and 9.0)
PIPES_SM75 = {
    "alu": (("int",), 64 / 32),
    "fma": (("fp", "imad"), 64 / 32),
    "conv": (("conv",), 16 / 32),
    "shfl": (("shfl",), 32 / 32),
    "lsu": (("mem",), 16 / 32),
}
# Compute capability 9.0 (the H200 check): same guide table: fp32 128, fp16 256 results (128 HFMA2
# lanes), integer add / logic 64, integer multiply-add 64 (IMAD only on the heavy half of the FMA
# pipe), conversions 16, shuffle 32; LD/ST 8 per sub-partition (assumed, as on GA100 / GH100).
PIPES_SM90 = {
    "alu": (("int",), 64 / 32),
    "fma": (("fp", "imad"), 128 / 32),
    "fmaheavy": (("imad",), 64 / 32),
    "conv": (("conv",), 16 / 32),
    "shfl": (("shfl",), 32 / 32),
    "lsu": (("mem",), 32 / 32),
}

# Streaming-read efficiency: the H200's measured read ceiling (benchmarks/results/decode_h200.json,
# ceiling_gbps.read = 4648.5 GB/s, the run the H200 check's measured % are against) / its 4.8 TB/s
# spec = 0.97, assumed for the Turing cards' GDDR6 (not measured).
H200_READ_CEILING_GBPS = 4648.5
STREAM_EFFICIENCY = H200_READ_CEILING_GBPS / 4800


@dataclass(frozen=True)
class Card:
    """One GPU: SMs, boost clock (GHz), DRAM spec (GB/s), L2-to-SM bandwidth (GB/s, None: not
    modelled), tensor-core fp16 FMA with fp32 accumulation per clock per SM, pipe limits, and the
    DRAM streaming efficiency to apply to the spec."""

    name: str
    sms: int
    ghz: float
    dram_gbps: float
    l2_gbps: float | None
    hmma_fma_per_clk: float
    pipes: dict
    stream_efficiency: float = STREAM_EFFICIENCY

    @property
    def read_ceiling_gbps(self) -> float:
        return self.dram_gbps * self.stream_efficiency


# Tensor cores: 8 per Turing SM x 64 fp16 FMA per clock = 512 (T4's 65 TFLOP/s = 40 SMs x 512 x 2 x
# 1.59 GHz: full rate with fp32 accumulation; Quadro RTX 8000's 130.5 = 72 x 512 x 2 x 1.77: full
# rate too, professional parts) and half that with fp32 accumulation on GeForce (RTX 2080 Ti: 53.8
# TFLOP/s fp32-accumulate vs 107.6 fp16-accumulate, Turing whitepaper). L2: the T4's L2 load
# throughput, ~1270 GB/s as reported by Jia et al. 2019 (arXiv:1903.07486; recalled, not re-measured
# here), scaled for TU102 by L2 slices (memory bus width: 352 / 384 vs 256 bits) and clock.
T4_L2_GBPS = 1270.0
CARDS = (
    Card("Tesla T4", 40, 1.59, 320.0, T4_L2_GBPS, 512.0, PIPES_SM75),
    Card("RTX 2080 Ti", 68, 1.545, 616.0, T4_L2_GBPS * 352 / 256 * 1.545 / 1.59, 256.0, PIPES_SM75),
    Card("Quadro RTX 8000", 72, 1.77, 672.0, T4_L2_GBPS * 384 / 256 * 1.77 / 1.59, 512.0, PIPES_SM75),
)
# The check card: 132 SMs at the 1.98 GHz boost (the results do not record the clock), DRAM =
# the read ceiling measured in the same run (efficiency 1; the check replaces it with the ceiling
# the results JSON records, _h200_measured), m16n8k8 at the measured 434 TFLOP/s
# (docs/TURING.md) = 434e12 / 2 / (132 x 1.98e9) FMA per clock per SM, L2 not modelled (no figure).
H200 = Card("H200", 132, 1.98, H200_READ_CEILING_GBPS, None, 434e12 / 2 / (132 * 1.98e9), PIPES_SM90,
            stream_efficiency=1.0)

MS = (1, 8, 16, 32)
GROUP_TILE_WEIGHTS = 16 * 32  # 16 k x 32 columns
HMMA_PER_GROUP_TILE_PER_NB = 4  # 2 rowblocks of 16 columns x 2 k-steps of 8
X_BYTES_PER_TOKEN = 16 * 2  # one group's 16 k of one token row, fp16


# ----------------------------------------------------------------------------- SASS


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str  # "@P0", "@!P2", ... or ""
    op: str  # full mnemonic, "LDG.E.EF.64.SYS"
    args: str
    target: int | None  # branch target address

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^([.$\w]+):\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^(@!?U?P[T0-9]+)\s+")
_TARGET = re.compile(r"`\(([^)]+)\)")


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """`nvdisasm -c` output -> instructions per function, branch labels resolved to addresses."""
    raw: dict[str, list] = {}
    labels: dict[str, dict[str, int]] = {}
    fn: str | None = None
    pending: list[str] = []
    for line in text.splitlines():
        if m := _SECTION.match(line):
            fn, pending = m.group(1), []
            raw[fn], labels[fn] = [], {}
        elif fn is None:
            continue
        elif m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTR.match(line):
            addr, body = int(m.group(1), 16), m.group(2)
            for name in pending:
                labels[fn][name] = addr
            pending = []
            pred = ""
            if p := _PRED.match(body):
                pred, body = p.group(1), body[p.end():]
            op, _, args = body.partition(" ")
            t = _TARGET.search(args)
            raw[fn].append((addr, pred, op, args.strip(), t.group(1) if t else None))
    return {
        f: [Instr(a, p, op, args, labels[f].get(t) if t else None) for a, p, op, args, t in rows]
        for f, rows in raw.items()
    }


def classify(op: str) -> str:
    """Instruction class of a SASS mnemonic (CLASSES; U* = uniform datapath; else "other")."""
    base = op.split(".")[0]
    if base in _CLASS_OF:
        return _CLASS_OF[base]
    if base.startswith("U"):
        return "uniform"
    return "other"


def _successors(ins: list[Instr], i: int, index: dict[int, int]) -> list[int]:
    x = ins[i]
    nxt = [i + 1] if i + 1 < len(ins) else []
    conditional = x.pred not in ("", "@PT", "@UPT")
    if x.target is not None and x.base in ("BRA", "JMP", "BRX", "JMX"):
        if x.op.startswith("BRA.DIV"):  # divergent-warp fallback: never taken by converged warps
            return nxt
        return [index[x.target], *nxt] if conditional else [index[x.target]]
    if x.base in ("EXIT", "RET", "BRX", "JMX") and not conditional:
        return []
    return nxt


def _bfs(ins: list[Instr], start: int, index: dict[int, int], stop: int | None = None) -> dict[int, int | None]:
    parent: dict[int, int | None] = {start: None}
    queue = deque([start])
    while queue:
        i = queue.popleft()
        if i == stop:
            break
        for j in _successors(ins, i, index):
            if j not in parent:
                parent[j] = i
                queue.append(j)
    return parent


def steady_loop(ins: list[Instr]) -> list[Instr]:
    """The K loop's steady-state iteration (module docstring, step 2), from its head to its
    backward branch inclusive. ValueError when the function has no loop holding HMMA."""
    index = {x.addr: i for i, x in enumerate(ins)}
    reach = _bfs(ins, 0, index)
    loops = [
        (i - t, t, i)
        for i in reach
        for t in _successors(ins, i, index)
        if t <= i and ins[i].target is not None and any(x.base == "HMMA" for x in ins[t: i + 1])
    ]
    if not loops:
        raise ValueError("no backward branch around HMMA instructions: not a decode kernel's K loop")
    _, head, back = max(loops)
    parent = _bfs(ins, head, index, stop=back)
    path: list[Instr] = []
    i: int | None = back
    while i is not None:
        path.append(ins[i])
        i = parent[i]
    return path[::-1]


def class_counts(loop: list[Instr]) -> Counter:
    return Counter(classify(x.op) for x in loop)


def _lane_bytes(op: str) -> int:
    mods = set(op.split(".")[1:])
    for width, nbytes in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if width in mods:
            return nbytes
    return 4


def stream_bytes(loop: list[Instr]) -> int:
    """Bytes the loop's evict-first global loads (ld.global.cs: the weight stream) read per warp."""
    return sum(32 * _lane_bytes(x.op) for x in loop if x.base == "LDG" and "EF" in x.op.split("."))


# ----------------------------------------------------------------------------- build and measure


def find_nvdisasm() -> Path | None:
    """nvdisasm from an nvidia-cuda-nvdisasm wheel (nvidia/cu*/bin/), else from PATH; None if absent."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm"), reverse=True):  # cu13 before cu12
            if os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("nvdisasm")
    return Path(found) if found else None


def disassemble(cubin: bytes, nvdisasm: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="qpn-sass-") as tmp:
        path = Path(tmp) / "module.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(nvdisasm), "-c", str(path)], check=True, capture_output=True, text=True).stdout


@dataclass
class LoopStats:
    """One variant's steady-state loop on one arch."""

    label: str
    arch: str
    nb: int  # 8-token blocks (QPN_NB)
    instructions: int  # per iteration
    group_tiles: int  # per iteration
    counts: Counter  # class -> per iteration
    stream_bytes: int  # weight bytes per iteration
    unknown: tuple[str, ...]  # opcodes classified "other"

    def per_gt(self, cls: str | None = None) -> float:
        return (self.instructions if cls is None else self.counts.get(cls, 0)) / self.group_tiles


def _macro(variant: KernelVariant, name: str, default: int) -> int:
    return int(dict(variant.defines).get(name, default))


def measure(variant: KernelVariant, arch: str, nvrtc: loader.NVRTC, nvdisasm: Path) -> LoopStats:
    """Compile (as the compile check does), disassemble, find the loop, count it."""
    name, text = loader.read_source(variant.source)
    cubin = loader.compile_text(nvrtc, text, name, arch, variant.defines).cubin
    if cubin is None:  # compute_XX targets give PTX only
        raise ValueError(f"arch must be a real sm_XX target to disassemble, got {arch!r}")
    functions = parse_sass(disassemble(cubin, nvdisasm))
    if variant.kernel not in functions:
        raise ValueError(f"{variant.kernel} not in the {arch} SASS of {variant.source} (found {sorted(functions)})")
    loop = steady_loop(functions[variant.kernel])
    counts = class_counts(loop)
    nb = _macro(variant, "QPN_NB", 1)
    tiles = 2 if _macro(variant, "QPN_GATED", 0) else 1  # per warp: gated, the gate and the up tile
    expected = _macro(variant, "QPN_UNROLL", 4) * tiles
    hmma = counts.get("hmma", 0)
    if hmma != HMMA_PER_GROUP_TILE_PER_NB * nb * expected:
        raise ValueError(
            f"{variant.label} {arch}: the loop holds {hmma} HMMA, not {HMMA_PER_GROUP_TILE_PER_NB} x QPN_NB {nb} x "
            f"QPN_UNROLL x tiles {expected}: the loop's unit changed, update turing_model's group-tile rule"
        )
    unknown = tuple(sorted({x.op.split(".")[0] for x in loop if classify(x.op) == "other"}))
    return LoopStats(variant.label, arch, nb, len(loop), expected, counts, stream_bytes(loop), unknown)


# ----------------------------------------------------------------------------- the model


@dataclass
class Projection:
    card: str
    m: int
    cycles: dict  # limit name -> SM cycles per group-tile (issue, pipes)
    ns: dict  # limit name -> ns per group-tile for the whole GPU (compute limits, dram, l2)

    @property
    def limit(self) -> str:
        return max(self.ns, key=lambda name: self.ns[name])

    @property
    def pct(self) -> float:
        """Share of the streaming-read ceiling: DRAM time / the slowest limit's time."""
        return 100.0 * self.ns["dram"] / max(self.ns.values())


def pipe_cycles(stats: LoopStats, card: Card) -> dict:
    """SM clock cycles per group-tile that issue and each pipe need (one warp's group-tile)."""
    cycles = {"issue": stats.per_gt() / ISSUE_PER_SM}
    for pipe, (classes, rate) in card.pipes.items():
        cycles[pipe] = sum(stats.per_gt(c) for c in classes) / rate
    fma_per_hmma = 16 * 8 * 8  # m16n8k8
    cycles["hmma"] = stats.per_gt("hmma") * fma_per_hmma / card.hmma_fma_per_clk
    return cycles


def project(stats: LoopStats, card: Card, m: int) -> Projection:
    """Time per group-tile on the whole card from each limit; ns = SM cycles / (SMs x GHz)."""
    cycles = pipe_cycles(stats, card)
    ns = {k: c / (card.sms * card.ghz) for k, c in cycles.items()}
    weight = stats.stream_bytes / stats.group_tiles
    ns["dram"] = weight / card.read_ceiling_gbps
    if card.l2_gbps:
        ns["l2"] = (weight + X_BYTES_PER_TOKEN * m) / card.l2_gbps
    return Projection(card.name, m, cycles, ns)


GEMM_MS = (64, 128, 512)
GEMM_SHAPES = ((28672, 8192), (34816, 5120))


@dataclass
class GemmProjection:
    us: float  # the GEMM call
    limit: str  # what sets its pace
    tensor_us: float  # 2 M N K at the card's fp16 tensor-core rate (fp32 accumulation): any HMMA GEMM's floor
    fp16_read_us: float  # the fp16 weight, x and y through DRAM once: cuBLAS fp16's bandwidth floor


def project_gemm(stats: LoopStats, card: Card, m: int, n: int, k: int) -> GemmProjection:
    """A GEMM-build call (cupy_kernels/gemm.py) on `card`: ceil(M / tokens) passes over the weight, each
    pass `group-tiles x` the slowest per-group-tile limit (issue, pipes, HMMA, DRAM for the weight,
    L2 for weight + x staged once per block). The same upper-bound assumptions as `project`."""
    tokens = 8 * stats.nb
    passes = -(-m // tokens)
    cycles = pipe_cycles(stats, card)
    ns = {name: c / (card.sms * card.ghz) for name, c in cycles.items()}
    weight = stats.stream_bytes / stats.group_tiles
    ns["dram"] = weight / card.read_ceiling_gbps
    if card.l2_gbps:
        ns["l2"] = (weight + X_BYTES_PER_TOKEN * tokens / gemm.GEMM_WARPS) / card.l2_gbps  # x: once per block
    limit = max(ns, key=lambda name: ns[name])
    group_tiles = (n // 32) * (k // 16)
    tensor = 2.0 * m * n * k / (2.0 * card.hmma_fma_per_clk * card.sms * card.ghz * 1e9) * 1e6
    fp16_read = (2.0 * n * k + 2.0 * m * k + 2.0 * m * n) / (card.read_ceiling_gbps * 1e3)
    return GemmProjection(passes * group_tiles * ns[limit] / 1e3, limit, tensor, fp16_read)


# ----------------------------------------------------------------------------- report


def target_for(m: int) -> float | None:
    """Issue 13's T4 target (% of bandwidth) for M, None where it sets none (M = 16)."""
    # issue 13: >= 85 % of the T4's bandwidth at M <= 8, >= 75 % at M = 32, nothing at M = 16
    return 85.0 if m <= 8 else 75.0 if m == 32 else None


def headroom(p: Projection) -> float:
    """DRAM time / the slowest compute limit's time (issue, pipes: not dram, not l2)."""
    return p.ns["dram"] / max(v for k, v in p.ns.items() if k not in ("dram", "l2"))


def _families(variants: Iterable[KernelVariant]) -> dict[str, dict[int, KernelVariant]]:
    """(family name, {nb: variant}) of the decode kernels: one family per kernel and non-M macros."""
    fams: dict[str, dict[int, KernelVariant]] = {}
    for v in variants:
        d = dict(v.defines)
        name = v.kernel + (" gated" if d.get("QPN_GATED") == "1" else "") + (
            " block-scales" if d.get("QPN8_BLOCK_SCALES") == "1" else "")
        fams.setdefault(name, {})[int(d.get("QPN_NB", 1))] = v
    return fams


def _nb(m: int) -> int:
    return -(-m // 8)


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def run_model(variants: Sequence[KernelVariant] | None = None, nvrtc: loader.NVRTC | None = None,
              nvdisasm: Path | None = None, h200_results: Path | None = None) -> dict:
    """Measure every variant on sm_75 (and sm_90 for the H200 check); returns everything the
    report and the record need."""
    from . import linear  # noqa: PLC0415 (the wrapper module registers the decode variants)

    variants = linear.DECODE_VARIANTS if variants is None else variants
    nvrtc = nvrtc or loader.CudaBindingsNVRTC()
    nvdisasm = nvdisasm or find_nvdisasm()
    if nvdisasm is None:
        raise FileNotFoundError(
            "nvdisasm not found: pip install 'nvidia-cuda-nvdisasm>=13,<14' (in qpn's [test] extra)")
    fams = _families(variants)
    gemm_builds = [v for v in gemm.KERNEL_VARIANTS if dict(v.defines).get("QPN_GATED") == "0"]
    jobs = [(v, "sm_75") for v in (*variants, *gemm_builds)]
    jobs += [(v, "sm_90") for fam in ("qpn2_linear", "qpn8_linear") for v in fams.get(fam, {}).values()]
    stats = measure_all(jobs, nvrtc, nvdisasm)
    h200_pct, h200_ceiling = _h200_measured(h200_results)
    gemm_stats = {v: stats["sm_75"].pop(v) for v in gemm_builds}
    return {"nvrtc": nvrtc.version, "nvdisasm": str(nvdisasm), "sm75": stats["sm_75"], "sm90": stats["sm_90"],
            "families": fams, "h200_measured": h200_pct, "gemm": gemm_stats,
            "h200": replace(H200, dram_gbps=h200_ceiling)}


def measure_all(jobs: list[tuple[KernelVariant, str]], nvrtc: loader.NVRTC,
                nvdisasm: Path) -> dict[str, dict[KernelVariant, LoopStats]]:
    """`measure` for every (variant, arch) job, in parallel; {arch: {variant: stats}}."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # NVRTC and nvdisasm run outside the GIL
        stats = list(pool.map(lambda job: measure(job[0], job[1], nvrtc, nvdisasm), jobs))
    out: dict[str, dict] = {"sm_75": {}, "sm_90": {}}
    for (v, arch), s in zip(jobs, stats, strict=True):
        out[arch][v] = s
    return out


def _h200_measured(path: Path | None) -> tuple[dict, float]:
    """({(fmt, n, k, m): % of ceiling}, read ceiling GB/s) from bench_decode's JSON: the % are
    against that run's ceiling (absent file: no comparison, H200_READ_CEILING_GBPS)."""
    if path is None or not path.is_file():
        return {}, H200_READ_CEILING_GBPS
    results = json.loads(path.read_text())
    rows = results["sections"]["decode"]["rows"]
    pct = {(f, r["n"], r["k"], r["m"]): r[f"{f}_pct"] for r in rows for f in ("qpn2", "qpn8")}
    return pct, float(results["ceiling_gbps"]["read"])


H200_SHAPES = ((28672, 8192), (34816, 5120))  # the shapes of >= 64 MB of QPN2 weight (tails negligible)


def report(res: dict, command: str) -> str:
    sm75, fams = res["sm75"], res["families"]
    today = datetime.date.today().isoformat()
    out = [
        "# Turing performance model of the decode kernels (CPU only, from the SASS)",
        "",
        f"{today}; `{command}`; NVRTC {'.'.join(map(str, res['nvrtc']))} (the compile check's build), "
        f"nvdisasm from `{Path(res['nvdisasm']).parent.parent.name}`. Method and assumptions: the docstring "
        "of `cupy_kernels/turing_model.py`. One group-tile = 16 k x 32 columns = 512 weights (one warp, "
        "one group of one tile); counts are per group-tile of the steady-state K loop (shortest way round "
        "the backward branch around the HMMA: full batch, QPN2 fast decode).",
        "",
        "## Model",
        "",
        "- Loop: the backward branch, reachable from the entry with `BRA.DIV` never taken, whose body holds "
        "HMMA and spans the most instructions; counted along the shortest way from its head back to it.",
        "- Unit: group-tiles per iteration = HMMA / (4 x QPN_NB) (an m16n8k8 covers 16 columns x 8 k for one "
        "8-token block), checked equal to QPN_UNROLL x tiles per block from the macros.",
        "- Rates (CUDA C++ Programming Guide, Arithmetic Instructions, cc 7.5, per SM per clock): integer / logic "
        "64 (ALU pipe), fp32 and IMAD 64 (FMA pipe), fp16x2 64 instructions (128 results), conversions 16, "
        "shuffle 32; loads / stores 16 (assumed: 4 LD/ST units per sub-partition); issue 4 warp-instructions. "
        "HMMA m16n8k8 with fp32 accumulation: 512 FMA per clock per SM on T4 and Quadro RTX 8000 (full rate, "
        "professional parts), 256 on the RTX 2080 Ti (GeForce half rate).",
        "- Bytes: weights = the loop's evict-first loads; x = 32 x M bytes per group-tile from L2 (re-read per "
        "tile, L1 hits not counted); the x of one call (<= 32 x K x 2 bytes) stays in L2, so DRAM sees weights only.",
        "- Upper bound: perfect latency hiding, boost clocks held, no prologue / split-K / epilogue cost; the "
        "share of bandwidth is DRAM time / max(DRAM, issue, each pipe, L2) per group-tile.",
        "",
        "## sm_75 instructions per group-tile, by class, and SM cycles per group-tile by limit",
        "",
        "Classes: int = ALU integer/logic, imad = IMAD (FMA pipe on Turing), fp = fp32 and fp16x2, conv = "
        "conversions / MUFU (16/clk/SM), shfl, mem = loads / stores, uniform = U* datapath, control. "
        "Cycles per SM (T4 rates; 2080 Ti: hmma x2): issue = all / 4; alu = int / 2; fma = (fp + imad) / 2; "
        "conv / 0.5; shfl / 1; lsu = mem / 0.5; hmma = HMMA x 1024 FMA / 512.",
        "",
        "| kernel | M build | per iter | gt/iter | total | " + " | ".join(CLASS_ORDER)
        + " | bytes | issue | alu | fma | conv | shfl | lsu | hmma |",
        "|" + "---|" * (6 + len(CLASS_ORDER) + 7),
    ]
    t4 = CARDS[0]
    for fam, by_nb in fams.items():
        for nb in sorted(by_nb):
            s = sm75[by_nb[nb]]
            cyc = pipe_cycles(s, t4)
            cells = [fam, f"M<={8 * nb}", str(s.instructions), str(s.group_tiles), _fmt(s.per_gt())]
            cells += [_fmt(s.per_gt(c)) for c in CLASS_ORDER]
            cells += [str(s.stream_bytes // s.group_tiles)]
            cells += [_fmt(cyc[k]) for k in ("issue", "alu", "fma", "conv", "shfl", "lsu", "hmma")]
            out.append("| " + " | ".join(cells) + " |")
    unknown = sorted({op for s in sm75.values() for op in s.unknown})
    if unknown:
        out += ["", f"- opcodes not classified (issue only): {', '.join(unknown)}"]
    out += [
        "",
        "## Projected share of the streaming-read ceiling, per card (limit in brackets)",
        "",
        f"Ceiling = spec x {STREAM_EFFICIENCY:.2f} (the H200's measured read ceiling, "
        f"{H200_READ_CEILING_GBPS:.0f} GB/s, / its 4800 GB/s spec). "
        "L2 = weight + x bytes (32 x M per group-tile: x re-read per 32-column tile, L1 hits not counted) "
        "at the assumed L2 bandwidth: " + ", ".join(f"{c.name} {c.l2_gbps:.0f} GB/s" for c in CARDS) + ".",
        "",
        "T4 headroom = DRAM time / the slowest compute limit's time: how far issue efficiency (or the clock) "
        "may fall below the model's before compute, not DRAM, sets the pace.",
        "",
        "| kernel | M | " + " | ".join(c.name for c in CARDS)
        + " | T4 ns/gt: dram / issue / alu / fma / hmma / l2 | T4 headroom |",
        "|---|---|" + "---|" * (len(CARDS) + 2),
    ]
    verdicts = []
    for fam, by_nb in fams.items():
        for m in MS:
            if _nb(m) not in by_nb:
                continue
            s = sm75[by_nb[_nb(m)]]
            projs = [project(s, c, m) for c in CARDS]
            cells = [f"{p.pct:.0f} % ({p.limit})" for p in projs]
            ns = projs[0].ns
            detail = " / ".join(f"{ns[k]:.3f}" for k in ("dram", "issue", "alu", "fma", "hmma", "l2"))
            out.append(f"| {fam} | {m} | " + " | ".join(cells) + f" | {detail} | {_fmt(headroom(projs[0]))}x |")
            want = target_for(m)
            if fam in ("qpn2_linear", "qpn8_linear") and want is not None:
                verdicts.append((fam, m, want, projs[0], s))
    out += [
        "", "## Issue 13 targets on the T4, by the model", "",
        "L2 needed: the L2-to-SM bandwidth at which the x re-reads alone would pull the row down to the target.",
        "", "| kernel | M | target | model | met | T4 headroom | L2 needed GB/s |", "|---|---|---|---|---|---|---|",
    ]
    for fam, m, want, p, s in verdicts:
        l2_needed = (s.stream_bytes / s.group_tiles + X_BYTES_PER_TOKEN * m) / (p.ns["dram"] * 100 / want)
        out.append(f"| {fam} | {m} | >= {want:.0f} % | {p.pct:.0f} % | {'yes' if p.pct >= want else 'no'} | "
                   f"{_fmt(headroom(p))}x | {l2_needed:.0f} |")
    out += _gemm_section(res)
    out += _h200_section(res)
    return "\n".join(out) + "\n"


def _gemm_section(res: dict) -> list[str]:
    """The GEMM builds (M > 32) projected on the T4 against its fp16 tensor-core and bandwidth floors."""
    t4 = CARDS[0]
    out = [
        "",
        "## GEMM builds (M > 32), projected on the Tesla T4",
        "",
        "The decode kernels built as a GEMM (cupy_kernels/gemm.py): 64 tokens per warp, x staged once per block "
        "of 8 tiles. One call = ceil(M / 64) passes over the weight (each re-streams it from DRAM: no T4 L2 "
        "holds a layer), each group-tile at its slowest limit. Floors of any fp16 GEMM on the card: tensor = "
        f"2 M N K at {2 * t4.hmma_fma_per_clk * t4.sms * t4.ghz / 1e3:.1f} TFLOP/s (HMMA with fp32 accumulation, "
        f"full rate on the T4); fp16 read = the fp16 weight + x + y once at {t4.read_ceiling_gbps:.0f} GB/s. "
        "cuBLAS fp16 cannot beat max(tensor, fp16 read); the dense path adds the dequantize pass "
        "(write 2 N K, read 0.5625 N K bytes) to it.",
        "",
        "| build | N x K | M | instr/gt | projected us (limit) | tensor floor us | fp16 read floor us "
        "| x max(floors) | dense path floor us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, s in res.get("gemm", {}).items():
        d = dict(v.defines)
        name = v.kernel + (" block-scales" if d.get("QPN8_BLOCK_SCALES") == "1" else "")
        for n, k in GEMM_SHAPES:
            for m in GEMM_MS:
                p = project_gemm(s, t4, m, n, k)
                floor = max(p.tensor_us, p.fp16_read_us)
                dense = (2.5625 * n * k) / (t4.read_ceiling_gbps * 1e3) + floor
                out.append(f"| {name} | {n}x{k} | {m} | {_fmt(s.per_gt())} | {p.us:.0f} ({p.limit}) | "
                           f"{p.tensor_us:.0f} | {p.fp16_read_us:.0f} | {floor / p.us:.2f} | {dense:.0f} |")
    return out


def _h200_section(res: dict) -> list[str]:
    fams, sm90, measured, h200 = res["families"], res["sm90"], res["h200_measured"], res["h200"]
    out = [
        "",
        "## Check against the H200 (same method on the sm_90 SASS)",
        "",
        f"H200: {h200.sms} SMs at {h200.ghz} GHz (boost; the results do not record the clock), read ceiling "
        f"{h200.dram_gbps:.0f} GB/s measured, sm_90 rates (fp32 / fp16x2 128, IMAD 64, ALU 64 per clock per SM), "
        "m16n8k8 at the measured 434 TFLOP/s, L2 not modelled. The H200 runs the compute_75 PTX JIT-compiled "
        "by its driver; the model compiles the same source for sm_90 with NVRTC (close, not identical). "
        "Measured: benchmarks/results/decode_h200.json (% of the read ceiling, weight + x + y bytes).",
        "",
        "Reading it: ncu saw 60-68 % of the H200's issue slots busy in QPN2 (issue 13), about its measured / "
        "predicted ratio at M <= 8: the model's counts and rates hold, the missing factor is latency hiding. "
        "At M >= 16 the ratio falls with occupancy, which the model leaves out: the M = 25-32 builds hold "
        "108-116 registers (16 warps per SM; ncu at M = 32: 54 % of issue slots busy, L1 47 %, L2 44 %, "
        "benchmarks/results/decode_m32_explore). On the T4 "
        "the same ratios leave QPN2 and QPN8 DRAM-bound at M <= 16 wherever the T4 headroom above exceeds 1 / ratio.",
        "",
        "| kernel | M | sm_90 instr/gt | predicted % (limit) | measured % "
        + " / ".join(f"{n}x{k}" for n, k in H200_SHAPES) + " | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for fam in ("qpn2_linear", "qpn8_linear"):
        by_nb = fams.get(fam, {})
        for m in MS:
            v = by_nb.get(_nb(m))
            if v is None or v not in sm90:
                continue
            p = project(sm90[v], h200, m)
            fmt = fam.split("_")[0]
            got = [measured.get((fmt, n, k, m)) for n, k in H200_SHAPES]
            meas = " / ".join("-" if g is None else f"{g:.1f}" for g in got)
            ratio = " / ".join("-" if g is None else f"{g / p.pct:.2f}" for g in got)
            out.append(f"| {fam} | {m} | {_fmt(sm90[v].per_gt())} | {p.pct:.0f} % ({p.limit}) | {meas} | {ratio} |")
    return out


def record(res: dict) -> dict:
    """The counts the CI test pins: sm_75 loop instructions per iteration per variant label."""
    return {
        "date": datetime.date.today().isoformat(),
        "nvrtc": ".".join(map(str, res["nvrtc"])),
        "loops": {s.label: {"instructions": s.instructions, "group_tiles": s.group_tiles}
                  for s in res["sm75"].values()},
    }


DEFAULT_H200_RESULTS = loader.KERNEL_DIR.parent / "benchmarks" / "results" / "decode_h200.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qpn.cupy_kernels.turing_model", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the markdown report here (default: stdout)")
    ap.add_argument("--record", type=Path, help="write the sm_75 loop counts (the CI test's JSON) here")
    ap.add_argument("--h200", type=Path, default=DEFAULT_H200_RESULTS, help="bench_decode JSON of the H200 run")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    command = " ".join(["python -m qpn.cupy_kernels.turing_model", *argv])
    try:
        res = run_model(h200_results=args.h200)
    except FileNotFoundError as exc:  # the disassembler wheel is missing: one line, no traceback
        print(f"turing_model: {exc}", file=sys.stderr)
        return 2
    text = report(res, command)
    for path, body in ((args.out, text), (args.record, args.record and json.dumps(record(res), indent=1) + "\n")):
        if path is not None:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(body)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    if args.out is None:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
