"""QPNExperts: the experts of a transformers mixture-of-experts block (transformers 5's Qwen3MoeExperts,
MixtralExperts: gate_up_proj [E, 2I, H], down_proj [E, H, I]; GptOssExperts: transposed, gate and up
interleaved, with biases and the clamped SwiGLU (experts_weights); each called as experts(hidden_states,
top_k_index, top_k_weights)) over one PackedExperts, and the checkpoint side of it: which per-expert
linears of a checkpoint form one experts module.

On disk each expert is a linear of its own, under the names HF and vLLM read (and ModelOpt exports):
`<block>.experts.<e>.{gate_proj, up_proj, down_proj}` (Qwen3-MoE) or `<block>.experts.<e>.{w1, w3, w2}`
(Mixtral: gate, up, down). Mixtral's checkpoints name the block `block_sparse_moe` where transformers 5's
model has `mlp` (transformers renames it on load; so does `module_path` here).

Numerics: the router stays the model's (its logits, softmax and top k in the model's own code); the
routing weights reach the op in fp32 (Qwen3-MoE's router rounds them to the model dtype first, as HF
computes them); the experts follow docs/DESIGN.md, "Mixture of experts"; the result is cast to the
input's dtype. fp16 and bf16 hidden states go to the op as they are (bf16: the op's bf16 contract,
docs/DESIGN.md, "bf16 activations"); any other dtype is rounded to fp16 first and the fp16 result back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from ..checkpoints.gpt_oss import MXFP4Experts
from ..ref.formats import WeightFormat
from ..ref.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from .moe_ops import activation_dtype
from .packed_experts import PackedExperts
from .packed_weight import PackedWeight, device_moves_only, pack_mxfp4, packed_weight_class, replacement_device

# role of a per-expert linear on disk -> its place in the fused experts: gate, up (w13), down (w2)
EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_NAME = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<role>" + "|".join(EXPERT_ROLES) + r")$")
# on-disk block names that transformers 5 loads under another module path
_BLOCK_RENAMES = ((".block_sparse_moe", ".mlp"),)


def expert_layers(names: list[str]) -> dict[str, dict[int, dict[str, str]]]:
    """{on-disk experts path ("<block>.experts"): {expert: {"gate" | "up" | "down": layer name}}} of the
    per-expert linears among `names` (others are not listed)."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match:
            experts = groups.setdefault(f"{match['block']}.experts", {})
            experts.setdefault(int(match["e"]), {})[EXPERT_ROLES[match["role"]]] = name
    return groups


def model_names(disk_name: str) -> list[str]:
    """The names a checkpoint name may have in a transformers model: itself, then with the MoE block renamed
    as transformers 5 renames it on load (Mixtral's block_sparse_moe -> mlp)."""
    return [disk_name] + [disk_name.replace(old, new) for old, new in _BLOCK_RENAMES if old in disk_name]


def module_path(model: nn.Module, disk_path: str) -> str:
    """The model's module path of an on-disk experts path (Mixtral's block_sparse_moe is transformers 5's mlp)."""
    candidates = model_names(disk_path)
    for path in candidates:
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return path
    raise ValueError(f"checkpoint experts {disk_path!r} have no module in the model (looked for {candidates}); "
                     "the checkpoint names must be the model's module paths")


class ExpertsWeights(NamedTuple):
    """A transformers experts module's weights in qpn's order (views, no copy until quantized)."""

    gate_up: Tensor  # [E, 2I, H]: gate rows, then up rows
    down: Tensor  # [E, H, I]
    gate_up_bias: Tensor | None  # [E, 2I], the same order (gpt-oss)
    down_bias: Tensor | None  # [E, H] (gpt-oss)
    activation: str  # the MoE ops' name of its gated epilogue (epilogue.ACTIVATIONS)


