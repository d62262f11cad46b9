"""GELU fusions for onnxruntime (targets ort-cpu and ort-cuda only; ``portable`` never sees them).

Matched by what the nodes compute, not by one exporter's layout. A rule is rooted at the Erf (or
the Tanh) and reads the expression around it:

- ``gelu``: 0.5 * x * (1 + erf(x / sqrt(2))) in any association and operand order (x * 0.5 first,
  (1 + erf) * 0.5 first, a final Div by 2, x * 0.7071 instead of x / 1.4142; constants by value
  within 1e-4 relative) -> com.microsoft Gelu, or the standard Gelu of opset 20 where the model
  imports opset >= 20 and the installed onnxruntime registers that kernel for the target.
- ``fast_gelu``: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) (x^3 as Pow(x, 3), x*x*x,
  the product expanded or not) -> com.microsoft FastGelu.
- ``bias_gelu``: Gelu(y + b), b a 1-D constant along the last axis -> com.microsoft BiasGelu
  (``bias_gelu_std`` for the opset-20 Gelu);
  ``fast_gelu_bias``: FastGelu(y + b) -> FastGelu(y, b).

All are exact only up to rounding (``exact=False``: onnxruntime's kernels compute erf and tanh
their own way); fp32 outputs agree within 1e-5 relative on the zoo models.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnxopt.core.pattern import Const, Match, Op, Rule
from onnxopt.targets import ORT_CPU, ORT_CUDA

from onnxopt.rules._semantic import close, dtype_of, factors, kernel, poly, private, scalar, typed

ORT = (ORT_CPU, ORT_CUDA)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _dtype_ok(m: Match, op: str, domain: str, dtype, opset: int = 1) -> str | None:
    """None when the target's provider runs ``op`` for ``dtype``."""
    target = m.options.get("target", ORT_CPU)
    if dtype is None:
        return "the input's element type is unknown"
    has = kernel(op, domain, opset, target, dtype)
    if has is None:  # no onnxruntime to ask: the types every build has
        ok = dtype == ir.DataType.FLOAT or (target == ORT_CUDA and dtype == ir.DataType.FLOAT16)
    else:
        ok = has or (target == ORT_CUDA and dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16))
    return None if ok else f"no {op} kernel for {dtype.name.lower()} on {target}"


def _products(value: ir.Value, graph: ir.Graph) -> list[ir.Value]:
    """The products above ``value``: climbing through the Mul (and Div by a constant) nodes that
    alone read it, each one's output, lowest first."""
    out = []
    while private(value, graph):
        use = next(iter(value.uses()))
        node = use.node
        if node.graph is not graph or node.domain not in ("", "ai.onnx"):
            break
        if node.op_type == "Mul" or (node.op_type == "Div" and use.idx == 0 and scalar(node.inputs[1])):
            value = node.outputs[0]
            out.append(value)
        else:
            break
    return out


def _gelu_match(m: Match, kind: str):
    """The plan (x, nodes, output) of the GELU around the root Erf/Tanh, or the reason it is not one."""
    root, graph = m.root, m.graph
    act = root.outputs[0]
    if act.is_graph_output():
        return f"the {root.op_type} output is a graph output"
    if not private(act, graph):
        return f"{root.op_type} output is read by several nodes"
    add = next(iter(act.uses())).node
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return f"{root.op_type} is not followed by + 1"
    other = add.inputs[1] if add.inputs[0] is act else add.inputs[0]
    if not close(scalar(other), 1.0):
        return f"{root.op_type} is not followed by + 1"
    one_plus = add.outputs[0]
    if not private(one_plus, graph):
        return f"1 + {root.op_type.lower()} is read by several nodes"
    tops = _products(one_plus, graph)
    if not tops:
        return f"1 + {root.op_type.lower()} is not multiplied by x / 2"
    # the lowest product that is the GELU (a product above it scales the GELU: gelu(x) * 2)
    reasons = []
    for top in tops:
        got = _gelu_at(m, kind, top, one_plus, add)
        if not isinstance(got, str):
            return got
        reasons.append(got)
    inner = [r for r in reasons if r.startswith(("erf's", "tanh's", "the Erf", "the Tanh"))]
    return (inner or reasons)[-1]


