"""Edge cases of the INT8 quantizer found in review: old opsets (attributes that became inputs in
opset 10/11), non-finite constant operands, values without an inferred type (after contrib ops),
initializers listed as graph inputs, the cost reason's wording, corrupt calibration files, integer
outputs in the SQNR, and exclude entries that match nothing. Each is proved on a small model built
here, with onnxruntime where the numbers matter."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt.ir import io
from onnxopt.errors import UsageError
from onnxopt.quantize import plan as qplan

from helpers import minmax

ort = pytest.importorskip("onnxruntime")


def _session(proto: onnx.ModelProto):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(proto, feed):
    s = _session(proto)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feed)))


def _sqnr(ref, test) -> float:
    ref, test = np.asarray(ref, np.float64), np.asarray(test, np.float64)
    return float(10 * np.log10(np.sum(ref * ref) / max(np.sum((ref - test) ** 2), 1e-30)))


def _plan_apply(proto, feeds, *, per_channel=True, target="portable", dtypes=None, exclude=()):
    model = io.to_ir(proto)
    rules = qplan.target_rules(target, per_channel=per_channel, use_costs=False)
    kw = {"dtypes": dtypes} if dtypes is not None else {}
    tensors = qplan.calibration_tensors(model, rules, exclude=exclude, **kw)
    plan = qplan.make_plan(model, minmax(proto, tensors, feeds), rules, exclude=exclude, **kw)
    stats = qplan.apply_plan(model, plan, strict=True)
    return plan, stats, io.to_proto(model)


def _w(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# --- 1. opsets below 11 -------------------------------------------------------------------------


def _old_cnn(opset: int) -> onnx.ModelProto:
    """Pad(pads attr, value attr) -> Conv -> Clip(min=0, max=6 attrs) -> Conv, opset 9 or 10."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Pad", ["x"], ["p"], pads=[0, 0, 1, 1, 0, 0, 1, 1], value=0.5, name="pad"),
             helper.make_node("Conv", ["p", "W"], ["c"], name="conv"),
             helper.make_node("Clip", ["c"], ["r"], min=0.0, max=6.0, name="clip"),
             helper.make_node("Conv", ["r", "W2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 14, 14])],
                          [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "W"),
                           numpy_helper.from_array(_w(rng, 8, 8, 3, 3) * 0.3, "W2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=5)
    onnx.checker.check_model(m)
    return m


def _feeds(n=4, shape=(1, 3, 16, 16), seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("opset", [9, 10])
def test_old_opset_pad_clip_raised_to_13(opset):
    m = _old_cnn(opset)
    plan, stats, q = _plan_apply(m, _feeds())
    assert stats["opset"] == [opset, 13] and {"Pad", "Clip"} <= set(stats["opset_converted"])
    onnx.checker.check_model(q, full_check=True)
    assert not [n for n in q.graph.node if n.op_type == "Clip"]  # absorbed into conv's output range
    feed = _feeds(1, seed=9)[0]
    assert _sqnr(_run(m, feed)["y"], _run(q, feed)["y"]) > 25


def test_old_opset_per_tensor_keeps_opset_10():
    m = _old_cnn(10)
    plan, stats, q = _plan_apply(m, _feeds(), per_channel=False)
    assert stats["opset"] == [10, 10] and stats["opset_converted"] == []
    onnx.checker.check_model(q, full_check=True)
    assert any(n.op_type == "QuantizeLinear" for n in q.graph.node)
    feed = _feeds(1, seed=9)[0]
    assert _sqnr(_run(m, feed)["y"], _run(q, feed)["y"]) > 25
    # below 10 there is no QuantizeLinear: raised even per tensor
    _, stats9, q9 = _plan_apply(_old_cnn(9), _feeds(), per_channel=False)
    assert stats9["opset"] == [9, 13]
    onnx.checker.check_model(q9, full_check=True)


@pytest.mark.parametrize("opset", [7, 9])
def test_raise_opset_old_forms_exact(opset):
    """Slice-1, TopK-1, Upsample-7/9 (nearest, upscale), Scatter-9, BatchNormalization-7, Clip-6 with
    one bound: the same outputs on onnxruntime after raise_opset(7/9 -> 13)."""
    rng = np.random.default_rng(4)
    up = (helper.make_node("Upsample", ["s"], ["u"], mode="nearest", scales=[1.0, 1.0, 2.0, 3.0], name="up")
          if opset == 7 else helper.make_node("Upsample", ["s", "scales"], ["u"], mode="nearest", name="up"))
    nodes = [helper.make_node("Slice", ["x"], ["s"], starts=[1, 2], ends=[3, 100], axes=[1, 3], name="slice"),
             helper.make_node("TopK", ["s"], ["tv", "ti"], k=2, axis=-1, name="topk"), up,
             helper.make_node("BatchNormalization", ["x", "g", "b", "mu", "var"], ["bn"], name="bn",
                               **({"spatial": 1} if opset < 9 else {})),
             helper.make_node("Clip", ["bn"], ["cl"], min=-0.5, name="clip_lo")]
    outs = ["tv", "u", "cl"]
    shapes = {"tv": [1, 2, 5, 2], "u": [1, 2, 10, 12], "cl": [1, 4, 5, 6], "sc": [1, 4, 5, 6]}
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales"),
             *(numpy_helper.from_array(np.abs(_w(rng, 4)) + 0.5, n) for n in ("g", "b", "mu", "var"))]
    if opset >= 9:
        nodes.append(helper.make_node("Scatter", ["x", "idx", "upd"], ["sc"], axis=1, name="scatter"))
        outs.append("sc")
        inits += [numpy_helper.from_array(np.array([0, 2], np.int64).reshape(1, 2, 1, 1), "idx"),
                  numpy_helper.from_array(_w(rng, 1, 2, 1, 1), "upd")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in outs]
                          + [helper.make_tensor_value_info("ti", TensorProto.INT64, [1, 2, 5, 2])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=4)
    onnx.checker.check_model(m)
    model = io.to_ir(m)
    converted = qplan.raise_opset(model, 13)
    assert converted == sorted({"Clip", "Slice", "TopK", "Upsample"}
                               | ({"Scatter"} if opset >= 9 else {"BatchNormalization"}))
    out = io.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    feed = {"x": _w(rng, 1, 4, 5, 6)}
    a, b = _run(m, feed), _run(out, feed)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_old_opset_refused_up_front_naming_the_op():
    """A nearest Resize-10 that scales down has no exact opset-11 form on onnxruntime: refused by
    calibration_tensors (before any calibration), the message naming the op and node."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Resize", ["c", "scales"], ["y"], mode="nearest", name="down")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(_w(rng, 4, 3, 1, 1), "W"),
                           numpy_helper.from_array(np.array([1, 1, 0.5, 0.5], np.float32), "scales")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 10)], ir_version=5)
    model = io.to_ir(m)
    with pytest.raises(UsageError, match=r"Resize 'down'.*scales down") as e:
        qplan.calibration_tensors(model, qplan.target_rules("portable", use_costs=False))
    assert "\n" not in str(e.value)
    # per tensor, opset 10 needs no raise: nothing to refuse
    assert qplan.calibration_tensors(model, qplan.target_rules("portable", per_channel=False, use_costs=False))
    with pytest.raises(UsageError, match="opsets below 7"):
        qplan.raise_opset(io.to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 6)])), 13)


def test_lrn_mvn_types_only_from_11():
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("LRN", ["x"], ["l"], size=3, name="lrn"),
             helper.make_node("MeanVarianceNormalization", ["l"], ["y"], name="mvn")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 6])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
    model = io.to_ir(m)
    assert qplan.raise_opset(model, 13) == []
    out = io.to_proto(model)
    onnx.checker.check_model(out)  # (full_check trips on onnx's own MVN function body)
    assert {o.domain: o.version for o in out.opset_import}[""] == 13
    feed = {"x": _w(rng, 1, 4, 5, 6)}
    np.testing.assert_array_equal(_run(m, feed)["y"], _run(out, feed)["y"])


# --- 2. non-finite constant operands ------------------------------------------------------------


def test_non_finite_constant_operand_stays_float():
    """Where(mask, -inf, conv) -> Softmax: the Where stays float (a quantized -inf saturates to the
    lowest level and the masked positions get probability); so does an Add of +inf. The Conv is
    still quantized."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Conv", ["x", "A"], ["m"], name="conv"),
             helper.make_node("Where", ["mask", "ninf", "m"], ["w"], name="where"),
             helper.make_node("Softmax", ["w"], ["y"], axis=-1, name="sm"),
             helper.make_node("Add", ["m", "pinf"], ["z"], name="add_inf"),
             helper.make_node("Mul", ["m", "half"], ["h"], name="mul_ok")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 1, 32]),
                     helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 16, 1, 32])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 16, 1, 32]) for n in ("y", "z", "h")],
        [numpy_helper.from_array(_w(rng, 16, 8, 1, 1), "A"),
         numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
         numpy_helper.from_array(np.array([np.inf], np.float32), "pinf"),
         numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    mask = np.zeros((2, 16, 1, 32), bool)
    mask[..., 16:] = True
    feeds = [{"x": _w(rng, 2, 8, 1, 32), "mask": mask} for _ in range(4)]
    plan, _, q = _plan_apply(m, feeds)
    assert "not finite" in plan.skipped["where"] and "not finite" in plan.skipped["add_inf"]
    assert "where" not in plan.nodes and "add_inf" not in plan.nodes
    assert {"conv", "mul_ok"} <= set(plan.nodes)
    out = _run(q, feeds[0])
    assert out["y"][..., 16:].max() == 0.0  # the masked positions keep no probability
    assert np.all(np.isposinf(out["z"]))


# --- 3. values onnx cannot type (contrib ops) ---------------------------------------------------


def _gelu_model():
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="mm1"),
             helper.make_node("Gelu", ["a"], ["g"], domain="com.microsoft", name="gelu"),
             helper.make_node("MatMul", ["g", "B"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 16])],
                          [numpy_helper.from_array(_w(rng, 32, 64) * 0.2, "A"),
                           numpy_helper.from_array(_w(rng, 64, 16) * 0.2, "B")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])


