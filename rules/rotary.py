"""Rotary position embedding for onnxruntime (issue 30): ``x * cos + rotate_half(x) * sin`` becomes
com.microsoft RotaryEmbedding (targets ort-cpu and ort-cuda).

Matched by what it computes, rooted at the Neg of ``rotate_half(x) = Concat(-x[..., h/2:], x[..., :h/2])``
(the halves taken by two Slices or one Split on the last axis): that Concat times ``S``, plus ``x`` times
``C``, where ``C`` and ``S`` are [B, 1, S, h] views (Unsqueeze on axis 1) of [B', S, h] values that are
element-wise functions (Cos, Sin, Cast, Mul or Div by a scalar constant, Neg, Identity) of ``Concat(F, F)``
on the last axis: whatever F is, ``C[..., i] == C[..., i + h/2]`` (and S likewise), which is all the fused op
assumes. Partial rotary (Phi-3): ``x`` is the first ``rot`` dimensions of ``q`` and the result is concatenated
with the rest: the op takes ``q`` with ``rotary_embedding_dim = rot``. Interleaved rotary is not matched (none
of the architectures in docs/decoders.md has it).

The op reads its cos/sin from tables indexed by ``position_ids``. Rather than a table of positions 0..max
(whose length the graph does not say: onnxruntime refuses a position past it), the tables are the model's own
per-token values: ``C[b, s, :h/2]`` as row ``b * S + s`` (``position_ids = b * S + s``, built on the device:
ConstantOfShape, CumSum), or, where C has one row for every batch row (``B' == 1``), row ``s`` with
``position_ids = [0]`` (the op's offset form). The values are the same numbers the original multiplies by, so
the result is the original's up to the kernel's rounding of ``x*c - y*s`` (``exact=False``). One table pair is
built per cos/sin value (every layer reads it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Match, Op, Rule
from onnxopt.ir.shapes import infer
from onnxopt.rules._attention_parts import dim_through, rank_of
from onnxopt.rules._semantic import const_array, dtype_of, earlier, kernel, private, scalar, typed
from onnxopt.targets import ORT_CPU, ORT_CUDA

ORT = (ORT_CPU, ORT_CUDA)
_ELEMENTWISE = ("Cos", "Sin", "Cast", "Neg", "Identity")


def _ints(value: ir.Value | None) -> list[int] | None:
    a = const_array(value)
    return [int(v) for v in a.reshape(-1)] if a is not None and a.dtype.kind in "iu" else None


def _int_elements(value: ir.Value | None, m: Match, depth: int = 0) -> list[int | None] | None:
    """The integers of a small shape computation (constants, Shape, Gather, Unsqueeze/Squeeze/Reshape/Cast,
    integer Add/Sub/Mul/Div, Concat), the dimensions it reads found by ``_dim`` (None for an element that
    reads an unknown one); None where the computation is not one of these."""
    found = _ints(value)
    if found is not None or value is None or depth > 8:
        return found
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op, ins = node.op_type, node.inputs
    if op == "Shape":
        rank = rank_of(ins[0], m.opsets)
        if rank is None:
            return None
        start, end = (node.attributes.get(k) for k in ("start", "end"))
        lo = 0 if start is None else start.value % rank if start.value < 0 else min(start.value, rank)
        hi = rank if end is None else end.value % rank if end.value < 0 else min(end.value, rank)
        return [d if isinstance(d, int) else None for d in (dim_through(ins[0], k, m.opsets) for k in range(lo, hi))]
    if op in ("Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity"):
        return _int_elements(ins[0], m, depth + 1)
    if op == "Gather":
        data, idx = _int_elements(ins[0], m, depth + 1), _ints(ins[1])
        axis = node.attributes.get("axis")
        if data is None or idx is None or (axis is not None and axis.value != 0):
            return None
        return [data[i] for i in idx] if all(-len(data) <= i < len(data) for i in idx) else None
    if op in ("Add", "Sub", "Mul", "Div") and len(ins) == 2:
        a, b = (_int_elements(v, m, depth + 1) for v in ins)
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        a, b = (x * n if len(x) == 1 else x for x in (a, b))
        if op == "Div" and 0 in b:
            return None
        f = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
             "Div": lambda x, y: int(x / y)}[op]  # (onnx's integer Div truncates toward zero)
        return [None if x is None or y is None else f(x, y) for x, y in zip(a, b)]
    if op == "Concat":
        parts = [_int_elements(v, m, depth + 1) for v in ins]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    return None


def _is(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _half(value: ir.Value, m: Match):
    """(x, "first"|"second", h, node) where ``value`` is the first or second half of ``x``'s last axis (a
    Slice, or an output of a Split into two equal parts), else None."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    x = node.inputs[0]
    rank = rank_of(x, m.opsets)
    h = dim_through(x, -1, m.opsets) if rank else None
    if not isinstance(h, int) or h % 2:
        return None
    if node.op_type == "Slice":
        bounds = _last_axis_slice(node, rank, m)
        if bounds is None:
            return None
        start, end = bounds[0] % h if bounds[0] < 0 else bounds[0], bounds[1]
        if start == 0 and end == h // 2:
            return x, "first", h, node
        if start == h // 2 and end >= h:
            return x, "second", h, node
        return None
    if node.op_type == "Split" and len(node.outputs) == 2:
        axis = node.attributes.get("axis")
        axis = 0 if axis is None else axis.value
        if axis % rank != rank - 1:
            return None
        sizes = _ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if sizes is None and node.attributes.get("split") is not None:
            sizes = list(node.attributes["split"].value)
        if sizes not in (None, [h // 2, h // 2]):
            return None
        return x, ("first", "second")[value.index()], h, node
    return None


def _last_axis_slice(node: ir.Node, rank: int, m: Match) -> tuple[int, int] | None:
    """(start, end) of a Slice on the last axis of a rank-``rank`` value, step 1, its bounds constants or
    computed from dimensions ``_dim`` finds (``x.shape[-1] // 2``)."""
    if len(node.inputs) < 4 or node.inputs[3] is None:
        return None
    starts, ends = (_int_elements(node.inputs[k], m) for k in (1, 2))
    starts, ends = (None if v is None or None in v else v for v in (starts, ends))
    axes = _ints(node.inputs[3])
    steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if None in (starts, ends, axes, steps) or len(starts) != 1 or steps != [1] or axes[0] % rank != rank - 1:
        return None
    return starts[0], ends[0]


def _sole_reader(value: ir.Value, graph: ir.Graph, op: str) -> ir.Node | None:
    if not private(value, graph):
        return None
    node = next(iter(value.uses())).node
    return node if _is(node, op) else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def _periodic(view: ir.Value, h: int, m: Match):
    """(the [B', S, h] value, the nodes between) where ``view`` is its Unsqueeze on axis 1 and it is an
    element-wise function of ``Concat(F, F)`` on the last axis; else the reason."""
    unsq = view.producer()
    if not _is(unsq, "Unsqueeze"):
        return "cos/sin is not an Unsqueeze of a [batch, sequence, head] value"
    axes = _ints(unsq.inputs[1]) if len(unsq.inputs) > 1 else list(unsq.attributes["axes"].value) \
        if unsq.attributes.get("axes") is not None else None
    table = unsq.inputs[0]
    if axes != [1] or rank_of(table, m.opsets) != 3 or dim_through(table, -1, m.opsets) != h:
        return "cos/sin is not an Unsqueeze on axis 1 of a [batch, sequence, head] value"
    value = table
    for _ in range(8):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            break
        if node.op_type in _ELEMENTWISE:
            value = node.inputs[0]
            continue
        if node.op_type in ("Mul", "Div") and scalar(node.inputs[1]) is not None:
            value = node.inputs[0]
            continue
        if node.op_type == "Mul" and scalar(node.inputs[0]) is not None:
            value = node.inputs[1]
            continue
        if node.op_type == "Concat" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
            axis = node.attributes["axis"].value
            if axis in (-1, 2):
                return table
        break
    return "cos/sin is not an element-wise function of Concat(F, F) on the last axis (so not half-periodic)"


def _same_dim(a, b) -> bool:
    return a == b if isinstance(a, int) or isinstance(b, int) else (a is not None and str(a) == str(b))


def rotary_match(m: Match):
    """What ``x * cos + rotate_half(x) * sin`` rooted at ``m.root`` (the Neg) is, or the reason it is not
    one: {"q" (the rotated [B, N, S, h] value, the whole head for partial rotary), "cos"/"sin" (the
    [B', S, h'] values), "rot", "head", "heads", "shared" (B' == 1), "dtype", "nodes" (what the rewrite
    replaces), "out" (the value it gives)}. Shared with rules/standard_rotary.py; the fused op's own
    checks (kernel, opset) are the caller's."""
    neg, graph = m.root, m.graph
    got = _half(neg.inputs[0], m)
    if got is None or got[1] != "second":
        src = neg.inputs[0].producer()
        if _is(src, "Slice") and any((_int_elements(v, m) or [None])[0] is None for v in src.inputs[1:4]
                                     if v is not None):
            return ("the Neg reads a Slice whose bounds are computed from a shape not known here, so not proven "
                    "the second half")
        return "the Neg does not read the second half of a value's last axis"
    x, _, h, slice_2 = got
    rank = rank_of(x, m.opsets)  # (known: _half read its last dimension)
    cat = _sole_reader(neg.outputs[0], graph, "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not neg.outputs[0] \
            or cat.attributes["axis"].value % rank != rank - 1:
        return "the negated half is not the first part of a Concat on the last axis (rotate_half)"
    first = _half(cat.inputs[1], m)
    if first is None or first[1] != "first" or first[0] is not x:
        return "the Concat's second part is not the first half of the same value"
    slice_1 = first[3]
    mul_s = _sole_reader(cat.outputs[0], graph, "Mul")
    if mul_s is None:
        return "rotate_half(x) is not multiplied by sin"
    s_view = _other(mul_s, cat.outputs[0])
    add = _sole_reader(mul_s.outputs[0], graph, "Add")
    if add is None:
        return "rotate_half(x) * sin is not added to x * cos"
    c_prod = _other(add, mul_s.outputs[0])
    mul_c = c_prod.producer() if c_prod is not None else None
    if not _is(mul_c, "Mul") or not private(c_prod, graph) or x not in mul_c.inputs:
        return "x * cos is not the other term"
    c_view = _other(mul_c, x)
    c3, s3 = _periodic(c_view, h, m), _periodic(s_view, h, m)
    for t in (c3, s3):
        if isinstance(t, str):
            return t
    if rank != 4:
        return f"x has rank {rank}, not 4 ([batch, heads, sequence, head])"
    out, q, rot = add.outputs[0], x, h
    nodes = [neg, cat, mul_s, mul_c, add]
    halves = list(dict.fromkeys((slice_2, slice_1)))  # (ordered: the rewrite's node order, and so its bytes)
    # partial rotary: x = q[..., :rot], the result concatenated with q[..., rot:]
    tail = _sole_reader(add.outputs[0], graph, "Concat")
    xs = x.producer()
    if tail is not None and len(tail.inputs) == 2 and tail.inputs[0] is add.outputs[0] and _is(xs, "Slice") \
            and tail.attributes["axis"].value % 4 == 3:
        full = xs.inputs[0]
        rest = tail.inputs[1].producer()
        width = dim_through(full, -1, m.opsets) if rank_of(full, m.opsets) == 4 else None
        width = width if isinstance(width, int) else None
        head, pass_ = _last_axis_slice(xs, 4, m), _last_axis_slice(rest, 4, m) if _is(rest, "Slice") else None
        if width is not None and width > h and head == (0, h) and pass_ is not None and rest.inputs[0] is full \
                and pass_[0] == h and pass_[1] >= width:
            out, q, rot = tail.outputs[0], full, h
            nodes += [tail]
            halves += [n for n in (xs, rest) if n not in halves]
    # the halves' Slices/Split go when only this expression reads them
    for node in halves:
        if all(u.node in nodes or u.node in halves for o in node.outputs for u in o.uses()):
            nodes.append(node)
    dims = [dim_through(q, k, m.opsets) for k in range(4)]
    tdims = [dim_through(c3, k, m.opsets) for k in range(3)]
    sdims = [dim_through(s3, k, m.opsets) for k in range(3)]
    if not _same_dim(tdims[1], dims[2]):
        return "cos/sin's sequence dimension is not proven to be x's (positions computed inside the model)"
    if tdims[0] == 1:
        shared = True
    elif _same_dim(tdims[0], dims[0]):
        shared = False
    else:
        return "cos/sin's batch dimension is not proven to be 1 or x's"
    if not _same_dim(sdims[0], tdims[0]) or not _same_dim(sdims[1], tdims[1]):
        return "cos and sin differ in shape"
    dtype = dtype_of(q, m.opsets)
    if dtype is None or dtype_of(c3, m.opsets) != dtype or dtype_of(s3, m.opsets) != dtype:
        return "x, cos and sin differ in element type (or it is unknown)"
    heads = dims[1] if isinstance(dims[1], int) else None
    return {"q": q, "cos": c3, "sin": s3, "rot": rot, "head": dims[3] if isinstance(dims[3], int) else None,
            "shared": shared, "heads": heads, "dtype": dtype, "nodes": tuple(dict.fromkeys(nodes)), "out": out,
            "dims": dims}


def _condition(m: Match):
    found = rotary_match(m)
    if isinstance(found, str):
        return found
    dtype = found["dtype"]
    target = m.options.get("target", ORT_CPU)
    has = kernel("RotaryEmbedding", "com.microsoft", 1, target, dtype)
    if target == ORT_CUDA and dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        has = True  # (onnxruntime-gpu registers these; the installed build may be the CPU one)
    if has is False or (has is None and dtype != ir.DataType.FLOAT):
        return f"no RotaryEmbedding kernel for {dtype.name.lower()} on {target}"
    if m.opset("") < 15:
        return f"the model imports opset {m.opset('')}: the row index needs Shape's start/end (opset 15)"
    q, dims, rot = found["q"], found["dims"], found["rot"]
    if rot != dims[3] and not isinstance(dims[1], int):
        return ("partial rotary: the head count is not known here (onnxruntime's RotaryEmbedding needs num_heads "
                "with rotary_embedding_dim)")
    m.nodes = found["nodes"]
    m.outputs = [found["out"]]
    # num_heads where the recorded shape says it, or partial rotary needs it (onnxruntime refuses it missing)
    recorded = infer(q, m.opsets)
    heads = dims[1] if isinstance(dims[1], int) and (rot != dims[3] or isinstance(recorded[1], int)) else None
    return {**{k: found[k] for k in ("q", "cos", "sin", "rot", "head", "shared")}, "heads": heads}


def _table(m: Match, b, value: ir.Value, half: int) -> ir.Value:
    """``value[..., :half]`` as a [rows, half] table (built once per value)."""
    name = f"{value.name}_rotary_table"
    found = earlier(m, name)
    if found is not None:
        return found
    cut = b.op("Slice", value, b.const(np.array([0], np.int64), "zero"), b.const(np.array([half], np.int64), "half"),
               b.const(np.array([-1], np.int64), "last"))
    return b.name(b.op("Reshape", cut, b.const(np.array([-1, half], np.int64), "rows_by_half")), name)


def _rows(m: Match, b, value: ir.Value) -> ir.Value:
    """position_ids for per-token tables: ``b * S + s`` as [B, S] int64 (built on the device, once), or
    ``[0]`` where the table has one row per position for every batch row."""
    if m.plan["shared"]:
        return b.const(np.array([0], np.int64), "rotary_offset")
    name = f"{value.name}_rotary_rows"
    found = earlier(m, name)
    if found is not None:
        return found
    bs = b.op("Shape", value, start=0, end=2)
    ones = b.op("ConstantOfShape", bs, value=ir.tensor(np.array([1], np.int64)))
    flat = b.op("Reshape", ones, b.const(np.array([-1], np.int64), "flat"))
    count = b.op("CumSum", flat, b.const(np.array(0, np.int64), "axis0"))
    index = b.op("Sub", count, b.const(np.array(1, np.int64), "one"))
    return b.name(b.op("Reshape", index, bs), name)


def _replace(m: Match, b):
    p = m.plan
    half = p["rot"] // 2
    attrs = {"interleaved": 0}
    if p["head"] is not None and p["rot"] != p["head"]:
        attrs["rotary_embedding_dim"] = p["rot"]
    if p["heads"] is not None:
        attrs["num_heads"] = p["heads"]
    y = b.op("RotaryEmbedding", p["q"], _rows(m, b, p["cos"]), _table(m, b, p["cos"], half),
             _table(m, b, p["sin"], half), domain="com.microsoft", **attrs)
    # the op's output has its input's type and shape (the matched Add's may be less known: a legacy export's)
    return typed(y, p["q"], m)


RULES = [
    Rule("rotary_embedding", Op("Neg", "x2"), _replace, condition=_condition, targets=ORT, benefit="rotary_embedding",
         exact=False,
         doc="x * cos + Concat(-x[..., h/2:], x[..., :h/2]) * sin (cos and sin half-periodic: element-wise functions "
             "of Concat(F, F)), with partial rotary's pass-through, becomes com.microsoft RotaryEmbedding reading the "
             "model's own per-token cos/sin as its tables."),
]
