"""rules/arithmetic.py: x * 1, x + 0, x - 0, x / 1, x / c, Pow(x, 2), MatMul + Add, flattened Gemm;
exact, so onnxruntime gives the same bits before and after, at the edges of floating point too
(infinities, NaN, subnormals and the sign of zero)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import fires, i64, refuses, run_rule, x_model

f32 = np.float32
INF, NAN = np.inf, np.nan
EDGE = np.array([[INF, -INF, NAN, 3e38], [-0.0, 1e-45, -1e-38, 2.5], [1.0, -2.0, 0.0, 1e19]], f32)


def _binary(op, c, x_shape=(2, 3), y_shape=None):
    """x -> Neg -> op(n, c) -> y."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node(op, ["n", "c"], ["y"])]
    return x_model(nodes, list(x_shape), list(y_shape or x_shape), {"c": np.asarray(c, f32)})


# --- neutral elements ---------------------------------------------------------------------------


@pytest.mark.parametrize("rule,op", [("mul_by_one", "Mul"), ("div_by_one", "Div")])
@pytest.mark.parametrize("c", [f32(1), np.ones(3, f32), np.ones((1, 3), f32)], ids=["scalar", "row", "2-D"])
def test_one_is_neutral(rule, op, c):
    out, _ = fires(rule, _binary(op, c), feeds={"x": EDGE[:2, :3].copy()})
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("rule,op", [("mul_by_one", "Mul"), ("div_by_one", "Div")])
def test_one_that_broadcasts_x_larger_is_kept(rule, op):
    refuses(rule, _binary(op, np.ones((2, 2, 3), f32), y_shape=(2, 2, 3)), "broadcasts x to a larger shape")


def test_neutral_elements_and_broadcast_refusal():
    nodes = [helper.make_node("Mul", ["x", "one"], ["a"]), helper.make_node("Add", ["a", "zero"], ["b"]),
             helper.make_node("Mul", ["b", "ones_big"], ["y"])]  # 1s of a larger shape: broadcasts
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [2, 3])],
              [init("one", np.float32(1)), init("zero", np.float32(-0.0)),  # x + -0.0 is x, -0.0 included
               init("ones_big", np.ones((2, 3), np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Mul"]
    assert_same_outputs(m, out, feeds_for(m))


def _then_reciprocal(op, c_name="c"):
    """Neg(x) op c -> Reciprocal: 1/x tells -0.0 (-inf) from +0.0 (+inf)."""
    return [helper.make_node("Neg", ["x"], ["n"]), helper.make_node(op, ["n", c_name], ["s"]),
            helper.make_node("Reciprocal", ["s"], ["y"])]


ZEROS = np.array([0.0, -0.0, 1.0, INF, NAN], f32)


@pytest.mark.parametrize("op,zero,fires_", [
    ("Add", 0.0, False),   # issue 11: -0.0 + 0.0 is +0.0; 1/x gives +inf, without the Add -inf
    ("Add", -0.0, True),   # x + -0.0 is x for every x
    ("Sub", -0.0, False),  # -0.0 - -0.0 is +0.0
    ("Sub", 0.0, True),    # x - 0.0 is x for every x
], ids=["add+0", "add-0", "sub-0", "sub+0"])
def test_zero_identities_keep_the_sign_of_zero(op, zero, fires_):
    m = x_model(_then_reciprocal(op), [5], 1, {"c": f32(zero)})
    rule = "add_zero" if op == "Add" else "sub_zero"
    if fires_:
        fires(rule, m, feeds={"x": ZEROS})
    else:
        refuses(rule, m, "-0.0", feeds={"x": ZEROS})


def test_add_zero_after_matmul_and_on_integers():
    """A MatMul never returns -0.0 on onnxruntime (products are added to +0.0), so the bias of
    zeros goes; integers have no -0.0."""
    x = np.array([[-1.0, -1.0], [INF, 1.0], [-0.0, 3e38]], f32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "zero"], ["s"]),
             helper.make_node("Reciprocal", ["s"], ["y"])]
    m = x_model(nodes, [3, 2], 2, {"w": np.array([[0.0, 1.0], [0.0, 2.0]], f32), "zero": np.zeros(2, f32)})
    fires("add_zero", m, feeds={"x": x})
    y, = run_ort(m, {"x": x})
    assert np.isposinf(y[0, 0])  # the product sum -1*0 + -1*0 is +0.0, as the test relies on
    xi = np.array([3, -4], np.int32)
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "zero"], ["y"])]
    m = x_model(nodes, [2], 1, {"zero": np.zeros(2, np.int32)}, dtype=TensorProto.INT32)
    fires("add_zero", m, feeds={"x": xi})


