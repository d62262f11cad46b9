"""Helpers for the transformer fusions (rules/normalization.py, rules/activation.py): matching a
decomposed expression by what it computes rather than by one exporter's node layout.

- ``scalar(v)``: the value of a one-element constant (any rank up to 1), else None.
- ``private(v, graph)``: ``v`` is an intermediate only one node reads (it can go with a rewrite).
- ``factors(v, graph)``: a product flattened: Mul trees (either operand order, any association)
  and Div by a constant, through intermediates read once: (constant factor, other factors, nodes).
- ``poly(v, graph)``: ``v`` as a polynomial of one value x up to degree 3 (Add, Sub, Mul, Div by a
  constant, Pow by 2 or 3, Neg), through intermediates read once: ({power: coefficient}, x, nodes).
- ``kernel(op, domain, opset, target, dtype)``: whether the installed onnxruntime registers a
  kernel for the op on the target's provider and element type (None when it cannot tell).
- ``unrepresentable(what, exact, dtype)``: why a constant a fusion computes (an attribute such as
  attention's ``scale`` or a normalization's ``epsilon``, or folded factors) cannot be stored in
  ``dtype``: it rounds to inf or NaN, to 0 from a nonzero value (attention's ``scale=0`` means
  1/sqrt(head_size) to onnxruntime), or to a subnormal (flushed to 0 where a kernel runs with
  denormals off, and few significant bits where not).
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnxopt.ir.util import RULE_KEY, constant_tensor, use_count
from onnxopt.ir.kernels import kernel_defs
from onnxopt.ir.shapes import infer

_PROVIDERS = {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}
_ONNX_TYPE = {ir.DataType.FLOAT: "tensor(float)", ir.DataType.FLOAT16: "tensor(float16)",
              ir.DataType.DOUBLE: "tensor(double)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}
FLOATS = frozenset(_ONNX_TYPE)


def scalar(value: ir.Value | None) -> float | None:
    """The number a one-element constant of rank 0 or 1 holds, else None."""
    tensor = constant_tensor(value)
    if tensor is None:
        return None
    try:
        array = tensor.numpy()
    except Exception:  # noqa: BLE001 - a tensor type numpy cannot hold
        return None
    if array.size != 1 or array.ndim > 1 or array.dtype.kind not in "fiu":
        return None
    return float(array.reshape(()))


def const_array(value: ir.Value | None) -> np.ndarray | None:
    tensor = constant_tensor(value)
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except Exception:  # noqa: BLE001
        return None


def private(value: ir.Value | None, graph: ir.Graph) -> bool:
    """``value`` is computed by a node of ``graph``, read by one node and not a graph output."""
    if value is None:
        return False
    node = value.producer()
    return node is not None and node.graph is graph and use_count(value) == 1 and not value.is_graph_output()


def producer(value: ir.Value | None, graph: ir.Graph, *op_types: str, only_use: bool = True) -> ir.Node | None:
    """The standard-domain node of one of ``op_types`` computing ``value`` (read once, unless
    ``only_use`` is False), else None."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.graph is not graph or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    if only_use and not private(value, graph):
        return None
    if node.outputs[0] is not value:
        return None
    return node


def close(a: float | None, b: float, rtol: float = 1e-4) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)


def factors(value: ir.Value, graph: ir.Graph, *, root: bool = True) -> tuple[float, list[ir.Value], list[ir.Node]]:
    """``value`` as k * f1 * f2 * ...: Mul nodes (and Div by a constant) are opened when read only
    by the product (the root always); returns (k, [f...], nodes opened)."""
    k, out, nodes = 1.0, [], []
    node = value.producer()
    opened = node is not None and node.graph is graph and node.domain in ("", "ai.onnx") \
        and node.op_type in ("Mul", "Div") and (root or private(value, graph))
    if opened and node.op_type == "Div":
        d = scalar(node.inputs[1])
        opened = d is not None and d != 0
    if not opened:
        c = scalar(value)
        return (c, [], []) if c is not None else (1.0, [value], [])
    nodes.append(node)
    if node.op_type == "Div":
        k0, f0, n0 = factors(node.inputs[0], graph, root=False)
        return k0 / scalar(node.inputs[1]), f0, nodes + n0
    for operand in node.inputs:
        k1, f1, n1 = factors(operand, graph, root=False)
        k *= k1
        out += f1
        nodes += n1
    return k, out, nodes


