"""Constant folding, control flow, CSE, algebraic rules and shape completion, each checked with
onnxruntime before and after, and each condition shown refusing where the rewrite would be wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize


def _i64(name, values):
    return init(name, np.array(values, dtype=np.int64))


# --- constant folding --------------------------------------------------------------------------


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


def test_random_ops_never_fold():
    nodes = [helper.make_node("RandomNormalLike", ["c"], ["r"], seed=1.0),
             helper.make_node("Add", ["x", "r"], ["y"])]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("c", np.zeros(3, np.float32))])
    out = optimize(m)
    assert "RandomNormalLike" in op_types(out)


def test_fold_size_limit_keeps_model_from_growing():
    # Expand of a scalar to 1 MiB + 4 bytes: over the limit, and it frees only 4 bytes
    nodes = [helper.make_node("Expand", ["c", "shape"], ["big"]), helper.make_node("Add", ["x", "big"], ["y"])]
    n = (1 << 18) + 1
    m = model(nodes, [tinfo("x", [n])], [tinfo("y", [n])], [init("c", np.float32(1)), _i64("shape", [n])])
    out, report = optimize(m, return_report=True)
    assert "Expand" in op_types(out)
    assert any("size limit" in r for r in report.rules["constant_folding"].reasons)
    out2 = optimize(m, fold_size_limit=8 << 20)
    assert "Expand" not in op_types(out2)
    assert_same_outputs(m, out2, feeds_for(m))


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
              [_i64("i0", 0), _i64("i1", 1), _i64("i2", 2), _i64("ax", [0])])
    out = optimize(m)
    assert op_types(out) == ["Reshape"]  # [0, 20]: batch copied at run time
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 20]
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 4, 5)).astype(np.float32)}
        assert_same_outputs(m, out, feeds)


# --- control flow ------------------------------------------------------------------------------


def _branch(name, op, const):
    return helper.make_graph([helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"])], name, [],
                             [tinfo(f"{name}_y", [3])], [init(f"{name}_c", np.float32(const))])


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_constant_condition_is_inlined(cond):
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=_branch("then", "Add", 1.0),
                              else_branch=_branch("else", "Mul", 3.0))]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("cond", np.array(cond))])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == (["Add"] if cond else ["Mul"])
    assert report.fired["if_constant_condition"] == 1
    assert [o.name for o in out.graph.output] == ["y"]
    assert_same_outputs(m, out, feeds_for(m))


def test_if_on_input_condition_is_kept():
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=_branch("then", "Add", 1.0),
                              else_branch=_branch("else", "Mul", 3.0))]
    m = model(nodes, [tinfo("x", [3]), tinfo("cond", [], TensorProto.BOOL)], [tinfo("y", [3])])
    assert op_types(optimize(m)) == ["If"]


# --- CSE and initializer de-duplication --------------------------------------------------------


def test_cse_and_duplicate_initializers():
    w = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]),
             helper.make_node("MatMul", ["x", "w2"], ["b"]),  # same weights, stored twice
             helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Add", ["ra", "rb"], ["y"])]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3])], [init("w1", w), init("w2", w.copy())])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["MatMul", "Relu", "Add"]
    assert len(out.graph.initializer) == 1
    assert report.fired["initializer_deduplication"] == 1
    assert report.fired["common_subexpression_elimination"] == 2
    assert_same_outputs(m, out, feeds_for(m))


def test_cse_never_merges_random_ops():
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["a"]), helper.make_node("RandomUniformLike", ["x"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"])]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])])
    assert op_types(optimize(m)).count("RandomUniformLike") == 2


# --- algebra -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mid,removed", [(TensorProto.DOUBLE, True), (TensorProto.FLOAT16, False),
                                         (TensorProto.INT32, False)])
def test_cast_round_trip_only_when_exact(mid, removed):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Cast", ["n"], ["a"], to=mid),
             helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT), helper.make_node("Neg", ["b"], ["y"])]
    m = model(nodes, [tinfo("x", [5])], [tinfo("y", [5])])
    out = optimize(m)
    assert op_types(out) == (["Neg", "Neg"] if removed else ["Neg", "Cast", "Cast", "Neg"])
    feeds = {"x": np.array([0.1, 1e-8, 70000.0, -3.7, 2.5], dtype=np.float32)}
    assert_same_outputs(m, out, feeds, rtol=0, atol=0)


@pytest.mark.parametrize("c,rewritten", [(4.0, True), (0.25, True), (3.0, False), (0.0, False)])
def test_div_to_mul_only_when_reciprocal_is_exact(c, rewritten):
    m = model([helper.make_node("Div", ["x", "c"], ["y"])], [tinfo("x", [4])], [tinfo("y", [4])],
              [init("c", np.float32(c))])
    out = optimize(m)
    assert op_types(out) == (["Mul"] if rewritten else ["Div"])
    feeds = {"x": np.array([1.0, -3.3, 1e-38, 7e37], dtype=np.float32)}
    if c != 0:
        assert_same_outputs(m, out, feeds, rtol=0, atol=0)


def test_neutral_elements_and_broadcast_refusal():
    nodes = [helper.make_node("Mul", ["x", "one"], ["a"]), helper.make_node("Add", ["a", "zero"], ["b"]),
             helper.make_node("Mul", ["b", "ones_big"], ["y"])]  # 1s of a larger shape: broadcasts
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [2, 3])],
              [init("one", np.float32(1)), init("zero", np.float32(-0.0)),  # x + -0.0 is x, -0.0 included
               init("ones_big", np.ones((2, 3), np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Mul"]
    assert_same_outputs(m, out, feeds_for(m))


def test_transpose_pair_cancels_and_merges():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["b"], ["c"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["c"], ["y"], perm=[2, 0, 1])]
    m = model(nodes, [tinfo("x", [2, 3, 4])], [tinfo("y", [4, 3, 2])])
    out = optimize(m)
    assert op_types(out) == ["Transpose"]
    assert_same_outputs(m, out, feeds_for(m))


def test_reshape_and_squeeze_pairs():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["b"]),
             helper.make_node("Unsqueeze", ["b", "ax"], ["c"]), helper.make_node("Squeeze", ["c", "ax"], ["y"])]
    m = model(nodes, [tinfo("x", [2, 6])], [tinfo("y", [3, 4])],
              [_i64("s1", [12]), _i64("s2", [3, 4]), _i64("ax", [0])])
    out = optimize(m)
    assert op_types(out) == ["Reshape"]
    assert_same_outputs(m, out, feeds_for(m))


def test_pow_two_becomes_mul_but_not_in_a_layer_norm():
    nodes = [helper.make_node("Pow", ["x", "two"], ["y"]),
             helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["z"], axes=[-1])]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3]), tinfo("z", [2, 1])], [init("two", np.float32(2))],
              opset=17)
    out = optimize(m)
    assert sorted(op_types(out)) == ["Mul", "Pow", "ReduceMean"]
    assert_same_outputs(m, out, feeds_for(m))


def test_matmul_add_to_gemm_only_for_2d():
    rng = np.random.default_rng(1)
    w, c = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Add", ["a", "c"], ["y"]),
             helper.make_node("MatMul", ["x3", "w"], ["a3"]), helper.make_node("Add", ["a3", "c"], ["y3"])]
    m = model(nodes, [tinfo("x", [2, 3]), tinfo("x3", [5, 2, 3])], [tinfo("y", [2, 4]), tinfo("y3", [5, 2, 4])],
              [init("w", w), init("c", c)])
    out = optimize(m)
    assert sorted(op_types(out)) == ["Add", "Gemm", "MatMul"]
    assert_same_outputs(m, out, feeds_for(m))


def test_conv_absorbs_per_channel_mul_add_and_pad():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
             helper.make_node("Conv", ["p", "w"], ["c"]),
             helper.make_node("Mul", ["c", "scale"], ["m"]),
             helper.make_node("Add", ["m", "shift"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 8, 8])],
              [_i64("pads", [0, 0, 1, 1, 0, 0, 1, 1]), init("w", w),
               init("scale", rng.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)),
               init("shift", rng.standard_normal((4, 1, 1)).astype(np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Conv"]
    assert list(next(a for a in out.graph.node[0].attribute if a.name == "pads").ints) == [1, 1, 1, 1]
    assert_same_outputs(m, out, feeds_for(m), rtol=1e-5, atol=1e-5)


def test_conv_mul_refuses_a_spatial_constant():
    w = np.ones((2, 1, 1, 1), np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 1, 2, 2])], [tinfo("y", [1, 2, 2, 2])],
              [init("w", w), init("s", np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2))])
    out = optimize(m)
    assert op_types(out) == ["Conv", "Mul"]


def test_sequence_at_of_split_to_sequence_becomes_one_split():
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "i0"], ["a"]),
             helper.make_node("SequenceAt", ["seq", "i2"], ["b"]),
             helper.make_node("SequenceAt", ["seq", "im1"], ["c"]),
             helper.make_node("Sum", ["a", "b"], ["y"]), helper.make_node("Neg", ["c"], ["z"])]
    m = model(nodes, [tinfo("x", [2, 6])], [tinfo("y", [2, 2]), tinfo("z", [2, 2])],
              [_i64("split", [2, 2, 2]), _i64("i0", 0), _i64("i2", 2), _i64("im1", -1)])
    out = optimize(m)
    assert sorted(op_types(out)) == ["Neg", "Split", "Sum"]
    assert_same_outputs(m, out, feeds_for(m))


def test_reshape_with_a_dimension_of_another_value_is_kept():
    """Copying x's batch into the shape of a Reshape of a *different* value is not a 0."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["d0"], axis=0),
             helper.make_node("Unsqueeze", ["d0", "ax"], ["u"]),
             helper.make_node("Concat", ["u", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["z", "shape"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["k", 6])
    m = model(nodes, [x, z], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])],
              [_i64("i0", 0), _i64("ax", [0]), _i64("m1", [-1])])
    out = optimize(m)
    assert "Shape" in op_types(out)
    feeds = {"x": np.zeros((3, 2), np.float32), "z": np.arange(36, dtype=np.float32).reshape(6, 6)}
    assert_same_outputs(m, out, feeds)


