"""A zero Pad merged into Conv / AveragePool pads: shape and values must stay what onnxruntime
computes, over ceil_mode, auto_pad, strides, dilations and count_include_pad, and the merged
model must still load (onnxruntime refuses pooling pads that reach the kernel size)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import helper

from onnxopt import optimize


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


def _assert_identical(m, out, x):
    """Same shape, same bits (NaN where NaN, the same infinities and signs of zero)."""
    a, = run_ort(m, {"x": x})
    b, = run_ort(out, {"x": x})
    assert a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


def _fired(report, rule):
    return report.fired.get(rule, 0) == 1


def _reasons(report, rule):
    stats = report.rules.get(rule)
    return " | ".join(stats.reasons) if stats else ""


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
    out, report = optimize(m, return_report=True)
    assert _fired(report, "pad_into_averagepool") == merges, _reasons(report, "pad_into_averagepool")
    if not merges:
        assert reason in _reasons(report, "pad_into_averagepool")
    _assert_identical(m, out, _edge_input(shape))


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
    out, report = optimize(m, return_report=True)
    assert _fired(report, "pad_into_conv") == merges, _reasons(report, "pad_into_conv")
    if not merges:
        assert "auto_pad" in _reasons(report, "pad_into_conv")
    _assert_identical(m, out, _edge_input(shape))


@pytest.mark.parametrize("value", [-0.0, float("nan"), 1.0])
def test_pad_value_other_than_positive_zero_is_kept(value):
    m = _pad_model("AveragePool", [1, 1, 4], [1, 1], dict(kernel_shape=[2], count_include_pad=1), pad_value=value)
    out, report = optimize(m, return_report=True)
    assert not _fired(report, "pad_into_averagepool")
    _assert_identical(m, out, _edge_input([1, 1, 4]))


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
        out, report = optimize(m, return_report=True)
        if _fired(report, "pad_into_averagepool"):
            fired[ceil] += 1
            _assert_identical(m, out, _edge_input([1, 1, n], seed=n * 100 + k * 10 + s))
        else:
            refused[ceil] += 1
    assert min(fired.values()) > 20 and refused[1] > refused[0] > 0, (fired, refused)
