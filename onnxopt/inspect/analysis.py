"""What a model computes, without running it: ``onnxopt inspect MODEL`` and :func:`analyze`.

:func:`analyze` reads a model's graph (never its weights: a model is loaded without its external
data, so a model of many gigabytes is analyzed in about the time its graph takes to parse; small
integer tensors kept in external data, the shapes a Reshape reads, are read for shape inference),
runs onnx's shape inference (``data_prop=True``) and gives, as a JSON-ready dict with a fixed key
order: the inputs and outputs, the opsets, the op types, the parameters (initializers and the tensors
of Constant nodes) by dtype, and per node and in total the floating-point operations, the bytes read
and written, the arithmetic intensity and whether the node is compute- or memory-bound on a device's
roofline.

FLOPs convention: **FLOPs = 2 x multiply-accumulates** (a multiply and an add count as two
operations), stated in the output as ``"flops_convention"``. Integer and quantized ops count the
same way ("operations" rather than floating-point ones: a QLinearConv counts as the Conv it
stands for). Every other op counts per element of its output (or input, for reductions), as
:data:`FLOPS_PER_ELEMENT` and the table in the README say: one per element for each element-wise
op, whatever it costs in hardware (Add, Mul, Relu, Sigmoid, Tanh, Erf, Exp, ... are each 1), and
a fused op counts as the ops it replaces (so optimizing a model does not change its count):

    op                                 FLOPs
    Conv                               2 x N x Cout x out-spatial x (Cin / groups) x kernel (+1 per output with a bias);
                                       dilations change the output's size only
    ConvTranspose                      2 x N x Cin x in-spatial x (Cout / groups) x kernel (+1 per output with a bias)
    MatMul, batched MatMul             2 x (output elements) x K
    Gemm                               2 x M x N x K (+1 per output with C)
    Einsum                             2 x (product of every index's size), for two operands
    element-wise ops                   1 per output element (Where, comparisons, Clip, Relu, Sigmoid, Erf, ...)
    Cast, Reshape, Transpose, Gather,  0 (data movement: bytes only)
    Concat, Slice, ...
    MaxPool, AveragePool, LpPool       1 per output element per kernel element
    GlobalAveragePool, GlobalMaxPool   1 per input element
    Reduce*, ArgMax, ArgMin            1 per input element (ReduceSumSquare, ReduceL2, ReduceLogSumExp: 2)
    BatchNormalization (inference)     2 per element (a scale and a shift)
    LayerNormalization                 5 per element (mean, subtract, square, sum, normalize) + 1 scale + 1 bias
    InstanceNormalization,             as LayerNormalization
    GroupNormalization
    RMSNormalization,                  4 per element (square, sum, normalize, scale)
    SimplifiedLayerNormalization
    Softmax, LogSoftmax                5 per element (max, subtract, exp, sum, divide)
    Gelu (and com.microsoft Gelu)      5 per element (the erf form: divide, erf, add, multiply, multiply)
    FastGelu                           8 per element (the tanh form) + 1 with a bias
    BiasGelu                           1 + 5 per element
    SkipLayerNormalization             1 (skip) + 1 (bias, if any) + LayerNormalization's 7
    EmbedLayerNormalization            1 (+ 1 with a segment table) for the embeddings' sum + LayerNormalization's 7
    Attention (com.microsoft)          its QKV projection (a Gemm with bias) + 2 x S x L x head-size per head for
                                       Q x K' and again for P x V + 7 per score (scale, mask, softmax)
    MultiHeadAttention                 Q x K' and P x V as above, + 7 per score
    FusedConv, FusedGemm, FusedMatMul  the Conv / Gemm / MatMul + 1 per output element for the activation
    QLinearConv, QLinearMatMul,        as Conv / MatMul / Gemm (integer multiply-accumulates, 2 each)
    ConvInteger, MatMulInteger, QGemm,
    MatMulNBits, DynamicQuantizeMatMul
    QuantizeLinear, DequantizeLinear   2 per element (scale, zero point)

An op not in the table counts 0 FLOPs and is listed in ``"uncounted_op_types"``; so are the nodes
of subgraphs (If, Loop, Scan bodies), which are not entered.

Bytes: a node reads each of its inputs once (weights included; ``weight_bytes`` is the part that
is initializers) and writes each of its outputs once: the traffic of an unfused, uncached run,
what a roofline's memory side needs. Except where an op reads only part of its first input: a
Gather, GatherElements or GatherND reads of its data the elements it gathers (as many bytes as it
writes, not the whole embedding table), a Slice its slice; Shape and Size read none of the data;
com.microsoft EmbedLayerNormalization reads of each table the bytes of its output (the rows it gathers).

Symbolic dimensions: a dimension that is a symbol (``batch``, ``sequence``) and not fixed by
``input_shapes`` (the ``--input-shape`` grammar of every command, ``onnxopt.ir.input_shapes``) stays
one. Every number in the output is then the value with **each symbol set to 1**, and the node or
the total has ``"symbolic": true`` and ``"expr"``: the exact polynomials, e.g.
``{"flops": "1536*batch*sequence^2 + 170459136*batch*sequence", ...}``. Give the dimensions
(``--input-shape input_ids=1x128``) for plain numbers. A dimension with neither a value nor a
name is the symbol ``?``.

Rooflines: ``device`` names an entry of ``onnxopt/data/devices.json`` (datasheet figures, each
with its source) or ``"local"`` (default): this machine's CPU, measured once (a float32 matmul on
every core with numpy, and a memory copy) and cached in ``~/.cache/onnxopt/device-<hash>.json``
(``$ONNXOPT_DEVICE_CACHE`` names another folder), the hash of the CPU model and the number of CPUs
the process may use. A node's ``intensity`` is FLOPs per byte moved;
it is ``"compute"``-bound when that is at least the device's ridge point (peak FLOP/s of the
node's dtype / memory bandwidth), else ``"memory"``-bound.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from fractions import Fraction
from importlib import resources
from pathlib import Path

import numpy as np
import onnx

from onnxopt.errors import UsageError
from onnxopt.ir.shapes import infer_proto, symbolic_infer

FLOPS_CONVENTION = ("FLOPs = 2 x multiply-accumulates; element-wise and other ops per element (see "
                    "onnxopt.inspect.analysis); integer ops counted as their float equivalents")
SYMBOLS_NOTE = "numbers evaluate every symbolic dimension at 1; 'expr' holds the polynomials"
LOCAL = "local"
CACHE_ENV = "ONNXOPT_DEVICE_CACHE"
SMALL_SHAPE_TENSOR = 1024  # elements: an integer tensor in external data this small is read for shape inference

# ---------------------------------------------------------------------------------------------
# polynomials in the symbolic dimensions


class Poly:
    """A polynomial with rational coefficients in named dimensions: ``{monomial: coefficient}``,
    a monomial a sorted tuple of symbol names (with repeats)."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict | None = None):
        self.terms = {m: c for m, c in (terms or {}).items() if c != 0}

    @classmethod
    def of(cls, x) -> Poly:
        if isinstance(x, Poly):
            return x
        if isinstance(x, str):
            return cls({(x,): Fraction(1)})
        return cls({(): Fraction(x)})

    def __add__(self, other) -> Poly:
        other = Poly.of(other)
        out = dict(self.terms)
        for m, c in other.terms.items():
            out[m] = out.get(m, 0) + c
        return Poly(out)

    __radd__ = __add__

    def __mul__(self, other) -> Poly:
        other = Poly.of(other)
        out: dict = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0) + c1 * c2
        return Poly(out)

    __rmul__ = __mul__

    def __truediv__(self, k) -> Poly:
        return Poly({m: c / Fraction(k) for m, c in self.terms.items()})

    @property
    def symbolic(self) -> bool:
        return any(self.terms)

    def at_one(self) -> int:
        """The value with every symbol 1 (rounded to a whole number)."""
        return int(round(sum(self.terms.values(), Fraction(0))))

    def __str__(self) -> str:
        if not self.terms:
            return "0"

        def monomial(m, c):
            names = []
            for name in sorted(set(m)):
                k = m.count(name)
                names.append(name if k == 1 else f"{name}^{k}")
            coef = int(c) if c.denominator == 1 else float(c)
            if not names:
                return str(coef)
            return "*".join(([] if coef == 1 else [str(coef)]) + names)

        order = sorted(self.terms.items(), key=lambda mc: (-len(mc[0]), mc[0]))
        return " + ".join(monomial(m, c) for m, c in order)


