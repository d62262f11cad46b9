"""rules/transpose.py (Transpose pairs, the identity, size-1-only Transposes as Reshape) and the pass
``transpose_optimization`` (onnxopt/transforms/transposes.py: Transposes pushed through layout-agnostic ops by a
cost in elements moved), each checked with onnxruntime CPU before and after."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_same_outputs
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

import onnx_ir as ir

from onnxopt import optimize
from onnxopt.models.nhwc import keras_like
from onnxopt.transforms.transposes import Cost, graph_cost, numel, plan_chain
from onnxopt.ir.shapes import opsets_of

from .check import fires, i64, opaque, refuses, same_outputs, x_model

NCHW_TO_NHWC = [0, 2, 3, 1]
NHWC_TO_NCHW = [0, 3, 1, 2]


def _after_neg(op, x_shape, y_shape, consts=(), *, opset=17, **attrs):
    inits = [c if isinstance(c, onnx.TensorProto) else i64(*c) for c in consts]
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node(op, ["n", *(i.name for i in inits)], ["y"], **attrs)]
    return x_model(nodes, x_shape, y_shape, inits, opset=opset)


# --- the rules ------------------------------------------------------------------------------------


def test_transpose_pair_cancels_and_merges():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["b"], ["c"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["c"], ["y"], perm=[2, 0, 1])]
    m = model(nodes, [tinfo("x", [2, 3, 4])], [tinfo("y", [4, 3, 2])])
    out = optimize(m)
    assert op_types(out) == ["Transpose"]
    assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("transpose_pair", m, times=2)  # the first pair cancels, the second merges
    assert op_types(out) == ["Transpose"]


def _transposes(inner, outer, hide=False):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), *([opaque("n", "h")] if hide else []),
             helper.make_node("Transpose", ["h" if hide else "n"], ["a"], **({"perm": inner} if inner else {})),
             helper.make_node("Transpose", ["a"], ["y"], **({"perm": outer} if outer else {}))]
    return x_model(nodes, [2, 3, 4], 3)


def test_transpose_pair_fires_without_perms():
    out, _ = fires("transpose_pair", _transposes(None, [1, 0, 2]))  # the default reverses the axes
    assert op_types(out) == ["Neg", "Transpose"]


def test_transpose_pair_refuses_a_default_perm_of_unknown_rank():
    refuses("transpose_pair", _transposes(None, [1, 0, 2], hide=True), "rank unknown")


def test_transpose_elimination_fires_on_the_identity_permutation():
    out, _ = fires("transpose_elimination", _after_neg("Transpose", [2, 3, 4], [2, 3, 4], perm=[0, 1, 2]))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("perm", [[1, 0, 2], None])
def test_transpose_elimination_refuses_a_permutation(perm):
    m = _after_neg("Transpose", [2, 3, 4], 3, **({"perm": perm} if perm else {}))
    refuses("transpose_elimination", m, "not the identity permutation")


@pytest.mark.parametrize("x_shape,perm,y_shape", [
    ([2, 1, 1, 5], [0, 2, 3, 1], [2, 1, 5, 1]),
    ([1, 8, 1, 1], NCHW_TO_NHWC, [1, 1, 1, 8]),
    (["n", 1, 3], [0, 2, 1], ["n", 3, 1]),        # a symbolic dimension left in place: 0
    ([1, "n", 3], [1, 0, 2], ["n", 1, 3]),        # one moved symbolic dimension: -1
], ids=["static", "nchw-c", "symbolic-in-place", "symbolic-moved"])
def test_transpose_to_reshape_fires(x_shape, perm, y_shape):
    out, _ = fires("transpose_to_reshape", _after_neg("Transpose", x_shape, y_shape, perm=perm))
    assert op_types(out) == ["Neg", "Reshape"]


def test_transpose_to_reshape_of_an_unsqueeze_is_an_unsqueeze():
    """tf2onnx's squeeze-and-excite: Unsqueeze [N, C] -> [N, 1, 1, C], then the Transpose to NCHW: one
    Unsqueeze [N, C, 1, 1], the batch's symbol kept."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("Unsqueeze", ["n", "ax"], ["u"]),
             helper.make_node("Transpose", ["u"], ["y"], perm=NHWC_TO_NCHW)]
    m = model(nodes, [tinfo("x", ["N", 8])], [tinfo("y", ["N", 8, 1, 1])], [i64("ax", [1, 2])])
    out, _ = fires("transpose_to_reshape", m)
    assert op_types(out) == ["Neg", "Unsqueeze"]
    ax = next(n for n in out.graph.node if n.op_type == "Unsqueeze").input[1]
    assert next(onnx.numpy_helper.to_array(t) for t in out.graph.initializer if t.name == ax).tolist() == [2, 3]


