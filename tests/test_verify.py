"""The verifier (onnxopt.verify) and its faces: ``python -m onnxopt verify``, ``bisect``,
``--verify`` and ``optimize(verify=...)``.

Failing verifications come from rules that are wrong on purpose (loaded as user rule files), so
the tests prove that a real difference is caught, located and named.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, model, tinfo
from onnxopt.verify import bisect
from onnxopt import cli, optimize, verify
from onnxopt.errors import InvalidModelError, UsageError
from onnxopt.models import synthetic

ort = pytest.importorskip("onnxruntime")
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()

# Wrong on purpose. drop_relu forwards Relu's input (it creates no node, so provenance cannot name
# it; bisect must). erf_to_tanh creates a node, which carries the rule's name.
BAD_RULES = textwrap.dedent('''
    from onnxopt import Op, Rule


    def _drop(m, b):
        return m["x"]


    def _tanh(m, b):
        return b.op("Tanh", m["x"])


    RULES = [
        Rule("drop_relu", Op("Relu", "x"), _drop,
             condition=lambda m: None if m.root.name == "b3/relu" else "not the one",
             doc="Wrong on purpose: removes one Relu."),
        Rule("erf_to_tanh", Op("Erf", "x"), _tanh, doc="Wrong on purpose: Erf is not Tanh."),
    ]
''')


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn")
    src = d / "model.onnx"
    onnx.save(synthetic.build(60), str(src))
    good = d / "good.onnx"
    optimize(str(src), output=str(good))
    rules = d / "bad_rules.py"
    rules.write_text(BAD_RULES)
    bad = d / "bad.onnx"
    assert cli.main([str(src), "-o", str(bad), "--rules", str(rules), "-q"]) == 0
    return {"src": src, "good": good, "bad": bad, "rules": rules, "dir": d}


def run_main(capsys, *args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxopt: error:") and "Traceback" not in err, err
    return lines[0]


# --- inputs ---------------------------------------------------------------------------------------


def _text_model():
    """input_ids index an embedding of 50 rows; the mask and a second table of 2 rows."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
             helper.make_node("Gather", ["types", "token_type_ids"], ["t"]),
             helper.make_node("Add", ["e", "t"], ["s"]),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "ax"], ["m3"]),
             helper.make_node("Mul", ["s", "m3"], ["y"])]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
           for n in ("input_ids", "token_type_ids", "attention_mask")]
    return model(nodes, ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
                 [init("emb", rng.standard_normal((50, 4)).astype(np.float32)),
                  init("types", rng.standard_normal((2, 4)).astype(np.float32)), init("ax", np.array([-1]))])


def test_generated_inputs_follow_shapes_symbols_and_valid_ranges():
    m = _text_model()
    feeds, how = verify.make_inputs(m, shapes={"input_ids": [3, 7]})
    # the symbols batch=3, seq=7 fixed by input_ids carry over to the other inputs
    assert {k: v.shape for k, v in feeds.items()} == {k: (3, 7) for k in feeds}
    assert how["input_ids"]["range"] == [0, 49] and feeds["input_ids"].max() <= 49
    assert how["token_type_ids"]["range"] == [0, 1]
    assert how["attention_mask"]["range"] == [0, 1] and set(np.unique(feeds["attention_mask"])) <= {0, 1}
    feeds2, _ = verify.make_inputs(m, shapes={"input_ids": [3, 7]})
    assert all(np.array_equal(feeds[k], feeds2[k]) for k in feeds)  # same seed, same inputs
    feeds3, _ = verify.make_inputs(m, shapes={"input_ids": [3, 7]}, seed=1)
    assert not np.array_equal(feeds["input_ids"], feeds3["input_ids"])
    feeds4, how4 = verify.make_inputs(m, int_ranges={"input_ids": (5, 6)})
    assert set(np.unique(feeds4["input_ids"])) <= {5, 6} and how4["input_ids"]["range"] == [5, 6]
    assert feeds4["input_ids"].shape == (1, 16)  # defaults: 1 on the first axis, 16 on others


