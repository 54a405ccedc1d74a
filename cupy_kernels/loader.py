"""The one loader of qpn's CUDA kernels: compile options, arch choice, caches, NVRTC backends.

Everything about how a `.cu` file of this folder becomes a launchable `cupy.RawKernel` lives
here, and only here (docs/STYLE.md, item 5):

- **Sources** resolve from this package's folder (never the working directory). Every `*.cuh`
  of the folder is handed to NVRTC as an in-memory header, so `#include "qpn_common.cuh"`
  works without an include path and without CUDA toolkit headers (the NVRTC wheel has none;
  the kernels need none).
- **Options** (`nvrtc_options`): C++17, IEEE fp32 (`--ftz=false --prec-div=true
  --prec-sqrt=true`: subnormal scales and weights must match numpy bit for bit; never
  `--use_fast_math`), `--fmad=true` (contraction is harmless where the kernels use `__fmul_rn`
  and inline-PTX `.rn` instructions, and wanted in fp32 accumulation loops), line info for
  compute-sanitizer, then the variant's `-D` macros in sorted order.
- **Arch** (`choose_target`): compute capability 7.5 -> an `sm_75` cubin; anything newer ->
  `compute_75` PTX that the driver JIT-compiles, so exactly the Turing-legal code runs on the
  H200 used for testing; 7.0 / 7.2 -> `sm_70` / `sm_72` cubins only with a CUDA 12 NVRTC (CUDA
  13 dropped Volta); below that a clear error. If the driver refuses the PTX (an NVRTC newer
  than the driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION), the loader warns once and builds a
  cubin for the device's own arch from the same source and options (`describe()` says so).
- **Caches**: compiled images on disk under `$QPN_CACHE_DIR` (default
  `$XDG_CACHE_HOME/qpn/kernels`, i.e. `~/.cache/qpn/kernels`), keyed by a SHA-256 of the
  source, the headers, the options, the target and the NVRTC version; written atomically (temp
  file + rename), so concurrent processes never see half a file. In memory: one `RawKernel` per
  (device, source, macros, kernel name); the fast path is one dict lookup.
- **NVRTC**: CuPy's own binding (`cupy.cuda.nvrtc`, the library CuPy itself uses) at run time;
  `cuda.bindings.nvrtc` for the CPU-only compile check (`compile_check.py`); a ctypes binding
  for a side-by-side CUDA 12 NVRTC (sm_70). CuPy's `RawModule(code=...)` is not used because
  it always targets the current device (it would build sm_90 on an H200); the loader compiles
  itself and hands the image to `cupy.RawModule(path=...)`.

Public: `get_function(source, name, defines=None) -> cupy.RawKernel`, `kernel(variant)`,
`describe()`, `choose_target`, `nvrtc_options`, `kernel_path`, `cache_dir`.
This module imports cupy only inside functions: `import qpn.cupy_kernels` works without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

if TYPE_CHECKING:
    from .variants import KernelVariant

KERNEL_DIR = Path(__file__).resolve().parent
CACHE_ENV = "QPN_CACHE_DIR"
LOADER_VERSION = "1"  # bump when the cache-key recipe or the image format changes

TURING_ARCH = "75"
BASE_OPTIONS = (
    "--std=c++17",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--fmad=true",
    "--generate-line-info",
)


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """What NVRTC builds: `arch` is its --gpu-architecture value, `image` "cubin" or "ptx"."""

    arch: str
    image: str
    why: str


def choose_target(compute_capability: tuple[int, int], nvrtc_version: tuple[int, int]) -> Target:
    """The build target for a device of `compute_capability` given the NVRTC at hand (pure)."""
    major, minor = compute_capability
    cc = 10 * major + minor
    if cc == 75:
        return Target("sm_75", "cubin", "Turing: native sm_75 cubin")
    if cc > 75:
        return Target(
            "compute_75", "ptx", f"cc {major}.{minor}: compute_75 PTX, JIT-compiled by the driver (Turing-legal code)"
        )
    if cc in (70, 72):
        if nvrtc_version[0] <= 12:
            return Target(f"sm_{cc}", "cubin", f"Volta: sm_{cc} cubin from CUDA {nvrtc_version[0]} NVRTC")
        raise RuntimeError(
            f"this GPU has compute capability {major}.{minor} (Volta); NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} "
            "(CUDA 13) no longer compiles sm_70/sm_72: install CuPy for CUDA 12 (cupy-cuda12x, qpn[cuda12]) "
            "so that a CUDA 12 NVRTC is used"
        )
    raise RuntimeError(
        f"this GPU has compute capability {major}.{minor}; qpn's kernels need 7.5 (Turing) or newer "
        "(7.0/7.2 only with a CUDA 12 NVRTC)"
    )


def nvrtc_options(arch: str, defines: Mapping[str, object] | tuple = ()) -> list[str]:
    """Every NVRTC option for one build: the base options, the arch, then sorted -D macros."""
    items = defines.items() if isinstance(defines, Mapping) else defines
    macros = [f"-D{k}={v}" for k, v in sorted((str(k), str(v)) for k, v in items)]
    return [*BASE_OPTIONS, f"--gpu-architecture={arch}", *macros]


# ----------------------------------------------------------------------------- sources


def kernel_path(source: str | os.PathLike) -> Path:
    """A kernel file name resolves inside this package's folder; an absolute path stays as is."""
    path = Path(source)
    return path if path.is_absolute() else KERNEL_DIR / path


