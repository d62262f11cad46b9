"""The command line: ``python -m onnxopt`` (subprocess) and ``onnxopt.cli.main`` (in-process)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt import cli
from onnxopt.models import synthetic

from conftest import assert_same_outputs

USER_RULES = textwrap.dedent('''
    import numpy as np
    from onnxopt import Op, Rule


    def _relu_to_max(m, b):
        return b.op("Max", m["x"], b.const(np.array(0.0, dtype=np.float32), name="zero"))


    RULES = [Rule("relu_to_max", Op("Relu", "x"), _relu_to_max, doc="Relu(x) is Max(x, 0).")]
''')


# --------------------------------------------------------------------------------------------
# helpers


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def run_cli(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=full_env, timeout=120)


def assert_one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("onnxopt: error:"), stderr
    assert lines[0].strip() != "onnxopt: error:"
    return lines[0]


def parse_tables(stdout: str) -> dict[str, dict[str, list[str]]]:
    """The report's tables keyed by their first header word ("op", "rule"): name -> columns."""
    tables = {}
    for block in stdout.split("\n\n"):
        lines = block.splitlines()
        if len(lines) >= 2 and set(lines[1].replace(" ", "")) == {"-"}:
            rows = {}
            for line in lines[2:]:
                name, *cols = line.split()
                rows[name] = cols
            tables[lines[0].split()[0]] = {"header": lines[0].split(), **rows}
    return tables


@pytest.fixture(scope="module")
def model100():
    return synthetic.build(100)


