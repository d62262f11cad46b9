"""The sequence one optimization runs: what the model reads first, the driver to a fixpoint with
the whole-graph passes between its rounds, and the final cleanup. The passes are those of the table
(``onnxopt.core.passes``: ``onnxopt.library.passes`` registers the built-in ones) the caller names;
this module names none, and runs each by what it declares:

0. The records of the input the chosen passes need (``Pass.needs``: the memory baseline), each once,
   before anything changes (the time counted as that of the first pass needing it); they may read
   the ModelProto the model was read from where the caller left it (``onnxopt.ir.shapes.SOURCE_KEY``),
   which is dropped then.
1. Dead code out (a dead reader of a value would block patterns that need it to have one use),
   and a note on each value of what the input recorded of its type and shape.
2. The passes of phase ``Phase.FIRST``, in table order (constant lifting, shape completion).
3. The driver until its worklist is empty; then the passes of phase ``Phase.BETWEEN`` (initializer
   deduplication, common-subexpression elimination, transpose placement), whose changes go back on
   the worklist, and the driver again, until neither changes anything.
4. For each pass that ``settles`` an option (the transpose pass: ``SETTLED``): the option set for the
   rules, and every node tried once more where the pass changed something or ``waiting`` says rules
   wait for it.
5. Dead code out, and the shapes the input did not record forgotten (inferred shapes are for the
   rules; written into the output they change what onnxruntime fuses).
6. The passes of phase ``Phase.LAST``, in table order (memory recomputation, then memory reordering).
7. The requirements' records handed back (``DriverResult.records``) and the passes' ``scratch``
   keys dropped.

A pass's changes count as rewrites (``max_rewrites``, ``stop_after``); a pass runs whole, so with
``stop_after`` it is one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import onnx_ir as ir

from onnxopt.core import passes
from onnxopt.core.driver import Driver
from onnxopt.core.passes import Pass, Phase
from onnxopt.core.pattern import Rule
from onnxopt.core.purity import Purity
from onnxopt.core.stats import DriverResult, RuleStats
from onnxopt.ir.shapes import SOURCE_KEY, forget_inferred_shapes, mark_declared
from onnxopt.ir.util import gc_paused, remove_unused

_MAX_PASS_ROUNDS = 32


def run(model: ir.Model, rules: Sequence[Rule], *, graph_passes: Iterable[str | Pass] | None = None,
        max_rewrites: int | None = None, stop_after: int | None = None, keep_log: bool = False,
        options: dict | None = None, strict: bool = False,
        progress: Callable[[str, int, int], None] | None = None) -> DriverResult:
    """Optimize ``model`` in place with ``rules`` and the whole-graph passes ``graph_passes`` names
    (registered ones, ``onnxopt.core.passes``; default: every registered pass); the driver's
    result, with each pass's statistics among the rules'. ``strict``: a bug in a rule raises
    (``onnxopt.errors.RuleBug``) instead of being recorded in the result's ``errors``.
    ``progress(step, done, total)`` hears of each pass and driver round (``onnxopt.reporting.console.Status``)."""
    with gc_paused():
        return _run(model, rules, graph_passes, max_rewrites, stop_after, keep_log, options, strict,
                    progress or (lambda step, done=0, total=0: None))


def _run(model, rules, graph_passes, max_rewrites, stop_after, keep_log, options, strict, progress) -> DriverResult:
    chosen = passes.lookup(passes.names() if graph_passes is None else graph_passes)
    stats = {p.name: RuleStats() for p in chosen}
    needs = {}  # requirement -> the first pass needing it (its time is that pass's)
    for p in chosen:
        for req in p.needs:
            needs.setdefault(req, p)
    for req, p in needs.items():  # the input as given, before anything changes
        t0 = time.perf_counter()
        req.record(model)
        stats[p.name].seconds += time.perf_counter() - t0
    model.graph.meta.pop(SOURCE_KEY, None)  # (the proto it was read from: true until the first change)
    _remove_dead(model)
    mark_declared(model)
    early, early_log = 0, []
    for p in chosen:
        if p.phase is Phase.FIRST:
            progress(f"rewriting: {p.name.replace('_', ' ')}")
            n = _run_pass(p, stats[p.name], model, None)
            early += n
            if n and keep_log:
                early_log.append({"pass": p.name, "rewrites": n})
    # (rules may ask which passes run: transpose_to_reshape leaves a Transpose the transpose pass cancels)
    options = {**(options or {}), "graph_passes": tuple(p.name for p in chosen)}
    driver = Driver(model, list(rules), max_rewrites=max_rewrites, stop_after=stop_after, keep_log=keep_log,
                    options=options, strict=strict)
    driver.result.rewrites = early
    driver.result.log.extend(early_log)
    progress(f"rewriting: {len(rules)} rules, round 1")
    result = driver.run()
    between = [p for p in chosen if p.phase is Phase.BETWEEN]
    for k in range(_MAX_PASS_ROUNDS):
        progress(f"rewriting: {len(rules)} rules, round {k + 2} ({result.rewrites} rewrites so far)")
        changed = 0
        for p in between:
            if driver.at_limit:
                break  # (stop_after: a pass is one step; the next one waits for the next round)
            n = _run_pass(p, stats[p.name], model, driver.touched)
            changed += n
            result.rewrites += n
            if n and keep_log:
                result.log.append({"pass": p.name, "rewrites": n})
        if not changed:
            break
        _remove_dead(model)
        driver.run(seed=False)
    for p in chosen:
        if p.settles is None or driver.at_limit:
            continue
        # the rules that wait for the pass (transpose_to_reshape waits for the transpose pass) take
        # what it left; and every node is tried once more, since a pass moves nodes past what the
        # worklist re-queues (a zero offset before a Transpose and a Conv whose bias came later)
        driver.options[p.settles] = True
        if stats[p.name].fired or (p.waiting is not None and p.waiting(model)):
            driver.run(seed=True)
    _remove_dead(model)
    forget_inferred_shapes(model)
    for p in chosen:
        if p.phase is Phase.LAST and not driver.at_limit:
            progress(f"rewriting: {p.name.replace('_', ' ')}")
            n = _run_pass(p, stats[p.name], model, None)
            result.rewrites += n
            if n and keep_log:
                result.log.append({"pass": p.name, "rewrites": n})
    result.records = {req.name: model.graph.meta.pop(req.key, None) for req in needs}
    for key in {key for p in chosen for key in p.scratch}:
        model.graph.meta.pop(key, None)
    result.rules.update(stats)
    return result


def _remove_dead(model: ir.Model) -> int:
    return remove_unused(model, Purity(model).removable)


def _run_pass(p: Pass, st: RuleStats, model: ir.Model, touched) -> int:
    """Run one graph pass; returns the rewrites it made (none for an annotation pass, whose count
    is reported as matched only)."""
    t0 = time.perf_counter()
    n = p.run(model, touched)
    st.seconds += time.perf_counter() - t0
    st.tried += 1
    st.matched += n
    if p.annotates:
        return 0
    st.fired += n
    return n