def read_source(source: str | os.PathLike) -> tuple[str, str]:
    """(file name, text) of a kernel source."""
    path = kernel_path(source)
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} does not exist (sources resolve from {KERNEL_DIR})")
    return path.name, path.read_text()


def read_headers() -> tuple[tuple[str, str], ...]:
    """Every *.cuh of the package folder as (include name, text), sorted by name."""
    return tuple((p.name, p.read_text()) for p in sorted(KERNEL_DIR.glob("*.cuh")))


def cache_key(text: str, headers: Sequence[tuple[str, str]], options: Sequence[str], target: Target,
              nvrtc_version: Sequence[int]) -> str:
    h = hashlib.sha256()
    for part in (LOADER_VERSION, target.arch, target.image, repr(tuple(nvrtc_version)), *options):
        h.update(part.encode())
        h.update(b"\0")
    for name, body in headers:
        h.update(name.encode() + b"\0" + body.encode() + b"\0")
    h.update(text.encode())
    return h.hexdigest()[:40]


def cache_dir() -> Path:
    """$QPN_CACHE_DIR, else $XDG_CACHE_HOME/qpn/kernels, else ~/.cache/qpn/kernels."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qpn" / "kernels"


# ----------------------------------------------------------------------------- NVRTC backends


class CompileResult(NamedTuple):
    ptx: bytes
    cubin: bytes | None  # None for a compute_XX (PTX-only) build
    log: str


class NVRTCError(RuntimeError):
    """NVRTC rejected a source; the message carries the program log."""


class NVRTC(Protocol):
    """What the loader and the CPU checks need of an NVRTC binding (the three classes below)."""

    version: tuple[int, int]

    def compile(self, text: str, name: str, options: Sequence[str], headers: Sequence[tuple[str, str]],
                want_cubin: bool) -> CompileResult: ...


# cupy.RawKernel: CuPy ships no type information (see _validate.CupyArray)
RawKernel: TypeAlias = Any


class _CupyNVRTC:
    """CuPy's own NVRTC binding (cupy.cuda.nvrtc): the library CuPy itself compiles with."""

    def __init__(self) -> None:
        from cupy.cuda import nvrtc  # noqa: PLC0415 (lazy: cupy is optional)

        self._n = nvrtc
        self.version = tuple(nvrtc.getVersion())

    def compile(self, text: str, name: str, options: Sequence[str], headers: Sequence[tuple[str, str]],
                want_cubin: bool) -> CompileResult:
        n = self._n
        prog = n.createProgram(text, name, [h.encode() for _, h in headers], [i.encode() for i, _ in headers])
        try:
            try:
                n.compileProgram(prog, list(options))
            except n.NVRTCError as exc:
                raise NVRTCError(f"NVRTC failed on {name} ({' '.join(options)}):\n{n.getProgramLog(prog)}") from exc
            log = n.getProgramLog(prog)
            ptx = n.getPTX(prog)
            ptx = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
            cubin = None
            if want_cubin:
                if not hasattr(n, "getCUBIN"):
                    raise NVRTCError("this CuPy's NVRTC binding has no getCUBIN; upgrade CuPy (>= 13)")
                cubin = bytes(n.getCUBIN(prog))
            return CompileResult(ptx, cubin, log)
        finally:
            n.destroyProgram(prog)


