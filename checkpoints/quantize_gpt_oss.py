"""`qpn quantize --format mxfp4` of a float gpt-oss folder: gpt-oss's own MXFP4 format (checkpoints/gpt_oss.py).

A float gpt-oss folder (config.json model_type "gpt_oss", as transformers' GptOssExperts saves it) stores each
layer's experts stacked, P = model.layers.{l}.mlp.experts:

    P.gate_up_proj  float [E, H, 2I]  gate / up interleaved along 2I (column 2i gate i, 2i + 1 up i)
    P.down_proj     float [E, I, H]
    P.gate_up_proj_bias [E, 2I], P.down_proj_bias [E, H]

that is [E, K, N]: K (the axis MXFP4 groups by 32) before N. The output is what openai/gpt-oss-20b ships:
P.gate_up_proj_blocks U8 [E, 2I, H/32, 16] + P.gate_up_proj_scales U8 [E, 2I, H/32] (still interleaved: the rows
keep the source's order), the same for down_proj ([E, H, I/32, ...]), the biases and every other tensor copied
byte for byte (attention, router, sinks, norms, embeddings, lm_head stay bf16: MODULES_TO_NOT_CONVERT), and
config.json's quantization_config {"modules_to_not_convert": MODULES_TO_NOT_CONVERT, "quant_method": "mxfp4"}.
Method rtn is the OCP rule (ref/mxfp4.py), the bytes the fixture maker writes; mse searches each block's
exponent (ref/scale_search.py), same format.

Other formats are refused: qpn serves gpt-oss in its own MXFP4 format only (its biased experts and swiglu
limit have no ModelOpt / compressed-tensors layout here), and the format quantizes every layer's experts and
nothing else, so --exclude does not apply.

Streaming: one experts tensor is read whole (memory bounded by the largest tensor, as for a dense model) and
quantized per expert in slices of its N rows (the caller's row slices), each slice gathered from the [K, N]
source as [rows, K] float32; the codes go straight into the output arrays.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ..ref.checks import ValueAtIndex, require_finite
from ..ref.dtypes import bf16_from_bits
from ..ref.formats import MX_BLOCK
from ..ref.mxfp4 import mxfp4_quantize
from ..ref.scale_search import mxfp4_quantize_mse
from .checkpoint import CheckpointError
from .gpt_oss import BLOCK_BYTES, EXPERTS_PREFIX, QUANT_METHOD, read_gpt_oss_config
from .safetensors_io import StoredTensor, TensorInfo

MODEL_TYPE = "gpt_oss"
# openai/gpt-oss-20b's config.json lists exactly these (tests/fixtures/make_gpt_oss_fixture.py)
MODULES_TO_NOT_CONVERT = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
FLOAT_TAGS = ("F32", "BF16", "F16")


def is_gpt_oss(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE


def _expert_shapes(cfg: Any) -> dict[str, tuple[int, int, int]]:
    """Stacked experts tensor suffix -> its float shape [E, K, N] (module docstring)."""
    e, h, i = cfg.experts, cfg.hidden, cfg.intermediate
    return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}


def gpt_oss_plan(config: Mapping[str, Any], config_path: str, tensors: Mapping[str, tuple[TensorInfo, str]],
                 fmt: str, exclude: Sequence[str]) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(the stacked experts tensors to quantize, excluded 2-D weight's module -> why, the output config.json) of a
    float gpt-oss folder; `tensors` maps each source tensor to (its header entry, its file). CheckpointError for
    a format or --exclude gpt-oss does not take, a config the MXFP4 layout cannot hold, a missing or misshapen
    experts tensor."""
    if fmt != QUANT_METHOD:
        raise CheckpointError(config_path, "model_type", f"is {MODEL_TYPE!r}: qpn quantize writes gpt-oss in its own "
                              f"MXFP4 format only (its biased experts have no {fmt} layout that qpn serves); use "
                              "--format mxfp4")
    if exclude:
        raise CheckpointError(config_path, "model_type", f"is {MODEL_TYPE!r}: gpt-oss's MXFP4 format quantizes every "
                              f"layer's experts and nothing else, so --exclude {exclude[0]!r} does not apply; drop it")
    out_config = dict(config, quantization_config={"modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
                                                   "quant_method": QUANT_METHOD})
    cfg = read_gpt_oss_config(out_config)  # the MXFP4 reader's config rules (E, H, I, L, top-k; H, I % 32 == 0)
    experts = []
    for layer in range(cfg.layers):
        for suffix, shape in _expert_shapes(cfg).items():
            name = f"{EXPERTS_PREFIX.format(layer=layer)}.{suffix}"
            if name not in tensors:
                raise CheckpointError(config_path, name, "is missing: a float gpt-oss folder stores each layer's "
                                      "experts stacked (mlp.experts.gate_up_proj [E, H, 2I], down_proj [E, I, H]); "
                                      "the folder is incomplete or not gpt-oss's")
            info, path = tensors[name]
            if info.dtype not in FLOAT_TAGS or info.shape != shape:
                raise CheckpointError(path, name, f"is {info.dtype} {list(info.shape)}, but config.json makes it a "
                                      f"float [E, K, N] = {list(shape)} ({' / '.join(FLOAT_TAGS)}); the tensor or "
                                      "the config is not this model's")
            experts.append(name)
    excluded = {}
    for name, (info, _) in tensors.items():
        if name.endswith(".weight") and info.dtype in FLOAT_TAGS and len(info.shape) == 2:
            module = name[: -len(".weight")]
            rule = next((p for p in MODULES_TO_NOT_CONVERT if fnmatch.fnmatchcase(module, p)
                         or fnmatch.fnmatchcase(module, f"{p}.*")), None)
            excluded[module] = f"gpt-oss's modules_to_not_convert {rule!r}" if rule else \
                "gpt-oss's format quantizes only the MoE experts"
    return experts, excluded, out_config


