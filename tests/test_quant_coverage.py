"""Integer-kernel coverage (onnxopt.quantize.coverage): which nodes of a QDQ model onnxruntime's CPU
provider runs as integer kernels, which stay float and why. The QDQ models come from onnxruntime's
own quantizer (quantize_static, QDQ, per-channel) on small float models built here, from QDQ graphs
written by hand where a specific structure is needed, and from a zoo model when it is cached."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt.errors import UsageError
from onnxopt.quantize.coverage import integer_coverage, is_qdq_model

quantization = pytest.importorskip("onnxruntime.quantization")


def _init(name, array, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(array, dtype), name)


def cnn(seed=0) -> onnx.ModelProto:
    """Conv/Relu/MaxPool, two Convs, a hard-swish (HardSigmoid, Mul), a residual Add, GAP, Flatten,
    Gemm, Sigmoid, Softmax."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("HardSigmoid", ["c2"], ["hs"], name="hsig"),
        helper.make_node("Mul", ["c2", "hs"], ["hsw"], name="mul"),
        helper.make_node("Conv", ["p1", "w3", "b3"], ["p1b"], name="conv3"),
        helper.make_node("Add", ["hsw", "p1b"], ["a1"], name="add"),
        helper.make_node("GlobalAveragePool", ["a1"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["l"], name="fc", transB=1),
        helper.make_node("Sigmoid", ["l"], ["s"], name="sig"),
        helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=1),
    ]
    inits = [_init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.3), _init("b1", rng.standard_normal(8) * 0.1),
             _init("w2", rng.standard_normal((8, 8, 3, 3)) * 0.2), _init("b2", rng.standard_normal(8) * 0.1),
             _init("w3", rng.standard_normal((8, 8, 1, 1)) * 0.2), _init("b3", rng.standard_normal(8) * 0.1),
             _init("wg", rng.standard_normal((10, 8)) * 0.3), _init("bg", rng.standard_normal(10) * 0.1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def calibration(shape=(1, 3, 16, 16), n=8, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def ort_quantize(model: onnx.ModelProto, tmp_path, feeds, *, exclude=(), name="q.onnx", **extra) -> str:
    """onnxruntime's quantize_static: QDQ, per-channel, uint8 activations, int8 weights."""
    src, dst = tmp_path / f"float-{name}", tmp_path / name
    onnx.save(model, src)

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantization.quantize_static(str(src), str(dst), Reader(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8, nodes_to_exclude=list(exclude),
                                 extra_options=extra or None)
    return str(dst)


@pytest.fixture(scope="module")
def cnn_q(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cov")
    return ort_quantize(cnn(), tmp, calibration(), exclude=["softmax"])


def test_cnn_kernels_and_float_islands(cnn_q):
    cov = integer_coverage(cnn_q, plan_reasons={"softmax": "excluded by the user"})
    kernels = {n.node: n.kernel for n in cov.integer}
    assert kernels["conv1"] == kernels["conv2"] == kernels["conv3"] == "QLinearConv"
    assert kernels["add"] == "QLinearAdd" and kernels["mul"] == "QLinearMul"
    assert kernels["gap"] == "QLinearGlobalAveragePool" and kernels["fc"] == "QGemm"
    assert kernels["sig"] == "QLinearSigmoid"
    kinds = {n.node: n.kind for n in cov.integer}
    assert kinds["pool1"] == kinds["flat"] == "data movement"  # on uint8 tensors
    islands = {n.node: n for n in cov.float_islands}
    assert set(islands) == {"hsig", "softmax"}
    assert islands["hsig"].reason == "no integer kernel for HardSigmoid on onnxruntime CPU"
    assert islands["hsig"].kernel == "HardSigmoid"
    # the caller's reason first, then what the graph shows: onnxruntime's quantizer left Softmax's output float
    assert islands["softmax"].reason.startswith("excluded by the user; ")
    assert "output 'y' is a graph output" in islands["softmax"].reason
    s = cov.summary()
    assert (s["compute_nodes"], s["compute_integer"], s["compute_float"]) == (10, 8, 2)
    assert s["movement_integer"] == 2 and s["fraction_integer"] == 0.8
    assert cov.by_op()["Conv"] == {"integer": 3, "float": 0, "movement_integer": 0, "movement_float": 0}
    # the HardSigmoid island costs a DQ before it and a Q after it; Softmax's float input a DQ
    assert cov.qdq_left["quantize"] >= 2 and cov.qdq_left["dequantize"] >= 2
    assert cov.rows()[0][:4] == ("hsig", "HardSigmoid", "HardSigmoid", "float")
    assert all(r[3] == "integer" for r in cov.rows()[2:])


def test_as_dict_is_json_and_deterministic(cnn_q):
    a = integer_coverage(cnn_q).as_dict()
    b = integer_coverage(onnx.load(cnn_q)).as_dict()  # a proto gives the same answer as its path
    assert json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)
    assert list(a) == ["provider", "summary", "by_op", "integer", "float_islands", "float_movement", "qdq_left",
                       "added", "kernels"]
    assert a["kernels"]["QLinearConv"] == 3
    # without the caller's reason, the graph's own
    soft = next(f for f in a["float_islands"] if f["node"] == "softmax")
    assert not soft["reason"].startswith("excluded")


def _qdq(t, scale, zp=0, dtype=np.uint8):
    nodes = [helper.make_node("QuantizeLinear", [t, f"{t}_s", f"{t}_z"], [f"{t}_q"], name=f"{t}_Q"),
             helper.make_node("DequantizeLinear", [f"{t}_q", f"{t}_s", f"{t}_z"], [f"{t}_dq"], name=f"{t}_DQ")]
    return nodes, [_init(f"{t}_s", scale), _init(f"{t}_z", zp, dtype)]


def hand_qdq() -> onnx.ModelProto:
    """Written by hand: Conv -> Relu -> Q (Relu absorbed), a MaxPool whose input and output scales
    differ, a MatMul with a float output (MatMulIntegerToFloat) and a LayerNormalization after it."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for part in [_qdq("x", 0.03, 128)]:
        nodes += part[0]
        inits += part[1]
    inits += [_init("wq", rng.integers(-100, 100, (8, 3, 3, 3)), np.int8), _init("ws", np.full(8, 0.003)),
              _init("wz", np.zeros(8), np.int8), _init("bq", rng.integers(-500, 500, 8), np.int32),
              _init("bs", np.full(8, 0.03 * 0.003)), _init("bz", np.zeros(8), np.int32)]
    nodes += [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="w_DQ", axis=0),
              helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b"], name="b_DQ", axis=0),
              helper.make_node("Conv", ["x_dq", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
              helper.make_node("Relu", ["c"], ["r"], name="relu")]
    for t, s in (("r", 0.02),):
        part = _qdq(t, s)
        nodes += part[0]
        inits += part[1]
    nodes.append(helper.make_node("MaxPool", ["r_dq"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    part = _qdq("p", 0.05)  # not r's parameters: onnxruntime cannot drop the pair around MaxPool
    nodes += part[0]
    inits += part[1]
    inits += [_init("shape", [1, 8, 64], np.int64), _init("mq", rng.integers(-100, 100, (64, 16)), np.int8),
              _init("ms", 0.002), _init("mz", 0, np.int8), _init("ln_s", np.ones(16)), _init("ln_b", np.zeros(16))]
    nodes += [helper.make_node("Reshape", ["p_dq", "shape"], ["rs"], name="reshape")]
    part = _qdq("rs", 0.05)
    nodes += part[0]
    inits += part[1]
    nodes += [helper.make_node("DequantizeLinear", ["mq", "ms", "mz"], ["m"], name="m_DQ"),
              helper.make_node("MatMul", ["rs_dq", "m"], ["mm"], name="matmul"),
              helper.make_node("LayerNormalization", ["mm", "ln_s", "ln_b"], ["y"], name="ln", axis=-1)]
    graph = helper.make_graph(nodes, "hand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_hand_written_qdq_graph():
    cov = integer_coverage(hand_qdq())
    integer = {n.node: n for n in cov.integer}
    assert integer["conv"].kernel == "QLinearConv"
    assert integer["relu"].kind == "fused" and integer["relu"].kernel == "fused into QLinearConv 'conv'"
    assert integer["matmul"].kernel == "MatMulIntegerToFloat"  # no Q after it: a float output, integer inside
    assert integer["reshape"].kind == "data movement"
    islands = {n.node: n for n in cov.float_islands}
    assert set(islands) == {"ln"}
    assert islands["ln"].reason == ("no integer kernel for LayerNormalization on onnxruntime CPU; input 'mm' not "
                                    "quantized (no DequantizeLinear before it); output 'y' is a graph output")
    (pool,) = cov.float_movement
    assert pool.node == "pool" and pool.kernel == "MaxPool"
    assert "input and output quantization parameters differ" in pool.reason
    assert cov.summary()["movement_float"] == 1


def test_float_model_and_bad_provider():
    cov = integer_coverage(cnn())  # no Q/DQ at all: every compute node is a float island, with why
    assert cov.integer == [] and {n.node for n in cov.float_movement} == {"pool1", "flat"}
    conv1 = next(n for n in cov.float_islands if n.node == "conv1")
    assert "input 'x' not quantized" in conv1.reason and "weight 'w1' is float in the QDQ model" in conv1.reason
    assert cov.summary()["compute_integer"] == 0
    # onnxruntime's float fusions: Relu into conv1's NCHWc Conv, the residual Add into conv3's, Sigmoid into FusedGemm
    fused = {n.node: n.kernel for n in cov.float_islands if n.kind == "fused"}
    assert fused == {"relu1": "fused into Conv 'conv1'", "add": "fused into Conv 'conv3'",
                     "sig": "fused into FusedGemm 'fc'"}
    assert not is_qdq_model(cnn()) and is_qdq_model(hand_qdq())
    with pytest.raises(UsageError, match="only 'cpu'"):
        integer_coverage(hand_qdq(), provider="cuda")


def test_zoo_model_coverage(tmp_path):
    """PP-OCR's mobile direction classifier (hard-swish: HardSigmoid, Mul) when the zoo cache holds it."""
    from onnxopt.models import zoo

    spec = zoo.get("ppocr-mobile-cls")
    path = spec.path()
    if not path.exists():
        pytest.skip("ppocr-mobile-cls is not in the zoo cache (python -m onnxopt.models build --only ppocr-mobile-cls)")
    q = ort_quantize(onnx.load(path), tmp_path, [spec.inputs(path, s) for s in range(2)])
    cov = integer_coverage(q)
    assert cov.by_op()["Conv"]["float"] == 0 and cov.by_op()["Conv"]["integer"] > 20
    hs = [n for n in cov.float_islands if n.op == "HardSigmoid"]
    assert hs and all(n.reason.startswith("no integer kernel for HardSigmoid") for n in hs)


# ---- the verifier on a float model and its quantized model -----------------------------------------------------


def test_verify_cli_shows_coverage_and_judges_by_sqnr(cnn_q, tmp_path, capsys):
    from onnxopt import cli

    src = tmp_path / "float.onnx"
    onnx.save(cnn(), src)
    report = tmp_path / "report.json"
    code = cli.main(["verify", str(src), cnn_q, "--runs", "0", "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    assert "integer kernels (CPU): 8/10 compute nodes (80.0%)" in out
    assert "hsig" in out and "no integer kernel for HardSigmoid on onnxruntime CPU" in out
    assert "QLinearConv 3" in out and "ok (SQNR " in out and "SQNR >= 20 dB" in out
    data = json.loads(report.read_text())
    assert data["coverage"]["summary"]["compute_integer"] == 8
    assert data["int8"]["min_sqnr_db"] == 20.0
    (row,) = data["providers"]["cpu"]["outputs"]
    assert row["ok"] and row["sqnr_db"] > 20
    # a target the model misses fails, naming the SQNR; no bisect command (it replays float rewrites)
    code = cli.main(["verify", str(src), cnn_q, "--runs", "0", "--min-sqnr", str(row["sqnr_db"] + 1), "-q"])
    out = capsys.readouterr().out
    assert code == 1 and f"SQNR {row['sqnr_db']:.1f} dB < " in out and "bisect" not in out


def test_verify_int8_criterion_only_for_a_float_and_quantized_pair(cnn_q):
    from onnxopt import verify

    r = verify.verify(cnn(), cnn_q, runs=0)
    assert r["ok"] and r["int8"]["min_sqnr_db"] == verify.INT8_MIN_SQNR_DB
    # tolerances given: the elementwise test the user asked for (int8 misses 1e-6)
    r = verify.verify(cnn(), cnn_q, runs=0, rtol=1e-6, atol=1e-7, culprit=False)
    assert not r["ok"] and "int8" not in r and "sqnr_db" not in r["providers"]["cpu"]["outputs"][0]
    # float against float and quantized against quantized: as ever (no SQNR criterion, no coverage)
    r = verify.verify(cnn(), cnn(), runs=0)
    assert r["ok"] and "int8" not in r and not r["low_precision"]
    r = verify.verify(cnn_q, cnn_q, runs=0)
    assert r["ok"] and "int8" not in r and r["low_precision"]
    with pytest.raises(UsageError, match="--min-sqnr"):
        verify.verify(cnn(), cnn_q, runs=0, min_sqnr=float("inf"))


def test_verify_cli_float_pair_has_no_coverage(tmp_path, capsys):
    from onnxopt import cli

    src = tmp_path / "float.onnx"
    onnx.save(cnn(), src)
    report = tmp_path / "report.json"
    assert cli.main(["verify", str(src), str(src), "--runs", "0", "--json", str(report)]) == 0
    assert "integer kernels" not in capsys.readouterr().out
    assert "coverage" not in json.loads(report.read_text())


# ---- nodes onnxruntime inlines or fuses into float kernels (found in review) ------------------------------------


def conv_hardswish_conv() -> onnx.ModelProto:
    """Conv -> HardSwish -> Conv at opset 14: onnxruntime inlines HardSwish (a function op) into a float
    HardSigmoid and Mul between the DequantizeLinear and QuantizeLinear around it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h"], name="hswish"),
             helper.make_node("Conv", ["h", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [_init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.3), _init("b1", rng.standard_normal(8) * 0.1),
             _init("w2", rng.standard_normal((8, 8, 3, 3)) * 0.2), _init("b2", rng.standard_normal(8) * 0.1)]
    graph = helper.make_graph(nodes, "hswish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def test_inlined_hardswish_is_float(tmp_path):
    q = ort_quantize(conv_hardswish_conv(), tmp_path, calibration())
    cov = integer_coverage(q)
    assert {n.node: n.kernel for n in cov.integer} == {"conv1": "QLinearConv", "conv2": "QLinearConv"}
    (hs,) = cov.float_islands  # was: "fused into QLinearConv 'conv1'", counted integer across the DQ
    assert (hs.node, hs.kernel, hs.kind) == ("hswish", "HardSigmoid+Mul", "compute")
    assert hs.reason == "no integer kernel for HardSwish on onnxruntime CPU"
    s = cov.summary()
    assert (s["compute_integer"], s["compute_nodes"]) == (2, 3)
    assert "HardSigmoid" not in cov.added and "Mul" not in cov.added  # mapped back to the HardSwish


def matmul_bias_gelu() -> onnx.ModelProto:
    """Written by hand in QDQ: x -> Q/DQ -> MatMul (int8 weight, float output) -> bias Add -> Erf-GELU
    (Div, Erf, Add, Mul, Mul) -> Identity -> Q/DQ -> MatMul. onnxruntime runs the MatMuls as
    MatMulIntegerToFloat and fuses the bias Add and the GELU into one float BiasGelu."""
    rng = np.random.default_rng(0)
    nodes, inits = _qdq("x", 0.03, 128)
    inits += [_init("w1q", rng.integers(-100, 100, (16, 32)), np.int8), _init("w1s", 0.003),
              _init("w1z", 0, np.int8), _init("b1", rng.standard_normal(32) * 0.1), _init("sqrt2", np.sqrt(2.0)),
              _init("one", 1.0), _init("half", 0.5), _init("w2q", rng.integers(-100, 100, (32, 8)), np.int8),
              _init("w2s", 0.003), _init("w2z", 0, np.int8)]
    nodes += [helper.make_node("DequantizeLinear", ["w1q", "w1s", "w1z"], ["w1"], name="w1_DQ"),
              helper.make_node("MatMul", ["x_dq", "w1"], ["m1"], name="mm1"),
              helper.make_node("Add", ["m1", "b1"], ["a"], name="bias_add"),
              helper.make_node("Div", ["a", "sqrt2"], ["d"], name="div"),
              helper.make_node("Erf", ["d"], ["e"], name="erf"),
              helper.make_node("Add", ["e", "one"], ["e1"], name="add1"),
              helper.make_node("Mul", ["a", "e1"], ["g0"], name="mul"),
              helper.make_node("Mul", ["g0", "half"], ["g"], name="mul_1"),
              helper.make_node("Identity", ["g"], ["gi"], name="identity")]
    part = _qdq("gi", 0.02)
    nodes += part[0]
    inits += part[1]
    nodes += [helper.make_node("DequantizeLinear", ["w2q", "w2s", "w2z"], ["w2"], name="w2_DQ"),
              helper.make_node("MatMul", ["gi_dq", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_gelu_fused_into_float_bias_gelu():
    q = matmul_bias_gelu()
    cov = integer_coverage(q)
    if "BiasGelu" not in cov.kernels:
        pytest.skip("this onnxruntime does not form BiasGelu here")
    integer = {n.node: n for n in cov.integer}
    assert integer["mm1"].kernel == "MatMulIntegerToFloat"
    fused = {n.node: n for n in cov.float_islands if n.kind == "fused"}
    # was: all six "fused into MatMulIntegerToFloat 'mm1'", counted integer
    assert set(fused) == {"bias_add", "div", "erf", "add1", "mul", "mul_1"}
    assert all(n.kernel == "fused into BiasGelu" and n.reason == "fused by onnxruntime into float BiasGelu"
               for n in fused.values())
    assert "BiasGelu" not in cov.added  # mapped back to the node whose output it writes
    # the Identity onnxruntime removed: data movement, never an integer compute node
    ident = [n for n in cov.integer + cov.float_movement + cov.float_islands if n.node == "identity"]
    assert [n.kind for n in ident] == ["data movement"]
    s = cov.summary()
    assert (s["compute_integer"], s["compute_nodes"]) == (2, 8)  # the two MatMuls; was 8/8
