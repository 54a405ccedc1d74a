"""ref/ and cupy_kernels/ ask ref/formats.py for the format rules (issue 14, item 1), and the
torch ops' CUDA backend validates once (issue 21: no *_trusted twins): torch_bridge/_cuda.py calls
the layouts' launches (cupy_kernels/layouts.py), which launch exactly what the public (validating)
CuPy wrappers launch.

No GPU here: the CuPy wrappers run against a stand-in `cupy` module (arrays with a shape, a dtype
and a device pointer) and a recording `kernel`, so the launch arguments are compared on the host.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qpn.cupy_kernels import dequantize as D
from qpn.cupy_kernels import linear as L
from qpn.cupy_kernels.layouts import layout_kernels
from qpn.ref import formats
from qpn.ref.formats import QPN2, QPN8, QPN8_BLOCK

ROOT = Path(__file__).resolve().parents[1]
LAYER_FILES = [p for part in ("ref", "cupy_kernels") for p in sorted((ROOT / part).glob("*.py"))]


# ----------------------------------------------------------------------------- one rule, one place


def test_ref_exports_the_descriptions():
    from qpn import ref

    assert (ref.QPN2, ref.QPN8, ref.QPN8_BLOCK) == (QPN2, QPN8, QPN8_BLOCK)
    assert ref.weight_format("fp8", "block") is QPN8_BLOCK and ref.WeightFormat is formats.WeightFormat


def _module_level_constants(path: Path) -> list[tuple[str, object]]:
    tree = ast.parse(path.read_text())
    return [(target.id, node.value.value) for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) for target in node.targets if isinstance(target, ast.Name)]


def test_the_layers_define_no_format_constant_of_their_own():
    """Multiples, block sizes and pad fixes are the description's; a layer may only alias them."""
    own = [f"{p.relative_to(ROOT)}: {name} = {value!r}" for p in LAYER_FILES if p.name != "formats.py"
           for name, value in _module_level_constants(p)
           if (("MULTIPLE" in name or "BLOCK" in name) and value in (16, 32, 64, 128))
           or (name.startswith("PAD_") and isinstance(value, str))
           or (isinstance(value, tuple) and value in (formats.FP8_GRANULARITIES, formats.FORMAT_NAMES))]
    assert not own, "restated format rules:\n" + "\n".join(own)