@pytest.mark.parametrize("x_shape,perm,reason", [
    ([2, 3, 4], [0, 2, 1], "moves a dimension"),
    ([2, 3, 4], [0, 1, 2], "identity"),
    (["a", 1, "b"], [2, 1, 0], "moves a dimension"),
    ([1, 0, 3], [1, 0, 2], "size 0"),
], ids=["moves", "identity", "two-symbols", "empty"])
def test_transpose_to_reshape_refuses(x_shape, perm, reason):
    y_shape = [x_shape[p] for p in perm]
    empty = 0 in x_shape
    feeds = {"x": np.zeros(x_shape, np.float32)} if empty else None
    refuses("transpose_to_reshape", _after_neg("Transpose", x_shape, y_shape, perm=perm), reason,
            depends=not empty, feeds=feeds)


def test_transpose_to_reshape_refuses_an_unknown_rank():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), opaque("n", "h"), helper.make_node("Transpose", ["h"], ["y"])]
    refuses("transpose_to_reshape", x_model(nodes, [2, 3], 2), "rank unknown")


def test_a_transpose_of_a_constant_is_folded():
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[2, 0, 1]), helper.make_node("Add", ["x", "wt"], ["y"])]
    m = x_model(nodes, [4, 2, 3], [4, 2, 3], {"w": w})
    out = optimize(m)
    assert op_types(out) == ["Add"]
    same_outputs(m, out)


# --- the pass: transpose_optimization ---------------------------------------------------------------


def _run_pass(m, **options):
    """The pass alone (and the transpose rules the driver runs around it)."""
    from onnxopt.targets import benefit

    from .check import RULES
    rules = [RULES["transpose_pair"], RULES["transpose_elimination"], RULES["transpose_to_reshape"]]
    with benefit.using(None):
        return optimize(m, rules=rules, graph_passes=["transpose_optimization"], return_report=True, **options)


def _transpose_count(m):
    return op_types(m).count("Transpose")


def _cost(m):
    return graph_cost(ir.serde.deserialize_model(m))


def test_a_push_through_three_ops_that_pays_only_at_the_third():
    """T -> Add(w) -> Mul(u) -> Relu -> T^-1, with w and u activations of shape [1, C, 1, 1]: each
    of the first two pushes adds a Transpose of w (u) and raises the cost; the third meets the
    inverse Transpose and cancels both."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Add", ["t", "w"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("Transpose", ["c"], ["y"], perm=NCHW_TO_NHWC)]
    m = model(nodes, [tinfo("x", [1, 8, 8, 16]), tinfo("w", [1, 16, 1, 1]), tinfo("u", [1, 16, 1, 1])],
              [tinfo("y", [1, 8, 8, 16])])
    g = ir.serde.deserialize_model(m)
    t = next(n for n in g.graph if n.op_type == "Transpose")
    plan = plan_chain(t, opsets_of(g))
    assert not isinstance(plan, str), plan
    assert len(plan.steps) == 3 and len(plan.merges) == 1
    assert plan.delta == -numel([1, 8, 8, 16]) - numel([1, 8, 8, 16])  # w, u: size-1 moves, free
    plan_two = plan_chain(t, opsets_of(g), max_steps=2)
    assert isinstance(plan_two, str)  # two pushes alone never pay
    out, report = _run_pass(m)
    assert _transpose_count(out) == 0, op_types(out)
    assert report.rules["transpose_optimization"].fired == 1
    same_outputs(m, out)


def test_a_push_whose_end_does_not_pay_is_not_committed():
    """T -> Add(w full size) -> T^-1: moving T costs a Transpose of w as large as the pair saves... no:
    the pair (2N) becomes one Transpose of w (N): it pays. With two full-size operands it does not."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Add", ["t", "w"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["b"]),
             helper.make_node("Transpose", ["b"], ["y"], perm=NCHW_TO_NHWC)]
    m = model(nodes, [tinfo("x", [1, 4, 4, 8]), tinfo("w", [1, 8, 4, 4]), tinfo("u", [1, 8, 4, 4])],
              [tinfo("y", [1, 4, 4, 8])])
    out, report = _run_pass(m)
    assert op_types(out) == op_types(m)
    assert report.rules["transpose_optimization"].fired == 0
    same_outputs(m, out)


def test_cost_is_symbolic_where_dimensions_are_not_numbers():
    assert numel(["n", 3, 4]) == Cost.of({1: 12})
    assert Cost.of({1: 1}).sign() > 0 and Cost.of({1: 1, 0: -1000}).sign() > 0
    assert Cost.of({0: 1000}) < Cost.of({1: 1})


