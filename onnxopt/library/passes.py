"""Whole-graph passes the rule language cannot express: they compare nodes with each other, or
look at the whole graph at once. ``PASSES`` at the end is their one table (``onnxopt.core.passes.Pass``:
name, function, phase, one-line doc, what each needs and provides), registered in
``onnxopt.core.passes``' table when this module loads; ``onnxopt.core.pipeline`` runs whatever that
table holds, so adding a pass is adding a row there (or ``onnxopt.core.passes.register`` elsewhere).

- ``common_subexpression_elimination``: nodes with the same op, attributes and input values
  compute the same outputs; later ones are replaced by the first (graph order is topological, so
  the first is defined before every use of the others). Only nodes ``onnxopt.core.purity`` calls pure
  are merged (never random ops, training-mode Dropout, ops of unknown domains, or calls of
  functions holding them); nodes with subgraphs are never merged.
- ``initializer_deduplication``: initializers (not graph inputs) with the same dtype, shape and
  bytes are one (e.g. the tied embedding matrix the legacy GPT-2 export stores twice).

Both run in every graph (If/Loop/Scan bodies included) and keep graph output names; CSE records
the nodes it merged in the kept node's metadata (``onnxopt.merged``; initializers have no node to
record it on). CSE's kept node also takes the metadata
keys only its twins carried (``irutil.inherit_metadata``: its own values first, then its twins' in
graph order), as a rule's new node keeps its sources'.

- ``shape_completion`` (before matching): onnx's shape inference with data propagation gives
  every value a type and shape with consistent symbolic dimensions, for the rules to reason with
  (a Reshape target read from a value with the same named dims becomes a constant). Shapes the
  model already declares are kept. Only for models with a dynamic input dimension (with static
  inputs every shape is static and per-node inference finds it). The inferred shapes are *not*
  written into the output: recorded there, they let onnxruntime fuse Add + LayerNormalization into
  SkipLayerNormalization, whose CPU kernel is slower (BERT legacy export: 2.7 ms against 0.45 ms
  per run, the whole model 10% slower with 8 fewer kernels).
"""

from __future__ import annotations

import hashlib
import collections
import json

import numpy as np
import onnx_ir as ir

from onnxopt.ir.util import (MERGED_KEY, REPLACED_KEY, RULE_KEY, SOURCES_KEY, can_take_output, graphs, inherit_metadata,
                     recorded_sources, redirect)
from onnxopt.core.passes import SETTLED, Effect, Pass, Phase, Requirement, Touched, register
from onnxopt.core.purity import Purity
from onnxopt.ir.shapes import forget_inferred_shapes, infer, infer_model, mark_declared, opsets_of  # noqa: F401
from onnxopt.transforms.recompute import BASELINE_KEY, CARRIED_KEY, SIZES_KEY


def _attr_key(attr: ir.Attr):
    if attr.is_ref():
        return (attr.name, "ref", attr.ref_attr_name)
    t = attr.type
    if t in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        raise _Unmergeable
    v = attr.value
    if t == ir.AttributeType.TENSOR:
        arr = v.numpy()
        return (attr.name, "t", str(arr.dtype), arr.shape, arr.tobytes())
    if t == ir.AttributeType.TENSORS:
        return (attr.name, "ts", tuple((str(a.dtype), a.shape, a.tobytes()) for a in (x.numpy() for x in v)))
    if t in (ir.AttributeType.FLOAT,):
        return (attr.name, "f", np.float32(v).tobytes())
    if t == ir.AttributeType.FLOATS:
        return (attr.name, "fs", np.asarray(list(v), dtype=np.float32).tobytes())
    if t in (ir.AttributeType.INTS, ir.AttributeType.STRINGS):
        return (attr.name, int(t), tuple(v))
    if t in (ir.AttributeType.INT, ir.AttributeType.STRING):
        return (attr.name, int(t), v)
    raise _Unmergeable  # sparse tensors, type protos: rare, left alone


class _Unmergeable(Exception):
    pass


