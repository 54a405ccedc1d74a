"""Model conversion: quantize a model's nn.Linear layers in place, or fill a model from a checkpoint.

- `convert(model, format, skip=...)` replaces every eligible `nn.Linear` (exactly that class:
  subclasses such as MultiheadAttention's out_projection are read by their owners through
  `.weight`, so they stay) with a `QPNLinear`, and every transformers experts module (gate_up_proj /
  down_proj: Qwen3-MoE, Mixtral) with a `QPNExperts`, quantized by qpn.ref's quantizers. Layers that
  stay are returned with the reason: in `skip`, K breaking the layout rule, a subclass, or a
  weight the quantizer rejects (NaN / inf, ...).
- `load_quantized(model, checkpoint)` puts the quantized linears of a ModelOpt /
  compressed-tensors checkpoint (read and validated by qpn.ref.load_checkpoint) into the model
  as QPNLinear layers - checkpoint layer names are module paths; per-expert linears
  (`<block>.experts.<e>.<gate_proj | up_proj | down_proj | w1 | w3 | w2>`) as one QPNExperts per
  experts module; a gpt-oss MXFP4 folder's stacked experts as one QPNExperts each (QPNMX, biases,
  swigluoai) - and copies every other
  checkpoint tensor into the parameter or buffer of the same name. A load that quantizes nothing
  or leaves model tensors unfilled is an error unless `allow_partial=True`. A folder written by
  `qpn pack` (checkpoints/packed/) is read with qpn.checkpoints.packed.load_packed and its QPN2 / QPN8 buffers go
  into the QPNLinear layers as they are, without a second prepack.
"""

from __future__ import annotations

import copy
import fnmatch
import os
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import torch
from torch import Tensor, nn

from .. import checkpoints
from ..checkpoints import packed
from ..ref.formats import FORMAT_NAMES
from .experts import QPNExperts, is_experts_module, model_names, new_experts, stacked_experts
from .module import QPNLinear, format_of
from .packed_weight import PackedWeight, replacement_device

# what load_quantized reads: a folder, or a checkpoint already loaded by qpn.ref or qpn.checkpoints.packed
Loaded: TypeAlias = checkpoints.Checkpoint | packed.PackedCheckpoint
CheckpointIn: TypeAlias = str | os.PathLike[str] | Loaded
Device: TypeAlias = torch.device | str | None

_TORCH_DTYPE_OF_TAG = {
    "BF16": torch.bfloat16,  # carried as uint16 bit patterns
    "F8_E4M3": torch.float8_e4m3fn,  # carried as uint8 bit patterns
    "F8_E5M2": torch.float8_e5m2,
}


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def convert(model: nn.Module, format: str = "nvfp4", skip: Sequence[str] = (), *,
            fp8_granularity: str = "channel") -> list[tuple[str, str]]:
    """Replace eligible nn.Linear layers of `model` by QPNLinear, in place.

    format: "nvfp4" (ModelOpt NVFP4 rules, QPN2: K % 64 == 0) or "fp8" (e4m3 with an amax/448
    scale per `fp8_granularity`: "channel" (default; the best FP8 accuracy at the same kernel
    cost), "tensor" (ModelOpt's FP8) or "block" (128x128, K % 128 == 0)).
    skip: module names or fnmatch patterns ("*.pooler.dense", "lm_head") to leave alone.
    Output features need no alignment (QPNLinear pads and crops). Each new layer lives on the
    old layer's device; weights are quantized on the host.
    All or nothing: every new layer is built before the first one replaces its nn.Linear, so an
    exception (anything but a ValueError, which skips that layer with its reason) leaves the model
    as it was. The peak memory is the model plus its quantized layers.
    Returns [(module name, reason)] for every nn.Linear (or subclass) that was left as it was.
    """
    if format not in FORMAT_NAMES:
        raise ValueError(f"format must be one of {FORMAT_NAMES}, got {format!r}")
    if isinstance(skip, str):
        skip = (skip,)
    skipped: list[tuple[str, str]] = []
    new_layers: dict[str, nn.Module] = _new_experts_of(model, format, skip, fp8_granularity, skipped)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if not name:
            skipped.append((name, "the model itself is an nn.Linear; wrap it or use QPNLinear.from_linear"))
        elif _matches(name, skip):
            skipped.append((name, "listed in skip"))
        elif type(module) is not nn.Linear:
            skipped.append((name, f"{type(module).__name__} is a subclass of nn.Linear; its owner may read .weight"))
        else:
            try:
                new_layers[name] = QPNLinear.from_linear(module, format, fp8_granularity=fp8_granularity)
            except ValueError as exc:
                skipped.append((name, str(exc)))
    # ---- every layer is built or skipped with its reason: only now does the model change
    for name, new in new_layers.items():
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, new)
    return skipped


