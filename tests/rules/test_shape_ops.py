"""rules/shape_ops.py: Reshape, Flatten, Squeeze/Unsqueeze, Transpose, Expand, Slice, Pad, Concat,
Split and Range that change nothing, chains of them, and Reshape targets that can be constants."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import assert_same_outputs
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper, numpy_helper

from onnxopt import optimize

from .check import RULES, _identical, fires, i64, opaque, refuses, run_rule, x_model, zoo_exact

INT64_MAX = np.iinfo(np.int64).max


def _after_neg(op, x_shape, y_shape, consts=(), *, opset=17, **attrs):
    """x -> Neg -> op(n, *consts, **attrs) -> y; ``consts`` are (name, int64 values)
    pairs or initializers. The Neg makes op's input an intermediate value, which can take the
    output's name when the op goes."""
    inits = [c if isinstance(c, onnx.TensorProto) else i64(*c) for c in consts]
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node(op, ["n", *(i.name for i in inits)], ["y"], **attrs)]
    return x_model(nodes, x_shape, y_shape, inits, opset=opset)


# --- Reshape ------------------------------------------------------------------------------------


def _two(first, x_shape, y_shape, s1, s2):
    """x -> Neg -> first(n[, s1]) -> Reshape(., s2) -> y."""
    inits = [i64("s2", s2)] + ([i64("s1", s1)] if s1 is not None else [])
    nodes = [helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node(first, ["n", "s1"] if s1 is not None else ["n"], ["a"]),
             helper.make_node("Reshape", ["a", "s2"], ["y"])]
    return model(nodes, [tinfo("x", x_shape)], [tinfo("y", y_shape)], inits)


def test_reshape_chain_fires():
    out, _ = fires("reshape_chain", _two("Reshape", [2, 6], [3, 4], [12], [3, 4]))
    assert op_types(out) == ["Neg", "Reshape"]


def test_reshape_chain_refuses_an_outer_shape_that_copies_a_dimension():
    refuses("reshape_chain", _two("Reshape", [2, 6], [3, 4], [3, 4], [0, 4]), "copies dimensions (0)")


def test_reshape_flatten_chain_fires():
    out, _ = fires("reshape_flatten_chain", _two("Flatten", [2, 3, 4], [6, 4], None, [6, 4]))
    assert op_types(out) == ["Neg", "Reshape"]


def test_reshape_flatten_chain_refuses_an_outer_shape_that_copies_a_dimension():
    refuses("reshape_flatten_chain", _two("Flatten", [2, 3, 4], [2, 12], None, [0, 12]), "copies dimensions (0)")


@pytest.mark.parametrize("x_shape,target", [([2, 3, 4], [2, -1, 4]), ([2, 3, 4], [0, 3, 4]), ([2, 3, 4], [2, 3, 4]),
                                            (["n", 6, 1, 1], [-1, 6, 1, 1]), (["n", 6, "m"], [-1, 6, 0])],
                         ids=["minus-one", "copy", "same", "symbolic-minus-one", "symbolic-copy"])
def test_reshape_elimination_fires_on_the_shape_x_has(x_shape, target):
    """-1 where x's only dimension that is not a number is: the others are x's, so it is that one."""
    out, _ = fires("reshape_elimination", _after_neg("Reshape", x_shape, x_shape, [("s", target)]))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("x_shape,target,reason", [([2, 6], [3, 4], "shape changes"), ([2, 6], [12], "rank changes"),
                                                   (["n", 6], [2, -1], "input shape not static"),
                                                   ],
                         ids=["shape", "rank", "dynamic"])
def test_reshape_elimination_refuses(x_shape, target, reason):
    y_shape = [3, 4] if target == [3, 4] else [12] if target == [12] else x_shape
    refuses("reshape_elimination", _after_neg("Reshape", x_shape, y_shape, [("s", target)]), reason)


def test_reshape_and_squeeze_pairs():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["b"]),
             helper.make_node("Unsqueeze", ["b", "ax"], ["c"]), helper.make_node("Squeeze", ["c", "ax"], ["y"])]
    m = model(nodes, [tinfo("x", [2, 6])], [tinfo("y", [3, 4])],
              [i64("s1", [12]), i64("s2", [3, 4]), i64("ax", [0])])
    out = optimize(m)
    assert op_types(out) == ["Reshape"]
    assert_same_outputs(m, out, feeds_for(m))


def _own_dims(reshaped="x", x_dims=("n", 3, 4), y_dims=("n", 12)):
    """Reshape(reshaped, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])): x's dim 0 read at run time."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["d0"], axis=0),
             helper.make_node("Unsqueeze", ["d0", "ax"], ["u"]), helper.make_node("Concat", ["u", "m1"], ["t"], axis=0),
             helper.make_node("Reshape", [reshaped, "t"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_dims))]
    if reshaped != "x":
        inputs.append(helper.make_tensor_value_info(reshaped, TensorProto.FLOAT, ["k", 12]))
    return model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_dims))],
                 [i64("i0", 0), i64("ax", [0]), i64("m1", [-1])])


def test_reshape_shape_from_input_fires_on_a_target_of_x_s_own_dims():
    m = _own_dims()
    for b in (3, 1):
        out, _ = fires("reshape_shape_from_input", m, feeds={"x": np.arange(b * 12, dtype=np.float32).reshape(b, 3, 4)})
    assert op_types(out) == ["Reshape"]
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 12]  # the declared 12 stands for the -1


def test_reshape_shape_from_input_refuses_dims_of_another_value():
    m = _own_dims(reshaped="z", y_dims=("n", "m"))
    feeds = {"x": np.zeros((3, 3, 4), np.float32), "z": np.arange(36, dtype=np.float32).reshape(3, 12)}
    refuses("reshape_shape_from_input", m, "not built from constants and the input's own dimensions", feeds=feeds)


def test_reshape_shape_from_input_refuses_a_constant_shape():
    refuses("reshape_shape_from_input", _after_neg("Reshape", [2, 6], [3, 4], [("s", [3, 4])]), "already a constant")


def test_reshape_with_a_dimension_of_another_value_is_kept():
    """Copying x's batch into the shape of a Reshape of a *different* value is not a 0."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["d0"], axis=0),
             helper.make_node("Unsqueeze", ["d0", "ax"], ["u"]),
             helper.make_node("Concat", ["u", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["z", "shape"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["k", 6])
    m = model(nodes, [x, z], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])],
              [i64("i0", 0), i64("ax", [0]), i64("m1", [-1])])
    out = optimize(m)
    assert "Shape" in op_types(out)
    feeds = {"x": np.zeros((3, 2), np.float32), "z": np.arange(36, dtype=np.float32).reshape(6, 6)}
    assert_same_outputs(m, out, feeds)


