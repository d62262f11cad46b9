"""Arithmetic identities and products: x * 1, x + 0, x / c, Pow(x, 2), MatMul + Add, flattened Gemm.

Exact: the rewritten graph computes, on onnxruntime, bit-identical values on every input (NaN,
infinities and the sign of zero included) and keeps every output's shape and dtype. (With
onnxruntime's graph optimizations off, a Gemm and MatMul + Add differ for long products; with them
on, onnxruntime makes the original's MatMul + Add the same Gemm -- for the bias shapes and types its
MatMulAddFusion takes, the only ones exact mode rewrites.) div_to_mul is not exact in exact
mode's sense (``Rule.exact``): the Mul it makes is one onnxruntime folds into a Conv's weights.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.ir.util import constant_tensor
from onnxopt.core.pattern import Const, Match, Op, Opt, Rule, forward
from onnxopt.ir.shapes import broadcast_keeps, is_dim_of, shape_elements

_x = forward("x")
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# onnxruntime's MatMul and Conv kernels add their products to +0.0, so they never return -0.0
_NO_NEGATIVE_ZERO = frozenset({"MatMul", "Conv"})


# the types whose x + 0, x - 0, x * 1, x / 1 onnxruntime's NoopElimination removes itself
_NOOP_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(np.int32),
                         np.dtype(np.int64)})


def neutral_condition(m: Match):
    """x op c keeps x's shape (c broadcasts no larger). In exact mode also: onnxruntime's own
    NoopElimination removes the node from the original (a single-element c of no higher rank than
    x, x's rank known, a type it handles), so the graph its fusions see is the same; a neutral
    node it keeps (c = ones((N,)) between a MatMul and a bias Add) stops its MatMul+Add fusion,
    and removing it would give one rounding where the original has two."""
    dims, c = m.dims("x"), m.const("c")
    if not broadcast_keeps(dims, c.shape):
        return "the constant broadcasts x to a larger shape"
    if m.options.get("exact"):
        if c.size != 1 or dims is None:
            return (f"exact: onnxruntime removes {m.root.op_type} by a neutral constant itself only when the "
                    "constant has one element and x's rank is known; removing it here can change what it fuses")
        if c.dtype not in _NOOP_TYPES:
            return f"exact: onnxruntime does not remove a neutral {m.root.op_type} of {c.dtype} itself"
    return None


def zero_neutral_condition(m: Match):
    """x + 0 is x except at x = -0.0: -0.0 + 0.0 is +0.0 (and 1/x downstream then gives +inf for
    -inf). So Add(x, c) goes when c is all -0.0 (x + -0.0 is x), Sub(x, c) when c is all +0.0,
    either when x holds no -0.0 (an integer, or a MatMul/Conv result) or when what reads the sum
    cannot tell the two zeros apart (:func:`_sign_of_zero_unseen`)."""
    reason = neutral_condition(m)
    if reason:
        return reason
    c = m.const("c")
    if c.dtype.kind not in "fV" or np.all(np.signbit(c) == (m.root.op_type == "Add")):
        return None
    producer = m["x"].producer()
    if producer is not None and producer.op_type in _NO_NEGATIVE_ZERO and producer.domain in ("", "ai.onnx"):
        return None
    if _sign_of_zero_unseen(m.root.outputs[0]):
        return None
    return f"x may be -0.0, which {m.root.op_type} with 0 turns into +0.0"


_MOVES = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"})


def _sign_of_zero_unseen(value: ir.Value, depth: int = 0) -> bool:
    """Every reader of ``value``, through ops that only move elements, is a Conv reading it as its
    input with a constant bias of no zero (and finite): its sums then never depend on the sign of
    a zero among their terms (b + (+0.0) and b + (-0.0) are b), so -0.0 and +0.0 inputs give
    identical outputs (a Keras model's Rescaling offset of 0 before its first Conv)."""
    if value.is_graph_output() or depth > 4 or not value.uses():
        return False
    for node, index in value.uses():
        if node.domain not in ("", "ai.onnx"):
            return False
        if node.op_type in _MOVES and index == 0:
            if not all(_sign_of_zero_unseen(out, depth + 1) for out in node.outputs):
                return False
        elif node.op_type == "Conv" and index == 0 and len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = constant_tensor(node.inputs[2])  # (not an initializer the caller may feed)
            arr = None if bias is None else bias.numpy()
            if arr is None or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr == 0):
                return False
        else:
            return False
    return True


def div_to_mul_condition(m: Match):
    """The plan: 1/c, exact in c's type (c a power of two whose reciprocal the type holds)."""
    c = m.const("c")
    if c.dtype.kind != "f":
        return "not a float division"
    if not np.all(np.isfinite(c)) or np.any(c == 0):
        return "zero or non-finite divisor"
    mantissa, _ = np.frexp(c.astype(np.float64))
    if not np.all(np.abs(mantissa) == 0.5):
        return "1/c is not exact (c is not a power of two)"
    with np.errstate(over="ignore"):  # (a reciprocal out of the type's range is refused just below)
        inverse = (1.0 / c.astype(np.float64)).astype(c.dtype)
    if not np.all(np.isfinite(inverse)) or np.any(inverse == 0):
        return "1/c leaves the type's range"
    return inverse


def div_to_mul_replacement(m: Match, b):
    return b.op("Mul", m["x"], b.const(m.plan, name="reciprocal"))


def pow_two_to_mul_condition(m: Match):
    p = m.const("p")
    if p.size != 1 or float(p.reshape(-1)[0]) != 2.0:
        return "exponent is not 2"
    if p.ndim > 0 and not broadcast_keeps(m.dims("x"), p.shape):
        return "the exponent broadcasts"
    if m.dtype("x") not in _FLOATS:
        return "not a float"
    if any(use.node.op_type == "ReduceMean" for use in m.root.outputs[0].uses()):
        # the variance of a layer norm: onnxruntime fuses Sub-Pow(2)-ReduceMean-... into one
        # LayerNormalization kernel, and its pattern wants Pow, not Mul
        return "a layer norm's variance (onnxruntime's LayerNorm fusion expects Pow)"
    return None


def pow_two_to_mul_replacement(m: Match, b):
    return b.op("Mul", m["x"], m["x"])


def matmul_add_to_gemm_condition(m: Match):
    dims, w, c = m.dims("a"), m.const("w"), m.const("c")
    if dims is None or len(dims) != 2 or w.ndim != 2:
        return "not a 2-D MatMul"
    if c.ndim > 2 or (c.ndim >= 1 and c.shape[-1] not in (1, w.shape[1])) or (
            c.ndim == 2 and c.shape[0] != 1 and c.shape[0] != dims[0]):
        return "bias does not broadcast to [M, N]"
    if c.dtype != w.dtype or w.dtype not in (np.float32, np.float64, np.float16):
        return "type"
    if m.options.get("exact"):
        return _onnxruntime_fuses_matmul_add(dims, w, c)
    return None


def _onnxruntime_fuses_matmul_add(dims: list, w: np.ndarray, c: np.ndarray) -> str | None:
    """Exact mode: onnxruntime's MatMulAddFusion makes the original's MatMul + Add this same Gemm
    (one rounding) only for a float or float16 bias of shape [N], [1, N], [M, 1] or [M, N] (M a
    known number); for any other (a scalar, [1] or [1, 1] broadcast over N > 1, a double) it runs
    MatMul then Add, which rounds twice, and the Gemm would change the bits."""
    if w.dtype not in (np.float32, np.float16):
        return f"exact: onnxruntime does not fuse a {w.dtype} MatMul + Add into Gemm itself"
    n, shape = w.shape[1], c.shape
    if len(shape) == 1 and shape[0] == n or len(shape) == 2 and (
            shape == (1, n) or shape[0] == dims[0] and shape[1] in (1, n)):
        return None
    return f"exact: onnxruntime does not fuse MatMul + Add with a bias of shape {list(shape)} into Gemm itself"


def matmul_add_to_gemm_replacement(m: Match, b):
    return b.op("Gemm", m["a"], m["w"], m["c"])


def _restores_leading_dims(m: Match, n: int) -> bool:
    """The shape tensor "s2" is x's leading dimensions (the same value, the same named symbol or
    the same static size) followed by n."""
    x, dims = m["x"], m.dims("x")
    elements = shape_elements(m["s2"])
    if elements is None or len(elements) != len(dims) or elements[-1] != n:
        return False
    for j, e in enumerate(elements[:-1]):
        if isinstance(e, int):
            if not (e == dims[j] and e > 0):
                return False
        elif not is_dim_of(e, x, j):
            return False
    return True


def gemm_flatten_to_matmul_condition(m: Match):
    dims, w = m.dims("x"), m.const("w")
    if dims is None or len(dims) < 3:
        return "x's rank is unknown or below 3"
    if w.ndim != 2 or m.attr("gemm", "transA", 0) != 0 or m.attr("gemm", "alpha", 1.0) != 1.0:
        return "Gemm transposes or scales A"
    k_axis, n_axis = (1, 0) if m.attr("gemm", "transB", 0) else (0, 1)
    k, n = w.shape[k_axis], w.shape[n_axis]
    if m.const("s1").tolist() != [-1, k] or dims[-1] != k:
        return "the first Reshape is not x flattened to [-1, K] along its last axis"
    if "c" in m:
        if m.attr("gemm", "beta", 1.0) != 1.0:
            return "Gemm scales its bias"
        c = m.dims("c")
        if c is None or not (len(c) <= 1 and c in ([], [1], [n]) or c in ([1, 1], [1, n])):
            return "bias does not broadcast along N only"
    if m.dtype("x") not in _FLOATS:
        return "type"
    if not _restores_leading_dims(m, n):
        return "the second Reshape does not restore x's leading dimensions"
    if m.options.get("exact"):
        return _onnxruntime_fuses_back(m, n)
    return None


def _onnxruntime_fuses_back(m: Match, n: int) -> str | None:
    """Exact mode: the MatMul + Add written for the Gemm gives the Gemm's bits only where
    onnxruntime's MatMulAddFusion turns it back into Reshape + Gemm + Reshape: an x of static
    shape, a float or float16 bias of shape [N] (no other broadcast when it reshapes), and an x
    it does not keep for its attention fusions (the output of Attention, of a Reshape (the heads
    merged), or of a LayerNormalization)."""
    if m.dtype("x") not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return f"exact: onnxruntime does not fuse a {m.dtype('x').name} MatMul + Add into Gemm itself"
    if m.static_shape("x") is None:
        return "exact: onnxruntime does not fuse MatMul + Add into Gemm on an input of dynamic shape"
    if "c" in m and m.dims("c") != [n]:
        return f"exact: onnxruntime does not fuse MatMul + Add with a bias of shape {m.dims('c')} on rank > 2"
    producer = m["x"].producer()
    if producer is not None and producer.op_type in ("Attention", "MultiHeadAttention", "Reshape",
                                                     "LayerNormalization"):
        return f"exact: onnxruntime may keep a MatMul reading a {producer.op_type} for its attention fusion"
    return None


def gemm_flatten_to_matmul_replacement(m: Match, b):
    w = m["w"] if not m.attr("gemm", "transB", 0) else b.const(np.ascontiguousarray(m.const("w").T), name="weight_t")
    out = b.op("MatMul", m["x"], w)
    return b.op("Add", out, m["c"]) if "c" in m else out


RULES = [
    Rule("mul_by_one", Op("Mul", "x", Const("c", value=1), commutative=True), _x, condition=neutral_condition,
         exact=True, doc="x * 1 is x (when 1 does not broadcast x larger)."),
    Rule("add_zero", Op("Add", "x", Const("c", value=0), commutative=True), _x, condition=zero_neutral_condition,
         exact=True, doc="x + 0 is x when x holds no -0.0 (an integer, a MatMul or Conv result) or the 0s are -0.0 "
             "(-0.0 + 0.0 is +0.0); when 0 does not broadcast x larger."),
    Rule("sub_zero", Op("Sub", "x", Const("c", value=0)), _x, condition=zero_neutral_condition,
         exact=True, doc="x - 0 is x when the 0s are +0.0 (x - -0.0 turns -0.0 into +0.0) or x holds no -0.0; "
             "when 0 does not broadcast x larger."),
    Rule("div_by_one", Op("Div", "x", Const("c", value=1)), _x, condition=neutral_condition,
         exact=True, doc="x / 1 is x (when 1 does not broadcast x larger)."),
    Rule("div_to_mul", Op("Div", "x", Const("c")), div_to_mul_replacement, condition=div_to_mul_condition,
         priority=-1, exact=False, doc="x / c is x * (1/c) when c is a power of two (so 1/c is exact)."),
    Rule("pow_two_to_mul", Op("Pow", "x", Const("p")), pow_two_to_mul_replacement,
         condition=pow_two_to_mul_condition, exact=True, doc="Pow(x, 2) is x * x."),
    Rule("matmul_add_to_gemm", Op("Add", Op("MatMul", "a", Const("w")), Const("c"), commutative=True),
         matmul_add_to_gemm_replacement, condition=matmul_add_to_gemm_condition,
         exact=True, doc="MatMul(A, W) + c on a 2-D A is Gemm(A, W, c)."),
    Rule("gemm_flatten_to_matmul",
         Op("Reshape", Op("Gemm", Op("Reshape", "x", Const("s1")), Const("w"), Opt("c"), name="gemm"), "s2"),
         gemm_flatten_to_matmul_replacement, condition=gemm_flatten_to_matmul_condition,
         exact=True, doc="Reshape(Gemm(Reshape(x, [-1, K]), W, c), x.shape[:-1] + [N]) -- a linear layer applied to "
             "flattened rows, as legacy GPT-2 exports write it -- is MatMul(x, W) + c: the reshapes and "
             "the shape arithmetic that rebuilt the leading dimensions go."),
]
