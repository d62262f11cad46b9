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
  quantized to uint8 on its own range), Div by a constant (made a Mul by the reciprocal: the
  x*relu6(x+3)/6 of a decomposed HardSwish runs as QLinearAdd, QLinearMul, QLinearMul), AveragePool, GlobalAveragePool, Sigmoid, LeakyRelu
  (input quantized) get their own output parameters.
- Ops that only move data (MaxPool, Reshape, Transpose, Flatten, Slice, Split, Squeeze,
  Unsqueeze, Gather, Expand, Tile, Resize nearest/linear, Depth/SpaceToDepth, ReduceMax/Min) and
  Concat share their input's parameters (Concat: one range over all inputs), so no requantization
  is inserted and onnxruntime drops their Q/DQ and runs them on uint8.

On ort-cpu (``use_costs``, the default) the plan also reads the measured cost table
``ort_cpu_costs.json`` (scripts/data/quant_costs.py: single-layer timings, float vs int8, on
onnxruntime's CPU provider): a Conv/MatMul/Gemm, Add/Mul/Div, GlobalAveragePool or Sigmoid whose
configuration is not measured at least 5% faster in int8, counting the QuantizeLinear /
DequantizeLinear its float neighbours add, is left float with the measured figures as the reason
in ``skipped`` (depthwise 5x5 stride 2x1 convolutions, for one: onnxruntime's uint8 depthwise
kernel is slower than its float one). The decision reads the shipped table only: the same model
gives the same plan on any machine. "portable" never reads it.

A value in the plan is quantized once after its producer, and every reader reads the
DequantizeLinear (a float reader too: onnxruntime fuses only a node whose output feeds Q alone).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt.errors import UsageError
from onnxopt.ir.util import constant_tensor, graphs, use_count
from onnxopt.ir.shapes import infer, opsets_of
from onnxopt.rules import qdq
from onnxopt.rules.qdq import activation_params

# --- Target rules -------------------------------------------------------------------------------

ANCHORS = frozenset({"Conv", "MatMul", "Gemm"})
BINARY = {"Add": (0, 1), "Mul": (0, 1), "Div": (0, 1), "Where": (1, 2)}  # op -> its float data inputs
# (Div only by a constant: rules/qdq.py makes it a Mul by the reciprocal, a QLinearMul)
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
    use_costs: bool = False  # leave float the nodes the shipped cost table measures as not faster in int8

    @property
    def weight_qmax(self) -> int:
        """Weights are symmetric in [-qmax, qmax] (7-bit with reduce_range)."""
        return 64 if self.reduce_range else 127

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"followed": list(self.followed)}


def target_rules(target: str = "ort-cpu", *, per_channel: bool = True, reduce_range: bool | None = None,
                 use_costs: bool = True) -> TargetRules:
    """The quantization rules of ``target``: "ort-cpu" (onnxruntime's x86 CPU provider) or
    "portable" (standard QDQ, the same numeric choices). "ort-cuda" is refused (UsageError):
    onnxruntime's CUDA provider runs QDQ models in float, slower than the float model.
    ``reduce_range`` (default off) quantizes weights to 7 bits, for x86 CPUs without VNNI.
    ``use_costs`` (ort-cpu only; "portable" never reads it): nodes whose configuration the shipped
    table ``ort_cpu_costs.json`` measures as not at least 5% faster in int8 are left float (see
    :func:`cost_decision`); False ignores the table (for experiments)."""
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
        if use_costs:
            followed.append(
                "measured costs (onnxopt/quantize/ort_cpu_costs.json, single-layer timings on onnxruntime CPU): a "
                "Conv/MatMul/Gemm, Add/Mul or pool that is not at least 5% faster in int8 than in float, counting the "
                "Q/DQ its float neighbours add, is left float; the decision reads the shipped table only")
    return TargetRules(name, "uint8", "int8", bool(per_channel), reduce, tuple(followed),
                       use_costs=bool(use_costs) and name == "ort-cpu")


# --- The plan -----------------------------------------------------------------------------------


@dataclasses.dataclass
class QuantPlan:
    """What to quantize and how.

    params: tensor name -> (scale np.float32, zero point np.uint8), for every activation tensor that
        gets a Q/DQ pair (weights are quantized by the rules, from the graph).
    nodes: names of the nodes that run quantized (compute and data-movement), in graph order.
    absorbed: Relu/Clip node name -> the tensor it is absorbed into.
    skipped: name of each float compute node left float -> why.
    unmatched_exclude: the ``exclude`` entries that named no node (name or plan key), op type or
        source node name (sorted), for the caller to warn about.
    costs: the shipped cost table's estimate of this plan's int8 time against float's (ort-cpu),
        with the table entries that decided it (``quantize(keep_float="auto")`` decides by it).
    """

    params: dict[str, tuple[np.float32, np.uint8]]
    nodes: list[str]
    skipped: dict[str, str]
    rules: TargetRules
    absorbed: dict[str, str] = dataclasses.field(default_factory=dict)
    unmatched_exclude: list[str] = dataclasses.field(default_factory=list)  # matched no node, op or source
    # the cost table's estimate of the quantized model against the float one (_cost_estimate)
    costs: dict | None = None

    @property
    def empty(self) -> bool:
        """Nothing is quantized (apply_plan then leaves the model as it is, opset included)."""
        return not self.nodes and not self.params

    def as_dict(self) -> dict:
        return {
            "target": self.rules.target,
            "rules": self.rules.as_dict(),
            "params": {k: {"scale": float(s), "zero_point": int(z)} for k, (s, z) in self.params.items()},
            "nodes": list(self.nodes),
            "absorbed": dict(self.absorbed),
            "skipped": dict(self.skipped),
            "unmatched_exclude": list(self.unmatched_exclude),
        }


def node_key(node: ir.Node, index: int) -> str:
    """A node's name, or (unnamed) a stable stand-in from its position; apply_plan names unnamed
    nodes so."""
    return node.name or f"{node.op_type}#{index}"


