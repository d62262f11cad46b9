"""Packed projections (issue 30): MatMuls of one activation by constant weights become one MatMul by
the weights side by side, and a Split (targets ort-cpu and ort-cuda).

A decoder reads each normalized hidden state with several projections: q_proj, k_proj and v_proj (under
grouped-query attention k and v are narrower than q), and the MLP's gate_proj and up_proj. Each is
``MatMul(x, W_i)`` with ``W_i`` [K, N_i] constant (``+ b_i``, a constant [N_i], where the model has biases:
Qwen2's q/k/v). The group becomes::

    y = MatMul(x, Concat(W_1 .. W_n, axis=1))  [+ Concat(b_1 .. b_n)]
    y_1 .. y_n = Split(y, [N_1 .. N_n], axis=-1)

each ``y_i`` taking the place of the projection it stands for (its name, type and shape): one GEMM of
``sum N_i`` columns instead of n narrow ones, as onnxruntime-genai's model builder writes (its packed QKV and
gate_up). The group is every MatMul of the graph that reads ``x`` as its first input by a constant weight,
packed in graph order (the new nodes go before the first of them, named after it), so the same model gives
the same bytes. The originals become unused and are dropped, so no weight is held twice (models over 2 GB
stay as large as they were); a packed weight of 1 MiB or more is concatenated when it is read (the save
writes it, then lets it go: ``onnxopt.ir.util.deferred``), so a model's packed weights are never all in
memory at once, and the originals, an input's external data, are not read before.

Biases: where every member is followed by an Add of a constant [N_i] (its only reader), the Adds are packed
too (one Add of the concatenated biases before the Split; a bias read elsewhere too, as a legacy export
shares equal biases between layers, is copied: N values, where a weight would be K x N). Where only some
are, the MatMuls are packed and each biased member keeps its own Add, now reading its Split output: a zero
bias for the others would turn a -0.0 into +0.0 and cost a wider Add for nothing.

Refused, with the reason: a weight read outside the group too (packing would copy it and keep the original;
one that only the group's members read is packed as copies and dropped), a member whose weight is constant
but not 2-D (its output's other dimensions are not x's), weights of another type than x or not a float
type, x of unknown rank, an empty projection. MatMuls of x by a weight that is not constant (activation
products) are no members; a weight still computed from constants (the dynamo exporter's ``Transpose(W)``,
which constant folding turns into an initializer) makes the group wait for it (not a candidate yet), so a
group is packed once, whole.

Not packed where attention_fusion packs the group itself (rules/attention.py): exactly three projections of
one width whose outputs each reach an attention's MatMuls (the scores for Q and K, the output for V) through
views only (Reshape, Transpose, Squeeze, Unsqueeze, a Mul or Div by a constant): an encoder's Q/K/V (BERT,
MiniLM), which attention_fusion turns into com.microsoft Attention with its own packed QKV weight. Decoders
rotate q and k (RotaryEmbedding, or its unfused form) before the scores, and grouped-query attention's k and
v are narrower, so their groups pack; the attention fusions that read q, k and v as 3-D values
(MultiHeadAttention, GroupQueryAttention) read the Split's outputs as they read the projections.

Targets: ort-cpu and ort-cuda, with the measured benefit key ``packed_projections``
(onnxopt/data/benefit.json says per target whether it pays). Not ``portable``: whether one wide GEMM beats
several narrow ones is the runtime's matter, measured here only for onnxruntime, and other tools'
attention fusions over a portable model (onnxruntime's transformers optimizer, TensorRT's) match separate
q/k/v MatMuls. ``exact=False``: each output element is the same dot product, but the GEMM kernel may block a
wider matrix differently (the results agree up to rounding).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxopt.core.pattern import Explain, Match, Op, Rule, Var
from onnxopt.ir.util import DEFERRED_MIN_BYTES, constant_tensor, deferred, use_count
from onnxopt.targets import ORT_CPU, ORT_CUDA

ORT = (ORT_CPU, ORT_CUDA)
_FLOATS = frozenset((ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BFLOAT16))
_VIEWS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze")
_MAX_VIEWS = 8


def _onnx(node: ir.Node | None, *op_types: str) -> bool:
    return node is not None and node.domain in ("", "ai.onnx") and node.op_type in op_types


def _matmul_readers(x: ir.Value) -> list[ir.Node]:
    """The MatMuls of x's graph that read x as their first input (each once)."""
    graph = x.graph
    out: dict[ir.Node, None] = {}
    for use in x.uses():
        node = use.node
        if use.idx == 0 and _onnx(node, "MatMul") and (graph is None or node.graph is graph):
            out[node] = None
    return list(out)


