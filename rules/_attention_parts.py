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
- ``head_norm(p)``: the heads of ``x<p>`` (its split, then any Reshape/Transpose views:
  ``<p>_norm_views``, the last one ``<p>_norm_view``) RMS-normalized over their last axis, per head
  (Qwen3 and Gemma 3's QK-norm): ``x / sqrt(mean(x^2) [+ eps]) [* gamma]`` as the exporters write it
  (``<p>_square``, ``<p>_mean``, ``<p>_eps_add``/``<p>_eps``, ``<p>_sqrt``, ``<p>_reciprocal``,
  ``<p>_divide``, ``<p>_scale``/``<p>_gamma``), or one RMSNormalization / SimplifiedLayerNormalization
  node (``<p>_norm_op``); the normalized value ``<p>_norm_in`` is read by the square and the division
  alone. The axes, the epsilon and the weight's shape are a condition's to read.
- ``scaled_dot_product(q, k)``: ``MatMul(q, k)`` (``qk``), the scores.
- ``masked_scores(qk)``: the scores scaled (``qk_scales``), an additive mask added (``mask_add``,
  the mask ``mask``; either operand order) or none, scaled again (``scores_scales``: a rule refuses
  scales after the mask, where their product is not 1).
- ``softmax(scores)``: ``Softmax`` (``softmax``; its output ``probs``), or torch's NaN guard around
  it, ``Where(IsNaN(p), 0, p)`` (``guard``).
- ``attention_output(probs, v)``: ``MatMul(probs, v)`` (``pv``).
- ``key_padding_bias()``: the additive mask made from a keep tensor (``Where(keep, 0, fill)``,
  ``(1 - keep) * fill``, ``Where(bool(1 - keep), fill, 1 - keep)``; binds ``keep``, ``fill``,
  ``inverted``, ``mask``), shared by every layer (absorbed); ``masked_scores`` tries it before a
  plain ``mask``. What ``keep`` holds is then a fact: ``read_key_padding(keep)`` proves
  keep[b, n, s, t] = bool(m[b, t]) (and t <= s) for a 2-D graph input m, or says why not.
- ``head_merge(attn)``: the root: ``Reshape(Transpose(...))`` (``out``, ``tr``; the target
  ``shape``) after any further Reshape/Transpose views of ``attn`` (``merge_views``). Everything
  under the Transpose is absorbed: the rewrite replaces the ends (``out``, ``tr``) and what lies
  between goes with them.

Every value inside is read by the next piece alone (``one_reader``: readers that are Shape nodes do
not count, they die with it), except the NaN guard's Softmax output, read by the guard's IsNaN and
Where, and a normalized head's input (``read_by_a_norm``: the square and the division).

Facts about values: ``dims_of`` (inferred dimensions, through the contrib ops), ``dim_through`` (one
dimension, read again through the nodes that made a value where its recorded shape holds onnx's unknown
symbols), ``rank_of``.
"""

from __future__ import annotations

import math

import onnx_ir as ir

import numpy as np

from onnxopt.core.pattern import ANY, Absorbed, All, Const, Explain, Op, Opt, Or, Pattern, Repeat, Var
from onnxopt.ir.shapes import infer, infer_outputs, is_dim_of, same_symbol, scalar_element, shape_elements
from onnxopt.ir.util import constant_tensor

MS = "com.microsoft"
MAX_VIEWS = 8  # Reshape/Transpose/scale nodes followed on one path
_MAX_LOOKUP = 4096  # values one shape question may look at (see dims_of)
_MAX_CONSTANT = 1 << 20  # elements of a constant the mask reader fits as indices

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


_UNKNOWN = "unk__"  # (how onnx's inference names a dimension it tied to nothing)
_SAME = ("Neg", "Cast", "Identity", "Relu", "Sqrt", "Reciprocal", "Cos", "Sin", "Erf", "Tanh", "Sigmoid", "Softmax")
_BROADCAST = ("Add", "Sub", "Mul", "Div", "Pow", "Where", "And", "Or")


def rank_of(value: ir.Value, opsets) -> int | None:
    """value's rank (inferred, or through the contrib ops: dims_of), or None."""
    shape = infer(value, opsets)
    if shape is None:
        shape = dims_of(value, opsets)
    return None if shape is None else len(shape)


def dim_through(value: ir.Value | None, axis: int, opsets, depth: int = 0, memo: dict | None = None):
    """Dimension ``axis`` of ``value``: the recorded one where it is a number or a named symbol, else read
    through the nodes that made it (Transpose, Slice, Reshape to a constant target, element-wise and
    broadcasting ops, MatMul, Gather, the com.microsoft ops that keep their input's shape). A shape recorded
    before a rewrite proved more stays behind it: a legacy export's Reshape to a computed target, which
    reshape_shape_from_input makes constant, leaves onnx's unknown symbols on every value after it (Phi-3's
    legacy export: the rotated half's width and the heads' sequence)."""
    rank = rank_of(value, opsets) if value is not None else None
    if rank is None or not -rank <= axis < rank:
        return None
    axis %= rank
    shape = infer(value, opsets)
    d = shape[axis] if shape is not None else None
    if _known_dim(d) or depth > 32:
        return d
    memo = {} if memo is None else memo
    if (id(value), axis) not in memo:
        memo[(id(value), axis)] = d  # (while it is being read: a value met again on the way is what is recorded)
        found = _traced_dim(value, axis, rank, opsets, depth, memo)
        memo[(id(value), axis)] = found if found is not None else d
    return memo[(id(value), axis)]


def _known_dim(d) -> bool:
    """d is a number or a named symbol (not onnx's unknown ``unk__N``, nor a symbol without a name)."""
    return isinstance(d, int) or (d is not None and getattr(d, "value", d) is not None
                                  and not str(d).startswith(_UNKNOWN))


def _traced_dim(value: ir.Value, axis: int, rank: int, opsets, depth: int, memo: dict):
    """``dim_through``'s reading of dimension ``axis`` (of ``rank``) through the node that made ``value``; None
    where that node does not say it."""
    node = value.producer()
    if node is None or value is not node.outputs[0]:
        return None
    op, ins = node.op_type, node.inputs
    found = None
    if node.domain == MS:
        same = op in SAME_SHAPE or op == "RotaryEmbedding"  # (its output has its input's shape)
        found = dim_through(ins[0], axis, opsets, depth + 1, memo) if same else None
    elif node.domain not in ("", "ai.onnx"):
        found = None
    elif op in _SAME:
        found = dim_through(ins[0], axis, opsets, depth + 1, memo)
    elif op == "Transpose":
        perm = node.attributes.get("perm")
        perm = list(perm.value) if perm is not None else list(range(rank))[::-1]
        found = dim_through(ins[0], perm[axis], opsets, depth + 1, memo)
    elif op == "Slice" and len(ins) >= 4 and ins[3] is not None:
        starts, ends, axes = (_const_ints(ins[k]) for k in (1, 2, 3))
        steps = _const_ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
        inner = dim_through(ins[0], axis, opsets, depth + 1, memo)
        if axes is not None and axis not in [a % rank for a in axes]:  # (another axis's bounds: any)
            found = inner
        elif None in (starts, ends, axes) or (steps is not None and any(t != 1 for t in steps)):
            found = None
        elif isinstance(inner, int):
            k = [a % rank for a in axes].index(axis)
            lo, hi = (min(max(v + inner if v < 0 else v, 0), inner) for v in (starts[k], ends[k]))
            found = max(hi - lo, 0)
    elif op == "Reshape" and len(ins) > 1:
        target = _const_ints(ins[1])
        if target is None:  # (a computed target: transformers' view(*input_shape, -1, head_dim))
            prime_shapes(ins[1], opsets)
            target = _parts(ins[1], opsets)  # (None for an element it cannot read: kv heads * n_rep)
        zero_copies = node.attributes.get("allowzero") is None or node.attributes["allowzero"].value == 0
        if target is not None and len(target) == rank:
            t = target[axis]
            if t is None:
                found = None
            elif isinstance(t, tuple):
                found = dim_through(t[1], t[2], opsets, depth + 1, memo)
            elif t > 0:
                found = t
            elif t == 0 and zero_copies:
                found = dim_through(ins[0], axis, opsets, depth + 1, memo)
            if t == -1 and zero_copies and target.count(-1) == 1 and None not in target:
                found = _rest_of(ins[0], target, opsets, depth, memo)
    elif op == "Concat":
        c_axis = node.attributes["axis"].value % rank
        parts = [dim_through(v, axis, opsets, depth + 1, memo) for v in ins]
        if axis != c_axis:  # (equal in every operand: the first one known)
            found = next((d for d in parts if _known_dim(d)), None)
        elif all(isinstance(d, int) for d in parts):
            found = sum(parts)
    elif op in ("Unsqueeze", "Squeeze"):
        axes = _const_ints(ins[1]) if len(ins) > 1 and ins[1] is not None else \
            (list(node.attributes["axes"].value) if node.attributes.get("axes") is not None else None)
        in_rank = rank_of(ins[0], opsets)
        if axes is not None and in_rank is not None:
            if op == "Unsqueeze":
                axes = sorted(a % rank for a in axes)
                kept = [k for k in range(rank) if k not in axes]
                found = 1 if axis in axes else dim_through(ins[0], kept.index(axis), opsets, depth + 1, memo)
            else:
                axes = [a % in_rank for a in axes]
                kept = [k for k in range(in_rank) if k not in axes]
                found = dim_through(ins[0], kept[axis], opsets, depth + 1, memo) if len(kept) == rank else None
    elif op == "Expand" and len(ins) > 1:
        target = expand_target(ins[1], opsets)
        in_rank = rank_of(ins[0], opsets)
        if target is not None and in_rank is not None and len(target) <= rank and in_rank <= rank:
            k_in, k_t = axis - (rank - in_rank), axis - (rank - len(target))
            e = dim_through(ins[0], k_in, opsets, depth + 1, memo) if k_in >= 0 else 1
            t = target[k_t] if k_t >= 0 else 1
            t = dim_through(t[1], t[2], opsets, depth + 1, memo) if isinstance(t, tuple) else t
            if isinstance(t, int) and t < 0:
                t = None
            found = t if e == 1 else e if t == 1 else e if _known_dim(e) and str(e) == str(t) else None
    elif op in _BROADCAST:  # (the dimension of an operand that is not 1, or 1 where every operand's is)
        seen = []
        for v in ins:
            r = rank_of(v, opsets) if v is not None else None
            k = axis - (rank - r) if r is not None else -1
            e = dim_through(v, k, opsets, depth + 1, memo) if k >= 0 else 1
            if _known_dim(e) and e != 1:
                return e
            seen.append(e)
        found = 1 if all(e == 1 for e in seen) else None
    elif op == "ReduceMean" or op == "ReduceSum":
        axes = _const_ints(ins[1]) if len(ins) > 1 and ins[1] is not None else \
            (list(node.attributes["axes"].value) if node.attributes.get("axes") is not None else None)
        keep = node.attributes.get("keepdims") is None or node.attributes["keepdims"].value == 1
        if axes and keep:
            found = 1 if axis in [a % rank for a in axes] else dim_through(ins[0], axis, opsets, depth + 1, memo)
    elif op == "MatMul" and rank >= 2:
        ranks = [rank_of(v, opsets) for v in ins[:2]]
        if None in ranks or min(ranks) < 2:
            found = None
        elif axis == rank - 1:
            found = dim_through(ins[1], -1, opsets, depth + 1, memo)
        elif axis == rank - 2:
            found = dim_through(ins[0], -2, opsets, depth + 1, memo)
        else:  # (a batch axis: broadcast, as an element-wise op's)
            seen = []
            for v, r in zip(ins[:2], ranks):
                k = axis - (rank - r)
                e = dim_through(v, k, opsets, depth + 1, memo) if 0 <= k < r - 2 else 1
                if _known_dim(e) and e != 1:
                    return e
                seen.append(e)
            found = 1 if all(e == 1 for e in seen) else None
    elif op == "Gather":
        g_axis = node.attributes.get("axis")
        i_rank = rank_of(ins[1], opsets)
        if (g_axis is None or g_axis.value == 0) and i_rank is not None:
            found = dim_through(ins[1], axis, opsets, depth + 1, memo) if axis < i_rank else \
                dim_through(ins[0], axis - i_rank + 1, opsets, depth + 1, memo)
    return found


def _rest_of(data: ir.Value, target: list, opsets, depth: int, memo: dict):
    """The -1 of a Reshape's ``target`` (ints and DimRefs): ``data``'s size over the target's other
    elements, their dimensions (a DimRef's, or ``data``'s own copied by a 0) cancelling ``data``'s symbols;
    None where they do not cancel or the division leaves a remainder."""
    in_rank = rank_of(data, opsets)
    if in_rank is None:
        return None
    copied = {i for i, e in enumerate(target) if isinstance(e, int) and e == 0}
    if max(copied, default=-1) >= in_rank:
        return None
    num = [dim_through(data, i, opsets, depth + 1, memo) for i in range(in_rank) if i not in copied]
    den = [dim_through(e[1], e[2], opsets, depth + 1, memo) if isinstance(e, tuple) else e
           for e in target if isinstance(e, tuple) or e > 0]
    if not all(_known_dim(d) for d in num + den):
        return None
    symbols = [str(d) for d in num if not isinstance(d, int)]
    for d in den:
        if not isinstance(d, int):
            if str(d) not in symbols:
                return None
            symbols.remove(str(d))
    if symbols:
        return None
    top = int(np.prod([d for d in num if isinstance(d, int)]))
    bottom = int(np.prod([d for d in den if isinstance(d, int)]))
    return top // bottom if bottom > 0 and top % bottom == 0 else None


def minus_one_kept(elements: list, versus: list, fills: list) -> list | None:
    """torch's ``expand(-1, ...)``, ``Where(Equal(t, c), fill, t)`` with constants c and fill, on t's
    ``elements`` (ints and DimRefs): element i is fill[i] where t[i] == c[i], else t[i]. A dimension read
    from a shape is never negative, so against a negative c[i] it is kept (an unknown one, None, stays
    unknown); None where not decided."""
    versus = versus * len(elements) if len(versus) == 1 else versus
    fills = fills * len(elements) if len(fills) == 1 else fills
    if len(versus) != len(elements) or len(fills) != len(elements):
        return None
    out = []
    for e, c, f in zip(elements, versus, fills):
        if isinstance(e, int):
            out.append(int(f) if e == c else e)
        elif c < 0:
            out.append(e)
        else:
            return None
    return out


def expand_target(value: ir.Value | None, opsets=None) -> list | None:
    """An Expand's target as ``shape_elements`` reads it (ints and DimRefs), also through torch's
    ``expand(-1, ...)`` (``minus_one_kept``); None where it is computed otherwise."""
    if value is None:
        return None
    if opsets is not None:
        prime_shapes(value, opsets)
    elements = shape_elements(value)
    node = value.producer() if elements is None else None
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return elements
    cond, fill, t = node.inputs
    eq = cond.producer()
    if eq is None or eq.op_type != "Equal" or eq.domain not in ("", "ai.onnx") or eq.inputs[0] is not t:
        return None
    flat = t.producer()
    if flat is not None and flat.op_type == "Reshape" and _const_ints(flat.inputs[1]) == [-1]:
        flat = flat.inputs[0]  # (transformers 4.57's mask flattens the Concat: Reshape(t, [-1]))
    else:
        flat = t
    inner = _parts(flat, opsets)
    if inner is None:
        return None
    versus, fills = (_filled(v, t, len(inner)) for v in (eq.inputs[1], fill))
    if versus is None or fills is None:
        return None
    return minus_one_kept(inner, versus, fills)


def _parts(value: ir.Value, opsets) -> list | None:
    """``shape_elements``' reading of a shape vector, or, for a Concat of parts of known lengths, each part's
    with None for the elements of a part it cannot read (a kv export's past + new length, an Add of scalars);
    None where neither says how many elements there are."""
    elements = shape_elements(value)
    node = value.producer()
    if elements is not None or node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return elements
    out = []
    for v in node.inputs:
        part = shape_elements(v)
        if part is None:
            shape = infer(v, opsets) if opsets is not None else None
            if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
                return None
            part = [_int_of(v, opsets)] if shape[0] == 1 else [None] * shape[0]
        out.extend(part)
    return out


_INT_OPS = {"Add": lambda a, c: a + c, "Sub": lambda a, c: a - c, "Mul": lambda a, c: a * c,
            "Div": lambda a, c: int(a / c) if c else None}  # (onnx's integer Div truncates toward zero)


def _int_of(value: ir.Value | None, opsets, depth: int = 0) -> int | None:
    """A one-element shape computation as a number: integer Add/Sub/Mul/Div of constants and of dimensions
    ``dim_through`` knows as numbers (read through Shape/Gather, Unsqueeze, Squeeze, Cast); None otherwise."""
    if value is None or depth > 8:
        return None
    got = _const_ints(value)
    if got is not None:
        return got[0] if len(got) == 1 else None
    element = scalar_element(value)
    if element is None:
        elements = shape_elements(value)
        element = elements[0] if elements is not None and len(elements) == 1 else None
    if isinstance(element, tuple):
        element = dim_through(element[1], element[2], opsets)
    if isinstance(element, int):
        return element
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        return _int_of(node.inputs[0], opsets, depth + 1)
    if node.op_type in _INT_OPS and len(node.inputs) == 2:
        a, c = (_int_of(v, opsets, depth + 1) for v in node.inputs)
        return None if a is None or c is None else _INT_OPS[node.op_type](a, c)
    return None


def _filled(value: ir.Value, like: ir.Value, n: int, depth: int = 0) -> list[int] | None:
    """The ``n`` ints of a vector the size of ``like``: a constant, ``ConstantOfShape(Shape(like))`` (torch's
    ``expand(-1, ...)`` as transformers 4.57's mask writes it: ``Equal(t, ConstantOfShape(Shape(t)) * -1)``),
    or a Mul of such; None otherwise."""
    got = _const_ints(value)
    if got is not None or depth > 4:
        return got * n if got is not None and len(got) == 1 else got
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "ConstantOfShape":
        shape = node.inputs[0].producer()
        fill = node.attributes.get("value")
        of = fill.value.numpy().reshape(-1) if fill is not None else np.zeros(1, np.float32)
        if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not like or of.dtype.kind not in "iu":
            return None
        return [int(of[0])] * n
    if node.op_type == "Mul" and len(node.inputs) == 2:
        a, c = (_filled(v, like, n, depth + 1) for v in node.inputs)
        return None if a is None or c is None or len(a) != n or len(c) != n else [x * y for x, y in zip(a, c)]
    return None


def _const_ints(value: ir.Value | None) -> list[int] | None:
    t = constant_tensor(value) if value is not None else None
    if t is None or t.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in t.numpy().reshape(-1)]