def _dtype(value: ir.Value | None, opsets, dtypes: Mapping[str, int] | None = None) -> ir.DataType | None:
    """``value``'s element type: inferred, else from ``dtypes`` (onnx element types by value name,
    e.g. an onnxruntime session's), else None (unknown: after a contrib op onnx cannot infer)."""
    if value is None:
        return None
    if value.type is None:
        infer(value, opsets)
    if isinstance(value.type, ir.TensorType) and value.type.dtype != ir.DataType.UNDEFINED:
        return value.type.dtype
    if dtypes and value.name in dtypes:
        return ir.DataType(int(dtypes[value.name]))
    return None


def _is_float(value: ir.Value | None, opsets, dtypes: Mapping[str, int] | None = None) -> bool:
    return _dtype(value, opsets, dtypes) == _FLOAT


def _not_float(values, opsets, dtypes, what: str = "input") -> str:
    """Why ``values`` are not all known float32: unknown types are said so, not called "not float32"."""
    for v in values:
        if v is not None and _dtype(v, opsets, dtypes) is None:
            return (f"{what} {v.name!r} has an unknown type (made by an op onnx cannot infer; give make_plan "
                    f"the value dtypes to quantize after it)")
    return f"{what} is not float32"


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
    kind: dict = dataclasses.field(default_factory=dict)  # node -> anchor/compute/mover


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


def _fed_initializer(value: ir.Value | None) -> bool:
    return value is not None and value.is_graph_input() and value.const_value is not None


def _anchor_refusal(node: ir.Node, opsets, dtypes: Mapping[str, int] | None = None) -> str | None:
    x = node.inputs[0] if node.inputs else None
    if not _is_float(x, opsets, dtypes):
        return _not_float([x], opsets, dtypes)
    if constant_tensor(x) is not None:
        return "its activation input is a constant"
    w = node.inputs[1] if len(node.inputs) > 1 else None
    wt = constant_tensor(w)
    for v, what in ((w, "weight"), (node.inputs[2] if len(node.inputs) > 2 else None, "bias")):
        if _fed_initializer(v):
            return (f"its {what} {v.name!r} is an initializer also listed as a graph input (the caller may feed "
                    f"it): kept float; remove it from the graph inputs to quantize it")
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


# --- Measured costs (ort-cpu) -------------------------------------------------------------------
#
# The table ``ort_cpu_costs.json`` (made by scripts/data/quant_costs.py) holds single-layer timings on
# onnxruntime's CPU provider: for each layer configuration, the float layer, the same layer as an
# integer kernel inside an int8 chain (uint8 in, uint8 out), and the QuantizeLinear /
# DequantizeLinear of its input and output that a float neighbour adds. The plan reads the shipped
# table only, so the same model gives the same plan on any machine.

COSTS_PATH = Path(__file__).with_name("ort_cpu_costs.json")
MIN_GAIN = 0.05  # int8 must be at least this much faster than float (boundary Q/DQ counted)
COSTED_OPS = frozenset({"Conv", "MatMul", "Gemm", "Add", "Mul", "Div", "GlobalAveragePool", "Sigmoid"})
_CATEGORICAL = ("kernel", "stride", "dilation")  # a mismatch counts _MISMATCH steps
_MISMATCH = 4.0
_LOG2 = ("ci", "co", "c", "k", "n_out")  # one step per factor 2
_LOG4 = ("px", "m", "n")  # one step per factor 4


def bucket2(v: int) -> int:
    """The power of 2 nearest to ``v`` (in log scale)."""
    return 1 << max(0, round(math.log2(max(int(v), 1))))


def bucket4(v: int) -> int:
    """The power of 4 nearest to ``v`` (in log scale)."""
    return 4 ** max(0, round(math.log(max(int(v), 1), 4)))


def _dims(value: ir.Value | None, opsets) -> list | None:
    if value is None:
        return None
    shape = infer(value, opsets)
    if shape is None:
        return None
    return [d if isinstance(d, int) else None for d in shape]


def _prod(dims) -> int | None:
    if dims is None or any(d is None for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64)) if dims else 1


def config_key(fields: Mapping) -> str:
    """The table's key of a layer configuration: its fields in a fixed order ("?" for unknown)."""
    parts = [fields["op"]]
    if "form" in fields:
        parts.append(fields["form"])
    for f in ("kernel", "stride", "dilation"):
        if f in fields:
            parts.append(f[0] + fields[f])
    for f in ("ci", "co", "c", "m", "k", "n_out", "n", "px"):
        if f in fields:
            v = fields[f]
            parts.append(f"{f}{'?' if v is None else v}")
    return " ".join(parts)


