"""The one loader (cupy_kernels/loader.py): arch choice, options, cache keys and folders (CPU),
then compiling, caching and launching on a GPU (marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest

from qpn.cupy_kernels import loader
from qpn.cupy_kernels.dequantize import QPN2_DEQUANTIZE

TARGET_CASES = [
    # (compute capability, NVRTC version) -> (arch, image)
    ((7, 5), (13, 0), ("sm_75", "cubin")),
    ((7, 5), (12, 9), ("sm_75", "cubin")),
    ((8, 0), (13, 0), ("compute_75", "ptx")),
    ((8, 6), (12, 4), ("compute_75", "ptx")),
    ((9, 0), (13, 0), ("compute_75", "ptx")),
    ((12, 0), (13, 0), ("compute_75", "ptx")),
    ((7, 0), (12, 9), ("sm_70", "cubin")),
    ((7, 2), (12, 0), ("sm_72", "cubin")),
]


@pytest.mark.parametrize("cc, nvrtc_version, expected", TARGET_CASES)
def test_choose_target(cc, nvrtc_version, expected):
    target = loader.choose_target(cc, nvrtc_version)
    assert (target.arch, target.image) == expected


@pytest.mark.parametrize(
    "cc, nvrtc_version, message",
    [((7, 0), (13, 0), "no longer compiles sm_70"), ((6, 1), (12, 9), "need 7.5"), ((5, 2), (13, 0), "need 7.5")],
)
def test_choose_target_refuses_old_gpus(cc, nvrtc_version, message):
    with pytest.raises(RuntimeError, match=message):
        loader.choose_target(cc, nvrtc_version)


def test_options_are_fixed_and_macros_sorted():
    opts = loader.nvrtc_options("sm_75", {"B": 2, "A": "x"})
    assert opts[: len(loader.BASE_OPTIONS)] == list(loader.BASE_OPTIONS)
    assert opts[len(loader.BASE_OPTIONS):] == ["--gpu-architecture=sm_75", "-DA=x", "-DB=2"]
    assert "--ftz=false" in opts and not any("fast_math" in o or o == "--ftz=true" for o in opts)
    assert loader.nvrtc_options("sm_75", (("B", "2"), ("A", "x"))) == opts


def test_cache_key_changes_with_every_input():
    target = loader.Target("compute_75", "ptx", "")
    headers = (("h.cuh", "int x;"),)
    base = loader.cache_key("src", headers, ["-DA=1"], target, (13, 0))
    variants = [
        loader.cache_key("src2", headers, ["-DA=1"], target, (13, 0)),
        loader.cache_key("src", (("h.cuh", "int y;"),), ["-DA=1"], target, (13, 0)),
        loader.cache_key("src", headers, ["-DA=2"], target, (13, 0)),
        loader.cache_key("src", headers, ["-DA=1"], loader.Target("sm_75", "cubin", ""), (13, 0)),
        loader.cache_key("src", headers, ["-DA=1"], target, (13, 1)),
    ]
    assert len({base, *variants}) == 6
    assert base == loader.cache_key("src", headers, ["-DA=1"], target, (13, 0))


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "k"))
    assert loader.cache_dir() == tmp_path / "k"
    monkeypatch.delenv(loader.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.cache_dir() == tmp_path / "qpn" / "kernels"


def test_sources_resolve_from_the_package_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    name, text = loader.read_source("qpn2_dequantize.cu")
    assert name == "qpn2_dequantize.cu" and "qpn2_dequantize" in text
    assert loader.kernel_path("qpn2_dequantize.cu").parent == loader.KERNEL_DIR
    assert ("qpn_common.cuh", (loader.KERNEL_DIR / "qpn_common.cuh").read_text()) in loader.read_headers()
    with pytest.raises(FileNotFoundError, match="resolve from"):
        loader.read_source("no_such_kernel.cu")


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_get_function_compiles_once_and_caches_on_disk(monkeypatch, tmp_path):
    import cupy

    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    loader.clear_memory_cache()
    try:
        fn = loader.kernel(QPN2_DEQUANTIZE)
        assert loader.kernel(QPN2_DEQUANTIZE) is fn  # in-memory: the same RawKernel
        assert isinstance(fn, cupy.RawKernel)
        info = loader.describe()
        images = sorted(tmp_path.glob("qpn2_dequantize-*"))
        assert len(images) == 1 and images[0].suffix == "." + info["image"]
        cc = cupy.cuda.Device().compute_capability
        assert info["target"] == ("sm_75" if cc == "75" else "compute_75")
        # a fresh process state reloads the same file instead of compiling again
        stamp = images[0].stat().st_mtime_ns
        loader.clear_memory_cache()
        loader.kernel(QPN2_DEQUANTIZE)
        assert images[0].stat().st_mtime_ns == stamp
        assert sorted(tmp_path.glob("qpn2_dequantize-*")) == images
    finally:
        loader.clear_memory_cache()  # later tests use the default cache folder again


@pytest.mark.gpu
def test_loaded_kernel_runs_on_the_current_stream():
    import cupy

    from qpn.cupy_kernels import qpn8_dequantize
    from qpn.ref import qpn8_dequantize as reference
    from qpn.ref import qpn8_prepack

    rng = np.random.default_rng(0)
    weight = rng.integers(0, 0x7F, size=(32, 64), dtype=np.uint8)  # 0x00..0x7E: no NaN codes
    codes, scales = qpn8_prepack(weight, np.float32(0.01))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = qpn8_dequantize(cupy.asarray(codes), cupy.asarray(scales), 32, 64)
    stream.synchronize()
    assert np.array_equal(out.get().view(np.uint16), reference(codes, scales, 32, 64).view(np.uint16))