class _NotPoly(Exception):
    pass


def poly(value: ir.Value, graph: ir.Graph, x: ir.Value | None = None, *, max_degree: int = 3
         ) -> tuple[dict[int, float], ir.Value, list[ir.Node]] | None:
    """``value`` as sum(c_p * x**p) for one value x (``x`` when given), through Add, Sub, Mul, Div by a
    constant, Pow by a small integer and Neg read only by the expression; None when it is not."""
    state = {"x": x, "nodes": []}
    try:
        coeffs = _poly(value, graph, state, max_degree, root=True)
    except _NotPoly:
        return None
    if state["x"] is None:
        return None
    return {p: c for p, c in coeffs.items() if c != 0.0}, state["x"], state["nodes"]


def _mul(a: dict, b: dict, max_degree: int) -> dict:
    out: dict[int, float] = {}
    for pa, ca in a.items():
        for pb, cb in b.items():
            if pa + pb > max_degree:
                raise _NotPoly()
            out[pa + pb] = out.get(pa + pb, 0.0) + ca * cb
    return out


def _poly(value, graph, state, max_degree, root=False) -> dict[int, float]:
    c = scalar(value)
    if c is not None:
        return {0: c}
    node = value.producer()
    expandable = node is not None and node.graph is graph and node.domain in ("", "ai.onnx") \
        and node.op_type in ("Add", "Sub", "Mul", "Div", "Pow", "Neg") and private(value, graph) \
        and value is not state["x"]
    if expandable:
        try:
            saved = len(state["nodes"]), state["x"]
            state["nodes"].append(node)
            return _expand(node, graph, state, max_degree)
        except _NotPoly:
            del state["nodes"][saved[0]:]
            state["x"] = saved[1]
            if root:
                raise
    if state["x"] is None:
        state["x"] = value
    elif state["x"] is not value:
        raise _NotPoly()
    return {1: 1.0}


def _expand(node, graph, state, max_degree) -> dict[int, float]:
    ins = node.inputs
    op = node.op_type
    if op == "Neg":
        return {p: -c for p, c in _poly(ins[0], graph, state, max_degree).items()}
    if op in ("Add", "Sub"):
        a = _poly(ins[0], graph, state, max_degree)
        b = _poly(ins[1], graph, state, max_degree)
        sign = 1.0 if op == "Add" else -1.0
        return {p: a.get(p, 0.0) + sign * b.get(p, 0.0) for p in set(a) | set(b)}
    if op == "Mul":
        return _mul(_poly(ins[0], graph, state, max_degree), _poly(ins[1], graph, state, max_degree), max_degree)
    if op == "Div":
        d = scalar(ins[1])
        if d is None or d == 0:
            raise _NotPoly()
        return {p: c / d for p, c in _poly(ins[0], graph, state, max_degree).items()}
    if op == "Pow":
        e = scalar(ins[1])
        if e is None or e != int(e) or not 1 <= e <= max_degree:
            raise _NotPoly()
        base = _poly(ins[0], graph, state, max_degree)
        out = {0: 1.0}
        for _ in range(int(e)):
            out = _mul(out, base, max_degree)
        return out
    raise _NotPoly()


# --------------------------------------------------------------------------------------------
# What the installed onnxruntime runs


@functools.lru_cache(maxsize=1)
def _kernel_defs():
    defs = kernel_defs()  # onnxopt.ir.kernels: read in a child process where the listing can crash
    return None if defs is None else tuple((op, dom, (lo, hi), prov, types) for op, dom, lo, hi, prov, types in defs)


def kernel(op: str, domain: str, opset: int, target: str, dtype: ir.DataType | None) -> bool | None:
    """The installed onnxruntime registers ``domain:op`` at ``opset`` on the target's provider for
    ``dtype``: True/False; None when it cannot tell (no onnxruntime, a target without a provider)."""
    defs = _kernel_defs()
    provider = _PROVIDERS.get(target)
    if defs is None or provider is None:
        return None
    want = _ONNX_TYPE.get(dtype)
    for name, dom, (lo, hi), prov, types in defs:
        if name == op and dom == domain and prov == provider and lo <= opset <= hi and (want is None or want in types):
            return True
    return False


