"""IR helpers every layer uses: what a value holds, who reads it, walking subgraphs, removing what
nothing reads, and pointing readers at another value while a graph output keeps its name.

A leaf: it imports onnx_ir and numpy, nothing of onnxopt.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

# Provenance, in the metadata of the nodes onnxopt makes (Netron shows it in a node's properties).
RULE_KEY = "onnxopt.rule"  # the rule that made the node
REPLACED_KEY = "onnxopt.replaced"  # the names of the nodes it matched
SOURCES_KEY = "onnxopt.sources"  # the original nodes it derives from, through earlier rewrites
MERGED_KEY = "onnxopt.merged"  # the nodes a graph pass merged into this one
OWN_PREFIX = "onnxopt."  # onnxopt's own keys: provenance, recorded by onnxopt, never inherited

STANDARD_DOMAINS = frozenset({"", "ai.onnx"})
# The ops of the standard domain that draw random values: never folded (onnxopt.ir.evaluate), never
# merged with a twin (onnxopt.core.purity). Here, below both, so that the evaluator needs no core module.
RANDOM_OPS = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
})


def domain(node: ir.Node) -> str:
    """The node's domain, with the standard one always spelled ""."""
    return "" if node.domain == "ai.onnx" else node.domain


def declare_domains(model: ir.Model) -> list[str]:
    """Import every operator domain a node uses and the model (or the local function holding the
    node) does not import: onnx.checker refuses a node of a domain its model does not import.
    Version 1 (com.microsoft's contrib ops, a local function's domain); a function's standard
    domain at the model's version. Returns what was added ("domain" or "function:domain")."""
    added: list[str] = []
    standard = opset_of(model.opset_imports, "")

    def declare(nodes, imports: dict, where: str) -> None:
        for node in nodes:
            dom = domain(node)
            if dom not in imports and not (dom == "" and "ai.onnx" in imports):
                imports[dom] = standard if dom == "" else 1
                added.append(where + dom)

    declare(model.graph.all_nodes(), model.opset_imports, "")
    for function in model.functions.values():
        declare(function.all_nodes(), function.opset_imports, f"{function.name}:")
        if function.domain and function.domain not in model.opset_imports:
            model.opset_imports[function.domain] = 1
            added.append(function.domain)
    return added


def is_standard(node: ir.Node) -> bool:
    return node.domain in STANDARD_DOMAINS


def opset_of(opsets: Mapping[str, int], domain_name: str = "") -> int:
    """The version a model imports for ``domain_name`` ("" and "ai.onnx" are one domain)."""
    if domain_name in STANDARD_DOMAINS:
        return opsets.get("", opsets.get("ai.onnx", 1))
    return opsets.get(domain_name, 1)


# --------------------------------------------------------------------------------------------
# Weights computed when they are read

# A rewrite that derives a tensor of at least this many bytes from other constants by moving their
# elements (a transpose, a concatenation) defers it: see :func:`deferred`.
DEFERRED_MIN_BYTES = 1 << 20


def deferred(compute: Callable[[], np.ndarray], dtype: ir.DataType, shape: Sequence[int]) -> ir.LazyTensor:
    """A tensor whose values ``compute()`` derives from other tensors each time they are read, kept nowhere.

    A rewrite that moves a weight's elements (a folded Transpose, packed projections' concatenation)
    gives its result so: the source tensors stay as they are (an input's external data stays
    memory-mapped, never copied), and the result exists only while something reads it: a rule that
    reads it, or the save, which writes the tensors one at a time (``onnx_ir``'s writer calls
    ``tofile`` on each). So optimizing a model over 2 GB holds one rewritten weight at a time, not all
    of them. ``compute`` must give the same array each time (it reads constants only); the array is
    checked against ``dtype`` and ``shape``."""
    shape = tuple(int(d) for d in shape)

    def materialise() -> ir.Tensor:
        array = np.ascontiguousarray(compute())
        if array.shape != shape or ir.DataType.from_numpy(array.dtype) != dtype:
            raise AssertionError(f"a deferred tensor computed {array.dtype}{list(array.shape)}, "
                                 f"declared {dtype.name}{list(shape)}")
        return ir.Tensor(array, dtype=dtype)

    return ir.LazyTensor(materialise, dtype=dtype, shape=ir.Shape(shape), cache=False)


