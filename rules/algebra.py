"""Algebraic simplification: each rule carries the condition that makes it exact.

Exact here means the rewritten graph computes, on onnxruntime, bit-identical values on every
input (NaN, infinities and the sign of zero included) and keeps every output's shape and dtype.
conv_mul_fold and conv_add_fold are exact up to rounding: they move a constant into a Conv's
weights or bias, as onnxruntime's own Conv fusions do, so results round differently (and one
within rounding of the type's largest value may overflow in one model only); they refuse where
folding could change more than rounding (see fold_weights).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.pattern import Const, Match, Op, Opt, Refuse, Rule, forward
from onnxopt.shapes import PLACEHOLDER_DIMS, gather_elements, infer, slice_elements

# --- helpers ----------------------------------------------------------------------------------


def _dtype(m: Match, name: str) -> ir.DataType | None:
    value = m[name]
    if value is None:
        return None
    if value.type is None:
        infer(value, m.opsets)
    if isinstance(value.type, ir.TensorType):
        return value.type.dtype
    return None


def _dims(m: Match, name: str) -> list | None:
    shape = m.shape(name)
    if shape is None:
        return None
    return [d if isinstance(d, int) else None for d in shape]


def _broadcast_keeps_shape(m: Match, x: str, c: np.ndarray) -> bool:
    """x op c has x's shape: every dim of c is 1 or the same static dim of x, c no higher rank."""
    if c.ndim == 0:
        return True
    dims = _dims(m, x)
    if dims is None or c.ndim > len(dims):
        return False
    for cd, xd in zip(reversed(c.shape), reversed(dims)):
        if cd != 1 and cd != xd:
            return False
    return True


_x = forward("x")