def float_scalar(value: ir.Value | None) -> float | None:
    """The number a one-element float constant of rank 0 or 1 holds, else None (a [1,1,1,1] factor
    could raise the rank); also the square root of one (``Sqrt(c)``: torch's sdpa scales q and k by
    sqrt(scale) each, and a float16 export keeps that Sqrt, which constant folding cannot fold exactly)."""
    t = constant_tensor(value)
    node = value.producer() if value is not None and t is None else None
    if node is not None and node.op_type == "Sqrt" and node.domain in ("", "ai.onnx") and is_sqrt_scale(node.inputs[0]):
        c = constant_tensor(node.inputs[0]).numpy().reshape(-1)
        return float(np.sqrt(c)[0])  # (in the constant's own type: as the model computes it)
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


def is_sqrt_scale(value: ir.Value) -> bool:
    """value is a positive float16/bfloat16 scalar constant whose Sqrt scales: constant folding leaves such a Sqrt
    (onnxruntime's CPU provider computes it in float32 with its float16 reader), a float32 one it folds first."""
    t = constant_tensor(value)
    return t is not None and t.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) and is_scale(value) \
        and float_scalar(value) > 0


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
    if elements is not None:  # (3 -> 3 where a batch of 1 is dropped: [1, S, H] -> [S, N, D])
        return len(elements) == 4 or len(elements) == 3 and found[0] == 1
    shape = infer(target, opsets)
    return shape is not None and len(shape) == 1 and shape[0] == 4


