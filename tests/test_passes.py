"""Whole-graph passes and dead-code removal: what may be merged or removed (onnxopt.core.purity),
initializer deduplication's cost, and shape completion (shapes for the rules, not for the output)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt.library import passes
from onnxopt import Op, Rule, optimize
from onnxopt.ir.util import remove_unused
from onnxopt.core.purity import Purity

FOO = "com.example"


def _custom_model(nodes, outputs, functions=(), domains=(FOO,), inits=()):
    m = model(nodes, [tinfo("x", [4])], [tinfo(o, [4]) for o in outputs], inits)
    m.opset_import.extend(helper.make_opsetid(d, 1) for d in domains)
    m.functions.extend(functions)
    return m


def _count(m: onnx.ModelProto, op_type: str) -> int:
    return op_types(m).count(op_type)


# --- common-subexpression elimination ------------------------------------------------------


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


def test_cse_keeps_the_declared_type_of_a_graph_output_it_merges():
    # the late twin is a graph output: the early one takes its name, and must take its declared
    # type and shape too (the output was written without a type, which onnx's checker refuses)
    nodes = [helper.make_node("Sigmoid", ["x"], ["t1"], name="s1"),
             helper.make_node("ReduceSum", ["t1"], ["s"], name="sum"),
             helper.make_node("Sigmoid", ["x"], ["t2"], name="s2")]
    m = model(nodes, [tinfo("x", [8])], [tinfo("s", [1]), tinfo("t2", [8])])
    out, report = optimize(m, return_report=True)
    assert report.fired["common_subexpression_elimination"] == 1
    assert [o.name for o in out.graph.output] == ["s", "t2"]
    assert out.graph.output[1].type == m.graph.output[1].type
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(m, out, feeds_for(m))


def test_cse_never_merges_random_ops():
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["a"]), helper.make_node("RandomUniformLike", ["x"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"])]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])])
    assert op_types(optimize(m)).count("RandomUniformLike") == 2


def test_dropouts_whose_training_mode_is_an_input_are_not_merged():
    """Two Dropouts with a training_mode the caller sets draw two masks when it is true."""
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["a"], name="d1"),
             helper.make_node("Dropout", ["x", "ratio", "training"], ["b"], name="d2"),
             helper.make_node("Sub", ["a", "b"], ["y"], name="sub")]
    m = model(nodes, [tinfo("x", [1000]), tinfo("training", [], TensorProto.BOOL)], [tinfo("y", [1000])],
              [init("ratio", np.array(0.5, np.float32))])
    out = optimize(m)
    assert _count(out, "Dropout") == 2
    feeds = {"x": np.ones(1000, np.float32), "training": np.array(True)}
    assert np.abs(run_ort(m, feeds)[0]).max() > 0  # two masks differ
    assert np.abs(run_ort(out, feeds)[0]).max() > 0


def _noise_function(name="Noise", draws=True):
    body = [helper.make_node("RandomUniformLike" if draws else "Relu", ["a"], ["r"]),
            helper.make_node("Add", ["a", "r"], ["b"])]
    return helper.make_function("local", name, ["a"], ["b"], body, [helper.make_opsetid("", 17)])


def _two_calls(function):
    nodes = [helper.make_node(function.name, ["x"], ["n1"], domain="local", name="call1"),
             helper.make_node(function.name, ["x"], ["n2"], domain="local", name="call2"),
             helper.make_node("Sub", ["n1", "n2"], ["y"], name="sub")]
    return _custom_model(nodes, ["y"], [function], domains=("local",))


def test_calls_of_a_function_that_draws_random_numbers_are_not_merged():
    m = _two_calls(_noise_function(draws=True))
    out = optimize(m)
    assert _count(out, "Noise") == 2
    feeds = {"x": np.zeros(4, np.float32)}
    assert np.abs(run_ort(m, feeds)[0]).max() > 0
    assert np.abs(run_ort(out, feeds)[0]).max() > 0


def test_calls_of_a_pure_function_are_merged():
    m = _two_calls(_noise_function(draws=False))
    out, report = optimize(m, return_report=True)
    assert report.fired.get("common_subexpression_elimination") == 1
    assert _count(out, "Noise") == 1
    assert_same_outputs(m, out, {"x": np.arange(-2, 2, dtype=np.float32)})


def test_a_call_of_a_function_that_calls_a_random_one_is_not_merged():
    inner = _noise_function("Inner", draws=True)
    outer = helper.make_function("local", "Outer", ["a"], ["b"],
                                 [helper.make_node("Inner", ["a"], ["b"], domain="local")],
                                 [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    m = _two_calls(outer)
    m.functions.append(inner)
    assert _count(optimize(m), "Outer") == 2


@pytest.mark.parametrize("inputs", [["x"], []], ids=["Foo(x)", "Gen()"])
def test_ops_of_an_unknown_domain_are_not_merged(inputs):
    nodes = [helper.make_node("Foo", inputs, ["a"], domain=FOO, name="foo1"),
             helper.make_node("Foo", inputs, ["b"], domain=FOO, name="foo2"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    out = optimize(_custom_model(nodes, ["y"]))
    assert _count(out, "Foo") == 2


def test_listed_microsoft_ops_are_merged_and_others_are_not():
    nodes = [helper.make_node("FusedMatMul", ["x", "w"], ["a"], domain="com.microsoft", name="fmm1", alpha=2.0),
             helper.make_node("FusedMatMul", ["x", "w"], ["b"], domain="com.microsoft", name="fmm2", alpha=2.0),
             helper.make_node("Sub", ["a", "b"], ["y"], name="sub")]
    x = tinfo("x", [2, 4])
    m = model(nodes, [x], [tinfo("y", [2, 4])], [init("w", np.eye(4, dtype=np.float32))])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out = optimize(m)
    assert _count(out, "FusedMatMul") == 1
    assert_same_outputs(m, out, {"x": np.ones((2, 4), np.float32)})
    # a random contrib op, an unlisted one, and Attention writing its cache in place stay twice
    for op_type, attrs in (("BiasDropout", {}), ("GroupQueryAttention", {}),
                           ("Attention", {"past_present_share_buffer": 1})):
        nodes = [helper.make_node(op_type, ["x"], [o], domain="com.microsoft", name=o, **attrs) for o in "ab"]
        nodes.append(helper.make_node("Add", ["a", "b"], ["y"], name="add"))
        out = optimize(_custom_model(nodes, ["y"], domains=("com.microsoft",)))
        assert _count(out, op_type) == 2, op_type


# --- dead-code removal --------------------------------------------------------------------------


def test_an_unused_node_of_an_unknown_domain_is_kept():
    nodes = [helper.make_node("Log", ["x"], ["logged"], domain=FOO, name="log"),  # may write somewhere
             helper.make_node("Relu", ["x"], ["y"], name="relu")]
    out = optimize(_custom_model(nodes, ["y"]))
    assert op_types(out) == ["Log", "Relu"]


def test_a_producer_left_unused_by_a_rewrite_is_kept_when_it_may_have_effects():
    to_zero = Rule("relu_to_zero", Op("Relu", "v"), lambda m, b: b.const(np.zeros(4, np.float32), "zero"))
    for op_type, domain, kept in (("Foo", FOO, True), ("RandomNormalLike", "", False)):
        nodes = [helper.make_node(op_type, ["x"], ["f"], domain=domain, name="producer"),
                 helper.make_node("Relu", ["f"], ["y"], name="relu")]
        out = optimize(_custom_model(nodes, ["y"]), rules=[to_zero])
        # a random op nobody reads goes: it changes no result (see onnxopt.core.purity)
        assert op_types(out) == ([op_type] if kept else []), op_type


def test_unused_nodes_in_function_bodies_and_subgraphs_follow_the_same_rule():
    body = [helper.make_node("Log", ["a"], ["unused1"], domain=FOO),
            helper.make_node("Neg", ["a"], ["unused2"]),
            helper.make_node("Relu", ["a"], ["b"])]
    function = helper.make_function("local", "F", ["a"], ["b"], body,
                                    [helper.make_opsetid("", 17), helper.make_opsetid(FOO, 1)])
    branch = helper.make_graph([helper.make_node("Log", ["x"], ["unused3"], domain=FOO),
                                helper.make_node("Neg", ["x"], ["unused4"]),
                                helper.make_node("Relu", ["x"], ["r"])], "then", [], [tinfo("r", [4])])
    nodes = [helper.make_node("F", ["x"], ["f"], domain="local", name="call"),
             helper.make_node("If", ["cond"], ["i"], name="if", then_branch=branch, else_branch=branch),
             helper.make_node("Add", ["f", "i"], ["y"], name="add")]
    m = model(nodes, [tinfo("x", [4]), tinfo("cond", [], TensorProto.BOOL)], [tinfo("y", [4])])
    m.opset_import.extend([helper.make_opsetid("local", 1), helper.make_opsetid(FOO, 1)])
    m.functions.append(function)
    irm = ir.from_proto(m)
    assert remove_unused(irm, Purity(irm).removable) == 3  # Neg in the function body and in both branches
    assert [n.op_type for n in irm.functions[("local", "F", "")]] == ["Log", "Relu"]
    if_node = next(n for n in irm.graph if n.op_type == "If")
    for attr in if_node.attributes.values():
        assert [n.op_type for n in attr.as_graph()] == ["Log", "Relu"]


# --- constant folding -------------------------------------------------------------------------


def test_a_training_mode_dropout_of_constants_is_not_folded():
    """Folded, its random mask would be drawn once and frozen into the model."""
    nodes = [helper.make_node("Dropout", ["c", "ratio", "training"], ["d"], name="drop"),
             helper.make_node("Add", ["x", "d"], ["y"], name="add")]
    m = model(nodes, [tinfo("x", [1000])], [tinfo("y", [1000])],
              [init("c", np.ones(1000, np.float32)), init("ratio", np.array(0.5, np.float32)),
               init("training", np.array(True))])
    out, report = optimize(m, return_report=True)
    assert "constant_folding" not in report.fired
    assert op_types(out) == ["Dropout", "Add"]
    feeds = {"x": np.zeros(1000, np.float32)}
    assert not np.array_equal(run_ort(out, feeds)[0], run_ort(out, feeds)[0])  # a new mask each run


# --- initializer deduplication ------------------------------------------------------------------


def test_deduplication_compares_look_alikes_a_bounded_number_of_times(monkeypatch):
    """Tensors whose strided samples agree (one-hot masks differing between the sampled bytes)
    were compared with every earlier look-alike: n^2 / 2 full comparisons. Now each is hashed
    once, and only tensors with equal hashes are compared; equal ones are still merged."""
    compared = collections.Counter()
    real = np.array_equal

    def array_equal(a, b, *args, **kw):
        compared["calls"] += 1
        return real(a, b, *args, **kw)

    monkeypatch.setattr(np, "array_equal", array_equal)
    for n in (500, 2000):
        compared.clear()
        inits, nodes = [], []
        for i in range(n):
            mask = np.zeros(4096, np.float32)
            mask[(2 * i + 1) % 4096] = 1.0  # odd positions: never among the sampled bytes
            inits.append(init(f"w{i}", mask))
            nodes.append(helper.make_node("Mul", [f"t{i}" if i else "x", f"w{i}"], [f"t{i + 1}"], name=f"mul{i}"))
        inits.append(init("copy", onnx.numpy_helper.to_array(inits[7])))  # one true duplicate
        nodes.append(helper.make_node("Mul", [f"t{n}", "copy"], ["y"], name="last"))
        irm = ir.from_proto(model(nodes, [tinfo("x", [4096])], [tinfo("y", [4096])], inits))
        assert passes.deduplicate_initializers(irm) == 1
        assert "copy" not in irm.graph.initializers
        assert compared["calls"] <= 2, (n, compared)


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
              [init("shp", np.array([4, 300], np.int64))])
    out = optimize(m)
    assert "Shape" in op_types(out)
    feeds = {"x": np.zeros(1200, np.float32), "shp": np.array([6, 200], np.int64)}
    assert run_ort(out, feeds)[0].tolist() == [6, 200] == run_ort(m, feeds)[0].tolist()
    assert [d.dim_value for d in out.graph.input[1].type.tensor_type.shape.dim] == [2]


def test_graphs_walks_what_onnx_irs_graphs_does_in_its_order():
    # onnxopt.ir.util.graphs replaces onnx_ir's Model.graphs() (a generic traversal, ~2x slower):
    # the same graphs, the same order, nested If branches included
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from onnxopt.ir.util import graphs

    def body(k):
        return helper.make_graph([helper.make_node("Identity", ["x"], [f"o{k}"])], f"b{k}", [],
                                 [helper.make_tensor_value_info(f"o{k}", TensorProto.FLOAT, [1])])

    inner = helper.make_node("If", ["c"], ["y"], then_branch=body(1), else_branch=body(2))
    then = helper.make_graph([inner, helper.make_node("Identity", ["y"], ["z"])], "t", [],
                             [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("If", ["c"], ["r"], then_branch=then, else_branch=body(3)),
             helper.make_node("Relu", ["x"], ["u"]),
             helper.make_node("If", ["c"], ["r2"], then_branch=body(4), else_branch=body(5))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                       helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("r", "u", "r2")])
    m = ir.serde.deserialize_model(helper.make_model(g))
    ours = list(graphs(m))
    assert [x.name for x in ours] == [x.name for x in m.graphs()] and len(ours) == 7
    assert all(a is b for a, b in zip(ours, m.graphs()))