def test_the_validation_helpers_are_defined_once():
    helpers = {"require_multiple", "require_int", "require_buffer_shape"}
    defined = [f"{p.relative_to(ROOT)}: {node.name}" for p in LAYER_FILES for node in ast.parse(p.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.name in helpers]
    assert sorted(defined) == sorted(f"ref/checks.py: {name}" for name in helpers)


def test_the_split_multiples_are_the_descriptions_key():
    assert L.SLICE_MULTIPLE == {"qpn2": 4, "qpn8": 1}


def test_qpn8_group_scales_format_is_the_shape_rule():
    from qpn.ref.qpn8 import qpn8_group_scales_format

    assert qpn8_group_scales_format((1, 96), 96, 48) is QPN8
    assert qpn8_group_scales_format((3, 2), 64, 384) is QPN8_BLOCK  # the layout needs whole tiles only
    with pytest.raises(ValueError, match=r"\[K/128, N/32\] = \[3, 2\] .* got shape \(2, 2\)"):
        qpn8_group_scales_format((2, 2), 64, 384)
    with pytest.raises(ValueError, match="K must be a positive multiple of 16 for QPN8"):
        qpn8_group_scales_format((1, 96), 96, 40)


def test_qpn2_prepack_dims_reads_shapes_only():
    from qpn.ref.qpn2 import qpn2_prepack_dims

    shaped = SimpleNamespace
    assert qpn2_prepack_dims(shaped(shape=(64, 64)), shaped(shape=(64, 8))) == (64, 128)
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 64 for QPN2, got K=96; K = 2 \*"):
        qpn2_prepack_dims(shaped(shape=(64, 48)), shaped(shape=(64, 6)))


# ----------------------------------------------------------------------------- the layouts' launches


class FakeArray:
    """A stand-in for a cupy.ndarray: what the wrappers read (shape, dtype, flags, device, pointer)."""

    def __init__(self, shape: tuple[int, ...], dtype: type, ptr: int = 0x10000) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.strides = ()
        self.flags = SimpleNamespace(c_contiguous=True)
        self.device = SimpleNamespace(id=0)
        self.data = SimpleNamespace(ptr=ptr)


@pytest.fixture
def launches(monkeypatch):
    """A stand-in `cupy` and a recording `kernel`: the list of (variant, arguments + dynamic shared memory) launched
    (the launch signature of cupy.RawKernel: grid, block, args, shared_mem=0)."""
    fake = SimpleNamespace(ndarray=FakeArray, cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    calls: list = []
    for module in (D, L):
        monkeypatch.setattr(module, "kernel", lambda variant: lambda grid, block, args, shared_mem=0: calls.append(
            (variant, (*args, np.int64(shared_mem)))))
    monkeypatch.setattr(L, "decode_split", lambda fmt, n, k: (1, 8, 4))  # one part: no workspace
    return calls


def _same_launches(calls: list, count: int) -> None:
    assert len(calls) == 2 * count
    for (variant_a, args_a), (variant_b, args_b) in zip(calls[:count], calls[count:], strict=True):
        assert variant_a is variant_b
        assert len(args_a) == len(args_b)
        for a, b in zip(args_a, args_b, strict=True):
            assert a is b or (type(a) is type(b) and isinstance(a, np.generic) and a == b), (a, b)


@pytest.mark.parametrize("g_shape", [(1,), (2,)])
def test_qpn2_layout_launches_what_the_wrappers_launch(launches, g_shape):
    n, k = 64, 128
    codes, scales = FakeArray((n, k // 2), np.uint8), FakeArray((n, k // 16), np.uint8)
    g, w16, x, y = FakeArray(g_shape, np.float32), FakeArray((n, k), np.float16), \
        FakeArray((1, k), np.float16), FakeArray((1, n), np.float16)
    D.qpn2_dequantize(codes, scales, g, n, k, out=w16, check=False)
    L.qpn2_linear(x, codes, scales, g, out=y)
    layout_kernels(QPN2).dequantize((codes, scales, g), n, k, w16)
    layout_kernels(QPN2).decode(x, (codes, scales, g), n, y, False, None)
    _same_launches(launches, 2)
    assert launches[0][1][3] == (0 if g_shape == (1,) else 1)  # the global scale's tile stride


@pytest.mark.parametrize("block", [False, True])
def test_qpn8_layout_launches_what_the_wrappers_launch(launches, block):
    n, k = 128, 256
    wf = QPN8_BLOCK if block else QPN8
    codes, group_scales = FakeArray((n, k), np.uint8), FakeArray(wf.buffer("group_scales").shape(n, k), np.float16)
    w16, x, y = FakeArray((n, k), np.float16), FakeArray((2, k), np.float16), FakeArray((2, n // 2), np.float16)
    D.qpn8_dequantize(codes, group_scales, n, k, out=w16, check=False)
    L.qpn8_linear(x, codes, group_scales, out=y, gated=True)
    layout_kernels(wf).dequantize((codes, group_scales), n, k, w16)
    layout_kernels(wf).decode(x, (codes, group_scales), n, y, True, None)
    _same_launches(launches, 2)
    assert launches[1][0] is L.QPN8_LINEAR[1, True, block]
    assert launches[0][1][2] == (n // 32 if block else 0)  # the kb stride of the group scales


def test_the_layouts_still_check_the_alignment(launches):
    """The torch ops check metadata only; a tensor's address is the GPU's rule, checked in the launch."""
    n, k = 64, 128
    scales, g = FakeArray((n, k // 16), np.uint8), FakeArray((1,), np.float32)
    with pytest.raises(ValueError, match="codes must start on a 8-byte boundary"):
        layout_kernels(QPN2).dequantize((FakeArray((n, k // 2), np.uint8, ptr=0x10004), scales, g), n, k,
                                        FakeArray((n, k), np.float16))
    with pytest.raises(ValueError, match="x must start on a 8-byte boundary"):
        layout_kernels(QPN8).decode(FakeArray((1, k), np.float16, ptr=0x10002),
                                    (FakeArray((n, k), np.uint8), FakeArray((1, n), np.float16)), n,
                                    FakeArray((1, n), np.float16), False, None)
    assert not launches


# ----------------------------------------------------------------------------- torch_bridge/_cuda.py


def test_the_cuda_backend_runs_the_layouts_launches_on_the_chosen_path(monkeypatch):
    """ops.py validated the tensors: _cuda.py calls the layout's launches (no validating wrapper), on
    the path dispatch.choose names, and asks no format anything."""
    from qpn.torch_bridge import _cuda, dispatch

    called: list[tuple[str, str]] = []

    class Recorder:
        def __init__(self, wf):
            self.family = wf

        def __getattr__(self, name):
            if name == "workspace_size":
                return lambda *args: 0
            return lambda *args: called.append((self.family.key, name))

    monkeypatch.setattr(_cuda, "_layout_kernels", Recorder)
    monkeypatch.setattr(_cuda, "_on_torch_stream", lambda device: contextlib.nullcontext(lambda t: t))
    monkeypatch.setattr(_cuda, "_mm_round",
                        lambda x, w16, scale=None: torch.zeros(x.shape[0], w16.shape[0], dtype=torch.float16))
    paths = {1: "decode", 48: "gemm"}
    monkeypatch.setattr(dispatch, "choose", lambda device, wf, m, n, k, gated: paths.get(m, "dense"))

    n, k, u8, f16 = 128, 256, torch.uint8, torch.float16
    qpn2 = (torch.zeros(n, k // 2, dtype=u8), torch.zeros(n, k // 16, dtype=u8), torch.ones(1))
    qpn8 = (torch.zeros(n, k, dtype=u8), torch.ones(1, n, dtype=f16))
    codes, scales = _cuda.prepack(QPN2, qpn2[:2], None, n, k)
    assert (codes.shape, scales.shape) == ((n, k // 2), (n, k // 16))
    codes, group_scales = _cuda.prepack(QPN8_BLOCK, (qpn8[0], torch.ones(1, 2)), "block", n, k)
    assert group_scales.shape == (k // 128, n // 32)
    for m in (1, 48, 65):
        x = torch.zeros(m, k, dtype=f16)
        assert _cuda.linear(QPN2, x, qpn2, n, k, n, False).shape == (m, n)
        assert _cuda.linear(QPN8, x, qpn8, n, k, n // 2, True).shape == (m, n // 2)
    assert called == [("qpn2", "prepack"), ("qpn8_block", "prepack"), ("qpn2", "decode"), ("qpn8", "decode"),
                      ("qpn2", "gemm"), ("qpn8", "gemm"), ("qpn2", "dequantize"), ("qpn8", "dequantize")]
