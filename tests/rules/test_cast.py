"""rules/cast.py: casts that change nothing, chains of casts, CastLike with a known target type."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_outputs
from helpers import model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import fires, opaque, refuses, with_opaque, x_model


def _cast(to, hide=False):
    """x -> Neg -> (Opaque) -> Cast(to) -> y."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), *([opaque("n", "h")] if hide else []),
             helper.make_node("Cast", ["h" if hide else "n"], ["y"], to=to)]
    m = x_model(nodes, [2, 3], [2, 3])
    m.graph.output[0].type.tensor_type.elem_type = to
    return m


def test_cast_elimination_fires_on_a_cast_to_the_same_type():
    out, _ = fires("cast_elimination", _cast(TensorProto.FLOAT))
    assert op_types(out) == ["Neg"]


@pytest.mark.parametrize("to,hide,reason", [(TensorProto.DOUBLE, False, "changes the type"),
                                            (TensorProto.FLOAT, True, "input dtype unknown")],
                         ids=["other-type", "unknown-type"])
def test_cast_elimination_refuses(to, hide, reason):
    refuses("cast_elimination", _cast(to, hide=hide), reason)


def _chain(x_type, mid, to):
    nodes = [helper.make_node("Abs", ["x"], ["n"]), helper.make_node("Cast", ["n"], ["a"], to=mid),
             helper.make_node("Cast", ["a"], ["y"], to=to)]
    return model(nodes, [tinfo("x", [5], x_type)], [tinfo("y", [5], to)])


@pytest.mark.parametrize("x_type,mid,to,ops", [
    (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT, ["Abs"]),  # a round trip: nothing left
    (TensorProto.INT8, TensorProto.INT32, TensorProto.FLOAT, ["Abs", "Cast"]),  # int32 holds every int8
    (TensorProto.UINT8, TensorProto.FLOAT16, TensorProto.INT64, ["Abs", "Cast"]),
], ids=["float-double-float", "int8-int32-float", "uint8-half-int64"])
def test_cast_chain_fires_through_an_exact_type(x_type, mid, to, ops):
    out, _ = fires("cast_chain", _chain(x_type, mid, to))
    assert op_types(out) == ops


@pytest.mark.parametrize("x_type,mid,to", [(TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.FLOAT),
                                           (TensorProto.INT32, TensorProto.FLOAT, TensorProto.INT32)],
                         ids=["float-half-float", "int32-float-int32"])
def test_cast_chain_refuses_a_type_that_loses_values(x_type, mid, to):
    m = _chain(x_type, mid, to)
    feeds = {"x": np.array([0.1, 1e-8, 70000.0, -3.7, 2.5], np.float32)} if x_type == TensorProto.FLOAT else \
        {"x": np.array([16777217, -1, 3, 2 ** 30 + 1, 7], np.int32)}  # (float32 rounds 2^24 + 1)
    refuses("cast_chain", m, "is not exact", feeds=feeds)


@pytest.mark.parametrize("mid,removed", [(TensorProto.DOUBLE, True), (TensorProto.FLOAT16, False),
                                         (TensorProto.INT32, False)])
def test_cast_round_trip_only_when_exact(mid, removed):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Cast", ["n"], ["a"], to=mid),
             helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT), helper.make_node("Neg", ["b"], ["y"])]
    m = model(nodes, [tinfo("x", [5])], [tinfo("y", [5])])
    out = optimize(m)
    assert op_types(out) == (["Neg", "Neg"] if removed else ["Neg", "Cast", "Cast", "Neg"])
    feeds = {"x": np.array([0.1, 1e-8, 70000.0, -3.7, 2.5], dtype=np.float32)}
    assert_same_outputs(m, out, feeds, rtol=0, atol=0)


def _castlike(hide=False):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), *([opaque("like", "l")] if hide else []),
             helper.make_node("CastLike", ["n", "l" if hide else "like"], ["y"], saturate=1)]
    m = model(nodes, [tinfo("x", [4]), tinfo("like", [1], TensorProto.FLOAT16)],
              [tinfo("y", [4], TensorProto.FLOAT16)], opset=19)
    return with_opaque(m) if hide else m


def test_castlike_to_cast_fires_when_the_target_type_is_known():
    out, _ = fires("castlike_to_cast", _castlike(), feeds={"x": np.array([1e5, -2.5, 1e-8, 3.3], np.float32),
                                                            "like": np.zeros(1, np.float16)})
    assert op_types(out) == ["Neg", "Cast"]
    cast = out.graph.node[1]
    assert {a.name: a.i for a in cast.attribute} == {"to": TensorProto.FLOAT16, "saturate": 1}


def test_castlike_to_cast_refuses_an_unknown_target_type():
    refuses("castlike_to_cast", _castlike(hide=True), "the target dtype is unknown")
