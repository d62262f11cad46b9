"""rules/standard_rotary.py: x * cos + rotate_half(x) * sin as the standard RotaryEmbedding for ``portable``
(issue 30): the model's own cos/sin halves as [B, S, rot/2] caches, no position_ids; where the model imports
opset >= 23 and onnxruntime has the kernel, refused with the reason otherwise. The forms are rules/rotary.py's
(``rotary_model`` builds them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import tinfo
from onnx import helper

from .check import fires, refuses
from .test_rotary import B, H, N, S, TOL, _feeds, rotary_model

ort = pytest.importorskip("onnxruntime")

RULE = "standard_rotary_embedding"


def at(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    model.opset_import[0].version = opset  # (rotary_model's ops are the same at 18 and 23)
    return model


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("split", [False, True], ids=["slices", "split"])
def test_rotary_becomes_the_standard_op_reading_the_models_cos_and_sin(split):
    out, report = fires(RULE, at(rotary_model(split=split), 23), feeds=_feeds(), tol=TOL)
    ops = [n.op_type for n in out.graph.node]
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    assert ops.count("RotaryEmbedding") == 1 and "Neg" not in ops and "Cos" in ops and "Sin" in ops
    assert node.domain == "" and len(node.input) == 3 and node.input[0] == "x"  # no position_ids
    assert _attrs(node) == {"interleaved": 0}  # (4-D input: no num_heads; the whole head rotated)
    onnx.checker.check_model(out, full_check=True)
    assert report.fusions[RULE]["hits"] == 1


def test_partial_rotary_takes_the_whole_head_with_its_rotary_dim():
    out, _ = fires(RULE, at(rotary_model(partial=4), 23), feeds=_feeds(width=H + 4), tol=TOL)
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    assert _attrs(node)["rotary_embedding_dim"] == H and node.input[0] == "x"
    assert not [n for n in out.graph.node if n.op_type == "Concat" and n.output[0] == "y"]


def test_positions_shared_by_the_batch_are_expanded_to_it():
    """cos/sin of [1, S] positions: the kernel takes [B, S, rot/2] caches only, so they are Expanded."""
    out, _ = fires(RULE, at(rotary_model(pos_batch=1), 23), feeds=_feeds(pos_batch=1), tol=TOL)
    assert [n.op_type for n in out.graph.node].count("Expand") == 2  # (cos and sin)


def test_the_caches_are_built_once_for_q_and_k():
    m = at(rotary_model(), 23)
    g = m.graph
    shared = ("C4", "S4", "h2", "zero", "big", "last")
    for node in list(g.node)[-7:]:  # the two Slices, Neg, Concat, the two Muls and the Add, on k
        c = onnx.NodeProto()
        c.CopyFrom(node)
        c.input[:] = ["k" if i == "x" else i if i in shared else i + "_k" for i in node.input]
        c.output[:] = ["yk" if o == "y" else o + "_k" for o in node.output]
        g.node.append(c)
    g.input.append(tinfo("k", ["b", N, "s", H]))
    g.output.append(tinfo("yk", ["b", N, "s", H]))
    feeds = {**_feeds(), "k": np.random.default_rng(5).standard_normal((B, N, S, H)).astype(np.float32)}
    out, _ = fires(RULE, m, times=2, feeds=feeds, tol=TOL)
    rotary = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 2 and rotary[0].input[1:] == rotary[1].input[1:]


@pytest.mark.parametrize("opset", [18, 22])
def test_before_opset_23_it_is_refused_with_the_reason(opset):
    _, report = refuses(RULE, at(rotary_model(), opset), f"the model imports opset {opset}", feeds=_feeds())
    assert any("RotaryEmbedding is a standard op from opset 23" in r for r in report.fusions[RULE]["reasons"])


def test_what_rotary_embedding_refuses_it_refuses_too():
    refuses(RULE, at(rotary_model(second="scaled"), 23), "not half-periodic", feeds=_feeds())
