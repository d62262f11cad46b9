"""The rule language.

A rule is one row of data: what it matches (a pattern), when it applies (a condition that gives the
reason when it refuses), what it becomes (a replacement), a name, a priority, the targets it is
valid for, and whether it is exact::

    Rule("conv_bn_fold",
         Op("BatchNormalization", Op("Conv", "x", Const("w"), Opt(Const("b")), name="conv"),
            Const("scale"), Const("beta"), Const("mean"), Const("var"), name="bn"),
         replacement=fold, condition=bn_is_inference, priority=10, exact=False,
         doc="Conv followed by inference BatchNormalization becomes one Conv")

``exact=True`` declares that the rewritten model gives the same bits as the original on the
installed onnxruntime's CPU provider with its default session options (graph optimizations on), at
any thread count, on every input (NaN, infinities and the sign of zero included): only such rules
run under ``optimize(exact=True)``, where a condition can see ``m.options["exact"]`` and refuse the
cases it is not exact for. ``exact=False`` says it is not; left out (None) it is undeclared,
which exact mode treats as not exact.

Patterns:
    ``Op(op_type, *inputs, domain="", attrs={}, commutative=False, name=None, output=0, shared=False)``
        a node; ``inputs`` are patterns (a plain string is shorthand for ``Var(string)``). A nested
        ``Op`` matches the producer of an input; by default that producer's output must have no
        other use and not be a graph output (``shared=True`` lifts this), and it must live in the
        same graph as the root. ``attrs`` maps names to a required value or a predicate; a missing
        attribute is compared through its schema default.
    ``Var(name, check=None)``    any value, bound to ``name`` (the same name twice must be the
        same value); ``check(value) -> bool`` a fact it must have
    ``Const(name, value=None, rtol=0, atol=0, check=None)``
        a value known at optimization time: an initializer that is not also a graph input, or the
        output of a Constant node; with ``value`` the constant must equal it (within tolerance);
        ``check(value) -> bool`` a fact it must have (a float scalar, nonzero).
    ``Op("*", domain="", name=...)`` (root only) any node of that domain, whatever its inputs:
        for rules such as constant folding whose condition inspects the node itself.
    ``Opt(pattern)`` an optional input: absent (bound to None) or matching ``pattern``
    ``ANY``          any value, unbound

    ``Op`` also takes ``uses=``: how many readers its output may have where it is nested (an int n:
    exactly n uses and not a graph output; a callable(value) -> bool for any other policy, e.g.
    readers that are Shape nodes do not count; ``shared=True`` is any number), ``bind=``: a name
    for its output, as ``Var`` would bind it (the same name elsewhere must be the same value), and
    ``check=``: a callable(node, opsets) -> bool for a fact about the node the rest of the
    pattern cannot say (its input's rank, say).

Composing patterns (a fragment is a Python function that returns a pattern; the pieces below
make a fragment say what it matches rather than leaving the walk to a condition):
    ``Or(*patterns)``  the first alternative that matches. Names bound by an alternative that
        was not taken are unbound (``m["x"]`` is None, ``m.node("n")`` None).
    ``Repeat(step, end, max=8, name=None)``
        ``step(step(...step(end)))``: zero to ``max`` nodes, each matched by ``step(rest)`` (a
        function from the pattern of what comes before to the pattern of one node), ending in
        ``end``. Greedy: the most steps after which ``end`` matches. ``name`` binds the steps'
        nodes as a tuple, in data order (``m.chain(name)``); names inside ``step`` are bound by
        the outermost step.
    ``Absorbed(pattern)``  the nodes matched inside are looked through, not claimed: they are not
        the rule's ends (``m.nodes``, the provenance's ``onnxopt.replaced``) but ``m.absorbed``;
        they go when the rewrite leaves them dead, and the new nodes' ``onnxopt.sources`` name
        them. A fusion matches its ends and absorbs what lay between.
    ``Explain(pattern, reason, deep=True)``  ``pattern``, failing with ``reason`` (what it means
        that this piece is missing, rather than which node it stopped at); ``deep=False`` only
        where the piece is not there at all (its first node does not match): a failure further
        inside keeps its own reason.
    ``Not(pattern, reason)``  a value ``pattern`` does not match (an absent input too); it binds
        nothing (what ``pattern`` bound while trying is dropped; a name bound before it must still
        be the same value inside), failing with ``reason`` where ``pattern`` matches.
    ``All(*patterns)``  a value each of ``patterns`` matches, in order (``All(Var("x"),
        Not(...))``: bound as ``x``, and not of some form).
    ``Around(anchor, pattern)``  a rule's whole pattern (its root), written rooted at its output
        and tried at an inner node: the Op named ``anchor`` (one op type; its key indexes the
        rule). Where a fusion's output node varies (a scale and a shift after it or not, a Div or
        a Mul by a reciprocal) while one inner node is always there, the pattern still says the
        whole expression. At an anchor node, the nodes reading it (transitively, up to as many
        nodes as the pattern has above the anchor) are tried as the root, the farthest first
        (greedy, like ``Repeat``): the first at which ``pattern`` matches with ``anchor`` bound to
        that node is the match. The match's root is the anchor (the new nodes are named after it
        and placed before it); ``Match.outputs`` are the outputs of the node it matched at, the
        values the replacement takes the place of. The nodes on the way from the anchor to that
        root are matched inside out: the anchor and what it reads first, then each node further
        out and its other inputs, so ``m.nodes`` lists them in that order (the anchor first) and a
        refusal names the first thing missing around the anchor. ``pattern``'s root is an Op or
        an ``Or`` of them.
    Like a PEG, a choice once made is kept: when an alternative (an ``Or``'s, a commutative
    ``Op``'s order, a ``Repeat``'s count) matched, a later failure elsewhere does not come back
    to try the next. When every alternative fails, the reason is that of the one that matched
    the most nodes before failing (on a tie: an ``Or``'s first, a commutative ``Op``'s last
    order, a ``Repeat``'s fewest steps).

A condition returns ``None``/``True`` to accept, a string (the reason) / ``False`` to refuse (a
numpy bool counts as the bool it is), or any other object to accept with a *plan*: the replacement finds it as ``match.plan``, so what the
condition computed (a target shape, per-channel factors) is not computed again. A replacement
takes ``(match, builder)`` and returns the value(s) that replace the root node's outputs, built
with ``builder.op(...)`` and ``builder.const(...)``; it may raise ``Refuse(reason)``. Any other
exception in a condition or a replacement is a bug in the rule: the driver reports it as an error
(``optimize(strict=True)`` raises it), never as a refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import onnx
import onnx_ir as ir

from onnxopt import targets as _targets
from onnxopt.errors import RuleError, UsageError
from onnxopt.ir.util import constant_tensor, graphs, opset_of, use_count
from onnxopt.ir.shapes import infer

class Refuse(Exception):
    """Raised by a replacement (or a condition) that finds it cannot apply; the message is the reason."""


# --------------------------------------------------------------------------------------------
# Patterns


class Pattern:
    """Base class. ``_match(value, state)`` returns None on success or a reason string."""

    def _match(self, value: ir.Value | None, state: _State) -> str | None:  # pragma: no cover
        raise NotImplementedError


def _as_pattern(p: Any) -> Pattern:
    if isinstance(p, Pattern):
        return p
    if isinstance(p, str):
        return Var(p)
    raise TypeError(f"not a pattern: {p!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Var(Pattern):
    name: str | None = None
    check: Callable[[ir.Value], bool] | None = None

    def _match(self, value, state):
        if value is None:
            return f"{self.name or 'input'} is absent"
        if self.check is not None and not self.check(value):
            return f"{self.name or 'input'}: check failed"
        return state.bind(self.name, value)


ANY = Var()


@dataclasses.dataclass(frozen=True, eq=False)
class Const(Pattern):
    name: str | None = None
    value: Any = None
    rtol: float = 0.0
    atol: float = 0.0
    check: Callable[[ir.Value], bool] | None = None  # a fact about the constant (it is a scalar, ...)

    def _match(self, value, state):
        if value is None:
            return f"{self.name or 'constant'} is absent"
        tensor = constant_tensor(value)
        if tensor is None:
            return f"{self.name or value.name!r} is not a constant"
        if self.value is not None:
            try:
                actual = tensor.numpy()
                # every element equals the value (an empty tensor equals nothing)
                ok = actual.size > 0 and bool(
                    np.all(np.isclose(actual, np.asarray(self.value), rtol=self.rtol, atol=self.atol)))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                return f"{self.name or value.name!r} is not {self.value!r}"
        if self.check is not None and not self.check(value):
            return f"{self.name or value.name!r}: check failed"
        if self.name is not None:
            state.consts[self.name] = tensor
        return state.bind(self.name, value)


@dataclasses.dataclass(frozen=True, eq=False)
class Opt(Pattern):
    pattern: Pattern

    def __init__(self, pattern: Any):
        object.__setattr__(self, "pattern", _as_pattern(pattern))

    def _match(self, value, state):
        if value is None:
            name = getattr(self.pattern, "name", None)
            return state.bind(name, None) if name else None
        return self.pattern._match(value, state)


def _schema_default(node: ir.Node, attr_name: str, opset: int):
    return _schema_default_cached(node.op_type, node.domain, opset, attr_name)


@functools.lru_cache(maxsize=4096)
def _schema_default_cached(op_type: str, domain: str, opset: int, attr_name: str):
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        return None
    attr = schema.attributes.get(attr_name)
    if attr is None or not attr.default_value.name:
        return None
    return onnx.helper.get_attribute_value(attr.default_value)


ANY_OP = "*"


class Op(Pattern):
    """A node pattern; see the module docstring."""

    __slots__ = ("op_type", "inputs", "domain", "attrs", "commutative", "name", "output", "shared", "uses", "bind",
                 "check")

    def __init__(
        self,
        op_type: str,
        *inputs: Any,
        domain: str = "",
        attrs: Mapping[str, Any] | None = None,
        commutative: bool = False,
        name: str | None = None,
        output: int = 0,
        shared: bool = False,
        uses: int | Callable[[ir.Value], bool] | None = None,
        bind: str | None = None,
        check: Callable[[ir.Node, Mapping[str, int]], bool] | None = None,
    ):
        self.op_type = op_type
        self.inputs = tuple(_as_pattern(p) for p in inputs)
        self.domain = "" if domain == "ai.onnx" else domain
        self.attrs = dict(attrs or {})
        self.commutative = commutative
        self.name = name
        self.output = output
        self.shared = shared
        if uses is not None and not callable(uses) and (not isinstance(uses, int) or uses < 1):
            raise TypeError(f"Op({op_type!r}): uses must be a count >= 1 or a callable, not {uses!r}")
        self.uses = uses  # None: one use (see the module docstring)
        self.bind = bind
        self.check = check

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.op_type)

    def __repr__(self) -> str:
        return f"Op({self.op_type!r}{', ' if self.inputs else ''}{', '.join(map(repr, self.inputs))})"

    # Matching a value: the value must be produced by a node this pattern accepts.
    def _match(self, value, state):
        if value is None:
            return f"{self.op_type} input is absent"
        node = value.producer()
        if node is None:
            return f"{value.name!r} is not produced by {self.op_type}"
        if node.graph is not state.graph:
            return f"{value.name!r} comes from another graph"
        if self.output >= len(node.outputs) or node.outputs[self.output] is not value:
            return f"{value.name!r} is not output {self.output} of {node.op_type}"
        if not self.shared:
            reason = self._readers(value, node)
            if reason is not None:
                return reason
        if self.bind is not None:
            if self.bind in state.values and state.values[self.bind] is not value:
                return f"{self.bind} is bound to two different values"
            saved = state.save()
            reason = self.match_node(node, state)
            if reason is None:
                return state.bind(self.bind, value)
            state.restore(saved)
            return reason
        return self.match_node(node, state)

    def _readers(self, value: ir.Value, node: ir.Node) -> str | None:
        """Why the readers of ``value`` (``node``'s output) do not fit ``uses`` where this pattern is
        nested, or None."""
        if callable(self.uses):
            if not self.uses(value):
                return f"{value.name!r} ({node.op_type}) has readers that do not fit"
            return None
        uses, want = use_count(value), 1 if self.uses is None else self.uses
        if uses != want:
            return f"{value.name!r} ({node.op_type}) has {uses} uses"
        if value.is_graph_output():
            return f"{value.name!r} ({node.op_type}) is a graph output"
        return None

    def match_node(self, node: ir.Node, state: _State) -> str | None:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain != self.domain or (node.op_type != self.op_type and self.op_type != ANY_OP):
            return f"expected {self.op_type}, found {node.op_type}"
        if node in state.node_set:
            return f"{node.name} is matched twice"
        anchor = state.anchor
        if anchor is not None and self.name == anchor[0] and node is not anchor[1]:
            return f"{node.name} is not the {anchor[0]} the rule is tried at"
        if self.check is not None and not self.check(node, state.opsets):
            return f"{node.name}: check failed"
        if self.op_type == ANY_OP:  # any node of the domain; its inputs are the condition's business
            state.push_node(node, self.name)
            return None
        for key, want in self.attrs.items():
            attr = node.attributes.get(key)
            if attr is not None:
                if attr.is_ref():
                    return f"{node.name}: attribute {key} is a reference"
                have = attr.value
                if isinstance(have, Sequence) and not isinstance(have, (str, bytes)):
                    have = list(have)
            else:
                have = _schema_default(node, key, state.opset(node.domain))
            ok = want(have) if callable(want) else have == want
            if not ok:
                return f"{node.name}: attribute {key}={have!r} does not fit"
        actual = list(node.inputs)
        while actual and actual[-1] is None:
            actual.pop()
        if len(actual) > len(self.inputs):
            return f"{node.name} has {len(actual)} inputs, pattern takes {len(self.inputs)}"
        actual += [None] * (len(self.inputs) - len(actual))
        path = state.path
        if path is not None and node in path:  # (an Around's way from its anchor to its root)
            return self._match_outward(node, state, actual, path[node])
        state.push_node(node, self.name)
        if not (self.commutative and len(actual) > 1):  # (the common case: one order)
            for i, (pattern, value) in enumerate(zip(self.inputs, actual)):
                reason = pattern._match(value, state)
                if reason is not None:
                    state.pop_node(node, self.name)
                    return f"{node.name} input {i}: {reason}"
            return None
        orders = self._orders(actual)
        best = None  # (progress, reason) of the order that matched the most nodes; the last on a tie
        high = state.high
        for order in orders:
            saved = state.save()
            state.high = len(state.nodes)
            reason = None
            for i, (pattern, value) in enumerate(zip(self.inputs, order)):
                reason = pattern._match(value, state)
                if reason is not None:
                    reason = f"{node.name} input {i}: {reason}"
                    break
            progress = state.high
            high = state.high = max(high, progress)
            if reason is None:
                return None
            state.restore(saved)
            if best is None or progress >= best[0]:
                best = (progress, reason)
        state.pop_node(node, self.name)
        return best[1]

    def _orders(self, actual: list) -> list[list]:
        if not (self.commutative and len(actual) > 1):
            return [actual]
        # all orders for up to 4 inputs; beyond that (24+ orders) only the given and reversed
        return [list(p) for p in itertools.permutations(actual)] if len(actual) <= 4 else [actual, actual[::-1]]

    def _match_outward(self, node: ir.Node, state: _State, actual: list, inner: ir.Value) -> str | None:
        """match_node for a node on the way from an Around's anchor to the root being tried: the
        input ``inner`` (the value that leads back to the anchor) first, then this node is
        recorded, then its other inputs; so the nodes of the match are recorded inside out (the
        anchor and what it reads first, then each node further out and what it reads besides)."""
        best = None  # (progress, reason) of the order that matched the most nodes; the last on a tie
        high = state.high
        for order in self._orders(actual):
            pairs = list(enumerate(zip(self.inputs, order)))
            k = next((j for j, (_, (_, value)) in enumerate(pairs) if value is inner), None)
            if k is not None:
                pairs.insert(0, pairs.pop(k))
            saved = state.save()
            state.high = len(state.nodes)
            reason, pushed = None, k is None
            if pushed:
                state.push_node(node, self.name)
            for i, (pattern, value) in pairs:
                reason = pattern._match(value, state)
                if reason is not None:
                    reason = f"{node.name} input {i}: {reason}"
                    break
                if not pushed:  # (after the input toward the anchor)
                    state.push_node(node, self.name)
                    pushed = True
            progress = state.high
            high = state.high = max(high, progress)
            if reason is None:
                return None
            state.restore(saved)
            if best is None or progress >= best[0]:
                best = (progress, reason)
        return best[1]


class Or(Pattern):
    """The first of ``alternatives`` that matches (see the module docstring)."""

    __slots__ = ("alternatives",)

    def __init__(self, *alternatives: Any):
        if len(alternatives) < 2:
            raise TypeError("Or takes two or more alternatives")
        self.alternatives = tuple(_as_pattern(p) for p in alternatives)

    def __repr__(self) -> str:
        return f"Or({', '.join(map(repr, self.alternatives))})"

    def _match(self, value, state):
        best = None  # (progress, reason) of the alternative that matched the most nodes; the first on a tie
        high = state.high
        for alternative in self.alternatives:
            saved = state.save()
            state.high = len(state.nodes)
            reason = alternative._match(value, state)
            progress = state.high
            high = state.high = max(high, progress)
            if reason is None:
                return None
            state.restore(saved)
            if best is None or progress > best[0]:
                best = (progress, reason)
        return best[1]


class Repeat(Pattern):
    """``step`` applied zero to ``max`` times over ``end``, greedily (see the module docstring)."""

    __slots__ = ("step", "end", "max", "name", "_steps")

    def __init__(self, step: Callable[[Pattern], Any], end: Any, *, max: int = 8, name: str | None = None):
        if max < 0:
            raise TypeError(f"Repeat: max must be >= 0, not {max}")
        self.step, self.end, self.max, self.name = step, _as_pattern(end), max, name
        # the pattern at each depth: step d's input is depth d + 1 (built once: patterns are immutable)
        levels = [_Level(self, d) for d in range(max + 1)]
        self._steps = tuple(_as_pattern(step(levels[d + 1])) for d in range(max))
        self.start = levels[0]

    def __repr__(self) -> str:
        return f"Repeat({getattr(self.step, '__name__', 'step')}, {self.end!r}, max={self.max})"

    def _match(self, value, state):
        return self.start._match(value, state)


class _Level(Pattern):
    """Depth ``depth`` of a Repeat: one more step (whose node is recorded in the chain), else its end."""

    __slots__ = ("repeat", "depth")

    def __init__(self, repeat: Repeat, depth: int):
        self.repeat, self.depth = repeat, depth

    def __repr__(self) -> str:
        return f"<{self.repeat!r} at depth {self.depth}>"

    def _match(self, value, state):
        repeat, high = self.repeat, state.high
        stepped = None
        if self.depth < repeat.max and value is not None:
            saved = state.save()
            state.high = len(state.nodes)
            reason = repeat._steps[self.depth]._match(value, state)
            progress, state.high = state.high, max(high, state.high)
            if reason is None:
                if repeat.name is not None:  # (the deeper steps recorded theirs first: data order)
                    state.chains[repeat.name] = state.chains.get(repeat.name, ()) + (value.producer(),)
                return None
            state.restore(saved)
            stepped = (progress, reason)
        high = state.high
        state.high = len(state.nodes)
        reason = repeat.end._match(value, state)
        progress, state.high = state.high, max(high, state.high)
        if reason is None:
            if repeat.name is not None:
                state.chains[repeat.name] = ()
            return None
        return stepped[1] if stepped is not None and stepped[0] > progress else reason


class Absorbed(Pattern):
    """``pattern``, its nodes looked through rather than claimed (see the module docstring)."""

    __slots__ = ("pattern",)

    def __init__(self, pattern: Any):
        self.pattern = _as_pattern(pattern)

    def __repr__(self) -> str:
        return f"Absorbed({self.pattern!r})"

    def _match(self, value, state):
        state.absorbing += 1
        try:
            return self.pattern._match(value, state)
        finally:
            state.absorbing -= 1


class Explain(Pattern):
    """``pattern``, failing with ``reason`` (see the module docstring)."""

    __slots__ = ("pattern", "reason", "deep")

    def __init__(self, pattern: Any, reason: str, *, deep: bool = True):
        self.pattern, self.reason, self.deep = _as_pattern(pattern), reason, deep

    def __repr__(self) -> str:
        return f"Explain({self.pattern!r}, {self.reason!r})"

    def _match(self, value, state):
        high, start = state.high, len(state.nodes)
        state.high = start
        reason = self.pattern._match(value, state)
        reached, state.high = state.high, max(high, state.high)
        if reason is None:
            return None
        return self.reason if self.deep or reached == start else reason


class Not(Pattern):
    """A value ``pattern`` does not match (see the module docstring)."""

    __slots__ = ("pattern", "reason")

    def __init__(self, pattern: Any, reason: str):
        self.pattern, self.reason = _as_pattern(pattern), reason

    def __repr__(self) -> str:
        return f"Not({self.pattern!r})"

    def _match(self, value, state):
        if value is None:  # (nothing matches an absent input)
            return None
        saved, high = state.save(), state.high
        reason = self.pattern._match(value, state)
        state.restore(saved)  # (what it bound while trying, on either outcome)
        state.high = high
        return None if reason is not None else self.reason


class All(Pattern):
    """A value every one of ``patterns`` matches (see the module docstring)."""

    __slots__ = ("patterns",)

    def __init__(self, *patterns: Any):
        if len(patterns) < 2:
            raise TypeError("All takes two or more patterns")
        self.patterns = tuple(_as_pattern(p) for p in patterns)

    def __repr__(self) -> str:
        return f"All({', '.join(map(repr, self.patterns))})"

    def _match(self, value, state):
        for pattern in self.patterns:
            reason = pattern._match(value, state)
            if reason is not None:
                return reason
        return None


_MAX_ROOTS = 64  # nodes an Around tries as its root at one anchor


class Around(Pattern):
    """A rule's pattern rooted at its output, tried at the inner node named ``anchor`` (see the
    module docstring)."""

    __slots__ = ("anchor", "pattern", "domain", "op_type", "depth", "_nested", "_anchors")

    def __init__(self, anchor: str, pattern: Any):
        self.anchor, self.pattern = anchor, _as_pattern(pattern)
        _check_root(self.pattern)
        found: dict[int, tuple[Op, int]] = {}
        _find_op(self.pattern, anchor, 0, found, set())
        if not found:
            raise TypeError(f"Around: the pattern has no Op named {anchor!r}")
        keys = {op.key for op, _ in found.values()}
        if len(keys) > 1:
            raise TypeError(f"Around: the Ops named {anchor!r} are of several types: {sorted(keys)}")
        self.domain, self.op_type = keys.pop()
        if self.op_type == ANY_OP:
            raise TypeError("Around: the anchor must name its op type, not '*'")
        self.depth = max(d for _, d in found.values())  # nodes from the root down to the anchor, at most
        # where the anchor is never the root, each root is reached through its output: an anchor Op's
        # readers policy (uses=, shared=), when they all have one, is asked first (one reason, not one per root)
        policies = {(op.shared, op.uses, op.output) for op, _ in found.values()}
        self._nested = next(op for op, _ in found.values()) \
            if min(d for _, d in found.values()) > 0 and len(policies) == 1 else None
        self._anchors = tuple(op for op, _ in found.values())

    inputs = ()  # (a Rule's root that is not an Op takes no input patterns of its own)

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.op_type)

    def __repr__(self) -> str:
        return f"Around({self.anchor!r}, {self.pattern!r})"

    def _match(self, value, state):
        raise TypeError("Around is a rule's pattern, not a piece of one")

    def match_node(self, node: ir.Node, state: _State) -> str | None:
        """Match at the anchor ``node``: the nodes that read it (transitively, up to ``depth``
        nodes away) are tried as the root, the farthest first; the first at which the pattern
        matches, with the Op named ``anchor`` bound to ``node``, is the match's end (its outputs
        are ``Match.outputs``)."""
        graph = node.graph
        nested = self._nested
        if nested is not None and not nested.shared and nested.output < len(node.outputs):
            reason = nested._readers(node.outputs[nested.output], node)
            if reason is not None:
                return f"{node.name}: {reason}"
        # Inside out, the anchor and what it reads are matched first, before anything is bound: where
        # no anchor Op matches there, no root can (one try, not one per root and alternative)
        state.anchor = (self.anchor, node)
        reason = None
        for op in self._anchors:
            saved = state.save()
            reason = op.match_node(node, state)
            state.restore(saved)
            if reason is None:
                break
        state.anchor, state.high = None, 0
        if reason is not None:
            return reason
        distance: dict[ir.Node, int] = {node: 0}
        toward: dict[ir.Node, ir.Value] = {}  # a reader -> the value by which it was reached
        reached_from: dict[ir.Node, ir.Node] = {}
        roots, frontier = [node], [node]
        for level in range(1, self.depth + 1):
            nxt = []
            for n in frontier:
                for out in n.outputs:
                    for use in out.uses():
                        reader = use.node
                        if reader.graph is not graph or reader in distance or len(roots) >= _MAX_ROOTS:
                            continue
                        distance[reader], toward[reader], reached_from[reader] = level, out, n
                        nxt.append(reader)
                        roots.append(reader)
            frontier = nxt
        roots.sort(key=lambda n: -distance[n])  # (stable: breadth-first order at one distance)
        best = None  # (progress, reason) of the root that matched the most nodes; the first on a tie
        state.anchor = (self.anchor, node)
        try:
            for root in roots:
                path, n = {}, root
                while n is not node:
                    path[n] = toward[n]
                    n = reached_from[n]
                saved = state.save()
                state.high = len(state.nodes)
                state.path = path
                reason = _match_root(self.pattern, root, state)
                if reason is None and node not in state.node_set:
                    reason = f"{root.name}: the pattern does not reach {node.name}"
                progress = state.high
                if reason is None:
                    state.outputs = list(root.outputs)
                    return None
                state.restore(saved)
                if best is None or progress > best[0]:
                    best = (progress, reason)
        finally:
            state.anchor = state.path = None
        return best[1]


def _check_root(pattern: Pattern) -> None:
    """An Around's pattern is rooted at a node: an Op, or a choice (Or, Explain) of such roots."""
    if isinstance(pattern, Or):
        for alternative in pattern.alternatives:
            _check_root(alternative)
    elif isinstance(pattern, Explain):
        _check_root(pattern.pattern)
    elif not isinstance(pattern, Op) or pattern.op_type == ANY_OP:
        raise TypeError(f"Around: the pattern's root must be an Op (or an Or of them), not {pattern!r}")


