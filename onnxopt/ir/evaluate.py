"""Evaluating nodes at optimization time, for constant folding.

A folded value is what onnxruntime's CPU provider (the installed version) computes for the node,
or the node is not folded: integer, bool and shape results exactly, float results within 1 ulp.
``scripts/oracles/fold.py`` checks this for every op and dtype, with edge values.

**With onnxruntime** (the ``[ort]`` extra), onnxruntime evaluates the node: a one-node model
whose constant inputs are its graph inputs (graph optimizations off, one thread, no memory
arena). Sessions are kept per distinct node signature (op, attributes, opset, input dtypes), so
an exporter's repeated nodes cost one session (~0.1 ms) and a run each (~10 us). Not folded:

- what onnxruntime refuses (no kernel for the dtype, an integer division by zero, an opset it
  does not know...); an integer Div of the smallest integer by -1 is not even handed to it (its
  kernel stops the process with SIGFPE);
- a float16 node onnxruntime has no float16 kernel for, when a consumer has none either:
  onnxruntime computes both in float32 between casts and keeps float32 between them, which a
  folded (float16) value would round.

Tensors of a dtype onnxruntime's Python API cannot exchange (bfloat16, float8, 4-bit) take the
exact path below, where onnxruntime has a kernel for the node on them.

**Without onnxruntime** (a rules-only install), only results that any correct implementation
computes identically are folded (onnx's reference implementation evaluates them):

- copies of input elements, any dtype: Reshape, Squeeze, Unsqueeze, Flatten, Transpose, Concat,
  Split, Slice, Gather, Expand, Tile, Where, ConstantOfShape, Shape, Size;
- comparisons and logic (Equal, Less, LessOrEqual, Greater, GreaterOrEqual, Not, And, Or, Xor);
- integer arithmetic (Add, Sub, Mul, Neg, Abs, Min, Max, and Div/Mod of non-negative integers
  by positive ones) and integer Range, on at most 65536 elements, each result checked against
  exact (Python) integer arithmetic: an overflow is not folded;
- Cast between integer and bool types when every value is kept, from integers to floats that
  hold them exactly, and between float types (rounded to nearest even).

Everything else (float arithmetic, reductions, normalizations, Pow...) is left to run. What
onnxopt cannot know without onnxruntime is which kernels onnxruntime lacks: a node it has no
kernel for (Where on uint16, Equal on bfloat16...) may be folded, so the result runs where the
input model did not.

**Sizes are decided before evaluating**: onnx's shape inference gives every output's dtype and
static shape from the constant inputs alone (their types, and the data of the small ones:
shapes, axes, pads, repeats, scales; never what the model declares); a node whose outputs are
not all known, or would pass the bytes allowed (:func:`allowed_bytes`), is not evaluated. So no
result larger than the limits is ever allocated (the evaluators' temporaries stay within a small
multiple of the results).

Also never folded: random ops and Dropout in training mode (their value differs per run), nodes
with subgraphs, ops outside the standard domain, sequence/optional/map values, string tensors,
and nodes whose constant inputs together pass ``DEFAULT_INPUT_LIMIT`` (256 MiB;
``optimize(fold_input_limit=...)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

# Imported with the library, not on the first fold: it loads every op's implementation (~0.1 s),
# which a process pays once rather than inside the first optimize() call.

from onnxopt.ir.io import first_line, onnxruntime_module  # noqa: E402
from onnxopt.ir.kernels import kernel_defs  # noqa: E402
from onnxopt.ir.util import DEFERRED_MIN_BYTES, RANDOM_OPS, constant_tensor, deferred, nbytes, use_count  # noqa: E402  (RANDOM_OPS: one list, what is never folded, merged or assumed fixed)
from onnxopt.ir.shapes import SMALL_CONST, infer, infer_node_outputs, slice_positions, small_tensor_proto  # noqa: E402

# Not folded here: Constant nodes become initializers by their own rule; Identity of a constant
# would only copy it (identity_elimination forwards the value instead); the rest have subgraphs.
NOT_FOLDED = RANDOM_OPS | frozenset({"Constant", "Identity", "If", "Loop", "Scan", "SequenceMap"})

from onnxopt.ir.shapes import DEFAULT_SIZE_LIMIT  # noqa: E402,F401  bytes: folded outputs up to this size are always accepted
# bytes: a node whose constant inputs add up to more is not evaluated (reading a multi-GiB weight
# at optimization time to fold, say, its sum costs more than it saves; weights stay lazy).
DEFAULT_INPUT_LIMIT = 256 << 20


class EvaluationError(Exception):
    pass


def evaluate(node: ir.Node, opsets: Mapping[str, int], inputs: Sequence[ir.TensorProtocol | None], max_bytes: int
             ) -> list[np.ndarray]:
    """Outputs of ``node`` (standard domain) on constant ``inputs`` (None for absent optional
    ones), as onnxruntime computes them; EvaluationError when the node is not to be folded,
    among others when its outputs would take more than ``max_bytes`` (decided before evaluating)."""
    expected = _before_evaluating(node, opsets, inputs, max_bytes)
    proto = _node_proto(node, inputs)
    arrays = [None if t is None else t.numpy() for t in inputs]
    opset, runtime = opsets.get("", 1), folding_runtime()
    if runtime is None:
        results, exact = _run_exact(proto, opset, arrays), True
    elif all(a is None or a.dtype in _EXCHANGED for a in arrays) and all(d.numpy() in _EXCHANGED for d, _ in expected):
        results, exact = _run_onnxruntime(runtime, proto, opset, arrays), False
    elif lacks_kernel(node, opsets, {t.dtype for t in inputs if t is not None} | {d for d, _ in expected}):
        raise EvaluationError("onnxruntime has no kernel for these dtypes")
    else:
        results, exact = _run_exact(proto, opset, arrays), True  # (bfloat16, float8...: onnxruntime runs it)
    if len(results) != len(expected):
        raise EvaluationError(f"evaluation gave {len(results)} outputs, the node has {len(expected)}")
    out = []
    for r, (dtype, shape) in zip(results, expected):
        if not isinstance(r, np.ndarray):
            raise EvaluationError(f"result is a {type(r).__name__}, not a tensor")
        if r.dtype != dtype.numpy():
            raise EvaluationError(f"evaluation gave {r.dtype}, inference {dtype.name}")
        if r.shape != shape:
            # onnx's reference implementation gives some scalars as [1]; onnxruntime's shape is the truth
            if not exact or r.size != math.prod(shape):
                raise EvaluationError(f"evaluation gave shape {r.shape}, inference {shape}")
            r = r.reshape(shape)
        out.append(r)
    return out


def evaluate_deferred(node: ir.Node, opsets: Mapping[str, int], inputs: Sequence[ir.TensorProtocol | None],
                      max_bytes: int) -> list[ir.TensorProtocol] | None:
    """The outputs of a Transpose of a constant of at least ``DEFERRED_MIN_BYTES`` (a dtype numpy and
    onnxruntime share) as tensors computed when read (``onnxopt.ir.util.deferred``): the elements moved,
    which is what onnxruntime computes, bit for bit; the source (an input's external data, memory-mapped)
    is not read now and the result is never held beyond its reading (a model over 2 GB whose exporter
    writes ``Transpose(W)`` before every MatMul keeps one transposed weight in memory at a time). The
    same checks as :func:`evaluate` (EvaluationError); None for any other node: evaluate it."""
    if node.op_type != "Transpose" or len(inputs) != 1 or inputs[0] is None:
        return None
    source = inputs[0]
    if nbytes(source) < DEFERRED_MIN_BYTES or source.dtype.numpy() not in _EXCHANGED:
        return None
    ((dtype, shape),) = _before_evaluating(node, opsets, inputs, max_bytes)
    attr = node.attributes.get("perm")
    perm = tuple(int(p) for p in attr.value) if attr is not None else tuple(range(len(source.shape)))[::-1]
    return [deferred(lambda: _transposed(source.numpy(), perm), dtype, shape)]


_TRANSPOSE_ROWS = 64  # rows of a matrix transposed at a time (numpy's whole-matrix strided copy is ~3x slower)


def _transposed(array: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    """``array`` transposed by ``perm``, contiguous: a matrix a band of rows at a time, which keeps the
    reads and writes in cache (0.10 s for 46 MB here, against 0.30 s for one copy, 0.08 s for onnxruntime)."""
    if array.ndim != 2 or perm != (1, 0):
        return np.ascontiguousarray(np.transpose(array, perm))
    out = np.empty((array.shape[1], array.shape[0]), array.dtype)
    for start in range(0, array.shape[0], _TRANSPOSE_ROWS):
        out[:, start:start + _TRANSPOSE_ROWS] = array[start:start + _TRANSPOSE_ROWS].T
    return out


def _before_evaluating(node: ir.Node, opsets: Mapping[str, int], inputs: Sequence[ir.TensorProtocol | None],
                       max_bytes: int) -> list[tuple[ir.DataType, tuple[int, ...]]]:
    """The outputs' dtypes and shapes, once it is known that the node is to be evaluated."""
    if node.op_type == "Dropout" and len(inputs) > 2 and inputs[2] is not None and inputs[2].numpy().any():
        raise EvaluationError("Dropout in training mode draws random numbers")
    expected = output_types(node, opsets.get("", 1), inputs)
    if expected is None:
        raise EvaluationError("the output shapes are not known before evaluating")
    if any(dtype == ir.DataType.STRING for dtype, _ in expected):
        raise EvaluationError("string tensors are not folded")
    total = sum(math.ceil(math.prod(shape) * dtype.itemsize) for dtype, shape in expected)
    if total > max_bytes:
        raise EvaluationError(f"the result of {total} bytes passes the size limit")
    runtime = folding_runtime()
    if runtime is not None and any(dtype == ir.DataType.FLOAT16 for dtype, _ in expected) \
            and _widened(runtime, node, opsets) \
            and any(_widened(runtime, use.node, opsets) for value in node.outputs for use in value.uses()):
        raise EvaluationError("onnxruntime computes this float16 node and a consumer in float32, keeping "
                              "float32 between them: folded, the value would be rounded to float16")
    return expected


# --- before evaluating: output dtypes and shapes ----------------------------------------------


def output_types(node: ir.Node, opset: int, inputs: Sequence[ir.TensorProtocol | None]
                 ) -> list[tuple[ir.DataType, tuple[int, ...]]] | None:
    """Each output's dtype and static shape from onnx's inference on the constant ``inputs``
    (their types, and the data of the small ones), or None when one is not known. What the model
    declares is not read: a wrong declaration must not let a huge result through."""

    proto = _node_proto(node, inputs)
    types, data = {}, {}
    for name, tensor in zip(proto.input, inputs):
        if tensor is None:
            continue
        types[name] = onnx.helper.make_tensor_type_proto(tensor.dtype.value, [int(d) for d in tensor.shape])
        if tensor.size <= SMALL_CONST and tensor.dtype != ir.DataType.STRING:
            data[name] = small_tensor_proto(tensor, name)
    inferred = infer_node_outputs(proto, {"": opset}, types, data)
    if inferred is None:
        return None
    out = []
    for name in proto.output:
        tp = inferred.get(name)
        if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.elem_type \
                or not tp.tensor_type.HasField("shape"):
            return None
        dims = tp.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value < 0 for d in dims):
            return None
        out.append((ir.DataType(tp.tensor_type.elem_type), tuple(int(d.dim_value) for d in dims)))
    if node.op_type == "Range" and out and out[0][1] != (_range_length(inputs),):
        return None  # onnx counts in the inputs' type: an int32 Range's length overflows (0 for 3e8)
    return out