def _prod(dims) -> Poly:
    out = Poly.of(1)
    for d in dims:
        out = out * Poly.of(d)
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs per op

ELEMENTWISE = frozenset("""Add Sub Mul Div Pow Max Min Mean Sum Neg Abs Sqrt Reciprocal Exp Log Tanh Relu Sigmoid
Erf Clip LeakyRelu PRelu Elu Selu Celu HardSigmoid HardSwish Softplus Softsign Sin Cos Tan Asin Acos Atan Sinh Cosh
Asinh Acosh Atanh Floor Ceil Round Sign Where Equal Greater GreaterOrEqual Less LessOrEqual Not And Or Xor Mod
BitShift IsNaN IsInf ThresholdedRelu Shrink Mish BitwiseAnd BitwiseOr BitwiseXor BitwiseNot QuickGelu
Trilu CumSum""".split())
ZERO = frozenset("""Cast CastLike Reshape Transpose Gather GatherElements GatherND Concat Slice Split Squeeze Unsqueeze
Expand Flatten Identity Shape Size Constant ConstantOfShape Pad Tile Dropout DepthToSpace SpaceToDepth ScatterND
ScatterElements Range NonZero OneHot EyeLike Optional OptionalGetElement OptionalHasElement SequenceConstruct
SequenceAt SequenceEmpty SequenceInsert SplitToSequence ConcatFromSequence ReverseSequence Compress Resize
Upsample""".split())
# Elementwise costs per element of the output (see the module docstring).
FLOPS_PER_ELEMENT = {"BatchNormalization": 2, "Softmax": 5, "LogSoftmax": 5, "Gelu": 5, "BiasGelu": 6,
                     "QuantizeLinear": 2, "DequantizeLinear": 2, "InstanceNormalization": 7,
                     "RMSNormalization": 4, "SimplifiedLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 5}
REDUCE_PER_INPUT = {"ReduceSum": 1, "ReduceMean": 1, "ReduceMax": 1, "ReduceMin": 1, "ReduceProd": 1,
                    "ReduceL1": 1, "ReduceL2": 2, "ReduceSumSquare": 2, "ReduceLogSum": 1, "ReduceLogSumExp": 2,
                    "ArgMax": 1, "ArgMin": 1, "GlobalAveragePool": 1, "GlobalMaxPool": 1, "GlobalLpPool": 2}
SCORE_FLOPS = 7  # per attention score: scale, mask, softmax (5)


class _Node:
    """What the counting functions see of one node: its attributes, input and output shapes
    (lists of int/str dims, None where unknown), and whether each input is given."""

    def __init__(self, node: onnx.NodeProto, ins: list, outs: list):
        self.op = node.op_type
        self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        self.ins, self.outs = ins, outs
        self.present = [bool(n) for n in node.input]

    def attr(self, name, default=None):
        v = self.attrs.get(name, default)
        return v.decode() if isinstance(v, bytes) else v

    def has(self, i: int) -> bool:
        return i < len(self.present) and self.present[i]

    def shape_in(self, i: int):
        if not self.has(i) or self.ins[i] is None:
            raise _Unknown
        return self.ins[i]

    def shape_out(self, i: int = 0):
        if i >= len(self.outs) or self.outs[i] is None:
            raise _Unknown
        return self.outs[i]


class _Unknown(Exception):
    """A shape the count needs is not known."""


def _conv(n: _Node, transpose=False) -> Poly:
    x, w = n.shape_in(0), n.shape_in(1)
    y = n.shape_out()
    kernel = _prod(w[2:])  # (the weight's shape holds Cin/groups or Cout/groups: groups need no term)
    if transpose:  # W: [Cin, Cout/groups, k...]: each input element meets Cout/groups x kernel weights
        macs = _prod(x) * Poly.of(w[1]) * kernel
    else:  # W: [Cout, Cin/groups, k...]
        macs = _prod(y) * Poly.of(w[1]) * kernel
    out = 2 * macs
    if n.has(2):
        out = out + _prod(y)
    return out


def _matmul(n: _Node, a_i=0, b_i=1, trans_a=False, trans_b=False) -> Poly:
    a = n.shape_in(a_i)
    y = n.shape_out()
    if len(a) == 1:
        k = a[0]
    else:
        k = a[-2] if trans_a else a[-1]
    return 2 * _prod(y) * Poly.of(k)


def _gemm(n: _Node) -> Poly:
    a = n.shape_in(0)
    y = n.shape_out()
    k = a[0] if n.attr("transA", 0) else a[1]
    out = 2 * _prod(y) * Poly.of(k)
    if n.has(2):
        out = out + _prod(y)
    return out


def _einsum(n: _Node) -> Poly:
    eq = n.attr("equation").replace(" ", "")
    lhs = eq.split("->")[0].split(",")
    if len(lhs) != 2 or "..." in eq:
        raise _Unknown
    sizes = {}
    for term, i in zip(lhs, range(2)):
        for letter, d in zip(term, n.shape_in(i)):
            sizes.setdefault(letter, d)
    return 2 * _prod(sizes.values())


def _pool(n: _Node) -> Poly:
    return _prod(n.shape_out()) * _prod(n.attr("kernel_shape", []))


def _layer_norm(n: _Node, scale_i=1, bias_i=2) -> Poly:
    per = 5 + (1 if n.has(scale_i) else 0) + (1 if n.has(bias_i) else 0)
    return per * _prod(n.shape_in(0))


def _skip_layer_norm(n: _Node) -> Poly:
    # inputs: input, skip, gamma, beta, bias
    per = 1 + 5 + 1 + (1 if n.has(3) else 0) + (1 if n.has(4) else 0)
    return per * _prod(n.shape_in(0))


def _embed_layer_norm(n: _Node) -> Poly:
    # inputs: input_ids, segment_ids, word, position, segment tables, gamma, beta, mask, position_ids
    per = (1 if n.has(4) else 0) + 1 + 5 + 1 + 1  # the embeddings' sum (2 or 3), then LayerNormalization's 7
    return per * _prod(n.shape_out())


def _attention(n: _Node) -> Poly:
    """com.microsoft Attention: input [B, S, Hin], weights [Hin, Dq+Dk+Dv], bias; num_heads."""
    x, w = n.shape_in(0), n.shape_in(1)
    b, s = x[0], x[1]
    heads = int(n.attr("num_heads"))
    sizes = n.attr("qkv_hidden_sizes")
    if sizes:
        _, dk, dv = (int(v) for v in sizes)
    elif isinstance(w[1], int):
        dk = dv = w[1] // 3
    else:
        raise _Unknown
    past = 0
    if n.has(4) and n.ins[4] is not None:  # past: [2, B, heads, P, head]
        past = n.ins[4][3]
    total = Poly.of(s) + Poly.of(past)
    proj = 2 * Poly.of(b) * Poly.of(s) * Poly.of(w[0]) * Poly.of(w[1])
    if n.has(2):
        proj = proj + Poly.of(b) * Poly.of(s) * Poly.of(w[1])
    scores = Poly.of(b) * heads * Poly.of(s) * total
    return proj + 2 * scores * Fraction(dk, heads) + 2 * scores * Fraction(dv, heads) + SCORE_FLOPS * scores


def _mha(n: _Node) -> Poly:
    """com.microsoft MultiHeadAttention: query [B, S, D], key [B, L, D] (or packed); num_heads."""
    q = n.shape_in(0)
    heads = int(n.attr("num_heads"))
    if len(q) != 3 or not n.has(1) or n.ins[1] is None or len(n.ins[1]) != 3:
        raise _Unknown
    k = n.ins[1]
    b, s, d = q
    length = k[1]
    scores = Poly.of(b) * heads * Poly.of(s) * Poly.of(length)
    return 4 * scores * Poly.of(d) / heads + SCORE_FLOPS * scores


def _fast_gelu(n: _Node) -> Poly:
    return (8 + (1 if n.has(1) else 0)) * _prod(n.shape_out())


def _qlinear_conv(n: _Node) -> Poly:
    # QLinearConv: x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B
    y, w = n.shape_out(), n.shape_in(3)
    out = 2 * _prod(y) * Poly.of(w[1]) * _prod(w[2:])
    return out + (_prod(y) if n.has(8) else 0)


def _conv_integer(n: _Node) -> Poly:
    y, w = n.shape_out(), n.shape_in(1)
    return 2 * _prod(y) * Poly.of(w[1]) * _prod(w[2:])


def _matmul_nbits(n: _Node) -> Poly:
    return 2 * _prod(n.shape_out()) * Poly.of(int(n.attr("K")))


def _fused(base):
    def count(n: _Node) -> Poly:
        extra = _prod(n.shape_out()) if n.attr("activation") else Poly.of(0)
        return base(n) + extra
    return count


def _fused_matmul(n: _Node) -> Poly:
    return _matmul(n, trans_a=bool(n.attr("transA", 0)))


COUNTERS = {
    "Conv": _conv, "ConvTranspose": lambda n: _conv(n, transpose=True),
    "MatMul": _matmul, "Gemm": _gemm, "Einsum": _einsum,
    "MaxPool": _pool, "AveragePool": _pool, "LpPool": _pool,
    "LayerNormalization": _layer_norm, "GroupNormalization": _layer_norm,
    "SkipLayerNormalization": _skip_layer_norm, "EmbedLayerNormalization": _embed_layer_norm,
    "Attention": _attention, "MultiHeadAttention": _mha,
    "FastGelu": _fast_gelu,
    "FusedConv": _fused(_conv), "FusedGemm": _fused(_gemm), "FusedMatMul": _fused_matmul,
    "QLinearConv": _qlinear_conv, "QLinearMatMul": lambda n: _matmul(n, 0, 3),
    "ConvInteger": _conv_integer, "MatMulInteger": _matmul, "MatMulIntegerToFloat": _matmul,
    "DynamicQuantizeMatMul": _matmul, "MatMulNBits": _matmul_nbits,
    "QGemm": lambda n: 2 * _prod(n.shape_out()) * Poly.of(n.shape_in(0)[0 if n.attr("transA", 0) else 1]),
}


def node_flops(n: _Node) -> Poly | None:
    """The FLOPs of one node (a polynomial); None for an op this module does not count."""
    op = n.op
    if op in COUNTERS:
        return COUNTERS[op](n)
    if op in REDUCE_PER_INPUT:
        return REDUCE_PER_INPUT[op] * _prod(n.shape_in(0))
    if op in FLOPS_PER_ELEMENT:
        return FLOPS_PER_ELEMENT[op] * _prod(n.shape_out())
    if op in ELEMENTWISE:
        per = max(1, sum(n.present) - 1) if op in ("Sum", "Mean", "Max", "Min") else 1
        return per * _prod(n.shape_out())
    if op in ZERO:
        return Poly.of(0)
    return None


# ---------------------------------------------------------------------------------------------
# loading and shapes


def _dtype_name(elem: int) -> str:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem not in _NAMES else _NAMES[elem]
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem).lower()