# --------------------------------------------------------------------------------------------
# One node of a chain: each takes the pattern of what comes before it (see Repeat)


def scale_factor_pattern() -> Pattern:
    """A scalar constant, or the square root of one (see ``float_scalar``)."""
    return Or(Const(check=is_scale), Op("Sqrt", Const(check=is_sqrt_scale), uses=one_reader))


def scale_step(rest: Pattern) -> Pattern:
    """A Mul (either operand order) or Div by a scalar constant."""
    return Or(Op("Mul", rest, scale_factor_pattern(), commutative=True, uses=one_reader),
              Op("Div", rest, scale_factor_pattern(), uses=one_reader))


def layout_step(rest: Pattern) -> Pattern:
    """A Reshape, a Transpose, or an Unsqueeze/Squeeze of constant axes (where a batch of 1 was
    dropped and put back by shape rules at fixed shapes): a view of the same elements."""
    return Or(Op("Reshape", rest, ANY, uses=one_reader), Op("Transpose", rest, uses=one_reader),
              Op("Unsqueeze", rest, Opt(Const()), uses=one_reader), Op("Squeeze", rest, Opt(Const()), uses=one_reader))


def view_step(rest: Pattern) -> Pattern:
    """A view or a scale: what lies between a head split and the MatMul that reads the heads."""
    return Or(layout_step(rest),
              Op("Mul", rest, scale_factor_pattern(), commutative=True, uses=one_reader),
              Op("Div", rest, scale_factor_pattern(), uses=one_reader))


