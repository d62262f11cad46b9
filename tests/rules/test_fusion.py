"""rules/fusion.py: BatchNormalization folded into a Conv or ConvTranspose before it, or into Mul and
Add, checked numerically with onnxruntime before and after; at the edges of floating point
(infinities and NaN in the parameters or weights, var + epsilon <= 0, zero scales, folded weights
that overflow) each fold refuses, naming why, and the outputs keep their bits."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import bn_node, bn_params, feeds_for, init, model, op_types, tinfo
from onnx import helper

from onnxopt import optimize

from .check import fires, refuses, x_model

f32 = np.float32
INF, NAN = np.inf, np.nan


def conv_bn_model(*, cin=4, cout=6, group=1, bias=True, dims=2, opset=17, dtype=np.float32,
                  transpose=False, kernel=3, seed=0, relu=True, bn_attrs=None):
    rng = np.random.default_rng(seed)
    spatial = [7] * dims
    if transpose:
        w = rng.standard_normal((cin, cout // group) + (kernel,) * dims).astype(dtype)
    else:
        w = rng.standard_normal((cout, cin // group) + (kernel,) * dims).astype(dtype)
    inits = [init("w", w), *bn_params("bn", cout, rng, dtype)]
    conv_in = ["x", "w"]
    if bias:
        inits.append(init("b", (rng.standard_normal(cout) * 0.5).astype(dtype)))
        conv_in.append("b")
    op = "ConvTranspose" if transpose else "Conv"
    nodes = [helper.make_node(op, conv_in, ["c"], name="conv", group=group, pads=[1] * (2 * dims),
                              **({"strides": [2] * dims} if transpose else {})),
             bn_node("c", "y" if not relu else "n", "bn", **(bn_attrs or {}))]
    if relu:
        nodes.append(helper.make_node("Relu", ["n"], ["y"], name="relu"))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return model(nodes, [tinfo("x", [2, cin] + spatial, elem)], [tinfo("y", dims + 2, elem)], inits, opset=opset)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(bias=False),
        dict(group=2, cin=4, cout=6),
        dict(group=4, cin=4, cout=4),  # depthwise
        dict(group=4, cin=4, cout=8, bias=False),  # depthwise with multiplier
        dict(dims=1),
        dict(dims=3, cin=2, cout=3),
        dict(opset=9),
        dict(opset=15, bn_attrs={"training_mode": 0}),
        dict(relu=False),
    ],
    ids=["plain", "no-bias", "grouped", "depthwise", "depthwise-x2", "conv1d", "conv3d", "opset9", "opset15",
         "no-relu"],
)
def test_conv_bn_fold(kw):
    m = conv_bn_model(**kw)
    out, report = optimize(m, return_report=True)
    assert "BatchNormalization" not in op_types(out)
    assert op_types(out).count("Conv") == 1
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert len(conv.input) == 3, "the folded Conv must carry a bias"
    assert report.fired == {"conv_bn_fold": 1}
    a, b = assert_same_outputs(m, out, feeds_for(m), rtol=1e-5, atol=1e-5)
    assert np.abs(a[0]).max() > 0.1  # outputs are not trivially zero


@pytest.mark.parametrize("kw", [dict(cin=32, cout=64), dict(cin=32, cout=64, bias=False),
                                dict(cin=16, cout=16, group=16, seed=3)], ids=["bias", "no-bias", "depthwise"])
def test_conv_bn_fold_is_bit_identical_on_onnxruntime(kw):
    """onnxruntime folds BatchNormalization into Conv itself when it loads the original; computed
    the same way, the folded weights are the same bits and so are the outputs."""
    m = conv_bn_model(**kw)
    out = optimize(m)
    assert "BatchNormalization" not in op_types(out)
    feeds = feeds_for(m)
    a = run_ort(m, feeds, optimize=True)[0]
    b = run_ort(out, feeds, optimize=True)[0]
    assert np.array_equal(a, b), float(np.abs(a - b).max())


def test_conv_bn_fold_fp16():
    m = conv_bn_model(dtype=np.float16)
    out = optimize(m)
    assert "BatchNormalization" not in op_types(out)
    assert_same_outputs(m, out, feeds_for(m), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(group=2, cin=4, cout=6), dict(group=4, cin=4, cout=4),
                                dict(dims=1)],
                         ids=["plain", "no-bias", "grouped", "depthwise", "convtranspose1d"])
def test_convtranspose_bn_fold(kw):
    m = conv_bn_model(transpose=True, **kw)
    out, report = optimize(m, return_report=True)
    assert op_types(out).count("ConvTranspose") == 1
    assert "BatchNormalization" not in op_types(out)
    assert report.fired == {"convtranspose_bn_fold": 1}
    assert_same_outputs(m, out, feeds_for(m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule,transpose", [("conv_bn_fold", False), ("convtranspose_bn_fold", True)])
def test_bn_folds_into_the_conv_before_it(rule, transpose):
    out, _ = fires(rule, conv_bn_model(transpose=transpose, relu=False), tol=1e-5)
    assert op_types(out) == ["ConvTranspose" if transpose else "Conv"]


def test_bn_without_conv_becomes_mul_add():
    rng = np.random.default_rng(1)
    m = model([helper.make_node("Relu", ["x"], ["r"], name="relu"), bn_node("r", "y", "bn")],
              [tinfo("x", [2, 5, 4, 3])], [tinfo("y", [2, 5, 4, 3])], bn_params("bn", 5, rng))
    out, report = optimize(m, return_report=True)
    assert sorted(op_types(out)) == ["Add", "Mul", "Relu"]
    assert report.fired == {"bn_to_mul_add": 1}
    assert_same_outputs(m, out, feeds_for(m))


def test_bn_rank2_input_becomes_mul_add():
    rng = np.random.default_rng(2)
    m = model([bn_node("x", "y", "bn")], [tinfo("x", [3, 5])], [tinfo("y", [3, 5])], bn_params("bn", 5, rng))
    out = optimize(m)
    assert sorted(op_types(out)) == ["Add", "Mul"]
    assert_same_outputs(m, out, feeds_for(m))


def test_conv_with_two_users_is_not_folded_but_bn_still_goes():
    """The Conv output feeds the BN and a graph output: folding would change that output."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), bn_node("c", "y", "bn")],
              [tinfo("x", [1, 4, 5, 5])], [tinfo("y", [1, 4, 5, 5]), tinfo("c", [1, 4, 5, 5])],
              [init("w", w), *bn_params("bn", 4, rng)])
    out, report = optimize(m, return_report=True)
    assert report.rules["conv_bn_fold"].fired == 0
    assert report.fired == {"bn_to_mul_add": 1}
    assert [o.name for o in out.graph.output] == ["y", "c"]
    assert_same_outputs(m, out, feeds_for(m))