def layer_config(node: ir.Node, opsets) -> dict | None:
    """A node's configuration in the cost table's terms, or None for ops the table does not cover.
    Conv: form (depthwise: group == input channels; grouped; full), kernel, stride, dilation, input
    and output channels (nearest power of 2), output pixels N*H*W (nearest power of 4; None when
    the shape is dynamic). MatMul/Gemm: rows M (power of 4), K and N (power of 2). Add/Mul: form
    (const: a constant operand; bcast: one operand smaller; same) and output elements (power of 4).
    GlobalAveragePool: channels, input pixels. Sigmoid: elements."""
    op = node.op_type
    if op not in COSTED_OPS or node.domain not in ("", "ai.onnx"):
        return None
    if op == "Conv":
        w = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
        if w is None or len(w.shape) != 4:
            return None
        cout, cin_g, kh, kw = (int(d) for d in w.shape)
        attr = node.attributes
        group = int(attr["group"].value) if attr.get("group") is not None else 1
        cin = cin_g * group
        form = "full" if group == 1 else ("depthwise" if cin_g == 1 else "grouped")
        stride = list(attr["strides"].value) if attr.get("strides") is not None else [1, 1]
        dil = list(attr["dilations"].value) if attr.get("dilations") is not None else [1, 1]
        out = _dims(node.outputs[0], opsets)
        px = _prod([out[0], *out[2:]]) if out is not None and len(out) == 4 else None
        return {"op": op, "form": form, "kernel": f"{kh}x{kw}", "stride": "x".join(map(str, stride)),
                "dilation": "x".join(map(str, dil)), "ci": bucket2(cin), "co": bucket2(cout),
                "px": None if px is None else bucket4(px)}
    if op in ("MatMul", "Gemm"):
        w = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
        if w is None or len(w.shape) != 2:
            return None
        k, n = (int(d) for d in w.shape)
        if op == "Gemm" and node.attributes.get("transB") is not None and node.attributes["transB"].value:
            k, n = n, k
        x = _dims(node.inputs[0], opsets)
        m = _prod(x[:-1]) if x else None
        return {"op": op, "m": None if m is None else bucket4(m), "k": bucket2(k), "n_out": bucket2(n)}
    if op in ("Add", "Mul", "Div"):
        op = "Mul" if op == "Div" else op  # a Div by a constant runs as a Mul by its reciprocal
        a, b = node.inputs[0], node.inputs[1]
        out = _prod(_dims(node.outputs[0], opsets))
        if constant_tensor(a) is not None or constant_tensor(b) is not None:
            form = "const"
        else:
            da, db = _dims(a, opsets), _dims(b, opsets)
            if da is None or db is None:
                form = "same" if da == db else "bcast"
            else:
                form = "same" if _prod(da) == _prod(db) and len(da) == len(db) else "bcast"
        return {"op": op, "form": form, "n": None if out is None else bucket4(out)}
    x = _dims(node.inputs[0], opsets)
    if op == "GlobalAveragePool":
        c = x[1] if x is not None and len(x) > 1 else None
        px = _prod([x[0], *x[2:]]) if x is not None and len(x) > 2 else None
        return {"op": op, "c": None if c is None else bucket2(c), "px": None if px is None else bucket4(px)}
    n = _prod(x)
    return {"op": op, "n": None if n is None else bucket4(n)}


@dataclasses.dataclass(frozen=True)
class Costs:
    """One configuration's measured costs relative to its float layer (the table's deciding thread
    setting): int8 (the
    integer kernel inside an int8 chain), and the Q/DQ of the layer's input and output."""

    key: str  # the table entry's key, or the matched keys joined by " | "
    exact: bool
    int8: float
    q_in: float
    dq_in: float
    q_out: float
    dq_out: float

    def label(self) -> str:
        return self.key if self.exact else f"nearest measured: {self.key}"


class CostTable:
    """The shipped cost table. ``lookup(fields)``: the entry with the same key, else the nearest
    entries by this rule: only entries of the same op and form are candidates; the distance counts
    4 for each of kernel, stride and dilation that differ, plus one step per factor 2 of channels
    (ci, co, c), K and N, and per factor 4 of pixels, rows and elements (px, m, n); a field the
    node does not know (a dynamic shape) is not counted. All candidates at the smallest distance
    are used: the geometric mean of their int8/float ratios, the mean of their Q/DQ shares. No candidate: None (the node is quantized as without
    the table)."""

    def __init__(self, data: Mapping):
        self.data = data
        self.entries: dict[str, dict] = dict(data.get("entries", {}))

    @property
    def threads(self) -> str:
        """The thread setting whose figures decide (the table names it: "1" or "default")."""
        return str(self.data.get("decide_threads", "1"))

    def ratios(self, entry: Mapping, threads: str | None = None) -> dict[str, float]:
        t = entry["threads"][threads or self.threads]
        f = float(t["float_us"])
        return {k: float(t[f"{k}_us"]) / f for k in ("int8", "q_in", "dq_in", "q_out", "dq_out")}

    @staticmethod
    def distance(query: Mapping, fields: Mapping) -> float | None:
        if query["op"] != fields["op"] or query.get("form") != fields.get("form"):
            return None
        d = 0.0
        for f in _CATEGORICAL:
            if f in query and query[f] != fields.get(f):
                d += _MISMATCH
        for group, step in ((_LOG2, 1.0), (_LOG4, 2.0)):
            for f in group:
                if query.get(f) is not None and fields.get(f) is not None:
                    d += abs(math.log2(query[f]) - math.log2(fields[f])) / step
        return d

    def lookup(self, query: Mapping) -> Costs | None:
        key = config_key(query)
        if key in self.entries:
            return Costs(key, True, **self.ratios(self.entries[key]))
        scored = []
        for k in sorted(self.entries):
            d = self.distance(query, self.entries[k]["fields"])
            if d is not None:
                scored.append((d, k))
        if not scored:
            return None
        best = min(d for d, _ in scored)
        keys = [k for d, k in scored if d <= best + 1e-9]
        rs = [self.ratios(self.entries[k]) for k in keys]
        mean = {f: float(np.mean([r[f] for r in rs])) for f in rs[0]}  # Q/DQ shares: arithmetic
        mean["int8"] = float(np.exp(np.mean([np.log(r["int8"]) for r in rs])))
        return Costs(" | ".join(keys), False, **mean)


@functools.lru_cache(maxsize=4)
def load_costs(path: str | None = None) -> CostTable:
    """The cost table (default: the shipped ort_cpu_costs.json); a missing or unreadable table is a
    UsageError."""
    p = Path(path) if path else COSTS_PATH
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the cost table {p}: {exc}") from None
    return CostTable(data)


def _describe(fields: Mapping) -> str:
    if fields["op"] == "Conv":
        return (f"{fields['form']} Conv {fields['kernel']} stride {fields['stride']}"
                + (f" dilation {fields['dilation']}" if fields["dilation"] != "1x1" else ""))
    return config_key(fields)