def test_reshape_shape_from_a_value_with_the_same_symbolic_dims():
    """The attention heads split of a BERT export: the target shape reads batch and sequence
    from another value whose dims are the same symbols; they become 0 (copy)."""
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Shape", ["h"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0), helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["ub"]), helper.make_node("Unsqueeze", ["t", "ax"], ["ut"]),
             helper.make_node("Concat", ["ub", "ut", "heads"], ["shape"], axis=0),
             helper.make_node("MatMul", ["x", "w"], ["q"]),
             helper.make_node("Reshape", ["q", "shape"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 2, 4])],
              [i64("i0", 0), i64("i1", 1), i64("ax", [0]), i64("heads", [2, 4]),
               init("w", np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32))])
    out = optimize(m)
    assert op_types(out) == ["MatMul", "Reshape"]
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[1].input[1]))
    assert shape.tolist() == [0, 0, 2, 4]
    for b, t in ((1, 5), (3, 2)):
        feeds = {"x": np.random.default_rng(b).standard_normal((b, t, 8)).astype(np.float32)}
        assert_same_outputs(m, out, feeds)


def _dynamo_heads(out_dims):
    """x [batch, seq, 8] -> Reshape(x, [dim0 via Shape/Slice/Squeeze/Reshape, -1, 2, 4], allowzero=1)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "z", "one"], ["s0"]),
             helper.make_node("Squeeze", ["s0"], ["b"]),
             helper.make_node("Reshape", ["b", "m1"], ["b1"]),
             helper.make_node("Concat", ["b1", "m1", "two", "four"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    return model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)],
                 [i64("z", [0]), i64("one", [1]), i64("m1", [-1]), i64("two", [2]), i64("four", [4])], opset=18)


def test_dynamo_style_reshape_with_allowzero():
    """The dynamo exporter's view(bsz, -1, heads, dim): dims through Squeeze/Reshape of scalars,
    allowzero=1. The output's declared symbols show the -1 is x's own seq, so the target is all
    copies and constants ([0, 0, 2, 4], allowzero 0): equal results, zero-sized dims included."""
    m = _dynamo_heads(["batch", "seq", 2, 4])
    out = optimize(m)
    assert op_types(out) == ["Reshape"]
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 0, 2, 4]
    for b, t in ((2, 3), (1, 1), (0, 3), (2, 0)):
        feeds = {"x": np.random.default_rng(b).standard_normal((b, t, 8)).astype(np.float32)}
        assert_same_outputs(m, out, feeds)


def test_allowzero_reshape_with_an_unproven_minus_one_is_kept():
    """Without proof that -1 is a copy, 0 and -1 together would change meaning for a zero-sized
    batch under allowzero=0 (onnxruntime accepts them under allowzero=1): the rule refuses."""
    m = _dynamo_heads(["batch", "h", 2, 4])
    out = optimize(m)
    assert "Shape" in op_types(out)
    for b in (2, 0):
        assert_same_outputs(m, out, {"x": np.zeros((b, 3, 8), np.float32)})
    refuses("reshape_shape_from_input", m, "a copied dimension of 0 would change meaning", feeds={"x": np.ones((2, 3, 8), np.float32)})


def test_empty_dim_params_are_not_one_symbol():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i"], ["g"], axis=0),
             helper.make_node("Concat", ["g", "m1"], ["t"], axis=0), helper.make_node("Reshape", ["x", "t"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["", ""])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["", ""])],
              [i64("i", [1]), i64("m1", [-1])])
    out = optimize(m)
    assert_same_outputs(m, out, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_allowzero_reshape_with_minus_one_keeps_its_meaning():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Concat", ["m1", "s"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["y"], allowzero=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", 4])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", 4])], [i64("m1", [-1])],
              opset=18)
    out = optimize(m)
    # the output's symbols prove the -1 is x's own dim 0: all copies, sound for zero-sized dims
    assert op_types(out) == ["Reshape"]
    for shape in ((2, 0, 4), (0, 3, 4), (2, 3, 4)):
        assert_same_outputs(m, out, {"x": np.zeros(shape, np.float32)})


def test_allowzero_minus_one_of_known_size_becomes_that_size():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["ub"]),
             helper.make_node("Concat", ["ub", "m1", "four"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6, 4])],
              [i64("i0", 0), i64("ax", [0]), i64("m1", [-1]), i64("four", [4])], opset=18)
    out = optimize(m)
    assert op_types(out) == ["Reshape"]
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 6, 4]
    for b in (2, 0):
        assert_same_outputs(m, out, {"x": np.ones((b, 3, 8), np.float32)})


# --- Flatten ------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [1, -1])
def test_flatten_elimination_fires_on_a_2d_value(axis):
    out, _ = fires("flatten_elimination", _after_neg("Flatten", [2, 3], [2, 3], axis=axis))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("x_shape,axis,y_shape", [([2, 3, 4], 1, [2, 12]), ([2, 3], 0, [1, 6])], ids=["3-D", "axis-0"])
def test_flatten_elimination_refuses(x_shape, axis, y_shape):
    refuses("flatten_elimination", _after_neg("Flatten", x_shape, y_shape, axis=axis), "not a 2-D input flattened")


# --- Squeeze / Unsqueeze ------------------------------------------------------------------------


def _pair(first, second, x_shape, y_shape, a1, a2, opset=17):
    """x -> Neg -> first(n, a1) -> second(., a2) -> y (axes as inputs from opset 13, else attributes)."""
    def node(op, inp, out, axes, name):
        if axes is None:
            return helper.make_node(op, [inp], [out])
        return helper.make_node(op, [inp, name], [out]) if opset >= 13 else helper.make_node(op, [inp], [out], axes=axes)

    inits = [i64(name, axes) for name, axes in (("a1", a1), ("a2", a2)) if axes is not None and opset >= 13]
    nodes = [helper.make_node("Neg", ["x"], ["n"]), node(first, "n", "u", a1, "a1"), node(second, "u", "y", a2, "a2")]
    return model(nodes, [tinfo("x", x_shape)], [tinfo("y", y_shape)], inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
def test_squeeze_unsqueeze_fires(opset):
    out, _ = fires("squeeze_unsqueeze", _pair("Unsqueeze", "Squeeze", [2, 3], [2, 3], [1], [1], opset=opset))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("a1,a2,reason", [([0], [1], "different axes"), ([-1], [-1], "negative axes")])
def test_squeeze_unsqueeze_refuses(a1, a2, reason):
    refuses("squeeze_unsqueeze", _pair("Unsqueeze", "Squeeze", [1, 3], [1, 3], a1, a2), reason)


def test_unsqueeze_squeeze_fires():
    out, _ = fires("unsqueeze_squeeze", _pair("Squeeze", "Unsqueeze", [1, 3], [1, 3], [0], [0]))
    assert op_types(out) == ["Neg"]


def test_unsqueeze_squeeze_refuses_a_squeeze_without_axes():
    refuses("unsqueeze_squeeze", _pair("Squeeze", "Unsqueeze", [1, 3], [1, 3], None, [0]), "axes not given")


@pytest.mark.parametrize("a1,a2", [([1], [2]), ([0], [0]), ([2], [0]), ([0, 2], [1, -1])])
def test_unsqueeze_chain_merges_with_remapped_axes(a1, a2):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Unsqueeze", ["n", "a1"], ["u"]),
             helper.make_node("Unsqueeze", ["u", "a2"], ["y"])]
    rank = 2 + len(a1) + len(a2)
    m = model(nodes, [tinfo("x", [3, 4])], [tinfo("y", rank)], [i64("a1", a1), i64("a2", a2)])
    out = optimize(m)
    assert op_types(out) == ["Neg", "Unsqueeze"]
    assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("unsqueeze_chain", m)
    assert op_types(out) == ["Neg", "Unsqueeze"]


def test_unsqueeze_chain_fires_before_opset_13():
    out, _ = fires("unsqueeze_chain", _pair("Unsqueeze", "Unsqueeze", [3, 4], [3, 1, 1, 4], [1], [1], opset=11))
    assert [a.ints for a in out.graph.node[1].attribute] == [[1, 2]]


def test_unsqueeze_chain_refuses_an_input_of_unknown_rank():
    nodes = [opaque("x", "h"), helper.make_node("Unsqueeze", ["h", "a1"], ["u"]),
             helper.make_node("Unsqueeze", ["u", "a2"], ["y"])]
    m = x_model(nodes, [3, 4], 4, [i64("a1", [0]), i64("a2", [-1])])
    refuses("unsqueeze_chain", m, "axes or rank unknown")


# --- Expand, Slice, Pad, Concat, Split ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [[1, 3], [3], [2, 1]])
def test_expand_elimination_fires_on_a_shape_x_covers(shape):
    out, _ = fires("expand_elimination", _after_neg("Expand", [2, 3], [2, 3], [("s", shape)]))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("x_shape,shape,y_shape,reason", [([1, 3], [2, 3], [2, 3], "expands"),
                                                          ([2, 3], [1, 2, 3], [1, 2, 3], "raises the rank")],
                         ids=["expands", "rank"])
def test_expand_elimination_refuses(x_shape, shape, y_shape, reason):
    refuses("expand_elimination", _after_neg("Expand", x_shape, y_shape, [("s", shape)]), reason)


@pytest.mark.parametrize("ends,axes", [([INT64_MAX], [1]), ([2, 3], [0, 1]), ([3], [-1])])
def test_slice_elimination_fires_on_a_slice_of_everything(ends, axes):
    m = _after_neg("Slice", [2, 3], [2, 3], [("st", [0] * len(ends)), ("en", ends), ("ax", axes)])
    out, _ = fires("slice_elimination", m)
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("starts,ends,steps,reason", [([0], [2], [1], "cuts the axis"), ([1], [3], [1], "does not start"),
                                                      ([0], [3], [2], "step is not 1")])
def test_slice_elimination_refuses(starts, ends, steps, reason):
    m = _after_neg("Slice", [2, 3], 2, [("st", starts), ("en", ends), ("ax", [1]), ("sp", steps)])
    refuses("slice_elimination", m, reason)


def test_pad_elimination_fires_on_zero_pads():
    out, _ = fires("pad_elimination", _after_neg("Pad", [2, 3], [2, 3], [("p", [0, 0, 0, 0])]))
    assert op_types(out) == ["Neg"]


def test_pad_elimination_refuses_pads():
    refuses("pad_elimination", _after_neg("Pad", [2, 3], [2, 5], [("p", [0, 1, 0, 1])]), "pads")


def test_concat_elimination_fires_on_one_input():
    out, _ = fires("concat_elimination", _after_neg("Concat", [2, 3], [2, 3], axis=0))
    assert op_types(out) == ["Neg"]


def test_concat_elimination_is_refused_where_its_input_cannot_take_the_output_s_name():
    """(Its condition, "more than one input", is never reached: the pattern takes one input.)"""
    m = model([helper.make_node("Concat", ["x"], ["y"], axis=0)], [tinfo("x", [2, 3])], [tinfo("y", [2, 3])])
    refuses("concat_elimination", m, "cannot take its place")


def test_concat_elimination_of_two_inputs_is_a_pattern_mismatch():
    """Its pattern takes one input: a Concat of two never reaches its condition (exact mode's
    guard, rules/_exact.py)."""
    m = x_model([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Concat", ["n", "n"], ["y"], axis=0)],
                [2, 3], [4, 3])
    for exact in (False, True):
        stats = run_rule("concat_elimination", m, exact=exact)[1].rules["concat_elimination"]
        assert stats.matched == 0 and stats.refused == 0 and stats.fired == 0, stats


@pytest.mark.parametrize("opset,split", [(13, [("sp", [3])]), (13, []), (11, [])], ids=["sizes", "no-sizes", "opset11"])
def test_split_elimination_fires_on_one_piece(opset, split):
    out, _ = fires("split_elimination", _after_neg("Split", [2, 3], [2, 3], split, opset=opset, axis=1))
    assert op_types(out) == ["Neg"]


def test_split_elimination_refuses_two_pieces():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Split", ["n", "sp"], ["a", "b"], axis=1)]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("a", [2, 1]), tinfo("b", [2, 2])], [i64("sp", [1, 2])])
    refuses("split_elimination", m, "more than one output")


# --- Range --------------------------------------------------------------------------------------


def _range(start_shape):
    """Range(start, limit, 2) with start a constant of ``start_shape`` and limit an input."""
    nodes = [helper.make_node("Range", ["start", "limit", "delta"], ["y"])]
    return model(nodes, [tinfo("limit", [], TensorProto.INT64)], [tinfo("y", 1, TensorProto.INT64)],
                 [init("start", np.full(start_shape, 3, np.int64)), init("delta", np.array(2, np.int64))])


def test_range_scalar_inputs_fires_on_a_one_element_input():
    out, _ = fires("range_scalar_inputs", _range([1]), feeds={"limit": np.array(11, np.int64)})
    assert op_types(out) == ["Reshape", "Range"]
    scalar = next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1])
    assert list(scalar.dims) == [0]


def test_range_scalar_inputs_refuses_scalars():
    refuses("range_scalar_inputs", _range([]), "inputs are scalars", feeds={"limit": np.array(11, np.int64)})


@pytest.mark.parametrize("x_shape,target,y_shape,axes", [
    ([2, 3], [2, 1, 3, 1], [2, 1, 3, 1], [1, 3]),
    (["n", 6], [-1, 6, 1, 1], ["n", 6, 1, 1], [2, 3]),      # tf2onnx's squeeze-and-excite reshape
    (["n", 6], [0, 1, 1, 6], ["n", 1, 1, 6], [1, 2]),       # the batch copied
    ([1, 6], [1, 1, 6], [1, 1, 6], [1]),                     # x's own 1s: either reading is the same
], ids=["static", "symbolic-minus-one", "symbolic-copy", "ones"])
def test_reshape_to_unsqueeze_fires(x_shape, target, y_shape, axes):
    """The Unsqueeze keeps the batch's symbol (a Reshape with -1 makes a new one)."""
    out, _ = fires("reshape_to_unsqueeze", _after_neg("Reshape", x_shape, y_shape, [("s", target)]))
    assert op_types(out) == ["Neg", "Unsqueeze"]
    unsq = next(n for n in out.graph.node if n.op_type == "Unsqueeze")
    got = next(onnx.numpy_helper.to_array(t) for t in out.graph.initializer if t.name == unsq.input[1])
    assert got.tolist() == axes
    if isinstance(x_shape[0], str):
        assert [d.dim_param or d.dim_value for d in out.graph.output[0].type.tensor_type.shape.dim] == y_shape


