"""Sequences that are only a way of splitting: SequenceAt of SplitToSequence is a Split output.

Exact: output i of a Split with the same pieces is the tensor SequenceAt picks.
"""

from __future__ import annotations

import numpy as np

from onnxopt.core.pattern import Const, Match, Op, Opt, Rule
from onnxopt.rules._semantic import squeeze


def _pieces(m: Match) -> list[int] | None:
    """The piece sizes SplitToSequence cuts, when known; None otherwise."""
    axis = int(m.attr("to_sequence", "axis", 0))
    dims = m.dims("x")
    d = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
    split = m.const("split")
    if split is None:
        return None if d is None else [1] * d
    if split.dtype.kind not in "iu":
        return None
    if split.ndim == 1:
        return [int(s) for s in split]
    if d is None or int(split) <= 0:
        return None
    s = int(split)
    return [s] * (d // s) + ([d % s] if d % s else [])


def sequence_at_split_condition(m: Match):
    """The plan: the pieces' sizes."""
    sizes = _pieces(m)
    if not sizes:
        return "the pieces are not known"
    i = m.const("i")
    if i.size != 1 or not -len(sizes) <= int(i.reshape(-1)[0]) < len(sizes):
        return "index out of range"
    if "split" in m and m.const("split").ndim == 0 and int(m.attr("to_sequence", "keepdims", 1)) == 0:
        # the spec ignores keepdims when split is given; onnxruntime squeezes for a scalar split
        return "scalar split with keepdims=0 (onnxruntime and the spec disagree)"
    if m.opset("") < 11:
        return "opset"
    return sizes


def sequence_at_split_replacement(m: Match, b):
    sizes = m.plan
    axis = int(m.attr("to_sequence", "axis", 0))
    i = int(m.const("i").reshape(-1)[0]) % len(sizes)
    if m.opset("") >= 13:
        outs = b.op("Split", m["x"], b.const(np.array(sizes, dtype=np.int64), name="split"), axis=axis,
                    outputs=len(sizes))
    else:
        outs = b.op("Split", m["x"], axis=axis, split=sizes, outputs=len(sizes))
    out = outs if len(sizes) == 1 else outs[i]
    if "split" not in m and int(m.attr("to_sequence", "keepdims", 1)) == 0:
        out = squeeze(m, b, out, [axis])
    return out


RULES = [
    Rule("sequence_at_split", Op("SequenceAt", Op("SplitToSequence", "x", Opt(Const("split")), name="to_sequence",
                                                  shared=True), Const("i")),
         sequence_at_split_replacement, condition=sequence_at_split_condition,
         exact=True, doc="SequenceAt(SplitToSequence(x), i) with known pieces is output i of a Split "
             "(identical Splits then merge: one Split instead of a sequence)."),
]
