"""Target-aware rule selection: rules not valid for the target and rules whose fusion the measured
benefit table says does not pay there are left out, and the report says which and why."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxopt.targets import benefit
from onnxopt.library import registry
from onnxopt import Op, Rule, optimize
from onnxopt.errors import UsageError
from onnxopt.reporting.text import format_optimize


def _max0(m, b):
    return b.op("Max", m["x"], b.const(np.zeros((), np.float32)))


def _rule(name, targets=("ort-cpu", "ort-cuda"), key=None, exact=False):
    return Rule(name, Op("Relu", "x"), replacement=_max0, targets=targets, exact=exact, benefit=key,
                doc="Relu as Max(x, 0) (test)")


SLOW_ON_CPU = {"entries": {"fuse_k": {"ort-cpu": {"apply": False, "evidence": {
    "ratio": 1.07, "models": {"bert-legacy": {"without_ms": 10.0, "with_ms": 10.7, "ratio": 1.07}},
    "source": {"command": "python -m scripts.data.benefit --keys fuse_k", "date": "2026-11-23 22:00 UTC",
               "machine": {"cpu": "AMD EPYC", "logical_cores": 2}}}},
    "ort-cuda": {"apply": True, "evidence": {"ratio": 0.8, "source": {"command": "gpu run", "date": "2026-11-23"}}}}}}


def test_select_records_rules_left_out_for_the_target():
    rules = [_rule("anywhere", targets=("portable", "ort-cpu", "ort-cuda")), _rule("ort_only"),
             _rule("cuda_only", targets="ort-cuda"), _rule("fused", key="fuse_k"), _rule("unmeasured", key="other_k")]
    with benefit.using(SLOW_ON_CPU):
        skipped = []
        chosen = registry.select(rules, target="cpu", skipped=skipped)
        assert [r.name for r in chosen] == ["anywhere", "ort_only", "unmeasured"]
        assert [(s["rule"], s["why"]) for s in skipped] == [("cuda_only", "target"), ("fused", "benefit")]
        assert skipped[0]["reason"] == "cuda_only: not valid for ort-cpu (valid for ort-cuda)"
        reason = skipped[1]["reason"]
        assert reason.startswith("fused: skipped for ort-cpu: measured 1.07x slower (bert-legacy 1.07x slower)")
        assert "scripts.data.benefit --keys fuse_k" in reason and "2026-11-23" in reason and "AMD EPYC" in reason
        assert skipped[1]["key"] == "fuse_k" and skipped[1]["evidence"]["ratio"] == 1.07
        skipped = []
        assert [r.name for r in registry.select(rules, target="cuda", skipped=skipped)] == [
            "anywhere", "ort_only", "cuda_only", "fused", "unmeasured"]
        assert skipped == []
        skipped = []
        assert [r.name for r in registry.select(rules, skipped=skipped)] == ["anywhere"]
        assert {s["rule"] for s in skipped} == {"ort_only", "cuda_only", "fused", "unmeasured"}
        # disabled and non-exact rules are the user's choice, not the target's: not recorded
        skipped = []
        assert registry.select(rules, target="cpu", disable=["ort_only"], exact=True, skipped=skipped) == []
        assert [s["rule"] for s in skipped] == ["cuda_only"]
        with pytest.raises(UsageError, match="unknown rule"):
            registry.select(rules, disable=["nope"])
    with benefit.using(None):  # an empty table: every rule with a key runs
        assert "fused" in [r.name for r in registry.select(rules, target="cpu")]


def _model():
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())])
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def _ops(model):
    return [n.op_type for n in model.graph.node]


def test_optimize_leaves_out_what_does_not_pay_and_reports_why():
    rule = _rule("relu_as_max", key="fuse_k")
    with benefit.using(SLOW_ON_CPU):
        out, rep = optimize(_model(), rules=[rule], target="ort-cpu", return_report=True)
        assert "Relu" in _ops(out) and "relu_as_max" not in rep.fired
        d = rep.as_dict()
        assert d["skipped"][0]["rule"] == "relu_as_max" and d["skipped"][0]["why"] == "benefit"
        text = format_optimize(rep, "in.onnx", "out.onnx")
        assert "skipped for ort-cpu by the measured benefit table" in text
        assert "relu_as_max: skipped for ort-cpu: measured 1.07x slower" in text
        out, rep = optimize(_model(), rules=[rule], target="ort-cuda", return_report=True)
        assert "Max" in _ops(out) and rep.fired == {"relu_as_max": 1} and rep.skipped == []
        out, rep = optimize(_model(), rules=[rule], return_report=True)  # portable: not valid there
        assert "Relu" in _ops(out)
        assert rep.skipped == [{"rule": "relu_as_max", "why": "target",
                                "reason": "relu_as_max: not valid for portable (valid for ort-cpu, ort-cuda)"}]
        assert "1 rule not valid for portable: relu_as_max" in format_optimize(rep, "a", "b")


def test_the_shipped_table_leaves_skip_layer_normalization_out_on_cpu_only():
    rule = _rule("sln_test", key="skip_layer_normalization")
    _, rep = optimize(_model(), rules=[rule], target="ort-cpu", return_report=True)
    assert rep.skipped and rep.skipped[0]["reason"].startswith("sln_test: skipped for ort-cpu: measured 1.")
    assert "slower" in rep.skipped[0]["reason"] and "benefit-cpu" in rep.skipped[0]["reason"]
    _, rep = optimize(_model(), rules=[rule], target="ort-cuda", return_report=True)
    assert rep.fired == {"sln_test": 1}


def test_builtin_rules_with_a_benefit_key_use_known_keys():
    keys = {"layer_normalization", "rms_normalization", "gelu", "fast_gelu", "bias_gelu", "skip_layer_normalization",
            "attention", "embed_layer_normalization", "rotary_embedding", "group_query_attention",
            "packed_projections"}
    for r in registry.builtin_rules():
        if r.benefit is not None:
            assert r.benefit in keys, f"{r.name}: benefit key {r.benefit!r} is not one of the table's keys"
            # a fusion with a benefit key is for onnxruntime's targets, or (rules/standard_*.py) a portable one
            # into a standard op only (measured on onnxruntime's CPU provider, the table's "portable" entry)
            assert "portable" not in r.targets or (set(r.targets) == {"portable"} and r.name.startswith("standard_")), \
                f"{r.name}: a fusion with a benefit key is for onnxruntime targets (or a portable standard_ rule)"


def test_list_rules_names_what_the_table_leaves_out(tmp_path, capsys):
    from onnxopt.cli import main

    f = tmp_path / "rules.py"
    f.write_text("import numpy as np\nfrom onnxopt import Op, Rule\n"
                 "RULES = [Rule('sln_test', Op('Relu', 'x'), replacement=lambda m, b: b.op('Max', m['x'], "
                 "b.const(np.zeros((), np.float32))), targets=('ort-cpu', 'ort-cuda'), exact=False, "
                 "benefit='skip_layer_normalization', doc='test')]\n")
    assert main(["--list-rules", "--target", "cpu", "--rules", str(f)]) == 0
    out = capsys.readouterr().out
    assert "left out for ort-cpu by the measured benefit table" in out and "sln_test: skipped for ort-cpu" in out
    assert main(["--list-rules", "--target", "cuda", "--rules", str(f)]) == 0
    out = capsys.readouterr().out
    assert "sln_test" in out and "left out for" not in out


def test_the_report_lists_each_fusion_with_hits_and_misses_and_the_fp16_summary():
    from onnxopt.models import zoo

    path = zoo.get("gpt2-legacy").path()
    if not path.exists():
        pytest.skip("the zoo's gpt2-legacy is not built (python -m onnxopt.models build --only gpt2-legacy)")
    _, rep = optimize(onnx.load(str(path)), target="ort-cuda", precision="fp16", return_report=True)
    assert rep.fusions["attention_fusion"]["hits"] == 4 and rep.fusions["fast_gelu"]["hits"] == 4
    skip = rep.fusions["skip_layer_normalization"]  # dynamic axes: some sums not proven the same size
    assert 4 <= skip["hits"] <= 9
    assert skip["missed"] == 0 or "broadcast" in next(iter(skip["reasons"]))
    assert rep.as_dict()["fusions"]["attention_fusion"]["key"] == "attention"
    text = format_optimize(rep, "in.onnx", "out.onnx")
    assert "fusions:" in text and "attention_fusion: 4 fused" in text
    assert "float16:" in text and "input and output types kept" in text


def test_provider_options_a_provider_does_not_take_are_one_line_errors(tmp_path):
    """onnxruntime drops an option its provider does not know without a word; verify says so instead
    of reporting it as applied; a malformed option, or one without --verify, is refused up front."""
    from onnxopt.cli import main
    from onnxopt.verify import verify

    m = _model()
    with pytest.raises(UsageError, match="CPUExecutionProvider has no such option"):
        verify(m, m, providers="cpu", runs=0, provider_options=["cpu:bogus_option=maybe"])
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--provider-option", "garbage", "-q"]) == 2
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--provider-option", "cpu:x=1", "-q"]) == 2
    assert not (tmp_path / "o.onnx").exists()


def test_the_verification_table_of_a_float16_model_shows_its_bounds():
    from onnxopt.reporting.text import format_verification
    from onnxopt.verify import verify

    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor("w", TensorProto.FLOAT, [8, 8],
                                              np.random.default_rng(0).normal(size=64).astype(np.float32))])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    half = optimize(m, target="ort-cuda", precision="fp16")
    rep = verify(m, half, providers="cpu", runs=0)
    text = format_verification(rep)
    assert rep["ok"] and "float16 model against its float32 original" in text
    assert "fp16 bounds" in text and "% of range" in text