def _node_key(node: ir.Node, purity: Purity):
    try:
        attrs = tuple(sorted(_attr_key(a) for a in node.attributes.values()))
    except _Unmergeable:  # (nodes with subgraphs among them)
        return None
    if not purity.mergeable(node):
        return None
    return (node.domain if node.domain != "ai.onnx" else "", node.op_type, node.overload,
            tuple(None if v is None else id(v) for v in node.inputs), len(node.outputs), attrs)


def eliminate_common_subexpressions(model: ir.Model, touched: Touched | None = None) -> int:
    """Later twins of a pure node (same op, attributes and inputs) are replaced by the first."""
    merged = 0
    purity = Purity(model)
    merged_names: dict[ir.Node, list[str]] = {}  # recorded once per kept node, when the pass ends
    for graph in graphs(model):
        seen: dict[tuple, ir.Node] = {}
        # nodes one rewrite made share its record: a twin whose siblings stay is stood for by them
        made_by = collections.Counter(n.metadata_props.get(REPLACED_KEY) for n in graph if RULE_KEY in n.metadata_props)
        for node in list(graph):
            if node.graph is not graph:
                continue
            key = _node_key(node, purity)
            if key is None:
                continue
            first = seen.get(key)
            if first is None:
                seen[key] = node
                continue
            if any(o.is_graph_output() for o in node.outputs) and any(o.is_graph_output() for o in first.outputs):
                continue
            pairs = list(zip(node.outputs, first.outputs))
            if any(old.is_graph_output() and not can_take_output(new) for old, new in pairs):
                continue
            redirected = [reader for old, new in pairs for reader in redirect(old, new)]
            if node.metadata_props.get(RULE_KEY) != "memory_recomputation":
                # (a copy memory_recomputation made of an earlier run's node stands for nothing new: its
                # name would pile up in the record each time the output is optimized again)
                merged_names.setdefault(first, []).append(node.name or node.op_type)
            made = recorded_sources(node)
            record = node.metadata_props.get(REPLACED_KEY) if RULE_KEY in node.metadata_props else None
            if record is not None:
                made_by[record] -= 1
            if made and (record is None or made_by[record] == 0):
                # a twin a rule made alone (or the last of its rewrite's nodes): the kept node stands for
                # what it stood for too
                sources = recorded_sources(first) or [first.name or first.op_type]
                first.metadata_props[SOURCES_KEY] = json.dumps(list(dict.fromkeys(sources + made)))
            inherit_metadata(first, [node])  # (the kept node's own values first)
            lost = [v for v in node.inputs if v is not None]
            graph.remove(node, safe=True)
            if touched is not None:
                touched(redirected, lost)
            merged += 1
    for first, names in merged_names.items():
        try:  # (a model's own value there may be anything: not JSON, not a list, 100,000 nested arrays)
            before = json.loads(first.metadata_props.get(MERGED_KEY, "[]"))
        except (ValueError, RecursionError):
            before = None
        before = [n for n in before if isinstance(n, str)] if isinstance(before, list) else []
        first.metadata_props[MERGED_KEY] = json.dumps(before + names)
    return merged


def deduplicate_initializers(model: ir.Model, touched: Touched | None = None) -> int:
    """Initializers (not graph inputs) with equal dtype, shape and bytes become one."""
    merged = 0
    for graph in graphs(model):
        inputs = set(graph.inputs)
        groups: dict[tuple, list[ir.Value]] = {}
        for value in graph.initializers.values():
            tensor = value.const_value
            if value in inputs or tensor is None or value.is_graph_output():
                continue
            groups.setdefault((tensor.dtype, tuple(tensor.shape)), []).append(value)
        for (dtype, _), values in groups.items():
            if len(values) < 2 or dtype == ir.DataType.STRING:
                continue
            # A cheap fingerprint (a strided sample of the bytes) first; tensors whose samples
            # agree are hashed whole, each once, and compared only when those hashes agree: distinct
            # large weights are never hashed, and n look-alikes (say one-hot masks that differ
            # between the sampled bytes) cost n hashes, not n^2 comparisons.
            firsts: dict[bytes, ir.Value | None] = {}  # by sample: the first tensor (None once hashed)
            whole: dict[bytes, ir.Value] = {}  # by a digest of all the bytes (look-alikes only)
            for value in values:
                sample = _sample(value)
                if sample is None:
                    continue
                first = firsts.setdefault(sample, value)
                if first is value:
                    continue
                if first is not None:
                    whole.setdefault(_digest(_bytes(first)), first)
                    firsts[sample] = None
                data = _bytes(value)
                if data is None:
                    continue
                keep = whole.setdefault(_digest(data), value)
                if keep is value or not np.array_equal(_bytes(keep), data):
                    continue
                redirected = redirect(value, keep)
                graph.initializers.pop(value.name)
                if touched is not None:
                    touched(redirected, ())
                merged += 1
    return merged


