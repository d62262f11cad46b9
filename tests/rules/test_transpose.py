"""rules/transpose.py (Transpose pairs, the identity, size-1-only Transposes as Reshape) and the pass
``transpose_optimization`` (onnxopt/layout_pass.py: Transposes pushed through layout-agnostic ops by a
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
from onnxopt.layout_pass import Cost, graph_cost, numel, plan_chain
from onnxopt.shapes import opsets_of

from .check import fires, i64, opaque, refuses, run_rule, same_outputs, x_model

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