def cost_decision(node: ir.Node, opsets, table: CostTable, *, input_quantized: bool = True,
                  float_reader: bool = True, quant_reader: bool = True) -> str | None:
    """Why ``node`` should stay float on ort-cpu according to the cost table, or None (quantize).
    int8 costs its integer kernel, plus a QuantizeLinear of its input when that is not quantized
    anyway (``input_quantized``: its producer, or another reader, is an integer kernel), plus a
    DequantizeLinear of its output when a float node reads it; float costs the float layer, plus
    a DequantizeLinear of its input when that is quantized anyway, plus a QuantizeLinear of its
    output when a quantized node reads it. int8 must be at least MIN_GAIN cheaper than float."""
    fields = layer_config(node, opsets)
    if fields is None:
        return None
    c = table.lookup(fields)
    if c is None:
        return None
    int8 = c.int8 + (0.0 if input_quantized else c.q_in) + (c.dq_out if float_reader else 0.0)
    flt = 1.0 + (c.dq_in if input_quantized else 0.0) + (c.q_out if quant_reader else 0.0)
    if int8 <= (1.0 - MIN_GAIN) * flt:
        return None
    but = "but" if c.int8 <= 1.0 - MIN_GAIN else "and"
    return (f"int8 measured on ort-cpu for {_describe(fields)}: kernel {c.int8:.2f}x the float layer, {but} "
            f"{int8 / flt:.2f}x with the Q/DQ its float neighbours need ({int8:.2f} vs {flt:.2f} float-layer "
            f"times; int8 must be at least {100 * MIN_GAIN:.0f}% faster; {c.label()}; "
            f"onnxopt/quantize/ort_cpu_costs.json)")


def _sources(node: ir.Node) -> tuple[str, ...]:
    """The names of the input model's nodes ``node`` was made from (its provenance, when a rule made
    it: the cleanup renames what it rewrites, e.g. a Conv folded with its BatchNormalization), so that
    ``exclude`` takes the names a user sees in the model they gave."""
    import json

    from onnxopt.ir.util import SOURCES_KEY

    try:
        names = json.loads(node.metadata_props.get(SOURCES_KEY, "[]"))
    except (ValueError, RecursionError):
        return ()
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()


def _structure(model: ir.Model, rules: TargetRules, exclude: Iterable[str], no_absorb: frozenset = frozenset(),
               costly: Mapping[str, str] | None = None, dtypes: Mapping[str, int] | None = None,
               refused: Mapping[str, str] | None = None) -> _Structure:
    """The plan's structure; with ``rules.use_costs`` the cost table's decisions are made by a
    fixpoint: each round, every quantized Conv/MatMul/Gemm, Add/Mul, GlobalAveragePool, Sigmoid is
    judged by :func:`cost_decision` with its neighbours as that round's plan has them (is its input
    quantized anyway; does a float node, a quantized node read its output), and those that do not
    pay are left float in the next round; it ends when a round leaves nothing more float.
    ``refused``: anchors left float with the reason (make_plan's: int8 weights out of range)."""
    if not rules.use_costs or costly is not None:
        return _structure_once(model, rules, exclude, no_absorb, {**(refused or {}), **(costly or {})}, dtypes)
    table = load_costs()
    opsets = opsets_of(model)
    costly: dict[str, str] = dict(refused or {})
    keys = {node: node_key(node, i) for i, node in enumerate(model.graph)}
    while True:  # each round leaves float what does not pay in the last round's plan; monotone
        s = _structure_once(model, rules, exclude, no_absorb, costly, dtypes)
        new = {}
        for node, in_q, float_reader, quant_reader in _cost_contexts(model, s, keys):
            reason = cost_decision(node, opsets, table, input_quantized=in_q, float_reader=float_reader,
                                   quant_reader=quant_reader)
            if reason:
                new[keys[node]] = reason
        if not new:
            return s
        costly.update(new)


def _cost_contexts(model: ir.Model, s: _Structure, keys: Mapping[ir.Node, str]):
    """Each quantized node the cost table covers, with its neighbours as the plan ``s`` has them:
    ``(node, input_quantized, float_reader, quant_reader)`` (is its input quantized anyway: its
    producer or another reader is an integer kernel; does a float node or a graph output, does a
    quantized node read its output), as :func:`cost_decision` takes them."""
    absorbed = set(s.absorbed)

    def quantized(n: ir.Node | None) -> bool:
        return n is not None and (n in s.kind or keys[n] in absorbed)

    def readers(v: ir.Value) -> tuple[list[ir.Node], bool]:
        """Readers of v, through absorbed Relu/Clip; and whether a graph output reads it."""
        out, graph_out = [], v.is_graph_output()
        for r, _ in v.uses():
            if keys[r] in absorbed:
                more, g = readers(r.outputs[0])
                out += more
                graph_out = graph_out or g
            else:
                out.append(r)
        return out, graph_out

    for node in model.graph:
        if node not in s.kind or node.op_type not in COSTED_OPS:
            continue
        live = [node.inputs[0]] if s.kind[node] == "anchor" else \
            [v for v in node.inputs if v is not None and constant_tensor(v) is None]
        in_q = all(quantized(v.producer()) or any(r is not node and r in s.kind and s.kind[r] != "mover"
                                                  for r, _ in v.uses()) for v in live)
        rs, graph_out = [], False
        for o in node.outputs:
            if o is not None:
                more, g = readers(o)
                rs += more
                graph_out = graph_out or g
        quant = [r for r in rs if r in s.kind]
        yield node, in_q, graph_out or len(quant) < len(rs), bool(quant)


def _work(fields: Mapping) -> float | None:
    """A layer configuration's work in the table's terms (multiply-adds or elements, from its
    bucketed fields), to scale a measured entry's time to a node of another size; None when a
    field is unknown (a dynamic shape)."""
    op = fields["op"]
    if op == "Conv":
        kh, kw = (int(x) for x in fields["kernel"].split("x"))
        per = fields["co"] if fields["form"] == "depthwise" else (fields["ci"] and fields["co"]
                                                                  and fields["ci"] * fields["co"])
        parts = [fields.get("px"), per, kh * kw]
    elif op in ("MatMul", "Gemm"):
        parts = [fields.get("m"), fields.get("k"), fields.get("n_out")]
    elif op == "GlobalAveragePool":
        parts = [fields.get("c"), fields.get("px")]
    else:
        parts = [fields.get("n")]
    return None if any(p is None for p in parts) else float(np.prod(parts, dtype=np.float64))


