"""`qpn verify`'s engine: a checkpoint folder (original or packed) opened as a Source, every layer
unpacked and compared with the checkpoint's bytes, dequantized on every backend present (numpy
reference, numba CPU, CUDA) to byte-identical fp16, and its linear run inside the derived fp32
bound (README, "Pack a checkpoint"). apps/cli.py prints the results; apps/demo.py runs it too.

Stacked experts (gpt-oss's MXFP4: Checkpoint.experts) are checked as layers too, one row per
projection of a stack ("{experts path}.w13", ".w2"): the same steps, expert by expert (verify_experts),
on the QPNMX buffers qpnmx_prepack / each backend's pack_mxfp4 build from the checkpoint's bytes. An MXFP4
linear (compressed-tensors' mxfp4-pack-quantized) is unpacked as every layer is, then checked as one expert.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from .. import checkpoints, ref
from ..checkpoints import packed as packing
from ..ref.formats import MX_BLOCK, QPN2
from . import mxfp4_checks
from .output import NO_BARS, UsageError, plural, table_line, table_rule

if TYPE_CHECKING:  # annotations only: torch is imported where a check needs it (the reference runs without)
    import torch

    from ..checkpoints.gpt_oss import MXFP4Experts
    from ..torch_bridge import PackedWeight

OK, FAIL, ABSENT = "ok", "FAIL", "-"


def format_name(format: str, granularity: str | None) -> str:
    """NVFP4, FP8/tensor, ...: the public format name, as `qpn pack` prints it, and the FP8 scale granularity."""
    return format.upper() if granularity is None else f"{format.upper()}/{granularity}"


DEFAULT_MS, MAX_M = (1, 40), 4096  # a decode M, one past the decode split (32); --m's bound: past all switches
DEFAULT_SEED, MAX_SEED = 0, 2**64 - 1  # a 64-bit seed (numpy's SeedSequence takes any int >= 0: one word is plenty)
EXPERT_PROJECTIONS = ("w13", "w2")  # MXFP4Experts' two weights: gate then up [2I, H], down [H, I]
T = TypeVar("T")


def cuda_status(need_torch: bool = True) -> tuple[bool, str]:
    """(usable, description): a CUDA device that CuPy (and, if need_torch, torch) can use."""
    if need_torch:
        import torch

        if not torch.cuda.is_available():
            return False, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    try:
        import cupy
    except ImportError as exc:
        return False, (f"CuPy is not importable ({exc}; install the extra: "
                       "pip install -e \".[cuda12]\" or \".[cuda13]\")")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver / no device
        return False, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "CuPy sees no CUDA device"
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return True, name.decode() if isinstance(name, bytes) else str(name)


@dataclass
class Backends:
    """The dequantize / linear backends present: "cpu" (numba, torch.ops.qpn) and "cuda" (CuPy kernels)."""

    devices: dict[str, torch.device]  # name -> torch.device
    lines: list[str]  # one description per backend, present or not

    @classmethod
    def find(cls) -> Backends:
        lines = ["numpy reference (qpn.ref): present"]
        devices: dict[str, torch.device] = {}
        try:
            import torch

            from .. import torch_bridge  # noqa: F401  registers torch.ops.qpn.*
        except Exception as exc:  # torch / numba missing or broken: the reference still runs
            lines.append(f"numba CPU (torch.ops.qpn): not found ({type(exc).__name__}: {exc})")
            lines.append("CUDA (qpn.cupy_kernels): not found (needs torch)")
            return cls(devices, lines)
        devices["cpu"] = torch.device("cpu")
        lines.append(f"numba CPU (torch.ops.qpn on cpu): present (torch {torch.__version__})")
        ok, detail = cuda_status()
        if ok:
            devices["cuda"] = torch.device("cuda")
            lines.append(f"CUDA (torch.ops.qpn on cuda, qpn.cupy_kernels): present ({detail})")
        else:
            lines.append(f"CUDA (qpn.cupy_kernels): not found - {detail}")
        return cls(devices, lines)


@dataclass
class Source:
    """A folder given on the command line: an original checkpoint or a packed one."""

    path: str
    packed: bool
    checkpoint: checkpoints.Checkpoint | packing.PackedCheckpoint

    @property
    def layer_names(self) -> list[str]:
        c = self.checkpoint
        return sorted(c.quantized_layers)

    @property
    def expert_rows(self) -> dict[str, tuple[MXFP4Experts, str]]:
        """"{experts path}.{w13 | w2}" -> (the stack, the projection): verify's rows of stacked experts
        (gpt-oss's MXFP4; a packed folder holds none)."""
        stacks = getattr(self.checkpoint, "experts", {})
        return {f"{path}.{stem}": (stack, stem) for path, stack in stacks.items() for stem in EXPERT_PROJECTIONS}

    @property
    def verify_names(self) -> list[str]:
        """What `qpn verify` checks, one table row each: the quantized layers, then the stacked experts' projections."""
        return self.layer_names + list(self.expert_rows)

    def describe(self) -> str:
        c = self.checkpoint
        kind = "qpn packed checkpoint of a" if self.packed else "original"
        rows = self.expert_rows
        sizes = " / ".join(map(str, sorted({stack.experts for stack, _ in rows.values()})))
        experts = (f" ({f'{len(rows)} of them ' if self.layer_names else ''}w13 and w2 of "
                   f"{plural(len(rows) // len(EXPERT_PROJECTIONS), 'stack')} of {sizes} MXFP4 experts)" if rows else "")
        return (f"{self.path}: {kind} {c.format} {c.quant_algo} checkpoint, "
                f"{plural(len(self.verify_names), 'quantized layer')}{experts}, "
                f"{plural(len(c.tensors), 'other tensor')}")


def open_source(path: str, *, check_values: bool = True) -> Source:
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist; pass a checkpoint folder")
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a folder; pass the checkpoint folder, not a file in it")
    if packing.is_packed(path):
        return Source(path, True, packing.load_packed(path, check_values=check_values))
    return Source(path, False, checkpoints.load_checkpoint(path))


def require_quantized_layers(source: Source) -> None:
    """UsageError (exit 2) for a folder with no quantized layer: `inspect` / `verify` would report
    "0 of 0 layers ok" for something that is not a usable quantized checkpoint."""
    why = packing.no_quantized_layer(source.checkpoint)
    if why is not None:
        raise UsageError(f"{source.path}: {why}")


@dataclass
class LayerResult:
    name: str
    fmt: str
    n: int
    k: int
    cells: dict = field(default_factory=dict)  # column -> OK / FAIL / ABSENT
    problems: list = field(default_factory=list)  # "column: what went wrong"
    upstream: dict = field(default_factory=dict)  # "P" / "E" (NVFP4) or "ckpt" (FP8) -> share of weights that differ

    @property
    def upstream_text(self) -> str:
        return ", ".join(f"{key} {100 * share:.1f} %" for key, share in self.upstream.items())

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, column: str, message: str) -> None:
        self.cells[column] = FAIL
        self.problems.append(f"{column}: {message}")


