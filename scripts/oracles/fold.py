"""Folding oracle: onnxopt's constant folding against onnxruntime, op by op, dtype by dtype.

    python -m scripts.oracles.fold [--jobs N] [--mode both|ort|exact] [--ops Add,Div] [--subset]
                                   [--show N] [--all-rules] [--max-memory GIB]

Every case is one node whose inputs are initializers. onnxruntime CPU runs that model as given
(default session options): the reference. onnxopt optimizes it (with the folding rules; every
rule with ``--all-rules``), and then either the node was folded, and onnxruntime on the result
must give the reference (integer and bool results and every shape and dtype exactly, floats
within 1 ulp, NaN where NaN), or it was left unfolded (and the result must still give the
reference). Where onnxruntime refuses the model (an integer division by zero, no kernel for the
dtype...), gives different values on two runs (Dropout in training mode), or is not run at all
(a result whose size onnx cannot infer or over 64 MiB, or a kernel that would stop the process),
the node must be left unfolded.

The cases:

- seeds: every one-node ONNX backend test case of the standard domain with non-string tensor
  inputs (``_backend_cases.py``): every op onnxopt can fold, with inputs that make sense for it;
- each seed with every other dtype its type constraints allow among those onnxruntime's Python
  API exchanges, plus bfloat16 and float8 (outputs of those read through a Cast to float);
- each of those with its data inputs (not indices, shapes or axes) filled with edge values: NaN,
  +-inf, -0, the dtype's extremes, the smallest normal and subnormal, halves; for integers the
  extremes, -1, 0 and 1, so that overflow and zero divisors come up;
- hand-written cases: fp16 sums that pass fp16's range (ReduceMean of 1000 x 100...), fp16
  normalizations near 300, NaN in ArgMax/Max, integer overflow (Pow, Mul, Neg, Abs, CumSum,
  reductions), integer division and modulo by zero and of the smallest integer by -1, empty
  tensors, Dropout in training mode.

Each case runs in two modes: ``ort`` (folding evaluates with onnxruntime) and ``exact`` (folding
as without onnxruntime installed). Printed per mode: cases, folded-and-agreed, left-unfolded,
disagreements (the first ``--show`` described); the exit status is 1 on any disagreement. In
``exact`` mode, folds where onnxruntime has no kernel for the node (so the result runs where the
input did not) are counted apart: without onnxruntime, onnxopt cannot know its kernels. Models
the ONNX checker refuses (dtype variants the schema does not take) are not counted.
``--subset`` runs the fixed representative subset CI runs (tests/test_fold_oracle.py): the
hand-written cases and every ``SUBSET_STEP``-th generated one. The whole takes about 3.5 minutes
with ``--jobs 2``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import multiprocessing
import resource
import sys
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from scripts.oracles import _backend_cases as backend

from onnxopt.ir import evaluate
from onnxopt import optimize
from onnxopt.errors import OnnxoptError

SUBSET_STEP = 53  # the CI subset: every 53rd generated case (and every hand-written one)
MAX_RESULT_BYTES = 64 << 20
_VARIANT_DTYPES = (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
_INDEX_TYPES = {"tensor(int32)", "tensor(int64)"}


@dataclasses.dataclass
class Case:
    name: str
    node: onnx.NodeProto
    inputs: list  # numpy arrays (None for an absent optional input)
    opset: int
    handmade: bool = False

    def model(self) -> onnx.ModelProto:
        """The node with its inputs as initializers; outputs of dtypes onnxruntime cannot give
        numpy are read through a Cast to float (exact for bfloat16 and float8)."""
        node = onnx.NodeProto()
        node.CopyFrom(self.node)
        names = [f"in{k}" if x is not None else "" for k, x in enumerate(self.inputs)]
        del node.input[:]
        node.input.extend(names)
        inits = [numpy_helper.from_array(np.asarray(x), n) for n, x in zip(names, self.inputs) if n]
        opsets = [helper.make_opsetid("", self.opset)]
        outputs = [onnx.ValueInfoProto(name=o) for o in node.output if o]
        proto = helper.make_model(helper.make_graph([node], self.name, [], outputs, inits), opset_imports=opsets,
                                  ir_version=max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True)))
        inferred = onnx.shape_inference.infer_shapes(proto)
        outputs = []
        for out in inferred.graph.output:
            elem = out.type.tensor_type.elem_type if out.type.HasField("tensor_type") else 0
            if elem in (TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2):
                proto.graph.node.append(helper.make_node("Cast", [out.name], [f"{out.name}_f"], to=TensorProto.FLOAT))
                outputs.append(helper.make_tensor_value_info(f"{out.name}_f", TensorProto.FLOAT, None))
            else:
                outputs.append(out)
        del proto.graph.output[:]
        proto.graph.output.extend(outputs)
        return proto


# --- generating cases -------------------------------------------------------------------------


def _formal_params(node: onnx.NodeProto, opset: int) -> list[str] | None:
    """The type string (a parameter such as "T", or a fixed "tensor(int64)") of each input."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    formal = list(schema.inputs)
    if not formal:
        return []
    return [formal[min(k, len(formal) - 1)].type_str for k in range(len(node.input))]


