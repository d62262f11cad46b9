"""No-op removal: nodes that pass their input through unchanged at inference time."""

from __future__ import annotations

from onnxopt.pattern import Const, Match, Op, Opt, Rule, constant_tensor, forward


_forward_x = forward("x")


def _dropout_is_inference(m: Match):
    node = m.root
    opset = m.opset("")
    if opset < 7:
        if m.attr("drop", "is_test", 0) != 1:
            return "Dropout before opset 7 without is_test=1 is in training mode"
    elif opset >= 12 and m["training_mode"] is not None:
        tensor = constant_tensor(m["training_mode"])
        if tensor is None:
            return "training_mode is not a constant"
        if bool(tensor.numpy().reshape(-1)[0]):
            return "training_mode is true"
    if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
        return "the mask output is used"
    return None


RULES = [
    Rule("identity_elimination", Op("Identity", "x"), _forward_x,
         doc="Identity(x) is x."),
    Rule("dropout_elimination",
         Op("Dropout", "x", Opt("ratio"), Opt("training_mode"), name="drop"), _forward_x,
         condition=_dropout_is_inference,
         doc="Dropout at inference (no training_mode, mask unused) is x."),
]