def _new_experts_of(model: nn.Module, format: str, skip: Sequence[str], fp8_granularity: str,
                    skipped: list[tuple[str, str]]) -> dict[str, nn.Module]:
    """{name: QPNExperts} for every transformers experts module (gate_up_proj / down_proj) that is not in
    `skip`; a ValueError skips that module with its reason."""
    wf = format_of(format, fp8_granularity)  # QPNLinear's rule: the granularity counts for FP8 only
    granularity = fp8_granularity if wf.granularities else None
    new: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not is_experts_module(module) or isinstance(module, QPNExperts):
            continue
        if _matches(name, skip):
            skipped.append((name, "listed in skip"))
            continue
        try:
            new[name] = QPNExperts.from_module(module, wf, granularity)
        except ValueError as exc:
            skipped.append((name, str(exc)))
    return new


class LoadReport(NamedTuple):
    """What `load_quantized` did: module / tensor names, sorted."""

    quantized: list[str]  # linears replaced by QPNLinear
    copied: list[str]  # unquantized checkpoint tensors copied into parameters / buffers
    unexpected: list[str]  # checkpoint tensors with no parameter / buffer of that name
    missing: list[str]  # state_dict() entries of the model that the checkpoint did not fill


class _Slot(NamedTuple):
    """One place a tensor lives: module._parameters[attr] or module._buffers[attr]."""

    module: nn.Module
    attr: str
    kind: str  # "_parameters" | "_buffers"


def _stored_to_torch(stored: checkpoints.StoredTensor) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(stored.array))  # writable copy of the (read-only, mmapped) data
    dtype = _TORCH_DTYPE_OF_TAG.get(stored.dtype)
    return tensor.view(dtype) if dtype is not None else tensor


def _packed_weight_of(layer: object) -> PackedWeight:
    """A checkpoint layer (NVFP4Linear / FP8Linear / MXFP4Linear, or a packed folder's PackedLayer) as its
    PackedWeight."""
    if isinstance(layer, packed.PackedLayer):
        return PackedWeight.from_packed_layer(layer)
    assert isinstance(layer, checkpoints.QUANTIZED_LINEARS)  # what checkpoints' readers return
    return PackedWeight.from_checkpoint(layer)


def _read_checkpoint(checkpoint: object) -> Loaded:
    if isinstance(checkpoint, (str, os.PathLike)):
        if packed.is_packed(checkpoint):
            return packed.load_packed(checkpoint)
        return checkpoints.load_checkpoint(checkpoint)
    if not isinstance(checkpoint, (checkpoints.Checkpoint, packed.PackedCheckpoint)):
        raise ValueError("checkpoint must be a folder path, a qpn.ref.Checkpoint or a "
                         f"qpn.checkpoints.packed.PackedCheckpoint, got {type(checkpoint).__name__}")
    return checkpoint


def _new_linears(model: nn.Module, checkpoint: Loaded, device: Device) -> tuple[dict[str, nn.Module], set[str]]:
    """{module name: new QPNLinear, or QPNExperts for a checkpoint's per-expert linears} and the checkpoint
    tensors they took (biases). The model is not touched."""
    layers = checkpoint.quantized_layers
    experts, expert_names = new_experts(model, layers, _packed_weight_of, device)
    new: dict[str, nn.Module] = dict(experts)
    if isinstance(checkpoint, checkpoints.Checkpoint):  # stacked experts (gpt-oss's MXFP4)
        new.update(stacked_experts(model, checkpoint.experts, device))
    consumed: set[str] = set()
    for name, linear in layers.items():
        if name in expert_names:
            continue
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"checkpoint layer {name!r} has no module at that path in the model; the checkpoint "
                             "names must be the model's module paths") from None
        if not isinstance(old, (nn.Linear, QPNLinear)):
            raise ValueError(f"checkpoint layer {name!r} is quantized but the model's {name} is a "
                             f"{type(old).__name__}, not an nn.Linear")
        if (old.out_features, old.in_features) != (linear.n, linear.k):
            raise ValueError(f"checkpoint layer {name!r} is [N, K] = [{linear.n}, {linear.k}] but the model's "
                             f"layer is [{old.out_features}, {old.in_features}]")
        old_device = old.codes.device if isinstance(old, QPNLinear) else old.weight.device
        bias_name = f"{name}.bias"
        if bias_name in checkpoint.tensors:
            bias = _stored_to_torch(checkpoint.tensors[bias_name]).float()
            consumed.add(bias_name)
        elif old.bias is None:
            bias = None
        elif old.bias.device.type == "meta":
            raise ValueError(f"layer {name!r} has a bias on the meta device and the checkpoint holds no "
                             f"{bias_name!r}; its values exist nowhere - build the model off meta or add the bias")
        else:
            bias = old.bias.detach().float()
        new[name] = QPNLinear.from_packed(_packed_weight_of(linear), bias).to(replacement_device(device, old_device))
    return new, consumed


