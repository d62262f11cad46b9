"""Exact mode at the level of single rules: the cases where a rewrite that computes the same values
would still change what onnxruntime computes (its own optimizer folds or fuses differently), the
refusals exact mode adds for them, and further proofs (larger shapes, more ops) of rules declared
exact. check.fires proves every rule declared exact where it fires; this file adds the cases.

Each "not exact" case shows the rule's rewrite changing the bits onnxruntime computes with its
default settings, and exact mode leaving the model as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import RULES, THREADS, _identical, exact_outputs, fires, refuses, run_default, x_model

f32 = np.float32
RNG = np.random.default_rng(13)


def _changes_bits(m, feeds, **options) -> bool:
    """optimize(m, **options) (default mode) gives other bits than m under onnxruntime's default
    settings."""
    out = optimize(m, **options)
    return any(not _identical(a, b) for t in THREADS
               for a, b in zip(run_default(m, feeds, t), run_default(out, feeds, t)))


def _same_under_exact(m, feeds):
    """optimize(m, exact=True) gives m's bits under onnxruntime's defaults; returns the result."""
    out = optimize(m, exact=True)
    for t in THREADS:
        for a, b in zip(run_default(m, feeds, t), run_default(out, feeds, t)):
            assert _identical(a, b), t
    return out


# --- constant folding: what onnxruntime does instead of folding ----------------------------------


def _conv_of_constants(consumer: str):
    """Conv(X, W) of two constants, then consumer(conv, c), added to x."""
    nodes = [helper.make_node("Conv", ["X", "W"], ["c"]), helper.make_node(consumer, ["c", "k"], ["ck"]),
             helper.make_node("Add", ["x", "ck"], ["y"])]
    inits = {"X": RNG.standard_normal((1, 3, 8, 8)).astype(f32), "W": RNG.standard_normal((4, 3, 3, 3)).astype(f32),
             "k": (RNG.standard_normal((4, 1, 1)) * 3).astype(f32)}
    return x_model(nodes, [1, 4, 6, 6], [1, 4, 6, 6], inits)


def _gemm_of_constants():
    nodes = [helper.make_node("Gemm", ["A", "B"], ["g"]), helper.make_node("Sum", ["g", "x"], ["y"])]
    inits = {"A": RNG.standard_normal((8, 300)).astype(f32), "B": RNG.standard_normal((300, 16)).astype(f32)}
    return x_model(nodes, [8, 16], [8, 16], inits)


def _reciprocal_times_x(opset=17):
    nodes = [helper.make_node("Div", ["one", "c"], ["r"]), helper.make_node("Mul", ["x", "r"], ["y"])]
    return x_model(nodes, [4, 64], [4, 64], {"one": f32(1), "c": RNG.uniform(0.5, 3, 64).astype(f32)}, opset=opset)


def _qdq_conv():
    """A QDQ conv: onnxruntime runs it as QLinearConv, reading the weights' DequantizeLinear."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"]), helper.make_node("Conv", ["xd", "wd"], ["c"]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"])]
    inits = {"xs": f32(0.02), "xz": np.uint8(128), "wq": RNG.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8),
             "ws": f32(0.01), "ys": f32(0.05), "yz": np.uint8(128)}
    return x_model(nodes, [1, 3, 8, 8], [1, 4, 6, 6], inits)


HAZARDS = {  # name: (model, what the refusal says, whether default mode's fold is shown changing bits)
    "conv+mul": (_conv_of_constants("Mul"), "fuses Conv+Mul", True),
    "conv+add": (_conv_of_constants("Add"), "fuses Conv+Add", False),  # (same bits here, by luck of rounding)
    "gemm+sum": (_gemm_of_constants(), "fuses Gemm+Sum", True),
    "1/c*x opset 13": (_reciprocal_times_x(13), "(1 / c) * x into x / c", True),
    "1/c*x opset 17": (_reciprocal_times_x(17), "(1 / c) * x into x / c", True),
    "qdq": (_qdq_conv(), "keeps DequantizeLinear", True),
}