def _allowed(node: onnx.NodeProto, opset: int) -> dict[str, set[str]]:
    schema = onnx.defs.get_schema(node.op_type, opset, "")
    return {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}


def _type_str(dtype) -> str:
    return f"tensor({ir.DataType.from_numpy(np.dtype(dtype)).name.lower()})"


def _convert(x: np.ndarray, dtype) -> np.ndarray:
    """``x``'s values in ``dtype``: rounded and clipped into an integer type's range."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.nan_to_num(x.astype(np.float64)), info.min, info.max).round().astype(dtype)
    if dtype == np.bool_:
        return x.astype(np.float64) != 0
    return x.astype(np.float64).astype(dtype) if x.dtype.kind != "f" or x.dtype.itemsize < 2 else x.astype(dtype)


def _edges(dtype) -> list:
    dtype = np.dtype(dtype)
    if dtype not in {np.dtype(t) for t in _VARIANT_DTYPES}:
        return []  # (4-bit, 2-bit, float4...: left as the seed has them)
    if dtype == np.bool_:
        return [True, False, False, True, True]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = [info.min, info.max, 0, 1, info.max - 1, 2, 7]
        return values + ([-1, info.min + 1, -2] if dtype.kind == "i" else [])
    info = ml_dtypes.finfo(dtype)
    return [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, float(info.max), -float(info.max), float(info.tiny),
            float(info.smallest_subnormal), 0.5, 2.5, -2.5, float(info.max) / 2, 1e-3]


def _with_edges(x: np.ndarray, rotate: int) -> np.ndarray:
    values = _edges(x.dtype)
    values = values[rotate % len(values):] + values[: rotate % len(values)]
    with np.errstate(all="ignore"):
        return np.resize(np.array(values, dtype=np.float64 if x.dtype.kind == "f" or x.dtype.itemsize < 2 else None)
                         .astype(x.dtype), x.shape)


def seeds() -> list[Case]:
    """One case per one-node backend test of the standard domain with (non-string) tensor inputs."""
    out = []
    for name, case in sorted(backend.cases().items()):
        nodes = case.model.graph.node
        if len(nodes) != 1 or nodes[0].domain not in ("", "ai.onnx") or not backend.tensor_inputs(case):
            continue
        if nodes[0].op_type in evaluate.NOT_FOLDED or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                                      for a in nodes[0].attribute):
            continue
        opset = next(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
        inputs, _ = backend.data(case)
        if any(x.dtype.kind in "OSU" for x in inputs):
            continue  # string tensors are never folded
        by_name = dict(zip((v.name for v in case.model.graph.input), inputs))
        out.append(Case(name, nodes[0], [by_name.get(i) if i else None for i in nodes[0].input], opset))
    return out


def variants(seed: Case) -> Iterator[Case]:
    """The seed, the seed in other dtypes, and each with edge values in its data inputs."""
    formal = _formal_params(seed.node, seed.opset)
    if formal is None:
        return
    allowed = _allowed(seed.node, seed.opset)
    typed = [seed]
    for param in sorted({p for p in formal if p in allowed}):
        positions = [k for k, p in enumerate(formal) if p == param and seed.inputs[k] is not None]
        if not positions:
            continue
        current = seed.inputs[positions[0]].dtype
        for dtype in _VARIANT_DTYPES:
            if np.dtype(dtype) == current or _type_str(dtype) not in allowed[param]:
                continue
            inputs = list(seed.inputs)
            for k in positions:
                inputs[k] = _convert(inputs[k], dtype)
            typed.append(Case(f"{seed.name}[{param}={np.dtype(dtype).name}]", seed.node, inputs, seed.opset))
    for case in typed:
        yield case
        data = [k for k, p in enumerate(formal) if case.inputs[k] is not None and case.inputs[k].size
                and p in allowed and not allowed[p] <= _INDEX_TYPES and _edges(case.inputs[k].dtype)]
        if data:
            inputs = list(case.inputs)
            for k in data:
                inputs[k] = _with_edges(inputs[k], 3 * k)
            yield Case(f"{case.name}[edges]", case.node, inputs, case.opset)


def _node(op, n_inputs, n_outputs=1, **attrs):
    return helper.make_node(op, [f"i{k}" for k in range(n_inputs)], [f"o{k}" for k in range(n_outputs)], **attrs)


def handmade() -> list[Case]:
    """Cases the issue named and their neighbours: large fp16 sums, overflow, zero divisors, empty tensors."""
    f16, i32, i64 = np.float16, np.int32, np.int64
    x300 = (300 + np.arange(24)).astype(f16).reshape(2, 3, 4)
    big = np.full((1000,), 100, f16)
    cases = [
        ("ReduceMean-fp16-1000x100", _node("ReduceMean", 1, keepdims=0), [big]),
        ("ReduceSum-fp16-1000x100", _node("ReduceSum", 1, keepdims=0), [big]),
        ("ReduceL2-fp16-1000x100", _node("ReduceL2", 1, keepdims=0), [big]),
        ("ReduceSumSquare-fp16", _node("ReduceSumSquare", 1, keepdims=0), [big]),
        ("ReduceLogSumExp-fp16", _node("ReduceLogSumExp", 1, keepdims=0), [big]),
        ("MatMul-fp16-long-dot", _node("MatMul", 2), [np.full((1, 1000), 10, f16), np.full((1000, 1), 10, f16)]),
        ("Softmax-fp16-large", _node("Softmax", 1), [np.array([60000, 65504, -65504, 0], f16)]),
        ("LayerNormalization-fp16-300", _node("LayerNormalization", 3), [x300, np.ones(4, f16), np.zeros(4, f16)]),
        ("InstanceNormalization-fp16-300", _node("InstanceNormalization", 3),
         [x300, np.ones(3, f16), np.zeros(3, f16)]),
        ("ArgMax-nan", _node("ArgMax", 1), [np.array([1, np.nan, 3], np.float32)]),
        ("ArgMin-nan", _node("ArgMin", 1), [np.array([1, np.nan, -3], np.float32)]),
        ("Max-nan", _node("Max", 2), [np.array([1, np.nan, 3], np.float32), np.array([np.nan, 2, 2], np.float32)]),
        ("Pow-int32-overflow", _node("Pow", 2), [np.array(3, i32), np.array(40, i32)]),
        ("Pow-int64-overflow", _node("Pow", 2), [np.array([3, -2], i64), np.array([50, 63], i64)]),
        ("Mul-int64-overflow", _node("Mul", 2), [np.array([2**62, 3], i64), np.array([4, 5], i64)]),
        ("Add-int32-overflow", _node("Add", 2), [np.array([2**31 - 1], i32), np.array([1], i32)]),
        ("Neg-int32-min", _node("Neg", 1), [np.array([-2**31, 5], i32)]),
        ("Abs-int64-min", _node("Abs", 1), [np.array([-2**63, -5], i64)]),
        ("CumSum-int32-overflow", _node("CumSum", 2), [np.array([2**30, 2**30, 2**30], i32), np.array(0, i64)]),
        ("ReduceSum-int32-overflow", _node("ReduceSum", 1, keepdims=0), [np.array([2**30] * 4, i32)]),
        ("ReduceProd-int64-overflow", _node("ReduceProd", 1, keepdims=0), [np.array([2**40, 2**40], i64)]),
        ("Div-int32-by-zero", _node("Div", 2), [np.array([5, 6], i32), np.array([0, 2], i32)]),
        ("Div-int64-by-zero", _node("Div", 2), [np.array([5], i64), np.array(0, i64)]),
        ("Mod-int64-by-zero", _node("Mod", 2), [np.array([5, 6], i64), np.array([0, 2], i64)]),
        ("Mod-fmod-int32-by-zero", _node("Mod", 2, fmod=1), [np.array([5, 6], i32), np.array([0, 2], i32)]),
        ("Div-int32-min-by-minus-one", _node("Div", 2), [np.array([-2**31, 6], i32), np.array([-1, 2], i32)]),
        ("Div-int64-min-by-minus-one", _node("Div", 2), [np.array([-2**63], i64), np.array([-1], i64)]),
        ("Div-int8-min-by-minus-one", _node("Div", 2), [np.array([-128, 6], np.int8), np.array([-1, 2], np.int8)]),
        ("Mod-int32-min-by-minus-one", _node("Mod", 2), [np.array([-2**31], i32), np.array([-1], i32)]),
        ("Div-int-negative", _node("Div", 2), [np.array([-7, 7, -7], i64), np.array([2, -2, -2], i64)]),
        ("Mod-int-negative", _node("Mod", 2), [np.array([-7, 7, -7], i64), np.array([2, -2, -2], i64)]),
        ("Div-float-by-zero", _node("Div", 2), [np.array([1, -1, 0], np.float32), np.array([0, 0, 0], np.float32)]),
        ("Reciprocal-zero", _node("Reciprocal", 1), [np.array([0.0, -0.0], np.float32)]),
        ("Log-zero-negative", _node("Log", 1), [np.array([0.0, -1.0], np.float32)]),
        ("Sqrt-negative", _node("Sqrt", 1), [np.array([-1.0, -0.0], np.float16)]),
        ("Cast-float-to-int-edges", _node("Cast", 1, to=TensorProto.INT32),
         [np.array([np.nan, np.inf, 3e9, -2.5], np.float32)]),
        ("Cast-float-to-fp16-overflow", _node("Cast", 1, to=TensorProto.FLOAT16),
         [np.array([70000, 65520, 1e-8], np.float32)]),
        ("Cast-int64-to-int32-wrap", _node("Cast", 1, to=TensorProto.INT32), [np.array([2**40 + 5, -1], i64)]),
        ("Cast-int64-to-float-inexact", _node("Cast", 1, to=TensorProto.FLOAT),
         [np.array([2**53 + 1, 2**24 + 1], i64)]),
        ("Range-int32-near-max", _node("Range", 3),
         [np.array(2**31 - 3, i32), np.array(2**31 - 1, i32), np.array(1, i32)]),
        ("Range-int32-overflowing-length", _node("Range", 3),
         [np.array(-2**31, i32), np.array(2**31 - 1, i32), np.array(2**27, i32)]),
        ("Add-empty", _node("Add", 2), [np.zeros((0, 3), np.float32), np.ones(3, np.float32)]),
        ("Concat-empty", _node("Concat", 2, axis=0), [np.zeros((0, 3), i64), np.ones((2, 3), i64)]),
        ("ReduceSum-empty", _node("ReduceSum", 1, keepdims=0), [np.zeros((0,), np.float32)]),
        ("ReduceMax-empty-int", _node("ReduceMax", 1, keepdims=0), [np.zeros((2, 0), i64)]),
        ("ReduceMean-empty", _node("ReduceMean", 1, keepdims=0), [np.zeros((0,), np.float32)]),
        ("MatMul-empty-inner", _node("MatMul", 2), [np.zeros((2, 0), np.float32), np.zeros((0, 3), np.float32)]),
        ("Mul-shape-arithmetic", _node("Mul", 2), [np.array([3, 4], i64), np.array([5], i64)]),
        ("Transpose-float-weights", _node("Transpose", 1, perm=[1, 0]), [np.arange(6, dtype=np.float32).reshape(2, 3)]),
        ("Expand-empty", _node("Expand", 2), [np.ones((1, 3), np.float32), np.array([0, 3], i64)]),
        ("Dropout-training", _node("Dropout", 3), [np.ones(64, np.float32), np.array(0.5, np.float32), np.array(True)]),
    ]
    return [Case(f"handmade:{name}", node, inputs, 18 if node.op_type != "Dropout" else 13, handmade=True)
            for name, node, inputs in cases]


def all_cases(ops: set[str] | None = None) -> list[Case]:
    import warnings

    out, seen = list(handmade()), set()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        generated = [case for seed in seeds() for case in variants(seed)]
    for case in generated:
        if True:
            key = hashlib.sha256(case.node.SerializeToString() + b"".join(
                np.asarray(x).dtype.str.encode() + str(np.shape(x)).encode() + np.asarray(x).tobytes()
                for x in case.inputs if x is not None)).digest()
            if key not in seen:
                seen.add(key)
                out.append(case)
    return [c for c in out if ops is None or c.node.op_type in ops]


def subset(cases: list[Case]) -> list[Case]:
    generated = [c for c in cases if not c.handmade]
    return [c for c in cases if c.handmade] + generated[::SUBSET_STEP]


# --- checking a case --------------------------------------------------------------------------


@contextlib.contextmanager
def mode(name: str):
    """Folding with onnxruntime ("ort") or as if it were not installed ("exact")."""
    saved = evaluate.folding_runtime
    if name == "exact":
        evaluate.folding_runtime = lambda: None
    try:
        yield
    finally:
        evaluate.folding_runtime = saved


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance between ``a`` and ``b`` in units in the last place (NaN matches NaN,
    -0 matches 0)."""
    a, b = np.atleast_1d(a), np.atleast_1d(b)
    nan = np.isnan(a) | np.isnan(b)
    if np.any(np.isnan(a) != np.isnan(b)):
        return math.inf
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    ordered = []
    for x in (a, b):
        i = x.view(ints).astype(object)
        ordered.append(np.where(i < 0, int(np.iinfo(ints).min) - i, i))
    d = np.abs(ordered[0] - ordered[1])
    d[nan] = 0
    return int(d.max()) if d.size else 0


