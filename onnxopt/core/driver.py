"""The fixpoint driver: the worklist, matching, committing a rewrite, cycle detection, provenance.

A worklist with set semantics, seeded with every node of every graph (If/Loop/Scan bodies
included) in graph order. Rules are indexed by their root op type and tried in priority order. A
rewrite puts back only what it touched (``Driver.touched``): the new nodes, the readers of the
values it replaced, and for each value a removed node read its producer and, when one is left,
its last reader. A value's other readers are not re-queued (patterns see them only through its use
count), so a weight read by n nodes costs nothing per rewrite: cost follows what changes.

Guarantees:
- Deterministic: the same model and rules give the same rewrites in the same order, and new
  nodes, values and initializers get names derived from the rule and the root node.
- Bounded: at most ``max_rewrites`` rewrites; a rule that fires again on the same structure over
  the same inputs (rules undoing each other) is reported as a cycle and not applied again there.
- Graph outputs keep their names; a rewrite that cannot honour that is refused.
- Valid ONNX: a node a rule makes in a domain the model does not import (com.microsoft's contrib
  ops, in any graph) adds the model's import of it (version 1); one in onnx's own domains that onnx
  does not define at the model's opset is refused with the reason.
- A rule that raises is a bug (``onnxopt.errors.RuleBug``): raised with ``strict``, else recorded
  and the rule skipped at that node; the model is left as it was there.
- Dead code goes only where that changes nothing (``onnxopt.core.purity``); the nodes a rule matched
  are the rule's to replace.
- Every node a rule creates carries provenance in its metadata: ``onnxopt.rule`` (the rule),
  ``onnxopt.replaced`` (the nodes it matched) and ``onnxopt.sources`` (the original nodes it
  derives from, through earlier rewrites), and keeps the metadata of the nodes it replaced
  (``irutil.inherit_metadata``: each key from the first matched node that has it, the root first).

A rule that needs the model around a run (an onnxscript rule, ``onnxopt.library.onnxscript_rules``) has
``begin(model)`` and ``end()``, called when each run starts and ends; its match may name the values
it replaces (``outputs``) when they are not the root's outputs.
"""

from __future__ import annotations

import collections
import functools
import json
import time
from collections.abc import Iterable, Sequence

import onnx
import onnx_ir as ir

from onnxopt.errors import RuleBug, RuleError
from onnxopt.ir.util import (REPLACED_KEY, RULE_KEY, SOURCES_KEY, constant_tensor, domain, graphs, inherit_metadata,
                     redirect,
                     recorded_sources, remove_dead, use_count)
from onnxopt.core.pattern import ANY_OP, Builder, Match, Namer, Refuse, Rule
from onnxopt.core.stats import DriverResult, RuleStats
from onnxopt.core.purity import Purity
from onnxopt.ir.shapes import DECLARED, opsets_of

_FIRED, _STOP = "fired", "stop"  # what trying one rule at one node came to (else None)
_FEW_USES = 16  # a value with more uses than this has more than one reader for every pattern
_MAX_ORIGINS = 64  # origin sets larger than this become one token (see Driver._cycle_key)


_ONNX_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview.training"})


@functools.cache
def _onnx_defines(op_type: str, version: int, dom: str) -> bool:
    return onnx.defs.has(op_type, version, dom)


class _InRule(Exception):
    """Carries (as its cause) what a rule's replacement raised, past the driver's own code."""


def _generalize_reason(reason: str) -> str:
    """The innermost part of a refusal reason (without the path of node names leading to it),
    so that reasons aggregate by kind."""
    return reason.rsplit(": ", 1)[-1]


def _value_key(value: ir.Value, created: set):
    """Identity of an input for cycle detection: constants that rules created, by content (rules
    that undo each other recreate equal constants as new values); everything else by object."""
    if value not in created:
        return id(value)
    tensor = constant_tensor(value)
    if tensor is not None and tensor.size <= 4096:
        try:
            array = tensor.numpy()
            return ("const", str(array.dtype), array.shape, array.tobytes())
        except Exception:
            pass
    return id(value)


