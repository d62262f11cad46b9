"""rules/sequence.py: SequenceAt of SplitToSequence is an output of a Split."""

from __future__ import annotations

import pytest
from conftest import assert_same_outputs
from helpers import feeds_for, model, op_types, tinfo
from onnx import helper

from onnxopt import optimize

from .check import fires, i64, opaque, refuses, x_model


def test_sequence_at_of_split_to_sequence_becomes_one_split():
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "i0"], ["a"]),
             helper.make_node("SequenceAt", ["seq", "i2"], ["b"]),
             helper.make_node("SequenceAt", ["seq", "im1"], ["c"]),
             helper.make_node("Sum", ["a", "b"], ["y"]), helper.make_node("Neg", ["c"], ["z"])]
    m = model(nodes, [tinfo("x", [2, 6])], [tinfo("y", [2, 2]), tinfo("z", [2, 2])],
              [i64("split", [2, 2, 2]), i64("i0", 0), i64("i2", 2), i64("im1", -1)])
    out = optimize(m)
    assert sorted(op_types(out)) == ["Neg", "Split", "Sum"]
    assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("sequence_at_split", m, times=3)  # one Split each (common-subexpression elimination merges them)
    assert sorted(op_types(out)) == ["Neg", "Split", "Split", "Split", "Sum"]


def _at(i, split=None, opset=17, hide=False, y_shape=(2,), **attrs):
    """x [2, 3] -> (Opaque) -> SplitToSequence(split, **attrs) -> SequenceAt(i) -> Neg -> y."""
    nodes = [*([opaque("x", "h")] if hide else []),
             helper.make_node("SplitToSequence", ["h" if hide else "x", *(["split"] if split is not None else [])],
                              ["seq"], **attrs),
             helper.make_node("SequenceAt", ["seq", "i"], ["a"]), helper.make_node("Neg", ["a"], ["y"])]
    inits = [i64("i", i)] + ([i64("split", split)] if split is not None else [])
    return x_model(nodes, [2, 3], list(y_shape), inits, opset=opset)


@pytest.mark.parametrize("kw", [dict(axis=1), dict(axis=1, keepdims=0), dict(axis=0, opset=11, y_shape=(1, 3)),
                                dict(axis=1, split=[1, 2], y_shape=(2, 2)), dict(axis=1, split=2, y_shape=(2, 1))],
                         ids=["pieces-of-1", "keepdims-0", "opset11", "sizes", "scalar-split"])
def test_sequence_at_split_fires_on_known_pieces(kw):
    kw.setdefault("y_shape", (2, 1) if kw.get("keepdims", 1) else (2,))
    out, _ = fires("sequence_at_split", _at(-1, **kw))
    assert "SplitToSequence" not in op_types(out) and "Split" in op_types(out)


def test_sequence_at_split_refuses_unknown_pieces():
    refuses("sequence_at_split", _at(0, hide=True, axis=1, y_shape=(2, 1)), "the pieces are not known")


def test_scalar_split_with_keepdims_0_is_left_alone():
    """The spec ignores keepdims when split is given; onnxruntime squeezes for a scalar split."""
    nodes = [helper.make_node("SplitToSequence", ["x", "one"], ["seq"], axis=0, keepdims=0),
             helper.make_node("SequenceAt", ["seq", "i0"], ["y"])]
    m = model(nodes, [tinfo("x", [3, 4])], [tinfo("y", [4])], [i64("one", 1), i64("i0", 0)])
    out = optimize(m)
    assert "SplitToSequence" in op_types(out)
    assert_same_outputs(m, out, feeds_for(m))
    refuses("sequence_at_split", m, "onnxruntime and the spec disagree")