_NAMES = {onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.STRING: "string",
          onnx.TensorProto.FLOAT8E4M3FN: "float8e4m3fn", onnx.TensorProto.FLOAT8E5M2: "float8e5m2",
          onnx.TensorProto.INT4: "int4", onnx.TensorProto.UINT4: "uint4"}


def _itemsize(elem: int) -> Fraction:
    if elem in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, getattr(onnx.TensorProto, "FLOAT4E2M1", -1)):
        return Fraction(1, 2)
    if elem in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return Fraction(0)
    try:
        return Fraction(onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize)
    except (KeyError, TypeError, ValueError):
        return Fraction(1)


def _dims(shape: onnx.TensorShapeProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape.dim]


def _type_shape(t: onnx.TypeProto):
    """(elem type, dims or None) of a tensor type; (None, None) for others."""
    if not t.HasField("tensor_type"):
        return None, None
    tt = t.tensor_type
    return tt.elem_type, (_dims(tt.shape) if tt.HasField("shape") else None)


def _load(model, input_shapes) -> tuple[onnx.ModelProto, Path | None]:
    from onnxopt.ir import input_shapes as grammar
    from onnxopt.ir import io

    if isinstance(model, onnx.ModelProto):
        proto, base = onnx.ModelProto(), None
        proto.CopyFrom(model)
    elif isinstance(model, (str, os.PathLike)):
        path = Path(os.fspath(model))
        proto, _ = io.read_checked(path, check=False)  # (one-line errors: missing, not ONNX, truncated)
        base = path.parent
    else:
        raise UsageError(f"analyze takes a path or an onnx.ModelProto, not {type(model).__name__}")
    shapes = grammar.normalize(input_shapes)
    if shapes:
        import onnx_ir as ir

        model_ir = ir.serde.deserialize_model(proto)  # (external tensors stay references: nothing is read)
        grammar.fix(model_ir, shapes)
        proto = ir.serde.serialize_model(model_ir)
    return proto, base