def _bits16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def _ordered16(a16: np.ndarray) -> np.ndarray:
    """fp16 bits -> int16 on a monotone line: +-magnitude (+0 and -0 both 0), so ulps are differences."""
    v = _bits16(a16).reshape(-1).view(np.int16)  # v = -32768 + magnitude where the sign bit is set
    sign = v >> 15  # -1 where negative, else 0 (arithmetic shift)
    ordered = v ^ (sign & np.int16(0x7FFF))  # negative: -1 - magnitude
    ordered -= sign  # negative: -magnitude (4x faster than np.where on 58 M weights)
    return ordered


def _worst_ulp_distance(a16: np.ndarray, b16: np.ndarray) -> int:
    """max |a - b| in fp16 ulps over finite fp16 arrays of one shape (+0 and -0 are 0 apart).

    Bits first: where a and b share a sign, their ulp distance is the difference of their bit
    patterns; where the signs differ, that difference is 0x8000 +- (at most 0x7BFF), never within
    +-1 modulo 2^16. So when every uint16 difference is -1, 0 or 1, the answer is 0 or 1 (two
    uint16 passes and two reductions, 0.1 s per 58 M weights instead of 0.45 s); otherwise the
    exact int32 distance decides (also for +0 vs -0).
    """
    diff = np.subtract(_bits16(a16), _bits16(b16))  # uint16, modulo 2^16
    diff += np.uint16(1)  # -1, 0, 1 -> 0, 1, 2
    if diff.size == 0 or diff.max() <= 2:
        return int(diff.size > 0 and (diff.min() != 1 or diff.max() != 1))
    a, b = _ordered16(a16).astype(np.int32), _ordered16(b16).astype(np.int32)
    return int(np.abs(a - b).max())


