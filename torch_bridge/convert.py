"""Model conversion: quantize a model's nn.Linear layers in place, or fill a model from a checkpoint.

- `convert(model, format, skip=...)` replaces every eligible `nn.Linear` (exactly that class:
  subclasses such as MultiheadAttention's out_projection are read by their owners through
  `.weight`, so they stay) with a `QPNLinear` quantized by qpn.ref's quantizers. Layers that
  stay are returned with the reason: in `skip`, K breaking the layout rule, a subclass, or a
  weight the quantizer rejects (NaN / inf, ...).
- `load_quantized(model, checkpoint)` puts the quantized linears of a ModelOpt /
  compressed-tensors checkpoint (read and validated by qpn.ref.load_checkpoint) into the model
  as QPNLinear layers - checkpoint layer names are module paths - and copies every other
  checkpoint tensor into the parameter or buffer of the same name. A folder written by
  `qpn pack` (qpn/packed.py) is read with qpn.packed.load_packed and its QPN2 / QPN8 buffers go
  into the QPNLinear layers as they are, without a second prepack.
"""

from __future__ import annotations

import fnmatch
import os
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from qpn import packed, ref

from .module import FORMATS, PackedWeight, QPNLinear

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
    Returns [(module name, reason)] for every nn.Linear (or subclass) that was left as it was.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if isinstance(skip, str):
        skip = (skip,)
    skipped: list[tuple[str, str]] = []
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
                new = QPNLinear.from_linear(module, format, fp8_granularity=fp8_granularity)
            except ValueError as exc:
                skipped.append((name, str(exc)))
                continue
            parent, attr = _parent_and_attr(model, name)
            setattr(parent, attr, new)
    return skipped


class LoadReport(NamedTuple):
    """What `load_quantized` did: module / tensor names, sorted."""

    quantized: list[str]  # linears replaced by QPNLinear
    copied: list[str]  # unquantized checkpoint tensors copied into parameters / buffers
    unexpected: list[str]  # checkpoint tensors with no parameter / buffer of that name
    missing: list[str]  # parameters / buffers of the model that the checkpoint did not fill


def _stored_to_torch(stored) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(stored.array))  # writable copy of the (read-only, mmapped) data
    dtype = _TORCH_DTYPE_OF_TAG.get(stored.dtype)
    return tensor.view(dtype) if dtype is not None else tensor


def _qpn_linear_of(linear, bias) -> QPNLinear:
    """QPNLinear from a qpn.ref NVFP4Linear / FP8Linear (prepacked here) or a qpn.packed.PackedLayer (as packed)."""
    if not isinstance(linear, packed.PackedLayer):
        return QPNLinear.from_checkpoint(linear, bias=bias)
    global_scale = torch.from_numpy(np.array(linear.global_scale)) if linear.global_scale is not None else None
    weight = PackedWeight(linear.format, torch.from_numpy(np.array(linear.codes)),
                          torch.from_numpy(np.array(linear.scales)), global_scale, linear.k, linear.n)
    return QPNLinear.from_packed(weight, bias, fp8_granularity="block" if linear.granularity == "block" else "channel")


def load_quantized(model: nn.Module, checkpoint, *, strict: bool = False) -> LoadReport:
    """Fill `model` from a quantized checkpoint, in place.

    checkpoint: a folder path (read with qpn.ref.load_checkpoint, or qpn.packed.load_packed for a
    `qpn pack` folder), a qpn.ref.Checkpoint or a qpn.packed.PackedCheckpoint.
    Every quantized linear `name` must be an nn.Linear (or QPNLinear) at module path `name`
    with the same [N, K]; it becomes a QPNLinear on that module's device (meta modules go to the
    CPU), taking the bias from checkpoint tensor `name.bias`, else from the old module. Every
    other checkpoint tensor is copied (cast to the target's dtype) into the parameter or buffer
    of the same name. strict=True raises ValueError if anything is unexpected or missing.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = packed.load_packed(checkpoint) if packed.is_packed(checkpoint) else ref.load_checkpoint(checkpoint)
    if not isinstance(checkpoint, (ref.Checkpoint, packed.PackedCheckpoint)):
        raise ValueError(f"checkpoint must be a folder path, a qpn.ref.Checkpoint or a qpn.packed.PackedCheckpoint, "
                         f"got {type(checkpoint).__name__}")
    layers = checkpoint.layers if isinstance(checkpoint, packed.PackedCheckpoint) else checkpoint.linears

    quantized, consumed = [], set()
    for name, linear in layers.items():
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
        device = old.codes.device if isinstance(old, QPNLinear) else old.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        bias_name = f"{name}.bias"
        if bias_name in checkpoint.tensors:
            bias = _stored_to_torch(checkpoint.tensors[bias_name]).float()
            consumed.add(bias_name)
        else:
            bias = old.bias.detach().float() if old.bias is not None and old.bias.device.type != "meta" else None
        new = _qpn_linear_of(linear, bias).to(device)
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, new)
        quantized.append(name)

    targets = dict(model.named_parameters(remove_duplicate=False))  # tied weights answer to every name
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    copied, unexpected = [], []
    for tensor_name, stored in checkpoint.tensors.items():
        if tensor_name in consumed:
            continue
        target = targets.get(tensor_name)
        if target is None:
            unexpected.append(tensor_name)
            continue
        value = _stored_to_torch(stored)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {tuple(value.shape)} but the model's "
                             f"has {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
        copied.append(tensor_name)

    quantized_prefixes = tuple(f"{name}." for name in quantized)
    filled = set(copied) | consumed
    missing = sorted(name for name in targets if name not in filled and not name.startswith(quantized_prefixes))
    report = LoadReport(sorted(quantized), sorted(copied), sorted(unexpected), missing)
    if strict and (report.unexpected or report.missing):
        raise ValueError(f"load_quantized(strict=True): unexpected checkpoint tensors {report.unexpected}, "
                         f"model tensors not in the checkpoint {report.missing}")
    return report