# --------------------------------------------------------------------------------------------
# The pieces


def head_split(p: str) -> Pattern:
    """A rank 3 -> 4 Reshape of the projection ``x<p>`` (``<p>_split``)."""
    return Op("Reshape", Var(f"x{p}"), ANY, name=f"{p}_split", uses=one_reader, check=is_head_split)


def read_by_a_norm(value: ir.Value) -> bool:
    """value is read by two nodes (an RMS normalization's square and division; Shape readers aside)."""
    if value.is_graph_output():
        return False
    return len({id(n) for n, _ in value.uses() if n.op_type != "Shape"}) == 2


def head_norm(p: str) -> Pattern:
    """The heads of ``x<p>`` RMS-normalized per head over their last axis (see the module docstring)."""
    x = Var(f"{p}_norm_in")
    split = Op("Reshape", Var(f"x{p}"), ANY, name=f"{p}_split", uses=read_by_a_norm, check=is_head_split)
    below = Repeat(layout_step, head_split(p), max=3, name=f"{p}_norm_views")
    viewed = Or(Op("Reshape", below, ANY, name=f"{p}_norm_view", uses=read_by_a_norm),
                Op("Transpose", below, name=f"{p}_norm_view", uses=read_by_a_norm))
    split_heads = All(x, Or(split, viewed))
    square = Or(Op("Pow", x, Const(check=_is_two), name=f"{p}_square"),
                Op("Mul", x, x, name=f"{p}_square"))
    mean = Op("ReduceMean", square, Opt(Const()), name=f"{p}_mean")
    rms = Op("Sqrt", Or(Op("Add", mean, Const(f"{p}_eps", check=_is_scalar), commutative=True, name=f"{p}_eps_add"),
                        mean), name=f"{p}_sqrt")
    divided = Or(Op("Div", split_heads, rms, name=f"{p}_divide"),
                 Op("Mul", split_heads, Op("Reciprocal", rms, name=f"{p}_reciprocal"), commutative=True,
                    name=f"{p}_divide"),
                 Op("Mul", split_heads, Op("Div", Const(check=_is_one), rms, name=f"{p}_reciprocal"),
                    commutative=True, name=f"{p}_divide"))
    return Or(Op("Mul", divided, Const(f"{p}_gamma"), commutative=True, name=f"{p}_scale"), divided,
              Op("RMSNormalization", split_heads, Const(f"{p}_gamma"), name=f"{p}_norm_op"),
              Op("SimplifiedLayerNormalization", split_heads, Const(f"{p}_gamma"), name=f"{p}_norm_op"))


def heads(p: str, what: str) -> Pattern:
    """A projection's heads as a MatMul reads them (see the module docstring)."""
    return Explain(Repeat(view_step, head_split(p), max=MAX_VIEWS - 1, name=f"{p}_views"),
                   f"{what} is not a reshape of a projection into heads")


def scaled_dot_product(q: Pattern, k: Pattern) -> Pattern:
    return Explain(Op("MatMul", q, k, name="qk", uses=one_reader), "the scores are not a MatMul", deep=False)


def additive_mask(scores: Pattern) -> Pattern:
    """scores + mask, in either order (the mask: ``mask``; where it is made from a keep tensor as
    ``key_padding_bias`` says, also ``keep``, ``fill`` and ``inverted``, else those are None)."""
    return Op("Add", scores, Or(key_padding_bias(), Var("mask")), commutative=True, name="mask_add", uses=one_reader)


def soft_capped(scores: Pattern) -> Pattern:
    """Gemma 2's soft-capping of the scaled scores: ``Mul(Tanh(Div(s, cap_in)), cap_out)`` (``cap``)."""
    return Op("Mul", Op("Tanh", Op("Div", scores, Const("cap_in", check=is_scale), uses=one_reader), uses=one_reader),
              Const("cap_out", check=is_scale), commutative=True, name="cap", uses=one_reader)


