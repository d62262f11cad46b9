"""coverage.py, the rule-coverage check: what counts as a rule that can refuse, the gaps it names,
and, in pytest sessions of their own over a directory of two made-up rules, that it fails a session
that ran the whole directory with a gap, and checks nothing when only part of it ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from onnxopt.library import registry
from onnxopt import Op, Refuse, Rule, forward
from onnxopt.targets import TARGETS

from .check import RULES
from .coverage import ENV_TABLE, can_refuse, gaps

ROOT = Path(__file__).resolve().parents[2]


def _refusing_helper(m):
    raise Refuse("no")


def test_a_rule_can_refuse_through_its_condition_or_its_replacement():
    assert not can_refuse(RULES["identity_elimination"])  # forward("x"): nothing to refuse
    assert can_refuse(RULES["cast_chain"])  # a condition
    assert can_refuse(RULES["transpose_pair"])  # its replacement raises Refuse
    assert can_refuse(RULES["shape_folding"])  # through a function of its module it calls
    assert can_refuse(RULES["conv_mul_fold"])
    assert can_refuse(Rule("r", Op("Neg", "x"), lambda m, b: _refusing_helper(m)))  # in a lambda, one call down
    assert not can_refuse(Rule("r", Op("Neg", "x"), forward("x")))


def test_gaps_name_each_rule_and_what_it_lacks():
    rules = [RULES["identity_elimination"], RULES["cast_chain"], RULES["transpose_pair"], RULES["reshape_chain"]]
    fired = {"identity_elimination": {"t1"}, "cast_chain": {"t2"}, "reshape_chain": {"t3"}}
    refused = {"identity_elimination": set(), "reshape_chain": {"t4"}}
    assert gaps(rules, fired, refused) == [
        "cast_chain: never refused (it has a condition)",
        "transpose_pair: never fired and never refused (its replacement can refuse)",
    ]
    assert gaps(rules[:1], fired, {}) == []  # a rule that cannot refuse needs only to fire


def test_a_rule_declared_exact_needs_a_proof():
    rules = [RULES["identity_elimination"], RULES["conv_bn_fold"]]  # exact, and not
    fired = {"identity_elimination": {"t1"}, "conv_bn_fold": {"t2"}}
    refused = {"conv_bn_fold": {"t3"}}
    assert gaps(rules, fired, refused, proven={}) == [
        "identity_elimination: declared exact, never shown bit-identical under onnxruntime's default settings"]
    assert gaps(rules, fired, refused, proven={"identity_elimination": {"t1"}}) == []


_CONFTEST = """
import importlib.util
from pathlib import Path

import onnx_ir as ir
from onnxopt import Op, Rule, forward

spec = importlib.util.spec_from_file_location("rule_coverage", {coverage!r})
coverage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(coverage)


def _floats_only(m):
    return None if m.dtype("x") == ir.DataType.FLOAT else "not a float"


RULES = [Rule("double_neg", Op("Neg", Op("Neg", "x")), forward("x"), condition=_floats_only),
         Rule("double_abs", Op("Abs", Op("Abs", "x")), lambda m, b: b.op("Abs", m["x"]))]


def pytest_configure(config):
    config.pluginmanager.register(coverage.RuleCoverage(Path(__file__).parent, RULES), "rule-coverage")
"""

_TESTS = """
from conftest import RULES
from onnx import TensorProto, helper

from onnxopt import optimize


def twice(op, dtype=TensorProto.FLOAT):
    nodes = [helper.make_node("Relu" if dtype == TensorProto.FLOAT else "Identity", ["x"], ["a"]),
             helper.make_node(op, ["a"], ["b"]), helper.make_node(op, ["b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [2])],
                              [helper.make_tensor_value_info("y", dtype, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def fired(op, dtype=TensorProto.FLOAT):
    _, report = optimize(twice(op, dtype), rules=RULES, graph_passes=(), return_report=True)
    return {{name: (st.fired, st.refused) for name, st in report.rules.items() if st.fired or st.refused}}
"""

_FIRST = """
from helpers_demo import fired


def test_double_neg_fires():
    assert fired("Neg") == {"double_neg": (1, 0)}


def test_nothing():
    pass
"""

_SECOND = """
from onnx import TensorProto

from helpers_demo import fired


def test_double_neg_refuses_integers():
    assert fired("Neg", TensorProto.INT32) == {"double_neg": (0, 1)}


def test_double_abs_fires():
    assert fired("Abs") == {"double_abs": (1, 0)}
"""


def _demo(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir()
    (directory / "conftest.py").write_text(_CONFTEST.format(coverage=str(Path(__file__).with_name("coverage.py"))))
    (directory / "helpers_demo.py").write_text(_TESTS.format())
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    return directory


def test_the_check_fails_a_whole_run_with_a_gap_and_only_that(tmp_path):
    gap = _demo(tmp_path / "gap", {"test_first.py": _FIRST})
    complete = _demo(tmp_path / "complete", {"test_first.py": _FIRST, "test_second.py": _SECOND})
    env = {**{k: v for k, v in os.environ.items() if k != ENV_TABLE},
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           # the check is the demo conftest's plugin: installed pytest plugins are not loaded (about
           # 1.7 s of each session's start here)
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    runs = {  # name: (directory, arguments); each its own pytest session, run side by side
        "gap": (gap, []),
        "gap -k": (gap, ["-k", "fires"]),
        "gap node id": (gap, ["test_first.py::test_double_neg_fires", "test_first.py::test_nothing"]),
        "complete": (complete, []),
        "complete, one file": (complete, ["test_first.py"]),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
                                    cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, (directory, args) in runs.items()}
    out = {name: (p.wait(timeout=120), p.stdout.read()) for name, p in procs.items()}
    for p in procs.values():
        p.stdout.close()

    rc, text = out["gap"]
    assert rc == 1, text
    assert "rule coverage FAILED" in text and "2 passed" in text, text
    assert "double_neg: never refused (it has a condition)" in text and "double_abs: never fired" in text, text
    for name in ("gap -k", "gap node id", "complete, one file"):  # part of the directory: no check
        rc, text = out[name]
        assert rc == 0 and "rule coverage" not in text, (name, text)
    rc, text = out["complete"]
    assert rc == 0 and "rule coverage PASSED" in text and "5 passed" in text, text


def test_the_check_watches_the_rules_list_rules_prints():
    # what --list-rules prints (before the graph passes) for each target: together, the same objects
    # the check counts (by object); the onnxruntime-only fusions are not listed for portable
    chosen = {id(r): r for t in TARGETS for r in registry.resolve(target=t)[0]}
    assert {id(r) for r in RULES.values()} == set(chosen) and len(RULES) == len(chosen)