def _cost_estimate(model: ir.Model, s: _Structure) -> dict:
    """The shipped cost table's estimate of the plan ``s``'s quantized model against the float one,
    on onnxruntime's CPU provider: for each quantized node the table covers, its float layer's time
    (the matched entries' float microseconds, scaled by the node's work against theirs; the entries'
    own time when a dimension is dynamic) and its int8 time (the integer kernel plus the Q/DQ its
    float neighbours add, against the float layer plus the Q/DQ its quantized neighbours add), as
    :func:`cost_decision` counts them. Nodes left float run alike in both models and are not
    counted. Returns ``{"float_us", "int8_us", "ratio", "nodes", "entries", ...}``: ``entries`` the
    table entries that decided, by their share of the float time (largest first). Reads the
    shipped table only: the same model and plan give the same estimate on any machine."""
    table = load_costs()
    opsets = opsets_of(model)
    keys = {node: node_key(node, i) for i, node in enumerate(model.graph)}
    total_f = total_q = 0.0
    by_entry: dict[str, dict] = {}
    for node, in_q, float_reader, quant_reader in _cost_contexts(model, s, keys):
        fields = layer_config(node, opsets)
        c = table.lookup(fields) if fields is not None else None
        if c is None:
            continue
        entries = c.key.split(" | ")
        base = []
        for k in entries:
            e = table.entries[k]
            us = float(e["threads"][table.threads]["float_us"])
            mine, theirs = _work(fields), _work(e["fields"])
            base.append(us * (mine / theirs) if mine and theirs else us)
        f_us = float(np.mean(base))
        flt = f_us * (1.0 + (c.dq_in if in_q else 0.0) + (c.q_out if quant_reader else 0.0))
        q = f_us * (c.int8 + (0.0 if in_q else c.q_in) + (c.dq_out if float_reader else 0.0))
        total_f += flt
        total_q += q
        row = by_entry.setdefault(c.key if c.exact else f"nearest measured: {c.key}",
                                  {"nodes": 0, "float_us": 0.0, "int8_us": 0.0})
        row["nodes"] += 1
        row["float_us"] += flt
        row["int8_us"] += q
    ranked = sorted(by_entry.items(), key=lambda kv: (-kv[1]["float_us"], kv[0]))
    return {"float_us": round(total_f, 3), "int8_us": round(total_q, 3),
            "ratio": round(total_q / total_f, 4) if total_f > 0 else None,
            "nodes": sum(r["nodes"] for r in by_entry.values()), "table": "onnxopt/quantize/ort_cpu_costs.json",
            "threads": table.threads,
            "entries": [{"entry": k, "nodes": r["nodes"], "share": round(r["float_us"] / total_f, 4),
                         "ratio": round(r["int8_us"] / r["float_us"], 4)} for k, r in ranked]}


def _structure_once(model: ir.Model, rules: TargetRules, exclude: Iterable[str], no_absorb: frozenset,
                    costly: Mapping[str, str], dtypes: Mapping[str, int] | None = None) -> _Structure:
    exclude = frozenset(exclude)
    opsets = opsets_of(model)
    graph = model.graph
    order = list(graph)
    keys = {node: node_key(node, i) for i, node in enumerate(order)}
    s = _Structure({}, [], {}, {}, _Union(), {}, set())
    kind: dict[ir.Node, str] = {}  # quantized nodes: anchor, compute, mover

    def excluded(node):
        return keys[node] in exclude or node.op_type in exclude or not exclude.isdisjoint(_sources(node))

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
        reason = _anchor_refusal(node, opsets, dtypes) or costly.get(keys[node])
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
        if not any(_is_float(v, opsets, dtypes) for v in node.outputs):
            if (op in ABSORBED or op in BINARY or op in UNARY or op in SHARED or op in MOVERS) and any(
                    v is not None and _dtype(v, opsets, dtypes) is None for v in node.outputs):
                s.skipped[key] = _not_float(node.outputs, opsets, dtypes, "output")
            continue  # (shape arithmetic, Shape of a float tensor and the like: not a float compute node)
        if op == "Constant":
            continue
        if excluded(node):
            s.skipped[key] = "excluded by the user"
            continue
        if key in costly:
            s.skipped[key] = costly[key]
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
            if len(data) != 2 or not all(_is_float(v, opsets, dtypes) for v in data):
                s.skipped[key] = _not_float(data, opsets, dtypes)
                continue
            live = [v for v in data if constant_tensor(v) is None]
            if not live:
                continue  # (constant arithmetic: folding's business)
            consts = [constant_tensor(v) for v in data if constant_tensor(v) is not None]
            if op != "Div" and any(c.size == 0 or not np.all(np.isfinite(np.asarray(c.numpy()))) for c in consts):
                # (a -inf mask would saturate to the lowest uint8 level: Softmax then gives it weight)
                s.skipped[key] = f"{op} with a constant operand that is empty or not finite (inf/nan) stays float"
                continue
            if op == "Div":
                d = constant_tensor(data[1])
                if d is None:
                    s.skipped[key] = "Div by a non-constant has no integer kernel"
                    continue
                dv = np.asarray(d.numpy())
                if dv.size == 0 or not np.all(np.isfinite(dv)) or np.any(dv == 0):
                    s.skipped[key] = "Div by a constant with zeros or non-finite values"
                    continue
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
    s.kind = kind
    return s


def _with_costs(rules: TargetRules, use_costs: bool | None) -> TargetRules:
    if use_costs is None or rules.target != "ort-cpu" or bool(use_costs) == rules.use_costs:
        return rules
    return target_rules(rules.target, per_channel=rules.per_channel, reduce_range=rules.reduce_range,
                        use_costs=bool(use_costs))


def calibration_tensors(model: ir.Model, rules: TargetRules, *, exclude: Iterable[str] = (),
                        use_costs: bool | None = None, dtypes: Mapping[str, int] | None = None) -> list[str]:
    """The float tensors whose calibrated (lo, hi) ranges ``make_plan`` needs, in graph order (the
    values a Relu/Clip is absorbed into are listed too: if the calibrated range makes the absorption
    inexact, make_plan undoes it and quantizes the value on its own range). ``use_costs``
    overrides ``rules.use_costs`` (pass make_plan the same). Raises UsageError up front when the
    QDQ model needs a higher opset (per channel: 13; per tensor: 10) that :func:`raise_opset`
    cannot reach exactly (the reason names the op)."""
    s = _structure(model, _with_costs(rules, use_costs), exclude, dtypes=dtypes)
    if _needs_opset(rules, opsets_of(model)[""], bool(s.nodes)) and (why := opset_refusal(model, rules.opset)):
        raise UsageError(why)
    return list(s.needs_range)


