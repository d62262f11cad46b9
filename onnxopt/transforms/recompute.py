"""Recomputation where the rewrites raised the peak activation memory: optimize does not leave it raised.

Rewrites can make a value live longer or larger than the input's values did. The plain case is
common-subexpression elimination: six attention layers each turned a 256-byte boolean mask into
a 1 KiB float one just before using it; merged, the float mask is made once and stays alive through
every layer's feed-forward peak (minilm, legacy export: 320,140 -> 320,896 bytes). Another: a graph
output merged with an early twin is made early and held to the end.

The ``memory_recomputation`` pass (last in the pipeline, before ``memory_reordering``) compares the
result's peak activation memory with the input's (``memory.peak``'s two figures: liveness over the
nodes' order, and over the order onnxruntime runs them in with its views and in-place outputs; the
input's recorded by the pipeline before its first pass, symbolic inputs at the verifier's run shapes),
and where either rose, it recomputes. A value alive across the peak (made before it, read after it,
not by it) whose producer is a pure single-output node that is cheap to run again (one pass over its
data: element-wise, casts, masks, reductions, shape and data movement; not MatMul, Conv, Gemm,
recurrences, Resize, TopK, ...) gets either a copy of that producer for each reader after the peak
(as each layer made its own mask before the merge), placed where both orders run it late
(``_copy``); or, for a graph output, a copy where the producer is for its readers while the producer
itself (keeping the output's name) moves late; or, for a graph output nothing reads, the producer moves
alone (``_move``). Of a value's edits the one that lowers the excess over
the input's figures (both orders summed) most is kept, if any does; largest values first; the pass repeats until neither figure
is above the input's or no edit helps (then ``optimize``'s report warns of the rise). Results are
unchanged (a copy computes what its original does); copies take the original's metadata (its
provenance: ``onnxopt.sources`` and the exporter's keys, not ``onnxopt.merged``, since a copy merged nothing)
and record the pass (``onnxopt.rule`` ``memory_recomputation``, ``onnxopt.replaced`` ``[]``: inserted). The reordering after it keeps what this wins: it takes an order only where the nodes'
order falls and onnxruntime's does not rise.

onnxruntime's own common-subexpression elimination (its basic graph optimizations, on by default)
merges the copies again when it loads the model; the figures here are the model as written (what a
session with its optimizations off, or another runtime, runs).
"""

from __future__ import annotations

import onnx_ir as ir

from onnxopt.ir.util import MERGED_KEY, REPLACED_KEY, RULE_KEY, graphs, subgraphs
from onnxopt.transforms.liveness import Liveness, Sizes, onnxruntime_order, result as peak_result, PEAK_KEY
from onnxopt.core.purity import Purity

BASELINE_KEY = "onnxopt.memory.baseline"  # graph.meta (in memory only): the input's memory.peak, recorded first
SIZES_KEY = "onnxopt.memory.sizes"  # graph.meta (in memory only): the memory passes' last inference, and its nodes
CARRIED_KEY = "onnxopt.memory.carried"  # graph.meta (in memory only): the baseline's inferred types, for the later passes

# not cheap to compute again: work beyond one pass over the data (products, convolutions, recurrences)
_COSTLY = frozenset({
    "Attention", "Conv", "ConvInteger", "ConvTranspose", "DeformConv", "Einsum", "GRU", "Gemm", "LSTM", "MatMul",
    "MatMulInteger", "QLinearConv", "QLinearMatMul", "RNN", "NonMaxSuppression", "TopK", "Unique", "NonZero",
    "RoiAlign", "Resize", "Upsample", "GridSample", "STFT", "DFT", "MelWeightMatrix", "TfIdfVectorizer",
})
_MAX_TRIES = 256  # copies tried per pass, kept or not (each try is one liveness simulation)
_PLACES = 8  # places tried for a graph output's producer: the end, and before each of the first nodes nothing
# reads after its inputs (onnxruntime explores those last-written first: the place decides when it runs)


