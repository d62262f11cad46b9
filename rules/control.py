"""Control flow whose condition is known: the branch that runs takes the If's place.

``If`` on a constant condition (exporters emit them for options fixed at export time, and the
ONNX function expansions of AffineGrid, CenterCropPad and others are full of them) is replaced by
the nodes of the branch that runs, moved into the enclosing graph; the other branch disappears.
Then the usual rules meet those nodes (constant folding, shape folding, ...).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxopt.ir.util import inherit_metadata
from onnxopt.core.pattern import Const, Match, Op, Refuse, Rule


def _branch(m: Match) -> ir.Graph | None:
    """The branch that runs, when the condition is one constant and the branch is there."""
    cond = m.const("cond")
    if cond.size != 1:
        return None
    attr = m.node("if").attributes.get("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch")
    if attr is None or attr.is_ref():
        return None
    return attr.as_graph()


def if_constant_condition_condition(m: Match):
    """The plan: the branch that runs."""
    graph = _branch(m)
    if graph is None:
        return "the condition is not a single constant, or the branch is missing"
    if graph.inputs:
        return "the branch declares inputs"
    if len(graph.outputs) != len(m.root.outputs):
        return "the branch has a different number of outputs"
    for node in graph:
        for attr in node.attributes.values():
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                return "the branch holds nested control flow"
            if attr.is_ref():
                return "the branch refers to a function attribute"
    return graph


def if_constant_condition_replacement(m: Match, b):
    graph = m.plan
    mapping: dict[ir.Value, ir.Value] = {}
    for name, value in graph.initializers.items():
        if value.const_value is None:
            raise Refuse(f"branch initializer {name!r} has no value")
        mapping[value] = b.const(value.const_value, name=name)
    for node in graph:
        inputs = [None if v is None else mapping.get(v, v) for v in node.inputs]
        outs = b.op(node.op_type, *inputs, domain=node.domain, outputs=len(node.outputs),
                    attrs=node.attributes.values(), overload=node.overload)
        outs = (outs,) if len(node.outputs) == 1 else outs
        inherit_metadata(outs[0].producer(), [node])  # its own (e.g. its stack trace) before the If's
        for old, new in zip(node.outputs, outs):
            new.type, new.shape = old.type, old.shape
            mapping[old] = new
    results = []
    for out in graph.outputs:
        new = mapping.get(out, out)
        if new.graph is graph:
            raise Refuse("a branch output is a branch input")
        results.append(new)
    return results


RULES = [
    Rule("if_constant_condition", Op("If", Const("cond"), name="if"), if_constant_condition_replacement,
         condition=if_constant_condition_condition,
         priority=50,
         exact=True, doc="If on a constant condition is the branch that runs, inlined into the enclosing graph."),
]