def _nvfp4_values_off_contract(weight_scale: np.ndarray, global_scale: np.ndarray) -> int:
    """How many values of ref.nvfp4_value_table (what nvfp4_dequantize looks up), over the scale bytes
    the layer uses x 16 codes, differ from the contract computed another way: float64 products (e4m3 *
    g and e2m1 * RN32(...) are exact there: 4 x 24 and 3 x 24 significant bits), RN32 by one cast,
    RN16 by numpy's float64 -> float16 cast (its own code path, not the float32 one the table uses)."""
    used = np.unique(weight_scale)
    g = float(np.float32(global_scale))
    block_multiplier = (ref.decode_e4m3(used).astype(np.float64) * g).astype(np.float32)  # RN32
    codes = ref.decode_e2m1(np.arange(16, dtype=np.uint8)).astype(np.float64)
    w32 = (block_multiplier.astype(np.float64)[:, None] * codes[None, :]).astype(np.float32)  # RN32
    expected = w32.astype(np.float64).astype(np.float16)  # RN16 (w32 is exact in float64)
    got = ref.nvfp4_value_table(np.float32(g))[used]
    return int(np.count_nonzero(_bits16(got) != _bits16(expected)))


def _share_differing(a16: np.ndarray, b16: np.ndarray) -> float:
    return float(np.mean(_bits16(a16) != _bits16(b16)))


def _packed_weight(layer: packing.PackedLayer, device: torch.device) -> PackedWeight:
    """The layer's packed weight on `device` (its CPU backend is numba, its CUDA backend CuPy)."""
    from ..torch_bridge import PackedWeight

    return PackedWeight.from_packed_layer(layer, device)


def _linear_on(packed: PackedWeight, x: np.ndarray) -> np.ndarray:
    import torch

    return packed.linear(torch.from_numpy(x).to(packed.device))[:, : packed.out_features].cpu().numpy()


