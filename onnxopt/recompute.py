"""Recomputation where the rewrites raised the peak activation memory: optimize never raises it.

Rewrites can make a value live longer or larger than the input's values did. The plain case is
common-subexpression elimination: six attention layers each turned a 256-byte boolean mask into
a 1 KiB float one just before using it; merged, the float mask is made once and stays alive through
every layer's feed-forward peak (minilm, legacy export: 320,140 -> 320,896 bytes). The
``memory_recomputation`` pass (the pipeline's last, after ``memory_reordering``) compares the peak
activation memory of the result with the input's (``memory.peak``'s two figures: liveness over the
nodes' order, and over the order onnxruntime runs them in with its views and in-place outputs;
recorded by the pipeline before its first pass, inputs with symbolic dimensions at the verifier's run
shapes), and where either rose, it recomputes: a value alive across the peak whose producer is a cheap,
pure, single-output node (elementwise, casts, masks, shape and data movement; no MatMul, Conv or
reduction) gets a copy of that node for each of its readers after the peak (as each layer made its
own mask before the merge), placed where both orders run it late (``_copy``). A copy is kept only when the figure that rose falls and neither figure rises above the
larger of its current value and the input's; the pass repeats (largest value first) until neither is
above the input's or no copy helps. Results are unchanged (the copy computes what the original does);
the copies take the original's metadata (its provenance). Where nothing helps, ``optimize``'s report
still warns of the rise.

onnxruntime's own common-subexpression elimination (its basic graph optimizations, on by default)
merges the copies again when it loads the model; the figures here are the model as written (what a
session with its optimizations off, or another runtime, runs).
"""

from __future__ import annotations

import onnx_ir as ir

from .irutil import subgraphs
from .liveness import Liveness, Sizes, onnxruntime_order, result as peak_result, PEAK_KEY
from .purity import Purity

BASELINE_KEY = "onnxopt.memory.baseline"  # graph.meta (in memory only): the input's peaks, recorded first

# cheap to compute again: one pass over their inputs, no accumulation
_CHEAP = frozenset({
    "Abs", "Add", "And", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast", "CastLike",
    "Ceil", "Clip", "Concat", "ConstantOfShape", "Div", "Equal", "Expand", "Flatten", "Floor", "Greater",
    "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less", "LessOrEqual", "Max", "Min", "Mod", "Mul", "Neg",
    "Not", "Or", "Range", "Reciprocal", "Relu", "Reshape", "Round", "Shape", "Sign", "Size", "Slice", "Squeeze",
    "Sub", "Tile", "Transpose", "Unsqueeze", "Where", "Xor", "Gather", "Pad",
})

_MAX_TRIES = 256  # copies tried per pass, kept or not (each try is one liveness simulation)


def baseline(model: ir.Model, infer) -> dict:
    """The two peaks of ``model`` as it is, and whether a size is unknown (then no guard: the
    input's figure is a lower bound)."""
    g = Liveness(model, Sizes(model, infer))
    return {"graph": g.peak_of(range(len(g.nodes))),
            "onnxruntime": g.peak_of(onnxruntime_order(g), runtime=True),
            "lower_bound": bool(g.unknown)}


class _Sizes:
    """A Sizes with the copies' outputs sized as their originals."""

    def __init__(self, base: Sizes):
        self.base = base
        self.copies: dict[ir.Value, ir.Value] = {}

    def __call__(self, value: ir.Value):
        return self.base(self.copies.get(value, value))


def _peaks(g: Liveness) -> tuple[int, int]:
    return g.peak_of(range(len(g.nodes))), g.peak_of(onnxruntime_order(g), runtime=True)