_SAMPLE_KEY = "onnxopt.sample_digest"  # a deferred tensor's sample, kept on it (see _sample)


def _sample(value: ir.Value) -> bytes | None:
    """A digest of a strided sample of the initializer's bytes (None when they cannot be read). A tensor
    computed when read (``onnxopt.ir.util.deferred``: a folded Transpose, packed weights) keeps its
    sample in its ``meta``: its values never change, and computing them again at every pass would cost
    the transpose or concatenation each time."""
    tensor = value.const_value
    deferred = isinstance(tensor, ir.LazyTensor)
    if deferred and _SAMPLE_KEY in tensor.meta:
        return tensor.meta[_SAMPLE_KEY]
    data = _bytes(value)
    sample = None if data is None else _digest(data[::max(1, data.size // 256)])
    if deferred:
        tensor.meta[_SAMPLE_KEY] = sample
    return sample


def _bytes(value: ir.Value) -> np.ndarray | None:
    """The bytes of an initializer's tensor (None for object arrays, or when it cannot be read)."""
    try:
        array = value.const_value.numpy()
    except Exception:
        return None
    return None if array.dtype == object else array.reshape(-1).view(np.uint8)


def _digest(data: np.ndarray) -> bytes:
    return hashlib.blake2b(data.tobytes(), digest_size=16).digest()


_LOCAL_LIMIT = 32


def has_dynamic_inputs(model: ir.Model) -> bool:
    """Some graph input has a dimension that is not a fixed number (or an unknown shape)."""
    for value in model.graph.inputs:
        if value.is_initializer():
            continue
        if value.shape is None or any(not isinstance(d, int) for d in value.shape):
            return True
    return False


def complete_shapes(model: ir.Model, touched: Touched | None = None) -> int:
    """Fill in the missing types and shapes of the main graph's values from onnx's shape inference
    (strict mode off, data propagation on); returns how many values gained a shape. A shape with
    anonymous dimensions takes the inferred one, whose symbols are consistent across the graph
    (rules compare them). A few missing values are inferred node by node instead. Weights are
    not serialized for it (see :func:`infer_model`)."""
    graph = model.graph
    if not has_dynamic_inputs(model):
        # Static inputs: every shape is static, per-node inference finds it when a rule asks,
        # and onnxruntime infers them all at load; there are no symbols to make consistent.
        return 0
    missing = {}
    for node in graph:
        for value in node.outputs:
            if value.name and (value.shape is None or value.type is None
                               or any(not isinstance(d, int) and d.value is None for d in value.shape)):
                missing[value.name] = value
    if not missing:
        return 0
    if len(missing) <= _LOCAL_LIMIT and all(v.shape is None for v in missing.values()):
        # a few new values: per-node inference from their inputs' (already consistent) shapes
        opsets = opsets_of(model)
        return sum(1 for v in missing.values() if infer(v, opsets) is not None)

    try:
        inferred = infer_model(model)
    except Exception:  # inference refusing a model we would save anyway: leave shapes as they are
        return 0
    filled = 0
    for info in inferred.graph.value_info:
        value = missing.get(info.name)
        if value is None or not info.type.HasField("tensor_type"):
            continue
        tt = info.type.tensor_type
        if value.type is None and tt.elem_type:
            value.type = ir.TensorType(ir.DataType(tt.elem_type))
        if tt.HasField("shape") and not value.is_graph_output():
            value.shape = ir.serde.deserialize_type_proto_for_shape(info.type)
            filled += 1
    return filled


def lift_constants(model: ir.Model, touched: Touched | None = None) -> int:
    """Every Constant node (any of its value forms) becomes an initializer, in every graph, with
    onnx_ir's pass: one sweep instead of a rewrite per node (PP-OCR keeps ~300 weights this way).
    Constants that are graph outputs stay nodes (rule ``constant_to_initializer`` takes them)."""
    from onnx_ir.passes.common import LiftConstantsToInitializersPass

    before = sum(1 for g in graphs(model) for n in g if n.op_type == "Constant")
    if not before:  # (nothing to lift: the pass would walk every graph again to find that)
        return 0
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    return before - sum(1 for g in graphs(model) for n in g if n.op_type == "Constant")


# --------------------------------------------------------------------------------------------
# The table


LIFT, DEDUP, CSE, SHAPES = "constant_lifting", "initializer_deduplication", "common_subexpression_elimination", \
    "shape_completion"
TRANSPOSES = "transpose_optimization"
MEMORY = "memory_reordering"
RECOMPUTE = "memory_recomputation"


def _optimize_transposes(model: ir.Model, touched: Touched | None = None) -> int:
    from onnxopt.transforms.transposes import optimize_transposes

    return optimize_transposes(model, touched)


def _has_transposes(model: ir.Model) -> bool:
    """transpose_to_reshape waits for the transpose pass: a Transpose left is one it may take."""
    return any(n.op_type == "Transpose" for n in model.graph)


def _reorder_for_memory(model: ir.Model, touched: Touched | None = None) -> int:
    from onnxopt.transforms.memory import reorder

    return reorder(model)


def _recompute_for_memory(model: ir.Model, touched: Touched | None = None) -> int:
    from onnxopt.transforms.memory import recompute

    return recompute(model)


def _memory_baseline(model: ir.Model) -> None:
    from onnxopt.transforms.memory import baseline

    baseline(model)


MEMORY_BASELINE = Requirement(
    "memory_before", BASELINE_KEY, _memory_baseline,
    "the input's peak activation memory (onnxopt.transforms.memory.report_peak), before any change: the limit "
    "memory recomputation works to, and optimize's report's \"before\"")

PASSES = tuple(register(p, replace=True) for p in (  # (replace: a reload of this module)
    Pass(LIFT, lift_constants, Phase.FIRST,
         "Constant nodes become initializers, in one sweep before matching (onnx_ir's pass).", exact=True),
    Pass(DEDUP, deduplicate_initializers, Phase.BETWEEN, "Initializers with equal dtype, shape and bytes become one.",
         exact=True),
    Pass(CSE, eliminate_common_subexpressions, Phase.BETWEEN,
         "Pure nodes (onnxopt.core.purity) with the same op, attributes and inputs become one.", exact=True),
    Pass(SHAPES, complete_shapes, Phase.FIRST,
         "Consistent symbolic shapes (onnx inference, data propagation) for the rules; not written out.",
         effect=Effect.ANNOTATES, exact=False),
    Pass(TRANSPOSES, _optimize_transposes, Phase.BETWEEN,
         "Transposes pushed down through layout-agnostic ops where a whole chain lowers the elements they move "
         "(onnxopt.transforms.transposes).", exact=False, settles=SETTLED, waiting=_has_transposes),
    Pass(RECOMPUTE, _recompute_for_memory, Phase.LAST,
         "Where the rewrites raised the peak activation memory above the input's, cheap pure nodes whose values "
         "live across the peak are computed again after it (onnxopt.transforms.recompute).", exact=True,
         needs=(MEMORY_BASELINE,), scratch=(SIZES_KEY, CARRIED_KEY)),
    Pass(MEMORY, _reorder_for_memory, Phase.LAST,
         "The main graph's nodes reordered (nothing else changes) where that strictly lowers the peak activation "
         "memory (onnxopt.transforms.memory).", effect=Effect.ORDER, exact=True,
         scratch=(SIZES_KEY, CARRIED_KEY)),
))
BY_NAME = {p.name: p for p in PASSES}  # the built-in passes (onnxopt.core.passes.table(): every registered one)
NAMES = tuple(BY_NAME)  # in the order reports and --list-rules show them
