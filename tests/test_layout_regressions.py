"""Regression: failing tests for the I/O layout edges (issue 16); fail on main's HEAD 6c420b2."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import init, model, tinfo
from onnx import helper

from onnxopt import optimize


def _conv_model():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [tinfo("x", ["N", 3, "H", "W"])], [tinfo("y", ["N", 4, "H", "W"])],
                 [init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
                  init("b", rng.standard_normal(4).astype(np.float32))], opset=13)


@pytest.mark.parametrize("edges", [{"input_layout": "NHWC"},
                                   {"input_preprocess": {"x": "uint8,NHWC,scale=1/255"}},
                                   {"input_preprocess": {"x": "uint8,HWC,scale=1/255"}}],
                         ids=["nhwc", "uint8-nhwc", "uint8-hwc"])
def test_verify_with_input_shapes_and_edges(edges):
    """Regression: api._optimize computes the verifier's run shapes (run_shapes) from
    loaded.model *after* layouts.apply edited its inputs, so the original model is then asked for
    inputs of the edited layout ([1, 8, 6, 3] for x [N, 3, H, W]): UsageError "--input-shape x:
    dimension 8 where the model fixes 3" (or "rank 3" for HWC). Without verify= it works; the
    docstring says input_shapes are in the model's own layout. Fix: take run_shapes before
    layouts.apply (right after fix_input_shapes)."""
    out, report = optimize(_conv_model(), verify=True, return_report=True, input_shapes={"x": [1, 3, 8, 6]}, **edges)
    assert report.verification["ok"], report.verification


def test_output_layout_on_an_output_that_is_an_input():
    """Regression: an output that is also a graph input (a passthrough x2) given
    --output-layout NHWC: layout._edit_output renames the value itself (old.name = "x2_nchw"), so
    the model's *input* is renamed too and callers feeding "x2" fail (verify reports not ok).
    apply refuses the input-side case ("is also an output of the model"); the output side should
    refuse likewise (or skip such outputs under an ALL layout)."""
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 3, 4, 4]), tinfo("x2", [1, 3, 4, 4])],
              [tinfo("y", [1, 3, 4, 4]), tinfo("x2", [1, 3, 4, 4])], opset=13)
    from onnxopt.errors import UsageError
    try:
        out, report = optimize(m, output_layout="NHWC", verify=True, return_report=True)
    except UsageError:
        return
    assert [i.name for i in out.graph.input] == ["x", "x2"], [i.name for i in out.graph.input]
    assert report.verification["ok"], report.verification


def test_edges_applied_to_an_already_edited_model():
    """Regression: optimize(m, input_layout=NHWC) -> m1; optimize(m1, output_layout=NHWC,
    verify=True) -> m2. layouts.apply overwrites metadata onnxopt.io_layout with the new record only
    (m2's says nothing of x being NHWC), and the verifier ignores the edges whenever the original
    has a record (verify: ``edges = ... if not edges_of(before) else None``): the second verify
    reports not ok, and verify(m, m2) fails too, though m2 is right. Fix: merge the records in
    apply (or refuse edges on a model that has them), and let the verifier apply the difference."""
    from onnxopt.verify import verify

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    m = model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 8, 8])],
              [init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32))], opset=13)
    m1 = optimize(m, input_layout="NHWC")
    m2, report = optimize(m1, output_layout="NHWC", verify=True, return_report=True)
    assert report.verification["ok"], "m1 -> m2 verification"
    assert verify(m, m2)["ok"], "m -> m2 verification"
