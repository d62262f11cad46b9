"""Shape and data-movement ops that change nothing, chains of them, shapes that can be constants
(Transposes have their own family, rules/transpose.py), and shape vectors rewritten into the forms
onnxruntime's CUDA provider keeps on the GPU (Shape's own start/end read directly where a kernel takes
the vector in host memory; see the section "Shape vectors onnxruntime's CUDA provider reads in host
memory" below).

Exact: each rule keeps every value and every output's shape and dtype. Reshape targets built from
the input's own Shape (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``) are read back with
``onnxopt.ir.shapes.shape_elements``; a dimension the target copies becomes a 0 in a constant target.
That one, reshape_shape_from_input, is not exact in exact mode's sense (``Rule.exact``): a constant
target lets onnxruntime's own optimizer rewrite the graph around it differently (README, Exact mode).
The shape-vector rules compute the same int64 values (exact); expand_shape_from_input takes another
value's dimension for x's by their named symbol only outside exact mode.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Const, Match, Op, Opt, Or, Rule, forward
from onnxopt.ir.shapes import infer, is_dim_of, same_symbol, shape_elements, slice_positions
from onnxopt.ir.util import constant_tensor

from onnxopt.rules._exact import exact_removal
from onnxopt.rules._semantic import unsqueeze

_x = forward("x")
_NO_END = 1 << 62  # a Slice end this large means "to the end" whatever the axis' size


def _axes(m: Match, node: str, input_name: str) -> list[int] | None:
    """Squeeze/Unsqueeze axes from the input (opset 13+) or the attribute, sorted."""
    if input_name in m:
        return sorted(int(a) for a in m.const(input_name).reshape(-1))
    attr = m.attr(node, "axes")
    return None if attr is None else sorted(int(a) for a in attr)


# --- Reshape ------------------------------------------------------------------------------------


def reshape_chain_condition(m: Match):
    if m.attr("outer", "allowzero", 0) != 1 and np.any(m.const("shape") == 0):
        return "the outer shape copies dimensions (0) from its input"
    return None


def reshape_chain_replacement(m: Match, b):
    return b.op("Reshape", m["x"], m["shape"], attrs=m.node("outer").attributes.values())


def reshape_elimination_condition(m: Match):
    """Every target dimension is x's own (the same number, or 0 copying it), but for one -1, which
    then is x's dimension there too, a number or not ([-1, 6, 1, 1] of x [N, 6, 1, 1])."""
    dims = m.dims("x")
    if dims is None:
        return "rank unknown"
    target = list(m.const("shape").reshape(-1))
    if len(target) != len(dims):
        return "rank changes"
    allowzero = m.attr("reshape", "allowzero", 0) == 1
    for t, d in zip(target, dims):
        if (d is not None and t == d) or (t == 0 and not allowzero):
            continue
        if t == -1 and target.count(-1) == 1:
            continue
        return "input shape not static" if d is None else "shape changes"
    return None


def reshape_to_unsqueeze_condition(m: Match):
    """The plan: the axes an Unsqueeze inserts where the Reshape's target is x's dimensions in order
    (a number, 0 copying x's dimension at that position, or one -1 standing for one of x's) with 1s
    between them. Unsqueeze keeps the dimensions' symbols where a Reshape with -1 gives its output a
    new one, which keeps onnxruntime from seeing that two branches have the same batch (it then
    neither fuses a residual Add into a Conv nor broadcasts without Reshapes)."""
    dims = m.dims("x")
    if dims is None:
        return "rank unknown"
    target = [int(t) for t in m.const("shape").reshape(-1)]
    if len(target) <= len(dims):
        return "does not raise the rank"
    if target.count(-1) > 1:
        return "more than one -1"
    if 0 in target and m.attr("reshape", "allowzero", 0) == 1:
        return "allowzero with a 0"
    axes, i = [], 0
    for j, t in enumerate(target):
        d = dims[i] if i < len(dims) else "end"
        if d != "end" and ((d is not None and t == d) or (t == 0 and j == i) or t == -1):
            i += 1
        elif t == 1:
            axes.append(j)
        else:
            return "not x's dimensions with 1s between"
    if i != len(dims):
        return "not x's dimensions with 1s between"
    return axes


# Ops whose output keeps input 0's leading dimensions (all but the last): normalizations and activations
# over the last axis, and the fused attention ops (output [B, S, *] of the query's [B, S, *]).
_ROW_KEEPING = {("", "LayerNormalization"), ("com.microsoft", "SkipLayerNormalization"),
                ("com.microsoft", "SkipSimplifiedLayerNormalization"), ("", "RMSNormalization"),
                ("com.microsoft", "SimplifiedLayerNormalization"), ("com.microsoft", "FastGelu"),
                ("com.microsoft", "BiasGelu"), ("com.microsoft", "Attention"), ("com.microsoft", "MultiHeadAttention")}
