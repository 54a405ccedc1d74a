#!/usr/bin/env bash
# One GPU session for the CuPy kernels: install, GPU tests, compute-sanitizer, benchmark.
#   bash benchmarks/run_on_device.sh OUT_DIR [stages]     stages: any of install,tests,sanitizer,bench (default: all)
# Every stage logs to OUT_DIR and runs even if an earlier one failed; the last lines summarise.
set -u
out=${1:?usage: run_on_device.sh OUT_DIR [stages]}
stages=${2:-install,tests,sanitizer,bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export QPN_CACHE_DIR=${QPN_CACHE_DIR:-/tmp/qpn-kernel-cache}

# The project installs editable; if the image's setuptools cannot (pyproject maps the repo root
# to the package `qpn`), a symlink named qpn on PYTHONPATH gives the same import layout.
if ! python3 -c 'import qpn.cupy_kernels' 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1
  if ! python3 -c 'import qpn.cupy_kernels' 2>>"$out/install.log"; then
    mkdir -p /tmp/qpn-path && ln -sfn "$(pwd)" /tmp/qpn-path/qpn
    export PYTHONPATH=/tmp/qpn-path${PYTHONPATH:+:$PYTHONPATH}
    echo "editable install failed: using PYTHONPATH=/tmp/qpn-path (symlink qpn -> repo)" >>"$out/install.log"
  fi
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c 'import cupy, qpn.cupy_kernels.loader as l; print("cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion()); print(l.describe())'
} >>"$out/install.log" 2>&1
summary=()

# Budgets fit one 10-minute device call: tests 180 s, benchmark 240 s, sanitizer 120 s.
if [[ $stages == *tests* ]]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider \
    tests/test_cupy_loader.py tests/test_cupy_prepack.py tests/test_cupy_dequantize.py tests/test_cupy_dense.py \
    >"$out/tests.log" 2>&1
  summary+=("tests: rc=$? $(tail -n 1 "$out/tests.log")")
fi
if [[ $stages == *bench* ]]; then
  timeout 240 python3 benchmarks/bench_kernels.py --out "$out" --name h200 ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  summary+=("bench: rc=$? $(grep -E '^- target' "$out/bench.log" | tr '\n' ' ')")
fi
if [[ $stages == *sanitizer* ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cupy_sanitizer.py >"$out/sanitizer.log" 2>&1
  summary+=("sanitizer: rc=$? $(tail -n 1 "$out/sanitizer.log")")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
