"""`qpn verify`'s MXFP4 checks of stacked experts (gpt-oss), one expert's weight at a time: gpt-oss's blocks uint8
[N, K/32, 16] and scales uint8 [N, K/32] (ref/mxfp4.py). apps/verify.py (verify_experts) runs them on every
expert of a stack and records what they find in the stack's row, next to the backend and linear steps it shares
with the per-linear layers; an MXFP4 linear (checkpoints.MXFP4Linear) runs them as one expert, on its weight
padded to whole 32-row tiles (`padded`). Each check returns (what the next step needs, the problems found, as
messages); a ValueError means the step could not run.

- qpnmx_round_trip ("unpack"): qpnmx_prepack, then qpnmx_unpack, gives the checkpoint's bytes back;
- mxfp4_reference ("ref"): mxfp4_w16 is the W16 contract evaluated another way, and qpnmx_dequantize of the
  packed buffers gives its bytes;
- pack_on / prepack_problems ("cpu", "cuda"): pack_mxfp4 on a backend's device gives qpnmx_prepack's bytes (the
  CPU prepack op is qpnmx_prepack itself; the CUDA one is CuPy's kernel). The backends' dequantize and linear
  are checked by verify.py's shared steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import ref
from ..checkpoints import MXFP4Linear
from ..checkpoints.packed.layers import MXFP4_PAD_SCALE_BYTE
from ..ref.codecs import E8M0_BIAS
from ..ref.formats import MX_BLOCK, QPNMX
from ..ref.geometry import TILE_N
from .output import plural

if TYPE_CHECKING:  # annotations only: torch is imported where a check needs it
    import torch

    from ..torch_bridge import PackedWeight

# experts of a stack whose linear `qpn verify` runs (every one is unpacked and dequantized): the kernel is the same
# for all, and gpt-oss-20b's 32 experts x 48 projections would make the linear most of verify's time
LINEAR_EXPERTS = 8
EXPERT_PROBLEMS_SHOWN = 3  # per check of a row, the experts whose failure is spelt out; the rest are counted
QPNMXBuffers = tuple[np.ndarray, np.ndarray, np.ndarray]  # qpnmx_prepack's codes, scales, tile_scale


def linear_experts(experts: int) -> list[int]:
    """The experts of a stack of `experts` whose linear `qpn verify` runs: all up to LINEAR_EXPERTS, else
    LINEAR_EXPERTS spread evenly from the first to the last."""
    if experts <= LINEAR_EXPERTS:
        return list(range(experts))
    return sorted({round(i * (experts - 1) / (LINEAR_EXPERTS - 1)) for i in range(LINEAR_EXPERTS)})


def checks_line(stack_sizes: Iterable[int]) -> str:
    """The line `qpn verify`'s report head adds for stacked experts (stacks of `stack_sizes` experts)."""
    which = "; ".join(f"experts {linear_experts(e)} of {e}" if e > LINEAR_EXPERTS else f"all {e} experts"
                      for e in sorted(set(stack_sizes)))
    return ("stacked experts (MXFP4 xE): each check on every expert of the row's stack (packed by ref.qpnmx_prepack, "
            f"and by pack_mxfp4 on each backend, whose bytes must match), the linear on {which} (W16 times its "
            "tiles' 2^T); a cell fails if any expert fails")