def agree(reference: list, got: list) -> str | None:
    """None when ``got`` is ``reference`` (floats within 1 ulp), else how they differ."""
    if len(reference) != len(got):
        return f"{len(got)} outputs, onnxruntime gives {len(reference)}"
    for i, (r, g) in enumerate(zip(reference, got)):
        if isinstance(r, list) or isinstance(g, list):  # a sequence: element by element
            reason = agree(r, g) if isinstance(r, list) and isinstance(g, list) else "a sequence and a tensor"
            if reason is not None:
                return f"output {i}: {reason}"
            continue
        r, g = np.asarray(r), np.asarray(g)
        if r.dtype != g.dtype or r.shape != g.shape:
            return f"output {i}: {g.dtype}{list(g.shape)}, onnxruntime gives {r.dtype}{list(r.shape)}"
        if r.dtype.kind == "f":
            d = ulps(r, g)
            if d > 1:
                k = int(np.argmax(np.abs(r.astype(np.float64) - g.astype(np.float64)))) if d != math.inf else \
                    int(np.argmax(np.isnan(r) != np.isnan(g)))
                return (f"output {i}: {d} ulps apart, e.g. {g.reshape(-1)[k]!r} where onnxruntime gives "
                        f"{r.reshape(-1)[k]!r}")
        elif not np.array_equal(r, g):
            k = int(np.argmax(r.reshape(-1) != g.reshape(-1)))
            return f"output {i}: {g.reshape(-1)[k]!r} where onnxruntime gives {r.reshape(-1)[k]!r}"
    return None