def _needs_opset(rules: TargetRules, opset: int, quantizes: bool) -> bool:
    """Whether the QDQ model needs the standard domain raised to ``rules.opset``: not when nothing
    is quantized, nor per tensor from opset 10 (QuantizeLinear-10 has no axis, needs none)."""
    if not quantizes or opset >= rules.opset:
        return False
    return rules.per_channel or opset < 10


def representable(scale: np.float32, zero_point: np.uint8) -> tuple[float, float]:
    """The lowest and highest values DequantizeLinear gives for uint8 (float32 arithmetic, as
    onnxruntime computes (q - zp) * scale)."""
    lo = np.float32(0 - int(zero_point)) * np.float32(scale)
    hi = np.float32(255 - int(zero_point)) * np.float32(scale)
    return float(lo), float(hi)


def make_plan(model: ir.Model, ranges: Mapping[str, tuple[float, float]], rules: TargetRules, *,
              exclude: Iterable[str] = (), use_costs: bool | None = None,
              dtypes: Mapping[str, int] | None = None) -> QuantPlan:
    """Scales and zero points from calibrated ranges: one parameter set per group of tensors that
    share it (data movers, Concat, absorbed Relu/Clip); exclusions by node name or op type.
    ``ranges`` must cover ``calibration_tensors(model, rules, exclude=exclude)``. On ort-cpu with
    ``rules.use_costs`` (``use_costs`` overrides it; False ignores the table), nodes the shipped cost
    table measures as not faster in int8 are left float, the reason in ``skipped``. ``dtypes``:
    onnx element types by value name (e.g. from an onnxruntime session's outputs) for the values
    onnx cannot type (outputs of com.microsoft and other contrib ops); a value typed FLOAT there is
    float, one typed nowhere is skipped as "unknown type" (pass calibration_tensors the same).
    Nothing quantized: ``plan.empty`` (apply_plan then leaves the model, opset included, as it is).
    Exclude entries that match no node name, op type or source name: ``plan.unmatched_exclude``."""
    rules = _with_costs(rules, use_costs)
    exclude = tuple(sorted(set(exclude)))
    no_absorb: set[str] = set()
    refused: dict[str, str] = {}  # anchors whose int8 weights need a scale float32 cannot hold
    keys = {node: node_key(node, i) for i, node in enumerate(model.graph)}
    while True:
        s = _structure(model, rules, exclude, frozenset(no_absorb), dtypes=dtypes, refused=refused)
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
        # an anchor whose weights, bias or their scales float32 cannot hold at its input's scale
        # (rules/qdq.py quantized_weights) stays float, its output with no Q: onnxruntime would
        # quantize DequantizeLinear -> Conv/Gemm (float weights) -> QuantizeLinear itself, with the
        # same scales (a Conv's output of 4e20 became 0)
        new = {}
        for node, kind in s.kind.items():
            x = node.inputs[0]
            if kind == "anchor" and node.op_type in ("Conv", "MatMul", "Gemm") and x is not None and x.name in params:
                why = qdq.quantized_weights(node, params[x.name][0], rules.per_channel, rules.weight_qmax)
                if isinstance(why, str) and qdq.out_of_range(why):
                    new[keys[node]] = f"its int8 weights cannot be written: {why}"
        # nor a Q after such a node where its input is quantized anyway (read by another node): an
        # anchor reading its output is left float too (x -> Conv0 (int8) and x -> Conv1 (refused)
        # -> Conv2: Conv1 between DQ(x) and Q, quantized by onnxruntime: the output came out 0)
        by_key = {k: n for n, k in keys.items()}
        for key in [*refused, *new]:
            node = by_key.get(key)
            for out in () if node is None else node.outputs:
                for reader, slot in () if out is None else out.uses():
                    k = keys.get(reader)
                    if slot == 0 and s.kind.get(reader) == "anchor" and k not in refused and k not in new:
                        new[k] = f"its input comes from {key}, left float for a scale float32 cannot hold"
        if not undo and not new:
            break
        no_absorb |= undo
        refused.update(new)
    ordered = {name: params[name] for name in s.qset}
    return QuantPlan(ordered, s.nodes, dict(s.skipped), rules,
                     {key: value for key, (value, _, _) in s.absorbed.items()}, _unmatched(model, exclude),
                     _cost_estimate(model, s))


def _unmatched(model: ir.Model, exclude: Iterable[str]) -> list[str]:
    """The ``exclude`` entries that match no node's plan key, op type or source name."""
    known: set[str] = set()
    for i, node in enumerate(model.graph):
        known.add(node_key(node, i))
        known.add(node.op_type)
        known.update(_sources(node))
    return sorted(e for e in set(exclude) if e not in known)


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
    "LRN", "MeanVarianceNormalization",
})


def _since(op: str, version: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, version, "").since_version
    except Exception:  # noqa: BLE001 - not defined at that version
        return None


def _coerced_softmax(node: ir.Node) -> None:
    """Softmax/LogSoftmax/Hardmax before opset 13 along axis a (not the last) as opset 13 writes it:
    the input flattened to 2-D at a, the op along axis 1, reshaped back; the output keeps its name."""
    from onnxopt.ir.util import redirect

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


# Ops whose definition before opset 11 (10 for Slice and TopK, 9 for BatchNormalization) differs in
# more than types; carried over by _old_form, or refused with the reason.
_OLD_FORMS = {"Pad": 11, "Clip": 11, "Slice": 10, "TopK": 10, "Resize": 11, "Upsample": 99, "Scatter": 11,
              "BatchNormalization": 9}
_SLOT_NAMES = {"Pad": {1: "pads", 2: "constant_value"}, "Clip": {1: "min", 2: "max"},
               "Slice": {1: "starts", 2: "ends", 3: "axes"}, "TopK": {1: "k"}, "Resize": {1: "roi", 2: "scales"}}