def masked_scores(qk: Pattern, softcap: bool = False) -> Pattern:
    """The scores, scaled, with an additive mask or none, scaled again (see the module docstring);
    ``softcap``: also soft-capped (``soft_capped``) after the first scales, before the mask."""
    scaled = Repeat(scale_step, qk, max=2, name="qk_scales")
    if not softcap:
        return Repeat(scale_step, Or(additive_mask(scaled), qk), max=3, name="scores_scales")
    return Repeat(scale_step, Or(additive_mask(Or(soft_capped(scaled), scaled)), soft_capped(scaled), qk),
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


# --------------------------------------------------------------------------------------------
# The mask: an additive bias that is a key-padding mask of a 2-D graph input (and a causal factor)
#
# The pieces below say how the bias is made from a boolean "keep" (or 0/1 number) tensor and
# bind it (``keep``) with the fill value (``fill``); ``read_key_padding`` then reads ``keep``
# element by element: what each of its elements [b, n, s, t] (right-aligned to rank 4) is, from the
# node types' semantics (Range, Unsqueeze, Add/Mul of indices, Flatten + Gather of a flat index,
# GatherND of stacked indices, Cast, And, comparisons of indices, Expand), so any exporter's index
# arithmetic reads the same when it addresses the same element, and one that addresses another
# element (a transposed index t*B + b, an offset, a window) is refused with its reason.


def key_padding_bias() -> Pattern:
    """The additive mask as the exporters make it from ``keep`` (binds ``keep``, ``fill``, the bias
    ``mask``):

    - ``Where(keep, 0, fill)`` (transformers 5, eager and sdpa, both exporters);
    - ``Mul(Sub(1, keep), fill)`` (transformers 4 eager: ``(1 - m[:, None, None, :]) * fill``);
    - ``Where(Cast<bool>(inv), fill, inv)`` with ``inv = Sub(1, keep)`` (transformers 4 sdpa:
      ``inverted.masked_fill(inverted.bool(), fill)``).

    Every node is shared by all the layers: absorbed, never claimed."""
    inverted = Op("Sub", Const(check=_is_one), Var("keep"), bind="inverted", shared=True)
    return Explain(Absorbed(Or(
        Op("Where", Var("keep"), Const(check=is_zero), Const("fill", check=_is_scalar), bind="mask", shared=True),
        Op("Mul", inverted, Const("fill", check=_is_scalar), commutative=True, bind="mask", shared=True),
        Op("Where", Op("Cast", inverted, shared=True, check=_to_bool), Const("fill", check=_is_scalar),
           Var("inverted"), bind="mask", shared=True))),
        "the mask is not Where(keep, 0, fill) nor (1 - keep) * fill")


def _is_one(value: ir.Value) -> bool:
    return float_scalar(value) == 1.0


def _is_two(value: ir.Value) -> bool:
    return float_scalar(value) == 2.0


def _is_scalar(value: ir.Value) -> bool:
    t = constant_tensor(value)
    return t is not None and t.numpy().size == 1 and t.numpy().dtype.kind == "f"


def _to_bool(node: ir.Node, opsets) -> bool:
    to = node.attributes.get("to")
    return to is not None and to.value == int(ir.DataType.BOOL)


class KeyPadding:
    """What ``read_key_padding`` proved: keep[b, n, s, t] = bool(mask[b, t]) (and t <= s where
    ``causal``), ``mask`` a 2-D graph input [B, T]."""

    __slots__ = ("mask", "causal")

    def __init__(self, mask: ir.Value, causal: bool):
        self.mask, self.causal = mask, causal


class _NotKeyPadding(Exception):
    """The keep tensor is not read as key padding; the message says why (short, no node names)."""


# A symbolic tensor: its rank, what its element at index (i0, ..., i_{r-1}) is, and the extent of
# each axis it varies along. Expressions (tuples; axes are the tensor's own):
#   ("lin", ((axis, coef), ...), c)   sum of coef * i_axis, + c   (coef: an int or a shape element)
#   ("mask", lin_b, lin_t, raw)       the graph input mask at [lin_b, lin_t]; raw: its number, else bool
#   ("le", lin_a, lin_b)              lin_a <= lin_b
#   ("and", (e, ...)), ("true",)      booleans
#   ("num", e)                        a boolean as 0/1 (a Cast of one to a number)
#   ("not", e)                        1 - a 0/1 number / logical not
#   ("const", x)                      the same number everywhere
class _Sym:
    __slots__ = ("rank", "expr", "extents")

    def __init__(self, rank: int, expr: tuple, extents: dict | None = None):
        self.rank, self.expr, self.extents = rank, expr, dict(extents or {})


def _remap(expr, f):
    """expr with every axis a renamed by f(a)."""
    kind = expr[0]
    if kind == "lin":
        return ("lin", tuple(sorted(((f(a), c) for a, c in expr[1]), key=lambda t: t[0])), expr[2])
    if kind == "mask":
        return ("mask", _remap(expr[1], f), _remap(expr[2], f), expr[3])
    if kind == "le":
        return ("le", _remap(expr[1], f), _remap(expr[2], f))
    if kind == "and":
        return ("and", tuple(_remap(e, f) for e in expr[1]))
    if kind in ("num", "not"):
        return (kind, _remap(expr[1], f))
    return expr


def _moved(sym: _Sym, f, rank: int) -> _Sym:
    return _Sym(rank, _remap(sym.expr, f), {f(a): e for a, e in sym.extents.items()})


def _aligned(sym: _Sym, rank: int) -> _Sym:
    """sym broadcast to ``rank`` (numpy's right alignment)."""
    shift = rank - sym.rank
    return sym if shift == 0 else _moved(sym, lambda a: a + shift, rank)


def _merge_extents(a: _Sym, b: _Sym) -> dict:
    out = dict(a.extents)
    for axis, e in b.extents.items():
        if axis in out and not _same_extent(out[axis], e):
            raise _NotKeyPadding("two index ranges of different lengths meet on one axis")
        out[axis] = e
    return out


def _same_extent(a, b, opsets=None) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return _static(a, opsets) == _static(b, opsets) is not None
    if (a[1] is b[1] and a[2] == b[2]) or same_symbol(a[1], a[2], b[1], b[2]):
        return True
    return opsets is not None and (_is_dim(a, b[1], b[2], opsets) or _is_dim(b, a[1], a[2], opsets))


def _int_scalar(value: ir.Value | None, opsets, depth: int = 0):
    """A scalar integer (an int, or a shape element ("dim", value, k)) as shape arithmetic gives it:
    through Cast/CastLike to an integer type, Squeeze/Reshape/Gather of a Shape, or a constant."""
    if value is None or depth > 8:
        return None
    t = constant_tensor(value)
    if t is not None:
        a = t.numpy()
        if a.size != 1 or a.dtype.kind not in "iuf" or not float(a.reshape(-1)[0]).is_integer():
            return None
        return int(a.reshape(-1)[0])
    prime_shapes(value, opsets)
    e = scalar_element(value)
    if e is not None:
        return e
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in ("Cast", "CastLike"):
        return _int_scalar(node.inputs[0], opsets, depth + 1)
    elements = shape_elements(value)  # a 1-element shape vector: Gather(Shape(x), [k]), Shape(x, k, k+1)
    if elements is None and node.op_type in ("Squeeze", "Reshape", "Unsqueeze"):
        elements = shape_elements(node.inputs[0])
    return elements[0] if elements is not None and len(elements) == 1 else None


def _const_axes(value: ir.Value) -> list[int] | None:
    t = constant_tensor(value)
    return None if t is None else [int(a) for a in t.numpy().reshape(-1)]


def _shape_rank(value: ir.Value | None, opsets) -> int | None:
    """The length of a 1-D shape vector."""
    prime_shapes(value, opsets)
    elements = shape_elements(value)
    if elements is not None:
        return len(elements)
    shape = infer(value, opsets) if value is not None else None
    return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None


def _lin(e) -> tuple | None:
    """An index expression as ("lin", terms, c), a constant integer read as one; None otherwise."""
    if e[0] == "lin":
        return e
    if e[0] == "const" and float(e[1]).is_integer():
        return ("lin", (), int(e[1]))
    return None


def _and(*parts) -> tuple:
    terms = []
    for p in parts:
        if p[0] == "and":
            terms.extend(p[1])
        elif p[0] == "const" and p[1]:
            continue  # (True)
        elif p[0] != "true":
            terms.append(p)
    return ("and", tuple(terms)) if len(terms) != 1 else terms[0] if terms else ("true",)


def _as_bool(e) -> tuple:
    """The boolean an expression is nonzero at."""
    if e[0] == "num":
        return e[1]
    if e[0] == "mask":
        return ("mask", e[1], e[2], False)
    if e[0] in ("and", "le", "true"):
        return e
    if e[0] == "not" and e[1][0] in ("num", "mask"):
        return ("not", _as_bool(e[1]))
    if e[0] == "const":
        return ("true",) if e[1] else ("const", False)
    raise _NotKeyPadding("the mask casts a number that is not 0/1 to bool")


class _Reader:
    """Reads values of the mask's subgraph into _Sym (memoised), relative to the 2-D graph input it
    finds (``mask``)."""

    def __init__(self, opsets):
        self.opsets = opsets
        self.memo: dict[ir.Value, _Sym] = {}
        self.mask: ir.Value | None = None

    def read(self, value: ir.Value, depth: int = 0) -> _Sym:
        if value in self.memo:
            return self.memo[value]
        if depth > 64:
            raise _NotKeyPadding("the mask is computed by too many nodes")
        sym = self._read(value, depth + 1)
        self.memo[value] = sym
        return sym

    def _input(self, value: ir.Value) -> _Sym:
        shape = value.shape
        if value.producer() is not None or shape is None or len(shape) != 2:
            raise _NotKeyPadding("the mask is not read from a 2-D graph input")
        if self.mask is not None and self.mask is not value:
            raise _NotKeyPadding("the mask reads two graph inputs")
        dtype = value.type.dtype if isinstance(value.type, ir.TensorType) else None
        if dtype not in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL, ir.DataType.FLOAT,
                         ir.DataType.FLOAT16, ir.DataType.INT8, ir.DataType.UINT8):
            raise _NotKeyPadding(f"the mask input has type {dtype}")
        self.mask = value
        extents = {0: ("dim", value, 0), 1: ("dim", value, 1)}
        return _Sym(2, ("mask", ("lin", ((0, 1),), 0), ("lin", ((1, 1),), 0), dtype != ir.DataType.BOOL), extents)

    def _read(self, value: ir.Value, depth: int) -> _Sym:
        t = constant_tensor(value)
        if t is not None:
            return _constant(t.numpy())
        node = value.producer()
        if node is None:
            return self._input(value)
        if node.domain not in ("", "ai.onnx"):
            raise _NotKeyPadding(f"the mask reads a {node.op_type} of domain {node.domain}")
        op, ins = node.op_type, node.inputs
        r = lambda v: self.read(v, depth)  # noqa: E731
        if op in ("Identity",):
            return r(ins[0])
        if op == "Cast":
            x = r(ins[0])
            to = node.attributes["to"].value
            if to == int(ir.DataType.BOOL):
                return _Sym(x.rank, _as_bool(x.expr), x.extents)
            if x.expr[0] in ("and", "le", "true") or x.expr[0] == "not" and x.expr[1][0] != "num":
                return _Sym(x.rank, ("num", x.expr), x.extents)
            if x.expr[0] == "mask" and not x.expr[3]:
                return _Sym(x.rank, ("num", x.expr), x.extents)
            return x  # (an index, a number, a 0/1 number: the same numbers in another type)
        if op == "Range":
            start, limit, delta = (_int_scalar(v, self.opsets) for v in ins)
            if start != 0 or delta != 1 or limit is None:
                raise _NotKeyPadding("a Range of the mask is not 0..n-1")
            return _Sym(1, ("lin", ((0, 1),), 0), {0: limit})
        if op == "Unsqueeze":
            x = r(ins[0])
            axes = _const_axes(ins[1]) if len(ins) > 1 else (
                list(node.attributes["axes"].value) if "axes" in node.attributes else None)
            if axes is None:
                raise _NotKeyPadding("an Unsqueeze of the mask has unknown axes")
            rank = x.rank + len(axes)
            axes = sorted(a % rank for a in axes)
            kept = [a for a in range(rank) if a not in axes]
            return _moved(x, lambda a: kept[a], rank)
        if op == "Squeeze":
            x = r(ins[0])
            axes = _const_axes(ins[1]) if len(ins) > 1 else (
                list(node.attributes["axes"].value) if "axes" in node.attributes else None)
            if axes is None or any(a % x.rank in x.extents for a in axes):
                raise _NotKeyPadding("a Squeeze of the mask removes an axis it varies along")
            axes = {a % x.rank for a in axes}
            kept = [a for a in range(x.rank) if a not in axes]
            return _moved(x, lambda a: kept.index(a), x.rank - len(axes))
        if op == "Transpose":
            x = r(ins[0])
            perm = node.attributes.get("perm")
            perm = list(perm.value) if perm is not None else list(range(x.rank))[::-1]
            return _moved(x, lambda a: perm.index(a), x.rank)
        if op == "Expand":
            x = r(ins[0])
            rank = _shape_rank(ins[1], self.opsets)
            if rank is None:
                raise _NotKeyPadding("an Expand of the mask has a target of unknown length")
            return _aligned(x, max(rank, x.rank))
        if op in ("Add", "Mul", "Sub", "And", "LessOrEqual", "GreaterOrEqual", "Less", "Greater"):
            return self._binary(node, r(ins[0]), r(ins[1]))
        if op == "ConstantOfShape":
            rank = _shape_rank(ins[0], self.opsets)
            attr = node.attributes.get("value")
            x = attr.value.numpy().reshape(-1)[0] if attr is not None else 0.0
            if rank is None:
                raise _NotKeyPadding("a ConstantOfShape of the mask has an unknown rank")
            return _Sym(rank, ("const", bool(x) if isinstance(x, np.bool_) else float(x)))
        if op == "Reshape":
            return self._reshape(node, depth)
        if op == "Gather":
            return self._gather(node, depth)
        if op == "GatherND":
            return self._gather_nd(node, depth)
        raise _NotKeyPadding(f"the mask is computed with {op}")

    def _binary(self, node: ir.Node, a: _Sym, b: _Sym) -> _Sym:
        op = node.op_type
        rank = max(a.rank, b.rank)
        a, b = _aligned(a, rank), _aligned(b, rank)
        extents = _merge_extents(a, b)
        ea, eb = a.expr, b.expr
        if op == "And":
            return _Sym(rank, _and(_as_bool(ea), _as_bool(eb)), extents)
        if op in ("LessOrEqual", "GreaterOrEqual", "Less", "Greater"):
            la, lb = _lin(ea), _lin(eb)
            if la is None or lb is None:
                raise _NotKeyPadding("the mask compares values that are not indices")
            if op.startswith("Greater"):
                la, lb = lb, la
            if op in ("Less", "Greater"):  # a < b  <=>  a + 1 <= b (integers)
                la = ("lin", la[1], la[2] + 1)
            # 0 <= i + c with every coefficient >= 0 and c >= 0 holds for every index i >= 0
            if not la[1] and all(isinstance(c, int) and c >= 0 or not isinstance(c, int) for _, c in lb[1]) \
                    and lb[2] >= la[2]:
                return _Sym(rank, ("true",), extents)
            return _Sym(rank, ("le", la, lb), extents)
        if op == "Sub":
            if ea[0] == "const" and ea[1] == 1.0 and eb[0] in ("num", "mask"):
                return _Sym(rank, ("not", eb), extents)
            la, lb = _lin(ea), _lin(eb)
            if la is not None and lb is not None and all(isinstance(c, int) for _, c in lb[1]):
                return _Sym(rank, _lin_add(la, ("lin", tuple((k, -c) for k, c in lb[1]), -lb[2])), extents)
            raise _NotKeyPadding("the mask subtracts values that are not indices")
        la, lb = _lin(ea), _lin(eb)
        if op == "Add" and la is not None and lb is not None:
            return _Sym(rank, _lin_add(la, lb), extents)
        if op == "Mul":
            for x, y in ((a, b), (b, a)):
                lx = _lin(x.expr)
                if lx is None:
                    continue
                factor = self._factor(y)
                if factor is not None:
                    return _Sym(rank, _lin_scale(lx, factor), extents)
        raise _NotKeyPadding(f"the mask's {op} is not index arithmetic")

    def _factor(self, other: _Sym):
        """The factor (an int, or a shape element) an index is multiplied by, read from the Mul's
        other operand."""
        if other.expr[0] == "const" and float(other.expr[1]).is_integer():
            return int(other.expr[1])
        if other.extents or other.expr[0] != "dimval":
            return None
        return other.expr[1]

    def _scalar_or(self, value: ir.Value):
        e = _int_scalar(value, self.opsets)
        if e is not None and not isinstance(e, int):
            return _Sym(0, ("dimval", e))
        return None

    def read_operand(self, value: ir.Value, depth: int) -> _Sym:
        s = self._scalar_or(value)
        return s if s is not None else self.read(value, depth)

    def _reshape(self, node: ir.Node, depth: int) -> _Sym:
        x_value, target = node.inputs[0], node.inputs[1]
        prime_shapes(target, self.opsets)
        elements = shape_elements(target)
        if elements is None:
            raise _NotKeyPadding("a Reshape of the mask has an unreadable target")
        inner = x_value.producer()
        # the flat round trip of a gathered element: Reshape(Reshape(Gather(F, idx), [-1]), Shape(idx))
        # (Reshape(Gather(F, idx), Shape(idx)) where shape rules merged the two Reshapes)
        gathered = inner.inputs[0] if inner is not None and inner.op_type == "Reshape" and shape_elements(
            inner.inputs[1]) == [-1] else x_value
        gather = gathered.producer()
        if gather is not None and gather.op_type == "Gather":
            idx = gather.inputs[1]
            idx_dims = dims_of(idx, self.opsets)
            if idx_dims is not None and len(idx_dims) == len(elements) and all(
                    _is_dim(e, idx, k, self.opsets) if not isinstance(e, int) else e == idx_dims[k]
                    for k, e in enumerate(elements)):
                g = self.read(gathered, depth)
                rank = g.rank - 1
                if rank != len(elements) or rank in g.extents:
                    raise _NotKeyPadding("a Reshape of the mask drops an axis it varies along")
                return _Sym(rank, g.expr, g.extents)
        # a Reshape that keeps every dimension (the mask made [B, -1] of itself)
        x = self.read(x_value, depth)
        if not _keeps_dims(node, self.opsets):
            raise _NotKeyPadding("a Reshape of the mask moves its elements")
        return x

    def _gather(self, node: ir.Node, depth: int) -> _Sym:
        """Gather(Flatten(mask, 2), b*T + t) on axis 0: mask[b, t] with a trailing axis of 1."""
        data, indices = node.inputs
        axis = node.attributes.get("axis")
        flat = data.producer()
        if (axis is not None and axis.value != 0) or flat is None or flat.op_type != "Flatten":
            raise _NotKeyPadding("the mask gathers from something that is not a flattened mask")
        fa = flat.attributes.get("axis")
        src = self.read(flat.inputs[0], depth)
        if src.rank != 2 or src.expr[0] != "mask" or src.expr[1] != ("lin", ((0, 1),), 0) \
                or src.expr[2] != ("lin", ((1, 1),), 0):
            raise _NotKeyPadding("the mask gathers from something that is not a flattened mask")
        if (1 if fa is None else fa.value) != 2:
            raise _NotKeyPadding("the mask gathers from a Flatten that is not [B*T, 1]")
        idx = self.read(indices, depth)
        li = _lin(idx.expr)
        mask = self.mask
        if li is not None and li[2] == 0 and len(li[1]) == 1 and _batch_of_one(mask, self.opsets):
            li = ("lin", li[1] + ((None, 0),), 0)  # (one batch row: b is 0)
        if li is None or li[2] != 0 or len(li[1]) != 2:
            raise _NotKeyPadding("the mask's index arithmetic does not address [b, t]")
        (a1, c1), (a2, c2) = li[1]
        for (ab, cb), (at, ct) in (((a1, c1), (a2, c2)), ((a2, c2), (a1, c1))):
            if ct == 1 and at is not None and (ab is None or _is_dim(cb, mask, 1, self.opsets)) \
                    and at in idx.extents and _same_extent(idx.extents[at], ("dim", mask, 1), self.opsets):
                rank = idx.rank + 1
                b = ("lin", (), 0) if ab is None else ("lin", ((ab, 1),), 0)
                expr = ("mask", b, ("lin", ((at, 1),), 0), src.expr[3])
                return _Sym(rank, expr, idx.extents)
        raise _NotKeyPadding("the mask's index arithmetic does not address [b, t]")

    def _gather_nd(self, node: ir.Node, depth: int) -> _Sym:
        """GatherND(mask, stack([b, t], -1)): mask[b, t]."""
        data, indices = node.inputs
        bd = node.attributes.get("batch_dims")
        src = self.read(data, depth)
        stack = indices.producer()
        folded = constant_tensor(indices)
        if (bd is not None and bd.value != 0) or src.rank != 2 or src.expr[0] != "mask" \
                or src.expr[1] != ("lin", ((0, 1),), 0) or src.expr[2] != ("lin", ((1, 1),), 0) or not (
                    folded is not None and folded.numpy().ndim >= 1 and folded.numpy().shape[-1] == 2
                    or stack is not None and stack.op_type == "Concat" and len(stack.inputs) == 2):
            raise _NotKeyPadding("the mask's GatherND does not read [b, t] of the mask")
        if folded is not None:  # (at fixed shapes: the stacked indices folded)
            a = folded.numpy()
            parts = [_constant(np.ascontiguousarray(a[..., i])) for i in range(2)]
            parts = [p if p.rank == a.ndim - 1 else _aligned(p, a.ndim - 1) for p in parts]
            return self._nd(parts, src)
        parts = []
        for v in stack.inputs:
            u = v.producer()
            if u is None or u.op_type != "Unsqueeze":
                raise _NotKeyPadding("the mask's GatherND indices are not a stack of two indices")
            part = self.read(u.inputs[0], depth)
            axes = _const_axes(u.inputs[1]) if len(u.inputs) > 1 else (
                list(u.attributes["axes"].value) if "axes" in u.attributes else None)
            if axes is None or len(axes) != 1 or axes[0] % (part.rank + 1) != part.rank:
                raise _NotKeyPadding("the mask's GatherND indices are not a stack of two indices")
            parts.append(part)
        axis = stack.attributes["axis"].value
        rank = max(p.rank for p in parts)
        if axis not in (-1, rank) or any(p.rank != rank for p in parts):
            raise _NotKeyPadding("the mask's GatherND indices are not a stack of two indices")
        return self._nd(parts, src)

    def _nd(self, parts: list, src: _Sym) -> _Sym:
        rank = parts[0].rank
        b, t = (_lin(p.expr) for p in parts)
        if b == ("lin", (), 0) and _batch_of_one(self.mask, self.opsets):
            b = None  # (one batch row: b is 0)
        if b is None and t is not None:
            pass
        elif b is None or t is None or b[2] != 0 or len(b[1]) != 1 or b[1][0][1] != 1:
            raise _NotKeyPadding("the mask's index arithmetic does not address [b, t]")
        if t is None or t[2] != 0 or len(t[1]) != 1 or t[1][0][1] != 1:
            raise _NotKeyPadding("the mask's index arithmetic does not address [b, t]")
        extents = _merge_extents(*parts)
        if not _same_extent(extents.get(t[1][0][0], 1), ("dim", self.mask, 1), self.opsets):
            raise _NotKeyPadding("the mask's index arithmetic does not address [b, t]")
        return _Sym(rank, ("mask", ("lin", (), 0) if b is None else b, t, src.expr[3]), extents)