def _float32(part: np.ndarray, tag: str) -> np.ndarray:
    return bf16_from_bits(part) if tag == "BF16" else part.astype(np.float32)


def quantize_gpt_oss_experts(name: str, stored: StoredTensor, slices: Sequence[slice], method: str,
                             pool: Executor) -> dict[str, StoredTensor]:
    """One stacked float experts tensor [E, K, N] -> {name_blocks: U8 [E, N, K/32, 16], name_scales: U8
    [E, N, K/32]}, quantized per expert in the given slices of N rows on `pool`. ValueError (ValueAtIndex) at
    the first NaN / inf of a slice, at the index the file holds it."""
    e, k, n = stored.shape
    mxfp4 = mxfp4_quantize_mse if method == "mse" else mxfp4_quantize
    blocks = np.empty((e, n, k // MX_BLOCK, BLOCK_BYTES), np.uint8)
    scales = np.empty((e, n, k // MX_BLOCK), np.uint8)

    def quantize(expert: int, rows: slice) -> None:
        part = _float32(stored.array[expert: expert + 1, :, rows], stored.dtype)  # [1, K, rows]: the file's order
        try:
            require_finite("w", part, "clean the weight before quantizing")
        except ValueAtIndex as exc:
            raise exc.shifted((expert, 0, rows.start)) from None
        blocks[expert, rows], scales[expert, rows] = mxfp4(np.ascontiguousarray(part[0].T))

    # list(): every slice ran (and raised) before the arrays are used; slices end in any order, the bytes do not
    list(pool.map(lambda job: quantize(*job), [(expert, rows) for expert in range(e) for rows in slices]))
    return {f"{name}_blocks": StoredTensor(blocks, "U8"), f"{name}_scales": StoredTensor(scales, "U8")}


__all__ = ["MODULES_TO_NOT_CONVERT", "gpt_oss_plan", "is_gpt_oss", "quantize_gpt_oss_experts"]