MIN_OPSET = 7  # below this, binary ops had legacy broadcast attributes: refused


def _elem_dtype(value: ir.Value | None, opsets) -> np.dtype | None:
    if value is None:
        return None
    if value.type is None:
        infer(value, opsets)
    if isinstance(value.type, ir.TensorType):
        try:
            return np.dtype(value.type.dtype.numpy())
        except Exception:  # noqa: BLE001 - no numpy counterpart (string, ...)
            return None
    return None


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _old_form(node: ir.Node, old: int, opsets):
    """How a node defined before opset 11 in another form is carried over: (new op type, {input
    slot: numpy array}, attributes to drop, attributes to set), or a reason string (refused)."""
    op = node.op_type
    if op == "Pad":  # Pad-2: pads and value attributes -> inputs 1 and 2
        pads = _attr(node, "pads")
        if pads is None:
            return "Pad-2 without pads"
        value = float(_attr(node, "value", 0.0))
        ins = {1: np.array(list(pads), dtype=np.int64)}
        if value != 0.0:
            dt = _elem_dtype(node.inputs[0], opsets)
            if dt is None:
                return "Pad-2 with a padding value on an input of unknown type"
            ins[2] = np.array(value, dtype=dt)
        return op, ins, ("pads", "value"), {}
    if op == "Clip":  # Clip-6: min and max attributes -> inputs 1 and 2
        ins = {}
        dt = _elem_dtype(node.inputs[0], opsets)
        for slot, name in ((1, "min"), (2, "max")):
            v = _attr(node, name)
            if v is not None:
                if dt is None or dt.kind != "f":
                    return "Clip-6 bounds on an input that is not known to be float"
                ins[slot] = np.array(v, dtype=dt)
        return op, ins, ("min", "max"), {}
    if op == "Slice":  # Slice-1: starts, ends, axes attributes -> inputs 1, 2, 3
        starts, ends = _attr(node, "starts"), _attr(node, "ends")
        if starts is None or ends is None:
            return "Slice-1 without starts/ends"
        ins = {1: np.array(list(starts), np.int64), 2: np.array(list(ends), np.int64)}
        axes = _attr(node, "axes")
        if axes is not None:
            ins[3] = np.array(list(axes), np.int64)
        return op, ins, ("starts", "ends", "axes"), {}
    if op == "TopK":  # TopK-1: k attribute -> input 1
        k = _attr(node, "k")
        if k is None:
            return "TopK-1 without k"
        return op, {1: np.array([int(k)], np.int64)}, ("k",), {}
    if op == "Scatter":  # deprecated in 11: ScatterElements-11 is the same operator
        return "ScatterElements", {}, (), {}
    if op == "BatchNormalization":  # BatchNormalization-7's spatial=1 is what 9 always does
        if int(_attr(node, "spatial", 1)) != 1:
            return "BatchNormalization-7 with spatial=0 has no later form"
        return op, {}, ("spatial",), {}
    if op in ("Resize", "Upsample"):  # Resize-10/Upsample: Resize-11 with asymmetric coordinates
        if op == "Upsample" and _since(op, old) == 7:
            scales = _attr(node, "scales")
            scales = None if scales is None else np.array(list(scales), np.float32)
        else:
            t = constant_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
            scales = None if t is None else np.asarray(t.numpy(), dtype=np.float32)
        if scales is None:
            return f"{op} before opset 11 with scales that are not a constant"
        mode = _attr(node, "mode", "nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode == "bilinear":
            mode = "linear"
        sets = {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
        if mode == "nearest":
            if not np.all(scales >= 1):  # onnxruntime rounds a downscale up, an upscale down
                return f"nearest {op} before opset 11 that scales down"
            sets["nearest_mode"] = "floor"
        elif mode != "linear":
            return f"{op} mode {mode!r} before opset 11"
        return "Resize", {1: np.zeros(0, np.float32), 2: scales}, ("scales", "mode"), sets
    return f"{op} changed before opset 11"


def _conversions(model: ir.Model, version: int) -> list:
    """What raising the standard domain to ``version`` does to each node that changed: a list of
    (node, how), how being "axes"/"softmax"/a _old_form tuple; raises UsageError (one line, naming
    the op and node) for a node that cannot be carried over exactly. Changes nothing."""
    opsets = opsets_of(model)
    old = opsets[""]
    if old >= version:
        return []
    if old < MIN_OPSET:
        raise UsageError(f"cannot raise the opset from {old} to {version}: opsets below {MIN_OPSET} are not "
                         f"converted (convert the model with onnx.version_converter first)")
    plans = []
    ranks: dict[str, int] | None = None

    def rank_of(value: ir.Value) -> int | None:
        nonlocal ranks
        shape = infer(value, opsets_of(model))
        if shape is not None:
            return len(shape)
        if ranks is None:  # once: onnx's whole-model inference, symbolic dimensions and all
            from onnxopt.ir import io

            inferred = onnx.shape_inference.infer_shapes(io.to_proto(model))
            ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
                     list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
                     if vi.type.tensor_type.HasField("shape")}
        return ranks.get(value.name)

    for graph in graphs(model):
        for node in graph:
            if node.domain not in ("", "ai.onnx"):
                continue
            a, b = _since(node.op_type, old), _since(node.op_type, version)
            if a == b:
                continue
            if node.op_type in _OLD_FORMS and a is not None and a < _OLD_FORMS[node.op_type]:
                how = _old_form(node, old, opsets)
                if isinstance(how, str):
                    raise UsageError(f"cannot raise the opset from {old} to {version}: {node.op_type} "
                                     f"{node.name!r}: {how} (convert the model to opset 11 first)")
                plans.append((node, how))
            elif node.op_type in _AXES_TO_INPUT or node.op_type == "Dropout":
                plans.append((node, "axes"))
            elif node.op_type in _LAST_AXIS_ONLY:
                axis = node.attributes.get("axis")
                axis = 1 if axis is None else int(axis.value)
                rank = rank_of(node.inputs[0])
                if not (axis == -1 or (rank is not None and axis in (rank - 1, -1))):
                    plans.append((node, "softmax"))  # Flatten(axis) -> op(axis=1) -> Reshape(Shape(x))
            elif node.op_type not in _TYPES_ONLY:
                raise UsageError(f"cannot raise the opset from {old} to {version}: {node.op_type} {node.name!r} "
                                 f"changed in between")
    return plans


def _const_input(node: ir.Node, slot: int, array: np.ndarray, suffix: str) -> None:
    """Set ``node``'s input ``slot`` to a new initializer holding ``array`` (inputs before it that
    are missing become empty)."""
    graph = node.graph
    base = f"{node.name or node.op_type}_{suffix}"
    taken = set(graph.initializers) | {v.name for n in graph for v in n.outputs if v is not None} \
        | {v.name for v in graph.inputs}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.Tensor(array, name=name))
    graph.register_initializer(value)
    if len(node.inputs) <= slot:
        node.resize_inputs(slot + 1)
    node.replace_input_with(slot, value)