def _keeps_dims(node: ir.Node, opsets, depth: int = 0) -> bool:
    """A Reshape whose target gives each dimension of its input back (one -1 at most; 0 copies
    where allowzero is off; a dimension read from a value that is such a Reshape of the input
    counts as the input's)."""
    x = node.inputs[0]
    target = node.inputs[1] if len(node.inputs) > 1 else None
    prime_shapes(target, opsets)
    elements = shape_elements(target)
    dims = dims_of(x, opsets)
    if elements is None or dims is None or len(dims) != len(elements):
        return False
    allowzero = node.attributes.get("allowzero")
    allowzero = allowzero is not None and allowzero.value == 1
    unknown = 0
    for k, e in enumerate(elements):
        if isinstance(e, int):
            if e == -1:
                unknown += 1
            elif not (e == 0 and not allowzero or e > 0 and dims[k] == e):
                return False
        elif not _is_dim(e, x, k, opsets, depth):
            return False
    return unknown <= 1


def _is_dim(e, x: ir.Value, k: int, opsets, depth: int = 0) -> bool:
    """A shape element stands for dimension k of x: is_dim_of, or through a Reshape of a value
    that keeps its dimensions (GPT-2 reads its batch from input_ids.view(-1, T))."""
    if isinstance(e, int):
        dims = dims_of(x, opsets)
        return dims is not None and dims[k] == e
    if is_dim_of(e, x, k):
        return True
    v, j = e[1], e[2]
    node = v.producer()
    if depth > 3 or node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ("Cast", "Identity"):
        return _is_dim(("dim", node.inputs[0], j), x, k, opsets, depth + 1)
    if node.op_type != "Reshape":
        return False
    return _keeps_dims(node, opsets, depth + 1) and _is_dim(("dim", node.inputs[0], j), x, k, opsets, depth + 1)


