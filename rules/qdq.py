"""QDQ placement: the rewrites that turn a float model into onnxruntime's QDQ form, following a
quantization plan (``onnxopt.quantize.plan.QuantPlan``, read from ``m.options["quant_plan"]``).

Not in the default optimize pipeline (``RULES`` is empty): ``onnxopt.quantize.plan.apply_plan``
runs ``QDQ_RULES`` with the plan, after putting Q/DQ pairs behind the graph inputs the plan
quantizes, and gives each DequantizeLinear one reader at the end.

- qdq_quantize_output: a value the plan quantizes gets QuantizeLinear -> DequantizeLinear right
  after its producer, with the plan's scale and zero point; every reader reads the DQ (a graph
  output becomes the DQ's output under its own name).
- qdq_conv_weights / qdq_matmul_weights / qdq_gemm_weights: a planned Conv, MatMul or Gemm whose
  activation comes through a DQ gets int8 symmetric weights (per output channel: Conv axis 0,
  MatMul [K,N] axis 1, Gemm axis 0 with transB else 1) and an int32 bias with scale s_x*s_w and zero
  point 0, each behind a DequantizeLinear; no float copy is kept. Gemm's alpha and beta are folded
  in (alpha=beta=1, which onnxruntime's QGemm fusion needs).
- qdq_constant_operand: a planned Add/Mul/Where's constant float operand becomes a uint8
  initializer behind a DQ (on its own range), as onnxruntime's binary QLinear kernels need.
- qdq_div_constant: a planned Div by a constant becomes a Mul by its float32 reciprocal (then
  qdq_mul_constant_operand quantizes that operand): QLinearMul has no Div sibling.
- qdq_relu_absorb / qdq_clip_absorb (exact): Relu(DQ(q)) where the zero point is the lowest level
  is DQ(q); Clip(DQ(q)) where every representable value lies inside the bounds is DQ(q).
- qdq_requantize_identity (exact): Q(DQ(q)) with the same scale, zero point and type is q.

The plan gives a Relu's input the Relu's output parameters, so that after qdq_quantize_output the
Relu sits between a DQ with zero point 0 and a Q of the same parameters: the last two rules remove
it and the now redundant pair, and the Conv's output is quantized with the Relu output's params.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.ir.util import constant_tensor, subgraphs, use_count
from onnxopt.core.pattern import Const, Match, Namer, Op, Opt, Rule, forward
from onnxopt.rules._semantic import unrepresentable

_INT32 = np.iinfo(np.int32)


def activation_params(lo: float, hi: float) -> tuple[np.float32, np.uint8]:
    """uint8 asymmetric (scale, zero point) for the range [lo, hi] extended to contain 0:
    scale = (hi - lo) / 255 (1.0 for an all-zero range), zero point round(-lo / scale) in [0, 255]."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo <= 0:
        return np.float32(1.0), np.uint8(0)
    scale = np.float32((hi - lo) / 255.0)
    if not np.isfinite(scale) or scale <= 0:
        scale = np.float32(np.finfo(np.float32).tiny)
    zp = int(np.clip(np.round(-lo / float(scale)), 0, 255))
    return scale, np.uint8(zp)


PLAN_KEY = "quantize.plan_node"  # node metadata apply_plan sets for the run (rewritten nodes inherit it)


def _base(node: ir.Node) -> str:
    """The plan's name for the node a rewritten node derives from."""
    return node.metadata_props.get(PLAN_KEY, "")


def _plan(m: Match):
    return m.options.get("quant_plan")


def options_for(model: ir.Model, plan) -> dict:
    """What the rules look up, derived once from the plan: the planned outputs by (producer's plan
    key, output index), and the planned nodes. Nodes carry their plan key in their metadata
    (``PLAN_KEY``, set by apply_plan), which the nodes a rule makes inherit."""
    outputs = {}
    for node in model.graph:
        for i, value in enumerate(node.outputs):
            if value is not None and value.name in plan.params and _base(node):
                outputs[(_base(node), i)] = plan.params[value.name]
    return {"quant_outputs": outputs, "quant_nodes": frozenset(plan.nodes)}


def _qdq(b, x: ir.Value, scale, zero_point, hint: str) -> ir.Value:
    s = b.const(np.array(scale, dtype=np.float32), name=f"{hint}_scale")
    z = b.const(np.array(zero_point, dtype=np.uint8), name=f"{hint}_zero_point")
    return b.op("DequantizeLinear", b.op("QuantizeLinear", x, s, z), s, z)


