"""The contract between the pipeline and the whole-graph passes, and the table of passes.

A whole-graph pass is a :class:`Pass`: a name, the :class:`Phase` it runs in, a run function
``run(model, touched) -> changes``, and what it declares:

- ``needs``: :class:`Requirement` s, records of the input model the pipeline makes before anything
  changes (the input's peak activation memory, which the memory recomputation pass must not exceed),
  each made once per run however many passes need it, and handed back in the run's result
  (``DriverResult.records``, by requirement name);
- ``settles``: a key of the driver's options the pipeline sets True for the rules once the pass is
  done (the rounds between which it runs are over), then tries every node once more where the pass
  changed something or ``waiting(model)`` says rules wait for it (a rule never imports a pass
  module: it reads the key, :data:`SETTLED`);
- ``effect``: what it changes (:class:`Effect`: nodes, only their order, or only annotations whose
  count is reported as matched, not fired);
- ``targets``: the targets it runs for (None: every one);
- ``scratch``: ``graph.meta`` keys it leaves for a later pass, dropped when the run ends;
- ``exact``: as ``Rule.exact``: under ``optimize(exact=True)`` only passes declaring True run.

Adding a pass is adding a row: :func:`register` puts it in the table (``onnxopt.library.passes``
registers the built-in ones, in the order they run within their phase); the pipeline
(``onnxopt.core.pipeline``) runs whatever the table holds, by phase, and names no pass.

Keys a pass leaves in the driver's options for the rules to read:

- :data:`SETTLED`: the transpose pass (``onnxopt.transforms.transposes``) has placed the graph's
  Transposes; the transpose rules stop deferring to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import onnx_ir as ir

from onnxopt.errors import UsageError

SETTLED = "transposes_settled"

Touched = Callable[[Sequence[ir.Node], Sequence[ir.Value]], None]
"""How a pass tells the driver what it changed: the nodes that now read a different value, and the
values that lost a use (``Driver.touched`` re-queues what that can make match)."""


class Phase(str, enum.Enum):
    """When a pass runs in the pipeline (equal to the 0.1 strings, "first", "between", "last")."""

    FIRST = "first"  # once, before matching (dead code out, declared shapes marked)
    BETWEEN = "between"  # after each driver fixpoint; its changes go back on the worklist, until nothing changes
    LAST = "last"  # once, at the end (dead code out, inferred shapes forgotten)

    def __str__(self) -> str:
        return self.value

    @property
    def when(self) -> str:
        """How ``--list-rules`` says it."""
        return {"first": "first", "between": "between rounds", "last": "last (once, at the end)"}[self.value]


class Effect(str, enum.Enum):
    """What a pass changes."""

    NODES = "nodes"  # nodes, values or initializers (its count is rewrites: fired)
    ORDER = "order"  # only the order of the main graph's nodes (fired)
    ANNOTATES = "annotates"  # no node: shapes or types for the rules (its count is reported as matched only)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Requirement:
    """A record of the input model some pass needs, made by ``record(model)`` (which leaves it in
    ``model.graph.meta[key]`` without changing the model) before the pipeline changes anything."""

    name: str
    key: str
    record: Callable[[ir.Model], None]
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Pass:
    """A whole-graph pass: ``run(model, touched)`` returns how many changes it made (see the module)."""

    name: str
    run: Callable[[ir.Model, Touched | None], int]
    phase: Phase
    doc: str
    effect: Effect = Effect.NODES
    exact: bool | None = None  # as Rule.exact: runs under optimize(exact=True) only when True
    needs: tuple[Requirement, ...] = ()
    settles: str | None = None  # an options key set True for the rules once the pass is done
    waiting: Callable[[ir.Model], bool] | None = None  # with settles: rules may wait for it (try every node again)
    targets: frozenset[str] | None = None  # the targets it runs for (None: all)
    scratch: tuple[str, ...] = ()  # graph.meta keys it leaves for later passes, dropped at the end

    def __post_init__(self):
        if not isinstance(self.phase, Phase):  # ("first", "between", "last": the 0.1 strings)
            object.__setattr__(self, "phase", Phase(self.phase))
        if not isinstance(self.effect, Effect):
            object.__setattr__(self, "effect", Effect(self.effect))

    @property
    def annotates(self) -> bool:
        """Changes no node: its count is reported as matched, not fired."""
        return self.effect is Effect.ANNOTATES

    def runs_for(self, target: str | None) -> bool:
        return self.targets is None or target is None or target in self.targets


_TABLE: dict[str, Pass] = {}


def register(p: Pass, *, replace: bool = False) -> Pass:
    """Add ``p`` to the table (after the passes registered before it, within its phase); a name
    already there is an error unless ``replace`` (the row keeps its place)."""
    if not isinstance(p, Pass):
        raise TypeError(f"register takes a Pass, not {type(p).__name__}")
    if p.name in _TABLE and not replace:
        raise ValueError(f"a pass named {p.name!r} is registered already")
    _TABLE[p.name] = p
    return p


def unregister(name: str) -> None:
    _TABLE.pop(name, None)


@contextlib.contextmanager
def registered(p: Pass) -> Iterator[Pass]:
    """``p`` in the table for the block's length (tests, a one-off experiment)."""
    register(p)
    try:
        yield p
    finally:
        unregister(p.name)


def table() -> tuple[Pass, ...]:
    """Every registered pass, in table order."""
    return tuple(_TABLE.values())


def names() -> tuple[str, ...]:
    return tuple(_TABLE)


def get(name: str) -> Pass | None:
    return _TABLE.get(name)


def lookup(chosen: Iterable[str | Pass]) -> list[Pass]:
    """The passes ``chosen`` names (or holds) in table order; a name not registered is a usage
    error (passes given as objects that are not registered run after the table's, in their order)."""
    chosen = list(chosen)
    given = [c for c in chosen if isinstance(c, Pass) and c.name not in _TABLE]
    wanted = {c if isinstance(c, str) else c.name for c in chosen}
    unknown = sorted(wanted - set(_TABLE) - {p.name for p in given})
    if unknown:
        raise UsageError(f"unknown graph pass(es): {', '.join(unknown)} (registered: {', '.join(_TABLE)})")
    return [p for p in _TABLE.values() if p.name in wanted] + given


def needing(chosen: Iterable[str | Pass], requirement: Requirement) -> bool:
    """Whether a pass of ``chosen`` needs ``requirement`` (the pipeline then records it)."""
    return any(requirement in p.needs for p in lookup(chosen))


def any_fired(chosen: Iterable[str | Pass], effect: Effect, stats: dict[str, Any]) -> bool:
    """Whether a pass of ``chosen`` with ``effect`` changed something in a run (``stats``: its
    per-pass statistics, ``DriverResult.rules``)."""
    return any(p.effect is effect and stats.get(p.name) is not None and stats[p.name].fired
               for p in lookup(chosen))


__all__ = ["SETTLED", "Effect", "Pass", "Phase", "Requirement", "Touched", "any_fired", "get", "lookup", "names",
           "needing", "register", "registered", "table", "unregister"]