@pytest.mark.parametrize("rule,op,zero", [("add_zero", "Add", -0.0), ("sub_zero", "Sub", 0.0)])
def test_zero_that_broadcasts_x_larger_is_kept(rule, op, zero):
    refuses(rule, _binary(op, np.full((2, 2, 3), zero, f32), y_shape=(2, 2, 3)), "broadcasts x to a larger shape")


# --- division -------------------------------------------------------------------------------------


@pytest.mark.parametrize("c,rewritten", [(4.0, True), (0.25, True), (3.0, False), (0.0, False)])
def test_div_to_mul_only_when_reciprocal_is_exact(c, rewritten):
    m = model([helper.make_node("Div", ["x", "c"], ["y"])], [tinfo("x", [4])], [tinfo("y", [4])],
              [init("c", np.float32(c))])
    out = optimize(m)
    assert op_types(out) == (["Mul"] if rewritten else ["Div"])
    feeds = {"x": np.array([1.0, -3.3, 1e-38, 7e37], dtype=np.float32)}
    if c != 0:
        assert_same_outputs(m, out, feeds, rtol=0, atol=0)


@pytest.mark.parametrize("c", [2.0 ** -127, 2.0 ** 127, 2.0 ** -126, 0.25])
def test_div_to_mul_with_subnormal_and_huge_powers_of_two(c):
    """1/c of a power of two is exact, subnormal c or 1/c included (2^-127 and 2^127): x / c and
    x * (1/c) round the same exact value."""
    x = np.array([1.0, -3e-30, 1e-38, 3e38, -0.0, INF, NAN, 1.5e-45], f32)
    fires("div_to_mul", _binary("Div", f32(c), x.shape), feeds={"x": x})


@pytest.mark.parametrize("c,reason", [(3.0, "not exact"), (0.0, "zero or non-finite divisor"),
                                      (INF, "zero or non-finite divisor"), (2.0 ** -149, "leaves the type's range")],
                         ids=["three", "zero", "inf", "min-subnormal"])
def test_div_to_mul_refuses(c, reason):
    x = np.array([1.0, -3.3, 1e-38, 7e37, -0.5, 0.0], f32)
    refuses("div_to_mul", _binary("Div", f32(c), x.shape), reason, feeds={"x": x})


def test_div_to_mul_refuses_an_integer_division():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Div", ["n", "c"], ["y"])]
    m = x_model(nodes, [3], [3], {"c": np.array(4, np.int32)}, dtype=TensorProto.INT32)
    refuses("div_to_mul", m, "not a float division", feeds={"x": np.array([7, -9, 13], np.int32)})


# --- Pow ------------------------------------------------------------------------------------------


def test_pow_two_to_mul_at_the_edges():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Pow", ["n", "two"], ["y"])]
    fires("pow_two_to_mul", x_model(nodes, list(EDGE.shape), 2, {"two": f32(2)}), feeds={"x": EDGE})


def test_pow_two_becomes_mul_but_not_in_a_layer_norm():
    nodes = [helper.make_node("Pow", ["x", "two"], ["y"]),
             helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["z"], axes=[-1])]
    m = model(nodes, [tinfo("x", [2, 3])], [tinfo("y", [2, 3]), tinfo("z", [2, 1])], [init("two", np.float32(2))],
              opset=17)
    out = optimize(m)
    assert sorted(op_types(out)) == ["Mul", "Pow", "ReduceMean"]
    assert_same_outputs(m, out, feeds_for(m))


@pytest.mark.parametrize("p,y_shape,reason", [(f32(3), [2, 3], "exponent is not 2"),
                                              (np.full((1, 1, 1), 2, f32), [1, 2, 3], "the exponent broadcasts")],
                         ids=["three", "broadcasts"])
def test_pow_two_to_mul_refuses(p, y_shape, reason):
    refuses("pow_two_to_mul", _binary("Pow", p, y_shape=y_shape), reason)


def test_pow_two_to_mul_refuses_a_layer_norm_variance():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Pow", ["n", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["y"], axes=[-1])]
    refuses("pow_two_to_mul", x_model(nodes, [2, 3], [2, 1], {"two": f32(2)}), "layer norm's variance")


def test_pow_two_to_mul_refuses_an_integer():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Pow", ["n", "two"], ["y"])]
    m = x_model(nodes, [3], [3], {"two": np.array(2, np.int32)}, dtype=TensorProto.INT32)
    refuses("pow_two_to_mul", m, "not a float", feeds={"x": np.array([7, -9, 13], np.int32)})


# --- MatMul + Add -------------------------------------------------------------------------------------


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


