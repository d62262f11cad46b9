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
from onnxopt.core.pattern import ANY, Absorbed, All, Around, Const, Explain, Not, Op, Opt, Or, Repeat, Rule, Var
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


# -- Not and All -----------------------------------------------------------------------------------


def test_not_matches_where_its_pattern_does_not_and_binds_nothing():
    # Neg(Sub(x, ReduceMean(x))) and Neg(Sub(x, Relu(x))): "not x minus its own mean"
    centred = Op("Sub", Var("v"), Op("ReduceMean", Var("v"), name="mean"), name="sub")
    rule = Rule("not", Op("Neg", All(Var("d"), Not(centred, "a mean is subtracted"))), _noop)
    m, nodes = _graph([_node("ReduceMean", ["x"], "mu"), _node("Sub", ["x", "mu"], "d"), _node("Neg", ["d"], "y")])
    assert _bind(rule, m, nodes["y"]) == "y input 0: a mean is subtracted"
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Sub", ["x", "r"], "d"), _node("Neg", ["d"], "y")])
    match = _bind(rule, m, nodes["y"])
    assert not isinstance(match, str), match
    # what the pattern inside bound while trying is dropped: its nodes are no part of the match, its names unknown
    assert match["d"] is nodes["d"].outputs[0] and match.nodes == (nodes["y"],)
    assert "v" not in rule.value_names and "sub" not in rule.node_names
    with pytest.raises(RuleError):
        match["v"]
    # an absent input is not of any form
    absent = Rule("absent", Op("Clip", "x", Not(Const("lo"), "a lower bound is given"), Opt("hi")), _noop)
    m, nodes = _graph([helper.make_node("Clip", ["x", "", "hi"], ["y"], name="y")],
                      [init("hi", np.array(6.0, np.float32))])
    assert not isinstance(_bind(absent, m, nodes["y"]), str)


def test_not_sees_the_names_bound_before_it():
    # Sub(x, Relu(x)) is "x minus a Relu of x" only where the Relu reads the x bound outside
    rule = Rule("outer", Op("Sub", "x", Not(Op("Relu", "x"), "x minus its Relu"), name="sub"), _noop)
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Sub", ["x", "r"], "y")])
    assert _bind(rule, m, nodes["y"]) == "y input 1: x minus its Relu"
    m, nodes = _graph([_node("Relu", ["z"], "r"), _node("Sub", ["x", "r"], "y")], inputs=(("x", [2]), ("z", [2])))
    assert not isinstance(_bind(rule, m, nodes["y"]), str)


def test_all_binds_what_each_pattern_binds_and_fails_with_the_first_failure():
    m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
    rule = Rule("all", Op("Neg", All(Var("v"), Op("Relu", "x", name="relu"))), _noop)
    match = _bind(rule, m, nodes["y"])
    assert match["v"] is nodes["r"].outputs[0] and match.node("relu") is nodes["r"] and match["x"] is not None
    failing = Rule("fail", Op("Neg", All(Op("Sigmoid", "x"), Op("Relu", "x"))), _noop)
    assert "expected Sigmoid, found Relu" in _bind(failing, m, nodes["y"])
    with pytest.raises(TypeError):
        All(Var("x"))


# -- Around: a pattern rooted at its output, tried at an inner node ---------------------------------


def _outward_graph(scale=True, shared=False):
    """y = [Mul(] Div(Sub(x, mu), Sqrt(Exp(x))) [, w)]; with ``shared`` the Div's output is read twice."""
    nodes = [_node("ReduceMean", ["x"], "mu"), _node("Sub", ["x", "mu"], "d"), _node("Exp", ["x"], "e"),
             _node("Sqrt", ["e"], "s"), _node("Div", ["d", "s"], "q")]
    if shared:
        nodes += [_node("Mul", ["q", "w"], "sc"), _node("Add", ["sc", "q"], "y")]
    else:
        nodes += [_node("Mul", ["q", "w"], "y")] if scale else [_node("Neg", ["q"], "y")]
    return _graph(nodes, [init("w", np.full(4, 2.0, np.float32))])


_QUOTIENT = Op("Div", Op("Sub", "x", Op("ReduceMean", "x", name="mu"), name="sub"),
               Op("Sqrt", Op("Exp", "x", name="exp"), name="root"), name="div")
_AROUND = Around("root", Or(Op("Mul", _QUOTIENT, Const("w"), commutative=True, name="scale"), _QUOTIENT))


