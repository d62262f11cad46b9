"""Session advice for a target, read from the optimized model: the provider options it benefits
from (each with the measured evidence of the benefit table, ``onnxopt.targets.benefit``), and for
``ort-cuda`` the nodes onnxruntime's CUDA provider would leave on the CPU (the "CPU islands"),
counted statically so that users see them without a GPU.

onnxruntime folds constants and merges common subexpressions before it places nodes (its basic
optimizations: a node whose inputs are all constants, Shape/Size of a value of static shape, a node
repeating an earlier one on the same inputs); the count does so first (``folded_by_onnxruntime``,
``merged_by_onnxruntime``) and places what remains.

The island count mirrors onnxruntime's placement (``GetCpuPreferredNodes`` in
``onnxruntime/core/framework/fallback_cpu_capability.cc``): a node without a CUDA kernel runs on
the CPU; the outputs of Shape and Size (whose CUDA kernels write to host memory) and of nodes
placed on the CPU are CPU tensors; a node that reads one of them (other than where its CUDA
kernel takes that input in host memory, as Reshape's shape), and otherwise only small
initializers (<= 100 elements) or graph inputs, and no float16/bfloat16 input, is placed on the
CPU too. It is an estimate: kernel availability is by op type (onnxruntime's OperatorKernels.md,
not every type constraint), and subgraphs of If/Loop/Scan are not looked into. The verifier's
by-provider kernel count on a GPU is the measurement.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxopt.targets import benefit as _benefit
from onnxopt import targets as _targets
from onnxopt.ir.util import constant_tensor

SMALL_INITIALIZER = 100  # elements (onnxruntime's kSmallInitializerThreshold)

# CUDA kernels whose outputs are in host memory
CPU_OUTPUT_OPS = {"Shape", "Size"}

# CUDA kernels that take these inputs in host memory (InputMemoryType(OrtMemTypeCPUInput, i)):
# a CPU tensor read there does not pull the node onto the CPU
CPU_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Tile": (1,), "ConstantOfShape": (0,),
    "Range": (0, 1, 2), "Resize": (1, 2, 3), "Upsample": (1,), "TopK": (1,), "Pad": (1, 2, 3),
    "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "OneHot": (1,), "Clip": (1, 2), "Dropout": (1, 2),
    "Trilu": (1,), "CumSum": (1,), "NonMaxSuppression": (2, 3, 4), "If": (0,), "Loop": (0, 1),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
}

# ai.onnx ops onnxruntime's CUDA provider has no kernel for (OperatorKernels.md, onnxruntime 1.2x-1.3x)
NO_CUDA_ONNX = {
    "StringNormalizer", "TfIdfVectorizer", "Unique", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
    "ConvInteger", "LpNormalization", "LpPool", "GlobalLpPool", "MaxRoiPool", "MaxUnpool", "Det", "STFT",
    "MelWeightMatrix", "HannWindow", "HammingWindow", "BlackmanWindow", "ImageDecoder", "RegexFullMatch",
    "StringConcat", "StringSplit", "Col2Im", "AffineGrid", "Bernoulli", "Hardmax", "Celu", "Optional",
    "OptionalGetElement", "OptionalHasElement", "SequenceMap", "CenterCropPad", "DFT",
}
# com.microsoft ops with a CUDA kernel (the transformer fusions onnxopt and onnxruntime emit, and others)
CUDA_CONTRIB = {
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "PackedMultiHeadAttention",
    "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention", "SparseAttention", "RotaryEmbedding",
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
    "LayerNormalization", "EmbedLayerNormalization", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd",
    "BiasSplitGelu", "BiasSoftmax", "BiasDropout", "FusedMatMul", "FusedConv", "NhwcConv", "GemmFastGelu",
    "MatMulNBits", "MatMulBnb4", "GroupNorm", "SkipGroupNorm", "RelativePositionBias",
    "GatedRelativePositionBias", "RemovePadding", "RestorePadding", "BeamSearch", "GreedySearch", "Sampling",
    "WhisperBeamSearch", "Inverse", "GridSample", "ComplexMul", "ComplexMulConj", "Rfft", "Irfft",
    "QuantizeLinear", "DequantizeLinear", "MoE", "QMoE", "Trilu", "TransposeMatMul", "ConvTransposeWithDynamicPads",
    "DynamicTimeWarping", "UnfoldTensor", "GemmFloat8", "SkipLayerNorm", "BitmaskDropout", "Crop",
}
# ops whose output shape depends on the input data: CUDA graph capture needs the same shapes every run
DATA_DEPENDENT = {"NonZero", "NonMaxSuppression", "Unique", "Compress", "If", "Loop", "Scan"}
CONTROL_FLOW = {"If", "Loop", "Scan"}
LOW_FLOAT = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def has_cuda_kernel(node: ir.Node) -> bool:
    """Whether onnxruntime's CUDA provider has a kernel for ``node`` (by op type; string tensors never)."""
    if any(v is not None and v.dtype == ir.DataType.STRING for v in (*node.inputs, *node.outputs)):
        return False
    domain = node.domain or ""
    if domain in ("", "ai.onnx"):
        return node.op_type not in NO_CUDA_ONNX
    if domain == "com.microsoft":
        return node.op_type in CUDA_CONTRIB
    return False  # ai.onnx.ml and custom domains: CPU kernels only


