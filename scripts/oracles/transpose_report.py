"""Transposes before and after onnxopt, and the bytes they move per inference (from shapes), with
onnxruntime's offline optimizer (basic level: its transpose optimizer) beside it.

    python -m scripts.oracles.transpose_report [--zoo NAME ...] [--nhwc-zoo NAME ...] [--blocks N ...]

The NHWC graphs are models/nhwc.py's keras_like (Transposes around every Conv, as tf2onnx writes
Keras models with its optimizer off); zoo models come from the zoo cache. Bytes are "-" where a
moved shape is not static (the elements are then a polynomial in s, a symbolic dimension).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from onnxopt import optimize
from onnxopt.transforms.transposes import graph_cost
from onnxopt.models.nhwc import keras_like


def ort_offline(m: onnx.ModelProto) -> onnx.ModelProto:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(Path(tmp) / "ort.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def row(name: str, m: onnx.ModelProto) -> str:
    cells = [name]
    for variant in (m, optimize(m), ort_offline(m)):
        count, elements, nbytes = graph_cost(ir.serde.deserialize_model(variant))
        cells.append(f"{count} / {elements} / {'-' if nbytes is None else nbytes}")
    return " | ".join(cells)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.transpose_report", description=__doc__.splitlines()[0])
    p.add_argument("--zoo", nargs="*", default=[], help="zoo models (from the cache), as they are")
    p.add_argument("--nhwc-zoo", nargs="*", default=["mobilenet_v2-legacy", "resnet50-legacy", "efficientnet_b0-legacy"],
                   help="zoo CNNs rewritten channels-last as tf2onnx writes Keras models (models/nhwc.py)")
    p.add_argument("--blocks", nargs="*", type=int, default=[1, 4])
    args = p.parse_args(argv)
    print("model | original: Transposes / elements / bytes | onnxopt | onnxruntime basic")
    for blocks in args.blocks:
        print(row(f"keras_like({blocks} blocks, batch 1, 56x56x32)", keras_like(blocks, 1, 56, 32)))
        print(row(f"keras_like({blocks} blocks, batch N, 56x56x32)", keras_like(blocks, "N", 56, 32)))
    from onnxopt.models import zoo
    from onnxopt.models.nhwc import to_nhwc_style

    for name in args.nhwc_zoo:
        path = zoo.get(name).path()
        if path.exists():
            print(row(f"{name} channels-last (tf2onnx style)", to_nhwc_style(onnx.load(str(path)))))
    for name in args.zoo:
        print(row(name, onnx.load(str(zoo.get(name).path()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