def _range_length(inputs: Sequence[ir.TensorProtocol | None]) -> int | None:
    """How many elements Range gives, counted with Python numbers (None if not finite)."""
    try:
        start, limit, delta = (t.numpy().reshape(-1)[0].item() for t in inputs)
        length = math.ceil((limit - start) / delta) if isinstance(delta, float) else -((start - limit) // delta)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError, OverflowError, IndexError):
        return None
    return max(length, 0)


def _node_proto(node: ir.Node, inputs: Sequence[object | None]) -> onnx.NodeProto:
    """``node`` alone, its inputs named i0, i1... ('' where absent), its outputs o0, o1..."""
    proto = onnx.helper.make_node(node.op_type, ["" if x is None else f"i{k}" for k, x in enumerate(inputs)],
                                  [f"o{k}" for k in range(len(node.outputs))])
    proto.attribute.extend(ir.serde.serialize_attribute(a) for a in node.attributes.values())
    return proto


# --- with onnxruntime ----------------------------------------------------------------------

# The dtypes onnxruntime's Python API takes and gives as numpy arrays.
_EXCHANGED = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64))
_SESSIONS: dict[tuple, object] = {}  # signature -> session, or the reason onnxruntime refused it
_SESSION_CACHE_SIZE = 256


@functools.cache
def folding_runtime():
    """The onnxruntime module folding runs, or None (imported on the first fold, not with the
    library). The fold oracle and the tests replace it with ``lambda: None`` to fold as without it."""
    return onnxruntime_module()