def test_around_is_tried_at_its_anchor_and_matches_at_the_farthest_root():
    m, nodes = _outward_graph()
    rule = Rule("around", _AROUND, _noop)
    assert rule.pattern.key == ("", "Sqrt") and rule.pattern.op_type == "Sqrt"  # (the driver's index, the listing)
    match = _bind(rule, m, nodes["s"])
    assert not isinstance(match, str), match
    assert match.root is nodes["s"] and match.outputs == [nodes["y"].outputs[0]]
    # inside out: the anchor and what it reads, then each node further out and its other inputs
    assert [n.name for n in match.nodes] == ["s", "e", "q", "d", "mu", "y"]
    assert match.node("scale") is nodes["y"] and match.const("w") is not None
    # where the scale is not the Div's only reader, the root is the Div, and the scale unbound
    m, nodes = _outward_graph(shared=True)
    match = _bind(rule, m, nodes["s"])
    assert match.outputs == [nodes["q"].outputs[0]] and match.node("scale") is None
    assert [n.name for n in match.nodes] == ["s", "e", "q", "d", "mu"]


def test_around_binds_its_anchor_to_the_node_it_is_tried_at():
    # y = Sqrt(a) + Sqrt(b): the pattern names the first operand's Sqrt the anchor
    m, nodes = _graph([_node("Sqrt", ["x"], "s1"), _node("Sqrt", ["z"], "s2"), _node("Add", ["s1", "s2"], "y")],
                      inputs=(("x", [2]), ("z", [2])))
    rule = Rule("first", Around("a", Op("Add", Op("Sqrt", "u", name="a"), Op("Sqrt", "v", name="b"))), _noop)
    match = _bind(rule, m, nodes["s1"])
    assert not isinstance(match, str) and match.node("b") is nodes["s2"] and match.root is nodes["s1"]
    assert "s1 is not the a the rule is tried at" in _bind(rule, m, nodes["s2"])
    # an alternative that does not reach the anchor is no match
    loose = Rule("loose", Around("a", Or(Op("Neg", Op("Sqrt", "x", name="a")), Op("Add", "p", "q"))), _noop)
    assert "the pattern does not reach s1" in _bind(loose, m, nodes["s1"])
    # where the anchor itself does not match, that is the reason, found before any root is tried
    exp = Rule("exp", Around("a", Op("Add", Op("Sqrt", Op("Exp", "u"), name="a"), "v")), _noop)
    assert _bind(exp, m, nodes["s1"]) == "s1 input 0: 'x' is not produced by Exp"


def test_around_refuses_with_the_reason_nearest_its_anchor():
    # the Sqrt reads a Relu, not an Exp: the reason is the anchor's input, found before the Div's numerator
    m, nodes = _graph([_node("Relu", ["x"], "e"), _node("Sqrt", ["e"], "s"), _node("Div", ["x", "s"], "y")])
    reason = _bind(Rule("around", _AROUND, _noop), m, nodes["s"])
    assert isinstance(reason, str) and "expected Exp, found Relu" in reason
    # an anchor read twice where its Op takes one reader: that, once, whatever the roots above it
    m, nodes = _graph([_node("Exp", ["x"], "e"), _node("Sqrt", ["e"], "s"), _node("Div", ["x", "s"], "q"),
                       _node("Add", ["q", "s"], "y")])
    assert _bind(Rule("around", _AROUND, _noop), m, nodes["s"]) == "s: 's' (Sqrt) has 2 uses"


def test_around_is_checked_when_built():
    with pytest.raises(TypeError, match="no Op named 'r'"):
        Around("r", Op("Neg", Op("Sqrt", "x", name="a")))
    with pytest.raises(TypeError, match="several types"):
        Around("a", Or(Op("Neg", Op("Sqrt", "x", name="a")), Op("Neg", Op("Exp", "x", name="a"))))
    with pytest.raises(TypeError, match="root must be an Op"):
        Around("a", Var("x"))
    with pytest.raises(TypeError, match="a rule's pattern"):  # (only a rule's root: nested, it is a bug)
        m, nodes = _graph([_node("Relu", ["x"], "r"), _node("Neg", ["r"], "y")])
        _bind(Rule("nested", Op("Neg", Around("a", Op("Relu", "x", name="a"))), _noop), m, nodes["y"])


def test_around_rewrite_is_named_after_its_anchor_and_replaces_its_root():
    """The driver, given an Around rule: the new node is named after the anchor and placed where
    it was, the root's output (a graph output) keeps its name, the provenance lists the nodes
    inside out, and everything matched goes."""
    m, nodes = _outward_graph()

    def replace(match, b):
        return b.op("Mul", b.op("LpNormalization", match["x"]), match["w"])

    result = Driver(m, [Rule("around", _AROUND, replace)]).run()
    assert result.rewrites == 1
    assert [(n.op_type, n.name) for n in m.graph] == [("LpNormalization", "s::around"), ("Mul", "s::around_1")]
    assert m.graph.outputs[0].name == "y" and m.graph.outputs[0].producer().op_type == "Mul"
    assert json.loads(list(m.graph)[0].metadata_props[REPLACED_KEY]) == ["s", "e", "q", "d", "mu", "y"]
