"""qpn's benchmark scripts, installed as `qpn.benchmarks` so that `qpn bench` runs from any install.

Each is a script of its own (`python benchmarks/bench_decode.py ...` in a clone, `python -m
qpn.benchmarks.bench_decode ...` anywhere) with a `build_parser()` and a `main(argv)`; `qpn bench [kernels |
decode | model]` runs bench_kernels, bench_decode or bench_model. They import each other as package modules
(`from qpn.benchmarks import bench_kernels as bk`), never through sys.path, so one module is loaded once
whichever way it started. results/ (the committed measurements) stays in the repository; an installed qpn
writes to `--out`, by default ./qpn-bench-results (bench_kernels.DEFAULT_OUT). A few tools read tests/ or the
checkout (pack_hashes, structure_counts, tp_nccl) and run from a clone only.
"""