# --- Q/DQ after planned values ------------------------------------------------------------------


def _has_q(value: ir.Value, params) -> bool:
    """``value`` is already read by exactly one QuantizeLinear with these parameters."""
    if value.is_graph_output() or use_count(value) != 1:
        return False
    reader, slot = next(iter(value.uses()))
    if reader.op_type != "QuantizeLinear" or slot != 0 or len(reader.inputs) < 3:
        return False
    s, z = (v.const_value for v in reader.inputs[1:3])
    return (s is not None and z is not None and s.numpy().size == 1
            and np.float32(s.numpy().reshape(-1)[0]) == np.float32(params[0])
            and z.numpy().dtype == np.uint8 and int(z.numpy().reshape(-1)[0]) == int(params[1]))


def quantize_output_condition(m: Match):
    node = m.root
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        return "a Q/DQ node"
    table = m.options.get("quant_outputs")
    if not table:
        return "no quantization plan"
    base = _base(node)
    todo = [(i, table[(base, i)]) for i, v in enumerate(node.outputs)
            if v is not None and (base, i) in table and not _has_q(v, table[(base, i)])]
    if not todo:
        return "no planned output left to quantize"
    if any(True for _ in subgraphs(node)):
        return "a node with subgraphs"
    return todo


def quantize_output_replacement(m: Match, b):
    node = m.root
    made = b.op(node.op_type, *node.inputs, domain=node.domain, outputs=len(node.outputs),
                attrs=list(node.attributes.values()), overload=node.overload)
    outs = [made] if len(node.outputs) == 1 else list(made)
    for i, (scale, zp) in m.plan:
        outs[i] = _qdq(b, outs[i], scale, zp, (node.name or node.op_type).split("::")[0])
    return outs


# --- Weights ------------------------------------------------------------------------------------