def experts_weights(module: nn.Module) -> ExpertsWeights | None:
    """The weights of transformers 5's fused experts, or None for any other module:
    - Qwen3-MoE / Mixtral: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I], SiLU;
    - gpt-oss (GptOssExperts): gate_up_proj [E, H, 2I] with gate and up interleaved (column 2i gate,
      2i + 1 up), gate_up_proj_bias [E, 2I] likewise, down_proj [E, I, H], down_proj_bias [E, H], the clamped
      SwiGLU of ref.gpt_oss (its alpha and limit must be gpt-oss's: the kernels hold them).
    The gpt-oss permutation (ref.gpt_oss.deinterleave) and transposes only move values."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == down.dim() == 3):
        return None
    b13, b2 = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
    if isinstance(b13, Tensor) and isinstance(b2, Tensor):  # gpt-oss
        e, hidden, two_i = gate_up.shape
        if tuple(down.shape) != (e, two_i // 2, hidden) or two_i % 2 or tuple(b13.shape) != (e, two_i) or \
                tuple(b2.shape) != (e, hidden):
            return None
        alpha, limit = getattr(module, "alpha", SWIGLU_ALPHA), getattr(module, "limit", SWIGLU_LIMIT)
        if (float(alpha), float(limit)) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            raise ValueError(f"{type(module).__name__}: qpn's swigluoai epilogue has gpt-oss's alpha {SWIGLU_ALPHA} "
                             f"and limit {SWIGLU_LIMIT}, this module has {alpha} and {limit}; leave it unconverted "
                             "(skip=)")
        order = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)]).to(gate_up.device)
        return ExpertsWeights(gate_up.transpose(1, 2)[:, order], down.transpose(1, 2), b13[:, order], b2, "swigluoai")
    e, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (e, hidden, two_i // 2) or two_i % 2:
        return None
    return ExpertsWeights(gate_up, down, None, None, "silu")


def is_experts_module(module: nn.Module) -> bool:
    """transformers 5's fused experts (experts_weights)."""
    return experts_weights(module) is not None


def complete_experts(disk_path: str, experts: Mapping[int, Mapping[str, str]]) -> list[tuple[str, str, str]]:
    """[(gate, up, down) layer names] for experts 0..E-1; a missing expert or role is a ValueError."""
    count = max(experts) + 1
    gaps = [f"{e}.{role}" for e in range(count) for role in ("gate", "up", "down") if role not in experts.get(e, {})]
    if gaps:
        raise ValueError(f"checkpoint experts {disk_path!r}: experts 0..{count - 1} need gate, up and down each, "
                         f"missing {gaps[:6]}; the checkpoint is incomplete")
    return [(experts[e]["gate"], experts[e]["up"], experts[e]["down"]) for e in range(count)]


def _experts_module(model: nn.Module, disk_path: str) -> tuple[str, nn.Module]:
    """(model path, module) that a checkpoint's experts `disk_path` replace: a transformers experts module
    (or a QPNExperts already)."""
    path = module_path(model, disk_path)
    old = model.get_submodule(path)
    if not (is_experts_module(old) or isinstance(old, QPNExperts)):
        raise ValueError(f"checkpoint experts {disk_path!r} are quantized but the model's {path} is a "
                         f"{type(old).__name__}, not a transformers experts module (gate_up_proj, down_proj)")
    return path, old


def _replacement(disk_path: str, path: str, old: nn.Module, packed: PackedExperts,
                 device: torch.device | str | None) -> QPNExperts:
    """The QPNExperts over `packed` that replaces `old`: the same (E, H, I), on `device` or old's device."""
    shape = (packed.num_experts, packed.hidden_size, packed.intermediate_size)
    if shape != _experts_shape(old):
        raise ValueError(f"checkpoint experts {disk_path!r} are (E, H, I) = {shape} but the model's {path} is "
                         f"{_experts_shape(old)}")
    old_device = next(iter(old.buffers() if isinstance(old, QPNExperts) else old.parameters())).device
    return QPNExperts(packed.to(replacement_device(device, old_device)))


def new_experts(model: nn.Module, layers: Mapping[str, object], packed_weight_of: Callable[[object], PackedWeight],
                device: torch.device | str | None) -> tuple[dict[str, QPNExperts], set[str]]:
    """({model path: a new QPNExperts} for every experts group among the checkpoint's `layers`, the layer
    names they took); `packed_weight_of` turns one layer into its PackedWeight; the model is not touched.
    Each group must be complete and match the model's experts module (E, H, I)."""
    new, taken = {}, set()
    for disk_path, experts in expert_layers(list(layers)).items():
        taken |= {name for roles in experts.values() for name in roles.values()}
        path, old = _experts_module(model, disk_path)
        packed = PackedExperts.from_checkpoint(
            [(layers[gate], layers[up], layers[down]) for gate, up, down in complete_experts(disk_path, experts)],
            packed_weight_of)
        new[path] = _replacement(disk_path, path, old, packed, device)
    return new, taken


