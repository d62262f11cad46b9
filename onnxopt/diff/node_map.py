"""The node map between two models, BEFORE and AFTER: which BEFORE nodes each AFTER node stands for,
read from onnxopt's provenance where AFTER carries it (``from_provenance``), else found by an alignment
(``align``: names, constant contents, op types, neighbourhoods); the models as this map sees them
(``Graph``); how far two maps agree (``agreement``). The map's form is ``onnxopt.diff``'s docstring's.

May import: onnx, numpy, ``onnxopt.ir`` (reading models as every command does, provenance keys) and
``onnxopt.errors``; nothing else of ``onnxopt.diff``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from onnxopt.ir.io import proto_graphs, read_checked
from onnxopt.ir.util import MERGED_KEY, OWN_PREFIX, REPLACED_KEY, RULE_KEY, SOURCES_KEY


# --------------------------------------------------------------------------------------------
# A graph as the mapping sees it


class _Node:
    __slots__ = ("key", "named", "op", "attrs", "attr_values", "inputs", "outputs", "props", "index")

    def __init__(self, key, named, proto: onnx.NodeProto, index):
        self.key, self.named, self.index = key, named, index
        self.op = (proto.domain if proto.domain not in ("", "ai.onnx") else "", proto.op_type)
        self.attr_values = _attr_values(proto)
        self.attrs = hashlib.sha1(repr(sorted(self.attr_values.items())).encode()).hexdigest()[:16]
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        self.props = {p.key: p.value for p in proto.metadata_props}


def _attr_values(proto: onnx.NodeProto) -> dict[str, str]:
    """Attribute name -> a hash of its value (a subgraph's nodes are mapped themselves: its name only)."""
    return {a.name: "graph" if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) else
            hashlib.sha1(a.SerializeToString(deterministic=True)).hexdigest()[:16] for a in proto.attribute}


def _tensor_hash(t: onnx.TensorProto) -> str:
    try:
        arr = numpy_helper.to_array(t)
        data = np.ascontiguousarray(arr).tobytes() if arr.dtype != object else repr(arr.tolist()).encode()
        desc = f"{arr.dtype}{arr.shape}".encode()
    except Exception:  # noqa: BLE001 - external data not at hand: its description stands for it
        data = t.SerializeToString(deterministic=True)
        desc = b""
    return hashlib.sha1(desc + data).hexdigest()[:16]


