"""rules/control.py: If on a constant condition is the branch that runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_same_outputs
from helpers import feeds_for, init, model, op_types, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize

from .check import fires, refuses


def _branch(name, op, const):
    return helper.make_graph([helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"])], name, [],
                             [tinfo(f"{name}_y", [3])], [init(f"{name}_c", np.float32(const))])


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_constant_condition_is_inlined(cond):
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=_branch("then", "Add", 1.0),
                              else_branch=_branch("else", "Mul", 3.0))]
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("cond", np.array(cond))])
    out, report = optimize(m, return_report=True)
    assert op_types(out) == (["Add"] if cond else ["Mul"])
    assert report.fired["if_constant_condition"] == 1
    assert [o.name for o in out.graph.output] == ["y"]
    assert_same_outputs(m, out, feeds_for(m))
    out, _ = fires("if_constant_condition", m)
    assert op_types(out) == (["Add"] if cond else ["Mul"])


def test_an_inlined_node_keeps_its_own_metadata_before_the_ifs():
    then = _branch("then", "Add", 1.0)
    onnx.helper.set_metadata_props(then.node[0], {"pkg.torch.onnx.stack_trace": "branch", "only": "branch"})
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=_branch("else", "Mul", 3.0))]
    onnx.helper.set_metadata_props(nodes[0], {"pkg.torch.onnx.stack_trace": "if", "from_if": "if"})
    m = model(nodes, [tinfo("x", [3])], [tinfo("y", [3])], [init("cond", np.array(True))])
    (node,) = fires("if_constant_condition", m)[0].graph.node
    props = {p.key: p.value for p in node.metadata_props}
    assert {k: props[k] for k in ("pkg.torch.onnx.stack_trace", "only", "from_if")} == {
        "pkg.torch.onnx.stack_trace": "branch", "only": "branch", "from_if": "if"}


def test_if_on_input_condition_is_kept():
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=_branch("then", "Add", 1.0),
                              else_branch=_branch("else", "Mul", 3.0))]
    m = model(nodes, [tinfo("x", [3]), tinfo("cond", [], TensorProto.BOOL)], [tinfo("y", [3])])
    assert op_types(optimize(m)) == ["If"]


def test_if_on_constant_condition_refuses_a_branch_with_nested_control_flow():
    inner = helper.make_node("If", ["c2"], ["then_y"], then_branch=_branch("t2", "Add", 1.0),
                             else_branch=_branch("e2", "Mul", 3.0))
    then = helper.make_graph([inner], "then", [], [tinfo("then_y", [3])])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=_branch("else", "Mul", 3.0))]
    m = model(nodes, [tinfo("x", [3]), tinfo("c2", [], TensorProto.BOOL)], [tinfo("y", [3])],
              [init("cond", np.array(True))])
    refuses("if_constant_condition", m, "the branch holds nested control flow")


def test_inlined_branch_keeps_a_local_function_overload():
    f_nodes = [helper.make_node("Neg", ["a"], ["b"])]
    fa = onnx.helper.make_function("local", "F", ["a"], ["b"], f_nodes, [helper.make_opsetid("", 17)], overload="a")
    fb = onnx.helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                                   [helper.make_opsetid("", 17)], overload="b")
    call = helper.make_node("F", ["x"], ["t_y"], domain="local")
    call.overload = "b"
    then = helper.make_graph([call], "then", [], [tinfo("t_y", [3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e_y"])], "else", [], [tinfo("e_y", [3])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                          [tinfo("x", [3])], [tinfo("y", [3])], [init("c", np.array(True))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          ir_version=10, functions=[fa, fb])
    out = optimize(m)
    assert [(n.op_type, n.overload) for n in out.graph.node] == [("F", "b")]
    assert_same_outputs(m, out, {"x": np.array([-1.0, 0.5, 2.0], np.float32)})
