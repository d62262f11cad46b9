"""Target knowledge and the quantization plan: which nodes run as integer kernels, which tensors get
which scale and zero point.

``target_rules("ort-cpu")`` says how onnxruntime's x86 CPU provider wants a QDQ model: uint8
asymmetric activations, int8 symmetric weights per output channel, no reduce_range on VNNI, and
the op types its QDQ selectors fuse (``core/optimizer/qdq_transformer/selectors_actions``).
``calibration_tensors`` names the float tensors whose ranges the plan needs; ``make_plan`` turns
their calibrated ranges into a :class:`QuantPlan`; ``apply_plan`` rewrites the model with the rule
family ``rules/qdq.py`` (QDQ placement) and finishes what rules cannot express (one DQ per
consumer).

How the plan is made (one pass over the main graph in order):

- *Anchors* (Conv, MatMul and Gemm with a constant float weight) are always quantized: their
  activation input gets a Q/DQ pair, their weights become int8 behind DequantizeLinear (done by
  the rules, which read the activation scale from the graph). A Conv's output is always
  quantized (QLinearConv needs a Q after it); a MatMul's or Gemm's only when a consumer wants it
  (without one onnxruntime runs MatMulIntegerToFloat / QGemm with a float output: one rounding
  less, and no Q/DQ pair in front of a graph output).
- *Relu/Clip* right after a quantized compute node, as that value's only reader, is absorbed:
  the value before it is quantized with the Relu's (Clip's) output parameters, whose zero point
  is the lowest level (for Clip: whose representable range lies inside the bounds), so
  Q(Relu(x)) == Q(x) exactly and the node goes away.
- Add, Mul, Where (every non-constant data input already quantized; a constant operand is
  quantized to uint8 on its own range), AveragePool, GlobalAveragePool, Sigmoid, LeakyRelu
  (input quantized) get their own output parameters.
- Ops that only move data (MaxPool, Reshape, Transpose, Flatten, Slice, Split, Squeeze,
  Unsqueeze, Gather, Expand, Tile, Resize nearest/linear, Depth/SpaceToDepth, ReduceMax/Min) and
  Concat share their input's parameters (Concat: one range over all inputs), so no requantization
  is inserted and onnxruntime drops their Q/DQ and runs them on uint8.

A value in the plan is quantized once after its producer, and every reader reads the
DequantizeLinear (a float reader too: onnxruntime fuses only a node whose output feeds Q alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from ..errors import UsageError
from ..irutil import constant_tensor, use_count
from ..shapes import infer, opsets_of

# --- Target rules -------------------------------------------------------------------------------

ANCHORS = frozenset({"Conv", "MatMul", "Gemm"})
BINARY = {"Add": (0, 1), "Mul": (0, 1), "Where": (1, 2)}  # op -> its float data inputs
UNARY = frozenset({"AveragePool", "GlobalAveragePool", "Sigmoid", "LeakyRelu"})
MOVERS = frozenset({"MaxPool", "Reshape", "Transpose", "Flatten", "Slice", "Split", "Squeeze", "Unsqueeze",
                    "Gather", "GatherElements", "Expand", "Tile", "Resize", "DepthToSpace", "SpaceToDepth",
                    "ReduceMax", "ReduceMin"})
SHARED = frozenset({"Concat"})  # every input and the output share one range
ABSORBED = frozenset({"Relu", "Clip"})
# float ops left float on purpose, with the reason the report gives
FLOAT_ON_PURPOSE = {
    "Softmax": "Softmax stays float (probabilities lose their small values in uint8)",
    "LayerNormalization": "LayerNormalization stays float (no integer kernel; normalization is accuracy-sensitive)",
    "ConvTranspose": "ConvTranspose has no QDQ fusion on onnxruntime's CPU provider",
}

_FLOAT = ir.DataType.FLOAT


@dataclasses.dataclass(frozen=True)
class TargetRules:
    """How a target wants its quantized model: dtypes, granularity, and the rules followed (words,
    for the report)."""

    target: str
    activation_dtype: str  # numpy dtype name: "uint8"
    weight_dtype: str  # "int8"
    per_channel: bool
    reduce_range: bool
    followed: tuple[str, ...]
    opset: int = 13  # the opset the QDQ model is raised to (DequantizeLinear's axis)

    @property
    def weight_qmax(self) -> int:
        """Weights are symmetric in [-qmax, qmax] (7-bit with reduce_range)."""
        return 64 if self.reduce_range else 127

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"followed": list(self.followed)}


def target_rules(target: str = "ort-cpu", *, per_channel: bool = True, reduce_range: bool | None = None) -> TargetRules:
    """The quantization rules of ``target``: "ort-cpu" (onnxruntime's x86 CPU provider) or
    "portable" (standard QDQ, the same numeric choices). "ort-cuda" is refused (UsageError):
    onnxruntime's CUDA provider runs QDQ models in float, slower than the float model.
    ``reduce_range`` (default off) quantizes weights to 7 bits, for x86 CPUs without VNNI."""
    name = {"cpu": "ort-cpu", "cuda": "ort-cuda"}.get(target, target)
    if name == "ort-cuda":
        raise UsageError("target ort-cuda: onnxruntime's CUDA provider runs QDQ models in float, slower than "
                         "the float model; quantize for ort-cpu, or keep the float model on CUDA")
    if name not in ("ort-cpu", "portable"):
        raise UsageError(f"unknown quantization target {target!r}; choose ort-cpu or portable")
    reduce = bool(reduce_range)
    followed = [
        "activations uint8 asymmetric (scale=(hi-lo)/255 over the calibrated range extended to contain 0): "
        "onnxruntime turns int8 activations into uint8 on x86 anyway (U8S8)",
        "weights int8 symmetric, zero point 0, " + ("in [-64, 64] (reduce_range: 7 bits, for AVX2 CPUs without VNNI)"
                                                    if reduce else "in [-127, 127] (no reduce_range: VNNI needs none)"),
        ("weights per output channel: Conv axis 0, MatMul [K,N] axis 1, Gemm axis 0 with transB else 1"
         if per_channel else "weights per tensor"),
        "bias int32 with scale s_x*s_w and zero point 0; Gemm alpha and beta folded into its weights (beta=1)",
        "Relu and Clip after a quantized node absorbed into its output's range (Q(Relu(x)) == Q(x))",
        "data-movement ops (MaxPool, Reshape, Transpose, Slice, Resize...) and Concat share their input's "
        "parameters: no requantization",
        "each DequantizeLinear has one reader; no graph output comes straight from a quantized node",
        "opset raised to 13 where below (DequantizeLinear axis; MaxPool-12 on uint8)",
    ]
    if name == "ort-cpu":
        followed += [
            "integer kernels for Conv (QLinearConv), MatMul (QLinearMatMul / MatMulIntegerToFloat), Gemm (QGemm), "
            "Add/Mul (QLinearAdd/Mul), AveragePool/GlobalAveragePool, Sigmoid, LeakyRelu, Concat, Where: the CPU "
            "provider's QDQ selectors",
            "activation x activation MatMul (attention), Softmax and LayerNormalization left float",
        ]
    return TargetRules(name, "uint8", "int8", bool(per_channel), reduce, tuple(followed))


# --- The plan -----------------------------------------------------------------------------------


@dataclasses.dataclass
class QuantPlan:
    """What to quantize and how.

    params: tensor name -> (scale np.float32, zero point np.uint8), for every activation tensor that
        gets a Q/DQ pair (weights are quantized by the rules, from the graph).
    nodes: names of the nodes that run quantized (compute and data-movement), in graph order.
    absorbed: Relu/Clip node name -> the tensor it is absorbed into.
    skipped: name of each float compute node left float -> why.
    """

    params: dict[str, tuple[np.float32, np.uint8]]
    nodes: list[str]
    skipped: dict[str, str]
    rules: TargetRules
    absorbed: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "target": self.rules.target,
            "rules": self.rules.as_dict(),
            "params": {k: {"scale": float(s), "zero_point": int(z)} for k, (s, z) in self.params.items()},
            "nodes": list(self.nodes),
            "absorbed": dict(self.absorbed),
            "skipped": dict(self.skipped),
        }


def node_key(node: ir.Node, index: int) -> str:
    """A node's name, or (unnamed) a stable stand-in from its position; apply_plan names unnamed
    nodes so."""
    return node.name or f"{node.op_type}#{index}"


def _is_float(value: ir.Value | None, opsets) -> bool:
    if value is None:
        return False
    if value.type is None:
        infer(value, opsets)
    return isinstance(value.type, ir.TensorType) and value.type.dtype == _FLOAT


def _readers(value: ir.Value) -> int:
    return use_count(value) + (1 if value.is_graph_output() else 0)


class _Union:
    def __init__(self):
        self.parent: dict[str, str] = {}

    def add(self, a: str) -> None:
        self.parent.setdefault(a, a)

    def find(self, a: str) -> str:
        self.add(a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclasses.dataclass
class _Structure:
    qset: dict[str, None]  # quantized values, in order
    nodes: list[str]
    absorbed: dict[str, tuple[str, float, float]]  # relu/clip key -> (value, lo bound, hi bound)
    skipped: dict[str, str]
    groups: _Union
    needs_range: dict[str, None]  # the tensors whose ranges the parameters come from
    from_consumer: set[str]  # absorbed values: their range is their Relu's/Clip's


def _clip_bounds(node: ir.Node, opsets) -> tuple[float, float] | str:
    if (opsets.get("", 1)) < 11 or len(node.inputs) == 1 and "min" in node.attributes:
        lo = node.attributes.get("min")
        hi = node.attributes.get("max")
        return (float(lo.value) if lo is not None else -np.inf, float(hi.value) if hi is not None else np.inf)
    bounds = []
    for i, default in ((1, -np.inf), (2, np.inf)):
        v = node.inputs[i] if len(node.inputs) > i else None
        if v is None:
            bounds.append(default)
            continue
        t = constant_tensor(v)
        if t is None:
            return "Clip bounds are not constant"
        bounds.append(float(np.asarray(t.numpy()).reshape(-1)[0]))
    return bounds[0], bounds[1]


def _anchor_refusal(node: ir.Node, opsets) -> str | None:
    x = node.inputs[0] if node.inputs else None
    if not _is_float(x, opsets):
        return "input is not float32"
    if constant_tensor(x) is not None:
        return "its activation input is a constant"
    w = node.inputs[1] if len(node.inputs) > 1 else None
    wt = constant_tensor(w)
    if wt is None:
        if node.op_type == "MatMul":
            return ("activation x activation MatMul stays float (attention scores: small products, "
                    "accuracy-sensitive)")
        return "its weight is not a constant"
    if wt.dtype != _FLOAT:
        return "its weight is not float32"
    if node.op_type == "Conv" and len(wt.shape) < 3:
        return "Conv weight of rank < 3"
    if node.op_type in ("MatMul", "Gemm") and len(wt.shape) != 2:
        return "weight is not 2-D"
    if node.op_type == "Gemm" and node.attributes.get("transA") is not None and node.attributes["transA"].value:
        return "Gemm with transA"
    b = node.inputs[2] if len(node.inputs) > 2 else None
    if b is not None:
        bt = constant_tensor(b)
        if bt is None:
            return "its bias is not a constant"
        if bt.dtype != _FLOAT:
            return "its bias is not float32"
        if node.op_type == "Gemm":
            n = wt.shape[0] if (node.attributes.get("transB") is not None and node.attributes["transB"].value) \
                else wt.shape[1]
            shape = tuple(bt.shape)
            if shape not in ((), (1,), (n,), (1, n), (1, 1)):
                return f"Gemm bias of shape {list(shape)} is not per output channel"
    return None


def _structure(model: ir.Model, rules: TargetRules, exclude: Iterable[str], no_absorb: frozenset = frozenset()
               ) -> _Structure:
    exclude = frozenset(exclude)
    opsets = opsets_of(model)
    graph = model.graph
    order = list(graph)
    keys = {node: node_key(node, i) for i, node in enumerate(order)}
    s = _Structure({}, [], {}, {}, _Union(), {}, set())
    kind: dict[ir.Node, str] = {}  # quantized nodes: anchor, compute, mover

    def excluded(node):
        return keys[node] in exclude or node.op_type in exclude

    def quantize(value: ir.Value, *, needs_range=True):
        s.qset[value.name] = None
        s.groups.add(value.name)
        if needs_range:
            s.needs_range[value.name] = None

    # Phase 1: anchors, whose inputs are quantized whatever else happens.
    for node in order:
        if node.op_type not in ANCHORS or node.domain not in ("", "ai.onnx"):
            continue
        if excluded(node):
            s.skipped[keys[node]] = "excluded by the user"
            continue
        reason = _anchor_refusal(node, opsets)
        if reason:
            s.skipped[keys[node]] = reason
            continue
        kind[node] = "anchor"
        quantize(node.inputs[0])
        if node.op_type == "Conv":
            quantize(node.outputs[0])

    # Phase 2: in graph order, what follows quantized values.
    for node in order:
        op, key = node.op_type, keys[node]
        if node.domain not in ("", "ai.onnx") or node in kind or key in s.skipped:
            continue
        if not any(_is_float(v, opsets) for v in node.outputs):
            continue  # (shape arithmetic, Shape of a float tensor and the like: not a float compute node)
        if op == "Constant":
            continue
        if excluded(node):
            s.skipped[key] = "excluded by the user"
            continue
        if op in ABSORBED:
            x = node.inputs[0]
            producer = x.producer()
            if key in no_absorb:
                s.skipped[key] = "its range would not start at its lowest level (kept float)"
                continue
            if producer is None or kind.get(producer) not in ("anchor", "compute"):
                s.skipped[key] = f"{op} after a node that stays float has no integer kernel"
                continue
            if _readers(x) != 1:
                s.skipped[key] = f"{op}'s input has other readers: it cannot be absorbed"
                continue
            bounds = (0.0, np.inf) if op == "Relu" else _clip_bounds(node, opsets)
            if isinstance(bounds, str):
                s.skipped[key] = bounds
                continue
            if bounds[0] > 0:
                s.skipped[key] = "Clip's lower bound is above 0: it cannot be absorbed"
                continue
            # the value before it is quantized with its parameters (its own range is kept
            # listed, for when the absorption is undone)
            quantize(x)
            s.from_consumer.add(x.name)
            quantize(node.outputs[0])
            s.groups.union(x.name, node.outputs[0].name)
            s.absorbed[key] = (x.name, bounds[0], bounds[1])
            continue
        if op in BINARY:
            data = [node.inputs[i] for i in BINARY[op] if i < len(node.inputs)]
            if len(data) != 2 or not all(_is_float(v, opsets) for v in data):
                s.skipped[key] = "input is not float32"
                continue
            live = [v for v in data if constant_tensor(v) is None]
            if not live:
                continue  # (constant arithmetic: folding's business)
            missing = [v for v in live if v.name not in s.qset]
            if missing:
                s.skipped[key] = f"input {missing[0].name!r} is not quantized (its producer stays float)"
                continue
            kind[node] = "compute"
            quantize(node.outputs[0])
            continue
        if op in UNARY:
            if node.inputs[0] is None or node.inputs[0].name not in s.qset:
                s.skipped[key] = "input is not quantized (its producer stays float)"
                continue
            kind[node] = "compute"
            quantize(node.outputs[0])
            continue
        if op in SHARED:
            ins = [v for v in node.inputs if v is not None]
            if not all(v.name in s.qset for v in ins):
                s.skipped[key] = "an input is not quantized (its producer stays float, or is a constant)"
                continue
            kind[node] = "mover"
            quantize(node.outputs[0], needs_range=False)
            for v in ins:
                s.groups.union(v.name, node.outputs[0].name)
            continue
        if op in MOVERS:
            x = node.inputs[0]
            if x is None or x.name not in s.qset:
                s.skipped[key] = "input is not quantized (its producer stays float)"
                continue
            if op == "MaxPool" and len([o for o in node.outputs if o is not None and (use_count(o) or o.is_graph_output())]) > 1:
                s.skipped[key] = "MaxPool with indices"
                continue
            if op == "Resize":
                mode = node.attributes.get("mode")
                mode = mode.value if mode is not None else "nearest"
                mode = mode.decode() if isinstance(mode, bytes) else mode
                if mode not in ("nearest", "linear"):
                    s.skipped[key] = f"Resize mode {mode} can leave the input's range"
                    continue
            kind[node] = "mover"
            outs = [o for o in node.outputs if o is not None]
            if op == "MaxPool":
                outs = outs[:1]
            for o in outs:
                quantize(o, needs_range=False)
                s.groups.union(x.name, o.name)
            continue
        s.skipped[key] = FLOAT_ON_PURPOSE.get(op, f"{op} has no integer kernel on {rules.target}")

    s.nodes = [keys[n] for n in order if n in kind]
    for node, k in kind.items():  # a mover's (Concat's) output lies in its inputs' range: not measured
        if k == "mover":
            for o in node.outputs:
                if o is not None:
                    s.needs_range.pop(o.name, None)
    s.needs_range = {name: None for name in s.qset if name in s.needs_range}
    return s


def calibration_tensors(model: ir.Model, rules: TargetRules, *, exclude: Iterable[str] = ()) -> list[str]:
    """The float tensors whose calibrated (lo, hi) ranges ``make_plan`` needs, in graph order (the
    values a Relu/Clip is absorbed into are listed too: if the calibrated range makes the absorption
    inexact, make_plan undoes it and quantizes the value on its own range)."""
    return list(_structure(model, rules, exclude).needs_range)


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


def representable(scale: np.float32, zero_point: np.uint8) -> tuple[float, float]:
    """The lowest and highest values DequantizeLinear gives for uint8 (float32 arithmetic, as
    onnxruntime computes (q - zp) * scale)."""
    lo = np.float32(0 - int(zero_point)) * np.float32(scale)
    hi = np.float32(255 - int(zero_point)) * np.float32(scale)
    return float(lo), float(hi)


def make_plan(model: ir.Model, ranges: Mapping[str, tuple[float, float]], rules: TargetRules, *,
              exclude: Iterable[str] = ()) -> QuantPlan:
    """Scales and zero points from calibrated ranges: one parameter set per group of tensors that
    share it (data movers, Concat, absorbed Relu/Clip); exclusions by node name or op type.
    ``ranges`` must cover ``calibration_tensors(model, rules, exclude=exclude)``."""
    exclude = tuple(sorted(set(exclude)))
    no_absorb: set[str] = set()
    while True:
        s = _structure(model, rules, exclude, frozenset(no_absorb))
        members: dict[str, list[str]] = {}
        for name in s.qset:
            members.setdefault(s.groups.find(name), []).append(name)
        params: dict[str, tuple[np.float32, np.uint8]] = {}
        for root, names in members.items():
            lo, hi, seen = np.inf, -np.inf, False
            for name in names:
                if name in s.from_consumer or name not in s.needs_range:
                    continue
                if name not in ranges:
                    raise UsageError(f"no calibrated range for tensor {name!r} (calibration_tensors() lists "
                                     f"what the plan needs)")
                a, b = (float(v) for v in ranges[name])
                if not (np.isfinite(a) and np.isfinite(b)) or a > b:
                    raise UsageError(f"calibrated range of {name!r} is not a finite (lo, hi): ({a}, {b})")
                lo, hi, seen = min(lo, a), max(hi, b), True
            if not seen:
                raise UsageError(f"no calibrated range for any of {names[0]!r}'s group")
            p = activation_params(lo, hi)
            for name in names:
                params[name] = p
        undo = set()
        for key, (value, cmin, cmax) in s.absorbed.items():
            scale, zp = params[value]
            qlo, qhi = representable(scale, zp)
            if qlo < cmin:
                undo.add(key)
                continue
            while qhi > cmax:  # float32 rounding of 255*s: nudge the scale down (the group shares it)
                scale = np.nextafter(scale, np.float32(0), dtype=np.float32)
                qlo, qhi = representable(scale, zp)
            if scale != params[value][0]:
                root = s.groups.find(value)
                for name in members[root]:
                    params[name] = (scale, zp)
        if not undo:
            break
        no_absorb |= undo
    ordered = {name: params[name] for name in s.qset}
    return QuantPlan(ordered, s.nodes, dict(s.skipped), rules,
                     {key: value for key, (value, _, _) in s.absorbed.items()})


# --- Applying it --------------------------------------------------------------------------------

# Ops whose definition changed between opsets 10-12 and 13 in more than the types they take, and
# how they are carried over (attribute -> constant input); anything else that changed is refused.
_AXES_TO_INPUT = {"Squeeze": "axes", "Unsqueeze": "axes", "ReduceSum": "axes", "Split": "split"}
_LAST_AXIS_ONLY = frozenset({"Softmax", "LogSoftmax", "Hardmax"})  # 13 changed what axis means, except the last
_TYPES_ONLY = frozenset({
    "Abs", "Add", "And", "ArgMax", "ArgMin", "AveragePool", "BatchNormalization", "Cast", "Ceil", "Clip", "Concat",
    "Constant", "ConstantOfShape", "Conv", "DepthToSpace", "DequantizeLinear", "Div", "Equal", "Erf", "Exp",
    "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gemm", "Greater", "GreaterOrEqual",
    "Identity", "If", "IsInf", "IsNaN", "Less", "LessOrEqual", "Log", "Loop", "MatMul", "Max", "MaxPool", "Mean",
    "Min", "Mod", "Mul", "Neg", "NonZero", "Not", "Or", "Pad", "Pow", "QuantizeLinear", "Reciprocal",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
    "ReduceProd", "ReduceSumSquare", "Relu", "Reshape", "Resize", "Scatter", "ScatterElements", "ScatterND",
    "Shape", "Sigmoid", "Sign", "Size", "Slice", "SpaceToDepth", "Sqrt", "Sub", "Sum", "Tanh", "Tile",
    "Transpose", "Where", "Xor", "Range", "TopK", "CumSum", "Einsum", "Celu", "HardSigmoid", "LeakyRelu",
    "Sin", "Cos", "Tan", "Softplus", "Softsign", "HardSwish", "Elu", "Selu", "PRelu", "Dropout",
})


def _since(op: str, version: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, version, "").since_version
    except Exception:  # noqa: BLE001 - not defined at that version
        return None


def _coerced_softmax(node: ir.Node) -> None:
    """Softmax/LogSoftmax/Hardmax before opset 13 along axis a (not the last) as opset 13 writes it:
    the input flattened to 2-D at a, the op along axis 1, reshaped back; the output keeps its name."""
    from ..irutil import redirect

    graph = node.graph
    axis = node.attributes.get("axis")
    axis = 1 if axis is None else int(axis.value)
    x, out = node.inputs[0], node.outputs[0]
    base = node.name or node.op_type
    flat = ir.Node("", "Flatten", [x], attributes=[ir.AttrInt64("axis", axis)], name=f"{base}_flatten",
                   outputs=[ir.Value(name=f"{out.name}_flat")])
    shape = ir.Node("", "Shape", [x], name=f"{base}_shape", outputs=[ir.Value(name=f"{out.name}_shape")])
    op = ir.Node("", node.op_type, [flat.outputs[0]], attributes=[ir.AttrInt64("axis", 1)], name=base,
                 outputs=[ir.Value(name=f"{out.name}_2d")])
    back = ir.Node("", "Reshape", [op.outputs[0], shape.outputs[0]], name=f"{base}_reshape",
                   outputs=[ir.Value(name=f"{out.name}_reshaped")])
    op.metadata_props.update(node.metadata_props)
    graph.insert_before(node, [flat, shape, op, back])
    redirect(out, back.outputs[0], take_name=True)
    graph.remove(node, safe=True)


def raise_opset(model: ir.Model, version: int = 13) -> list[str]:
    """Raise the standard domain's import to ``version`` (>= the current one) in place, carrying
    over the ops whose definition changed (Squeeze/Unsqueeze/ReduceSum axes and Split's split become
    inputs; Softmax family only along the last axis; Dropout's ratio attribute becomes its input).
    Value names are kept. Returns the op types converted; raises UsageError where a node cannot be
    carried over exactly."""
    old = opsets_of(model)[""]
    if old >= version:
        return []
    plans = []
    ranks: dict[str, int] | None = None

    def rank_of(value: ir.Value) -> int | None:
        nonlocal ranks
        shape = infer(value, opsets_of(model))
        if shape is not None:
            return len(shape)
        if ranks is None:  # once: onnx's whole-model inference, symbolic dimensions and all
            from .. import io

            inferred = onnx.shape_inference.infer_shapes(io.to_proto(model))
            ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
                     list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
                     if vi.type.tensor_type.HasField("shape")}
        return ranks.get(value.name)

    for graph in model.graphs():
        for node in graph:
            if node.domain not in ("", "ai.onnx"):
                continue
            a, b = _since(node.op_type, old), _since(node.op_type, version)
            if a == b:
                continue
            if node.op_type in _AXES_TO_INPUT or node.op_type == "Dropout":
                plans.append(node)
            elif node.op_type in _LAST_AXIS_ONLY:
                axis = node.attributes.get("axis")
                axis = 1 if axis is None else int(axis.value)
                rank = rank_of(node.inputs[0])
                if not (axis == -1 or (rank is not None and axis in (rank - 1, -1))):
                    plans.append(node)  # Flatten(axis) -> op(axis=1) -> Reshape(Shape(x)): the old meaning
            elif node.op_type not in _TYPES_ONLY:
                raise UsageError(f"cannot raise the opset from {old} to {version}: {node.op_type} {node.name!r} "
                                 f"changed in between")
    converted = []
    for node in plans:
        op = node.op_type
        if op in _LAST_AXIS_ONLY:
            _coerced_softmax(node)
            converted.append(op)
            continue
        attr_name = "ratio" if op == "Dropout" else _AXES_TO_INPUT[op]
        attr = node.attributes.pop(attr_name, None)
        if attr is None:
            continue
        graph = node.graph
        if op == "Dropout":
            array = np.array(attr.value, dtype=np.float32)
        else:
            array = np.array(list(attr.value), dtype=np.int64)
        name = f"{node.name or op}_{attr_name}"
        taken = {v.name for v in graph.initializers.values()}
        k = 0
        while name in taken:
            k += 1
            name = f"{node.name or op}_{attr_name}_{k}"
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         const_value=ir.Tensor(array, name=name))
        graph.register_initializer(value)
        inputs = list(node.inputs)
        slot = 1
        while len(inputs) <= slot:
            inputs.append(None)
        inputs[slot] = value
        node.resize_inputs(len(inputs))
        node.replace_input_with(slot, value)
        converted.append(op)
    model.opset_imports[""] = version
    model.opset_imports.pop("ai.onnx", None)
    if model.ir_version < 7:
        model.ir_version = 7
    return sorted(set(converted))


def apply_plan(model: ir.Model, plan: QuantPlan, *, strict: bool | None = None) -> dict:
    """Rewrite ``model`` in place into its QDQ form: opset raised to 13 where below, Q/DQ pairs
    after the graph inputs the plan quantizes, then the rule family ``rules/qdq.py`` to a fixpoint
    (``onnxopt.pipeline.run`` with ``options={"quant_plan": plan}``), then one DequantizeLinear per
    reader. Returns the rule statistics ({rule: fired count} plus "opset_converted" and
    "dq_split")."""
    from .. import pipeline
    from ..errors import strict_default
    from onnxopt.rules import qdq  # the rule family (rules/qdq.py)

    for i, node in enumerate(model.graph):
        node.metadata_props[qdq.PLAN_KEY] = node_key(node, i)
    old_opset = opsets_of(model)[""]
    try:
        converted = raise_opset(model, plan.rules.opset)
    except UsageError:
        if plan.rules.per_channel:
            raise
        converted = []  # per-tensor QDQ is valid from opset 10
    qdq.quantize_graph_inputs(model, plan)
    result = pipeline.run(model, qdq.QDQ_RULES, options={"quant_plan": plan, **qdq.options_for(model, plan)},
                          strict=strict_default(strict))
    split = qdq.one_dq_per_reader(model)
    for node in model.graph:
        node.metadata_props.pop(qdq.PLAN_KEY, None)
    stats = {name: st.fired for name, st in sorted(result.rules.items()) if st.fired}
    stats["opset"] = [old_opset, opsets_of(model)[""]]
    stats["opset_converted"] = converted
    stats["dq_split"] = split
    if result.errors:
        stats["errors"] = [e.as_dict() if hasattr(e, "as_dict") else str(e) for e in result.errors]
    return stats