_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _skeleton(proto: onnx.ModelProto) -> None:
    """Drop the data of the weights held in the file that shape inference has no use for (all but
    small integer tensors), in place: the copies shape inference makes then cost no weight bytes.
    Their dims and types stay; they read as external tensors that are not loaded."""
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        small_int = t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and \
            math.prod(t.dims) <= SMALL_SHAPE_TENSOR
        if small_int or math.prod(t.dims) <= 16:
            continue
        for field in _DATA_FIELDS:
            t.ClearField(field)
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        t.external_data.add(key="location", value="(not loaded: onnxopt.inspect.analysis)")


def _read_small_external(proto: onnx.ModelProto, base: Path | None) -> None:
    """Integer initializers kept in external data and small enough to be shapes: read (only
    their bytes), so that shape inference can use their values."""
    from onnx import external_data_helper as ext

    if base is None:
        return
    for t in proto.graph.initializer:
        if (t.data_location == onnx.TensorProto.EXTERNAL and t.data_type in (onnx.TensorProto.INT64,
                                                                            onnx.TensorProto.INT32)
                and math.prod(t.dims) <= SMALL_SHAPE_TENSOR):
            try:
                ext.load_external_data_for_tensor(t, str(base))
            except (OSError, ValueError):
                continue
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return infer_proto(proto)  # (bounded: onnxopt.ir.shapes.bounded_infer)
    except Exception:  # (a model shape inference stops on is analyzed with the shapes it declares)
        return proto