def _pending(w: ir.Value) -> bool:
    """``w`` is not constant yet but computed from constants only (constant folding will make it one)."""
    node = w.producer()
    return node is not None and node.op_type != "Constant" and bool(node.inputs) and all(
        v is None or constant_tensor(v) is not None for v in node.inputs)


def _candidate(x: ir.Value) -> bool:
    """x is read by two or more MatMuls by constant weights, none of the others waiting for a weight to fold."""
    readers = _matmul_readers(x)
    if any(_pending(n.inputs[1]) for n in readers):
        return False
    return sum(constant_tensor(n.inputs[1]) is not None for n in readers) >= 2


def _members(x: ir.Value) -> list[ir.Node]:
    return [n for n in _matmul_readers(x) if constant_tensor(n.inputs[1]) is not None]


def _bias(node: ir.Node) -> tuple[ir.Node, ir.Value] | None:
    """(the Add, the bias) where the MatMul's only reader adds a constant to it, else None."""
    out = node.outputs[0]
    if out.is_graph_output() or use_count(out) != 1:
        return None
    add = out.uses()[0].node
    if not _onnx(add, "Add") or add.graph is not node.graph or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    if other is out or constant_tensor(other) is None:
        return None
    return add, other


def _private(value: ir.Value, readers: set[ir.Node]) -> bool:
    """``value`` is read by ``readers`` only (the group's own nodes), and is no graph output."""
    return not value.is_graph_output() and all(u.node in readers for u in value.uses())


def _readers(value: ir.Value) -> list[ir.Node] | None:
    """[the one reader of ``value``] (readers of its shape or type only do not count: a Shape, a
    CastLike's target), else None."""
    if value.is_graph_output():
        return None
    readers = [u.node for u in value.uses() if u.node.op_type != "Shape"
               and not (u.node.op_type == "CastLike" and u.idx == 1)]
    return readers if len(readers) == 1 else None


def _through_views(value: ir.Value) -> ir.Node | None:
    """The MatMul ``value`` reaches through views only (each value read once), else None."""
    for _ in range(_MAX_VIEWS):
        readers = _readers(value)
        if readers is None:
            return None
        node = readers[0]
        if _onnx(node, "MatMul"):
            return node
        if _onnx(node, *_VIEWS) and node.inputs[0] is value:
            value = node.outputs[0]
        elif _onnx(node, "Mul", "Div") and any(v is not value and _scalar(v) for v in node.inputs):
            value = node.outputs[0]
        else:
            return None
    return None


_ELEMENTWISE = ("Cast", "CastLike", "Sqrt", "Reciprocal", "Neg", "Identity", "Mul", "Div", "Add", "Sub", "Pow")