def _run_onnxruntime(runtime, proto: onnx.NodeProto, opset: int, arrays: list) -> list[np.ndarray]:
    reason = crashes_onnxruntime(proto.op_type, arrays)
    if reason is not None:
        raise EvaluationError(reason)
    dtypes = tuple(None if a is None else a.dtype.str for a in arrays)
    key = (opset, proto.SerializeToString(deterministic=True), dtypes)
    session = _SESSIONS.get(key)
    if session is None:
        if len(_SESSIONS) >= _SESSION_CACHE_SIZE:
            _SESSIONS.pop(next(iter(_SESSIONS)))
        session = _SESSIONS[key] = _session(runtime, proto, opset, arrays)
    if isinstance(session, str):
        raise EvaluationError(session)
    try:
        return session.run(None, {name: a for name, a in zip(proto.input, arrays) if name})
    except Exception as exc:  # onnxruntime refuses these values (e.g. an integer division by zero)
        raise EvaluationError(first_line(exc, typed=True)) from None


def _session(runtime, proto: onnx.NodeProto, opset: int, arrays: list):
    """A session running ``proto`` on inputs of the dtypes of ``arrays`` (any shapes)."""
    inputs = [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), None)
              for name, a in zip(proto.input, arrays) if name]
    graph = onnx.helper.make_graph([proto], "fold", inputs, [onnx.ValueInfoProto(name=o) for o in proto.output])
    opsets = [onnx.helper.make_opsetid("", opset)]
    model = onnx.helper.make_model(graph, opset_imports=opsets,
                                   ir_version=onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    options = runtime.SessionOptions()
    options.graph_optimization_level = runtime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False  # a cached session would keep its largest result's memory
    options.enable_mem_pattern = False
    options.log_severity_level = 4  # its refusals are reported as reasons, not printed
    try:
        return runtime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        return first_line(exc, typed=True)


@functools.cache
def _kernels(runtime) -> dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]] | None:
    """(domain, op) -> onnxruntime's CPU kernels for it: opset range and the types it takes, or
    None when this onnxruntime does not list its kernels."""
    defs = kernel_defs()  # (read safely: on a GPU build the listing can crash the process)
    if defs is None:
        return None
    out: dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]] = {}
    for op, domain, lo, hi, provider, types in defs:
        if provider == "CPUExecutionProvider":
            out.setdefault((domain, op), []).append((lo, hi, frozenset(types)))
    return out