@pytest.fixture
def src(model100, tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(model100, str(path))
    return path


@pytest.fixture
def user_rules(tmp_path):
    path = tmp_path / "my_rules.py"
    path.write_text(USER_RULES)
    return path


def run_main(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------------------------
# Success


def test_success_prints_tables(src, model100, tmp_path):
    out = tmp_path / "out.onnx"
    proc = run_cli(src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert out.is_file()
    tables = parse_tables(proc.stdout)
    ops = tables["op"]
    assert ops["header"][:4] == ["op", "type", "before", "after"]
    assert ops["BatchNormalization"][:2] == ["20", "0"]
    assert ops["Identity"][:2] == ["20", "0"]
    assert ops["unchanged"][:3] == ["60", "60", "+0"]  # Add, Conv and Relu: the op types that kept their count
    assert "Conv" not in ops
    assert ops["total"][:3] == ["100", "60", "-40"]
    rules = tables["rule"]
    fired = rules["header"].index("fired")
    assert rules["conv_bn_fold"][fired - 1] == "20"
    assert rules["identity_elimination"][fired - 1] == "20"
    assert "constant_folding" not in rules  # tried, never fired: counted on the summary line only
    assert "nodes 100 -> 60 (-40, -40.0%); 40 rewrites by 2 rules; " in proc.stdout
    assert f"wrote {out} (" in proc.stdout
    assert_same_outputs(model100, str(out), synthetic.inputs(model100))


def test_json_report(src, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, stdout, stderr = run_main(capsys, src, "-o", out, "--json", report)
    assert code == 0 and stderr == ""
    data = json.loads(report.read_text())
    assert data["input"] == str(src) and data["output"] == str(out)
    assert data["nodes_before"] == 100 and data["nodes_after"] == 60
    assert sum(data["op_types_before"].values()) == 100
    assert sum(data["op_types_after"].values()) == 60
    assert data["op_types_after"] == {"Add": 20, "Conv": 20, "Relu": 20}
    assert data["rules"]["conv_bn_fold"]["fired"] == 20
    assert data["rules"]["identity_elimination"]["fired"] == 20
    assert data["rewrites"] == sum(r["fired"] for r in data["rules"].values()) == 40
    assert set(data["seconds"]) >= {"load", "rewrite", "save", "total"}
    assert all(isinstance(v, (int, float)) and v >= 0 for v in data["seconds"].values())
    assert data["seconds"]["total"] >= data["seconds"]["rewrite"]
    assert data["hit_limit"] is False
    assert len(onnx.load(str(out)).graph.node) == 60
    # No temporary file of the JSON writer is left behind.
    assert listing(tmp_path) == ["model.onnx", "out.onnx", "report.json"]


def test_quiet_prints_nothing(src, tmp_path, capsys):
    code, stdout, stderr = run_main(capsys, src, "-o", tmp_path / "out.onnx", "-q")
    assert code == 0 and stdout == "" and stderr == ""
    assert (tmp_path / "out.onnx").is_file()


def test_input_unchanged_after_success(src, tmp_path, capsys):
    digest, mtime = sha256(src), src.stat().st_mtime_ns
    code, _, _ = run_main(capsys, src, "-o", tmp_path / "out.onnx")
    assert code == 0
    assert sha256(src) == digest and src.stat().st_mtime_ns == mtime


def test_deterministic_across_processes(src, tmp_path):
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"out{seed}.onnx"
        proc = run_cli(src, "-o", out, "-q", env={"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_external_data_option(tmp_path, capsys):
    model = synthetic.build(20, channels=16)
    path = tmp_path / "wide.onnx"
    onnx.save(model, str(path))
    out = tmp_path / "out.onnx"
    code, _, _ = run_main(capsys, path, "-o", out, "--external-data", "weights.bin", "-q")
    assert code == 0
    assert (tmp_path / "weights.bin").stat().st_size > 0
    assert_same_outputs(model, str(out), synthetic.inputs(model), rtol=1e-4, atol=1e-4)
    code, _, _ = run_main(capsys, path, "-o", tmp_path / "default.onnx", "--external-data", "-q")
    assert code == 0 and (tmp_path / "default.onnx.data").stat().st_size > 0


def test_external_data_model_from_another_directory(tmp_path):
    model = synthetic.build(20, channels=16)
    (tmp_path / "src").mkdir()
    onnx.save(model, str(tmp_path / "src" / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="w.data", size_threshold=0)
    proc = run_cli(tmp_path / "src" / "m.onnx", "-o", tmp_path / "out.onnx", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.onnx.data").is_file()


# --------------------------------------------------------------------------------------------
# Rule selection


def listed_rows(stdout: str) -> dict[str, str]:
    """The rows --list-rules prints, by name, in order: each row of its tables (a block of a title
    line, a header, a dashed rule and the rows), keyed by its first word."""
    return {row.split()[0]: row for block in stdout.split("\n\n") for lines in [block.splitlines()]
            if len(lines) > 2 and set(lines[2].replace(" ", "")) == {"-"} for row in lines[3:]}


def listed_rules(stdout: str) -> list[str]:
    """The names --list-rules prints, in order."""
    return list(listed_rows(stdout))


def portable_rules() -> list[str]:
    """The built-in rules --list-rules shows for the default target (the onnxruntime fusions are not)."""
    return [r.name for r in onnxopt.default_rules() if "portable" in r.targets]


def test_list_rules(capsys):
    code, stdout, stderr = run_main(capsys, "--list-rules")
    assert code == 0 and stderr == ""
    listed = listed_rules(stdout)
    from onnxopt.library.passes import NAMES as PASSES

    expected = portable_rules() + list(PASSES)
    assert listed == expected
    assert {"conv_bn_fold", "identity_elimination", "bn_to_mul_add"} <= set(listed)
    # each pass says when it runs: the memory passes once at the end (they were listed "between rounds")
    rows = listed_rows(stdout)
    from onnxopt.library.passes import BY_NAME

    when = {"first": "first ", "between": "between rounds ", "last": "last (once, at the end) "}
    for name in PASSES:
        assert rows[name][len(name):].lstrip().startswith(when[BY_NAME[name].phase]), rows[name]
    assert BY_NAME["memory_recomputation"].phase == BY_NAME["memory_reordering"].phase == "last"


def test_list_rules_with_disable(capsys):
    code, stdout, _ = run_main(capsys, "--list-rules", "--disable", "conv_bn_fold")
    assert code == 0
    listed = set(listed_rules(stdout))
    from onnxopt.library.passes import NAMES as PASSES

    assert listed == (set(portable_rules()) | set(PASSES)) - {"conv_bn_fold"}
    # graph passes are disabled by the same flag
    code, stdout, _ = run_main(capsys, "--list-rules", "--disable", PASSES[0])
    assert code == 0 and PASSES[0] not in listed_rules(stdout)


@pytest.mark.parametrize("shapes", ["no_value_info", "shape_inferred"])
def test_disable_conv_bn_fold(shapes, tmp_path, capsys):
    model = synthetic.build(100)
    if shapes == "shape_inferred":
        model = onnx.shape_inference.infer_shapes(model)
    path = tmp_path / "in.onnx"
    onnx.save(model, str(path))
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, _, _ = run_main(capsys, path, "-o", out, "--json", report, "--disable", "conv_bn_fold")
    assert code == 0
    data = json.loads(report.read_text())
    assert "conv_bn_fold" not in data["rules"]
    after = data["op_types_after"]
    # Conv and BN stay apart. Each BN either stays or becomes Mul + Add through bn_to_mul_add
    # (which rule of the two applies after a Conv is the rule library's choice, and has changed).
    mul = after.get("Mul", 0)
    assert after.get("BatchNormalization", 0) + mul == 20
    assert data["rules"]["bn_to_mul_add"]["fired"] == mul
    assert after["Add"] == 20 + mul
    assert after["Conv"] == 20 and after["Relu"] == 20 and "Identity" not in after
    assert data["nodes_after"] == 80 + mul
    conv_weights = {n.input[1] for n in onnx.load(str(out)).graph.node if n.op_type == "Conv"}
    assert conv_weights == {f"b{i}.w" for i in range(20)}  # the original, unfolded weights
    assert_same_outputs(model, str(out), synthetic.inputs(model))


def test_disable_unknown_rule(src, tmp_path):
    proc = run_cli(src, "-o", tmp_path / "out.onnx", "--disable", "no_such_rule")
    assert proc.returncode == 2
    line = assert_one_line_error(proc.stderr)
    assert "no_such_rule" in line
    assert listing(tmp_path) == ["model.onnx"]


def test_user_rules_file(src, model100, user_rules, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, stdout, stderr = run_main(capsys, src, "-o", out, "--json", report, "--rules", user_rules)
    assert code == 0, stderr
    data = json.loads(report.read_text())
    assert data["rules"]["relu_to_max"]["fired"] == 20
    assert data["rules"]["conv_bn_fold"]["fired"] == 20
    assert data["op_types_after"] == {"Add": 20, "Conv": 20, "Max": 20}
    assert parse_tables(stdout)["rule"]["relu_to_max"][1] == "20"
    assert_same_outputs(model100, str(out), synthetic.inputs(model100))


def test_user_rules_listed(user_rules, capsys):
    code, stdout, _ = run_main(capsys, "--list-rules", "--rules", user_rules)
    assert code == 0
    listed = listed_rules(stdout)
    assert f"{user_rules}: 1 rule\n" in stdout  # the family of a user's rule: its file
    from onnxopt.library.passes import NAMES as PASSES

    assert listed == portable_rules() + ["relu_to_max"] + list(PASSES)


def test_no_builtin_rules(src, model100, user_rules, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, _, _ = run_main(capsys, src, "-o", out, "--json", report, "--rules", user_rules,
                          "--no-builtin-rules")
    assert code == 0
    data = json.loads(report.read_text())
    assert list(data["rules"]) == ["relu_to_max"]
    assert data["rules"]["relu_to_max"]["fired"] == 20
    assert data["op_types_after"] == {"Add": 20, "BatchNormalization": 20, "Conv": 20, "Identity": 20,
                                      "Max": 20}
    assert_same_outputs(model100, str(out), synthetic.inputs(model100))


@pytest.mark.parametrize("body", ['raise RuntimeError("boom from user rules")\n', "def broken(:\n"],
                         ids=["raises", "syntax_error"])
def test_rules_file_failing_on_import(body, src, tmp_path):
    bad = tmp_path / "bad_rules.py"
    bad.write_text(body)
    proc = run_cli(src, "-o", tmp_path / "out.onnx", "--rules", bad)
    assert proc.returncode == 2
    line = assert_one_line_error(proc.stderr)
    assert "bad_rules.py" in line
    if "boom" in body:
        assert "RuntimeError" in line and "boom from user rules" in line
    else:
        assert "SyntaxError" in line
    assert proc.stdout == ""
    assert listing(tmp_path) == ["bad_rules.py", "model.onnx"]


# --------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr, no traceback, nothing written


def _write_checker_failure(path: Path, kind: str) -> None:
    if kind == "conv":  # a Conv without its required weight input
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])
        node = helper.make_node("Conv", ["x"], ["y"])
    else:  # an input that nothing produces
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
        node = helper.make_node("Add", ["x", "nowhere"], ["y"])
    graph = helper.make_graph([node], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))


def _setup_bad(case: str, tmp_path: Path, model100) -> tuple[list, str]:
    """Create the bad input in tmp_path; return the CLI arguments and a word the error must hold."""
    src = tmp_path / "in.onnx"
    out = tmp_path / "out.onnx"
    if case == "text":
        src.write_text("this is a text file, not a model\n")
        return [src, "-o", out], "not an ONNX model"
    if case == "truncated":
        data = model100.SerializeToString()
        src.write_bytes(data[: int(len(data) * 0.6)])
        return [src, "-o", out], "truncated"
    if case in ("checker_conv", "checker_dangling"):
        _write_checker_failure(src, case.split("_")[1])
        return [src, "-o", out], "checker"
    if case == "missing_external_data":
        onnx.save(synthetic.build(20), str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="weights.bin", size_threshold=0)
        (tmp_path / "weights.bin").unlink()
        return [src, "-o", out], "weights.bin"
    if case == "nonexistent":
        return [tmp_path / "nope.onnx", "-o", out], "nope.onnx"
    onnx.save(model100, str(src))
    if case == "same_as_input":
        return [src, "-o", src], "input"
    if case == "same_as_input_other_spelling":
        (tmp_path / "sub").mkdir()
        return [src, "-o", tmp_path / "sub" / ".." / "in.onnx"], "input"
    if case == "missing_output":  # (a bare MODEL is inspected: an optimize option without -o is this error)
        return [src, "--exact"], "-o"
    if case == "missing_input":
        return ["-o", out], "no model given"
    if case == "unknown_option":
        return [src, "-o", out, "--frobnicate"], "--frobnicate"
    raise AssertionError(case)


BAD_CASES = [
    "text", "truncated", "checker_conv",
    "checker_dangling",
    "missing_external_data", "nonexistent", "same_as_input", "same_as_input_other_spelling",
    "missing_output", "missing_input",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(case, model100, tmp_path):
    args, word = _setup_bad(case, tmp_path, model100)
    before = {name: sha256(tmp_path / name) for name in listing(tmp_path) if (tmp_path / name).is_file()}
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = assert_one_line_error(proc.stderr)
    assert word in line
    assert proc.stdout == ""
    after = {name: sha256(tmp_path / name) for name in listing(tmp_path) if (tmp_path / name).is_file()}
    assert after == before  # no output file, input untouched
    assert not (tmp_path / "out.onnx").exists()


def test_unknown_option(model100, tmp_path):
    args, word = _setup_bad("unknown_option", tmp_path, model100)
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("onnxopt: error:") and word in last
    assert not (tmp_path / "out.onnx").exists()


def test_unknown_option_is_one_line(model100, tmp_path, capsys):
    args, _ = _setup_bad("unknown_option", tmp_path, model100)
    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in args])
    assert info.value.code == 2
    assert_one_line_error(capsys.readouterr().err)


def test_bare_model_takes_inspect_options_abbreviated(tmp_path, capsys):
    """``onnxopt MODEL --dev NAME`` is inspect, as ``onnxopt inspect MODEL --dev NAME`` is (argparse takes an
    unambiguous prefix); an option only optimizing takes still asks for -o."""
    from helpers import model as make, tinfo
    from onnx import helper as h

    src = tmp_path / "m.onnx"
    onnx.save(make([h.make_node("Relu", ["x"], ["y"])], [tinfo("x", [2])], [tinfo("y", [2])]), src)
    out = tmp_path / "a.json"
    assert cli.main([str(src), "--dev", "h100-sxm", "--js", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["device"]["key"] == "h100-sxm"
    assert cli.main([str(src), "--prec", "fp16"]) == 2
    assert "no output given" in capsys.readouterr().err
