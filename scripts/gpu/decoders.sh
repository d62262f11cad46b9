#!/usr/bin/env bash
# Issue 30 on the lent GPU machine (see ../shared/gpu/README.md): onnxruntime-genai's model builder against
# onnxopt on decoders in float16 on CUDA, through onnxruntime-genai's generator. Needs the carried
# onnxruntime-gpu parts (/tmp/gw) and, in .gpu/wheels, onnxruntime_genai_cuda (CUDA 13; its builder too).
# Each step fits one command; the folders stay in /tmp/dec while the machine is held.
#   bash scripts/gpu/decoders.sh prepare CONFIG       # HF folder (random fp16), builder, fp16 export, onnxopt
#   bash scripts/gpu/decoders.sh time CONFIG [ARGS]   # interleaved generation, batch 1 and 4; kernels per provider
#   bash scripts/gpu/decoders.sh window               # the window onnxruntime's CUDA GroupQueryAttention attends
# CONFIG: a RANDOM_CONFIGS name of scripts/bench/genai_generation.py (llama-1b, qwen2-0.5b). Results in $OUT.
set -uo pipefail
. "$(dirname "$0")/env.sh"
W=/tmp/dec
step=$1; shift
common=(--provider cuda --precision fp16 --exporter dynamo --work "$W" --prompts 0)
case "$step" in
  window)
    python3 -c "
import numpy as np
from onnxopt.rules._mask_probe import window_keys
for lws in (2, 4):
    print('local_window_size', lws, 'keys attended: cpu', window_keys(lws, 'CPUExecutionProvider'),
          'cuda fp16', window_keys(lws, 'CUDAExecutionProvider', np.float16))" 2>&1 | tee "$OUT/window.txt" ;;
  prepare)
    c=$1; shift
    python3 -m scripts.bench.genai_generation "${common[@]}" --random-config "$c" --prepare-only \
      --json "$OUT/prepare-$c.json" "$@" 2>&1 | tail -40 | tee "$OUT/prepare-$c.log"
    cp "$W/$c-random/onnxopt/report.json" "$OUT/onnxopt-report-$c.json" 2>/dev/null ;;
  time)
    c=$1; shift
    python3 -m scripts.bench.genai_generation "${common[@]}" --random-config "$c" --batch 1 4 \
      --json "$OUT/genai-cuda-$c.json" --markdown "$OUT/genai-cuda-$c.md" "$@" 2>&1 | tail -60 | tee "$OUT/time-$c.log"
    python3 -m scripts.bench.decoder_kernels "$W/$c-random/builder/model.onnx" "$W/$c-random/export/model.onnx" \
      "$W/$c-random/onnxopt/model.onnx" --provider cuda --json "$OUT/kernels-$c.json" > /dev/null 2> "$OUT/kernels-$c.err" ;;
esac