class Graph:
    """The nodes of a model (subgraphs included), their edges and the constants they read."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.nodes: list[_Node] = []
        self.consts: dict[str, str] = {}  # value name -> content hash
        self.graph_inputs: set[str] = set()
        self.graph_outputs: set[str] = set()
        self._keys: set[str] = set()
        # every name in the model: a position key never takes one (a node may be named "#1")
        self._names = {n.name for g in proto_graphs(model.graph) for n in g.node if n.name}
        self.main: list[_Node] = []  # the main graph's nodes, in order
        self._walk(model.graph, "")
        self.by_key = {n.key: n for n in self.nodes}
        self.producer: dict[str, tuple[_Node, int]] = {}
        self.consumers: dict[str, list[tuple[_Node, int]]] = collections.defaultdict(list)
        for n in self.nodes:
            for j, o in enumerate(n.outputs):
                if o:
                    self.producer[o] = (n, j)
            for i, v in enumerate(n.inputs):
                if v:
                    self.consumers[v].append((n, i))

    def _walk(self, graph: onnx.GraphProto, prefix: str) -> None:
        inits = {t.name for t in graph.initializer}
        for t in graph.initializer:
            self.consts[t.name] = _tensor_hash(t)
        for v in graph.input:
            if v.name not in inits:
                self.graph_inputs.add(v.name)
            else:
                self.consts.pop(v.name, None)  # an input with a default: not a constant
        self.graph_outputs.update(v.name for v in graph.output)  # (a branch's outputs anchor it as the main's do)
        for i, proto in enumerate(graph.node):
            # a name met before (in this graph or another) is no identity: the node is keyed by position
            named = bool(proto.name) and proto.name not in self._keys
            key = proto.name if named else f"{prefix}#{i}"
            while not named and (key in self._names or key in self._keys):
                key += "#"
            self._keys.add(key)
            node = _Node(key, named, proto, len(self.nodes))
            self.nodes.append(node)
            if not prefix:
                self.main.append(node)
            if proto.op_type == "Constant" and proto.domain in ("", "ai.onnx") and proto.output:
                for a in proto.attribute:
                    if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                        self.consts[proto.output[0]] = _tensor_hash(a.t)
                    elif a.name != "value":
                        self.consts[proto.output[0]] = hashlib.sha1(a.SerializeToString()).hexdigest()[:16]
            for a in proto.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    self._walk(a.g, f"{key}/{a.name}")
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for k, g in enumerate(a.graphs):
                        self._walk(g, f"{key}/{a.name}{k}")

    def op_counts(self) -> dict[str, int]:
        c = collections.Counter(f"{d}.{op}" if d else op for d, op in (n.op for n in self.nodes))
        return dict(sorted(c.items()))


def load(model) -> onnx.ModelProto:
    """A model file read as onnxopt reads one (a one-line error for a file that is not ONNX, truncated or
    missing its external data), with its external data: initializer contents are compared."""
    if isinstance(model, onnx.ModelProto):
        return model
    from onnx.external_data_helper import load_external_data_for_model


    proto, external = read_checked(model, check=False)
    if external:
        load_external_data_for_model(proto, os.path.dirname(os.path.abspath(os.fspath(model))))
    return proto


# --------------------------------------------------------------------------------------------
# The mapping from provenance


def has_provenance(after: Graph) -> bool:
    return any(RULE_KEY in n.props or MERGED_KEY in n.props for n in after.nodes)


def from_provenance(before: Graph, after: Graph) -> dict:
    """The mapping AFTER's provenance records; AFTER nodes without it are matched by name (or, for
    unnamed ones, by structure: ``align``)."""
    names = {n.key for n in before.nodes if n.named}
    pairs: dict[str, list[str]] = {}
    rules: dict[str, str | None] = {}
    replaced: dict[str, list[str]] = {}
    plain = []
    for n in after.nodes:
        rule = n.props.get(RULE_KEY)
        same = before.by_key.get(n.key) if n.named and n.key in names else None
        if rule is None or (same is not None and all(same.props.get(k) == n.props.get(k) for k in (RULE_KEY, REPLACED_KEY))):
            plain.append(n)  # (a node BEFORE holds already, made by an earlier optimization: itself)
            continue
        rep = _json_list(n.props.get(REPLACED_KEY))
        src = _json_list(n.props.get(SOURCES_KEY))
        rules[n.key] = rule
        replaced[n.key] = rep
        pairs[n.key] = [s for s in dict.fromkeys(src + rep) if s in names]
    kept_named = {}
    for n in plain:
        if n.named and n.key in names:
            twins = _json_list(n.props.get(MERGED_KEY)) + _json_list(n.props.get(SOURCES_KEY))
            kept_named[n.key] = list(dict.fromkeys([n.key] + [m for m in twins if m in names]))
    pairs.update(kept_named)
    rest = [n for n in plain if n.key not in kept_named]
    if rest:  # unnamed or renamed nodes without provenance: by structure
        used = {b for bs in pairs.values() for b in bs}
        sub = align(before, after, skip_before=used, skip_after=set(pairs))
        for n in rest:
            pairs[n.key] = sub["pairs"].get(n.key, [])
    made = set(rules)
    if rest:
        made |= {c["after"] for c in sub["created"]} & {n.key for n in rest}
    return _classify(before, after, pairs, rules, replaced, "provenance", made)


def _json_list(text: str | None) -> list[str]:
    try:
        value = json.loads(text or "[]")
    except (ValueError, RecursionError):  # (a model's metadata may hold anything: 100,000 nested arrays)
        return []
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _changed(b: _Node, a: _Node, before: Graph, after: Graph) -> bool:
    """The node itself differs: op, attributes, arity, or a constant input (constant in both) with other
    contents. (An input that became a constant by folding upstream leaves the node as it was.)"""
    if b.op != a.op or b.attrs != a.attrs or len(b.inputs) != len(a.inputs):
        return True
    return any(vb in before.consts and va in after.consts and before.consts[vb] != after.consts[va]
               for vb, va in zip(b.inputs, a.inputs))


def _classify(before: Graph, after: Graph, pairs, rules, replaced, method, made) -> dict:
    """Statuses from the pairs: a node in ``made`` is created unless it stands for exactly one BEFORE
    node of its op (then changed or kept); any other node with a partner is kept or changed."""
    created, fused, changed, kept = [], [], [], []
    for n in after.nodes:
        bs = pairs.get(n.key, [])
        pairs[n.key] = bs
        alone = len(bs) == 1 and before.by_key[bs[0]].op == n.op and n.key not in rules
        if (n.key in made and not alone) or not bs:
            created.append({"after": n.key, "rule": rules.get(n.key), "replaced": replaced.get(n.key, bs)})
            if len(bs) > 1:
                fused.append(n.key)
        elif _changed(before.by_key[bs[0]], n, before, after):
            changed.append({"before": bs[0], "after": n.key})
        else:
            kept.append(n.key)
    # a "fused" node is one made alone from many: several created nodes sharing their sources are a rewrite
    group = collections.Counter(tuple(sorted(pairs[k])) for k in fused)
    fused = [k for k in fused if group[tuple(sorted(pairs[k]))] == 1]
    mapped = {b for bs in pairs.values() for b in bs}
    removed = [n.key for n in before.nodes if n.key not in mapped]
    return {"method": method, "created": created, "fused": fused, "removed": removed, "changed": changed,
            "kept": kept, "pairs": pairs}


# --------------------------------------------------------------------------------------------
# The mapping from an alignment (no provenance)

_DEPTH = 4


def _signatures(g: Graph, fixed: set[str] | None = None) -> dict[str, list[str]]:
    """By node key, [k]: a hash of the node and what it reads, k producers deep (constants by content,
    graph inputs and outputs by name). With ``fixed`` (constant-like values: ``_constant_like``),
    constants and what folding would make of them are alike: "a constant", content unseen."""
    sig: dict[str, list[str]] = {}
    const = set(g.consts) if fixed is None else fixed
    for n in g.nodes:
        h = hashlib.sha1(repr((n.op, n.attrs)).encode())
        for v in n.inputs:
            h.update(("k" if fixed is not None and v in fixed else f"c{g.consts[v]}" if v in g.consts else
                      f"i{v}" if v in g.graph_inputs else "-" if not v else "n").encode() + b"|")
        for v in n.outputs:
            if v in g.graph_outputs:
                h.update(f"o{v}".encode())
        sig[n.key] = [h.hexdigest()[:16]]
    for k in range(1, _DEPTH + 1):
        for n in g.nodes:
            h = hashlib.sha1(sig[n.key][0].encode())
            for v in n.inputs:
                p = g.producer.get(v)
                if p is not None and v not in const:
                    h.update(f"{sig[p[0].key][k - 1]}:{p[1]}|".encode())
            sig[n.key].append(h.hexdigest()[:16])
    return sig


def align(before: Graph, after: Graph, *, use_names: bool = True, skip_before=frozenset(),
          skip_after=frozenset()) -> dict:
    """The mapping from names, constants and structure: equal names with equal op types; then
    nodes equal k producers deep (k = 4 .. 0), each signature shared by as many nodes on both sides
    paired in order; then neighbours of pairs with one candidate on each side (same op, same slot);
    then the same with constants alike (content unseen: folded weights). Unmatched BEFORE nodes
    equal to a matched one were merged into its partner (``_twins``); those an AFTER node reads past
    were eliminated, or folded into it where two of their op make one (``_bypassed``). What is left:
    an AFTER node is created, standing for the unmatched BEFORE nodes it touches through the same
    edges (a region of unmatched nodes on each side, linked where they meet the same matched node
    on the same input or output slot; a region of several rewrites split by ``_split``); a BEFORE
    node is removed."""
    # exact signatures first; then, for what is left, with constants alike (folded weights: a
    # Transpose of an initializer before, the transposed initializer after)
    rounds = [(_signatures(before), _signatures(after)),
              (_signatures(before, _constant_like(before)), _signatures(after, _constant_like(after)))]
    b2a: dict[str, str] = {}
    a2b: dict[str, str] = {}

    def pair(b: _Node, a: _Node) -> bool:
        if b.key in b2a or a.key in a2b or b.key in skip_before or a.key in skip_after or b.op != a.op:
            return False
        b2a[b.key], a2b[a.key] = a.key, b.key
        return True

    if use_names:
        for a in after.nodes:
            b = before.by_key.get(a.key)
            if a.named and b is not None and b.named:
                pair(b, a)
    for (sig_b, sig_a), k in ((r, k) for r in rounds for k in range(_DEPTH, -1, -1)):
        groups_b = collections.defaultdict(list)
        groups_a = collections.defaultdict(list)
        for b in before.nodes:
            if b.key not in b2a and b.key not in skip_before:
                groups_b[sig_b[b.key][k]].append(b)
        for a in after.nodes:
            if a.key not in a2b and a.key not in skip_after:
                groups_a[sig_a[a.key][k]].append(a)
        for s, bs in groups_b.items():
            as_ = groups_a.get(s)
            if as_ and len(bs) == len(as_):
                for b, a in zip(bs, as_):
                    pair(b, a)
        _propagate(before, after, b2a, a2b, pair)
    _propagate(before, after, b2a, a2b, pair, through=True)
    # regions of unmatched nodes, linked across the matched boundary
    parent: dict[tuple, tuple] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x, y):
        parent[find(x)] = find(y)

    def changed(a: _Node) -> bool:
        return _changed(before.by_key[a2b[a.key]], a, before, after)

    loose_a = {a.key for a in after.nodes if a.key not in skip_after and (a.key not in a2b or changed(a))}
    merged = _twins(before, b2a, skip_before)
    twins = {k for ks in merged.values() for k in ks}
    # an unmatched Identity was eliminated (nothing takes its place), not fused into its neighbours
    dropped = {b.key for b in before.nodes if b.op == ("", "Identity") and b.key not in b2a}
    rep = {**b2a, **{k: a for a, ks in merged.items() for k in ks}}  # BEFORE key -> AFTER key standing for it
    absorbed = _bypassed(before, after, b2a, rep, a2b, loose_a, set(skip_before))
    bypassed = {k for ks in absorbed.values() for k in ks}
    dropped |= set(absorbed.pop("", ()))
    # a twin nothing matched reads (its readers unmatched too) went with them: removed, not merged
    live = _live(before, b2a, twins, dropped | bypassed)
    merged = {a: [k for k in ks if k in live and k not in bypassed] for a, ks in merged.items()}
    gone = dropped | bypassed | (twins & live)
    loose_b = {b.key for b in before.nodes if b.key not in skip_before and b.key not in b2a and b.key not in gone}
    loose_b |= {a2b[k] for k in loose_a if k in a2b}
    a_order = {n.key: n.index for n in after.nodes}
    b_order = {n.key: n.index for n in before.nodes}
    loose_a_list = sorted(loose_a, key=a_order.get)  # (set order varies with the hash seed: the output must not)
    loose_b_list = sorted(loose_b, key=b_order.get)
    for a in loose_a_list:
        if a in a2b:
            union(("a", a), ("b", a2b[a]))
    for side, g, loose in (("a", after, loose_a), ("b", before, loose_b)):
        fixed = _constant_like(g)
        for n in g.nodes:
            if n.key not in loose:
                continue
            find((side, n.key))
            if all(o in fixed for o in n.outputs if o):
                continue  # folding material joins no region through what it reads
            for v in n.inputs:
                p = g.producer.get(v)
                if p is not None and p[0].key in loose and v not in fixed:
                    union((side, n.key), (side, p[0].key))
    # Regions that feed the same matched node's same input slot (or the same graph output) took
    # each other's place: linked. (Regions that only read the same value are not: a removed branch
    # and a fusion beside it share their input, not their purpose.)
    touch = collections.defaultdict(set)
    for side, g, loose, m in (("a", after, loose_a, a2b), ("b", before, loose_b, None)):
        for n in g.nodes:
            if n.key not in loose:
                continue
            for v in n.outputs:
                if v in g.graph_outputs:
                    touch[("output", v)].add(find((side, n.key)))
                for c, i in _readers(g, v, dropped if m is None else ()):
                    if c.key not in loose:
                        touch[("in", m.get(c.key) if m is not None else c.key, i)].add(find((side, n.key)))
    for regions in touch.values():
        regions = list(regions)
        if len({r[0] for r in regions}) == 2:
            for r in regions[1:]:
                union(regions[0], r)
    members = collections.defaultdict(lambda: ([], []))
    for b in loose_b_list:
        members[find(("b", b))][0].append(b)
    for a in loose_a_list:
        members[find(("a", a))][1].append(a)
    pairs: dict[str, list[str]] = {a: [b] for a, b in a2b.items()}
    order = {n.key: n.index for n in before.nodes}
    for bs, as_ in members.values():
        bs = sorted(bs, key=order.get)
        split = _split(before, after, bs, as_, a2b) if len(as_) > 1 else None
        for a in as_:
            pairs[a] = split[a] if split else bs
    for a, ks in [*merged.items(), *absorbed.items()]:
        if a in pairs:  # (not one of skip_after)
            pairs[a] = pairs[a] + ks
    for a in after.nodes:
        if a.key not in skip_after:
            pairs.setdefault(a.key, [])
    made = loose_a | set(absorbed)
    # a node under a name BEFORE lacks was made by a rewrite, even where it pairs with a node as it was
    renamed = {a.key for a in after.nodes if a.named and a.key not in before.by_key} if use_names else set()
    _absorb_shape_chains(before, after, pairs, skip_before, made | renamed)
    return _classify(before, after, pairs, {}, {}, "alignment", made)


def _absorb_shape_chains(before: Graph, after: Graph, pairs: dict[str, list[str]], skip, rewritten: set[str]) -> None:
    """Shape arithmetic nothing in AFTER stands for (Shape, Gather, Unsqueeze, Concat computing a Reshape's
    shape from an activation), read only by nodes that map to nodes a rewrite made, went with those
    rewrites: the last of them (in AFTER's order: the rewrite after which the arithmetic had no reader
    left) stands for it too, as a rewrite's provenance records the producers that died with it. Read by
    a node AFTER keeps as it was, it was folded away (removed); chains of constants alone too."""
    shaped = _constant_like(before) - _constant_like(before, shapes=False)
    order = {a.key: a.index for a in after.nodes}
    owner: dict[str, set[str]] = collections.defaultdict(set)
    for a, bs in pairs.items():
        for b in bs:
            owner[b].add(a)
    for n in reversed(before.nodes):
        if n.key in owner or n.key in skip or not n.outputs or not all(o in shaped for o in n.outputs if o):
            continue
        if any(v in before.graph_outputs for v in n.outputs):
            continue
        targets = [owner.get(c.key, set()) for v in n.outputs if v for c, _ in _readers(before, v, ())]
        if targets and all(len(t) == 1 and t <= rewritten for t in targets):
            a = max((next(iter(t)) for t in targets), key=order.get)
            pairs[a] = pairs[a] + [n.key]
            owner[n.key].add(a)


def _readers(g: Graph, v: str, through) -> list[tuple[_Node, int]]:
    """The nodes reading value v and on which input slot, looking through the nodes in ``through``
    (eliminated ones: what read them now reads what they read)."""
    out = []
    for c, i in g.consumers.get(v, ()):
        if c.key in through:
            out += [r for o in c.outputs if o for r in _readers(g, o, through)]
        else:
            out.append((c, i))
    return out


def _twins(before: Graph, b2a: dict[str, str], skip) -> dict[str, list[str]]:
    """BEFORE nodes merged into a matched one (common subexpressions), by AFTER node: unmatched, equal
    to a matched node in op, attributes and inputs. Values are numbered as common-subexpression
    elimination numbers them: a constant by its contents, the output of a node standing for an AFTER
    node (matched, or merged: so a chain of merged nodes is found link by link) by that node, any
    other output by its node's op, attributes and inputs' numbers (what folding made a constant)."""
    rep = dict(b2a)  # BEFORE key -> the AFTER node standing for it
    merged: dict[str, list[str]] = collections.defaultdict(list)
    grew = True
    while grew:
        grew = False
        number: dict[str, tuple] = {}
        ids: dict[tuple, int] = {}
        keys: dict[str, tuple] = {}
        first: dict[tuple, str] = {}
        for b in before.nodes:  # (topological order)
            ins = tuple(("c", before.consts[v]) if v in before.consts else number.get(v, ("v", v)) for v in b.inputs)
            keys[b.key] = key = (b.op, b.attrs, ins)
            if b.key in b2a:
                first.setdefault(key, b2a[b.key])
            made = ("n", rep[b.key]) if b.key in rep else ("s", ids.setdefault(key, len(ids)))
            for j, o in enumerate(b.outputs):
                if o:
                    number[o] = (*made, j)
        for b in before.nodes:
            a = first.get(keys[b.key]) if b.inputs and b.key not in rep and b.key not in skip else None
            if a is not None:
                rep[b.key] = a
                merged[a].append(b.key)
                grew = True
    return merged


def _live(before: Graph, b2a, candidates: set[str], through: set[str]) -> set[str]:
    """The candidates something matched reads (directly, through other candidates, or through the
    nodes in ``through``: eliminated ones), or that make a graph output."""
    live = set(b2a)
    for b in reversed(before.nodes):
        if (b.key in candidates or b.key in through) and b.key not in live and any(
                v in before.graph_outputs or any(c.key in live for c, _ in before.consumers.get(v, ()))
                for v in b.outputs):
            live.add(b.key)
    return live


_BYPASS_DEPTH = 6
# ops two of which in a row make one of their kind (what a chain rewrite folds into its last node)
_COMPOSING = {("", op) for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Cast", "Expand")}


def _gained(b: _Node, a: _Node) -> bool:
    """AFTER node ``a`` has an attribute its partner ``b`` has not, or has with another value (one
    ``b`` spelled out and ``a`` leaves to its default is no gain)."""
    return any(b.attr_values.get(k) != v for k, v in a.attr_values.items())


def _bypassed(before: Graph, after: Graph, b2a, rep, a2b, loose, skip) -> dict[str, list[str]]:
    """BEFORE nodes a matched pair's AFTER node reads past: where the AFTER node reads, on some input
    slot, what an unmatched BEFORE node upstream of its partner's same slot read (``rep``: the AFTER
    node standing for a BEFORE node, matched or merged), the unmatched nodes between were bypassed
    (merged ones too: a chain folded before its twins were merged). Those of the op of the AFTER
    node or of the one it reads, where two of that op make one, were folded into that node (a chain
    of Reshapes, Unsqueezes, Transposes made one), by AFTER node. The others, where the AFTER node
    gained no attribute value and what it reads is made as before (a kept node, a graph input), were
    eliminated (an Add of zeros, two Transposes that cancel): under the key "" (nothing stands for
    them); else they were fused into one of them (a Pad into a Conv's pads, a BatchNormalization
    into the Conv before it): left to the regions. ``loose``: AFTER nodes changed or unmatched."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    taken = set(skip)

    def equiv(v: str) -> str | None:  # the AFTER value standing for BEFORE's v
        p = before.producer.get(v)
        if p is None:
            return v if v in before.graph_inputs else None
        k = rep.get(p[0].key)
        return after.by_key[k].outputs[p[1]] if k is not None and p[1] < len(after.by_key[k].outputs) else None

    def path(v: str, target: str, depth: int) -> list[str] | None:
        if v in before.consts:
            return None
        if equiv(v) == target:
            return []
        p = before.producer.get(v)
        if p is None or depth == 0 or p[0].key in b2a or p[0].key in taken:
            return None
        for u in p[0].inputs:
            found = path(u, target, depth - 1) if u else None
            if found is not None:
                return [p[0].key] + found
        return None

    for a in after.nodes:  # (AFTER's order: deterministic)
        bk = a2b.get(a.key)
        if bk is None:
            continue
        for vb, va in zip(before.by_key[bk].inputs, a.inputs):
            p = before.producer.get(vb)
            if not va or p is None or p[0].key in b2a:
                continue
            found = path(vb, va, _BYPASS_DEPTH)
            source = after.producer.get(va)
            for k in found or ():
                op = before.by_key[k].op
                into = a if op == a.op else source[0] if source is not None and op == source[0].op else None
                if into is not None and op in _COMPOSING:
                    out[into.key].append(k)
                elif not _gained(before.by_key[bk], a) and (source is None or source[0].key not in loose):
                    out[""].append(k)
                else:
                    continue  # what reads past it or what it reads changed: a fusion (Pad into a Conv's pads)
                taken.add(k)
    return out


