"""`qpn quantize`: a Hugging Face float checkpoint -> a weight-only quantized checkpoint, streamed.

SRC is a Hugging Face folder: config.json (no quantization_config yet) + model.safetensors, or shards
listed in model.safetensors.index.json; weights F32 / BF16 / F16. Each tensor is read alone with file
reads (`SafetensorsFile`: a file that changes under the read is an error, never a SIGBUS), quantized if
it is a linear weight qpn quantizes, and queued for an output shard; a shard is written (by a background
thread) when it holds SHARD_BYTES. A weight is quantized in row slices of SLICE_VALUES values on WORKERS
threads, after one pass for its amax (the tensor-wide scale): the ref quantizer runs per slice with that
scale given, so its float32 temporaries are a few slices, not the tensor, and the bytes are the whole
tensor's (every other rule is local to a row, a 16 / 32-block or a 128x128 block: tests). Memory: about
1.5 shards (`_ShardWriter`) + one source tensor + its output + the slices in flight.

Which weights are quantized: every 2-D `*.weight` of a float dtype whose module is not excluded (per-expert
MoE weights too, as Qwen3-MoE and Mixtral store them). Excluded, as ModelOpt excludes them by default:
embeddings, lm_head, MoE routers / gates (`*.mlp.gate`, `*router*`, Mixtral's `block_sparse_moe.gate`) -
DEFAULT_EXCLUDE - and every `--exclude` glob (fnmatch on the module name); kept in the source dtype too:
weights whose K the format cannot group (NVFP4 K % 16, MXFP4 K % 32). Everything else (norms, biases,
buffers) is copied byte for byte. The excluded modules are listed in the config (exclude_modules / ignore).

Output (FORMATS): the producer's export layout and configs, weight-only (no input scales).
- nvfp4, fp8, fp8-channel, fp8-block: ModelOpt 0.47's, as its exporter writes it (tensors, shapes,
  dtypes, config.json `quantization_config` and hf_quant_config.json: tests/fixtures/modelopt/*), quant_algo
  NVFP4 (config groups without input activations: vLLM reads that as W4A16), FP8, FP8_PER_CHANNEL_PER_TOKEN
  and the weight-only FP8_PB_WO. ModelOpt stores an FP8_PB_WO weight of one 128x128 block with a scalar scale.
- mxfp4: compressed-tensors mxfp4-pack-quantized (MXFP4A16), the MXFP4 layout qpn writes and vLLM reads.

Bytes (method "rtn"): what the producers' quantizers write for the same float weights (ref/nvfp4.py,
ref/fp8.py, ref/mxfp4.py; FP8 per-tensor rounds the quotient to the source dtype as ModelOpt's export
does). Method "mse": each group's scale searched (ref/scale_search.py); same layout, any reader.

gpt-oss (model_type "gpt_oss", stacked experts): gpt-oss's own MXFP4 format, checkpoints/quantize_gpt_oss.py.

Fused shards (q/k/v, gate/up of one module; an expert's gate/up, Mixtral's w1/w3): by default each projection
keeps its own scale, which qpn serves exactly. shared_fused_scales=True writes ModelOpt's exporter form
instead: the group's NVFP4 global scale is the largest member's and every member is re-quantized with it;
FP8_PB_WO weights of one block share the largest scale the same way; an expert's gate/up share its FP8
per-tensor scale (transformers 5 fuses them into one gate_up_proj parameter per expert, which ModelOpt
quantizes whole: tests/fixtures/modelopt/*moe_fp8, mixtral_fp8), while ModelOpt 0.47 leaves the other FP8
tensor / channel scales per projection. It reads every weight once more first (the group's amax).

The folder appears atomically (`atomic_folder`); overwrite replaces only a folder `qpn quantize` wrote
(`_not_ours`). Copied beside the weights: SIDE_FILES (tokenizer, chat template, generation config).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from ..ref.checks import require_weight_to_quantize
from ..ref.dtypes import BF16, FP16, bf16_from_bits
from ..ref.formats import FP8_BLOCK, MX_BLOCK
from ..ref.fp8 import fp8_block_grid, fp8_block_grid_4d, fp8_quantize, fp8_scale
from ..ref.geometry import GROUP_K
from ..ref.mxfp4 import mxfp4_quantize
from ..ref.nvfp4 import nvfp4_global_scale, nvfp4_quantize
from ..ref.scale_search import (
    fp8_quantize_mse,
    fp8_scale_candidates,
    fp8_tensor_row_errors,
    mxfp4_quantize_mse,
    nvfp4_quantize_mse,
)
from .atomic import TargetRules, atomic_folder, write_json
from .checkpoint import CheckpointError, FP8Linear, MXFP4Linear, NVFP4Linear, QuantizedLinear
from .compressed_tensors import CT_MXFP4_FORMAT, CompressedTensors
from .folder import (
    CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    INDEX_FILE,
    SAVED_METADATA,
    SINGLE_FILE,
    not_written_by,
    weight_files,
)
from .modelopt import ModelOpt
from .producer import Producer
from .quantize_gpt_oss import gpt_oss_plan, is_gpt_oss, quantize_gpt_oss_experts
from .safetensors_io import SafetensorsFile, StoredTensor, TensorInfo, write_safetensors

SHARD_BYTES = 1 << 30  # an output shard is written when its tensors reach 1 GiB (the bound on queued output)
DEFAULT_EXCLUDE = ("*embed_tokens", "*lm_head", "*.mlp.gate", "*.block_sparse_moe.gate", "*router*")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json")
# vLLM's qkv_proj, gate_up_proj (w13 of a Mixtral expert)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
FLOAT_TAGS = {"F32": None, "BF16": BF16, "F16": FP16}  # source tag -> the dtype ModelOpt's FP8 quotient takes
METHODS = ("rtn", "mse")
# Values per row slice: a weight is quantized in slices of whole rows (whole 128-row blocks for FP8_PB_WO) once
# its tensor-wide scale is known, so the quantizer's float32 temporaries (~10 of a slice) stay in the caches
# and memory holds the source tensor, its output and a few slices (module docstring).
SLICE_VALUES = 1 << 18
WORKERS = min(4, os.cpu_count() or 1)  # slices run on a thread pool (numpy releases the GIL in its loops)
# A float source tag -> (its unsigned bit carrier, the mask of everything but the sign, the +inf pattern):
# IEEE floats are sign-magnitude, so the largest |w| has the largest masked pattern and a finite tensor's
# largest pattern is below +inf's - an exact amax and finiteness check in two integer passes (`_amax`).
_MAGNITUDE_BITS = {"BF16": (np.uint16, 0x7FFF, 0x7F80), "F16": (np.uint16, 0x7FFF, 0x7C00),
                   "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000)}
_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"


@dataclass(frozen=True)
class QuantizeFormat:
    """One `--format`: the producer whose layout it writes, its quant_algo, the K multiple it needs."""

    name: str
    quant_algo: str
    k_multiple: int
    methods: tuple[str, ...] = METHODS
    granularity: str | None = None  # FP8's

    @property
    def modelopt(self) -> bool:
        return self.quant_algo != "MXFP4"


FORMATS = {f.name: f for f in (
    QuantizeFormat("nvfp4", "NVFP4", GROUP_K),
    QuantizeFormat("fp8", "FP8", 1, granularity="tensor"),
    QuantizeFormat("fp8-channel", "FP8_PER_CHANNEL_PER_TOKEN", 1, granularity="channel"),
    QuantizeFormat("fp8-block", "fp8_pb_wo", 1, granularity="block"),  # ModelOpt 0.47 writes it in lower case
    QuantizeFormat("mxfp4", "MXFP4", MX_BLOCK),
)}


@dataclass
class QuantizeReport:
    """What `quantize` did: the quantized modules, the excluded ones (module -> why), files, bytes."""

    quantized: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    source_bytes: int = 0
    output_bytes: int = 0


def _module(tensor_name: str) -> str:
    return tensor_name[: -len(".weight")]


def _fused_key(module: str) -> tuple[str, int] | None:
    """(parent module, group index) for a q/k/v or gate/up projection, else None."""
    parent, _, leaf = module.rpartition(".")
    for index, group in enumerate(FUSED_GROUPS):
        if leaf in group:
            return parent, index
    return None


def _exclusion(module: str, tensor: Any, fmt: QuantizeFormat, exclude: Sequence[str]) -> str | None:
    """Why the 2-D float weight of `module` stays unquantized, or None to quantize it."""
    for pattern in DEFAULT_EXCLUDE:
        if fnmatch.fnmatchcase(module, pattern):
            return f"ModelOpt's default exclusion {pattern!r}"
    for pattern in exclude:
        if fnmatch.fnmatchcase(module, pattern):
            return f"--exclude {pattern!r}"
    k = tensor.shape[1]
    if k % fmt.k_multiple:
        return f"K = {k} is not a multiple of {fmt.k_multiple}, which {fmt.name} groups"
    return None


def _in_expert(module: str) -> bool:
    """Whether `module` is a projection of one expert (its parent ends in `.experts.<index>`)."""
    head, _, index = module.rpartition(".")[0].rpartition(".")
    return index.isdigit() and head.endswith(".experts")


def _is_linear_weight(name: str, tag: str, shape: Sequence[int]) -> bool:
    return name.endswith(".weight") and tag in FLOAT_TAGS and len(shape) == 2


def _float32(stored: StoredTensor, rows: slice = slice(None)) -> np.ndarray:
    """Rows of a float source tensor as float32 values, exactly (bf16 travels as bit patterns)."""
    if stored.dtype == "BF16":
        return bf16_from_bits(stored.array[rows])
    return stored.array[rows].astype(np.float32)


def _row_slices(n: int, k: int, multiple: int) -> list[slice]:
    """Slices of about SLICE_VALUES values of an [n, k] weight, each a multiple of `multiple` rows but the last."""
    rows = -(-max(1, SLICE_VALUES // k) // multiple) * multiple
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def _amax(stored: StoredTensor, slices: Sequence[slice], pool: Executor) -> np.float32:
    """amax(|w|) of a finite float source tensor (`_MAGNITUDE_BITS`); ValueError naming the first NaN / inf
    value (the ref's own check, run on the whole tensor only then)."""
    carrier, magnitude, inf = _MAGNITUDE_BITS[stored.dtype]
    bits = stored.array.view(carrier)
    largest = carrier(max(pool.map(lambda rows: (bits[rows] & carrier(magnitude)).max(), slices)))
    if largest >= inf:
        require_weight_to_quantize(_float32(stored))  # raises, with the index as the file holds it
    if stored.dtype == "BF16":
        return np.float32(bf16_from_bits(largest))
    return np.float32(largest.view(stored.array.dtype))


def _not_ours(folder: str) -> str | None:
    """None if `folder` holds only what `quantize` writes (its shards carry SAVED_METADATA's writer mark)."""
    return not_written_by(folder, "qpn quantize", SIDE_FILES)


TARGET_RULES: TargetRules = {"ours": _not_ours, "what": "quantized checkpoint", "flag": "--overwrite"}


class _Source:
    """SRC's config and weight files, each opened once for file reads; tensor name -> its file."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        config_path = os.path.join(folder, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise CheckpointError(folder, None, f"has no {CONFIG_FILE}; pass a Hugging Face model folder")
        try:
            with open(config_path, encoding="utf-8") as f:
                self.config = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(config_path, None, f"is not valid UTF-8 JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(config_path, None, "must hold a JSON object")
        if "quantization_config" in self.config or os.path.exists(os.path.join(folder, HF_QUANT_CONFIG_FILE)):
            raise CheckpointError(config_path, "quantization_config", "SRC is already quantized; qpn quantize "
                                  "takes the float model (fp32 / bf16 / fp16) it came from")
        names, weight_map, index_path = weight_files(folder)
        self.files: dict[str, SafetensorsFile] = {}
        self.file_of: dict[str, str] = {}
        try:
            for name in names:
                opened = self.files[name] = SafetensorsFile(os.path.join(folder, name))
                for tensor in opened.header.tensors:
                    if tensor in self.file_of:
                        raise CheckpointError(opened.path, tensor, f"also stored in {self.file_of[tensor]}; a "
                                                                   "tensor may live in one file")
                    if weight_map is not None and weight_map.get(tensor) != name:
                        raise CheckpointError(opened.path, tensor, f"is in this file but {index_path} maps it to "
                                                                   f"{weight_map.get(tensor)!r}; the index is stale")
                    self.file_of[tensor] = name
        except BaseException:
            self.close()
            raise

    def tensors(self) -> Iterable[tuple[str, SafetensorsFile]]:
        """(tensor name, its open file) in file order, then header order."""
        for file in self.files.values():
            for name in file.header.tensors:
                yield name, file

    def close(self) -> None:
        for opened in self.files.values():
            opened.close()


class _ShardWriter:
    """Queues output tensors and writes a shard each time SHARD_BYTES are queued (the final names, which
    need the shard count, are given at `finish`).

    A shard is written (and fsynced) by one background thread while the next tensors are quantized. Memory:
    `make_room` keeps the shard being written + the queue + the source tensor read next within
    shard_bytes * 3 / 2 (waiting for the write when they would not fit), so a model's peak holds about that
    plus one tensor's output and the quantizer's slices, whatever the model's size. Call `close` before
    the folder is removed or committed: it waits for the write in flight.
    """

    def __init__(self, folder: str, shard_bytes: int) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.queued: dict[str, StoredTensor] = {}
        self.parts: list[tuple[str, list[str]]] = []  # (temporary file, its tensors)
        self.total = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="qpn-quantize-write")
        self._writing: Future[None] | None = None
        self._writing_bytes = 0

    def _queued_bytes(self) -> int:
        return sum(t.nbytes for t in self.queued.values())

    def make_room(self, info: TensorInfo) -> None:
        """Before a source tensor of this header entry is read (its output is at most its size): start writing
        the queue if the tensor would take it past shard_bytes, and wait for the write in flight if the
        memory budget (class docstring) needs it."""
        begin, end = info.data_offsets
        if self.queued and self._queued_bytes() + end - begin > self.shard_bytes:
            self._flush()
        if self._writing_bytes + self._queued_bytes() + end - begin > self.shard_bytes * 3 // 2:
            self._wait()

    def add(self, tensors: Mapping[str, StoredTensor]) -> None:
        self.queued.update(tensors)
        if self._queued_bytes() >= self.shard_bytes:
            self._flush()

    def _wait(self) -> None:
        if self._writing is not None:
            writing, self._writing, self._writing_bytes = self._writing, None, 0
            writing.result()  # a failed write raises here

    def _flush(self) -> None:
        if not self.queued:
            return
        self._wait()  # one shard in flight at a time
        part = os.path.join(self.folder, f".part-{len(self.parts):05d}.safetensors")
        queued, self.queued = self.queued, {}
        self.parts.append((part, sorted(queued)))
        self._writing_bytes = sum(t.nbytes for t in queued.values())
        self.total += self._writing_bytes
        self._writing = self._io.submit(write_safetensors, part, queued, SAVED_METADATA)

    def close(self) -> None:
        """Wait for a write still in flight, which only a failure elsewhere leaves (`finish` waits for the last
        and raises its error): that failure is the one to report, so this write's own error is dropped."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - see the docstring; KeyboardInterrupt still propagates
            pass
        finally:
            self._io.shutdown()

    def finish(self) -> list[str]:
        """Rename the parts to model.safetensors or model-i-of-n.safetensors (+ the index); the file names."""
        self._flush()
        self._wait()
        count = len(self.parts)
        names = [SINGLE_FILE] if count == 1 else [_SHARD_NAME.format(i + 1, count) for i in range(count)]
        for (part, _), name in zip(self.parts, names, strict=True):
            os.rename(part, os.path.join(self.folder, name))
        if count > 1:
            write_json(os.path.join(self.folder, INDEX_FILE), {
                "metadata": {"total_size": self.total},
                "weight_map": {t: name for (_, tensors), name in zip(self.parts, names, strict=True) for t in tensors},
            })
        return names


def _configs(fmt: QuantizeFormat, excluded: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json's quantization_config, hf_quant_config.json or None) in the producer's own form."""
    producer = {"name": "qpn", "version": __version__}
    if not fmt.modelopt:  # compressed-tensors MXFP4A16, as CompressedTensors.default_quantization_config words it
        weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MX_BLOCK, "symmetric": True,
                   "dynamic": False, "scale_dtype": "torch.uint8"}
        group = {"targets": ["Linear"], "weights": weights, "format": CT_MXFP4_FORMAT, "input_activations": None}
        return {"quant_method": "compressed-tensors", "format": CT_MXFP4_FORMAT, "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": list(excluded)}, None
    section: dict[str, Any] = {"quant_algo": fmt.quant_algo, "kv_cache_quant_algo": None}
    if fmt.quant_algo == "NVFP4":
        section["group_size"] = GROUP_K
    section["exclude_modules"] = list(excluded)
    hf_quant_config = {"producer": producer, "quantization": section}
    # config.json's form, as ModelOpt's convert_hf_quant_config_format writes it (tests/fixtures/modelopt/*):
    # config_groups for NVFP4 and FP8 per-tensor only; input_activations None, as nothing calibrated them
    config: dict[str, Any] = {}
    if fmt.quant_algo in ("NVFP4", "FP8"):
        weights = {"dynamic": False, "num_bits": 4 if fmt.quant_algo == "NVFP4" else 8, "type": "float"}
        if fmt.quant_algo == "NVFP4":
            weights["group_size"] = GROUP_K
        config["config_groups"] = {"group_0": {"input_activations": None, "weights": weights, "targets": ["Linear"]}}
    config.update({"ignore": list(excluded), "quant_algo": fmt.quant_algo, "producer": producer,
                   "quant_method": "modelopt"})
    return config, hf_quant_config


def _shared_scales(source: _Source, candidates: Mapping[str, str], fmt: QuantizeFormat,
                   progress: Callable[..., Iterable], pool: Executor) -> dict[str, np.float32]:
    """module -> the scale its fused group shares (ModelOpt's exporter form; module docstring)."""
    block, tensor = fmt.granularity == "block", fmt.granularity == "tensor"
    if fmt.quant_algo != "NVFP4" and not block and not tensor:
        return {}
    amax: dict[str, np.float32] = {}
    groups: dict[tuple[str, int], list[str]] = {}
    for module, tensor_name in progress(candidates.items(), desc="amax of fused groups", total=len(candidates),
                                        unit="tensor"):
        key = _fused_key(module)
        if key is None or (tensor and not _in_expert(module)):
            continue  # FP8 per tensor: ModelOpt shares only an expert's gate/up (module docstring)
        opened = source.files[source.file_of[tensor_name]]
        n, k = opened.header.tensors[tensor_name].shape
        if block and fp8_block_grid(n, k) != (1, 1):
            continue  # ModelOpt shares only one-block scales (module docstring)
        amax[module] = _amax(opened.read(tensor_name), _row_slices(n, k, 1), pool)
        groups.setdefault(key, []).append(module)
    shared: dict[str, np.float32] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        top = max(amax[m] for m in members)
        # the scale of the largest amax is the members' largest scale (RN32(amax / divisor) is monotone)
        scale = nvfp4_global_scale(top) if fmt.quant_algo == "NVFP4" else np.float32(fp8_scale(top, "tensor"))
        shared.update(dict.fromkeys(members, scale))
    return shared


def _quantize_one(fmt: QuantizeFormat, method: str, module: str, stored: StoredTensor,
                  shared: np.float32 | None, pool: Executor) -> QuantizedLinear:
    """One weight -> the checkpoint data model's linear (checked there) in the format's layout: the ref
    quantizer run on row slices (SLICE_VALUES) with the tensor-wide scale found first, the same bytes as on
    the whole tensor (every other rule is local to a row, an NVFP4 / MXFP4 block or a 128x128 FP8 block)."""
    n, k = stored.shape
    granularity = fmt.granularity
    slices = _row_slices(n, k, FP8_BLOCK if granularity == "block" else 1)
    amax = _amax(stored, slices, pool)
    quantize: Callable[[np.ndarray, slice], tuple[np.ndarray, ...]]
    if fmt.quant_algo == "NVFP4":
        g = shared if shared is not None else nvfp4_global_scale(amax)
        nvfp4 = nvfp4_quantize_mse if method == "mse" else nvfp4_quantize

        def quantize(w32: np.ndarray, _: slice) -> tuple[np.ndarray, ...]:
            return nvfp4(w32, g)[:2]
    elif fmt.quant_algo == "MXFP4":
        mxfp4 = mxfp4_quantize_mse if method == "mse" else mxfp4_quantize

        def quantize(w32: np.ndarray, _: slice) -> tuple[np.ndarray, ...]:
            return tuple(mxfp4(w32))
    else:
        assert granularity is not None  # every FP8 format names its granularity
        quotient = FLOAT_TAGS[stored.dtype] if granularity == "tensor" else None  # ModelOpt's export (ref/fp8.py)
        if shared is not None and granularity == "block":  # a one-block FP8_PB_WO weight: one slice
            scale: np.ndarray | None = np.full(fp8_block_grid(n, k), shared, np.float32)
        elif shared is not None:  # an expert's gate / up: their fused parameter's scale
            scale = np.asarray(shared, np.float32)
        elif granularity == "tensor" and method == "rtn":
            scale = fp8_scale(amax, granularity)
        elif granularity == "tensor":  # mse: the scale whose sum of the rows' errors is least (ref/scale_search.py)
            candidates = fp8_scale_candidates(fp8_scale(amax, granularity))
            row_errors = list(pool.map(lambda r: fp8_tensor_row_errors(_float32(stored, r), candidates, quotient),
                                       slices))
            totals = [np.concatenate([e[c] for e in row_errors]).sum() for c in range(len(candidates))]
            scale = candidates[int(np.argmin(totals))]  # the first least, as the search's strict < keeps it
        else:
            scale = None  # per row / per 128-row block: the ref finds each slice's own

        def quantize(w32: np.ndarray, rows: slice) -> tuple[np.ndarray, ...]:
            if scale is not None:  # tensor: the scalar; block: the slice's rows of the grid
                given = scale if granularity == "tensor" else scale[rows.start // FP8_BLOCK:-(-rows.stop // FP8_BLOCK)]
                return tuple(fp8_quantize(w32, granularity, given, quotient))
            if method == "mse":
                return tuple(fp8_quantize_mse(w32, granularity, quotient))
            return tuple(fp8_quantize(w32, granularity, quotient_dtype=quotient))

    # The codes (output 0: a row per weight row) go straight into their rows of one array, the scales (1/16
    # of that or less) are concatenated: memory holds the output once. Slices end in order: deterministic.
    codes: np.ndarray | None = None
    scales = []
    for rows, (part_codes, part_scales) in zip(slices, pool.map(lambda r: quantize(_float32(stored, r), r), slices),
                                               strict=True):
        if codes is None:
            codes = np.empty((n, *part_codes.shape[1:]), part_codes.dtype)
        codes[rows] = part_codes
        scales.append(part_scales)
    assert codes is not None  # n >= 1: one slice at least
    if fmt.quant_algo == "NVFP4":
        return NVFP4Linear(module, codes, np.concatenate(scales), np.asarray(g, np.float32))
    if fmt.quant_algo == "MXFP4":
        return MXFP4Linear(module, codes, np.concatenate(scales))
    assert granularity is not None
    return FP8Linear(module, codes, scales[0] if granularity == "tensor" else np.concatenate(scales), granularity)


def _stored(producer: Producer, linear: QuantizedLinear) -> dict[str, StoredTensor]:
    """The linear's tensors as the producer writes them; FP8_PB_WO scales in ModelOpt 0.47's shapes."""
    stored = producer.linear_tensors(linear)
    if isinstance(linear, FP8Linear) and linear.granularity == "block":
        name = f"{linear.name}.{linear.scale_name}"
        grid = fp8_block_grid_4d(linear.n, linear.k)
        shape = () if grid == (1, 1, 1, 1) else grid
        stored[name] = StoredTensor(np.ascontiguousarray(stored[name].array).reshape(shape), stored[name].dtype)
    return stored


@dataclass
class _Plan:
    """What `quantize_checkpoint` writes: the 2-D linears to quantize (module -> tensor) in the producer's layout,
    or gpt-oss's stacked experts tensors; config.json and hf_quant_config.json (or None)."""

    linears: dict[str, str]
    experts: set[str]
    config: dict[str, Any]
    hf_quant_config: dict[str, Any] | None
    producer: Producer | None


def _plan(source: _Source, fmt: QuantizeFormat, exclude: Sequence[str], report: QuantizeReport) -> _Plan:
    """Which source tensors are quantized and the configs (module docstring); fills report.excluded."""
    if is_gpt_oss(source.config):
        tensors = {name: (opened.header.tensors[name], opened.path) for name, opened in source.tensors()}
        experts, report.excluded, config = gpt_oss_plan(source.config, os.path.join(source.folder, CONFIG_FILE),
                                                        tensors, fmt.name, exclude)
        return _Plan({}, set(experts), config, None, None)
    linears = {}
    for name, opened in source.tensors():
        info = opened.header.tensors[name]
        if _is_linear_weight(name, info.dtype, info.shape):
            why = _exclusion(_module(name), info, fmt, exclude)
            if why is None:
                linears[_module(name)] = name
            else:
                report.excluded[_module(name)] = why
    if not linears:
        raise CheckpointError(source.folder, None, f"has no 2-D float linear weight to quantize as {fmt.name} (all "
                                                   f"{len(report.excluded)} excluded); check --exclude")
    if not any(fnmatch.fnmatchcase(m, "*lm_head") for m in report.excluded):
        # a tied lm_head has no tensor, but vLLM builds a ParallelLMHead and quantizes it unless the list names it
        report.excluded["lm_head"] = "tied to the embedding (no tensor of its own); ModelOpt lists it all the same"
    qc, hf_quant_config = _configs(fmt, sorted(report.excluded))
    producer: Producer = ModelOpt(qc, CONFIG_FILE) if fmt.modelopt else CompressedTensors(qc, CONFIG_FILE)
    return _Plan(linears, set(), dict(source.config, quantization_config=qc), hf_quant_config, producer)


def _write_beside(folder: str, src: str, plan: _Plan, report: QuantizeReport) -> None:
    """The configs and the SIDE_FILES SRC holds, into the output folder."""
    write_json(os.path.join(folder, CONFIG_FILE), plan.config)
    if plan.hf_quant_config is not None:
        write_json(os.path.join(folder, HF_QUANT_CONFIG_FILE), plan.hf_quant_config)
    for side in SIDE_FILES:
        path = os.path.join(src, side)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(folder, side))
            report.copied.append(side)


def quantize_checkpoint(src: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str, *,
                        method: str = "rtn", exclude: Sequence[str] = (), shared_fused_scales: bool = False,
                        overwrite: bool = False, progress: Callable[..., Iterable] = lambda it, **_: it,
                        shard_bytes: int = SHARD_BYTES) -> QuantizeReport:
    """Quantize the Hugging Face folder `src` into `out` (module docstring); progress(iterable, desc=, total=,
    unit=) shows the tensors. Bad input: CheckpointError / SafetensorsError naming the file and tensor, or
    ValueError for a bad argument; `out` is untouched on any failure."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    qfmt = FORMATS[fmt]
    if method not in qfmt.methods:
        raise ValueError(f"method must be one of {qfmt.methods} for {fmt}, got {method!r}")
    src_path, out_path = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if not os.path.isdir(src_path):
        raise CheckpointError(src_path, None, "is not a folder; pass a Hugging Face model folder (config.json + "
                                              "model.safetensors or shards)")
    source = _Source(src_path)
    report = QuantizeReport()
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="qpn-quantize")
    try:
        plan = _plan(source, qfmt, exclude, report)
        shared = _shared_scales(source, plan.linears, qfmt, progress, pool) if shared_fused_scales else {}

        def output_of(name: str, opened: SafetensorsFile) -> dict[str, StoredTensor]:
            """The output tensors of source tensor `name`: itself, or its quantized tensors."""
            tensor = opened.read(name)
            report.source_bytes += tensor.nbytes
            module = _module(name) if name.endswith(".weight") else None
            if name not in plan.experts and module not in plan.linears:
                return {name: tensor}
            try:
                if name in plan.experts:
                    _, k, n = tensor.shape
                    quantized = quantize_gpt_oss_experts(name, tensor, _row_slices(n, k, 1), method, pool)
                else:
                    assert module is not None and plan.producer is not None  # a linear of the producer's layout
                    quantized = _stored(plan.producer, _quantize_one(qfmt, method, module, tensor,
                                                                     shared.get(module), pool))
            except ValueError as exc:  # NaN / inf weights, or scales beyond fp32: the ref's words
                raise CheckpointError(opened.path, name, f"cannot be quantized as {fmt}: {exc}") from None
            report.quantized.append(module if module in plan.linears else name)
            return quantized

        with atomic_folder(out_path, overwrite=overwrite, protected=(src_path,), **TARGET_RULES) as tmp:
            writer = _ShardWriter(tmp, shard_bytes)
            try:
                total = sum(len(f.header.tensors) for f in source.files.values())
                for name, opened in progress(source.tensors(), desc=f"quantize {fmt} ({method})", total=total,
                                             unit="tensor"):
                    writer.make_room(opened.header.tensors[name])
                    writer.add(output_of(name, opened))  # no reference to the source tensor stays here
                report.files = writer.finish()
                report.output_bytes = writer.total
            finally:
                writer.close()  # before atomic_folder removes or commits the folder
            _write_beside(tmp, src_path, plan, report)
    finally:
        pool.shutdown(cancel_futures=True)  # after Ctrl-C: the slices queued are dropped, the running ones end
        source.close()
    return report


__all__ = ["DEFAULT_EXCLUDE", "FORMATS", "METHODS", "SIDE_FILES", "QuantizeReport", "quantize_checkpoint"]
