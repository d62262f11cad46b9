"""Constant folding: nodes whose inputs are all known at optimization time become initializers.

Also the shape arithmetic exporters emit (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``):
``Shape``/``Size`` of a value whose shape is static fold, and so do ``Gather``/``Slice`` of a
``Shape`` that pick only static dimensions, so dynamic axes stay dynamic while everything known is
computed once. Evaluation, exclusions and the size limit are described in ``onnxopt.ir.evaluate``; the
limit is ``optimize(fold_size_limit=...)`` / ``--fold-size-limit`` (default 1 MiB). A Transpose of a weight
of 1 MiB or more (the dynamo exporter's ``Transpose(W)`` before each MatMul) becomes a tensor computed when
read (``evaluate.evaluate_deferred``): a model's transposed weights are never all in memory at once.

Exact mode (``Rule.exact``): constant folding gives the bits onnxruntime's own folding gives (the same
kernel), except where onnxruntime does something else with the node, which exact mode leaves alone
(:func:`onnxruntime_rewrites_instead`); the Gather/Slice foldings are not exact: onnxruntime does not
fold a static dimension of a dynamic shape, and the constant can end in a Conv's weights.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.ir import evaluate
from onnxopt.ir.util import constant_tensor
from onnxopt.core.pattern import Const, Match, Op, Opt, Refuse, Rule
from onnxopt.core.purity import random_reason
from onnxopt.ir.shapes import gather_elements, slice_elements


def _limit(m: Match) -> int:
    return int(m.options.get("fold_size_limit", evaluate.DEFAULT_SIZE_LIMIT))


def _consts(b, m: Match, arrays) -> list[ir.Value]:
    out = []
    for value, array in zip(m.root.outputs, arrays):
        # what the model records for the value must be what the node computes (a graph output keeps it)
        # (an array, or a tensor computed when read: evaluate.evaluate_deferred)
        deferred = isinstance(array, ir.LazyTensor)
        have = array.dtype if deferred else ir.DataType.from_numpy(array.dtype)
        dims = tuple(int(d) for d in array.shape)
        if isinstance(value.type, ir.TensorType) and value.type.dtype != have:
            raise Refuse(f"evaluation gave {have.name}, the model records {value.type.dtype.name}")
        if value.shape is not None and (len(value.shape) != len(dims) or any(
                isinstance(d, int) and d != n for d, n in zip(value.shape, dims))):
            raise Refuse(f"evaluation gave shape {dims}, the model records {list(value.shape)}")
        if not deferred and not array.flags.c_contiguous:
            array = array.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        out.append(b.const(array, name=value.name or "folded"))
    return out


# --- Constant nodes ------------------------------------------------------------------------


def constant_to_initializer_condition(m: Match):
    if constant_tensor(m.root.outputs[0]) is None:
        return "a Constant holding a sparse tensor, strings or an attribute reference is kept"
    return None


def constant_to_initializer_replacement(m: Match, b):
    tensor = constant_tensor(m.root.outputs[0])
    if tensor.dtype == ir.DataType.STRING:
        raise Refuse("string constants are kept as Constant nodes")
    return b.const(tensor if isinstance(tensor, ir.Tensor) and tensor.name is None else tensor.numpy(),
                   name=m.root.outputs[0].name or "const")


# --- general folding -----------------------------------------------------------------------


def constant_folding_condition(m: Match):
    node = m.root
    if node.op_type in evaluate.NOT_FOLDED:
        return f"{node.op_type} is never folded"
    random = random_reason(node, m.opset(""))
    if random is not None:
        return f"not folded: {random}"  # (a training-mode Dropout draws a new mask each run)
    if not node.inputs or all(v is None for v in node.inputs):
        return "no inputs"  # ConstantOfShape with no input etc. are left alone
    for value in node.inputs:
        if value is not None and constant_tensor(value) is None:
            return "an input is not constant"
    for attr in node.attributes.values():
        if attr.is_ref():
            return "an attribute is a reference"
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return "has a subgraph"
    return onnxruntime_rewrites_instead(node) if m.options.get("exact") else None


# Consumers onnxruntime's own rewrite rules merge a node with before its constant folding gets to
# it (they run first), computing other bits than the folded node would: (node, consumer) op types.
_FUSED_BEFORE_FOLDING = {
    ("Conv", "Add"): "Conv+Add", ("Conv", "Mul"): "Conv+Mul", ("Conv", "BatchNormalization"): "Conv+BN",
    ("Gemm", "Sum"): "Gemm+Sum",
}


def onnxruntime_rewrites_instead(node: ir.Node) -> str | None:
    """Exact mode: why onnxruntime, given the model as it is, would not fold ``node`` itself but
    keep it (DequantizeLinear, for its quantized kernels) or merge it into a consumer first (its
    level-1 rules run before its constant folding): a value folded here would then differ from
    what the session computes. None when onnxruntime folds it as this rule does (the same kernel)."""
    if node.op_type == "DequantizeLinear":
        return "exact: onnxruntime keeps DequantizeLinear unfolded, for its quantized kernels"
    consumers = {use.node.op_type for value in node.outputs for use in value.uses()
                 if use.node.domain in ("", "ai.onnx")}
    one = constant_tensor(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
    if node.op_type == "Div" and "Mul" in consumers and one is not None and one.size == 1 \
            and float(one.numpy().reshape(-1)[0]) == 1.0:
        return "exact: onnxruntime turns (1 / c) * x into x / c instead of folding 1 / c"
    for consumer in sorted(consumers):
        fusion = _FUSED_BEFORE_FOLDING.get((node.op_type, consumer))
        if fusion is not None:
            return f"exact: onnxruntime fuses {fusion} into the {node.op_type}'s weights before folding it"
    return None


def constant_folding_replacement(m: Match, b):
    node = m.root
    tensors = [constant_tensor(value) if value is not None else None for value in node.inputs]
    in_bytes = sum(evaluate.nbytes(t) for t in tensors if t is not None)
    in_limit = int(m.options.get("fold_input_limit", evaluate.DEFAULT_INPUT_LIMIT))
    if in_bytes > in_limit:
        raise Refuse(f"constant inputs of {in_bytes} bytes pass the input limit")
    if any(t is not None and t.dtype == ir.DataType.STRING for t in tensors):
        raise Refuse("string inputs are not folded")
    try:
        allowed = evaluate.allowed_bytes(node, _limit(m))
        results = evaluate.evaluate_deferred(node, m.opsets, tensors, allowed)  # (a weight's Transpose)
        if results is None:
            results = evaluate.evaluate(node, m.opsets, tensors, allowed)
    except evaluate.EvaluationError as exc:
        raise Refuse(str(exc)) from None
    return _consts(b, m, results)


# --- shapes ---------------------------------------------------------------------------------


def _shape_range(m: Match, dims: list) -> list:
    start = m.attr("shape", "start", 0) or 0
    end = m.attr("shape", "end", None)
    return dims[start:end] if end is not None else dims[start:]


def _runs_in_onnxruntime(m: Match) -> None:
    dtype = evaluate.expected_dtype(m["x"], m.opsets)
    if dtype is not None and evaluate.lacks_kernel(m.root, m.opsets, [dtype]):
        raise Refuse(f"onnxruntime has no {m.root.op_type} kernel for {dtype.name}: folded, the model would run")


def shape_folding_replacement(m: Match, b):
    _runs_in_onnxruntime(m)
    dims = m.dims("x")
    if dims is None:
        raise Refuse("shape unknown")
    dims = _shape_range(m, dims)
    if any(d is None for d in dims):
        raise Refuse("the shape has dynamic dimensions")
    return b.const(np.array(dims, dtype=np.int64), name=m.root.outputs[0].name or "shape")


def size_folding_replacement(m: Match, b):
    _runs_in_onnxruntime(m)
    dims = m.dims("x")
    if dims is None or any(d is None for d in dims):
        raise Refuse("the shape is not static")
    return b.const(np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64), name=m.root.outputs[0].name or "size")


def shape_gather_folding_replacement(m: Match, b):
    dims = m.dims("x")
    if dims is None:
        raise Refuse("shape unknown")
    idx = m.const("idx")
    if (m.attr("gather", "axis", 0) or 0) != 0:
        raise Refuse("not on axis 0")
    picked = gather_elements(_shape_range(m, dims), idx)
    if picked is None:
        raise Refuse("not integer indices in range")
    if any(d is None for d in picked):
        raise Refuse("a picked dimension is dynamic")
    return b.const(np.array(picked, dtype=np.int64).reshape(idx.shape), name=m.root.outputs[0].name or "dims")


def shape_slice_folding_replacement(m: Match, b):
    dims = m.dims("x")
    if dims is None:
        raise Refuse("shape unknown")
    picked = slice_elements(_shape_range(m, dims), m.const("starts"), m.const("ends"), m.const("axes"),
                            m.const("steps"))
    if picked is None:
        raise Refuse("not a 1-D slice")
    if any(d is None for d in picked):
        raise Refuse("a sliced dimension is dynamic")
    return b.const(np.array(picked, dtype=np.int64), name=m.root.outputs[0].name or "dims")


_SHAPE = Op("Shape", "x", name="shape", shared=True)

RULES = [
    Rule("constant_to_initializer", Op("Constant", name="constant"), constant_to_initializer_replacement,
         condition=constant_to_initializer_condition, priority=100,
         exact=True, doc="A Constant node becomes an initializer (weights kept in Constant nodes, as PP-OCR does)."),
    Rule("constant_folding", Op("*", name="node"), constant_folding_replacement,
         condition=constant_folding_condition, priority=90,
         exact=True, doc="A standard node whose inputs are all constant is evaluated (as onnxruntime computes it) into "
             "initializers."),
    Rule("shape_folding", Op("Shape", "x", name="shape"), shape_folding_replacement, priority=80,
         exact=True, doc="Shape of a value whose shape is static is a constant."),
    Rule("size_folding", Op("Size", "x"), size_folding_replacement, priority=80,
         exact=True, doc="Size of a value whose shape is static is a constant."),
    Rule("shape_gather_folding", Op("Gather", _SHAPE, Const("idx"), name="gather"), shape_gather_folding_replacement,
         priority=80, exact=False,
         doc="Gather of static dimensions from a Shape is a constant, even when other axes are dynamic."),
    Rule("shape_slice_folding",
         Op("Slice", _SHAPE, Const("starts"), Const("ends"), Opt(Const("axes")), Opt(Const("steps"))),
         shape_slice_folding_replacement, priority=80,
         exact=False, doc="Slice of static dimensions from a Shape is a constant, even when other axes are dynamic."),
]
