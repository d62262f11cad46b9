"""Normalization fusions for onnxruntime (targets ort-cpu and ort-cuda; ``portable``'s standard
RMSNormalization at opset >= 23 is rules/standard_normalization.py's, on this pattern).

Matched by what the nodes compute. The patterns of ``layer_normalization`` and ``rms_normalization``
say the whole expression, rooted at its output (the division, the scale or the shift), from the pieces
of rules/_normalization_parts.py, and are tried at the Sqrt (``Around("sqrt", ...)``: the one node
every form has; the fused node is named after it and takes its place); their conditions read the
means' axes, the constants' values and the types:

- ``layer_normalization``: d = x - mean(x); d / sqrt(mean(d^2) + eps) (d^2 as Pow(d, 2) or d * d;
  the division as Div, or Mul by Reciprocal(Sqrt) or by Div(1, Sqrt)), optionally * gamma and
  + beta (constants along the last axis, either operand order), the means over the last axis
  -> LayerNormalization (opset >= 17).
- ``rms_normalization``: x / sqrt(mean(x^2) + eps) (the same forms; x not itself x' - mean(x'),
  the layer normalization's form), optionally * weight -> with the residual Add that computes x
  (the condition's choice, not the pattern's) com.microsoft SkipSimplifiedLayerNormalization, else
  the standard RMSNormalization where the model imports opset >= 23 and onnxruntime has the
  kernel; else refused (onnxruntime's SimplifiedLayerNormalization is registered in the ONNX domain
  without being an ONNX operator: onnx.checker refuses it). The float16 form with float32 statistics
  (transformers' LlamaRMSNorm exported in float16: x32 = Cast<float>(x16), x32 / sqrt(mean(x32^2) +
  eps) [* a float32 scale float16 holds exactly], Cast<float16>, [* a float16 weight]) fuses on the
  float16 input and weight, both Casts and the weight inside: onnxruntime's float16 kernels
  (SkipSimplifiedLayerNormalization, RMSNormalization; CPU and CUDA) take the statistics in float32,
  and the standard RMSNormalization's stash_type 1 (its default) is that very computation; the
  residual Add is then the float16 one before the Cast.
- ``skip_layer_normalization``: LayerNormalization(a + b [+ bias]) over the last axis, a and b of
  the shapes com.microsoft SkipLayerNormalization takes -> SkipLayerNormalization; where the sum
  is read elsewhere too (a pre-LN transformer's residual stream) its fourth output gives it.

Not exact (``exact=False``): the kernels accumulate in their own order; fp32 outputs agree within
1e-5 relative on the zoo models. In the float16 form the export rounds twice (the normalized value
to float16, then its product by the weight), onnxruntime's kernels compute in float32 and round the
output: outputs agree within float16 rounding (on onnxruntime CPU both within 2 ulps of a float64
reference, tests/rules/test_normalization.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Around, Const, Explain, Match, Op, Opt, Or, Rule, Var
from onnxopt.ir.shapes import infer
from onnxopt.targets import ORT_CPU, ORT_CUDA, PORTABLE

from onnxopt.rules._normalization_parts import (affine, centred, divided, not_centred, read_by_a_division,
                                                root_mean_square, scaled)
from onnxopt.rules._semantic import (FLOATS, const_array, dtype_of, kernel, private, producer, scalar, typed,
                        unrepresentable)

ORT = (ORT_CPU, ORT_CUDA)

# d = x - mean(x); d / sqrt(mean(d^2) + eps) [* gamma [+ beta]], rooted at its output, tried at the Sqrt
_LAYER_NORMALIZED = divided(Explain(centred("x", bind="d"), "no mean is subtracted (rms_normalization's form)"),
                            root_mean_square("d"))
LAYER_NORMALIZATION = Around("sqrt", read_by_a_division(Or(affine(_LAYER_NORMALIZED), scaled(_LAYER_NORMALIZED),
                                                            _LAYER_NORMALIZED)))
# x / sqrt(mean(x^2) + eps) [* weight]
_RMS_NORMALIZED = divided(not_centred("x"), root_mean_square("x"))
RMS_NORMALIZATION = Around("sqrt", read_by_a_division(Or(scaled(_RMS_NORMALIZED), _RMS_NORMALIZED)))


def _dims(value: ir.Value, m: Match) -> list | None:
    shape = infer(value, m.opsets)
    return None if shape is None else [d if isinstance(d, int) else d for d in shape]


def _axes(node: ir.Node, m: Match) -> list[int] | None:
    """The axes a ReduceMean reduces (None: all, or not known)."""
    if m.opset("") >= 18:
        if len(node.inputs) < 2 or node.inputs[1] is None:
            return None
        axes = const_array(node.inputs[1])
        return None if axes is None else [int(a) for a in axes.ravel()]
    attr = node.attributes.get("axes")
    return None if attr is None else [int(a) for a in attr.value]


def _last_axis_mean(node: ir.Node, rank: int | None, m: Match) -> str | None:
    if node.attributes.get("keepdims") is not None and node.attributes["keepdims"].value != 1:
        return "a mean does not keep its dimensions"
    axes = _axes(node, m)
    if axes is None:
        return "a mean's axes are not known"
    if axes == [-1] or (rank is not None and axes == [rank - 1]):
        return None
    return f"a mean is over axes {axes}, not the last one"


def _consumer(value: ir.Value, graph: ir.Graph) -> ir.Node | None:
    if not private(value, graph):
        return None
    node = next(iter(value.uses())).node
    return node if node.graph is graph and node.domain in ("", "ai.onnx") else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def _per_channel(array: np.ndarray, rank: int | None, h: int | None, what: str):
    """``array`` as a 1-D vector along the last axis of an input of ``rank`` dims and ``h`` channels."""
    if rank is None:
        return "the input's rank is unknown"
    if array.ndim > rank:
        return f"{what} has more dimensions than the input"
    if any(d != 1 for d in array.shape[:-1]):
        return f"{what} varies along another axis than the last"
    vec = array.reshape(-1)
    if vec.size == 1:
        if h is None:
            return f"{what} is one number and the last dimension is unknown"
        vec = np.full((h,), vec[0], dtype=array.dtype)
    elif h is not None and vec.size != h:
        return f"{what} has {vec.size} values, the last dimension is {h}"
    return vec


def norm_plan(m: Match, layer: bool):
    """(x, eps, gamma, beta, dtype) of a matched normalization, or the reason it cannot be fused:
    what the pattern leaves to it (the readers of the centred value, the means' axes, the scale's
    and shift's values, the epsilon, the types)."""
    x = m["x"]
    if layer:
        # the centred value goes with the rewrite: read by the square and the division alone
        d = m["d"]
        readers = {u.node for u in d.uses()}
        if d.is_graph_output() or readers - {m.node("square"), m.node("divide")}:
            return "the centred input is read elsewhere"
    dims = _dims(x, m)
    rank = None if dims is None else len(dims)
    for mean in ("mean_square", "mean") if layer else ("mean_square",):
        if reason := _last_axis_mean(m.node(mean), rank, m):
            return reason
    h = dims[-1] if dims and isinstance(dims[-1], int) else None
    gamma = beta = None
    if "gamma" in m:
        gamma = _per_channel(m.const("gamma"), rank, h, "the scale")
        if isinstance(gamma, str):
            return gamma
    if layer and "beta" in m:
        beta = _per_channel(m.const("beta"), rank, h, "the shift")
        if isinstance(beta, str):
            return beta
    if gamma is None and h is None:
        return "the last dimension is unknown (for a scale of ones)"
    eps = scalar(m["eps"]) if "eps" in m else 0.0
    if reason := unrepresentable("the epsilon", eps, np.float32):  # (the fused op's float attribute)
        return reason
    dtype = dtype_of(x, m.opsets)
    if dtype not in FLOATS:
        return f"the input's type {dtype} is not a float type"
    for vec in (gamma, beta):
        if vec is not None and vec.dtype != dtype.numpy():
            return "the scale or shift differs from the input in type"
    if gamma is None:
        gamma = np.ones((h,), dtype=dtype.numpy())
    return x, eps, gamma, beta, dtype


def _target(m: Match) -> str:
    return m.options.get("target", ORT_CPU)


def _layer_condition(m: Match):
    plan = norm_plan(m, layer=True)
    if isinstance(plan, str):
        return plan
    if m.opset("") < 17:
        return f"LayerNormalization needs opset 17 (the model imports {m.opset('')})"
    if kernel("LayerNormalization", "", m.opset(""), _target(m), plan[4]) is False and _target(m) == ORT_CPU:
        return f"no LayerNormalization kernel for {plan[4].name.lower()} on {_target(m)}"
    return plan


def _layer_replace(m: Match, b):
    x, eps, gamma, beta, _ = m.plan
    ins = [x, b.const(gamma, name="ln_scale")]
    if beta is not None:
        ins.append(b.const(beta, name="ln_bias"))
    return typed(b.op("LayerNormalization", *ins, axis=-1, epsilon=float(eps)), x, m)


def _upcast(m: Match, x: ir.Value, gamma: np.ndarray):
    """float16 statistics taken in float32 (transformers' LlamaRMSNorm of a float16 model:
    ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).half()``): where the normalized ``x``
    is a Cast to float of a float16 value and the result (after its float32 scale, if any) is read
    by a Cast back to float16 alone, ``(x16, gamma16)``: the fused op takes the float16 input and
    computes its statistics in float32 (onnxruntime's kernels for float16; the standard
    RMSNormalization's stash_type 1), and ``m.nodes`` and ``m.outputs`` take in both Casts and a
    float16 scale by a constant after them (where no float32 one came before). None where it is not
    that form; the reason where it is and cannot be fused so (then the float32 form is tried, as
    before, on the Cast's output; ``m`` untouched)."""
    up = producer(x, m.graph, "Cast", only_use=False)
    if up is None or up.attributes.get("to") is None or up.attributes["to"].value != ir.DataType.FLOAT:
        return None
    x16 = up.inputs[0]
    if dtype_of(x16, m.opsets) != ir.DataType.FLOAT16:
        return None
    down = _consumer(m.outputs[0], m.graph)
    if down is None or down.op_type != "Cast" or down.attributes.get("to") is None \
            or down.attributes["to"].value != ir.DataType.FLOAT16:
        return None
    if x.is_graph_output() or {u.node for u in x.uses()} - set(m.nodes):
        return "the float16 input's float32 copy is read elsewhere"
    with np.errstate(over="ignore"):
        gamma16 = gamma.astype(np.float16)
    if not np.array_equal(gamma16.astype(np.float32), gamma):
        return "the float32 scale is not exact in float16 (the fused op's scale has the input's type)"
    nodes, out = [up, down], down.outputs[0]
    weigh = _consumer(out, m.graph)
    if "gamma" not in m and weigh is not None and weigh.op_type == "Mul" and len(weigh.inputs) == 2:
        w = const_array(_other(weigh, out))
        dims = _dims(x16, m)
        vec = None if w is None else _per_channel(w, None if dims is None else len(dims), gamma.shape[0], "the weight")
        if isinstance(vec, np.ndarray) and vec.dtype == np.float16:
            gamma16, out = vec, weigh.outputs[0]
            nodes.append(weigh)
    m.nodes = tuple(dict.fromkeys((*m.nodes, *nodes)))
    m.outputs = [out]
    return x16, gamma16


def _rms_condition(m: Match):
    plan = norm_plan(m, layer=False)
    if isinstance(plan, str):
        return plan
    x, eps, gamma, _, dtype = plan
    upcast = _upcast(m, x, gamma)
    if isinstance(upcast, str):
        # the float32 form on the Cast's output, as before this form was known; its refusal says both
        # (no ": " inside, where the driver's report would keep only what follows it)
        plan = _rms_plan(m, x, eps, gamma, dtype)
        return f"{plan}; nor in float16 with float32 statistics, as {upcast}" if isinstance(plan, str) else plan
    if upcast is not None:
        (x, gamma), dtype = upcast, ir.DataType.FLOAT16
    return _rms_plan(m, x, eps, gamma, dtype)


def _rms_plan(m: Match, x: ir.Value, eps: float, gamma: np.ndarray, dtype: ir.DataType):
    """The fused form for the RMS normalization of ``x`` (its type ``dtype``), or the reason."""
    target, opset = _target(m), m.opset("")
    # portable: the standard op alone, where the installed onnxruntime (if any) runs it on the CPU
    portable = target == PORTABLE
    std = opset >= 23 and (kernel("RMSNormalization", "", opset, ORT_CPU, dtype) is not False if portable
                           else kernel("RMSNormalization", "", opset, target, dtype))
    # the residual Add before it makes com.microsoft SkipSimplifiedLayerNormalization (one kernel for
    # both); before opset 23 that is the only form: ONNX has no RMS normalization, and onnxruntime's
    # SimplifiedLayerNormalization is registered in the ONNX domain without being an ONNX operator
    # (onnx.checker refuses the model)
    add = None if portable else producer(x, m.graph, "Add", only_use=False)
    reason = None
    if add is not None:
        op = "SkipSimplifiedLayerNormalization"
        operands = _skip_operands(m, add.inputs[0], add.inputs[1], gamma.shape[0], op)
        if isinstance(operands, str):
            reason = f"the residual Add before it: {operands}"
        else:
            reason = _sum_read_on(m, x, m.root, set(m.nodes))
        if reason is None:
            a, skip, bias, bias_node = operands
            m.nodes = tuple(dict.fromkeys((*m.nodes, add) + ((bias_node,) if bias_node is not None else ())))
            return "skip", x, eps, gamma, a, skip, bias
        m.outputs = m.outputs[:1]
    if std:
        return "std", x, eps, gamma
    if opset >= 23:
        if portable:
            return f"the installed onnxruntime has no RMSNormalization kernel for {dtype.name.lower()}"
        return reason or f"no RMSNormalization kernel for {dtype.name.lower()} on {target}"
    if portable:
        return f"ONNX has no RMS normalization before opset 23 (the model imports {opset})"
    return reason or (f"ONNX has no RMS normalization before opset 23 (the model imports {opset}) and no "
                      "residual Add precedes it (onnxruntime's SimplifiedLayerNormalization is no ONNX operator)")


def _rms_replace(m: Match, b):
    form, x, eps, gamma = m.plan[:4]
    scale = b.const(gamma, name="rms_scale")
    if form == "std":
        return typed(b.op("RMSNormalization", x, scale, axis=-1, epsilon=float(eps)), x, m)
    a, skip, bias = m.plan[4:]
    ins = [a, skip, scale, bias]
    while ins[-1] is None:
        ins.pop()
    op = "SkipSimplifiedLayerNormalization"
    if len(m.outputs) == 2:
        y, _, _, total = b.op(op, *ins, domain="com.microsoft", outputs=4, epsilon=float(eps))
        return [typed(y, x, m), typed(total, x, m)]
    return typed(b.op(op, *ins, domain="com.microsoft", epsilon=float(eps)), x, m)


# --- SkipLayerNormalization ------------------------------------------------------------------


def _equal_dims(x, y) -> bool | None:
    """True: the same (equal sizes, or the same named symbol); False: different or one broadcasts;
    None: not known."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    if not isinstance(x, int) and not isinstance(y, int) and x is not None and y is not None \
            and getattr(x, "value", None) is not None and x.value == getattr(y, "value", None):
        return True
    if x == 1 or y == 1:  # one is 1 and the other unknown: it may broadcast
        return False
    return None


def _fits(inp, skip) -> bool:
    """SkipLayerNormalization takes ``inp`` as its input and ``skip`` as its skip: input (B, S, H)
    or (T, H); skip of the same shape, or (1, S, H) or (S, H) for a 3-D input. Each dimension must
    be proven equal (the same size, or the same named symbol): the kernel refuses a skip that would
    broadcast, where the Add it replaces did not (two differently named dynamic axes may differ)."""
    if len(inp) not in (2, 3):
        return False
    if len(skip) != len(inp) and not (len(inp) == 3 and len(skip) == 2):
        return False
    for i in range(1, len(skip) + 1):
        if i == 3 and skip[-i] == 1:
            continue  # (1, S, H): broadcast over the batch
        if _equal_dims(inp[-i], skip[-i]) is not True:
            return False
    return True


def _skip_condition(m: Match):
    ln, add = m.node("ln"), m.node("add")
    for out in ln.outputs[1:]:
        if out.uses() or out.is_graph_output():
            return "the normalization's mean or inverse deviation outputs are used"
    if m.attr("ln", "stash_type", 1) != 1:
        return "stash_type 0 (statistics in the input's type)"
    total = add.outputs[0]
    ranks = [len(d) for d in (_dims(m["a"], m), _dims(m["b"], m)) if d is not None]
    rank = max(ranks) if ranks else None
    axis = m.attr("ln", "axis", -1)
    if axis != -1 and (rank is None or axis != rank - 1):
        return f"normalizes from axis {axis}, not the last"
    gamma, beta = m.const("gamma"), m.const("beta")
    for what, p in (("scale", gamma), ("shift", beta)):
        if p is not None and (p.ndim != 1 or p.shape[0] != gamma.shape[0]):
            return f"the normalization's {what} is not 1-D along the last axis"
    op = "SkipLayerNormalization" if m.root.op_type == "LayerNormalization" else "SkipSimplifiedLayerNormalization"
    operands = _skip_operands(m, m["a"], m["b"], gamma.shape[0], op)
    if isinstance(operands, str):
        return operands
    a, b_, bias, bias_node = operands
    if reason := _sum_read_on(m, total, ln, {ln}):
        return reason
    if bias_node is not None:
        m.nodes = tuple(dict.fromkeys((*m.nodes, bias_node)))
    return a, b_, bias


def _skip_operands(m: Match, a: ir.Value, b_: ir.Value, h: int, op: str):
    """(input, skip, bias or None, the bias's Add or None) of ``op`` (Skip[Simplified]LayerNormalization)
    for the sum a + b normalized over ``h`` channels, or the reason it cannot take them."""
    graph, bias, bias_node = m.graph, None, None
    # a bias added to one operand first: (a + bias) + b
    for first, second in ((a, b_), (b_, a)):
        inner = producer(first, graph, "Add")
        if inner is None:
            continue
        for i in (0, 1):
            arr = const_array(inner.inputs[i])
            if arr is not None and arr.ndim == 1 and arr.shape[0] == h \
                    and constant_free(inner.inputs[1 - i]):
                bias, bias_node = inner.inputs[i], inner
                a, b_ = inner.inputs[1 - i], second
                break
        if bias is not None:
            break
    da, db = _dims(a, m), _dims(b_, m)
    if da is None or db is None:
        return "an operand's rank is unknown"
    if not _fits(da, db):
        a, b_, da, db = b_, a, db, da
        if not _fits(da, db):
            return "the operands broadcast in a way the fused op does not take"
    if isinstance(da[-1], int) and da[-1] != h:
        return f"the normalization's scale has {h} values, the last dimension is {da[-1]}"
    dtype = dtype_of(a, m.opsets)
    if dtype not in FLOATS or dtype_of(b_, m.opsets) != dtype:
        return "the operands are not of one float type"
    target = _target(m)
    if kernel(op, "com.microsoft", 1, target, dtype) is False and target == ORT_CPU:
        return f"no {op} kernel for {dtype.name.lower()} on {target}"
    return a, b_, bias, bias_node


def _sum_read_on(m: Match, total: ir.Value, root: ir.Node, fused: set) -> str | None:
    """Where the sum is read by other nodes than ``fused`` (a pre-norm transformer's residual stream),
    the fused node's fourth output gives it (``m.outputs`` gets it), and it must be computed before
    its first reader (the new node goes where ``root`` is); the reason when it is not."""
    readers = {u.node for u in total.uses()} - fused
    if total.is_graph_output() or readers:
        before = set()
        for node in m.graph:
            if node is root:
                break
            before.add(node)
        if readers & before:
            return "the sum is read before the normalization"
        m.outputs = [m.outputs[0] if getattr(m, "outputs", None) else root.outputs[0], total]
    return None


def constant_free(value) -> bool:
    return const_array(value) is None


def _skip_replace(m: Match, b):
    a, skip, bias = m.plan
    gamma = m["gamma"]
    beta = m["beta"]
    eps = float(m.attr("ln", "epsilon", 1e-5))
    if m.root.op_type == "LayerNormalization":
        op, ins = "SkipLayerNormalization", [a, skip, gamma, beta, bias]
    else:
        op, ins = "SkipSimplifiedLayerNormalization", [a, skip, gamma, bias]
    while ins[-1] is None:
        ins.pop()
    if len(getattr(m, "outputs", ())) == 2:
        y, _, _, total = b.op(op, *ins, domain="com.microsoft", outputs=4, epsilon=eps)
        typed(y, a, m)
        typed(total, a, m)
        return [y, total]
    return typed(b.op(op, *ins, domain="com.microsoft", epsilon=eps), a, m)


# --- a scale or shift after the fused node (an exporter's Cast between them went later) --------------


def _fold_condition(m: Match):
    norm, graph = m.root, m.graph
    skip = norm.op_type == "SkipSimplifiedLayerNormalization"
    # (a Skip normalization's fourth output, input + skip, does not change: it may be read on)
    for out in norm.outputs[1:3] if skip else norm.outputs[1:]:
        if out.uses() or out.is_graph_output():
            return "the normalization's statistics outputs are used"
    dims = _dims(m["x"], m)
    rank = None if dims is None else len(dims)
    axis = m.attr("norm", "axis", -1)
    if axis != -1 and (rank is None or axis != rank - 1):
        return f"normalizes from axis {axis}, not the last"
    scale = m.const("scale")
    if scale.ndim != 1:
        return "the scale is not 1-D"
    layer = norm.op_type == "LayerNormalization"
    nxt = _consumer(norm.outputs[0], graph)
    if nxt is None or nxt.op_type not in (("Mul", "Add") if layer else ("Mul",)) or len(nxt.inputs) != 2:
        return "not followed by a Mul (or Add) by a constant"
    c = const_array(_other(nxt, norm.outputs[0]))
    if c is None:
        return "not followed by a Mul (or Add) by a constant"
    vec = _per_channel(c, rank, scale.shape[0], "the constant")
    if isinstance(vec, str):
        return vec
    if vec.dtype != scale.dtype:
        return "the constant differs from the scale in type"
    bias = m.const("bias") if layer else None
    with np.errstate(over="ignore", invalid="ignore"):
        if nxt.op_type == "Mul":
            new_scale = (scale.astype(np.float64) * vec).astype(scale.dtype)
            new_bias = None if bias is None else (bias.astype(np.float64) * vec).astype(scale.dtype)
        else:
            new_scale = scale
            new_bias = ((0 if bias is None else bias.astype(np.float64)) + vec.astype(np.float64)).astype(scale.dtype)
    if not all(np.all(np.isfinite(a)) for a in (new_scale, new_bias) if a is not None):
        return "the folded constants overflow"
    # a scale that rounds to 0 or to a subnormal loses the input (a subnormal is flushed to 0 where
    # the kernel runs with denormals off); a shift is added, so only its overflow matters
    if nxt.op_type == "Mul" and (reason := unrepresentable("the folded scale", scale.astype(np.float64) * vec,
                                                            scale.dtype)):
        return reason
    m.nodes = tuple(dict.fromkeys((*m.nodes, nxt)))
    m.outputs = [nxt.outputs[0]]
    if skip and len(norm.outputs) > 3 and (norm.outputs[3].uses() or norm.outputs[3].is_graph_output()):
        m.outputs.append(norm.outputs[3])
    return new_scale, new_bias


def _fold_replace(m: Match, b):
    new_scale, new_bias = m.plan
    norm = m.root
    if norm.op_type == "SkipSimplifiedLayerNormalization":  # (input, skip, gamma[, bias]): the gamma replaced
        ins = list(norm.inputs)
        ins[2] = b.const(new_scale, name="norm_scale")
        outs = b.op(norm.op_type, *ins, domain=norm.domain, outputs=len(norm.outputs),
                    attrs=list(norm.attributes.values()))
        outs = outs if isinstance(outs, tuple) else (outs,)
        y = typed(outs[0], m["x"], m)
        if len(m.outputs) > 1:
            outs[3].type, outs[3].shape = norm.outputs[3].type, norm.outputs[3].shape
            return y, outs[3]
        return y
    ins = [m["x"], b.const(new_scale, name="norm_scale")]
    if new_bias is not None:
        ins.append(b.const(new_bias, name="norm_bias"))
    return typed(b.op(norm.op_type, *ins, domain=norm.domain, attrs=list(norm.attributes.values())), m["x"], m)


RULES = [
    Rule("layer_normalization", LAYER_NORMALIZATION, _layer_replace, condition=_layer_condition, targets=ORT,
         benefit="layer_normalization", exact=False,
         doc="(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* gamma] [+ beta] over the last axis becomes "
             "LayerNormalization (opset >= 17)."),
    Rule("rms_normalization", RMS_NORMALIZATION, _rms_replace, condition=_rms_condition, targets=ORT,
         benefit="rms_normalization", exact=False,
         doc="x / sqrt(mean(x^2) + eps) [* weight] over the last axis becomes RMSNormalization (opset >= 23 with "
             "onnxruntime's kernel), or with the residual Add before it com.microsoft "
             "SkipSimplifiedLayerNormalization; a float16 input cast to float32 for it and the result cast back "
             "(then weighted in float16) fuses in float16 (the kernels' statistics are float32)."),
    Rule("skip_layer_normalization",
         Op("LayerNormalization", Op("Add", "a", "b", name="add", shared=True), Const("gamma"), Opt(Const("beta")),
            name="ln"),
         _skip_replace, condition=_skip_condition, targets=ORT, benefit="skip_layer_normalization", exact=False,
         doc="LayerNormalization over the last axis of a + b (+ a 1-D bias) becomes com.microsoft "
             "SkipLayerNormalization; its fourth output gives the sum where the sum is read elsewhere."),
    Rule("skip_simplified_layer_normalization",
         Op("SimplifiedLayerNormalization", Op("Add", "a", "b", name="add", shared=True), Const("gamma"),
            Opt(Const("beta")), name="ln"),
         _skip_replace, condition=_skip_condition, targets=ORT, benefit="skip_layer_normalization", exact=False,
         doc="onnxruntime's SimplifiedLayerNormalization (RMS) over the last axis of a + b (+ a 1-D bias) becomes "
             "com.microsoft SkipSimplifiedLayerNormalization (fourth output as skip_layer_normalization's)."),
    Rule("layer_normalization_affine_fold",
         Op("LayerNormalization", "x", Const("scale"), Opt(Const("bias")), name="norm"),
         _fold_replace, condition=_fold_condition, targets=ORT, benefit="layer_normalization", exact=False,
         doc="LayerNormalization followed by a Mul or Add by a constant along the last axis takes it into its "
             "scale and bias."),
    Rule("rms_normalization_scale_fold", Op("SimplifiedLayerNormalization", "x", Const("scale"), name="norm"),
         _fold_replace, condition=_fold_condition, targets=ORT, benefit="rms_normalization", exact=False,
         doc="SimplifiedLayerNormalization followed by a Mul by a constant along the last axis takes it into its "
             "scale."),
    Rule("skip_simplified_layer_normalization_scale_fold",
         Op("SkipSimplifiedLayerNormalization", "x", "skip", Const("scale"), Opt(Var("skip_bias")), domain="com.microsoft",
            name="norm"),
         _fold_replace, condition=_fold_condition, targets=ORT, benefit="rms_normalization", exact=False,
         doc="com.microsoft SkipSimplifiedLayerNormalization followed by a Mul by a constant along the last axis "
             "takes it into its gamma (the exporters' RMSNorm weight Mul, left outside where a Cast stood between "
             "it and the normalization when that was fused); its input + skip output is unchanged."),
    Rule("rms_normalization_std_scale_fold", Op("RMSNormalization", "x", Const("scale"), name="norm"),
         _fold_replace, condition=_fold_condition, targets=ORT, benefit="rms_normalization", exact=False,
         doc="RMSNormalization followed by a Mul by a constant along the last axis takes it into its scale."),
]