# Ops whose output has input 0's shape (elementwise on one tensor).
_SAME_SHAPE = {("", "Relu"), ("", "Tanh"), ("", "Erf"), ("", "Sigmoid"), ("", "Gelu"), ("", "Cast"),
               ("", "Identity"), ("", "Not"), ("", "CumSum"), ("com.microsoft", "Gelu")}
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "And",
                 "Or"}
_WALK_LIMIT = 256


def _dim_source(v: ir.Value, j: int, element, opsets, budget: list[int]) -> bool:
    """Dimension j of v is provably the dimension ``element`` (a shape-vector element) reads: v (or a
    value it is computed from, dimension for dimension) has that dimension, or one with its named
    symbol. The walk goes back through ops that keep their input's leading dimensions
    (``_ROW_KEEPING``, and MatMul by a 2-D right operand, for every dimension but the last), ops that
    keep the shape (``_SAME_SHAPE``, Softmax), broadcasting ops (every operand that reaches dimension
    j proves it or has a static 1 there, at least one proves it), Unsqueeze (j not inserted) and
    Gather on axis 0 of a 2-D table (the indices' dimensions). Ranks must be known (inference may
    run); onnx's inference loses the symbols along a fused graph's rows, this walk does not need them."""
    while True:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if is_dim_of(element, v, j):
            return True
        node = v.producer()
        shape = infer(v, opsets)
        if node is None or shape is None or not node.inputs or node.inputs[0] is None:
            return False
        r = len(shape)
        if not 0 <= j < r:
            return False
        key = (node.domain or "", node.op_type)
        if key in _SAME_SHAPE or (key == ("", "Softmax") and node.attributes.get_int("axis", -1) in (-1, r - 1)):
            v = node.inputs[0]
        elif key in _ROW_KEEPING or key == ("", "MatMul"):
            if j >= r - 1:
                return False
            if key == ("", "MatMul"):
                w = node.inputs[1]
                if w is None or w.shape is None or len(w.shape) != 2:
                    return False
            v = node.inputs[0]
        elif key[0] == "" and key[1] in _BROADCASTING:
            proven = False
            for operand in node.inputs:
                ds = infer(operand, opsets) if operand is not None else None
                if ds is None:
                    return False
                k = j - (r - len(ds))
                if k < 0:
                    continue  # this operand does not reach dimension j
                if isinstance(ds[k], int) and ds[k] == 1:
                    continue
                if not _dim_source(operand, k, element, opsets, budget):
                    return False
                proven = True
            return proven
        elif key == ("", "Unsqueeze"):
            axes = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None \
                else None
            axes = node.attributes.get_ints("axes", None) if axes is None else axes.numpy().tolist()
            if axes is None:
                return False
            axes = [int(a) % r for a in axes]
            if j in axes:
                return False
            j -= sum(1 for a in axes if a < j)
            v = node.inputs[0]
        elif key == ("", "Reshape"):
            elements = shape_elements(node.inputs[1]) if len(node.inputs) > 1 else None
            if elements is None or len(elements) != r or node.attributes.get_int("allowzero", 0) != 0:
                return False
            e = elements[j]
            if isinstance(e, int):
                if e != 0:
                    return False
                x_shape = infer(node.inputs[0], opsets)  # 0 copies the input's dimension j
                if x_shape is None or j >= len(x_shape):
                    return False
                v = node.inputs[0]
            else:
                v, j = e[1], e[2]
        elif key == ("", "Range"):
            start, delta = (constant_tensor(node.inputs[i]) if len(node.inputs) > i else None for i in (0, 2))
            if start is None or delta is None or start.numpy().tolist() != 0 or delta.numpy().tolist() != 1:
                return False
            e = _scalar_element(node.inputs[1])
            if e is None or isinstance(e, int):
                return False
            v, j = e[1], e[2]
        elif key == ("", "ConstantOfShape"):
            elements = shape_elements(node.inputs[0])
            if elements is None or j >= len(elements) or isinstance(elements[j], int):
                return False
            v, j = elements[j][1], elements[j][2]
        elif key == ("", "Gather") and node.attributes.get_int("axis", 0) == 0:
            table = node.inputs[0]
            ids = node.inputs[1] if len(node.inputs) > 1 else None
            if ids is None or table.shape is None or len(table.shape) != 2 or j >= r - 1:
                return False
            v = ids
        else:
            return False