def test_inputs_from_npz_and_generated_for_the_rest(tmp_path):
    m = _text_model()
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    np.savez(tmp_path / "in.npz", input_ids=ids)
    feeds, how = verify.make_inputs(m, npz=tmp_path / "in.npz")
    assert np.array_equal(feeds["input_ids"], ids) and how["input_ids"]["source"] == "npz"
    assert feeds["attention_mask"].shape == (1, 3) and how["attention_mask"]["source"] == "generated"
    np.savez(tmp_path / "wrong.npz", input_ids=ids.astype(np.int32))
    with pytest.raises(UsageError, match="int32"):
        verify.make_inputs(m, npz=tmp_path / "wrong.npz")
    np.savez(tmp_path / "extra.npz", nope=ids)
    with pytest.raises(UsageError, match="nope"):
        verify.make_inputs(m, npz=tmp_path / "extra.npz")


@pytest.mark.parametrize("bad", [dict(shapes={"missing": [1]}), dict(shapes={"input_ids": [1, 2, 3]}),
                                 dict(int_ranges={"nope": (0, 1)})])
def test_input_settings_that_do_not_fit_the_model_are_refused(bad):
    with pytest.raises(UsageError):
        verify.make_inputs(_text_model(), **bad)


@pytest.mark.parametrize("text,ok", [("x=1x3x224x224", {"x": [1, 3, 224, 224]}), ("a:b=2,3", {"a:b": [2, 3]}),
                                     ("x", None), ("x=1xq", None), ("x=-1", None)])
def test_parse_input_shape(text, ok):
    if ok is None:
        with pytest.raises(UsageError):
            verify.parse_input_shapes([text])
    else:
        assert verify.parse_input_shapes([text]) == ok


# --- comparison -----------------------------------------------------------------------------------


def test_compare_statistics_and_tolerance():
    a = np.linspace(-1, 1, 1000).astype(np.float32)
    b = a.copy()
    b[10] += 1e-3  # out of fp32 tolerance
    b[20] += 1e-7  # within it
    r = verify.compare(a, b, *verify.tolerance("float32")[:2])
    assert not r["ok"] and r["out_of_tolerance"] == 1
    assert r["max_abs"] == pytest.approx(1e-3, rel=1e-3) and r["cosine"] > 0.999999
    assert r["p99_abs"] < r["max_abs"] and r["mean_abs"] == pytest.approx(r["max_abs"] / 1000, rel=0.01)
    assert verify.compare(a, a.copy(), 1e-4, 1e-5)["ok"]
    assert verify.compare(a, a[:10], 1e-4, 1e-5)["problem"] == "shape 1000 in the original, 10 now"
    assert verify.compare(a, a.astype(np.float64), 1e-4, 1e-5)["problem"] == \
        "dtype float32 in the original, float64 now"


def test_nan_and_inf_are_compared_explicitly():
    a = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    assert verify.compare(a, a.copy(), 1e-4, 1e-5)["ok"]  # NaN meets NaN, infinities themselves
    r = verify.compare(a, np.array([0.0, np.inf, -np.inf, 1.0], np.float32), 1e-4, 1e-5)
    assert not r["ok"] and r["nan_mismatch"] == 1 and r["nan_before"] == 1 and r["nan_after"] == 0
    r = verify.compare(a, np.array([np.nan, np.inf, np.inf, 1.0], np.float32), 1e-4, 1e-5)
    assert not r["ok"] and r["inf_mismatch"] == 1
    r = verify.compare(a, np.array([np.nan, 3e38, -np.inf, 1.0], np.float32), 1.0, 1e30)  # inf vs finite
    assert not r["ok"] and r["inf_mismatch"] == 1