@pytest.mark.parametrize("case", list(HAZARDS))
def test_exact_constant_folding_leaves_what_onnxruntime_rewrites_before_folding(case):
    """onnxruntime's level-1 rules (Conv+Add/Mul/BN, Gemm+Sum, 1/c*x) run before its constant
    folding and merge a node of constants into its consumer, and it never folds the
    DequantizeLinear of a QDQ unit: folded by onnxopt, the session computes other bits."""
    m, reason, differs = HAZARDS[case]
    refuses("constant_folding", m, reason, exact=True)
    if differs:
        assert _changes_bits(m, feeds_for_x(m))
    _same_under_exact(m, feeds_for_x(m))


def feeds_for_x(m):
    dims = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    if m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT:
        return {"x": np.random.default_rng(0).standard_normal(dims).astype(f32)}
    raise AssertionError("float input expected")


EDGES = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -3e-39, 3e38, -2.5, 0.75, 88.7, -104.0], f32)
FINITE = np.array([-0.0, 0.0, 1e-45, -3e-39, 3e3, -2.5, 0.75, 88.7, -104.0, 1e-3, 7.0], f32)  # (for reductions)
REDUCING = {"Softmax", "ReduceSum", "LayerNormalization"}  # one NaN in a row is NaN everywhere there


@pytest.mark.parametrize("op,attrs,inputs", [
    ("Exp", {}, 1), ("Tanh", {}, 1), ("Erf", {}, 1), ("Sigmoid", {}, 1), ("Sqrt", {}, 1), ("Log", {}, 1),
    ("Reciprocal", {}, 1), ("Softmax", {"axis": -1}, 1), ("Div", {}, 2), ("Pow", {}, 2), ("Sub", {}, 2),
    ("MatMul", {}, 2), ("ReduceSum", {"keepdims": 0}, 1), ("LayerNormalization", {"axis": -1}, 3),
])
def test_constant_folding_is_exact_under_onnxruntime_defaults(op, attrs, inputs):
    """A node of constants folds to the bits the session computes for it (onnxruntime evaluates
    it with the same kernel its own constant folding uses), at the edges of floating point and
    on 67 elements per row (vector bodies and tails)."""
    edges = FINITE if op in REDUCING else EDGES
    a = np.resize(edges, (3, 67)) if op != "MatMul" else RNG.standard_normal((3, 67)).astype(f32)
    others = {2: [np.resize(EDGES[::-1], (3, 67)) if op != "MatMul" else RNG.standard_normal((67, 67)).astype(f32)],
              3: [RNG.standard_normal(67).astype(f32), RNG.standard_normal(67).astype(f32)]}.get(inputs, [])
    names = ["a", *[f"b{i}" for i in range(len(others))]]
    shape = [3] if op == "ReduceSum" else [3, 67]
    nodes = [helper.make_node(op, names, ["c"], **attrs), helper.make_node("Add", ["x", "c"], ["y"])]
    fires("constant_folding", x_model(nodes, shape, shape, dict(zip(names, [a, *others]))))


# --- larger products: onnxruntime fuses the original the same way -----------------------------------


@pytest.mark.parametrize("m_,k,n", [(64, 1000, 300), (128, 2048, 64)])
def test_matmul_add_to_gemm_is_exact_for_long_products(m_, k, n):
    """onnxruntime turns the original MatMul + Add into the same Gemm (its MatMulAddFusion), so
    the bias is added the same way however many blocks the product takes. (With its graph
    optimizations off the two differ for such long products: the Gemm adds the bias before the
    last blocks of the product, so check.fires, which also compares that way, is not used.)"""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("MatMul", ["n", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "c"], ["y"])]
    inits = {"w": RNG.standard_normal((k, n)).astype(f32), "c": RNG.standard_normal(n).astype(f32)}
    _, report = exact_outputs("matmul_add_to_gemm", x_model(nodes, [m_, k], [m_, n], inits))
    assert report.fired["matmul_add_to_gemm"] == 1


def test_gemm_flatten_to_matmul_is_exact_for_long_products():
    k, n = 1024, 96
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["r"]), helper.make_node("Gemm", ["r", "w", "c"], ["g"]),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"w": RNG.standard_normal((k, n)).astype(f32), "c": RNG.standard_normal(n).astype(f32),
             "flat": np.array([-1, k], np.int64), "back": np.array([2, 64, n], np.int64)}
    _, report = exact_outputs("gemm_flatten_to_matmul", x_model(nodes, [2, 64, k], [2, 64, n], inits))
    assert report.fired["gemm_flatten_to_matmul"] == 1