def _split(before: Graph, after: Graph, bs: list[str], as_: list[str], a2b) -> dict[str, list[str]] | None:
    """Several rewrites side by side make one region (two Conv+BatchNormalization folds in a row; a
    Gemm made a MatMul beside a SplitToSequence made a Split): where every AFTER node of the region
    has an anchor among its BEFORE nodes (its partner when it was changed; else the k-th of its op
    type in order where both sides hold as many of that op; else the BEFORE nodes reading constants
    of the same contents as it and no other; else where it sits: ``_fork_anchors``), each BEFORE
    node goes to the nearest anchor upstream of it (a rewrite absorbs what its source feeds: a
    Conv's BatchNormalization, Mul and Add), else to the nearest downstream (a Conv's Pad); edges
    within the region."""
    inside = set(bs)
    anchors = {a2b[a]: a for a in as_ if a2b.get(a) in inside}
    free_a = [k for k in sorted(as_, key=lambda k: after.by_key[k].index) if k not in anchors.values()]
    by_op_b, by_op_a = collections.defaultdict(list), collections.defaultdict(list)
    for k in bs:
        if k not in anchors:
            by_op_b[before.by_key[k].op].append(k)
    for k in free_a:
        by_op_a[after.by_key[k].op].append(k)
    for op, ks in by_op_a.items():
        if len(by_op_b.get(op, ())) == len(ks):
            anchors.update(zip(by_op_b[op], ks))
    free_a = [k for k in free_a if k not in anchors.values()]
    consts = lambda g, n: {g.consts[v] for v in n.inputs if v in g.consts}  # noqa: E731
    reads = {k: consts(before, before.by_key[k]) for k in bs if k not in anchors}
    for k in free_a:
        mine = consts(after, after.by_key[k])
        hits = [b for b, c in reads.items() if c & mine]
        if hits and all(sum(1 for o in free_a if consts(after, after.by_key[o]) & reads[b]) == 1 for b in hits):
            anchors.update(dict.fromkeys(hits, k))
    _fork_anchors(before, after, set(bs), set(as_), anchors, a2b)
    if len(set(anchors.values())) < len(as_):
        return None
    owner = dict(anchors)
    for up in (False, True):  # what the anchors feed first, then what feeds them
        frontier = [k for k in bs if k in owner]
        while frontier:  # breadth first, in BEFORE's order
            claims: dict[str, str] = {}
            for k in frontier:
                n = before.by_key[k]
                near = ([before.producer[v][0].key for v in n.inputs if v in before.producer] if up else
                        [c.key for v in n.outputs for c, _ in before.consumers.get(v, ())])
                for m in near:
                    if m in inside and m not in owner:
                        claims.setdefault(m, owner[k])
            owner.update(claims)
            frontier = sorted(claims, key=lambda m: before.by_key[m].index)
    out = {a: [] for a in as_}
    for k in bs:
        if k in owner:
            out[owner[k]].append(k)
    return out