def _concrete_counts(proto: onnx.ModelProto) -> _Counts:
    """The counts of a model whose inputs are all numbers: onnx's shape inference, and where it
    leaves a count unknown or symbolic, onnxruntime's (when installed) if it leaves fewer."""
    counts = _Counts(_infer(proto).graph, proto.graph.node)
    open_rows = counts.open()
    if open_rows:
        other = symbolic_infer(proto)
        if other is not None and len(other.graph.node) == len(proto.graph.node):
            alt = _Counts(other.graph, proto.graph.node, proto.graph.initializer)
            if len(alt.rows) == len(counts.rows) and alt.open() < open_rows:
                return alt
    return counts


# ---------------------------------------------------------------------------------------------
# devices


def devices_table() -> dict:
    """The shipped device table (``onnxopt/data/devices.json``): name -> entry."""
    text = resources.files("onnxopt").joinpath("data/devices.json").read_text()
    return json.loads(text)["devices"]


def cpu_model() -> str:
    """This machine's CPU model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onnxopt")


def measure_cpu(n: int = 2048, copy_mib: int = 256, repeats: int = 3) -> dict:
    """This CPU's float32 matmul FLOP/s (numpy, every core: its BLAS threads) and memory
    bandwidth (a copy of ``copy_mib`` MiB: bytes read + written per second), best of ``repeats``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    flops = 2 * n ** 3 / best
    src = np.ones(copy_mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best_copy = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - t)
    bandwidth = 2 * src.nbytes / best_copy
    return {"name": f"{cpu_model()} (this machine, {usable_cpus()} usable CPUs)", "kind": "cpu",
            "peak_flops": {"float32": float(f"{flops:.4g}")}, "bandwidth": float(f"{bandwidth:.4g}"),
            "source": f"measured on this machine: numpy float32 {n}x{n} matmul on every core, a {copy_mib} MiB "
                      f"copy (best of {repeats})"}


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _valid_entry(entry) -> bool:
    """Whether a cached measurement has what :func:`device` reads: a name, a source, a positive
    finite bandwidth and positive finite peaks (by dtype)."""
    return (isinstance(entry, dict) and isinstance(entry.get("name"), str) and bool(entry["name"])
            and isinstance(entry.get("source"), str) and _positive(entry.get("bandwidth"))
            and isinstance(entry.get("peak_flops"), dict) and bool(entry["peak_flops"])
            and all(isinstance(k, str) and _positive(v) for k, v in entry["peak_flops"].items()))


