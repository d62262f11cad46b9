"""QDQ placement (onnxopt.quantize.plan + rules/qdq.py), proved with onnxruntime.

Small float models built here cover every placement case (Conv+Relu, Conv+Clip(0,6), depthwise
Conv, MaxPool, Concat, residual Add, Mul, GlobalAveragePool, Gemm with alpha/beta != 1, MatMul with
a constant weight, a graph output from a quantized node, a tensor read twice). Ranges are minmax
over a few random feeds, measured here with onnxruntime (intermediate tensors exposed). The
quantized model must run, fuse into integer kernels in onnxruntime's optimized graph
(ORT_ENABLE_ALL, CPU), keep no float weight, carry int32 biases with scale s_x*s_w, lose its
Relu/Clip, give each DQ one reader, stay close to float (SQNR), and be byte-identical run to run.
The zoo models (skipped when absent from the cache) check the same on real networks.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxopt
from onnxopt.ir import io
from onnxopt.errors import UsageError
from onnxopt.quantize import plan as qplan

from helpers import minmax

ort = pytest.importorskip("onnxruntime")

FLOAT_KERNELS = {"Conv", "FusedConv", "NhwcFusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"}


# --- helpers ------------------------------------------------------------------------------------


def _session(proto: onnx.ModelProto, level=None, optimized: Path | None = None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = level if level is not None else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def quantize(proto: onnx.ModelProto, feeds, *, per_channel=True, exclude=(), reduce_range=None):
    """The pipeline's order: cleanup, rules, tensors, ranges, plan, apply."""
    clean = onnxopt.optimize(proto)
    model = io.to_ir(clean)
    # placement is what these tests prove: the measured-cost decisions (tests/test_quant_costs.py)
    # would leave some of these tiny layers float
    rules = qplan.target_rules("ort-cpu", per_channel=per_channel, reduce_range=reduce_range, use_costs=False)
    tensors = qplan.calibration_tensors(model, rules, exclude=exclude)
    plan = qplan.make_plan(model, minmax(clean, tensors, feeds), rules, exclude=exclude)
    stats = qplan.apply_plan(model, plan, strict=True)
    return clean, io.to_proto(model), plan, stats


def sqnr(ref, test) -> float:
    ref, test = np.asarray(ref, np.float64), np.asarray(test, np.float64)
    return float(10 * np.log10(np.sum(ref * ref) / max(np.sum((ref - test) ** 2), 1e-30)))


def optimized_graph(proto, feed, tmp_path) -> onnx.ModelProto:
    path = tmp_path / "ort_optimized.onnx"
    _session(proto, optimized=path).run(None, feed)
    return onnx.load(str(path))


def kernel_counts(m: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in m.graph.node)


def _inits(m):
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


def _producers(m):
    return {o: n for n in m.graph.node for o in n.output}


def _readers(m):
    r = collections.Counter()
    for n in m.graph.node:
        for i in n.input:
            r[i] += 1
    return r


# --- the small model ----------------------------------------------------------------------------


