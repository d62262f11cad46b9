"""rules/folding.py: Constant nodes become initializers, nodes of constants are evaluated, and the
shape arithmetic exporters write folds where the dimensions it reads are static.

(How values are evaluated, and what is never folded, is tests/test_folding.py's: onnxopt.ir.evaluate.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import fires, i64, refuses


# --- Constant nodes -------------------------------------------------------------------------------


def test_constants_lift_without_the_pass_too():
    """With constant_lifting disabled the rule does the same, one node at a time."""
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    nodes = [helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w)),
             helper.make_node("Constant", [], ["k"], value_floats=[1.0, 2.0, 3.0]),
             helper.make_node("Add", ["x", "k"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")]
    m = model(nodes, [tinfo("x", [4, 3])], [tinfo("y", [4, 2])])
    for disable, fired in (([], "constant_lifting"), (["constant_lifting"], "constant_to_initializer")):
        out, report = optimize(m, disable=disable, return_report=True)
        assert op_types(out) == ["Add", "MatMul"] and report.fired[fired] == 2
        assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("constant_to_initializer", m, times=2)
    assert op_types(out) == ["Add", "MatMul"]


def test_constant_to_initializer_refuses_strings():
    nodes = [helper.make_node("Constant", [], ["s"], value_strings=["a", "b"]), helper.make_node("Neg", ["x"], ["y"])]
    m = model(nodes, [tinfo("x", [2])], [tinfo("y", [2]), tinfo("s", [2], TensorProto.STRING)])
    refuses("constant_to_initializer", m, "string")


# --- general folding ------------------------------------------------------------------------------


def test_constant_nodes_and_constant_subgraph_fold():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w)),
             helper.make_node("Transpose", ["w"], ["wt"]),
             helper.make_node("Mul", ["wt", "two"], ["w2"]),
             helper.make_node("MatMul", ["x", "w2"], ["y"])]
    m = model(nodes, [tinfo("x", [4, 3])], [tinfo("y", [4, 2])], [init("two", np.float32(2))])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["MatMul"]
    assert report.fired["constant_lifting"] == 1 and report.fired["constant_folding"] == 2
    folded = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    np.testing.assert_array_equal(folded, w.T * 2)
    assert_same_outputs(m, out, feeds_for(m))


def test_constant_folding_fires_on_a_node_of_constants():
    nodes = [helper.make_node("Mul", ["a", "b"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])],
              [init("a", np.array([1.5, -2.0, 3e38], np.float32)), init("b", np.array([2.0, 0.1, 10.0], np.float32))])
    out, _ = fires("constant_folding", m)
    assert op_types(out) == ["Add"]


def test_random_ops_never_fold():
    nodes = [helper.make_node("RandomNormalLike", ["c"], ["r"], seed=1.0),
             helper.make_node("Add", ["x", "r"], ["y"])]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("c", np.zeros(3, np.float32))])
    out = optimize(m)
    assert "RandomNormalLike" in op_types(out)
    refuses("constant_folding", m, "RandomNormalLike is never folded")


def test_fold_size_limit_keeps_model_from_growing():
    # Expand of a scalar to 1 MiB + 4 bytes: over the limit, and it frees only 4 bytes
    nodes = [helper.make_node("Expand", ["c", "shape"], ["big"]), helper.make_node("Add", ["x", "big"], ["y"])]
    n = (1 << 18) + 1
    m = model(nodes, [tinfo("x", [n])], [tinfo("y", [n])], [init("c", np.float32(1)), i64("shape", [n])])
    out, report = optimize(m, return_report=True)
    assert "Expand" in op_types(out)
    assert any("size limit" in r for r in report.rules["constant_folding"].reasons)
    out2 = optimize(m, fold_size_limit=8 << 20)
    assert "Expand" not in op_types(out2)
    assert_same_outputs(m, out2, feeds_for(m))
    refuses("constant_folding", m, "size limit")


@pytest.mark.parametrize("s,e,a,st", [([-10], [-20], [0], [-1]), ([-1], [-1000], [1], [-1]), ([5], [0], [-1], [-2]),
                                      ([1, 0], [3, 2], [2, 0], [1, 1])])
def test_constant_slice_folds_with_onnx_clamping(s, e, a, st):
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    nodes = [helper.make_node("Slice", ["d", "s", "e", "a", "st"], ["sl"]), helper.make_node("Neg", ["sl"], ["y"])]
    m = model(nodes, [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
              [init("d", data), i64("s", s), i64("e", e), i64("a", a), i64("st", st)])
    out = optimize(m, check=False)
    assert "Slice" not in op_types(out)
    np.testing.assert_array_equal(run_ort(out, {})[0], run_ort(m, {})[0])


# --- shapes -----------------------------------------------------------------------------------------


def test_shape_chain_folds_static_dims_and_keeps_dynamic_ones():
    """The exporters' Shape -> Gather -> Unsqueeze -> Concat -> Reshape: the static dims fold,
    the dynamic batch stays a run-time value."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["d0"], axis=0),
             helper.make_node("Gather", ["s", "i1"], ["d1"], axis=0),
             helper.make_node("Gather", ["s", "i2"], ["d2"], axis=0),
             helper.make_node("Mul", ["d1", "d2"], ["d12"]),
             helper.make_node("Unsqueeze", ["d0", "ax"], ["u0"]),
             helper.make_node("Unsqueeze", ["d12", "ax"], ["u1"]),
             helper.make_node("Concat", ["u0", "u1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 5])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 20])],
              [i64("i0", 0), i64("i1", 1), i64("i2", 2), i64("ax", [0])])
    out = optimize(m)
    assert op_types(out) == ["Reshape"]  # [0, 20]: batch copied at run time
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 20]
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 4, 5)).astype(np.float32)}
        assert_same_outputs(m, out, feeds)