def _linear_bounds(x16: np.ndarray, w16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ref.linear_bounds_fp32 with its fp32 matmuls on torch's CPU matmul: widening fp16 to fp32
    there is vectorized, numpy's astype is not (0.15 s per 14336 x 4096 layer, half of the bound's
    time; measured on the 2-core benchmark machine, bench_verify.py). torch's fp32 matmul accumulates
    in fp32 at matmul precision "highest"; otherwise, ref's own numpy matmul."""
    import torch

    def torch_fp32_sums(w16: np.ndarray, x32: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        w = torch.from_numpy(w16).float()  # exact
        x = torch.from_numpy(x32)
        s32 = w @ x[:m].T
        return s32.numpy(), (w.abs_() @ x.abs().T).numpy()

    from ..torch_bridge._cpu_ops import fp32_matmul_exact  # noqa: PLC0415  (torch, as above)

    return ref.linear_bounds_fp32(x16, w16, fp32_sums=torch_fp32_sums if fp32_matmul_exact() else None)


def _packed_layer_of(linear: checkpoints.QuantizedLinear) -> packing.PackedLayer:
    """Prepack an original layer with qpn.ref, as `qpn pack` would (for verifying an original folder)."""
    return packing.PackedLayer(linear.name, linear.weight_format.format, linear.n, linear.k,
                               packing.prepack_layer(linear), packing.scale_fields(linear))


def _new_result(source: Source, name: str) -> LayerResult:
    """The layer's name, format, N and K, before any check (the table can be laid out from these)."""
    c = source.checkpoint
    if name in source.expert_rows:
        stack, stem = source.expert_rows[name]
        blocks = getattr(stack, stem).blocks  # [E, N, K/32, 16]
        return LayerResult(name, f"MXFP4 x{stack.experts}", int(blocks.shape[1]), MX_BLOCK * int(blocks.shape[2]))
    if isinstance(c, packing.PackedCheckpoint):
        layer = c.layers[name]
        return LayerResult(name, format_name(layer.format, layer.granularity), layer.n, layer.k)
    linear = c.linears[name]
    return LayerResult(name, format_name(linear.weight_format.format, getattr(linear, "granularity", None)),
                       linear.n, linear.k)


def verify_layer(name: str, source: Source, backends: Backends, ms: Sequence[int], seed: int,
                 upstream: bool) -> LayerResult:
    """Every check of one layer (module docstring of the `verify` command in README / --help), in order:
    unpack, the reference's dequantization, every backend's, the linear; a step that cannot give the
    next its input ends the layer's checks. A row of stacked experts goes to verify_experts."""
    if name in source.expert_rows:
        return verify_experts(name, source, backends, ms, seed)
    c = source.checkpoint
    result = _new_result(source, name)
    if isinstance(c, packing.PackedCheckpoint):
        layer = c.layers[name]
    else:
        reason = packing.unpackable_reason(c.linears[name])
        if reason is not None:
            result.fail("unpack", f"cannot be packed: {reason}")
            return result
        layer = _packed_layer_of(c.linears[name])
    original = _check_unpack(result, c, name, layer)
    if original is None:
        return result
    if isinstance(original, checkpoints.MXFP4Linear):  # the rest as one expert's, on the weight padded to N_pad
        _verify_expert(result, name, *mxfp4_checks.padded(original), backends, ms, seed)
        return result
    weights = _check_reference(result, layer, original)
    if weights is None:
        return result
    w16, checkpoint_w16 = weights
    packed = _packed_on_backends(result, lambda device: _packed_weight(layer, device), backends)
    _check_backend_dequantize(result, packed, w16)
    _check_linear(result, name, w16, packed, ms, seed, _linear_bounds, "ref.linear_bounds_of_fp32_sums")
    if upstream:
        result.upstream = _upstream_shares(layer, w16, checkpoint_w16)
    return result


def _check_unpack(result: LayerResult, c: checkpoints.Checkpoint | packing.PackedCheckpoint, name: str,
                  layer: packing.PackedLayer) -> checkpoints.QuantizedLinear | None:
    """Step 1: the packed bytes give back the checkpoint's bytes, and prepacking those gives the packed
    bytes. Returns the unpacked layer (None: it could not be unpacked)."""
    try:
        original = layer.unpack()
    except ValueError as exc:
        result.fail("unpack", str(exc))
        return None
    back = {role: t.array for role, t in packing.source_tensors(original).items()}
    if isinstance(c, packing.PackedCheckpoint):
        _check_against_manifest(result, name, layer, original, back)
    else:
        wanted = {role: t.array for role, t in packing.source_tensors(c.linears[name]).items()}
        bad = [role for role in wanted if not np.array_equal(_u8(wanted[role]), _u8(back[role]))]
        if bad:
            result.fail("unpack", f"unpack(prepack(x)) != x for {', '.join(bad)}")
    result.cells.setdefault("unpack", OK)
    return original


def _check_against_manifest(result: LayerResult, name: str, layer: packing.PackedLayer,
                            original: checkpoints.QuantizedLinear, back: dict[str, np.ndarray]) -> None:
    """Step 1 of a packed folder: the unpacked tensors' sha256 and scalars are the manifest's, and a fresh
    prepack of them gives the stored buffers."""
    expected = layer.entry["source_tensors"]
    bad = [role for role, a in back.items() if packing.sha256_array(a) != expected[role]["sha256"]]
    if bad:
        result.fail("unpack", f"unpacking gives {', '.join(bad)} bytes whose sha256 differs from the manifest's "
                              "(the packed file is corrupt)")
    scalars = {"global_scale": getattr(original, "global_scale", None), "input_scale": original.input_scale}
    if isinstance(original, checkpoints.FP8Linear) and layer.granularity == "tensor":
        scalars["weight_scale"] = original.weight_scale
    bad = [key for key, value in scalars.items()
           if (value is None) != (key not in layer.entry) or
           (value is not None and np.float32(layer.entry[key][0]) != value)]
    if bad:
        result.fail("unpack", f"{', '.join(bad)} differ from the manifest's (the packed file is corrupt)")
    repacked = packing.prepack_layer(original)
    bad = [s for s, a in layer.buffers().items() if not np.array_equal(_u8(a), _u8(repacked[s]))]
    if bad:
        result.fail("unpack", f"{', '.join(f'{name}.{s}' for s in bad)} differ from a fresh prepack of the "
                              "unpacked layer (the packed file is corrupt)")


def _check_reference(result: LayerResult, layer: packing.PackedLayer,
                     original: checkpoints.NVFP4Linear | checkpoints.FP8Linear,
                     ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Step 2a: the reference's W16 and, for FP8, the checkpoint semantics' (None: the reference raised)."""
    checkpoint_w16 = None
    try:
        if isinstance(original, checkpoints.NVFP4Linear):
            # Decoded once: the packed bytes are the checkpoint's (step 1), so qpn2_dequantize would
            # repeat this very call. What is left to check is the reference's arithmetic; how it
            # looks the values up is checked by the backends.
            w16 = ref.nvfp4_dequantize(original.weight_packed, original.weight_scale, original.global_scale)
            wrong = _nvfp4_values_off_contract(original.weight_scale, original.global_scale)
            if wrong:
                result.fail("ref", f"{wrong} of the (scale byte, code) values this layer uses differ from the "
                                   "contract RN16(RN32(e2m1 * RN32(e4m3 * g))) evaluated in float64")
        else:
            # the bytes step 1 unpacked (and compared) from layer.codes, not a third permutation of them
            w16 = ref.qpn8.qpn8_dequantize_unpacked(original.weight, layer.scales, layer.n_padded, layer.k)
            checkpoint_w16 = ref.fp8_dequantize(original.weight, original.weight_scale)
            worst = _worst_ulp_distance(w16, checkpoint_w16)
            if worst > 1:  # the QPN8 contract differs from RN16(RN32(e4m3 * s)) by at most 1 ulp (docs/QPN8.md)
                result.fail("ref", f"qpn8_dequantize is {worst} ulp from the checkpoint semantics (the contract "
                                   "allows 1)")
    except ValueError as exc:
        result.fail("ref", str(exc))
        return None
    result.cells.setdefault("ref", OK)
    return w16, checkpoint_w16


def _packed_on_backends(result: LayerResult, build: Callable[[torch.device], PackedWeight], backends: Backends
                        ) -> dict[str, PackedWeight]:
    """The layer's packed weight, build(device), on every backend present, built once (steps 2b and 3 share
    it); a backend that cannot hold it fails its cell."""
    packed: dict[str, PackedWeight] = {}
    for backend in ("cpu", "cuda"):
        if backend not in backends.devices:
            result.cells[backend] = ABSENT
            continue
        try:
            packed[backend] = build(backends.devices[backend])
        except Exception as exc:  # a backend that raises on valid buffers is a failure to report, not a crash
            result.fail(backend, f"packing raised {type(exc).__name__}: {exc}")
    return packed


def _check_backend_dequantize(result: LayerResult, packed: dict[str, PackedWeight], w16: np.ndarray) -> None:
    """Step 2b: every backend present gives the reference's fp16 bytes."""
    for backend, weight in packed.items():
        try:
            got = weight.dequantize().cpu().numpy()
        except Exception as exc:  # a backend that raises on valid buffers is a failure to report, not a crash
            result.fail(backend, f"dequantize raised {type(exc).__name__}: {exc}")
            continue
        if not np.array_equal(_bits16(got), _bits16(w16)):
            result.fail(backend, f"dequantize differs from the reference in {100 * _share_differing(got, w16):.3g} % "
                                 "of weights")
        else:
            result.cells.setdefault(backend, OK)  # a FAIL found before (a stacked expert's prepack bytes) stays


def _check_linear(result: LayerResult, name: str, w16: np.ndarray, packed: dict[str, PackedWeight],
                  ms: Sequence[int], seed: int,
                  bounds: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], bound_name: str) -> None:
    """Step 3: the linear on random activations (seeded by `seed` and `name`), inside the derived
    fp32-accumulation bound around the exact reference (bounds(x16, w16) -> (lo, hi), named `bound_name` in a
    failure), on every backend present."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    xs = [rng.standard_normal((m, w16.shape[1]), dtype=np.float32).astype(np.float16) for m in ms]
    # one bound for all M at once (w16 is widened once, not per M)
    lo_all, hi_all = bounds(np.concatenate(xs), w16)
    rows = np.cumsum([0, *ms])
    linear_cell = ABSENT
    for m, x, start, stop in zip(ms, xs, rows[:-1], rows[1:], strict=True):
        lo, hi = lo_all[start:stop], hi_all[start:stop]
        for backend, weight in packed.items():
            try:
                y = _linear_on(weight, x)
            except Exception as exc:
                result.fail("linear", f"{backend} M={m} raised {type(exc).__name__}: {exc}")
                continue
            outside = ~((lo <= y) & (y <= hi))
            if outside.any():
                result.fail("linear", f"{backend} M={m}: {int(outside.sum())} outputs outside the fp32-accumulation "
                                      f"bound of {bound_name}")
            elif linear_cell != FAIL:
                linear_cell = OK
    result.cells.setdefault("linear", linear_cell)


def _upstream_shares(layer: packing.PackedLayer, w16: np.ndarray, checkpoint_w16: np.ndarray | None,
                     ) -> dict[str, float]:
    """The share of weights whose fp16 bytes upstream's decode roundings (NVFP4: P / E, ref.UPSTREAM_VARIANTS)
    or the checkpoint semantics (FP8) would change."""
    if layer.weight_format is QPN2:
        args = (layer.codes, layer.scales, layer.nvfp4_global_scale(), layer.n_padded, layer.k)
        p = ref.qpn2_dequantize_variant_p(*args)[:layer.n]
        e = ref.qpn2_dequantize_variant_e(*args)[:layer.n]
        return {"P": _share_differing(p, w16), "E": _share_differing(e, w16)}
    assert checkpoint_w16 is not None  # every FP8 layer has the checkpoint semantics' W16 (step 2a)
    return {"ckpt": _share_differing(w16, checkpoint_w16)}


# ---------------------------------------------------------------------------------------------- stacked experts


def verify_experts(name: str, source: Source, backends: Backends, ms: Sequence[int], seed: int) -> LayerResult:
    """Every check of one projection of a stack of MXFP4 experts (a row "{path}.w13" / ".w2"): verify_layer's
    steps on each expert in turn into the row's one result (a cell fails if it fails for any expert: a step sets
    ok only where nothing failed), the linear on mxfp4_checks.linear_experts(E) of them; no upstream shares."""
    stack, stem = source.expert_rows[name]
    weight = getattr(stack, stem)  # ref.mxfp4.MXFP4Weight: blocks [E, N, K/32, 16], scales [E, N, K/32]
    result = _new_result(source, name)
    with_linear = set(mxfp4_checks.linear_experts(stack.experts))
    problems = []  # per expert
    for e in range(stack.experts):
        _verify_expert(result, f"{name}[{e}]", weight.blocks[e], weight.scales[e], backends,
                       ms if e in with_linear else (), seed)
        problems.append(result.problems)
        result.problems = []
    result.problems = mxfp4_checks.expert_problems(problems)
    return result


def _verify_expert(result: LayerResult, name: str, blocks: np.ndarray, scales: np.ndarray, backends: Backends,
                   ms: Sequence[int], seed: int) -> None:
    """verify_layer's steps on one expert's weight (gpt-oss's blocks [N, K/32, 16], scales [N, K/32]): the
    reference side from mxfp4_checks, the backends and the linear as a layer's; no linear when `ms` is empty."""
    buffers = _expert_step(result, "unpack", mxfp4_checks.qpnmx_round_trip, blocks, scales)
    weights = None if buffers is None else _expert_step(result, "ref", mxfp4_checks.mxfp4_reference, blocks,
                                                        scales, buffers)
    if buffers is None or weights is None:
        return
    w16, tile_scale = weights
    packed = _packed_on_backends(result, lambda device: mxfp4_checks.pack_on(blocks, scales, device), backends)
    for backend, weight in packed.items():
        for problem in mxfp4_checks.prepack_problems(weight, buffers):
            result.fail(backend, problem)
    _check_backend_dequantize(result, packed, w16)
    if ms:
        _check_linear(result, name, w16, packed, ms, seed,
                      lambda x16, w: ref.mxfp4.mxfp4_linear_bounds(x16, w, tile_scale), "ref.mxfp4_linear_bounds")


def _expert_step(result: LayerResult, column: str, check: Callable[..., tuple[T, list[str]]], *args: object
                 ) -> T | None:
    """One check of mxfp4_checks, (value, problems), recorded under `column`; one that raised ValueError gives None."""
    try:
        value, problems = check(*args)
    except ValueError as exc:
        result.fail(column, str(exc))
        return None
    for problem in problems:
        result.fail(column, problem)
    result.cells.setdefault(column, OK)
    return value


def _u8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def verify_source(source: Source, *, ms: Sequence[int] = DEFAULT_MS, seed: int = DEFAULT_SEED,
                  upstream: bool = False, progress: Callable = NO_BARS,
                  backends: Backends | None = None,
                  on_result: Callable[[LayerResult], None] = lambda _: None) -> tuple[list[LayerResult], list[str]]:
    """(per-layer results, problems outside the layers: copied tensors and config files of a packed folder).

    on_result(result) is called as each layer finishes (`qpn verify` prints its row there).
    """
    backends = backends or Backends.find()
    names = source.verify_names
    results = []
    for name in progress(names, desc="verify", total=len(names), unit="layer"):
        results.append(verify_layer(name, source, backends, ms, seed, upstream))
        on_result(results[-1])
    other = []
    c = source.checkpoint
    if isinstance(c, packing.PackedCheckpoint):
        bad = [name for name, entry in c.manifest["tensors"].items()
               if packing.sha256_array(c.tensors[name].array) != entry["sha256"]]
        if bad:
            other.append(f"copied tensors whose sha256 differs from the manifest: {', '.join(bad)}")
        other += packing.copied_file_problems(c)  # the configs and the other copied files
    return results, other


VERIFY_CHECKS = ("unpack", "ref", "cpu", "cuda", "linear")


class VerifyTable:
    """The per-layer table of `qpn verify`, laid out before the checks run so rows print as layers finish."""

    def __init__(self, source: Source, upstream: bool) -> None:
        firsts = [_new_result(source, name) for name in source.verify_names]
        self.headers = ["layer", "format", "N", "K", *VERIFY_CHECKS] + (["upstream differs"] if upstream else [])
        columns = [[r.name for r in firsts], [r.fmt for r in firsts], [str(r.n) for r in firsts],
                   [str(r.k) for r in firsts]] + [[OK, FAIL, ABSENT]] * len(VERIFY_CHECKS) + [[]] * upstream
        self.widths = [max([len(h), *(len(v) for v in col)]) for h, col in zip(self.headers, columns, strict=True)]
        self.upstream = upstream

    def head(self) -> list[str]:
        return [table_line(self.headers, self.widths), table_rule(self.widths)]

    def row(self, r: LayerResult) -> str:
        cells = [r.name, r.fmt, r.n, r.k] + [r.cells.get(col, ABSENT) for col in VERIFY_CHECKS]
        return table_line(cells + ([r.upstream_text] if self.upstream else []), self.widths)


def verify_report_head(source: Source, backends: Backends, ms: Sequence[int]) -> list[str]:
    sizes = [stack.experts for stack, _ in source.expert_rows.values()]
    return [source.describe(), "backends:", *(f"  {line}" for line in backends.lines),
            f"checks: unpack = packed bytes <-> checkpoint bytes; ref / cpu / cuda = fp16 weights byte-equal to the "
            f"reference; linear = x[M, K] @ W16^T with M in {list(ms)} inside the fp32-accumulation bound",
            *([mxfp4_checks.checks_line(sizes)] if sizes else [])]


def verify_report_tail(source: Source, results: Sequence[LayerResult], other: Sequence[str],
                       upstream: bool) -> list[str]:
    lines = []
    if upstream:
        lines.append("(upstream differs: share of weights where upstream's decode roundings P / E (NVFP4) or the "
                     "checkpoint semantics (FP8) give other fp16 bytes than the qpn contract; "
                     f"{ref.UPSTREAM_VARIANTS})")
    failed = [r for r in results if not r.ok]
    lines += [f"FAIL {r.name}: {problem}" for r in failed for problem in r.problems]
    lines += [f"FAIL {problem}" for problem in other]
    copied = (f"; {plural(len(source.checkpoint.tensors), 'other tensor')} "
              + ("checked" if source.packed else "not checked"))
    lines.append(f"{len(results) - len(failed)} of {plural(len(results), 'layer')} ok{copied}"
                 + (f"; {len(failed) + len(other)} FAILED" if failed or other else ""))
    return lines


def upstream_summary(results: Sequence[LayerResult]) -> str:
    """The `upstream` shares over all layers, weighted by each layer's N * K."""
    totals: dict[str, float] = {}
    weights = sum(r.n * r.k for r in results if r.upstream)
    for r in results:
        for key, share in r.upstream.items():
            totals[key] = totals.get(key, 0.0) + share * r.n * r.k
    return ", ".join(f"{key} {100 * total / weights:.1f} %" for key, total in totals.items()) if weights else ""
