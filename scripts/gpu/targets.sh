#!/usr/bin/env bash
# One command on the lent GPU machine (see ../shared/gpu/README.md): install the carried
# onnxruntime-gpu, build one part of the target benchmark's models with the project's own
# builders, and measure them on CUDA (scripts/bench/targets.py --target ort-cuda). Results go to
# $OUT/targets-<part>.{json,md,log}; merge the parts' JSON afterwards:
#   python -m scripts.bench.targets --merge out*/targets-*.json -o all.json --markdown BENCHMARKS-targets.md
#
#   usage: bash scripts/gpu/targets.sh N/M [python -m scripts.bench.targets options...]     (a part of the core set)
#          bash scripts/gpu/targets.sh --models NAME ... [options...]
#   e.g.   bash scripts/gpu/targets.sh 1/6;  bash scripts/gpu/targets.sh 2/8 --set full
#
# Time: the machine takes at most 10 minutes a command. No model is started after DEADLINE seconds
# (default 300) of the benchmark; the JSON is written after each model, so what finished survives
# the outer `timeout` (LIMIT, default 540 s).
set -uo pipefail
. "$(dirname "$0")/env.sh"  # onnxruntime-gpu, onnxopt on the path, the zoo cache
rm -rf /tmp/bench-targets  # the previous part's optimized models (the model cache stays)
sel=()
tag=custom
if [[ ${1:-} == */* ]]; then
  sel=(--part "$1"); tag=part${1/\//of}; shift
fi
tag=${TAG:-$tag}  # scripts/gpu/transformers.sh names its parts
python3 -c "import onnxruntime.transformers.optimizer, onnxscript.rewriter.ort_fusions; print('peers importable')" \
  || echo "WARNING: a peer does not import; its rows will show the error"
[ -n "${ONNXOPT_OPTIMUM_SITE:-}" ] \
  || echo "WARNING: optimum-onnx is not installed (carry .gpu/wheels-optimum): its rows fail and so does the run"
timeout --signal=INT "${LIMIT:-540}" python3 -m scripts.bench.targets --target ort-cuda ${sel[@]+"${sel[@]}"} \
  --cache "$ONNXOPT_CACHE" --work /tmp/bench-targets --jobs "${JOBS:-6}" --timeout 300 \
  --deadline "${DEADLINE:-300}" --runs 100 --warmup 20 --latency-budget 20 \
  --json "$OUT/targets-$tag.json" --markdown "$OUT/targets-$tag.md" "$@" 2>&1 | tee "$OUT/targets-$tag.log"
