"""Integer-kernel coverage: which nodes of a QDQ model onnxruntime runs as integer kernels, and
which stay float islands, and why.

A QDQ model says *what* may run in int8; onnxruntime decides what does, when it loads the model:
its QDQ selectors fuse ``DequantizeLinear -> op -> QuantizeLinear`` groups into QLinearConv,
QLinearMatMul, QGemm, MatMulIntegerToFloat, QLinearAdd/Mul/..., drop the Q/DQ pairs around ops
that only move data (MaxPool, Reshape, Transpose, ...) so those run on uint8/int8 tensors, absorb
Relu/Clip into the QuantizeLinear after them, and leave everything else in float between a
DequantizeLinear and a QuantizeLinear. :func:`integer_coverage` loads the model as a user runs it
(``ORT_ENABLE_ALL`` on the CPU provider), reads back the optimized graph onnxruntime writes
(``SessionOptions.optimized_model_filepath``), maps its nodes to the QDQ model's and, for every
node that stayed float, derives the reason from the QDQ graph around it (and from the optimized
graph's neighbours: an int8 input onnxruntime could not convert to uint8, say).

How optimized nodes are mapped back (checked on onnxruntime 1.17-1.32): a fused node keeps the
name of the op it replaces (QLinearAdd ``add`` for Add ``add``); the layout transformer appends
``_token_<n>`` (``conv1_token_23``) and ensuring one consumer per DQ appends ``/duplicated``; a
node whose name does not lead back is mapped through its outputs (a fused node writes the output
of the QuantizeLinear it absorbed). A node that vanished takes the status of the kernel that writes
its output (a function onnxruntime inlined, ``_inlfunc_HardSwish...`` HardSigmoid+Mul; a float
fusion such as BiasGelu, which also takes the vanished nodes behind it), else of a consumer whose
kernel reads its inputs (an Add in SkipLayerNormalization), else of its producer, and that only when
reached without crossing a QuantizeLinear/DequantizeLinear; an integer producer's status only when
the node feeds nothing but the QuantizeLinear the kernel absorbed (Relu/Clip in QLinearConv).
Identity/Dropout removed are data movement, never compute.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnxopt.ir import io
from onnxopt.errors import UsageError

__all__ = ["Coverage", "FloatIsland", "IntegerNode", "INTEGER_KERNELS", "ORT_CPU_QDQ_OPS", "integer_coverage",
           "is_qdq_model"]

# Optimized-graph op types that compute on integers (onnxruntime's contrib and standard ops).
INTEGER_KERNELS = frozenset({
    "QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "QLinearAdd", "QLinearMul",
    "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu",
    "QLinearSoftmax", "QLinearWhere", "QLinearReduceMean", "QLinearConvTranspose", "QLinearGather", "QAttention",
    "QEmbedLayerNormalization", "ConvInteger", "MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM",
    "NhwcQLinearConv", "QLinearLookup"})

# Ops that only move or select data: on uint8/int8 tensors they run in 8 bits, no arithmetic.
DATA_MOVEMENT = frozenset({
    "MaxPool", "NhwcMaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split",
    "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Resize", "Concat", "Pad", "ReduceMax", "ReduceMin",
    "ArgMax", "ArgMin", "Identity", "DepthToSpace", "SpaceToDepth", "Dropout"})

# The ops onnxruntime's CPU QDQ selectors turn into integer kernels (qdq_selector_action_transformer.cc),
# with what they become; Relu and Clip are absorbed into the QuantizeLinear after them.
ORT_CPU_QDQ_OPS = {
    "Conv": "QLinearConv", "MatMul": "QLinearMatMul or MatMulIntegerToFloat", "Gemm": "QGemm",
    "Add": "QLinearAdd", "Mul": "QLinearMul", "AveragePool": "QLinearAveragePool",
    "GlobalAveragePool": "QLinearGlobalAveragePool", "LeakyRelu": "QLinearLeakyRelu", "Sigmoid": "QLinearSigmoid",
    "Softmax": "QLinearSoftmax", "Concat": "QLinearConcat", "Where": "QLinearWhere",
    **{op: f"{op} on 8-bit tensors" for op in ("MaxPool", "Resize", "ReduceMax", "ReduceMin", "Expand", "Flatten",
                                                "Gather", "GatherElements", "Reshape", "Slice", "Squeeze", "Tile",
                                                "Transpose", "Unsqueeze", "Split", "ArgMax")},
    "Relu": "absorbed into the QuantizeLinear after it", "Clip": "absorbed into the QuantizeLinear after it"}

_QUANT = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "EyeLike"})
_EIGHT_BIT = frozenset({TensorProto.UINT8, TensorProto.INT8})
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
_BOOL_OUT = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
                       "IsNaN", "IsInf"})
_WEIGHT_SLOT = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1}
_BIAS_SLOT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}
_FUSION_TARGETS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_OPTIONAL_Q = frozenset({"MatMul", "Gemm"})  # MatMulIntegerToFloat / QGemm with a float output need no Q
_LAYOUT = frozenset({"Transpose", "ReorderInput", "ReorderOutput"})  # added by layout transformers
_SUFFIX = re.compile(r"(_token_\d+|/duplicated)$")


@dataclasses.dataclass(frozen=True)
class IntegerNode:
    """A node of the QDQ model that runs in integers: ``kernel`` is the optimized graph's op type
    (QLinearConv, ...; "fused into QLinearConv 'conv1'" for a Relu absorbed); ``kind``:
    "compute", "data movement" or "fused"."""

    node: str
    op: str
    kernel: str
    kind: str


@dataclasses.dataclass(frozen=True)
class FloatIsland:
    """A node of the QDQ model that onnxruntime runs in float, the kernel it runs as and why."""

    node: str
    op: str
    reason: str
    kernel: str
    kind: str  # "compute", "data movement" or "fused"


@dataclasses.dataclass
class Coverage:
    """What onnxruntime made of a QDQ model (see :func:`integer_coverage`).

    ``integer``: the nodes running in integers; ``float_islands``: float compute nodes with the
    reason; ``float_movement``: data-movement ops left on float tensors (no arithmetic, but they
    sit between float values); ``qdq_left``: QuantizeLinear/DequantizeLinear nodes left in the
    optimized graph (each a requantization or a float boundary paid at every run;
    ``dequantize_constant``: DQs of weights that stayed float); ``added``: op types onnxruntime
    added (layout Transposes, reorders), by count. All lists are in the QDQ model's node order."""

    provider: str
    integer: list[IntegerNode]
    float_islands: list[FloatIsland]
    float_movement: list[FloatIsland]
    qdq_left: dict[str, int]
    added: dict[str, int]
    kernels: dict[str, int]  # the optimized graph's op types, by count

    @property
    def compute_total(self) -> int:
        return sum(1 for n in self.integer if n.kind != "data movement") + len(self.float_islands)

    @property
    def compute_integer(self) -> int:
        return sum(1 for n in self.integer if n.kind != "data movement")

    def by_op(self) -> dict[str, dict[str, int]]:
        """Per op type of the QDQ model: compute nodes {"integer": n, "float": m} (data movement
        counted apart as "movement_integer"/"movement_float")."""
        out: dict[str, Counter] = {}
        for n in self.integer:
            out.setdefault(n.op, Counter())["movement_integer" if n.kind == "data movement" else "integer"] += 1
        for n in self.float_islands:
            out.setdefault(n.op, Counter())["float"] += 1
        for n in self.float_movement:
            out.setdefault(n.op, Counter())["movement_float"] += 1
        keys = ("integer", "float", "movement_integer", "movement_float")
        return {op: {k: c[k] for k in keys} for op, c in sorted(out.items())}

    def summary(self) -> dict:
        total, done = self.compute_total, self.compute_integer
        return {"compute_nodes": total, "compute_integer": done, "compute_float": total - done,
                "fraction_integer": round(done / total, 4) if total else None,
                "movement_integer": sum(1 for n in self.integer if n.kind == "data movement"),
                "movement_float": len(self.float_movement),
                "quantize_left": self.qdq_left.get("quantize", 0),
                "dequantize_left": self.qdq_left.get("dequantize", 0),
                "dequantize_constant_left": self.qdq_left.get("dequantize_constant", 0)}

    def as_dict(self) -> dict:
        """JSON-safe, in a fixed order: same model, same dict."""
        return {"provider": self.provider, "summary": self.summary(), "by_op": self.by_op(),
                "integer": [dataclasses.asdict(n) for n in self.integer],
                "float_islands": [dataclasses.asdict(n) for n in self.float_islands],
                "float_movement": [dataclasses.asdict(n) for n in self.float_movement],
                "qdq_left": dict(sorted(self.qdq_left.items())), "added": dict(sorted(self.added.items())),
                "kernels": dict(sorted(self.kernels.items()))}

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """One row per node: (node, op, runs as, "integer"/"float", reason or ""), float islands
        first, then float data movement, then integer nodes; each group in model order."""
        return ([(n.node, n.op, n.kernel, "float", n.reason) for n in self.float_islands]
                + [(n.node, n.op, n.kernel, "float", n.reason) for n in self.float_movement]
                + [(n.node, n.op, n.kernel, "integer", "") for n in self.integer])