@pytest.mark.parametrize("x_shape,target,y_shape,reason", [
    ([2, 3], [3, 2], [3, 2], "does not raise the rank"),
    ([2, 3], [3, 1, 2], [3, 1, 2], "not x's dimensions with 1s between"),
    ([2, 6], [2, 2, 3], [2, 2, 3], "not x's dimensions with 1s between"),
    (["n", 6], [-1, 1, -1], ["n", 1, 6], "more than one -1"),
], ids=["same-rank", "reordered", "split", "two-minus-ones"])
def test_reshape_to_unsqueeze_refuses(x_shape, target, y_shape, reason):
    if target.count(-1) > 1:  # (not a valid Reshape: the rule's guard, on the pattern alone)
        m = _after_neg("Reshape", x_shape, y_shape, [("s", target)])
        out, report = run_rule("reshape_to_unsqueeze", m)
        assert reason in report.rules["reshape_to_unsqueeze"].reasons
        return
    refuses("reshape_to_unsqueeze", _after_neg("Reshape", x_shape, y_shape, [("s", target)]), reason)


# --- Shape vectors read in host memory (onnxruntime's CUDA placement) -----------------------------------
# Each test builds y = Reshape(x, Concat(v, [-1])) (or an Expand) where v picks dimensions of x's Shape,
# and feeds x at several batch and sequence sizes: the picked dimensions are what the output depends on.

