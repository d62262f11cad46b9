#!/usr/bin/env bash
# Rebuild the Keras benchmark models of issue 16 (MobileNetV2, ResNet50, EfficientNetB0; tf2onnx optimizer on
# and off) and check them on onnxruntime CPU:
#
#     bash scripts/oracles/keras_models.sh [--out DIR] [--models mobilenetv2,...] [--opset 18] [--seed 0] [--keras-init]
#
# TensorFlow lives in its own virtual environment, $KERAS_VENV (default ~/.cache/onnxopt/tf-venv), made here
# with python3.11 and the pins of scripts/oracles/keras_models-requirements.txt if it is missing. The check runs with
# $PYTHON (default: python3), the project's environment with onnxruntime. Output: DIR (default
# ~/.cache/onnxopt/models/keras) with the .onnx files, keras-<name>.ref.npz and manifest.json.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${KERAS_VENV:-$HOME/.cache/onnxopt/tf-venv}"
py="${PYTHON:-python3}"
out="$HOME/.cache/onnxopt/models/keras"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --out) out="${args[i+1]:?--out needs a folder}" ;;
        --out=*) out="${args[i]#--out=}" ;;
    esac
done

if [ ! -x "$venv/bin/python" ]; then
    command -v python3.11 >/dev/null || { echo "keras_models.sh: python3.11 not found (the pins are for 3.11)" >&2; exit 1; }
    echo "keras_models.sh: making $venv (tensorflow-cpu, tf2onnx; a few minutes)"
    python3.11 -m venv "$venv"
    if ! { "$venv/bin/pip" install -q --upgrade pip && "$venv/bin/pip" install -q -r "$here/keras_models-requirements.txt"; } \
        >"$venv.install.log" 2>&1; then
        echo "keras_models.sh: pip install into $venv failed (log: $venv.install.log)" >&2
        rm -rf "$venv"
        exit 1
    fi
fi
"$venv/bin/python" "$here/build_keras_models.py" "$@"
"$py" "$here/keras_models.py" --dir "$out"
