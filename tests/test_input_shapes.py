"""Input-shape overrides (issue 13, point 1): one grammar, ``NAME=D1,D2,...`` (numbers or symbol
names) or ``NAME=1x3x224x224``, for ``optimize(input_shapes=...)`` and ``--input-shape`` on every
command. On optimize the model's inputs are fixed (a symbol given a value takes it everywhere),
the rules fold what became static, and ``--verify`` runs the original at the same shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import run_ort
from helpers import init, model, tinfo
from onnxopt.verify import bisect
from onnxopt.ir import input_shapes
from onnxopt import cli, optimize, verify
from onnxopt.errors import UsageError

pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[1]


def dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def io_dims(m: onnx.ModelProto) -> tuple[dict, dict]:
    return {i.name: dims(i) for i in m.graph.input}, {o.name: dims(o) for o in m.graph.output}


def ops(m: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in m.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxopt: error:") and "Traceback" not in err, err
    return lines[0]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# --- the grammar ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,shape", [
    ("x=1x3x224x224", (1, 3, 224, 224)), ("x=1,3,224,224", (1, 3, 224, 224)), ("x=batch,3,224,224", ("batch", 3, 224, 224)),
    ("x=n, 3", ("n", 3)), ("x=7", (7,)), ("x=", ()), ("x=0x5", (0, 5)), (f"x={2**63 - 1}", (2**63 - 1,)),
    ("x=p2o.DynamicDimension.0,3", ("p2o.DynamicDimension.0", 3)), ("x=_s0,s1", ("_s0", "s1")),
    ("a:b=2,3", (2, 3)), ("a=b=2", (2,)),
])
def test_the_grammar_accepts_both_forms_and_symbols(text, shape):
    name = text.rpartition("=")[0]
    assert input_shapes.parse([text]) == {name: shape}


BAD_TEXT = {
    "x": "expected NAME=", "=1x2": "expected NAME=", "x=-1,3": "-1 is negative", "x=1x-3": "neither",
    "x=1xq": "'1xq' is neither", "x=2xx3": "neither", "x=2x3x": "neither", "x=+2": "neither", "x=1,,3": "empty",
    "x=1x3,4": "'1x3' is neither", "x=99999999999999999999": "over 2**63-1", "x=9223372036854775808x2": "over",
    "x=None,3": "'None' names no dimension", "x=?": "neither", "x=b*s": "neither", "x=1.5": "neither",
}


@pytest.mark.parametrize("text", sorted(BAD_TEXT))
def test_a_malformed_shape_is_one_usage_error(text):
    with pytest.raises(UsageError, match=BAD_TEXT[text].replace("*", r"\*").replace("?", r"\?")) as exc:
        input_shapes.parse([text])
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"--input-shape {text!r}")


def test_an_input_given_twice_must_be_given_the_same_shape():
    assert input_shapes.parse(["x=1x3", "x=1,3"]) == {"x": (1, 3)}
    with pytest.raises(UsageError, match="--input-shape x: given twice, as 1x3 and 2x3"):
        input_shapes.parse(["x=1x3", "x=2x3"])


def test_the_python_forms():
    norm = input_shapes.normalize
    assert norm({"x": [1, 3, np.int64(224), "w"]}) == {"x": (1, 3, 224, "w")}
    assert norm({"x": "1x3", "y": "batch,4", "z": ()}) == {"x": (1, 3), "y": ("batch", 4), "z": ()}
    assert norm(["x=1x3", "y=b,2"]) == norm("x=1x3") | {"y": ("b", 2)}
    assert norm(None) == {} and norm({}) == {}
    for bad, why in (({"x": [1, -2]}, "-2 is negative"), ({"x": [True, 2]}, "True is neither"),
                     ({"x": [1.0]}, "1.0 is neither"), ({"x": ["a b"]}, "'a b' is neither"), ({"x": 3}, "not a list"),
                     ([3], "expected a mapping")):
        with pytest.raises(UsageError, match=why):
            norm(bad)


def test_an_iterator_of_entries_is_read_whole():
    assert input_shapes.normalize(e for e in ["x=1x3", "y=n,2"]) == {"x": (1, 3), "y": ("n", 2)}


def test_verify_shapes_for_no_input_are_refused_with_the_inputs_fixed_too():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", ["b", 3])], [tinfo("y", ["b", 3])])
    for fixed in (None, {"x": [2, 3]}):  # (with the inputs fixed, the typo was silently dropped)
        with pytest.raises(UsageError, match="the model has no input 'nosuch'"):
            optimize(m, input_shapes=fixed, verify="cpu", verify_options={"input_shapes": {"nosuch": [1]}})


def test_bisect_fix_input_shape_errors_name_that_flag(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", ["b", 3])], [tinfo("y", ["b", 3])])
    onnx.save(m, tmp_path / "m.onnx")
    r = run_cli("bisect", tmp_path / "m.onnx", "--fix-input-shape", "nosuch=1")
    assert r.returncode == 2 and one_line(r.stderr).startswith("onnxopt: error: --fix-input-shape nosuch=1: "), r.stderr


def test_running_a_model_needs_numbers():
    """verify and bisect run the model: a symbol there has no value."""
    assert input_shapes.parse(["x=1x3"], numbers=True) == {"x": (1, 3)}
    with pytest.raises(UsageError, match=r"--input-shape x=batch,3: dimension 0 is the symbol 'batch', and running "
                                         r"the model needs a number"):
        verify.parse_input_shapes(["x=batch,3"])
    with pytest.raises(UsageError, match="the symbol 'n'"):
        verify.make_inputs(_two_inputs(), shapes={"x": ["n", 5, 4]})


# --- fixing a model -------------------------------------------------------------------------------

def _two_inputs(out_dims=("batch", "seq", 4)) -> onnx.ModelProto:
    """x: [batch, seq, 4], y: [batch, 8]; z = x * mean(y) (same shape as x), w = sum of y."""
    nodes = [helper.make_node("ReduceMean", ["y"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
             helper.make_node("Mul", ["x", "m3"], ["z"]),
             helper.make_node("ReduceSum", ["y", "ax1"], ["w"], keepdims=0)]
    return model(nodes, [tinfo("x", ["batch", "seq", 4]), tinfo("y", ["batch", 8])],
                 [tinfo("z", list(out_dims)), tinfo("w", ["batch"])], [init("ax", np.array([2])),
                                                                        init("ax1", np.array([1]))], opset=13)


def _fixed(m, shapes, **kw) -> onnx.ModelProto:
    out = optimize(m, input_shapes=shapes, **kw)
    feeds = {i.name: np.random.default_rng(0).standard_normal(dims(i)).astype(np.float32) for i in out.graph.input
             if all(isinstance(d, int) for d in dims(i))}
    if len(feeds) == len(out.graph.input):  # fully static: the same outputs as the original at those shapes
        for a, b in zip(run_ort(m, feeds), run_ort(out, feeds)):
            np.testing.assert_array_equal(a, b)
    return out


def test_a_symbol_fixed_on_one_input_is_fixed_everywhere():
    out = _fixed(_two_inputs(), {"x": [2, 5, 4]})
    assert io_dims(out) == ({"x": [2, 5, 4], "y": [2, 8]}, {"z": [2, 5, 4], "w": [2]})


def test_a_new_name_the_model_gives_another_dimension_is_refused():
    """Renaming batch to "n" where an output's other dimension is already "n" would declare the two
    equal, which the rules would believe (two dims with one name are equal)."""
    m = _two_inputs(out_dims=("batch", "n", 4))
    with pytest.raises(UsageError, match="cannot take the name 'n', which the model gives another dimension "
                                         r"\(z dimension 1\)"):
        optimize(m, input_shapes={"x": ["n", "seq", 4]})
    out = optimize(m, input_shapes={"x": ["b", "seq", 4]})  # a new name is a rename
    assert io_dims(out)[0] == {"x": ["b", "seq", 4], "y": ["b", 8]}


def test_the_report_records_the_shapes_fixed_as_given():
    _, report = optimize(_two_inputs(), input_shapes="x=2,seq,4", return_report=True, exact=True)
    assert report.as_dict()["settings"] == {"target": "portable", "exact": True, "input_shapes": {"x": [2, "seq", 4]}}
    assert optimize(_two_inputs(), return_report=True)[1].settings["input_shapes"] == {}


def test_a_symbol_kept_or_renamed_stays_dynamic_and_the_model_runs_at_any_value():
    src = _two_inputs()
    out = optimize(src, input_shapes={"x": ["n", 5, 4]})  # batch renamed, seq fixed
    assert io_dims(out) == ({"x": ["n", 5, 4], "y": ["n", 8]}, {"z": ["n", 5, 4], "w": ["n"]})
    out = optimize(src, input_shapes=["x=batch,5,4"])  # batch kept
    assert io_dims(out) == ({"x": ["batch", 5, 4], "y": ["batch", 8]}, {"z": ["batch", 5, 4], "w": ["batch"]})
    for b in (1, 3):
        feeds = {"x": np.ones((b, 5, 4), np.float32), "y": np.arange(b * 8, dtype=np.float32).reshape(b, 8)}
        for a, c in zip(run_ort(src, feeds), run_ort(out, feeds)):
            np.testing.assert_array_equal(a, c)


def test_output_dimensions_inference_proves_static_become_numbers():
    """Outputs declared with their own symbols (as PP-OCR's are) take the numbers inference proves."""
    out = _fixed(_two_inputs(out_dims=("o0", "o1", "o2")), {"x": [2, 5, 4]})
    assert io_dims(out)[1] == {"z": [2, 5, 4], "w": [2]}
    out = optimize(_two_inputs(out_dims=("o0", "o1", "o2")), input_shapes={"x": [2, "seq", 4]})
    assert dims(out.graph.output[0])[0] == 2 and dims(out.graph.output[0])[1] != 2  # seq is left dynamic


def test_declared_values_take_the_values_and_no_shape_is_added():
    m = _two_inputs()
    m.graph.value_info.append(tinfo("m3", ["batch", 1, "batch*seq"]))  # as torch's dynamo exporter writes them
    out = optimize(m, input_shapes={"x": [2, 5, 4]}, rules=[])  # (no rewrite: the declared values stay)
    assert {vi.name: dims(vi) for vi in out.graph.value_info if vi.name == "m3"} == {"m3": [2, 1, 1]}
    bare = optimize(_two_inputs(), input_shapes={"x": [2, 5, 4]}, rules=[])
    assert [vi.name for vi in bare.graph.value_info if vi.name not in {i.name for i in bare.graph.initializer}] == []


def _static_first_dim() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [3, "s"])], [tinfo("y", [3, "s"])])