X_DIMS = ("b", "s", 8)
SIZES = ((2, 3, 8), (1, 5, 8), (4, 1, 8))


def _sized_feeds(shape, name="x"):
    return {name: np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 3.5}


def _vector_model(vector_nodes, inits=(), *, opset=17, x_dims=X_DIMS, v="v"):
    """x -> vector_nodes (which compute ``v`` from x's Shape) -> y = Reshape(x, Concat(v, [-1]))."""
    nodes = [*vector_nodes, helper.make_node("Concat", [v, "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    return x_model(nodes, list(x_dims), 2 if v == "v" else None, [*inits, i64("minus_one", [-1])], opset=opset)


def _fires_at_every_size(name, m, **kw):
    for shape in SIZES:
        out, report = fires(name, m, feeds=_sized_feeds(shape), **kw)
    return out, report


def _shape_attrs(m: onnx.ModelProto) -> list[dict]:
    return [{a.name: a.i for a in n.attribute} for n in m.graph.node if n.op_type == "Shape"]


def _gather_unsqueeze(k, shape_attrs=None):
    return [helper.make_node("Shape", ["x"], ["s"], **(shape_attrs or {})),
            helper.make_node("Gather", ["s", "k"], ["g"], axis=0), helper.make_node("Unsqueeze", ["g", "ax0"], ["v"])]


@pytest.mark.parametrize("k,picked", [(0, (0, 1)), (1, (1, 2)), (2, (2, 3)), (-1, (2, 3)), (-3, (0, 1))])
def test_shape_dim_unsqueeze_fires(k, picked):
    m = _vector_model(_gather_unsqueeze(k), [i64("k", k), i64("ax0", [0])])
    out, _ = _fires_at_every_size("shape_dim_unsqueeze", m)
    assert op_types(out) == ["Shape", "Concat", "Reshape"]  # (the first Shape and the Gather are dead)
    start, end = picked
    assert _shape_attrs(out) == [{k: v for k, v in (("start", start), ("end", end)) if (k, v) not in (("start", 0), ("end", 3))}]


def test_shape_dim_unsqueeze_reads_a_shape_that_has_start_and_end():
    m = _vector_model(_gather_unsqueeze(-1, {"start": 1}), [i64("k", -1), i64("ax0", [0])])
    out, _ = _fires_at_every_size("shape_dim_unsqueeze", m)
    assert _shape_attrs(out) == [{"start": 2}]


def test_shape_dim_unsqueeze_keeps_a_gather_read_elsewhere():
    """A Gather that also feeds a Range stays for it; the Unsqueeze goes."""
    m = _vector_model([*_gather_unsqueeze(1), helper.make_node("Range", ["zero", "g", "one"], ["r"]),
                       helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
                       helper.make_node("ReduceSum", ["rf"], ["sum"], keepdims=0)],
                      [i64("k", 1), i64("ax0", [0]), i64("zero", 0), i64("one", 1)])
    m.graph.output.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, []))
    out, _ = _fires_at_every_size("shape_dim_unsqueeze", m, depends=False)
    assert "Unsqueeze" not in op_types(out) and "Gather" in op_types(out)


def test_shape_dim_unsqueeze_refuses_before_opset_15():
    m = _vector_model(_gather_unsqueeze(1), [i64("k", 1), i64("ax0", [0])], opset=14)
    refuses("shape_dim_unsqueeze", m, "opset 14 < 15, where Shape takes no start and end", feeds=_sized_feeds((2, 3, 8)))


def test_shape_dim_unsqueeze_refuses_an_input_of_unknown_rank():
    nodes = [opaque("x", "h"), helper.make_node("Shape", ["h"], ["s"]),
             helper.make_node("Gather", ["s", "k"], ["g"], axis=0), helper.make_node("Unsqueeze", ["g", "ax0"], ["v"])]
    m = _vector_model(nodes, [i64("k", 1), i64("ax0", [0])])
    refuses("shape_dim_unsqueeze", m, "rank of the Shape's input is unknown", feeds=_sized_feeds((2, 3, 8)))


def test_shape_dim_unsqueeze_refuses_an_index_out_of_range():
    """Gather fails at run time there; Shape's start and end would clamp instead: not rewritten."""
    m = _vector_model(_gather_unsqueeze(3), [i64("k", 3), i64("ax0", [0])])
    _, report = run_rule("shape_dim_unsqueeze", m)
    st = report.rules["shape_dim_unsqueeze"]
    assert st.fired == 0 and "index 3 is out of range of the 3 dimensions the Shape gives" in st.reasons


def test_shape_dim_unsqueeze_refuses_a_vector_index():
    """Gather(Shape(x), [k]) is already 1-D: its Unsqueeze makes a [1, 1] matrix, not a shape vector."""
    nodes = [*_gather_unsqueeze(1)[:2], helper.make_node("Unsqueeze", ["g", "ax0"], ["u"]),
             helper.make_node("Reshape", ["u", "minus_one"], ["v"])]
    m = _vector_model(nodes, [i64("k", [1]), i64("ax0", [0])])
    refuses("shape_dim_unsqueeze", m, "the Gather's index is not an integer scalar", feeds=_sized_feeds((2, 3, 8)))


def _sym_size(k, opset=18, target=(-1,), squeeze_axes=None):
    """Dynamo's sym_size: Squeeze(Shape(x, k, k+1)), made 1-D by Reshape(., [-1])."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=k, **({"end": k + 1} if k != -1 else {})),
             helper.make_node("Squeeze", ["s", "sq"] if squeeze_axes is not None else ["s"], ["d"]),
             helper.make_node("Reshape", ["d", "t"], ["v"])]
    inits = [i64("t", list(target))] + ([i64("sq", squeeze_axes)] if squeeze_axes is not None else [])
    return _vector_model(nodes, inits, opset=opset)


@pytest.mark.parametrize("k,target,axes", [(0, (-1,), None), (1, (1,), None), (1, (-1,), [0]), (-1, (-1,), None)])
def test_shape_dim_reshape_fires_on_dynamo_sym_size(k, target, axes):
    out, _ = _fires_at_every_size("shape_dim_reshape", _sym_size(k, target=target, squeeze_axes=axes))
    assert op_types(out) == ["Shape", "Concat", "Reshape"]
    start = k % 3
    assert _shape_attrs(out) == [{k: v for k, v in (("start", start), ("end", start + 1)) if (k, v) not in (("start", 0), ("end", 3))}]


def test_shape_dim_reshape_fires_on_a_gather():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "k"], ["g"], axis=0),
             helper.make_node("Reshape", ["g", "t"], ["v"])]
    out, _ = _fires_at_every_size("shape_dim_reshape", _vector_model(nodes, [i64("k", 1), i64("t", [-1])]))
    assert _shape_attrs(out) == [{"start": 1, "end": 2}]


def test_shape_dim_reshape_refuses_a_squeeze_of_two_dimensions():
    """Squeeze of a 2-element vector keeps it: Reshape(Squeeze(Shape(x, 0, 2)), [-1]) is not one dimension."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=0, end=2), helper.make_node("Squeeze", ["s"], ["d"]),
             helper.make_node("Reshape", ["d", "t"], ["v"])]
    refuses("shape_dim_reshape", _vector_model(nodes, [i64("t", [-1])]), "the Squeeze reads 2 dimensions, not one",
            feeds=_sized_feeds((2, 3, 8)))