def _scalar(value: ir.Value | None) -> bool:
    """``value`` is a constant of one element, or element-wise arithmetic of such constants (the dynamo
    export's scale, ``CastLike(sqrt(1 / sqrt(d)), q)``, before folding; CastLike's target gives only a type)."""
    if value is None:
        return False
    tensor = constant_tensor(value)
    if tensor is not None:
        return int(np.prod(_shape(tensor))) == 1
    seen, stack = 0, [value.producer()]
    while stack:  # (a few nodes up)
        node = stack.pop()
        seen += 1
        if node is None or seen > 8 or not _onnx(node, *_ELEMENTWISE):
            return False
        for i, v in enumerate(node.inputs):
            if v is None or (node.op_type == "CastLike" and i == 1):
                continue
            tensor = constant_tensor(v)
            if tensor is not None:
                if int(np.prod(_shape(tensor))) != 1:
                    return False
                continue
            stack.append(v.producer())
    return True


def _near_softmax(value: ir.Value, forward: bool) -> bool:
    """``value`` reaches a Softmax (forward: through its readers; back: through its producers) within a few
    element-wise steps (the scale, the mask, a Cast, torch's NaN guard)."""
    for _ in range(4):
        if forward:
            readers = _readers(value)
            if readers is None:
                return False
            node = readers[0]
        else:
            node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return False
        if node.op_type == "Softmax":
            return True
        if node.op_type not in ("Mul", "Div", "Add", "Where", "Cast", "Identity", "Dropout"):
            return False
        if forward:
            value = node.outputs[0]
        else:  # (the operand that is not a constant, nor IsNaN's test)
            rest = [v for v in node.inputs if v is not None and constant_tensor(v) is None
                    and not _onnx(v.producer(), "IsNaN")]
            if not rest:
                return False
            value = rest[-1]
    return False


def _attention_packs(outs: list[ir.Value], widths: list[int]) -> bool:
    """The three projections ``outs`` are an attention's Q, K and V that attention_fusion packs itself (see
    the module docstring): two reach one MatMul (the scores, before a Softmax), the third the MatMul that
    reads the probabilities."""
    if len(outs) != 3 or len(set(widths)) != 1:
        return False
    reached = [_through_views(v) for v in outs]
    if any(n is None for n in reached) or len(set(reached)) != 2:
        return False
    scores = next(n for n in reached if reached.count(n) == 2)
    output = next(n for n in reached if reached.count(n) == 1)
    return _near_softmax(scores.outputs[0], True) and _near_softmax(output.inputs[0], False)


def _shape(tensor) -> tuple:
    return tuple(int(d) for d in tensor.shape)


def _condition(m: Match):
    x = m["x"]
    dims = m.dims("x")
    if dims is None or not dims:
        return "x's rank is unknown" if dims is None else "x is a scalar"
    dtype = m.dtype("x")
    if dtype not in _FLOATS:
        return f"x is not of a float type ({dtype.name.lower() if dtype is not None else 'unknown'})"
    # (the checks read the constants' shapes and types only: a weight is read when it is packed)
    members = _members(x)
    widths, group = [], set(members)
    for node in members:
        w, name = node.inputs[1], node.name or node.op_type
        if not _private(w, group):
            return f"the weight of {name} is read elsewhere too (packing would copy it)"
        tensor = constant_tensor(w)
        shape = _shape(tensor)
        if len(shape) != 2:
            return f"the weight of {name} has rank {len(shape)}, not 2 (its output's other dimensions differ)"
        if tensor.dtype != dtype:
            return f"the weight of {name} is {tensor.dtype.name.lower()}, x is {dtype.name.lower()}"
        if isinstance(dims[-1], int) and shape[0] != dims[-1]:
            return f"the weight of {name} has {shape[0]} rows, x's last dimension is {dims[-1]}"
        if shape[1] == 0:
            return f"{name} projects to no columns"
        widths.append(shape[1])
    biases = [_bias(n) for n in members]
    packed_bias = all(b is not None for b in biases)
    if packed_bias:  # (a bias read elsewhere too is copied: N values, where a weight would be K x N)
        for n, (_, b) in zip(widths, biases):
            tensor = constant_tensor(b)
            if _shape(tensor) != (n,) or tensor.dtype != dtype:
                packed_bias = False  # (a bias of another shape or type stays an Add of its own)
                break
    if _attention_packs([b[0].outputs[0] if b is not None else n.outputs[0] for n, b in zip(members, biases)],
                        widths):
        return "an attention's Q, K and V of one width: attention_fusion packs them into com.microsoft Attention"
    # packed in graph order; the driver puts the new nodes before the root (the first) and names them after it
    order = _graph_order(m.graph, members)
    at = {node: i for i, node in enumerate(members)}
    members = order
    widths = [widths[at[n]] for n in order]
    biases = [biases[at[n]] for n in order]
    m.root = members[0]
    m.nodes = tuple(members) + (tuple(add for add, _ in biases) if packed_bias else ())
    m.outputs = [add.outputs[0] for add, _ in biases] if packed_bias else [n.outputs[0] for n in members]
    return {"weights": [n.inputs[1] for n in members], "widths": widths, "axis": len(dims) - 1,
            "biases": [b for _, b in biases] if packed_bias else None}


