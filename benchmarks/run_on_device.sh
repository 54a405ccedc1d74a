#!/usr/bin/env bash
# One GPU session: install, every gpu-marked test, compute-sanitizer, the benchmarks.
#   bash benchmarks/run_on_device.sh OUT_DIR [stages]
#   stages: any of tests,sanitizer,bench,decode,dispatch,moe,model,moemodel (default: all of these) and the opt-in
#   gptoss,gptossmodel,bf16; budgets: TESTS_S, SAN_S, BENCH_S, MODEL_S, BF16_S
#   (moe: benchmarks/bench_moe.py, the Qwen3-30B / Mixtral MoE layers; moemodel: bench_model.py --model qwen3moe)
#   (gptoss: bench_moe.py --layers gptoss20b,gptoss120b, MXFP4 experts vs fp16, results gpt_oss_moe_h200.{md,json};
#    gptossmodel: bench_model.py --model gptoss20b, fp16 vs MXFP4 experts, results gpt_oss_model_h200.{md,json};
#    each a few minutes, asked for by name: e.g. run_on_device.sh OUT gptoss,gptossmodel; bf16:
#    benchmarks/bench_bf16.py, bf16 against fp16 activations)
#   (dispatch: benchmarks/bench_dispatch.py, every linear path timed; its table lands in OUT_DIR)
#   (model: benchmarks/bench_model.py, Llama-3.1-8B-shaped decode tokens/s vs fp16; MODEL_ARGS passes arguments)
# Every stage logs to OUT_DIR and runs even if an earlier one failed; the last lines summarise.
# On a machine without the MiniLM wheel, set QPN_MINILM_DIR to a copy of its model folder; the
# notebooks need the [test] extra (nbclient), which the device image lacks, so they are left out.
set -u
out=${1:?usage: run_on_device.sh OUT_DIR [stages]}
stages=${2:-tests,sanitizer,bench,decode,dispatch,moe,model,moemodel}
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

if [[ $stages == *tests* ]]; then
  timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=30 -k "not sanitizer" tests/ --ignore=tests/test_notebooks.py \
    >"$out/tests.log" 2>&1
  summary+=("tests: rc=$? $(tail -n 1 "$out/tests.log")")
fi
if [[ $stages == *sanitizer* ]]; then
  timeout "${SAN_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -k sanitizer tests/ --ignore=tests/test_notebooks.py >"$out/sanitizer.log" 2>&1
  summary+=("sanitizer: rc=$? $(tail -n 1 "$out/sanitizer.log")")
fi
if [[ $stages == *bench* ]]; then
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_kernels.py --out "$out" --name h200 ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  summary+=("bench: rc=$? $(grep -E '^- target' "$out/bench.log" | tr '\n' ' ')")
fi
if [[ $stages == *decode* ]]; then
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_decode.py --out "$out" --name decode_h200 ${BENCH_ARGS:-} >"$out/bench_decode.log" 2>&1
  summary+=("bench_decode: rc=$?")
fi
if [[ $stages == *dispatch* ]]; then
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_dispatch.py --device cuda --out "$out" >"$out/bench_dispatch.log" 2>&1
  summary+=("bench_dispatch: rc=$? $(grep -c ' -> ' "$out/bench_dispatch.log") rows")
fi
if [[ $stages =~ (^|,)moe(,|$) ]]; then
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_moe.py --out "$out" >"$out/bench_moe.log" 2>&1
  summary+=("bench_moe: rc=$? $(grep -c ' us (graph' "$out/bench_moe.log") rows")
fi
if [[ $stages =~ (^|,)model(,|$) ]]; then  # ~5 min: build 8B fp16 on the GPU, quantize one layer, 3 formats x 5 batches (about 2 min manual-only)
  timeout "${MODEL_S:-540}" python3 benchmarks/bench_model.py --out "$out" --name model_h200 ${MODEL_ARGS:-} \
    >"$out/bench_model.log" 2>&1
  summary+=("bench_model: rc=$? $(grep -E '^(manual|compile) +batch +[0-9]+ nvfp4' "$out/bench_model.log" | awk '{printf "%s b%s %sx; ", $1, $3, $11}')")
fi
if [[ $stages =~ (^|,)moemodel(,|$) ]]; then  # Qwen3-30B-A3B shapes: 61 GB of fp16 built on the GPU
  timeout "${MODEL_S:-540}" python3 benchmarks/bench_model.py --model qwen3moe --graphs manual --out "$out" \
    --name moe_model_h200 ${MODEL_ARGS:-} >"$out/bench_moe_model.log" 2>&1
  summary+=("bench_moe_model: rc=$? $(grep -E '^manual +batch +[0-9]+ nvfp4' "$out/bench_moe_model.log" | awk '{printf "b%s %sx; ", $3, $11}')")
fi
if [[ $stages =~ (^|,)gptoss(,|$) ]]; then  # ~2-3 min: 32 + 128 MXFP4 experts packed on the GPU, M = 1, 8, 32, 512
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_moe.py --layers gptoss20b,gptoss120b --ms 1,8,32,512 \
    --out "$out" --name gpt_oss_moe_h200 >"$out/bench_gpt_oss_moe.log" 2>&1
  summary+=("bench_gpt_oss_moe: rc=$? $(grep -c ' us (graph' "$out/bench_gpt_oss_moe.log") rows; $(grep -E '^- target' "$out/bench_gpt_oss_moe.log" | tr '\n' ' ')")
fi
if [[ $stages =~ (^|,)gptossmodel(,|$) ]]; then  # ~3-5 min: gpt-oss-20b shapes, 42 GB of fp16 built on the GPU
  timeout "${MODEL_S:-540}" python3 benchmarks/bench_model.py --model gptoss20b --graphs manual --out "$out" \
    --name gpt_oss_model_h200 ${MODEL_ARGS:-} >"$out/bench_gpt_oss_model.log" 2>&1
  summary+=("bench_gpt_oss_model: rc=$? $(grep -E '^manual +batch +[0-9]+ mxfp4' "$out/bench_gpt_oss_model.log" | awk '{printf "b%s %s tok/s %sx; ", $3, $7, $11}')")
fi
if [[ $stages =~ (^|,)bf16(,|$) ]]; then  # ~1 min: bf16 against fp16 x through the same kernels
  timeout "${BF16_S:-240}" python3 benchmarks/bench_bf16.py --out "$out" ${BF16_ARGS:-} >"$out/bench_bf16.log" 2>&1
  summary+=("bench_bf16: rc=$? $(grep -E '^- target' "$out/bench_bf16.log" | tr '\n' ' ')")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