def _chain(op_nodes, x_shape, y_shape, inits=(), inputs=(), opset=17, dtype=TensorProto.FLOAT, out_dtype=None,
           perm_in=NHWC_TO_NCHW, perm_out=NCHW_TO_NHWC):
    """x -> Transpose(perm_in) -> op_nodes (reading "t", writing "o") -> Transpose(perm_out) -> y."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm_in), *op_nodes,
             helper.make_node("Transpose", ["o"], ["y"], perm=perm_out)]
    ins = [tinfo("x", x_shape, dtype), *inputs]
    return model(nodes, ins, [tinfo("y", y_shape, out_dtype or dtype)], inits, opset=opset)


R = np.random.default_rng(0)


def _f(*shape):
    return R.standard_normal(shape).astype(np.float32)


X = [2, 5, 6, 4]  # NHWC; the op sees NCHW [2, 4, 5, 6]
CASES = {
    "relu": ([helper.make_node("Relu", ["t"], ["o"])], X, {}),
    "cast": ([helper.make_node("Cast", ["t"], ["o"], to=TensorProto.DOUBLE)], X, {"out_dtype": TensorProto.DOUBLE}),
    "leakyrelu": ([helper.make_node("LeakyRelu", ["t"], ["o"], alpha=0.2)], X, {}),
    "clip": ([helper.make_node("Clip", ["t", "lo", "hi"], ["o"])], X,
             {"inits": [init("lo", np.float32(-0.5)), init("hi", np.float32(0.5))]}),
    "add-const-c": ([helper.make_node("Add", ["t", "b"], ["o"])], X, {"inits": [init("b", _f(4, 1, 1))]}),
    "mul-const-full": ([helper.make_node("Mul", ["b", "t"], ["o"])], X, {"inits": [init("b", _f(2, 4, 5, 6))]}),
    "sub-const-lower-rank": ([helper.make_node("Sub", ["t", "b"], ["o"])], X, {"inits": [init("b", _f(6))]}),
    "add-activation": ([helper.make_node("Add", ["t", "w"], ["o"])], X, {"inputs": [tinfo("w", [1, 4, 1, 1])]}),
    "add-activation-lower-rank": ([helper.make_node("Add", ["t", "w"], ["o"])], X, {"inputs": [tinfo("w", [4, 1, 1])]}),
    "where": ([helper.make_node("Where", ["c", "t", "b"], ["o"])], X,
              {"inits": [init("b", _f(4, 1, 1))], "inputs": [tinfo("c", [1, 1, 6], TensorProto.BOOL)]}),
    "prelu": ([helper.make_node("PRelu", ["t", "s"], ["o"])], X, {"inits": [init("s", _f(4, 1, 1))]}),
    "softmax": ([helper.make_node("Softmax", ["t"], ["o"], axis=1)], X, {}),
    "logsoftmax-neg": ([helper.make_node("LogSoftmax", ["t"], ["o"], axis=-1)], X, {}),
    "pad": ([helper.make_node("Pad", ["t", "pads"], ["o"])], X,
            {"inits": [i64("pads", [0, 0, 1, 2, 0, 1, 0, 3])], "y": [2, 6, 11, 5]}),
    "pad-axes": ([helper.make_node("Pad", ["t", "pads", "", "axes"], ["o"], mode="reflect")], X,
                 {"inits": [i64("pads", [1, 2, 1, 0]), i64("axes", [2, 3])], "y": [2, 7, 8, 4], "opset": 18}),
    "slice": ([helper.make_node("Slice", ["t", "st", "en", "ax"], ["o"])], X,
              {"inits": [i64("st", [1, 0]), i64("en", [3, -1]), i64("ax", [1, -1])], "y": [2, 5, 5, 2]}),
    "slice-no-axes": ([helper.make_node("Slice", ["t", "st", "en"], ["o"])], X,
                      {"inits": [i64("st", [1, 1]), i64("en", [2, 3])], "y": [1, 5, 6, 2]}),
    "resize": ([helper.make_node("Resize", ["t", "", "sc"], ["o"], mode="nearest")], X,
               {"inits": [init("sc", np.array([1, 1, 2, 2], np.float32))], "y": [2, 10, 12, 4]}),
    "resize-linear-sizes": ([helper.make_node("Resize", ["t", "", "", "sz"], ["o"], mode="linear")], X,
                            {"inits": [i64("sz", [2, 4, 10, 3])], "y": [2, 10, 3, 4]}),
    "qdq-per-axis": ([helper.make_node("QuantizeLinear", ["t", "qs", "zp"], ["q"], axis=1),
                      helper.make_node("DequantizeLinear", ["q", "qs", "zp"], ["o"], axis=1)], X,
                     {"inits": [init("qs", np.array([0.1, 0.2, 0.05, 0.3], np.float32)),
                                init("zp", np.array([0, 3, -2, 1], np.int8))]}),
    "qdq-per-tensor": ([helper.make_node("QuantizeLinear", ["t", "qs", "zp"], ["q"]),
                        helper.make_node("DequantizeLinear", ["q", "qs", "zp"], ["o"])], X,
                       {"inits": [init("qs", np.float32(0.1)), init("zp", np.int8(2))]}),
    "concat": ([helper.make_node("Concat", ["t", "w"], ["o"], axis=1)], X,
               {"y": [2, 5, 6, 8], "inputs": [tinfo("w", [2, 4, 5, 6])]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_pass_pushes_through(case):
    nodes, x_shape, kw = CASES[case]
    kw = dict(kw)
    y = kw.pop("y", X)
    m = _chain(nodes, x_shape, y, **kw)
    onnx.checker.check_model(m, full_check=True)
    out, report = _run_pass(m)
    assert report.rules["transpose_optimization"].fired >= 1, report.rules["transpose_optimization"]
    assert _transpose_count(out) < _transpose_count(m), op_types(out)
    onnx.checker.check_model(out, full_check=True)
    same_outputs(m, out, tol=1e-6 if case.startswith(("resize", "softmax", "logsoftmax")) else None)


def test_the_pass_pushes_through_split_into_the_transposes_of_each_output():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Split", ["t", "sp"], ["s0", "s1"], axis=1),
             helper.make_node("Transpose", ["s0"], ["y0"], perm=NCHW_TO_NHWC),
             helper.make_node("Transpose", ["s1"], ["y1"], perm=NCHW_TO_NHWC)]
    m = model(nodes, [tinfo("x", X)], [tinfo("y0", [2, 5, 6, 2]), tinfo("y1", [2, 5, 6, 2])], [i64("sp", [2, 2])])
    out, report = _run_pass(m)
    assert op_types(out) == ["Split"]
    same_outputs(m, out)


def _tail(op_nodes, y_shape, inits=(), opset=17, y_dtype=TensorProto.FLOAT):
    """x (NHWC [2, 5, 6, 4]) -> Transpose to NCHW -> op_nodes (reading "t", writing "y"): the ops shrink
    what the Transpose moves, so the push pays with no Transpose after."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW), *op_nodes]
    return model(nodes, [tinfo("x", X)], [tinfo("y", y_shape, y_dtype)], inits, opset=opset)