def small_model(opset=13, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(*shape, sc=0.2):
        return numpy_helper.from_array((rng.standard_normal(shape) * sc).astype(np.float32))

    def init(name, t):
        t.name = name
        return t

    inits = [init("w1", w(8, 3, 3, 3)), init("b1", w(8)), init("w2", w(8, 1, 3, 3)), init("b2", w(8)),
             init("w3", w(8, 16, 1, 1)), init("b3", w(8)),
             numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.float32(6), "six"),
             init("gw", w(8, 10)), init("gb", w(10)), init("mc", w(1, 8, 1, 1, sc=1.0)), init("mw", w(10, 4))]
    clip = (helper.make_node("Clip", ["c2", "zero", "six"], ["r2"], name="clip2") if opset >= 11
            else helper.make_node("Clip", ["c2"], ["r2"], name="clip2", min=0.0, max=6.0))
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="dwconv", pads=[1, 1, 1, 1], group=8),
        clip,
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["p1", "r2"], ["cat"], name="concat", axis=1),  # r2 is read twice
        helper.make_node("Conv", ["cat", "w3", "b3"], ["c3"], name="conv3"),  # c3: a graph output, read too
        helper.make_node("Add", ["c3", "r2"], ["a"], name="residual"),
        helper.make_node("Mul", ["a", "mc"], ["mu"], name="mul"),
        helper.make_node("GlobalAveragePool", ["mu"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "gw", "gb"], ["y"], name="gemm", alpha=1.5, beta=0.5),
        helper.make_node("MatMul", ["y", "mw"], ["z"], name="matmul"),
    ]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4]),
                               helper.make_tensor_value_info("c3", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def feeds(n=6, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


@pytest.fixture(scope="module")
def small():
    return quantize(small_model(), feeds())


# --- target rules -------------------------------------------------------------------------------


def test_target_rules():
    r = qplan.target_rules("ort-cpu")
    assert (r.activation_dtype, r.weight_dtype, r.per_channel, r.reduce_range) == ("uint8", "int8", True, False)
    assert r.weight_qmax == 127 and any("U8S8" in line for line in r.followed)
    assert qplan.target_rules("cpu", reduce_range=True).weight_qmax == 64
    assert not qplan.target_rules("portable", per_channel=False).per_channel
    with pytest.raises(UsageError, match="CUDA provider runs QDQ models in float"):
        qplan.target_rules("ort-cuda")
    with pytest.raises(UsageError, match="unknown quantization target"):
        qplan.target_rules("tensorrt")


# --- the small model, quantized -----------------------------------------------------------------


def test_integer_kernels_and_no_float_compute_left(small, tmp_path):
    clean, q, plan, _ = small
    onnx.checker.check_model(q)
    counts = kernel_counts(optimized_graph(q, feeds(1)[0], tmp_path))
    assert counts["QLinearConv"] == 3
    assert counts["QGemm"] == 1 and counts["MatMulIntegerToFloat"] == 1
    for op in ("QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearConcat"):
        assert counts[op] == 1, (op, counts)
    assert not FLOAT_KERNELS & set(counts), counts
    assert not {"Add", "Mul", "GlobalAveragePool", "Concat", "Relu", "Clip"} & set(counts), counts
    assert plan.skipped == {}
    assert plan.absorbed == {"relu1": "c1", "clip2": "c2"}


def test_outputs_close_to_float(small):
    clean, q, _, _ = small
    for feed in feeds(3, seed=7):
        ref = _session(clean).run(None, feed)
        out = _session(q).run(None, feed)
        for a, b in zip(ref, out):
            assert a.shape == b.shape
            assert sqnr(a, b) > 25, sqnr(a, b)


def test_weights_int8_bias_int32_and_no_float_copy(small):
    clean, q, plan, _ = small
    inits, prod = _inits(q), _producers(q)
    float_inits = [a for a in inits.values() if a.dtype == np.float32]
    assert all(a.ndim <= 1 and a.size <= 10 for a in float_inits), "a float weight is left"
    assert not any(a.dtype == np.float32 and a.size >= 64 for a in inits.values())
    nodes = [n for n in q.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert len(nodes) == 5
    for node in nodes:
        dq_x, dq_w = prod[node.input[0]], prod[node.input[1]]
        assert dq_x.op_type == dq_w.op_type == "DequantizeLinear"
        w = inits[dq_w.input[0]]
        assert w.dtype == np.int8 and np.abs(w).max() == 127  # symmetric, full range per channel
        assert not inits[dq_w.input[2]].any()  # zero point 0
        w_scale = inits[dq_w.input[1]]
        axis = {a.name: a.i for a in dq_w.attribute}.get("axis", 1)
        want_axis = {"Conv": 0, "Gemm": 1, "MatMul": 1}[node.op_type]  # (Gemm here has transB=0)
        assert axis == want_axis and w_scale.shape == (w.shape[want_axis],)
        if len(node.input) > 2:
            dq_b = prod[node.input[2]]
            b, b_scale = inits[dq_b.input[0]], inits[dq_b.input[1]]
            assert b.dtype == np.int32 and not inits[dq_b.input[2]].any()
            x_scale = inits[dq_x.input[1]]
            np.testing.assert_array_equal(b_scale, (np.float32(x_scale) * w_scale).astype(np.float32))
        if node.op_type == "Gemm":
            attrs = {a.name: a.f for a in node.attribute}
            assert attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
    # the Gemm's folded weights still compute alpha*A*B + beta*C (checked through the outputs above)


def test_bias_and_weights_match_float_values(small):
    clean, q, _, _ = small
    f_inits, inits, prod = _inits(clean), _inits(q), _producers(q)
    conv1 = next(n for n in q.graph.node if n.op_type == "Conv" and prod[n.input[1]].input[0].startswith("conv1"))
    dq_w, dq_b = prod[conv1.input[1]], prod[conv1.input[2]]
    w = inits[dq_w.input[0]].astype(np.float32) * inits[dq_w.input[1]].reshape(-1, 1, 1, 1)
    b = inits[dq_b.input[0]].astype(np.float64) * inits[dq_b.input[1]]
    np.testing.assert_allclose(w, f_inits["w1"], atol=float(inits[dq_w.input[1]].max()) / 2 + 1e-7)
    np.testing.assert_allclose(b, f_inits["b1"], atol=float(inits[dq_b.input[1]].max()) / 2 + 1e-9)


def test_qdq_structure(small):
    clean, q, plan, _ = small
    ops = [n.op_type for n in q.graph.node]
    assert "Relu" not in ops and "Clip" not in ops
    readers, outputs = _readers(q), {o.name for o in q.graph.output}
    for n in q.graph.node:
        if n.op_type == "DequantizeLinear":
            assert readers[n.output[0]] + (n.output[0] in outputs) == 1, n.name
    prod = _producers(q)
    # graph outputs keep their names; the quantized Conv's output leaves through Q -> DQ
    assert [o.name for o in q.graph.output] == ["z", "c3"]
    assert prod["c3"].op_type == "DequantizeLinear" and prod[prod["c3"].input[0]].op_type == "QuantizeLinear"
    assert prod["z"].op_type == "MatMul"  # MatMulIntegerToFloat: a float output, no Q/DQ before it
    # Relu absorbed: conv1's output is quantized with the Relu output's parameters, zero point 0
    assert plan.params["c1"] == plan.params["r1"] and plan.params["r1"][1] == 0
    # data movers and Concat share one parameter set: no requantization
    assert plan.params["p1"] == plan.params["r1"] == plan.params["cat"] == plan.params["r2"]
    lo, hi = qplan.representable(*plan.params["r2"])
    assert lo == 0.0 and hi <= 6.0


def test_byte_identical(small):
    _, q, _, _ = small
    again = quantize(small_model(), feeds())[1]
    assert q.SerializeToString() == again.SerializeToString()


def test_opset11_raised_to_13_per_channel(tmp_path):
    clean, q, plan, stats = quantize(small_model(opset=11), feeds(4))
    assert stats["opset"] == [11, 13]
    assert {o.domain: o.version for o in q.opset_import}[""] == 13
    onnx.checker.check_model(q)
    dq_axes = [a.i for n in q.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "axis"]
    assert dq_axes.count(0) >= 3  # the Convs' per-channel weights (and biases)
    counts = kernel_counts(optimized_graph(q, feeds(1)[0], tmp_path))
    assert counts["QLinearConv"] == 3 and not FLOAT_KERNELS & set(counts)
    ref, out = _session(clean).run(None, feeds(1)[0]), _session(q).run(None, feeds(1)[0])
    assert min(sqnr(a, b) for a, b in zip(ref, out)) > 25


def test_per_tensor_and_reduce_range():
    _, q, _, _ = quantize(small_model(), feeds(4), per_channel=False, reduce_range=True)
    inits, prod = _inits(q), _producers(q)
    for n in q.graph.node:
        if n.op_type == "Conv":
            dq_w = prod[n.input[1]]
            assert inits[dq_w.input[1]].ndim == 0 and np.abs(inits[dq_w.input[0]]).max() == 64


def test_exclude_by_name_and_op_type(tmp_path):
    _, q, plan, _ = quantize(small_model(), feeds(4), exclude=("conv3", "Mul"))
    assert plan.skipped["conv3"] == "excluded by the user" and plan.skipped["mul"] == "excluded by the user"
    assert "conv3" not in plan.nodes and "mul" not in plan.nodes
    counts = kernel_counts(optimized_graph(q, feeds(1)[0], tmp_path))
    assert counts["QLinearConv"] == 2 and counts["QLinearMul"] == 0
    inits = _inits(q)
    assert any(a.dtype == np.float32 and a.shape == (8, 16, 1, 1) for a in inits.values())  # conv3's float weight


def test_relu_with_a_second_reader_is_not_absorbed():
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 1, 1))).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Add", ["c", "r"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    fs = [{"x": rng.standard_normal((1, 3, 4, 4)).astype(np.float32)} for _ in range(3)]
    clean, q, plan, _ = quantize(m, fs)
    assert plan.absorbed == {} and "other readers" in plan.skipped["relu"]
    assert "Relu" in [n.op_type for n in q.graph.node]
    ref, out = _session(clean).run(None, fs[0]), _session(q).run(None, fs[0])
    assert sqnr(ref[0], out[0]) > 25


