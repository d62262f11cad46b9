"""QDQ placement refuses a scale or constant float32 cannot hold (issue 27, items 1 and 5 as a class,
in rules/qdq.py and the plan): a weight scale that overflows to inf, an int32 bias scale
(x_scale * w_scale) that rounds to 0 or to a subnormal number, Gemm's alpha folded into weights
that round to 0, a Div's reciprocal that is subnormal, a constant operand's subnormal scale.

Each model here has finite, normal weights, inputs and outputs. The quantized model is run as a
user runs it (onnxruntime, graph optimizations on: onnxruntime quantizes DequantizeLinear -> Conv
with float weights -> QuantizeLinear itself, so a Conv the rule alone refused still lost its
output; the plan leaves such a node float, its output with no Q).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxopt
from onnxopt.ir import io
from onnxopt.quantize import plan as qplan

from helpers import minmax

ort = pytest.importorskip("onnxruntime")

f32 = np.float32
TINY = float(np.finfo(np.float32).tiny)
RNG = np.random.default_rng(27)
W = RNG.standard_normal((4, 3, 1, 1))


def _model(nodes, inits, x_shape, y_shape):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(np.asarray(v, f32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)


def _feeds(shape, scale, n=4):
    return [{"x": (RNG.standard_normal(shape) * scale).astype(f32)} for _ in range(n)]


def _quantize(proto, feeds):
    """The pipeline's order (tests/test_quant_qdq.py): cleanup, tensors, ranges, plan, apply."""
    clean = onnxopt.optimize(proto)
    model = io.to_ir(clean)
    rules = qplan.target_rules("ort-cpu", use_costs=False)
    tensors = qplan.calibration_tensors(model, rules)
    plan = qplan.make_plan(model, minmax(clean, tensors, feeds), rules)
    stats = qplan.apply_plan(model, plan, strict=True)
    return clean, io.to_proto(model), plan, stats


def _run(proto, feed):
    """onnxruntime CPU as a user runs it (graph optimizations on)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _close(clean, q, feed, rel=0.02):
    ref, out = _run(clean, feed).astype(np.float64), _run(q, feed).astype(np.float64)
    assert np.all(np.isfinite(ref)) and np.abs(ref).max() >= TINY  # a normal output: the case is real
    err = float(np.abs(out - ref).max()) if np.all(np.isfinite(out)) else np.inf
    assert err <= rel * float(np.abs(ref).max()), (err, float(np.abs(ref).max()), out.ravel()[:4])


def _scales_normal(q):
    """Every scale a Q/DQ reads is a finite normal float32 (0 * inf = NaN; 0 zeroes; subnormal loses bits)."""
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    for n in q.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] in inits:
            s = inits[n.input[1]].astype(np.float64)
            assert np.all(np.isfinite(s)) and np.all(np.abs(s) >= TINY), (n.name, s)
    return inits


def _conv(bias, w_scale=1.0):
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv")],
                  {"w": W * w_scale, "b": bias * (1.0 + np.arange(4))}, [1, 3, 4, 4], [1, 4, 4, 4])


def test_conv_whose_weight_scale_overflows_stays_float():
    """Inputs near 1e-28 (activation scale 1e-30) and a bias of 1e20: the weight scale raised for the
    bias to fit int32 (bias / (x_scale * 2**30)) is 1e41, inf in float32: every weight dequantized to
    0 * inf and the output (4e20) came out 0, onnxruntime's QLinearConv or not."""
    feeds = _feeds((1, 3, 4, 4), 1e-28)
    clean, q, plan, _ = _quantize(_conv(1e20), feeds)
    _close(clean, q, feeds[0])
    assert "conv" not in plan.nodes and "weight scale is inf" in plan.skipped["conv"], plan.skipped
    _scales_normal(q)
    assert any(n.op_type == "Conv" and n.input[1] == "w" for n in q.graph.node)  # float weights


def test_no_q_after_a_conv_left_float_whose_input_is_quantized_anyway():
    """x -> conv0 (int8) and x -> conv1 (bias 1e20: weight scale inf, left float) -> conv2: conv2
    quantized conv1's output, so conv1 sat between DQ(x) and a Q and onnxruntime quantized it itself
    (its own scales: bias / (x_scale * w_scale) far beyond int32); the output came out 0. conv2 is
    left float too, with the reason."""
    w = [RNG.standard_normal((4, 4, 1, 1)) for _ in range(3)]
    m = _model([helper.make_node("Conv", ["x", "w0"], ["a"], name="conv0"),
                helper.make_node("Conv", ["x", "w1", "b1"], ["b"], name="conv1"),
                helper.make_node("Conv", ["b", "w2"], ["c"], name="conv2"),
                helper.make_node("Add", ["a", "c"], ["y"], name="add")],
               {"w0": w[0] * 1e20, "w1": w[1], "b1": np.full(4, 1e20), "w2": w[2] * 1e-20}, [1, 4, 4, 4], [1, 4, 4, 4])
    feeds = _feeds((1, 4, 4, 4), 1e-28)
    clean, q, plan, _ = _quantize(m, feeds)
    _close(clean, q, feeds[0])
    assert "weight scale is inf" in plan.skipped["conv1"], plan.skipped
    assert plan.skipped["conv2"] == "its input comes from conv1, left float for a scale float32 cannot hold"
    assert "conv0" in plan.nodes
    _scales_normal(q)