def test_shape_dim_reshape_refuses_a_target_of_two_dimensions():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2), helper.make_node("Squeeze", ["s"], ["d"]),
             helper.make_node("Reshape", ["d", "t"], ["m"]), helper.make_node("Reshape", ["m", "minus_one"], ["v"])]
    refuses("shape_dim_reshape", _vector_model(nodes, [i64("t", [1, 1])]), "not make the scalar a 1-D vector",
            feeds=_sized_feeds((2, 3, 8)))


def _shape_slice(starts, ends, axes=None, steps=None, *, opset=17, shape_attrs=None):
    names = ["s", "starts", "ends"] + (["axes"] if axes is not None or steps is not None else []) + \
        (["steps"] if steps is not None else [])
    inits = [i64("starts", starts), i64("ends", ends)] + ([i64("axes", axes if axes is not None else [0])]
                                                           if axes is not None or steps is not None else []) + \
        ([i64("steps", steps)] if steps is not None else [])
    nodes = [helper.make_node("Shape", ["x"], ["s"], **(shape_attrs or {})), helper.make_node("Slice", names, ["v"])]
    return _vector_model(nodes, inits, opset=opset)


@pytest.mark.parametrize("starts,ends,axes,steps,picked", [
    ([1], [3], None, None, {"start": 1}), ([-2], [INT64_MAX], None, None, {"start": 1}),
    ([0], [-1], [0], [1], {"end": 2}), ([-100], [1], None, None, {"end": 1}), ([1], [2], [-1], None, {"start": 1, "end": 2})])