def _scalar_element(n: ir.Value | None):
    """The shape-vector element a scalar holds: a Gather of a shape vector at a constant scalar index,
    or a Squeeze of a one-element one; None otherwise."""
    node = None if n is None else n.producer()
    if node is None or node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
        return None
    if node.op_type == "Gather" and node.attributes.get_int("axis", 0) in (0, -1) and len(node.inputs) > 1:
        k = constant_tensor(node.inputs[1])
        elements = shape_elements(node.inputs[0])
        if k is None or elements is None or k.numpy().ndim != 0:
            return None
        k = int(k.numpy())
        return elements[k] if -len(elements) <= k < len(elements) else None
    if node.op_type == "Squeeze":
        elements = shape_elements(node.inputs[0])
        return elements[0] if elements is not None and len(elements) == 1 else None
    return None


def _own_dims_target(m: Match) -> list[int] | None:
    """The Reshape's target as constants, with 0 where it copies x's own dimension at the same
    position (the same value, or one with the same named symbol); None when it is built otherwise."""
    elements = shape_elements(m["shape"])
    if elements is None:
        return None
    x, dims = m["x"], m.dims("x")
    rank = None if dims is None else len(dims)
    out = []
    for j, e in enumerate(elements):
        if isinstance(e, int):
            if e == 0:
                return None  # a literal 0 already copies; keep the arithmetic simple
            out.append(e)
        elif rank is not None and j < rank and (is_dim_of(e, x, j)
                                                or _dim_source(x, j, e, m.opsets, [_WALK_LIMIT])):
            out.append(0)
        elif e[1].shape is not None and isinstance(e[1].shape[e[2]], int) and int(e[1].shape[e[2]]) > 0:
            out.append(int(e[1].shape[e[2]]))  # (a static 0 would read as "copy")
        else:
            return None
    return None if out.count(-1) > 1 else _without_minus_one(m, out)


def _without_minus_one(m: Match, target: list[int]) -> list[int]:
    """A -1 where the Reshape's output has a known size, or the symbol of x's dimension at that
    position, is that size or a copy (0): then no -1 is left to meet a copied 0 of a zero-sized
    dimension."""
    if -1 not in target:
        return target
    j = target.index(-1)
    out, dims = m.root.outputs[0], m.output_dims()
    if dims is None or len(dims) != len(target):
        return target
    if dims[j] is not None and dims[j] > 0:
        return target[:j] + [dims[j]] + target[j + 1:]
    x_dims = m.dims("x")
    if x_dims is not None and j < len(x_dims) and same_symbol(out, j, m["x"], j):
        return target[:j] + [0] + target[j + 1:]
    return target


def reshape_shape_from_input_condition(m: Match):
    if m["shape"].producer() is None:
        return "the shape is already a constant"
    target = _own_dims_target(m)
    if target is None:
        return "the shape is not built from constants and the input's own dimensions"
    if m.attr("reshape", "allowzero", 0) == 1 and -1 in target and 0 in target:
        # onnxruntime accepts 0 with -1 under allowzero=1 (the spec does not); allowzero=0 would not
        return "allowzero=1 with -1: a copied dimension of 0 would change meaning"
    return target  # the plan: the constant target


def reshape_shape_from_input_replacement(m: Match, b):
    # A 0 copies the dimension it stands for, which is the value the original computed, so the
    # new Reshape copies (allowzero 0) even where the original had allowzero=1 (it has no literal 0).
    attrs = [a for a in m.node("reshape").attributes.values() if a.name != "allowzero"]
    return b.op("Reshape", m["x"], b.const(np.array(m.plan, dtype=np.int64), name="shape"), attrs=attrs)


def flatten_elimination_condition(m: Match):
    dims = m.dims("x")
    if dims is None or len(dims) != 2 or m.attr("flatten", "axis", 1) not in (1, -1):
        return "not a 2-D input flattened at axis 1"
    return None


# --- Squeeze / Unsqueeze --------------------------------------------------------------------------


def squeeze_unsqueeze_condition(m: Match):
    inner, outer = _axes(m, "inner", "a1"), _axes(m, "outer", "a2")
    if inner is None or outer is None:
        return "axes not given"
    if any(a < 0 for a in inner + outer):
        return "negative axes"
    if inner != outer:
        return "different axes"
    return None


def unsqueeze_chain_condition(m: Match):
    """The plan: the axes of one Unsqueeze doing both."""
    a1, a2, dims = _axes(m, "inner", "a1"), _axes(m, "outer", "a2"), m.dims("x")
    if a1 is None or a2 is None or dims is None:
        return "axes or rank unknown"
    middle, final = len(dims) + len(a1), len(dims) + len(a1) + len(a2)
    a1 = sorted(a % middle for a in a1)
    a2 = sorted(a % final for a in a2)
    if len(set(a1)) != len(a1) or len(set(a2)) != len(a2):
        return "repeated axes"
    kept = [p for p in range(final) if p not in a2]  # the intermediate's axes, in the final tensor
    return sorted(set(a2) | {kept[a] for a in a1})


