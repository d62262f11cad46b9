"""Float16 overflow and rounding (issue 27 item 3): the converter keeps values float16 cannot hold
in float32, and verify judges a float16 model in float16 arithmetic (onnxopt.verify.fp16).

onnxruntime's CPU provider computes many float16 ops in float32, so a float16 model that gives
inf/NaN on a GPU "agreed" there. The three cases of the issue, as small models: a MatMul reaching
409,600 (x[2,4096] @ 10s, / 1000), x*300*300/1e4 between two MatMuls, and (x+1000)-1000 between
two MatMuls (float16's spacing at 1000 is 0.5). The oracle is onnx's reference evaluator, which
computes in the model's declared types.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxopt import optimize
from onnxopt.cli import main as cli_main
from onnxopt.transforms.precision import convert_fp16
from onnxopt.verify import verify

from helpers import FP16_ARITH_CASES as CASES
from helpers import FP16_W16 as W16
from helpers import error_of_range, init, model, reference_output, tinfo

@pytest.mark.parametrize("case", CASES)
def test_the_plain_conversion_fails_in_float16_arithmetic(case):
    """The oracle: the case's plain float16 conversion (no data) overflows or misses the bound in
    onnx's reference evaluator, while onnxruntime's CPU provider agrees with the original."""
    src, feeds = CASES[case]()
    half = optimize(src, precision="fp16")
    ref32 = reference_output(src, feeds)
    got = reference_output(half, feeds)
    assert not np.isfinite(got).all() or error_of_range(ref32, got) > 0.01
    import onnxruntime as ort
    cpu = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.isfinite(cpu).all() and error_of_range(ref32, cpu) <= 0.01  # what misled verify


@pytest.mark.parametrize("case", CASES)
def test_verify_judges_float16_in_float16_arithmetic(case, tmp_path, capsys):
    src, feeds = CASES[case]()
    half = optimize(src, precision="fp16")  # plain: what `optimize --precision fp16` without data writes
    report = verify(src, half, feeds=feeds, runs=0)
    assert report["providers"]["cpu"]["ok"]  # onnxruntime's CPU provider computes in float32 here
    f = report["fp16"]
    assert not report["ok"] and f["ok"] is False, f
    assert f["arithmetic"].startswith("float16") and "these inputs only" in f["note"]
    row = f["outputs"][0]
    assert not row["ok"] and ("inf/NaN" in row["problem"] or row["error_of_range"] > 0.01), row
    # the command line: the terminal line and the JSON name the arithmetic
    a, b, npz = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "in.npz"
    onnx.save(src, a)
    onnx.save(half, b)
    np.savez(npz, **feeds)
    code = cli_main(["verify", str(a), str(b), "--inputs", str(npz), "--runs", "0", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code != 0 and "FLOAT16 ARITHMETIC: OUTPUTS DIFFER" in out
    assert "verdict: outputs differ in float16 arithmetic" in out and "these inputs only" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["fp16"]["arithmetic"] == f["arithmetic"] and saved["fp16"]["ok"] is False


@pytest.mark.parametrize("case", CASES)
def test_conversion_with_data_keeps_what_float16_cannot_hold(case):
    src, feeds = CASES[case]()
    out, rep = optimize(src, precision="fp16", return_report=True, verify="cpu",
                        verify_options={"feeds": feeds, "runs": 0})
    v = rep.verification
    assert v["ok"], v
    # in true float16 (onnx's reference evaluator, declared types) the result is finite and in bounds
    got = reference_output(out, feeds)
    assert np.isfinite(got).all() and error_of_range(reference_output(src, feeds), got) <= 0.01
    p = rep.precision
    assert p["ranges"]["source"].startswith("values at the data") and p["ranges"]["values_kept"] >= 1
    reasons = " ".join(p["kept_fp32"])
    assert ("beyond float16's range at the data" in reasons) or ("too fine for float16" in reasons), p["kept_fp32"]
    if "fp16" in v:  # (a model left with no float16 op is verified as float32)
        assert v["fp16"]["ok"] and v["fp16"]["arithmetic"].startswith("float16")


def test_the_converter_keeps_only_the_values_at_fault():
    """x*300*300/1e4 between MatMuls: the MatMuls and h*300 (|h| < 8: < 2400) stay float16; the
    second Mul, which overflows, and the Div reading it are float32."""
    src, feeds = CASES["mul300x300"]()
    out, rep = optimize(src, precision="fp16", return_report=True, verify="cpu",
                        verify_options={"feeds": feeds, "runs": 0})
    kept = rep.precision["kept_fp32"]
    assert sum(kept.values()) == 2 and rep.precision["nodes_fp16"] == 3, kept
    assert {k.split(":")[0] for k in kept} == {"Mul", "Div"}
    mms = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert all({i.name: i.data_type for i in out.graph.initializer}[n.input[1]] == TensorProto.FLOAT16 for n in mms)


@pytest.mark.parametrize("case", CASES)
def test_emulation_matches_the_reference_evaluator(case):
    from onnxopt.verify.fp16 import emulated, run_fp16

    src, feeds = CASES[case]()
    half = optimize(src, precision="fp16")
    (got,), how = run_fp16(half, [feeds])
    ref = reference_output(half, feeds)
    assert "rounded to float16" in how
    assert np.array_equal(np.isfinite(got[0][1]), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[0][1][fin], ref[fin], rtol=2e-3, atol=1e-3)
    onnx.checker.check_model(emulated(half))


def test_bounds_from_the_weights_keep_an_overflowing_op_without_data():
    """Sigmoid (|s| <= 1) x 1e5: at most 1e5, beyond float16 whatever the input; / 1e3 back in range.
    Without data, interval propagation keeps the Mul float32; the MatMuls convert."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Mul", ["s", "big"], ["m"]), helper.make_node("Div", ["m", "k"], ["d"]),
             helper.make_node("MatMul", ["d", "W"], ["y"])]
    src = model(nodes, [tinfo("x", [4, 16])], [tinfo("y", [4, 16])],
                [init("W", W16), init("big", np.array(1e5, np.float32)), init("k", np.array(1e3, np.float32))])
    m = ir.serde.deserialize_model(src)
    rep = convert_fp16(m)
    out = ir.serde.serialize_model(m)
    assert rep.ranges["source"].startswith("bounds from the weights")
    assert any(k.startswith("Mul:") and "bounds from the weights" in k for k in rep.kept_fp32), rep.kept_fp32
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}
    got = reference_output(out, feeds)
    assert np.isfinite(got).all() and error_of_range(reference_output(src, feeds), got) <= 0.01
    assert rep.nodes_fp16 >= 2  # the MatMuls