def _read_cached(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if _valid_entry(entry) else None


@contextlib.contextmanager
def _exclusive(lock: Path):
    """An exclusive lock on ``lock`` (fcntl.flock, held until the block ends) where the OS has it
    and the file can be opened; else no lock."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


def _write_atomic(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def local_device(*, measure=measure_cpu) -> dict:
    """This machine's CPU: measured once, then read from its cache file (written atomically),
    keyed by the CPU model and the number of CPUs this process may use. Concurrent first runs
    measure one at a time under a lock beside the cache (``device-<key>.lock``): a run that waited
    reads the figure the first wrote. A cache entry that is not a valid measurement is measured
    again and overwritten; where the cache cannot be written, the figures are returned uncached."""
    key = hashlib.sha256(f"{cpu_model()}\n{usable_cpus()} CPUs".encode()).hexdigest()[:16]
    path = _cache_dir() / f"device-{key}.json"
    entry = _read_cached(path)
    if entry is not None:
        return entry
    with _exclusive(path.with_suffix(".lock")):
        entry = _read_cached(path)  # (written by a run this one waited for)
        if entry is not None:
            return entry
        entry = measure()
        if _valid_entry(entry):
            try:
                _write_atomic(path, entry)
            except OSError:
                pass  # (a read-only cache: measured again next time)
    return entry


def device(name: str | None = None) -> dict:
    """A device's roofline: an entry of the table, or this machine (``None`` or ``"local"``),
    with its ``key`` and ``ridge`` (FLOPs per byte, by dtype)."""
    if name in (None, LOCAL):
        entry, key = local_device(), LOCAL
    else:
        table = devices_table()
        if name not in table:
            raise UsageError(f"--device {name}: unknown device; known: {', '.join([LOCAL, *table])}")
        entry, key = table[name], name
    peak = entry["peak_flops"]
    return {"key": key, "name": entry["name"], "kind": entry.get("kind", ""), "peak_flops": peak,
            "bandwidth": entry["bandwidth"],
            "ridge": {dt: round(v / entry["bandwidth"], 3) for dt, v in peak.items()},
            "source": entry["source"], **({"notes": entry["notes"]} if entry.get("notes") else {})}


_PEAK_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
               "int8": "int8", "uint8": "int8", "float8e4m3fn": "float8", "float8e5m2": "float8"}


def _ridge(dev: dict, dtype: str | None) -> float:
    ridge = dev["ridge"]
    return ridge.get(_PEAK_DTYPE.get(dtype or "", ""), ridge.get("float32", next(iter(ridge.values()))))


# ---------------------------------------------------------------------------------------------
# the analysis


def _value(poly: Poly) -> int:
    return poly.at_one()


def _op_name(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


# ops that read only part of their first input: as many bytes as they write, or none of its data
_PARTIAL_READ = {"Gather": "written", "GatherElements": "written", "GatherND": "written", "Slice": "written",
                 "Shape": "none", "Size": "none"}
# contrib ops that gather rows of some inputs (tables): each such input read as many bytes as output 0
_GATHERED_INPUTS = {"com.microsoft.EmbedLayerNormalization": frozenset({2, 3, 4})}


class _Counts:
    """Per node of one shape-inferred graph: FLOPs, bytes read, bytes written, weight bytes
    (polynomials), the compute dtype, whether every shape was known; and the op types not counted."""

    def __init__(self, g: onnx.GraphProto, order=None, weights=None):
        """``order``: the nodes in the order the rows follow (another tool's inference may sort them);
        ``weights``: the model's initializers (another tool's inference may have moved them)."""
        types: dict[str, tuple] = {}
        for v in [*g.input, *g.output, *g.value_info]:
            elem, dims = _type_shape(v.type)
            if elem is not None:
                types[v.name] = (elem, dims)
        self.weights = {}
        for t in (weights if weights is not None else g.initializer):
            self.weights[t.name] = (t.data_type, list(t.dims))
            types.setdefault(t.name, (t.data_type, list(t.dims)))
        for node in g.node:  # Constant nodes' tensors are weights too (some exporters keep every weight so)
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for a in node.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        self.weights.setdefault(node.output[0], (a.t.data_type, list(a.t.dims)))
                        types.setdefault(node.output[0], (a.t.data_type, list(a.t.dims)))
        self.uncounted: set[str] = set()
        self.outputs = list(g.output)
        keyed = {tuple(node.output): self._node(node, types) for node in g.node}
        self.rows = [keyed[tuple(node.output)] for node in (order if order is not None else g.node)]

    def open(self) -> int:
        """How many nodes have a count that is not known or not a number."""
        return sum(not row[5] or any(p.symbolic for p in row[:4]) for row in self.rows)

    def _node(self, node: onnx.NodeProto, types: dict):
        def nbytes(name):
            if not name or name not in types or types[name][1] is None:
                return None
            elem, dims = types[name]
            return _prod(dims) * _itemsize(elem)

        op = _op_name(node)
        view = _Node(node, [types.get(n, (None, None))[1] if n else None for n in node.input],
                     [types.get(n, (None, None))[1] for n in node.output])
        known = True
        try:
            flops = node_flops(view)
        except (_Unknown, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError):
            flops, known = Poly.of(0), False
        if flops is None:
            flops = Poly.of(0)
            self.uncounted.add(op)
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            self.uncounted.add(op)
        read, written, wbytes = Poly.of(0), Poly.of(0), Poly.of(0)
        for name in node.output:
            b = nbytes(name)
            known = known and not (name and b is None)
            written = written + (b or 0)
        part = _PARTIAL_READ.get(op) if node.domain in ("", "ai.onnx") else None
        gathered = _GATHERED_INPUTS.get(op, ())
        for k, name in enumerate(node.input):
            b = nbytes(name)
            known = known and not (name and b is None)
            if k in gathered and b is not None:
                b = nbytes(node.output[0])  # (the rows it gathers, not the whole table)
                if b is None:
                    known = False
            if part is not None and k == 0 and b is not None:
                # (only what it takes: the rows a Gather gathers, a Slice's slice; a Shape reads no data)
                b = 0 if part == "none" else nbytes(node.output[0])
                if b is None:
                    known = False
            read = read + (b or 0)
            if name in self.weights:
                wbytes = wbytes + (b or 0)
        dtype = next((_dtype_name(types[n][0]) for n in [*node.input, *node.output]
                      if n in types and types[n][0] and n not in self.weights), None)
        return [flops, read, written, wbytes, dtype, known]


def _subgraph_weights(g: onnx.GraphProto):
    """(elem type, dims) of every initializer and Constant tensor in the subgraphs (If, Loop, Scan
    bodies) of ``g``'s nodes, at any depth."""
    for node in g.node:
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                        list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                for t in sub.initializer:
                    yield t.data_type, list(t.dims)
                for n in sub.node:
                    if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                        for c in n.attribute:
                            if c.name == "value" and c.type == onnx.AttributeProto.TENSOR:
                                yield c.t.data_type, list(c.t.dims)
                yield from _subgraph_weights(sub)


def _input_symbols(proto: onnx.ModelProto) -> list[str]:
    """The symbolic dimensions of the graph's inputs, in order (an unnamed one is named ``?``)."""
    inits = {t.name for t in proto.graph.initializer}
    out = []
    for v in proto.graph.input:
        if v.name in inits or not v.type.HasField("tensor_type") or not v.type.tensor_type.HasField("shape"):
            continue
        for d in v.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                name = d.dim_param or "?"
                if name not in out:
                    out.append(name)
    return out


def _at(proto: onnx.ModelProto, values: dict[str, int]) -> onnx.ModelProto:
    """A copy of ``proto`` with the symbols given values wherever the graph declares them."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    g = copy.graph
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            for d in v.type.tensor_type.shape.dim:
                if not d.HasField("dim_value") and (d.dim_param or "?") in values:
                    d.dim_value = values[d.dim_param or "?"]
    return copy


FIT_DEGREE = 2  # per symbol: attention's scores grow with sequence^2
FIT_POINTS = (2, 3, 5)
FIT_CHECK = 7
FIT_MAX_SYMBOLS = 3


def _fit(proto: onnx.ModelProto, symbols: list[str], n_rows: int) -> tuple[list[list[Poly]], list[bool]] | None:
    """Each node's (FLOPs, read, written, weight bytes) as exact polynomials in the input
    symbols: counted at concrete values of the symbols (onnx's shape inference then knows every
    shape a symbol decides, where symbolic inference loses them at a Reshape) and interpolated,
    degree <= 2 per symbol; checked at one more point. With them, per node, whether every shape
    was known at every point counted. None where that does not hold."""
    import itertools

    exps = list(itertools.product(range(FIT_DEGREE + 1), repeat=len(symbols)))
    points = list(itertools.product(FIT_POINTS, repeat=len(symbols)))

    known = [True] * n_rows

    def counted(point):
        c = _concrete_counts(_at(proto, dict(zip(symbols, point))))
        if len(c.rows) != n_rows:
            return None
        for i, row in enumerate(c.rows):
            known[i] = known[i] and row[5]
        vals = []
        for row in c.rows:
            for p in row[:4]:
                if p.symbolic:
                    return None
                vals.append(Fraction(p.at_one()))
        return vals

    samples = []
    for point in points:
        vals = counted(point)
        if vals is None:
            return None
        samples.append(vals)
    # Solve V c = y for every quantity at once (V: the monomials at the points), exactly.
    m = len(points)
    vander = [[Fraction(math.prod(x ** e for x, e in zip(point, ex))) for ex in exps] for point in points]
    inv = _inverse(vander)
    n_q = len(samples[0])
    coefs = [[sum(inv[i][j] * samples[j][q] for j in range(m)) for i in range(m)] for q in range(n_q)]
    monomials = [tuple(sorted(s for s, e in zip(symbols, ex) for _ in range(e))) for ex in exps]
    polys = [Poly(dict(zip(monomials, cs))) for cs in coefs]
    check = counted((FIT_CHECK,) * len(symbols))
    values = dict(zip(symbols, (FIT_CHECK,) * len(symbols)))
    if check is None or any(_evaluate(p, values) != c for p, c in zip(polys, check)):
        return None
    if any(c.denominator != 1 for p in polys for c in p.terms.values()):
        return None
    return [polys[k:k + 4] for k in range(0, n_q, 4)], known


def _evaluate(p: Poly, values: dict) -> Fraction:
    return sum((c * math.prod(values[s] for s in m) for m, c in p.terms.items()), Fraction(0))


def _inverse(a: list[list[Fraction]]) -> list[list[Fraction]]:
    n = len(a)
    m = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if m[r][col] != 0)
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        m[col] = [x / p for x in m[col]]
        for r in range(n):
            if r != col and m[r][col] != 0:
                f = m[r][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [row[n:] for row in m]


def analyze(model, input_shapes=None, device=None) -> dict:
    """What ``model`` (a path or an ``onnx.ModelProto``) computes: see the module docstring.
    ``input_shapes``: fixed dimensions, as ``optimize(input_shapes=...)`` takes them
    (``{"x": [1, 3, 224, 224]}`` or ``["x=1x3x224x224"]``); ``device``: a name of
    :func:`devices_table`, or None / ``"local"`` for this machine (measured once, cached).
    Bad input raises ``UsageError`` / ``InvalidModelError`` (one line)."""
    dev = globals()["device"](device)
    proto, base = _load(model, input_shapes)
    _read_small_external(proto, base)
    _skeleton(proto)
    symbols = _input_symbols(proto)
    counts = _Counts(_infer(proto).graph, proto.graph.node) if symbols else _concrete_counts(proto)
    g = proto.graph
    if symbols and len(symbols) <= FIT_MAX_SYMBOLS and any(p.symbolic for row in counts.rows for p in row[:4]):
        fitted = _fit(proto, symbols, len(counts.rows))
        if fitted is not None:
            for row, polys, known in zip(counts.rows, *fitted):
                row[:4] = polys
                row[5] = known  # (counted at every point of the fit)
    nodes, by_op = [], {}
    total_f, total_r, total_w = Poly.of(0), Poly.of(0), Poly.of(0)
    for i, (node, (flops, read, written, wbytes, dtype, known)) in enumerate(zip(g.node, counts.rows)):
        op = _op_name(node)
        total_f, total_r, total_w = total_f + flops, total_r + read, total_w + written
        f, r, w = _value(flops), _value(read), _value(written)
        moved = r + w
        intensity = round(f / moved, 4) if moved and known else None  # (unknown shapes: no figure)
        bound = None if intensity is None else ("compute" if intensity >= _ridge(dev, dtype) else "memory")
        entry = {"name": node.name or f"{op}_{i}", "op": op, "flops": f, "bytes_read": r, "bytes_written": w,
                 "weight_bytes": _value(wbytes), "intensity": intensity, "bound": bound, "dtype": dtype}
        if flops.symbolic or read.symbolic or written.symbolic:
            entry["symbolic"] = True
            entry["expr"] = {"flops": str(flops), "bytes_read": str(read), "bytes_written": str(written)}
        if not known:
            entry["shapes_known"] = False
        nodes.append(entry)
        s = by_op.setdefault(op, {"nodes": 0, "flops": 0, "bytes_read": 0, "bytes_written": 0})
        s["nodes"] += 1
        s["flops"] += f
        s["bytes_read"] += r
        s["bytes_written"] += w

    by_dtype: dict = {}
    count, size = 0, Fraction(0)
    for elem, dims in [*counts.weights.values(), *_subgraph_weights(g)]:
        n = math.prod(dims)
        b = n * _itemsize(elem)
        d = by_dtype.setdefault(_dtype_name(elem), {"count": 0, "bytes": 0})
        d["count"] += n
        d["bytes"] += int(b)
        count, size = count + n, size + b
    symbolic = total_f.symbolic or total_r.symbolic or total_w.symbolic
    f, r, w = _value(total_f), _value(total_r), _value(total_w)
    ops: dict = {}
    for node in g.node:
        ops[_op_name(node)] = ops.get(_op_name(node), 0) + 1

    def io_entry(v):
        elem, dims = _type_shape(v.type)
        return {"name": v.name, "dtype": _dtype_name(elem) if elem else None,
                "shape": None if dims is None else [d if isinstance(d, int) else str(d) for d in dims]}

    report = {
        "flops_convention": FLOPS_CONVENTION,
        "inputs": [io_entry(v) for v in g.input if v.name not in counts.weights],
        "outputs": [io_entry(v) for v in counts.outputs],
        "opsets": {(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
        "op_types": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "params": {"count": count, "bytes": int(size),
                   "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])))},
        "flops": f, "bytes_read": r, "bytes_written": w,
        "intensity": round(f / (r + w), 4) if r + w else None,
        "symbolic": symbolic,
    }
    if symbolic:
        used = sorted({sym for p in (total_f, total_r, total_w) for m in p.terms for sym in m})
        own = [sym for sym in symbols if sym in used]
        inferred = [sym for sym in used if sym not in symbols]
        report["symbols"] = {"inputs": own, "undetermined": inferred}
        report["symbols_note"] = SYMBOLS_NOTE + (
            f"; {', '.join(inferred)}: dimensions shape inference could not determine (not the inputs': "
            "--input-shape cannot set them)" if inferred else "")
        report["expr"] = {"flops": str(total_f), "bytes_read": str(total_r), "bytes_written": str(total_w)}
    report["uncounted_op_types"] = sorted(counts.uncounted)
    report["nodes_with_unknown_shapes"] = sum(not row[5] for row in counts.rows)
    report["by_op_type"] = dict(sorted(by_op.items(), key=lambda kv: (-kv[1]["flops"], kv[0])))
    report["device"] = dict(dev)
    report["nodes"] = nodes
    return report


# ---------------------------------------------------------------------------------------------
# the terminal report


def check_top(top: int) -> int:
    if top < 0:
        raise UsageError(f"--top {top}: expected a whole number >= 0")
    return top


__all__ = ["analyze", "device", "devices_table", "local_device", "measure_cpu", "Poly",
           "FLOPS_CONVENTION"]