def test_shape_slice_to_attributes_fires(starts, ends, axes, steps, picked):
    out, _ = _fires_at_every_size("shape_slice_to_attributes", _shape_slice(starts, ends, axes, steps))
    assert op_types(out) == ["Shape", "Concat", "Reshape"] and _shape_attrs(out) == [picked]


def test_shape_slice_to_attributes_reads_a_shape_that_has_start_and_end():
    out, _ = _fires_at_every_size("shape_slice_to_attributes", _shape_slice([1], [2], shape_attrs={"start": 1}))
    assert _shape_attrs(out) == [{"start": 2}]


@pytest.mark.parametrize("starts,ends,steps,opset,reason", [
    ([0], [3], [2], 17, "step is not 1 (Shape takes no step)"), ([2], [1], None, 17, "the slice is empty"),
    ([1], [3], None, 14, "opset 14 < 15")])
def test_shape_slice_to_attributes_refuses(starts, ends, steps, opset, reason):
    refuses("shape_slice_to_attributes", _shape_slice(starts, ends, steps=steps, opset=opset), reason,
            feeds=_sized_feeds((2, 3, 8)))


def _concat_of(parts, inits=(), *, z=False):
    """v = Concat of Shape(x or z, start, end) pieces ((value, start, end)) and constants (names)."""
    nodes, names = [], []
    for i, p in enumerate(parts):
        if isinstance(p, str):
            names.append(p)
            continue
        value, start, end = p
        attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        nodes.append(helper.make_node("Shape", [value], [f"p{i}"], **attrs))
        names.append(f"p{i}")
    nodes.append(helper.make_node("Concat", names, ["v"], axis=0))
    m = _vector_model(nodes, inits)
    if z:
        m.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["c", "d", 8]))
    return m


def test_shape_concat_merge_fires_on_neighbouring_runs_of_one_shape():
    m = _concat_of([("x", 0, 1), ("x", 1, 2), "eight"], [i64("eight", [8])])
    out, _ = _fires_at_every_size("shape_concat_merge", m)
    assert op_types(out) == ["Shape", "Concat", "Concat", "Reshape"] and _shape_attrs(out) == [{"end": 2}]


def test_shape_concat_merge_leaves_one_shape_where_everything_merges():
    out, _ = _fires_at_every_size("shape_concat_merge", _concat_of([("x", 0, 1), ("x", 1, None)]))
    assert op_types(out) == ["Shape", "Concat", "Reshape"] and _shape_attrs(out) == [{}]


def test_shape_concat_merge_refuses_dimensions_that_are_not_consecutive():
    refuses("shape_concat_merge", _concat_of([("x", 0, 1), ("x", 2, 3)]),
            "no two neighbouring inputs are consecutive dimensions of one Shape", feeds=_sized_feeds((2, 3, 8)))


