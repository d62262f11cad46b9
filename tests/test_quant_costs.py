"""The measured cost table (onnxopt/quantize/ort_cpu_costs.json, made by scripts/data/quant_costs.py) and
the ort-cpu plan's use of it: a configuration measured as not faster in int8 stays float, with the
table's reason; "portable" and use_costs=False ignore it; the nearest-key rule; the decision reads
the shipped table only (no timing), so the output is the same run to run."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt.ir import io
from onnxopt.quantize import plan as qplan

# --- the table ----------------------------------------------------------------------------------


def test_table_loads_with_machine_fields():
    data = json.loads(qplan.COSTS_PATH.read_text())
    m = data["machine"]
    for field in ("cpu", "flags", "cores", "onnxruntime"):
        assert m[field], field
    # the generator's command as run then (its flat name before scripts/ became a package)
    assert data["date"] and re.match(r"python (-m scripts\.data\.quant_costs|scripts/quant_costs\.py) ", data["command"])
    assert data["decide_threads"] in ("1", "default")
    table = qplan.load_costs()
    assert len(table.entries) >= 50
    for key, e in table.entries.items():
        assert qplan.config_key(e["fields"]) == key
        for threads in ("default", "1"):
            t = e["threads"][threads]
            assert t["float_us"] > 0 and t["int8_us"] > 0, key
            for k in ("q_in_us", "dq_in_us", "q_out_us", "dq_out_us"):
                assert t[k] >= 0, key
    ops = {e["fields"]["op"] for e in table.entries.values()}
    assert {"Conv", "Gemm", "Add", "Mul", "GlobalAveragePool"} <= ops
    forms = {e["fields"].get("form") for e in table.entries.values() if e["fields"]["op"] == "Conv"}
    assert {"depthwise", "full"} <= forms


# --- a depthwise 5x5 stride 2x1 Conv between two pointwise Convs ----------------------------------


def _dw_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    c = 64

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32))

    inits = []
    for name, arr in (("w0", w(c, 16, 3, 3)), ("b0", w(c)), ("w1", w(c, c, 3, 3)), ("b1", w(c)),
                      ("wd", w(c, 1, 5, 5)), ("bd", w(c)), ("w2", w(c, c, 3, 3)), ("b2", w(c))):
        arr.name = name
        inits.append(arr)
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["a0"], name="c0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a0"], ["a0r"], name="relu0"),
        helper.make_node("Conv", ["a0r", "w1", "b1"], ["a"], name="pw1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ar"], name="relu1"),
        helper.make_node("Conv", ["ar", "wd", "bd"], ["d"], name="dw", group=c, kernel_shape=[5, 5],
                         strides=[2, 1], pads=[2, 2, 2, 2]),
        helper.make_node("Relu", ["d"], ["dr"], name="relu2"),
        helper.make_node("Conv", ["dr", "w2", "b2"], ["y"], name="pw2", pads=[1, 1, 1, 1]),
    ]
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 32, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _ranges(names) -> dict:
    return {n: (0.0, 4.0) for n in names}  # (post-Relu ranges: the absorptions hold)


def _plan(proto, rules, **kw):
    model = io.to_ir(proto)
    tensors = qplan.calibration_tensors(model, rules, **kw)
    return model, qplan.make_plan(model, _ranges(tensors), rules, **kw)


def test_depthwise_5x5_stride_2x1_left_float_on_ort_cpu():
    table = qplan.load_costs()
    model = io.to_ir(_dw_model())
    dw = next(n for n in model.graph if n.name == "dw")
    fields = qplan.layer_config(dw, qplan.opsets_of(model))
    assert fields["form"] == "depthwise" and fields["kernel"] == "5x5" and fields["stride"] == "2x1"
    c = table.lookup(fields)
    assert c is not None and c.int8 > 1.0  # what the shipped table measured: int8 slower than float

    _, p = _plan(_dw_model(), qplan.target_rules("ort-cpu"))
    assert "dw" not in p.nodes
    reason = p.skipped["dw"]
    assert "int8 measured" in reason and "depthwise Conv 5x5 stride 2x1" in reason
    assert "ort_cpu_costs.json" in reason
    assert "pw1" in p.nodes and "pw2" in p.nodes  # the full 3x3 Convs around it stay int8

    for rules, kw in ((qplan.target_rules("portable"), {}), (qplan.target_rules("ort-cpu", use_costs=False), {}),
                      (qplan.target_rules("ort-cpu"), {"use_costs": False})):
        _, p = _plan(_dw_model(), rules, **kw)
        assert "dw" in p.nodes and "dw" not in p.skipped, rules.target


def test_quantized_model_runs_and_dw_conv_stays_float():
    ort = pytest.importorskip("onnxruntime")
    model, p = _plan(_dw_model(), qplan.target_rules("ort-cpu"))
    qplan.apply_plan(model, p, strict=True)
    proto = io.to_proto(model)
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    dw = [n for n in convs if any(a.name == "group" and a.i > 1 for a in n.attribute)]
    assert len(dw) == 1
    init = {i.name: i for i in proto.graph.initializer}
    assert dw[0].input[1] in init and init[dw[0].input[1]].data_type == TensorProto.FLOAT  # float weight kept
    x = np.random.default_rng(1).standard_normal((4, 16, 32, 64)).astype(np.float32)
    ref = ort.InferenceSession(_dw_model().SerializeToString(), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    a, b = ref.run(None, {"x": x})[0], got.run(None, {"x": x})[0]
    assert a.shape == b.shape and np.isfinite(b).all()


# --- the nearest-key rule -----------------------------------------------------------------------


def _entry(fields, float_us, int8_us, q=0.0, dq_in=None):
    t = {"float_us": float_us, "int8_us": int8_us, "q_in_us": q, "dq_in_us": q if dq_in is None else dq_in,
         "q_out_us": q, "dq_out_us": q}
    return {"fields": fields, "threads": {"1": t, "default": t}}


def _conv(form, k, s, ci, co, px):
    return {"op": "Conv", "form": form, "kernel": k, "stride": s, "dilation": "1x1", "ci": ci, "co": co, "px": px}


def test_nearest_key_rule():
    fields = [_conv("depthwise", "3x3", "1x1", 32, 32, 1024), _conv("depthwise", "3x3", "1x1", 32, 32, 4096),
              _conv("depthwise", "5x5", "1x1", 64, 64, 1024), _conv("full", "1x1", "1x1", 32, 64, 1024)]
    ratios = [2.0, 8.0, 3.0, 0.5]
    table = qplan.CostTable({"decide_threads": "1", "entries": {
        qplan.config_key(f): _entry(f, 10.0, 10.0 * r) for f, r in zip(fields, ratios)}})
    # exact
    c = table.lookup(fields[0])
    assert c.exact and c.int8 == pytest.approx(2.0)
    # missing channel bucket: the same kernel at 16 channels is one step from both 3x3 entries' ci/co
    # (2 steps), the px decides: 1024 is nearer than 4096
    c = table.lookup(_conv("depthwise", "3x3", "1x1", 16, 16, 1024))
    assert not c.exact and c.key == qplan.config_key(fields[0]) and c.int8 == pytest.approx(2.0)
    # a kernel mismatch costs 4 steps: 5x5 at 32 channels is nearer the 3x3 entries (4 + 1 px step...)
    # than nothing; 5x5 at 64 channels exists: a 5x5 query at 32 channels, px 1024 -> 5x5/64 (2 steps) wins
    # over 3x3/32 (4 steps)
    c = table.lookup(_conv("depthwise", "5x5", "1x1", 32, 32, 1024))
    assert c.key == qplan.config_key(fields[2])
    # unknown pixels (dynamic shape): both 3x3/32 entries tie; their geometric mean
    c = table.lookup(_conv("depthwise", "3x3", "1x1", 32, 32, None))
    assert not c.exact and c.int8 == pytest.approx(4.0)
    # another form is never a candidate
    assert table.lookup(_conv("grouped", "3x3", "1x1", 32, 32, 1024)) is None
    # the same lookup twice, and in another insertion order: the same answer
    rev = qplan.CostTable({"entries": dict(reversed(list(table.entries.items())))})
    q = _conv("depthwise", "3x3", "1x1", 32, 32, None)
    assert rev.lookup(q) == table.lookup(q)


def test_boundary_cost_of_an_elementwise_op(monkeypatch):
    """An Add whose int8 kernel is a little faster but whose output a float node reads (a DQ
    after it) is left float; read by a quantized node only, it is quantized."""
    f = {"op": "Add", "form": "const", "n": 1024}
    table = qplan.CostTable({"decide_threads": "1", "entries": {qplan.config_key(f): _entry(f, 10.0, 9.0, q=5.0, dq_in=1.0)}})
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"], name="add")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [numpy_helper.from_array(np.array(3.0, np.float32), "c")])
    m = io.to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    node = next(iter(m.graph))
    opsets = qplan.opsets_of(m)
    # int8 0.9 + DQ out 0.5 = 1.4 vs float 1.0 + DQ in 0.1 = 1.1 -> float
    reason = qplan.cost_decision(node, opsets, table, float_reader=True, quant_reader=False)
    assert reason and "1.40 vs 1.10" in reason
    # int8 0.9 vs float 1.0 + 0.1 (DQ in) + 0.5 (Q out) = 1.6: quantized
    assert qplan.cost_decision(node, opsets, table, float_reader=False, quant_reader=True) is None


# --- determinism --------------------------------------------------------------------------------


def test_plan_reads_the_table_only_and_is_deterministic(monkeypatch):
    ort = pytest.importorskip("onnxruntime")

    def no_timing(*a, **k):
        raise AssertionError("the plan must not run onnxruntime")

    monkeypatch.setattr(ort, "InferenceSession", no_timing)
    outs = []
    for _ in range(2):
        model, p = _plan(_dw_model(), qplan.target_rules("ort-cpu"))
        qplan.apply_plan(model, p, strict=True)
        outs.append((io.to_proto(model).SerializeToString(), json.dumps(p.as_dict(), sort_keys=True)))
    assert outs[0] == outs[1]


# --- Div by a constant (a decomposed HardSwish runs on integer kernels) --------------------------


def test_hardswish_decomposition_runs_on_integer_kernels(tmp_path):
    """x * Clip(x + 3, 0, 6) / 6 after a Conv: the Div by 6 becomes a Mul by 1/6, so the Add, the
    Mul and the Div run as QLinearAdd / QLinearMul (no float island, no Div left)."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32), "w")
    w2 = numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), "w2")
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("three", 3.0), ("zero", 0.0), ("six", 6.0), ("six_d", 6.0))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "three"], ["a"], name="add"),
             helper.make_node("Clip", ["a", "zero", "six"], ["r"], name="clip"),
             helper.make_node("Div", ["r", "six_d"], ["d"], name="div"),
             helper.make_node("Mul", ["c", "d"], ["h"], name="mul"),
             helper.make_node("Conv", ["h", "w2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "hs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, w2, *consts])
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    proto.ir_version = 8
    feeds = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    # ranges measured with onnxruntime (intermediate tensors exposed)
    model = io.to_ir(proto)
    rules = qplan.target_rules("ort-cpu", use_costs=False)
    tensors = qplan.calibration_tensors(model, rules)
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for t in tensors:
        if t not in ("x", "y"):
            probe.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    outs = [dict(zip(names, sess.run(None, f))) | f for f in feeds]
    ranges = {t: (min(float(o[t].min()) for o in outs), max(float(o[t].max()) for o in outs)) for t in tensors}
    p = qplan.make_plan(model, ranges, rules)
    assert {"add", "div", "mul"} <= set(p.nodes) and p.absorbed == {"clip": "a"}
    qplan.apply_plan(model, p, strict=True)
    q = io.to_proto(model)
    assert "Div" not in [n.op_type for n in q.graph.node]
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3
    got = ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"])
    kernels = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert kernels.count("QLinearMul") == 2 and kernels.count("QLinearAdd") == 1, kernels
    assert not {"Div", "Mul", "Add", "Clip"} & set(kernels), kernels
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    a, b = ref.run(None, feeds[0])[0].astype(np.float64), got.run(None, feeds[0])[0].astype(np.float64)
    assert 10 * np.log10(np.sum(a * a) / np.sum((a - b) ** 2)) > 25