def is_qdq_model(proto: onnx.ModelProto) -> bool:
    """The main graph holds QuantizeLinear or DequantizeLinear nodes."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node)


# ---- the graphs ------------------------------------------------------------------------------------------------


class _Graph:
    """Producers, consumers, constants and element types of one graph."""

    def __init__(self, graph: onnx.GraphProto, dtypes: Mapping[str, int] | None = None):
        self.graph = graph
        self.nodes = list(graph.node)
        self.inits = {t.name: t for t in graph.initializer}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for o in n.output:
                if o:
                    self.producer[o] = i
            for x in n.input:
                if x:
                    self.consumers.setdefault(x, []).append(i)
        self.outputs = {o.name for o in graph.output}
        self.constants = set(self.inits) | {o for n in self.nodes if n.op_type == "Constant" for o in n.output}
        self.dtypes = _dtypes(graph, self.nodes, dtypes)

    def producer_node(self, name: str):
        i = self.producer.get(name)
        return None if i is None else self.nodes[i]

    def value(self, name: str):
        """A small constant's value (initializer or Constant node), else None."""
        t = self.inits.get(name)
        if t is None:
            n = self.producer_node(name)
            if n is not None and n.op_type == "Constant":
                t = next((a.t for a in n.attribute if a.name == "value"), None)
        if t is None or t.data_location == TensorProto.EXTERNAL:
            return None
        try:
            return numpy_helper.to_array(t)
        except Exception:  # noqa: BLE001 - a value we cannot read is compared by name only
            return None


