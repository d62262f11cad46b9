"""The pieces of scaled dot-product attention as patterns, for the attention fusions.

    out = head_merge(softmax(masked_scores(scaled_dot_product(heads(Q), heads(K)))) @ heads(V))

Each piece is a function that returns a pattern (onnxopt.core.pattern), so an encoder fusion
(rules/attention.py) and a decoder's (a KV cache concatenated into K and V) put the same pieces
together; the names a piece binds are listed with it, prefixed where a piece is used more than once
(``heads("q")`` binds ``xq``, ``q_split``, ``q_views``). The pieces say what the graph is made of;
what the layout of each view means (which dimension is a head), the scales' product, the mask's
shape and the types are facts a rule's condition reads from what they bind.

- ``heads(p, what)``: a projection ``x<p>`` ([B, S, H]) split into heads by a rank 3 -> 4 Reshape
  (``<p>_split``), then any Reshape/Transpose views and Mul/Div by scalar constants
  (``<p>_views``, data order) up to the MatMul that reads it; the split is the first such Reshape
  on the way (the dynamo exporter's key goes 4-D -> 3-D -> 4-D again). Missing: "<what> is not a
  reshape of a projection into heads".
- ``scaled_dot_product(q, k)``: ``MatMul(q, k)`` (``qk``), the scores.
- ``masked_scores(qk)``: the scores scaled (``qk_scales``), an additive mask added (``mask_add``,
  the mask ``mask``; either operand order) or none, scaled again (``scores_scales``: a rule refuses
  scales after the mask, where their product is not 1).
- ``softmax(scores)``: ``Softmax`` (``softmax``; its output ``probs``), or torch's NaN guard around
  it, ``Where(IsNaN(p), 0, p)`` (``guard``).
- ``attention_output(probs, v)``: ``MatMul(probs, v)`` (``pv``).
- ``head_merge(attn)``: the root: ``Reshape(Transpose(...))`` (``out``, ``tr``; the target
  ``shape``) after any further Reshape/Transpose views of ``attn`` (``merge_views``). Everything
  under the Transpose is absorbed: the rewrite replaces the ends (``out``, ``tr``) and what lies
  between goes with them.

Every value inside is read by the next piece alone (``one_reader``: readers that are Shape nodes do
not count, they die with it), except the NaN guard's Softmax output, read by the guard's IsNaN and
Where.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnxopt.core.pattern import ANY, Absorbed, Const, Explain, Op, Or, Pattern, Repeat, Var
from onnxopt.ir.shapes import infer, infer_outputs, shape_elements
from onnxopt.ir.util import constant_tensor

MS = "com.microsoft"
MAX_VIEWS = 8  # Reshape/Transpose/scale nodes followed on one path
_MAX_LOOKUP = 4096  # values one shape question may look at (see dims_of)

# contrib ops whose first output has their first input's shape (onnx's inference knows none of them)
SAME_SHAPE = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                        "LayerNormalization", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd"})


# --------------------------------------------------------------------------------------------
# Facts the patterns' checks read


def dims_of(value: ir.Value, opsets, seen: set | None = None) -> list | None:
    """value's dimensions (inferred), looking through the contrib ops other fusions make (onnx's
    inference knows none of them, nor then anything after one: a layer's projections read a
    SkipLayerNormalization). What is found that way is recorded on the values as inference records
    its findings (the pipeline drops inferred shapes at the end), so that shape_elements can read
    Shape nodes of them."""
    shape = infer(value, opsets)
    if shape is not None:
        return list(shape)
    seen = set() if seen is None else seen
    if value in seen or len(seen) > _MAX_LOOKUP:
        return None
    seen.add(value)
    node = value.producer()
    if node is None:
        return None
    if node.domain == MS and node.op_type in SAME_SHAPE and value is node.outputs[0]:
        found = dims_of(node.inputs[0], opsets, seen)
        if found is not None:
            value.shape = ir.Shape(found)
            if value.type is None:
                value.type = node.inputs[0].type
        return found
    if node.domain not in ("", "ai.onnx") or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return None
    # a standard node: its inputs first, then onnx's inference for it once more
    for v in node.inputs:
        if v is None or v.name is None:
            continue
        if constant_tensor(v) is None and v.shape is None and dims_of(v, opsets, seen) is None:
            return None
    infer_outputs(node, opsets)
    return None if value.shape is None else list(value.shape)


def prime_shapes(value: ir.Value | None, opsets, depth: int = 0) -> None:
    """Infer the shapes the Shape nodes feeding a shape vector read (shape_elements needs ranks)."""
    if value is None or depth > 8:
        return
    node = value.producer()
    if node is None:
        return
    if node.op_type == "Shape" and node.inputs[0] is not None:
        dims_of(node.inputs[0], opsets)
        return
    for v in node.inputs:
        prime_shapes(v, opsets, depth + 1)


def float_scalar(value: ir.Value | None) -> float | None:
    """The number a one-element float constant of rank 0 or 1 holds, else None (a [1,1,1,1] factor
    could raise the rank)."""
    t = constant_tensor(value)
    if t is None:
        return None
    a = t.numpy()
    if a.size != 1 or a.ndim > 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(-1)[0])


def is_scale(value: ir.Value) -> bool:
    """value is a float scalar constant a Mul or Div can scale by: nonzero and finite."""
    f = float_scalar(value)
    return f is not None and f != 0 and math.isfinite(f)


def is_zero(value: ir.Value) -> bool:
    return float_scalar(value) == 0.0


def one_reader(value: ir.Value) -> bool:
    """value is read once by the chain (readers that are Shape nodes do not count: they die with it)."""
    if value.is_graph_output():
        return False
    others = [n for n, _ in value.uses() if n.op_type != "Shape"]
    return len(others) <= 1


def is_head_split(node: ir.Node, opsets) -> bool:
    """node (a Reshape) reshapes a rank-3 tensor into a rank-4 one."""
    found = dims_of(node.inputs[0], opsets)
    if found is None or len(found) != 3 or len(node.inputs) < 2:
        return False
    target = node.inputs[1]
    prime_shapes(target, opsets)
    elements = shape_elements(target)
    if elements is not None:
        return len(elements) == 4
    shape = infer(target, opsets)
    return shape is not None and len(shape) == 1 and shape[0] == 4


# --------------------------------------------------------------------------------------------
# One node of a chain: each takes the pattern of what comes before it (see Repeat)


def scale_step(rest: Pattern) -> Pattern:
    """A Mul (either operand order) or Div by a scalar constant."""
    return Or(Op("Mul", rest, Const(check=is_scale), commutative=True, uses=one_reader),
              Op("Div", rest, Const(check=is_scale), uses=one_reader))


def layout_step(rest: Pattern) -> Pattern:
    """A Reshape or a Transpose: a view of the same elements."""
    return Or(Op("Reshape", rest, ANY, uses=one_reader), Op("Transpose", rest, uses=one_reader))


def view_step(rest: Pattern) -> Pattern:
    """A view or a scale: what lies between a head split and the MatMul that reads the heads."""
    return Or(Op("Reshape", rest, ANY, uses=one_reader), Op("Transpose", rest, uses=one_reader),
              Op("Mul", rest, Const(check=is_scale), commutative=True, uses=one_reader),
              Op("Div", rest, Const(check=is_scale), uses=one_reader))


# --------------------------------------------------------------------------------------------
# The pieces


def head_split(p: str) -> Pattern:
    """A rank 3 -> 4 Reshape of the projection ``x<p>`` (``<p>_split``)."""
    return Op("Reshape", Var(f"x{p}"), ANY, name=f"{p}_split", uses=one_reader, check=is_head_split)


def heads(p: str, what: str) -> Pattern:
    """A projection's heads as a MatMul reads them (see the module docstring)."""
    return Explain(Repeat(view_step, head_split(p), max=MAX_VIEWS - 1, name=f"{p}_views"),
                   f"{what} is not a reshape of a projection into heads")