TAILS = {
    "reducemean-keepdims": ([helper.make_node("ReduceMean", ["t"], ["y"], axes=[2, 3])], [2, 4, 1, 1], {}),
    "reducesum-13-axes-input": ([helper.make_node("ReduceSum", ["t", "ax"], ["y"], keepdims=0)], [2, 4],
                                {"inits": [i64("ax", [-1, 2])], "opset": 13}),
    "reducemax-18-axes-input": ([helper.make_node("ReduceMax", ["t", "ax"], ["y"], keepdims=0)], [2, 6],
                                {"inits": [i64("ax", [1, 2])], "opset": 18}),
    "reduce-all": ([helper.make_node("ReduceL2", ["t"], ["y"], keepdims=1)], [1, 1, 1, 1], {}),
    "argmax": ([helper.make_node("ArgMax", ["t"], ["y"], axis=1, keepdims=0)], [2, 5, 6],
               {"y_dtype": TensorProto.INT64}),
    "gather-scalar": ([helper.make_node("Gather", ["t", "i"], ["y"], axis=1)], [2, 5, 6],
                      {"inits": [init("i", np.array(2, np.int64))]}),
    "gather-2d": ([helper.make_node("Gather", ["t", "i"], ["y"], axis=3)], [2, 4, 5, 1, 2],
                  {"inits": [init("i", np.array([[0, 5]], np.int64))]}),
    "slice-then-squeeze": ([helper.make_node("Slice", ["t", "st", "en", "ax"], ["s"]),
                            helper.make_node("Squeeze", ["s", "ax"], ["y"])], [2, 5, 6],
                           {"inits": [i64("st", [1]), i64("en", [2]), i64("ax", [1])]}),
    "squeeze-11": ([helper.make_node("Slice", ["t", "st", "en", "ax"], ["s"]),
                    helper.make_node("Squeeze", ["s"], ["y"], axes=[1])], [2, 5, 6],
                   {"inits": [i64("st", [1]), i64("en", [2]), i64("ax", [1])], "opset": 11}),
    "reshape-squeeze-like": ([helper.make_node("ReduceMean", ["t"], ["r"], axes=[2]),
                              helper.make_node("Reshape", ["r", "s"], ["y"])], [2, 4, 6],
                             {"inits": [i64("s", [2, 4, 6])]}),
}


@pytest.mark.parametrize("case", list(TAILS))
def test_the_pass_pushes_into_ops_that_shrink(case):
    nodes, y, kw = TAILS[case]
    m = _tail(nodes, y, **kw)
    onnx.checker.check_model(m, full_check=True)
    before = _cost(m)
    out, report = _run_pass(m)
    assert report.rules["transpose_optimization"].fired >= 1, report.rules["transpose_optimization"]
    onnx.checker.check_model(out, full_check=True)
    assert _cost(out)[1] < before[1], (op_types(out), _cost(out), before)
    same_outputs(m, out, tol=1e-6 if "reduce" in case else None, depends=case != "argmax")