# --- shape completion --------------------------------------------------------------------------


def test_shape_completion_informs_rules_but_output_records_only_declared_shapes():
    """Inferred shapes guide the rules; the output records only what the input declared (inferred
    value_info lets onnxruntime fuse SkipLayerNormalization, slower on CPU than what it replaces)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Add", ["a", "x"], ["b"]),
             helper.make_node("Neg", ["b"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])
    m = model(nodes, [x], [y])
    out, report = optimize(m, return_report=True)
    assert report.rules["shape_completion"].matched >= 2  # a and b got shapes for the rules
    assert list(out.graph.value_info) == []
    declared = model(nodes, [x], [y])
    declared.graph.value_info.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", 8]))
    kept = optimize(declared)
    assert [(v.name, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in kept.graph.value_info] \
        == [("a", ["batch", "seq", 8])]
    assert_same_outputs(m, out, feeds_for(m))


def test_declared_value_info_survives_as_declared():
    """A value declared with a type only keeps its type (and gets no inferred shape); a declared
    value that a rule replaces with a new node's output keeps its value_info there (the same
    tensor, under the same name)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Pow", ["a", "two"], ["p"]),
             helper.make_node("Neg", ["p"], ["c"]), helper.make_node("Cast", ["c"], ["d"], to=TensorProto.FLOAT),
             helper.make_node("Abs", ["d"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
              [init("two", np.float32(2.0))])
    m.graph.value_info.extend([helper.make_tensor_value_info("a", TensorProto.FLOAT, None),  # type only
                               helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 8])])
    out = optimize(m)
    assert op_types(out) == ["Relu", "Mul", "Neg", "Abs"]  # Pow(a, 2) is a*a; the no-op Cast is gone
    assert out.graph.node[1].output[0] == "p"
    infos = {v.name: v.type.tensor_type for v in out.graph.value_info}
    assert set(infos) == {"a", "p"}
    assert infos["a"].elem_type == TensorProto.FLOAT and not infos["a"].HasField("shape")
    assert [d.dim_param or d.dim_value for d in infos["p"].shape.dim] == ["batch", 8]
    assert_same_outputs(m, out, feeds_for(m))


