"""BatchNormalization folding: into a preceding Conv or ConvTranspose, or into Mul+Add.

All arithmetic is done in float64 and cast back to the weights' type once, so folding adds no
more rounding than storing the folded weights needs (conv_bn_fold instead rounds the way
onnxruntime's own fusion does). The result equals the BatchNormalization's up to rounding, NaN and
infinities of the input included: parameters that hold inf or NaN or have var + epsilon <= 0,
weights that do, a zero factor (for a conv), a factor scale / sqrt(var + epsilon) that rounds to 0,
to a subnormal or to inf in the parameters' type, and folded values that overflow or flush to 0 are
refused (see rules/_weights.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

import ml_dtypes

from onnxopt.core.pattern import Const, Match, Op, Opt, Refuse, Rule

from onnxopt.rules._semantic import unrepresentable
from onnxopt.rules._weights import fold_weights, non_finite

_FLOAT_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


def _bn_inference(m: Match) -> str | None:
    """The BatchNormalization computes y = (x - mean) / sqrt(var + eps) * scale + beta."""
    bn = m.node("bn")
    opset = m.opset("")
    if opset >= 14:
        if m.attr("bn", "training_mode", 0) != 0:
            return "BatchNormalization is in training mode"
        for out in bn.outputs[1:]:
            if out.uses() or out.is_graph_output():
                return "BatchNormalization's running statistics outputs are used"
    elif sum(1 for out in bn.outputs if out.name) > 1:
        # Before opset 14 the number of outputs selects training mode (batch statistics).
        return "BatchNormalization with more than one output is in training mode"
    if opset < 7 and m.attr("bn", "is_test", 0) != 1:
        return "BatchNormalization without is_test=1 is in training mode"
    if opset < 9 and m.attr("bn", "spatial", 1) != 1:
        return "BatchNormalization with spatial=0"
    params = [m.const(k) for k in ("scale", "beta", "mean", "var")]
    channels = params[0].size
    for name, p in zip(("scale", "beta", "mean", "var"), params):
        if p.ndim != 1 or p.size != channels:
            return f"BatchNormalization {name} has shape {p.shape}, expected ({channels},)"
        if p.dtype not in _FLOAT_DTYPES:
            return f"BatchNormalization {name} has type {p.dtype}"
    reason = non_finite({f"BatchNormalization {k}": p for k, p in zip(("scale", "beta", "mean", "var"), params)})
    if reason:
        return reason
    work = np.float64 if params[3].dtype == np.float64 else np.float32
    if np.any(params[3].astype(work) + work(m.attr("bn", "epsilon", 1e-5)) <= 0):
        return "BatchNormalization var + epsilon <= 0"
    # the per-channel factor scale / sqrt(var + eps) is what every fold multiplies by: where it rounds
    # to 0 from a nonzero scale, to a subnormal (flushed to 0 with denormals off) or to inf in the
    # parameters' type, the input would no longer count as it does in the BatchNormalization
    s, _ = _bn_factors(m)
    return unrepresentable("the BatchNormalization factor scale / sqrt(var + epsilon)", s, params[0].dtype)


def _bn_factors(m: Match) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (multiplier, offset) in float64: y = x * s + t."""
    eps = float(m.attr("bn", "epsilon", 1e-5))
    scale, beta, mean, var = (m.const(k).astype(np.float64) for k in ("scale", "beta", "mean", "var"))
    s = scale / np.sqrt(var + eps)
    return s, beta - mean * s


def _conv_condition(m: Match, out_channels_of) -> str | None:
    reason = _bn_inference(m)
    if reason:
        return reason
    w = m.const("w")
    if w.dtype not in _FLOAT_DTYPES:
        return f"weight type {w.dtype} is not a float type"
    if w.ndim < 3:
        return f"weight rank {w.ndim} < 3"
    out_channels = out_channels_of(m, w)
    channels = m.const("scale").size
    if out_channels != channels:
        return f"conv has {out_channels} output channels, BatchNormalization {channels}"
    bias = m.const("b")
    if bias is not None and bias.shape != (out_channels,):
        return f"bias has shape {bias.shape}, expected ({out_channels},)"
    return None


def conv_bn_fold_condition(m: Match):
    return _conv_condition(m, lambda m, w: w.shape[0])


def convtranspose_bn_fold_condition(m: Match):
    return _conv_condition(m, lambda m, w: w.shape[1] * int(m.attr("conv", "group", 1)))


def _new_bias(m: Match, s: np.ndarray, t: np.ndarray, dtype) -> np.ndarray:
    bias = m.const("b")
    return ((np.zeros_like(s) if bias is None else bias.astype(np.float64)) * s + t).astype(dtype)