def unsqueeze_plan_replacement(m: Match, b):
    """Unsqueeze(x, the condition's axes)."""
    return unsqueeze(m, b, m["x"], m.plan)


# --- Expand, Slice, Pad, Concat, Split ----------------------------------------------------------------


def expand_elimination_condition(m: Match):
    dims = m.dims("x")
    if dims is None:
        return "input shape unknown"
    target = [int(s) for s in m.const("shape").reshape(-1)]
    if len(target) > len(dims):
        return "raises the rank"
    if not target and m.options.get("exact"):
        # (its ExpandElimination wants a target of at least one element; the Expand it keeps then
        # stands between the ops it would fuse, a MatMul and its bias Add)
        return "exact: onnxruntime does not remove an Expand to the empty shape itself"
    for t, d in zip(reversed(target), reversed(dims)):
        if t == 1 or (d is not None and t == d):
            continue
        return "expands"
    return None


def _slice_onnxruntime_keeps(m: Match, _verdict) -> bool:
    """onnxruntime's own slice elimination takes out a Slice whose every end is INT64_MAX (from
    0, step 1): exact mode needs no guard for that one."""
    return not bool(np.all(m.const("ends") == np.iinfo(np.int64).max))


def slice_elimination_condition(m: Match):
    starts, ends, steps = m.const("starts"), m.const("ends"), m.const("steps")
    if steps is not None and np.any(steps != 1):
        return "step is not 1"
    if np.any(starts != 0):
        return "does not start at 0"
    dims = m.dims("x")
    axes = m.const("axes") if "axes" in m else np.arange(len(ends))
    for axis, end in zip(axes.reshape(-1), ends.reshape(-1)):
        if end >= _NO_END:
            continue
        if dims is None or int(axis) >= len(dims) or int(axis) < -len(dims):
            return "cannot tell whether it covers the axis"
        d = dims[int(axis)]
        if d is None or end < d:
            return "cuts the axis"
    return None


def pad_elimination_condition(m: Match):
    return "pads" if np.any(m.const("pads") != 0) else None


def split_elimination_condition(m: Match):
    return "more than one output" if len(m.root.outputs) != 1 else None


# --- Range --------------------------------------------------------------------------------------


def range_scalar_inputs_condition(m: Match):
    """The plan: the inputs (start, limit, delta) that hold one element in a [1]-like shape."""
    one_element = [name for name in ("start", "limit", "delta")
                   if (dims := m.dims(name)) is not None and len(dims) > 0 and all(d == 1 for d in dims)]
    return one_element or "inputs are scalars or of unknown shape"


def range_scalar_inputs_replacement(m: Match, b):
    scalar = b.const(np.zeros((0,), dtype=np.int64), name="scalar_shape")
    inputs = [b.op("Reshape", m[name], scalar) if name in m.plan else m[name] for name in ("start", "limit", "delta")]
    return b.op("Range", *inputs)


# --- Shape vectors onnxruntime's CUDA provider reads in host memory ---------------------------------
# Shape's CUDA kernel writes its output to host memory. A node that reads it other than through an
# input its CUDA kernel takes in host memory (a Reshape's or Expand's shape, Slice's starts and ends,
# Range, ConstantOfShape, Tile's repeats...), and otherwise only small constants, is placed on the CPU,
# and so are the nodes reading that one (onnxruntime's GetCpuPreferredNodes; the static estimate is
# onnxopt.targets.advice.cuda_placement). Exporters pick dimensions with Gather, Squeeze, Unsqueeze,
# Slice and Concat of a Shape: each is such a node. Shape's own start and end (opset 15) pick a run of
# dimensions in the Shape node itself, so these rules rewrite the picking into it: the same int64
# values, one host-memory Shape read directly by the node that needs it.

_SHAPE_OPSET = 15  # Shape takes start and end from opset 15


def _shape_positions(node: ir.Node, rank: int) -> list[int]:
    """The dimensions (of a value of rank ``rank``) that Shape ``node`` returns, in order: its start and
    end as ONNX reads them (negative from the back, clamped to [0, rank])."""
    start, end = node.attributes.get("start"), node.attributes.get("end")
    return list(range(rank))[slice(start.value if start is not None else None, end.value if end is not None else None)]


def _rank(value: ir.Value, opsets) -> int | None:
    shape = infer(value, opsets)
    return None if shape is None else len(shape)


def _shape_vector(value: ir.Value, opsets) -> list | None:
    """shape_elements of ``value`` once the values its Shape nodes read have their shapes inferred
    (shape_elements needs their ranks, which the model may not record)."""
    _infer_shape_sources(value, opsets, 0)
    return shape_elements(value)