def _read_dims(op, z_dims, consts=()):
    """y = k + op(Shape(z), *consts): the dimensions of z, read at run time, added to the input k
    (so that the outputs depend on an input; z's values do not matter)."""
    reads = [helper.make_node(op, ["z"], ["d"])] if op in ("Shape", "Size") else [
        helper.make_node("Shape", ["z"], ["s"]), helper.make_node(op, ["s", *(c.name for c in consts)], ["d"])]
    inputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, z_dims), tinfo("k", [1], TensorProto.INT64)]
    return model([*reads, helper.make_node("Add", ["k", "d"], ["y"])], inputs, [tinfo("y", 1, TensorProto.INT64)],
                 list(consts))


@pytest.mark.parametrize("rule,op,consts,y", [
    ("shape_folding", "Shape", (), [2, 3, 4]),
    ("size_folding", "Size", (), [24]),
    ("shape_gather_folding", "Gather", ("i", [1, 2]), [3, 4]),
    ("shape_slice_folding", "Slice", ("st", [1], "en", [3]), [3, 4]),
])
def test_shape_folding_fires_on_static_dimensions(rule, op, consts, y):
    consts = [i64(consts[i], consts[i + 1]) for i in range(0, len(consts), 2)]
    dims = [2, 3, 4] if rule in ("shape_folding", "size_folding") else ["n", 3, 4]
    m = _read_dims(op, dims, consts)
    feeds = {"z": np.zeros((2, 3, 4), np.float32), "k": np.array([10], np.int64)}
    out, _ = fires(rule, m, feeds=feeds)
    assert op_types(out) == ["Add"]
    assert run_ort(out, feeds)[0].tolist() == [10 + d for d in y]


@pytest.mark.parametrize("rule,op,consts,reason", [
    ("shape_folding", "Shape", (), "the shape has dynamic dimensions"),
    ("size_folding", "Size", (), "the shape is not static"),
    ("shape_gather_folding", "Gather", ("i", [0, 2]), "a picked dimension is dynamic"),
    ("shape_slice_folding", "Slice", ("st", [0], "en", [2]), "a sliced dimension is dynamic"),
])
def test_shape_folding_refuses_dynamic_dimensions(rule, op, consts, reason):
    consts = [i64(consts[i], consts[i + 1]) for i in range(0, len(consts), 2)]
    m = _read_dims(op, ["n", 3, 4], consts)
    refuses(rule, m, reason, feeds={"z": np.zeros((2, 3, 4), np.float32), "k": np.array([10], np.int64)})


@pytest.mark.parametrize("disable", [[], ["shape_slice_folding"]])
def test_slice_of_shape_clamps_like_onnx_for_negative_steps(disable):
    """Slice(Shape(x), -10, -20, step -1): ONNX clamps the start to 0 and picks [A]; Python's
    slice would pick nothing."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "st", "en", "ax", "sp"], ["t"]),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 1, 1])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a"])],
              [i64("st", [-10]), i64("en", [-20]), i64("ax", [0]), i64("sp", [-1])])
    out = optimize(m, disable=disable)
    for a in (6, 1):
        assert_same_outputs(m, out, {"x": np.arange(a, dtype=np.float32).reshape(a, 1, 1)})
