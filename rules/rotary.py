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
from onnxopt.ir.shapes import infer, scalar_element, shape_elements
from onnxopt.rules._semantic import const_array, dtype_of, earlier, kernel, private, scalar, typed
from onnxopt.targets import ORT_CPU, ORT_CUDA

ORT = (ORT_CPU, ORT_CUDA)
_ELEMENTWISE = ("Cos", "Sin", "Cast", "Neg", "Identity")


def _ints(value: ir.Value | None) -> list[int] | None:
    a = const_array(value)
    return [int(v) for v in a.reshape(-1)] if a is not None and a.dtype.kind in "iu" else None


def _is(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _half(value: ir.Value, m: Match):
    """(x, "first"|"second", h, node) where ``value`` is the first or second half of ``x``'s last axis (a
    Slice, or an output of a Split into two equal parts), else None."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    x = node.inputs[0]
    shape = infer(x, m.opsets)
    h = _dim(x, -1, m) if shape is not None and len(shape) >= 1 else None
    if h is None or h % 2:
        return None
    rank = len(shape)
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


_INT_ARITHMETIC = {"Add": lambda a, c: a + c, "Sub": lambda a, c: a - c, "Mul": lambda a, c: a * c,
                   "Div": lambda a, c: a // c if c and a % c == 0 else None}  # (ONNX's integer Div truncates)


def _bound(value: ir.Value | None, m: Match | None, depth: int = 0) -> list[int] | None:
    """A Slice bound as ints: a constant, or shape arithmetic on dimensions inference knows (a legacy
    export's ``x[..., x.shape[-1] // 2:]`` is ``Unsqueeze(Div(Gather(Shape(x), 3), 2))``; Phi-3's
    ``q[..., :cos.shape[-1]]``): Unsqueeze of a scalar, Gather of a dimension through Shape, and integer
    Add/Sub/Mul/Div (exact division only) of such scalars."""
    got = _ints(value)
    if got is not None or m is None or value is None or depth > 6:
        return got
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Unsqueeze":
        inner = _bound(node.inputs[0], m, depth + 1)
        return inner if inner is not None and len(inner) == 1 else None
    if node.op_type in _INT_ARITHMETIC and len(node.inputs) == 2:
        a, c = (_bound(v, m, depth + 1) for v in node.inputs)
        if a is None or c is None or len(a) != 1 or len(c) != 1:
            return None
        r = _INT_ARITHMETIC[node.op_type](a[0], c[0])
        return None if r is None else [r]
    element = scalar_element(value)
    if element is None:
        elements = shape_elements(value)
        element = elements[0] if elements is not None and len(elements) == 1 else None
    if isinstance(element, int):
        return [element]
    if element is None:
        return None
    _, of, k = element
    size = _dim(of, k, m, depth + 1)
    return None if size is None else [size]


def _dim(value: ir.Value, k: int, m: Match, depth: int = 0) -> int | None:
    """Dimension ``k`` of ``value`` as an int: inferred, or, where inference has only a symbol (onnx's fresh
    ``unk__N`` for a dimension it could not compute: a Slice whose bound was computed), read through a
    Transpose, a Reshape of constant target, or the length a Slice with known bounds on that axis leaves of
    a known dimension (Phi-3's ``q[..., :rotary_dim]``, ``rotary_dim = cos.shape[-1]``)."""
    shape = infer(value, m.opsets)
    if shape is None or not -len(shape) <= k < len(shape):
        return None
    if isinstance(shape[k], int):
        return shape[k]
    node = value.producer()
    rank = len(shape)
    if _is(node, "Transpose") and depth <= 6:
        perm = node.attributes.get("perm")
        return _dim(node.inputs[0], perm.value[k % rank], m, depth + 1) if perm is not None else None
    if _is(node, "Reshape") and depth <= 6:
        return _reshaped_dim(node, k % rank, rank, m, depth + 1)
    if not _is(node, "Slice") or depth > 6 or len(node.inputs) < 4 or node.inputs[3] is None:
        return None
    starts, ends, axes = (_bound(node.inputs[i], m, depth + 1) for i in (1, 2, 3))
    steps = _bound(node.inputs[4], m, depth + 1) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if None in (starts, ends, axes, steps) or len(axes) != 1 or steps != [1] or axes[0] % rank != k % rank:
        return None
    full = _dim(node.inputs[0], k, m, depth + 1)
    if full is None:
        return None
    start, end = (max(0, min(full, b + full if b < 0 else b)) for b in (starts[0], ends[0]))
    return max(0, end - start)


def _sym(value: ir.Value, k: int, m: Match, depth: int = 0):
    """Dimension ``k`` of ``value``: an int, or the name of the symbol it is, read through Transposes,
    Reshapes (a target element that is a dimension read through Shape is that dimension) and Slices of
    other axes before inference's own answer (which names a dimension it could not compute with a fresh
    ``unk__N``); None when unknown."""
    shape = infer(value, m.opsets)
    if shape is None or not -len(shape) <= k < len(shape):
        return None
    rank, k = len(shape), k % len(shape)
    inferred = shape[k] if isinstance(shape[k], int) else str(shape[k]) if _known(shape[k]) else None
    node = value.producer()
    if isinstance(inferred, int) or depth > 8 or node is None:
        return inferred
    got = None
    if _is(node, "Transpose") and node.attributes.get("perm") is not None:
        got = _sym(node.inputs[0], node.attributes["perm"].value[k], m, depth + 1)
    elif _is(node, "Reshape"):
        elements = shape_elements(node.inputs[1])
        e = elements[k] if elements is not None and len(elements) == rank else None
        if isinstance(e, tuple):
            got = _sym(e[1], e[2], m, depth + 1)
        elif e == -1:
            got = _reshaped_dim(node, k, rank, m, depth + 1)
        elif isinstance(e, int) and e > 0:
            got = e
    elif _is(node, "Slice") and len(node.inputs) > 3 and node.inputs[3] is not None:
        axes = _ints(node.inputs[3])
        if axes is not None and all(a % rank != k for a in axes):
            got = _sym(node.inputs[0], k, m, depth + 1)
    return got if got is not None else inferred


def _reshaped_dim(node: ir.Node, k: int, rank: int, m: Match, depth: int) -> int | None:
    """Dimension ``k`` of a Reshape's output: its target's element k where that is a number, or, for the -1
    (transformers' ``view(*input_shape, -1, head_dim)``), the input's size over the target's other elements,
    where their symbols (dimensions read through Shape, or copied by a 0) cancel the input's."""
    elements = shape_elements(node.inputs[1])
    if elements is None or len(elements) != rank:
        return None
    e = elements[k]
    if isinstance(e, int) and e > 0:
        return e
    src = infer(node.inputs[0], m.opsets)
    if e != -1 or src is None:
        return None

    def size(of, j):
        got = _dim(of, j, m, depth + 1)
        if got is not None:
            return got
        d = (infer(of, m.opsets) or [None] * (j + 1))[j]
        return str(d) if _known(d) else None

    num = [size(node.inputs[0], j) for j in range(len(src))]
    den = [size(x[1], x[2]) if isinstance(x, tuple) else num[j] if x == 0 and j < len(num) else x
           for j, x in enumerate(elements) if j != k]
    if any(d is None for d in num + den):
        return None
    symbols = [d for d in num if isinstance(d, str)]
    for d in den:
        if isinstance(d, str):
            if d not in symbols:
                return None
            symbols.remove(d)
    if symbols:
        return None
    top = int(np.prod([d for d in num if isinstance(d, int)]))
    bottom = int(np.prod([d for d in den if isinstance(d, int)]))
    return top // bottom if bottom > 0 and top % bottom == 0 else None


def _last_axis_slice(node: ir.Node, rank: int, m: Match | None = None) -> tuple[int, int] | None:
    """(start, end) of a Slice on the last axis of a rank-``rank`` value, step 1, its bounds constants (or,
    with ``m``, shape arithmetic on known dimensions: ``_bound``)."""
    if len(node.inputs) < 4 or node.inputs[3] is None:
        return None
    starts, ends, axes = (_bound(node.inputs[k], m) for k in (1, 2, 3))
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
    shape = infer(table, m.opsets)
    if axes != [1] or shape is None or len(shape) != 3 or shape[-1] != h:
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


def _known(d) -> bool:
    return isinstance(d, int) or (d is not None and getattr(d, "value", d) is not None)


def _expand_batch(node: ir.Node, m: Match):
    """The first dimension an Expand's target gives: its first element, read as ``shape_elements`` reads it,
    or through torch's ``expand(-1, ...)`` (``Where(Equal(t, c), fill, t)``: a dimension read from a shape is
    never negative, so against a negative ``c[0]`` it is kept); None when not known."""
    target = node.inputs[1] if len(node.inputs) > 1 else None
    elements = shape_elements(target)
    where = target.producer() if target is not None and elements is None else None
    if _is(where, "Where") and len(where.inputs) == 3:
        cond, fill, t = where.inputs
        eq = cond.producer()
        cs, fs = _ints(eq.inputs[1]) if _is(eq, "Equal") and eq.inputs[0] is t else None, _ints(fill)
        elements = shape_elements(t)
        if not cs or not fs or not elements:
            return None
        first = elements[0]
        if isinstance(first, int):
            elements = [fs[0] if first == cs[0] else first]
        elif cs[0] < 0:
            elements = [first]
        else:
            return None
    if not elements:
        return None
    first = elements[0]
    if isinstance(first, int):
        return first
    _, value, k = first
    shape = infer(value, m.opsets)
    return shape[k] if shape is not None and -len(shape) <= k < len(shape) and _known(shape[k]) else None


def _batch_dim(value: ir.Value, m: Match, depth: int = 0):
    """``value``'s first dimension, read through what cos/sin tables are built of: element-wise ops,
    Unsqueeze/Squeeze of other axes, Concat on another axis, a Transpose keeping axis 0, a batched MatMul
    (its operands' batch dimensions equal, or one of them 1) and an Expand of a batch of 1 (transformers 4.x:
    ``inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :]``, whose batch
    an exporter's shape inference names with a fresh symbol); else the inferred dimension where it is known;
    None when neither says."""
    shape = infer(value, m.opsets)
    if shape is None or len(shape) == 0:
        return None
    inferred = shape[0] if _known(shape[0]) else None
    node = value.producer()
    if isinstance(inferred, int) or node is None or depth > 12 or node.domain not in ("", "ai.onnx"):
        return inferred
    op, rank = node.op_type, len(shape)
    got = None
    if op in _ELEMENTWISE or op in ("Mul", "Div") and scalar(node.inputs[1]) is not None:
        got = _batch_dim(node.inputs[0], m, depth + 1)
    elif op == "Mul" and scalar(node.inputs[0]) is not None:
        got = _batch_dim(node.inputs[1], m, depth + 1)
    elif op in ("Unsqueeze", "Squeeze"):
        axes = _ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if axes and all(a > 0 for a in axes):
            got = _batch_dim(node.inputs[0], m, depth + 1)
    elif op == "Concat" and node.attributes["axis"].value % rank != 0:
        parts = [_batch_dim(v, m, depth + 1) for v in node.inputs]
        got = parts[0] if all(p is not None and _same_dim(p, parts[0]) for p in parts) else None
    elif op == "Transpose":
        perm = node.attributes.get("perm")
        got = _batch_dim(node.inputs[0], m, depth + 1) if perm is not None and perm.value[0] == 0 else None
    elif op == "MatMul" and rank >= 3 and all(len(infer(v, m.opsets) or ()) == rank for v in node.inputs):
        a, c = (_batch_dim(v, m, depth + 1) for v in node.inputs)
        if a is not None and c is not None:
            got = c if a == 1 else a if c == 1 or _same_dim(a, c) else None
    elif op == "Expand":
        inner = infer(node.inputs[0], m.opsets)
        first = _expand_batch(node, m)
        if inner is not None and len(inner) == rank and first is not None:
            got = first if inner[0] == 1 else inner[0] if first == 1 else first if _same_dim(inner[0], first) else None
    return got if got is not None else inferred


def _condition(m: Match):
    neg, graph = m.root, m.graph
    got = _half(neg.inputs[0], m)
    if got is None or got[1] != "second":
        src = neg.inputs[0].producer()
        if _is(src, "Slice") and any(_bound(v, m) is None for v in src.inputs[1:4] if v is not None):
            return ("the Neg reads a Slice whose bounds are computed from a shape not known here, so not proven "
                    "the second half")
        return "the Neg does not read the second half of a value's last axis"
    x, _, h, slice_2 = got
    rank = len(infer(x, m.opsets))  # (known: _half read its last dimension)
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
        fshape = infer(full, m.opsets)
        width = _dim(full, -1, m) if fshape is not None and len(fshape) == 4 else None
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
    dims = list(infer(q, m.opsets))
    dims[0], dims[2] = _sym(q, 0, m), _sym(q, 2, m)
    tdims = list(infer(c3, m.opsets))
    sdims = list(infer(s3, m.opsets))
    if not _same_dim(tdims[1], dims[2]):
        return "cos/sin's sequence dimension is not proven to be x's (positions computed inside the model)"
    tdims[0], sdims[0] = _batch_dim(c3, m), _batch_dim(s3, m)
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
    target = m.options.get("target", ORT_CPU)
    has = kernel("RotaryEmbedding", "com.microsoft", 1, target, dtype)
    if target == ORT_CUDA and dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        has = True  # (onnxruntime-gpu registers these; the installed build may be the CPU one)
    if has is False or (has is None and dtype != ir.DataType.FLOAT):
        return f"no RotaryEmbedding kernel for {dtype.name.lower()} on {target}"
    if m.opset("") < 15:
        return f"the model imports opset {m.opset('')}: the row index needs Shape's start/end (opset 15)"
    heads, head = _dim(q, 1, m), _dim(q, 3, m)
    if head is None or rot != head and heads is None:
        return ("partial rotary: the head count is not known here (onnxruntime's RotaryEmbedding needs num_heads "
                "with rotary_embedding_dim)" if head is not None else "x's head size is not known here")
    m.nodes = tuple(dict.fromkeys(nodes))
    m.outputs = [out]
    return {"q": q, "cos": c3, "sin": s3, "rot": rot, "head": head, "shared": shared, "heads": heads}


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