def scaled_dot_product(q: Pattern, k: Pattern) -> Pattern:
    return Explain(Op("MatMul", q, k, name="qk", uses=one_reader), "the scores are not a MatMul", deep=False)


def additive_mask(scores: Pattern) -> Pattern:
    """scores + mask, in either order (the mask: ``mask``)."""
    return Op("Add", scores, Var("mask"), commutative=True, name="mask_add", uses=one_reader)


def masked_scores(qk: Pattern) -> Pattern:
    """The scores, scaled, with an additive mask or none, scaled again (see the module docstring)."""
    return Repeat(scale_step, Or(additive_mask(Repeat(scale_step, qk, max=2, name="qk_scales")), qk),
                  max=3, name="scores_scales")


def softmax(scores: Pattern) -> Pattern:
    """Softmax(scores), or torch's NaN guard around it: Where(IsNaN(p), 0, p)."""
    return Explain(Or(Op("Softmax", scores, name="softmax", bind="probs", uses=one_reader),
                      Op("Where", Op("IsNaN", Op("Softmax", scores, name="softmax", bind="probs", uses=2),
                                     uses=one_reader), Const(check=is_zero), Var("probs"), name="guard", shared=True)),
                   "not an attention output (no Softmax before the MatMul)", deep=False)


def attention_output(probs: Pattern, v: Pattern) -> Pattern:
    return Explain(Op("MatMul", probs, v, name="pv", uses=one_reader), "not an attention output", deep=False)


def head_merge(attn: Pattern) -> Op:
    """The root: Reshape(Transpose(views of attn)), everything under the Transpose absorbed."""
    views = Repeat(layout_step, attn, max=MAX_VIEWS - 2, name="merge_views")
    return Op("Reshape", Op("Transpose", Absorbed(views), name="tr"), "shape", name="out")