def test_unsqueeze_is_pushed_through():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Unsqueeze", ["t", "ax"], ["u"]),
             helper.make_node("Transpose", ["u"], ["y"], perm=[0, 1, 3, 4, 2])]
    m = model(nodes, [tinfo("x", X)], [tinfo("y", [2, 1, 5, 6, 4])], [i64("ax", [1])])
    out, _ = _run_pass(m)
    assert _transpose_count(out) == 0, op_types(out)
    same_outputs(m, out)


@pytest.mark.parametrize("case,reason", [("softmax-11", "before opset 13"), ("fan-out", "no prefix lowers the cost"),
                                         ("graph-output", "no prefix lowers the cost")])
def test_the_pass_refuses(case, reason):
    if case == "softmax-11":
        m = _chain([helper.make_node("Softmax", ["t"], ["o"], axis=1)], X, X, opset=11)
    elif case == "fan-out":  # Relu's branch ends at a graph output; the Transpose stays for the Conv
        m = _chain([helper.make_node("Relu", ["t"], ["r"]), helper.make_node("Conv", ["t", "w"], ["o"])], X, [2, 5, 6, 3],
                   inits=[init("w", _f(3, 4, 1, 1))])
        m.graph.output.append(tinfo("r", [2, 4, 5, 6]))
    else:
        m = _tail([helper.make_node("Relu", ["t"], ["y"])], [2, 4, 5, 6])
    g = ir.serde.deserialize_model(m)
    t = next(n for n in g.graph if n.op_type == "Transpose")
    plan = plan_chain(t, opsets_of(g))
    assert isinstance(plan, str) and reason in plan, plan
    out, report = _run_pass(m)
    assert report.rules["transpose_optimization"].fired == 0
    assert op_types(out) == op_types(m)


# --- NHWC graphs as tf2onnx writes them: Transposes around every Conv --------------------------------


@pytest.mark.parametrize("batch", [1, "N"], ids=["static", "symbolic-batch"])
def test_a_keras_like_nhwc_graph_keeps_only_the_input_transpose(batch):
    m = keras_like(1, batch)
    before = _cost(m)
    out = optimize(m)
    after = _cost(out)
    assert before[0] == 6 and after[0] == 1, (before, after, op_types(out))
    assert after[1] < before[1]
    feeds = {"x": np.random.default_rng(2).standard_normal((2 if batch == "N" else 1, 16, 16, 3)).astype(np.float32)}
    same_outputs(m, out, feeds, tol=1e-5)