def _constant(a: np.ndarray) -> _Sym:
    """A constant as the reader's expressions: one number repeated, integer indices affine in the
    axes (a folded Range and its arithmetic, at fixed shapes), or a boolean comparison of two axes'
    indices (a folded causal triangle)."""
    if a.size == 0:
        raise _NotKeyPadding("the mask reads an empty constant")
    x = a.reshape(-1)[0]
    if np.all(a == x):
        return _Sym(a.ndim, ("const", bool(x) if a.dtype == np.bool_ else float(x)))
    if a.size > _MAX_CONSTANT:
        raise _NotKeyPadding("the mask reads a large constant")
    axes = [k for k in range(a.ndim) if a.shape[k] > 1]
    extents = {k: int(a.shape[k]) for k in axes}
    grids = np.indices(a.shape)
    if a.dtype.kind in "iu" or a.dtype.kind == "f" and np.all(np.mod(a, 1) == 0):
        ai = a.astype(np.int64)
        c0 = int(ai.reshape(-1)[0])
        terms = []
        for k in axes:
            step = [0] * a.ndim
            step[k] = 1
            terms.append((k, int(ai[tuple(step)]) - c0))
        fitted = c0 + sum(c * grids[k] for k, c in terms)
        if np.array_equal(fitted, ai):
            return _Sym(a.ndim, ("lin", tuple((k, c) for k, c in terms if c), c0), extents)
        raise _NotKeyPadding("the mask reads indices that are not affine in the axes")
    if a.dtype == np.bool_:
        for i in axes:
            for j in axes:
                if i != j and np.array_equal(a, grids[i] <= grids[j]):
                    return _Sym(a.ndim, ("le", ("lin", ((i, 1),), 0), ("lin", ((j, 1),), 0)), extents)
    raise _NotKeyPadding("the mask reads a constant that is neither one number nor indices")


