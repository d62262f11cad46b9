"""rules/_head_layouts.py: what the attention fusions read about the values between a projection and its heads."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from helpers import init, model, tinfo
from onnx import helper

from onnxopt.rules._head_layouts import ancestors


def _packed(axes):
    """h [b, s, 64] -> MatMul (qkv, 96 wide) -> Slice [0:64) on ``axes``: Phi-3's q of its packed projection."""
    nodes = [helper.make_node("MatMul", ["h", "w"], ["qkv"]),
             helper.make_node("Slice", ["qkv", "zero", "end", "axes"], ["q"])]
    inits = [init("w", np.zeros((64, 96), np.float32)), init("zero", np.array([0], np.int64)),
             init("end", np.array([64], np.int64)), init("axes", np.array(axes, np.int64))]
    return ir.from_proto(model(nodes, [tinfo("h", ["b", "s", 64])], [tinfo("q", ["b", "s", 64])], inits, opset=18))


def test_ancestors_go_through_a_slice_of_the_last_axis():
    """A packed projection's part has the projection's first two dimensions, so a Reshape reading the
    projected hidden state's batch and length (transformers' view(*input_shape, -1, head_dim)) reads the heads'."""
    m = _packed([-1])
    q = m.graph.outputs[0]
    assert [v.name for v in ancestors(q, m.opset_imports)] == ["q", "qkv", "h"]


def test_ancestors_stop_at_a_slice_of_another_axis():
    m = _packed([1])
    q = m.graph.outputs[0]
    assert [v.name for v in ancestors(q, m.opset_imports)] == ["q"]
