"""Folded constants stay in their type's range (issue 27, item 5, as a class): a rule that folds a
factor or an offset into a convolution's weights refuses when a folded value would overflow, or
become 0 or a subnormal number where the value it replaces was a normal one. A subnormal weight
keeps fewer bits than the type holds: the original scaled the sum (normal), the fold scales each
weight, and a large input then shows more than rounding's difference.

(The input preprocessing's fold, onnxopt/transforms/edges.py, is tested in tests/test_layout_preprocess_range.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import init, model, tinfo
from onnx import helper

from .check import fires, refuses

f32 = np.float32
RNG = np.random.default_rng(5)


def _conv_then(then, inits, *, weights=1.0, bias=None):
    w = (RNG.standard_normal((4, 3, 3, 3)) * weights).astype(f32)
    b = (RNG.standard_normal(4) if bias is None else np.full(4, bias)).astype(f32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), *then]
    return model(nodes, [tinfo("x", [1, 3, 6, 6])], [tinfo("y", [1, 4, 6, 6])],
                 [init("w", w), init("b", b), *[init(k, np.asarray(v, f32)) for k, v in inits.items()]])


def _large_input():
    return {"x": (RNG.standard_normal((1, 3, 6, 6)) * 1e4).astype(f32)}


def _mul(k):
    return [helper.make_node("Mul", ["c", "k"], ["y"])], {"k": np.full((4, 1, 1), k)}


def _bn(scale, mean=0.0, var=1.0, **attrs):
    return ([helper.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["y"], **attrs)],
            {"s": np.full(4, scale), "beta": np.zeros(4), "mean": np.full(4, mean), "var": np.full(4, var)})


@pytest.mark.parametrize("factor", [1e-39, 1e-43], ids=["1e-39", "1e-43"])
def test_conv_mul_fold_refuses_weights_that_become_subnormal(factor):
    """conv * 1e-43 on weights of about 1: the folded weights 1e-43 keep 7 of float32's 24 bits."""
    nodes, inits = _mul(factor)
    refuses("conv_mul_fold", _conv_then(nodes, inits), "underflow to subnormal", feeds=_large_input())


def test_conv_mul_fold_refuses_a_bias_that_becomes_subnormal():
    """Weights stay normal (1 * 1e-30), the bias 1e-10 * 1e-30 does not."""
    nodes, inits = _mul(1e-30)
    refuses("conv_mul_fold", _conv_then(nodes, inits, bias=1e-10), "folded bias underflow to subnormal",
            feeds=_large_input())


def test_conv_mul_fold_still_folds_within_the_range():
    nodes, inits = _mul(1e-20)
    fires("conv_mul_fold", _conv_then(nodes, inits), feeds=_large_input(), tol=1e-5)


def test_conv_bn_fold_refuses_weights_that_become_subnormal():
    """A normal factor (1e-30) on weights of about 1e-10: the folded weights 1e-40 are subnormal."""
    nodes, inits = _bn(1e-30)
    refuses("conv_bn_fold", _conv_then(nodes, inits, weights=1e-10), "underflow to subnormal",
            feeds={"x": (RNG.standard_normal((1, 3, 6, 6)) * 1e30).astype(f32)})


def test_conv_bn_fold_refuses_a_factor_that_is_subnormal():
    """The factor scale / sqrt(var + eps) itself subnormal (1e-39): refused before any weight is folded."""
    nodes, inits = _bn(1e-39)
    refuses("conv_bn_fold", _conv_then(nodes, inits), "subnormal in float32", feeds=_large_input())