def _infer_shape_sources(value: ir.Value | None, opsets, depth: int) -> None:
    node = None if value is None or depth > 8 else value.producer()
    if node is None:
        return
    if node.op_type == "Shape":
        infer(node.inputs[0], opsets)
        return
    for v in node.inputs:
        _infer_shape_sources(v, opsets, depth + 1)


def _shape_of(b, x: ir.Value, start: int, end: int, rank: int) -> ir.Value:
    """Shape(x) of dimensions start..end-1, with start and end only where they pick less than all."""
    attrs = {}
    if start != 0:
        attrs["start"] = start
    if end != rank:
        attrs["end"] = end
    return b.op("Shape", x, **attrs)


def _picked_dim(m: Match) -> int | str:
    """The dimension of x the scalar holds (a Gather of x's Shape at a scalar index, or a Squeeze of a
    one-dimension slice of it), or why it cannot be told."""
    if m.opset("") < _SHAPE_OPSET:
        return f"opset {m.opset('')} < {_SHAPE_OPSET}, where Shape takes no start and end"
    dims = m.dims("x")
    if dims is None:
        return "the rank of the Shape's input is unknown"
    positions = _shape_positions(m.node("shape"), len(dims))
    if m.node("gather") is not None:
        if m.attr("gather", "axis", 0) not in (0, -1):
            return "the Gather is not along the shape vector's axis"
        k = m.const("k")
        if k.ndim != 0 or k.dtype.kind not in "iu":
            return "the Gather's index is not an integer scalar"
        k = int(k)
        if not -len(positions) <= k < len(positions):
            return f"index {k} is out of range of the {len(positions)} dimensions the Shape gives"
        return positions[k]
    if len(positions) != 1:
        return f"the Squeeze reads {len(positions)} dimensions, not one"
    axes = m.const("squeeze_axes") if "squeeze_axes" in m else None
    if axes is not None and axes.reshape(-1).tolist() not in ([0], [-1]):
        return "the Squeeze's axes are not [0]"
    return positions[0]


def _scalar_dim():
    """A scalar holding one dimension of x: Gather(Shape(x), k) (legacy exports) or
    Squeeze(Shape(x, k, k+1)) (dynamo's sym_size); both may have other readers."""
    shape = Op("Shape", "x", name="shape", shared=True)
    return Or(Op("Gather", shape, Const("k"), name="gather", shared=True),
              Op("Squeeze", shape, Opt(Const("squeeze_axes")), name="squeeze", shared=True))


def shape_dim_unsqueeze_condition(m: Match):
    axes = _axes(m, "vector", "axes")
    if axes not in ([0], [-1]):
        return "the Unsqueeze does not make the scalar a 1-D vector (axes [0])"
    return _picked_dim(m)


def shape_dim_reshape_condition(m: Match):
    if m.const("target").reshape(-1).tolist() not in ([-1], [1]):
        return "the Reshape does not make the scalar a 1-D vector of one element"
    return _picked_dim(m)


def shape_dim_replacement(m: Match, b):
    """Shape(x, start=k, end=k+1): the condition's dimension k as a one-element vector."""
    k = m.plan
    return _shape_of(b, m["x"], k, k + 1, len(m.dims("x")))


def shape_slice_to_attributes_condition(m: Match):
    """The plan: (start, end) of x's dimensions the Slice of its Shape picks."""
    if m.opset("") < _SHAPE_OPSET:
        return f"opset {m.opset('')} < {_SHAPE_OPSET}, where Shape takes no start and end"
    dims = m.dims("x")
    if dims is None:
        return "the rank of the Shape's input is unknown"
    parts = [m.const(n) if n in m else None for n in ("starts", "ends", "axes", "steps")]
    if any(p is not None and (p.size != 1 or p.dtype.kind not in "iu") for p in parts):
        return "not one integer start, end, axis and step"
    start, end = int(parts[0].reshape(-1)[0]), int(parts[1].reshape(-1)[0])
    if parts[2] is not None and int(parts[2].reshape(-1)[0]) not in (0, -1):
        return "not a slice along axis 0"
    if parts[3] is not None and int(parts[3].reshape(-1)[0]) != 1:
        return "step is not 1 (Shape takes no step)"
    positions = _shape_positions(m.node("shape"), len(dims))
    picked = [positions[i] for i in slice_positions(len(positions), start, end, 1)]
    if not picked:
        return "the slice is empty"
    return picked[0], picked[-1] + 1


def shape_slice_to_attributes_replacement(m: Match, b):
    start, end = m.plan
    return _shape_of(b, m["x"], start, end, len(m.dims("x")))


_CONCAT_INPUTS = 16  # the most inputs shape_concat_merge looks at (shape vectors are short)


