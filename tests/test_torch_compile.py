"""torch.compile(fullgraph=True) over QPNLinear: one graph serves every M, results unchanged.

The decode / dense choice lives inside torch.ops.qpn.*_linear, so the traced graph holds the
op and nothing that depends on M. What torch itself adds: dynamo specializes sizes 0 and 1
(a documented torch rule, not ours), so with dynamic shapes a run M = 1, 64, 1, 7, 200 compiles
exactly twice - a graph for M = 1 and one symbolic-M graph for everything else - and never
again; marking M unbacked (`torch._dynamo.decorators.mark_unbacked`) gives one graph for all M.

CPU runs use the aot_eager backend (it exercises the fake kernels, functionalization and
dynamic shapes; inductor's C++ build would add minutes on the 2-core CI machine); CUDA runs use
inductor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from qpn import ref
from qpn.torch_bridge import QPNLinear

M_SEQUENCE = [1, 64, 1, 7, 200, 1, 33]
K, HIDDEN, N = 256, 192, 96  # 192 = 6 * 32, N = 96 padded-free; the fp8 layer crops nothing either
DYNAMIC_MODES = ["dynamic", "mark_dynamic", "mark_unbacked"]
EXPECTED_COMPILES = {"dynamic": 2, "mark_dynamic": 2, "mark_unbacked": 1}


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class TwoLayers(nn.Module):
    """nvfp4 layer, a pointwise op, an fp8 layer (with bias): what a real block looks like."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = QPNLinear.from_linear(nn.Linear(K, HIDDEN, bias=False), "nvfp4")
        self.down = QPNLinear.from_linear(nn.Linear(HIDDEN, N, bias=True), "fp8")

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class RecordingBackend(CompileCounterWithBackend):
    """Counts compilations (dynamo frames) and keeps the qpn ops that each traced graph calls."""

    def __init__(self, backend: str):
        super().__init__(backend)
        self.qpn_calls: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.qpn_calls.append([str(node.target).removesuffix(".default") for node in gm.graph.nodes
                               if node.op == "call_function" and str(node.target).startswith("qpn.")])
        return super().__call__(gm, example_inputs)


def backend_for(device: str) -> RecordingBackend:
    return RecordingBackend("aot_eager" if device == "cpu" else "inductor")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", DYNAMIC_MODES)
def test_compiled_module_serves_every_m_without_recompiling(mode, device):
    torch._dynamo.reset()
    model = TwoLayers().to(device)
    counter = backend_for(device)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True if mode == "dynamic" else None)
    rng = np.random.default_rng(1)
    for m in M_SEQUENCE:
        x = torch.from_numpy((rng.standard_normal((m, K)) / 16).astype(np.float16)).to(device)
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        elif mode == "mark_unbacked":
            torch._dynamo.decorators.mark_unbacked(x, 0)
        y = compiled(x)
        eager = model(x)
        assert y.shape == (m, N) and y.dtype == torch.float16
        # Same op, same inputs: the compiled graph adds nothing numeric around it.
        assert torch.equal(y.view(torch.int16), eager.view(torch.int16)), f"M={m}"
    assert counter.frame_count == EXPECTED_COMPILES[mode], f"compiled {counter.frame_count} times for M={M_SEQUENCE}"
    for calls in counter.qpn_calls:  # each graph calls each layer's op once, whatever M was traced
        assert calls == ["qpn.nvfp4_linear", "qpn.fp8_linear"]


@pytest.mark.parametrize("device", devices())
def test_compiled_3d_input_and_gated_op(device):
    """[B, T, K] activations with a dynamic T, and the gated op called directly (as the vLLM
    method does), under one compiled function."""
    torch._dynamo.reset()
    rng = np.random.default_rng(2)
    n_fused, k = 128, 128
    q = ref.nvfp4_quantize(rng.standard_normal((n_fused, k)).astype(np.float32))
    codes, scales = torch.ops.qpn.nvfp4_prepack(torch.from_numpy(q.weight_packed), torch.from_numpy(q.weight_scale))
    codes, scales = codes.to(device), scales.to(device)
    g = torch.from_numpy(q.weight_scale_2).to(device)

    def gated_mlp(x):
        flat = x.reshape(-1, k)
        return torch.ops.qpn.nvfp4_linear(flat, codes, scales, g, gated=True).reshape(*x.shape[:-1], n_fused // 2)

    counter = backend_for(device)
    compiled = torch.compile(gated_mlp, backend=counter, fullgraph=True, dynamic=True)
    for t in (3, 17, 40):
        x = torch.from_numpy((rng.standard_normal((2, t, k)) / 8).astype(np.float16)).to(device)
        y = compiled(x)
        assert y.shape == (2, t, n_fused // 2)
        assert torch.equal(y.view(torch.int16), gated_mlp(x).view(torch.int16))
    assert counter.frame_count == 1