def test_untyped_value_after_a_contrib_op():
    m = _gelu_model()
    feeds = _feeds(4, (2, 5, 32))
    plan, _, _ = _plan_apply(m, feeds)
    assert plan.nodes == ["mm1"]
    assert "unknown type" in plan.skipped["mm2"] and "not float32" not in plan.skipped["mm2"]
    plan, _, q = _plan_apply(m, feeds, dtypes={"g": TensorProto.FLOAT})
    assert plan.nodes == ["mm1", "mm2"] and "g" in plan.params
    feed = _feeds(1, (2, 5, 32), seed=5)[0]
    assert _sqnr(_run(m, feed)["y"], _run(q, feed)["y"]) > 25
    # mm2's weight is int8 behind a DequantizeLinear: no float copy of B is left
    assert "B" not in {i.name for i in q.graph.initializer}
    # typed otherwise (an int64 output): not float, said so
    plan, _, _ = _plan_apply(m, feeds, dtypes={"g": TensorProto.INT64})
    assert plan.skipped["mm2"] == "input is not float32"


# --- 4. initializers also listed as graph inputs ------------------------------------------------


def test_initializer_graph_input_left_float_and_opset_kept():
    rng = np.random.default_rng(9)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="gemm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("W", TensorProto.FLOAT, [8, 4]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
                          [numpy_helper.from_array(_w(rng, 8, 4), "W"), numpy_helper.from_array(_w(rng, 4), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=3)
    plan, stats, q = _plan_apply(m, _feeds(2, (4, 8)))
    assert plan.empty and plan.nodes == [] and plan.params == {}
    assert "'W'" in plan.skipped["gemm"] and "graph input" in plan.skipped["gemm"]
    assert stats["opset"] == [11, 11]  # nothing quantized: the opset is not raised
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in q.graph.node)


