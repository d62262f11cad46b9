#!/usr/bin/env bash
# One command on the lent GPU machine (see ../shared/gpu/README.md): install the carried
# onnxruntime-gpu and wheels, build the benchmark models with the project's own builders, and run
# the side-by-side benchmark with CPU and CUDA columns. Results go to $OUT.
#   usage: bash scripts/gpu/bench.sh [python -m scripts.bench.peers options...]
set -uo pipefail
. "$(dirname "$0")/env.sh"  # onnxruntime-gpu, onnxopt on the path, the zoo cache
python3 -m scripts.bench.peers --providers cpu,cuda --cache "$ONNXOPT_CACHE" \
  --json "$OUT/bench_gpu.json" --markdown "$OUT/BENCHMARKS_gpu.md" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