def test_training_mode_bn_is_left_alone():
    rng = np.random.default_rng(4)
    m = model([bn_node("x", "y", "bn", training_mode=1)], [tinfo("x", [2, 3, 4, 4])], [tinfo("y", [2, 3, 4, 4])],
              bn_params("bn", 3, rng), opset=15)
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["BatchNormalization"]
    assert report.rules["bn_to_mul_add"].refused + sum(report.rules["bn_to_mul_add"].reasons.values()) >= 1
    assert any("training" in r for r in report.rules["bn_to_mul_add"].reasons)


def test_bn_with_non_constant_parameters_is_left_alone():
    rng = np.random.default_rng(5)
    params = bn_params("bn", 3, rng)
    # scale is a graph input: the caller can change it at run time
    m = model([bn_node("x", "y", "bn")], [tinfo("x", [2, 3, 4, 4]), tinfo("bn.scale", [3])],
              [tinfo("y", [2, 3, 4, 4])], params[1:])
    out = optimize(m)
    assert op_types(out) == ["BatchNormalization"]


def test_initializer_that_is_also_an_input_is_not_a_constant():
    rng = np.random.default_rng(6)
    m = conv_bn_model(relu=False)
    m.graph.input.append(tinfo("w", [6, 4, 3, 3]))  # overridable at run time
    out, report = optimize(m, return_report=True)
    assert op_types(out) == ["Conv", "BatchNormalization"]  # w can change at run time: nothing folds
    assert "'w' is not a constant" in report.rules["conv_bn_fold"].reasons
    assert "follows a Conv that could absorb it" in report.rules["bn_to_mul_add"].reasons
    feeds = feeds_for(m)
    feeds["w"] = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(m, feeds)[0], rtol=1e-5, atol=1e-5)


def test_shared_weight_is_folded_per_conv():
    """Two Conv+BN pairs sharing one weight each get their own folded weight."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1", pads=[1, 1, 1, 1]), bn_node("c1", "y1", "bn1"),
             helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]), bn_node("c2", "y2", "bn2")]
    m = model(nodes, [tinfo("x", [1, 4, 6, 6])], [tinfo("y1", 4), tinfo("y2", 4)],
              [init("w", w), *bn_params("bn1", 4, rng), *bn_params("bn2", 4, rng)])
    out = optimize(m)
    assert op_types(out) == ["Conv", "Conv"]
    assert "w" not in {i.name for i in out.graph.initializer}  # the original weight is no longer used
    assert_same_outputs(m, out, feeds_for(m))


@pytest.mark.parametrize("opset", [9, 12, 13])
def test_bn_with_training_outputs_before_opset14_is_training_mode(opset):
    """Before opset 14 the number of outputs selects training mode, even if extra outputs are unused."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((3, 3, 3, 3)).astype(np.float32)
    bn = helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.beta", "bn.mean", "bn.var"],
                          ["y", "rm", "rv", "sm", "sv"], name="bn")
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), bn],
              [tinfo("x", [2, 3, 4, 4])], [tinfo("y", [2, 3, 4, 4])], [init("w", w), *bn_params("bn", 3, rng)],
              opset=opset)
    out, report = optimize(m, return_report=True)
    assert "BatchNormalization" in op_types(out)
    assert not report.fired
    assert_same_outputs(m, out, feeds_for(m))


