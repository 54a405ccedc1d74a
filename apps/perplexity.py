"""Perplexity and top-1 agreement of causal LMs over a text, in transformers through `qpn.from_pretrained`.

    python -m qpn.apps.perplexity TEXT FOLDER [FOLDER ...] [--window 512] [--tokens N] [--dtype float32]

The text is tokenized by the first folder's tokenizer (every folder must share it: quantizing keeps the
tokenizer files) and cut into non-overlapping windows of `--window` tokens; in each window every token after the
first is predicted from the ones before it in that window (teacher forcing), so a model scores T - windows
tokens. Perplexity = exp(mean negative log-likelihood); top-1 agreement = the share of those positions where a
model's most likely next token equals the first folder's (the reference, e.g. the fp16 model). One row per
folder. `--dtype` is the activations' and unquantized tensors' dtype (float32 by default: on a CPU torch's
fp16 matmuls are slow, and qpn's linears take fp32 through fp16 anyway).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from .arguments import Parser, integer_in, path_name
from .output import EXIT_BAD_INPUT

MAX_TOKENS = 1 << 24
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = ("float32", "float16", "bfloat16")


class Scores(NamedTuple):
    """One model over one text: per scored position, the negative log-likelihood of the true next token and the
    model's most likely next token."""

    nll: Any  # torch.Tensor float64 [positions]
    top1: Any  # torch.Tensor int64 [positions]

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    def agreement(self, other: Scores) -> float:
        """The share of positions where both models predict the same next token."""
        return float((self.top1 == other.top1).double().mean())


def text_ids(tokenizer_folder: str | os.PathLike[str], text_path: str | os.PathLike[str],
             max_tokens: int | None = None) -> Any:
    """The text's token ids (torch int64 [T]) under the folder's tokenizer; the first `max_tokens` if given."""
    import torch
    import transformers

    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    folder = os.fspath(tokenizer_folder)
    if not os.path.isdir(folder):  # transformers would take the name for a model hub's
        raise ValueError(f"{folder} is not a folder; pass a model folder holding its tokenizer")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the first folder's "
                         "tokenizer reads the text: put a folder with one first")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
    return ids[:max_tokens] if max_tokens is not None else ids


def score(model: Any, ids: Any, window: int = 512) -> Scores:
    """Teacher-forced scores of `model` over `ids` in non-overlapping windows (module docstring)."""
    import torch

    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to predict from, one to predict), got {window}")
    device = next(model.parameters()).device
    nll, top1 = [], []
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window].to(device)
            if len(chunk) < 2:
                break
            logits = model(chunk[None]).logits[0, :-1].double()
            nll.append(-torch.log_softmax(logits, -1).gather(-1, chunk[1:, None])[:, 0].cpu())
            top1.append(logits.argmax(-1).cpu())
    return Scores(torch.cat(nll), torch.cat(top1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m qpn.apps.perplexity", description=__doc__.split("\n\n")[0])
    parser.add_argument("text", type=path_name, help="a UTF-8 text file")
    parser.add_argument("folders", type=path_name, nargs="+", metavar="FOLDER",
                        help="model folders; the first is the reference")
    parser.add_argument("--window", type=integer_in(2, MAX_TOKENS, "--window"), default=512,
                        help="tokens per window (default 512)")
    parser.add_argument("--tokens", type=integer_in(2, MAX_TOKENS, "--tokens"), default=None,
                        help="score only the text's first N tokens")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    import torch

    from ..torch_bridge.pretrained import from_pretrained, is_quantized_folder

    try:
        ids = text_ids(args.folders[0], args.text, args.tokens)
        for folder in args.folders:  # every folder's config before any scoring: a bad last one stops at once
            is_quantized_folder(folder)
        reference = None
        print(f"{len(ids)} tokens, windows of {args.window}")
        for folder in args.folders:
            scores = score(from_pretrained(folder, dtype=getattr(torch, args.dtype)), ids, args.window)
            reference = reference or scores
            print(f"{folder}: perplexity {scores.perplexity:.4f}, top-1 agreement {scores.agreement(reference):.4f}")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever it said
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