# --- 5. the cost reason --------------------------------------------------------------------------


def test_cost_reason_does_not_contradict_itself():
    """int8 kernel 0.62x the float layer, 1.33x with its Q/DQ: the reason says both, as such."""
    f = {"op": "Add", "form": "const", "n": 1024}
    t = {"float_us": 10.0, "int8_us": 6.2, "q_in_us": 3.0, "dq_in_us": 0.0, "q_out_us": 0.0, "dq_out_us": 4.1}
    table = qplan.CostTable({"decide_threads": "1",
                             "entries": {qplan.config_key(f): {"fields": f, "threads": {"1": t, "default": t}}}})
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"], name="add")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [numpy_helper.from_array(np.array(3.0, np.float32), "c")])
    m = io.to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    reason = qplan.cost_decision(next(iter(m.graph)), qplan.opsets_of(m), table, input_quantized=False,
                                 float_reader=True, quant_reader=False)
    assert reason is not None
    assert "kernel 0.62x the float layer, but 1.33x with the Q/DQ" in reason
    assert "faster than" not in reason and "slower than" not in reason


# --- 8. exclude entries that match nothing ------------------------------------------------------


def test_unmatched_exclude_entries():
    m = _old_cnn(10)
    model = io.to_ir(m)
    rules = qplan.target_rules("portable", use_costs=False)
    tensors = qplan.calibration_tensors(model, rules)
    ranges = minmax(m, tensors, _feeds())
    plan = qplan.make_plan(model, ranges, rules, exclude=["conv2", "Relu", "Pad", "no_such_node"])
    assert plan.unmatched_exclude == ["Relu", "no_such_node"]
    assert plan.skipped["conv2"] == "excluded by the user"
    assert plan.as_dict()["unmatched_exclude"] == ["Relu", "no_such_node"]
    assert qplan.make_plan(model, ranges, rules).unmatched_exclude == []


