"""NHWC graphs as tf2onnx writes Keras models: Transposes around every Conv (tf2onnx's own
optimizer off), for the transpose-optimization tests and scripts/transpose_report.py.

``keras_like(blocks, batch, size, c)``: x (NHWC) -> [T -> Conv 3x3 -> T] -> Relu, then ``blocks``
residual blocks (Relu -> [T -> Conv 1x1 -> T] -> Add -> Mul by a channels-last constant ->
[T -> Conv 3x3 -> T] -> Sigmoid), then ReduceMean over H, W (global pooling, NHWC) -> y [batch, c].
``batch`` may be a name (a symbolic dimension).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NHWC_TO_NCHW = [0, 3, 1, 2]
NCHW_TO_NHWC = [0, 2, 3, 1]


def keras_like(blocks: int = 1, batch: int | str = 1, size: int = 16, c: int = 8, seed: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes: list = []
    inits: list = []

    def init(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))

    def conv(x, y, name, cin, cout, k):
        init(f"{name}.w", (rng.standard_normal((cout, cin, k, k)) * (1.0 / np.sqrt(cin * k * k))).astype(np.float32))
        init(f"{name}.b", (rng.standard_normal(cout) * 0.1).astype(np.float32))
        nodes.extend([helper.make_node("Transpose", [x], [f"{name}.in"], perm=NHWC_TO_NCHW),
                      helper.make_node("Conv", [f"{name}.in", f"{name}.w", f"{name}.b"], [f"{name}.out"],
                                       pads=[k // 2] * 4),
                      helper.make_node("Transpose", [f"{name}.out"], [y], perm=NCHW_TO_NHWC)])

    conv("x", "stem", "stem", 3, c, 3)
    h = "stem"
    for i in range(blocks):
        nodes.append(helper.make_node("Relu", [h], [f"b{i}.r"]))
        conv(f"b{i}.r", f"b{i}.c1", f"b{i}.conv1", c, c, 1)
        nodes.append(helper.make_node("Add", [f"b{i}.r", f"b{i}.c1"], [f"b{i}.a"]))
        init(f"b{i}.gamma", rng.uniform(0.5, 1.5, c).astype(np.float32))
        nodes.append(helper.make_node("Mul", [f"b{i}.a", f"b{i}.gamma"], [f"b{i}.m"]))
        conv(f"b{i}.m", f"b{i}.c2", f"b{i}.conv2", c, c, 3)
        nodes.append(helper.make_node("Sigmoid", [f"b{i}.c2"], [f"b{i}.s"]))
        h = f"b{i}.s"
    init("hw", np.array([1, 2], np.int64))
    nodes.append(helper.make_node("ReduceMean", [h, "hw"], ["y"], keepdims=0))
    graph = helper.make_graph(nodes, "keras_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   [batch, size, size, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
