#!/usr/bin/env bash
# The benefit table's CUDA entries, in one command on the lent GPU machine (see ../shared/gpu/README.md,
# as scripts/gpu/bench.sh): install the carried onnxruntime-gpu, build the zoo models there, then
#   1. every benefit key of the rules (the library's, and the stand-ins of scripts/data/benefit_standin_rules.py
#      for keys whose rule has not landed) on ort-cuda: with and without, interleaved;
#   2. the session options of the advice (prefer_nhwc on the Conv models, CUDA graphs at fixed shapes).
# Writes $OUT/benefit-cuda.json, $OUT/benefit-cuda-advice.json, $OUT/benefit-cuda-nhwc-fp16-b32.json; merge
# them here with (later files win per key and target: put the run the decision should rest on last)
#   python -m scripts.data.benefit --merge OUT/benefit-cuda.json OUT/benefit-cuda-nhwc-fp16-b32.json \
#       OUT/benefit-cuda-advice.json --into onnxopt/data/benefit.json
# With both the library's rule and the stand-in carrying a key, both run "with" and neither "without".
#   usage: bash scripts/gpu/benefit.sh [--runs N] [--models NAME ...]   (options go to both runs)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. "$(dirname "$0")/env.sh"  # onnxruntime-gpu, onnxopt and the scripts on the path, the zoo cache
python3 -m scripts.data.benefit --targets ort-cuda --models ${BENEFIT_MODELS:-bert-legacy gpt2-legacy minilm-legacy} \
  --runs 100 --warmup 10 --threads 0 --cache "$ONNXOPT_CACHE" -o "$OUT/benefit-cuda.json" "$@" 2>&1 \
  | tee "$OUT/benefit-cuda.log"
python3 -m scripts.data.benefit --advice --targets ort-cuda --runs 100 --warmup 10 --cache "$ONNXOPT_CACHE" \
  -o "$OUT/benefit-cuda-advice.json" "$@" 2>&1 | tee "$OUT/benefit-cuda-advice.log"
# prefer_nhwc at a large batch in fp16, where the issue's resnet50 target is (needs optimize(precision=...))
python3 -m scripts.data.benefit --advice --targets ort-cuda --keys cuda_prefer_nhwc --batch 32 --precision fp16 \
  --models resnet50-legacy mobilenet_v2-legacy --runs 100 --warmup 10 --cache "$ONNXOPT_CACHE" \
  -o "$OUT/benefit-cuda-nhwc-fp16-b32.json" 2>&1 | tee "$OUT/benefit-cuda-nhwc-fp16.log"