# --- rules declared not exact: value-preserving or not, onnxruntime computes other bits -------------


def _conv(then):
    """Conv(x, W) followed by ``then`` (nodes reading "c", writing "y")."""
    return [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]), *then]


def _conv_model(then, inits=(), x_shape=(2, 3, 16, 16), weights=1.0):
    w = (RNG.standard_normal((8, 3, 3, 3)) * weights).astype(f32)
    x = tinfo("x", ["N", *x_shape[1:]])
    return model(_conv(then), [x], [tinfo("y", ["N", 8, *x_shape[2:]])], [init("W", w), *inits])


NOT_EXACT = {
    # x / 2^20 after a Conv: the Mul it becomes is one onnxruntime folds into the weights
    # (ConvMulFusion), where tiny weights lose bits as subnormals
    "div_to_mul": _conv_model([helper.make_node("Div", ["c", "k"], ["y"])], [init("k", f32(2 ** 20))],
                              weights=1e-33),
    # a Mul by a [1] constant onnxruntime does not fold into the weights (PP-OCRv4 det's 28)
    "conv_mul_fold": _conv_model([helper.make_node("Mul", ["k", "c"], ["y"])], [init("k", np.array([1.7], f32))]),
    # CastLike(k, c) onnxruntime cannot fold (c is computed); the Cast it becomes folds, then fuses
    "castlike_to_cast": _conv_model([helper.make_node("CastLike", ["k", "c"], ["kc"]),
                                     helper.make_node("Mul", ["c", "kc"], ["y"])],
                                    [init("k", RNG.uniform(0.1, 3, (8, 1, 1)).astype(f32))]),
    # the channel count read from the shape (onnxruntime does not fold it: the batch is dynamic)
    "shape_gather_folding": _conv_model([helper.make_node("Shape", ["c"], ["s"]),
                                         helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
                                         helper.make_node("Cast", ["d"], ["df"], to=TensorProto.FLOAT),
                                         helper.make_node("Div", ["df", "three"], ["q"]),
                                         helper.make_node("Mul", ["c", "q"], ["y"])],
                                        [init("one", np.array(1, np.int64)), init("three", f32(3))]),
}


@pytest.mark.parametrize("rule", list(NOT_EXACT))
def test_rules_declared_not_exact_change_what_onnxruntime_computes(rule):
    m = NOT_EXACT[rule]
    feeds = {"x": RNG.standard_normal((2, 3, 16, 16)).astype(f32)}
    _, report = optimize(m, rules=[RULES[rule]], return_report=True)
    assert report.fired.get(rule), report.fired
    assert _changes_bits(m, feeds, rules=[RULES[rule]])  # the rule alone
    out = _same_under_exact(m, feeds)
    assert rule not in {p.value for n in out.graph.node for p in n.metadata_props if p.key == "onnxopt.rule"}


def test_pad_into_conv_is_not_exact_on_infinities():
    """With its graph optimizations on, onnxruntime computes Pad + Conv and the Conv with the
    pads merged differently where an infinite weight meets the Pad's zeros (0 * inf is NaN):
    other bits (tests/rules/test_conv.py's "valid" case, which fires with optimizations off)."""
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
             helper.make_node("Conv", ["p", "w"], ["y"], auto_pad="VALID", strides=[2, 2])]
    w = np.random.default_rng(1).standard_normal((3, 2, 3, 2)).astype(f32)
    w[0, 0, 0, 0] = np.inf
    m = x_model(nodes, [1, 2, 6, 6], 4, {"pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "w": w})
    x = np.random.default_rng(0).standard_normal((1, 2, 6, 6)).astype(f32)
    x.reshape(-1)[:3] = [np.inf, -np.inf, np.nan]
    assert _changes_bits(m, {"x": x}, rules=[RULES["pad_into_conv"]])
    assert op_types(_same_under_exact(m, {"x": x})) == ["Pad", "Conv"]
