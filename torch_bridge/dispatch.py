"""The one dispatch policy of the linear ops: which kernel path runs a call (device, M, N, K, gated).

Candidates, each with the range it can implement:

    path       device  M          what runs
    decode     cuda    1-32       the decode kernels (cupy_kernels/linear.py)
    gemm       cuda    >= 1       the fused-dequantize GEMM (cupy_kernels/gemm.py; built for 33-512)
    dense      cuda    >= 1       dequantize to fp16, then cuBLAS with fp32 accumulation (_cuda.py)
    cpu_fused  cpu     1-32       numba: the decode fused into the dot products (_cpu.py)
    cpu_blas   cpu     >= 1       numba decode in chunks, then torch's fp32 matmul (_cpu_ops.py)

The choice is the candidate of least cost, cost read from the MEASURED table of the device family
(`dispatch_tables/<family>.json`: "sm_90" for an H200, "cpu" for the CPU backend), written by
`benchmarks/bench_dispatch.py` on that family (times of every path at a grid of M on a set of
layer shapes). A call's cost: the row of the same layout (QPN8 block scales fall back to QPN8's rows,
gated to plain) at the measured shape nearest in log N + log K, linear in M between the measured M
(beyond the last, proportional to M), scaled by N*K over the row's when larger (a smaller layer is
latency-bound: it takes the measured layer's time). A family without a table, or a
call no measured path covers, takes the rule the kernels were tuned for (`rule_path`): decode up to 32,
the GEMM up to cupy_kernels.gemm_threshold, dense above; on the CPU the fused kernels up to
_cpu.FUSED_MAX_M (the measured 4096 x 4096 crossover), decode-then-BLAS above.

bf16 activations take the same choice as fp16: on CUDA every path runs them through fp16 rows (each row
times a power of two, exact: docs/DESIGN.md, "bf16 activations"), written by one small launch that the
decode at M <= 8 and the dense path add and the other paths take in place of their x-fragment launch
(benchmarks/results/bf16_h200.md); the CPU paths take bf16 as they are.

Every path computes the contract's W16 with fp32 accumulation: the choice moves time, never a
weight (an output can move by the fp32 summation order only, inside ref.linear_bounds). Host
arithmetic only, cached per call shape: safe on every forward and under CUDA-graph capture.
`describe()` prints the table and the choices (`qpn inspect --dispatch`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cupy_kernels.linear import MAX_M  # a constant: importing it imports no CuPy
from ..ref.formats import BY_KEY, WEIGHT_FORMATS, WeightFormat

TABLES = Path(__file__).resolve().parent / "dispatch_tables"
# the decode kernels' range (4 tensor-core n8 blocks); the fused numba kernels run any M but are offered
# to the policy over the same range, the one their table measures (their time grows ~M^2 past M = 8)
DECODE_MAX_M = CPU_FUSED_MAX_M = MAX_M


@dataclass(frozen=True)
class Candidate:
    name: str
    device: str  # "cuda" | "cpu"
    max_m: int | None  # None: any M

    def can_implement(self, device: str, m: int) -> bool:
        return device == self.device and m >= 1 and (self.max_m is None or m <= self.max_m)


CANDIDATES = (
    Candidate("decode", "cuda", DECODE_MAX_M),
    Candidate("gemm", "cuda", None),
    Candidate("dense", "cuda", None),
    Candidate("cpu_fused", "cpu", CPU_FUSED_MAX_M),
    Candidate("cpu_blas", "cpu", None),
)
PATHS = tuple(c.name for c in CANDIDATES)


def device_family(device: torch.device) -> str:
    """"cpu", or "sm_<major><minor>" of a CUDA device (the tables' key)."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_family(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_family(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@dataclass(frozen=True)
class Row:
    layout: str  # a WeightFormat key
    n: int
    k: int
    gated: bool
    m: int
    us: dict[str, float]  # path -> measured microseconds


@functools.cache
def table(family: str) -> tuple[Row, ...]:
    """The measured rows of `family` (empty without a table file)."""
    path = TABLES / f"{family}.json"
    if not path.is_file():
        return ()
    data = json.loads(path.read_text())
    return tuple(Row(r["layout"], r["n"], r["k"], r["gated"], r["m"], dict(r["us"])) for r in data["rows"])


def _rows_for(rows: tuple[Row, ...], wf: WeightFormat, gated: bool) -> list[Row]:
    """The layout's own rows, else those of a description with its byte layout (QPN8 for QPN8_BLOCK);
    gated rows, else plain ones."""
    for layout in dict.fromkeys((wf.key, *(f.key for f in WEIGHT_FORMATS if f.layout == wf.layout))):
        for g in dict.fromkeys((gated, False)):
            found = [r for r in rows if r.layout == layout and r.gated == g]
            if found:
                return found
    return []


def _interpolate(points: list[tuple[int, float]], m: int) -> float:
    points.sort()
    if m <= points[0][0]:
        return points[0][1]
    if m >= points[-1][0]:
        return points[-1][1] * m / points[-1][0]
    for (m0, t0), (m1, t1) in zip(points, points[1:], strict=False):
        if m0 <= m <= m1:
            return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
    raise AssertionError("unreachable: m lies between the first and the last point")


def costs(family: str, wf: WeightFormat, m: int, n: int, k: int, gated: bool) -> dict[str, float]:
    """Estimated microseconds of every path the table measured for this call (module docstring)."""
    rows = _rows_for(table(family), wf, gated)
    if not rows:
        return {}
    shapes = {(r.n, r.k) for r in rows}
    nr, kr = min(shapes, key=lambda s: (abs(math.log(n / s[0])) + abs(math.log(k / s[1])), s))
    scale = max(1.0, n * k / (nr * kr))  # smaller layers are latency-bound: the measured layer's time
    points: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if (r.n, r.k) == (nr, kr):
            for path, us in r.us.items():
                points.setdefault(path, []).append((r.m, us))
    return {path: _interpolate(p, m) * scale for path, p in points.items()}


def rule_path(device: str, wf: WeightFormat, m: int, n: int, k: int) -> str:
    """The path without a measured table (module docstring)."""
    if device == "cpu":
        from ._cpu import FUSED_MAX_M  # noqa: PLC0415  (a constant; numba itself is imported on first use)

        return "cpu_fused" if m <= FUSED_MAX_M else "cpu_blas"
    from ..cupy_kernels.gemm import gemm_threshold  # noqa: PLC0415  (reads the device: CUDA only)

    if m <= DECODE_MAX_M:
        return "decode"
    return "gemm" if m <= gemm_threshold(wf.format, n, k) else "dense"


def _device_kind(family: str) -> str:
    """"cpu" or "cuda": what a family's paths run on (the candidates' can_implement reads it)."""
    return "cpu" if family == "cpu" else "cuda"


@functools.lru_cache(maxsize=4096)
def _choose(family: str, key: str, m: int, n: int, k: int, gated: bool) -> str:
    wf = BY_KEY[key]
    device = _device_kind(family)
    able = [c.name for c in CANDIDATES if c.can_implement(device, m)]
    measured = {path: t for path, t in costs(family, wf, m, n, k, gated).items() if path in able}
    if measured:
        return min(measured, key=lambda path: (measured[path], PATHS.index(path)))
    return rule_path(device, wf, m, n, k)


def choose(device: torch.device, wf: WeightFormat, m: int, n: int, k: int, gated: bool) -> str:
    """The path that runs an [M, K] x [N, K] call of layout `wf` on `device` (the one place it is chosen): the
    measured table's choice, for fp16 and bf16 activations alike (module docstring)."""
    return _choose(device_family(device), wf.key, m, n, k, gated)


DESCRIBE_MS = (1, 8, 16, 32, 33, 48, 64, 96, 128, 256, 512, 1024)
DESCRIBE_SHAPES = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (5120, 17408))


