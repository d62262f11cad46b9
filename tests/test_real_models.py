"""Real architectures: torchvision classifiers exported with BatchNormalization kept.

Random weights (no model hub here) with BatchNormalization statistics measured on photographs
(onnxopt.models.torchvision_models), so outputs follow inputs; outputs are
compared with onnxruntime on the same input before and after optimization.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_ort

from onnxopt import optimize

torch = pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to build torchvision models")
pytest.importorskip("PIL", reason="torchvision needs pillow")

from onnxopt.models import torchvision_models  # noqa: E402

CASES = [
    ("resnet50", "legacy"),
    ("mobilenet_v2", "legacy"),
    ("efficientnet_b0", "legacy"),
    ("mobilenet_v2", "dynamo"),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}
    root = tmp_path_factory.mktemp("torchvision")

    def get(name, exporter):
        key = (name, exporter)
        if key not in cache:
            cache[key] = torchvision_models.export(name, root / f"{name}_{exporter}.onnx", exporter=exporter)
        return cache[key]

    return get


@pytest.mark.parametrize("name,exporter", CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_torchvision_model(exported, tmp_path, name, exporter):
    src = exported(name, exporter)
    before_bytes = src.read_bytes()
    dst = tmp_path / "opt.onnx"
    _, report = optimize(src, output=dst, return_report=True)
    assert src.read_bytes() == before_bytes
    assert sum(report.after.values()) <= sum(report.before.values())
    # every BatchNormalization follows a Conv with constant weights (in the dynamo export once
    # constant folding has computed the conv bias the exporter builds at run time): all fold away
    assert "BatchNormalization" not in report.after
    if exporter == "legacy":
        assert report.before["BatchNormalization"] > 10
        assert "BatchNormalization" not in report.after
        assert report.fired["conv_bn_fold"] == report.before["BatchNormalization"]
        assert report.after["Conv"] == report.before["Conv"]
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    a = run_ort(str(src), {"input": x})[0]
    b = run_ort(str(dst), {"input": x})[0]
    assert a.shape == b.shape == (1, 1000)
    scale = np.abs(a).max()
    assert scale > 1e-3
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, scale))
    # and the same argmax, which is what a classifier's user sees
    assert int(a.argmax()) == int(b.argmax())
    assert onnx.load(str(dst), load_external_data=False).ir_version <= 13