def _dtypes(graph: onnx.GraphProto, nodes, known: Mapping[str, int] | None) -> dict[str, int]:
    """Element types of the graph's values: declared ones, then propagated through the nodes with
    the rules of the ops that matter here (contrib ops included, which onnx cannot infer)."""
    out: dict[str, int] = dict(known or {})
    for t in graph.initializer:
        out[t.name] = t.data_type
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.tensor_type.elem_type:
            out.setdefault(vi.name, vi.type.tensor_type.elem_type)
    for n in nodes:
        op, ins = n.op_type, list(n.input)
        attrs = {a.name: a for a in n.attribute}
        first = next((out[x] for x in ins if x and x in out), None)
        if op == "QuantizeLinear":
            t = out.get(ins[2]) if len(ins) > 2 and ins[2] else (
                attrs["output_dtype"].i if "output_dtype" in attrs and attrs["output_dtype"].i else TensorProto.UINT8)
        elif op == "DynamicQuantizeLinear":
            t = TensorProto.UINT8
        elif op == "DequantizeLinear":
            t = out.get(ins[1], TensorProto.FLOAT)
        elif op in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
            t = TensorProto.FLOAT
        elif op in ("ConvInteger", "MatMulInteger"):
            t = TensorProto.INT32
        elif op == "QGemm" and len(ins) < 8:  # no y_scale: a float output
            t = TensorProto.FLOAT
        elif op == "Cast" and "to" in attrs:
            t = attrs["to"].i
        elif op in ("Shape", "Size", "NonZero", "ArgMax", "ArgMin"):
            t = TensorProto.INT64
        elif op in _BOOL_OUT:
            t = TensorProto.BOOL
        elif op in ("Constant", "ConstantOfShape"):
            v = attrs.get("value")
            t = v.t.data_type if v is not None else TensorProto.FLOAT
        elif op == "Where":
            t = out.get(ins[1], first)
        else:
            t = first
        for k, o in enumerate(n.output):
            if o and t is not None:
                out.setdefault(o, TensorProto.INT64 if (op == "TopK" and k == 1) else t)
    return out


def _base(name: str) -> str:
    while True:
        stripped = _SUFFIX.sub("", name)
        if stripped == name:
            return name
        name = stripped


def _label(n, i: int) -> str:
    return n.name or f"{n.op_type}#{i}"


def _is_integer_kernel(n) -> bool:
    return n.op_type in INTEGER_KERNELS or (n.domain == "com.microsoft" and n.op_type.startswith("QLinear"))


# ---- the optimized graph -------------------------------------------------------------------------------------


def _optimized(source, provider: str, threads: int) -> onnx.ModelProto:
    """The graph onnxruntime runs: the model optimized at ORT_ENABLE_ALL and written back (weights
    to a data file beside it, not read)."""
    ort = io.onnxruntime_module()
    if ort is None:
        raise UsageError("integer coverage needs onnxruntime (pip install 'onnxopt[ort]')")
    with tempfile.TemporaryDirectory(prefix="onnxopt-coverage-") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = path
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if threads:
            so.intra_op_num_threads = threads
        try:
            ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"onnxruntime cannot load the quantized model: {io.first_line(exc, 300)}") from None
        return onnx.load(path, load_external_data=False)


# ---- the analysis --------------------------------------------------------------------------------------------


