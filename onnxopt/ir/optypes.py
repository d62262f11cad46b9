"""Element types of a graph's values, from declarations and the ops' schemas.

onnx's schemas for the default domain, onnxruntime's registry for com.microsoft ops (and for a
default-domain op onnx does not know at the model's opset). A value's type is its declared one, else
its producer's: a fixed type string, or a type variable bound to an input's type (Cast: its ``to``;
CastLike: its second input's; ConstantOfShape and Constant: their tensor's). Used by the float16
converter (:mod:`onnxopt.transforms.precision`) and the float16-arithmetic emulation (:mod:`onnxopt.verify.fp16`).
"""

from __future__ import annotations

import dataclasses
import functools

import onnx
import onnx_ir as ir

from onnxopt.ir.util import constant_tensor, opset_of

F32, F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16


@functools.lru_cache(maxsize=None)
def ort_schemas() -> dict:
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C
    except Exception:  # noqa: BLE001 - no onnxruntime: com.microsoft ops stay float32
        return {}
    table: dict = {}
    for s in C.get_all_operator_schema():
        table.setdefault((s.domain, s.name), []).append(s)
    return table


@dataclasses.dataclass(frozen=True)
class Formal:
    inputs: tuple  # (type_str, variadic) per formal input
    outputs: tuple
    allowed: dict  # type var -> frozenset of allowed type strings


@functools.lru_cache(maxsize=4096)
def formal(domain: str, op: str, opset: int) -> Formal | None:
    if domain in ("", "ai.onnx"):
        try:
            s = onnx.defs.get_schema(op, opset, "")
        except Exception:  # noqa: BLE001 - not an onnx op at this opset: onnxruntime's registry
            s = None
        if s is not None:
            Var = onnx.defs.OpSchema.FormalParameterOption.Variadic
            return Formal(tuple((p.type_str, p.option == Var) for p in s.inputs),
                           tuple((p.type_str, p.option == Var) for p in s.outputs),
                           {t.type_param_str: frozenset(t.allowed_type_strs) for t in s.type_constraints})
        domain = ""
    found = [s for s in ort_schemas().get((domain, op), []) if s.since_version <= opset]
    if not found:
        return None
    s = max(found, key=lambda s: s.since_version)
    return Formal(tuple((p.typeStr, str(p.option).endswith("Variadic")) for p in s.inputs),
                   tuple((p.typeStr, str(p.option).endswith("Variadic")) for p in s.outputs),
                   {t.type_param_str: frozenset(t.allowed_type_strs) for t in s.type_constraints})


def type_str(params: tuple, i: int) -> str | None:
    if i < len(params):
        return params[i][0]
    if params and params[-1][1]:  # a variadic last parameter takes the rest
        return params[-1][0]
    return None


DTYPE_OF_STR = {f"tensor({name})": dt for name, dt in (
    ("float", F32), ("float16", F16), ("double", ir.DataType.DOUBLE), ("bfloat16", ir.DataType.BFLOAT16),
    ("int64", ir.DataType.INT64), ("int32", ir.DataType.INT32), ("bool", ir.DataType.BOOL),
    ("int8", ir.DataType.INT8), ("uint8", ir.DataType.UINT8), ("string", ir.DataType.STRING))}


def infer_dtypes(graph: ir.Graph, opsets: dict) -> dict[ir.Value, ir.DataType | None]:
    """The dtype of every output of ``graph``'s nodes (in order): declared, else from the schema."""
    out: dict[ir.Value, ir.DataType | None] = {}

    def dt(v: ir.Value | None) -> ir.DataType | None:
        if v is None:
            return None
        if v in out:
            return out[v]
        return v.dtype if v.type is not None else (v.const_value.dtype if v.const_value is not None else None)

    for node in graph:
        dom = "" if node.domain == "ai.onnx" else node.domain
        f = formal(dom, node.op_type, opset_of(opsets, dom))
        for i, o in enumerate(node.outputs):
            out[o] = o.dtype if o.type is not None else _output_dtype(node, f, i, dt)
    return out


def _output_dtype(node: ir.Node, f: Formal | None, i: int, dt) -> ir.DataType | None:
    if node.op_type == "Cast" and (to := node.attributes.get("to")) is not None:
        return ir.DataType(to.value)
    if node.op_type == "CastLike":
        return dt(node.inputs[1]) if len(node.inputs) > 1 else None
    if node.op_type == "ConstantOfShape":
        a = node.attributes.get("value")
        return a.value.dtype if a is not None else F32
    if node.op_type == "Constant":
        t = constant_tensor(node.outputs[0])
        return t.dtype if t is not None else None
    if f is None:
        return None
    ts = type_str(f.outputs, i)
    if ts is None:
        return None
    if ts.startswith("tensor("):
        return DTYPE_OF_STR.get(ts)
    for j, inp in enumerate(node.inputs):
        if inp is not None and type_str(f.inputs, j) == ts and dt(inp) is not None:
            return dt(inp)
    return None


__all__ = ["DTYPE_OF_STR", "Formal", "formal", "infer_dtypes", "ort_schemas", "type_str"]
