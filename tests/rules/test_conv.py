"""rules/conv.py: a Conv absorbs a per-output-channel Mul or Add that follows it, and a zero Pad
merges into the pads of a Conv or AveragePool that follows it.

The folds are exact up to rounding and refuse where folding could change more (infinities and NaN
in the constants, weights or inputs, products that overflow or flush to 0, zero factors): with
powers of two they round nothing, so onnxruntime gives the same bits before and after. The Pad
merges keep shape and values over ceil_mode, auto_pad, strides, dilations and count_include_pad,
and the merged model still loads (onnxruntime refuses pooling pads that reach the kernel size)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_same_outputs, run_ort
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import helper

from onnxopt import optimize

from .check import fires, i64, refuses, run_rule, same_outputs, x_model

f32 = np.float32
INF, NAN = np.inf, np.nan


def test_conv_absorbs_per_channel_mul_add_and_pad():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
             helper.make_node("Conv", ["p", "w"], ["c"]),
             helper.make_node("Mul", ["c", "scale"], ["m"]),
             helper.make_node("Add", ["m", "shift"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 8, 8])],
              [i64("pads", [0, 0, 1, 1, 0, 0, 1, 1]), init("w", w),
               init("scale", rng.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)),
               init("shift", rng.standard_normal((4, 1, 1)).astype(np.float32))])
    out = optimize(m)
    assert op_types(out) == ["Conv"]
    assert list(next(a for a in out.graph.node[0].attribute if a.name == "pads").ints) == [1, 1, 1, 1]
    assert_same_outputs(m, out, feeds_for(m), rtol=1e-5, atol=1e-5)


# --- conv_mul_fold, conv_add_fold ---------------------------------------------------------------------


def _per_channel(values):
    return np.array(values, f32).reshape(1, -1, 1)


X = np.array([[[1.0, -2.0, 0.5, 3.0, -0.25]]], f32)
X_EDGE = np.array([[[INF, -INF, NAN, 3e38, -0.0, 1.0, -2.0]]], f32)
W2 = np.array([[[1.0, 1.0]], [[0.5, -2.0]]], f32)  # two output channels, kernel 2


def _check(nodes, x, inits, rule, fires_, reason=""):
    """x -> nodes -> y: ``rule`` fires (the same bits on onnxruntime) or refuses naming ``reason``."""
    m = x_model(nodes, list(x.shape), x.ndim, inits)
    if fires_:
        fires(rule, m, feeds={"x": x})
    else:
        refuses(rule, m, reason, feeds={"x": x})


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
    w, c, x, fires_, reason = CONV_MUL[case]
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"]), helper.make_node("Mul", ["conv", "c"], ["y"])]
    _check(nodes, x, {"w": w, "c": c}, "conv_mul_fold", fires_, reason)


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
    bias, c, x, fires_, reason = CONV_ADD[case]
    w = np.ones((2, 1, 1), f32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"]), helper.make_node("Add", ["conv", "c"], ["y"])]
    _check(nodes, x, {"w": w, "b": bias, "c": c}, "conv_add_fold", fires_, reason)


def test_conv_mul_refuses_a_spatial_constant():
    w = np.ones((2, 1, 1, 1), np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 1, 2, 2])], [tinfo("y", [1, 2, 2, 2])],
              [init("w", w), init("s", np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2))])
    out = optimize(m)
    assert op_types(out) == ["Conv", "Mul"]
    refuses("conv_mul_fold", m, "the constant is not per output channel")


@pytest.mark.parametrize("rule,op", [("conv_mul_fold", "Mul"), ("conv_add_fold", "Add")])
def test_conv_folds_within_rounding(rule, op):
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1]), helper.make_node(op, ["c", "conv"], ["y"])]
    inits = {"w": rng.standard_normal((4, 3, 3)).astype(f32), "b": rng.standard_normal(4).astype(f32),
             "c": rng.uniform(0.5, 2, (4, 1)).astype(f32)}  # (the constant first: the pattern commutes)
    out, _ = fires(rule, x_model(nodes, [2, 3, 6], 3, inits), tol=1e-5)
    assert op_types(out) == ["Conv"]


# --- Pad merged into Conv / AveragePool pads ------------------------------------------------------------


def _pad_model(op, x_shape, extra, attrs, *, opset=19, pad_value=None, weight=None):
    """x -> Pad(extra on the spatial axes) -> op(attrs) -> y."""
    r = len(x_shape) - 2
    inits = [init("pads", np.array([0, 0] + list(extra[:r]) + [0, 0] + list(extra[r:]), np.int64))]
    pad_inputs = ["x", "pads"]
    if pad_value is not None:
        inits.append(init("value", np.float32(pad_value)))
        pad_inputs.append("value")
    op_inputs = ["p"]
    if weight is not None:
        inits.append(init("w", weight))
        op_inputs.append("w")
    nodes = [helper.make_node("Pad", pad_inputs, ["p"]), helper.make_node(op, op_inputs, ["y"], **attrs)]
    return model(nodes, [tinfo("x", x_shape)], [tinfo("y", len(x_shape))], inits, opset=opset)


def _edge_input(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:3] = [np.inf, -np.inf, np.nan]
    return x


def _merges(rule, m, x, merges, reason):
    """``rule`` merges the Pad (the same shape and bits on onnxruntime) or refuses naming ``reason``."""
    if merges:
        fires(rule, m, feeds={"x": x})
    else:
        refuses(rule, m, reason, feeds={"x": x})


# (x shape, Pad's spatial pads (begins then ends), AveragePool attributes, merges?, reason when not)
POOL_CASES = {
    # issue 11: 1x3x3x3 padded to 5x5 pools to 3x3; with the pads merged the last window would
    # start in the op's right padding and be dropped (2x2)
    "ceil-right-pad-drops-a-window": ([1, 3, 3, 3], [1, 1, 1, 1], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
                                      False, "ceil_mode"),
    "ceil-left-pad-only": ([1, 3, 3, 3], [1, 1, 0, 0], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), True, ""),
    "ceil-right-pad-same-size": ([1, 3, 4, 4], [0, 0, 1, 1], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
                                 True, ""),
    "ceil-dilated": ([1, 2, 6, 5], [1, 0, 1, 1], dict(kernel_shape=[2, 3], strides=[2, 3], dilations=[2, 1],
                                                      ceil_mode=1), True, ""),
    "floor-strided-dilated": ([1, 2, 7, 6], [1, 2, 1, 0], dict(kernel_shape=[3, 3], strides=[2, 3], dilations=[2, 1]),
                              True, ""),
    "ceil-with-op-pads": ([1, 2, 3, 3], [0, 0, 1, 1], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1,
                                                          pads=[1, 1, 0, 0]), False, "ceil_mode"),
    "ceil-with-op-pads-same-size": ([1, 2, 5, 5], [0, 1, 1, 0], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
                                                                    pads=[1, 0, 0, 1]), True, ""),
    "exclude-pad": ([1, 2, 4, 4], [1, 1, 1, 1], dict(kernel_shape=[2, 2], count_include_pad=0), False, "excludes"),
    "pad-reaches-kernel": ([1, 2, 4, 4], [2, 0, 0, 0], dict(kernel_shape=[2, 2]), False, "kernel size"),
    "valid": ([1, 2, 5, 5], [1, 1, 0, 1], dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID"), True, ""),
    "valid-ceil": ([1, 2, 5, 5], [0, 0, 1, 1], dict(kernel_shape=[2, 2], strides=[2, 2], auto_pad="VALID", ceil_mode=1),
                   False, "VALID"),
    "same-upper": ([1, 2, 5, 5], [1, 1, 1, 1], dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER"), False, "SAME_UPPER"),
    "opset11": ([1, 2, 5, 5], [1, 1, 1, 1], dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), True, ""),
}


@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_pad_into_averagepool_keeps_shape_and_values(case):
    shape, extra, attrs, merges, reason = POOL_CASES[case]
    attrs = {"count_include_pad": 1, **attrs}
    m = _pad_model("AveragePool", shape, extra, attrs, opset=11 if case == "opset11" else 19)
    _merges("pad_into_averagepool", m, _edge_input(shape), merges, reason)


# (x shape, Pad's spatial pads, Conv attributes, merges?)
CONV_CASES = {
    "strided-dilated": ([1, 2, 7, 6], [1, 2, 3, 0], dict(strides=[2, 3], dilations=[2, 1]), True),
    "pads-beyond-kernel": ([1, 2, 4, 4], [3, 0, 0, 2], dict(pads=[1, 1, 1, 1]), True),
    "valid": ([1, 2, 6, 6], [1, 1, 1, 1], dict(auto_pad="VALID", strides=[2, 2]), True),
    "notset": ([1, 2, 6, 6], [1, 1, 1, 1], dict(auto_pad="NOTSET", pads=[0, 1, 0, 1]), True),
    "same-upper": ([1, 2, 6, 6], [1, 1, 1, 1], dict(auto_pad="SAME_UPPER", strides=[2, 2]), False),
    "same-lower": ([1, 2, 5, 5], [0, 1, 1, 0], dict(auto_pad="SAME_LOWER"), False),
}


@pytest.mark.parametrize("case", list(CONV_CASES), ids=list(CONV_CASES))
def test_pad_into_conv_keeps_shape_and_values(case):
    shape, extra, attrs, merges = CONV_CASES[case]
    w = np.random.default_rng(1).standard_normal((3, shape[1], 3, 2)).astype(np.float32)
    w[0, 0, 0, 0] = np.inf  # the Pad's zeros meet it: 0 * inf is NaN in both models
    m = _pad_model("Conv", shape, extra, attrs, weight=w)
    _merges("pad_into_conv", m, _edge_input(shape), merges, "auto_pad")


@pytest.mark.parametrize("value", [-0.0, float("nan"), 1.0])
def test_pad_value_other_than_positive_zero_is_kept(value):
    # (6 elements: windows past the three non-finite ones show what the rest does)
    m = _pad_model("AveragePool", [1, 1, 6], [1, 1], dict(kernel_shape=[2], count_include_pad=1), pad_value=value)
    refuses("pad_into_averagepool", m, "pad value is not +0.0", feeds={"x": _edge_input([1, 1, 6])})


def test_averagepool_sweep_matches_onnxruntime():
    """Every merge the rule makes over a grid of 1-D pools gives the same shape and bits; the
    grid holds both kinds (merged and refused) for ceil_mode."""
    fired = {0: 0, 1: 0}
    refused = {0: 0, 1: 0}
    for n, k, s, d, ceil, ph, pt, eh, et in itertools.product(
            [3, 4, 5], [2, 3], [1, 2, 3], [1, 2], [0, 1], [0, 1], [0, 1], [0, 1], [1, 2]):
        attrs = dict(kernel_shape=[k], strides=[s], dilations=[d], ceil_mode=ceil, count_include_pad=1,
                     pads=[ph, pt])
        m = _pad_model("AveragePool", [1, 1, n], [eh, et], attrs)
        try:
            run_ort(m, {"x": np.zeros((1, 1, n), np.float32)})
        except Exception:
            continue  # the original itself does not run (a window past the input)
        out, report = run_rule("pad_into_averagepool", m)
        if report.rules["pad_into_averagepool"].fired:
            fired[ceil] += 1
            same_outputs(m, out, {"x": _edge_input([1, 1, n], seed=n * 100 + k * 10 + s)}, depends=False)
        else:
            refused[ceil] += 1
    assert min(fired.values()) > 20 and refused[1] > refused[0] > 0, (fired, refused)


def _relu_pad_maxpool(*, relu=True, pads=(0, 0, 1, 1, 0, 0, 1, 1), kernel=(3, 3), dilations=None, indices=False):
    """x [1, 2, 7, 7] -> Relu -> zero Pad -> MaxPool (a Keras ResNet's stem: ZeroPadding2D, MaxPool VALID)."""
    attrs = {"kernel_shape": list(kernel), "strides": [2, 2]}
    if dilations:
        attrs["dilations"] = list(dilations)
    nodes = [helper.make_node("Relu" if relu else "Neg", ["x"], ["r"]), helper.make_node("Pad", ["r", "p"], ["q"]),
             helper.make_node("MaxPool", ["q"], ["y", *(["i"] if indices else [])], **attrs)]
    outs = [tinfo("y", 4)] + ([tinfo("i", 4, 7)] if indices else [])  # (7: int64)
    return model(nodes, [tinfo("x", [1, 2, 7, 7])], outs, [i64("p", list(pads))])


def test_pad_into_maxpool_after_relu():
    """Every window keeps an element >= 0, so MaxPool's -inf padding takes the maximum the zeros did;
    inputs all negative in places (the windows' maxima are the pad's 0 and Relu's 0 alike)."""
    x = np.random.default_rng(3).standard_normal((1, 2, 7, 7)).astype(np.float32)
    x[0, 0, :3] = -1.0
    out, _ = fires("pad_into_maxpool", _relu_pad_maxpool(), feeds={"x": x})
    assert op_types(out) == ["Relu", "MaxPool"]


@pytest.mark.parametrize("kw,reason", [
    ({"relu": False}, "not a Relu's output"),
    ({"pads": (0, 0, 3, 3, 0, 0, 3, 3)}, "kernel size"),
    ({"dilations": (2, 2)}, "dilated MaxPool"),
    ({"indices": True}, "the Indices output is read"),
], ids=["negative-values", "pad-reaches-kernel", "dilated", "indices"])
def test_pad_into_maxpool_refuses(kw, reason):
    refuses("pad_into_maxpool", _relu_pad_maxpool(**kw), reason)