def integer_coverage(model, *, provider: str = "cpu", plan_reasons: Mapping[str, str] | None = None,
                     threads: int = 0) -> Coverage:
    """Which nodes of the QDQ ``model`` (a path, bytes, onnx.ModelProto or onnx_ir.Model; ours,
    onnxruntime's ``quantize_static`` or Quark's) onnxruntime's CPU provider runs as integer
    kernels, and which stay float, with the reason for each.

    ``plan_reasons``: {node name: reason} the quantizer knows (a node excluded by the user, left
    float for fidelity): it comes first in that node's reason."""
    from onnxopt.verify.runtime import OrtModel

    if provider != "cpu":
        raise UsageError(f"integer coverage: provider {provider!r}: only 'cpu' (onnxruntime's CUDA provider runs "
                         "QDQ models in float)")
    plan_reasons = dict(plan_reasons or {})
    m = OrtModel(model, "quantized model")
    try:
        opt = _optimized(m.source(), provider, threads)
        proto = m.proto
    finally:
        m.close()
    try:
        if proto.ByteSize() >= io.PROTO_LIMIT:
            raise ValueError("too large for onnx's shape inference")
        inferred = onnx.shape_inference.infer_shapes(proto)
        known = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info
                 if vi.type.tensor_type.elem_type}
    except Exception:  # noqa: BLE001 - propagation alone then
        known = {}
    q = _Graph(proto.graph, known)
    o = _Graph(opt.graph)
    opset = next((op.version for op in proto.opset_import if op.domain in ("", "ai.onnx")), 0)
    return _Analysis(q, o, opset, plan_reasons, provider).run()