def _find_op(pattern: Pattern, name: str, depth: int, found: dict, seen: set) -> None:
    """The Ops named ``name`` under ``pattern`` and the most nodes above each (``found``: id -> (op, depth))."""
    if (id(pattern), depth) in seen:
        return
    seen.add((id(pattern), depth))
    if isinstance(pattern, Op):
        if pattern.name == name and found.get(id(pattern), (None, -1))[1] < depth:
            found[id(pattern)] = (pattern, depth)
        for p in pattern.inputs:
            _find_op(p, name, depth + 1, found, seen)
    elif isinstance(pattern, (Opt, Absorbed, Explain)):
        _find_op(pattern.pattern, name, depth, found, seen)
    elif isinstance(pattern, Or):
        for p in pattern.alternatives:
            _find_op(p, name, depth, found, seen)
    elif isinstance(pattern, All):
        for p in pattern.patterns:
            _find_op(p, name, depth, found, seen)
    elif isinstance(pattern, Repeat):
        _find_op(pattern.start, name, depth, found, seen)
    elif isinstance(pattern, _Level):
        if pattern.depth < pattern.repeat.max:
            _find_op(pattern.repeat._steps[pattern.depth], name, depth, found, seen)
        _find_op(pattern.repeat.end, name, depth, found, seen)
    # (Var, Const: no node; Not: binds nothing, so its nodes are no anchor)