class _Sizes:
    """A Sizes with the copies' outputs sized as their originals."""

    def __init__(self, base: Sizes):
        self.base = base
        self.copies: dict[ir.Value, ir.Value] = {}

    def __call__(self, value: ir.Value):
        return self.base(self.copies.get(value, value))

    def dims(self, value: ir.Value):
        return self.base.dims(self.copies.get(value, value))

    def dtype(self, value: ir.Value):
        return self.base.dtype(self.copies.get(value, value))


def recompute(model: ir.Model, infer, g: Liveness | None = None) -> int:
    """The pass: copies made (0 when the input's peaks were not exceeded or no copy helps). ``g``:
    ``model``'s Liveness (sized by ``infer``) where the caller has it."""
    base = model.graph.meta.get(BASELINE_KEY)
    if base is None or base["lower_bound"]:
        return 0
    sizes = _Sizes(Sizes(model, infer))
    g = g if g is not None else Liveness(model, sizes)
    if g.unknown:
        return 0
    current = g.peaks()
    limit = (base["peak_bytes"], base["onnxruntime_peak_bytes"])
    if current[0] <= limit[0] and current[1] <= limit[1]:
        return 0
    purity = Purity(model)
    names = _names(model)
    made, tries, refused = 0, 0, set()
    while tries < _MAX_TRIES and _excess(current, limit):
        which = 0 if current[0] > limit[0] else 1
        order = list(range(len(g.nodes))) if which == 0 else onnxruntime_order(g)
        kept = False
        for value, readers in _candidates(g, order, purity, refused):
            # every edit for this value tried; the one that lowers the excess most kept (the first of equals)
            best, best_excess = None, _excess(current, limit)
            for k, edit in enumerate(_edits(model, g, value, readers, names)):
                tries += 1
                copies, undo = edit()
                sizes.copies.update((copy.outputs[0], value) for copy in copies)
                excess = _excess(Liveness(model, sizes).peaks(), limit)
                undo()
                if excess < best_excess:
                    best, best_excess = k, excess
            if best is not None:
                copies, _ = list(_edits(model, g, value, readers, names))[best]()
                sizes.copies.update((copy.outputs[0], value) for copy in copies)
                g = Liveness(model, sizes)
                current, kept = g.peaks(), True
                made += len(copies) or 1  # (a move alone counts one)
                break
            if tries >= _MAX_TRIES:
                break
            refused.add(value)
        if not kept:
            break
    if made:
        model.graph.meta[PEAK_KEY] = peak_result(g, range(len(g.nodes)), curve=False)
    return made


def _excess(peaks, limit) -> int:
    """How far the peaks are above the input's, both orders together."""
    return sum(max(0, p - b) for p, b in zip(peaks, limit))


def _edits(model: ir.Model, g: Liveness, value: ir.Value, readers: list[ir.Node], names: set[str]):
    """The ways to stop ``value`` living across the peak, each a function that makes the change and
    returns the copies it made: a copy of its producer for each reader after the peak (placed early
    or just before the reader, ``_copy``); for a graph output, a copy where the producer is for the
    readers, and the producer itself (which keeps the output's name) moved late: to the end, or
    before the first node that nothing reads (onnxruntime runs those last-written first); or, where
    it is read after the peak too, the copy for the readers before the peak only, and the producer
    moved just before the first reader after it."""
    if value in g.outputs:
        node = value.producer()
        graph = model.graph
        after = max((g.index[v.producer()] for v in node.inputs
                     if v is not None and v.producer() is not None and v.producer() in g.index), default=-1)
        roots = [k for k in range(after + 1, len(g.nodes))
                 if k != g.index[node] and not any(o.uses() for o in g.nodes[k].outputs)]
        if not value.uses():
            # nothing reads it: no copy, only where it runs (in onnxruntime's order a node nothing reads
            # is a root, explored last-written first: placed before another root it runs after that one;
            # at the end, first)
            for place in [None] + [g.nodes[k] for k in roots[:_PLACES]]:
                yield lambda place=place: _move(graph, node, place)
            return
        places = [(None, False)] + [(g.nodes[k], False) for k in roots[:_PLACES]]
        early = [u for u in dict.fromkeys(use.node for use in value.uses()) if u not in readers]
        if readers and early:  # read after the peak too: the copy for the readers before it, the producer
            places.append((min(readers, key=g.index.__getitem__), True))  # just before the first after it
        for place, split in places:
            def edit(place=place, split=split):
                users = early if split else [use.node for use in value.uses()]
                copy = _copy(model, value, node, names, False)
                for user in users:
                    for k, v in enumerate(user.inputs):
                        if v is value:
                            user.replace_input_with(k, copy.outputs[0])
                graph.remove(node, safe=False)
                if place is None:
                    graph.append(node)
                else:
                    graph.insert_before(place, node)
                return [copy], lambda: _undo(model, [copy], value)
            yield edit
        return
    for early in (True, False):
        def edit(early=early):
            copies = [_copy(model, value, reader, names, early) for reader in readers]
            return copies, lambda: _undo(model, copies, value)
        yield edit