def test_plan_parameters_and_missing_range():
    model = io.to_ir(onnxopt.optimize(small_model()))
    rules = qplan.target_rules(use_costs=False)
    tensors = qplan.calibration_tensors(model, rules)
    assert tensors[0] == "x" and "c1" in tensors and "r1" in tensors
    assert not {"p1", "cat", "f"} & set(tensors)  # data movers and Concat: their inputs' range
    ranges = {t: (-1.0, 3.0) for t in tensors}
    ranges["r1"] = ranges["r2"] = (0.0, 5.1)
    plan = qplan.make_plan(model, ranges, rules)
    scale, zp = plan.params["x"]
    assert scale == np.float32(4.0 / 255) and zp == np.uint8(round(1.0 / float(scale)))
    assert plan.params["c1"] == plan.params["r1"] and plan.params["r1"][1] == 0
    assert plan.params["y"][1] == zp  # (a range not containing 0 is extended to it: checked below)
    plan2 = qplan.make_plan(model, {**ranges, "x": (0.5, 2.0)}, rules)
    assert plan2.params["x"] == (np.float32(2.0 / 255), np.uint8(0))
    with pytest.raises(UsageError, match="no calibrated range for tensor 'x'"):
        qplan.make_plan(model, {k: v for k, v in ranges.items() if k != "x"}, rules)