class CudaBindingsNVRTC:
    """NVRTC through `cuda.bindings.nvrtc` (cuda-bindings + nvidia-cuda-nvrtc wheels; no GPU)."""

    def __init__(self) -> None:
        from cuda.bindings import nvrtc  # noqa: PLC0415

        self._n = nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
        self._check(err, "nvrtcVersion")
        self.version = (major, minor)

    def _check(self, err: object, what: str, prog: object = None) -> None:
        if err != self._n.nvrtcResult.NVRTC_SUCCESS:
            log = self._log(prog) if prog is not None else ""
            raise NVRTCError(f"{what} failed: {err}\n{log}")

    def _log(self, prog: Any) -> str:
        err, size = self._n.nvrtcGetProgramLogSize(prog)
        buf = _out_buffer(size)
        self._n.nvrtcGetProgramLog(prog, buf)
        return bytes(buf).rstrip(b"\0").decode(errors="replace")

    def compile(self, text: str, name: str, options: Sequence[str], headers: Sequence[tuple[str, str]],
                want_cubin: bool) -> CompileResult:
        n = self._n
        err, prog = n.nvrtcCreateProgram(
            text.encode(), name.encode(), len(headers),
            [h.encode() for _, h in headers], [i.encode() for i, _ in headers],
        )
        self._check(err, "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in options]
            (err,) = n.nvrtcCompileProgram(prog, len(opts), opts)
            if err != n.nvrtcResult.NVRTC_SUCCESS:
                raise NVRTCError(f"NVRTC failed on {name} ({' '.join(options)}):\n{self._log(prog)}")
            log = self._log(prog)
            err, size = n.nvrtcGetPTXSize(prog)
            self._check(err, "nvrtcGetPTXSize", prog)
            ptx = _out_buffer(size)
            self._check(n.nvrtcGetPTX(prog, ptx)[0], "nvrtcGetPTX", prog)
            cubin: bytes | None = None
            if want_cubin:
                err, size = n.nvrtcGetCUBINSize(prog)
                self._check(err, "nvrtcGetCUBINSize", prog)
                cubin_buffer = _out_buffer(size)
                self._check(n.nvrtcGetCUBIN(prog, cubin_buffer)[0], "nvrtcGetCUBIN", prog)
                cubin = bytes(cubin_buffer)
            return CompileResult(bytes(ptx).rstrip(b"\0"), cubin, log)
        finally:
            n.nvrtcDestroyProgram(prog)


def _out_buffer(size: int) -> bytearray:
    """A fresh writable buffer for NVRTC to fill. Never `b" " * size`: for size 1 (an empty log)
    CPython returns its shared one-byte b" " object, NVRTC writes NUL into it, and every b" " in
    the process turns into b"\0" (seen: safetensors headers padded with NUL after a compile)."""
    return bytearray(size)


class CtypesNVRTC:
    """NVRTC through ctypes on a given libnvrtc.so (used for a side-by-side CUDA 12 NVRTC)."""

    def __init__(self, library: str | os.PathLike):
        self.path = str(library)
        lib = ctypes.CDLL(self.path)
        self._lib = lib
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, code: int, what: str, prog: ctypes.c_void_p | None = None) -> None:
        if code != 0:
            raise NVRTCError(f"{what} failed with NVRTC status {code}\n{self._log(prog) if prog else ''}")

    def _get(self, prog: ctypes.c_void_p | None, size_fn: Any, get_fn: Any) -> bytes:
        size = ctypes.c_size_t()
        self._check(size_fn(prog, ctypes.byref(size)), "size query", None)
        buf = ctypes.create_string_buffer(size.value)
        self._check(get_fn(prog, buf), "get", None)
        return buf.raw[: size.value]

    def _log(self, prog: Any) -> str:
        lib = self._lib
        log = self._get(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
        return log.rstrip(b"\0").decode(errors="replace")

    def compile(self, text: str, name: str, options: Sequence[str], headers: Sequence[tuple[str, str]],
                want_cubin: bool) -> CompileResult:
        lib = self._lib
        prog = ctypes.c_void_p()
        n_headers = len(headers)
        bodies = (ctypes.c_char_p * max(n_headers, 1))(*[h.encode() for _, h in headers])
        names = (ctypes.c_char_p * max(n_headers, 1))(*[i.encode() for i, _ in headers])
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), n_headers, bodies, names),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            if lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
                raise NVRTCError(f"NVRTC failed on {name} ({' '.join(options)}):\n{self._log(prog)}")
            log = self._log(prog)
            ptx = self._get(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX).rstrip(b"\0")
            cubin = self._get(prog, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if want_cubin else None
            return CompileResult(ptx, cubin, log)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_cuda12_nvrtc() -> Path | None:
    """libnvrtc.so.12 from the nvidia-cuda-nvrtc-cu12 wheel, if installed (for sm_70 builds)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
        if candidate.is_file():
            return candidate
    return None


def compile_source(nvrtc: NVRTC, source: str | os.PathLike, arch: str, defines: Mapping[str, object] | tuple = (),
                   extra_options: Sequence[str] = ()) -> CompileResult:
    """Compile one kernel file (name in this folder, or absolute path) with the project options."""
    name, text = read_source(source)
    return compile_text(nvrtc, text, name, arch, defines, extra_options)


def compile_text(nvrtc: NVRTC, text: str, name: str, arch: str, defines: Mapping[str, object] | tuple = (),
                 extra_options: Sequence[str] = ()) -> CompileResult:
    """Compile source text with the project options plus `extra_options` (the compile check adds
    `--ptxas-options=-v`); a cubin is produced for sm_XX, PTX only for compute_XX."""
    options = [*nvrtc_options(arch, defines), *extra_options]
    return nvrtc.compile(text, name, options, read_headers(), arch.startswith("sm_"))


# ----------------------------------------------------------------------------- run-time loading

_LOCK = threading.RLock()
_KERNELS: dict = {}  # (device id, source, macros, name) -> cupy.RawKernel
_VARIANT_KERNELS: dict = {}  # (device id, KernelVariant) -> cupy.RawKernel
_MODULES: dict = {}  # (device id, source, macros) -> (cupy.RawModule, Target)
_NVRTC: NVRTC | None = None
_BUILD_NOTES: dict = {}  # device id -> how its kernels were built
_PTX_ERRORS = ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_NO_BINARY_FOR_GPU")


def _runtime_nvrtc() -> NVRTC:
    global _NVRTC
    if _NVRTC is None:
        try:
            _NVRTC = _CupyNVRTC()
        except (ImportError, AttributeError):  # a CuPy without the binding: use cuda-bindings
            _NVRTC = CudaBindingsNVRTC()
    return _NVRTC


def _macros(defines: Mapping[str, object] | tuple | None) -> tuple[tuple[str, str], ...]:
    if defines is None:
        return ()
    items = defines.items() if isinstance(defines, Mapping) else defines
    return tuple(sorted((str(k), str(v)) for k, v in items))


def _build_image(source: str | os.PathLike, macros: tuple[tuple[str, str], ...], target: Target) -> Path:
    """Compile (or find in the disk cache) one module image; returns its file."""
    nvrtc = _runtime_nvrtc()
    name, text = read_source(source)
    headers = read_headers()
    options = nvrtc_options(target.arch, macros)
    key = cache_key(text, headers, options, target, nvrtc.version)
    folder = cache_dir()
    path = folder / f"{Path(name).stem}-{key}.{target.image}"
    if path.is_file():
        return path
    result = nvrtc.compile(text, name, options, headers, target.image == "cubin")
    data = result.cubin if target.image == "cubin" else result.ptx + b"\0"
    assert data is not None  # compiled with want_cubin for a cubin image: every binding returns it
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="." + target.image)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache folder should stay readable
        os.replace(tmp, path)  # atomic: readers see the old state or the whole file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _load(source: str | os.PathLike, macros: tuple[tuple[str, str], ...], name: str, device_id: int) -> RawKernel:
    import cupy  # noqa: PLC0415

    module_key = (device_id, str(source), macros)
    entry = _MODULES.get(module_key)
    if entry is None:
        cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "75", "90"
        target = choose_target((int(cc[:-1]), int(cc[-1])), _runtime_nvrtc().version)
        module = cupy.RawModule(path=str(_build_image(source, macros, target)))
        try:
            module.get_function(name)  # forces the driver to load (and JIT) the image now
        except cupy.cuda.driver.CUDADriverError as exc:
            if target.image != "ptx" or not any(code in str(exc) for code in _PTX_ERRORS):
                raise
            native = Target(
                f"sm_{cc}", "cubin", f"cc {cc}: driver refused compute_75 PTX ({exc}); native sm_{cc} cubin"
            )
            warnings.warn(
                f"qpn: the CUDA driver refused NVRTC {_runtime_nvrtc().version} PTX ({exc}); building sm_{cc} "
                "cubins from the same Turing-legal sources instead (update the driver to test the PTX path)",
                RuntimeWarning,
                stacklevel=3,
            )
            target = native
            module = cupy.RawModule(path=str(_build_image(source, macros, target)))
        _BUILD_NOTES[device_id] = target.why
        entry = _MODULES[module_key] = (module, target)
    return entry[0].get_function(name)


def get_function(source: str, name: str, defines: Mapping[str, object] | tuple | None = None) -> RawKernel:
    """The `cupy.RawKernel` `name` of kernel file `source` built with `defines`, for the current device.

    source: a file name in this package's folder (e.g. "qpn2_dequantize.cu") or an absolute
    path; defines: macros (dict or tuple of pairs). Compiles on first use (disk-cached), then
    returns the same RawKernel from memory. Launch it on the current CuPy stream as usual.
    """
    import cupy  # noqa: PLC0415

    device_id = cupy.cuda.runtime.getDevice()
    macros = _macros(defines)
    key = (device_id, source, macros, name)
    fn = _KERNELS.get(key)
    if fn is None:
        with _LOCK:
            fn = _KERNELS.get(key)
            if fn is None:
                fn = _KERNELS[key] = _load(source, macros, name, device_id)
    return fn


def kernel(variant: KernelVariant) -> RawKernel:
    """`get_function` for a registered `KernelVariant` (see variants.py); the wrappers' fast path
    (one dict lookup keyed by device and variant, no macro sorting)."""
    import cupy  # noqa: PLC0415

    key = (cupy.cuda.runtime.getDevice(), variant)
    fn = _VARIANT_KERNELS.get(key)
    if fn is None:
        fn = _VARIANT_KERNELS[key] = get_function(variant.source, variant.kernel, variant.defines)
    return fn


def describe(device_id: int | None = None) -> dict:
    """How kernels are built here: NVRTC version, target, cache folder (for logs and benchmarks)."""
    import cupy  # noqa: PLC0415

    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    cc = cupy.cuda.Device(device_id).compute_capability
    nvrtc = _runtime_nvrtc()
    target = choose_target((int(cc[:-1]), int(cc[-1])), nvrtc.version)
    return {
        "compute_capability": f"{cc[:-1]}.{cc[-1]}",
        "nvrtc_version": ".".join(map(str, nvrtc.version)),
        "nvrtc_binding": type(nvrtc).__name__,
        "target": target.arch,
        "image": target.image,
        "built_as": _BUILD_NOTES.get(device_id, target.why),
        "options": nvrtc_options(target.arch),
        "cache_dir": str(cache_dir()),
    }


def clear_memory_cache() -> None:
    """Forget loaded modules (tests use it to exercise the disk cache)."""
    with _LOCK:
        _KERNELS.clear()
        _VARIANT_KERNELS.clear()
        _MODULES.clear()
        _BUILD_NOTES.clear()
