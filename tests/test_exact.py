"""Exact mode, as users call it: ``optimize(..., exact=True)`` and ``--exact`` apply only the rules
and passes declared exact (every built-in one declares it), and the result gives the input's bits
on onnxruntime's CPU provider with its default session options at 1 and 2 threads: on small
models for each pass (tests/rules proves each rule), and end to end on zoo models where the
default mode does change the bits (so these tests can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import bn_node, bn_params, feeds_for, init, model, op_types, tinfo
from helpers import shared_zoo_model
from onnx import helper

import onnxopt
from onnxopt.library import passes
from onnxopt.library import registry
from onnxopt import Op, Rule, forward, optimize
from onnxopt.models import zoo
from rules.check import zoo_exact
from test_cli import listed_rows

ROOT = Path(__file__).resolve().parent.parent


def _bits_kept(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict | None = None) -> None:
    feeds = feeds_for(before) if feeds is None else feeds
    result = zoo_exact.compare(before.SerializeToString(), after.SerializeToString(), feeds)
    assert all(result["identical"].values()), result


# --- declarations and selection ------------------------------------------------------------------


def test_every_builtin_rule_and_pass_declares_whether_it_is_exact():
    undeclared = [r.name for r in onnxopt.default_rules() if not isinstance(r.exact, bool)]
    assert undeclared == [], f"built-in rules that leave Rule.exact undeclared: {undeclared}"
    assert [p.name for p in passes.PASSES if not isinstance(p.exact, bool)] == []
    exact = {r.name for r in onnxopt.default_rules() if r.exact}
    assert {"constant_folding", "identity_elimination", "cast_chain"} <= exact
    assert not exact & {"conv_bn_fold", "conv_mul_fold", "conv_add_fold", "bn_to_mul_add", "div_to_mul",
                        "castlike_to_cast", "reshape_shape_from_input", "shape_gather_folding", "pad_into_conv"}


def test_a_rule_is_undeclared_by_default_and_exact_takes_only_a_bool():
    assert Rule("r", Op("Neg", "x"), forward("x")).exact is None
    with pytest.raises(TypeError, match="exact must be True, False or None"):
        Rule("r", Op("Neg", "x"), forward("x"), exact=1)


def test_exact_selection_keeps_declared_exact_rules_and_passes_only():
    mine = [Rule("mine_exact", Op("Neg", "x"), forward("x"), exact=True),
            Rule("mine_not", Op("Abs", "x"), forward("x"), exact=False),
            Rule("mine_undeclared", Op("Relu", "x"), forward("x"))]
    rules, graph_passes = registry.resolve(extra_rules=mine, exact=True)
    # (exact mode's default target is portable: range_of_dim, exact but for ort-cuda only, is not among them)
    assert [r.name for r in rules] == [r.name for r in onnxopt.default_rules() if r.exact and "portable" in r.targets] \
        + ["mine_exact"]
    assert graph_passes == [p.name for p in passes.PASSES if p.exact]
    assert "shape_completion" not in graph_passes
    rules, graph_passes = registry.resolve(extra_rules=mine)
    portable = [r for r in onnxopt.default_rules() if "portable" in r.targets]  # (not the onnxruntime fusions)
    assert len(rules) == len(portable) + 3 and graph_passes == list(passes.NAMES)


def _conv_bn_identity():
    """x -> Conv -> BatchNormalization -> Identity -> y: conv_bn_fold (not exact) and
    identity_elimination (exact) both apply."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), bn_node("c", "b", "bn"),
             helper.make_node("Identity", ["b"], ["y"])]
    return model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 8, 8])],
                 [init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)), *bn_params("bn", 4, rng)])


def test_optimize_exact_applies_only_exact_rules_and_keeps_the_bits():
    m = _conv_bn_identity()
    out, report = optimize(m, exact=True, return_report=True)
    assert op_types(out) == ["Conv", "BatchNormalization"] and report.fired == {"identity_elimination": 1}
    _bits_kept(m, out)
    out, report = optimize(m, return_report=True)  # the default mode folds the BatchNormalization
    assert op_types(out) == ["Conv"] and report.fired["conv_bn_fold"] == 1


