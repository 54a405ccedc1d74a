"""Run one real vLLM `LLM()` on the CPU and write what the tests compare, as JSON.

    python tests/vllm_run.py MODEL OUT.json [--quantization qpn] [--tp 2] [--compile] [--max-model-len 64]

It lives in its own process because vLLM sets up its distributed state, its compilation caches and
its engine once per process (a second `LLM()` in one pytest process is not what a server does, and
tensor parallelism spawns workers anyway). Greedy decoding (temperature 0, MAX_TOKENS or --max-tokens new tokens)
of PROMPTS (or --prompts; each with its new tokens within --max-model-len, 64 by default: the tiny models), with:
- "prompt_logprobs": per prompt, the log-probability of each prompt token given the tokens before
  it (teacher forcing: the same inputs for every model, so the numbers compare position by position);
- "tokens" / "top2": per prompt, the generated token ids and, at each step, the two best
  (token, log-probability) pairs, so a test can tell a real disagreement from a near tie;
- "kv_scales" (tensor parallelism 1 only): per attention layer, the k / v scales vLLM's attention uses
  (`_k_scale_float`, `_v_scale_float`);
- "quant_methods" (tensor parallelism 1 only): the class name of every linear / embedding layer's quant_method.
The tokenizer is skipped (token ids in, token ids out): the tiny test models have none.
"""

from __future__ import annotations

import argparse
import json
import os

PROMPTS = ([1, 5, 77, 300, 12, 9, 140, 33], [1, 400, 2, 17, 250, 61], [1, 9, 9, 9, 310, 128, 77, 5, 44, 3],
           [1, 222, 31, 7], [1, 64, 128, 192, 255, 3, 3], [1, 480, 470, 460, 450], [1, 42], [1, 300, 301, 302, 88, 19])
MAX_TOKENS = 8


def _inspect(model) -> dict:
    """Runs inside the vLLM worker (LLM.apply_model): what the tests check of the loaded model."""
    kv = []
    methods = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            methods[name] = type(method).__name__
        if hasattr(module, "_k_scale_float") and hasattr(module, "kv_cache_dtype"):
            kv.append([float(module._k_scale_float), float(module._v_scale_float), str(module.kv_cache_dtype)])
    return {"kv_scales": kv, "quant_methods": methods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile (vLLM's default) instead of eager")
    parser.add_argument("--dtype", default="half")
    parser.add_argument("--prompts", type=json.loads, default=PROMPTS, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="new tokens per prompt")
    parser.add_argument("--max-model-len", type=int, default=64, help="tokens per sequence, prompt and new ones")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny models need a few MB
    if args.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: faster, simpler
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, quantization=args.quantization, dtype=args.dtype, skip_tokenizer_init=True,
              enforce_eager=not args.compile, max_model_len=args.max_model_len, seed=0, tensor_parallel_size=args.tp,
              distributed_executor_backend="mp" if args.tp > 1 else None)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2, prompt_logprobs=1,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in args.prompts], params, use_tqdm=False)
    result = {"prompt_logprobs": [], "tokens": [], "top2": []}
    for prompt, out in zip(args.prompts, outputs, strict=True):
        # position 0 has no log-probability; position i: log p(prompt[i] | prompt[:i])
        result["prompt_logprobs"].append([None if d is None else d[tok].logprob
                                          for tok, d in zip(prompt, out.prompt_logprobs, strict=True)])
        gen = out.outputs[0]
        result["tokens"].append(list(gen.token_ids))
        result["top2"].append([sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda p: -p[1])[:2]
                               for step in gen.logprobs])
    if args.tp == 1:  # in-process model; worker processes would need _inspect pickled by reference
        result.update(llm.apply_model(_inspect)[0])
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