def test_optimized_model_runs_with_ort_optimizations():
    """Complete shapes must never make onnxruntime's own optimizer reject the model."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Add", ["a", "x"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])
    out = optimize(m)
    feeds = {"x": np.ones((3, 8), np.float32)}
    np.testing.assert_array_equal(run_ort(out, feeds, optimize=True)[0], run_ort(m, feeds)[0])


@pytest.mark.parametrize("a1,a2", [([1], [2]), ([0], [0]), ([2], [0]), ([0, 2], [1, -1])])
def test_unsqueeze_chain_merges_with_remapped_axes(a1, a2):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Unsqueeze", ["n", "a1"], ["u"]),
             helper.make_node("Unsqueeze", ["u", "a2"], ["y"])]
    rank = 2 + len(a1) + len(a2)
    m = model(nodes, [tinfo("x", [3, 4])], [tinfo("y", rank)], [_i64("a1", a1), _i64("a2", a2)])
    out = optimize(m)
    assert op_types(out) == ["Neg", "Unsqueeze"]
    assert_same_outputs(m, out, feeds_for(m))


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
              [_i64("i0", 0), _i64("i1", 1), _i64("ax", [0]), _i64("heads", [2, 4]),
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
                 [_i64("z", [0]), _i64("one", [1]), _i64("m1", [-1]), _i64("two", [2]), _i64("four", [4])], opset=18)


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


def test_overridable_input_default_is_never_taken_for_a_constant():
    """An initializer that is also a graph input is a default the caller may override: shape
    inference's data propagation must not see its value, so nothing derived from it folds."""
    n = 40
    nodes = [helper.make_node("Reshape", ["x", "shp"], ["r0"])]
    for i in range(n):  # enough nodes that shape completion runs over the whole graph
        nodes.append(helper.make_node("Sin" if i % 2 else "Cos", [f"r{i}"], [f"r{i + 1}"]))
    nodes.append(helper.make_node("Shape", [f"r{n}"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    shp = helper.make_tensor_value_info("shp", TensorProto.INT64, [2])
    m = model(nodes, [x, shp], [helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
              [_i64("shp", [4, 300])])
    out = optimize(m)
    assert "Shape" in op_types(out)
    feeds = {"x": np.zeros(1200, np.float32), "shp": np.array([6, 200], np.int64)}
    assert run_ort(out, feeds)[0].tolist() == [6, 200] == run_ort(m, feeds)[0].tolist()
    assert [d.dim_value for d in out.graph.input[1].type.tensor_type.shape.dim] == [2]


# --- review regressions ------------------------------------------------------------------------


@pytest.mark.parametrize("disable", [[], ["shape_slice_folding"]])
def test_slice_of_shape_clamps_like_onnx_for_negative_steps(disable):
    """Slice(Shape(x), -10, -20, step -1): ONNX clamps the start to 0 and picks [A]; Python's
    slice would pick nothing."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "st", "en", "ax", "sp"], ["t"]),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 1, 1])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a"])],
              [_i64("st", [-10]), _i64("en", [-20]), _i64("ax", [0]), _i64("sp", [-1])])
    out = optimize(m, disable=disable)
    for a in (6, 1):
        assert_same_outputs(m, out, {"x": np.arange(a, dtype=np.float32).reshape(a, 1, 1)})


def test_empty_dim_params_are_not_one_symbol():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i"], ["g"], axis=0),
             helper.make_node("Concat", ["g", "m1"], ["t"], axis=0), helper.make_node("Reshape", ["x", "t"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["", ""])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["", ""])],
              [_i64("i", [1]), _i64("m1", [-1])])
    out = optimize(m)
    assert_same_outputs(m, out, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_inlined_branch_keeps_a_local_function_overload():
    f_nodes = [helper.make_node("Neg", ["a"], ["b"])]
    fa = onnx.helper.make_function("local", "F", ["a"], ["b"], f_nodes, [helper.make_opsetid("", 17)], overload="a")
    fb = onnx.helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                                   [helper.make_opsetid("", 17)], overload="b")
    call = helper.make_node("F", ["x"], ["t_y"], domain="local")
    call.overload = "b"
    then = helper.make_graph([call], "then", [], [tinfo("t_y", [3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e_y"])], "else", [], [tinfo("e_y", [3])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                          [tinfo("x", [3])], [tinfo("y", [3])], [init("c", np.array(True))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          ir_version=10, functions=[fa, fb])
    out = optimize(m)
    assert [(n.op_type, n.overload) for n in out.graph.node] == [("F", "b")]
    assert_same_outputs(m, out, {"x": np.array([-1.0, 0.5, 2.0], np.float32)})


def test_scalar_split_with_keepdims_0_is_left_alone():
    """The spec ignores keepdims when split is given; onnxruntime squeezes for a scalar split."""
    nodes = [helper.make_node("SplitToSequence", ["x", "one"], ["seq"], axis=0, keepdims=0),
             helper.make_node("SequenceAt", ["seq", "i0"], ["y"])]
    m = model(nodes, [tinfo("x", [3, 4])], [tinfo("y", [4])], [_i64("one", 1), _i64("i0", 0)])
    out = optimize(m)
    assert "SplitToSequence" in op_types(out)
    assert_same_outputs(m, out, feeds_for(m))


def test_allowzero_reshape_with_minus_one_keeps_its_meaning():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Concat", ["m1", "s"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["y"], allowzero=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", 4])
    m = model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", 4])], [_i64("m1", [-1])],
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
              [_i64("i0", 0), _i64("ax", [0]), _i64("m1", [-1]), _i64("four", [4])], opset=18)
    out = optimize(m)
    assert op_types(out) == ["Reshape"]
    shape = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1]))
    assert shape.tolist() == [0, 6, 4]
    for b in (2, 0):
        assert_same_outputs(m, out, {"x": np.ones((b, 3, 8), np.float32)})


@pytest.mark.parametrize("s,e,a,st", [([-10], [-20], [0], [-1]), ([-1], [-1000], [1], [-1]), ([5], [0], [-1], [-2]),
                                      ([1, 0], [3, 2], [2, 0], [1, 1])])
def test_constant_slice_folds_with_onnx_clamping(s, e, a, st):
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    nodes = [helper.make_node("Slice", ["d", "s", "e", "a", "st"], ["sl"]), helper.make_node("Neg", ["sl"], ["y"])]
    m = model(nodes, [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
              [init("d", data), _i64("s", s), _i64("e", e), _i64("a", a), _i64("st", st)])
    out = optimize(m, check=False)
    assert "Slice" not in op_types(out)
    np.testing.assert_array_equal(run_ort(out, {})[0], run_ort(m, {})[0])


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


def _conv1d(trans_b=0, alpha=1.0, bias_shape=(6,), last=6, lead_from="x"):
    """GPT-2's Conv1D as the legacy exporter writes it: Reshape(x, [-1, K]) -> Gemm(W, c) ->
    Reshape to x.shape[:-1] + [N], the leading dims read through Shape/Gather/Unsqueeze/Concat."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 4) if trans_b else (4, 6)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Shape", [lead_from if lead_from != "x" else "h"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0), helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["ub"]), helper.make_node("Unsqueeze", ["t", "ax"], ["ut"]),
             helper.make_node("Concat", ["ub", "ut", "n"], ["size_out"], axis=0),
             helper.make_node("Reshape", ["h", "flat"], ["h2"]),
             helper.make_node("Gemm", ["h2", "w", "c"], ["g"], transB=trans_b, alpha=alpha),
             helper.make_node("Reshape", ["g", "size_out"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])]
    if lead_from != "x":
        inputs.append(helper.make_tensor_value_info(lead_from, TensorProto.FLOAT, ["b2", "s2", 4]))
    return model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", last])],
                 [_i64("i0", 0), _i64("i1", 1), _i64("ax", [0]), _i64("n", [last]), _i64("flat", [-1, 4]),
                  init("w", w), init("c", rng.standard_normal(bias_shape).astype(np.float32))])


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias_shape", [(6,), (1, 6)])
def test_gemm_on_flattened_rows_becomes_matmul(trans_b, bias_shape):
    m = _conv1d(trans_b=trans_b, bias_shape=bias_shape)
    out = optimize(m)
    assert op_types(out) == ["Relu", "MatMul", "Add"]
    for b, t in ((1, 5), (3, 2)):
        feeds = {"x": np.random.default_rng(b).standard_normal((b, t, 4)).astype(np.float32)}
        assert_same_outputs(m, out, feeds, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(alpha=0.5), dict(bias_shape=(3, 6)), dict(last=3), dict(lead_from="other")],
                         ids=["alpha", "bias-per-row", "wrong-N", "dims-of-another-value"])
def test_gemm_on_flattened_rows_kept_when_not_provably_a_linear_layer(kw):
    m = _conv1d(**kw)
    out = optimize(m)
    assert "Gemm" in op_types(out)