def _has_kernel(runtime, node: ir.Node, opsets: Mapping[str, int], dtypes) -> bool:
    """onnxruntime's CPU provider has a kernel for ``node`` that takes all of ``dtypes`` (assumed
    when onnxruntime does not list its kernels)."""
    kernels = _kernels(runtime)
    if kernels is None:
        return True
    domain = "" if node.domain == "ai.onnx" else node.domain
    opset = opsets.get(domain, 1)
    wanted = {f"tensor({dtype.name.lower()})" for dtype in dtypes}
    return any(lo <= opset <= hi and wanted <= types for lo, hi, types in kernels.get((domain, node.op_type), ()))


def lacks_kernel(node: ir.Node, opsets: Mapping[str, int], dtypes) -> bool:
    """onnxruntime is installed and has no CPU kernel for ``node`` on ``dtypes``: it refuses the
    model, and folding the node (by any rule) would make it run."""
    runtime = folding_runtime()
    return runtime is not None and not _has_kernel(runtime, node, opsets, dtypes)


def _widened(runtime, node: ir.Node, opsets: Mapping[str, int]) -> bool:
    """onnxruntime's CPU provider has no float16 kernel for ``node``, so it casts the node's
    float16 inputs to float32 and its outputs back, and keeps float32 between two such nodes."""
    return not _has_kernel(runtime, node, opsets, [ir.DataType.FLOAT16])