def families() -> list[str]:
    """The device families of this machine ("cpu", then each CUDA device's) and of every committed table."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [_cuda_family(i) for i in range(torch.cuda.device_count())]
    found += sorted(p.stem for p in TABLES.glob("*.json"))
    return list(dict.fromkeys(found))


def describe(family: str, wf: WeightFormat, gated: bool = False,
             shapes: tuple[tuple[int, int], ...] = DESCRIBE_SHAPES) -> str:
    """A text table: per [N, K] shape and M, the path chosen and the estimated us of it ("?": a CUDA
    family without a table, whose rule reads the device: run on that device)."""
    rows = _rows_for(table(family), wf, gated)
    if rows:
        source = f"measured table dispatch_tables/{family}.json ({len(rows)} rows of {rows[0].layout}" \
                 f"{', gated' if rows[0].gated else ''})"
    else:
        source = f"no measured table for {family}: the rule (rule_path)"
    lines = [f"dispatch for {wf.label}{' (gated)' if gated else ''} on {family}: {source}"]
    for n, k in shapes:
        cells = []
        for m in DESCRIBE_MS:
            est = costs(family, wf, m, n, k, gated)
            pick = _choose(family, wf.key, m, n, k, gated) if family == "cpu" or est else "?"
            cells.append(f"M={m}: {pick}" + (f" {est[pick]:.1f}us" if pick in est else ""))
        lines.append(f"  {n}x{k}: " + ", ".join(cells))
    return "\n".join(lines)
