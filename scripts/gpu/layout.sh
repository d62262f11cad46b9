#!/usr/bin/env bash
# One command on the lent GPU machine (see ../shared/gpu/README.md): install the carried
# onnxruntime-gpu, build the model(s) with the project's own builders, and run part C of the layout
# benchmark (scripts/bench/layout.py gpu --provider cuda): the original, onnxopt target ort-cuda, the
# same with the NHWC uint8 input, and the com.microsoft NhwcConv experiment, fp32 and fp16, each
# with the provider's defaults and with prefer_nhwc=1. Results go to $OUT/layout-<tag>.{json,md,log};
# put the parts together afterwards with
#   python -m scripts.bench.layout render out*/layout-*.json --markdown BENCHMARKS-layout.md
#
#   usage: bash scripts/gpu/layout.sh MODEL [python -m scripts.bench.layout gpu options...]
#   e.g.   bash scripts/gpu/layout.sh resnet50-legacy                 (batches 1 and 32)
#          bash scripts/gpu/layout.sh ppocrv4-det                     (batch 1, 640x640 pages)
#          bash scripts/gpu/layout.sh resnet50-legacy --batches 32 --precisions fp16
#
# Time: the machine takes at most 10 minutes a command; one model per command. No batch is started
# after DEADLINE seconds (default 330) of the benchmark; the JSON is written after each model, and
# the outer `timeout` (LIMIT, default 480 s) stops the rest. resnet50 is exported at each batch on
# the machine (about a minute at batch 32) unless the cache has it (.gpu/zoo carried, or /tmp/zoo
# from an earlier command on the same machine).
set -uo pipefail
. "$(dirname "$0")/env.sh"  # onnxruntime-gpu, onnxopt on the path, the zoo cache
model=${1:?usage: bash scripts/gpu/layout.sh MODEL [options...]}
shift
tag=${TAG:-$model}  # TAG: another name for the files, e.g. when one model runs in several commands
rm -rf "/tmp/bench-layout-$tag"  # the previous run's optimized models (the model cache stays)
timeout --signal=INT "${LIMIT:-480}" python3 -m scripts.bench.layout gpu --provider cuda --models "$model" \
  --cache "$ONNXOPT_CACHE" --work "/tmp/bench-layout-$tag" --timeout 240 --deadline "${DEADLINE:-330}" \
  --runs "${RUNS:-100}" --warmup 20 --latency-budget "${BUDGET:-25}" \
  --json "$OUT/layout-$tag.json" --markdown "$OUT/layout-$tag.md" "$@" 2>&1 | tee "$OUT/layout-$tag.log"
