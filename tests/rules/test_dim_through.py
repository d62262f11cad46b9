"""rules/_attention_parts.dim_through on transformers 4.57's sdpa mask (optimum's exports, issue 30): onnx infers
its And/Expand/Slice as [None] * 4, and the head axis is read through the nodes that made it."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt.ir.shapes import infer
from onnxopt.rules._attention_parts import dim_through


def _mask_model(heads_element: int):
    """``Where(Slice(Expand(And(causal [1, 1, S, T], Reshape(pad, [B, 1, 1, T] computed)), Where(Equal(t, -1),
    1, t)), [..., :keys.shape[2]]), 0, -inf)`` with ``t = Reshape(Concat(B, heads_element, S, T), [-1])``, its
    -1 test ``ConstantOfShape(Shape(t)) * -1`` as torch's expand(-1, ...) exports it."""
    n = helper.make_node
    nodes = [
        n("Shape", ["pad"], ["pad_b"], start=0, end=1), n("Shape", ["pad"], ["pad_t"], start=1, end=2),
        n("Concat", ["pad_b", "one", "one", "pad_t"], ["pad_shape"], axis=0),
        n("Reshape", ["pad", "pad_shape"], ["pad4"]),
        n("And", ["causal", "pad4"], ["both"]),
        n("Shape", ["ids"], ["ids_shape"]), n("Gather", ["ids_shape", "i0"], ["b"], axis=0),
        n("Gather", ["ids_shape", "i1"], ["s"], axis=0), n("Shape", ["causal"], ["c_shape"]),
        n("Gather", ["c_shape", "i3"], ["t"], axis=0),
        n("Unsqueeze", ["b", "ax0"], ["b1"]), n("Unsqueeze", ["s", "ax0"], ["s1"]), n("Unsqueeze", ["t", "ax0"], ["t1"]),
        n("Concat", ["b1", "heads", "s1", "t1"], ["target4"], axis=0),
        n("Reshape", ["target4", "minus_one"], ["flat"]),
        n("Shape", ["flat"], ["flat_shape"]),
        n("ConstantOfShape", ["flat_shape"], ["ones"], value=helper.make_tensor("v", TensorProto.INT64, [1], [1])),
        n("Mul", ["ones", "minus_one"], ["minus_ones"]), n("Equal", ["flat", "minus_ones"], ["is_m1"]),
        n("Where", ["is_m1", "ones", "flat"], ["target"]),
        n("Expand", ["both", "target"], ["expanded"]),
        n("Shape", ["keys"], ["k_shape"]), n("Gather", ["k_shape", "i2"], ["k"], axis=0),
        n("Unsqueeze", ["k", "ax0"], ["k1"]),
        n("Slice", ["expanded", "zero", "k1", "ax3"], ["cut"]),
        n("Where", ["cut", "f0", "finf"], ["mask"]),
    ]
    inits = [init("one", np.array([1], np.int64)), init("i0", np.array(0, np.int64)), init("i1", np.array(1, np.int64)),
             init("i2", np.array(2, np.int64)), init("i3", np.array(3, np.int64)), init("ax0", np.array([0], np.int64)),
             init("ax3", np.array([3], np.int64)), init("zero", np.array([0], np.int64)),
             init("heads", np.array([heads_element], np.int64)), init("minus_one", np.array([-1], np.int64)),
             init("f0", np.array(0, np.float32)), init("finf", np.array(-np.inf, np.float32))]
    inputs = [tinfo("causal", [1, 1, "s", "t"], TensorProto.BOOL), tinfo("pad", ["b", "t"], TensorProto.BOOL),
              tinfo("ids", ["b", "s"], TensorProto.INT64), tinfo("keys", ["b", 2, "t", 4])]
    m = ir.serde.deserialize_model(model(nodes, inputs, [helper.make_tensor_value_info("mask", TensorProto.FLOAT, None)], inits, opset=18))
    return m, next(v for node in m.graph for v in node.outputs if v.name == "mask")


def test_the_sdpa_masks_head_axis_is_read_through_its_makers():
    m, mask = _mask_model(-1)
    shape = infer(mask, m.opset_imports)
    assert shape is None or not isinstance(shape[1], int)  # (inference alone does not say it)
    assert dim_through(mask, 1, m.opset_imports) == 1
    assert str(dim_through(mask, 0, m.opset_imports)) == "b"


def test_an_expand_to_two_heads_is_read_as_two():
    m, mask = _mask_model(2)
    assert dim_through(mask, 1, m.opset_imports) == 2