def crashes_onnxruntime(op_type: str, arrays: list) -> str | None:
    """Inputs on which onnxruntime's kernel stops the process instead of refusing."""
    if op_type == "Div" and len(arrays) == 2 and arrays[0] is not None and arrays[0].dtype.kind == "i":
        a, b = arrays
        if np.any(a == np.iinfo(a.dtype).min) and np.any(b == -1):  # (not checked pairwise: rare enough)
            return "an integer division of the smallest integer by -1 overflows"
    return None


# --- without onnxruntime: the exact set -------------------------------------------------------

_COPIES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Concat", "Split", "Slice", "Gather",
                     "Expand", "Tile", "Where", "ConstantOfShape", "Shape", "Size"})
_COMPARISONS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor"})
# Integer arithmetic and its exact counterpart on Python integers (numpy object arrays). Div and
# Mod only for non-negative operands, where truncating (onnxruntime) and flooring agree.
_INTEGER = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Neg": np.negative, "Abs": np.abs,
            "Min": np.minimum, "Max": np.maximum, "Div": np.floor_divide, "Mod": np.mod}
_INTEGER_ELEMENTS = 1 << 16  # Python integers take ~40 bytes each: the checked arithmetic stays small
_EVALUATORS: dict[tuple[int, bytes], "onnx.reference.ReferenceEvaluator"] = {}
_EVALUATOR_CACHE_SIZE = 512


def _run_exact(proto: onnx.NodeProto, opset: int, arrays: list) -> list[np.ndarray]:
    op, present = proto.op_type, [a for a in arrays if a is not None]
    if op in _INTEGER or op == "Range":
        if not present or any(a.dtype.kind not in "iu" for a in present):
            raise EvaluationError(f"{op} is folded without onnxruntime only on integers")
        if max(a.size for a in present) > _INTEGER_ELEMENTS:
            raise EvaluationError(f"integer {op} on more than {_INTEGER_ELEMENTS} elements needs onnxruntime")
        if op in ("Div", "Mod") and (np.any(present[0] < 0) or np.any(present[1] <= 0)):
            raise EvaluationError(f"{op} of negative numbers or by zero is folded only with onnxruntime")
    elif op == "Cast":
        pass  # checked on the result
    elif op not in _COPIES and op not in _COMPARISONS:
        raise EvaluationError(f"{op} is folded only with onnxruntime")
    if op == "Slice" and opset >= 10 and len(arrays) >= 3 and all(x is not None for x in arrays[:3]):
        try:
            results = [_slice(arrays)]
        except (ValueError, IndexError) as exc:
            raise EvaluationError(f"{type(exc).__name__}: {exc}") from None
    else:
        results = _reference(proto, opset, arrays)
    if op in _INTEGER:
        exact = functools.reduce(_INTEGER[op], [a.astype(object) for a in present]) if len(present) > 1 \
            else _INTEGER[op](present[0].astype(object))
        _check_exact(results[0], exact, op)
    elif op == "Range":
        start, limit, delta = (int(a.reshape(-1)[0]) for a in present)
        _check_exact(results[0], np.array(range(start, limit, delta), dtype=object), op)  # (delta 0 failed above)
    elif op == "Cast":
        _check_cast(present[0], results[0])
    return results


