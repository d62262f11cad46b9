"""--input-preprocess whose constants leave float32's range (issue 27, item 5): the fold into the
first Convs keeps the element-wise chain where a folded constant would not be finite or would
underflow (scale=1e-39 on a padded Conv made the offset mean/scale = -5e38, inf in float32, and
every output NaN); coefficients that are themselves out of float32's range are a usage error (one
line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import init, model, tinfo
from onnx import helper

from onnxopt.transforms import edges as layout
from onnxopt import optimize
from onnxopt.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent


def _conv(pads):
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[pads] * 4)]
    side = 8 if pads else 6
    return model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, side, side])],
                 [init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
                  init("b", rng.standard_normal(4).astype(np.float32))])


def _run(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("pads,spec,reason", [
    (1, "uint8,HWC,scale=1e-39,mean=0.5", "offset"),  # -0.5 / 1e-39 overflows float32
    (1, "uint8,HWC,scale=1e-45,mean=0.5,0.4,0.3", "offset"),
    (0, "uint8,HWC,scale=1e-30,std=1e10", "weights"),  # a = 1e-40: the folded weights subnormal
], ids=["padded-1e-39", "padded-1e-45", "unpadded-subnormal"])
def test_preprocessing_whose_fold_leaves_the_range_stays_element_wise(pads, spec, reason):
    m = _conv(pads)
    out, report = optimize(m, input_preprocess={"x": spec}, return_report=True)
    rec = report.layout["inputs"]["x"]
    assert rec["folded"] is None and reason in rec["not_folded"], rec
    assert "Mul" in [n.op_type for n in out.graph.node]  # the chain stayed
    onnx.checker.check_model(out, full_check=True)
    pre = layout.parse_preprocess({"x": spec})["x"]
    for seed in range(3):
        pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        want, got = _run(m, {"x": layout.reference_input(pixels, pre)}), _run(out, {"x": pixels})
        assert np.all(np.isfinite(got)), got
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_preprocessing_within_the_range_still_folds():
    out, report = optimize(_conv(1), input_preprocess={"x": "uint8,HWC,scale=1/255,mean=0.5"}, return_report=True)
    assert report.layout["inputs"]["x"]["folded"].startswith("weights")


@pytest.mark.parametrize("spec,message", [
    ("uint8,HWC,scale=1e30,std=1e-30", "out of float32's range"),  # scale/std = 1e60
    ("uint8,HWC,mean=1e30,std=1e-30", "out of float32's range"),
    ("uint8,HWC,scale=1e-50", "rounds to 0 in float32"),
], ids=["scale-over-std", "mean-over-std", "scale-to-zero"])
def test_coefficients_out_of_float32_are_a_usage_error(spec, message):
    with pytest.raises(UsageError, match=message):
        optimize(_conv(1), input_preprocess={"x": spec})


def test_cli_says_so_in_one_line_with_exit_2(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_conv(1), src)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "onnxopt", str(src), "-o", str(tmp_path / "out.onnx"),
                        "--input-preprocess", "x=uint8,HWC,scale=1e30,std=1e-30"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "out of float32's range" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out.onnx").exists()