def test_a_realistic_model_still_converts_nearly_everything():
    """mobilenet_v2 (the zoo, photographs): with data, no value is near float16's range or too fine
    for it; all 100 nodes convert (measured: 100 float16, 0 kept), and verify agrees in float16
    arithmetic too."""
    from onnxopt.models import zoo

    spec = zoo.get("mobilenet_v2-legacy")
    path = spec.path()
    if not path.exists():
        pytest.skip("mobilenet_v2-legacy is not in the zoo cache (python -m onnxopt.models build --only "
                    "mobilenet_v2-legacy)")
    feeds = spec.inputs(path)
    _, rep = optimize(onnx.load(str(path)), precision="fp16", target="ort-cpu", return_report=True, verify="cpu",
                      verify_options={"feeds": feeds, "runs": 0})
    p, v = rep.precision, rep.verification
    assert p["nodes_fp16"] >= 0.95 * (p["nodes_fp16"] + p["nodes_fp32"]), p
    assert p["ranges"]["values_kept"] == 0, p["ranges"]
    assert v["ok"] and v["fp16"]["ok"] and v["fp16"]["arithmetic"].startswith("float16"), v["fp16"]


def _fp16_chain(order):
    """A float16 model: MatMul, then x*300/1e4*300 (in range) or x*300*300/1e4 (9e4 x |h|: overflow)."""
    F16 = TensorProto.FLOAT16
    ops = {"safe": [("Mul", "a"), ("Div", "d"), ("Mul", "a")], "overflow": [("Mul", "a"), ("Mul", "a"), ("Div", "d")]}
    nodes, prev = [helper.make_node("MatMul", ["x", "W"], ["h"])], "h"
    for k, (op, c) in enumerate(ops[order]):
        nodes.append(helper.make_node(op, [prev, c], [f"t{k}"]))
        prev = f"t{k}"
    nodes.append(helper.make_node("MatMul", [prev, "W"], ["y"]))
    return model(nodes, [tinfo("x", [4, 16], F16)], [tinfo("y", [4, 16], F16)],
                 [init("W", W16.astype(np.float16)), init("a", np.array(300, np.float16)),
                  init("d", np.array(1e4, np.float16))])


def test_verify_judges_two_float16_models_in_float16_arithmetic():
    """An optimized float16 model (a rewrite reordered x*300/1e4*300 into x*300*300/1e4): both
    models in float16 arithmetic, where the rewrite overflows; onnxruntime's CPU provider agrees."""
    feeds = {"x": np.random.default_rng(0).uniform(0, 2, (4, 16)).astype(np.float16)}
    report = verify(_fp16_chain("safe"), _fp16_chain("overflow"), feeds=feeds, runs=0)
    f = report["fp16_arithmetic"]
    assert report["providers"]["cpu"]["ok"] and not report["ok"] and f["ok"] is False, f
    assert f["arithmetic"].startswith("float16") and not f["outputs"][0]["ok"]
    same = verify(_fp16_chain("safe"), _fp16_chain("safe"), feeds=feeds, runs=0)
    assert same["ok"] and same["fp16_arithmetic"]["ok"]


def test_bisect_runs_a_float16_model_in_float16_arithmetic(tmp_path):
    from onnxopt.verify.bisect import bisect

    path = tmp_path / "m.onnx"
    onnx.save(_fp16_chain("safe"), path)
    feeds = {"x": np.random.default_rng(0).uniform(0, 2, (4, 16)).astype(np.float16)}
    report = bisect(str(path), feeds=feeds)
    assert report["arithmetic"].startswith("float16"), report


def test_the_command_line_names_the_arithmetic_in_its_line_json_and_html(tmp_path, capsys):
    src, feeds = CASES["plus-minus-1000"]()
    a, npz = tmp_path / "a.onnx", tmp_path / "in.npz"
    onnx.save(src, a)
    np.savez(npz, **feeds)
    code = cli_main([str(a), "-o", str(tmp_path / "b.onnx"), "--precision", "fp16", "--verify", "cpu", "--inputs",
                     str(npz), "--runs", "0", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: outputs agree on cpu and in float16 arithmetic" in out and "these inputs only" in out
    assert "value(s) float16 cannot hold, by the data" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    v = saved.get("verification") or saved["report"]["verification"]
    assert v["fp16"]["arithmetic"].startswith("float16") and v["fp16"]["ok"]
    page = (tmp_path / "r.html").read_text()
    assert "FLOAT16 ARITHMETIC: outputs agree" in page and "these inputs only" in page