def test_default_tolerances_by_dtype_and_model_precision():
    assert verify.tolerance("float32")[:2] == (1e-4, 1e-5)
    assert verify.tolerance("float16")[:2] == (1e-2, 1e-3)
    assert verify.tolerance("int64")[:2] == (0.0, 0.0)
    assert verify.tolerance("int8")[:2] == (0.0, 1.0)
    assert verify.tolerance("float32", low_precision=True)[:2] == verify.LOW_PRECISION
    assert verify.tolerance("float32", rtol=0.5)[:2] == (0.5, 1e-5)
    fp16 = model([helper.make_node("Add", ["x", "c"], ["y"])], [tinfo("x", [2], TensorProto.FLOAT16)],
                 [tinfo("y", [2], TensorProto.FLOAT16)], [init("c", np.ones(2, np.float16))])
    assert verify.is_low_precision(fp16) and not verify.is_low_precision(_text_model())


# --- verify: agreement, kernels, latency ----------------------------------------------------------


def test_verify_optimized_model_agrees_with_fewer_kernels(syn, tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code, out, err = run_main(capsys, "verify", syn["src"], syn["good"], "--runs", "5", "--json", report_path)
    assert code == 0, out + err
    rep = json.loads(report_path.read_text())
    cpu = rep["providers"]["cpu"]
    assert rep["ok"] and cpu["ok"]
    k = cpu["kernels"]
    # onnxruntime folds this model's BatchNormalization itself: the same kernels either way
    assert k["after"]["kernels"] == k["before"]["kernels"] == sum(k["before"]["by_op"].values())
    convs = sum(n.op_type == "Conv" for n in onnx.load(str(syn["src"])).graph.node)
    assert k["before"]["by_op"]["Conv"] == convs > 0 and "BatchNormalization" not in k["before"]["by_op"]
    assert k["before"]["by_provider"] == {"CPUExecutionProvider": k["before"]["kernels"]}
    lat = cpu["latency"]
    assert lat["rounds"] == 5 and lat["after"]["median_ms"] > 0 and lat["ratio_median"] > 0
    assert lat["before"]["p90_ms"] >= lat["before"]["median_ms"]
    row = cpu["outputs"][0]
    assert row["ok"] and row["max_abs"] < 1e-4 and row["cosine"] > 0.99999
    assert "outputs agree" in out and "kernels per run:" in out and "latency" in out


def test_verify_names_the_culprit_of_a_wrong_rewrite(syn, tmp_path, capsys):
    code, out, err = run_main(capsys, "verify", syn["src"], syn["bad"], "--runs", "0", "--json", tmp_path / "r.json")
    assert code == 1
    rep = json.loads((tmp_path / "r.json").read_text())
    c = rep["providers"]["cpu"]["culprit"]
    # b3's Relu was dropped: the first value that diverges is what reads it, b3's Add
    assert c["value"] == "b3.out" and c["node"]["name"] == "b3/add" and "rule" not in c
    # it read Identity(Relu(BN(Conv))), now the folded Conv directly: no rule can be tied to that
    changed = [i for i in c["inputs"] if not i["agrees"]]
    assert [(i["now"], i["producer_now"]["op_type"]) for i in changed] == [("b3.bn", "Conv")]
    assert {r["name"]: r["producer"]["op_type"] for r in c["read_before"]}["b3.id"] == "Identity"
    assert "first diverging value 'b3.out'" in out and "no rule is named" in out
    assert f"to find the rewrite: python -m onnxopt bisect {syn['src']}" in out


def test_bisect_finds_the_rule_and_node(syn, tmp_path, capsys):
    code, out, err = run_main(capsys, "bisect", syn["src"], "--rules", syn["rules"], "--json", tmp_path / "b.json")
    assert code == 1, out + err
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["culprit_rule"] == "drop_relu"
    assert rep["steps"] == [{"rule": "drop_relu", "replaced": ["b3/relu"], "created": []}]
    assert 0 < rep["first_failing_rewrite"] <= rep["rewrites"]
    assert out.strip().endswith("culprit: drop_relu")
    # the step before is fine and the step itself is not: replay both
    for n, ok in ((rep["first_failing_rewrite"] - 1, True), (rep["first_failing_rewrite"], False)):
        from onnxopt.library import registry

        extra = registry.load_rules_file(str(syn["rules"]))
        out_model = optimize(onnx.load(str(syn["src"])), extra_rules=extra, stop_after=n)
        r = verify.verify(syn["src"], out_model, runs=0)
        assert r["ok"] is ok


def test_bisect_rule_bugs_are_loud(syn, tmp_path, capsys, monkeypatch):
    """A rule that raises is reported by bisect as by optimize (a warning, the JSON's errors) and
    raises with --strict or ONNXOPT_STRICT=1."""
    rules = tmp_path / "buggy_rules.py"
    rules.write_text("from onnxopt import Op, Rule\n"
                     "RULES = [Rule('typo', Op('Relu', 'x'), lambda m, b: m['x'], condition=lambda m: m['y'])]\n")
    args = ("bisect", syn["src"], "--rules", rules, "--no-builtin-rules")
    code, _, err = run_main(capsys, *args)  # (the test suite sets ONNXOPT_STRICT=1)
    assert code == 2 and "rule typo raised RuleError" in one_line_error(err)
    monkeypatch.delenv("ONNXOPT_STRICT")
    code, _, err = run_main(capsys, *args, "--strict")
    assert code == 2 and "rule typo raised RuleError" in one_line_error(err)
    code, out, _ = run_main(capsys, *args, "--json", tmp_path / "b.json")
    assert code == 0 and "warning: rule typo raised RuleError" in out and "a bug in the rule" in out
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["errors"] and {e["rule"] for e in rep["errors"]} == {"typo"}
    assert {e["phase"] for e in rep["errors"]} == {"condition"}


def test_bisect_of_a_good_optimization_exits_0(syn, capsys):
    code, out, _ = run_main(capsys, "bisect", syn["src"], "-q")
    assert code == 0 and "nothing to bisect" in out


def test_culprit_rule_from_provenance_on_a_real_model(tmp_path, capsys):
    """BERT (transformers, legacy exporter): erf_to_tanh turns its GELU wrong; the first diverging
    value is the rule's own node, named by provenance; bisect agrees."""
    pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to export BERT")
    pytest.importorskip("transformers", reason="transformers (the 'export' extra) is needed to build BERT")
    from onnxopt.models import transformers_models

    src = tmp_path / "bert.onnx"
    transformers_models.export("bert", src, exporter="legacy", cache=tmp_path)
    rules = tmp_path / "bad.py"
    rules.write_text(BAD_RULES)
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    assert cli.main([str(src), "-o", str(good), "-q"]) == 0
    assert cli.main([str(src), "-o", str(bad), "--rules", str(rules), "-q"]) == 0
    code, out, _ = run_main(capsys, "verify", src, good, "--input-shape", "input_ids=2x9", "--runs", "3",
                            "--json", tmp_path / "g.json")
    assert code == 0, out
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["inputs"]["attention_mask"]["shape"] == [2, 9]  # the symbols carried over
    assert g["inputs"]["input_ids"]["range"][1] == 8191  # the word-embedding table's rows
    k = g["providers"]["cpu"]["kernels"]
    assert k["after"]["kernels"] < k["before"]["kernels"]
    code, out, _ = run_main(capsys, "verify", src, bad, "--runs", "0", "--json", tmp_path / "b.json")
    assert code == 1
    c = json.loads((tmp_path / "b.json").read_text())["providers"]["cpu"]["culprit"]
    assert c["rule"] == "erf_to_tanh" and c["node"]["op_type"] == "Tanh"
    assert "created by rule erf_to_tanh" in out
    code, out, _ = run_main(capsys, "bisect", src, "--rules", rules, "--disable", "drop_relu", "-q")
    assert code == 1 and out.strip() == "culprit: erf_to_tanh"


# --- optimize(verify=...) and --verify ------------------------------------------------------------


def test_optimize_with_verify_reports_and_writes(syn, tmp_path):
    out = tmp_path / "o.onnx"
    _, report = optimize(str(syn["src"]), output=str(out), verify=True, verify_options={"runs": 3},
                         return_report=True)
    assert out.exists() and report.verification["ok"]
    assert report.verification["providers"]["cpu"]["latency"]["rounds"] == 3
    assert "verify" in report.seconds and report.as_dict()["verification"]["ok"]


def test_optimize_with_verify_refuses_a_wrong_result_and_writes_nothing(syn, tmp_path, monkeypatch):
    from onnxopt.library import registry

    monkeypatch.setattr(bisect, "BISECT_BUDGET_S", 3600.0)  # the bisect below runs whatever the machine's load

    out = tmp_path / "o.onnx"
    extra = registry.load_rules_file(str(syn["rules"]))
    with pytest.raises(verify.VerificationError, match="b3.out") as exc:
        optimize(str(syn["src"]), output=str(out), extra_rules=extra, verify="cpu", verify_options={"runs": 0})
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert exc.value.report["providers"]["cpu"]["culprit"]["node"]["name"] == "b3/add"
    # a quick bisect ran by itself and named the wrong rule, which provenance cannot
    assert exc.value.report["bisect"]["culprit_rule"] == "drop_relu" and "drop_relu" in str(exc.value)
    # in memory too: a proto in, nothing back
    with pytest.raises(verify.VerificationError):
        optimize(onnx.load(str(syn["src"])), extra_rules=extra, verify=True, verify_options={"runs": 0})


def test_cli_verify_flag(syn, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    code, stdout, err = run_main(capsys, syn["src"], "-o", out, "--verify", "cpu", "--runs", "2")
    assert code == 0 and out.exists() and "outputs agree on cpu" in stdout
    bad = tmp_path / "bad.onnx"
    code, stdout, err = run_main(capsys, syn["src"], "-o", bad, "--verify", "cpu", "--rules", syn["rules"], "--runs", "0")
    assert code == 1 and not bad.exists()
    assert err.startswith("onnxopt: verification failed, no output written: outputs differ on cpu")
    assert len(err.strip().splitlines()) == 1


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["not-onnx", "missing", "truncated", "provider", "shape-arg", "npz"])
def test_bad_input_exits_2_with_one_line(syn, tmp_path, capsys, case):
    good = syn["good"]
    args = ["verify", syn["src"], good]
    if case == "not-onnx":
        (tmp_path / "x.onnx").write_text("hello")
        args = ["verify", tmp_path / "x.onnx", good]
    elif case == "missing":
        args = ["verify", tmp_path / "nope.onnx", good]
    elif case == "truncated":
        data = syn["src"].read_bytes()
        (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
        args = ["verify", syn["src"], tmp_path / "t.onnx"]
    elif case == "provider":
        args += ["--providers", "tpu"]
    elif case == "shape-arg":
        args += ["--input-shape", "input"]
    elif case == "npz":
        (tmp_path / "in.npz").write_text("no")
        args += ["--inputs", tmp_path / "in.npz"]
    code, out, err = run_main(capsys, *args)
    assert code == 2
    one_line_error(err)


def test_model_onnxruntime_cannot_run_is_bad_input(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"], domain="custom.nope")], [tinfo("x", [2])], [tinfo("y", [2])])
    m.opset_import.append(helper.make_opsetid("custom.nope", 1))
    onnx.save(m, str(tmp_path / "m.onnx"))
    code, out, err = run_main(capsys, "verify", tmp_path / "m.onnx", tmp_path / "m.onnx")
    assert code == 2 and "onnxruntime (cpu) cannot run the original model" in one_line_error(err)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_cuda_requested_without_it_is_a_clear_error(syn, capsys):
    code, out, err = run_main(capsys, "verify", syn["src"], syn["good"], "--providers", "cpu,cuda")
    assert code == 2 and "CUDAExecutionProvider is not available" in one_line_error(err)


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and an NVIDIA GPU (CUDAExecutionProvider)")
def test_cpu_and_cuda(syn, tmp_path):
    rep = verify.verify(syn["src"], syn["good"], providers="cpu,cuda", runs=5)
    assert rep["ok"] and set(rep["providers"]) == {"cpu", "cuda"}
    k = rep["providers"]["cuda"]["kernels"]["after"]
    assert k["by_provider"].get("CUDAExecutionProvider", 0) > 0
    assert set(rep["cross_provider"]["cpu-vs-cuda"]) == {"before", "after"}


# --- the report -----------------------------------------------------------------------------------


def test_report_in_memory_models_and_bytes(syn):
    src = onnx.load(str(syn["src"]))
    rep = verify.verify(src, syn["good"].read_bytes(), runs=0)
    assert rep["ok"] and "latency" not in rep["providers"]["cpu"]
    with pytest.raises(InvalidModelError):
        verify.verify(src, b"garbage", runs=0)


# --- regressions from review ----------------------------------------------------------------------


def _matmul_model(neg=False):
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Neg" if neg else "Identity", ["r"], ["y"])]
    return model(nodes, [tinfo("x", [2, 64])], [tinfo("y", [2, 64])],
                 [init("w", rng.standard_normal((64, 64)).astype(np.float32))])


def test_external_data_models_in_another_directory(tmp_path, capsys, monkeypatch):
    d = tmp_path / "models"
    d.mkdir()
    for name, neg in (("a", False), ("b", True)):
        onnx.save(_matmul_model(neg), str(d / f"{name}.onnx"), save_as_external_data=True, location=f"{name}.data",
                  size_threshold=0)
    monkeypatch.chdir(tmp_path)  # the data files are beside the models, not in the working directory
    code, out, err = run_main(capsys, "verify", d / "a.onnx", d / "b.onnx", "--runs", "0", "--json", "r.json")
    assert code == 1, err
    c = json.loads((tmp_path / "r.json").read_text())["providers"]["cpu"]["culprit"]
    assert c["value"] == "y" and c["node"]["op_type"] == "Neg"  # intermediate values exposed with the weights
    out_path = tmp_path / "o.onnx"
    code, out, err = run_main(capsys, d / "a.onnx", "-o", out_path, "--verify", "cpu", "--runs", "0")
    assert code == 0, err
    assert (tmp_path / "o.onnx.data").exists()  # written with external data, after verification
    code, out, err = run_main(capsys, "bisect", d / "a.onnx", "-q")
    assert code == 0 and "nothing to bisect" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("onnxopt-verify")]


def test_no_temporary_directories_are_left(syn, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    verify.verify(syn["src"], syn["bad"], runs=0)  # culprit search writes exposed models
    from onnxopt.library import registry

    bisect.bisect(syn["src"], extra_rules=registry.load_rules_file(str(syn["rules"])))
    assert list(tmp_path.iterdir()) == []


def test_int64_outputs_compare_exactly():
    a = np.array([2**60, 5], dtype=np.int64)
    b = np.array([2**60 + 1, 5], dtype=np.int64)
    r = verify.compare(a, b, *verify.tolerance("int64")[:2])
    assert not r["ok"] and r["out_of_tolerance"] == 1 and r["max_abs"] == 1.0
    assert verify.compare(a, a.copy(), 0.0, 0.0)["ok"]
    i8 = np.array([3, -4], np.int8)
    assert verify.compare(i8, np.array([4, -4], np.int8), *verify.tolerance("int8")[:2])["ok"]  # one step
    assert not verify.compare(i8, np.array([5, -4], np.int8), *verify.tolerance("int8")[:2])["ok"]


def test_relative_error_at_a_zero_reference_is_bounded():
    r = verify.compare(np.array([0.0, 1.0], np.float32), np.array([1e-3, 1.0], np.float32), 1e-4, 1e-5)
    assert r["max_rel"] == pytest.approx(1.0) and not r["ok"]


def test_an_optimized_model_that_does_not_run_fails_verification(tmp_path, capsys):
    bad_rule = tmp_path / "r.py"
    bad_rule.write_text(textwrap.dedent('''
        from onnxopt import Op, Rule

        def _wrong(m, b):
            return b.op("Relu", m["x"], domain="com.example.nothing")

        RULES = [Rule("unknown_op", Op("Neg", "x"), _wrong, doc="Wrong on purpose: an op nobody implements.")]
    '''))
    src = tmp_path / "m.onnx"
    onnx.save(_matmul_model(True), str(src))
    out = tmp_path / "o.onnx"
    code, stdout, err = run_main(capsys, src, "-o", out, "--rules", bad_rule, "--verify", "cpu", "--runs", "0")
    assert code == 1 and not out.exists() and "cannot run the optimized model" in err
    assert err.strip().endswith(", unknown_op") and len(err.strip().splitlines()) == 1  # bisect named it


@pytest.mark.parametrize("args", [["--seed", "-1"], ["--runs", "-1"], ["--int-range", "input_ids=0:99999999999999999999"],
                                  ["--int-range", "input_ids=-1:3x"], ["--int-range", "emb=0:3"]])
def test_bad_settings_exit_2(tmp_path, capsys, args):
    src = tmp_path / "text.onnx"
    onnx.save(_text_model(), str(src))
    code, out, err = run_main(capsys, "verify", src, src, *args)
    assert code == 2
    one_line_error(err)


def test_int_range_on_a_float_input_is_refused():
    with pytest.raises(UsageError, match="not an integer"):
        verify.make_inputs(synthetic.build(10), int_ranges={"input": (0, 1)})


def test_stop_after_counts_each_graph_pass_as_one_step():
    """bisect relies on stop_after=n being a prefix of the full run: a pass runs whole, and no
    further pass runs once the count is reached."""
    w = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
             helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["x", "w2"], ["b"]),
             helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Add", ["ra", "rb"], ["s"]), helper.make_node("Add", ["s", "zero"], ["t"]),
             helper.make_node("Identity", ["t"], ["y"])]
    m = model(nodes, [tinfo("x", [2, 4])], [tinfo("y", [2, 4])], [init("w1", w), init("w2", w.copy())])
    full = optimize(m, stop_after=10**9, return_report=True)[1]
    kinds = [s.get("pass") or s["rule"] for s in full.log]
    assert {"constant_lifting", "initializer_deduplication", "common_subexpression_elimination"} <= set(kinds), kinds
    count = 0
    for i, step in enumerate(full.log):
        count += step.get("rewrites", 1)
        rep = optimize(m, stop_after=count, return_report=True)[1]
        assert rep.log == full.log[: i + 1], (i, kinds)


def test_cuda_sessions_compare_without_tf32(monkeypatch):
    seen = {}

    class FakeSession:
        def __init__(self, model, so, providers):
            seen["providers"] = providers

    monkeypatch.setattr(ort, "InferenceSession", FakeSession)
    verify.session(b"", "cuda", exact=True)
    assert seen["providers"][0] == ("CUDAExecutionProvider", {"use_tf32": "0"})
    verify.session(b"", "cuda")
    assert seen["providers"][0] == "CUDAExecutionProvider"  # latency: onnxruntime's defaults


def test_a_dimension_of_minus_one_is_dynamic():
    """PP-OCR's exports declare the batch axis as dim_value -1 (meaning unknown)."""
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", ["b", 3])], [tinfo("y", ["b", 3])])
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    feeds, _ = verify.make_inputs(m)
    assert feeds["x"].shape == (1, 3)
    feeds, _ = verify.make_inputs(m, shapes={"x": [4, 3]})
    assert feeds["x"].shape == (4, 3)


def test_an_internal_error_is_one_line_and_not_exit_1(syn, capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(verify, "verify", boom)
    code, out, err = run_main(capsys, "verify", syn["src"], syn["good"])
    assert code == 3 and err.strip() == "onnxopt: internal error: RuntimeError: something broke (please report it)"


# --- regressions from the second review -----------------------------------------------------------


@pytest.mark.parametrize("args", [["--rtol", "nan"], ["--atol", "inf"], ["--rtol", "-1"], ["--threads", "-1"]])
def test_tolerances_must_be_finite_and_not_negative(syn, capsys, args):
    code, out, err = run_main(capsys, "verify", syn["src"], syn["bad"], *args)
    assert code == 2 and "must" in one_line_error(err)
    code, out, err = run_main(capsys, "bisect", syn["src"], *args[:2]) if args[0] != "--threads" else (2, "", "")
    assert code == 2


def test_failed_verify_flag_prints_the_report_and_writes_the_json(syn, tmp_path, capsys):
    out, rep = tmp_path / "o.onnx", tmp_path / "o.json"
    code, stdout, err = run_main(capsys, syn["src"], "-o", out, "--rules", syn["rules"], "--verify", "cpu",
                                 "--runs", "0", "--json", rep)
    assert code == 1 and not out.exists()
    assert "OUTPUTS DIFFER" in stdout and "culprit:" in stdout
    data = json.loads(rep.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert data["output"] is None and data["verification"]["ok"] is False


def test_cosine_is_finite_and_bounded_for_huge_and_fp16_values():
    big = np.full(4, 1e200)
    assert verify.compare(big, big.copy(), 0, 0)["cosine"] == 1.0
    h = np.array([60000, -60000, 60000], np.float16)
    assert -1.0 <= verify.compare(h, -h, 1e-2, 1e-3)["cosine"] <= 1.0


def test_json_report_is_strict_even_with_non_finite_numbers(tmp_path):
    with cli.io.Outputs() as outputs:
        outputs.claim(tmp_path / "r.json", "--json")
        cli._stage_json(outputs, str(tmp_path / "r.json"), {"a": float("nan"), "b": [float("inf"), 1.5]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": "nan", "b": ["inf", 1.5]}


def test_mixed_precision_models_get_the_looser_tolerance():
    cast = model([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                  helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], [tinfo("x", [2])], [tinfo("y", [2])])
    const = model([helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.FLOAT16, [1], [1.0])),
                   helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT),
                   helper.make_node("Add", ["x", "cf"], ["y"])], [tinfo("x", [2])], [tinfo("y", [2])])
    assert verify.is_low_precision(cast) and verify.is_low_precision(const)


def test_bisect_takes_the_optimize_settings(syn, capsys):
    code, out, _ = run_main(capsys, "bisect", syn["src"], "--rules", syn["rules"], "--max-rewrites", "3", "-q")
    # the wrong rule would fire later than the third rewrite: within the cap, the model verifies
    assert code == 0 and "(3 rewrites) verifies" in out
    code, out, _ = run_main(capsys, "bisect", syn["src"], "--rules", syn["rules"], "-q")
    assert code == 1


def test_placeholder_dimension_names_are_not_shared_symbols():
    """'?' names no one value: a shape given for one input does not carry to another's '?'."""
    nodes = [helper.make_node("Relu", ["a"], ["ya"]), helper.make_node("Relu", ["b"], ["yb"])]
    m = model(nodes, [tinfo("a", ["?", 3]), tinfo("b", ["?", 5]), ], [tinfo("ya", ["?", 3]), tinfo("yb", ["?", 5])])
    feeds, _ = verify.make_inputs(m, shapes={"a": [7, 3]})
    assert feeds["a"].shape == (7, 3) and feeds["b"].shape == (1, 5)