def _small_constant(value: ir.Value) -> bool:
    t = constant_tensor(value)
    if t is None:
        return False
    return int(np.prod(t.shape.numpy() if hasattr(t.shape, "numpy") else tuple(t.shape))) <= SMALL_INITIALIZER


def _few(value: ir.Value) -> bool:
    return value.shape is not None and all(isinstance(d, int) for d in value.shape) and \
        int(np.prod(tuple(value.shape))) <= SMALL_INITIALIZER


def _dims(value: ir.Value) -> list:
    if value.shape is None:
        return ["?"]
    return [d if isinstance(d, int) else (str(d.value) if getattr(d, "value", None) is not None else "?")
            for d in value.shape]


NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
              "QuantizeLinear", "DequantizeLinear"}
SMALL_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL}


def _static_shapes(model: ir.Model, nodes: list[ir.Node]) -> dict[str, tuple[int, ...]]:
    """Static shapes of the values Shape/Size read, by name: declared, else from onnx's inference
    over a copy (``onnxopt.library.passes.infer_model``; the model itself is not touched)."""
    wanted, out = [], {}
    for n in nodes:
        if n.op_type in ("Shape", "Size") and n.inputs and n.inputs[0] is not None:
            v = n.inputs[0]
            if v.shape is not None and all(isinstance(d, int) for d in v.shape):
                out[v.name] = tuple(v.shape)
            else:
                wanted.append(v.name)
    if wanted:
        try:
            from onnxopt.ir.shapes import infer_model

            proto = infer_model(model)
            for vi in [*proto.graph.value_info, *proto.graph.output, *proto.graph.input]:
                dims = vi.type.tensor_type.shape.dim
                if vi.name in wanted and vi.type.tensor_type.HasField("shape") and \
                        all(d.HasField("dim_value") for d in dims):
                    out[vi.name] = tuple(d.dim_value for d in dims)
        except Exception:  # noqa: BLE001 - an estimate: without inference, Shape is not folded
            pass
    return out


def _folded_by_onnxruntime(model: ir.Model, nodes: list[ir.Node]) -> tuple[set[int], set[int]]:
    """What onnxruntime's basic optimizations (constant folding, before it places nodes) fold away:
    nodes whose inputs are all constants, and Shape/Size of a value of static shape. Returns the ids
    of the folded nodes and of the values they leave as (small) constants."""
    static = _static_shapes(model, nodes)
    const_values: set[int] = set()
    folded: set[int] = set()
    for n in nodes:
        if (n.domain or "") not in ("", "ai.onnx") or n.op_type in NOT_FOLDED or any(
                a.type == ir.AttributeType.GRAPH or a.type == ir.AttributeType.GRAPHS for a in n.attributes.values()):
            continue
        if n.op_type in ("Shape", "Size"):
            ok = bool(n.inputs) and n.inputs[0] is not None and n.inputs[0].name in static
        else:
            ok = all(v is None or id(v) in const_values or constant_tensor(v) is not None for v in n.inputs)
        if ok:
            folded.add(id(n))
            const_values.update(id(o) for o in n.outputs)
    return folded, const_values


def _attr_key(a) -> tuple:
    v = a.value
    if isinstance(v, (list, tuple)):
        v = tuple(v)
    elif hasattr(v, "numpy"):
        v = ("tensor", np.asarray(v.numpy()).tobytes())
    return (a.name, repr(v))


