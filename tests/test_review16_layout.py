"""REVIEW 16: failing tests for the I/O layout edges (issue 16); fail on main's HEAD 6c420b2."""

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
def test_review16_verify_with_input_shapes_and_edges(edges):
    """REVIEW 16 (bug): api._optimize computes the verifier's run shapes (run_shapes) from
    loaded.model *after* layouts.apply edited its inputs, so the original model is then asked for
    inputs of the edited layout ([1, 8, 6, 3] for x [N, 3, H, W]): UsageError "--input-shape x:
    dimension 8 where the model fixes 3" (or "rank 3" for HWC). Without verify= it works; the
    docstring says input_shapes are in the model's own layout. Fix: take run_shapes before
    layouts.apply (right after fix_input_shapes)."""
    out, report = optimize(_conv_model(), verify=True, return_report=True, input_shapes={"x": [1, 3, 8, 6]}, **edges)
    assert report.verification["ok"], report.verification