def _result_bytes(case: Case) -> int | None:
    """The case node's result size as onnx infers it (None if unknown)."""
    tensors = [None if x is None else ir.tensor(np.asarray(x)) for x in case.inputs]
    node = ir.Node("", case.node.op_type, [ir.Value(name=f"in{k}") for k in range(len(case.inputs))],
                   [ir.serde.deserialize_attribute(a) for a in case.node.attribute], num_outputs=len(case.node.output))
    types = evaluate.output_types(node, case.opset, tensors)
    return None if types is None else sum(math.ceil(math.prod(s) * d.itemsize) for d, s in types)


@dataclasses.dataclass
class Verdict:
    case: str
    mode: str
    kind: str  # "agreed" (folded, same values), "unfolded", "disagreed", "refused", "invalid"
    detail: str = ""


def _reference(model: onnx.ModelProto) -> list | None | str:
    """onnxruntime's outputs on the unfolded model; None where it refuses the model, "random"
    where two runs differ (Dropout in training mode...)."""
    try:
        first = backend.run(model)
    except Exception:  # noqa: BLE001
        return None
    return first if agree(first, backend.run(model)) is None else "random"


def check(case: Case, modes: list[str], all_rules: bool = False) -> list[Verdict]:
    """The verdict on ``case`` in each mode, onnxopt with the folding rules (or all its rules)."""
    from onnxopt.rules import folding

    try:
        model = case.model()
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001  (a dtype variant the op's schema does not take)
        return [Verdict(case.name, m, "invalid", str(exc).splitlines()[0][:160]) for m in modes]
    op = case.node.op_type
    size = _result_bytes(case)
    if size is None or size > MAX_RESULT_BYTES or evaluate.crashes_onnxruntime(op, case.inputs) is not None:
        # not run: it could take any memory, or stop this process (onnxruntime's SIGFPE). onnxopt
        # must not fold it either (it decides sizes before evaluating, and guards that kernel).
        reference, why = None, "not run"
    else:
        reference, why = _reference(model), "refused"
    out = []
    for m in modes:
        with mode(m):
            try:
                optimized = optimize(model) if all_rules else optimize(model, rules=folding.RULES)
            except OnnxoptError as exc:
                out.append(Verdict(case.name, m, "disagreed", f"optimize failed: {exc}"))
                continue
        folded = sum(n.op_type == op for n in optimized.graph.node) < sum(n.op_type == op for n in model.graph.node)
        out.append(Verdict(case.name, m, *_judge(reference, why, model, optimized, folded, m)))
    return out


def _judge(reference, why: str, model, optimized, folded: bool, mode_name: str) -> tuple[str, str]:
    if isinstance(reference, str):
        return ("disagreed", "folded a node whose value differs per run") if folded else ("unfolded", "")
    if reference is None:
        if why == "not run":
            return ("disagreed", "folded a node onnxruntime was not to run") if folded else ("unfolded", "")
        try:
            backend.run(optimized)
        except Exception:  # noqa: BLE001
            return "unfolded", ""
        # Without onnxruntime, onnxopt cannot know which kernels it lacks: reported, not a disagreement
        what = "folded" if folded else "rewritten"
        return "refused" if mode_name == "exact" else "disagreed", f"{what} where onnxruntime refuses the model"
    try:
        got = backend.run(optimized)
    except Exception as exc:  # noqa: BLE001
        return "disagreed", f"onnxruntime refuses the result: {str(exc).splitlines()[0][:160]}"
    reason = agree(reference, got)
    if reason is not None:
        return "disagreed", ("folded: " if folded else "unfolded: ") + reason
    return ("agreed" if folded else "unfolded"), ""


def run(cases: list[Case], modes: list[str], all_rules: bool = False) -> list[Verdict]:
    import warnings

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return [v for case in cases for v in check(case, modes, all_rules)]


def summary(verdicts: list[Verdict], modes: list[str], show: int = 10) -> tuple[str, int]:
    """The counts per mode and the first ``show`` disagreements; and how many disagreements."""
    lines, bad = [], 0
    for m in modes:
        counts = collections.Counter(v.kind for v in verdicts if v.mode == m)
        cases = counts["agreed"] + counts["unfolded"] + counts["disagreed"] + counts["refused"]
        bad += counts["disagreed"]
        lines.append(f"{m:5}: {cases} cases, {counts['agreed']} folded and agreed, {counts['unfolded']} left unfolded, "
                     f"{counts['disagreed']} disagreements" + (
                         f", {counts['refused']} folded where onnxruntime has no kernel" if counts["refused"] else "")
                     + f" ({counts['invalid']} invalid models not counted)")
    shown = [v for v in verdicts if v.kind == "disagreed"][:show]
    lines += [f"  DISAGREES [{v.mode}] {v.case}: {v.detail}" for v in shown]
    refused = [v for v in verdicts if v.kind == "refused"][:show]
    lines += [f"  no kernel [{v.mode}] {v.case}: {v.detail}" for v in refused]
    return "\n".join(lines), bad


_POOL_CASES: list[Case] = []  # the cases, for the worker processes (forked: they share them)


def _run_chunk(args):
    indices, modes, all_rules = args
    return run([_POOL_CASES[k] for k in indices], modes, all_rules)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.oracles.fold", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("both", "ort", "exact"), default="both")
    p.add_argument("--ops", help="comma-separated op types (default: all)")
    p.add_argument("--subset", action="store_true", help="the fixed subset CI runs")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--show", type=int, default=20, help="disagreements to describe")
    p.add_argument("--all-rules", action="store_true",
                   help="optimize with every built-in rule, not only the folding ones (other rules' rewrites "
                        "of constant nodes are then judged too)")
    p.add_argument("--max-memory", type=float, default=8, metavar="GIB",
                   help="address space per process (edge values can make onnxruntime allocate anything)")
    args = p.parse_args(argv)
    limit = int(args.max_memory * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    modes = ["ort", "exact"] if args.mode == "both" else [args.mode]
    cases = all_cases(set(args.ops.split(",")) if args.ops else None)
    if args.subset:
        cases = subset(cases)
    if args.jobs > 1:
        _POOL_CASES[:] = cases
        chunks = [(range(k, len(cases), args.jobs * 8), modes, args.all_rules) for k in range(args.jobs * 8)]
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            verdicts = [v for part in pool.map(_run_chunk, chunks) for v in part]
    else:
        verdicts = run(cases, modes, args.all_rules)
    text, bad = summary(verdicts, modes, args.show)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
