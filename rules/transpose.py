"""Transposes: pairs merged or cancelled, the identity removed, and those that move only size-1
dimensions turned into a Reshape (a view: no element moves).

Pushing Transposes through the ops that do not care about layout is a whole-graph decision (a
chain of pushes may pay only at its end): the pass ``transpose_optimization``
(``onnxopt.transforms.transposes``) makes it, by a cost in elements moved. A Transpose of a constant is
folded by constant folding (rules/folding.py). All rules here are exact: they move no value.
"""

from __future__ import annotations

import numpy as np

from onnxopt.ir.util import constant_tensor
from onnxopt.core.passes import SETTLED
from onnxopt.ir.util import moves_data, perm_of
from onnxopt.core.pattern import Match, Op, Refuse, Rule, forward

from onnxopt.rules._exact import exact_removal
from onnxopt.rules._semantic import unsqueeze

_x = forward("x")


def transpose_pair_replacement(m: Match, b):
    dims = m.dims("x")
    first = perm_of(m.node("inner"), None if dims is None else len(dims))
    if first is None:
        raise Refuse("rank unknown")
    second = perm_of(m.node("outer"), len(first))
    if len(first) != len(second):
        raise Refuse("ranks differ")
    perm = [first[i] for i in second]
    if perm == list(range(len(perm))):
        return m["x"]
    inner = m.node("inner").outputs[0]
    if inner.is_graph_output() or len(inner.uses()) > 1:
        raise Refuse("the inner Transpose has other readers and the pair does not cancel")
    return b.op("Transpose", m["x"], perm=perm)


def transpose_elimination_condition(m: Match):
    perm = m.attr("transpose", "perm")
    if perm is None or [int(p) for p in perm] != list(range(len(perm))):
        return "not the identity permutation"
    return None


def transpose_to_reshape_condition(m: Match):
    """The plan: the Reshape's target (0 copies a dimension left in place, one -1 stands for one
    moved dimension that is not a number)."""
    dims = m.dims("x")
    if dims is None:
        return "rank unknown"
    perm = perm_of(m.node("transpose"), len(dims))
    if len(perm) != len(dims) or sorted(perm) != list(range(len(dims))):
        return "not a permutation of x's axes"
    if perm == list(range(len(perm))):
        return "the identity permutation (transpose_elimination)"
    if moves_data([d if d is not None else "s" for d in dims], perm):
        return "moves a dimension that is not size 1"
    if 0 in dims:
        return "a dimension of size 0"
    if "transpose_optimization" in m.options.get("graph_passes", ()) and not m.options.get(SETTLED):
        # the transpose pass cancels size-1 Transposes it pushes into others, and onnxruntime carries
        # its NCHWc layout through Transposes, not through a Reshape: they stay Transposes until the
        # pass is done (the pipeline's last round converts those left)
        return "waits for the transpose pass"
    target = []
    for j, p in enumerate(perm):
        d = dims[p]
        if d is not None:
            target.append(d)
        elif p == j:
            target.append(0)
        else:
            target.append(-1)
    if target.count(-1) > 1:
        return "more than one moved dimension is not a number"
    return target


def _unsqueezed(m: Match) -> tuple | None:
    """``(u, axes)`` where x is ``Unsqueeze(u)`` (constant axes) and the Transpose, which moves only
    size-1 dimensions, keeps u's dimensions in order: the Transpose is ``Unsqueeze(u, axes)``."""
    node = m["x"].producer()
    if node is None or node.op_type != "Unsqueeze" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.inputs) > 1:
        tensor = constant_tensor(node.inputs[1])
        axes = None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]
    else:
        attr = node.attributes.get("axes")
        axes = None if attr is None else [int(a) for a in attr.value]
    dims = m.dims("x")
    if axes is None or dims is None:
        return None
    q = len(dims)
    axes = {a % q for a in axes}
    perm = perm_of(m.node("transpose"), q)
    where = [perm.index(k) for k in range(q) if k not in axes]  # u's dimensions in the output
    if where != sorted(where):
        return None
    return node.inputs[0], [j for j in range(q) if j not in where]


def transpose_to_reshape_replacement(m: Match, b):
    unsq = _unsqueezed(m)
    if unsq is not None:  # (an Unsqueeze keeps the dimensions' symbols; a Reshape's -1 does not)
        return unsqueeze(m, b, *unsq)
    return b.op("Reshape", m["x"], b.const(np.array(m.plan, dtype=np.int64), name="shape"))


RULES = [
    Rule("transpose_pair", Op("Transpose", Op("Transpose", "x", name="inner", shared=True), name="outer"),
         transpose_pair_replacement, exact=True,
         doc="Two Transposes are one, or none when they cancel (then also where the inner one has other readers)."),
    Rule("transpose_elimination", Op("Transpose", "x", name="transpose"), _x,
         condition=exact_removal(transpose_elimination_condition, "identity Transpose"), exact=True, doc="Transpose by the identity permutation is x."),
    Rule("transpose_to_reshape", Op("Transpose", "x", name="transpose"), transpose_to_reshape_replacement,
         condition=transpose_to_reshape_condition, exact=True,
         doc="A Transpose that moves only size-1 dimensions (the others keep their order) is a Reshape "
             "(an Unsqueeze where it reads one)."),
]