FIX_ERRORS = [
    (_two_inputs, {"nope": [1]}, "--input-shape nope=1: the model has no input 'nope' (its inputs: x, y)"),
    (_two_inputs, {"x": [2, 5]}, "--input-shape x=2x5: 2 dimensions, the model's input has 3 (batch,seq,4)"),
    (_two_inputs, {"x": [2, 5, 3]}, "--input-shape x=2x5x3: dimension 2 is 4 in the model, not 3"),
    (_two_inputs, {"x": [2, 5, "c"]}, "--input-shape x=2,5,c: dimension 2 is 4 in the model; it cannot become the "
                                      "symbol 'c'"),
    (_two_inputs, {"x": [2, 5, 4], "y": [3, 8]}, "--input-shape: the symbol 'batch' is given two values, 2 (x "
                                                 "dimension 0) and 3 (y dimension 0)"),
    (_two_inputs, {"x": ["batch", 5, 4], "y": [3, 8]}, "the symbol 'batch' is given two values, batch (x dimension "
                                                       "0) and 3 (y dimension 0)"),
    (_two_inputs, {"x": ["n", 5, 4], "y": ["m", 8]}, "the symbol 'batch' is given two values, n (x dimension 0) "
                                                     "and m (y dimension 0)"),
    (_two_inputs, {"x": [2, "batch", 4]}, "the symbol 'batch' is given two values, 2 (x dimension 0) and batch (x "
                                          "dimension 1)"),
    (_static_first_dim, {"x": [4, 2]}, "dimension 0 is 3 in the model, not 4"),
]