def quantize_weights(w: np.ndarray, axis: int | None, qmax: int, x_scale: np.float32,
                     bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """int8 symmetric weights (per ``axis``, or per tensor), their float32 scales, and the int32
    bias with scale x_scale * w_scale (float32 product) and its scale. A channel's scale is raised
    where its bias would not fit int32; an all-zero channel gets scale 1."""
    w64 = w.astype(np.float64)
    if axis is None:
        absmax = np.array(np.abs(w64).max() if w64.size else 0.0)
    else:
        others = tuple(a for a in range(w.ndim) if a != axis)
        absmax = np.abs(w64).max(axis=others) if w64.size else np.zeros(w.shape[axis])
    scale = absmax / qmax
    if bias is not None:
        bmax = np.abs(bias.astype(np.float64)) if axis is not None else np.array(np.abs(bias.astype(np.float64)).max(initial=0.0))
        scale = np.maximum(scale, bmax / (float(x_scale) * float(_INT32.max // 2)))
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    wq = np.clip(np.round(w64 / scale.astype(np.float64).reshape(shape)), -qmax, qmax).astype(np.int8)
    if bias is None:
        return wq, scale, None, None
    bscale = (np.float32(x_scale) * scale).astype(np.float32)
    bq = np.clip(np.round(bias.astype(np.float64) / bscale.astype(np.float64)), _INT32.min, _INT32.max).astype(np.int32)
    return wq, scale, bq, bscale


def out_of_range(reason: str) -> bool:
    """Whether a refusal of these rules is one of a scale or constant out of float32's (or the bias's
    int32) range (``unrepresentable``'s wording): apply_plan reports those, a planned node left float."""
    return " in float32 (" in reason or "does not fit int32" in reason


def scale_refusal(x_scale, w_scale: np.ndarray, bias: np.ndarray | None, bias_scale: np.ndarray | None) -> str | None:
    """Why quantize_weights' result must not be written, else None: a scale float32 cannot hold
    (``unrepresentable``: inf, 0 or subnormal) -- the activation's, the weights', or the int32
    bias's x_scale * w_scale (0 there dequantizes every bias to 0) -- or a bias that does not fit
    int32 at its scale (it would be clipped)."""
    if np.any(w_scale == 0):  # (quantize_weights gives an all-zero channel scale 1: this one rounded to 0)
        return "the weight scale rounds to 0 in float32 (the weights are below 127 times its smallest number)"
    why = unrepresentable("the activation scale", float(x_scale)) or unrepresentable("the weight scale", w_scale)
    if why is None and bias is not None:
        why = unrepresentable("the bias scale (activation scale x weight scale)",
                              float(x_scale) * w_scale.astype(np.float64))
        if why is None and not np.all(np.abs(bias.astype(np.float64) / bias_scale.astype(np.float64)) <= _INT32.max):
            why = "the bias does not fit int32 at its scale (activation scale x weight scale)"
    return why


def _dq_const(b, q: np.ndarray, scale: np.ndarray, axis: int | None, hint: str) -> ir.Value:
    zp = np.zeros(scale.shape, dtype=q.dtype)
    attrs = {} if axis is None or scale.ndim == 0 else {"axis": axis}
    return b.op("DequantizeLinear", b.const(q, name=f"{hint}_quantized"), b.const(scale, name=f"{hint}_scale"),
                b.const(zp, name=f"{hint}_zero_point"), **attrs)


def quantized_weights(node: ir.Node, x_scale, per_channel: bool, qmax: int):
    """The planned Conv/MatMul/Gemm ``node``'s int8 weights at activation scale ``x_scale``: (int8
    weight, scale, axis, int32 bias, bias scale, attributes to set), or the reason it cannot have
    them. make_plan asks too (a node refused here is left float by the plan, its output with no
    Q: given DequantizeLinear -> Conv with float weights -> QuantizeLinear, onnxruntime quantizes
    the weights itself, with the same scales)."""
    op = node.op_type

    def const(i):
        t = constant_tensor(node.inputs[i]) if i < len(node.inputs) else None
        return None if t is None else t.numpy()

    def attr(name, default):
        a = node.attributes.get(name)
        return default if a is None else a.value

    w = const(1)
    if w is None:
        return "weight is not a constant"
    if w.dtype != np.float32:
        return "weight is not float32"
    bias = const(2) if op != "MatMul" else None
    if op != "MatMul" and len(node.inputs) > 2 and node.inputs[2] is not None and bias is None:
        return "bias is not a constant"
    attrs = {}
    if op == "Gemm":
        alpha, beta = float(attr("alpha", 1.0)), float(attr("beta", 1.0))
        trans_b = int(attr("transB", 0))
        if int(attr("transA", 0)):
            return "Gemm with transA"
        n = w.shape[0] if trans_b else w.shape[1]
        # folded in float64, quantized from there: rounded to float32 first, a tiny alpha made whole
        # channels 0 (then given scale 1: the channel's output lost), which the scales' checks below
        # cannot see; alpha * w outside float32's range shows in the weight scale
        w = w.astype(np.float64) * alpha
        if bias is not None:
            if bias.size not in (1, n):
                return "Gemm bias is not per output channel"
            bias = np.broadcast_to((bias.astype(np.float64) * beta).reshape(-1), (n,))
        axis = 0 if trans_b else 1
        attrs = {"alpha": 1.0, "beta": 1.0}
    elif op == "Conv":
        axis = 0
    else:
        if w.ndim != 2:
            return "weight is not 2-D"
        axis = 1
    if not np.all(np.isfinite(w)) or (bias is not None and not np.all(np.isfinite(bias))):
        return "non-finite weights"
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        wq, ws, bq, bs = quantize_weights(w, axis if per_channel else None, qmax, np.float32(x_scale), bias)
    # a scale that overflowed to inf (DequantizeLinear gives NaN: 0 * inf), or underflowed to 0 or a
    # subnormal (values near float32's limits): the node stays float, with the reason
    if (why := scale_refusal(x_scale, ws, bias, bs)) is not None:
        return why
    return wq, ws, axis if per_channel else None, bq, bs, attrs


def weights_condition(m: Match):
    """The plan: (int8 weight, scale, axis, int32 bias, bias scale, attributes to set)."""
    plan = _plan(m)
    if plan is None or _base(m.root) not in m.options.get("quant_nodes", ()):
        return "not planned"
    xs = m.const("xs")
    if xs.size != 1 or xs.dtype != np.float32:
        return "activation scale is not a float32 scalar"
    return quantized_weights(m.root, xs.reshape(-1)[0], plan.rules.per_channel, plan.rules.weight_qmax)


def weights_replacement(m: Match, b):
    wq, ws, axis, bq, bs, attrs = m.plan
    node = m.root
    hint = (node.name or node.op_type).split("::")[0]
    inputs = [node.inputs[0], _dq_const(b, wq, ws, axis, f"{hint}_weight")]
    if bq is not None:
        inputs.append(_dq_const(b, bq, bs, 0 if axis is not None else None, f"{hint}_bias"))
    kept = [a for a in node.attributes.values() if a.name not in attrs]
    return b.op(node.op_type, *inputs, attrs=kept, **attrs)


_DQX = Op("DequantizeLinear", "xq", Const("xs"), Opt(Const("xz")), shared=True, name="dqx")


# --- Constant operands of binary ops ------------------------------------------------------------


def constant_operand_condition(m: Match):
    """The plan: {input slot: (uint8 tensor, scale, zero point)} for each constant float operand."""
    if _plan(m) is None or _base(m.root) not in m.options.get("quant_nodes", ()):
        return "not planned"
    slots = (1, 2) if m.root.op_type == "Where" else (0, 1)
    todo = {}
    for i in slots:
        t = constant_tensor(m.root.inputs[i]) if i < len(m.root.inputs) else None
        if t is None or t.dtype != ir.DataType.FLOAT:
            continue
        c = t.numpy()
        if c.size == 0 or not np.all(np.isfinite(c)):
            return "constant operand is empty or not finite"
        lo, hi = min(float(c.min()), 0.0), max(float(c.max()), 0.0)
        # (activation_params gives float32's smallest normal for a scale that rounds to 0)
        if hi > lo and (why := unrepresentable("the constant operand's scale", (hi - lo) / 255.0)) is not None:
            return why
        scale, zp = activation_params(lo, hi)
        q = np.clip(np.round(c.astype(np.float64) / float(scale)) + int(zp), 0, 255).astype(np.uint8)
        todo[i] = (q, scale, zp)
    return todo or "no float constant operand"


def constant_operand_replacement(m: Match, b):
    node = m.root
    inputs = list(node.inputs)
    hint = (node.name or node.op_type).split("::")[0]
    for i, (q, scale, zp) in sorted(m.plan.items()):
        s = b.const(np.array(scale, dtype=np.float32), name=f"{hint}_operand_scale")
        z = b.const(np.array(zp, dtype=np.uint8), name=f"{hint}_operand_zero_point")
        inputs[i] = b.op("DequantizeLinear", b.const(q, name=f"{hint}_operand_quantized"), s, z)
    return b.op(node.op_type, *inputs, attrs=list(node.attributes.values()))


def div_constant_condition(m: Match):
    if _plan(m) is None or _base(m.root) not in m.options.get("quant_nodes", ()):
        return "not planned"
    d = m.const("d")
    if d.dtype != np.float32 or d.size == 0 or not np.all(np.isfinite(d)) or np.any(d == 0):
        return "divisor is not a finite non-zero float32 constant"
    exact = 1.0 / d.astype(np.float64)
    with np.errstate(over="ignore", under="ignore"):
        r = exact.astype(np.float32)
    # float32 holds 1/d exactly only for d a power of two (x * r is then x / d bit for bit); any other
    # reciprocal must be a normal number: for |d| above 2**126 it is subnormal and keeps as few as 21
    # of float32's 24 bits (x * r is then off by up to 2**-21 of x / d)
    if not np.all(r.astype(np.float64) == exact) and (why := unrepresentable("the reciprocal 1/d", exact)):
        return why
    if not np.all(np.isfinite(r)):
        return "the reciprocal 1/d is inf in float32"
    return r


def div_constant_replacement(m: Match, b):
    node = m.root
    hint = (node.name or node.op_type).split("::")[0]
    return b.op("Mul", node.inputs[0], b.const(m.plan, name=f"{hint}_reciprocal"))


# --- Exact clean-ups ----------------------------------------------------------------------------


def _dq_params(m: Match, s: str, z: str):
    """(scale, zero point array, qmin, qmax) of a per-tensor DQ, or a reason."""
    scale = m.const(s)
    zp = m.const(z) if z in m else None
    if scale.size != 1 or (zp is not None and zp.size != 1):
        return "per-axis parameters"
    dtype = np.dtype(np.uint8) if zp is None else zp.dtype
    if dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        return "not an 8-bit DQ"
    info = np.iinfo(dtype)
    zero = 0 if zp is None else int(zp.reshape(-1)[0])
    sc = np.float32(scale.reshape(-1)[0])
    lo = float(np.float32(info.min - zero) * sc)
    hi = float(np.float32(info.max - zero) * sc)
    return lo, hi


def relu_absorb_condition(m: Match):
    r = _dq_params(m, "s", "z")
    if isinstance(r, str):
        return r
    return None if r[0] >= 0.0 else "the DQ's lowest level is below 0"


def clip_absorb_condition(m: Match):
    r = _dq_params(m, "s", "z")
    if isinstance(r, str):
        return r
    if m.opset() < 11:
        lo, hi = m.attr("clip", "min", -np.inf), m.attr("clip", "max", np.inf)
    else:
        lo = float(m.const("lo").reshape(-1)[0]) if "lo" in m else -np.inf
        hi = float(m.const("hi").reshape(-1)[0]) if "hi" in m else np.inf
    if not (r[0] >= lo and r[1] <= hi):
        return "the DQ's representable range is not inside the Clip's bounds"
    return None


def absorb_replacement(m: Match, b):
    dq = m.node("dq")
    return b.op("DequantizeLinear", *dq.inputs, attrs=list(dq.attributes.values()))


def requantize_identity_condition(m: Match):
    s1, s2 = m.const("s1"), m.const("s2")
    z1 = m.const("z1") if "z1" in m else np.zeros((), np.uint8)
    z2 = m.const("z2") if "z2" in m else np.zeros((), np.uint8)
    if s1.shape != s2.shape or z1.shape != z2.shape or z1.dtype != z2.dtype:
        return "different parameter shapes or types"
    if not (np.array_equal(s1, s2) and np.array_equal(z1, z2)):
        return "different scale or zero point"
    if s1.size != 1 and m.attr("dq", "axis", 1) != m.attr("q", "axis", 1):
        return "different axes"
    if m.node("q").attributes.get("saturate") is not None or m.node("q").attributes.get("output_dtype") is not None:
        return "Q with saturate/output_dtype"
    return None


_DQ = Op("DequantizeLinear", "q", Const("s"), Opt(Const("z")), shared=True, name="dq")

QDQ_RULES = [
    Rule("qdq_quantize_output", Op("*", name="node"), quantize_output_replacement,
         condition=quantize_output_condition, exact=False,
         doc="A value the plan quantizes gets QuantizeLinear -> DequantizeLinear after its producer (plan's scale "
             "and zero point); its readers read the DQ."),
    Rule("qdq_conv_weights", Op("Conv", _DQX, Const("w"), Opt(Const("b")), name="op"), weights_replacement,
         condition=weights_condition, exact=False, priority=5,
         doc="A planned Conv reading a DQ: int8 symmetric weights per output channel (axis 0) and an int32 bias "
             "(scale s_x*s_w) behind DequantizeLinear."),
    Rule("qdq_matmul_weights", Op("MatMul", _DQX, Const("w"), name="op"), weights_replacement,
         condition=weights_condition, exact=False, priority=5,
         doc="A planned MatMul reading a DQ with a constant [K,N] weight: int8 symmetric weights per column "
             "(axis 1) behind DequantizeLinear."),
    Rule("qdq_gemm_weights", Op("Gemm", _DQX, Const("w"), Opt(Const("b")), name="op"), weights_replacement,
         condition=weights_condition, exact=False, priority=5,
         doc="A planned Gemm reading a DQ: alpha and beta folded (both 1), int8 weights per output channel and "
             "an int32 bias behind DequantizeLinear."),
    Rule("qdq_add_constant_operand", Op("Add", "a", "b", name="op"), constant_operand_replacement,
         condition=constant_operand_condition, exact=False,
         doc="A planned Add's constant float operand becomes uint8 behind a DQ (on its own range)."),
    Rule("qdq_mul_constant_operand", Op("Mul", "a", "b", name="op"), constant_operand_replacement,
         condition=constant_operand_condition, exact=False,
         doc="A planned Mul's constant float operand becomes uint8 behind a DQ (on its own range)."),
    Rule("qdq_where_constant_operand", Op("Where", "c", "a", "b", name="op"), constant_operand_replacement,
         condition=constant_operand_condition, exact=False,
         doc="A planned Where's constant float operand becomes uint8 behind a DQ (on its own range)."),
    Rule("qdq_div_constant", Op("Div", "a", Const("d"), name="op"), div_constant_replacement,
         condition=div_constant_condition, exact=False, priority=5,
         doc="A planned Div by a constant becomes a Mul by its float32 reciprocal (QLinearMul; no QLinearDiv)."),
    Rule("qdq_relu_absorb", Op("Relu", _DQ, name="relu"), absorb_replacement, condition=relu_absorb_condition,
         exact=True, priority=10,
         doc="Relu(DQ(q)) whose lowest level dequantizes to >= 0 is DQ(q)."),
    Rule("qdq_clip_absorb", Op("Clip", _DQ, Opt(Const("lo")), Opt(Const("hi")), name="clip"), absorb_replacement,
         condition=clip_absorb_condition, exact=True, priority=10,
         doc="Clip(DQ(q)) whose representable range lies inside the bounds is DQ(q)."),
    Rule("qdq_requantize_identity",
         Op("QuantizeLinear", Op("DequantizeLinear", "q", Const("s1"), Opt(Const("z1")), shared=True, name="dq"),
            Const("s2"), Opt(Const("z2")), name="q"),
         forward("q"), condition=requantize_identity_condition, exact=True, priority=10,
         doc="Q(DQ(q)) with the same scale, zero point and type is q."),
]

RULES: list[Rule] = []  # not in the default optimize pipeline: apply_plan runs QDQ_RULES with a plan


# --- Whole-graph steps apply_plan runs around the rules -----------------------------------------


def _namer(model: ir.Model) -> Namer:
    return Namer(model)


def _qdq_after(model: ir.Model, name: Namer, x: ir.Value, scale, zp, producer: ir.Node | None) -> None:
    """Q -> DQ reading ``x`` (right after ``producer``, or first for a graph input); every node
    that read ``x`` reads the DQ (a graph output keeps ``x``)."""
    graph = model.graph
    readers = list(x.uses())
    s = ir.Value(name=name(f"{x.name}_scale"), shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.Tensor(np.array(scale, dtype=np.float32)))
    z = ir.Value(name=name(f"{x.name}_zero_point"), shape=ir.Shape([]), type=ir.TensorType(ir.DataType.UINT8),
                 const_value=ir.Tensor(np.array(zp, dtype=np.uint8)))
    for v in (s, z):
        v.const_value.name = v.name
        graph.register_initializer(v)
    q = ir.Node("", "QuantizeLinear", [x, s, z], name=name(f"{x.name}_QuantizeLinear"),
                outputs=[ir.Value(name=name(f"{x.name}_quantized"))])
    dq = ir.Node("", "DequantizeLinear", [q.outputs[0], s, z], name=name(f"{x.name}_DequantizeLinear"),
                 outputs=[ir.Value(name=name(f"{x.name}_dequantized"))])
    if producer is not None:
        graph.insert_after(producer, [q, dq])
    elif len(graph):
        graph.insert_before(graph.node(0), [q, dq])
    else:
        graph.extend([q, dq])
    for reader, slot in readers:
        reader.replace_input_with(slot, dq.outputs[0])


def quantize_graph_inputs(model: ir.Model, plan) -> int:
    """Q -> DQ after each graph input the plan quantizes, and after each planned output of a node
    outside the standard domain (a com.microsoft Gelu, say: the rules match standard ops only);
    their readers read the DQ. (A graph input has no producer for qdq_quantize_output to root
    at.) Returns how many."""
    graph = model.graph
    name = _namer(model)
    done = 0
    for x in list(graph.inputs):
        if x.name not in plan.params or not use_count(x):
            continue
        _qdq_after(model, name, x, *plan.params[x.name], None)
        done += 1
    for node in list(graph):
        if node.domain in ("", "ai.onnx"):
            continue
        for x in node.outputs:
            if x is not None and x.name in plan.params and use_count(x):
                _qdq_after(model, name, x, *plan.params[x.name], node)
                done += 1
    return done


def one_dq_per_reader(model: ir.Model) -> int:
    """Give every reader of a DequantizeLinear its own copy (onnxruntime's QDQ selectors fuse a DQ
    into one node only); a DQ that is a graph output keeps it and its readers get copies. Returns
    the copies made."""
    graph = model.graph
    name = _namer(model)
    made = 0
    for node in list(graph):
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
            continue
        out = node.outputs[0]
        readers = list(out.uses())  # (in the order they were made: deterministic)
        keep = 0 if out.is_graph_output() else 1
        for reader, slot in readers[keep:]:
            clone = ir.Node("", "DequantizeLinear", list(node.inputs),
                            attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                            name=name(f"{node.name}_copy"), outputs=[ir.Value(name=name(f"{out.name}_copy"))])
            clone.metadata_props.update(node.metadata_props)
            graph.insert_before(reader, clone)
            reader.replace_input_with(slot, clone.outputs[0])
            made += 1
    return made