def _graph_order(graph: ir.Graph, nodes: list[ir.Node]) -> list[ir.Node]:
    """``nodes`` in the graph's order."""
    wanted, out = set(nodes), []
    for node in graph:
        if node in wanted:
            out.append(node)
            if len(out) == len(wanted):
                break
    return out


def _concatenated(tensors: list) -> np.ndarray | ir.LazyTensor:
    """The weights [K, N_i] side by side: computed when read where they make DEFERRED_MIN_BYTES or more
    (``onnxopt.ir.util.deferred``: the sources, an input's external data among them, are not read now, and
    the packed weight is not held beyond its reading), else now."""
    rows = int(tensors[0].shape[0])
    shape = (rows, sum(int(t.shape[1]) for t in tensors))
    dtype = tensors[0].dtype
    if rows * shape[1] * dtype.itemsize < DEFERRED_MIN_BYTES:
        return np.concatenate([t.numpy() for t in tensors], axis=1)

    def side_by_side() -> np.ndarray:  # (each source read into place: a source computed when read, a folded
        out = np.empty(shape, dtype.numpy())  # Transpose, is held one at a time beside the result)
        start = 0
        for tensor in tensors:
            block = tensor.numpy()
            out[:, start:start + block.shape[1]] = block
            start += block.shape[1]
            del block
        return out

    return deferred(side_by_side, dtype, shape)


def _replace(m: Match, b):
    plan = m.plan
    name = m.root.name or "projection"
    weight = b.const(_concatenated([constant_tensor(w) for w in plan["weights"]]), name=f"{name}_packed_weight")
    y = b.op("MatMul", m["x"], weight)
    if plan["biases"] is not None:
        biases = [constant_tensor(v).numpy() for v in plan["biases"]]
        y = b.op("Add", y, b.const(np.concatenate(biases), name=f"{name}_packed_bias"))
    sizes = np.array(plan["widths"], np.int64)
    n, axis = len(plan["widths"]), plan["axis"]  # (the last, from the front: no -1 before opset 11)
    if m.opset("") >= 13:
        outs = b.op("Split", y, b.const(sizes, name=f"{name}_packed_sizes"), outputs=n, axis=axis)
    else:
        outs = b.op("Split", y, outputs=n, axis=axis, split=[int(s) for s in sizes])
    return list(outs)


RULES = [
    Rule("packed_projections",
         Op("MatMul", Explain(Var("x", check=_candidate), "x is not read by two or more MatMuls by constant "
                              "weights (or one of them waits for its weight to fold)"), "w", name="mm"),
         _replace, condition=_condition, targets=ORT, benefit="packed_projections", exact=False,
         doc="MatMuls of one activation by constant 2-D weights [K, N_i] (each with its Add of a constant [N_i] "
             "bias, where all have one) become one MatMul by the concatenated weights and a Split into the N_i "
             "(decoders' q/k/v and gate/up projections); not an encoder's Q/K/V that attention_fusion packs."),
]
