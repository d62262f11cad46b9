"""onnxscript's rewrite rules, run inside onnxopt's driver.

``onnxscript.rewriter``'s ``RewriteRule`` and ``RewriteRuleSet`` (its rule library, or a user's
own) may be passed wherever onnxopt takes rules (``optimize(rules=...)``, ``extra_rules=``, the
``RULES`` of a ``--rules`` file); :func:`from_onnxscript` makes each an onnxopt :class:`Rule`
that the driver indexes, tries, refuses and fires like its own, with the same statistics
(tried, matched, refused with reasons, fired, errors), provenance (``onnxopt.rule`` names it) and
loud bugs. Both work on onnx_ir, so nothing is converted: at each node the driver asks onnxscript
to match the rule (its pattern, then its checks: node and value ``_check`` functions and the
condition function), and for the rewrite asks it for the replacement (``try_rewrite``), whose
nodes and initializers are made again through onnxopt's builder (onnxopt's names) and committed
by the driver.

How each of the rule's features maps:

- the pattern and its checks: onnxscript's own matcher, on the node the driver tries (indexed by
  the pattern's root op); a pattern that does not match gives its reason, a check or condition
  that fails (``MatchResult().fail(...)``, ``MatchFailureError``) a refusal with its reason, and
  any other exception in a check, a condition or a replacement is a bug in the rule (RuleBug);
- ``remove_nodes``: as in onnxscript, with it the matched nodes must have no other reader; either
  way, matched nodes nothing reads after the rewrite are removed;
- ``commute``: the variants ``rule.commute()`` (or ``RewriteRuleSet(..., commute=True)``) makes
  are one onnxopt rule, tried in order at each node;
- ``graph_pre_visitor`` / ``graph_post_visitor`` (a class rule's ``setup`` / ``cleanup``): called
  when each driver run starts and ends (the driver walks every graph of the model in one run);
- patterns with several output nodes (``SlicesSplit``): the values of every output node are
  replaced; a replacement that would read a value computed after its first output node is
  refused;
- constants: as onnxscript's ``rewrite()`` does, the outputs of the main graph's Constant nodes,
  and of those a rewrite makes, carry their value, type and shape (onnxscript's
  ``basic_constant_propagation``), which its constant patterns and checks read (on the main
  graph, onnxopt does not write them out: it forgets the shapes the input did not record);
- ``as_function=True`` (the matched nodes become a model-local function) cannot be mapped: such a
  rule is refused with one line (RuleError) when it is chosen.

Names: the rule's ``name``; for an unnamed rule (onnxscript's function-style rules), the name of
the module variable that holds it, or the rule it was commuted from, in the module that defines
its replacement (``mul_by_1_rule``), else ``<root op>_<replacement function>``.

This module imports onnxscript; ``onnxopt.library.registry`` imports it only when it meets onnxscript's
objects.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

import onnx_ir as ir
from onnxscript.optimizer import basic_constant_propagation
from onnxscript.rewriter import pattern as ospattern
from onnxscript.rewriter._pattern_ir import StringConstantPattern

from onnxopt import targets as _targets
from onnxopt.errors import RuleError
from onnxopt.ir.util import subgraphs
from onnxopt.core.pattern import Match, Op, Refuse, Rule


def is_onnxscript(obj: Any) -> bool:
    """``obj`` is one of onnxscript's objects or classes (or derived from one), so that this
    module is the one to judge it."""
    return any(cls.__module__.split(".")[0] == "onnxscript"
               for cls in (obj if isinstance(obj, type) else type(obj)).__mro__)


class _Outcome(ospattern.MatchingTracer):
    """What onnxscript's matcher reported on one node: its status and match result."""

    def __init__(self) -> None:
        super().__init__()
        self.status: ospattern.MatchStatus | None = None
        self.result: ospattern.MatchResult | None = None

    def log(self, rule, container, node, match_result, status) -> None:
        self.status, self.result = status, match_result

    def reason(self, default: str) -> str:
        return (self.result.reason if self.result is not None else "") or default


class OnnxscriptMatch(Match):
    """A match of an onnxscript rule: the nodes it matched, the values it replaces (``outputs``:
    the root's outputs, or those of each output node of the pattern), and which variant matched,
    or why the rule refuses (a check or condition that failed, or raised)."""

    def __init__(self, rule: OnnxscriptRule, root: ir.Node, opsets, options, variant: int,
                 result: ospattern.MatchResult | None, refusal: str | None = None, error: Exception | None = None):
        state = types.SimpleNamespace(graph=root.graph, values={}, consts={}, named={}, opsets=opsets,
                                      options=options, nodes=list(result.nodes) if result else [root])
        super().__init__(rule, root, state)
        self.variant = variant
        self.outputs = list(result.outputs) if result and result.outputs else list(root.outputs)
        self.refusal, self.error = refusal, error


