"""A tiny Llama as a ModelOpt NVFP4 checkpoint, with a tokenizer: a model vLLM serves on any CPU.

    python -m qpn.apps.tiny_llama ./tiny-llama-nvfp4

writes a folder that vLLM (its OpenAI-compatible server, `LLM()`) and `qpn inspect / pack / verify`
take as they take a real ModelOpt export: a 2-layer `LlamaForCausalLM` (hidden 256, 4 query / 2
key-value heads of 64, intermediate 512), random weights from a fixed seed, its 14 linears
quantized with qpn.ref's ModelOpt-exact NVFP4 quantizer and laid out as ModelOpt's
`export_hf_checkpoint` writes them (config.json with `quantization_config`, model.safetensors;
embeddings, norms and lm_head in fp16, lm_head excluded from quantization as ModelOpt does).

The tokenizer is character-level (every printable ASCII character and the newline are a token,
plus <unk>, <s>, </s>), built with the `tokenizers` library that vLLM and transformers bring, and
saved with transformers' `PreTrainedTokenizerFast.save_pretrained`: nothing is downloaded. Its
vocabulary is the model's, so every token the model can produce decodes to text. It carries a chat
template (CHAT_TEMPLATE), so vLLM's chat endpoint (`client.chat.completions`) serves it too. The weights are
random, so the text is gibberish; what the folder shows is the serving path (plugin, loading,
the qpn kernels, the tokenizer) end to end. tests/test_vllm_server.py serves it with vLLM's
OpenAI-compatible server.

Exit codes: 0 written; 2 the folder exists or cannot be written, or transformers is missing.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import checkpoints, ref
from ..ref.geometry import GROUP_K

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: config.json's bos / eos ids
VOCABULARY = (*SPECIALS, *(chr(c) for c in range(32, 127)), "\n")
INIT_STD = 0.08  # Llama's 0.02 would make the next-token distribution nearly flat
# The chat template (Jinja, as Hugging Face tokenizers carry it): "role: content" lines, then "assistant: " for the
# reply. vLLM's chat endpoint refuses a model without one (400); every character it adds is in VOCABULARY.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
LINEAR_SHAPES = {  # leaf -> (N, K)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def hf_llama_config(vocab_size: int, max_position_embeddings: int) -> dict[str, Any]:
    """A complete Hugging Face LlamaConfig of this shape (what transformers' save_pretrained writes);
    tests/tiny_llama.py builds its checkpoints on it too."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": max_position_embeddings, "mlp_bias": False,
        "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True, "vocab_size": vocab_size,
    }


def llama_config() -> dict[str, Any]:
    """config.json: the LlamaConfig plus ModelOpt's quantization_config."""
    return {
        **hf_llama_config(len(VOCABULARY), 512),
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                "group_size": GROUP_K, "exclude_modules": ["lm_head"],
                                "producer": {"name": "qpn", "version": "0.1.0"}},
    }


def tiny_llama_checkpoint(seed: int = 0) -> checkpoints.Checkpoint:
    """The quantized model in memory (qpn.checkpoints.Checkpoint, ModelOpt NVFP4)."""
    rng = np.random.default_rng(seed)
    vocab = len(VOCABULARY)
    tensors = {"model.embed_tokens.weight": rng.normal(0, 1.0, (vocab, HIDDEN)),
               "model.norm.weight": 1 + rng.normal(0, 0.05, HIDDEN),
               "lm_head.weight": rng.normal(0, INIT_STD, (vocab, HIDDEN))}
    linears: dict[str, checkpoints.NVFP4Linear | checkpoints.FP8Linear] = {}
    one = np.array(1.0, dtype=np.float32)  # ModelOpt's NVFP4 (W4A4) stores an input scale; qpn does not use it
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.05, HIDDEN)
        for leaf, shape in LINEAR_SHAPES.items():
            name = f"model.layers.{i}.{leaf}"
            q = ref.nvfp4_quantize(rng.normal(0, INIT_STD, shape).astype(np.float32))
            linears[name] = checkpoints.NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2,
                                                    input_scale=one)
    stored = {name: checkpoints.StoredTensor(w.astype(np.float16), "F16") for name, w in tensors.items()}
    return checkpoints.Checkpoint("modelopt", "NVFP4", linears, stored, llama_config())


def tokenizer() -> Any:
    """The character-level tokenizer (a transformers PreTrainedTokenizerFast; BOS first, as Llama's)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCABULARY)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()  # tokens are joined as they are, no spaces between them
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)


def write_tiny_llama(folder: str | os.PathLike[str], seed: int = 0) -> None:
    """Write the checkpoint and its tokenizer into the new folder `folder` (which must not exist): all or
    nothing - if the tokenizer cannot be written, the folder this call wrote goes again."""
    if os.path.lexists(folder):
        raise FileExistsError(errno.EEXIST, f"{os.fspath(folder)} exists; pass a new folder")
    tok = tokenizer()  # first: without transformers nothing is written
    checkpoints.save_checkpoint(folder, tiny_llama_checkpoint(seed))
    try:
        tok.save_pretrained(os.fspath(folder))
    except BaseException:
        shutil.rmtree(folder)  # this call's own new folder, not yet complete
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qpn.apps.tiny_llama", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT_DIR", help="the folder to create (must not exist)")
    args = parser.parse_args(argv)
    if os.path.lexists(args.out):
        print(f"{parser.prog}: error: {args.out} exists; pass a new folder", file=sys.stderr)
        return 2
    try:
        write_tiny_llama(args.out)
    except ImportError as exc:
        print(f"{parser.prog}: error: the tokenizer needs transformers (vLLM brings it; or `pip install "
              f"transformers`): {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: a 2-layer Llama, ModelOpt NVFP4, with a {len(VOCABULARY)}-token character tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