def _shared(outer):
    nodes = [helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("Transpose", ["n"], ["a"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["a"], ["b"], perm=outer),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Add", ["b", "x"], ["y0"]),
             helper.make_node("Identity", ["r"], ["y1"])]
    return model(nodes, [tinfo("x", [3, 3, 3])], [tinfo("y0", [3, 3, 3]), tinfo("y1", [3, 3, 3])])


def test_transpose_pair_cancels_where_the_inner_transpose_has_other_readers():
    out, _ = fires("transpose_pair", _shared([0, 2, 1]))
    assert op_types(out).count("Transpose") == 1


def test_transpose_pair_refuses_to_merge_where_the_inner_transpose_has_other_readers():
    refuses("transpose_pair", _shared([1, 0, 2]), "other readers and the pair does not cancel")


def test_a_chain_ending_where_a_transpose_and_another_op_read_it():
    """T -> Relu -> {T^-1 -> y0, Sigmoid -> y1}: the pushed Transpose stays for Sigmoid and the
    inverse one cancels: one Transpose fewer."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y0"], perm=NCHW_TO_NHWC),
             helper.make_node("Sigmoid", ["r"], ["y1"])]
    m = model(nodes, [tinfo("x", X)], [tinfo("y0", X), tinfo("y1", [2, 4, 5, 6])])
    out, report = _run_pass(m)
    assert report.rules["transpose_optimization"].fired == 1
    assert _transpose_count(out) == 1, op_types(out)
    same_outputs(m, out)


def test_silu_reading_the_transpose_twice_is_pushed_through():
    """T -> {Sigmoid, Mul(t, Sigmoid(t))} -> T^-1 (SiLU, as EfficientNet converted from Keras has it):
    the push into Sigmoid keeps T for Mul and raises the cost; the push into Mul reads T through a
    cancelled Transpose, T goes, and the inverse Transpose cancels."""
    m = _chain([helper.make_node("Sigmoid", ["t"], ["s"]), helper.make_node("Mul", ["t", "s"], ["o"])], X, X)
    out, report = _run_pass(m)
    assert report.rules["transpose_optimization"].fired == 1
    assert _transpose_count(out) == 0, op_types(out)
    same_outputs(m, out)


@pytest.mark.parametrize("name", ["mobilenet_v2-legacy", "resnet50-legacy", "efficientnet_b0-legacy"])
def test_zoo_cnns_written_channels_last_keep_only_the_input_transpose(name):
    """A zoo CNN rewritten as tf2onnx writes Keras models (models/nhwc.py: NHWC activations, Transposes
    around every Conv, pooling and per-channel op: 213 to 295 of them) comes back to one Transpose, at
    the input, with the outputs of the NCHW model on the transposed input."""
    from onnxopt.models.nhwc import to_nhwc_style

    from .zoo_cases import load

    nchw = load(name)
    m = to_nhwc_style(nchw)
    out = optimize(m)
    assert _cost(m)[0] > 200 and _cost(out)[0] == 1
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    from conftest import run_ort
    want = run_ort(nchw, {nchw.graph.input[0].name: x})[0]
    got = run_ort(out, {out.graph.input[0].name: np.ascontiguousarray(x.transpose(0, 2, 3, 1))})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_the_nodes_the_pass_makes_say_so():
    out, _ = _run_pass(_chain([helper.make_node("Relu", ["t"], ["o"], name="act")], X, X))
    relu = next(n for n in out.graph.node if n.op_type == "Relu")
    props = {p.key: p.value for p in relu.metadata_props}
    assert props["onnxopt.rule"] == "transpose_optimization" and props["onnxopt.replaced"] == '["act"]'


def _random_chain(seed):
    """x [2, 3, 4, 5] -> Transpose(random perm) -> 1 to 4 random layout-agnostic ops -> Transpose
    (the inverse perm, or another) -> y: shapes from onnx's inference."""
    rng = np.random.default_rng(seed)
    perm = [int(p) for p in rng.permutation(4)]
    nodes = [helper.make_node("Transpose", ["x"], ["v0"], perm=perm)]
    inits, inputs = [], [tinfo("x", [2, 3, 4, 5])]
    shape = [[2, 3, 4, 5][p] for p in perm]
    cur = "v0"
    for k in range(int(rng.integers(1, 5))):
        nxt = f"v{k + 1}"
        kind = rng.choice(["relu", "addc", "mulact", "softmax", "slice", "pad", "reducekeep", "concat"])
        axis = int(rng.integers(0, 4))
        if kind == "relu":
            nodes.append(helper.make_node("Relu", [cur], [nxt]))
        elif kind == "addc":
            cshape = [s if rng.random() < 0.5 else 1 for s in shape][int(rng.integers(0, 4)):]
            inits.append(init(f"c{k}", rng.standard_normal(cshape).astype(np.float32)))
            nodes.append(helper.make_node("Add", [cur, f"c{k}"], [nxt]))
        elif kind == "mulact":
            inputs.append(tinfo(f"w{k}", [s if rng.random() < 0.5 else 1 for s in shape]))
            nodes.append(helper.make_node("Mul", [f"w{k}", cur], [nxt]))
        elif kind == "softmax":
            nodes.append(helper.make_node("Softmax", [cur], [nxt], axis=axis - 4 * int(rng.integers(0, 2))))
        elif kind == "slice":
            if shape[axis] < 2:
                nodes.append(helper.make_node("Neg", [cur], [nxt]))
            else:
                inits += [i64(f"st{k}", [1]), i64(f"en{k}", [shape[axis]]), i64(f"ax{k}", [axis])]
                nodes.append(helper.make_node("Slice", [cur, f"st{k}", f"en{k}", f"ax{k}"], [nxt]))
                shape[axis] -= 1
        elif kind == "pad":
            pads = [int(a) for a in rng.integers(0, 2, 8)]
            inits.append(i64(f"p{k}", pads))
            nodes.append(helper.make_node("Pad", [cur, f"p{k}"], [nxt]))
            shape = [s + pads[i] + pads[4 + i] for i, s in enumerate(shape)]
        elif kind == "reducekeep":
            nodes.append(helper.make_node("ReduceSum", [cur, f"r{k}"], [nxt], keepdims=1))
            inits.append(i64(f"r{k}", [axis]))
            shape[axis] = 1
        else:
            inputs.append(tinfo(f"w{k}", shape[:axis] + [2] + shape[axis + 1:]))
            nodes.append(helper.make_node("Concat", [cur, f"w{k}"], [nxt], axis=axis))
            shape[axis] += 2
        cur = nxt
    out_perm = inverse_perm = [perm.index(i) for i in range(4)]
    if rng.random() < 0.3:
        out_perm = [int(p) for p in rng.permutation(4)]
    nodes.append(helper.make_node("Transpose", [cur], ["y"], perm=out_perm))
    del inverse_perm
    m = model(nodes, inputs, [tinfo("y", [shape[p] for p in out_perm])], inits)
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_keep_their_outputs(seed):
    m = _random_chain(seed)
    out = optimize(m)
    assert _cost(out)[1] < _cost(m)[1] or _cost(out)[1] == _cost(m)[1]
    same_outputs(m, out, tol=1e-5)


@pytest.mark.parametrize("shape,perm_out,pays", [([2, 30, 4], [0, 2, 1], True), ([2, 5, 24], [0, 2, 1], False)],
                         ids=["merges-h-w", "merges-w-c"])
def test_reshape_merging_dimensions_adjacent_before_the_transpose(shape, perm_out, pays):
    """x [2, 4, 5, 6] -> T to NHWC -> Reshape [2, 30, 4] (H, W merged: adjacent in NCHW too) -> T:
    Reshape [2, 4, 30] and one Transpose, cancelled here. W and C merged are not adjacent in NCHW."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NCHW_TO_NHWC),
             helper.make_node("Reshape", ["t", "s"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=perm_out)]
    m = model(nodes, [tinfo("x", [2, 4, 5, 6])], [tinfo("y", [shape[p] for p in perm_out])], [i64("s", shape)])
    g = ir.serde.deserialize_model(m)
    plan = plan_chain(next(n for n in g.graph if n.op_type == "Transpose"), opsets_of(g))
    out, report = _run_pass(m)
    if pays:
        assert op_types(out) == ["Reshape"], op_types(out)
    else:
        assert isinstance(plan, str) and "not adjacent" in plan, plan
        assert op_types(out) == op_types(m)
    same_outputs(m, out)


def test_reshape_splitting_a_dimension_is_pushed_through():
    """x [2, 30, 4] -> T (0, 2, 1) -> [2, 4, 30] -> Reshape [2, 4, 5, 6] -> T to NHWC: Reshape [2, 5, 6, 4], no
    Transpose (the split commutes with any permutation)."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["t", "s"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=NCHW_TO_NHWC)]
    m = model(nodes, [tinfo("x", [2, 30, 4])], [tinfo("y", [2, 5, 6, 4])], [i64("s", [2, 4, 5, 6])])
    out, _ = _run_pass(m)
    assert op_types(out) == ["Reshape"], op_types(out)
    same_outputs(m, out)


# --- residual branches, diamonds and forks (as tf2onnx writes ResNet and EfficientNet blocks) --------


def test_a_residual_read_in_both_layouts_reuses_its_transpose():
    """r (NHWC) is read by T1 -> Conv and by Add(T2(Conv...), r) -> T3 -> Conv: the push of T2 through
    the Add reads r through the T1 the graph has (no new Transpose), and T3 cancels: only T1 stays."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t1"], perm=NHWC_TO_NCHW),
             helper.make_node("Conv", ["t1", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["c1"], ["t2"], perm=NCHW_TO_NHWC),
             helper.make_node("Add", ["t2", "r"], ["a"]),
             helper.make_node("Transpose", ["a"], ["t3"], perm=NHWC_TO_NCHW),
             helper.make_node("Conv", ["t3", "w2"], ["y"])]
    m = model(nodes, [tinfo("x", X)], [tinfo("y", [2, 3, 5, 6])],
              [init("w1", _f(4, 4, 3, 3)), init("w2", _f(3, 4, 1, 1))])
    out, report = _run_pass(m)
    assert _transpose_count(out) == 1, op_types(out)
    same_outputs(m, out, tol=1e-5)


def test_a_diamond_in_the_middle_of_a_chain():
    """T -> Add(const) -> {Sigmoid, Mul(a, Sigmoid(a))} -> T^-1: the chain goes through SiLU's two
    nodes as one element-wise op; nothing is left."""
    m = _chain([helper.make_node("Add", ["t", "c"], ["a"]), helper.make_node("Sigmoid", ["a"], ["s"]),
                helper.make_node("Mul", ["a", "s"], ["o"])], X, X, inits=[init("c", _f(4, 1, 1))])
    out, report = _run_pass(m)
    assert _transpose_count(out) == 0, op_types(out)
    same_outputs(m, out)


def test_a_fork_pays_where_no_single_chain_does():
    """Squeeze-and-excite in NHWC between two Transposes: v = Mul(T(x), c) is read by ReduceMean (the
    squeeze) and by Mul(v, Sigmoid(ReduceMean(v))) (the excite), then T^-1. No chain alone pays
    (the carried Transpose stays for the other reader); pushed into both readers it does: no
    Transpose moving data is left."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Mul", ["t", "c"], ["v"]),
             helper.make_node("ReduceMean", ["v"], ["m"], axes=[2, 3], keepdims=1),
             helper.make_node("Sigmoid", ["m"], ["s"]),
             helper.make_node("Mul", ["v", "s"], ["e"]),
             helper.make_node("Transpose", ["e"], ["y"], perm=NCHW_TO_NHWC)]
    m = model(nodes, [tinfo("x", X)], [tinfo("y", X)], [init("c", _f(4, 1, 1))])
    g = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(m))
    t = next(n for n in g.graph if n.op_type == "Transpose")
    plan = plan_chain(t, opsets_of(g))
    assert not isinstance(plan, str) and plan.branches, plan
    out, report = _run_pass(m)
    count, elements, _ = _cost(out)
    assert elements == Cost() and count < 2, op_types(out)
    same_outputs(m, out, tol=1e-6)  # (a mean over another memory layout rounds differently)