def recompute(model: ir.Model, infer) -> int:
    """The pass: copies made (0 when the input's peaks were not exceeded or no copy helps)."""
    base = model.graph.meta.pop(BASELINE_KEY, None)
    if base is None or base["lower_bound"]:
        return 0
    sizes = _Sizes(Sizes(model, infer))
    g = Liveness(model, sizes)
    if g.unknown:
        return 0
    current = _peaks(g)
    limit = (base["graph"], base["onnxruntime"])
    if current[0] <= limit[0] and current[1] <= limit[1]:
        return 0
    purity = Purity(model)
    names = _names(model)
    made, tries, refused = 0, 0, set()
    while tries < _MAX_TRIES and (current[0] > limit[0] or current[1] > limit[1]):
        which = 0 if current[0] > limit[0] else 1
        order = list(range(len(g.nodes))) if which == 0 else onnxruntime_order(g)
        kept = False
        for value, readers in _candidates(g, order, purity, refused):
            tries += 1
            for early in (True, False):
                copies = [_copy(model, value, reader, names, early) for reader in readers]
                sizes.copies.update((copy.outputs[0], value) for copy in copies)
                trial = Liveness(model, sizes)
                peaks = _peaks(trial)
                if peaks[which] < current[which] and all(p <= max(c, b) for p, c, b in zip(peaks, current, limit)):
                    g, current, kept = trial, peaks, True
                    made += len(copies)
                    break
                for copy in copies:
                    _undo(model, copy, value)
            if kept:
                break
            refused.add(value)
            if tries >= _MAX_TRIES:
                break
        if not kept:
            break
    if made:
        model.graph.meta[PEAK_KEY] = peak_result(g, range(len(g.nodes)), curve=False)
    return made


def _candidates(g: Liveness, order: list[int], purity: Purity, refused: set):
    """Values alive across the peak of ``order`` (made before it, read after it, not by it), whose
    producer may be copied; largest first. Yields (value, the readers after the peak)."""
    curve, last, pos = g.simulate(order, runtime=False)
    step = curve.index(max(curve))
    at = g.nodes[order[step]]
    found = []
    for k in order[:step]:
        node = g.nodes[k]
        if len(node.outputs) != 1 or node.op_type not in _CHEAP or node.domain not in ("", "ai.onnx"):
            continue
        value = node.outputs[0]
        if value in refused or value in g.outputs or last.get(value, -1) <= step or not g.size.get(value):
            continue
        if value in at.inputs or any(True for _ in subgraphs(node)) or not purity.mergeable(node):
            continue
        uses = list(value.uses())
        if any(use.node.graph is not g.graph for use in uses):  # (read inside a body: left alone)
            continue
        readers = [use.node for use in uses if pos.get(g.index[use.node], -1) > step]
        if readers:
            found.append((g.size[value], step - pos[k], value, readers))
    found.sort(key=lambda item: (-item[0], -item[1]))
    for _, _, value, readers in found:
        yield value, readers


def _names(model: ir.Model) -> set[str]:
    names = set()
    for graph in model.graphs():
        names.update(v.name for v in graph.inputs if v.name)
        names.update(graph.initializers)
        for node in graph:
            if node.name:
                names.add(node.name)
            names.update(o.name for o in node.outputs if o.name)
    return names


def _unique(base: str, names: set[str]) -> str:
    k = 1
    while f"{base}_recomputed{k}" in names:
        k += 1
    name = f"{base}_recomputed{k}"
    names.add(name)
    return name


def _copy(model: ir.Model, value: ir.Value, reader: ir.Node, names: set[str], early: bool) -> ir.Node:
    """A copy of ``value``'s producer for ``reader``, which reads its output instead. Placed just
    before ``reader``, or (``early``) just before the last node in the graph that makes another of
    ``reader``'s inputs, where that comes after the copy's own inputs: onnxruntime explores a node's
    producers last-written first, so the copy runs after the other operands rather than before them
    (and is held while they run); in the nodes' order it is alive only while that node runs."""
    node = value.producer()
    graph = model.graph
    where = reader
    if early:
        position = {n: i for i, n in enumerate(graph)}
        own = max((position[v.producer()] for v in node.inputs
                   if v is not None and v.producer() is not None and v.producer() in position), default=-1)
        others = [position[v.producer()] for v in reader.inputs
                  if v is not None and v is not value and v.producer() is not None and v.producer() in position]
        if others and max(others) > own:
            where = graph.node(max(others))
    copy = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                   num_outputs=1, name=_unique(node.name or node.op_type, names), overload=node.overload,
                   version=node.version, metadata_props=dict(node.metadata_props))
    out = copy.outputs[0]
    out.name = _unique(value.name or "value", names)
    out.type = value.type
    out.shape = None if value.shape is None else ir.Shape(value.shape)
    graph.insert_before(where, copy)
    for use in list(value.uses()):
        if use.node is reader:
            reader.replace_input_with(use.idx, out)
    return copy


def _undo(model: ir.Model, copy: ir.Node, value: ir.Value) -> None:
    out = copy.outputs[0]
    for use in list(out.uses()):
        use.node.replace_input_with(use.idx, value)
    model.graph.remove(copy, safe=True)
