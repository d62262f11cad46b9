#!/usr/bin/env bash
# The verifier on CUDA for models whose input/output layouts onnxopt changed (issue 16, item 4): one
# command on the lent GPU machine (see ../shared/gpu/README.md and scripts/gpu/env.sh). Builds
# resnet50-legacy there; PP-OCRv4 det and, when carried in .gpu/keras/, a tf2onnx Keras model come
# with the working tree. Each model is optimized for ort-cuda with raw uint8 input (and an NHWC
# output for PP-OCRv4 det), verified on CPU and CUDA as part of optimizing (--verify cpu,cuda: the
# original gets the same pixels preprocessed in numpy, outputs compared transposed back), then with
# `onnxopt verify` under prefer_nhwc=1. Reports (text and JSON) go to $OUT.
#   usage: bash scripts/gpu/layout_verify.sh
set -uo pipefail
. "$(dirname "$0")/env.sh"
mkdir -p /tmp/opt
python3 -m onnxopt.models build --only resnet50-legacy 2>&1 | tail -2
IMAGENET="scale=1/255,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"
run() { echo; echo "\$ $*"; "$@"; echo "(exit $?)"; }
R50="$ONNXOPT_CACHE/resnet50-legacy.onnx"
run python3 -m onnxopt "$R50" -o /tmp/opt/r50-u8.onnx --target ort-cuda --input-preprocess "input=uint8,HWC,$IMAGENET,bgr" \
  --verify cpu,cuda --json "$OUT/r50-u8.json"
run python3 -m onnxopt "$R50" -o /tmp/opt/r50-u8-fp16.onnx --target ort-cuda --precision fp16 \
  --input-preprocess "input=uint8,NHWC,$IMAGENET" --verify cpu,cuda --json "$OUT/r50-u8-fp16.json"
run python3 -m onnxopt verify "$R50" /tmp/opt/r50-u8-fp16.onnx --providers cpu,cuda --provider-option cuda:prefer_nhwc=1 \
  --runs 50 --json "$OUT/r50-u8-fp16-verify-nhwc.json"
DET="$ONNXOPT_CACHE/ppocrv4-det.onnx"
run python3 -m onnxopt "$DET" -o /tmp/opt/det-u8.onnx --target ort-cuda --input-preprocess "x=uint8,NHWC,$IMAGENET,bgr" \
  --output-layout NHWC --input-shape x=1,3,640,640 --verify cpu,cuda --json "$OUT/det-u8.json"
for k in .gpu/keras/*.onnx; do
  [ -f "$k" ] || continue
  b=$(basename "$k" .onnx)
  run python3 -m onnxopt "$k" -o "/tmp/opt/$b.onnx" --target ort-cuda --verify cpu,cuda --input-shape input=1,224,224,3 \
    --json "$OUT/$b.json"
done
true