# --- 6. calibration files that are not NumPy files ----------------------------------------------


def _one_input_model():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_corrupt_calibration_files_named_as_such(tmp_path):
    from onnxopt.quantize.data import CalibrationError, open_calibration

    m = _one_input_model()
    bad_npz = tmp_path / "calib.npz"
    bad_npz.write_bytes(b"this is not a zip archive at all" * 4)
    with pytest.raises(CalibrationError,
                       match=r"calib\.npz: cannot read it as \.npz \(not a \.npz file: not a zip archive\)$") as e:
        open_calibration(bad_npz, m)
    assert "pickle" not in str(e.value) and "\n" not in str(e.value)
    folder = tmp_path / "feeds"
    folder.mkdir()
    np.save(folder / "0000.npy", np.ones((1, 4), np.float32))
    (folder / "0001.npy").write_bytes(b"garbage" * 10)
    np.savez(folder / "0002.npz", x=np.ones((1, 4), np.float32))
    with pytest.raises(CalibrationError, match=r"calibration feed 1 \(0001\.npy\): .*not a \.npy file") as e:
        list(open_calibration(folder, m))
    assert "pickle" not in str(e.value)
    (folder / "0001.npy").unlink()
    (folder / "0002.npz").write_bytes(b"")
    with pytest.raises(CalibrationError, match=r"not a \.npz file: empty"):
        list(open_calibration(folder, m))


def test_numpy_integers_accepted_as_counts():
    from onnxopt.quantize.data import open_calibration

    calib = open_calibration([{"x": np.full((1, 4), i, np.float32)} for i in range(6)], _one_input_model())
    part, held = calib.split(np.int64(2))
    assert (len(part), len(held)) == (4, 2)
    assert [f["x"][0, 0] for f in held] == [1.0, 4.0]
    assert [len(calib.shard(np.int32(i), np.int64(3))) for i in range(3)] == [2, 2, 2]


# --- 7. SQNR of integer outputs -----------------------------------------------------------------


def test_output_sqnr_scores_float_outputs_only():
    from onnxopt.quantize.fidelity import output_sqnr

    rng = np.random.default_rng(11)
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="mm"),
             helper.make_node("ArgMax", ["a"], ["cls"], axis=1, keepdims=0, name="am"),
             helper.make_node("Relu", ["a"], ["r"], name="relu")]
    outs = [helper.make_tensor_value_info("cls", TensorProto.INT64, ["B"]),
            helper.make_tensor_value_info("r", TensorProto.FLOAT, ["B", 100])]
    feeds = [{"x": _w(rng, 8, 16)} for _ in range(4)]
    for outputs, expect in ((outs, ["r"]), (outs[:1], [])):
        g = helper.make_graph(nodes if len(outputs) == 2 else nodes[:2], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])], outputs,
                              [numpy_helper.from_array(_w(rng, 16, 100), "A")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        plan, _, q = _plan_apply(m, feeds)
        assert plan.nodes and plan.nodes[0] == "mm"
        db = output_sqnr(m, q, feeds)
        assert list(db) == expect
        if expect:
            assert 20 < db["r"] < 80