@dataclasses.dataclass(frozen=True, eq=False)
class OnnxscriptRule(Rule):
    """One onnxscript RewriteRule (with its commuted variants) as an onnxopt Rule; see the module
    docstring. The pattern is only its root op, for the driver's index."""

    variants: tuple = ()
    run: dict = dataclasses.field(default_factory=dict, repr=False)  # the model of the driver run under way

    # -- a driver run ----------------------------------------------------------------------
    def begin(self, model: ir.Model) -> None:
        """A driver run starts on ``model``: constants marked, the rule's graph_pre_visitor."""
        self.run["model"] = model
        basic_constant_propagation(model.graph)  # as onnxscript's rewrite() does
        for visitor in _distinct(v.graph_pre_visitor for v in self.variants):
            visitor()

    def end(self) -> None:
        """The run ends: the rule's graph_post_visitor."""
        self.run.pop("model", None)
        for visitor in _distinct(v.graph_post_visitor for v in self.variants):
            visitor()

    def _model(self) -> ir.Model:
        model = self.run.get("model")
        if model is None:
            raise RuleError(f"onnxscript rule {self.name} runs inside onnxopt's driver only")
        return model

    # -- the driver's questions --------------------------------------------------------------
    def bind(self, node: ir.Node, opsets, options=None) -> OnnxscriptMatch | str:
        """The first variant that matches ``node`` with its checks passing; else a match that
        carries the first refusal (a variant whose structure matched), or the pattern's reason."""
        model, refused, reason = self._model(), None, None
        for i, variant in enumerate(self.variants):
            outcome = _Outcome()
            try:
                variant.match(model, node.graph, node, check_nodes_are_removable=variant.remove_nodes,
                              tracer=outcome)
            except Exception as exc:  # noqa: BLE001 - a check that raised: the driver reports it (judge)
                return OnnxscriptMatch(self, node, opsets, options, i, None, error=exc)
            if outcome.status == ospattern.MatchStatus.SUCCESS:
                return OnnxscriptMatch(self, node, opsets, options, i, outcome.result)
            if outcome.status == ospattern.MatchStatus.CONDITION_FAILED and refused is None:
                refused = OnnxscriptMatch(self, node, opsets, options, i, outcome.result,
                                          refusal=outcome.reason("condition failed"))
            reason = reason or outcome.reason("pattern does not match")
        return refused if refused is not None else reason

    def judge(self, m: OnnxscriptMatch) -> str | None:
        if m.error is not None:
            raise m.error
        return m.refusal

    def rewrite(self, m: OnnxscriptMatch, builder) -> list[ir.Value]:
        """The matched variant's replacement (onnxscript's ``try_rewrite``), made through
        ``builder``; Refuse when it gives none."""
        outcome = _Outcome()
        delta = self.variants[m.variant].try_rewrite(self._model(), m.graph, m.root, tracer=outcome)
        if delta is None:
            raise Refuse(outcome.reason("replacement failed"))
        news = _rebuild(delta, builder)
        if len({v.producer() for v in m.outputs}) > 1:  # several output nodes: the new nodes go before the first
            late = _after(m.root)
            for node in builder.nodes:
                for value in node.inputs:
                    if value is not None and value.producer() in late:
                        raise Refuse(f"the replacement reads {value.name!r}, computed after {m.root.name!r}")
            early = _before(m.root) - set(m.nodes)  # (matched nodes go with the rewrite)
            for value in m.outputs:
                for use in value.uses():
                    if use.node in early:
                        raise Refuse(f"{value.name!r} is read before {m.root.name!r}, where the replacement "
                                     "would compute it")
        return news


def _replace(m: OnnxscriptMatch, builder) -> list[ir.Value]:
    return m.rule.rewrite(m, builder)


def _distinct(callables: Iterable) -> list:
    seen: list = []
    for fn in callables:
        if fn is not None and fn not in seen:
            seen.append(fn)
    return seen


def _rebuild(delta, builder) -> list[ir.Value]:
    """Make the replacement's initializers and nodes again through onnxopt's builder (its names;
    nothing enters the graph until the driver commits) and return the values that replace the
    matched outputs. onnxscript's own copies are let go: they must not count as readers."""
    made: dict[ir.Value, ir.Value] = {}
    try:
        for value in delta.new_initializers:
            made[value] = builder.const(value.const_value, name=value.name or "const")
        for node in delta.new_nodes:
            outs = builder.op(node.op_type, *(made.get(v, v) for v in node.inputs), domain=node.domain,
                              outputs=len(node.outputs), attrs=list(node.attributes.values()),
                              overload=node.overload)
            for old, new in zip(node.outputs, (outs,) if len(node.outputs) == 1 else outs):
                new.type, new.shape = old.type, old.shape
                made[old] = new
    finally:
        for node in delta.new_nodes:
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
    basic_constant_propagation(builder.nodes)  # (as onnxscript does after each rewrite)
    return [made.get(v, v) for v in delta.new_outputs]


