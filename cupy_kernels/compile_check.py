"""CPU-only Turing compile check: every launched kernel variant builds for sm_75 within the rules.

Run: `python -m qpn.cupy_kernels.compile_check` (exit status 1 on any violation). No GPU and no
CuPy needed: NVRTC comes from the `nvidia-cuda-nvrtc` wheel through `cuda-bindings`.

For every variant of `variants.all_variants()` (kernels of one file with the same macros
form one module, compiled once), with exactly the loader's options (`loader.nvrtc_options`):

1. compute_75 PTX (front end only, inline asm passed through unchecked) is scanned for
   instructions outside the Turing rules (docs/DESIGN.md, "Turing rules for every kernel";
   docs/TURING.md): `cp.async`, any `m16n8k16` or `m8n8k4` shape, anything `.bf16` or
   `.tf32`, fp8/fp6/fp4 conversions (`cvt.*e4m3/e5m2/e2m1/...`), `wgmma`/`tcgen05`;
2. an sm_75 cubin is built with `--ptxas-options=-v`; the ptxas report in the program log gives
   registers, static shared memory, stack frame and spill bytes per function. Rules: the build
   succeeds, the registered kernel is in it, 0 spill bytes (stores and loads) in every
   function, stack frame <= the variant's `max_stack_bytes` (0 by default: no local arrays),
   static shared memory <= 48 KiB (sm_75's static limit; up to 64 KiB only as dynamic
   shared memory with the opt-in attribute, which the wrapper must set);
3. the same for sm_70 when the variant lists it and a CUDA 12 NVRTC is installed side by side
   (`pip install nvidia-cuda-nvrtc-cu12`; CUDA 13 cannot target sm_70). Without one, sm_70 is
   skipped and the table says so.

Prints a table: kernel | arch | registers | smem | stack | spills | status.

`occupancy_sm75(registers, smem, warps_per_block)`: resident blocks and warps per Turing SM from
those resource figures (CUDA's occupancy rules for cc 7.5); tests/test_turing_compile.py holds every
decode build to shared memory that never limits a Turing SM below its registers (issue 25).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import loader
from .variants import KernelVariant, all_variants

STATIC_SMEM_LIMIT = 48 * 1024  # bytes; sm_75 static __shared__ limit per block

# (what, regex) over the PTX with comments removed.
FORBIDDEN_PTX = (
    ("cp.async (sm_80+ asynchronous copy)", re.compile(r"\bcp\.async\b")),
    ("m16n8k16 MMA shape (sm_80+)", re.compile(r"\bm16n8k16\b")),
    ("m8n8k4 MMA shape (Volta-native, emulated elsewhere: 18.7 vs 434 TFLOP/s on the H200)", re.compile(r"\bm8n8k4\b")),
    ("bf16 type (sm_80+)", re.compile(r"\.bf16(x2)?\b")),
    ("tf32 type (sm_80+)", re.compile(r"\.tf32\b")),
    ("fp8/fp6/fp4 conversion (sm_89+)", re.compile(r"\bcvt\.[a-z0-9.]*\b(e4m3|e5m2|e2m1|e2m3|e3m2|ue8m0)")),
    ("wgmma/tcgen05 (Hopper/Blackwell)", re.compile(r"\b(wgmma|tcgen05)\b")),
)

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class FunctionStats:
    registers: int | None = None
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass
class KernelReport:
    label: str
    arch: str
    stats: FunctionStats | None
    problems: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


# Turing (cc 7.5) limits per SM, as CUDA's occupancy calculator (cuda_occupancy.h, CUDA 13) applies
# them: 65536 registers in 4 sub-partitions, allocated per warp in units of 256; 64 KiB of shared
# memory (the 64 KiB carveout; no per-block reservation before cc 8.0), allocated in 256-byte units;
# 32 warps; 16 blocks.
SM75_REGISTERS = 65536
SM75_REG_UNIT = 256
SM75_SUBPARTITIONS = 4
SM75_SMEM = 64 * 1024
SM75_SMEM_UNIT = 256
SM75_WARPS = 32
SM75_RESIDENT_CTAS = 16  # thread blocks resident per SM


@dataclass(frozen=True)
class Occupancy:
    """Blocks and warps per Turing SM, and which limit sets them (registers, shared, warps, blocks)."""

    warps_per_block: int
    blocks: int
    limit: str
    by: tuple[tuple[str, int], ...]  # (limit, blocks it allows)

    @property
    def warps(self) -> int:
        return self.blocks * self.warps_per_block

    def warps_allowed(self, limit: str) -> int:
        """Warps per SM that `limit` alone allows (at most the SM's 32)."""
        return min(SM75_WARPS, dict(self.by)[limit] * self.warps_per_block)


def occupancy_sm75(registers: int, smem: int, warps_per_block: int) -> Occupancy:
    """Resident blocks of `warps_per_block` warps per Turing SM for a kernel of `registers` registers
    per thread and `smem` bytes of shared memory per block (cudaOccMaxActiveBlocksPerMultiprocessor's
    rules for cc 7.5)."""
    reg_warp = -(-registers * 32 // SM75_REG_UNIT) * SM75_REG_UNIT
    if reg_warp * -(-warps_per_block // SM75_SUBPARTITIONS) * SM75_SUBPARTITIONS > SM75_REGISTERS:
        by_regs = 0
    elif reg_warp == 0:
        by_regs = SM75_RESIDENT_CTAS
    else:
        by_regs = SM75_REGISTERS // SM75_SUBPARTITIONS // reg_warp * SM75_SUBPARTITIONS // warps_per_block
    smem_block = -(-smem // SM75_SMEM_UNIT) * SM75_SMEM_UNIT
    by = (("registers", by_regs), ("shared", SM75_SMEM // smem_block if smem_block else SM75_RESIDENT_CTAS),
          ("warps", SM75_WARPS // warps_per_block), ("blocks", SM75_RESIDENT_CTAS))
    limit, blocks = min(by, key=lambda kv: kv[1])
    return Occupancy(warps_per_block, blocks, limit, by)


def parse_ptxas_log(log: str) -> dict[str, FunctionStats]:
    """ptxas -v report -> stats per function (entries and non-inlined device functions)."""
    stats: dict[str, FunctionStats] = {}
    entry = props_for = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            stats.setdefault(entry, FunctionStats())
        elif m := _PROPS.search(line):
            props_for = m.group(1)
            stats.setdefault(props_for, FunctionStats())
        elif (m := _FRAME.search(line)) and props_for is not None:
            s = stats[props_for]
            s.stack, s.spill_stores, s.spill_loads = (int(v) for v in m.groups())
        elif (m := _USED.search(line)) and entry is not None:
            s = stats[entry]
            s.registers = int(m.group(1))
            if sm := _SMEM.search(line):
                s.smem = int(sm.group(1))
    return stats


def scan_ptx(ptx: str) -> list[str]:
    """Names of forbidden instruction classes found in the PTX (comments ignored)."""
    code = re.sub(r"//[^\n]*", "", ptx)
    return [what for what, pattern in FORBIDDEN_PTX if pattern.search(code)]


def _first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[:n])


def check_module(
    nvrtc: loader.NVRTC,
    text: str,
    name: str,
    kernels: list[tuple[str, str, int]],
    defines: Mapping[str, object] | tuple = (),
    arch: str = "sm_75",
    scan: bool = True,
) -> list[KernelReport]:
    """Check one source text for one real arch; kernels = [(label, kernel name, max stack bytes)]."""
    reports = [KernelReport(label, arch, None) for label, _, _ in kernels]
    if scan:
        try:
            ptx = loader.compile_text(nvrtc, text, name, "compute_" + arch[3:], defines).ptx.decode(errors="replace")
        except loader.NVRTCError as exc:
            for r in reports:
                r.problems.append(f"PTX build failed: {_first_lines(str(exc))}")
            return reports
        found = scan_ptx(ptx)
        for r in reports:
            r.problems.extend(f"forbidden PTX: {what}" for what in found)
    try:
        result = loader.compile_text(nvrtc, text, name, arch, defines, ("--ptxas-options=-v",))
    except loader.NVRTCError as exc:
        for r in reports:
            r.problems.append(f"{arch} build failed: {_first_lines(str(exc))}")
        return reports
    stats = parse_ptxas_log(result.log)
    spilling = sorted(f for f, s in stats.items() if s.spill_stores or s.spill_loads)
    for r, (_, kernel_name, max_stack) in zip(reports, kernels, strict=True):
        r.stats = stats.get(kernel_name)
        if r.stats is None or r.stats.registers is None:
            r.problems.append(f"kernel {kernel_name!r} not found in the {arch} build (is it extern \"C\" __global__?)")
            continue
        if spilling:
            r.problems.append(f"register spills in {', '.join(spilling)}")
        if r.stats.stack > max_stack:
            r.problems.append(f"stack frame {r.stats.stack} B > {max_stack} B (local-memory arrays)")
        if r.stats.smem > STATIC_SMEM_LIMIT:
            r.problems.append(f"static shared memory {r.stats.smem} B > {STATIC_SMEM_LIMIT} B")
    return reports


def check_variants(variants: tuple[KernelVariant, ...] | None = None, nvrtc: loader.NVRTC | None = None,
                   cuda12: loader.CtypesNVRTC | None = None) -> tuple[list[KernelReport], list[str]]:
    """Check every variant; returns (reports, notes). cuda12: a CUDA 12 NVRTC or None (auto)."""
    if variants is None:
        variants = all_variants()
    if nvrtc is None:
        nvrtc = loader.CudaBindingsNVRTC()
    notes = [f"NVRTC {nvrtc.version[0]}.{nvrtc.version[1]} (cuda-bindings); options: {' '.join(loader.BASE_OPTIONS)}"]
    if cuda12 is None:
        lib = loader.find_cuda12_nvrtc()
        cuda12 = loader.CtypesNVRTC(lib) if lib else None
    if cuda12 is None:
        notes.append("sm_70: skipped, no CUDA 12 NVRTC installed (pip install nvidia-cuda-nvrtc-cu12)")
    else:
        notes.append(f"sm_70: NVRTC {cuda12.version[0]}.{cuda12.version[1]} ({cuda12.path})")

    # Group variants into modules: same file + same macros compile once.
    modules: dict[tuple, list[KernelVariant]] = {}
    for v in variants:
        modules.setdefault((v.source, v.defines), []).append(v)

    reports: list[KernelReport] = []
    for (source, defines), members in modules.items():
        name, text = loader.read_source(source)
        archs = sorted({a for v in members for a in v.archs}, reverse=True)  # sm_75 first
        for arch in archs:
            sel = [v for v in members if arch in v.archs]
            kernels = [(v.label, v.kernel, v.max_stack_bytes) for v in sel]
            compiler: loader.NVRTC
            if arch in ("sm_70", "sm_72"):  # CUDA 13's NVRTC dropped them: CUDA 12's compiles them
                if cuda12 is None:
                    reports.extend(KernelReport(label, arch, None, note="skipped: no CUDA 12 NVRTC")
                                   for label, _, _ in kernels)
                    continue
                compiler = cuda12
            else:
                compiler = nvrtc
            reports.extend(check_module(compiler, text, name, kernels, defines, arch, scan=arch == "sm_75"))
    return reports, notes


def format_table(reports: list[KernelReport]) -> str:
    head = ("kernel", "arch", "registers", "smem", "stack", "spills", "status")
    rows = [head]
    for r in reports:
        s = r.stats
        if s is None:
            cells = ("-", "-", "-", "-")
        else:
            cells = (str(s.registers), str(s.smem), str(s.stack), f"{s.spill_stores}/{s.spill_loads}")
        status = "; ".join(r.problems) if r.problems else (r.note or "ok")
        rows.append((r.label, r.arch, *cells, status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(" | ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + " | " + row[-1])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    reports, notes = check_variants()
    for note in notes:
        print(note)
    print(format_table(reports))
    bad = [r for r in reports if not r.ok]
    print(f"{len(reports) - len(bad)} ok, {len(bad)} failed" + ("" if not bad else ": see the status column"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
