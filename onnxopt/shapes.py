"""Shapes on demand.

Exported models often lack shape information on intermediate values, and running ONNX shape
inference over a whole large graph is slow (minutes at 100k nodes through onnx_ir's pass). Rules
that need a shape ask :func:`infer` for one value; it runs onnx's own per-node inference
(``onnx.shape_inference.infer_node_outputs``) on just the producers that value depends on whose
outputs are unknown, and records the results on those values, so each value is inferred once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from .irutil import constant_tensor, opset_of

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


def rank(value: ir.Value | None, opsets: Mapping[str, int]) -> int | None:
    shape = infer(value, opsets)
    return None if shape is None else len(shape)


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
