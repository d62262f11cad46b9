"""Folds that combine constants into weights, and algebraic identities, at the edges of floating
point: infinities and NaN in the constants, weights or inputs, products that overflow or flush to
0, zero factors and the sign of zero. Either a rule refuses (with its reason) or onnxruntime gives
the same bits before and after (NaN where NaN, the same infinities and signs of zero)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

f32 = np.float32
INF, NAN = np.inf, np.nan


def _check(nodes, x, inits, rule, fires, reason="", *, y_rank=None, dtype=TensorProto.FLOAT):
    """Optimize x -> nodes -> y; ``rule`` fired or refused naming ``reason``; same bits on onnxruntime."""
    m = model(nodes, [tinfo("x", list(x.shape), dtype)], [tinfo("y", y_rank or x.ndim, dtype)],
              [init(k, v) for k, v in inits.items()])
    out, report = optimize(m, return_report=True)
    stats = report.rules.get(rule)
    reasons = " | ".join(stats.reasons) if stats else ""
    assert report.fired.get(rule, 0) == (1 if fires else 0), reasons
    assert reason in reasons
    a, = run_ort(m, {"x": x})
    b, = run_ort(out, {"x": x})
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(a, b, equal_nan=True), (a, b)
    if a.dtype.kind == "f":
        assert np.array_equal(np.signbit(a[~np.isnan(a)]), np.signbit(b[~np.isnan(b)])), (a, b)
    return a


def _per_channel(values):
    return np.array(values, f32).reshape(1, -1, 1)


X = np.array([[[1.0, -2.0, 0.5, 3.0, -0.25]]], f32)
X_EDGE = np.array([[[INF, -INF, NAN, 3e38, -0.0, 1.0, -2.0]]], f32)
W2 = np.array([[[1.0, 1.0]], [[0.5, -2.0]]], f32)  # two output channels, kernel 2

# (w, Mul constant, x, fires, reason)
CONV_MUL = {
    # issue 11: (1*1 + -2*1) * inf is -inf; 1*inf + -2*inf is NaN
    "inf-factor": (W2, _per_channel([INF, 2]), X, False, "inf or NaN"),
    "nan-factor": (W2, _per_channel([NAN, 2]), X, False, "inf or NaN"),
    # (conv) * 0 is -0.0 where the conv is negative; zero weights give +0.0
    "zero-factor": (W2, _per_channel([0, 2]), X, False, "zero factor"),
    # 1e30 * 1e20 overflows in the weights; x * 1e30 * 1e20 does not overflow for x = 1e-30
    "weights-overflow": (np.full((2, 1, 1), 1e30, f32), _per_channel([1e20, 2]), np.full((1, 1, 3), 1e-30, f32),
                         False, "overflow"),
    # 1e-30 * 1e-20 flushes to 0 in the weights; 1e30 * 1e-30 * 1e-20 is 1e-20
    "weights-underflow": (np.full((2, 1, 1), 1e-30, f32), _per_channel([1e-20, 2]), np.full((1, 1, 3), 1e30, f32),
                          False, "underflow"),
    "inf-weights": (np.array([[[INF, 1.0]], [[1.0, 1.0]]], f32), _per_channel([0.5, 2]), X, False, "inf or NaN"),
    # powers of two: exact, so the folded model gives the same bits, infinities and NaN of x included
    "edge-inputs": (W2, _per_channel([0.5, -4]), X_EDGE, True, ""),
}


@pytest.mark.parametrize("case", list(CONV_MUL), ids=list(CONV_MUL))
def test_conv_mul_fold_at_the_edges(case):
    w, c, x, fires, reason = CONV_MUL[case]
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"]), helper.make_node("Mul", ["conv", "c"], ["y"])]
    _check(nodes, x, {"w": w, "c": c}, "conv_mul_fold", fires, reason)


# (bias, Add constant, x, fires, reason)
CONV_ADD = {
    # 3e38 + 3e38 overflows in the bias; (-3e38 + 3e38) + 3e38 does not
    "bias-overflow": (np.array([3e38, 0], f32), _per_channel([3e38, 2]), np.full((1, 1, 3), -3e38, f32),
                      False, "overflow"),
    "inf-constant": (np.array([1, 0], f32), _per_channel([INF, 2]), X, False, "inf or NaN"),
    "nan-bias": (np.array([NAN, 0], f32), _per_channel([1, 2]), X, False, "inf or NaN"),
    "edge-inputs": (np.array([1, -3], f32), _per_channel([4, 0.5]), X_EDGE, True, ""),
}


@pytest.mark.parametrize("case", list(CONV_ADD), ids=list(CONV_ADD))
def test_conv_add_fold_at_the_edges(case):
    bias, c, x, fires, reason = CONV_ADD[case]
    w = np.ones((2, 1, 1), f32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"]), helper.make_node("Add", ["conv", "c"], ["y"])]
    _check(nodes, x, {"w": w, "b": bias, "c": c}, "conv_add_fold", fires, reason)


def _bn_inits(scale, beta, mean, var):
    return {k: np.array(v, f32) for k, v in zip(("scale", "beta", "mean", "var"), (scale, beta, mean, var))}


# (conv weights, BatchNormalization scale/beta/mean/var, epsilon, x, reason); none folds
CONV_BN = {
    # scale / sqrt(var + eps) ~ 3e35 times weights 1e20 overflows; the conv of x = 1e-30 then BN does not
    "weights-overflow": (np.full((2, 1, 1), 1e20, f32), ([1e30, 1], [0, 0], [0, 0], [1e-30, 1]), 1e-5,
                         np.full((1, 1, 3), 1e-30, f32), "overflow"),
    # scale 0, beta -0.0: (conv) * 0 + -0.0 is -0.0 where the conv is negative; zero weights give +0.0
    "zero-scale": (W2, ([0, 1], [-0.0, 0], [0, 0], [1, 1]), 1e-5, X, "zero factor"),
    "inf-scale": (W2, ([INF, 1], [0, 0], [1, 0], [1, 1]), 1e-5, X, "inf or NaN"),
    "nan-mean": (W2, ([1, 1], [0, 0], [NAN, 0], [1, 1]), 1e-5, X, "inf or NaN"),
    "var-plus-eps-zero": (W2, ([1, 1], [0, 0], [0, 0], [0, 1]), 0.0, X, "var + epsilon"),
    "negative-var": (W2, ([1, 1], [0, 0], [0, 0], [-1, 1]), 1e-5, X, "var + epsilon"),
    "inf-weights": (np.array([[[INF, 1.0]], [[1.0, 1.0]]], f32), ([1, 1], [0, 0], [0, 0], [1, 1]), 1e-5, X,
                    "inf or NaN"),
}


@pytest.mark.parametrize("transpose", [False, True], ids=["conv", "convtranspose"])
@pytest.mark.parametrize("case", list(CONV_BN), ids=list(CONV_BN))
def test_conv_bn_fold_at_the_edges(case, transpose):
    w, params, eps, x, reason = CONV_BN[case]
    op = "ConvTranspose" if transpose else "Conv"
    if transpose:
        w = np.ascontiguousarray(w.transpose(1, 0, 2))  # (C_in, C_out, k)
    nodes = [helper.make_node(op, ["x", "w"], ["conv"]),
             helper.make_node("BatchNormalization", ["conv", "scale", "beta", "mean", "var"], ["y"], epsilon=eps)]
    _check(nodes, x, {"w": w, **_bn_inits(*params)}, f"{op.lower()}_bn_fold", False, reason)


@pytest.mark.parametrize("params,reason", [
    (([3e38, 1], [0, 0], [0, 0], [1e-6, 1]), "inf or NaN"),  # scale / sqrt(var + eps) overflows
    (([1, 1], [0, 0], [0, 0], [-1, 1]), "var + epsilon"),
    (([1, 1], [INF, 0], [0, 0], [1, 1]), "inf or NaN"),
], ids=["scale-overflow", "negative-var", "inf-beta"])
def test_bn_to_mul_add_refuses_non_finite_factors(params, reason):
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("BatchNormalization", ["r", "scale", "beta", "mean", "var"], ["y"])]
    x = np.array([[[1.0, 1e-30], [2.0, 0.0]]], f32)
    _check(nodes, x, _bn_inits(*params), "bn_to_mul_add", False, reason)


def test_bn_to_mul_add_with_a_zero_scale_keeps_nan_and_sign():
    """x * 0 + shift is what onnxruntime's BatchNormalization computes itself: NaN for an infinite
    x, and the Add of +0.0 that follows the Mul stays (x * 0 may be -0.0)."""
    nodes = [helper.make_node("Neg", ["x"], ["r"]),
             helper.make_node("BatchNormalization", ["r", "scale", "beta", "mean", "var"], ["y"])]
    x = np.array([[[INF, 1.0, -1.0], [2.0, -0.0, NAN]]], f32)
    _check(nodes, x, _bn_inits([0, 1], [0, 0], [0, 0], [1, 1]), "bn_to_mul_add", True)


# --- algebraic identities and the sign of zero ---------------------------------------------------


def _then_reciprocal(op, c_name="c"):
    """Neg(x) op c -> Reciprocal: 1/x tells -0.0 (-inf) from +0.0 (+inf)."""
    return [helper.make_node("Neg", ["x"], ["n"]), helper.make_node(op, ["n", c_name], ["s"]),
            helper.make_node("Reciprocal", ["s"], ["y"])]


ZEROS = np.array([0.0, -0.0, 1.0, INF, NAN], f32)


@pytest.mark.parametrize("op,zero,fires", [
    ("Add", 0.0, False),   # issue 11: -0.0 + 0.0 is +0.0; 1/x gives +inf, without the Add -inf
    ("Add", -0.0, True),   # x + -0.0 is x for every x
    ("Sub", -0.0, False),  # -0.0 - -0.0 is +0.0
    ("Sub", 0.0, True),    # x - 0.0 is x for every x
], ids=["add+0", "add-0", "sub-0", "sub+0"])
def test_zero_identities_keep_the_sign_of_zero(op, zero, fires):
    _check(_then_reciprocal(op), ZEROS, {"c": f32(zero)}, "add_zero" if op == "Add" else "sub_zero", fires,
           "" if fires else "-0.0")


def test_add_zero_after_matmul_and_on_integers():
    """A MatMul never returns -0.0 on onnxruntime (products are added to +0.0), so the bias of
    zeros goes; integers have no -0.0."""
    x = np.array([[-1.0, -1.0], [INF, 1.0], [-0.0, 3e38]], f32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "zero"], ["s"]),
             helper.make_node("Reciprocal", ["s"], ["y"])]
    y = _check(nodes, x, {"w": np.array([[0.0, 1.0], [0.0, 2.0]], f32), "zero": np.zeros(2, f32)}, "add_zero", True)
    assert np.isposinf(y[0, 0])  # the product sum -1*0 + -1*0 is +0.0, as the test relies on
    xi = np.array([3, -4], np.int32)
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "zero"], ["y"])]
    _check(nodes, xi, {"zero": np.zeros(2, np.int32)}, "add_zero", True, dtype=TensorProto.INT32)


@pytest.mark.parametrize("c", [2.0 ** -127, 2.0 ** 127, 2.0 ** -126, 0.25])
def test_div_to_mul_with_subnormal_and_huge_powers_of_two(c):
    """1/c of a power of two is exact, subnormal c or 1/c included (2^-127 and 2^127): x / c and
    x * (1/c) round the same exact value."""
    x = np.array([1.0, -3e-30, 1e-38, 3e38, -0.0, INF, NAN, 1.5e-45], f32)
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Div", ["n", "c"], ["y"])]
    _check(nodes, x, {"c": f32(c)}, "div_to_mul", True)


EDGE = np.array([[INF, -INF, NAN, 3e38], [-0.0, 1e-45, -1e-38, 2.5], [1.0, -2.0, 0.0, 1e19]], f32)


def test_pow_two_to_mul_at_the_edges():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Pow", ["n", "two"], ["y"])]
    _check(nodes, EDGE, {"two": f32(2)}, "pow_two_to_mul", True)


def test_matmul_add_to_gemm_at_the_edges():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("MatMul", ["n", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "c"], ["y"])]
    w = np.array([[1, -1], [2, 0.5], [-3, 0], [1e-3, 4]], f32)
    _check(nodes, EDGE, {"w": w, "c": np.array([INF, -0.0], f32)}, "matmul_add_to_gemm", True)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_flatten_to_matmul_at_the_edges(trans_b):
    x = EDGE.reshape(1, 3, 4)
    w = np.array([[1, -1], [2, 0.5], [-3, 0], [1e-3, 4]], f32)
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["r"]),
             helper.make_node("Gemm", ["r", "w", "c"], ["g"], transB=trans_b),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"w": w.T.copy() if trans_b else w, "c": np.array([NAN, -0.0], f32),
             "flat": np.array([-1, 4], np.int64), "back": np.array([1, 3, 2], np.int64)}
    _check(nodes, x, inits, "gemm_flatten_to_matmul", True)