def _pieces(m: Match) -> list[list]:
    """The Concat's inputs as pieces: ["dims", x, start, end, value] (a Shape of x: its run of
    dimensions), ["const", array, value] (a 1-D integer constant) or ["other", value]."""
    out = []
    for value in m.root.inputs:
        tensor = constant_tensor(value)
        node = value.producer()
        if tensor is not None and tensor.numpy().ndim == 1:
            out.append(["const", tensor.numpy(), value])
        elif node is not None and node.op_type == "Shape" and node.domain in ("", "ai.onnx") \
                and (rank := _rank(node.inputs[0], m.opsets)) is not None:
            positions = _shape_positions(node, rank)
            if positions:
                out.append(["dims", node.inputs[0], positions[0], positions[-1] + 1, value])
                continue
            out.append(["other", value])
        else:
            out.append(["other", value])
    return out


def shape_concat_merge_condition(m: Match):
    """The plan: the pieces of the new Concat, neighbouring runs of one x's dimensions merged into
    one Shape and neighbouring constants into one."""
    if m.opset("") < _SHAPE_OPSET:
        return f"opset {m.opset('')} < {_SHAPE_OPSET}, where Shape takes no start and end"
    merged, joined = [], 0
    for piece in _pieces(m):
        last = merged[-1] if merged else None
        if last is not None and last[0] == piece[0] == "dims" and last[1] is piece[1] and last[3] == piece[2]:
            merged[-1] = ["dims", last[1], last[2], piece[3], None]
            joined += 1
        elif last is not None and last[0] == piece[0] == "const" and last[1].dtype == piece[1].dtype:
            merged[-1] = ["const", np.concatenate([last[1], piece[1]]), None]
        else:
            merged.append(piece)
    if not joined:
        return "no two neighbouring inputs are consecutive dimensions of one Shape"
    return merged


def shape_concat_merge_replacement(m: Match, b):
    values = []
    for piece in m.plan:
        if piece[-1] is not None:  # an input kept as it was
            values.append(piece[-1])
        elif piece[0] == "dims":
            values.append(_shape_of(b, piece[1], piece[2], piece[3], _rank(piece[1], m.opsets)))
        else:
            values.append(b.const(piece[1], name="dims"))
    return values[0] if len(values) == 1 else b.op("Concat", *values, axis=0)


def expand_shape_from_input_condition(m: Match):
    """The plan: Expand's target as constants, 1 where it copies x's own dimension at the aligned
    position (broadcast against x, a 1 gives x's dimension: the same output). A dimension read from
    x itself is x's; one of another value is x's where the two carry the same named symbol, which
    exact mode does not take (onnxruntime does not check that inputs keep their declared symbols)."""
    if constant_tensor(m["shape"]) is not None:
        return "the shape is already a constant"
    elements = _shape_vector(m["shape"], m.opsets)
    if elements is None:
        return "the shape is not built from constants and Shape outputs"
    dims = m.dims("x")
    if dims is None:
        return "the rank of the expanded value is unknown"
    x, lead, exact = m["x"], len(elements) - len(dims), m.options.get("exact")
    target = []
    for j, e in enumerate(elements):
        if isinstance(e, int):
            target.append(e)
            continue
        i = j - lead
        if i >= 0 and ((e[1] is x and e[2] == i) or (not exact and is_dim_of(e, x, i))):
            target.append(1)
        elif i >= 0 and is_dim_of(e, x, i):
            return "exact: the dimension is another value's with the same symbol, which inputs may not keep"
        else:
            return f"element {j} of the shape is not the expanded value's own dimension"
    return target


def expand_shape_from_input_replacement(m: Match, b):
    return b.op("Expand", m["x"], b.const(np.array(m.plan, dtype=np.int64), name="shape"))


_NORMALIZATIONS = {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                   "SkipSimplifiedLayerNormalization"}


def _position_lookups(value: ir.Value) -> list[ir.Node] | str:
    """The Gathers of constant tables reading ``value`` as their indices, through Unsqueeze and
    Expand (position ids), or why ``value`` is read otherwise."""
    lookups, frontier = [], [value]
    while frontier:
        v = frontier.pop()
        for node, i in v.uses():
            if node.op_type in ("Unsqueeze", "Expand") and i == 0 and node.domain in ("", "ai.onnx"):
                frontier.extend(node.outputs)
            elif node.op_type == "Gather" and i == 1 and constant_tensor(node.inputs[0]) is not None:
                lookups.append(node)
            else:
                return (f"the Range is also read by a {node.op_type}: index arithmetic (the attention mask's) that "
                        f"its fusion reads as a Range")
    return lookups