def _merged_by_onnxruntime(nodes: list[ir.Node], outputs: set[int] = frozenset()) -> dict[int, int]:
    """onnxruntime's common-subexpression elimination (a basic optimization, before placement): a node
    computing what an earlier one does from the same inputs goes. Returns {id of a removed node's
    output value: id of the value that stands for it}."""
    rep: dict[int, int] = {}
    seen: dict[tuple, ir.Node] = {}
    for n in nodes:
        if n.op_type in NOT_FOLDED or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                          for a in n.attributes.values()):
            continue
        try:
            key = (n.domain or "", n.op_type, tuple(None if v is None else rep.get(id(v), id(v)) for v in n.inputs),
                   tuple(sorted(_attr_key(a) for a in n.attributes.values())), len(n.outputs))
        except Exception:  # noqa: BLE001 - an attribute we cannot key: never merged
            continue
        first = seen.get(key)
        if first is None or any(id(o) in outputs for o in n.outputs):  # (a graph output keeps its node)
            seen.setdefault(key, n)
            continue
        for mine, theirs in zip(n.outputs, first.outputs):
            rep[id(mine)] = id(theirs)
        rep[id(n)] = id(first)
    return rep


def cuda_placement(model: ir.Model, *, examples: int = 12) -> dict:
    """The nodes of ``model``'s main graph that onnxruntime's CUDA provider would run on the CPU
    (a static estimate, see the module docstring): ``cpu_nodes``, by op type, by reason ("no CUDA
    kernel", "shape arithmetic": reads a CPU tensor such as Shape's output), the first
    ``examples`` of them, the graph inputs with dynamic dimensions, and whether every node runs on
    CUDA at static shapes (``all_on_cuda_static``)."""
    graph = model.graph
    every = list(graph)
    folded, folded_values = _folded_by_onnxruntime(model, every)
    merged = _merged_by_onnxruntime([n for n in every if id(n) not in folded], {id(v) for v in graph.outputs})
    nodes = [n for n in every if id(n) not in folded and id(n) not in merged]
    order = {id(n): i for i, n in enumerate(nodes)}
    graph_inputs = {id(v) for v in graph.inputs}
    cuda = {id(n): has_cuda_kernel(n) for n in nodes}
    cpu_values: set[int] = set()
    heap: list[tuple[int, int]] = []

    readers: dict[int, list[ir.Node]] = {}  # value id (a merged one's representative) -> the nodes reading it
    for n in nodes:
        for v in n.inputs:
            if v is not None:
                readers.setdefault(merged.get(id(v), id(v)), []).append(n)

    def push_consumers(node: ir.Node) -> None:
        for out in node.outputs:
            for user in readers.get(id(out), ()):
                heapq.heappush(heap, (order[id(user)], id(user)))

    by_id = {id(n): n for n in nodes}
    for n in nodes:
        if cuda[id(n)] and n.op_type in CPU_OUTPUT_OPS and (n.domain or "") in ("", "ai.onnx"):
            cpu_values.update(id(o) for o in n.outputs)
            push_consumers(n)
    placed: dict[int, str] = {}
    visited: set[int] = set()
    while heap:
        _, nid = heapq.heappop(heap)
        if nid in visited:
            continue
        visited.add(nid)
        n = by_id[nid]
        if not cuda[nid]:
            cpu_values.update(id(o) for o in n.outputs)
            push_consumers(n)
            continue
        on_cpu = True
        cpu_slots = CPU_INPUTS.get(n.op_type, ()) if (n.domain or "") in ("", "ai.onnx") else ()
        for i, v in enumerate(n.inputs):
            if v is None:
                on_cpu = False
                break
            vid = merged.get(id(v), id(v))
            if v.dtype in LOW_FLOAT:
                on_cpu = False
                break
            if id(v) in graph_inputs or _small_constant(v) or (
                    id(v) in folded_values and (v.dtype in SMALL_TYPES or _few(v))):
                continue
            if vid not in cpu_values or i in cpu_slots:
                on_cpu = False
                break
        if on_cpu:
            placed[nid] = "shape arithmetic"
            cpu_values.update(id(o) for o in n.outputs)
            push_consumers(n)
    for n in nodes:
        if not cuda[id(n)]:
            placed[id(n)] = "no CUDA kernel"
    cpu = [n for n in nodes if id(n) in placed]
    dynamic = {v.name: _dims(v) for v in graph.inputs
               if v.shape is None or any(not isinstance(d, int) for d in v.shape)}
    control = sum(1 for n in nodes if n.op_type in CONTROL_FLOW and (n.domain or "") in ("", "ai.onnx"))
    data_dep = sorted({n.op_type for n in nodes if n.op_type in DATA_DEPENDENT and (n.domain or "") in ("", "ai.onnx")})
    return {
        "nodes": len(nodes),
        "folded_by_onnxruntime": len(folded),
        "merged_by_onnxruntime": sum(1 for n in every if id(n) in merged),
        "cpu_nodes": len(cpu),
        "by_op": dict(Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                              for n in cpu).most_common()),
        "by_reason": dict(Counter(placed[id(n)] for n in cpu).most_common()),
        "examples": [{"node": n.name, "op": n.op_type, "reason": placed[id(n)]} for n in cpu[:examples]],
        "dynamic_inputs": dynamic,
        "control_flow": control,
        "data_dependent_ops": data_dep,
        "all_on_cuda_static": not cpu and not dynamic and not control and not data_dep,
        "method": "static estimate of onnxruntime's CUDA placement (onnxopt.targets.advice); the verifier's by-provider "
                  "kernel count on a GPU measures it",
    }


