#!/usr/bin/env bash
# One GPU session for the decode kernels: install, tests, sanitizer, benchmark (logs in OUT_DIR).
#   bash benchmarks/run_decode_on_device.sh OUT_DIR [stages]   stages: any of tests,sanitizer,bench
set -u
out=${1:?usage: run_decode_on_device.sh OUT_DIR [stages]}
stages=${2:-tests,sanitizer,bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export QPN_CACHE_DIR=${QPN_CACHE_DIR:-/tmp/qpn-kernel-cache}
if ! python3 -c 'import qpn.cupy_kernels' 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1
  if ! python3 -c 'import qpn.cupy_kernels' 2>>"$out/install.log"; then
    mkdir -p /tmp/qpn-path && ln -sfn "$(pwd)" /tmp/qpn-path/qpn
    export PYTHONPATH=/tmp/qpn-path${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
summary=()
if [[ $stages == *tests* ]]; then
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider --maxfail=20 tests/test_decode_math.py tests/test_cupy_linear.py \
    -k "not sanitizer" >"$out/tests.log" 2>&1
  summary+=("tests: rc=$? $(tail -n 1 "$out/tests.log")")
fi
if [[ $stages == *sanitizer* ]]; then
  timeout ${SAN_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_cupy_linear.py -k sanitizer >"$out/sanitizer.log" 2>&1
  summary+=("sanitizer: rc=$? $(tail -n 1 "$out/sanitizer.log")")
fi
if [[ $stages == *bench* ]]; then
  timeout ${BENCH_S:-240} python3 benchmarks/bench_decode.py --out "$out" --name decode_h200 ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  summary+=("bench: rc=$?")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
