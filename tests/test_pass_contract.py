"""The whole-graph pass contract (onnxopt.core.passes): a pass is a row of the table; the pipeline
runs each by its phase and what it declares (requirements recorded before any change, an option it
settles for the rules, its effect, its targets, its scratch keys) and names none."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import init, model, op_types, tinfo
from onnx import helper

import onnxopt.core.pipeline
from onnxopt import Op, Rule, optimize
from onnxopt.core import passes
from onnxopt.core.passes import Effect, Pass, Phase, Requirement
from onnxopt.errors import UsageError
from onnxopt.library import passes as builtin
from onnxopt.library import registry


def _model() -> onnx.ModelProto:
    """x -> Identity -> Add(Constant) -> y, and a dead Relu: the Identity is the rules' (removed by
    the driver's first round), the Constant the constant lifting pass's."""
    nodes = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", onnx.TensorProto.FLOAT, [4],
                                                                              [1, 2, 3, 4])),
             helper.make_node("Identity", ["x"], ["i"]),
             helper.make_node("Add", ["i", "c"], ["y"]),
             helper.make_node("Relu", ["x"], ["dead"])]
    return model(nodes, [tinfo("x", [4])], [tinfo("y", [4])])


def test_a_registered_pass_runs_in_its_phase():
    seen = []

    def watcher(phase):
        def run(m: ir.Model, touched=None) -> int:
            ops = [n.op_type for n in m.graph]
            seen.append((phase, "Constant" in ops, "Identity" in ops, "Relu" in ops))
            return 0
        return run

    rows = [Pass("probe_first", watcher("first"), Phase.FIRST, "a probe"),
            Pass("probe_between", watcher("between"), Phase.BETWEEN, "a probe"),
            Pass("probe_last", watcher("last"), Phase.LAST, "a probe")]
    for p in rows:
        passes.register(p)
    try:
        assert passes.names()[-3:] == ("probe_first", "probe_between", "probe_last")
        out, report = optimize(_model(), return_report=True)
    finally:
        for p in rows:
            passes.unregister(p.name)
    # first: after constant lifting (earlier in the table) and dead code, before any rule;
    # between: after the driver's first round; last: once, at the end
    assert seen[0] == ("first", False, True, False)
    assert seen[1] == ("between", False, False, False)
    assert seen[-1] == ("last", False, False, False)
    assert [s[0] for s in seen[1:-1]] == ["between"] * (len(seen) - 2)
    assert report.rules["probe_first"].tried == 1 and report.rules["probe_last"].tried == 1
    assert report.rules["probe_between"].tried == len(seen) - 2
    assert op_types(out) == ["Add"]
    assert "probe_last" not in passes.names()


def test_a_pass_counts_by_its_effect_and_its_changes_reach_the_output():
    def mark(m: ir.Model, touched=None) -> int:
        m.metadata_props["probe"] = "ran"
        return 1

    def annotate(m: ir.Model, touched=None) -> int:
        return 3

    with passes.registered(Pass("probe_mark", mark, Phase.LAST, "marks the model")), \
            passes.registered(Pass("probe_note", annotate, "first", "annotates", effect="annotates")):
        out, report = optimize(_model(), return_report=True)
    assert {p.key: p.value for p in out.metadata_props}.get("probe") == "ran"
    assert report.rules["probe_mark"].fired == 1
    note = report.rules["probe_note"]
    assert (note.matched, note.fired) == (3, 0)  # (an annotation changes no node)
    assert passes.get("probe_note") is None  # (the block's end took them out)


def test_requirements_are_recorded_once_before_any_change_and_handed_back():
    calls = []

    def record(m: ir.Model) -> None:
        calls.append(1)
        m.graph.meta["probe.input"] = sorted(n.op_type for n in m.graph)

    req = Requirement("probe_input", "probe.input", record, "the input's ops")

    def use(m: ir.Model, touched=None) -> int:
        assert m.graph.meta["probe.input"] == ["Add", "Constant", "Identity", "Relu"]
        m.graph.meta["probe.scratch"] = object()  # left for a later pass: dropped at the end
        return 0

    two = [Pass("probe_a", use, Phase.LAST, "needs", needs=(req,), scratch=("probe.scratch",)),
           Pass("probe_b", use, Phase.FIRST, "needs", needs=(req,))]
    m = ir.from_proto(_model())
    result = onnxopt.core.pipeline.run(m, [], graph_passes=two)  # (objects not registered run too)
    assert calls == [1]
    assert result.records == {"probe_input": ["Add", "Constant", "Identity", "Relu"]}
    assert "probe.input" not in m.graph.meta and "probe.scratch" not in m.graph.meta
    assert passes.needing(two, req) and not passes.needing(two[:0], req)


def _waits(m, b):
    return m["x"]


def test_a_pass_settles_an_option_the_rules_wait_for():
    waits = Rule("probe_identity", Op("Identity", "x"), _waits,
                 condition=lambda m: None if m.options.get("probe_settled") else "waits for the probe pass")

    def nothing(m, touched=None) -> int:
        return 0

    settling = Pass("probe_settle", nothing, Phase.BETWEEN, "settles", settles="probe_settled",
                    waiting=lambda m: any(n.op_type == "Identity" for n in m.graph))
    m = ir.from_proto(_model())
    result = onnxopt.core.pipeline.run(m, [waits], graph_passes=[])
    assert [n.op_type for n in m.graph] == ["Constant", "Identity", "Add"]  # (without the pass the rule waits)
    assert result.rules["probe_identity"].reasons["waits for the probe pass"] >= 1
    m = ir.from_proto(_model())
    result = onnxopt.core.pipeline.run(m, [waits], graph_passes=[settling])
    assert [n.op_type for n in m.graph] == ["Constant", "Add"]
    assert result.rules["probe_identity"].fired == 1


def test_a_pass_for_one_target_runs_only_there():
    row = Pass("probe_cuda", lambda m, t=None: 0, Phase.LAST, "cuda only", targets=frozenset({"ort-cuda"}),
               exact=True)
    with passes.registered(row):
        assert "probe_cuda" in registry.resolve(target="ort-cuda")[1]
        assert "probe_cuda" not in registry.resolve(target="portable")[1]
        assert "probe_cuda" not in registry.resolve(target="cpu")[1]
        _, report = optimize(_model(), target="cuda", return_report=True)
        assert report.rules["probe_cuda"].tried == 1
        _, report = optimize(_model(), return_report=True)
        assert "probe_cuda" not in report.rules


def test_exact_mode_runs_only_passes_declared_exact():
    with passes.registered(Pass("probe_undeclared", lambda m, t=None: 0, Phase.LAST, "undeclared")):
        assert "probe_undeclared" in registry.resolve()[1]
        assert "probe_undeclared" not in registry.resolve(exact=True)[1]


def test_registering_twice_and_unknown_names_are_errors():
    with pytest.raises(ValueError, match="registered already"):
        passes.register(Pass(builtin.CSE, lambda m, t=None: 0, Phase.LAST, "twin"))
    with pytest.raises(UsageError, match="unknown graph pass"):
        optimize(_model(), graph_passes=["no_such_pass"])
    assert Pass("p", lambda m, t=None: 0, "between", "0.1 strings").phase is Phase.BETWEEN
    assert Phase.LAST == "last" and {"first": 1}[Phase.FIRST] == 1  # (0.1 code compares with the strings)


def test_the_builtin_table_declares_what_the_pipeline_special_cased():
    t = builtin.BY_NAME
    assert passes.names()[:len(builtin.NAMES)] == builtin.NAMES
    assert t[builtin.TRANSPOSES].settles == passes.SETTLED and t[builtin.TRANSPOSES].waiting is not None
    assert builtin.MEMORY_BASELINE in t[builtin.RECOMPUTE].needs
    assert t[builtin.MEMORY].effect is Effect.ORDER and t[builtin.SHAPES].effect is Effect.ANNOTATES
    assert [p.name for p in builtin.PASSES if p.phase is Phase.LAST] == [builtin.RECOMPUTE, builtin.MEMORY]


def test_the_pipeline_names_no_pass():
    source = Path(onnxopt.core.pipeline.__file__).read_text()
    tree = ast.parse(source)
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith(("onnxopt.transforms", "onnxopt.library"))]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    for name in builtin.NAMES:  # (the docstring says what the passes do, never their names)
        assert not any(name in s for s in strings), name
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(tree)
                                                                         if isinstance(n, ast.Attribute)}
    assert not names & {"SETTLED", "TRANSPOSES", "RECOMPUTE", "MEMORY", "BASELINE_KEY", "SIZES_KEY"}


RULES_FILE = '''
import onnx_ir as ir
from onnxopt import Op, Rule
from onnxopt.core.passes import Pass, Phase, register


def stamp(model: ir.Model, touched=None) -> int:
    model.metadata_props["stamped_by"] = "stamp_pass"
    return 1


register(Pass("stamp_pass", stamp, Phase.LAST, "Stamps the model (a pass a rules file adds).", exact=True))
RULES = [Rule("relu_relu", Op("Relu", Op("Relu", "x")), lambda m, b: b.op("Relu", m["x"]), exact=True)]
'''


def test_a_rules_file_adds_a_pass_listed_and_run_by_the_command_line(tmp_path):
    rules = tmp_path / "stamp_rules.py"
    rules.write_text(RULES_FILE)
    proc = subprocess.run([sys.executable, "-m", "onnxopt", "--list-rules", "--rules", str(rules)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.split("graph passes (onnxopt/library/passes.py)")[1].splitlines()
    names = [r.split()[0] for r in rows[3:] if r.strip()]
    assert names == [*builtin.NAMES, "stamp_pass"]
    row = next(r for r in rows if r.startswith("stamp_pass"))
    assert row.split()[1:6] == ["last", "(once,", "at", "the", "end)"]
    assert row.rstrip().endswith("Stamps the model (a pass a rules file adds).")
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_model(), src)
    proc = subprocess.run([sys.executable, "-m", "onnxopt", str(src), "-o", str(out), "--rules", str(rules)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.key: p.value for p in onnx.load(out).metadata_props}["stamped_by"] == "stamp_pass"