def _gelu_at(m: Match, kind: str, top: ir.Value, one_plus: ir.Value, add: ir.Node):
    root, graph = m.root, m.graph
    k, fs, mul_nodes = factors(top, graph)
    if one_plus not in fs or fs.count(one_plus) != 1:
        return f"1 + {root.op_type.lower()} is not a factor of the product"
    rest = [f for f in fs if f is not one_plus]
    if not rest:
        return f"1 + {root.op_type.lower()} is not multiplied by x"
    total, x, nodes = {0: k}, None, []
    for f in rest:
        got = poly(f, graph, x)
        if got is None:
            return "the factors besides 1 + erf/tanh are not 0.5 * x"
        coeffs, x, more = got
        nodes += more
        new: dict[int, float] = {}
        for pa, ca in total.items():
            for pb, cb in coeffs.items():
                new[pa + pb] = new.get(pa + pb, 0.0) + ca * cb
        total = {p: c for p, c in new.items() if c != 0.0}
    if set(total) != {1} or not close(total[1], 0.5):
        return "the factors besides 1 + erf/tanh are not 0.5 * x"
    inner = poly(root.inputs[0], graph, x)
    if inner is None:
        return f"the {root.op_type} input is not a polynomial of the product's x"
    coeffs, _, inner_nodes = inner
    if kind == "erf":
        if set(coeffs) != {1} or not close(coeffs[1], 1.0 / math.sqrt(2.0)):
            return "erf's input is not x / sqrt(2)"
    else:
        if set(coeffs) != {1, 3} or not close(coeffs[1], _SQRT_2_OVER_PI) \
                or not close(coeffs[3], _SQRT_2_OVER_PI * 0.044715, 1e-3):
            return "tanh's input is not sqrt(2/pi) * (x + 0.044715 x^3)"
    m.nodes = tuple(dict.fromkeys((root, add, *mul_nodes, *nodes, *inner_nodes)))
    m.outputs = [top]
    return x


def _gelu_condition(m: Match):
    x = _gelu_match(m, "erf")
    if isinstance(x, str):
        return x
    dtype = dtype_of(x, m.opsets)
    target = m.options.get("target", ORT_CPU)
    if m.opset("") >= 20 and kernel("Gelu", "", m.opset(""), target, dtype):
        return ("std", x)
    if reason := _dtype_ok(m, "Gelu", "com.microsoft", dtype):
        return reason
    return ("ms", x)


def _gelu_replace(m: Match, b):
    form, x = m.plan
    if form == "std":
        return typed(b.op("Gelu", x), x, m)
    return typed(b.op("Gelu", x, domain="com.microsoft"), x, m)


def _fast_gelu_condition(m: Match):
    x = _gelu_match(m, "tanh")
    if isinstance(x, str):
        return x
    if reason := _dtype_ok(m, "FastGelu", "com.microsoft", dtype_of(x, m.opsets)):
        return reason
    return x


def _fast_gelu_replace(m: Match, b):
    return typed(b.op("FastGelu", m.plan, domain="com.microsoft"), m.plan, m)


def _bias_condition(op: str):
    def condition(m: Match):
        bias = m.const("bias")
        if bias.ndim != 1:
            return f"the bias has rank {bias.ndim}, not 1"
        dims = m.dims("y")
        if not dims or dims[-1] is None:
            return "the last dimension of the input is unknown"
        if dims[-1] != bias.shape[0]:
            return f"the bias has {bias.shape[0]} values, the last dimension is {dims[-1]}"
        if m.dtype("y") != m.dtype("bias"):
            return "the bias and the input differ in type"
        return _dtype_ok(m, op, "com.microsoft", m.dtype("y"))
    condition.__name__ = f"{op.lower()}_bias_condition"
    return condition


def _bias_gelu_replace(m: Match, b):
    return typed(b.op("BiasGelu", m["y"], m["bias"], domain="com.microsoft"), m["y"], m)


def _fast_gelu_bias_replace(m: Match, b):
    return typed(b.op("FastGelu", m["y"], m["bias"], domain="com.microsoft"), m["y"], m)


def _biased():
    return Op("Add", "y", Const("bias"), commutative=True)


RULES = [
    Rule("gelu", Op("Erf", "u"), _gelu_replace, condition=_gelu_condition, targets=ORT, benefit="gelu",
         exact=False, doc="0.5 * x * (1 + erf(x / sqrt 2)), in any association and operand order, becomes "
             "com.microsoft Gelu (the standard Gelu at opset >= 20 where onnxruntime has its kernel)."),
    Rule("fast_gelu", Op("Tanh", "u"), _fast_gelu_replace, condition=_fast_gelu_condition, targets=ORT,
         benefit="fast_gelu", exact=False,
         doc="0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) becomes com.microsoft FastGelu."),
    Rule("bias_gelu", Op("Gelu", _biased(), domain="com.microsoft"), _bias_gelu_replace,
         condition=_bias_condition("BiasGelu"), targets=ORT, benefit="bias_gelu", exact=False,
         doc="com.microsoft Gelu of x + a 1-D constant along the last axis becomes com.microsoft BiasGelu."),
    Rule("bias_gelu_std", Op("Gelu", _biased(), attrs={"approximate": lambda v: v in ("none", b"none")}), _bias_gelu_replace,
         condition=_bias_condition("BiasGelu"), targets=ORT, benefit="bias_gelu", exact=False,
         doc="The standard Gelu (opset 20) of x + a 1-D constant along the last axis becomes com.microsoft BiasGelu."),
    Rule("fast_gelu_bias", Op("FastGelu", _biased(), domain="com.microsoft"), _fast_gelu_bias_replace,
         condition=_bias_condition("FastGelu"), targets=ORT, benefit="fast_gelu", exact=False,
         doc="com.microsoft FastGelu of x + a 1-D constant along the last axis takes the constant as its bias input."),
]
