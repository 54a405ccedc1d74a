"""One object per mixture of experts: E experts of one layout, each a fused gate/up projection (w13,
[2I, H]: gate rows, then up rows) and a down projection (w2, [H, I]), their buffers stacked along a
leading expert dimension, and the MoE operation on them (moe_ops.py; docs/DESIGN.md, "Mixture of
experts"); gpt-oss's experts add float32 biases (w13_bias [E, 2I], gate's then up's; w2_bias [E, H])
and their own activation ("swigluoai"). Expert e's two projections are PackedWeight views of slice e
(no copy), so everything a packed weight does (dequantize, reference_dequantize, the layout's rules)
holds per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import moe_ops  # noqa: F401  (registers torch.ops.qpn.*_moe)
from .epilogue import ACTIVATIONS
from .packed_weight import PackedWeight


class PackedExperts:
    """E experts of one layout (module docstring). Build one with `stack` or `from_checkpoint`."""

    __slots__ = ("weight_class", "w13", "w2", "hidden_size", "intermediate_size", "w13_bias", "w2_bias", "activation")

    def __init__(self, weight_class: type[PackedWeight], w13: Mapping[str, Tensor], w2: Mapping[str, Tensor],
                 hidden_size: int, intermediate_size: int, w13_bias: Tensor | None = None,
                 w2_bias: Tensor | None = None, activation: str = "silu") -> None:
        self.weight_class = weight_class
        self.w13, self.w2 = dict(w13), dict(w2)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.w13_bias, self.w2_bias, self.activation = w13_bias, w2_bias, activation
        self.expert(0)  # the layout's rules on the first expert's views (metadata only)
        counts = {int(t.shape[0]) for t in (*self.w13.values(), *self.w2.values())}
        if len(counts) != 1:
            raise ValueError(f"every stacked buffer must hold the same experts, got leading sizes {sorted(counts)}")
        for name, bias, rows in (("w13_bias", w13_bias, 2 * self.intermediate_size),
                                 ("w2_bias", w2_bias, self.hidden_size)):
            if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (self.num_experts, rows)):
                raise ValueError(f"{name} must be float32 [{self.num_experts}, {rows}], got {bias.dtype} "
                                 f"{list(bias.shape)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")

    @classmethod
    def over(cls, weight_class: type[PackedWeight], w13: Mapping[str, Tensor], w2: Mapping[str, Tensor],
             hidden_size: int, intermediate_size: int, w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
             activation: str = "silu") -> PackedExperts:
        """Experts over buffers a module already holds, without the constructor's checks (QPNExperts builds
        one per forward, as QPNLinear does with PackedWeight.over); the MoE op checks the same metadata at
        every call."""
        packed = cls.__new__(cls)
        packed.weight_class, packed.w13, packed.w2 = weight_class, dict(w13), dict(w2)
        packed.hidden_size, packed.intermediate_size = hidden_size, intermediate_size
        packed.w13_bias, packed.w2_bias, packed.activation = w13_bias, w2_bias, activation
        return packed

    @property
    def num_experts(self) -> int:
        return int(self.w13["codes"].shape[0])

    @property
    def device(self) -> torch.device:
        return self.w13["codes"].device

    def expert(self, e: int) -> tuple[PackedWeight, PackedWeight]:
        """(w13, w2) of expert e: packed weights over slice e of the stacked buffers."""
        h, i = self.hidden_size, self.intermediate_size
        return (self.weight_class({n: t[e] for n, t in self.w13.items()}, h, 2 * i),
                self.weight_class({n: t[e] for n, t in self.w2.items()}, i, h))

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x float16 [M, H], routing float32 [M, k] / int [M, k] -> float16 [M, H] (the layout's MoE op)."""
        op: Callable[..., Tensor] = getattr(torch.ops.qpn, f"{self.weight_class.weight_format.format}_moe")
        return op(x, *self.w13.values(), *self.w2.values(), topk_weights, topk_ids, self.w13_bias, self.w2_bias,
                  self.activation)

    def to(self, device: torch.device | str) -> PackedExperts:
        b13, b2 = (None if b is None else b.to(device) for b in (self.w13_bias, self.w2_bias))
        return PackedExperts(self.weight_class, {n: t.to(device) for n, t in self.w13.items()},
                             {n: t.to(device) for n, t in self.w2.items()}, self.hidden_size, self.intermediate_size,
                             b13, b2, self.activation)

    @classmethod
    def stack(cls, experts: Sequence[tuple[PackedWeight, PackedWeight]], w13_bias: Tensor | None = None,
              w2_bias: Tensor | None = None, activation: str = "silu") -> PackedExperts:
        """Experts given as (w13, w2) packed weights of one layout and shape, stacked in order (the biases and
        activation as the constructor takes them)."""
        if not experts:
            raise ValueError("a mixture of experts needs at least one expert")
        w13_0, w2_0 = experts[0]
        weight_class = type(w13_0)
        shapes = {(type(a), a.out_features, a.in_features, type(b), b.out_features, b.in_features) for a, b in experts}
        if len(shapes) != 1 or type(w2_0) is not weight_class or w13_0.out_features != 2 * w2_0.in_features or \
                w2_0.out_features != w13_0.in_features:
            raise ValueError(f"experts must share one layout and the shapes w13 [2I, H], w2 [H, I], got "
                             f"{sorted((a.__name__, n1, k1, b.__name__, n2, k2) for a, n1, k1, b, n2, k2 in shapes)}")
        w13 = {n: torch.stack([a.buffers[n] for a, _ in experts]) for n in w13_0.buffers}
        w2 = {n: torch.stack([b.buffers[n] for _, b in experts]) for n in w2_0.buffers}
        return cls(weight_class, w13, w2, w13_0.in_features, w2_0.in_features, w13_bias, w2_bias, activation)

    @classmethod
    def from_checkpoint(cls, experts: Sequence[tuple[Any, Any, Any]],
                        packed_weight_of: Callable[[Any], PackedWeight] = PackedWeight.from_checkpoint
                        ) -> PackedExperts:
        """Experts as checkpoint layers (gate, up, down) each, e.g. ModelOpt's per-expert linears
        (CheckpointLinear, packed by `packed_weight_of`; convert passes one that also takes a packed folder's
        layers): gate and up stacked into w13 with their own scales (per-tile global scales for NVFP4)."""
        packed = packed_weight_of
        return cls.stack([(PackedWeight.stack_rows([packed(gate), packed(up)]), packed(down))
                          for gate, up, down in experts])