# Cast: a source type whose every value the target holds exactly (so a round trip is the identity)
_EXACT = {
    ir.DataType.BOOL: {ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8,
                       ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64, ir.DataType.FLOAT16,
                       ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BFLOAT16},
    ir.DataType.INT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT16,
                       ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BFLOAT16},
    ir.DataType.UINT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT16,
                        ir.DataType.UINT32, ir.DataType.UINT64, ir.DataType.FLOAT16, ir.DataType.FLOAT,
                        ir.DataType.DOUBLE, ir.DataType.BFLOAT16},
    ir.DataType.INT16: {ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.UINT16: {ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT32, ir.DataType.UINT64,
                         ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.INT32: {ir.DataType.INT64, ir.DataType.DOUBLE},
    ir.DataType.UINT32: {ir.DataType.INT64, ir.DataType.UINT64, ir.DataType.DOUBLE},
    ir.DataType.FLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.BFLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.FLOAT: {ir.DataType.DOUBLE},
}


# --- Cast -------------------------------------------------------------------------------------


def _cast_noop(m: Match):
    src = _dtype(m, "x")
    if src is None:
        return "input dtype unknown"
    if int(m.attr("cast", "to")) != src.value:
        return "changes the type"
    if m.attr("cast", "saturate", 1) != 1 and src.value != int(m.attr("cast", "to")):
        return "saturate"
    return None


def _cast_chain(m: Match):
    src = _dtype(m, "x")
    if src is None:
        return "input dtype unknown"
    mid = ir.DataType(int(m.attr("inner", "to")))
    if mid != src and mid not in _EXACT.get(src, ()):
        return f"{src.name} -> {mid.name} is not exact"
    return None


def _cast_chain_replace(m: Match, b):
    src = _dtype(m, "x")
    to = int(m.attr("outer", "to"))
    if to == src.value:
        return m["x"]
    return b.op("Cast", m["x"], attrs=m.node("outer").attributes.values())


def _castlike_known(m: Match):
    if _dtype(m, "like") is None:
        return "the target dtype is unknown"
    return None


def _castlike_to_cast(m: Match, b):
    attrs = {"to": _dtype(m, "like").value}
    sat = m.node("cl").attributes.get("saturate")
    if sat is not None:
        attrs["saturate"] = sat.value
    return b.op("Cast", m["x"], **attrs)


# --- shape ops --------------------------------------------------------------------------------


def _reshape_chain(m: Match):
    shape = m.const("shape")
    if m.attr("outer", "allowzero", 0) != 1 and np.any(shape == 0):
        return "the outer shape copies dimensions (0) from its input"
    return None


def _reshape_chain_replace(m: Match, b):
    return b.op("Reshape", m["x"], m["shape"], attrs=m.node("outer").attributes.values())


def _reshape_noop(m: Match):
    dims = _dims(m, "x")
    shape = m.const("shape")
    if dims is None or any(d is None for d in dims):
        return "input shape not static"
    target = list(shape.reshape(-1))
    if len(target) != len(dims):
        return "rank changes"
    allowzero = m.attr("r", "allowzero", 0) == 1
    for t, d in zip(target, dims):
        if t == d or (t == 0 and not allowzero):
            continue
        if t == -1 and target.count(-1) == 1:
            continue
        return "shape changes"
    return None


def _flatten_noop(m: Match):
    dims = _dims(m, "x")
    axis = m.attr("f", "axis", 1)
    if dims is None or len(dims) != 2 or axis not in (1, -1):
        return "not a 2-D input flattened at axis 1"
    return None


def _axes(m: Match, node: str, input_name: str):
    """Squeeze/Unsqueeze axes from the input (opset 13+) or the attribute."""
    if input_name in m:
        arr = m.const(input_name)
        return None if arr is None else sorted(int(a) for a in arr.reshape(-1))
    attr = m.attr(node, "axes")
    return None if attr is None else sorted(int(a) for a in attr)


def _squeeze_unsqueeze(m: Match):
    inner, outer = _axes(m, "inner", "a1"), _axes(m, "outer", "a2")
    if inner is None or outer is None:
        return "axes not given"
    if any(a < 0 for a in inner + outer):
        return "negative axes"
    if inner != outer:
        return "different axes"
    return None


def _transpose_perm(m: Match, node: str, rank_of: str):
    perm = m.attr(node, "perm")
    if perm is None:
        r = _dims(m, rank_of)
        if r is None:
            return None
        perm = list(reversed(range(len(r))))
    return [int(p) for p in perm]


def _transpose_pair(m: Match, b):
    p1 = _transpose_perm(m, "inner", "x")
    if p1 is None:
        raise Refuse("rank unknown")
    p2 = m.attr("outer", "perm")
    p2 = list(reversed(range(len(p1)))) if p2 is None else [int(p) for p in p2]
    if len(p1) != len(p2):
        raise Refuse("ranks differ")
    perm = [p1[i] for i in p2]
    if perm == list(range(len(perm))):
        return m["x"]
    return b.op("Transpose", m["x"], perm=perm)


def _transpose_identity(m: Match):
    perm = m.attr("t", "perm")
    if perm is None or [int(p) for p in perm] != list(range(len(perm))):
        return "not the identity permutation"
    return None


def _expand_noop(m: Match):
    dims = _dims(m, "x")
    shape = m.const("shape")
    if dims is None:
        return "input shape unknown"
    target = [int(s) for s in shape.reshape(-1)]
    if len(target) > len(dims):
        return "raises the rank"
    for t, d in zip(reversed(target), reversed(dims)):
        if t == 1 or (d is not None and t == d):
            continue
        return "expands"
    return None


_BIG = 1 << 62


def _slice_noop(m: Match):
    starts, ends = m.const("starts"), m.const("ends")
    steps = m.const("steps") if "steps" in m else None
    if steps is not None and np.any(steps != 1):
        return "step is not 1"
    if np.any(starts != 0):
        return "does not start at 0"
    dims = _dims(m, "x")
    axes = m.const("axes") if "axes" in m else np.arange(len(ends))
    for axis, end in zip(axes.reshape(-1), ends.reshape(-1)):
        if end >= _BIG:
            continue
        if dims is None or int(axis) >= len(dims) or int(axis) < -len(dims):
            return "cannot tell whether it covers the axis"
        d = dims[int(axis)]
        if d is None or end < d:
            return "cuts the axis"
    return None


def _pad_noop(m: Match):
    pads = m.const("pads")
    if np.any(pads != 0):
        return "pads"
    return None


def _concat_single(m: Match):
    node = m.root
    if len(node.inputs) != 1:
        return "more than one input"
    return None


def _split_single(m: Match):
    node = m.root
    if len(node.outputs) != 1:
        return "more than one output"
    return None


# --- arithmetic -------------------------------------------------------------------------------


def _neutral(m: Match):
    return None if _broadcast_keeps_shape(m, "x", m.const("c")) else "the constant broadcasts x to a larger shape"


# onnxruntime's MatMul and Conv kernels add their products to +0.0, so they never return -0.0
_NO_NEGATIVE_ZERO = frozenset({"MatMul", "Conv"})


def _zero_neutral(m: Match):
    """x + 0 is x except at x = -0.0: -0.0 + 0.0 is +0.0 (and 1/x downstream then gives +inf for
    -inf). So Add(x, c) goes when c is all -0.0 (x + -0.0 is x), Sub(x, c) when c is all +0.0,
    either when x holds no -0.0: an integer, or a MatMul/Conv result."""
    reason = _neutral(m)
    if reason:
        return reason
    c = m.const("c")
    if c.dtype.kind not in "fV" or np.all(np.signbit(c) == (m.root.op_type == "Add")):
        return None
    producer = m["x"].producer()
    if producer is not None and producer.op_type in _NO_NEGATIVE_ZERO and producer.domain in ("", "ai.onnx"):
        return None
    return f"x may be -0.0, which {m.root.op_type} with 0 turns into +0.0"


def _div_by_const(m: Match):
    c = m.const("c")
    if c.dtype.kind != "f":
        return "not a float division"
    if not np.all(np.isfinite(c)) or np.any(c == 0):
        return "zero or non-finite divisor"
    mant, _ = np.frexp(c.astype(np.float64))
    if not np.all(np.abs(mant) == 0.5):
        return "1/c is not exact (c is not a power of two)"
    inv = (1.0 / c.astype(np.float64)).astype(c.dtype)
    if not np.all(np.isfinite(inv)) or np.any(inv == 0):
        return "1/c leaves the type's range"
    return None


def _div_to_mul(m: Match, b):
    c = m.const("c")
    return b.op("Mul", m["x"], b.const((1.0 / c.astype(np.float64)).astype(c.dtype), name="reciprocal"))


def _pow_two(m: Match):
    c = m.const("p")
    if c.size != 1 or float(c.reshape(-1)[0]) != 2.0:
        return "exponent is not 2"
    if c.ndim > 0 and not _broadcast_keeps_shape(m, "x", c):
        return "the exponent broadcasts"
    if _dtype(m, "x") not in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return "not a float"
    if any(use.node.op_type == "ReduceMean" for use in m.root.outputs[0].uses()):
        # the variance of a layer norm: onnxruntime fuses Sub-Pow(2)-ReduceMean-... into one
        # LayerNormalization kernel, and its pattern wants Pow, not Mul
        return "a layer norm's variance (onnxruntime's LayerNorm fusion expects Pow)"
    return None


def _square(m: Match, b):
    return b.op("Mul", m["x"], m["x"])


def _matmul_add(m: Match):
    dims = _dims(m, "a")
    w = m.const("w")
    c = m.const("c")
    if dims is None or len(dims) != 2 or w.ndim != 2:
        return "not a 2-D MatMul"
    if c.ndim > 2 or (c.ndim >= 1 and c.shape[-1] not in (1, w.shape[1])) or (c.ndim == 2 and c.shape[0] != 1 and c.shape[0] != dims[0]):
        return "bias does not broadcast to [M, N]"
    if c.dtype != w.dtype or w.dtype not in (np.float32, np.float64, np.float16):
        return "type"
    return None


def _gemm(m: Match, b):
    return b.op("Gemm", m["a"], m["w"], m["c"])


def _unflatten_elements_match(m: Match, x: ir.Value, n: int) -> bool:
    """The shape tensor "s2" is x's leading dimensions (the same value, the same named symbol or
    the same static size) followed by n."""
    elements = _shape_elements(m["s2"])
    rank = len(x.shape)
    if elements is None or len(elements) != rank or elements[-1] != n:
        return False
    for j, e in enumerate(elements[:-1]):
        if isinstance(e, int):
            if not (isinstance(x.shape[j], int) and e == x.shape[j] and e > 0):
                return False
        elif not (e[1] is x and e[2] == j or _same_symbol(e[1], e[2], x, j)):
            return False
    return True


def _gemm_unflatten(m: Match):
    x = m["x"]
    w = m.const("w")
    if infer(x, m.opsets) is None or len(x.shape) < 3:
        return "x's rank is unknown or below 3"
    if w.ndim != 2 or m.attr("gemm", "transA", 0) != 0 or m.attr("gemm", "alpha", 1.0) != 1.0:
        return "Gemm transposes or scales A"
    k_axis, n_axis = (1, 0) if m.attr("gemm", "transB", 0) else (0, 1)
    k, n = w.shape[k_axis], w.shape[n_axis]
    flat = m.const("s1")
    if flat.tolist() != [-1, k] or x.shape[-1] != k:
        return "the first Reshape is not x flattened to [-1, K] along its last axis"
    if "c" in m:
        if m.attr("gemm", "beta", 1.0) != 1.0:
            return "Gemm scales its bias"
        c = _dims(m, "c")
        if c is None or not (len(c) <= 1 and c in ([], [1], [n]) or c in ([1, 1], [1, n])):
            return "bias does not broadcast along N only"
    if _dtype(m, "x") not in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return "type"
    if not _unflatten_elements_match(m, x, n):
        return "the second Reshape does not restore x's leading dimensions"
    return None


def _gemm_to_matmul(m: Match, b):
    w = m["w"] if not m.attr("gemm", "transB", 0) else b.const(np.ascontiguousarray(m.const("w").T), name="weight_t")
    out = b.op("MatMul", m["x"], w)
    return b.op("Add", out, m["c"]) if "c" in m else out


# --- Conv absorbs per-channel Mul/Add and Pad ---------------------------------------------------


def _per_channel(m: Match, out_channels: int, c: np.ndarray, rank: int) -> np.ndarray | None:
    """c as a vector over the output channels, if it broadcasts along channels only."""
    if c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + c.shape
    if shape[0] != 1 or any(s != 1 for s in shape[2:]):
        return None
    if shape[1] not in (1, out_channels):
        return None
    return np.broadcast_to(c.reshape(-1), (out_channels,)).copy()


def non_finite(arrays: dict[str, np.ndarray | None]) -> str | None:
    """The refusal for folding constants of which one holds inf or NaN, else None."""
    for name, array in arrays.items():
        if array is not None and not np.all(np.isfinite(array)):
            return f"{name} holds inf or NaN"
    return None


def folded_refusal(name: str, after: np.ndarray, before: np.ndarray | None = None) -> str | None:
    """Why folded weights or bias ``after`` (in their own type) could change results beyond
    rounding, else None: they overflow, or (``before``: the values a factor scaled) a nonzero
    weight rounds to 0 and its input no longer counts."""
    if not np.all(np.isfinite(after)):
        return f"the folded {name} overflow"
    if before is not None and np.any((after == 0) & (before != 0)):
        return f"the folded {name} underflow to 0"
    return None


def fold_weights(m: Match, factor: np.ndarray, fold) -> tuple[np.ndarray, np.ndarray | None]:
    """``fold()``: the weights ``m.const("w")`` and bias ``m.const("b")`` (or None) with the
    per-output-channel ``factor`` folded in, when that equals scaling the conv's result up to
    rounding (NaN and infinities of the input included). Raises Refuse for a zero factor (conv * 0
    is -0.0 where the conv is negative and NaN where it overflows, zero weights give +0.0), a
    non-finite weight or bias, and folded ones that overflow or underflow to 0."""
    if np.any(factor == 0):
        raise Refuse("a zero factor")
    w, bias = m.const("w"), m.const("b") if "b" in m else None
    reason = non_finite({"the weights": w, "the bias": bias})
    if reason is None:
        with np.errstate(over="ignore", under="ignore"):
            new_w, new_b = fold()
        reason = folded_refusal("weights", new_w, w)
        if reason is None and new_b is not None:
            reason = folded_refusal("bias", new_b)
    if reason:
        raise Refuse(reason)
    return new_w, new_b


def _conv_ok(m: Match):
    w = m.const("w")
    if w.dtype.kind != "f":
        return "not a float conv"
    if m.const("c").dtype != w.dtype:
        return "type"
    vec = _per_channel(m, w.shape[0], m.const("c"), w.ndim)
    if vec is None:
        return "the constant is not per output channel"
    return non_finite({f"the {m.root.op_type} constant": vec, "the bias": m.const("b")})


def _conv_mul(m: Match, b):
    w, c = m.const("w"), m.const("c")
    vec = _per_channel(m, w.shape[0], c, w.ndim).astype(np.float64)

    def fold():
        new_w = (w.astype(np.float64) * vec.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        return new_w, (m.const("b").astype(np.float64) * vec).astype(w.dtype) if "b" in m else None

    new_w, new_b = fold_weights(m, vec, fold)
    inputs = [m["x"], b.const(new_w, name="weight")]
    if new_b is not None:
        inputs.append(b.const(new_b, name="bias"))
    return b.op("Conv", *inputs, attrs=m.node("conv").attributes.values())


def _conv_add(m: Match, b):
    w, c = m.const("w"), m.const("c")
    vec = _per_channel(m, w.shape[0], c, w.ndim).astype(np.float64)
    bias = m.const("b").astype(np.float64) if "b" in m else np.zeros(w.shape[0])
    with np.errstate(over="ignore"):
        new_b = (bias + vec).astype(w.dtype)
    if reason := folded_refusal("bias", new_b):
        raise Refuse(reason)
    return b.op("Conv", m["x"], m["w"], b.const(new_b, name="bias"), attrs=m.node("conv").attributes.values())


def _pool_output_size(n: int, kernel: int, stride: int, dilation: int, ceil: bool, head: int, tail: int) -> int:
    """An AveragePool output length as onnxruntime and the ONNX spec compute it: with ceil_mode a
    window that would start in the right padding is dropped (PyTorch's rule)."""
    span = n + head + tail - dilation * (kernel - 1) - 1
    size = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (size - 1) * stride >= n + head:
        size -= 1
    return size


def _pad_into(m: Match):
    """A zero Pad merges into the op's pads when the op then sees the same input positions, the
    padding counts like the Pad's zeros, and the output keeps its shape:

    - auto_pad NOTSET, or VALID (pads 0) without ceil_mode; SAME_* derives pads from the input size;
    - the pad value is +0.0 (Conv and AveragePool pad with +0.0; a -0.0 or NaN pad is refused);
    - AveragePool: count_include_pad=1 (else the Pad's zeros count and the op's padding does not),
      every merged pad smaller than the kernel (onnxruntime refuses the model otherwise), and with
      ceil_mode=1, padding added on the right must not change the output length (a window
      starting in the op's right padding is dropped, one starting in the Pad's zeros is not).

    Strides and dilations need nothing: both read the padded input the same way."""
    if m.attr("pad", "mode", "constant") != "constant":
        return "not a constant pad"
    if "value" in m:
        v = m.const("value")
        if v.size != 1 or float(v.reshape(-1)[0]) != 0.0 or np.signbit(v.reshape(-1)[0]):
            return "pad value is not +0.0"
    if "axes" in m:
        return "pad with axes"
    pads = m.const("pads").reshape(-1)
    if np.any(pads < 0):
        return "negative pads crop"
    n = pads.size // 2
    if n < 3 or pads[0] or pads[1] or pads[n] or pads[n + 1]:
        return "pads batch or channel axes"
    auto_pad = _auto_pad(m)
    ceil = m.attr("op", "ceil_mode", 0) != 0
    if auto_pad not in ("NOTSET", "VALID"):
        return f"auto_pad {auto_pad} derives its pads from the input size, which the Pad changes"
    if auto_pad == "VALID" and ceil:
        return "auto_pad VALID with ceil_mode"  # the spec sizes VALID with ceil_mode differently
    old, new = _merged_pads(m)
    if len(old) != n * 2 - 4:
        return "the op's pads do not match the Pad's rank"
    if m.node("op").op_type != "AveragePool":
        return None
    if m.attr("op", "count_include_pad", 0) != 1:
        return "AveragePool excludes padding from the average"
    k = n - 2
    kernel = m.attr("op", "kernel_shape") or []
    if len(kernel) != k:
        return "kernel_shape does not match the Pad's rank"
    if any(p >= kernel[i % k] for i, p in enumerate(new)):
        return "a merged pad would reach the kernel size (onnxruntime requires pads smaller than the kernel)"
    if ceil and any(pads[n + 2:]):
        dims = _dims(m, "x")
        if dims is None or any(d is None for d in dims[2:]):
            return "ceil_mode with padding on the right needs static spatial dimensions"
        strides = m.attr("op", "strides") or [1] * k
        dilations = m.attr("op", "dilations") or [1] * k
        for i in range(k):
            window = (kernel[i], strides[i], dilations[i], True)
            padded = dims[i + 2] + int(pads[i + 2]) + int(pads[n + i + 2])
            if _pool_output_size(padded, *window, old[i], old[k + i]) \
                    != _pool_output_size(dims[i + 2], *window, new[i], new[k + i]):
                return "under ceil_mode, padding merged on the right changes the output size"
    return None


def _auto_pad(m: Match) -> str:
    auto_pad = m.attr("op", "auto_pad", "NOTSET")
    return auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad


def _merged_pads(m: Match) -> tuple[list[int], list[int]]:
    """The op's pads (0s under auto_pad VALID) and those pads plus the Pad's spatial ones."""
    pads = [int(p) for p in m.const("pads").reshape(-1)]
    n = len(pads) // 2
    extra = pads[2:n] + pads[n + 2:]
    old = m.attr("op", "pads") if _auto_pad(m) == "NOTSET" else None
    old = [int(p) for p in old or [0] * len(extra)]
    return old, [a + e for a, e in zip(old, extra)]


def _pad_fold(m: Match, b):
    node = m.node("op")
    attrs = [a for a in node.attributes.values() if a.name not in ("pads", "auto_pad")]
    return b.op(node.op_type, m["x"], *node.inputs[1:], attrs=attrs, pads=_merged_pads(m)[1])


def _range_one_element(m: Match):
    for name in ("s", "l", "d"):
        dims = _dims(m, name)
        if dims is not None and len(dims) > 0 and all(d == 1 for d in dims):
            return None
    return "inputs are scalars or of unknown shape"


def _range_scalars(m: Match, b):
    scalar = b.const(np.zeros((0,), dtype=np.int64), name="scalar_shape")
    inputs = []
    for name in ("s", "l", "d"):
        dims = _dims(m, name)
        if dims is not None and len(dims) > 0 and all(d == 1 for d in dims):
            inputs.append(b.op("Reshape", m[name], scalar))
        else:
            inputs.append(m[name])
    return b.op("Range", *inputs)


RULES = [
    Rule("range_scalar_inputs", Op("Range", "s", "l", "d"), _range_scalars, condition=_range_one_element,
         doc="Range inputs known to hold one element in a [1]-like shape become scalars, as the spec requires "
             "(onnxruntime's shape inference rejects them once their shapes are known)."),
    # Cast
    Rule("cast_elimination", Op("Cast", "x", name="cast"), _x, condition=_cast_noop,
         doc="Cast to the type x already has is x."),
    Rule("cast_chain", Op("Cast", Op("Cast", "x", name="inner"), name="outer"), _cast_chain_replace,
         condition=_cast_chain,
         doc="Cast(Cast(x, A), B) is Cast(x, B) (or x) when A holds every value of x's type exactly."),
    Rule("castlike_to_cast", Op("CastLike", "x", "like", name="cl"), _castlike_to_cast, condition=_castlike_known,
         doc="CastLike(x, y) with y's dtype known is Cast(x, to=dtype): then constant inputs fold."),
    # shape ops
    Rule("reshape_chain", Op("Reshape", Op("Reshape", "x", "s1"), Const("shape"), name="outer"),
         _reshape_chain_replace, condition=_reshape_chain,
         doc="Reshape(Reshape(x, s1), s2) is Reshape(x, s2) when s2 copies no dimension (no 0)."),
    Rule("reshape_flatten_chain", Op("Reshape", Op("Flatten", "x"), Const("shape"), name="outer"),
         _reshape_chain_replace, condition=_reshape_chain,
         doc="Reshape(Flatten(x), s) is Reshape(x, s) when s copies no dimension (no 0)."),
    Rule("reshape_elimination", Op("Reshape", "x", Const("shape"), name="r"), _x, condition=_reshape_noop,
         doc="Reshape to the shape x already has (static) is x."),
    Rule("flatten_elimination", Op("Flatten", "x", name="f"), _x, condition=_flatten_noop,
         doc="Flatten of a 2-D value at axis 1 is the value."),
    Rule("squeeze_unsqueeze", Op("Squeeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=_squeeze_unsqueeze,
         doc="Squeeze(Unsqueeze(x, axes), axes) is x."),
    Rule("unsqueeze_squeeze", Op("Unsqueeze", Op("Squeeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                                 name="outer"), _x, condition=_squeeze_unsqueeze,
         doc="Unsqueeze(Squeeze(x, axes), axes) is x (the squeezed axes had size 1)."),
    Rule("transpose_pair", Op("Transpose", Op("Transpose", "x", name="inner"), name="outer"), _transpose_pair,
         doc="Two Transposes are one (or none when they cancel)."),
    Rule("transpose_elimination", Op("Transpose", "x", name="t"), _x, condition=_transpose_identity,
         doc="Transpose by the identity permutation is x."),
    Rule("expand_elimination", Op("Expand", "x", Const("shape")), _x, condition=_expand_noop,
         doc="Expand to a shape x already covers is x."),
    Rule("slice_elimination", Op("Slice", "x", Const("starts"), Const("ends"), Opt(Const("axes")), Opt(Const("steps"))),
         _x, condition=_slice_noop, doc="Slice from 0 to past the end with step 1 is x."),
    Rule("pad_elimination", Op("Pad", "x", Const("pads"), Opt("value"), Opt("axes")), _x, condition=_pad_noop,
         doc="Pad by zeros on every side is x."),
    Rule("concat_elimination", Op("Concat", "x"), _x, condition=_concat_single, doc="Concat of one input is it."),
    Rule("split_elimination", Op("Split", "x", Opt(Const("split"))), _x, condition=_split_single,
         doc="Split into one piece is x."),
    # arithmetic
    Rule("mul_by_one", Op("Mul", "x", Const("c", value=1), commutative=True), _x, condition=_neutral,
         doc="x * 1 is x (when 1 does not broadcast x larger)."),
    Rule("add_zero", Op("Add", "x", Const("c", value=0), commutative=True), _x, condition=_zero_neutral,
         doc="x + 0 is x when x holds no -0.0 (an integer, a MatMul or Conv result) or the 0s are -0.0 "
             "(-0.0 + 0.0 is +0.0); when 0 does not broadcast x larger."),
    Rule("sub_zero", Op("Sub", "x", Const("c", value=0)), _x, condition=_zero_neutral,
         doc="x - 0 is x when the 0s are +0.0 (x - -0.0 turns -0.0 into +0.0) or x holds no -0.0; "
             "when 0 does not broadcast x larger."),
    Rule("div_by_one", Op("Div", "x", Const("c", value=1)), _x, condition=_neutral,
         doc="x / 1 is x (when 1 does not broadcast x larger)."),
    Rule("div_to_mul", Op("Div", "x", Const("c")), _div_to_mul, condition=_div_by_const, priority=-1,
         doc="x / c is x * (1/c) when c is a power of two (so 1/c is exact)."),
    Rule("pow_two_to_mul", Op("Pow", "x", Const("p")), _square, condition=_pow_two, doc="Pow(x, 2) is x * x."),
    Rule("matmul_add_to_gemm", Op("Add", Op("MatMul", "a", Const("w")), Const("c"), commutative=True), _gemm,
         condition=_matmul_add, doc="MatMul(A, W) + c on a 2-D A is Gemm(A, W, c)."),
    Rule("gemm_flatten_to_matmul",
         Op("Reshape", Op("Gemm", Op("Reshape", "x", Const("s1")), Const("w"), Opt("c"), name="gemm"), "s2"),
         _gemm_to_matmul, condition=_gemm_unflatten,
         doc="Reshape(Gemm(Reshape(x, [-1, K]), W, c), x.shape[:-1] + [N]) -- a linear layer applied to "
             "flattened rows, as legacy GPT-2 exports write it -- is MatMul(x, W) + c: the reshapes and "
             "the shape arithmetic that rebuilt the leading dimensions go."),
    # Conv absorbs
    Rule("conv_mul_fold", Op("Mul", Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv"), Const("c"),
                             commutative=True), _conv_mul, condition=_conv_ok,
         doc="Conv followed by Mul by a per-output-channel constant scales the weights and bias (not for a "
             "zero or non-finite factor, non-finite weights, or folded weights that overflow or flush to 0)."),
    Rule("conv_add_fold", Op("Add", Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv"), Const("c"),
                             commutative=True), _conv_add, condition=_conv_ok,
         doc="Conv followed by Add of a per-output-channel constant adds it to the bias (finite constants "
             "whose sum stays finite)."),
    Rule("pad_into_conv", Op("Conv", Op("Pad", "x", Const("pads"), Opt(Const("value")), Opt("axes"), name="pad"),
                             "w", Opt("b"), name="op"), _pad_fold, condition=_pad_into,
         doc="Zero Pad of spatial axes before a Conv (auto_pad NOTSET or VALID) becomes the Conv's pads."),
    Rule("pad_into_averagepool", Op("AveragePool", Op("Pad", "x", Const("pads"), Opt(Const("value")), Opt("axes"),
                                                      name="pad"), name="op"), _pad_fold, condition=_pad_into,
         doc="Zero Pad before an AveragePool with count_include_pad=1 becomes its pads (each below the "
             "kernel size; under ceil_mode only where the output size stays)."),
]


# --- sequences and shapes built from the input's own dimensions -------------------------------


def _split_sizes(m: Match) -> list[int] | None:
    """The piece sizes SplitToSequence cuts, when known; None otherwise."""
    axis = int(m.attr("sts", "axis", 0))
    dims = _dims(m, "x")
    d = None
    if dims is not None and -len(dims) <= axis < len(dims):
        d = dims[axis]
    if "split" in m:
        split = m.const("split")
        if split.dtype.kind not in "iu":
            return None
        if split.ndim == 1:
            return [int(s) for s in split]
        if d is None or int(split) <= 0:
            return None
        s = int(split)
        return [s] * (d // s) + ([d % s] if d % s else [])
    return None if d is None else [1] * d


def _sequence_at_split(m: Match):
    sizes = _split_sizes(m)
    if not sizes:
        return "the pieces are not known"
    i = m.const("i")
    if i.size != 1 or not -len(sizes) <= int(i.reshape(-1)[0]) < len(sizes):
        return "index out of range"
    if "split" in m and m.const("split").ndim == 0 and int(m.attr("sts", "keepdims", 1)) == 0:
        # the spec ignores keepdims when split is given; onnxruntime squeezes for a scalar split
        return "scalar split with keepdims=0 (onnxruntime and the spec disagree)"
    if m.opset("") < 11:
        return "opset"
    return None


def _sequence_at_to_split(m: Match, b):
    sizes = _split_sizes(m)
    axis = int(m.attr("sts", "axis", 0))
    i = int(m.const("i").reshape(-1)[0]) % len(sizes)
    if m.opset("") >= 13:
        outs = b.op("Split", m["x"], b.const(np.array(sizes, dtype=np.int64), name="split"), axis=axis,
                    outputs=len(sizes))
    else:
        outs = b.op("Split", m["x"], axis=axis, split=sizes, outputs=len(sizes))
    out = outs if len(sizes) == 1 else outs[i]
    if "split" not in m and int(m.attr("sts", "keepdims", 1)) == 0:
        if m.opset("") >= 13:
            out = b.op("Squeeze", out, b.const(np.array([axis], dtype=np.int64), name="axes"))
        else:
            out = b.op("Squeeze", out, axes=[axis])
    return out


def _shape_elements(value: ir.Value | None, depth: int = 0) -> list | None:
    """A 1-D int64 shape tensor as a list of ints and ("dim", source, k) entries (the k-th
    dimension of ``source`` read through Shape), or None when it is anything else."""
    from onnxopt.irutil import constant_tensor

    if value is None or depth > 8:
        return None
    tensor = constant_tensor(value)
    if tensor is not None:
        arr = tensor.numpy()
        if arr.dtype != np.int64 or arr.ndim > 1:
            return None
        return [int(a) for a in arr.reshape(-1)]
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Concat":
        axis = node.attributes.get("axis")
        if axis is None or axis.value not in (0, -1):
            return None
        parts = []
        for v in node.inputs:
            part = _shape_elements(v, depth + 1)
            if part is None:
                return None
            parts.extend(part)
        return parts
    if op == "Shape":
        src = node.inputs[0]
        if src.shape is None:
            return None
        rank = len(src.shape)
        start = node.attributes.get("start")
        end = node.attributes.get("end")
        ks = list(range(rank))[slice(start.value if start else None, end.value if end else None)]
        return [("dim", src, k) for k in ks]
    if op == "Reshape" and len(node.inputs) == 2:  # a scalar made 1-D: Reshape(s, [-1]) or [1]
        target = constant_tensor(node.inputs[1])
        if target is None or target.numpy().reshape(-1).tolist() not in ([-1], [1]):
            return None
        inner = _scalar_element(node.inputs[0], depth + 1)
        if inner is not None:
            return [inner]
        part = _shape_elements(node.inputs[0], depth + 1)
        return part if part is not None and len(part) == 1 else None
    if op == "Unsqueeze" and len(node.inputs) >= 1:
        axes = node.inputs[1] if len(node.inputs) > 1 else None
        inner = _scalar_element(node.inputs[0], depth + 1)
        if inner is None:
            return None
        axes_t = constant_tensor(axes) if axes is not None else None
        ax = axes_t.numpy().reshape(-1).tolist() if axes_t is not None else node.attributes.get("axes").value \
            if node.attributes.get("axes") is not None else None
        return [inner] if ax is not None and list(ax) in ([0], [-1]) else None
    if op in ("Gather", "Slice"):
        src = _shape_elements(node.inputs[0], depth + 1)
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


def _scalar_element(value: ir.Value | None, depth: int):
    from onnxopt.irutil import constant_tensor

    if value is None:
        return None
    tensor = constant_tensor(value)
    if tensor is not None:
        arr = tensor.numpy()
        return int(arr) if arr.ndim == 0 and arr.dtype == np.int64 else None
    node = value.producer()
    if node is not None and node.op_type in ("Squeeze", "Reshape") and node.domain in ("", "ai.onnx"):
        part = _shape_elements(node.inputs[0], depth + 1)  # a 1-element shape tensor made a scalar
        if node.op_type == "Reshape":
            target = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
            if target is None or target.numpy().size != 0:
                return None
        return part[0] if part is not None and len(part) == 1 else None
    if node is None or node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
        return None
    src = _shape_elements(node.inputs[0], depth + 1)
    idx = constant_tensor(node.inputs[1])
    axis = node.attributes.get("axis")
    if src is None or idx is None or idx.numpy().ndim != 0 or (axis is not None and axis.value != 0):
        return None
    i = int(idx.numpy())
    return src[i] if -len(src) <= i < len(src) else None


def _reshape_target(m: Match) -> list[int] | None:
    """The Reshape's shape as constants, its input's own dimensions (same position) as 0."""
    target = _reshape_elements_target(m)
    return None if target is None else _resolve_minus_one(m, target)


def _reshape_elements_target(m: Match) -> list[int] | None:
    elements = _shape_elements(m["shape"])
    if elements is None:
        return None
    x = m["x"]
    rank = len(x.shape) if x.shape is not None else None
    out = []
    for j, e in enumerate(elements):
        if isinstance(e, int):
            if e == 0:
                return None  # a literal 0 already copies; keep the arithmetic simple
            out.append(e)
        elif rank is not None and j < rank and (e[1] is x and e[2] == j or _same_symbol(e[1], e[2], x, j)):
            out.append(0)
        elif e[1].shape is not None and isinstance(e[1].shape[e[2]], int) and int(e[1].shape[e[2]]) > 0:
            out.append(int(e[1].shape[e[2]]))  # (a static 0 would read as "copy")
        else:
            return None
    if out.count(-1) > 1:
        return None
    return out


def _same_symbol(a: ir.Value, k: int, x: ir.Value, j: int) -> bool:
    """Dimension k of a and dimension j of x carry the same named symbol (onnx's shape inference
    gives equal dimensions equal names, and distinct unknowns distinct ones)."""
    if a.shape is None or x.shape is None or not -len(a.shape) <= k < len(a.shape):
        return False
    da, dx = a.shape[k], x.shape[j]
    return (not isinstance(da, int) and not isinstance(dx, int) and bool(da.value) and da.value == dx.value
            and da.value not in _placeholder_symbols(x.graph or a.graph))


def _placeholder_symbols(graph: ir.Graph | None) -> frozenset:
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


def _reshape_from_own_dims(m: Match):
    if m["shape"].producer() is None:
        return "the shape is already a constant"
    target = _reshape_target(m)
    if target is None:
        return "the shape is not built from constants and the input's own dimensions"
    if m.attr("r", "allowzero", 0) == 1 and -1 in target and 0 in target:
        # onnxruntime accepts 0 with -1 under allowzero=1 (the spec does not); allowzero=0 would not
        return "allowzero=1 with -1: a copied dimension of 0 would change meaning"
    return None


def _resolve_minus_one(m: Match, target: list[int]) -> list[int]:
    """A -1 where the Reshape's output has a known size, or the symbol of x's dimension at that
    position, is that size or a copy (0): then no -1 is left to meet a copied 0 of a zero-sized
    dimension."""
    if -1 not in target:
        return target
    j = target.index(-1)
    out, x = m.root.outputs[0], m["x"]
    if out.shape is None or len(out.shape) != len(target):
        return target
    if isinstance(out.shape[j], int) and out.shape[j] > 0:
        return target[:j] + [int(out.shape[j])] + target[j + 1:]
    if x.shape is not None and j < len(x.shape) and _same_symbol(out, j, x, j):
        return target[:j] + [0] + target[j + 1:]
    return target


def _reshape_const_shape(m: Match, b):
    # A 0 copies the dimension it stands for, which is the value the original computed, so the
    # new Reshape copies (allowzero 0) even where the original had allowzero=1 (it has no literal 0).
    target = _reshape_target(m)
    attrs = [a for a in m.node("r").attributes.values() if a.name != "allowzero"]
    return b.op("Reshape", m["x"], b.const(np.array(target, dtype=np.int64), name="shape"), attrs=attrs)


def _merged_axes(m: Match) -> list[int] | None:
    a1, a2 = _axes(m, "inner", "a1"), _axes(m, "outer", "a2")
    dims = _dims(m, "x")
    if a1 is None or a2 is None or dims is None:
        return None
    r = len(dims)
    mid, final = r + len(a1), r + len(a1) + len(a2)
    a1 = sorted(a % mid for a in a1)
    a2 = sorted(a % final for a in a2)
    if len(set(a1)) != len(a1) or len(set(a2)) != len(a2):
        return None
    kept = [p for p in range(final) if p not in a2]  # the intermediate's axes, in the final tensor
    return sorted(set(a2) | {kept[a] for a in a1})


def _unsqueeze_mergeable(m: Match):
    if _merged_axes(m) is None:
        return "axes or rank unknown"
    return None


def _unsqueeze_merge(m: Match, b):
    axes = _merged_axes(m)
    if m.opset("") >= 13:
        return b.op("Unsqueeze", m["x"], b.const(np.array(axes, dtype=np.int64), name="axes"))
    return b.op("Unsqueeze", m["x"], axes=axes)


RULES += [
    Rule("sequence_at_split", Op("SequenceAt", Op("SplitToSequence", "x", Opt(Const("split")), name="sts",
                                                  shared=True), Const("i")),
         _sequence_at_to_split, condition=_sequence_at_split,
         doc="SequenceAt(SplitToSequence(x), i) with known pieces is output i of a Split "
             "(identical Splits then merge: one Split instead of a sequence)."),
    Rule("reshape_shape_from_input", Op("Reshape", "x", "shape", name="r"), _reshape_const_shape,
         condition=_reshape_from_own_dims,
         doc="Reshape whose target shape is assembled (Shape/Gather/Slice/Unsqueeze/Concat) from constants "
             "and x's own dimensions at the same positions (the same value, or the same named symbol) takes a "
             "constant shape, with 0 for the copied ones."),
    Rule("unsqueeze_chain", Op("Unsqueeze", Op("Unsqueeze", "x", Opt(Const("a1")), name="inner"), Opt(Const("a2")),
                               name="outer"), _unsqueeze_merge, condition=_unsqueeze_mergeable,
         doc="Unsqueeze(Unsqueeze(x, a1), a2) is one Unsqueeze with both sets of axes."),
]
