"""A Conv absorbs what follows or precedes it: a per-output-channel Mul or Add, a zero Pad.

conv_mul_fold and conv_add_fold are exact up to rounding: they move a constant into the Conv's
weights or bias, as onnxruntime's own Conv fusions do, so results round differently (and one
within rounding of the type's largest value may overflow in one model only); they refuse where
folding could change more than rounding (see rules/_weights.py). The Pad merges are exact. In exact
mode's sense (``Rule.exact``) only pad_into_averagepool is: with its graph optimizations on,
onnxruntime's padded Conv skips the padding a Pad + Conv multiplies (an infinite weight then gives
NaN in one model only).
"""

from __future__ import annotations

import numpy as np

from onnxopt.core.pattern import Const, Match, Op, Opt, Refuse, Rule

from onnxopt.rules._weights import fold_weights, folded_refusal, non_finite


def _per_channel(c: np.ndarray, out_channels: int, rank: int) -> np.ndarray | None:
    """c as a vector over the output channels, if it broadcasts along channels only."""
    if c.ndim > rank:
        return None
    shape = (1,) * (rank - c.ndim) + c.shape
    if shape[0] != 1 or any(s != 1 for s in shape[2:]) or shape[1] not in (1, out_channels):
        return None
    return np.broadcast_to(c.reshape(-1), (out_channels,)).copy()


def conv_constant_condition(m: Match):
    """The plan: the constant as a float64 vector over the Conv's output channels."""
    w = m.const("w")
    if w.dtype.kind != "f":
        return "not a float conv"
    if m.const("c").dtype != w.dtype:
        return "type"
    vector = _per_channel(m.const("c"), w.shape[0], w.ndim)
    if vector is None:
        return "the constant is not per output channel"
    return non_finite({f"the {m.root.op_type} constant": vector, "the bias": m.const("b")}) or vector.astype(np.float64)


def conv_mul_fold_replacement(m: Match, b):
    w, bias, factor = m.const("w"), m.const("b"), m.plan

    def fold():
        new_w = (w.astype(np.float64) * factor.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        return new_w, None if bias is None else (bias.astype(np.float64) * factor).astype(w.dtype)

    new_w, new_b = fold_weights(m, factor, fold, bias_scaled=True)
    inputs = [m["x"], b.const(new_w, name="weight")]
    if new_b is not None:
        inputs.append(b.const(new_b, name="bias"))
    return b.op("Conv", *inputs, attrs=m.node("conv").attributes.values())


def conv_add_fold_replacement(m: Match, b):
    w, bias = m.const("w"), m.const("b")
    with np.errstate(over="ignore"):
        new_b = ((np.zeros(w.shape[0]) if bias is None else bias.astype(np.float64)) + m.plan).astype(w.dtype)
    if reason := folded_refusal("bias", new_b):
        raise Refuse(reason)
    return b.op("Conv", m["x"], m["w"], b.const(new_b, name="bias"), attrs=m.node("conv").attributes.values())


# --- Pad --------------------------------------------------------------------------------------------


def _pool_output_size(n: int, kernel: int, stride: int, dilation: int, ceil: bool, head: int, tail: int) -> int:
    """An AveragePool output length as onnxruntime and the ONNX spec compute it: with ceil_mode a
    window that would start in the right padding is dropped (PyTorch's rule)."""
    span = n + head + tail - dilation * (kernel - 1) - 1
    size = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (size - 1) * stride >= n + head:
        size -= 1
    return size


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


def pad_into_condition(m: Match):
    """The plan: the op's pads with the Pad's merged in. A zero Pad merges into the op's pads when
    the op then sees the same input positions, the padding counts like the Pad's zeros, and the
    output keeps its shape:

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
    op = m.node("op").op_type
    if op == "Conv":
        return new
    if op == "AveragePool" and m.attr("op", "count_include_pad", 0) != 1:
        return "AveragePool excludes padding from the average"
    if op == "MaxPool":
        why = _maxpool_zero_pad_is_its_own(m)
        if why:
            return why
    k = n - 2
    kernel = m.attr("op", "kernel_shape") or []
    if len(kernel) != k:
        return "kernel_shape does not match the Pad's rank"
    if any(p >= kernel[i % k] for i, p in enumerate(new)):
        return "a merged pad would reach the kernel size (onnxruntime requires pads smaller than the kernel)"
    if ceil and any(pads[n + 2:]):
        dims = m.dims("x")
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
    return new


def _maxpool_zero_pad_is_its_own(m: Match) -> str | None:
    """MaxPool pads with -inf, a Pad with 0: the same maximum when every window keeps a real element
    (each pad below the kernel, no dilation) and the real elements are >= 0 (x is a Relu's output).
    Not exact: where a window's elements are all -0.0 the Pad's +0.0 may win the maximum, and NaN
    meets a 0 instead of -inf. The Indices output (positions in the padded input) must be unread."""
    producer = m["x"].producer()
    if producer is None or producer.op_type != "Relu" or producer.domain not in ("", "ai.onnx"):
        return "x is not a Relu's output (a zero pad is not -inf padding for negative values)"
    node = m.node("op")
    if len(node.outputs) > 1 and node.outputs[1] is not None and (node.outputs[1].uses()
                                                                 or node.outputs[1].is_graph_output()):
        return "the Indices output is read"
    if any(int(d) != 1 for d in (m.attr("op", "dilations") or [])):
        return "dilated MaxPool"
    return None


def pad_into_replacement(m: Match, b):
    node = m.node("op")
    attrs = [a for a in node.attributes.values() if a.name not in ("pads", "auto_pad")]
    return b.op(node.op_type, m["x"], *node.inputs[1:], attrs=attrs, pads=m.plan)


_ZERO_PAD = Op("Pad", "x", Const("pads"), Opt(Const("value")), Opt("axes"), name="pad")

RULES = [
    Rule("conv_mul_fold", Op("Mul", Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv"), Const("c"),
                             commutative=True), conv_mul_fold_replacement, condition=conv_constant_condition,
         exact=False,
         doc="Conv followed by Mul by a per-output-channel constant scales the weights and bias (not for a "
             "zero or non-finite factor, non-finite weights, or folded weights or bias that overflow, flush to 0 or "
             "become subnormal)."),
    Rule("conv_add_fold", Op("Add", Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv"), Const("c"),
                             commutative=True), conv_add_fold_replacement, condition=conv_constant_condition,
         exact=False, doc="Conv followed by Add of a per-output-channel constant adds it to the bias (finite constants "
             "whose sum stays finite)."),
    Rule("pad_into_conv", Op("Conv", _ZERO_PAD, "w", Opt("b"), name="op"), pad_into_replacement,
         condition=pad_into_condition,
         exact=False, doc="Zero Pad of spatial axes before a Conv (auto_pad NOTSET or VALID) becomes the Conv's pads."),
    Rule("pad_into_maxpool", Op("MaxPool", _ZERO_PAD, name="op"), pad_into_replacement,
         condition=pad_into_condition,
         exact=False, doc="Zero Pad of a Relu's output before a MaxPool becomes its pads (each below the kernel, no "
             "dilation, Indices unread): every window keeps an element >= 0, so -inf padding takes the same "
             "maximum (a Keras ResNet's ZeroPadding2D before its stem pool)."),
    Rule("pad_into_averagepool", Op("AveragePool", _ZERO_PAD, name="op"), pad_into_replacement,
         condition=pad_into_condition,
         exact=True, doc="Zero Pad before an AveragePool with count_include_pad=1 becomes its pads (each below the "
             "kernel size; under ceil_mode only where the output size stays)."),
]