def _fork_anchors(before: Graph, after: Graph, bs: set[str], as_: set[str], anchors: dict[str, str],
                  a2b: dict[str, str]) -> None:
    """Anchors for AFTER nodes of a region still without one, from where they sit: one with two or
    more readers whose place in BEFORE is known (an anchor in the region; a matched node outside it,
    read by the region's node on the same slot of its partner) stands for the nearest BEFORE node
    upstream of all of them (a fork: a Split for a SplitToSequence and its SequenceAts); one with two
    or more such producers, for the nearest downstream of all of them (a join)."""
    def reach(ks, up: bool) -> set[str]:
        seen, todo = set(), list(ks)
        while todo:
            n = before.by_key[todo.pop()]
            near = ([before.producer[v][0].key for v in n.inputs if v in before.producer] if up else
                    [c.key for v in n.outputs for c, _ in before.consumers.get(v, ())])
            for m in near:
                if m in bs and m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    def readers(n: _Node, where) -> list[set[str]]:
        out = []
        for v in n.outputs:
            for c, i in after.consumers.get(v, ()):
                if c.key in where:
                    out.append(reach([where[c.key]], True))
                elif c.key in a2b and i < len(before.by_key[a2b[c.key]].inputs):
                    p = before.producer.get(before.by_key[a2b[c.key]].inputs[i])
                    if p is not None and p[0].key in bs:
                        out.append({p[0].key} | reach([p[0].key], True))
        return out

    def sources(n: _Node, where) -> list[set[str]]:
        out = []
        for v in n.inputs:
            p = after.producer.get(v)
            if p is None:
                continue
            if p[0].key in where:
                out.append(reach([where[p[0].key]], False))
            elif p[0].key in a2b:
                outs = before.by_key[a2b[p[0].key]].outputs
                readers_b = before.consumers.get(outs[p[1]], ()) if p[1] < len(outs) else ()
                first = [c.key for c, _ in readers_b if c.key in bs]
                if first:
                    out.append(set(first) | reach(first, False))
        return out

    grew = True
    while grew:
        grew = False
        where = {a: b for b, a in anchors.items()}
        for k in sorted(as_ - set(where), key=lambda k: after.by_key[k].index):
            n = after.by_key[k]
            for group, up in ((readers(n, where), True), (sources(n, where), False)):
                if len(group) < 2:
                    continue
                common = set.intersection(*group) - set(anchors)
                if common:
                    pick = (max if up else min)(common, key=lambda b: before.by_key[b].index)
                    anchors[pick] = k
                    grew = True
                    break
            if grew:
                break