def _slots(model: nn.Module, replaced: Sequence[str]) -> dict[str, _Slot]:
    """Every parameter and buffer (non-persistent too, tied ones under each name) outside the replaced modules."""
    skip = tuple(f"{name}." for name in replaced)
    slots = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                name = f"{prefix}.{attr}" if prefix else attr
                if tensor is not None and not name.startswith(skip):
                    slots[name] = _Slot(module, attr, kind)
    return slots


def _tensor(slot: _Slot) -> torch.Tensor:
    return getattr(slot.module, slot.kind)[slot.attr]


def _recomputed_buffers(model: nn.Module, names: list[str], slots: dict[str, _Slot],
                        device: Device) -> dict[str, Tensor]:
    """Values for non-persistent meta buffers (rotary inv_freq): computed, never stored in a checkpoint.

    transformers' PreTrainedModel._init_weights(module) computes them (it is what from_pretrained
    runs for them). It runs on a shallow copy of each owner module whose buffers are fresh
    NaN-filled tensors, so the model itself is untouched; a value it leaves NaN was not computed.
    """
    init = getattr(model, "_init_weights", None)
    by_owner: dict[int, list[str]] = {}
    for name in names:
        by_owner.setdefault(id(slots[name].module), []).append(name)
    values = {}
    for owner_names in by_owner.values():
        module = slots[owner_names[0]].module
        clone = copy.copy(module)
        clone._buffers = dict(module._buffers)
        for name in owner_names:
            meta = _tensor(slots[name])
            fresh = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            clone._buffers[slots[name].attr] = fresh.fill_(float("nan")) if fresh.is_floating_point() else fresh
        if callable(init):
            with torch.no_grad():
                init(clone)
        for name in owner_names:
            value = clone._buffers[slots[name].attr]
            if value is None or not callable(init) or not value.is_floating_point() or torch.isnan(value).any():
                raise ValueError(
                    f"buffer {name!r} is on the meta device, is not stored in checkpoints (non-persistent) and "
                    f"{'the model has no _init_weights' if not callable(init) else '_init_weights did not compute it'}"
                    "; create the model's buffers off meta (e.g. accelerate.init_empty_weights(), which keeps "
                    "buffers on the CPU) or set them before load_quantized")
            values[name] = value
    return values


def _first_names(names: Sequence[str]) -> str:
    return f"{list(names[:8])}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"