def test_undeclared_user_rules_are_left_out_of_exact_mode_with_a_warning():
    m = model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
              [tinfo("x", [3])], [tinfo("y", [3])])
    neg_abs = Rule("neg_abs", Op("Neg", "x"), lambda m, b: b.op("Abs", m["x"]))  # undeclared (and wrong)
    out, report = optimize(m, extra_rules=[neg_abs], exact=True, return_report=True)
    assert op_types(out) == ["Relu", "Neg"] and "neg_abs" not in report.rules
    assert any("exact: left out 1 rule(s)" in w and "neg_abs" in w for w in report.warnings), report.warnings
    declared = Rule("neg_abs", Op("Neg", "x"), lambda m, b: b.op("Abs", m["x"]), exact=False)
    _, report = optimize(m, extra_rules=[declared], exact=True, return_report=True)
    assert not any(w.startswith("exact:") for w in report.warnings)


# --- the passes declared exact ---------------------------------------------------------------------


def test_passes_declared_exact_keep_the_bits():
    """Constant lifting, initializer deduplication and CSE, each firing, under exact mode."""
    w = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["k"], value=onnx.numpy_helper.from_array(w)),
             helper.make_node("MatMul", ["x", "k"], ["a"]), helper.make_node("MatMul", ["x", "w1"], ["b"]),
             helper.make_node("MatMul", ["x", "w2"], ["c"]), helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("Mul", ["s", "c"], ["y"])]
    m = model(nodes, [tinfo("x", [3, 6])], [tinfo("y", [3, 4])], [init("w1", w), init("w2", w)])
    out, report = optimize(m, exact=True, return_report=True)
    assert {"constant_lifting", "initializer_deduplication", "common_subexpression_elimination"} <= set(report.fired)
    assert op_types(out) == ["MatMul", "Add", "Mul"]
    _bits_kept(m, out, {"x": np.array([[np.nan, -0.0, np.inf, 1e-45, -3e38, 2.5]] * 3, np.float32)})


def test_exact_mode_runs_no_shape_completion():
    """Shapes inferred with data propagation are knowledge onnxruntime's own inference lacks:
    exact mode does without them."""
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", ["batch", 3])], [tinfo("y", ["batch", 3])])
    assert "shape_completion" in optimize(m, return_report=True)[1].rules
    assert "shape_completion" not in optimize(m, exact=True, return_report=True)[1].rules


# --- the command line -------------------------------------------------------------------------------


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_cli_exact_optimizes_lists_and_verifies_without_tolerance(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_conv_bn_identity(), src)
    r = _cli(src, "-o", tmp_path / "out.onnx", "--exact", "--json", tmp_path / "r.json", "--verify", "cpu",
             "--runs", "0")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert {k: v["fired"] for k, v in report["rules"].items() if v["fired"]} == {"identity_elimination": 1}
    assert "conv_bn_fold" not in report["rules"] and "shape_completion" not in report["rules"]
    (row,) = report["verification"]["providers"]["cpu"]["outputs"]
    assert row["rtol"] == 0 and row["atol"] == 0 and row["max_abs"] == 0
    assert op_types(onnx.load(tmp_path / "out.onnx")) == ["Conv", "BatchNormalization"]

    listed = listed_rows(_cli("--list-rules", "--exact").stdout)
    assert list(listed) == [r.name for r in onnxopt.default_rules() if r.exact and "portable" in r.targets] + \
        [p.name for p in passes.PASSES if p.exact]
    assert all(" exact " in row for row in listed.values())
    full = listed_rows(_cli("--list-rules").stdout)
    assert " exact " not in full["conv_bn_fold"] and " tolerance " in full["conv_bn_fold"]

    r = _cli("bisect", src, "--exact", "--json", tmp_path / "b.json")  # bisect takes the same rule options
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "b.json").read_text())["rewrites"] == 1  # the Identity only


# --- end to end on zoo models -------------------------------------------------------------------------

# vision with BatchNormalization (the dynamo export's CastLike'd parameters), two transformers,
# PP-OCRv4 det (its Mul by a scalar after a Conv); the default mode changes the bits of those marked
E2E = {"mobilenet_v2-dynamo": True, "gpt2-dynamo": True, "bert-legacy": False, "ppocrv4-det": True}


@pytest.fixture(scope="module")
def zoo_model(tmp_path_factory):
    """A zoo model: from the zoo cache when built there, else exported into a temporary folder
    (fetched models are skipped when not cached: no network in tests)."""
    return shared_zoo_model  # built once per session, shared with the other tests that read it


@pytest.mark.parametrize("name", list(E2E))
def test_exact_mode_keeps_the_bits_of_zoo_models(zoo_model, name):
    path = zoo_model(name)
    row = zoo_exact.check_model(path, zoo.get(name).inputs(path))
    assert all(row["exact"]["identical"].values()), row["exact"]
    assert row["exact"]["nodes"] < row["nodes"]
    if E2E[name]:
        assert not any(row["default"]["identical"].values()), row["default"]