class _Analysis:
    def __init__(self, q: _Graph, o: _Graph, opset: int, plan_reasons: dict, provider: str):
        self.q, self.o, self.opset, self.plan_reasons, self.provider = q, o, opset, plan_reasons, provider
        by_name: dict[str, int] = {}
        for i, n in enumerate(q.nodes):
            if n.name:
                by_name.setdefault(n.name, i)
        # optimized node -> QDQ node: by name (suffixes stripped), else by the outputs it writes
        self.mapped: dict[int, list[int]] = {}
        self.unmapped: list[int] = []
        for j, n in enumerate(o.nodes):
            i = self._by_name(n, by_name) if n.name else None
            if i is None:
                i = next((k for k in (self._through_outputs(x) for x in n.output if x)
                          if k is not None and _same_work(n, q.nodes[k])), None)
            if i is None:
                self.unmapped.append(j)
            else:
                self.mapped.setdefault(i, []).append(j)
        self.status: dict[int, tuple[str, str]] = {}  # QDQ node -> ("integer"|"float", kernel text)
        self.kernel_at: dict[int, int] = {}  # QDQ node -> the optimized node that does its work

    def _by_name(self, n, by_name: dict[str, int]) -> int | None:
        """The QDQ node an optimized node is named after: its name less onnxruntime's suffixes
        (``_token_<n>``, ``/duplicated``) and prefix (``fused `` of FusedGemm/FusedConv); an NCHWc
        Conv is named after the value it writes (``<value>_nchwc``): the Conv behind that value."""
        name = _base(n.name)
        name = name[len("fused "):] if name.startswith("fused ") else name
        if name in by_name:
            return by_name[name]
        if n.domain == "com.microsoft.nchwc" and name.endswith("_nchwc"):
            k = self.q.producer.get(name[: -len("_nchwc")])
            for _ in range(4):  # back through the activation / sum the NCHWc Conv absorbed
                if k is None or self.q.nodes[k].op_type == n.op_type:
                    break
                k = self.q.producer.get(_data_input(self.q.nodes[k]))
            return k if k is not None and self.q.nodes[k].op_type == n.op_type else None
        return None

    def _through_outputs(self, name: str) -> int | None:
        """The QDQ node that wrote ``name``: a compute node, or the one behind a QuantizeLinear."""
        i = self.q.producer.get(name)
        if i is None:
            return None
        n = self.q.nodes[i]
        if n.op_type == "QuantizeLinear":
            k = self.q.producer.get(n.input[0])
            return k if k is not None and self.q.nodes[k].op_type not in _QUANT else i
        return i

    def _kind(self, i: int) -> str | None:
        """"quant", "constant", "shape", "data movement" or "compute" for a QDQ-model node."""
        n = self.q.nodes[i]
        if n.op_type in _QUANT:
            return "quant"
        if n.op_type in _SHAPE_OPS or n.domain not in ("", "ai.onnx", "com.microsoft"):
            return "shape" if n.op_type in _SHAPE_OPS else "compute"
        if all(x in self.q.constants for x in n.input if x):
            return "constant"  # folded when the session loads
        data = [self.q.dtypes.get(x) for x in [*n.input, *n.output] if x]
        if data and not any(t in _FLOATS or t in _EIGHT_BIT for t in data if t is not None) and None not in data:
            return "shape"
        return "data movement" if n.op_type in DATA_MOVEMENT else "compute"

    def run(self) -> Coverage:
        q, o = self.q, self.o
        self._value_map()
        kinds = {i: self._kind(i) for i in range(len(q.nodes))}
        self.kinds = kinds
        entries: dict[int, object] = {}
        for i, n in enumerate(q.nodes):  # the nodes onnxruntime kept (as themselves or as a kernel of theirs)
            if kinds[i] in ("quant", "constant", "shape") or i not in self.mapped:
                continue
            kind, label = kinds[i], _label(n, i)
            opt = [o.nodes[j] for j in self.mapped[i]]
            k = next((x for x in opt if _is_integer_kernel(x)), None)
            if k is None and kind == "data movement":
                k = next((x for x in opt if o.dtypes.get(_data_input(x)) in _EIGHT_BIT), None)
            if k is not None:
                self.status[i] = ("integer", f"{k.op_type} {label!r}")
                self.kernel_at[i] = self.o.nodes.index(k)
                entries[i] = IntegerNode(label, n.op_type, k.op_type, kind)
                continue
            main = next((x for x in opt if _base(x.name) == n.name), opt[0])
            self.status[i] = ("float", f"{main.op_type} {label!r}")
            self.kernel_at[i] = self.o.nodes.index(main)
            entries[i] = FloatIsland(label, n.op_type, self._why(i, main), main.op_type, kind)
        self.entries = entries
        for i in range(len(q.nodes)):  # the nodes that vanished: inlined, fused into a neighbour, absorbed, removed
            if kinds[i] not in ("quant", "constant", "shape") and i not in entries:
                self._resolve(i, 0)
        integer, islands, movement = [], [], []
        for i in sorted(entries):
            e = entries[i]
            if isinstance(e, IntegerNode):
                integer.append(e)
            else:
                (movement if e.kind == "data movement" else islands).append(e)
        qdq_left = Counter()
        for n in o.nodes:
            if n.op_type == "QuantizeLinear":
                qdq_left["quantize"] += 1
            elif n.op_type == "DequantizeLinear":
                qdq_left["dequantize_constant" if n.input[0] in o.constants else "dequantize"] += 1
        taken = {j for js in self.mapped.values() for j in js}
        added = Counter(o.nodes[j].op_type for j in self.unmapped if j not in taken and o.nodes[j].op_type not in _QUANT)
        kernels = Counter(n.op_type for n in o.nodes)
        return Coverage(self.provider, integer, islands, movement, dict(qdq_left), dict(added), dict(kernels))

    # ---- nodes absent from the optimized graph ----

    def _value_map(self) -> None:
        """QDQ-model value -> optimized-graph value: the same name where onnxruntime kept it, else the
        value at the same slot of a node kept as the same op (onnxruntime renames the values around the
        Q/DQ it fuses: a QuantizeLinear it kept reads the value under another name)."""
        q, o = self.q, self.o
        o_values = set(o.producer) | {v.name for v in o.graph.input} | o.constants
        self.o_values = o_values
        vmap: dict[str, str] = {}
        for i, js in self.mapped.items():
            n = q.nodes[i]
            for j in js:
                m = o.nodes[j]
                if m.op_type != n.op_type or m.domain != n.domain:
                    continue
                for a, b in [*zip(n.input, m.input), *zip(n.output, m.output)]:
                    if a and b:
                        vmap.setdefault(a, b)
        self.vmap = vmap

    def _writer(self, name: str) -> int | None:
        """The optimized node that computes the QDQ value ``name`` (through the layout nodes onnxruntime
        added: Transpose, ReorderInput/ReorderOutput of NCHWc), or None."""
        o = self.o
        v = name if name in self.o_values else self.vmap.get(name)
        j = o.producer.get(v) if v else None
        for _ in range(4):
            if j is None or j in self.owner or o.nodes[j].op_type not in _LAYOUT:
                break
            j = o.producer.get(_data_input(o.nodes[j]))
        if j is None or o.nodes[j].op_type in _QUANT:
            return None
        return j

    @functools.cached_property
    def owner(self) -> dict[int, int]:
        return {j: i for i, js in self.mapped.items() for j in js}

    def _float_chain(self, j: int) -> list[int]:
        """The unmapped float nodes that compute the value ``o.nodes[j]`` writes, back to mapped nodes,
        Q/DQ or constants (an inlined function body: HardSigmoid, Mul for HardSwish)."""
        o, seen, stack = self.o, [], [j]
        while stack and len(seen) < 16:
            k = stack.pop()
            if k in seen or k in self.owner or o.nodes[k].op_type in _QUANT or _is_integer_kernel(o.nodes[k]):
                continue
            seen.append(k)
            stack += [p for x in o.nodes[k].input if x and x not in o.constants
                      for p in [o.producer.get(x)] if p is not None]
        return sorted(seen)

    def _inlined(self, i: int, chain: list[int]) -> bool:
        """``chain`` does exactly node ``i``'s work: onnxruntime names it after the function it inlined
        (``_inlfunc_<Op>``), or it reads nothing but ``i``'s own inputs."""
        q, o, n = self.q, self.o, self.q.nodes[i]
        tag = f"_inlfunc_{n.op_type}"
        if any(o.nodes[k].name.startswith(tag) or any(y.startswith(tag) for y in o.nodes[k].output) for k in chain):
            return True
        own = {self.vmap.get(x, x) for x in n.input if x}
        made = {y for k in chain for y in o.nodes[k].output}
        outside = {x for k in chain for x in o.nodes[k].input if x and x not in made and x not in o.constants}
        return bool(outside) and outside <= own

    def _resolve(self, i: int, depth: int) -> tuple[str, str]:
        """The status of a node absent from the optimized graph, from (1) the kernel that writes its
        output: an inlined function body (HardSwish as HardSigmoid+Mul), a float fusion onnxruntime added
        (BiasGelu; the nodes behind it that vanished too are fused into it), an integer kernel that
        absorbed it; else (2) the kernel of a consumer that reads the node's own inputs (an Add absorbed
        into SkipLayerNormalization); else (3) its producer's kernel, reached without passing a
        QuantizeLinear/DequantizeLinear: integer only when the node's outputs feed nothing but the
        QuantizeLinears that kernel absorbed (Relu/Clip into QLinearConv), or nodes fused the same way."""
        if i in self.entries:
            return self.status[i]
        if i in self.status:  # on the path being resolved: a cycle guard
            return self.status[i]
        q, o, n = self.q, self.o, self.q.nodes[i]
        kind, label = self.kinds[i], _label(n, i)
        fused_kind = "data movement" if kind == "data movement" else "fused"
        self.status[i] = ("float", "?")

        def fused(state, where, j, text=None):
            text = text or f"fused into {where}"
            if state == "integer":
                return self._set(i, state, where, j, IntegerNode(label, n.op_type, text, fused_kind))
            return self._set(i, state, where, j, FloatIsland(label, n.op_type, f"{text}, which runs in float", text,
                                                             fused_kind))

        if depth > 200:
            return self._set(i, "float", "removed", None, FloatIsland(label, n.op_type, "not traced to a kernel",
                                                                      "removed", fused_kind))
        # (1) the kernel that writes the node's output
        j = next((w for y in n.output if y for w in [self._writer(y)] if w is not None), None)
        if j is not None:
            w = o.nodes[j]
            src = self.owner.get(j)
            if src is not None:
                if src in self.entries:
                    state, where = self.status[src]
                else:
                    state, where = ("integer" if _is_integer_kernel(w) else "float"), \
                        f"{w.op_type} {_label(q.nodes[src], src)!r}"
                return fused(state, where, j)
            if _is_integer_kernel(w):
                return fused("integer", w.op_type, j)
            chain = self._float_chain(j)
            ops = "+".join(o.nodes[k].op_type for k in chain) or w.op_type
            for k in chain:
                self.mapped.setdefault(i, []).append(k)
                self.owner[k] = i
            if self._inlined(i, chain):
                return self._set(i, "float", f"{ops} {label!r}", j, FloatIsland(
                    label, n.op_type, self._why(i, o.nodes[chain[-1] if chain else j]), ops, kind))
            out = fused("float", ops, j, f"fused into {ops}")
            self.entries[i] = dataclasses.replace(self.entries[i], reason=f"fused by onnxruntime into float {ops}")
            self._fuse_behind(i, j, ops)
            return out
        # (2) a consumer whose kernel reads this node's inputs absorbed it
        own = {self.vmap.get(x, x) for x in n.input if x and x not in q.constants}
        feeds = []
        for y in n.output:
            for c in q.consumers.get(y, []):
                if q.nodes[c].op_type in _QUANT:
                    feeds.append(("quant", c))
                    continue
                if self.kinds.get(c) in ("constant", "shape"):
                    continue
                state, where = self._resolve(c, depth + 1)
                feeds.append((state, c))
                if i in self.entries:  # resolved on the way (fused behind a kernel found downstream)
                    return self.status[i]
                k = self.kernel_at.get(c)
                if k is not None and where not in ("?", "removed") and own & set(o.nodes[k].input):
                    return fused(state, where, k)
        # (3) the producer, not across a QuantizeLinear/DequantizeLinear
        src = self._producer(i)
        if src is not None:
            state, where = self._resolve(src, depth + 1)
            if where not in ("?", "removed"):
                quiet = all((s == "quant" and c not in self.mapped) or s == "integer" for s, c in feeds)
                if state == "integer" and not quiet:
                    return self._set(i, "float", "removed", None, FloatIsland(
                        label, n.op_type, f"not fused into {where}: its output feeds a float node", "removed",
                        fused_kind))
                return fused(state, where, self.kernel_at.get(src))
        if kind == "data movement" or n.op_type in ("Identity", "Dropout"):
            return self._set(i, "integer", "removed", None, IntegerNode(label, n.op_type, "removed by onnxruntime",
                                                                        "data movement"))
        return self._set(i, "float", "removed", None, FloatIsland(
            label, n.op_type, "removed by onnxruntime (merged with an identical node, or folded); not traced to a "
            "kernel", "removed", "fused"))

    def _fuse_behind(self, i: int, j: int, ops: str) -> None:
        """The nodes behind node ``i`` that vanished too, back to values the float kernel ``j`` (added by
        onnxruntime) reads or constants: fused into it (the bias Add and the Erf-GELU before BiasGelu)."""
        q, o = self.q, self.o
        reads = set()
        for k in self.mapped.get(i, [j]):
            reads |= {x for x in o.nodes[k].input if x}
        stack = [x for x in q.nodes[i].input if x]
        while stack:
            x = stack.pop()
            if x in q.constants or x in reads or self.vmap.get(x) in reads or x in self.o_values:
                continue
            p = q.producer.get(x)
            if p is None or p in self.entries or self.kinds.get(p) not in ("compute", "data movement"):
                continue
            pn = q.nodes[p]
            text = f"fused into {ops}"
            self._set(p, "float", ops, j, FloatIsland(_label(pn, p), pn.op_type, f"fused by onnxruntime into float "
                                                      f"{ops}", text, "data movement" if self.kinds[p] ==
                                                      "data movement" else "fused"))
            stack += [y for y in pn.input if y]

    def _set(self, i: int, state: str, where: str, kernel: int | None, entry) -> tuple[str, str]:
        self.status[i] = (state, where)
        self.entries[i] = entry
        if kernel is not None:
            self.kernel_at[i] = kernel
        return self.status[i]

    def _producer(self, i: int) -> int | None:
        """The node whose kernel could have absorbed node ``i``: the producer of one of its inputs, reached
        without passing a QuantizeLinear/DequantizeLinear (Conv/Gemm/MatMul first: they absorb activations
        and sums)."""
        q = self.q
        found = []
        for x in q.nodes[i].input:
            if not x or x in q.constants:
                continue
            k = q.producer.get(x)
            if k is None or q.nodes[k].op_type in _QUANT or self.kinds.get(k) in ("constant", "shape"):
                continue
            found.append(k)
        return next((k for k in found if q.nodes[k].op_type in _FUSION_TARGETS), found[0] if found else None)


    # ---- why a node stayed float ----

    def _why(self, i: int, opt_node) -> str:
        q, n = self.q, self.q.nodes[i]
        op = n.op_type
        reasons = []
        if n.name in self.plan_reasons:
            reasons.append(self.plan_reasons[n.name])
        supported = op in ORT_CPU_QDQ_OPS and n.domain in ("", "ai.onnx")
        if not supported:
            reasons.append(f"no integer kernel for {op} on onnxruntime {self.provider.upper()}")
        shared = []
        dq_params = []
        for slot, x in enumerate(n.input):
            if not x or q.dtypes.get(x) not in _FLOATS | {None}:
                continue
            p = q.producer_node(x)
            is_weight = slot == _WEIGHT_SLOT.get(op) and _constant_behind(q, x)
            is_bias = slot == _BIAS_SLOT.get(op)
            if p is None or p.op_type != "DequantizeLinear":
                if x in q.constants:
                    if is_bias or is_weight:
                        reasons.append(f"{'bias' if is_bias else 'weight'} {x!r} is float in the QDQ model")
                    continue
                reasons.append(f"input {x!r} not quantized (no DequantizeLinear before it)")
                continue
            if len(q.consumers.get(x, [])) > 1:
                shared.append(x)
            if is_bias and q.dtypes.get(p.input[0]) != TensorProto.INT32:
                reasons.append(f"bias {x!r} is not int32")
            elif slot == _WEIGHT_SLOT.get(op) and not _constant_behind(q, p.input[0]) and op in ("Conv", "Gemm"):
                reasons.append(f"weight {x!r} is not a constant")
            elif not is_weight and not is_bias:
                dq_params.append(p)
                t = q.dtypes.get(p.input[0])
                if t in (TensorProto.INT16, TensorProto.UINT16) and supported:
                    reasons.append(f"input {x!r} is 16-bit: onnxruntime's CPU {op} kernels take 8 bits")
        q_params = []
        for y in n.output:
            if not y:
                continue
            cons = [q.nodes[k] for k in q.consumers.get(y, [])]
            qs = [c for c in cons if c.op_type == "QuantizeLinear"]
            if y in q.outputs:
                reasons.append(f"output {y!r} is a graph output")
            elif not qs and op not in _OPTIONAL_Q:
                reasons.append(f"output {y!r} not quantized (no QuantizeLinear after it)")
            elif qs and len(cons) > len(qs):
                reasons.append(f"output {y!r} also feeds {len(cons) - len(qs)} float node(s) besides its "
                               "QuantizeLinear")
            q_params += qs
        if supported:
            reasons += self._selector_reasons(n, dq_params, q_params, opt_node)
        if not reasons:
            reasons.append("onnxruntime kept it float although its inputs and outputs are quantized "
                           "(no CPU selector matched the group)" + (
                               f"; its input {shared[0]!r} (a DequantizeLinear) also feeds "
                               f"{len(q.consumers[shared[0]]) - 1} other node(s)" if shared else ""))
        return "; ".join(dict.fromkeys(reasons))

    def _selector_reasons(self, n, dq_params, q_params, opt_node) -> list[str]:
        """Conditions of onnxruntime's CPU selectors a quantized group can still miss."""
        q, o, op = self.q, self.o, n.op_type
        out = []
        attrs = {a.name: a for a in n.attribute}
        if op == "MaxPool" and self.opset < 12:
            out.append(f"MaxPool at opset {self.opset}: 8-bit MaxPool needs opset 12")
        if op == "Gemm" and len(n.input) > 2 and n.input[2] and "beta" in attrs and attrs["beta"].f != 1.0:
            out.append(f"Gemm beta={attrs['beta'].f:g} (QGemm needs beta=1)")
        types = {q.dtypes.get(p.input[0]) for p in dq_params} | {q.dtypes.get(x.input[2]) if len(x.input) > 2 and
                                                                 x.input[2] else TensorProto.UINT8 for x in q_params}
        types.discard(None)
        if len(types) > 1 and op not in ("Conv", "MatMul", "Gemm"):
            out.append("its inputs and output mix int8 and uint8")
        if op in DATA_MOVEMENT and dq_params and q_params and not _same_params(q, dq_params[0], q_params[0]):
            out.append(f"input and output quantization parameters differ (onnxruntime drops the Q/DQ around {op} "
                       "only when they are equal)")
        # the optimized graph: 8-bit types after onnxruntime's int8 -> uint8 conversion of Q/DQ pairs (its x86
        # Conv/MatMul kernels take uint8 activations; it converts a pair only when one DequantizeLinear reads the Q)
        ins = {x: o.dtypes.get(p.input[0]) for x in opt_node.input if x
               for p in [o.producer_node(x)] if p is not None and p.op_type == "DequantizeLinear"
               and p.input[0] not in o.constants}
        outs = {o.dtypes.get(c.output[0]) for y in opt_node.output if y for c in
                (o.nodes[k] for k in o.consumers.get(y, [])) if c.op_type == "QuantizeLinear"}
        int8_in = next((x for x, t in ins.items() if t == TensorProto.INT8), None)
        why = "onnxruntime converts an int8 QuantizeLinear to uint8 only when one DequantizeLinear reads it"
        if int8_in is not None and op in ("Conv", "MatMul"):
            out.append(f"input {int8_in!r} stays int8 in onnxruntime's graph and its x86 {op} kernels take uint8 "
                       f"activations ({why})")
        elif len(({*ins.values()} | outs) & _EIGHT_BIT) > 1:
            out.append(f"its inputs and output mix int8 and uint8 in onnxruntime's graph ({why})")
        return out


