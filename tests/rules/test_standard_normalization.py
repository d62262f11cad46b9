"""rules/standard_normalization.py: RMS normalization as the standard RMSNormalization for ``portable``
(issue 30), where the model imports opset >= 23 and onnxruntime has the kernel; refused with the reason
otherwise. The forms are rules/normalization.py's (its tests build them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from .check import fires, refuses
from .test_normalization import H, RMS_CONSTS, TOL, build, ops, rms_nodes

RULE = "standard_rms_normalization"


@pytest.mark.parametrize("kw", [dict(), dict(form="one-div"), dict(form="div", swap=True), dict(weight=False)],
                         ids=["dynamo", "legacy", "div-swapped", "no-weight"])
def test_rms_becomes_the_standard_op_and_the_residual_add_stays(kw):
    m = build(rms_nodes(opset=23, residual=True, **kw), RMS_CONSTS, opset=23, extra_inputs=[("res", ("b", "s", H))])
    out, report = fires(RULE, m, tol=TOL)  # (target portable: the default)
    counts = ops(out)
    assert counts["RMSNormalization"] == 1 and counts["Add"] == 1, counts
    assert set(counts) <= {"Add", "RMSNormalization", "Identity"}, counts  # (no-weight's own Identity)
    node = next(x for x in out.graph.node if x.op_type == "RMSNormalization")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "" and attrs["axis"] == -1 and np.isclose(attrs["epsilon"], 1e-6)
    onnx.checker.check_model(out, full_check=True)
    assert report.fusions[RULE]["hits"] == 1


@pytest.mark.parametrize("opset", [17, 18, 22])
def test_before_opset_23_it_is_refused_with_the_reason(opset):
    _, report = refuses(RULE, build(rms_nodes(opset=opset), RMS_CONSTS, opset=opset), "the model imports opset")
    reason = next(iter(report.fusions[RULE]["reasons"]))
    assert f"opset {opset}" in reason and "from opset 23" in reason


def test_what_rms_normalization_refuses_it_refuses_too():
    """The plan is rms_normalization's: a mean over another axis than the last is refused for the same reason."""
    nodes = rms_nodes(opset=23)
    m = build(nodes, {**RMS_CONSTS, "axes": np.array([1])}, opset=23, shape=("b", 3, H))
    refuses(RULE, m, "a mean is over axes [1], not the last one")