def _normalized_embedding(gather: ir.Node) -> bool:
    """The looked-up rows reach, through Adds read by nothing else, a normalization that nothing else
    reads the sum of (an embedding LayerNormalization: its fusion reads the Range; GPT-2's embedding
    sum is also the residual, so its Range is this rule's)."""
    v = gather.outputs[0]
    for _ in range(4):
        readers = [node for node, _ in v.uses()]
        if len(readers) != 1 or v.is_graph_output():
            return False
        node = readers[0]
        if node.op_type in _NORMALIZATIONS:
            return not (len(node.outputs) > 3 and node.outputs[3] is not None and node.outputs[3].uses())
        if node.op_type != "Add":
            return False
        v = node.outputs[0]
    return False


def range_of_dim_condition(m: Match):
    """The plan: the dimension k of x whose size the Range counts up to (from 0, by 1). Only position
    ids (the Range read as the indices of a table's Gather) are taken: the attention mask's aranges
    are its fusion's to read (as Ranges), and so are an embedding LayerNormalization's position ids."""
    for name, want in (("start", 0), ("delta", 1)):
        c = m.const(name)
        if c.ndim != 0 or c.dtype != np.int64 or int(c) != want:
            return f"{name} is not the int64 scalar {want}"
    lookups = _position_lookups(m.root.outputs[0])
    if isinstance(lookups, str):
        return lookups
    if not lookups:
        return "the Range is not read as position ids (the indices of a Gather of a constant table)"
    if any(_normalized_embedding(g) for g in lookups):
        return "the position ids of an embedding LayerNormalization (its fusion reads the Range)"
    return _picked_dim(m)


def range_of_dim_replacement(m: Match, b):
    """CumSum(ConstantOfShape(Shape(x, k, k+1), 1), axis 0, exclusive): 0, 1, ..., n-1 computed on the
    device from the host-memory Shape (ConstantOfShape reads its shape there)."""
    k = m.plan
    n = _shape_of(b, m["x"], k, k + 1, len(m.dims("x")))
    ones = b.op("ConstantOfShape", n, value=ir.tensor(np.array([1], dtype=np.int64)))
    return b.op("CumSum", ones, b.const(np.array(0, dtype=np.int64), name="axis"), exclusive=1)

