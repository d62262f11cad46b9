"""Shapes on demand.

Exported models often lack shape information on intermediate values, and running ONNX shape
inference over a whole large graph is slow (minutes at 100k nodes through onnx_ir's pass). Rules
that need a shape ask :func:`infer` for one value; it runs onnx's own per-node inference
(``onnx.shape_inference.infer_node_outputs``) on just the producers that value depends on whose
outputs are unknown, and records the results on those values, so each value is inferred once.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.ir.util import constant_tensor, graphs_below, opset_of, proto_graphs

# Dimension names some exporters write for every unknown dimension: they name no one value.
PLACEHOLDER_DIMS = frozenset({"?", "None", "none", "-1", "*", "unknown", "dynamic", "N/A"})

DECLARED = "onnxopt.declared"  # value meta: what the input model recorded for it ("type" or "shape")

_MAX_NODES = 4096  # per request: bounds the work one question can cause
SMALL_CONST = 1024  # constant inputs up to this many elements are passed as data (Reshape shapes...)


def opsets_of(model: ir.Model) -> dict[str, int]:
    """The model's opset imports, the standard domain under "" (however the model spells it)."""
    opsets = dict(model.opset_imports)
    opsets[""] = opset_of(opsets, "")
    return opsets


def _known(value: ir.Value) -> bool:
    return value.type is not None and value.shape is not None


def _from_constant(value: ir.Value) -> bool:
    tensor = constant_tensor(value)
    if tensor is None:
        return False
    value.shape = ir.Shape(tensor.shape)
    value.type = ir.TensorType(tensor.dtype)
    return True


_TRIED = "onnxopt.shape_tried"


def forget_tried(node: ir.Node) -> None:
    """Let :func:`infer` try ``node`` again (its outputs' shapes were dropped)."""
    node.meta.pop(_TRIED, None)


def mark_declared(model: ir.Model) -> None:
    """Remember, on each main-graph node output, whether the input model recorded its type
    and shape, its type only, or nothing (the driver carries the mark over to the value that
    replaces it, which is the same tensor)."""
    for node in model.graph:
        for value in node.outputs:
            if value.shape is not None:
                value.meta[DECLARED] = "shape"
            elif value.type is not None:
                value.meta[DECLARED] = "type"


def forget_inferred_shapes(model: ir.Model) -> int:
    """Drop what the input model did not record on the main graph's node outputs (inferred
    types and shapes, those of values rules created), so the output records what the input did:
    a value declared with a type only keeps its type; graph outputs keep theirs."""
    dropped = 0
    for node in model.graph:
        forget_tried(node)  # (else a later inference skips the node and finds no shape)
        for value in node.outputs:
            kept = value.meta.get(DECLARED)
            if kept == "shape" or value.is_graph_output():
                continue
            if value.shape is not None or (kept is None and value.type is not None):
                value.shape = None
                if kept is None:
                    value.type = None
                dropped += 1
    return dropped


def _infer_node(node: ir.Node, opsets: Mapping[str, int]) -> None:
    # Once per node: a node whose outputs stay unknown is not asked again (new nodes are).
    if node.op_type == "If" and node.domain in ("", "ai.onnx"):
        _infer_if(node, opsets)  # not marked: its branches may become known later (cheap to ask again)
        return
    if node.meta.get(_TRIED):
        return
    node.meta[_TRIED] = True
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
        return
    infer_outputs(node, opsets)


def infer_outputs(node: ir.Node, opsets: Mapping[str, int]) -> None:
    """onnx's inference for one node from its inputs' types and small constant values, recorded on
    its outputs where they have no type or shape yet (every time it is called; :func:`infer` asks
    once per node)."""
    types, data = {}, {}
    for value in node.inputs:
        if value is None or value.name is None:
            continue
        if value.type is not None:
            types[value.name] = ir.serde.serialize_value(value).type
        tensor = constant_tensor(value)
        if tensor is not None and tensor.size <= SMALL_CONST:
            data[value.name] = small_tensor_proto(tensor, value.name)
    out = infer_node_outputs(ir.serde.serialize_node(node), opsets, types, data)
    if out is None:
        return
    for value in node.outputs:
        tp = out.get(value.name)
        if tp is None:
            continue
        if value.type is None:
            value.type = ir.serde.deserialize_type_proto_for_type(tp)
        if value.shape is None:
            value.shape = ir.serde.deserialize_type_proto_for_shape(tp)