def _match_root(pattern: Pattern, node: ir.Node, state: _State) -> str | None:
    """``pattern`` (see _check_root) matched with its root at ``node``."""
    if isinstance(pattern, Op):
        reason = pattern.match_node(node, state)
        if reason is None and pattern.bind is not None:
            reason = state.bind(pattern.bind, node.outputs[pattern.output] if pattern.output < len(node.outputs)
                                else None)
        return reason
    if isinstance(pattern, Explain):
        high, start = state.high, len(state.nodes)
        state.high = start
        reason = _match_root(pattern.pattern, node, state)
        reached, state.high = state.high, max(high, state.high)
        if reason is None:
            return None
        return pattern.reason if pattern.deep or reached == start else reason
    best = None  # an Or, as Or._match
    high = state.high
    for alternative in pattern.alternatives:
        saved = state.save()
        state.high = len(state.nodes)
        reason = _match_root(alternative, node, state)
        progress = state.high
        high = state.high = max(high, progress)
        if reason is None:
            return None
        state.restore(saved)
        if best is None or progress > best[0]:
            best = (progress, reason)
    return best[1]


class _State:
    """Bindings being built during one match; supports backtracking. ``high`` is the most nodes
    matched at once since an alternative began (how far it got, to choose the reason to give)."""

    __slots__ = ("graph", "values", "consts", "nodes", "node_set", "named", "opsets", "options", "chains",
                 "absorbed", "absorbing", "high", "anchor", "path", "outputs")

    def __init__(self, graph: ir.Graph, opsets: Mapping[str, int], options: Mapping[str, Any] | None = None):
        self.options = options or {}
        self.graph = graph
        self.values: dict[str, ir.Value | None] = {}
        self.consts: dict[str, ir.TensorProtocol] = {}
        self.nodes: list[ir.Node] = []
        self.node_set: set[ir.Node] = set()
        self.named: dict[str, ir.Node] = {}
        self.opsets = opsets
        self.chains: dict[str, tuple[ir.Node, ...]] = {}  # a Repeat's nodes, by its name
        self.absorbed: set[ir.Node] = set()  # the matched nodes an Absorbed pattern looked through
        self.absorbing = 0  # > 0 while matching inside an Absorbed pattern
        self.high = 0
        self.anchor: tuple[str, ir.Node] | None = None  # an Around's: the name its anchor must bind, the node
        self.path: dict[ir.Node, ir.Value] | None = None  # an Around's way out: node -> its input toward the anchor
        self.outputs: list[ir.Value] | None = None  # an Around's: the outputs of the root it matched at

    def opset(self, domain: str) -> int:
        return self.opsets.get(domain, self.opsets.get("ai.onnx", 1) if domain == "" else 1)

    def bind(self, name: str | None, value: ir.Value | None) -> str | None:
        if name is None:
            return None
        if name in self.values:
            if self.values[name] is not value:
                return f"{name} is bound to two different values"
            return None
        self.values[name] = value
        return None

    def push_node(self, node: ir.Node, name: str | None) -> None:
        self.nodes.append(node)
        self.node_set.add(node)
        if self.absorbing:
            self.absorbed.add(node)
        if len(self.nodes) > self.high:
            self.high = len(self.nodes)
        if name is not None:
            self.named[name] = node

    def pop_node(self, node: ir.Node, name: str | None) -> None:
        self.nodes.remove(node)
        self.node_set.discard(node)
        self.absorbed.discard(node)
        if name is not None:
            self.named.pop(name, None)

    def save(self):
        return (dict(self.values), dict(self.consts), len(self.nodes), dict(self.named), dict(self.chains))

    def restore(self, saved) -> None:
        values, consts, n, named, chains = saved
        self.values, self.consts, self.named, self.chains = values, consts, named, chains
        for node in self.nodes[n:]:
            self.node_set.discard(node)
            self.absorbed.discard(node)
        del self.nodes[n:]


