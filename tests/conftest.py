from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

import onnxopt.models
import onnxopt.rules

# The tests test this checkout: rules/ and models/ are installed as onnxopt.rules and onnxopt.models
# (setup.cfg's package_dir; an editable install maps them here). A checkout tested against another
# checkout's rules would pass or fail for the wrong code: say so, once, instead.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _pkg, _dir in ((onnxopt, "onnxopt"), (onnxopt.rules, "rules"), (onnxopt.models, "models")):
    if os.path.dirname(os.path.abspath(_pkg.__file__)) != os.path.join(_ROOT, _dir):
        raise pytest.UsageError(f"{_pkg.__name__} is imported from {os.path.dirname(_pkg.__file__)}, not this "
                                f"checkout's {_dir}/: run `pip install -e .` here (or use a virtual environment)")

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is needed to check rewrites numerically")

# A bug in a rule (its condition or replacement raising) fails the test that meets it, in this
# process and in the command lines tests start, instead of being reported and skipped.
os.environ.setdefault("ONNXOPT_STRICT", "1")


def run_ort(model: onnx.ModelProto | bytes | str, feeds: dict[str, np.ndarray], *, optimize: bool = False):
    """Outputs of onnxruntime CPU; graph optimizations off so onnxruntime's own fusions do not mask ours."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_same_outputs(before, after, feeds, *, rtol=1e-5, atol=1e-5):
    a = run_ort(before, feeds)
    b = run_ort(after, feeds)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)
    return a, b