def opset_refusal(model: ir.Model, version: int = 13) -> str | None:
    """Why :func:`raise_opset` would refuse ``model`` (a one-line reason), or None; changes
    nothing. Lets a caller refuse before calibrating."""
    try:
        _conversions(model, version)
    except UsageError as exc:
        return str(exc)
    return None


def raise_opset(model: ir.Model, version: int = 13) -> list[str]:
    """Raise the standard domain's import to ``version`` (>= the current one) in place, carrying
    over the ops whose definition changed (Squeeze/Unsqueeze/ReduceSum axes and Split's split become
    inputs; Softmax family only along the last axis; Dropout's ratio attribute becomes its input;
    below opset 11: Pad-2's pads/value, Clip-6's min/max, Slice-1's starts/ends/axes and TopK-1's k
    become inputs, Scatter becomes ScatterElements, BatchNormalization-7 loses spatial=1, Resize-10
    and Upsample with constant scales become Resize-11 with asymmetric coordinates (nearest: only
    upscaling, floor)). Value names are kept. Returns the op types converted; raises UsageError,
    before changing anything, where a node cannot be carried over exactly (opsets below 7 are
    refused)."""
    old = opsets_of(model)[""]
    if old >= version:
        return []
    plans = _conversions(model, version)
    converted = []
    for node, how in plans:
        op = node.op_type
        if how == "softmax":
            _coerced_softmax(node)
            converted.append(op)
            continue
        if isinstance(how, tuple):
            new_op, inputs, drop, sets = how
            for name in drop:
                node.attributes.pop(name, None)
            for name, v in sets.items():
                node.attributes[name] = ir.AttrString(name, v)
            if op in ("Resize", "Upsample") and len(node.inputs) > 1:
                node.resize_inputs(1)  # (the scales move to slot 2)
            for slot, array in sorted(inputs.items()):
                _const_input(node, slot, array, _SLOT_NAMES.get(new_op, {}).get(slot, f"input{slot}"))
            node.op_type = new_op
            converted.append(op)
            continue
        attr_name = "ratio" if op == "Dropout" else _AXES_TO_INPUT[op]
        attr = node.attributes.pop(attr_name, None)
        if attr is None:
            continue
        if op == "Dropout":
            array = np.array(attr.value, dtype=np.float32)
        else:
            array = np.array(list(attr.value), dtype=np.int64)
        _const_input(node, 1, array, attr_name)
        converted.append(op)
    model.opset_imports[""] = version
    model.opset_imports.pop("ai.onnx", None)
    if model.ir_version < 7:
        model.ir_version = 7
    return sorted(set(converted))


def strip_plan_keys(model: ir.Model) -> None:
    """Remove the plan keys :func:`apply_plan` leaves with ``keep_plan_keys``."""
    for node in model.graph:
        node.metadata_props.pop(qdq.PLAN_KEY, None)


def apply_plan(model: ir.Model, plan: QuantPlan, *, strict: bool | None = None, keep_plan_keys: bool = False) -> dict:
    """Rewrite ``model`` in place into its QDQ form: opset raised to 13 where below, Q/DQ pairs
    after the graph inputs the plan quantizes, then the rule family ``rules/qdq.py`` to a fixpoint
    (``onnxopt.core.pipeline.run`` with ``options={"quant_plan": plan}``), then one DequantizeLinear per
    reader. Returns the rule statistics ({rule: fired count} plus "opset_converted", "dq_split"
    and, where a rule left a planned node float because a scale or constant it would write is out
    of float32's range, "kept_float": {"rule: reason": count}). ``keep_plan_keys``: leave each
    node's plan key (``rules/qdq.py``'s ``PLAN_KEY``) in its metadata, so that measurements on the
    QDQ model name nodes as the plan does (the fallback's); :func:`strip_plan_keys` removes them
    before the model is written."""
    from onnxopt.core import pipeline
    from onnxopt.errors import strict_default

    for i, node in enumerate(model.graph):
        node.metadata_props[qdq.PLAN_KEY] = node_key(node, i)
    old_opset = opsets_of(model)[""]
    converted = raise_opset(model, plan.rules.opset) if _needs_opset(plan.rules, old_opset, not plan.empty) else []
    qdq.quantize_graph_inputs(model, plan)
    result = pipeline.run(model, qdq.QDQ_RULES, options={"quant_plan": plan, **qdq.options_for(model, plan)},
                          strict=strict_default(strict))
    split = qdq.one_dq_per_reader(model)
    if not keep_plan_keys:
        strip_plan_keys(model)
    stats = {name: st.fired for name, st in sorted(result.rules.items()) if st.fired}
    stats["opset"] = [old_opset, opsets_of(model)[""]]
    stats["opset_converted"] = converted
    stats["dq_split"] = split
    kept = {f"{name}: {why}": n for name, st in sorted(result.rules.items())
            for why, n in sorted(st.reasons.items()) if qdq.out_of_range(why)}
    if kept:  # planned nodes a scale or constant float32 cannot hold left float (rules/qdq.py)
        stats["kept_float"] = kept
    if result.errors:
        stats["errors"] = [e.as_dict() if hasattr(e, "as_dict") else str(e) for e in result.errors]
    return stats