# --------------------------------------------------------------------------------------------
# Matches and rules


class Match:
    """What a pattern bound. ``m["x"]`` is a value, ``m.const("w")`` a numpy array,
    ``m.node("bn")`` a node, ``m.attr("bn", "epsilon", 1e-5)`` an attribute value; ``m.dtype("x")``,
    ``m.shape("x")``, ``m.dims("x")`` and ``m.static_shape("x")`` are the one way to ask about a
    value's type and shape (inferred locally when the model lacks them); ``m.opset("")`` the
    imported version of a domain; ``m.plan`` what the condition computed for the replacement;
    ``m.chain("views")`` the nodes a named Repeat went through. ``m.nodes`` are the nodes the rule
    replaces (root first), ``m.absorbed`` those it looked through (see ``Absorbed``).

    Asking for a name the rule's pattern does not bind is a bug in the rule: it raises RuleError
    (an optional input that is absent is bound to None: ``m["b"]`` is None, ``"b" in m`` False).
    """

    def __init__(self, rule: Rule, root: ir.Node, state: _State):
        self.rule = rule
        self.root = root
        self.graph = state.graph
        self.values = state.values
        self.tensors = state.consts
        absorbed = getattr(state, "absorbed", ())  # (a state another matcher made may have neither)
        self.nodes: tuple[ir.Node, ...] = tuple(n for n in state.nodes if n not in absorbed) if absorbed \
            else tuple(state.nodes)
        self.absorbed: tuple[ir.Node, ...] = tuple(n for n in state.nodes if n in absorbed) if absorbed else ()
        self.named = state.named
        self.chains: Mapping[str, tuple[ir.Node, ...]] = getattr(state, "chains", {})
        self.opsets: Mapping[str, int] = state.opsets  # the model's imports (see opset())
        self.options = state.options  # the optimize() call's settings (e.g. fold_size_limit)
        self.plan: Any = None  # what the condition returned beyond "yes" (see Rule)
        self._arrays: dict[str, np.ndarray] = {}
        outputs = getattr(state, "outputs", None)
        if outputs is not None:  # (an Around: the values it replaces are its root's, not the anchor's)
            self.outputs = outputs

    def _unbound(self, name: str, kind: str, names) -> RuleError:
        return RuleError(f"rule {self.rule.name} asks for {kind} {name!r}, which its pattern does not bind "
                         f"(it binds {', '.join(sorted(names)) or 'none'})")

    def _value_name(self, name: str) -> str:
        if name not in self.rule.value_names:
            raise self._unbound(name, "the value", self.rule.value_names)
        return name

    def __getitem__(self, name: str) -> ir.Value | None:
        return self.values.get(self._value_name(name))

    def __contains__(self, name: str) -> bool:
        """``name`` is bound to a value (an optional input that is absent is not)."""
        return self.values.get(self._value_name(name)) is not None

    def const(self, name: str) -> np.ndarray | None:
        """The constant bound to ``name`` as a numpy array (converted once per match); None for an
        optional constant that is absent."""
        if name not in self.rule.const_names:
            raise self._unbound(name, "the constant", self.rule.const_names)
        array = self._arrays.get(name)
        if array is None:
            tensor = self.tensors.get(name)
            if tensor is None:
                return None
            array = self._arrays[name] = tensor.numpy()
        return array

    def node(self, name: str) -> ir.Node | None:
        """The node bound to ``name`` (None for an optional one that is absent)."""
        if name not in self.rule.node_names:
            raise self._unbound(name, "the node", self.rule.node_names)
        return self.named.get(name)

    def chain(self, name: str) -> tuple[ir.Node, ...]:
        """The nodes the Repeat named ``name`` went through, in data order (empty for none, or where
        the alternative holding it was not taken)."""
        if name not in self.rule.chain_names:
            raise self._unbound(name, "the chain", self.rule.chain_names)
        return self.chains.get(name, ())

    def attr(self, node_name: str, attr_name: str, default: Any = None) -> Any:
        node = self.node(node_name)
        attr = None if node is None else node.attributes.get(attr_name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return list(value)
        return value

    def opset(self, domain: str = "") -> int:
        """The version the model imports for ``domain`` ("" and "ai.onnx" are one domain)."""
        return opset_of(self.opsets, domain)

    def shape(self, name: str) -> ir.Shape | None:
        """The shape of the value bound to ``name``, inferred locally when the model lacks it."""
        return infer(self[name], self.opsets)

    def dims(self, name: str) -> list[int | None] | None:
        """The dimensions of ``name``'s value: numbers, None for a dimension that is not one; None
        when even the rank is unknown."""
        shape = self.shape(name)
        return None if shape is None else [d if isinstance(d, int) else None for d in shape]

    def output_dims(self, k: int = 0) -> list[int | None] | None:
        """The dimensions the root node's output ``k`` has as the model records it (not inferred:
        what the output will be is the rule's business), like :meth:`dims`."""
        shape = self.root.outputs[k].shape
        return None if shape is None else [d if isinstance(d, int) else None for d in shape]

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        """``name``'s shape when every dimension is a number, else None."""
        dims = self.dims(name)
        return None if dims is None or any(d is None for d in dims) else tuple(dims)

    def dtype(self, name: str) -> ir.DataType | None:
        """The element type of ``name``'s value, inferred locally when the model lacks it."""
        value = self[name]
        if value is None:
            return None
        if value.type is None:
            infer(value, self.opsets)
        return value.type.dtype if isinstance(value.type, ir.TensorType) else None  # (not a sequence's)


Condition = Callable[[Match], Union[None, bool, str]]
Replacement = Callable[[Match, "Builder"], Union[ir.Value, Sequence[ir.Value], None]]


def forward(name: str) -> Replacement:
    """A replacement that is the value bound to ``name``: the matched nodes compute nothing new
    (Identity, x * 1, a Cast to the same type...)."""

    def replace(m: Match, b) -> ir.Value:
        return m[name]

    replace.__name__ = f"forward_{name}"
    return replace


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    name: str
    pattern: Op | Around
    replacement: Replacement
    condition: Condition | None = None
    doc: str = ""
    priority: int = 0
    targets: frozenset[str] = frozenset(_targets.TARGETS)
    exact: bool | None = None  # see the module docstring; None: undeclared (not run under exact mode)
    # A key of the measured benefit table (``onnxopt.targets.benefit``): where a fusion helps on one target and
    # hurts on another, the table (written by a benchmark script) says per target whether it runs.
    benefit: str | None = None

    def __post_init__(self):
        if self.exact is not None and not isinstance(self.exact, bool):
            raise TypeError(f"rule {self.name}: exact must be True, False or None (undeclared), not {self.exact!r}")
        if not isinstance(self.pattern, (Op, Around)):
            raise TypeError(f"rule {self.name}: the pattern's root must be an Op (or an Around)")
        values, consts, nodes, chains = _names(self.pattern)
        object.__setattr__(self, "value_names", frozenset(values))
        object.__setattr__(self, "const_names", frozenset(consts))
        object.__setattr__(self, "node_names", frozenset(nodes))
        object.__setattr__(self, "chain_names", frozenset(chains))
        if self.pattern.op_type == ANY_OP and self.pattern.inputs:
            raise TypeError(f"rule {self.name}: Op('*') takes no input patterns")
        try:  # (one name alone is one target, not its letters)
            targets = _targets.normalize_all([self.targets] if isinstance(self.targets, str) else self.targets)
        except UsageError as exc:
            raise ValueError(f"rule {self.name}: {exc}") from None
        object.__setattr__(self, "targets", targets)

    @property
    def summary(self) -> str:
        return (self.doc or "").strip().splitlines()[0] if self.doc else ""

    def bind(self, node: ir.Node, opsets: Mapping[str, int], options: Mapping[str, Any] | None = None
             ) -> Match | str:
        """A Match of the pattern rooted at ``node``, or why the pattern does not match there."""
        state = _State(node.graph, opsets, options)
        reason = self.pattern.match_node(node, state)
        return reason if reason is not None else Match(self, node, state)

    def judge(self, m: Match) -> str | None:
        """The condition's verdict on ``m``: None to go ahead (what it returned beyond "yes" is
        ``m.plan``, for the replacement), or the reason it refuses."""
        if self.condition is None:
            return None
        try:
            verdict = self.condition(m)
        except Refuse as exc:  # (a helper the condition shares with the replacement may raise it)
            return str(exc) or "condition refused"
        if verdict is None:
            return None
        if isinstance(verdict, (bool, np.bool_)):  # (numpy's False, from np.all(...), refuses too)
            return None if verdict else "condition refused"
        if isinstance(verdict, str):
            return verdict
        m.plan = verdict
        return None

    def match(self, node: ir.Node, opsets: Mapping[str, int], options: Mapping[str, Any] | None = None
              ) -> Match | str:
        """A Match, or the reason this rule does not apply at ``node`` (its pattern, or its condition)."""
        m = self.bind(node, opsets, options)
        if isinstance(m, str):
            return m
        reason = self.judge(m)
        return reason if reason is not None else m


def _names(pattern: Pattern) -> tuple[set, set, set, set]:
    """The names a pattern binds: values (Var, Const and Op's ``bind``), constants (Const), nodes
    (Op), chains (Repeat)."""
    values: set[str] = set()
    consts: set[str] = set()
    nodes: set[str] = set()
    chains: set[str] = set()
    stack, seen = [pattern], set()
    while stack:
        p = stack.pop()
        if id(p) in seen:  # (a fragment used twice, a Repeat's steps sharing their levels)
            continue
        seen.add(id(p))
        if isinstance(p, (Var, Const)) and p.name is not None:
            values.add(p.name)
            if isinstance(p, Const):
                consts.add(p.name)
        elif isinstance(p, Op):
            if p.name is not None:
                nodes.add(p.name)
            if p.bind is not None:
                values.add(p.bind)
            stack.extend(p.inputs)
        elif isinstance(p, (Opt, Absorbed, Explain, Around)):
            stack.append(p.pattern)
        elif isinstance(p, Or):
            stack.extend(p.alternatives)
        elif isinstance(p, All):
            stack.extend(p.patterns)
        elif isinstance(p, Repeat):
            if p.name is not None:
                chains.add(p.name)
            stack.append(p.end)
            stack.extend(p._steps)
    return values, consts, nodes, chains


# --------------------------------------------------------------------------------------------
# Building replacements


class Namer:
    """Unique, deterministic names for new nodes and values across the whole model."""

    def __init__(self, model: ir.Model):
        taken: set[str] = set()
        for graph in graphs(model):
            for value in graph.inputs:
                taken.add(value.name)
            for name in graph.initializers:
                taken.add(name)
            for node in graph:
                taken.add(node.name)
                for value in node.outputs:
                    taken.add(value.name)
        taken.discard(None)
        self.taken = taken
        self.counters: dict[str, int] = {}

    def __call__(self, hint: str) -> str:
        if hint not in self.taken:
            self.taken.add(hint)
            return hint
        n = self.counters.get(hint, 0)
        while True:
            n += 1
            name = f"{hint}_{n}"
            if name not in self.taken:
                self.counters[hint] = n
                self.taken.add(name)
                return name


class Builder:
    """Creates the replacement nodes and initializers of one rewrite.

    Nothing touches the graph until the driver commits; an aborted rewrite leaves no trace.
    """

    def __init__(self, match: Match, namer: Callable[[str], str]):
        self.match = match
        self._namer = namer
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []

    def op(
        self,
        op_type: str,
        *inputs: ir.Value | None,
        domain: str = "",
        outputs: int = 1,
        attrs: Mapping[str, Any] | Sequence[ir.Attr] | None = None,
        overload: str = "",
        **kwattrs: Any,
    ) -> Any:
        """Create a node; returns its output (or a tuple of outputs when ``outputs > 1``).
        ``overload`` names the overload of a model-local function being called."""
        attributes: list[ir.Attr] = []
        if attrs is not None:
            if isinstance(attrs, Mapping):
                kwattrs = {**attrs, **kwattrs}
            else:
                taken = set(kwattrs)
                attributes = [_copy_attr(a) for a in attrs if a.name not in taken]
        attributes += [_to_attr(k, v) for k, v in kwattrs.items()]
        # "<original node name>::<rule>": earlier rules' suffixes are dropped, so names do not grow
        root_name = (self.match.root.name or self.match.root.op_type).split("::")[0]
        base = self._namer(f"{root_name}::{self.match.rule.name}")
        outs = [ir.Value(name=self._namer(f"{base}_out{i}" if outputs > 1 else f"{base}_out")) for i in range(outputs)]
        node = ir.Node(domain, op_type, list(inputs), attributes=attributes, outputs=outs, name=base,
                       overload=overload)
        self.nodes.append(node)
        return outs[0] if outputs == 1 else tuple(outs)

    def name(self, value: ir.Value, hint: str) -> ir.Value:
        """Name a value this rewrite made ``hint`` (made unique across the model), so that later
        rewrites can find it and read it rather than compute it again; returns the value."""
        value.name = self._namer(hint)
        return value

    def const(self, array: Any, name: str = "const") -> ir.Value:
        """A new initializer holding ``array`` (numpy array or ir tensor)."""
        if isinstance(array, np.ndarray):
            tensor = ir.Tensor(array)
        elif isinstance(array, (ir.Tensor, ir.ExternalTensor, ir.StringTensor, ir.LazyTensor)):
            tensor = array
        else:
            tensor = ir.tensor(np.asarray(array))
        value = ir.Value(
            name=self._namer(name),
            shape=ir.Shape(tensor.shape),
            type=ir.TensorType(tensor.dtype),
            const_value=tensor,
        )
        tensor.name = value.name
        self.initializers.append(value)
        return value

    def check(self, olds: Sequence[ir.Value], news: Sequence[ir.Value]) -> str | None:
        """Why the replacement ``news`` cannot take the place of the root's outputs ``olds``, or
        None: at most one value per output, every used output replaced, and a graph output
        replaced only by a value made here or by an intermediate of this graph that can take its
        name."""
        graph, builder = self.match.graph, self
        if len(news) > len(olds):
            return f"replacement gives {len(news)} values for {len(olds)} outputs"
        for old in olds[len(news):]:
            if old.uses() or old.is_graph_output():
                return f"output {old.name!r} is used but not replaced"
        if len({id(v) for v in news}) != len(news):
            return "the replacement gives one value for two outputs"
        created = {v for n in builder.nodes for v in n.outputs} | set(builder.initializers)
        seen_outputs: set[ir.Value] = set()
        for old, new in zip(olds, news):
            if new is old:
                continue
            if not old.is_graph_output():
                continue
            if new in created:
                continue
            # An existing value would become this graph output: it must be an ordinary
            # intermediate of this graph that can take the output's name.
            producer = new.producer()
            if producer is None or producer.graph is not graph:
                return f"{old.name!r} is a graph output and {new.name!r} cannot take its place"
            if new.is_graph_output() or new in seen_outputs:
                return f"{old.name!r} and {new.name!r} would be the same graph output"
            seen_outputs.add(new)
        return None

    def abort(self) -> None:
        for node in self.nodes:
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
        self.nodes.clear()
        self.initializers.clear()


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    if attr.is_ref():
        return ir.RefAttr(attr.name, attr.ref_attr_name, attr.type)
    return ir.Attr(attr.name, attr.type, attr.value)


def _to_attr(name: str, value: Any) -> ir.Attr:
    if isinstance(value, ir.Attr):
        return _copy_attr(value) if value.name == name else ir.Attr(name, value.type, value.value)
    return ir.convenience.convert_attribute(name, value)