def test_shape_concat_merge_refuses_dimensions_of_two_values():
    feeds = {**_sized_feeds((2, 3, 8)), "z": np.ones((2, 3, 8), np.float32)}
    refuses("shape_concat_merge", _concat_of([("x", 0, 1), ("z", 1, 2)], z=True), "no two neighbouring", feeds=feeds)


def _expand_model(vector_nodes, inits=(), *, y_dims=("b", None, "s")):
    """x [b, s] -> t = Unsqueeze(x, 1) -> y = Expand(t, target), target from vector_nodes."""
    nodes = [helper.make_node("Unsqueeze", ["x", "ax1"], ["t"]), *vector_nodes,
             helper.make_node("Expand", ["t", "target"], ["y"])]
    return x_model(nodes, ["b", "s"], 3, [*inits, i64("ax1", [1])])


EXPAND_SIZES = ((2, 3), (1, 5), (4, 1))


def _expand_target(source="t"):
    """target = Concat(Shape(source, 0, 1), [3], Shape(source, -1)): [b, 3, s]."""
    return [helper.make_node("Shape", [source], ["b"], end=1), helper.make_node("Shape", [source], ["s"], start=-1),
            helper.make_node("Concat", ["b", "three", "s"], ["target"], axis=0)]


def test_expand_shape_from_input_fires_on_the_value_s_own_dimensions():
    m = _expand_model(_expand_target("t"), [i64("three", [3])])
    for shape in EXPAND_SIZES:
        out, _ = fires("expand_shape_from_input", m,
                       feeds={"x": np.arange(np.prod(shape), dtype=np.float32).reshape(shape)})
    assert op_types(out) == ["Unsqueeze", "Expand"]
    assert run_rule("expand_shape_from_input", m, exact=True)[1].rules["expand_shape_from_input"].fired == 1
    assert onnx.numpy_helper.to_array(out.graph.initializer[-1]).tolist() == [1, 3, 1]


def test_expand_shape_from_input_takes_a_symbol_outside_exact_mode_only():
    """Shape(x) of x [b, s]: t = Unsqueeze(x) has the same symbols b and s at its dims 0 and 2."""
    m = _expand_model(_expand_target("x"), [i64("three", [3])])
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    out, _ = fires("expand_shape_from_input", m, feeds=feeds)
    assert op_types(out) == ["Unsqueeze", "Expand"]
    refuses("expand_shape_from_input", m, "the dimension is another value's with the same symbol", feeds=feeds,
            exact=True)


def test_expand_shape_from_input_refuses_another_value_s_dimension():
    nodes = _expand_target("t")
    nodes[0] = helper.make_node("Shape", ["z"], ["b"], end=1)
    m = _expand_model(nodes, [i64("three", [3])])
    m.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["c"]))
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "z": np.zeros(2, np.float32)}
    refuses("expand_shape_from_input", m, "element 0 of the shape is not the expanded value's own dimension", feeds=feeds)


# --- the Shape-vector rules on the zoo's transformer exports ---------------------------------------

SHAPE_VECTOR_RULES = ("shape_dim_unsqueeze", "shape_dim_reshape", "shape_slice_to_attributes", "shape_concat_merge",
                      "expand_shape_from_input")
# what fires on each export in exact mode (legacy: Gather/Unsqueeze; dynamo: sym_size and Slices of Shape; the
# Expand targets read other values' dims of the same symbol: tests/test_advice.py sees that one fire)
_LEGACY = {"shape_dim_unsqueeze", "shape_concat_merge"}
_DYNAMO = {"shape_dim_reshape", "shape_slice_to_attributes", "shape_concat_merge"}
ZOO_FIRES = {"bert-legacy": _LEGACY, "gpt2-legacy": _LEGACY | {"shape_slice_to_attributes"},  # (GPT-2's Conv1D views)
             "bert-dynamo": _DYNAMO, "gpt2-dynamo": _DYNAMO}


@pytest.mark.parametrize("name", ["bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo"])
def test_shape_vector_rules_are_exact_on_zoo_transformers(name):
    """The rules alone in exact mode: the model gives the original's bits under onnxruntime's defaults at 1 and 2 threads, at three
    batch and sequence sizes (the dimensions the rewritten Shapes read)."""
    from . import zoo_cases

    src = zoo_cases.load(name)
    rules = [RULES[n] for n in SHAPE_VECTOR_RULES]
    out, report = optimize(src, rules=rules, exact=True, return_report=True)
    assert {n for n in SHAPE_VECTOR_RULES if report.fired.get(n)} == ZOO_FIRES[name], report.fired
    a, b = src.SerializeToString(), out.SerializeToString()
    for batch, seq in ((2, 16), (1, 7), (3, 5)):
        feeds = zoo_cases.feeds(name, src, batch, seq)
        for threads in (1, 2):
            for x, y in zip(zoo_exact.outputs(a, feeds, threads), zoo_exact.outputs(b, feeds, threads), strict=True):
                assert _identical(x, y), (name, batch, seq, threads)


def _range_model(scalar_nodes, inits=(), *, opset=17, start=0, delta=1, reader="lookup"):
    """x [b, s, 8] -> n (scalar_nodes: a dimension of x) -> positions = Range(start, n, delta), read as
    ``reader``: "lookup" (y = x + table[positions], GPT-2's position embedding), "norm" (the same sum
    normalized and read by nothing else: an embedding LayerNormalization's), "sum" (y = x + the sum of
    the positions: index arithmetic such as the attention mask's)."""
    nodes = [*scalar_nodes, helper.make_node("Range", ["start", "n", "delta"], ["r"])]
    rng = np.random.default_rng(0)
    consts = [i64("start", start), i64("delta", delta)]
    if reader == "sum":
        nodes += [helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
                  helper.make_node("ReduceSum", ["rf"], ["total"], keepdims=0), helper.make_node("Add", ["x", "total"], ["y"])]
    else:
        nodes += [helper.make_node("Unsqueeze", ["r", "ax0"], ["pos"]), helper.make_node("Gather", ["table", "pos"], ["emb"]),
                  helper.make_node("Add", ["x", "emb"], ["y" if reader == "lookup" else "sum"])]
        consts += [i64("ax0", [0]), init("table", rng.standard_normal((16, 8)).astype(np.float32))]
        if reader == "norm":
            nodes.append(helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1))
            consts += [init("gamma", np.ones(8, np.float32)), init("beta", np.zeros(8, np.float32))]
    return x_model(nodes, list(X_DIMS), 3, [*inits, *consts], opset=opset)