def test_a_fork_that_does_not_pay_is_not_taken():
    """As above, but the excite's other factor is a graph input in NCHW terms of its own: pushing
    into the Mul needs a Transpose of a full-size tensor; the squeeze branch alone does not pay."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=NHWC_TO_NCHW),
             helper.make_node("Mul", ["t", "c"], ["v"]),
             helper.make_node("ReduceMean", ["v"], ["m"], axes=[2, 3], keepdims=1),
             helper.make_node("Mul", ["v", "w"], ["e"]),
             helper.make_node("Add", ["e", "m"], ["y"])]
    m = model(nodes, [tinfo("x", X), tinfo("w", [2, 4, 5, 6])], [tinfo("y", [2, 4, 5, 6])], [init("c", _f(4, 1, 1))])
    out, report = _run_pass(m)
    assert _cost(out)[1] == _cost(m)[1] or _cost(out)[1] < _cost(m)[1]
    same_outputs(m, out, tol=1e-6)


def test_the_report_does_not_change_the_output():
    """return_report measures the Transposes on a copy: the shapes it infers are not written."""
    m = keras_like(2, "N", 16, 8)
    a = optimize(m)
    b, _ = optimize(m, return_report=True)
    assert a.SerializeToString() == b.SerializeToString()


def _random_nhwc_graph(seed):
    """A random tf2onnx-style NHWC network on x [2, 6, 7, 4]: blocks of Conv between Transposes,
    SiLU (a diamond), squeeze-and-excite (a fork), a residual Add read in both layouts, constants
    broadcast in NHWC, ReduceMean heads; every value the next block reads is NHWC."""
    rng = np.random.default_rng(seed)
    nodes, inits, k = [], [], [0]

    def name(base):
        k[0] += 1
        return f"{base}{k[0]}"

    def conv(v, c=4):
        t, o, back, w = name("t"), name("c"), name("b"), name("w")
        inits.append(init(w, rng.standard_normal((c, 4, 1, 1)).astype(np.float32) * 0.5))
        nodes.extend([helper.make_node("Transpose", [v], [t], perm=NHWC_TO_NCHW),
                      helper.make_node("Conv", [t, w], [o]),
                      helper.make_node("Transpose", [o], [back], perm=NCHW_TO_NHWC)])
        return back

    v = "x"
    residual = None
    for _ in range(int(rng.integers(2, 6))):
        kind = rng.choice(["conv", "silu", "se", "residual", "const", "relu"])
        if kind == "conv":
            residual = v if rng.random() < 0.5 else residual
            v = conv(v)
        elif kind == "silu":
            s, o = name("s"), name("m")
            nodes += [helper.make_node("Sigmoid", [v], [s]), helper.make_node("Mul", [v, s], [o])]
            v = o
        elif kind == "se":
            r, s, o = name("r"), name("s"), name("e")
            nodes += [helper.make_node("ReduceMean", [v], [r], axes=[1, 2], keepdims=1),
                      helper.make_node("Sigmoid", [r], [s]), helper.make_node("Mul", [v, s], [o])]
            v = o
        elif kind == "residual" and residual is not None:
            o = name("a")
            nodes.append(helper.make_node("Add", [conv(v), residual], [o]))
            v, residual = o, None
        elif kind == "const":
            c, o = name("k"), name("q")
            inits.append(init(c, rng.standard_normal([1, 1, 4][int(rng.integers(0, 3)):]).astype(np.float32)))
            nodes.append(helper.make_node(rng.choice(["Add", "Mul"]), [v, c], [o]))
            v = o
        else:
            o = name("relu")
            nodes.append(helper.make_node("Relu", [v], [o]))
            v = o
    v = conv(v)
    if rng.random() < 0.5:
        nodes.append(helper.make_node("ReduceMean", [v], ["y"], axes=[1, 2], keepdims=0))
        out = tinfo("y", [2, 4])
    else:
        nodes.append(helper.make_node("Identity", [v], ["y"]))
        out = tinfo("y", [2, 6, 7, 4])
    m = model(nodes, [tinfo("x", [2, 6, 7, 4])], [out], inits)
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


@pytest.mark.parametrize("seed", range(30))
def test_random_nhwc_networks_keep_their_outputs_and_lose_transposes(seed):
    m = _random_nhwc_graph(seed)
    out = optimize(m)
    before, after = _cost(m), _cost(out)
    assert after[1] < before[1] or after[1] == before[1], (before, after)
    assert after[0] <= 2, op_types(out)  # the input's, and one where the head reads NHWC
    same_outputs(m, out, tol=1e-5)