def expert_problems(per_expert: Sequence[list[str]]) -> list[str]:
    """A stack's row's problems from its experts' ("check: message" each, expert 0 first): the first
    EXPERT_PROBLEMS_SHOWN experts a check fails for named ("check: expert e: message"), the others counted."""
    out: list[str] = []
    failing: dict[str, list[int]] = {}  # check -> the experts it fails for
    for expert, problems in enumerate(per_expert):
        for problem in problems:
            check, _, message = problem.partition(": ")
            experts = failing.setdefault(check, [])
            if expert not in experts:
                experts.append(expert)
            if len(experts) <= EXPERT_PROBLEMS_SHOWN:
                out.append(f"{check}: expert {expert}: {message}")
    return out + [f"{check}: fails for {plural(len(rest), 'more expert')} too: {', '.join(map(str, rest))}"
                  for check, experts in failing.items() if (rest := experts[EXPERT_PROBLEMS_SHOWN:])]


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def padded(linear: MXFP4Linear) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 linear's (blocks [N_pad, K/32, 16], scales [N_pad, K/32]), padded as qpn pack and pack_mxfp4 pad:
    zero codes, scale byte MXFP4_PAD_SCALE_BYTE (pad weights +0; qpnmx_prepack takes whole 32-row tiles)."""
    n, n_pad = linear.n, QPNMX.padded_n(linear.n)
    blocks = np.full((n_pad, *linear.blocks.shape[1:]), QPNMX.pad_code, np.uint8)
    scales = np.full((n_pad, linear.scales.shape[1]), MXFP4_PAD_SCALE_BYTE, np.uint8)
    blocks[:n], scales[:n] = linear.blocks, linear.scales
    return blocks, scales


def qpnmx_round_trip(blocks: np.ndarray, scales: np.ndarray) -> tuple[QPNMXBuffers, list[str]]:
    """(the QPNMX buffers of qpnmx_prepack, problems): qpnmx_unpack of those must give the checkpoint's bytes."""
    buffers = ref.mxfp4.qpnmx_prepack(blocks, scales)  # ValueError: not a packable weight (N, K, NaN scales)
    n, k = blocks.shape[0], MX_BLOCK * blocks.shape[1]
    back = ref.mxfp4.qpnmx_unpack(buffers[0], buffers[1], n, k)
    bad = [role for role, want, got in zip(("blocks", "scales"), (blocks, scales), back, strict=True)
           if not _same_bytes(want, got)]
    return buffers, [f"qpnmx_unpack(qpnmx_prepack(x)) != x for {', '.join(bad)}"] if bad else []


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray, buffers: QPNMXBuffers,
                    ) -> tuple[tuple[np.ndarray, np.ndarray], list[str]]:
    """((W16 float16 [N, K], tile_scale float32 [N/32]) = mxfp4_w16 of the checkpoint's bytes, problems): the
    contract evaluated another way (_w16_off_contract) must give the same, and qpnmx_dequantize of the packed
    buffers the same fp16 bytes."""
    w16, tile_scale = ref.mxfp4.mxfp4_w16(blocks, scales)
    packed_w16 = ref.mxfp4.qpnmx_dequantize(*buffers, *w16.shape)
    problems = _w16_off_contract(blocks, scales, w16, tile_scale)
    differ = np.ascontiguousarray(packed_w16).view(np.uint16) != w16.view(np.uint16)
    if differ.any():
        problems.append(f"qpnmx_dequantize of the packed buffers differs from mxfp4_w16 of the checkpoint's bytes in "
                        f"{100 * differ.mean():.3g} % of weights")
    return (w16, tile_scale), problems


def _w16_off_contract(blocks: np.ndarray, scales: np.ndarray, w16: np.ndarray, tile_scale: np.ndarray) -> list[str]:
    """What of mxfp4_w16's (W16, 2^T) differs from the contract (ref/mxfp4.py, "W16") computed another way:
    T(t) = the 32-row tile's largest scale byte - 127 - W16_TOP_EXP, and W16 = RN16(value / 2^T) from the exact
    values of mxfp4_values (float64: value / 2^T = e2m1 * 2^(s - 127 - T), an exponent >= -241, is exact there)
    rounded once by numpy's float64 -> float16 cast."""
    top = scales.reshape(-1, TILE_N * scales.shape[-1]).max(axis=1).astype(np.int64)
    two_t = np.ldexp(1.0, top - E8M0_BIAS - ref.mxfp4.W16_TOP_EXP)  # float64, exact
    if not np.array_equal(np.asarray(tile_scale, np.float64), two_t):
        return ["mxfp4_w16's tile scales are not 2^(the tile's largest e8m0 exponent - W16_TOP_EXP)"]
    expected = (ref.mxfp4.mxfp4_values(blocks, scales) / np.repeat(two_t, TILE_N)[:, None]).astype(np.float16)
    wrong = int(np.count_nonzero(w16.view(np.uint16) != expected.view(np.uint16)))
    return [f"mxfp4_w16 differs from the contract RN16(value / 2^T) evaluated in float64 from mxfp4_values in "
            f"{plural(wrong, 'weight')}"] if wrong else []


def pack_on(blocks: np.ndarray, scales: np.ndarray, device: torch.device) -> PackedWeight:
    """One expert's weight packed on `device` by pack_mxfp4 (torch.ops.qpn.mxfp4_prepack runs there)."""
    import torch

    from .. import torch_bridge

    return torch_bridge.pack_mxfp4(torch.from_numpy(np.array(blocks)).to(device),
                                   torch.from_numpy(np.array(scales)).to(device))


def prepack_problems(weight: PackedWeight, buffers: QPNMXBuffers) -> list[str]:
    """A backend's packed weight holds qpnmx_prepack's bytes (no pad rows: qpnmx_prepack takes whole 32-row tiles)."""
    bad = [name for name, want in zip(weight.buffers, buffers, strict=True)
           if not _same_bytes(weight.buffers[name].cpu().numpy(), want)]
    return [f"pack_mxfp4 gives other {', '.join(bad)} bytes than ref.qpnmx_prepack"] if bad else []