_GATHER_DIM = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "k"], ["n"], axis=0)]
_SYM_SIZE = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2), helper.make_node("Squeeze", ["s"], ["n"])]


@pytest.mark.parametrize("scalar_nodes,inits", [(_GATHER_DIM, [i64("k", 1)]), (_SYM_SIZE, [])], ids=["gather", "sym_size"])
def test_range_of_dim_fires_on_position_ids_on_ort_cuda(scalar_nodes, inits):
    """Range(0, s, 1) read as GPT-2's position ids, computed on the device."""
    out, _ = _fires_at_every_size("range_of_dim", _range_model(scalar_nodes, inits), target="ort-cuda")
    assert op_types(out) == ["Shape", "ConstantOfShape", "CumSum", "Unsqueeze", "Gather", "Add"]
    assert _shape_attrs(out) == [{"start": 1, "end": 2}]


def test_range_of_dim_is_for_ort_cuda_only():
    out, report = run_rule("range_of_dim", _range_model(_GATHER_DIM, [i64("k", 1)]), target="ort-cpu")
    assert "Range" in op_types(out) and not report.fired.get("range_of_dim")


@pytest.mark.parametrize("reader,reason", [
    ("sum", "index arithmetic (the attention mask's) that its fusion reads as a Range"),
    ("norm", "the position ids of an embedding LayerNormalization (its fusion reads the Range)")])
def test_range_of_dim_leaves_the_mask_s_and_an_embedding_normalization_s_ranges(reader, reason):
    m = _range_model(_GATHER_DIM, [i64("k", 1)], reader=reader)
    refuses("range_of_dim", m, reason, feeds=_sized_feeds((2, 4, 8)), target="ort-cuda")


@pytest.mark.parametrize("start,delta,reason", [(1, 1, "start is not the int64 scalar 0"),
                                                (0, 2, "delta is not the int64 scalar 1")])
def test_range_of_dim_refuses_other_counts(start, delta, reason):
    _, report = run_rule("range_of_dim", _range_model(_GATHER_DIM, [i64("k", 1)], start=start, delta=delta),
                         target="ort-cuda")
    st = report.rules["range_of_dim"]
    assert st.fired == 0 and reason in st.reasons, st.reasons


def test_range_of_dim_refuses_before_opset_15():
    refuses("range_of_dim", _range_model(_GATHER_DIM, [i64("k", 1)], opset=14), "opset 14 < 15",
            feeds=_sized_feeds((2, 4, 8)), target="ort-cuda")


def test_view_back_to_the_rows_of_the_ids_becomes_a_constant_target():
    """GPT-2 legacy's last view, ``h.view(-1, S, C)`` with S read from the ids' Shape, takes a constant target
    when h's rows are provably the ids' (Gather of the view [-1, S] of the ids, then ops that keep the leading
    dimensions: here LayerNormalization, a MatMul by a 2-D weight and an Add of a 1-D bias), so no Concat of
    a Shape is left for the CPU; a Transpose on the way (rows no longer the ids') keeps the Concat."""
    def model(transpose: bool):
        nodes = [
            helper.make_node("Shape", ["ids"], ["s1"], start=1, end=2),
            helper.make_node("Concat", ["m1", "s1"], ["view"], axis=0),
            helper.make_node("Reshape", ["ids", "view"], ["ids2"]),
            helper.make_node("Gather", ["table", "ids2"], ["e"], axis=0),
            helper.make_node("LayerNormalization", ["e", "g", "bb"], ["n"], axis=-1),
            helper.make_node("MatMul", ["n", "w"], ["h0"]),
            helper.make_node("Add", ["h0", "bias"], ["h1"]),
        ]
        last = "h1"
        if transpose:
            nodes.append(helper.make_node("Transpose", ["h1"], ["h2"], perm=[1, 0, 2]))
            last = "h2"
        nodes += [helper.make_node("Concat", ["m1", "s1", "c"], ["target"], axis=0),
                  helper.make_node("Reshape", [last, "target"], ["y"])]
        rng = np.random.default_rng(0)
        inits = [numpy_helper.from_array(np.array([-1], np.int64), "m1"),
                 numpy_helper.from_array(np.array([6], np.int64), "c"),
                 numpy_helper.from_array(rng.standard_normal((20, 6)).astype(np.float32), "table"),
                 numpy_helper.from_array(np.ones(6, np.float32), "g"), numpy_helper.from_array(np.zeros(6, np.float32), "bb"),
                 numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32), "w"),
                 numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "bias")]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 6])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)

    from onnxopt import optimize

    src = model(False)
    out, rep = optimize(src, target="ort-cuda", return_report=True)
    assert not [n for n in out.graph.node if n.op_type == "Concat"], [n.op_type for n in out.graph.node]
    a = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in ((2, 5), (1, 9), (3, 1)):
        ids = np.random.default_rng(1).integers(0, 20, shape).astype(np.int64)
        np.testing.assert_allclose(a.run(None, {"ids": ids})[0], b.run(None, {"ids": ids})[0], rtol=1e-6, atol=1e-6)
    kept, _ = optimize(model(True), target="ort-cuda", return_report=True)
    assert [n for n in kept.graph.node if n.op_type == "Concat"]