def unrepresentable(what: str, exact, dtype=np.float32) -> str | None:
    """The refusal for a fused constant whose exact value(s) ``exact`` (float64 or a Python float)
    do not survive storage in ``dtype`` (an attribute of type float: float32), else None."""
    exact = np.asarray(exact, dtype=np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        stored = exact.astype(dtype)
    if not np.all(np.isfinite(stored)):
        return f"{what} is inf or NaN in {np.dtype(dtype).name} ({_show(exact)})"
    if np.any((stored == 0) & (exact != 0)):
        return f"{what} rounds to 0 in {np.dtype(dtype).name} ({_show(exact)})"
    tiny = float(ml_dtypes.finfo(dtype).tiny)
    if np.any((stored != 0) & (np.abs(stored.astype(np.float64)) < tiny)):
        return f"{what} is subnormal in {np.dtype(dtype).name} ({_show(exact)})"
    return None


def _show(exact: np.ndarray) -> str:
    if exact.size == 1:
        return f"{float(exact.reshape(-1)[0]):.3g}"
    finite = exact[np.isfinite(exact) & (exact != 0)]
    low = float(np.abs(finite).min()) if finite.size else 0.0
    high = float(np.abs(exact).max())
    return f"magnitudes {low:.3g} to {high:.3g}"


def last_dim(m, name: str) -> int | None:
    dims = m.dims(name)
    return None if not dims else dims[-1]


def dtype_of(value: ir.Value | None, opsets) -> ir.DataType | None:
    """``value``'s element type, inferred locally when the model lacks it."""
    if value is None:
        return None
    if value.type is None:
        infer(value, opsets)
    return value.type.dtype if isinstance(value.type, ir.TensorType) else None


def typed(new: ir.Value, like: ir.Value, m) -> ir.Value:
    """``new`` takes the element type and shape of ``like`` (an output onnx cannot infer: a contrib
    op's, so that the rules after it still see its shape)."""
    dtype = dtype_of(like, m.opsets)
    if dtype is not None:
        new.type = ir.TensorType(dtype)
    shape = infer(like, m.opsets)
    if shape is not None:
        new.shape = ir.Shape(list(shape))
    return new



def _with_axes(m, b, op: str, x: ir.Value, axes: list[int], name: str, since: int, **attrs) -> ir.Value:
    """``op(x, axes)``: the axes an int64 input (a constant called ``name``) from opset ``since``, an
    attribute before."""
    if m.opset("") >= since:
        return b.op(op, x, b.const(np.array(axes, dtype=np.int64), name=name), **attrs)
    return b.op(op, x, axes=axes, **attrs)


def unsqueeze(m, b, x: ir.Value, axes: list[int], name: str = "axes") -> ir.Value:
    """Unsqueeze(x, axes), its axes an input from opset 13."""
    return _with_axes(m, b, "Unsqueeze", x, axes, name, 13)


def squeeze(m, b, x: ir.Value, axes: list[int], name: str = "axes") -> ir.Value:
    """Squeeze(x, axes), its axes an input from opset 13."""
    return _with_axes(m, b, "Squeeze", x, axes, name, 13)


def reduce_max(m, b, x: ir.Value, axes: list[int], name: str = "axes") -> ir.Value:
    """ReduceMax(x, axes, keepdims=1), its axes an input from opset 18."""
    return _with_axes(m, b, "ReduceMax", x, axes, name, 18, keepdims=1)


def earlier(m, name: str) -> ir.Value | None:
    """The value ``name`` an earlier rewrite of this rule made (:meth:`Builder.name`), where it is defined
    before the root (so this match can read it: a value built once for every layer); None otherwise."""
    for node in m.graph:
        if node is m.root:
            return None
        if node.metadata_props.get(RULE_KEY) != m.rule.name:
            continue
        for v in node.outputs:
            if v.name == name:
                return v
    return None