def _before(root: ir.Node) -> set[ir.Node]:
    """The nodes of ``root``'s graph that come before it, and the nodes of their subgraphs."""
    early: set[ir.Node] = set()
    stack = []
    for node in root.graph:
        if node is root:
            break
        stack.append(node)
    while stack:
        node = stack.pop()
        early.add(node)
        stack.extend(inner for graph in subgraphs(node) for inner in graph)
    return early


def _after(root: ir.Node) -> set[ir.Node]:
    """The nodes of ``root``'s graph that come after it."""
    later: set[ir.Node] = set()
    seen = False
    for node in root.graph:
        if seen:
            later.add(node)
        seen = seen or node is root
    return later


# --------------------------------------------------------------------------------------------
# From onnxscript's objects to onnxopt's rules


def _refuse(rule, why: str) -> RuleError:
    return RuleError(f"onnxscript rule {_label(rule)}: {why}")


def _label(rule) -> str:
    name = getattr(rule, "name", None)
    return name if isinstance(name, str) and name else rule.__name__ if isinstance(rule, type) else type(rule).__name__


def _root(rule) -> tuple[str, str]:
    """The (domain, op type) of the node the rule's pattern is rooted at (its first output node),
    or (domain, "*") when the op type is itself a pattern."""
    graph_pattern = getattr(rule, "_target_pattern", None)  # (onnxscript keeps it private)
    if graph_pattern is None:
        raise _refuse(rule, "this onnxscript version keeps no pattern onnxopt can read")
    node = graph_pattern.output_nodes[0]
    op_id = node.op_identifier()
    if op_id is not None:
        return op_id[0], op_id[1]
    domain, op = node.domain, node.op
    if not isinstance(domain, StringConstantPattern):
        raise _refuse(rule, f"its root matches nodes of several domains ({domain}), which onnxopt's driver "
                            "cannot index")
    return domain.value(), op.value() if isinstance(op, StringConstantPattern) else "*"


def _replacement_function(rule):
    replacement = getattr(rule, "_replacement_pattern", None)  # (onnxscript keeps it private)
    return replacement, getattr(replacement, "_function", None)


def _name(rule, op_type: str) -> str:
    if rule.name:
        return rule.name
    replacement, function = _replacement_function(rule)
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    for var, value in vars(module).items() if module is not None else ():
        if isinstance(value, ospattern.RewriteRule) and _replacement_function(value)[0] is replacement:
            return var
    return f"{op_type}_{getattr(function, '__name__', 'rule').strip('<>')}"


def _flatten(items: Any) -> list:
    """onnxscript's RewriteRules in ``items`` (one rule, a rule set, or a sequence of them)."""
    if isinstance(items, ospattern.RewriteRule):
        return [items]
    if isinstance(items, ospattern.RewriteRuleSet):
        return list(items.rules)
    if isinstance(items, ospattern.RewriteRuleClassBase) or (
            isinstance(items, type) and issubclass(items, ospattern.RewriteRuleClassBase)):
        raise _refuse(items, "a RewriteRuleClassBase; pass its rule() (a RewriteRule)")
    if isinstance(items, (ospattern.Pattern, ospattern.PatternBase)):
        raise _refuse(items, "a Pattern matches but rewrites nothing; pass a RewriteRule")
    if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
        return [rule for item in items for rule in _flatten(item)]
    raise RuleError(f"not a Rule: {items!r} (onnxopt takes its own Rules and onnxscript's RewriteRule and "
                    "RewriteRuleSet)")


def from_onnxscript(rules: Any, *, targets: Iterable[str] | str | None = None, priority: int = 0) -> list[Rule]:
    """onnxopt Rules for onnxscript's ``rules`` (a RewriteRule, a RewriteRuleSet, or a sequence of
    them), one per rule, its commuted variants in it, in the order first met. ``targets`` (default:
    every target; say ``"ort-cpu"`` for rules that make onnxruntime's contrib ops) and ``priority``
    apply to all of them. A rule whose features onnxopt cannot map is refused (RuleError, one line)."""
    groups: dict[tuple, list] = {}
    for rule in _flatten(rules):
        if rule.as_function:
            raise _refuse(rule, "as_function=True (the matched nodes become a model-local function) is not "
                                "supported by onnxopt's driver")
        root = _root(rule)
        key = (rule.name, id(_replacement_function(rule)[0]), root)
        group = groups.setdefault(key, [])
        if all(rule is not r for r in group):
            group.append(rule)
    made = []
    for (_, _, (domain, op_type)), variants in groups.items():
        function = _replacement_function(variants[0])[1]
        made.append(OnnxscriptRule(
            _name(variants[0], op_type), Op(op_type, domain=domain), replacement=_replace,
            doc=f"onnxscript rule ({getattr(function, '__module__', None) or 'onnxscript'})", priority=priority,
            targets=_targets.TARGETS if targets is None else targets, variants=tuple(variants)))
    return made