# --------------------------------------------------------------------------------------------
# What a value holds, who reads it


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor behind ``value`` if it is known at optimization time, else None.

    Initializers that are also graph inputs are *not* constant: the caller may override them.
    """
    if value is None:
        return None
    producer = value.producer()
    if producer is None:
        if value.const_value is not None and not value.is_graph_input():
            return value.const_value
        return None
    if producer.op_type == "Constant" and producer.domain in STANDARD_DOMAINS:
        attr = producer.attributes.get("value")
        if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.TENSOR:
            return attr.value  # (as_tensor() re-checks the type against a Protocol: slow)
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
            attr = producer.attributes.get(key)
            if attr is not None and not attr.is_ref():
                return ir.tensor(np.array(attr.value, dtype=dtype))
        for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
            attr = producer.attributes.get(key)
            if attr is not None and not attr.is_ref():
                return ir.tensor(np.array(list(attr.value), dtype=dtype))
    return None


def use_count(value: ir.Value) -> int:
    """``len(value.uses())`` without the copy onnx_ir's ``uses()`` makes of every use: a weight
    read by 50k nodes is asked once per rewrite, and that copy made the driver quadratic. (It
    reads onnx_ir's private use table, and falls back to ``uses()`` should that change.)"""
    uses = getattr(value, "_uses", None)
    return len(uses) if isinstance(uses, dict) else len(value.uses())


def nbytes(tensor: ir.TensorProtocol) -> int:
    """The tensor's size in bytes, without reading its data."""
    try:
        return int(tensor.nbytes)
    except Exception:  # noqa: BLE001 - a tensor type without nbytes
        return int(np.prod(tensor.shape.numpy(), dtype=np.int64)) * max(1, tensor.dtype.itemsize)


def is_unused(node: ir.Node) -> bool:
    """Nothing reads the node's outputs and none is a graph output."""
    return not any(use_count(v) or v.is_graph_output() for v in node.outputs)


def node_counts(model: ir.Model) -> dict[str, int]:
    """Nodes by op type (``domain.Op`` outside the standard domain), in every graph."""
    counts: collections.Counter = collections.Counter()
    for graph in graphs(model):
        for node in graph:
            counts[node.op_type if is_standard(node) else f"{node.domain}.{node.op_type}"] += 1
    return dict(sorted(counts.items()))


def recorded_sources(node: ir.Node) -> list[str]:
    """The original nodes ``node`` stands for as its provenance records them (``onnxopt.sources``, else
    the ``onnxopt.replaced`` of a node a rule made); [] for a node of the original model."""
    props = node.metadata_props
    for key in (SOURCES_KEY, REPLACED_KEY) if RULE_KEY in props else (SOURCES_KEY,):
        try:
            names = json.loads(props.get(key, "null"))
        except (ValueError, RecursionError):  # (not onnxopt's JSON: a model may hold anything there)
            continue
        if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            return names
    return []


def inherit_metadata(node: ir.Node, sources: Iterable[ir.Node]) -> None:
    """Give ``node`` the metadata (``metadata_props``) of the nodes it takes the place of, such as
    the exporter's ``pkg.torch.onnx.stack_trace``: for each key, the value of the first source that
    carries it, so the sources' common value where they agree and the first one's where they
    differ. Keys ``node`` has already stay as they are, and onnxopt's own keys (``onnxopt.*``,
    provenance) are not inherited. The order of ``sources`` decides: the driver passes the nodes
    a rule matched, root first; CSE the kept node first."""
    props = node.metadata_props
    for source in sources:
        if source is node:
            continue
        for key, value in source.metadata_props.items():
            if key not in props and not key.startswith(OWN_PREFIX):
                props[key] = value


# --------------------------------------------------------------------------------------------
# Subgraphs


_GRAPH, _GRAPHS = ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS


def graphs(model: ir.Model) -> Iterator[ir.Graph]:
    """What ``model.graphs()`` gives, the same graphs in the same order (the main graph; then, once it
    has been walked, every subgraph, depth first as met), found by a plain walk of the nodes that hold
    attributes (:func:`subgraphs`): ~1.5x faster than onnx_ir's generic traversal, and a run walks the
    graph a dozen times."""
    yield model.graph
    yield from graphs_below(model.graph)


def graphs_below(graph: ir.Graph) -> list[ir.Graph]:
    """Every subgraph below ``graph`` (``graph.subgraphs()``: depth first as met, each once), as a list."""
    found: dict[ir.Graph, None] = {}
    _walk_graphs(graph, found)
    return list(found)


def _walk_graphs(graph: ir.Graph, found: dict) -> None:
    for node in graph:
        if not node.attributes:  # (most nodes: no attribute to look through)
            continue
        for sub in subgraphs(node):
            found.setdefault(sub, None)
            _walk_graphs(sub, found)


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs a node holds in its attributes (If branches, Loop and Scan bodies)."""
    for attr in node.attributes.values():
        kind = attr.type  # (compared first: most attributes are neither, and is_ref is a call)
        if kind is _GRAPH:
            if not attr.is_ref():
                yield attr.as_graph()
        elif kind is _GRAPHS and not attr.is_ref():
            yield from attr.as_graphs()


def detach_graph(graph: ir.Graph) -> list[ir.Value]:
    """Disconnect every node of ``graph`` (and its subgraphs) from its inputs, so that a removed
    If/Loop/Scan body stops counting as a reader of outer values; returns the outer-scope values
    they read."""
    outer = []
    for node in graph.all_nodes():
        for i, value in enumerate(node.inputs):
            if value is None:
                continue
            producer = value.producer()
            owner = producer.graph if producer is not None else value.graph
            if owner is not None and owner is not graph and owner is not node.graph:
                outer.append(value)
            node.replace_input_with(i, None)
    return outer


# --------------------------------------------------------------------------------------------
# Removing what nothing reads

Removable = Callable[[ir.Node, "Mapping[str, int] | None"], bool]
"""Whether a node nothing reads may go (``onnxopt.core.purity.Purity.removable``): ``(node, opsets)``,
with the imports of the function whose body holds it (None: the model's)."""


def _remove_unused_in(graph: ir.Graph, removable: Removable) -> int:
    """One reverse pass (users come after producers, so chains go at once), then initializers."""
    removed = 0
    for node in reversed(graph):
        if not is_unused(node) or not removable(node, None):
            for sub in subgraphs(node):
                removed += _remove_unused_in(sub, removable)
            continue
        for sub in subgraphs(node):
            detach_graph(sub)
        graph.remove(node, safe=True)
        removed += 1
    for name, value in list(graph.initializers.items()):
        if not use_count(value) and not value.is_graph_output() and not value.is_graph_input():
            del graph.initializers[name]
            removed += 1
    return removed


def remove_unused(model: ir.Model, removable: Removable) -> int:
    """Dead nodes and unused initializers, in the main graph, every subgraph and local function.

    Graph inputs and outputs are kept: the model's interface does not change. A node nothing reads
    goes only when ``removable`` says so (nodes that may have effects stay). (onnx_ir's
    RemoveUnusedNodesPass also trims optional outputs, but looks up an op schema per node, which
    costs more than the whole rewrite on large graphs, and removes any unused node.)
    """
    removed = _remove_unused_in(model.graph, removable)
    for function in model.functions.values():
        for node in reversed(function):
            if is_unused(node) and removable(node, function.opset_imports):
                function.remove(node, safe=True)
                removed += 1
    return removed


def remove_dead(replaced: Sequence[ir.Node], removable: Removable) -> tuple[list[ir.Value], list[ir.Node]]:
    """After a rewrite: remove the ``replaced`` nodes that nothing reads any more, then the
    producers that became unused and may go (``removable``); returns the values the removed nodes
    read (each has lost a use) and the nodes that went, in the order they went."""
    lost: list[ir.Value] = []
    removed: list[ir.Node] = []
    stack = [(node, True) for node in reversed(replaced)]
    while stack:
        node, was_replaced = stack.pop()
        graph = node.graph
        if graph is None or not is_unused(node) or not (was_replaced or removable(node, None)):
            continue
        inputs = [v for v in node.inputs if v is not None]
        for sub in subgraphs(node):
            inputs += detach_graph(sub)  # a removed body's nodes stop counting as readers of outer values
        graph.remove(node, safe=True)
        removed.append(node)
        lost += inputs
        for value in inputs:
            producer = value.producer()
            if producer is not None and producer.graph is not None:
                stack.append((producer, False))
    return lost, removed


# --------------------------------------------------------------------------------------------
# Pointing readers at another value


def can_take_output(value: ir.Value) -> bool:
    """``value`` may become a graph output under another name: it is an ordinary intermediate."""
    return not (value.is_graph_output() or value.is_graph_input() or value.is_initializer())


SAME_AS_KEY = "onnxopt.same_as"  # Value.meta (in memory only): the name of the value this one replaced, taking its name


def redirect(old: ir.Value, new: ir.Value, *, take_name: bool = False) -> list[ir.Node]:
    """Point every reader of ``old`` at ``new``; returns the nodes that read ``old``. A graph output
    keeps its name, type and shape (``new`` takes them: it must be able to, see :func:`can_take_output`), and with
    ``take_name`` ``new`` takes ``old``'s name in any case (a value a rewrite made)."""
    readers = list(old.consumers())
    name = old.name
    if old.is_graph_output() or (take_name and name):
        if old.is_graph_output():  # (the output's declared type and shape: the same tensor)
            new.type = old.type if old.type is not None else new.type
            new.shape = old.shape if old.shape is not None else new.shape
        old.name = None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        new.name = name
        new.meta[SAME_AS_KEY] = name  # the tensor ``old`` was, under its name (onnxopt.transforms.memory reads it)
    else:
        old.replace_all_uses_with(new)
    return readers


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector paused for the duration (nesting is fine): the IR is a large
    web of reference cycles, and the collector's full passes over it make time grow faster than
    the graph; nothing onnxopt does relies on it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            # Hand what was allocated meanwhile to the oldest generation (two list splices) so
            # that re-enabling does not start with one young-generation pass over all of it; it
            # is collected by the next full collection, as long-lived data would be.
            gc.freeze()
            gc.unfreeze()
            gc.enable()


_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})  # the ONNX ops with graph attributes


def proto_graphs(graph: onnx.GraphProto):
    """A GraphProto and its subgraphs (If/Loop/Scan/SequenceMap bodies, and any graph attribute of an
    op of another domain, nested), depth first. (The attributes of ONNX ops without subgraphs are not
    read: on large graphs that was most of the walk's time.)"""
    yield graph
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type not in _SUBGRAPH_OPS:
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from proto_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from proto_graphs(g)


def fresh_namer(taken: set) -> Callable[[str], str]:
    """A function giving ``base``, else ``base_1``, ``base_2``, ...: the first name not in ``taken``
    (which it then joins)."""
    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    return fresh


def moves_data(in_shape: Sequence, perm: Sequence[int]) -> bool:
    """A Transpose of a tensor of ``in_shape`` by ``perm`` moves elements (it moves a dimension
    other than a size-1 one; a dimension that is not a number counts as not size 1)."""
    kept = [p for p in perm if in_shape[p] != 1]
    return kept != sorted(kept)


def perm_of(node: ir.Node, rank: int | None) -> list[int] | None:
    attr = node.attributes.get("perm")
    if attr is not None and not attr.is_ref():
        return [int(p) for p in attr.value]
    return None if rank is None else list(reversed(range(rank)))