def test_conv_whose_bias_scale_rounds_to_0_stays_float():
    """Inputs and weights near 1e-21, a bias near 1e-37 (all normal): x_scale * w_scale is 1e-46,
    0 in float32, so the bias dequantized to 0 and the output (2e-37, the bias) came out 0."""
    feeds = _feeds((1, 3, 4, 4), 1e-21)
    clean, q, plan, _ = _quantize(_conv(5e-38, w_scale=1e-21), feeds)
    _close(clean, q, feeds[0])
    assert "bias scale (activation scale x weight scale) rounds to 0" in plan.skipped["conv"], plan.skipped
    _scales_normal(q)


def test_conv_whose_bias_scale_is_subnormal_stays_float():
    """Inputs near 1e-18, weights near 1e-20: the bias scale, about 1e-42, would be subnormal (12 of
    float32's 24 bits)."""
    feeds = _feeds((1, 3, 4, 4), 1e-18)
    clean, q, plan, _ = _quantize(_conv(1e-37, w_scale=1e-20), feeds)
    assert "bias scale (activation scale x weight scale) is subnormal" in plan.skipped["conv"], plan.skipped
    _scales_normal(q)
    _close(clean, q, feeds[0])


def test_gemm_whose_alpha_rounds_the_folded_weights_to_0_stays_float():
    """alpha = 1e-36 on weights near 1e-10 (inputs near 1e30, output near 1e-15): alpha * w rounded to
    float32 was 0, each channel then took scale 1 and int8 weights 0, and the output came out 0.
    Folded in float64, the weight scale (1e-48) is what float32 cannot hold: refused."""
    w = RNG.standard_normal((8, 4)) * 1e-10
    m = _model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", alpha=1e-36)],
               {"w": w, "b": np.zeros(4)}, [2, 8], [2, 4])
    feeds = _feeds((2, 8), 1e30)
    clean, q, plan, _ = _quantize(m, feeds)
    _close(clean, q, feeds[0])
    assert "weight scale rounds to 0" in plan.skipped["gemm"], plan.skipped
    _scales_normal(q)


def test_gemm_alpha_and_beta_still_fold_within_the_range():
    w = RNG.standard_normal((8, 4))
    m = _model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", alpha=1e-3, beta=2.0)],
               {"w": w, "b": RNG.standard_normal(4)}, [2, 8], [2, 4])
    feeds = _feeds((2, 8), 1.0)
    clean, q, plan, stats = _quantize(m, feeds)
    assert stats.get("qdq_gemm_weights") == 1 and "kept_float" not in stats
    inits = _scales_normal(q)
    assert not any(a.dtype == np.float32 and a.size == 32 for a in inits.values())  # no float weight left
    _close(clean, q, feeds[0])


def _conv_then(op, const, w_scale):
    """Conv (weights scaled by w_scale) -> op with a [1,4,4,4] constant (not foldable into the Conv)."""
    return _model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                   helper.make_node(op, ["c", "k"], ["y"], name=op.lower())],
                  {"w": W * w_scale, "k": const}, [1, 3, 4, 4], [1, 4, 4, 4])


def test_div_by_a_constant_whose_reciprocal_is_subnormal_stays_a_div():
    """Div by 2e38 (values near 1e37): 1/d = 5e-39 is subnormal in float32; x * float32(1/d) is off
    from x / d by more than rounding (shown here), and the operand's scale would be 2e-41."""
    d = np.full((1, 4, 4, 4), 2e38)
    x = (RNG.standard_normal(4096) * 1e37).astype(f32)
    r = f32(1.0) / f32(2e38)
    assert r < TINY
    ulps = np.abs(x * r - x / f32(2e38)) / np.spacing(np.abs(x / f32(2e38)))
    assert ulps.max() > 1  # (a subnormal reciprocal keeps 21 bits: several ulps off)
    feeds = _feeds((1, 3, 4, 4), 1.0)
    clean, q, plan, stats = _quantize(_conv_then("Div", d, 1e37), feeds)
    assert "div" in plan.nodes
    assert "Div" in [n.op_type for n in q.graph.node]
    assert any("the reciprocal 1/d is subnormal" in k for k in stats["kept_float"]), stats
    inits = _scales_normal(q)
    assert not any(a.dtype == np.float32 and np.any((a != 0) & (np.abs(a) < TINY)) for a in inits.values())
    _close(clean, q, feeds[0])


def test_div_by_a_constant_with_a_normal_reciprocal_still_becomes_a_mul():
    d = np.full((1, 4, 4, 4), 3e35)  # 1/d = 3.3e-36 and its uint8 scale 1.3e-38: normal
    feeds = _feeds((1, 3, 4, 4), 1.0)
    clean, q, plan, stats = _quantize(_conv_then("Div", d, 1e35), feeds)
    assert stats.get("qdq_div_constant") == 1 and "kept_float" not in stats, stats
    assert "Div" not in [n.op_type for n in q.graph.node]
    _scales_normal(q)
    _close(clean, q, feeds[0])


def test_constant_operand_whose_scale_is_subnormal_stays_float():
    """Mul by a constant near 1e-37: its uint8 scale (max / 255 = 4e-40) would be subnormal."""
    k = (1.0 + np.arange(64)).reshape(1, 4, 4, 4) / 64 * 1e-37
    feeds = _feeds((1, 3, 4, 4), 1.0)
    clean, q, plan, stats = _quantize(_conv_then("Mul", k, 1e30), feeds)
    assert any("the constant operand's scale is subnormal" in key for key in stats["kept_float"]), stats
    inits = _scales_normal(q)
    assert any(a.dtype == np.float32 and a.shape == (1, 4, 4, 4) for a in inits.values())  # the float operand
    _close(clean, q, feeds[0])