def _constant_like(g: Graph, shapes: bool = True) -> set[str]:
    """Values computed from constants and shapes alone (what folding and static shapes remove); without
    ``shapes``, from constants alone."""
    fixed = set(g.consts)
    for n in g.nodes:  # (topological order within a graph)
        read = n.inputs[:1] if n.op == ("", "CastLike") else n.inputs  # (its second input: a type only)
        if (shapes and n.op in (("", "Shape"), ("", "Size"))) or all(not v or v in fixed for v in read):
            fixed.update(o for o in n.outputs if o)
    return fixed


def _propagate(before: Graph, after: Graph, b2a, a2b, pair, through: bool = False) -> None:
    """Neighbours of pairs with one candidate on each side (same op, same slot), pairs of pairs in
    turn. With ``through``, a producer is also sought upstream of the BEFORE one of another op, past
    unmatched nodes read once (on their first input read from a node): what the AFTER side dropped."""
    work = list(a2b.items())
    while work:
        ak, bk = work.pop()
        a, b = after.by_key[ak], before.by_key[bk]
        found = []
        for va, vb in zip(a.inputs, b.inputs):
            pa, pb = after.producer.get(va), before.producer.get(vb)
            if pa and pb and through and pa[0].key not in a2b:
                pb = _upstream_of_op(before, pb, pa[0].op, b2a)
            if pa and pb and pa[1] == pb[1] and pair(pb[0], pa[0]):
                found.append((pa[0].key, pb[0].key))
        for va, vb in zip(a.outputs, b.outputs):
            ca = collections.defaultdict(list)
            cb = collections.defaultdict(list)
            for c, i in after.consumers.get(va, ()):
                if c.key not in a2b:
                    ca[(c.op, i)].append(c)
            for c, i in before.consumers.get(vb, ()):
                if c.key not in b2a:
                    cb[(c.op, i)].append(c)
            for slot, cs in ca.items():
                others = cb.get(slot, [])
                if len(cs) == 1 and len(others) == 1 and pair(others[0], cs[0]):
                    found.append((cs[0].key, others[0].key))
        work.extend(found)


