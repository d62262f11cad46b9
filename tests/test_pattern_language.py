"""The rule language's composition pieces (onnxopt.core.pattern): Or, Repeat, Absorbed, Explain, and
Op's uses=/bind=/check=, Const's check=: what each binds, what it refuses with which reason, and
what the driver records for a rule that absorbs the nodes between its ends."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import init, model, tinfo
from onnx import helper

from onnxopt.core.driver import Driver
from onnxopt.core.pattern import ANY, Absorbed, Const, Explain, Op, Or, Repeat, Rule, Var
from onnxopt.errors import RuleError
from onnxopt.ir.shapes import opsets_of
from onnxopt.ir.util import REPLACED_KEY, SOURCES_KEY


def _graph(nodes, inits=(), outputs=("y",), inputs=(("x", [2, 3, 4]),)):
    proto = model(nodes, [tinfo(n, s) for n, s in inputs], [tinfo(o, None) for o in outputs], inits)
    m = ir.from_proto(proto)
    return m, {n.name: n for n in m.graph}


def _bind(rule: Rule, m: ir.Model, root: ir.Node):
    return rule.bind(root, opsets_of(m))


def _node(op, ins, out, **attrs):
    return helper.make_node(op, ins, [out], name=out, **attrs)


def _views(rest):
    return Or(Op("Transpose", rest), Op("Reshape", rest, ANY), Op("Mul", rest, Const(check=_scalar),
                                                                       commutative=True))


def _scalar(value: ir.Value) -> bool:
    return value.const_value is not None and value.const_value.numpy().size == 1


def _noop(m, b):
    return None


# -- Or --------------------------------------------------------------------------------------------


def test_or_takes_the_first_alternative_that_matches_and_leaves_the_others_unbound():
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
    rule = Rule("or", Op("Neg", Or(Op("Sigmoid", "a", name="sig"), Op("Relu", "b", name="relu"))), _noop)
    match = _bind(rule, m, nodes["y"])
    assert not isinstance(match, str)
    assert match.node("relu") is nodes["r"] and match["b"] is nodes["r"].inputs[0]
    assert match.node("sig") is None and match["a"] is None  # the alternative not taken binds nothing
    assert match.nodes == (nodes["y"], nodes["r"])


def test_or_gives_the_reason_of_the_alternative_that_got_furthest():
    # Neg(Relu(Abs(x))): the second alternative matches Relu and then fails at Abs; the first fails at once
    m, nodes = _graph([_node("Abs", ["x"], "a"), _node("Relu", ["a"], "r"), _node("Neg", ["r"], "y")])
    rule = Rule("or", Op("Neg", Or(Op("Sigmoid", "u"), Op("Relu", Op("Exp", "v")))), _noop)
    reason = _bind(rule, m, nodes["y"])
    assert isinstance(reason, str) and "expected Exp, found Abs" in reason
    # on a tie, the first alternative's reason
    rule = Rule("tie", Op("Neg", Or(Op("Sigmoid", "u"), Op("Tanh", "v"))), _noop)
    assert "expected Sigmoid, found Relu" in _bind(rule, m, nodes["y"])


def test_commutative_op_gives_the_reason_of_the_order_that_got_furthest():
    # Add(Abs(x), Relu(x)) against Add(Abs(Sigmoid(v)), w): the first order matches Abs, then fails at
    # x; the second (the last, whose reason a tie would give) fails at once
    m, nodes = _graph([_node("Abs", ["x"], "a"), _node("Relu", ["x"], "r"), _node("Add", ["a", "r"], "y")])
    rule = Rule("comm", Op("Add", Op("Abs", Op("Sigmoid", "v")), "w", commutative=True), _noop)
    assert "'x' is not produced by Sigmoid" in _bind(rule, m, nodes["y"])


# -- Repeat ----------------------------------------------------------------------------------------


def test_repeat_is_greedy_and_binds_its_chain_in_data_order():
    # Relu(x) -> Transpose -> Reshape -> Mul(0.5) -> Neg: the views between Relu and Neg are one chain
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Transpose", ["r"], "t", perm=[0, 2, 1]),
                       _node("Reshape", ["t", "shape"], "s"), _node("Mul", ["half", "s"], "h"),
                       _node("Neg", ["h"], "y")],
                      [init("shape", np.array([2, 12], np.int64)), init("half", np.array(0.5, np.float32))])
    rule = Rule("rep", Op("Neg", Repeat(_views, Op("Relu", "x", name="relu"), name="views")), _noop)
    match = _bind(rule, m, nodes["y"])
    assert not isinstance(match, str), match
    assert match.chain("views") == (nodes["t"], nodes["s"], nodes["h"])
    assert match.node("relu") is nodes["r"]
    # at most max steps: two are not enough to reach the Relu
    short = Rule("short", Op("Neg", Repeat(_views, Op("Relu", "x"), max=2, name="views")), _noop)
    assert "expected Relu, found Transpose" in _bind(short, m, nodes["y"])


def test_repeat_takes_the_most_steps_after_which_its_end_matches():
    # Reshape(Reshape(x)): the end is "a Reshape"; greedy takes the first Reshape as the end, the second as a step
    m, nodes = _graph([_node("Reshape", ["x", "s1"], "a"), _node("Reshape", ["a", "s2"], "b"),
                       _node("Neg", ["b"], "y")],
                      [init("s1", np.array([6, 4], np.int64)), init("s2", np.array([24], np.int64))])
    rule = Rule("rep", Op("Neg", Repeat(_views, Op("Reshape", "x", ANY, name="first"), name="views")), _noop)
    match = _bind(rule, m, nodes["y"])
    assert match.node("first") is nodes["a"] and match.chain("views") == (nodes["b"],)
    assert match["x"] is nodes["a"].inputs[0]
    # zero steps: the end at once, an empty chain
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
    rule = Rule("zero", Op("Neg", Repeat(_views, Op("Relu", "x"), name="views")), _noop)
    assert _bind(rule, m, nodes["y"]).chain("views") == ()


def test_a_chain_the_pattern_does_not_name_is_a_bug_in_the_rule():
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
    rule = Rule("zero", Op("Neg", Repeat(_views, Op("Relu", "x"), name="views")), _noop)
    with pytest.raises(RuleError, match="chain 'other'"):
        _bind(rule, m, nodes["y"]).chain("other")


# -- Op's uses, bind and check; Const's check ---------------------------------------------------------


def test_uses_counts_and_predicates():
    # Where(IsNaN(p), 0, p) with p = Softmax(x): p has two readers
    m, nodes = _graph([_node("Softmax", ["x"], "p"), _node("IsNaN", ["p"], "nan"),
                       _node("Where", ["nan", "zero", "p"], "y")], [init("zero", np.array(0.0, np.float32))])
    guard = Op("Where", Op("IsNaN", Op("Softmax", "x", uses=2, bind="probs", name="sm")),
               Const("zero", check=lambda v: float(v.const_value.numpy()) == 0.0), Var("probs"))
    match = _bind(Rule("guard", guard, _noop), m, nodes["y"])
    assert not isinstance(match, str), match
    assert match["probs"] is nodes["p"].outputs[0] and match.node("sm") is nodes["p"]
    # one use by default: p has two
    plain = Op("Where", Op("IsNaN", Op("Softmax", "x")), "zero", "p")
    assert "has 2 uses" in _bind(Rule("one", plain, _noop), m, nodes["y"])
    # bind= and a Var of the same name must be one value
    other = Op("Where", Op("IsNaN", Op("Softmax", "x", uses=2, bind="probs")), "probs", ANY)
    assert "bound to two different values" in _bind(Rule("two", other, _noop), m, nodes["y"])
    # a predicate on the readers
    counted = Op("Where", Op("IsNaN", Op("Softmax", "x", uses=lambda v: len(v.uses()) < 2)), "zero", "p")
    assert "readers that do not fit" in _bind(Rule("pred", counted, _noop), m, nodes["y"])
    # Const's check refuses
    one = Op("Where", ANY, Const("zero", check=lambda v: float(v.const_value.numpy()) == 1.0), ANY)
    assert "'zero': check failed" in _bind(Rule("const", one, _noop), m, nodes["y"])
    with pytest.raises(TypeError):
        Op("Relu", "x", uses=0)


def test_op_check_sees_the_node_and_the_opsets():
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
    seen = []

    def check(node, opsets):
        seen.append((node.name, opsets[""]))
        return False

    assert "r: check failed" in _bind(Rule("check", Op("Neg", Op("Relu", "x", check=check)), _noop), m, nodes["y"])
    assert seen == [("r", 17)]


# -- Explain ---------------------------------------------------------------------------------------


def test_explain_gives_its_reason_for_the_piece_that_is_missing():
    m, nodes = _graph([_node("Abs", ["x"], "a"), _node("Neg", ["a"], "y")])
    rule = Rule("why", Op("Neg", Explain(Op("Relu", "x"), "no activation before the negation")), _noop)
    assert _bind(rule, m, nodes["y"]) == "y input 0: no activation before the negation"
    # deep=False: only where the piece's first node is not there; found, a failure inside keeps its reason
    m, nodes = _graph([_node("Abs", ["x"], "a"), _node("Relu", ["a"], "r"), _node("Neg", ["r"], "y")])
    missing = Explain(Op("Sigmoid", Op("Exp", "x")), "no Sigmoid", deep=False)
    assert _bind(Rule("missing", Op("Neg", missing), _noop), m, nodes["y"]) == "y input 0: no Sigmoid"
    inside = Explain(Op("Relu", Op("Exp", "x")), "no Relu", deep=False)
    assert "expected Exp, found Abs" in _bind(Rule("inside", Op("Neg", inside), _noop), m, nodes["y"])
    deep = Explain(Op("Relu", Op("Exp", "x")), "no Relu over Exp")
    assert _bind(Rule("deep", Op("Neg", deep), _noop), m, nodes["y"]) == "y input 0: no Relu over Exp"


# -- Absorbed: what the driver records -----------------------------------------------------------------


def test_absorbed_nodes_are_looked_through_not_claimed():
    """Neg(Transpose(Relu(a))) -> Sigmoid(a) with the Transpose and Relu absorbed: the rewrite
    replaces its end (Neg) in the provenance's onnxopt.replaced and the cycle key; what lay between
    goes with it and is named in onnxopt.sources."""
    proto = model([_node("Abs", ["x"], "a"), _node("Relu", ["a"], "r"), _node("Transpose", ["r"], "t", perm=[0, 1, 2]),
                   _node("Neg", ["t"], "y")], [tinfo("x", [2, 3, 4])], [tinfo("y", None)])
    m = ir.from_proto(proto)

    def replace(match, b):
        assert [n.name for n in match.nodes] == ["y"]
        assert [n.name for n in match.absorbed] == ["t", "r"]
        assert match.node("relu").name == "r"  # (named nodes inside are bound as anywhere)
        return b.op("Sigmoid", match["a"])

    rule = Rule("ends", Op("Neg", Absorbed(Op("Transpose", Op("Relu", "a", name="relu")))), replace)
    result = Driver(m, [rule]).run()
    assert result.rewrites == 1
    assert [n.op_type for n in m.graph] == ["Abs", "Sigmoid"]
    node = list(m.graph)[1]
    assert json.loads(node.metadata_props[REPLACED_KEY]) == ["y"]
    assert json.loads(node.metadata_props[SOURCES_KEY]) == ["y", "t", "r"]