def small_tensor_proto(tensor: ir.TensorProtocol, name: str) -> onnx.TensorProto:
    """``tensor`` (at most SMALL_CONST elements) as the data inference reads, named ``name``."""
    proto = ir.serde.serialize_tensor(tensor)
    proto.name = name
    return proto


def infer_node_outputs(proto: onnx.NodeProto, opsets: Mapping[str, int], types: Mapping[str, onnx.TypeProto],
                       data: Mapping[str, onnx.TensorProto]) -> dict[str, onnx.TypeProto] | None:
    """onnx's inference for one node, from its inputs' types and the data of its small constant
    inputs (shapes, axes, pads...): output name -> type, or None when onnx refuses or has no schema."""
    domain = "" if proto.domain == "ai.onnx" else proto.domain
    try:
        schema = onnx.defs.get_schema(proto.op_type, opsets.get(domain, 1), domain)
        return onnx.shape_inference.infer_node_outputs(
            schema, proto, types, data, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    except Exception:
        return None


def _infer_if(node: ir.Node, opsets: Mapping[str, int]) -> None:
    """An If output takes the type and shape its two branches agree on."""
    then_attr, else_attr = node.attributes.get("then_branch"), node.attributes.get("else_branch")
    if then_attr is None or else_attr is None or then_attr.is_ref() or else_attr.is_ref():
        return
    then_g, else_g = then_attr.as_graph(), else_attr.as_graph()
    for i, value in enumerate(node.outputs):
        if i >= len(then_g.outputs) or i >= len(else_g.outputs) or _known(value):
            continue
        a, b = then_g.outputs[i], else_g.outputs[i]
        sa, sb = infer(a, opsets), infer(b, opsets)
        if sa is None or sb is None or a.type is None or a.type != b.type:
            continue
        if len(sa) != len(sb) or any(not (isinstance(x, int) and x == y) for x, y in zip(sa, sb)):
            continue  # only fully static, equal shapes are taken
        if value.type is None:
            value.type = a.type
        if value.shape is None:
            value.shape = ir.Shape(list(sa))


def infer(value: ir.Value | None, opsets: Mapping[str, int]) -> ir.Shape | None:
    """The shape of ``value`` (None if unknown even after local inference)."""
    if value is None:
        return None
    if _known(value) or _from_constant(value):
        return value.shape
    # Depth-first over unknown producers; a node is inferred once all its inputs were tried.
    stack: list[tuple[ir.Node, bool]] = []
    producer = value.producer()
    if producer is None:
        return value.shape
    stack.append((producer, False))
    visited: set[ir.Node] = set()
    while stack and len(visited) <= _MAX_NODES:
        node, ready = stack.pop()
        if ready:
            _infer_node(node, opsets)
            continue
        if node in visited or node.meta.get(_TRIED):
            continue
        visited.add(node)
        stack.append((node, True))
        for inp in node.inputs:
            if inp is None or _known(inp) or _from_constant(inp):
                continue
            up = inp.producer()
            if up is not None and up not in visited:
                stack.append((up, False))
    return value.shape


def broadcast_keeps(dims: list | None, shape: tuple[int, ...]) -> bool:
    """A value of dimensions ``dims`` (numbers, None for unknown) broadcast with one of static
    ``shape`` keeps its own shape: ``shape`` is of no higher rank and each of its dimensions is 1
    or equals the value's (a known number)."""
    if len(shape) == 0:
        return True
    if dims is None or len(shape) > len(dims):
        return False
    return all(c == 1 or c == d for c, d in zip(reversed(shape), reversed(dims)))


# --- shape vectors ----------------------------------------------------------------------------
# A shape vector (what Shape returns) as a list of elements: numbers, or anything standing for a
# dimension (None for "unknown", a symbolic reference). Gather and Slice pick from it as they
# would from the tensor; both rule families that read shape arithmetic use these.


def gather_elements(elements: list, indices: np.ndarray) -> list | None:
    """``elements`` picked by a Gather on axis 0 (indices in flattened order), or None when the
    indices are not integers or one is out of range."""
    if indices.dtype.kind not in "iu":
        return None
    flat = indices.reshape(-1).astype(np.int64)
    n = len(elements)
    if np.any(flat < -n) or np.any(flat >= n):
        return None
    return [elements[int(i)] for i in flat]


def slice_elements(elements: list, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray | None = None,
                   steps: np.ndarray | None = None) -> list | None:
    """``elements`` picked by a Slice of the vector (one start/end, axis 0 or -1, a nonzero
    step; ONNX's clamping), or None for anything else."""
    parts = [starts, ends, axes if axes is not None else np.array([0]), steps if steps is not None else np.array([1])]
    if any(p.size != 1 or p.dtype.kind not in "iu" for p in parts):
        return None
    start, end, axis, step = (int(p.reshape(-1)[0]) for p in parts)
    if axis not in (0, -1) or step == 0:
        return None
    return [elements[i] for i in slice_positions(len(elements), start, end, step)]


def slice_positions(n: int, start: int, end: int, step: int) -> list[int]:
    """The indices ONNX Slice picks on an axis of length ``n`` (the spec's clamping, which for a
    negative step differs from Python's: a start below 0 becomes 0, not an empty slice)."""
    if step == 0:
        raise ValueError("zero step")
    if start < 0:
        start += n
    if end < 0:
        end += n
    if step > 0:
        start, end = min(max(start, 0), n), min(max(end, 0), n)
    else:
        start, end = min(max(start, 0), n - 1), min(max(end, -1), n - 1)
    return list(range(start, end, step))


# --- shape arithmetic, read back --------------------------------------------------------------
# Exporters build a Reshape's target from the input's own Shape: Shape -> Gather/Slice ->
# Unsqueeze -> Concat. shape_elements reads such a vector back as numbers and ("dim", value, k)
# references (dimension k of value), so a rule can tell a target that copies the input's own
# dimensions from one that does not.

DimRef = tuple  # ("dim", value, k): dimension k of value, read through Shape
_DEPTH = 8  # how far back shape_elements follows the arithmetic


def shape_elements(value: ir.Value | None, depth: int = 0) -> list | None:
    """A 1-D int64 shape tensor as a list of ints and DimRef entries, or None when it is anything
    else (a value computed some other way, or from deeper than _DEPTH nodes)."""
    if value is None or depth > _DEPTH:
        return None
    tensor = constant_tensor(value)
    if tensor is not None:
        arr = tensor.numpy()
        if arr.dtype not in (np.int64, np.int32) or arr.ndim > 1:  # (int32: exporters that cast shapes)
            return None
        return [int(a) for a in arr.reshape(-1)]
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Cast":  # int64 <-> int32 of shape values (tf2onnx computes shapes in int32): the same values
        to = node.attributes.get("to")
        if to is None or to.value not in (int(ir.DataType.INT64), int(ir.DataType.INT32)):
            return None
        return shape_elements(node.inputs[0], depth + 1)
    if op == "Concat":
        axis = node.attributes.get("axis")
        if axis is None or axis.value not in (0, -1):
            return None
        parts = []
        for v in node.inputs:
            part = shape_elements(v, depth + 1)
            if part is None:
                return None
            parts.extend(part)
        return parts
    if op == "Shape":
        src = node.inputs[0]
        if src.shape is None:
            return None
        start, end = node.attributes.get("start"), node.attributes.get("end")
        ks = list(range(len(src.shape)))[slice(start.value if start else None, end.value if end else None)]
        return [("dim", src, k) for k in ks]
    if op == "Reshape" and len(node.inputs) == 2:  # a scalar made 1-D: Reshape(s, [-1]) or [1]
        target = constant_tensor(node.inputs[1])
        if target is None or target.numpy().reshape(-1).tolist() not in ([-1], [1]):
            return None
        inner = scalar_element(node.inputs[0], depth + 1)
        if inner is not None:
            return [inner]
        part = shape_elements(node.inputs[0], depth + 1)
        return part if part is not None and len(part) == 1 else None
    if op == "Unsqueeze" and len(node.inputs) >= 1:
        axes = node.inputs[1] if len(node.inputs) > 1 else None
        inner = scalar_element(node.inputs[0], depth + 1)
        if inner is None:
            return None
        axes_t = constant_tensor(axes) if axes is not None else None
        ax = axes_t.numpy().reshape(-1).tolist() if axes_t is not None else node.attributes.get("axes").value \
            if node.attributes.get("axes") is not None else None
        return [inner] if ax is not None and list(ax) in ([0], [-1]) else None
    if op in ("Gather", "Slice"):
        src = shape_elements(node.inputs[0], depth + 1)
        if src is None:
            return None
        if op == "Gather":
            idx = constant_tensor(node.inputs[1])
            axis = node.attributes.get("axis")
            if idx is None or (axis is not None and axis.value != 0) or idx.numpy().ndim != 1:
                return None
            return gather_elements(src, idx.numpy())
        consts = [constant_tensor(v) if v is not None else None for v in node.inputs[1:5]]
        if len(consts) < 2 or consts[0] is None or consts[1] is None or any(
                v is not None and c is None for v, c in zip(node.inputs[3:5], consts[2:])):
            return None
        arrays = [c.numpy() if c is not None else None for c in consts] + [None] * (4 - len(consts))
        return slice_elements(src, *arrays)
    return None


def scalar_element(value: ir.Value | None, depth: int = 0):
    """A scalar int64 read back like :func:`shape_elements` reads a vector (an int or a DimRef), or None."""
    if value is None:
        return None
    tensor = constant_tensor(value)
    if tensor is not None:
        arr = tensor.numpy()
        return int(arr) if arr.ndim == 0 and arr.dtype == np.int64 else None
    node = value.producer()
    if node is not None and node.op_type in ("Squeeze", "Reshape") and node.domain in ("", "ai.onnx"):
        part = shape_elements(node.inputs[0], depth + 1)  # a 1-element shape tensor made a scalar
        if node.op_type == "Reshape":
            target = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
            if target is None or target.numpy().size != 0:
                return None
        return part[0] if part is not None and len(part) == 1 else None
    if node is None or node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
        return None
    src = shape_elements(node.inputs[0], depth + 1)
    idx = constant_tensor(node.inputs[1])
    axis = node.attributes.get("axis")
    if src is None or idx is None or idx.numpy().ndim != 0 or (axis is not None and axis.value != 0):
        return None
    i = int(idx.numpy())
    return src[i] if -len(src) <= i < len(src) else None


def same_dim(a: ir.Value, k: int, x: ir.Value, j: int) -> bool:
    """Dimension k of a is proven equal to dimension j of x: equal numbers, or one named symbol."""
    if a.shape is None or x.shape is None or not (-len(a.shape) <= k < len(a.shape)
                                                  and -len(x.shape) <= j < len(x.shape)):
        return False
    da, dx = a.shape[k], x.shape[j]
    if isinstance(da, int) and isinstance(dx, int):
        return da == dx
    return same_symbol(a, k, x, j)


def same_symbol(a: ir.Value, k: int, x: ir.Value, j: int) -> bool:
    """Dimension k of a and dimension j of x carry the same named symbol (onnx's shape inference
    gives equal dimensions equal names, and distinct unknowns distinct ones)."""
    if a.shape is None or x.shape is None or not -len(a.shape) <= k < len(a.shape):
        return False
    da, dx = a.shape[k], x.shape[j]
    return (not isinstance(da, int) and not isinstance(dx, int) and bool(da.value) and da.value == dx.value
            and da.value not in placeholder_symbols(x.graph or a.graph))


def is_dim_of(element, x: ir.Value, j: int) -> bool:
    """A shape-vector element stands for dimension j of x: it reads that very dimension, or one
    with the same named symbol."""
    return not isinstance(element, int) and (element[1] is x and element[2] == j
                                             or same_symbol(element[1], element[2], x, j))


def placeholder_symbols(graph: ir.Graph | None) -> frozenset:
    """Dimension names that cannot be trusted to mean one value: the placeholders some exporters
    write for every unknown dimension, and any name that one graph input repeats on two axes
    (which, at face value, would claim those axes equal)."""
    names = set(PLACEHOLDER_DIMS)
    for value in (graph.inputs if graph is not None else ()):
        if value.shape is None:
            continue
        seen = set()
        for d in value.shape:
            if not isinstance(d, int) and d.value:
                if d.value in seen:
                    names.add(d.value)
                seen.add(d.value)
    return frozenset(names)


INFER_DATA_LIMIT = 1000  # bytes: initializers up to this size keep their data for data propagation


def infer_model(model: ir.Model):
    """onnx's shape inference (data propagation on, strict mode off) over :func:`light_proto` of
    ``model``. ``model`` itself is left as it was (no shape, type or initializer order changes)."""
    return infer_proto(light_proto(model))


def infer_proto(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's shape inference as :func:`infer_model` runs it (data propagation on, strict mode off),
    bounded as :func:`bounded_infer` bounds it."""
    return bounded_infer(proto)


# --- bounding onnx's data propagation ----------------------------------------------------------
# onnx's data propagation (infer_shapes(data_prop=True)) keeps the value of every 1-D or scalar
# integer tensor an op with a propagation function reads as a list of dimensions, one per element;
# where it knows no value it makes one of unknown dimensions from the input's static length. A
# ConstantOfShape of [1e9] feeding an Add so became 1e9 dimension objects (22.7 GB for a 139-byte
# model). bounded_infer lets propagation read only inputs whose length is known to be within the
# bound: the others (a length above it, or one only propagation itself could learn) are read through
# a stand-in graph input of unknown length, and where propagation learns a small length for one, it
# is read again in the next round.

DATA_PROP_OPS = frozenset({"Add", "Cast", "Concat", "Gather", "Mul", "Shape", "Size", "Slice", "Squeeze", "Sub",
                           "Unsqueeze"})  # onnx's ops with a data propagation function (onnx 1.23)
_CUT_PREFIX = "onnxopt.bounded."
_ROUNDS = 4


# bytes: constant folding's size limit (folded outputs up to this size are always accepted), defined
# here, below the evaluator, because inference is bounded by it too (``evaluate.DEFAULT_SIZE_LIMIT``
# is this value)
DEFAULT_SIZE_LIMIT = 1 << 20


def data_element_limit() -> int:
    """The most elements one value may have for onnx's data propagation or onnxruntime's symbolic
    inference to materialize it: constant folding's size limit (:data:`DEFAULT_SIZE_LIMIT`, bytes)
    in int64 elements, the type shape values are computed in."""
    return DEFAULT_SIZE_LIMIT // 8


_graphs = proto_graphs  # (a graph and its subgraphs, depth first)


def _types(proto: onnx.ModelProto, names: frozenset[str] | set[str] | None = None) -> dict[str, onnx.TypeProto]:
    """The tensor types ``proto`` declares by name (the first declaration of each, graphs depth first);
    only those of ``names`` where given (reading every declaration's type is the cost)."""
    types = {}
    for g in _graphs(proto.graph):
        for field in (g.input, g.value_info, g.output):
            for vi in field:
                name = vi.name
                if name and (names is None or name in names) and name not in types \
                        and vi.type.HasField("tensor_type"):
                    types[name] = vi.type
    return types


def _constant_lengths(proto: onnx.ModelProto) -> dict[str, tuple[int, int, int]]:
    """Initializers and Constant values by name: (rank, elements, elem_type)."""
    out = {}
    for g in _graphs(proto.graph):
        for t in g.initializer:
            out[t.name] = (len(t.dims), math.prod(t.dims), t.data_type)
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
                for a in n.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        out[n.output[0]] = (len(a.t.dims), math.prod(a.t.dims), a.t.data_type)
                    elif a.name in ("value_ints", "value_floats", "value_strings"):
                        out[n.output[0]] = (1, len(a.ints) + len(a.floats) + len(a.strings), 7)
    return out


def _risky(name: str, types: Mapping[str, onnx.TypeProto], consts: Mapping, limit: int) -> bool:
    """Whether onnx's data propagation could make more than ``limit`` dimensions of ``name``: a
    constant of rank 0 or 1 with more elements, or a value whose static type is not known to be of
    another rank or of a length within the limit."""
    if name in consts:
        rank, size, _ = consts[name]
        if rank <= 1 and size > limit:
            return True
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        return name not in consts
    dims = t.tensor_type.shape.dim
    if len(dims) != 1:
        return False
    return not (dims[0].HasField("dim_value") and 0 <= dims[0].dim_value <= limit)


def _reads(proto: onnx.ModelProto):
    """(node, input position, name) for every input of an op with a data propagation function, or
    of a call to one of the model's functions (onnx infers those through their bodies)."""
    local = {(f.domain, f.name) for f in proto.functions}
    for g in _graphs(proto.graph):
        for n in g.node:
            std = n.domain in ("", "ai.onnx")
            if (std and n.op_type in DATA_PROP_OPS) or (n.domain, n.op_type) in local:
                for i, name in enumerate(n.input):
                    if name:
                        yield n, i, name


def _with_cuts(proto: onnx.ModelProto, cut: set[str], types, consts) -> onnx.ModelProto:
    """A copy of ``proto`` whose propagating ops read each value of ``cut`` from a stand-in graph
    input of the value's element type and unknown length."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for n, i, name in _reads(copy):
        if name in cut:
            n.input[i] = _CUT_PREFIX + name
    for name in sorted(cut):
        t = types.get(name)
        elem = t.tensor_type.elem_type if t is not None else consts.get(name, (0, 0, 0))[2]
        rank_one = t is not None and t.tensor_type.HasField("shape") and len(t.tensor_type.shape.dim) == 1 \
            or name in consts and consts[name][0] == 1
        vi = onnx.helper.make_tensor_value_info(_CUT_PREFIX + name, elem or onnx.TensorProto.INT64,
                                                [None] if rank_one else None)
        copy.graph.input.append(vi)
    return copy


def _uncut(result: onnx.ModelProto, first: Mapping[str, onnx.TypeProto]) -> onnx.ModelProto:
    """``result`` with the stand-ins gone (nodes read the values again), and where it knows a
    dimension less than the inference without propagation (``first``) did, that one's."""
    for g in _graphs(result.graph):
        for n in g.node:
            for i, name in enumerate(n.input):
                if name.startswith(_CUT_PREFIX):
                    n.input[i] = name[len(_CUT_PREFIX):]
        for field in (g.input, g.value_info):
            keep = [vi for vi in field if not vi.name.startswith(_CUT_PREFIX)]
            if len(keep) != len(field):
                del field[:]
                field.extend(keep)
        for vi in (*g.value_info, *g.output):
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param.startswith(_CUT_PREFIX):
                    d.ClearField("dim_param")
            before = first.get(vi.name)
            if before is None or not before.tensor_type.HasField("shape"):
                continue
            if not vi.type.tensor_type.HasField("shape"):
                vi.type.tensor_type.shape.CopyFrom(before.tensor_type.shape)
                continue
            now, was = vi.type.tensor_type.shape.dim, before.tensor_type.shape.dim
            if len(now) == len(was):
                for d, b in zip(now, was):
                    if not d.HasField("dim_value") and b.HasField("dim_value"):
                        d.dim_value = b.dim_value
    return result


def bounded_infer(proto: onnx.ModelProto, limit: int | None = None) -> onnx.ModelProto:
    """onnx's shape inference with data propagation (strict mode off), its memory bounded: no value
    it propagates has more than ``limit`` elements (default :func:`data_element_limit`). A first
    inference without propagation gives the static lengths; the values an op with a propagation
    function reads that are not known to be within the limit are read from stand-ins of unknown
    length, and rounds are run while propagation makes more of them known to be small. Where no
    value needs a stand-in, the result is onnx's own, as before. Raises what onnx's inference
    raises."""
    limit = data_element_limit() if limit is None else limit
    read = {name for _, _, name in _reads(proto)}
    if not read:  # (no op propagates data: nothing to bound, no inference without propagation needed)
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    plain = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=False)
    first = _types(plain, read)  # (only the values propagating ops read are judged, cut and typed)
    consts = _constant_lengths(proto)
    cut = {name for name in read if _risky(name, first, consts, limit)}
    if not cut:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    result = None
    for _ in range(_ROUNDS):
        cut_proto = _with_cuts(proto, cut, first, consts)
        result = onnx.shape_inference.infer_shapes(cut_proto, check_type=False, strict_mode=False, data_prop=True)
        known = _types(result, cut)
        # A stand-in's own value is typed by its producer: what propagation learned of its length. One
        # now known to be small is read again; so is one that no stand-in is upstream of, unless it is
        # known to be large (its type is then what propagation alone gives it).
        free = _upstream_free(cut_proto)
        smaller = {name for name in cut if not _risky(name, known, consts, limit)
                   or name in free and name not in consts and not _over(known.get(name), limit)}
        if not smaller:
            break
        cut -= smaller
        first = {**first, **{k: v for k, v in known.items() if k in smaller}}
        if not cut:
            return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    return _uncut(result, _types(plain))


def _over(t: onnx.TypeProto | None, limit: int) -> bool:
    """A 1-D type of a known length over ``limit``."""
    if t is None or not t.tensor_type.HasField("shape") or len(t.tensor_type.shape.dim) != 1:
        return False
    d = t.tensor_type.shape.dim[0]
    return d.HasField("dim_value") and d.dim_value > limit


def _upstream_free(proto: onnx.ModelProto) -> set[str]:
    """The main graph's values that no stand-in (``_with_cuts``) is upstream of (subgraphs' reads
    count as their node's)."""
    tainted: set[str] = set()
    for n in proto.graph.node:  # (topological order, as onnx's inference requires)
        reads = set(n.input)
        for attr in n.attribute:
            if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    for sub in _graphs(g):
                        reads.update(i for m in sub.node for i in m.input)
        if any(r.startswith(_CUT_PREFIX) or r in tainted for r in reads if r):
            tainted.update(o for o in n.output if o)
    return {o for n in proto.graph.node for o in n.output if o and o not in tainted}


def tensor_nbytes(tensor) -> int:
    """``tensor.nbytes``, read straight from the proto where onnx_ir wraps one (its ``nbytes`` builds an
    ir.Shape from the proto's dims on every call: a tenth of a second per pass over 10,000 weights);
    the same formula, so the same number."""
    if type(tensor) is ir.serde.TensorProtoTensor:
        return proto_nbytes(tensor.raw)
    return tensor.nbytes


def proto_nbytes(proto: onnx.TensorProto) -> int:
    """The bytes of the tensor a TensorProto describes (its type and dims; the data not read)."""
    return math.ceil(ir.DataType(proto.data_type).itemsize * math.prod(proto.dims))


def light_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` serialized without large weights, for shape inference: those are declared as graph
    inputs of their type and shape instead (an initializer that is also a graph input, a default the
    caller may override, keeps no data at all, so data propagation never takes its default for a
    constant); initializers up to ``INFER_DATA_LIMIT`` bytes (shape tensors) keep their data."""
    from onnxopt.ir import io

    graph = model.graph
    inputs = {v.name for v in graph.inputs}
    detached = [v for v in graph.initializers.values()
                if v.name in inputs or v.const_value is None or tensor_nbytes(v.const_value) > INFER_DATA_LIMIT]
    with io.detached_initializers(graph, detached):
        proto = ir.serde.serialize_model(model)
    for value in detached:
        tensor = value.const_value
        if value.name in inputs or tensor is None:
            continue  # already a declared graph input, or nothing to declare
        proto.graph.input.append(onnx.helper.make_tensor_value_info(
            value.name, tensor.dtype.value, [int(d) for d in tensor.shape]))
    return proto


SOURCE_KEY = "onnxopt.source"  # graph.meta (in memory only): the ModelProto the model was just read from, unchanged


def light_source(model: ir.Model) -> onnx.ModelProto | None:
    """:func:`light_proto` of ``model`` taken from the ModelProto it was read from (``SOURCE_KEY``,
    set by whoever read it while nothing has changed it; the proto already parsed, this costs no
    serialization of the graph): the same nodes, inputs, outputs and initializers kept or declared
    alike, and the value types the model records for its nodes' outputs, as its serialization
    writes them. None where the model has none recorded, or has subgraphs or local functions
    (whose recorded values this does not sort as the serialization would)."""
    source = model.graph.meta.get(SOURCE_KEY)
    if source is None or model.functions or graphs_below(model.graph):
        return None
    try:
        return _light_source(source)
    except Exception:  # noqa: BLE001 - (a tensor type with no size): the serialization's way, as before
        return None


def _light_source(source: onnx.ModelProto) -> onnx.ModelProto:
    graph = source.graph
    light = onnx.ModelProto()
    for field, value in source.ListFields():  # (all but the graph)
        if field.name == "graph":
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated:
            getattr(light, field.name).extend(value)
        elif field.message_type is not None:
            getattr(light, field.name).CopyFrom(value)
        else:
            setattr(light, field.name, value)
    out = light.graph
    out.name = graph.name
    out.node.extend(graph.node)
    out.input.extend(graph.input)
    out.output.extend(graph.output)
    produced = {o for n in graph.node for o in n.output if o}
    inputs = {i.name for i in graph.input}
    declared = inputs | {o.name for o in graph.output}
    out.value_info.extend(vi for vi in graph.value_info
                          if vi.name in produced and vi.name not in declared and vi.HasField("type"))
    detached = []
    for tensor in graph.initializer:
        if tensor.name in inputs or proto_nbytes(tensor) > INFER_DATA_LIMIT:
            detached.append(tensor)
        else:
            out.initializer.append(tensor)
    for tensor in detached:
        if tensor.name not in inputs:
            out.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return light


@functools.cache
def _symbolic_shape_inference():
    """onnxruntime's SymbolicShapeInference class (None without onnxruntime or where the file moved), read from
    its file without importing the package ``onnxruntime.tools``: that package's ``__init__`` imports torch
    where torch is installed (1.5 s of every command that infers shapes; the tool itself needs only onnx,
    numpy and sympy). Loaded once per process, under the module's own name (its logger is then onnxruntime's
    child, which :func:`symbolic_infer` quiets)."""
    done = sys.modules.get("onnxruntime.tools.symbolic_shape_infer")
    try:
        if done is not None:
            return done.SymbolicShapeInference
        spec = importlib.util.find_spec("onnxruntime")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / "tools" / "symbolic_shape_infer.py"
        if not path.is_file():
            return None
        file_spec = importlib.util.spec_from_file_location("onnxruntime.tools.symbolic_shape_infer", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return module.SymbolicShapeInference
    except Exception:  # noqa: BLE001 - (an onnxruntime whose tool changed: no symbolic inference, as without it)
        return None


def symbolic_infer(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnxruntime's symbolic shape inference, where onnxruntime is installed: it computes the
    shape arithmetic of exported models (Shape, Gather, Slice of a position table, ...) that
    onnx's inference leaves unknown; None without it or where it fails."""
    SymbolicShapeInference = _symbolic_shape_inference()
    if SymbolicShapeInference is None:
        return None
    import contextlib
    import io as _stdio
    import logging

    logger = logging.getLogger("onnxruntime")
    level = logger.level
    # Weights not loaded become graph inputs of their type and shape: it would read the values of
    # any initializer an element-wise op takes.
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    g = copy.graph
    kept = [t for t in g.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    moved = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    names = {v.name for v in g.input}
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved
                   if t.name not in names)
    del g.initializer[:]
    g.initializer.extend(kept)
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(_stdio.StringIO()):
            # SymbolicShapeInference.infer_shapes's own loop, without its ending: where some shape stays
            # open it saves "sym_shape_infer_temp.onnx" into the current folder and raises, and the shapes
            # it did infer are what is wanted here
            sym = _bounded_symbolic(SymbolicShapeInference)(2**31 - 1, True, False, 0)
            sym._preprocess(copy)
            while sym.run_:
                sym._infer_impl()
            sym._update_output_from_vi()
            return sym.out_mp_
    except Exception:  # (an onnxruntime whose tool changed, or inference failing outright)
        return None
    finally:
        logger.setLevel(level)


class _TooLarge(Exception):
    pass


def _bounded_symbolic(base):
    """onnxruntime's SymbolicShapeInference, bounded as :func:`bounded_infer` bounds onnx's: it
    computes the value of an int64 ConstantOfShape whose shape it knows (``np.ones`` of that shape),
    the one place it makes a value larger than the ones it reads; one of more than
    :func:`data_element_limit` elements stops it (symbolic_infer then gives None)."""
    limit = data_element_limit()

    class Bounded(base):
        def _infer_ConstantOfShape(self, node):  # noqa: N802 - the name onnxruntime dispatches to
            dims = self._get_int_or_float_values(node)[0]
            if dims is not None:
                dims = dims if isinstance(dims, list) else [dims]
                try:
                    count = math.prod(int(d) for d in dims)
                except (TypeError, ValueError):
                    count = None  # (a symbolic dimension: no value is made)
                if count is not None and count > limit:
                    raise _TooLarge(f"ConstantOfShape of {count} elements")
            return super()._infer_ConstantOfShape(node)

    return Bounded