def load_quantized(model: nn.Module, checkpoint: CheckpointIn, *, strict: bool = False,
                   allow_partial: bool = False, device: Device = None) -> LoadReport:
    """Fill `model` from a quantized checkpoint, in place; all or nothing.

    checkpoint: a folder path (read with qpn.ref.load_checkpoint, or qpn.checkpoints.packed.load_packed for a
    `qpn pack` folder), a qpn.ref.Checkpoint or a qpn.checkpoints.packed.PackedCheckpoint.
    Every quantized linear `name` must be an nn.Linear (or QPNLinear) at module path `name`
    with the same [N, K]; it becomes a QPNLinear taking the bias from checkpoint tensor
    `name.bias`, else from the old module. Every other checkpoint tensor is copied (cast to the
    target's dtype) into the parameter or buffer of the same name (tied names share one tensor).

    device: where the new QPNLinear layers and the tensors of a meta-device model go. None: each
    layer on its old module's device, and the CPU for anything on meta. A model built under
    `torch.device("meta")` is materialized from the checkpoint; its non-persistent buffers
    (rotary inv_freq), which no checkpoint holds, are computed by the model's own
    `_init_weights` (transformers models have it); anything still on meta afterwards is a
    ValueError naming it.

    Everything is read, validated and built before the model changes: on any error the model is
    as it was. A load that would leave the model partly as it was is refused with a ValueError:
    a checkpoint with no quantized layer, or a `model.state_dict()` entry that the checkpoint does
    not fill (parameters and persistent buffers; non-persistent buffers are not in state_dict, tied
    names count as filled through any one of them, replaced linears' own tensors do not count).
    allow_partial=True accepts both and returns the report (its `missing` names what kept the
    model's values). strict=True also refuses checkpoint tensors that have no place in the model
    (`unexpected`); it cannot be combined with allow_partial=True.
    """
    if strict and allow_partial:
        raise ValueError("load_quantized(strict=True, allow_partial=True): strict refuses what allow_partial "
                         "accepts (model tensors the checkpoint does not fill); pass one of them")
    checkpoint = _read_checkpoint(checkpoint)
    device = torch.device(device) if device is not None else None
    new_linears, consumed = _new_linears(model, checkpoint, device)
    why = packed.no_quantized_layer(checkpoint)
    if why is not None and not allow_partial:
        raise ValueError(f"the checkpoint holds {why}; every nn.Linear of the model would keep its own weights - "
                         "or pass allow_partial=True to copy the other tensors anyway")
    slots = _slots(model, list(new_linears))
    values, unexpected = _checkpoint_values(checkpoint, consumed, slots)
    aliases: dict[int, list[str]] = {}  # one tensor under several names (tied weights)
    for name, slot in slots.items():
        aliases.setdefault(id(_tensor(slot)), []).append(name)
    filled = {alias for name in values for alias in aliases[id(_tensor(slots[name]))]}
    state_names = set(model.state_dict(keep_vars=True))
    on_meta = sorted(name for name, slot in slots.items() if name not in filled and _tensor(slot).is_meta)
    stored_meta = [name for name in on_meta if name in state_names]
    if stored_meta:
        raise ValueError(f"model tensors on the meta device that the checkpoint does not hold: "
                         f"{_first_names(stored_meta)}; their values exist nowhere - build those parts off meta or "
                         "load a checkpoint that has them")
    meta_device = device if device is not None else torch.device("cpu")
    computed = _recomputed_buffers(model, on_meta, slots, meta_device)

    missing = sorted(name for name in state_names & set(slots) if name not in filled)
    report = LoadReport(sorted(new_linears), sorted(values), sorted(unexpected), missing)
    _require_complete(report, strict, allow_partial)
    # ---- every check passed: change the model
    _change_model(model, new_linears, {**values, **computed}, slots, meta_device)
    return report


def _checkpoint_values(checkpoint: Loaded, consumed: set[str],
                       slots: dict[str, _Slot]) -> tuple[dict[str, Tensor], list[str]]:
    """({model name: the checkpoint's value, cast to the model tensor's dtype}, [checkpoint tensors with no
    place in the model]) for every tensor the new QPNLinear layers did not consume; a shape mismatch is a
    ValueError."""
    values, unexpected = {}, []
    for tensor_name, stored in checkpoint.tensors.items():
        if tensor_name in consumed:
            continue
        name = next((n for n in model_names(tensor_name) if n in slots), None)  # Mixtral's router: under mlp
        if name is None:
            unexpected.append(tensor_name)
            continue
        target = _tensor(slots[name])
        value = _stored_to_torch(stored)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {tuple(value.shape)} but the model's "
                             f"{name!r} has {tuple(target.shape)}")
        values[name] = value.to(target.dtype)
    return values, unexpected


def _require_complete(report: LoadReport, strict: bool, allow_partial: bool) -> None:
    """strict: nothing unexpected or missing; otherwise nothing missing unless allow_partial."""
    if strict and (report.unexpected or report.missing):
        raise ValueError(f"load_quantized(strict=True): unexpected checkpoint tensors {report.unexpected}, "
                         f"model tensors not in the checkpoint {report.missing}")
    if report.missing and not allow_partial:
        raise ValueError(f"{len(report.missing)} model tensors are not in the checkpoint and would keep the model's "
                         f"own (e.g. random) values: {_first_names(report.missing)}; load a checkpoint that holds "
                         "them (or the model they were saved from), or pass allow_partial=True to keep the model's "
                         "values there (the report lists them as missing)")


def _change_model(model: nn.Module, new_linears: dict[str, nn.Module], values: dict[str, Tensor],
                  slots: dict[str, _Slot], meta_device: torch.device) -> None:
    """The only step of load_quantized that changes the model (every check has passed): the new layers in
    place, every value copied into its tensor, a meta tensor replaced by one new tensor (tied names stay
    tied)."""
    for name, module in new_linears.items():
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, module)
    materialized: dict[int, Tensor] = {}  # old meta tensor -> its one new tensor
    for name, value in values.items():
        target = _tensor(slots[name])
        if not target.is_meta:
            with torch.no_grad():
                target.copy_(value)
            continue
        new = value.to(meta_device)
        if isinstance(target, nn.Parameter):
            new = nn.Parameter(new, requires_grad=target.requires_grad)
        materialized[id(target)] = new
    for slot in slots.values():
        moved = materialized.get(id(_tensor(slot)))
        if moved is not None:
            getattr(slot.module, slot.kind)[slot.attr] = moved