def _move(graph: ir.Graph, node: ir.Node, place: ir.Node | None):
    """``node`` moved before ``place`` (None: to the end); no copies, and how to move it back."""
    nodes = list(graph)
    position = nodes.index(node)
    following = nodes[position + 1] if position + 1 < len(nodes) else None
    graph.remove(node, safe=False)
    if place is None:
        graph.append(node)
    else:
        graph.insert_before(place, node)

    def undo():
        graph.remove(node, safe=False)
        if following is None:
            graph.append(node)
        else:
            graph.insert_before(following, node)
    return [], undo


def _candidates(g: Liveness, order: list[int], purity: Purity, refused: set):
    """Values alive across the peak of ``order`` (made before it, read after it, not by it), whose
    producer may be copied; largest first. Yields (value, the readers after the peak)."""
    curve, last, pos = g.simulate(order, runtime=False)
    step = curve.index(max(curve))
    at = g.nodes[order[step]]
    found = []
    for k in order[:step]:
        node = g.nodes[k]
        if len(node.outputs) != 1 or node.op_type in _COSTLY or node.domain not in ("", "ai.onnx"):
            continue
        value = node.outputs[0]
        if value in refused or last.get(value, -1) <= step or not g.size.get(value):
            continue
        if value in at.inputs or any(True for _ in subgraphs(node)) or not purity.mergeable(node):
            continue
        uses = list(value.uses())
        if any(use.node.graph is not g.graph for use in uses):  # (read inside a body: left alone)
            continue
        # (each reader once: a node reading the value twice gets one copy, for both)
        readers = list(dict.fromkeys(use.node for use in uses if pos.get(g.index[use.node], -1) > step))
        if value not in g.outputs and len(readers) == len({use.node for use in uses}):
            continue  # (read only after the peak: copies would leave the producer with no reader)
        if readers or value in g.outputs:
            found.append((g.size[value], step - pos[k], value, readers))
    found.sort(key=lambda item: (-item[0], -item[1]))
    for _, _, value, readers in found:
        yield value, readers


def _names(model: ir.Model) -> set[str]:
    names = set()
    for graph in graphs(model):
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
                   version=node.version, metadata_props={
                       **{k: v for k, v in node.metadata_props.items() if k != MERGED_KEY},  # (it merged none)
                       RULE_KEY: "memory_recomputation", REPLACED_KEY: "[]"})  # (inserted, as a layout Transpose)
    out = copy.outputs[0]
    out.name = _unique(value.name or "value", names)
    out.type = value.type
    out.shape = None if value.shape is None else ir.Shape(value.shape)
    graph.insert_before(where, copy)
    for use in list(value.uses()):
        if use.node is reader:
            reader.replace_input_with(use.idx, out)
    return copy


def _undo(model: ir.Model, copies: list[ir.Node], value: ir.Value) -> None:
    """Take ``copies`` (of ``value``'s producer) out again, their readers back on ``value``, and the
    producer back before the first of them where an edit moved it."""
    graph = model.graph
    node = value.producer()
    for copy in copies:
        out = copy.outputs[0]
        for use in list(out.uses()):
            use.node.replace_input_with(use.idx, value)
    if copies and value.is_graph_output():
        graph.remove(node, safe=False)
        graph.insert_before(copies[0], node)
    for copy in copies:
        graph.remove(copy, safe=True)
