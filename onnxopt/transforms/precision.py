"""float32 -> float16: weights and compute in half precision, precision-sensitive ops kept in float32.

:func:`convert_fp16` rewrites an ``onnx_ir`` model in place:

1. Each main-graph node that reads or writes float32 is classified:

   - *fp16*: its float32 inputs and outputs whose type constraint (the op's schema at the model's
     opset: onnx's, or onnxruntime's for com.microsoft ops) admits float16 become float16. Inputs
     of a fixed type (Resize's ``scales``, LayerNormalization's ``Mean``/``InvStdDev`` outputs) stay
     float32, as do shape-typed (integer) inputs, which are never touched.
   - *fp32*, with the reason: an op of the block list (:data:`DEFAULT_BLOCK_OPS`: reductions that
     accumulate, Exp/Pow/Log, Softmax's input, Range, Cumsum, ...; on the ``portable`` target also
     the normalization ops, whose statistics other runtimes may compute in float16 -- onnxruntime's
     kernels take float16 and compute them in float32, so on ``ort-cpu``/``ort-cuda`` they
     convert), a constant input beyond float16's range (|x| > 65504) or a constant whose largest
     magnitude is below float16's smallest normal (epsilons such as 1e-12), an op without
     float16 in its type constraint, a custom domain, a node with subgraphs, an input of unknown
     type, a node named in ``keep_nodes``.
   - *any*: reads float of either width and writes no float (Shape, Size, Cast to an integer):
     it takes whatever its input is, so it never needs a Cast.

2. Cheap ops (element-wise arithmetic, data movement, Cast from an integer) are *light*: they
   start in float16 unless one of their computed inputs is float32 (float32 spreads forward
   through them to the next heavy op), and then each is flipped, alone or with a light reader of
   the same precision, wherever that lowers the number of Casts the graph needs, until no flip
   does. Heavy ops (MatMul, Conv, Gemm, attention, normalization, ...) stay where step 1 put
   them: they are the point of fp16.

3. Casts go at region edges: a value read in the other precision gets one Cast per precision
   needed, shared by all its readers. Constants are converted, not cast (a weight read in both
   precisions is kept in both). On ``ort-cuda``, float32 sentinels (|x| >= 1e30: masks of
   ``finfo(float32).min``) become float16's +-65504 rather than +-inf (see :data:`SENTINEL`).
   With ``keep_io_types`` (the default) graph inputs and outputs keep float32 and their names.
   Cast pairs that compose exactly (float16 -> float32 -> float16, an integer -> float32 ->
   float16, float16 -> float32 -> an integer) are merged or cancelled, and an integer made
   float16 for float16 readers is cast from the integer directly for its float32 readers.

4. With measurements (``onnxopt.verify.fp16_fallback.convert_fp16_checked``, which ``optimize(precision="fp16",
   verify=...)`` uses on the verifier's inputs), the fewest heavy nodes that bring every output
   within the fidelity bounds stay float32.

Refused with a one-line ``UsageError``: a model that already computes in float16/bfloat16, and a
quantized one (its float parts are scales, not compute).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt import targets
from onnxopt.errors import UsageError
from onnxopt.ir.util import REPLACED_KEY, RULE_KEY, constant_tensor, fresh_namer, opset_of, subgraphs
from onnxopt.ir.optypes import Formal as _Formal, formal as _formal, infer_dtypes, type_str as _type_str

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14  # 6.1e-5
# float32 values this large are sentinels ("minus infinity" masks of finfo(float32).min), not data.
# With clamp_sentinels (the default on ort-cuda) they become float16's +-65504, as onnxruntime's
# own converter clamps them: masked attention then converts whole (a fused attention's bias stays
# finite). Float16 arithmetic absorbs a score into -65504 as float32 absorbs it into finfo.min, so
# a fully masked row stays uniform on the GPU; a runtime that adds in float32 (onnxruntime's CPU
# provider) keeps a trace of the scores there (GPT-2 dynamo, left-padded: 1.2% of the range at the
# padded positions, the others unchanged). Without it, their readers stay float32 (the default on
# ort-cpu and portable: exact masks, a few more Casts).
SENTINEL = 1e30
# Values observed at the data are kept float32 when they reach within this factor of 65504: other
# inputs than the sample may go further.
FP16_HEADROOM = 4.0
RANGE_CHUNK = 256  # values exposed per run when measuring value ranges (value_ranges)

F32, F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16

# Precision-sensitive ops kept in float32 (see the module docstring).
DEFAULT_BLOCK_OPS = frozenset({
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceProd", "Exp", "Pow", "Log", "LogSoftmax", "Range", "CumSum", "Einsum",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
    "EyeLike", "NonMaxSuppression", "RoiAlign", "TopK", "STFT", "DFT", "Det",
})
# Ops whose statistics onnxruntime computes in float32 from float16 inputs; converted on ort-*
# targets only (a portable runtime may accumulate in float16).
NORMALIZATION_OPS = frozenset({
    "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "RMSNormalization", "GroupNormalization", "InstanceNormalization",
    "LpNormalization", "MeanVarianceNormalization",
})
# Ops kept float32 on ort-cuda: onnxruntime's CUDA provider has no float16 kernel for them (FusedConv
# in float16 falls back to the CPU with Memcpy nodes: measured with onnxruntime-gpu 1.31.1, H200).
CUDA_FP32_OPS = frozenset({"FusedConv"})
# Ops that take their input's precision: float16 where it is, float32 where float32 reaches them.
# Softmax, by measurement: in float16 on the zoo's BERT/GPT-2/MiniLM exports it keeps the same
# fidelity as in float32 (cosine 1.0, max error 0.02-0.07% of the range either way) with a quarter
# of the Casts (BERT legacy: 3 instead of 11); but where a value that float16 cannot hold reaches it
# (a constant beyond 65504 keeps its reader float32), it stays float32 too.
FOLLOW_OPS = frozenset({"Softmax"})
# Cheap ops, flipped between precisions to minimize Casts.
LIGHT_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Reciprocal", "Relu", "LeakyRelu", "Sigmoid", "Tanh",
    "Erf", "Where", "Clip", "Max", "Min", "Floor", "Ceil", "Round", "Sign", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "IsNaN", "IsInf", "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus",
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Concat", "Split", "Slice", "Gather",
    "GatherElements", "GatherND", "Expand", "Tile", "Pad", "Cast", "ConstantOfShape", "Dropout", "Mod",
})
# Read float of either width, write no float: never need a Cast.
ANY_OPS = frozenset({"Shape", "Size"})
QUANT_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "MatMulInteger",
    "ConvInteger", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool",
    "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSoftmax", "QGemm", "QAttention", "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat", "MatMulNBits", "MatMulBnb4", "GatherBlockQuantized", "DynamicQuantizeLSTM",
})
_LOW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_FLOAT_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})


@dataclasses.dataclass
class Fp16Report:
    """What :func:`convert_fp16` did."""

    nodes_fp16: int = 0
    nodes_fp32: int = 0  # nodes reading or writing float32 that stayed so
    kept_fp32: dict[str, int] = dataclasses.field(default_factory=dict)  # "Op: reason" -> count
    casts_added: int = 0
    casts_merged: int = 0  # Cast pairs merged into one or cancelled
    casts: int = 0  # Cast nodes in the result (the model's own included)
    flips: int = 0  # light ops moved between precisions to save Casts
    initializers_converted: int = 0
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    keep_io_types: bool = True
    target: str = targets.PORTABLE
    fallback: dict | None = None  # convert_fp16_checked: the fidelity measured, the nodes kept in float32
    ranges: dict | None = None  # where value ranges came from, how many values cannot be float16

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kept_fp32"] = dict(sorted(self.kept_fp32.items(), key=lambda kv: (-kv[1], kv[0])))
        return d

    def summary(self) -> str:
        return (f"fp16: {self.nodes_fp16} nodes in float16, {self.nodes_fp32} kept in float32, "
                f"{self.casts} Casts ({self.casts_added} added, {self.casts_merged} pairs merged), "
                f"weights {self.weight_bytes_before / 2**20:.1f} -> {self.weight_bytes_after / 2**20:.1f} MiB")


# --------------------------------------------------------------------------------------------
# Refusals


def check_convertible(model: ir.Model) -> None:
    """Raise UsageError (one line) for a model :func:`convert_fp16` refuses: already in
    float16/bfloat16, or quantized."""
    quant = sorted({n.op_type for n in model.graph.all_nodes() if n.op_type in QUANT_OPS})
    if quant:
        raise UsageError(f"precision fp16: the model is quantized ({', '.join(quant[:3])}); fp16 conversion takes a "
                         f"float32 model")
    low = [v.name for v in model.graph.initializers.values() if v.dtype in _LOW]
    low += [v.name for v in model.graph.inputs if v.dtype in _LOW]
    for node in model.graph.all_nodes():
        if node.op_type == "Cast" and (to := node.attributes.get("to")) is not None and \
                ir.DataType(to.value) in _LOW:
            low.append(node.name)
        low += [v.name for v in node.outputs if v.dtype in _LOW]
    if low:
        raise UsageError(f"precision fp16: the model already computes in float16/bfloat16 ({len(low)} value(s), "
                         f"e.g. {low[0]!r}); fp16 conversion takes a float32 model")


# --------------------------------------------------------------------------------------------
# Schemas: which inputs/outputs a type constraint lets become float16


# (onnxopt.ir.optypes: each op's formal parameters, onnx's schema or onnxruntime's for com.microsoft)


# --------------------------------------------------------------------------------------------
# Planning


@dataclasses.dataclass
class _Plan:
    kind: str  # "fp16" | "fp32" | "any"
    light: bool = False
    forced: bool = False  # fp32 by the block list or a constant: never flipped
    conv_in: frozenset = frozenset()  # float32 input positions that are float16 when kind == "fp16"
    conv_out: frozenset = frozenset()
    reason: str | None = None


class _Converter:
    def __init__(self, model: ir.Model, keep_io_types: bool, block_ops: frozenset, target: str,
                 keep_nodes: frozenset = frozenset(), clamp_sentinels: bool | None = None,
                 ranges: dict | None = None):
        self.keep_nodes = keep_nodes
        self.ranges = ranges  # value name -> (min, max) at the data (value_ranges), or None: bounds only
        self.limits: dict[str, str] = {}  # value name -> why it cannot be float16 (its range or spacing)
        self.sentinel = SENTINEL if (target == targets.ORT_CUDA if clamp_sentinels is None else clamp_sentinels) \
            else float("inf")
        self.model, self.graph = model, model.graph
        self.keep_io = keep_io_types
        self.block = block_ops
        self.target = target
        self.opsets = dict(model.opset_imports)
        self.nodes = list(self.graph)
        self.in_graph = set(self.nodes)
        self.dtype: dict[ir.Value, ir.DataType | None] = {}
        self.plans: dict[ir.Node, _Plan] = {}
        self.report = Fp16Report(keep_io_types=keep_io_types, target=target)

    # -- types --------------------------------------------------------------------------------
    def dt(self, v: ir.Value | None) -> ir.DataType | None:
        if v is None:
            return None
        if v in self.dtype:
            return self.dtype[v]
        return v.dtype if v.type is not None else (v.const_value.dtype if v.const_value is not None else None)

    def _infer_types(self) -> None:
        """Every main-graph value's dtype: declared, else from the producer's schema
        (:func:`onnxopt.ir.optypes.infer_dtypes`)."""
        self.dtype.update(infer_dtypes(self.graph, self.opsets))

    def _schema(self, node: ir.Node) -> _Formal | None:
        dom = "" if node.domain == "ai.onnx" else node.domain
        return _formal(dom, node.op_type, opset_of(self.opsets, dom))

    # -- classification -----------------------------------------------------------------------
    def _classify(self, node: ir.Node) -> _Plan | None:
        f_in = [i for i, v in enumerate(node.inputs) if self.dt(v) == F32]
        f_out = [i for i, v in enumerate(node.outputs) if self.dt(v) == F32]
        if not f_in and not f_out:
            return None
        op = node.op_type
        if op == "Constant" and node.domain in ("", "ai.onnx"):
            return None  # a constant: converted where read in float16, never cast
        light = op in LIGHT_OPS

        def fp32(reason: str, forced: bool = True) -> _Plan:
            return _Plan("fp32", light=light and not forced, forced=forced, reason=f"{op}: {reason}")

        if node.domain not in _FLOAT_DOMAINS:
            return fp32(f"custom domain {node.domain}")
        if any(True for _ in subgraphs(node)):
            return fp32("has subgraphs")
        if node.domain in ("", "ai.onnx"):
            if op == "Cast":
                if f_in:  # float32 -> anything: reads float16 as well (the fp16 -> fp32 step is exact)
                    return _Plan("any")
                return _Plan("fp16", light=True, conv_out=frozenset(f_out))  # integer -> float: a source
            if op in ANY_OPS:
                return _Plan("any")
            if op == "ConstantOfShape":
                a = node.attributes.get("value")
                t = a.value.numpy() if a is not None else np.zeros(1, np.float32)
                if not _fits(t, self.sentinel):
                    return fp32("value beyond float16's range")
                return _Plan("fp16", light=True, conv_out=frozenset(f_out))
        if op in self.block:
            return fp32("block list")
        if node.name in self.keep_nodes:
            return fp32("kept in float32 by name (keep_nodes)")
        if op in CUDA_FP32_OPS and self.target == targets.ORT_CUDA:
            return fp32("no float16 kernel on onnxruntime's CUDA provider")
        if op in NORMALIZATION_OPS and self.target == targets.PORTABLE:
            return fp32("normalization statistics (portable target; ort-* targets convert it)")
        formal = self._schema(node)
        if formal is None:
            return fp32("no schema known")
        conv_in, conv_out, vars_ = set(), set(), set()
        for side, idx, params, vals in (("in", f_in, formal.inputs, node.inputs),
                                        ("out", f_out, formal.outputs, node.outputs)):
            for i in idx:
                ts = _type_str(params, i)
                if ts is None:
                    return fp32("more float inputs than its schema")
                if ts.startswith("tensor("):
                    continue  # a fixed type (Resize's scales): stays float32
                if "tensor(float16)" not in formal.allowed.get(ts, ()):
                    continue  # a type var without float16 (LayerNormalization's Mean): stays float32
                vars_.add(ts)
                (conv_in if side == "in" else conv_out).add(i)
        # every input bound to a converted type var must be float32 now (known), or it would mismatch
        for j, inp in enumerate(node.inputs):
            if inp is not None and j not in conv_in and _type_str(formal.inputs, j) in vars_:
                return fp32("an input of unknown type")
        for j, out in enumerate(node.outputs):
            if j not in conv_out and _type_str(formal.outputs, j) in vars_ and self.dt(out) is None:
                return fp32("an output of unknown type")
        if not conv_in and not conv_out:
            return fp32("no float16 in its type constraint")
        for side, idx, vals in (("output", conv_out, node.outputs), ("input", conv_in, node.inputs)):
            for j in sorted(idx):
                lim = self.limits.get(vals[j].name) if vals[j] is not None else None
                if lim:
                    return fp32(("its output is " if side == "output" else "reads a value ") + _LIMIT_TEXT[lim[0]])
        for j in conv_in:
            t = constant_tensor(node.inputs[j])
            if t is not None:
                why = _range_problem(t.numpy(), self.sentinel)
                if why and not (why == _TINY and op in ("Add", "Sub") and not _guards_division(node)):
                    return fp32(why if why != _TINY or op not in ("Add", "Sub") else why + ", guarding a division "
                                "or root")
        return _Plan("fp16", light=light, conv_in=frozenset(conv_in), conv_out=frozenset(conv_out))

    # -- precision of values, what readers need -----------------------------------------------
    def prec(self, v: ir.Value) -> ir.DataType | None:
        """The dtype ``v`` will have (for float32 values), None for a constant (converted freely)."""
        p = v.producer()
        if p is None:
            if v.is_graph_input():  # (an overridable initializer keeps its float32 default)
                return F32 if self.keep_io or v.is_initializer() else F16
            if v.const_value is not None:
                return None
            return F32
        if p.op_type == "Constant" and p.domain in ("", "ai.onnx"):
            return None
        plan = self.plans.get(p)
        if p not in self.in_graph or plan is None:
            return F32
        if plan.kind == "fp16" and v.index() in plan.conv_out:
            return F16
        return F32

    def need(self, node: ir.Node, i: int) -> ir.DataType | None:
        if node not in self.in_graph:
            return F32  # a reader in a subgraph
        plan = self.plans.get(node)
        if plan is None:
            return F32
        if plan.kind == "any":
            return None
        return F16 if plan.kind == "fp16" and i in plan.conv_in else F32

    def needs(self, v: ir.Value) -> set:
        out = {self.need(n, i) for n, i in v.uses()}
        if v.is_graph_output():
            out.add(F32 if self.keep_io else F16)
        out.discard(None)
        return out

    def casts_on(self, v: ir.Value) -> int:
        if self.dt(v) != F32 or constant_tensor(v) is not None:
            return 0
        p = self.prec(v)
        if p is None:
            return 0
        return len(self.needs(v) - {p})

    # -- the plan -------------------------------------------------------------------------------
    def plan(self) -> None:
        self._infer_types()
        self.limits = self._limits()
        self.report.ranges = {"source": (f"values at the data ({len(self.ranges)} float values observed)"
                                         if self.ranges is not None else
                                         "bounds from the weights and constants (interval propagation)"),
                              "values_kept": len(self.limits),
                              "values": {k: d for k, (_, d) in sorted(self.limits.items())[:20]}}
        for node in self.nodes:
            plan = self._classify(node)
            if plan is not None:
                self.plans[node] = plan
        # float32 spreads forward through light ops
        for node in self.nodes:
            plan = self.plans.get(node)
            follow = node.op_type in FOLLOW_OPS and node.domain in ("", "ai.onnx")
            if plan is None or not (plan.light or follow) or plan.kind != "fp16":
                continue
            if any(self.prec(node.inputs[i]) == F32 for i in plan.conv_in if node.inputs[i] is not None):
                plan.kind = "fp32"
                if follow:
                    plan.forced = True
                    plan.reason = f"{node.op_type}: its input is float32 (a mask beyond float16's range upstream)"
        # then flip light ops, one at a time or two neighbours together, wherever that saves Casts
        light = [n for n in self.nodes if (p := self.plans.get(n)) is not None and p.light and not p.forced
                 and (p.conv_in or p.conv_out)]
        flippable = set(light)
        for _ in range(64):
            changed = False
            for node in light:
                if self._try_flip((node,)):
                    changed = True
                    continue
                kind = self.plans[node].kind
                for out in node.outputs:
                    for reader, _ in out.uses():
                        if reader in flippable and reader is not node and self.plans[reader].kind == kind \
                                and self._try_flip((node, reader)):
                            changed = True
                            break
                    else:
                        continue
                    break
            if not changed:
                break

    def _limits(self) -> dict[str, tuple[str, str]]:
        """Values that cannot be float16: at the data (``ranges``), those reaching beyond
        float16's range with :data:`FP16_HEADROOM` to spare, or whose float16 spacing at their
        magnitude is more than FP16_MAX_ERROR of their spread over the data ((x + 1000) - 1000: 0.5
        at 1000); without data, those whose bound from the weights and constants exceeds 65504."""
        out: dict[str, tuple[str, str]] = {}
        if self.ranges is not None:
            for name, (lo, hi) in self.ranges.items():
                top = max(abs(lo), abs(hi))
                if top > FP16_MAX / FP16_HEADROOM:
                    out[name] = ("range", f"reaches {top:.4g} at the data")
                    continue
                spread = hi - lo
                if spread > 0 and top >= FP16_MIN_NORMAL:
                    half = float(np.spacing(np.float16(top))) / 2  # float16's rounding error at that magnitude
                    if half > targets.FP16_MAX_ERROR * spread:
                        out[name] = ("spacing", f"float16 rounds by up to {half:g} at {top:.4g}, {half / spread:.1%} "
                                                f"of its spread at the data ({spread:.4g})")
            return out
        for name, b in _bounds(self).items():
            if FP16_MAX < b < SENTINEL:  # (a mask of finfo.min overflowing to -inf keeps its meaning)
                out[name] = ("bound", f"can reach {b:.4g} (bound from the weights and constants)")
        return out

    def _try_flip(self, nodes: tuple) -> bool:
        """Flip the light ``nodes`` to the other precision if that lowers the Casts around them."""
        touched = {v for n in nodes for v in (*n.inputs, *n.outputs) if v is not None and self.dt(v) == F32}
        before = sum(self.casts_on(v) for v in touched)
        for n in nodes:
            plan = self.plans[n]
            plan.kind = "fp32" if plan.kind == "fp16" else "fp16"
        if sum(self.casts_on(v) for v in touched) < before:
            self.report.flips += len(nodes)
            return True
        for n in nodes:
            plan = self.plans[n]
            plan.kind = "fp32" if plan.kind == "fp16" else "fp16"
        return False

    # -- rewriting ------------------------------------------------------------------------------
    def apply(self) -> Fp16Report:
        graph, rep = self.graph, self.report
        names = {v.name for v in _all_values(graph) if v.name}
        counter = collections.Counter()

        fresh = fresh_namer(names)

        rep.weight_bytes_before = sum(v.const_value.nbytes for v in graph.initializers.values()
                                      if v.const_value is not None)
        # 1. constants read in float16: converted (or copied when also read in float32)
        for v in list(graph.initializers.values()):
            if v.is_graph_input() or v.const_value is None or v.dtype != F32:
                continue
            uses = v.uses()
            half = [(n, i) for n, i in uses if self.need(n, i) == F16]
            if not half:
                continue
            arr = _half(v.const_value.numpy(), self.sentinel)
            full = [(n, i) for n, i in uses if self.need(n, i) != F16]
            if not full and not v.is_graph_output():
                v.const_value = ir.tensor(arr, name=v.name)
                v.type = ir.TensorType(F16)
            else:
                new = ir.Value(name=fresh(f"{v.name}_fp16"), type=ir.TensorType(F16), shape=v.shape,
                               const_value=ir.tensor(arr, name=None))
                new.const_value.name = new.name
                graph.register_initializer(new)
                for n, i in half:
                    n.replace_input_with(i, new)
            rep.initializers_converted += 1
        # Constant nodes read in float16 (graph-output constants the lifting left): a float16 copy
        for node in self.nodes:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
                continue
            v = node.outputs[0]
            t = constant_tensor(v)
            half = [(n, i) for n, i in v.uses() if self.need(n, i) == F16]
            if t is None or t.dtype != F32 or not half:
                continue
            new = ir.Value(name=fresh(f"{v.name}_fp16"), type=ir.TensorType(F16), shape=v.shape,
                           const_value=ir.tensor(_half(t.numpy(), self.sentinel), name=None))
            new.const_value.name = new.name
            graph.register_initializer(new)
            for n, i in half:
                n.replace_input_with(i, new)
        # 2. node attributes that set a float32 output
        for node, plan in self.plans.items():
            if plan.kind != "fp16":
                continue
            if node.op_type == "Cast":
                node.attributes["to"] = ir.AttrInt64("to", F16.value)
            elif node.op_type == "ConstantOfShape":
                a = node.attributes.get("value")
                t = a.value.numpy() if a is not None else np.zeros(1, np.float32)
                node.attributes["value"] = ir.AttrTensor("value", ir.tensor(_half(t, self.sentinel)))
        # 3. values: new types, Casts where readers need the other precision
        values = [v for v in graph.inputs if self.dt(v) == F32]
        values += [v for n in self.nodes for v in n.outputs if self.dt(v) == F32]
        precs = {v: self.prec(v) for v in values}
        wanted = {}
        for v in values:
            p = precs[v]
            if p is None:
                continue
            wanted[v] = (p, [(n, i, self.need(n, i)) for n, i in v.uses()])
        for v, (p, uses) in wanted.items():
            if p == F16:
                v.type = ir.TensorType(F16)
            made: dict[ir.DataType, ir.Value] = {}
            for n, i, q in uses:
                if q is None or q == p:
                    continue
                if q not in made:
                    made[q] = self._cast(v, q, fresh(f"{v.name}_to_{'fp16' if q == F16 else 'fp32'}"), fresh)
                n.replace_input_with(i, made[q])
            io_type = F32 if self.keep_io else F16
            if v.is_graph_output() and p != io_type:
                # the graph output keeps its name and type: a Cast takes both
                name = v.name
                v.name = fresh(f"{name}_{'fp16' if p == F16 else 'fp32'}")
                cast = self._cast(v, io_type, name, fresh)
                for k, out in enumerate(graph.outputs):
                    if out is v:
                        graph.outputs[k] = cast
            if v.is_graph_input() and p == F16:
                pass  # keep_io_types=False: the input itself is float16 (type set above)
        rep.casts_added = sum(1 for n in graph if n.meta.get(_MADE))
        # 4. Cast pairs that compose exactly
        rep.casts_merged = _merge_cast_pairs(graph)
        _remove_dead(graph)
        rep.weight_bytes_after = sum(v.const_value.nbytes for v in graph.initializers.values()
                                     if v.const_value is not None)
        for node, plan in self.plans.items():
            if node.graph is not graph:
                continue
            if plan.kind == "fp16":
                rep.nodes_fp16 += 1
            elif plan.kind == "fp32":
                rep.nodes_fp32 += 1
                counter[plan.reason or f"{node.op_type}: float32 by its neighbours (fewer Casts)"] += 1
        rep.kept_fp32 = dict(counter)
        rep.casts = sum(1 for n in graph if n.op_type == "Cast")
        return rep

    def _cast(self, v: ir.Value, to: ir.DataType, name: str, fresh) -> ir.Value:
        out = ir.Value(name=name, type=ir.TensorType(to), shape=v.shape)
        node = ir.Node("", "Cast", [v], [ir.AttrInt64("to", to.value)], outputs=[out],
                       name=fresh(f"{name}_cast"))
        node.meta[_MADE] = True
        node.metadata_props[RULE_KEY] = "fp16"
        node.metadata_props[REPLACED_KEY] = "[]"  # inserted: it replaced nothing
        p = v.producer()
        if p is not None and p.graph is self.graph:
            self.graph.insert_after(p, node)
        else:
            self.graph.insert_before(self.graph.node(0), node) if len(self.graph) else self.graph.append(node)
        return out


_MADE = "onnxopt.fp16_cast"


def _half(a: np.ndarray, sentinel: float = SENTINEL) -> np.ndarray:
    """float32 -> float16, sentinels (|x| >= ``sentinel``) to +-65504 rather than +-inf."""
    a = np.asarray(a)
    big = np.isfinite(a) & (np.abs(a) >= sentinel)
    if big.any():
        a = np.where(big, np.sign(a) * FP16_MAX, a)
    return a.astype(np.float16)


def _fits(a: np.ndarray, sentinel: float = SENTINEL) -> bool:
    a = np.asarray(a, np.float64)
    finite = np.abs(a[np.isfinite(a)])
    finite = finite[finite < sentinel]
    return not finite.size or float(finite.max()) <= FP16_MAX


# Interval propagation (magnitude bounds |x| <= B), for the conversion without data: sound bounds
# from the weights and constants where an op's output is bounded whatever its input (Sigmoid, Tanh,
# Softmax, a normalization) and through the ops after it; a graph input is unbounded (inf).
_UNIT = frozenset({"Sigmoid", "Tanh", "Softmax", "Erf", "Sin", "Cos", "HardSigmoid"})
_SAME = frozenset({"Relu", "Abs", "Neg", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
                   "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Dropout", "MaxPool",
                   "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Split", "Floor", "Ceil", "Round",
                   "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin", "ReduceMean", "Sign", "Shrink",
                   "ThresholdedRelu", "Softsign"})
_EITHER = frozenset({"Concat", "Max", "Min", "Mean"})


def _bounds(conv: "_Converter") -> dict[str, float]:
    """A bound on |x| for each float32 value of the main graph (inf where none is known)."""
    inf = float("inf")
    B: dict[ir.Value, float] = {}

    def const(v: ir.Value) -> np.ndarray | None:
        t = constant_tensor(v)
        return None if t is None or t.dtype not in (F32, ir.DataType.DOUBLE) else np.asarray(t.numpy(), np.float64)

    def bound(v: ir.Value | None) -> float:
        if v is None:
            return 0.0
        if v in B:
            return B[v]
        a = const(v)
        if a is None:
            return inf
        a = np.abs(a[np.isfinite(a)]) if a.size else a
        b = float(a.max()) if a.size else 0.0
        return inf if b >= SENTINEL else b  # (sentinel masks: handled as constants are)

    def attr(node, name, default):
        a = node.attributes.get(name)
        return a.value if a is not None else default

    for node in conv.nodes:
        if node.domain not in ("", "ai.onnx") or not node.outputs or conv.dt(node.outputs[0]) != F32:
            continue
        op, ins = node.op_type, list(node.inputs)
        b = inf
        try:
            if op in _UNIT:
                b = 1.0
            elif op in _SAME or (op == "LeakyRelu" and abs(attr(node, "alpha", 0.01)) <= 1):
                b = bound(ins[0])
            elif op in _EITHER:
                b = max((bound(v) for v in ins), default=inf)
            elif op == "Where":
                b = max(bound(ins[1]), bound(ins[2]))
            elif op in ("Add", "Sub", "Sum"):
                b = sum(bound(v) for v in ins)
            elif op == "Mul":
                b = bound(ins[0]) * bound(ins[1])
            elif op == "Div":
                d = const(ins[1])
                if d is not None and d.size and np.all(np.abs(d) > 0):
                    b = bound(ins[0]) / float(np.abs(d).min())
            elif op == "Clip":
                lim = [np.abs(c).max() for c in (const(v) for v in ins[1:3] if v is not None)
                       if c is not None and c.size]
                b = min([bound(ins[0]), *lim]) if len(lim) == 2 else bound(ins[0])
            elif op == "Pad":
                b = max(bound(ins[0]), bound(ins[2]) if len(ins) > 2 else 0.0)
            elif op in ("MatMul", "Gemm"):
                w = const(ins[1])
                if w is not None and w.ndim >= 2:
                    if op == "Gemm" and attr(node, "transB", 0):
                        w = w.T
                    gain = float(np.abs(w).sum(axis=-2).max())
                    b = bound(ins[0]) * gain
                    if op == "Gemm":
                        b = b * abs(attr(node, "alpha", 1.0)) + abs(attr(node, "beta", 1.0)) * \
                            (bound(ins[2]) if len(ins) > 2 else 0.0)
            elif op == "Conv":
                w = const(ins[1])
                if w is not None and w.ndim >= 3:
                    gain = float(np.abs(w).reshape(w.shape[0], -1).sum(axis=1).max())
                    b = bound(ins[0]) * gain + (bound(ins[2]) if len(ins) > 2 else 0.0)
            elif op == "BatchNormalization" and len(ins) >= 5:
                sc, bi, mu, var = (const(v) for v in ins[1:5])
                if all(x is not None for x in (sc, bi, mu, var)):
                    g = np.abs(sc) / np.sqrt(var + attr(node, "epsilon", 1e-5))
                    b = float((g * (bound(ins[0]) + np.abs(mu)) + np.abs(bi)).max())
            elif op == "LayerNormalization":
                shape = ins[0].shape
                axis = attr(node, "axis", -1)
                dims = list(shape)[axis:] if shape is not None else None
                if dims and all(isinstance(d, int) for d in dims):
                    n = float(np.prod(dims))
                    b = np.sqrt(n) * bound(ins[1]) + (bound(ins[2]) if len(ins) > 2 else 0.0)
        except (TypeError, ValueError, IndexError):  # a shape or constant this analysis does not follow
            b = inf
        for out in node.outputs:
            if conv.dt(out) == F32:
                B[out] = float(b) if b == b else inf
    return {v.name: b for v, b in B.items() if v.name}


def value_ranges(model: bytes, feeds_list, sentinel: float = SENTINEL) -> dict[str, tuple[float, float]]:
    """(min, max) of each float32 value of the main graph (graph inputs, node outputs) over the
    runs of the float32 ``model`` on ``feeds_list`` (onnxruntime's CPU provider, its graph
    optimizations off so each value is the graph's own); non-finite values and sentinels
    (|x| >= ``sentinel``: masks of finfo(float32).min, whose overflow to -inf in float16 keeps
    their meaning; the sentinel policy decides their readers) left out."""
    import onnxruntime as ort

    proto = onnx.load_from_string(model)
    m = ir.serde.deserialize_model(proto)
    dt = infer_dtypes(m.graph, dict(m.opset_imports))
    inputs = {i.name for i in proto.graph.input}
    names = [v.name for n in m.graph for v in n.outputs if v.name and dt.get(v) == F32]
    names = [n for n in dict.fromkeys(names) if n not in inputs]
    want = set(names) | {v.name for v in m.graph.inputs if v.name and v.type is not None and v.dtype == F32}
    del m, dt
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ranges: dict[str, list[float]] = {}

    def take(name: str, a) -> None:
        if name not in want or not isinstance(a, np.ndarray) or a.dtype != np.float32:
            return
        a = a[np.isfinite(a) & (np.abs(a) < sentinel)]
        if a.size:
            lo, hi = float(a.min()), float(a.max())
            r = ranges.setdefault(name, [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)

    for feeds in feeds_list:
        for k, v in feeds.items():
            take(k, v)
    # the values exposed RANGE_CHUNK at a time: one run each, so that no more than that many
    # activations are alive at once beside the run's own
    for start in range(0, len(names), RANGE_CHUNK):
        chunk = names[start:start + RANGE_CHUNK]
        p = onnx.ModelProto()
        p.CopyFrom(proto)
        del p.graph.output[:]
        for name in chunk:
            vi = p.graph.output.add()
            vi.name = name
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        sess = ort.InferenceSession(p.SerializeToString(), so, providers=["CPUExecutionProvider"])
        del p
        for feeds in feeds_list:
            for name, a in zip(chunk, sess.run(chunk, {i.name: feeds[i.name] for i in sess.get_inputs()})):
                take(name, a)
        del sess
    return {k: (v[0], v[1]) for k, v in ranges.items()}


_TINY = "a constant below float16's smallest normal (|x| < 6.1e-5)"
_LIMIT_TEXT = {  # why a value cannot be float16 (Converter._limits)
    "range": "beyond float16's range at the data (|x| > 65504/4: float16 overflows to inf)",
    "spacing": "too fine for float16 at its magnitude at the data (float16's rounding > 1% of its spread)",
    "bound": "beyond float16's range by the bounds from the weights and constants (|x| may exceed 65504)",
}
_DIVIDING = {"Sqrt": (0,), "Reciprocal": (0,), "Div": (1,), "Log": (0,), "Pow": (0,)}


def _guards_division(node: ir.Node) -> bool:
    """A tiny constant added in ``node`` is an epsilon that matters: its output is a denominator, a
    root's or a log's argument (``var + 1e-12`` before Sqrt/Div). Elsewhere (a bias that happens to
    be tiny) float16 flushing it changes nothing the other operand does not dwarf. (A tiny factor,
    in Mul or Div, always keeps its reader float32: float16 keeps few of its digits.)"""
    return any(i in _DIVIDING.get(reader.op_type, ()) for out in node.outputs for reader, i in out.uses())


def _range_problem(a: np.ndarray, sentinel: float = SENTINEL) -> str | None:
    """Why a float32 constant cannot be float16, or None."""
    a = np.asarray(a, np.float64)
    finite = np.abs(a[np.isfinite(a)])
    if not finite.size:
        return None
    data = finite[finite < sentinel]  # sentinels (masks) become +-65504: see _half
    if not data.size:
        return None
    top = float(data.max())
    if top > FP16_MAX:
        return "a constant beyond float16's range (|x| > 65504)"
    if 0 < top < FP16_MIN_NORMAL:
        return _TINY
    return None


def _all_values(graph: ir.Graph) -> Iterable[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph.all_nodes():
        yield from node.outputs


# exact compositions Cast(A -> B) then Cast(B -> C): A -> B loses nothing C needs
_INTS = {ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.INT32,
         ir.DataType.UINT32, ir.DataType.INT64, ir.DataType.UINT64}


def _composes(a: ir.DataType, b: ir.DataType, c: ir.DataType) -> bool:
    if b != F32:
        return False
    if a == F16:  # float16 -> float32 is exact
        return True
    if a == ir.DataType.BOOL:
        return True
    if a in _INTS and c == F16:
        # an integer through float32 to float16: equal to the direct cast (below 2**24 float32 is
        # exact; above, both overflow float16 to inf)
        return True
    return False


def _merge_cast_pairs(graph: ir.Graph) -> int:
    merged = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
            continue
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        if inner is None or inner.op_type != "Cast" or inner.domain not in ("", "ai.onnx") or inner.graph is not graph:
            continue
        src = inner.inputs[0]
        a, b = src.dtype if src.type is not None else None, ir.DataType(inner.attributes["to"].value)
        c = ir.DataType(node.attributes["to"].value)
        if a is None:
            continue
        if b == F16 and c == F32 and (a in _INTS or a == ir.DataType.BOOL):
            # an integer made float16 (for float16 readers), read in float32: cast the integer
            # directly, as the original did (float16 would round integers above 2048)
            node.replace_input_with(0, src)
            merged += 1
            continue
        if not _composes(a, b, c):
            continue
        out = node.outputs[0]
        if a == c:
            if out.is_graph_output():
                continue  # the output's name needs a node to carry it
            out.replace_all_uses_with(src)
        else:
            node.replace_input_with(0, src)
        merged += 1
    return merged


def _remove_dead(graph: ir.Graph) -> None:
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if node.op_type in ("Cast", "Constant") and not any(o.uses() or o.is_graph_output() for o in node.outputs):
                graph.remove(node, safe=True)
                changed = True
    for name, v in list(graph.initializers.items()):
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input():
            del graph.initializers[name]


def convert_fp16(model: ir.Model, *, keep_io_types: bool = True, block_ops: Iterable[str] | None = None,
                 target: str | None = None, keep_nodes: Iterable[str] = (),
                 clamp_sentinels: bool | None = None, ranges: dict | None = None) -> Fp16Report:
    """Convert ``model`` (in place) from float32 to float16 compute and weights; returns what was done.

    ``keep_io_types``: graph inputs and outputs keep float32 (Casts at the edges); else float32
    inputs and outputs become float16. ``block_ops``: op types kept in float32 (default
    :data:`DEFAULT_BLOCK_OPS`). ``target``: ``portable`` keeps the normalization ops in float32
    too; ``ort-cpu``/``ort-cuda`` (whose kernels compute their statistics in float32) convert them.
    ``keep_nodes``: names of nodes kept in float32 (see ``onnxopt.verify.fp16_fallback.convert_fp16_checked``).
    ``clamp_sentinels``: float32 constants of magnitude >= 1e30 (``finfo(float32).min`` masks)
    become +-65504 instead of keeping their readers in float32 (default: on for ``ort-cuda`` only;
    see :data:`SENTINEL`).
    ``ranges``: ``{value name: (min, max)}`` at data (:func:`value_ranges`): values reaching near
    float16's range, or whose float16 spacing is coarse against their spread, keep their producers
    and float16 readers float32; without it, bounds from the weights and constants do (a value
    that can exceed 65504 whatever the inputs).
    Raises ``UsageError`` for a model already in float16/bfloat16 or quantized."""
    check_convertible(model)
    return planned(model, keep_io_types=keep_io_types, block_ops=block_ops, target=target, keep_nodes=keep_nodes,
                   clamp_sentinels=clamp_sentinels, ranges=ranges).apply()


def planned(model: ir.Model, *, keep_io_types: bool = True, block_ops: Iterable[str] | None = None,
            target: str | None = None, keep_nodes: Iterable[str] = (), clamp_sentinels: bool | None = None,
            ranges: dict | None = None):
    """The conversion :func:`convert_fp16` makes, planned and not yet applied: ``.plans`` (node -> its
    plan: ``kind`` "fp16" or kept, ``light``) and ``.apply()`` (in place, returns the :class:`Fp16Report`).
    The measured conversion (``onnxopt.verify.fp16_fallback``) plans one per set of nodes kept float32."""
    conv = _Converter(model, keep_io_types, frozenset(DEFAULT_BLOCK_OPS if block_ops is None else block_ops),
                      targets.normalize(target), frozenset(keep_nodes), clamp_sentinels, ranges)
    conv.plan()
    return conv


__all__ = ["DEFAULT_BLOCK_OPS", "FP16_MAX", "FP16_MIN_NORMAL", "Fp16Report", "LIGHT_OPS", "NORMALIZATION_OPS",
           "check_convertible", "convert_fp16", "planned", "value_ranges"]