def conv_bn_fold_replacement(m: Match, b):
    """The folded weights are computed the way onnxruntime's own ConvBNFusion computes them, step
    by step in the weights' type (float32, float64; float16 through float32 with a rounding per
    step): onnxruntime applies that fusion to the original model when it loads it, so the
    optimized model then runs bit-identical weights and gives bit-identical outputs there."""
    w = m.const("w")
    dtype = w.dtype
    work = np.float64 if dtype == np.float64 else np.float32

    def step(x):  # one operation's result, rounded to the tensor type
        return np.asarray(x, dtype=work).astype(dtype).astype(work)

    eps = step(np.float32(m.attr("bn", "epsilon", 1e-5)))
    scale, beta, mean, var = (m.const(k).astype(work) for k in ("scale", "beta", "mean", "var"))
    with np.errstate(over="ignore"):
        s = step(scale / step(np.sqrt(step(var + eps))))

    def fold():
        w_new = (w.astype(work, copy=False) * s.reshape((-1,) + (1,) * (w.ndim - 1))).astype(dtype)
        if "b" in m:
            return w_new, step(step(step(m.const("b").astype(work) - mean) * s) + beta)
        return w_new, step(beta - step(mean * s))

    w_new, bias_new = fold_weights(m, s, fold)
    conv = m.node("conv")
    weight = b.const(w_new, name=f"{m['w'].name}_bnfold")
    bias = b.const(bias_new.astype(dtype), name=f"{conv.name or 'conv'}_bias_bnfold")
    return b.op("Conv", m["x"], weight, bias, attrs=list(conv.attributes.values()))


def convtranspose_bn_fold_replacement(m: Match, b):
    s, t = _bn_factors(m)
    w = m.const("w")
    group = int(m.attr("conv", "group", 1))
    # Weight is (C_in, C_out / group, k...); output channel of (i, j) is (i // (C_in/group)) * C_out/group + j.
    cin, cout_g = w.shape[0], w.shape[1]

    def fold():
        grouped = w.astype(np.float64).reshape((group, cin // group, cout_g) + w.shape[2:])
        factor = s.reshape((group, 1, cout_g) + (1,) * (w.ndim - 2))
        return (grouped * factor).reshape(w.shape).astype(w.dtype), _new_bias(m, s, t, w.dtype)

    w_new, bias_new = fold_weights(m, s, fold)
    conv = m.node("conv")
    weight = b.const(w_new, name=f"{m['w'].name}_bnfold")
    bias = b.const(bias_new, name=f"{conv.name or 'convtranspose'}_bias_bnfold")
    return b.op("ConvTranspose", m["x"], weight, bias, attrs=list(conv.attributes.values()))


def bn_to_mul_add_condition(m: Match):
    reason = _bn_inference(m)
    if reason:
        return reason
    if m.opset("") < 7:
        return "Mul/Add before opset 7 broadcast only with the broadcast attribute"
    x = m["x"]
    producer = x.producer()
    if producer is not None and producer.op_type in ("Conv", "ConvTranspose") and producer.domain == "" \
            and len(x.uses()) == 1 and not x.is_graph_output():
        # Two kernels instead of one would be a loss; the BN stays for conv folding once the
        # conv's weights or bias become constant.
        return "follows a Conv that could absorb it"
    dims, dtype = m.dims("x"), m.dtype("x")
    if dims is None or dtype is None:
        return "input shape is unknown"
    if len(dims) < 2:
        return f"input rank {len(dims)} < 2"
    if dtype not in (ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BFLOAT16):
        return f"input type {dtype} is not a float type"
    if dims[1] is not None and dims[1] != m.const("scale").size:
        return f"input has {dims[1]} channels, parameters {m.const('scale').size}"
    return dtype, len(dims)  # the plan: x's type and rank


def bn_to_mul_add_replacement(m: Match, b):
    s, t = _bn_factors(m)
    dtype, rank = m.plan
    with np.errstate(over="ignore"):
        s, t = s.astype(dtype.numpy()), t.astype(dtype.numpy())
    if reason := non_finite({"the folded scale": s, "the folded shift": t}):
        raise Refuse(reason)
    shape = (-1,) + (1,) * (rank - 2)
    name = m.node("bn").name or "bn"
    scaled = b.op("Mul", m["x"], b.const(s.reshape(shape), name=f"{name}_scale"))
    return b.op("Add", scaled, b.const(t.reshape(shape), name=f"{name}_shift"))


def _bn(producer):
    return Op("BatchNormalization", producer, Const("scale"), Const("beta"), Const("mean"), Const("var"),
              name="bn")


RULES = [
    Rule("conv_bn_fold",
         _bn(Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv")),
         conv_bn_fold_replacement, condition=conv_bn_fold_condition, priority=10,
         exact=False, doc="Conv followed by inference BatchNormalization becomes one Conv (bias added if absent; "
             "grouped and depthwise too; finite parameters, a nonzero scale, folded weights in range)."),
    Rule("convtranspose_bn_fold",
         _bn(Op("ConvTranspose", "x", Const("w"), Opt(Const("b")), name="conv")),
         convtranspose_bn_fold_replacement, condition=convtranspose_bn_fold_condition, priority=10,
         exact=False,
         doc="ConvTranspose followed by inference BatchNormalization becomes one ConvTranspose (as conv_bn_fold)."),
    Rule("bn_to_mul_add",
         _bn("x"), bn_to_mul_add_replacement, condition=bn_to_mul_add_condition, priority=0,
         exact=False, doc="BatchNormalization after anything else becomes Mul and Add by per-channel constants (finite "
             "parameters and factors)."),
]
