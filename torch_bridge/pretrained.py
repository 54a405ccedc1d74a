"""`from_pretrained(folder)`: a quantized folder as a transformers model ready for `generate`, in one call.

The folder is any that `load_quantized` reads - a ModelOpt export (NVFP4, FP8 per tensor / channel / block, mixed
precision; also what `qpn quantize` writes), a compressed-tensors one, a gpt-oss MXFP4 one, a `qpn pack`
output - holding a transformers model's `config.json`. The model class is transformers' own for the config
(`AutoModelForCausalLM`), built on the meta device, so no weight memory is allocated for it; `load_quantized`
then puts a QPNLinear / QPNExperts where the folder holds a quantized layer (from its codes and scales: no
float copy of a quantized weight ever exists) and materializes every other tensor (embeddings, norms, lm_head,
routers, biases) from the folder on `device`, strict: a model tensor the folder does not hold, or a folder
tensor the model has no place for, is an error and nothing is returned. The config is read without its
`quantization_config`, so that transformers does not apply a quantizer of its own (it would expect the
producer's library and a GPU): the quantized layers are qpn's.

A folder with no quantization config at all (a plain fp16 / bf16 export, the baseline one compares against)
is loaded by transformers' own `from_pretrained`, so the same call serves both sides of a comparison.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..checkpoints import packed
from ..checkpoints.folder import CONFIG_FILE, HF_QUANT_CONFIG_FILE
from .convert import Device, load_quantized

GENERATION_CONFIG_FILE = "generation_config.json"


def is_quantized_folder(folder: str) -> bool:
    """A `qpn pack` folder, or one whose config.json has a quantization_config or that has hf_quant_config.json
    (the producers' two ways of saying it, as qpn's checkpoint reader takes them). A ValueError where `folder`
    holds no config.json: a folder on disk is required (nothing is downloaded)."""
    if not os.path.isdir(folder):  # transformers would take the name for a model hub's
        raise ValueError(f"from_pretrained: {folder} is not a folder; pass a Hugging Face model folder on disk")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"from_pretrained: {folder} has no {CONFIG_FILE}; it must be a Hugging Face model folder "
                         "on disk (the model's config next to its safetensors)")
    if packed.is_packed(folder) or os.path.isfile(os.path.join(folder, HF_QUANT_CONFIG_FILE)):
        return True
    with open(config_path, encoding="utf-8") as f:
        return "quantization_config" in json.load(f)


def from_pretrained(folder: str | os.PathLike[str], *, device: Device = None, dtype: torch.dtype | None = None
                    ) -> nn.Module:
    """The model in `folder` as a transformers causal LM in eval mode, its quantized layers qpn's.

    device: where the model goes (None: the CPU). dtype: the dtype of the unquantized tensors and of the
    activations (QPNLinear takes fp16 or bf16 as they are and fp32 through fp16); None: the config's `dtype`,
    else float16.
    The folder's generation_config.json, if any, becomes the model's generation config, as transformers does.
    Errors: a ValueError naming what does not fit (a folder tensor, a model tensor, a layer's shape).
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"qpn.from_pretrained builds transformers models and needs transformers ({exc}); "
                          "pip install transformers") from None

    folder = os.fspath(folder)
    target = torch.device(device) if device is not None else torch.device("cpu")
    quantized = is_quantized_folder(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    if dtype is None:
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float16
    if not quantized:
        plain: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype)
        return plain.to(target).eval()
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # qpn's layers, not a transformers quantizer (module docstring)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    load_quantized(model, folder, device=target, strict=True)
    if os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()
