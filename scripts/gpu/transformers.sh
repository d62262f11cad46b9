#!/usr/bin/env bash
# The CUDA transformer table of BENCHMARKS.md and the README (issue 27, item 20): onnxopt --target ort-cuda
# against onnxruntime's transformers optimizer (num_heads/hidden_size from each model's config, opt_level
# default (1), 0, 2 and 99, use_gpu, fp16 with keep_io_types), optimum's ORTOptimizer (O2, O3; O4 = its fp16;
# its own wheels) and onnxscript's ort_fusions (docs/benchmarks-peers.md), on one GPU card in one
# session of the lent machine (it is given back after 30 minutes held: about 2 for the carrying, 3 parts of
# at most 9.5 minutes).
#
# 1. Here, in the repository's root (the checkout the device tool copies):
#        bash scripts/gpu/transformers.sh prepare
#    -> .gpu/part0..part4 (the onnxruntime-gpu 1.31.1 wheel in 5 parts; git-ignored), .gpu/minilm-a and
#       .gpu/minilm-b (all-MiniLM-L6-v2's config and weights in two parts: the machine reaches no registry),
#       .gpu/wheels-optimum (optimum-onnx 0.1.0 and its pins, ~16 MB: scripts/bench/_optimum.py PINS),
#       .gpu/wheels (onnxsim, ~10 MB: the fixed-shape peers' first step).
# 2. On the GPU machine, back to back (it is released 30 s after a command ends, and /tmp with it):
#        mkdir -p /tmp/gw && cp .gpu/partN /tmp/gw/                 carry [".gpu/partN"], N = 0..4
#        mkdir -p /tmp/gm && cp .gpu/minilm-a/* /tmp/gm/            carry [".gpu/minilm-a"]
#        mkdir -p /tmp/gm && cp .gpu/minilm-b/* /tmp/gm/            carry [".gpu/minilm-b"]
#        bash scripts/gpu/transformers.sh 1/3                       (then 2/3, 3/3; timeout_s 600)
#                                   with carry [".gpu/wheels-optimum", ".gpu/wheels"] (26 MB; env.sh installs
#                                   them once: optimum's into /tmp/site-optimum, for its process only)
#    Each part measures fp16 at batches 1 and 8 and fp32 at batch 1 (the issue's table; --fp32-batches 1),
#    about 7 minutes a part with every peer configuration (18 rows a model; estimate from the 11-row run of
#    2026-11-27 on an H200, not yet measured: each part's models are listed by `python -m scripts.bench.targets
#    --list --set transformers --part N/3`, lightest first).
#    Each part writes $OUT/targets-transformers-partNof3.{json,md,log}; no model is started after DEADLINE
#    (default 330 s) and the run stops at LIMIT (default 570 s), the JSON rewritten after each model.
# 3. Here: bash scripts/gpu/transformers.sh merge DIR ...   (the folders the three parts came back in)
#    -> scripts/results/targets/cuda-transformers.{json,md}, and the table put into BENCHMARKS.md and its
#       summary line into README.md (between their <!-- cuda-transformers... --> markers)
set -uo pipefail
cmd=${1:?usage: scripts/gpu/transformers.sh prepare | N/M | merge DIR...}
shift
case $cmd in
prepare)
  set -e
  ver=${ORT_GPU_VERSION:-1.31.1}
  mkdir -p .gpu
  whl=.gpu/onnxruntime_gpu-$ver-cp312-cp312-manylinux_2_28_x86_64.whl
  if [[ ! -f $whl ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      -d .gpu "onnxruntime-gpu==$ver"
  fi
  rm -f .gpu/part?
  split -b 52428800 -d -a 1 "$whl" .gpu/part
  # all-MiniLM-L6-v2 (the zoo's minilm-legacy): fetched by the zoo's own code (pip, pinned version)
  d=$(python3 -c "from onnxopt.models import transformers_models as tm; print(tm.minilm_dir())")
  rm -rf .gpu/minilm-a .gpu/minilm-b
  mkdir -p .gpu/minilm-a .gpu/minilm-b
  cp "$d/config.json" .gpu/minilm-a/
  split -b 52428800 -d -a 1 "$d/model.safetensors" .gpu/minilm-st.
  mv .gpu/minilm-st.0 .gpu/minilm-a/st.0
  mv .gpu/minilm-st.1 .gpu/minilm-b/st.1
  sha256sum "$d/model.safetensors" | cut -c1-64 > .gpu/minilm-a/sha256
  # optimum-onnx and its pinned deps (pure Python but tokenizers' abi3 wheel; ~16 MB), for CPython 3.12
  rm -rf .gpu/wheels-optimum
  python3 -m scripts.bench._optimum wheels .gpu/wheels-optimum
  # onnxsim (~10 MB): the fixed-shape peers get the model onnxsim fixed (--overwrite-input-shape) first
  rm -rf .gpu/wheels && mkdir -p .gpu/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .gpu/wheels "onnxsim==${ONNXSIM_VERSION:-0.8.1}"
  du -sh .gpu/part? .gpu/minilm-a .gpu/minilm-b .gpu/wheels-optimum .gpu/wheels
  ;;
merge)
  set -e
  out=scripts/results/targets
  mkdir -p "$out"
  files=()
  for d in "$@"; do files+=("$d"/targets-transformers-*.json); done
  python3 -m scripts.bench.targets --merge "${files[@]}" -o "$out/cuda-transformers.json" \
    --markdown "$out/cuda-transformers.md" --compact "$out/cuda-transformers-table.md" --into BENCHMARKS.md README.md
  ;;
*/*)
  export TAG=transformers-part${cmd/\//of}
  LIMIT=${LIMIT:-570} DEADLINE=${DEADLINE:-330} JOBS=${JOBS:-6} \
    bash "$(dirname "$0")/targets.sh" "$cmd" --set transformers --fp32-batches 1 "$@"
  ;;
*)
  echo "usage: scripts/gpu/transformers.sh prepare | N/M | merge DIR..." >&2
  exit 2
  ;;
esac