def _upstream_of_op(g: Graph, start: tuple[_Node, int], op, matched, depth: int = 4):
    """(node, output slot): ``start``, or the first node of op ``op`` up the chain of unmatched nodes
    read once above it; None where there is none."""
    node, slot = start
    for _ in range(depth):
        if node.op == op or node.key in matched:
            break
        if sum(len(g.consumers.get(o, ())) for o in node.outputs if o) != 1:
            return None
        up = next((g.producer[v] for v in node.inputs if v in g.producer and v not in g.consts), None)
        if up is None:
            return None
        node, slot = up
    return (node, slot) if node.op == op and node.key not in matched else None


# --------------------------------------------------------------------------------------------
# The face


def mapping(before, after, *, method: str = "auto") -> dict:
    """The mapping between two models (paths or ModelProtos): ``method`` "provenance", "alignment" or
    "auto" (provenance where AFTER carries it)."""
    b, a = Graph(load(before)), Graph(load(after))
    if method == "provenance" or method == "auto" and has_provenance(a):
        return from_provenance(b, a)
    return align(b, a)


def strip_provenance(model: onnx.ModelProto, names: bool = False) -> onnx.ModelProto:
    """A copy without onnxopt's node metadata (and, with ``names``, without node names)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    stack = [model.graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            keep = [p for p in n.metadata_props if not p.key.startswith(OWN_PREFIX)]
            del n.metadata_props[:]
            n.metadata_props.extend(keep)
            if names:
                n.name = ""
            for a in n.attribute:
                stack.extend([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
    return model


def agreement(reference: dict, other: dict, before_keys: Iterable[str] | None = None) -> dict:
    """How far ``other``'s mapping agrees with ``reference``'s: an AFTER node agrees when it stands
    for the same BEFORE nodes in both, a BEFORE node when the same AFTER nodes stand for it."""
    rp, op = reference["pairs"], other["pairs"]
    a_ok = sum(1 for k, v in rp.items() if set(op.get(k, [])) == set(v))
    inv = lambda p: {b: frozenset(a for a, bs in p.items() if b in bs) for bs in p.values() for b in bs}  # noqa: E731
    ri, oi = inv(rp), inv(op)
    keys = set(before_keys) if before_keys is not None else set(ri) | set(oi) | set(reference["removed"])
    b_ok = sum(1 for k in keys if ri.get(k, frozenset()) == oi.get(k, frozenset()))
    total = len(rp) + len(keys)
    return {"after_nodes": len(rp), "after_agree": a_ok, "before_nodes": len(keys), "before_agree": b_ok,
            "ratio": round((a_ok + b_ok) / total, 4) if total else 1.0}