def test_raise_opset_converts_exactly():
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Squeeze", ["x"], ["s"], name="sq", axes=[0]),
             helper.make_node("Softmax", ["s"], ["sm"], name="softmax", axis=1),  # not the last axis of 3-D
             helper.make_node("Unsqueeze", ["sm"], ["u"], name="unsq", axes=[0]),
             helper.make_node("Split", ["u"], ["y0", "y1"], name="split", axis=3, split=[2, 3])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 5])],
                              [helper.make_tensor_value_info("y0", TensorProto.FLOAT, [1, 2, 4, 2]),
                               helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, 2, 4, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
    model = io.to_ir(m)
    converted = qplan.raise_opset(model, 13)
    assert converted == ["Softmax", "Split", "Squeeze", "Unsqueeze"]
    out = io.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    feed = {"x": rng.standard_normal((1, 2, 4, 5)).astype(np.float32)}
    for a, b in zip(_session(m).run(None, feed), _session(out).run(None, feed)):
        np.testing.assert_array_equal(a, b)


# --- real models (zoo cache; skipped when absent) -----------------------------------------------

ZOO = {  # model: (feeds for calibration, minimum output SQNR in dB)
    "resnet50-legacy": (4, 20.0),
    "mobilenet_v2-legacy": (4, 14.0),
    "ppocr-mobile-cls": (4, 12.0),
    "minilm-legacy": (4, 8.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_become_integer(name, tmp_path):
    from onnxopt.models import zoo

    spec = zoo.get(name)
    path = spec.path()
    if not path.is_file():
        pytest.skip(f"{name} is not in the zoo cache (python -m onnxopt.models build --only {name})")
    n_feeds, min_db = ZOO[name]
    calib = [spec.inputs(path, seed) for seed in range(n_feeds)]
    clean, q, plan, _ = quantize(onnx.load(str(path)), calib)
    counts = kernel_counts(optimized_graph(q, spec.inputs(path, 100), tmp_path))
    convs = sum(1 for n in clean.graph.node if n.op_type == "Conv")
    assert counts["QLinearConv"] == convs
    assert not {"Conv", "FusedConv", "NhwcFusedConv"} & set(counts)
    const_matmuls = [n for n in clean.graph.node if n.op_type == "MatMul" and n.input[1] in _inits(clean)]
    assert counts["MatMulIntegerToFloat"] + counts["QLinearMatMul"] == len(const_matmuls)
    gemms = sum(1 for n in clean.graph.node if n.op_type == "Gemm")
    assert counts["QGemm"] == gemms and not counts["Gemm"] and not counts["FusedGemm"]
    if name == "ppocr-mobile-cls":
        assert {o.domain: o.version for o in q.opset_import}[""] == 13  # from opset 11
    worst = min(sqnr(a, b) for seed in (101, 102)
                for a, b in zip(_session(clean).run(None, spec.inputs(path, seed)),
                                _session(q).run(None, spec.inputs(path, seed))) if a.dtype.kind == "f")
    assert worst > min_db, worst
