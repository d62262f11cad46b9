"""scripts/bench/_quant_quark.py, the AMD Quark peer of the quantization benchmark (issue 14).

The worker runs in Quark's own virtual environment (amd-quark pins older onnx/onnxruntime than this project):
``ONNXOPT_QUARK_PYTHON`` names its interpreter (default /work/quark-venv/bin/python). The quantizing test skips
when that interpreter or amd-quark is absent (CI has neither); the argument and calibration-data checks happen
before Quark is imported, so they run with this interpreter everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.helpers import init, model, tinfo

ort = pytest.importorskip("onnxruntime")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "_quant_quark.py"
QUARK_PYTHON = os.environ.get("ONNXOPT_QUARK_PYTHON", "/work/quark-venv/bin/python")


def _quark_python() -> str:
    if not os.path.exists(QUARK_PYTHON):
        pytest.skip(f"no Quark environment at {QUARK_PYTHON} (set ONNXOPT_QUARK_PYTHON)")
    probe = subprocess.run([QUARK_PYTHON, "-c", "import importlib.metadata as m; print(m.version('amd-quark'))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"amd-quark is not installed in {QUARK_PYTHON}")
    return QUARK_PYTHON


def _conv_model() -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> GlobalAveragePool -> Flatten -> Gemm, fixed random weights."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="fc", transB=1),
    ]
    inits = [
        init("w1", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)),
        init("b1", (rng.standard_normal(8) * 0.1).astype(np.float32)),
        init("w2", (rng.standard_normal((16, 8, 3, 3)) * 0.15).astype(np.float32)),
        init("b2", (rng.standard_normal(16) * 0.1).astype(np.float32)),
        init("wf", (rng.standard_normal((10, 16)) * 0.3).astype(np.float32)),
        init("bf", (rng.standard_normal(10) * 0.1).astype(np.float32)),
    ]
    return model(nodes, [tinfo("x", [1, 3, 16, 16])], [tinfo("y", [1, 10])], inits, opset=13)


def _feeds(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(count)]


def _setup(tmp_path: Path, key: str = "x") -> tuple[Path, Path]:
    path = tmp_path / "float.onnx"
    onnx.save(_conv_model(), path)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, feed in enumerate(_feeds(8, 1)):
        np.savez(calib / f"{i:03d}.npz", **{key: feed["x"]})
    return path, calib


def _run(python: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_bad_calibration_is_one_line_exit_2(tmp_path):
    path, calib = _setup(tmp_path, key="image")
    res = _run(sys.executable, "--model", path, "--calib", calib, "--out", tmp_path / "q.onnx", "--variant", "a8w8")
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("a8w8: calibration feed 000.npz:"), res.stderr
    assert "'image'" in lines[0] and "'x'" in lines[0]
    assert not (tmp_path / "q.onnx").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run(sys.executable, "--model", path, "--calib", empty, "--out", tmp_path / "q.onnx", "--variant", "cle")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"cle: calibration folder {str(empty)!r} has no .npz files"]


def test_a8w8_writes_a_qdq_model_onnxruntime_runs(tmp_path):
    python = _quark_python()
    path, calib = _setup(tmp_path)
    out = tmp_path / "q.onnx"
    res = _run(python, "--model", "float.onnx", "--calib", "calib", "--out", "q.onnx", "--variant", "a8w8",
               "--per-channel", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert sorted(os.listdir(tmp_path)) == ["calib", "float.onnx", "q.onnx"]  # Quark's stray files kept out
    lines = res.stdout.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["variant"] == "a8w8" and record["per_channel"] is True and record["calibration_feeds"] == 8
    assert record["seconds"] > 0 and record["quark_version"]
    assert record["config"]["global_config"]["weight"]["quant_granularity"] == "QuantGranularity.Channel"
    assert record["config"]["global_config"]["activation"]["data_type"] == "Int8"

    quant = onnx.load(out)
    ops = [n.op_type for n in quant.graph.node]
    assert ops.count("QuantizeLinear") >= 2 and ops.count("DequantizeLinear") >= 5
    # the weights are stored as int8 behind DequantizeLinear, not as float
    dq_inputs = {n.input[0] for n in quant.graph.node if n.op_type == "DequantizeLinear"}
    int8_inits = [i for i in quant.graph.initializer
                  if i.name in dq_inputs and i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 4]
    assert len(int8_inits) == 2

    so = ort.SessionOptions()
    so.log_severity_level = 3
    f_sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    q_sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    ref = np.concatenate([f_sess.run(None, feed)[0] for feed in _feeds(8, 2)])
    got = np.concatenate([q_sess.run(None, feed)[0] for feed in _feeds(8, 2)])
    sqnr = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - got).astype(np.float64) ** 2))
    assert 15 < sqnr < 80, sqnr  # quantized (not a float copy) and close to the float model
