"""No-op removal: nodes that pass their input through unchanged at inference time."""

from __future__ import annotations

from onnxopt.core.pattern import Match, Op, Opt, Rule, forward
from onnxopt.core.purity import dropout_training


_forward_x = forward("x")


def dropout_elimination_condition(m: Match):
    node = m.root
    reason = dropout_training(node, m.opset(""))
    if reason is not None:
        return reason
    if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
        return "the mask output is used"
    return None


RULES = [
    Rule("identity_elimination", Op("Identity", "x"), _forward_x,
         exact=True, doc="Identity(x) is x."),
    Rule("dropout_elimination",
         Op("Dropout", "x", Opt("ratio"), Opt("training_mode"), name="drop"), _forward_x,
         condition=dropout_elimination_condition,
         exact=True, doc="Dropout at inference (no training_mode, mask unused) is x."),
]
