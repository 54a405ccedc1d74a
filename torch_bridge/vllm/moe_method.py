"""qpn's FusedMoE methods for vLLM: ModelOpt NVFP4 and FP8 (per tensor, per channel) experts of Qwen3-MoE /
Mixtral checkpoints (issue 22), and gpt-oss's MXFP4 experts (issue 23, QPNGptOssMoEMethod at the end), run
weight-only through torch.ops.qpn.{nvfp4,fp8,mxfp4}_moe.

Imported only inside vLLM (config.get_quant_method meets a FusedMoE layer): the class subclasses vLLM's
FusedMoEMethodBase. Along vLLM 0.32's MoE seam:
- create_weights registers the checkpoint layout's parameters under ModelOpt's names (w13_weight [E, 2I,
  H/2 or H], w2_weight [E, H, I/2 or I], w13_weight_scale, w2_weight_scale, NVFP4's w13_weight_scale_2
  [E, 2] / w2_weight_scale_2 [E], the input scales), so vLLM's own FusedMoE weight loader fills them per
  expert and shard (w1 = gate, w3 = up, w2 = down) and splits I across tensor-parallel ranks; the scale
  parameters carry its `quant_method` kind (block, tensor, channel) so that loader reads them right.
- process_weights_after_loading packs every expert through qpn's packers (the same value checks: NaN
  scale bytes, fp16 overflow; an error names the vLLM layer): w13 = gate's rows then up's, each with its
  own scale (NVFP4: one global scale per 32-row tile, never a max() of the two), w2 = down; stacks them
  (PackedExperts), keeps the buffers as frozen Parameters qpn_w13_<name> / qpn_w2_<name> and drops the
  checkpoint parameters. Each rank's I must keep the layouts' rules (I % 32; NVFP4's down projection
  K = I % 64).
- apply runs the MoE op on vLLM's routing (topk_weights fp32, topk_ids): fp16 activations, the
  combine in top-k order, a token's output independent of the batch (docs/DESIGN.md, "Mixture of
  experts"); the result in x's dtype. A bf16 model's x (dtype="bfloat16") goes to the op as bf16 (the
  op's sums, epilogue and combine each rounded once to bf16, as vLLM computes them in bf16; on CUDA
  through fp16 rows times a power of two, exact: docs/DESIGN.md, "bf16 activations").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from ...checkpoints.gpt_oss import ON_DISK
from ...ref.checks import ValueAtIndex, require_finite, require_no_nan_e8m0
from ...ref.formats import MX_BLOCK, QPN2, QPN8, QPNMX, WeightFormat, weight_format
from ...ref.geometry import TILE_N
from ..epilogue import ACTIVATIONS
from ..experts import EXPERT_ROLES
from ..moe_ops import activation_dtype
from ..packed_experts import PackedExperts
from ..packed_weight import PackedWeight, pack_fp8, pack_mxfp4, pack_nvfp4
from .methods import NVFP4_GROUP_SIZE, replace_parameters
from .sharding import (
    ValueRule,
    checkpoint_where,
    e4m3_code_rule,
    fp8_scale_rule,
    nvfp4_block_scale_rule,
    positive_scale_rule,
    served_folder,
)


def _activation(moe_config: Any) -> str:
    """The MoE ops' name of the layer's gated activation (vLLM's MoEActivation value: "silu", "swigluoai"); one
    the kernels do not run is refused before any weight loads."""
    activation = getattr(getattr(moe_config, "activation", None), "value", "silu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"vLLM MoE activation {activation!r}: qpn's MoE kernels run {sorted(ACTIVATIONS)}; serve this "
                         "checkpoint without quantization='qpn'")
    return activation


def _data(layer: torch.nn.Module, name: str) -> Tensor:
    param = getattr(layer, name)
    assert isinstance(param, Tensor)  # a Parameter create_weights registered
    return param.data


def _checked(rule: ValueRule, name: str, loaded: Tensor, where: Callable[[], str],
             offset: Sequence[int] | None = None) -> None:
    """`rule` on a checkpoint tensor as vLLM hands it over (the file's indices, shifted by `offset` where vLLM
    narrowed it to this rank); its error starts with `where()` (sharding.checkpoint_where)."""
    try:
        rule(name, loaded)
    except ValueAtIndex as exc:
        raise ValueError(f"{where()}: {exc.shifted(offset) if offset is not None else exc}") from None
    except ValueError as exc:
        raise ValueError(f"{where()}: {exc}") from None


_SHARD_ROLE = {"w1": "gate", "w3": "up", "w2": "down"}  # vLLM's FusedMoE shard ids


def expert_tensor(prefix: str, expert: int, shard_id: str, name: str) -> str:
    """The checkpoint tensor vLLM loads into expert `expert`'s shard `shard_id` of parameter w13_/w2_`name`:
    `<prefix>.<e>.{gate_proj, up_proj, down_proj}.<name>`, or Mixtral's `w1 / w3 / w2` under its
    block_sparse_moe (torch_bridge.experts.EXPERT_ROLES)."""
    mixtral = ".block_sparse_moe." in f"{prefix}."
    leaf = next(n for n, role in EXPERT_ROLES.items() if role == _SHARD_ROLE.get(shard_id) and
                n.startswith("w") == mixtral) if shard_id in _SHARD_ROLE else str(shard_id)
    return f"{prefix}.{expert}.{leaf}.{name}"


def _expert_loader(vllm_loader: Callable[..., Any], rule: ValueRule, name: str, prefix: str,
                   folder: str | None) -> Callable[..., Any]:
    """vLLM's FusedMoE loader, after `rule` judged the one expert's checkpoint tensor it gets (indices the file's)."""
    def weight_loader(param: Parameter, loaded_weight: Tensor, weight_name: str, shard_id: str, expert_id: int,
                      return_success: bool = False) -> Any:
        def where() -> str:
            return checkpoint_where(expert_tensor(prefix, expert_id, shard_id, name), folder, prefix)
        _checked(rule, name, loaded_weight, where)
        if getattr(param, "quant_method", None) == FusedMoeWeightScaleSupported.CHANNEL.value:
            loaded_weight = loaded_weight.reshape(-1, 1)  # ModelOpt stores [N]; vLLM's channel loader copies [N, 1]
        return vllm_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=return_success)
    return weight_loader


class QPNFusedMoEMethod(FusedMoEMethodBase):
    """ModelOpt NVFP4 / FP8 experts through qpn's MoE op (module docstring). `granularity`: the FP8
    scale granularity ("tensor" | "channel"), None for NVFP4."""

    def __init__(self, quant_config: Any, moe_config: Any, granularity: str | None) -> None:
        super().__init__(moe_config)
        self.quant_config = quant_config
        self.granularity = granularity
        self.weight_format: WeightFormat = weight_format(QPN2.format) if granularity is None else \
            weight_format(QPN8.format, granularity)
        self.activation = _activation(moe_config)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # no vLLM modular kernel: apply runs qpn's op

    def uses_weight_scale_2_pattern(self) -> bool:
        return self.weight_format is QPN2

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        self._require_layout(layer, h, i)
        wf = self.weight_format
        nvfp4 = wf is QPN2
        weight_dtype = torch.uint8 if nvfp4 else torch.float8_e4m3fn

        prefix, folder = getattr(layer, "layer_name", type(layer).__name__), served_folder()
        # each checkpoint tensor's values are judged as vLLM's loader gets it, one expert's tensor of the file
        rules: dict[str, ValueRule] = {"weight_scale": nvfp4_block_scale_rule, "weight_scale_2": positive_scale_rule} \
            if nvfp4 else {"weight": e4m3_code_rule, "weight_scale": fp8_scale_rule}

        def register(name: str, data: Tensor, kind: str | None = None) -> None:
            param = Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            attrs = {**extra_weight_attrs, **({"quant_method": kind} if kind else {})}
            rule, own = rules.get(name.partition("_")[2]), attrs.get("weight_loader")
            if rule is not None and own is not None:
                attrs["weight_loader"] = _expert_loader(own, rule, name.partition("_")[2], prefix, folder)
            set_weight_attrs(param, attrs)

        register("w13_weight", torch.empty(e, 2 * i, h * wf.code_bits // 8, dtype=weight_dtype))
        register("w2_weight", torch.empty(e, h, i * wf.code_bits // 8, dtype=weight_dtype))
        if nvfp4:
            block = FusedMoeWeightScaleSupported.BLOCK.value
            register("w13_weight_scale", torch.empty(e, 2 * i, h // NVFP4_GROUP_SIZE, dtype=torch.float8_e4m3fn),
                     block)
            register("w2_weight_scale", torch.empty(e, h, i // NVFP4_GROUP_SIZE, dtype=torch.float8_e4m3fn), block)
            tensor = FusedMoeWeightScaleSupported.TENSOR.value
            register("w13_weight_scale_2", torch.ones(e, 2, dtype=torch.float32), tensor)
            register("w2_weight_scale_2", torch.ones(e, dtype=torch.float32), tensor)
        elif self.granularity == "channel":
            channel = FusedMoeWeightScaleSupported.CHANNEL.value
            register("w13_weight_scale", torch.ones(e, 2 * i, 1, dtype=torch.float32), channel)
            register("w2_weight_scale", torch.ones(e, h, 1, dtype=torch.float32), channel)
        else:
            tensor = FusedMoeWeightScaleSupported.TENSOR.value
            register("w13_weight_scale", torch.ones(e, 2, dtype=torch.float32), tensor)
            register("w2_weight_scale", torch.ones(e, dtype=torch.float32), tensor)
        register("w13_input_scale", torch.ones(e, dtype=torch.float32))  # loaded, never read (weight-only)
        register("w2_input_scale", torch.ones(e, dtype=torch.float32))

    def _require_layout(self, layer: torch.nn.Module, hidden: int, inter: int) -> None:
        """Each rank's experts keep the layouts' rules: I_part % 32 (the gate / up halves in whole tiles) and
        the K multiples of both projections (w13: K = H, w2: K = I_part); said before any weight loads."""
        wf = self.weight_format
        step = max(TILE_N, wf.k_multiple)
        if inter % step == 0 and hidden % wf.k_multiple == 0:
            return
        tp = getattr(self.moe, "tp_size", 1)
        raise ValueError(f"vLLM MoE layer {getattr(layer, 'layer_name', '?')!r}: {wf.label} experts need the "
                         f"intermediate size per rank to be a multiple of {step} and the hidden size of "
                         f"{wf.k_multiple}, got I_part={inter} (tp_size={tp}), H={hidden}; pick a tensor-parallel "
                         "size that keeps I_part a multiple of it, or serve this checkpoint with vLLM's ModelOpt path")

    def _pack_expert(self, layer: torch.nn.Module, e: int) -> tuple[PackedWeight, PackedWeight]:
        w13, w2 = _data(layer, "w13_weight")[e], _data(layer, "w2_weight")[e]
        inter = self.weight_format.k_of_codes(w2.shape[1])
        s13, s2 = _data(layer, "w13_weight_scale")[e], _data(layer, "w2_weight_scale")[e]
        halves: list[PackedWeight]
        if self.weight_format is QPN2:
            g13, g2 = _data(layer, "w13_weight_scale_2")[e], _data(layer, "w2_weight_scale_2")[e]
            halves = [pack_nvfp4(w13[r], s13[r], g13[j]) for j, r in enumerate((slice(0, inter), slice(inter, None)))]
            return PackedWeight.stack_rows(halves), pack_nvfp4(w2, s2, g2)
        if self.granularity == "channel":
            return pack_fp8(w13, s13.reshape(-1).contiguous(), "channel"), pack_fp8(w2, s2.reshape(-1).contiguous(),
                                                                                  "channel")
        halves = [pack_fp8(w13[r], s13[j], "tensor") for j, r in enumerate((slice(0, inter), slice(inter, None)))]
        return PackedWeight.stack_rows(halves), pack_fp8(w2, s2, "tensor")

    # the checkpoint parameters create_weights registers per projection (w13_<name>, w2_<name>), dropped once packed
    CHECKPOINT_PARAMS: tuple[str, ...] = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def _biases(self, layer: torch.nn.Module) -> tuple[Tensor | None, Tensor | None]:
        """(w13, w2) float32 biases in qpn's order, or None: ModelOpt's experts have none."""
        del layer
        return None, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        prefix = getattr(layer, "layer_name", type(layer).__name__)
        pairs = []
        for e in range(_data(layer, "w13_weight").shape[0]):
            try:
                pairs.append(self._pack_expert(layer, e))
            except ValueError as exc:  # what only two tensors show (fp16 overflow); a single tensor's: at load
                raise ValueError(f"vLLM MoE layer {prefix!r}, expert {e}: {exc}") from exc
        packed = PackedExperts.stack(pairs)
        b13, b2 = self._biases(layer)
        checkpoint = [f"{stem}_{name}" for stem in ("w13", "w2") for name in self.CHECKPOINT_PARAMS]
        # the biases become Parameters next to the packed buffers (vLLM moves and shards Parameters)
        w13 = replace_parameters(layer, checkpoint, {**packed.w13, **({} if b13 is None else {"bias": b13})}, "w13_")
        w2 = replace_parameters(layer, (), {**packed.w2, **({} if b2 is None else {"bias": b2})}, "w2_")
        experts = PackedExperts(packed.weight_class, w13, w2, packed.hidden_size, packed.intermediate_size,
                                w13.pop("bias", None), w2.pop("bias", None), self.activation)
        setattr(layer, "qpn_experts", experts)  # noqa: B010 (a plain attribute: no Module, no Parameter)

    def apply(self, layer: torch.nn.Module, x: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              shared_experts: Any = None, shared_experts_input: Tensor | None = None) -> Tensor:
        x_op = x.to(activation_dtype(x.dtype)).contiguous()  # fp16 or bf16 as it is (docstring)
        experts: PackedExperts = getattr(layer, "qpn_experts")  # noqa: B009 (typed)
        out = experts.forward(x_op, topk_weights.float().contiguous(), topk_ids.contiguous())
        return out.to(x.dtype)


# ----------------------------------------------------------------------------- gpt-oss (MXFP4)


def _whole_experts_loader(tensor: str, folder: str | None, vllm_layer: str, rule: ValueRule | None,
                          offset: Sequence[int]) -> Callable[..., bool | None]:
    """The loader of one parameter: vLLM's gpt-oss loader (`_load_weights_mxfp4`) hands over every expert at once,
    already narrowed to this rank ([E, 2I_part, ...] for w13, [E, H, I_part / ...] for w2, biases [E, ...];
    vLLM's own FusedMoE loader takes that form only under its "gpt_oss_mxfp4" config, so the parameters carry
    this one). `rule` judges the checkpoint tensor `tensor` as it comes, gate / up rows interleaved as the file
    holds them; `offset`: where this rank's slice starts in it."""
    def weight_loader(param: Parameter, loaded_weight: Tensor, weight_name: str | None = None,
                      shard_id: str | None = None, expert_id: int | None = None,
                      return_success: bool = False) -> bool | None:
        del weight_name, shard_id, expert_id
        if rule is not None:
            _checked(rule, tensor.rpartition(".")[2], loaded_weight,
                     lambda: checkpoint_where(tensor, folder, vllm_layer), offset)
        param.data[tuple(slice(0, size) for size in loaded_weight.shape)].copy_(loaded_weight)
        return True if return_success else None
    return weight_loader


def _e8m0_rule(name: str, loaded: Tensor) -> None:
    require_no_nan_e8m0(name, loaded.detach().cpu().numpy())


def _finite_rule(name: str, loaded: Tensor) -> None:
    require_finite(name, loaded.detach().float().cpu().numpy(), "the checkpoint is corrupt there (re-download it)")


def _deinterleave_rows(t: Tensor) -> Tensor:
    """gpt-oss's w13 rows (2i gate, 2i + 1 up) -> gate rows, then up rows (qpn.ref.gpt_oss.deinterleave)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


class QPNGptOssMoEMethod(QPNFusedMoEMethod):
    """gpt-oss's MXFP4 experts (quantization_config.quant_method "mxfp4"): vLLM's gpt-oss loader fills
    w13_weight [E, 2I, H/2] and w13_weight_scale [E, 2I, H/32] (uint8 codes and e8m0 bytes, gate and up
    rows interleaved), w2_weight [E, H, I/2], w2_weight_scale [E, H, I/32], and the bf16 biases w13_bias
    [E, 2I] (interleaved) / w2_bias [E, H] (tensor parallel: rank 0 only, vLLM zeroes the rest), kept in
    float32 here (exact). process_weights_after_loading moves gate and up apart (a permutation), packs
    every expert into QPNMX and keeps the biases; apply runs qpn::mxfp4_moe with the layer's activation
    (gpt-oss: swigluoai, the same alpha 1.702 and limit 7 as vLLM's kernel)."""

    CHECKPOINT_PARAMS = ("weight", "weight_scale", "bias")

    def __init__(self, quant_config: Any, moe_config: Any) -> None:
        super().__init__(quant_config, moe_config, None)
        self.weight_format = QPNMX

    def uses_weight_scale_2_pattern(self) -> bool:
        return False

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        self._require_layout(layer, h, i)
        prefix, folder = getattr(layer, "layer_name", type(layer).__name__), served_folder()
        first = getattr(self.moe, "tp_rank", 0) * i  # this rank's first intermediate row (vLLM's narrowing)
        # parameter -> (its value rule, where this rank's slice starts in the checkpoint tensor)
        checks: dict[str, tuple[ValueRule | None, tuple[int, ...]]] = {
            "w13_weight": (None, ()), "w2_weight": (None, ()),
            "w13_weight_scale": (_e8m0_rule, (0, 2 * first, 0)),
            "w2_weight_scale": (_e8m0_rule, (0, 0, first // MX_BLOCK)),
            "w13_bias": (_finite_rule, (0, 2 * first)), "w2_bias": (_finite_rule, (0, 0))}

        def register(name: str, data: Tensor) -> None:
            param = Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            field = name.replace("_weight_scale", "_scales").replace("_weight", "_blocks")  # gpt_oss.ON_DISK's keys
            loader = _whole_experts_loader(f"{prefix}.{ON_DISK[field]}", folder, prefix, *checks[name])
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": loader})

        register("w13_weight", torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8))
        register("w13_weight_scale", torch.zeros(e, 2 * i, h // MX_BLOCK, dtype=torch.uint8))
        register("w2_weight", torch.zeros(e, h, i // 2, dtype=torch.uint8))
        register("w2_weight_scale", torch.zeros(e, h, i // MX_BLOCK, dtype=torch.uint8))
        register("w13_bias", torch.zeros(e, 2 * i, dtype=torch.float32))
        register("w2_bias", torch.zeros(e, h, dtype=torch.float32))

    def _pack_expert(self, layer: torch.nn.Module, e: int) -> tuple[PackedWeight, PackedWeight]:
        w13 = _deinterleave_rows(_data(layer, "w13_weight")[e:e + 1])[0]
        s13 = _deinterleave_rows(_data(layer, "w13_weight_scale")[e:e + 1])[0]
        return pack_mxfp4(w13, s13), pack_mxfp4(_data(layer, "w2_weight")[e], _data(layer, "w2_weight_scale")[e])

    def _biases(self, layer: torch.nn.Module) -> tuple[Tensor | None, Tensor | None]:
        return _deinterleave_rows(_data(layer, "w13_bias").float()), _data(layer, "w2_bias").float().contiguous()
