"""NHWC graphs as tf2onnx writes Keras models: Transposes around every Conv (tf2onnx's own
optimizer off), for the transpose-optimization tests and scripts/oracles/transpose_report.py.

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


_LAYOUT_FREE = frozenset("Relu Clip Add Sub Mul Div Sigmoid HardSigmoid HardSwish Tanh LeakyRelu Neg Identity".split())


def to_nhwc_style(m: onnx.ModelProto) -> onnx.ModelProto:
    """``m`` (NCHW, rank-4 activations) rewritten as tf2onnx writes a Keras model: its rank-4 graph
    inputs channels-last, every rank-4 activation NHWC, and a Transpose to NCHW before (and back
    after) each op that is not element-wise with scalar constants (Conv, pooling, BatchNormalization,
    a per-channel Mul...). Its outputs must not be rank 4 (classifiers). Same outputs as ``m`` on
    inputs transposed to NHWC."""
    inferred = onnx.shape_inference.infer_shapes(m)
    g = inferred.graph
    rank = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.tensor_type.HasField("shape"):
            rank[vi.name] = len(vi.type.tensor_type.shape.dim)
    consts = {i.name: i for i in g.initializer}
    nhwc: set[str] = set()
    to_nchw: dict[str, str] = {}
    nodes = []
    inputs = []
    for vi in g.input:
        if vi.name in consts:
            continue
        if rank.get(vi.name) == 4:
            dims = list(vi.type.tensor_type.shape.dim)
            shape = [d.dim_value or d.dim_param for d in (dims[0], dims[2], dims[3], dims[1])]
            inputs.append(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, shape))
            nhwc.add(vi.name)
        else:
            inputs.append(vi)
    for node in g.node:
        acts = [i for i in node.input if i and i not in consts]
        scalar_consts = all(int(np.prod(consts[i].dims)) == 1 for i in node.input if i in consts)
        if node.op_type in _LAYOUT_FREE and scalar_consts and all(a in nhwc for a in acts) and acts:
            nodes.append(node)
            nhwc.update(o for o in node.output if rank.get(o) == 4)
            continue
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for k, name in enumerate(new.input):
            if name in nhwc:
                if name not in to_nchw:
                    to_nchw[name] = f"{name}__nchw"
                    nodes.append(helper.make_node("Transpose", [name], [to_nchw[name]], perm=NHWC_TO_NCHW))
                new.input[k] = to_nchw[name]
        after = []
        for k, name in enumerate(new.output):
            if rank.get(name) == 4:
                new.output[k] = f"{name}__nchw_out"
                after.append(helper.make_node("Transpose", [new.output[k]], [name], perm=NCHW_TO_NHWC))
                nhwc.add(name)
        nodes.append(new)
        nodes.extend(after)
    if any(o.name in nhwc for o in g.output):
        raise ValueError("to_nhwc_style: a rank-4 graph output")
    graph = helper.make_graph(nodes, g.name, inputs, list(m.graph.output), list(g.initializer))
    out = helper.make_model(graph, opset_imports=list(m.opset_import), ir_version=m.ir_version)
    return out