@pytest.mark.parametrize("build,shapes,message", FIX_ERRORS)
def test_a_shape_that_does_not_fit_the_model_is_one_usage_error(build, shapes, message):
    src = build()
    before = src.SerializeToString()
    with pytest.raises(UsageError) as exc:
        optimize(src, input_shapes=shapes)
    assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert src.SerializeToString() == before


@pytest.mark.parametrize("shape,message", [
    ("nope=1", "the model has no input 'nope' (its inputs: x, y)"), ("x=2x5", "2 dimensions"),
    ("x=2,5,3", "dimension 2 is 4 in the model, not 3"), ("x=2,-5,4", "-5 is negative"),
    ("x=2,5,4 --input-shape y=3x8", "the symbol 'batch' is given two values"),
    ("x=2,5,4 --input-shape x=3,5,4", "given twice"), ("x=2x5x4x", "neither"),
])
def test_the_command_line_refuses_each_in_one_line_with_exit_2(tmp_path, shape, message):
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(_two_inputs(), str(src))
    proc = run_cli(src, "-o", out, "--input-shape", *shape.replace(" --input-shape ", "\0--input-shape\0").split("\0"))
    assert proc.returncode == 2 and message in one_line(proc.stderr), proc.stderr
    assert not out.exists()


# --- a real export: BERT (legacy exporter), dynamic batch and sequence -----------------------------