def index_rules(rules: Sequence[Rule]) -> dict[tuple[str, str], list[Rule]]:
    """Rules by root (domain, op_type), highest priority first, then by name."""
    seen: set[str] = set()
    index: dict[tuple[str, str], list[Rule]] = {}
    for rule in rules:
        if not isinstance(rule, Rule):
            raise RuleError(f"not a Rule: {rule!r}")
        if rule.name in seen:
            raise RuleError(f"two rules are named {rule.name!r}")
        seen.add(rule.name)
        index.setdefault(rule.pattern.key, []).append(rule)
    for bucket in index.values():
        bucket.sort(key=lambda r: (-r.priority, r.name))
    return index


class Driver:
    def __init__(self, model: ir.Model, rules: Sequence[Rule], *, max_rewrites: int | None = None,
                 stop_after: int | None = None, keep_log: bool = False, options: dict | None = None,
                 strict: bool = False):
        self.model = model
        self.strict = strict  # a rule's bug raises (RuleBug) instead of being recorded
        self.options = dict(options or {})
        self.index = index_rules(rules)
        self._wild = {key[0]: bucket for key, bucket in self.index.items() if key[1] == ANY_OP}
        self._merged: dict[tuple[str, str], list[Rule]] = {}
        self.result = DriverResult(rules={r.name: RuleStats() for r in rules})
        self.opsets = opsets_of(model)
        self.max_rewrites = max_rewrites
        self.stop_after = stop_after  # for bisecting: apply only the first N rewrites
        self.keep_log = keep_log
        self._namer: Namer | None = None
        self._queue: collections.deque[ir.Node] = collections.deque()
        self._queued: set[ir.Node] = set()
        self._seen_keys: set[tuple] = set()
        self._blocked: set[tuple] = set()
        self._keepalive: list = []
        self._origin: dict[ir.Node, frozenset] = {}
        self._tokens: dict[frozenset, frozenset] = {}  # large origin sets, and the token for each
        # the sources of the nodes rules made, as a tree (a tuple of the matched nodes' trees and
        # names), written into their metadata when the run ends: a chain of n rewrites would
        # otherwise copy lists of 1, 2, ... n names
        self._sources: dict[ir.Node, tuple] = {}
        self._unwritten: list[ir.Node] = []
        self._created: set[ir.Value] = set()  # initializers made by rules
        self._purity = Purity(model)
        self._limit: int | None = None
        self._scoped = [r for r in rules if hasattr(r, "begin")]  # rules told when a run starts and ends

    @property
    def at_limit(self) -> bool:
        """The rewrite limit (``max_rewrites``, or ``stop_after``) is reached."""
        return self._limit is not None and self.result.rewrites >= self._limit

    # -- worklist -------------------------------------------------------------------------
    def _push(self, node: ir.Node | None) -> None:
        if node is not None and node.graph is not None:
            self.result.pushes += 1
            if node not in self._queued:
                self._queued.add(node)
                self._queue.append(node)

    def _push_with_users(self, node: ir.Node) -> None:
        """``node`` and the users of its outputs: a pattern rooted one node further down may now
        match (BatchNormalization over a Conv whose bias just became constant)."""
        self._push(node)
        for out in node.outputs:
            for use in out.uses():
                self._push(use.node)

    def touched(self, redirected: Iterable[ir.Node], lost: Iterable[ir.Value]) -> None:
        """Re-queue what a change can make match: the nodes that now read a different value (and
        their users), and for each value that lost a use, its producer (rules look at their root's
        users) and the node left reading it when only one is (a nested pattern needs a single
        use; a constant only one node reads may be folded into it). A redirected node's inputs
        with a few readers put those readers back too: a value that gained a reader may lift a
        condition on its use count (bn_to_mul_add waits while a Conv's output has one reader).
        Other users are not re-queued: nothing they can see changed, and a weight shared by n
        nodes would otherwise put all n back after each rewrite."""
        for node in redirected:
            self._push_with_users(node)
            for value in node.inputs:
                if value is not None and 1 < use_count(value) <= _FEW_USES:
                    for reader in value.consumers():
                        self._push(reader)
        for value in lost:
            self._push(value.producer())
            if 0 < use_count(value) <= _FEW_USES:
                consumers = value.consumers()
                if len(consumers) == 1:
                    self._push_with_users(consumers[0])

    # -- main loop ------------------------------------------------------------------------
    def run(self, seed: bool = True) -> DriverResult:
        """Rewrite until the worklist is empty; ``seed`` puts every node on it first (later
        calls after a whole-graph pass only continue with what that pass touched)."""
        result = self.result
        if seed:
            initial = 0
            for graph in graphs(self.model):
                for node in graph:
                    initial += 1
                    self._push(node)
            if self._limit is None:
                limit = self.max_rewrites if self.max_rewrites is not None else 10 * initial + 1000
                if self.stop_after is not None:
                    limit = min(limit, self.stop_after)
                self._limit = limit
        for rule in self._scoped:
            self._guarded(rule, "setup", rule.begin, self.model)
        try:
            self._loop()
        finally:
            for rule in self._scoped:
                self._guarded(rule, "cleanup", rule.end)
        self._write_sources()
        return result

    def _loop(self) -> None:
        result = self.result
        limit = self._limit
        index = self.index
        stats = result.rules
        clock = time.perf_counter
        while self._queue:
            node = self._queue.popleft()
            self._queued.discard(node)
            if node.graph is None:
                continue
            key = (domain(node), node.op_type)
            candidates = self._merged.get(key)
            if candidates is None:
                candidates = self._merged[key] = sorted(
                    index.get(key, []) + self._wild.get(key[0], []), key=lambda r: (-r.priority, r.name))
            if not candidates:
                continue
            result.visited += 1
            for rule in candidates:
                st = stats[rule.name]
                st.tried += 1
                t0 = clock()
                try:
                    outcome = self._try(rule, node, st, limit)
                finally:
                    st.seconds += clock() - t0
                if outcome == _STOP:
                    self._queue.clear()
                    self._queued.clear()
                    break
                if outcome == _FIRED:
                    break

    def _guarded(self, rule: Rule, phase: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the rule's own code failed: a bug, loud
            self._bug(rule, self.model.graph.name or "(the model)", phase, exc)

    def _bug(self, rule: Rule, where: str, phase: str, cause: BaseException) -> None:
        """A bug in ``rule`` (its code raised): raised with ``strict``, else recorded."""
        bug = RuleBug(rule.name, where, phase, cause)
        if self.strict:
            raise bug from cause
        self.result.rules[rule.name].errors += 1
        self.result.errors.append(bug)

    def _try(self, rule: Rule, node: ir.Node, st: RuleStats, limit: int) -> str | None:
        """Try one rule at one node: _FIRED, _STOP (the rewrite limit is reached), or None."""
        phase = "pattern"
        try:
            m = rule.bind(node, self.opsets, self.options)  # (attribute predicates are the rule's code)
            if isinstance(m, str):
                st.reasons[_generalize_reason(m)] += 1
                return None
            st.matched += 1
            phase = "condition"
            reason = rule.judge(m)
            if reason is None:
                if self.result.rewrites >= limit:
                    self.result.hit_limit = self.stop_after is None or limit < self.stop_after
                    return _STOP
                phase = "replacement"
                reason = self._apply(m)
        except Exception as exc:  # noqa: BLE001 - the rule's own code failed: a bug, loud
            cause = exc.__cause__ if isinstance(exc, _InRule) else exc
            if phase == "replacement" and not isinstance(exc, _InRule):
                raise  # the driver's own commit failed: not the rule's doing
            self._bug(rule, node.name or node.op_type, phase, cause)
            return None
        if reason is not None:
            st.refused += 1
            st.reasons[_generalize_reason(reason)] += 1
            return None
        st.fired += 1
        self.result.rewrites += 1
        return _FIRED

    # -- one rewrite ----------------------------------------------------------------------
    def _origins(self, node: ir.Node) -> frozenset:
        origins = self._origin.get(node)
        if origins is None:  # an original node: its own origin (the dict keeps it alive)
            origins = self._origin[node] = frozenset((id(node),))
        return origins

    def _cycle_key(self, m: Match) -> tuple:
        """Identifies a rewrite by rule, matched op types, the values it reads from outside and
        the original nodes it derives from. Rules undoing each other recreate the same key;
        two identical but distinct subexpressions do not (their origins differ)."""
        inside = set(m.nodes)
        external = []
        for node in m.nodes:
            for value in node.inputs:
                if value is None or value.producer() in inside:
                    continue
                external.append(value)
        shape = tuple((n.domain, n.op_type) for n in m.nodes)
        origins = frozenset().union(*(self._origins(n) for n in m.nodes))
        if len(origins) > _MAX_ORIGINS:
            # A long chain of rewrites (a Reshape chain collapsing one pair at a time) would carry
            # ever larger sets from rewrite to rewrite: a large set becomes one token instead, the
            # same token for the same set, so a rewrite that recurs still has the same key.
            origins = self._tokens.setdefault(origins, frozenset((-len(self._tokens) - 1,)))
        return (m.rule.name, shape, tuple(_value_key(v, self._created) for v in external), origins), external

    def _apply(self, m: Match) -> str | None:
        """Apply the rewrite for ``m``; None on success, else the reason it was refused."""
        root, graph, rule = m.root, m.graph, m.rule
        key, external = self._cycle_key(m)
        if key in self._blocked:
            return "blocked after a cycle"
        if key in self._seen_keys:
            self._blocked.add(key)
            self.result.cycles.append({
                "rule": rule.name,
                "node": root.name,
                "created_by": root.metadata_props.get(RULE_KEY, ""),
                "message": f"rule {rule.name} would rewrite {root.name} again after "
                           f"{root.metadata_props.get(RULE_KEY, 'another rule')} recreated it; stopped",
            })
            return "cycle detected"
        if self._namer is None:
            self._namer = Namer(self.model)
        builder = Builder(m, self._namer)
        try:
            replacement = rule.replacement(m, builder)
        except Refuse as exc:
            builder.abort()
            return str(exc) or "replacement refused"
        except Exception as exc:  # a bug in the rule: the model is left as it was, the caller reports it
            builder.abort()
            raise _InRule() from exc
        if replacement is None:
            builder.abort()
            return "replacement returned nothing"
        news = [replacement] if isinstance(replacement, ir.Value) else list(replacement) \
            if isinstance(replacement, (list, tuple)) else None
        if news is None or not all(isinstance(v, ir.Value) for v in news):
            builder.abort()
            raise _InRule() from TypeError(f"the replacement returned {replacement!r}, not values")
        olds = list(getattr(m, "outputs", root.outputs))  # (an onnxscript match may name others)
        reason = builder.check(olds, news) or self._undefined_op(m, builder)
        if reason is not None:
            builder.abort()
            return reason
        self._seen_keys.add(key)
        self._keepalive.append(external)  # ids in seen keys must stay unique
        for node in builder.nodes:
            self._origin[node] = key[3]
        self._commit(m, builder, olds, news)
        return None

    def _undefined_op(self, m: Match, builder: Builder) -> str | None:
        """Why a node the rewrite made would make the model invalid ONNX, or None: an operator of
        onnx's own domains that onnx does not define at the version the model imports (onnx.checker
        refuses it; onnxruntime's SimplifiedLayerNormalization is registered in the ONNX domain but
        is no ONNX operator). A rewrite of such a node into itself (the input has it) is let be."""
        matched = {(domain(n), n.op_type) for n in m.nodes}
        for node in builder.nodes:
            dom = domain(node)
            if dom not in _ONNX_DOMAINS or (dom, node.op_type) in matched:
                continue
            version = self.opsets.get(dom, 1) if dom else self.opsets[""]
            if not _onnx_defines(node.op_type, version, dom) and not self._local_function(node):
                return (f"onnx defines no {node.op_type} in domain '{dom or 'ai.onnx'}' at opset {version} "
                        "(the output would fail onnx.checker)")
        return None

    def _local_function(self, node: ir.Node) -> bool:
        return (node.domain, node.op_type, node.overload) in self.model.functions

    def _declare_domains(self, builder: Builder) -> None:
        """The model imports every domain the new nodes use (com.microsoft for a contrib op): the
        imports are the model's, for its subgraphs too."""
        imports = self.model.opset_imports
        for node in builder.nodes:
            dom = domain(node)
            if dom and dom not in imports:
                imports[dom] = self.opsets[dom] = 1  # (com.microsoft's contrib ops are version 1)

    def _source_tree(self, node: ir.Node) -> tuple:
        tree = self._sources.get(node)
        if tree is None:  # an original node: the sources an earlier optimization recorded, or itself
            tree = tuple(recorded_sources(node)) or (node.name or node.op_type,)
        return tree

    def _write_sources(self) -> None:
        """Record ``onnxopt.sources`` on the nodes rules made that are still in the model."""
        for node in self._unwritten:
            if node.graph is not None:
                node.metadata_props[SOURCES_KEY] = json.dumps(_names(self._sources[node]))
        self._unwritten.clear()

    def _commit(self, m: Match, builder: Builder, olds, news) -> None:
        root, graph, rule = m.root, m.graph, m.rule
        replaced = [n.name or n.op_type for n in m.nodes]
        replaced_text = json.dumps(replaced)
        sources = tuple(self._source_tree(n) for n in m.nodes)
        matched = set(m.nodes)
        for node in builder.nodes:
            inherit_metadata(node, m.nodes)  # (the exporter's stack trace and scopes: root first)
            node.metadata_props[RULE_KEY] = rule.name
            node.metadata_props[REPLACED_KEY] = replaced_text
            self._sources[node] = sources
        self._unwritten.extend(builder.nodes)
        self._declare_domains(builder)
        if builder.nodes:
            graph.insert_before(root, builder.nodes)
        if builder.initializers and self.model.ir_version < 4:
            # Before IR 4 an initializer must also be a graph input; IR 4 lifts that and
            # changes nothing else for these models.
            self.model.ir_version = 4
        for value in builder.initializers:
            graph.register_initializer(value)
            self._created.add(value)
        created = {v for n in builder.nodes for v in n.outputs} | set(builder.initializers)
        redirected: list[ir.Node] = []
        for old, new in zip(olds, news):
            if new is old:
                continue
            # Same tensor, so the old type and shape hold; a graph output keeps its declared
            # ones (its dimension names are part of the model's interface).
            known = (new.type, new.shape)
            if old.type is not None and (new.type is None or old.is_graph_output()):
                new.type = old.type
            if old.shape is not None and (new.shape is None or old.is_graph_output()):
                new.shape = old.shape
            if DECLARED in old.meta and new in created:
                new.meta[DECLARED] = old.meta[DECLARED]  # the same tensor, as recorded
            if (new.type, new.shape) != known:  # what its readers' conditions see changed
                redirected.extend(new.consumers())
            redirected.extend(redirect(old, new, take_name=new in created))
        # Remove what the rewrite made dead: the root, then matched nodes and their producers.
        lost, removed = remove_dead(m.nodes, self._purity.removable)
        self.result.removed_dead += len(removed)
        # The producers that went with the matched nodes (a fusion matches its ends; what lay between, and fed
        # only them, dies with them): the new nodes stand for those too.
        absorbed = tuple(self._source_tree(n) for n in removed if n not in matched)
        if absorbed:
            for node in builder.nodes:
                self._sources[node] = sources + absorbed
        self.touched(redirected, lost)
        for node in builder.nodes:
            self._push(node)
        if self.keep_log:
            self.result.log.append({"rule": rule.name, "replaced": replaced,
                                    "created": [n.name for n in builder.nodes]})


def _names(tree: tuple) -> list[str]:
    """The names in ``tree`` (nested tuples of names) in order, each once; a subtree met again
    (two matched nodes from one earlier rewrite) is not walked again."""
    names: dict[str, None] = {}
    walked: set[int] = set()
    stack: list = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            names[item] = None
        elif id(item) not in walked:
            walked.add(id(item))
            stack.extend(reversed(item))
    return list(names)