def _option(key: str, option: str, value: str, why: str, table: _benefit.Table) -> dict:
    d = table.decide(key, _targets.ORT_CUDA)
    models = (d.evidence or {}).get("models", {}) if d.measured else {}
    slower = sorted(m for m, e in models.items() if isinstance(e, dict) and (e.get("ratio") or 0) > 1.0)
    return {"provider": "cuda", "option": option, "value": value, "key": key, "why": why, "advised": d.apply,
            "measured": d.measured,
            # a verdict over several models: where some measured slower, say so; verify shows it for this one
            **({"caveat": f"measured slower on {', '.join(slower)}: check this model with the verify command"}
               if d.apply and slower else {}),
            "evidence": d.reason if d.measured else f"not measured yet ({key}: python -m scripts.data.benefit --advice on "
                                                    "a GPU); try it with verify --provider-option",
            "flag": f"--provider-option cuda:{option}={value}"}


def advise(model: ir.Model, target: str, table: _benefit.Table | None = None) -> dict | None:
    """Session advice for ``target`` (``ort-cuda`` only; None for the others): ``provider_options``
    (each: option, value, why, advised per the benefit table, measured, evidence, the verify flag),
    ``not_advised`` (options considered and why they do not apply), ``cpu_islands``
    (:func:`cuda_placement`)."""
    if _targets.normalize(target) != _targets.ORT_CUDA:
        return None
    table = table or _benefit.current()
    placement = cuda_placement(model)
    options, not_advised = [], []
    convs = sum(1 for n in model.graph if n.op_type == "Conv" and (n.domain or "") in ("", "ai.onnx")
                and n.inputs and n.inputs[0] is not None and (n.inputs[0].shape is None or len(n.inputs[0].shape) == 4))
    if convs:
        opt = _option("cuda_prefer_nhwc", "prefer_nhwc", "1", f"{convs} 2-D Conv node(s) in NCHW", table)
        (options if opt["advised"] else not_advised).append(opt)
    else:
        not_advised.append({"option": "prefer_nhwc", "why": "no 2-D Conv"})
    if placement["all_on_cuda_static"]:
        opt = _option("cuda_graph", "enable_cuda_graph", "1",
                      "every node runs on CUDA at static shapes (static estimate)", table)
        (options if opt["advised"] else not_advised).append(opt)
    else:
        why = []
        if placement["dynamic_inputs"]:
            why.append("dynamic input dims: " + ", ".join(f"{k} {v}" for k, v in placement["dynamic_inputs"].items())
                       + " (fix them with --input-shape)")
        if placement["cpu_nodes"]:
            why.append(f"{placement['cpu_nodes']} node(s) would run on the CPU")
        if placement["control_flow"]:
            why.append(f"{placement['control_flow']} control-flow node(s)")
        if placement["data_dependent_ops"]:
            why.append("data-dependent output shapes: " + ", ".join(placement["data_dependent_ops"]))
        not_advised.append({"option": "enable_cuda_graph", "why": "; ".join(why)})
    return {"target": _targets.ORT_CUDA, "provider_options": options, "not_advised": not_advised,
            "cpu_islands": placement}


def provider_options_flags(advice: Mapping | None) -> list[str]:
    """The ``verify --provider-option`` flags of the advised options."""
    return [o["flag"] for o in (advice or {}).get("provider_options", ()) if o.get("advised")]