def _same_work(opt_node, node) -> bool:
    """An optimized node found through its outputs is taken for ``node`` when it does that node's work: the
    same op, an integer kernel, or a fused float kernel (FusedConv for Conv); a layout Transpose writing a
    QuantizeLinear's output is not."""
    t = opt_node.op_type
    return (t == node.op_type or _is_integer_kernel(opt_node) or t.startswith("Fused") or t.endswith(node.op_type)) \
        and not (t in DATA_MOVEMENT and node.op_type not in DATA_MOVEMENT)


def _data_input(n) -> str:
    return next((x for x in n.input if x), "")


def _constant_behind(g: _Graph, name: str) -> bool:
    """``name`` is a constant, or a DequantizeLinear (or Transpose/Reshape) of one."""
    seen = 0
    while name and seen < 4:
        if name in g.constants:
            return True
        p = g.producer_node(name)
        if p is None or p.op_type not in ("DequantizeLinear", "Transpose", "Reshape", "Unsqueeze", "Cast"):
            return False
        name, seen = p.input[0], seen + 1
    return False


def _same_params(g: _Graph, dq, qn) -> bool:
    """A DequantizeLinear and a QuantizeLinear with equal scale and zero point (by name or value)."""
    for k in (1, 2):
        a = dq.input[k] if len(dq.input) > k else ""
        b = qn.input[k] if len(qn.input) > k else ""
        if a == b:
            continue
        va, vb = g.value(a) if a else np.zeros((), np.uint8), g.value(b) if b else np.zeros((), np.uint8)
        if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype or not np.array_equal(va, vb):
            return False
    return True