def stacked_experts(model: nn.Module, experts: Mapping[str, MXFP4Experts], device: torch.device | str | None
                    ) -> dict[str, QPNExperts]:
    """{model path: a new QPNExperts} for a checkpoint's stacked MXFP4 experts (gpt-oss: w13 gate rows then up,
    float32 biases, swigluoai), each matching the model's experts module (E, H, I); the model is not touched."""
    new = {}
    for disk_path, mx in experts.items():
        path, old = _experts_module(model, disk_path)
        packed = PackedExperts.stack(
            [(pack_mxfp4(mx.w13_blocks[e], mx.w13_scales[e]), pack_mxfp4(mx.w2_blocks[e], mx.w2_scales[e]))
             for e in range(mx.experts)],
            torch.from_numpy(np.array(mx.w13_bias)), torch.from_numpy(np.array(mx.w2_bias)), "swigluoai")
        new[path] = _replacement(disk_path, path, old, packed, device)
    return new


def _experts_shape(module: nn.Module) -> tuple[int, int, int]:
    if isinstance(module, QPNExperts):
        return module.num_experts, module.hidden_size, module.intermediate_size
    weights = experts_weights(module)
    assert weights is not None  # the caller's is_experts_module
    e, hidden, inter = weights.down.shape
    return int(e), int(hidden), int(inter)


class QPNExperts(nn.Module):
    """Drop-in for a transformers 5 experts module (module docstring). Buffers (in state_dict):
    w13_<buffer> and w2_<buffer>, the layout's buffers of every expert stacked along dim 0."""

    def __init__(self, packed: PackedExperts) -> None:
        super().__init__()
        self.weight_format: WeightFormat = packed.weight_class.weight_format
        self.num_experts, self.hidden_size, self.intermediate_size = (
            packed.num_experts, packed.hidden_size, packed.intermediate_size)
        self.activation = packed.activation
        for prefix, buffers in (("w13", packed.w13), ("w2", packed.w2)):
            for name, tensor in buffers.items():
                self.register_buffer(f"{prefix}_{name}", tensor)
        self.register_buffer("w13_bias", packed.w13_bias)  # None: not in state_dict
        self.register_buffer("w2_bias", packed.w2_bias)

    @property
    def packed_experts(self) -> PackedExperts:
        """The experts over this module's buffers (no copy)."""
        names = [b.name for b in self.weight_format.buffers]
        w13, w2 = ({n: getattr(self, f"{stem}_{n}") for n in names} for stem in ("w13", "w2"))
        b13, b2 = self._buffers["w13_bias"], self._buffers["w2_bias"]  # registered in __init__ (None: no bias)
        return PackedExperts.over(packed_weight_class(self.weight_format), w13, w2, self.hidden_size,
                                  self.intermediate_size, b13, b2, self.activation)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QPNExperts:
        """Device moves apply to the buffers, dtype casts do not (packed_weight.device_moves_only)."""
        return super()._apply(device_moves_only(fn), recurse)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """hidden_states [M, H] (fp16 or bf16: as it is; any other float dtype: computed in fp16), the router's
        top-k -> [M, H] in its dtype (module docstring)."""
        dtype = activation_dtype(hidden_states.dtype)
        x = hidden_states.reshape(-1, self.hidden_size).to(dtype).contiguous()
        out = self.packed_experts.forward(x, top_k_weights.reshape(x.shape[0], -1).float().contiguous(),
                                          top_k_index.reshape(x.shape[0], -1).contiguous())
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, layout={self.weight_format.label!r}, "
                f"activation={self.activation!r}, bias={self.w13_bias is not None}")

    @classmethod
    def from_module(cls, module: nn.Module, wf: WeightFormat, granularity: str | None = None) -> QPNExperts:
        """Quantize a transformers experts module's weights (read as float32) with qpn.ref's quantizers."""
        weights = experts_weights(module)
        if weights is None:
            raise ValueError(f"{type(module).__name__} is not a transformers experts module (gate_up_proj, down_proj)")
        gate_up = weights.gate_up.detach().to("cpu", torch.float32).numpy()
        down = weights.down.detach().to("cpu", torch.float32).numpy()
        inter = down.shape[2]
        pairs = []
        for e in range(gate_up.shape[0]):
            halves = [PackedWeight.quantize(np.ascontiguousarray(w), wf, granularity)
                      for w in (gate_up[e, :inter], gate_up[e, inter:])]
            pairs.append((PackedWeight.stack_rows(halves), PackedWeight.quantize(np.ascontiguousarray(down[e]), wf,
                                                                                granularity)))
        b13, b2 = (None if b is None else b.detach().to("cpu", torch.float32).contiguous()
                   for b in (weights.gate_up_bias, weights.down_bias))
        return cls(PackedExperts.stack(pairs, b13, b2, weights.activation).to(weights.gate_up.device))