RULES = [
    Rule("reshape_chain", Op("Reshape", Op("Reshape", "x", "s1"), Const("shape"), name="outer"),
         reshape_chain_replacement, condition=reshape_chain_condition,
         exact=True, doc="Reshape(Reshape(x, s1), s2) is Reshape(x, s2) when s2 copies no dimension (no 0)."),
    Rule("reshape_flatten_chain", Op("Reshape", Op("Flatten", "x"), Const("shape"), name="outer"),
         reshape_chain_replacement, condition=reshape_chain_condition,
         exact=True, doc="Reshape(Flatten(x), s) is Reshape(x, s) when s copies no dimension (no 0)."),
    Rule("reshape_elimination", Op("Reshape", "x", Const("shape"), name="reshape"), _x,
         condition=exact_removal(reshape_elimination_condition, "Reshape"),
         exact=True, doc="Reshape to the shape x already has (static) is x."),
    Rule("reshape_to_unsqueeze", Op("Reshape", "x", Const("shape"), name="reshape"), unsqueeze_plan_replacement,
         condition=reshape_to_unsqueeze_condition, exact=True,
         doc="Reshape that only inserts size-1 dimensions (x's own in order, copied by 0 or one of them "
             "as -1) is an Unsqueeze, which keeps the dimensions' symbols."),
    Rule("reshape_shape_from_input", Op("Reshape", "x", "shape", name="reshape"), reshape_shape_from_input_replacement,
         condition=reshape_shape_from_input_condition,
         exact=False,
         doc="Reshape whose target shape is assembled (Shape/Gather/Slice/Unsqueeze/Concat) from constants "
             "and x's own dimensions at the same positions (the same value, or the same named symbol) takes a "
             "constant shape, with 0 for the copied ones."),
    Rule("flatten_elimination", Op("Flatten", "x", name="flatten"), _x, condition=exact_removal(flatten_elimination_condition, "Flatten"),
         exact=True, doc="Flatten of a 2-D value at axis 1 is the value."),
    Rule("squeeze_unsqueeze", Op("Squeeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=exact_removal(squeeze_unsqueeze_condition, "Unsqueeze and Squeeze"),
         exact=True, doc="Squeeze(Unsqueeze(x, axes), axes) is x."),
    Rule("unsqueeze_squeeze", Op("Unsqueeze", Op("Squeeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=exact_removal(squeeze_unsqueeze_condition, "Squeeze and Unsqueeze"),
         exact=True, doc="Unsqueeze(Squeeze(x, axes), axes) is x (the squeezed axes had size 1)."),
    Rule("unsqueeze_chain", Op("Unsqueeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                               name="outer"), unsqueeze_plan_replacement, condition=unsqueeze_chain_condition,
         exact=True, doc="Unsqueeze(Unsqueeze(x, a1), a2) is one Unsqueeze with both sets of axes."),
    Rule("expand_elimination", Op("Expand", "x", Const("shape")), _x, condition=expand_elimination_condition,
         exact=True, doc="Expand to a shape x already covers is x."),
    Rule("slice_elimination", Op("Slice", "x", Const("starts"), Const("ends"), Opt(Const("axes")), Opt(Const("steps"))),
         _x, condition=exact_removal(slice_elimination_condition, "Slice", _slice_onnxruntime_keeps), exact=True, doc="Slice from 0 to past the end with step 1 is x."),
    Rule("pad_elimination", Op("Pad", "x", Const("pads"), Opt("value"), Opt("axes")), _x,
         condition=exact_removal(pad_elimination_condition, "Pad"), exact=True, doc="Pad by zeros on every side is x."),
    Rule("concat_elimination", Op("Concat", "x"), _x, condition=exact_removal(None, "Concat"), exact=True,
         doc="Concat of one input is it (the pattern takes one input)."),
    Rule("split_elimination", Op("Split", "x", Opt(Const("split"))), _x, condition=exact_removal(split_elimination_condition, "Split"),
         exact=True, doc="Split into one piece is x."),
    Rule("range_scalar_inputs", Op("Range", "start", "limit", "delta"), range_scalar_inputs_replacement,
         condition=range_scalar_inputs_condition,
         exact=True,
         doc="Range inputs known to hold one element in a [1]-like shape become scalars, as the spec requires "
             "(onnxruntime's shape inference rejects them once their shapes are known)."),
    Rule("shape_dim_unsqueeze", Op("Unsqueeze", _scalar_dim(), Opt(Const("axes")), name="vector"),
         shape_dim_replacement, condition=shape_dim_unsqueeze_condition, exact=True,
         doc="Unsqueeze(Gather(Shape(x), k), [0]) or Unsqueeze(Squeeze(Shape(x, k, k+1)), [0]) is "
             "Shape(x, start=k, end=k+1) (opset 15): one host-memory Shape instead of nodes onnxruntime's CUDA "
             "provider places on the CPU."),
    Rule("shape_dim_reshape", Op("Reshape", _scalar_dim(), Const("target"), name="vector"),
         shape_dim_replacement, condition=shape_dim_reshape_condition, exact=True,
         doc="Reshape(Squeeze(Shape(x, k, k+1)), [-1]) (dynamo's sym_size made 1-D) or Reshape(Gather(Shape(x), "
             "k), [-1]) is Shape(x, start=k, end=k+1) (opset 15)."),
    Rule("shape_slice_to_attributes",
         Op("Slice", Op("Shape", "x", name="shape", shared=True), Const("starts"), Const("ends"), Opt(Const("axes")),
            Opt(Const("steps"))),
         shape_slice_to_attributes_replacement, condition=shape_slice_to_attributes_condition, exact=True,
         doc="Slice(Shape(x), a, b) with step 1 is Shape(x, start=a, end=b) (opset 15)."),
    Rule("shape_concat_merge",
         Op("Concat", "part0", *(Opt(f"part{i}") for i in range(1, _CONCAT_INPUTS)), attrs={"axis": lambda a: a in (0, -1)}),
         shape_concat_merge_replacement, condition=shape_concat_merge_condition, exact=True,
         doc="Concat of neighbouring runs of one value's dimensions (Shape(x, a, b), Shape(x, b, c)) is one "
             "Shape(x, a, c), and neighbouring constants one constant; a Concat left with one input is that input."),
    Rule("expand_shape_from_input", Op("Expand", "x", "shape"), expand_shape_from_input_replacement,
         condition=expand_shape_from_input_condition, exact=True,
         doc="Expand whose target shape is assembled from constants and x's own dimensions (at the positions "
             "they broadcast against; outside exact mode also another value's dimension of the same named "
             "symbol) takes a constant target with 1 for those: the same output, no shape arithmetic left."),
    Rule("range_of_dim", Op("Range", Const("start"), _scalar_dim(), Const("delta")), range_of_dim_replacement,
         condition=range_of_dim_condition, targets={"ort-cuda"}, exact=True,
         doc="Range(0, n, 1) of a dimension n read from a Shape (Gather(Shape(x), k) or dynamo's Squeeze(Shape(x, "
             "k, k+1))), read as position ids (GPT-2's), is CumSum(ConstantOfShape(Shape(x, k, k+1), 1), exclusive): "
             "the same 0..n-1 without the scalar node onnxruntime's CUDA provider runs on the CPU. Not the attention "
             "mask's aranges nor an embedding LayerNormalization's positions (their fusions read the Range). "
             "ort-cuda only: on the CPU the Range is the cheaper form."),
]