def test_ir3_model_with_constant_node_weights_stays_valid():
    """Folding creates initializers; an IR 3 model would need them as graph inputs too."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((3, 3, 3, 3)).astype(np.float32)
    consts = [helper.make_node("Constant", [], [t.name], value=t) for t in [init("w", w), *bn_params("bn", 3, rng)]]
    m = model(consts + [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                        bn_node("c", "y", "bn")],
              [tinfo("x", [1, 3, 4, 4])], [tinfo("y", [1, 3, 4, 4])], opset=8)
    m.ir_version = 3
    out = optimize(m)
    onnx.checker.check_model(out, full_check=True)
    assert op_types(out) == ["Conv"]
    assert_same_outputs(m, out, feeds_for(m))
    optimize(out)  # its own output is valid input


def test_dead_user_does_not_block_folding():
    rng = np.random.default_rng(10)
    w = rng.standard_normal((3, 3, 3, 3)).astype(np.float32)
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), bn_node("c", "y", "bn"),
               helper.make_node("Relu", ["c"], ["dead"], name="dead_relu")],
              [tinfo("x", [1, 3, 4, 4])], [tinfo("y", [1, 3, 4, 4])], [init("w", w), *bn_params("bn", 3, rng)])
    out, report = optimize(m, return_report=True)
    assert report.fired == {"conv_bn_fold": 1}
    assert op_types(out) == ["Conv"]
    assert_same_outputs(m, out, feeds_for(m))


# --- at the edges of floating point -------------------------------------------------------------


def _bn_inits(scale, beta, mean, var):
    return {k: np.array(v, f32) for k, v in zip(("scale", "beta", "mean", "var"), (scale, beta, mean, var))}


X = np.array([[[1.0, -2.0, 0.5, 3.0, -0.25]]], f32)
W2 = np.array([[[1.0, 1.0]], [[0.5, -2.0]]], f32)  # two output channels, kernel 2

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
    # issue 27: the factor 1e-20 / sqrt(3e38) = 5.8e-40 is a float32 subnormal (0 where denormals are off)
    "subnormal-factor": (W2, ([1e-20, 1], [0, 0], [0, 0], [3e38, 1]), 1e-5, X, "is subnormal in float32"),
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
    refuses(f"{op.lower()}_bn_fold", x_model(nodes, list(x.shape), x.ndim, {"w": w, **_bn_inits(*params)}), reason,
            feeds={"x": x})


@pytest.mark.parametrize("params,reason", [
    (([3e38, 1], [0, 0], [0, 0], [1e-6, 1]), "inf or NaN"),  # scale / sqrt(var + eps) overflows
    (([1, 1], [0, 0], [0, 0], [-1, 1]), "var + epsilon"),
    (([1, 1], [INF, 0], [0, 0], [1, 1]), "inf or NaN"),
    (([1e-20, 1], [0, 0], [0, 0], [3e38, 1]), "is subnormal in float32"),  # the factor: 5.8e-40 (issue 27)
], ids=["scale-overflow", "negative-var", "inf-beta", "subnormal-factor"])
def test_bn_to_mul_add_refuses_non_finite_factors(params, reason):
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("BatchNormalization", ["r", "scale", "beta", "mean", "var"], ["y"])]
    x = np.array([[[1.0, 1e-30], [2.0, 0.0]]], f32)
    refuses("bn_to_mul_add", x_model(nodes, list(x.shape), x.ndim, _bn_inits(*params)), reason, feeds={"x": x})


def test_bn_to_mul_add_with_a_zero_scale_keeps_nan_and_sign():
    """x * 0 + shift is what onnxruntime's BatchNormalization computes itself: NaN for an infinite
    x, and the Add of +0.0 that follows the Mul stays (x * 0 may be -0.0)."""
    nodes = [helper.make_node("Neg", ["x"], ["r"]),
             helper.make_node("BatchNormalization", ["r", "scale", "beta", "mean", "var"], ["y"])]
    x = np.array([[[INF, 1.0, -1.0], [2.0, -0.0, NAN]]], f32)
    fires("bn_to_mul_add", x_model(nodes, list(x.shape), x.ndim, _bn_inits([0, 1], [0, 0], [0, 0], [1, 1])),
          feeds={"x": x})