def _matmul_add(x_shape, c, dtype=f32):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("MatMul", ["n", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "c"], ["y"])]
    w = np.array([[1, -1], [2, 0.5], [-3, 0], [1e-3, 4]]).astype(dtype)
    return x_model(nodes, x_shape, len(x_shape), {"w": w, "c": np.asarray(c, dtype)},
                   dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def test_matmul_add_to_gemm_at_the_edges():
    fires("matmul_add_to_gemm", _matmul_add(list(EDGE.shape), np.array([INF, -0.0], f32)), feeds={"x": EDGE})


@pytest.mark.parametrize("x_shape,c,dtype,reason", [([5, 3, 4], np.ones(2), f32, "not a 2-D MatMul"),
                                                    ([3, 4], np.ones((2, 3, 2)), f32, "does not broadcast to [M, N]"),
                                                    ([3, 4], np.ones(2), np.int32, "type")],
                         ids=["3-D", "bias-3-D", "int32"])
def test_matmul_add_to_gemm_refuses(x_shape, c, dtype, reason):
    m = _matmul_add(x_shape, c, dtype)
    refuses("matmul_add_to_gemm", m, reason, feeds={"x": np.arange(np.prod(x_shape)).reshape(x_shape).astype(dtype)})


# --- Gemm on flattened rows -------------------------------------------------------------------------


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_flatten_to_matmul_at_the_edges(trans_b):
    x = EDGE.reshape(1, 3, 4)
    w = np.array([[1, -1], [2, 0.5], [-3, 0], [1e-3, 4]], f32)
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["r"]),
             helper.make_node("Gemm", ["r", "w", "c"], ["g"], transB=trans_b),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"w": w.T.copy() if trans_b else w, "c": np.array([NAN, -0.0], f32),
             "flat": np.array([-1, 4], np.int64), "back": np.array([1, 3, 2], np.int64)}
    fires("gemm_flatten_to_matmul", x_model(nodes, list(x.shape), 3, inits), feeds={"x": x})


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
                 [i64("i0", 0), i64("i1", 1), i64("ax", [0]), i64("n", [last]), i64("flat", [-1, 4]),
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


@pytest.mark.parametrize("kw,reason,rows", [
    (dict(alpha=0.5), "Gemm transposes or scales A", 1),
    (dict(bias_shape=(3, 6)), "bias does not broadcast along N only", 3),
    (dict(last=3), "the second Reshape does not restore x's leading dimensions", None),  # (does not run)
    (dict(lead_from="other"), "the second Reshape does not restore x's leading dimensions", 1),
], ids=["alpha", "bias-per-row", "wrong-N", "dims-of-another-value"])
def test_gemm_on_flattened_rows_kept_when_not_provably_a_linear_layer(kw, reason, rows):
    m = _conv1d(**kw)
    out = optimize(m)
    assert "Gemm" in op_types(out)
    if rows is None:  # the model does not run: only the reason is checked
        out, report = run_rule("gemm_flatten_to_matmul", m)
        assert report.rules["gemm_flatten_to_matmul"].refused == 1 and reason in report.rules["gemm_flatten_to_matmul"].reasons
        return
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((rows, 1, 4)).astype(np.float32) for name in ("x", kw.get("lead_from", "x"))}
    refuses("gemm_flatten_to_matmul", m, reason, feeds=feeds)


def _offset_then_conv(bias):
    """x [1, 4, 4, 3] NHWC * 1/255 + 0 (a Keras Rescaling) -> Transpose -> Conv (bias ``bias``)."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["a"]), helper.make_node("Add", ["a", "zero"], ["b"]),
             helper.make_node("Transpose", ["b"], ["t"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["t", "w", *(["bias"] if bias is not None else [])], ["y"])]
    inits = [init("s", f32(1 / 255)), init("zero", np.zeros(3, f32)),
             init("w", np.random.default_rng(0).standard_normal((2, 3, 1, 1)).astype(f32))]
    if bias is not None:
        inits.append(init("bias", np.array(bias, f32)))
    return model(nodes, [tinfo("x", [1, 4, 4, 3])], [tinfo("y", [1, 2, 4, 4])], inits)


def test_add_zero_before_a_conv_with_a_bias_keeps_every_bit():
    """A Conv adds its bias to the products: b + (-0.0) and b + (+0.0) are b, so the offset of 0
    goes, even on inputs of -0.0 (checked bit for bit)."""
    x = np.zeros((1, 4, 4, 3), f32)
    x[0, :2] = -0.0
    x[0, 3] = [1.0, -2.0, 3.0]
    fires("add_zero", _offset_then_conv([0.5, -1.0]), feeds={"x": x})


@pytest.mark.parametrize("bias,why", [(None, "no bias"), ([0.5, 0.0], "a bias of 0")])
def test_add_zero_before_a_conv_that_could_show_the_sign_is_kept(bias, why):
    x = np.full((1, 4, 4, 3), -0.0, f32)
    refuses("add_zero", _offset_then_conv(bias), "-0.0", feeds={"x": x}, depends=False)
