"""Evaluating nodes at optimization time, for constant folding.

The evaluator is onnx's reference implementation (``onnx.reference``), one node at a time:

- it *is* the ONNX specification in executable form, for every standard op at every opset
  version, so a folded value is what the standard says the node computes;
- it ships with onnx, which the core already needs, so folding works without onnxruntime (an
  optional extra here);
- a node costs about 0.3 ms to evaluate, and only nodes whose inputs are all constant are ever
  evaluated, which in exported models are shape computations and small parameter tensors.

onnxruntime would be faster on large tensors but needs a session per evaluation (milliseconds
each) and is not always installed; numpy alone would mean re-implementing the spec by hand.

What is never folded: random ops (their value differs per run), nodes with subgraphs, ops outside
the standard domain, sequence/optional/map values, string tensors, results whose size breaks
the size limit (see :func:`size_allows`), and nodes whose constant inputs together pass
``DEFAULT_INPUT_LIMIT`` (256 MiB; ``optimize(fold_input_limit=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

# Imported with the library, not on the first fold: it loads every op's implementation (~0.1 s),
# which a process pays once rather than inside the first optimize() call.
from onnx.reference import ReferenceEvaluator

RANDOM_OPS = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
})
# Not folded here: Constant nodes become initializers by their own rule; Identity of a constant
# would only copy it (identity_elimination forwards the value instead); the rest have subgraphs.
NOT_FOLDED = RANDOM_OPS | frozenset({"Constant", "Identity", "If", "Loop", "Scan", "SequenceMap"})

DEFAULT_SIZE_LIMIT = 1 << 20  # bytes: folded outputs up to this size are always accepted
# bytes: a node whose constant inputs add up to more is not evaluated (reading a multi-GiB weight
# at optimization time to fold, say, its sum costs more than it saves; weights stay lazy).
DEFAULT_INPUT_LIMIT = 256 << 20


class EvaluationError(Exception):
    pass


_EVALUATORS: dict[tuple[int, bytes], ReferenceEvaluator] = {}
_EVALUATOR_CACHE_SIZE = 512


def _evaluator(proto: onnx.NodeProto, opset: int) -> ReferenceEvaluator:
    """One evaluator per distinct node (op, attributes, input/output arity, opset): building one
    costs ~0.4 ms, and exporters repeat the same node many times (one per layer)."""
    key = (opset, proto.SerializeToString(deterministic=True))
    evaluator = _EVALUATORS.get(key)
    if evaluator is None:
        if len(_EVALUATORS) >= _EVALUATOR_CACHE_SIZE:
            _EVALUATORS.pop(next(iter(_EVALUATORS)))
        evaluator = _EVALUATORS[key] = ReferenceEvaluator(proto, opsets={"": opset})
    return evaluator


def _slice(inputs: Sequence[np.ndarray | None]) -> np.ndarray:
    """Slice (opset 10+), with the spec's clamping: onnx's reference implementation clamps a
    negative step's start like Python does (an empty result where ONNX picks the first element)."""
    data, starts, ends = inputs[0], inputs[1].reshape(-1), inputs[2].reshape(-1)
    axes = inputs[3].reshape(-1) if len(inputs) > 3 and inputs[3] is not None else np.arange(len(starts))
    steps = inputs[4].reshape(-1) if len(inputs) > 4 and inputs[4] is not None else np.ones(len(starts), np.int64)
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or len(set(int(a) % max(data.ndim, 1) for a in axes)) != len(axes):
        raise EvaluationError("inconsistent Slice inputs")
    out = data
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = int(a)
        if not -data.ndim <= a < data.ndim:
            raise EvaluationError("axis out of range")
        a %= data.ndim
        out = np.take(out, slice_positions(out.shape[a], int(s), int(e), int(st)), axis=a)
    return np.ascontiguousarray(out)


def evaluate(node: ir.Node, opset: int, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """Outputs of ``node`` (standard domain) on constant ``inputs`` (None for absent optional ones)."""
    if node.op_type == "Slice" and opset >= 10 and len(inputs) >= 3 and all(x is not None for x in inputs[:3]):
        try:
            return [_slice(inputs)]
        except (ValueError, IndexError) as exc:
            raise EvaluationError(f"{type(exc).__name__}: {exc}") from None
    in_names = ["" if x is None else f"i{k}" for k, x in enumerate(inputs)]
    out_names = [f"o{k}" if v is not None else "" for k, v in enumerate(node.outputs)]
    attrs = [ir.serde.serialize_attribute(a) for a in node.attributes.values()]
    proto = onnx.helper.make_node(node.op_type, in_names, out_names)
    proto.attribute.extend(attrs)
    try:
        evaluator = _evaluator(proto, opset)
        feeds = {name: x for name, x in zip(in_names, inputs) if name}
        results = evaluator.run(None, feeds)
    except Exception as exc:  # the reference implementation refuses: then so do we
        raise EvaluationError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    out = []
    for r in results:
        if not isinstance(r, np.ndarray):
            if isinstance(r, (np.generic, int, float, bool)):
                r = np.asarray(r)
            else:
                raise EvaluationError(f"result is a {type(r).__name__}, not a tensor")
        out.append(r)
    return out


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


def nbytes(tensor: ir.TensorProtocol) -> int:
    try:
        return int(tensor.nbytes)
    except Exception:
        return int(np.prod(tensor.shape.numpy(), dtype=np.int64)) * max(1, tensor.dtype.itemsize)


def size_allows(node: ir.Node, out_bytes: int, limit: int) -> bool:
    """A folded result is accepted when it is at most ``limit`` bytes, or when it is no larger than
    the constants feeding the node that this node alone uses (they disappear with it), so folding
    never grows the model by more than ``limit`` per node."""
    if out_bytes <= limit:
        return True
    from .pattern import constant_tensor

    freed = 0
    for value in node.inputs:
        if value is None or value.is_graph_output():
            continue
        if any(use.node is not node for use in value.uses()):
            continue
        tensor = constant_tensor(value)
        if tensor is not None:
            freed += nbytes(tensor)
    return out_bytes <= freed


def expected_dtype(value: ir.Value, opsets: Mapping[str, int]) -> ir.DataType | None:
    from .shapes import infer

    if value.type is None:
        infer(value, opsets)
    if value.type is None:
        return None
    if not isinstance(value.type, ir.TensorType):
        return ir.DataType.UNDEFINED  # sequence/optional/sparse: never a folded tensor
    return value.type.dtype


def expected_shape(value: ir.Value, opsets: Mapping[str, int]) -> tuple[int, ...] | None:
    """The static shape the model (or onnx's shape inference) gives ``value``, if fully known."""
    from .shapes import infer

    shape = infer(value, opsets)
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)