@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("torch", reason="torch (the 'export' extra) is needed to export BERT")
    pytest.importorskip("transformers", reason="transformers (the 'export' extra) is needed to build BERT")
    from onnxopt.models import transformers_models

    d = tmp_path_factory.mktemp("bert")
    src = d / "bert.onnx"
    transformers_models.export("bert", src, exporter="legacy", cache=d)
    dynamic = onnx.load(str(optimize(str(src), output=str(d / "dynamic.onnx"))))
    return {"src": src, "dir": d, "dynamic": dynamic}


def _text_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 8192, (batch, seq)), "token_type_ids": rng.integers(0, 2, (batch, seq)),
            "attention_mask": np.ones((batch, seq), np.int64)}


def _same_outputs(a, b, feeds):
    for x, y in zip(run_ort(onnx.load(str(a)) if isinstance(a, Path) else a, feeds),
                    run_ort(onnx.load(str(b)) if isinstance(b, Path) else b, feeds)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


SHAPE_ARITHMETIC = ("Shape", "Unsqueeze", "Concat", "ConstantOfShape", "Range", "Expand")


def test_optimize_fixes_a_real_model_and_folds_its_shape_arithmetic(bert):
    dynamic = bert["dynamic"]
    fixed, report = optimize(str(bert["src"]), output=str(bert["dir"] / "fixed.onnx"), return_report=True,
                             input_shapes={"input_ids": [1, 16]})
    fixed = onnx.load(fixed)
    assert io_dims(dynamic) == ({n: ["batch", "sequence"] for n in ("input_ids", "attention_mask", "token_type_ids")},
                                {"last_hidden_state": ["batch", "sequence", 256], "pooler_output": ["batch", 256]})
    assert io_dims(fixed) == ({n: [1, 16] for n in ("input_ids", "attention_mask", "token_type_ids")},
                              {"last_hidden_state": [1, 16, 256], "pooler_output": [1, 256]})
    assert [o.type.tensor_type.elem_type for o in fixed.graph.output] == [o.type.tensor_type.elem_type
                                                                          for o in dynamic.graph.output]
    # the Shape -> Gather -> Unsqueeze -> Concat -> Reshape chains on batch and sequence folded away
    assert sum(ops(dynamic).get(op, 0) for op in SHAPE_ARITHMETIC) > 20
    assert sum(ops(fixed).get(op, 0) for op in SHAPE_ARITHMETIC) == 0
    assert len(fixed.graph.node) < len(dynamic.graph.node) - 50
    assert report.fired.get("shape_folding", 0) + report.fired.get("constant_folding", 0) > 0
    _same_outputs(bert["src"], fixed, _text_feeds(1, 16))
    # nothing inferred is written where the export declared nothing
    inits = {i.name for i in fixed.graph.initializer}
    assert [vi.name for vi in fixed.graph.value_info if vi.name not in inits] == []


def test_a_partial_override_keeps_the_other_axis_dynamic(bert):
    out = optimize(onnx.load(str(bert["src"])), input_shapes={"attention_mask": "2,sequence"})
    assert io_dims(out)[0]["input_ids"] == [2, "sequence"]
    assert io_dims(out)[1] == {"last_hidden_state": [2, "sequence", 256], "pooler_output": [2, 256]}
    assert len(out.graph.node) < len(bert["dynamic"].graph.node)
    for seq in (7, 19):
        _same_outputs(bert["src"], out, _text_feeds(2, seq, seed=seq))


def test_the_same_override_gives_byte_identical_output(bert, tmp_path):
    """The override is part of the input: the same shapes, however written, give the same bytes."""
    runs = {"a": ["input_ids=1,16", "token_type_ids=1x16"], "b": ["input_ids=1,16", "token_type_ids=1x16"],
            "c": ["token_type_ids=1,16", "input_ids=1x16"]}
    for name, shapes in runs.items():
        proc = run_cli(bert["src"], "-o", tmp_path / f"{name}.onnx", *[w for s in shapes for w in ("--input-shape", s)],
                       "-q")
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes() == (tmp_path / "c.onnx").read_bytes()
    api = tmp_path / "api.onnx"
    optimize(str(bert["src"]), output=str(api), input_shapes={"token_type_ids": [1, 16], "input_ids": "1x16"})
    assert api.read_bytes() == (tmp_path / "a.onnx").read_bytes()


def test_the_command_line_fixes_the_model_and_verifies_at_the_same_shapes(bert, tmp_path):
    """--input-shape on optimize was accepted and ignored (the output kept batch); --verify runs the
    original, still dynamic, at the shapes fixed."""
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    proc = run_cli(bert["src"], "-o", out, "--input-shape", "input_ids=1x24", "--verify", "cpu", "--runs", "1",
                   "--json", report)
    assert proc.returncode == 0, proc.stderr
    assert io_dims(onnx.load(str(out)))[0] == {n: [1, 24] for n in ("input_ids", "attention_mask", "token_type_ids")}
    rep = json.loads(report.read_text())
    assert {k: v["shape"] for k, v in rep["verification"]["inputs"].items()} == {
        n: [1, 24] for n in ("input_ids", "attention_mask", "token_type_ids")}
    assert rep["verification"]["ok"]
    assert rep["nodes_after"] < len(bert["dynamic"].graph.node)
    assert rep["settings"] == {"target": "portable", "exact": False, "input_shapes": {"input_ids": [1, 24]}}


def test_verify_is_fed_by_input_shape(bert, tmp_path):
    fixed = tmp_path / "f.onnx"
    optimize(str(bert["src"]), output=str(fixed), input_shapes={"input_ids": [1, 24]})
    proc = run_cli("verify", bert["src"], fixed, "--runs", "0", "-q")  # generated at 1x16: the fixed model refuses it
    assert proc.returncode == 1 and "cannot run the optimized model" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("verify", bert["src"], fixed, "--runs", "0", "-q", "--input-shape", "input_ids=1,24")
    assert proc.returncode == 0 and proc.stdout.strip() == "verdict: outputs agree", proc.stdout + proc.stderr
    for face in (["verify", bert["src"], fixed], ["bisect", bert["src"]]):
        proc = run_cli(*face, "--input-shape", "input_ids=batch,24")
        assert proc.returncode == 2 and "dimension 0 is the symbol 'batch'" in one_line(proc.stderr)


WRONG_ERF = textwrap.dedent("""
    from onnxopt import Op, Rule

    RULES = [Rule("erf_to_tanh", Op("Erf", "x"), lambda m, b: b.op("Tanh", m["x"]), doc="Wrong on purpose.")]
""")


def test_a_failed_verify_bisects_the_optimization_with_the_shapes_fixed(bert, tmp_path, capsys, monkeypatch):
    rules = tmp_path / "wrong.py"
    rules.write_text(WRONG_ERF)
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    args = [bert["src"], "-o", out, "--rules", rules, "--input-shape", "input_ids=1,sequence", "--verify", "cpu",
            "--runs", "0", "--json", report]
    monkeypatch.setattr(bisect, "BISECT_BUDGET_S", 3600.0)
    assert cli.main([str(a) for a in args]) == 1 and not out.exists()
    found = json.loads(report.read_text())["verification"]["bisect"]
    assert found["culprit_rule"] == "erf_to_tanh"
    assert {k: v["shape"] for k, v in found["inputs"].items()} == {n: [1, 16] for n in ("input_ids", "attention_mask",
                                                                                        "token_type_ids")}
    monkeypatch.setattr(bisect, "BISECT_BUDGET_S", 0.0)  # left to the user: the command replays the same shapes
    capsys.readouterr()
    assert cli.main([str(a) for a in args]) == 1
    command = capsys.readouterr().err.strip().split("to find the rewrite: ")[1]
    assert "--fix-input-shape input_ids=1,sequence" in command and "--input-shape input_ids=1x16" in command
    words = command.split()[3:]  # (python -m onnxopt ...)
    assert cli.main(words + ["-q"]) == 1
    assert "erf_to_tanh" in capsys.readouterr().out
