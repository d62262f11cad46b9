"""``onnxopt.quantize()``, ``optimize(quantize=)`` and ``onnxopt quantize``: end to end on a small CNN
built here (CI) and on zoo models where present; bad input of every kind is one line and exit 2."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt.errors import UsageError

from helpers import bn_node, bn_params, init, model, tinfo

ort = pytest.importorskip("onnxruntime")


def _cnn(opset=17, dynamic_batch=False, seed=0) -> onnx.ModelProto:
    """Conv+BN+Relu, Conv+Clip(0,6), MaxPool, a residual Add, GlobalAveragePool, Flatten, Gemm: the
    shape of a small classifier, with weights large enough that int8 kernels matter."""
    rng = np.random.default_rng(seed)
    c = 16
    w1 = (rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    w3 = (rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32)
    wf = (rng.standard_normal((10, c)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        bn_node("c1", "b1", "bn1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "bias2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6"),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], name="dwconv", pads=[1, 1, 1, 1], group=c),
        helper.make_node("Add", ["c3", "p1"], ["a"], name="residual"),
        helper.make_node("GlobalAveragePool", ["a"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="fc", transB=1),
    ]
    inits = [init("w1", w1), *bn_params("bn1", c, rng), init("w2", w2),
             init("bias2", (rng.standard_normal(c) * 0.1).astype(np.float32)), init("w3", w3),
             init("lo", np.float32(0)), init("hi", np.float32(6)), init("wf", wf),
             init("bf", (rng.standard_normal(10) * 0.1).astype(np.float32))]
    x = tinfo("x", ["batch" if dynamic_batch else 1, 3, 32, 32])
    return model(nodes, [x], [tinfo("y", ["batch" if dynamic_batch else 1, 10])], inits, opset=opset)


def _feeds(n, seed=0, batch=1):
    rng = np.random.default_rng(seed)
    # smooth images (not white noise): a photograph's statistics matter for calibration
    out = []
    for _ in range(n):
        base = rng.standard_normal((batch, 3, 8, 8)).astype(np.float32)
        out.append({"x": np.repeat(np.repeat(base, 4, axis=2), 4, axis=3) + 0.1 * rng.standard_normal(
            (batch, 3, 32, 32)).astype(np.float32)})
    return out


def _run(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString() if isinstance(m, onnx.ModelProto) else str(m), so,
                                providers=["CPUExecutionProvider"])
    return [sess.run(None, f)[0] for f in feeds]


def _sqnr(ref, test):
    ref, test = np.concatenate([r.ravel() for r in ref]), np.concatenate([t.ravel() for t in test])
    return 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((ref - test).astype(np.float64) ** 2), 1e-30))


def _ops(m: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in m.graph.node}


def test_quantize_a_cnn_end_to_end():
    float_model = _cnn()
    # portable: QDQ wherever an op can be quantized (ort-cpu also leaves float what its measured cost
    # table says int8 does not speed up: below)
    q, report = onnxopt.quantize(float_model, _feeds(20), keep_float="never", return_report=True, target="portable")
    assert isinstance(q, onnx.ModelProto)
    assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(q)
    assert not {"BatchNormalization", "Relu", "Clip"} & _ops(q)  # folded, absorbed into the ranges
    weights = [i for i in q.graph.initializer if len(i.dims) == 4]
    assert weights and all(i.data_type == TensorProto.INT8 for i in weights)  # no float weight kept
    test = _feeds(8, seed=99)
    assert _sqnr(_run(float_model, test), _run(q, test)) > 25
    d = report.as_dict()
    assert d["kept"] == "int8" and d["settings"]["target"] == "portable"
    assert d["calibration"]["held_out"] == 8 and d["calibration"]["calibrated_on"] == 12
    assert d["coverage"]  # which nodes became integer kernels
    assert min(d["fidelity"]["output_sqnr_db"].values()) > 25
    assert d["settings"]["target_rules"]["followed"]


def test_ort_cpu_leaves_float_what_its_cost_table_measures_slower():
    q, report = onnxopt.quantize(_cnn(), _feeds(10), keep_float="never", fidelity=None, return_report=True)
    assert report.settings["target"] == "ort-cpu"
    costed = [why for why in report.plan["skipped"].values() if "ort_cpu_costs.json" in why]
    assert costed  # the small layers of this CNN: measured no faster in int8
    assert "QuantizeLinear" in _ops(q)


def test_keep_float_never_is_byte_identical_and_the_input_untouched(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_cnn(), src)
    before = src.read_bytes()
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, f in enumerate(_feeds(12)):
        np.savez(calib / f"{i:03d}.npz", **f)
    outs = []
    for k in range(2):
        out = onnxopt.quantize(str(src), str(calib), output=str(tmp_path / f"q{k}.onnx"), keep_float="never")
        outs.append(hashlib.sha256(Path(out).read_bytes()).hexdigest())
    assert outs[0] == outs[1]
    assert src.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]


def test_workers_give_the_same_model(tmp_path):
    feeds = _feeds(10)
    one = onnxopt.quantize(_cnn(), feeds, keep_float="never", method="entropy", workers=1)
    two = onnxopt.quantize(_cnn(), feeds, keep_float="never", method="entropy", workers=2)
    assert one.SerializeToString() == two.SerializeToString()


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
def test_every_method_quantizes(method):
    float_model = _cnn()
    q = onnxopt.quantize(float_model, _feeds(10), keep_float="never", method=method, fidelity=None)
    test = _feeds(4, seed=5)
    assert _sqnr(_run(float_model, test), _run(q, test)) > 15


def test_dynamic_batch_and_external_data(tmp_path):
    m = _cnn(dynamic_batch=True)
    src = tmp_path / "ext.onnx"
    onnx.save(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
              size_threshold=0)
    out = onnxopt.quantize(str(src), _feeds(10, batch=2), output=str(tmp_path / "q.onnx"),
                           keep_float="never", external_data=True)
    test = _feeds(2, seed=3, batch=3)  # another batch size than calibration's
    assert _run(str(out), test)[0].shape == (3, 10)


def test_optimize_with_quantize_option():
    q, report = onnxopt.optimize(_cnn(), quantize={"calibration": _feeds(10), "keep_float": "never"},
                                 return_report=True)
    assert "QuantizeLinear" in _ops(q) and report.kept == "int8"
    with pytest.raises(UsageError, match="calibration"):
        onnxopt.optimize(_cnn(), quantize={"method": "entropy"})
    with pytest.raises(UsageError, match="verify"):
        onnxopt.optimize(_cnn(), quantize={"calibration": _feeds(5)}, verify=True)


def test_fallback_meets_an_impossible_target_by_going_float():
    """A fidelity no int8 model can meet: layers fall back until met (here: all of them)."""
    float_model = _cnn()
    q, report = onnxopt.quantize(float_model, _feeds(10), keep_float="never", fidelity=200.0,
                                 return_report=True)
    fb = report.fidelity["fallback"]
    assert fb and fb["excluded"]
    assert report.warnings or min(report.fidelity["output_sqnr_db"].values()) >= 200


def test_refusals_are_one_line_usage_errors():
    q = onnxopt.quantize(_cnn(), _feeds(6), keep_float="never")
    with pytest.raises(UsageError, match="already quantized"):
        onnxopt.quantize(q, _feeds(6))
    with pytest.raises(UsageError, match="ort-cuda"):
        onnxopt.quantize(_cnn(), _feeds(6), target="ort-cuda")
    with pytest.raises(UsageError, match="method"):
        onnxopt.quantize(_cnn(), _feeds(6), method="kl")
    with pytest.raises(UsageError, match="keep_float"):
        onnxopt.quantize(_cnn(), _feeds(6), keep_float="maybe")
    with pytest.raises(UsageError):
        onnxopt.quantize(_cnn(), [])  # an empty set
    bad = _feeds(6)
    bad[2]["x"][0, 0, 0, 0] = np.nan
    with pytest.raises(UsageError, match="(?i)nan"):
        onnxopt.quantize(_cnn(), bad)
    fp16 = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [1, 4], TensorProto.FLOAT16)],
                 [tinfo("y", [1, 4], TensorProto.FLOAT16)])
    with pytest.raises(UsageError, match="float16"):
        onnxopt.quantize(fp16, [{"x": np.ones((1, 4), np.float16)}])


def _cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "onnxopt", "quantize", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def test_cli_quantize_writes_model_and_json(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_cnn(), src)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.concatenate([f["x"] for f in _feeds(10)])[:, None])  # samples along the first axis
    r = _cli(src, "-o", tmp_path / "q.onnx", "--calib", calib, "--keep-float", "never", "--json",
             tmp_path / "r.json", "--method", "percentile")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "q.onnx").exists()
    import json

    d = json.loads((tmp_path / "r.json").read_text())
    assert d["kept"] == "int8" and d["settings"]["method"] == "percentile"
    assert "ort-cpu" in r.stdout


@pytest.mark.parametrize("case", ["wrong-name", "cuda", "quantized", "empty-folder", "not-onnx"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, case):
    src = tmp_path / "m.onnx"
    onnx.save(_cnn(), src)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, f in enumerate(_feeds(6)):
        np.savez(calib / f"{i}.npz", **({"image": f["x"]} if case == "wrong-name" else f))
    if case == "empty-folder":
        for p in calib.iterdir():
            p.unlink()
    extra = []
    if case == "cuda":
        extra = ["--target", "ort-cuda"]
    if case == "quantized":
        onnx.save(onnxopt.quantize(_cnn(), _feeds(6), keep_float="never"), src)
    if case == "not-onnx":
        src.write_bytes(b"not a model")
    r = _cli(src, "-o", tmp_path / "q.onnx", "--calib", calib, *extra)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert not (tmp_path / "q.onnx").exists()


def test_exclude_takes_the_names_of_the_model_given():
    """conv1 is folded with its BatchNormalization by the cleanup (renamed); excluding it by the name
    the user sees leaves it float."""
    q, report = onnxopt.quantize(_cnn(), _feeds(10), keep_float="never", fidelity=None, exclude=["conv1"],
                                 return_report=True, target="portable")
    float_inits = {i.name for i in q.graph.initializer if i.data_type == TensorProto.FLOAT}
    floats = [n for n in q.graph.node if n.op_type == "Conv" and n.input[1] in float_inits]
    assert len(floats) == 1 and "conv1" in floats[0].metadata_props[-1].value
    assert any("excluded" in why for why in report.plan["skipped"].values())


def test_the_fallback_returns_the_worst_layer_first():
    """Three MatMuls, per-tensor weights, one with an outlier weight that wrecks its int8 grid: the
    fallback's damage ranking (measured on the QDQ model, named as the plan names nodes) tries
    that one first. (Alone it does not help: its output's range, blown up by the outlier, is still
    requantized for the next MatMul; the fallback drops that trial and goes on.)"""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    bad = w(64, 64)
    bad[0, 0] = 2000.0
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="a_mm"),
             helper.make_node("MatMul", ["a", "Z"], ["b"], name="z_bad"),
             helper.make_node("MatMul", ["b", "C"], ["y"], name="c_mm")]
    m = model(nodes, [tinfo("x", ["B", 64])], [tinfo("y", ["B", 64])],
              [numpy_helper.from_array(w(64, 64), "A"), numpy_helper.from_array(bad, "Z"),
               numpy_helper.from_array(w(64, 64), "C")], opset=13)
    feeds = [{"x": w(4, 64)} for _ in range(20)]
    _, report = onnxopt.quantize(m, feeds, keep_float="never", target="portable", per_channel=False, fidelity=40,
                                 return_report=True)
    fb = report.fidelity["fallback"]
    first = fb["rounds"][0]["chosen"][0]
    assert first["node"] == "z_bad" and first["damage_nsr"] > 0.01
    assert fb["met"] and "z_bad" in fb["excluded"]


def test_an_output_may_not_replace_a_calibration_file(tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, f in enumerate(_feeds(6)):
        np.savez(calib / f"{i}.npz", **f)
    before = (calib / "1.npz").read_bytes()
    with pytest.raises(UsageError, match="never overwrites what it reads"):
        onnxopt.quantize(_cnn(), str(calib), output=str(calib / "1.npz"), keep_float="never")
    src = tmp_path / "m.onnx"
    onnx.save(_cnn(), src)
    r = _cli(src, "-o", calib / "1.npz", "--calib", calib, "--keep-float", "never")
    assert r.returncode == 2 and (calib / "1.npz").read_bytes() == before


def test_unknown_quantize_options_of_optimize_are_usage_errors():
    with pytest.raises(UsageError, match="bogus"):
        onnxopt.optimize(_cnn(), quantize={"calibration": _feeds(5), "bogus": 1})


def test_an_exclude_that_matches_nothing_is_a_warning():
    _, report = onnxopt.quantize(_cnn(), _feeds(6), keep_float="never", fidelity=None, exclude=["NoSuchNode"],
                                 return_report=True)
    assert any("NoSuchNode" in w for w in report.warnings)


def test_a_graph_output_from_a_quantized_conv_keeps_its_type_and_shape():
    """The output's DequantizeLinear takes its name: it keeps the declared shape (onnx's checker
    requires one; PP-OCRv4 rec's output failed it)."""
    rng = np.random.default_rng(1)
    m = model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])],
              [tinfo("x", [1, 3, 16, 16])], [tinfo("y", [1, 8, 16, 16])],
              [init("w", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32))])
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(6)]
    q = onnxopt.quantize(m, feeds, keep_float="never", target="portable", fidelity=None)
    onnx.checker.check_model(q, full_check=True)
    y = q.graph.output[0]
    assert [d.dim_value for d in y.type.tensor_type.shape.dim] == [1, 8, 16, 16]
