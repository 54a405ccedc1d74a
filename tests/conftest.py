"""Shared pytest set-up: the `gpu` marker skips cleanly, with the reason, without CUDA; `vllm` tests may not
skip where QPN_REQUIRE_VLLM=1 (.ci/run's real-vLLM step); subprocesses and signal handlers whose verdict
does not depend on the runner's load or inherited signal dispositions (`run_child`, `start_child`,
`default_signal_handlers`)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys

import pytest

# ----------------------------------------------------------------------------------------------
# verdicts that do not depend on how the runner was started or how loaded the machine is

# A subprocess's timeout is a hang guard, never a verdict: 15x the slowest child measured alone
# (test_turing_compile's compile_check, 121 s on a shared 2-core machine), far above any loaded run.
HANG_GUARD_S = 1800
# An ignored signal is inherited across fork and exec: `nohup pytest` ignores SIGHUP, a script's
# background job (`pytest &`) SIGINT. qpn rightly keeps an inherited SIG_IGN, so a test that stops
# qpn with one of these sets the disposition itself.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _default_signals() -> None:
    """Popen's preexec_fn: the child starts as from an interactive shell, each stop signal at its default."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def start_child(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen with SIGINT / SIGTERM / SIGHUP at their defaults in the child, whatever the runner ignores."""
    return subprocess.Popen(args, preexec_fn=_default_signals, **kwargs)


def run_child(args, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with default stop signals (`start_child`) and HANG_GUARD_S as its timeout."""
    kwargs.setdefault("timeout", HANG_GUARD_S)
    return subprocess.run(args, preexec_fn=_default_signals, **kwargs)


@pytest.fixture
def default_signal_handlers():
    """In-process: SIGINT / SIGTERM / SIGHUP as a Python started from an interactive shell has them
    (KeyboardInterrupt, the default actions) for one test, whatever the runner inherited; put back after."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; otherwise why GPU tests cannot run here."""
    try:
        import cupy
    except ImportError as exc:  # CPU-only machine (CI): CuPy is an extra, not a core dependency
        return f"CuPy is not installed ({exc}); GPU tests need a CUDA device and qpn[cuda12|cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # driver missing or no device
        return f"no CUDA device visible to CuPy ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA device visible to CuPy"
    return None


def pytest_collection_modifyitems(config, items):
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Where a real vLLM must run (.ci/run's vLLM venv sets it), a `vllm` test that skips is a failure:
# a broken vLLM import would otherwise turn the whole `-m vllm` run into green skips. The one exception: a
# skip whose reason starts with HARDWARE_SKIP, for what vLLM itself refuses on this machine's CPU (named in
# the reason, checked the way vLLM checks it).
REQUIRE_VLLM = os.environ.get("QPN_REQUIRE_VLLM") == "1"
HARDWARE_SKIP = "vLLM refuses this on this CPU: "


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_VLLM and report.skipped and "vllm" in item.keywords and HARDWARE_SKIP not in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"QPN_REQUIRE_VLLM=1 but this vllm test skipped: {report.longrepr}"


def _compute_sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "compute-sanitizer")):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


@pytest.fixture
def compute_sanitizer():
    """`run(tool, script)`: run `python script --drive` under compute-sanitizer's `tool`
    (memcheck, racecheck) and assert that the driver finished and the tool found nothing."""
    sanitizer = _compute_sanitizer_path()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found (CUDA toolkit bin/ not on PATH)")

    def run(tool: str, script: str) -> None:
        proc = run_child([sanitizer, "--tool", tool, "--error-exitcode", "99", sys.executable, script, "--drive"],
                         capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "driver done" in output, output[-4000:]
        clean = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
        assert clean in output, output[-4000:]

    return run


@pytest.fixture(scope="session")
def cp():
    """CuPy, for the gpu-marked tests (which the collection hook above skips, naming why, where it is absent)."""
    import cupy

    return cupy


@pytest.fixture(scope="session")
def nvrtc():
    """NVRTC through cuda-bindings (the compile check's compiler, CPU-only); skips with the fix."""
    from qpn.cupy_kernels import loader

    try:
        return loader.CudaBindingsNVRTC()
    except Exception as exc:  # ImportError, or the library missing behind the bindings
        pytest.skip(f"NVRTC through cuda-bindings is unavailable ({type(exc).__name__}: {exc}); "
                    "pip install 'cuda-bindings>=13' 'nvidia-cuda-nvrtc>=13'")