def _check_exact(result, exact: np.ndarray, op: str) -> None:
    if not isinstance(result, np.ndarray) or result.shape != np.shape(exact) \
            or not np.all(result.astype(object) == exact):
        raise EvaluationError(f"{op} overflows its integer type")


def _check_cast(x: np.ndarray, y) -> None:
    """A Cast that keeps every value (integers and bools), or rounds floats to floats."""
    if not isinstance(y, np.ndarray) or x.dtype.kind not in "iubf" or y.dtype.kind not in "iubf":
        raise EvaluationError("this Cast is folded only with onnxruntime")
    if x.dtype.kind == "f":
        if y.dtype.kind != "f":
            raise EvaluationError("a Cast from floats to integers is folded only with onnxruntime")
        return  # float to float: IEEE rounding to nearest even
    if y.dtype.kind == "b":
        return  # nonzero is True
    if x.size > _INTEGER_ELEMENTS or not np.all(y.astype(object) == x.astype(object)):
        raise EvaluationError("a Cast that changes values is folded only with onnxruntime")


def _reference(proto: onnx.NodeProto, opset: int, arrays: list) -> list:
    key = (opset, proto.SerializeToString(deterministic=True))
    evaluator = _EVALUATORS.get(key)
    try:
        if evaluator is None:  # building one costs ~0.4 ms, and exporters repeat nodes
            if len(_EVALUATORS) >= _EVALUATOR_CACHE_SIZE:
                _EVALUATORS.pop(next(iter(_EVALUATORS)))
            from onnx.reference import ReferenceEvaluator  # (imported when first needed: ~20 ms)

            evaluator = _EVALUATORS[key] = ReferenceEvaluator(proto, opsets={"": opset})
        with np.errstate(all="ignore"):
            results = evaluator.run(None, {name: a for name, a in zip(proto.input, arrays) if name})
    except Exception as exc:  # the reference implementation refuses: then so do we
        raise EvaluationError(first_line(exc, typed=True)) from None
    return [np.asarray(r) if isinstance(r, (np.generic, int, float, bool)) else r for r in results]


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


# --- sizes and declared types -------------------------------------------------------------------


def allowed_bytes(node: ir.Node, limit: int) -> int:
    """How many bytes of results folding ``node`` may create: ``limit``, or as many as the
    constants feeding the node that this node alone uses (they disappear with it), so folding
    never grows the model by more than ``limit`` per node."""
    freed = 0
    for value in node.inputs:
        if value is None or value.is_graph_output():
            continue
        if use_count(value) != sum(1 for v in node.inputs if v is value):  # another node reads it too
            continue
        tensor = constant_tensor(value)
        if tensor is not None:
            freed += nbytes(tensor)
    return max(limit, freed)


def expected_dtype(value: ir.Value, opsets: Mapping[str, int]) -> ir.DataType | None:
    if value.type is None:
        infer(value, opsets)
    if value.type is None:
        return None
    if not isinstance(value.type, ir.TensorType):
        return ir.DataType.UNDEFINED  # sequence/optional/sparse: never a folded tensor
    return value.type.dtype