def _batch_of_one(mask: ir.Value | None, opsets) -> bool:
    """The mask input has one batch row (fixed shapes): every b index is 0."""
    dims = dims_of(mask, opsets) if mask is not None else None
    return dims is not None and dims[0] == 1


def _static(e, opsets):
    """A shape element as a number where it is one (a dimension of static size), else None."""
    if isinstance(e, int):
        return e
    dims = dims_of(e[1], opsets) if opsets is not None else None
    d = dims[e[2]] if dims is not None and -len(dims) <= e[2] < len(dims) else None
    return d if isinstance(d, int) else None


def _lin_add(a, b):
    terms = dict(a[1])
    for k, c in b[1]:
        if k in terms:
            if not (isinstance(c, int) and isinstance(terms[k], int)):
                raise _NotKeyPadding("the mask's index arithmetic adds two symbolic factors")
            terms[k] += c
            if terms[k] == 0:
                del terms[k]
        else:
            terms[k] = c
    return ("lin", tuple(sorted(terms.items())), a[2] + b[2])


def _lin_scale(a, factor):
    if isinstance(factor, int):
        return ("lin", tuple((k, c * factor) for k, c in a[1] if c * factor), a[2] * factor)
    if a[2] != 0 or any(c != 1 for _, c in a[1]):
        raise _NotKeyPadding("the mask's index arithmetic scales a sum by a length")
    return ("lin", tuple((k, factor) for k, _ in a[1]), 0)


def read_key_padding(keep: ir.Value, opsets) -> KeyPadding | str:
    """keep[b, n, s, t] (right-aligned to rank 4) is bool(m[b, t]) of a 2-D graph input m, and t <= s
    where causal: the facts, or the reason it is not read so."""
    reader = _Reader(opsets)
    reader.read = _with_scalars(reader)
    try:
        sym = reader.read(keep)
        if sym.rank > 4:
            raise _NotKeyPadding(f"the mask has rank {sym.rank}")
        sym = _aligned(sym, 4)
        expr = _as_bool(sym.expr)
        terms = expr[1] if expr[0] == "and" else (expr,)
        mask_terms = [e for e in terms if e[0] == "mask"]
        causal = [e for e in terms if e[0] == "le"]
        if len(mask_terms) != 1 or len(causal) + 1 != len(terms) or len(causal) > 1:
            raise _NotKeyPadding("the mask is not key padding (and a causal factor)")
        (_, b, t, _raw), = mask_terms
        if b == ("lin", (), 0) and _batch_of_one(reader.mask, opsets):
            b = ("lin", ((0, 1),), 0)  # (axis 0 has one row: its index is 0)
        if b != ("lin", ((0, 1),), 0) or t != ("lin", ((3, 1),), 0):
            raise _NotKeyPadding("the mask is not read at [batch, key]")
        if causal and causal[0] != ("le", ("lin", ((3, 1),), 0), ("lin", ((2, 1),), 0)):
            raise _NotKeyPadding("the mask's position factor is not causal (key <= query)")
        # the key range spans the mask's keys (proven); the batch range and a causal query range are
        # refused where they provably do not span the mask's batch / keys (a static length that differs:
        # broadcasting would repeat one row). A batch range read from the activations' shape, whose
        # name inference lost (BERT's position embedding), is taken as the batch: a range of 1 there
        # at run time while the scores have more rows is the one case this does not prove.
        mask = reader.mask
        spans = [(3, ("dim", mask, 1), True), (0, ("dim", mask, 0), False)]
        spans += [(2, ("dim", mask, 1), False)] if causal else []
        for axis, want, strict in spans:
            have = sym.extents.get(axis, 1)
            if axis == 0 and have == 1 and _batch_of_one(mask, opsets):
                continue
            if _same_extent(have, want, opsets):
                continue
            if strict or _static(have, opsets) is not None or _static(want, opsets) is not None:
                raise _NotKeyPadding("the mask's index ranges do not span its batch and keys")
        return KeyPadding(reader.mask, bool(causal))
    except _NotKeyPadding as exc:
        return str(exc)


def _with_scalars(reader: _Reader):
    """The reader's read, trying a value as a scalar length first (a dimension read from a Shape)."""
    plain = reader.read

    def read(value, depth=0):
        if value not in reader.memo:
            s = reader._scalar_or(value)
            if s is not None:
                reader.memo[value] = s
        return plain(value, depth)
    return read
