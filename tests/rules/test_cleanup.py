"""rules/cleanup.py: Identity and inference Dropout removal, checked with onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_outputs
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import fires, refuses


def test_identity_chain_removed():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Identity", ["a"], ["b"], name="id1"),
             helper.make_node("Identity", ["b"], ["c"], name="id2"),
             helper.make_node("Neg", ["c"], ["y"], name="neg")]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3])])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Relu", "Neg"]
    assert report.fired == {"identity_elimination": 2}
    assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("identity_elimination", m, times=2)
    assert op_types(out) == ["Relu", "Neg"]


def test_identity_feeding_graph_output_keeps_output_name():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Identity", ["a"], ["y"], name="id")]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3])])
    out = optimize(m)
    assert op_types(out) == ["Relu"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert out.graph.node[0].output == ["y"]
    assert_same_outputs(m, out, feeds_for(m))


def test_identity_from_graph_input_to_graph_output_is_kept():
    """Removing it would make the output name disappear (input and output would be one value)."""
    m = model([helper.make_node("Identity", ["x"], ["y"], name="id")], [tinfo("x", [2])], [tinfo("y", [2])])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Identity"]
    assert report.rules["identity_elimination"].refused == 1
    assert_same_outputs(m, out, feeds_for(m))


def test_identity_of_initializer_to_output_is_kept():
    m = model([helper.make_node("Identity", ["c"], ["y"], name="id")], [], [tinfo("y", [3])],
              [init("c", np.arange(3, dtype=np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Identity"]
    assert_same_outputs(m, out, {})


def test_two_identities_of_one_value_to_two_outputs():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Identity", ["a"], ["y1"], name="id1"),
             helper.make_node("Identity", ["a"], ["y2"], name="id2")]
    m = model(nodes, [tinfo("x", [2])], [tinfo("y1", [2]), tinfo("y2", [2])])
    out = optimize(m)
    assert [o.name for o in out.graph.output] == ["y1", "y2"]
    assert op_types(out).count("Identity") == 1  # one output can take over 'a', the other cannot
    assert_same_outputs(m, out, feeds_for(m))


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 17])
def test_inference_dropout_removed(opset):
    inputs = ["a"] if opset < 12 else ["a", "ratio"]
    inits = [] if opset < 12 else [init("ratio", np.array(0.3, dtype=np.float32))]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Dropout", inputs, ["d"], name="drop", **({"ratio": 0.3} if opset < 12 else {})),
             helper.make_node("Neg", ["d"], ["y"], name="neg")]
    m = model(nodes, [tinfo("x", [4, 5])], [tinfo("y", [4, 5])], inits, opset=opset)
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Relu", "Neg"]
    assert report.fired == {"dropout_elimination": 1}
    assert "ratio" not in {i.name for i in out.graph.initializer}  # unused initializer removed
    assert_same_outputs(m, out, feeds_for(m))
    fires("dropout_elimination", m)


def test_dropout_with_constant_false_training_mode_removed():
    nodes = [helper.make_node("Dropout", ["x", "ratio", "train"], ["d"], name="drop"),
             helper.make_node("Neg", ["d"], ["y"], name="neg")]
    m = model(nodes, [tinfo("x", [4, 5])], [tinfo("y", [4, 5])],
              [init("ratio", np.array(0.5, dtype=np.float32)), init("train", np.array(False))], opset=13)
    out = optimize(m)
    assert op_types(out) == ["Neg"]
    assert_same_outputs(m, out, feeds_for(m))


def test_dropout_in_training_mode_kept():
    nodes = [helper.make_node("Dropout", ["x", "ratio", "train"], ["y"], name="drop")]
    m = model(nodes, [tinfo("x", [4, 5]), tinfo("train", [], TensorProto.BOOL)], [tinfo("y", [4, 5])],
              [init("ratio", np.array(0.5, dtype=np.float32))], opset=13)
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Dropout"]
    assert "training_mode is not a constant" in report.rules["dropout_elimination"].reasons
    refuses("dropout_elimination", m, "training_mode is not a constant", feeds={**feeds_for(m), "train": np.array(False)})


def test_dropout_with_used_mask_kept():
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"], name="drop")]
    m = model(nodes, [tinfo("x", [4, 5])], [tinfo("y", [4, 5]), tinfo("mask", [4, 5], TensorProto.BOOL)], opset=13)
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Dropout"]
    assert "the mask output is used" in report.rules["dropout_elimination"].reasons
    refuses("dropout_elimination", m, "the mask output is used")
