"""The sequence one optimization runs: what the model reads first, the driver to a fixpoint with
the whole-graph passes between its rounds, and the final cleanup.

1. Dead code out (a dead reader of a value would block patterns that need it to have one use),
   and a note on each value of what the input recorded of its type and shape.
2. The passes of phase "first" (``onnxopt.library.passes.PASSES``), in table order: constant lifting,
   shape completion.
3. The driver until its worklist is empty; then the passes of phase "between" (initializer
   deduplication, common-subexpression elimination), whose changes go back on the worklist, and
   the driver again, until neither changes anything.
4. Dead code out, and the shapes the input did not record forgotten (inferred shapes are for the
   rules; written into the output they change what onnxruntime fuses).
5. The passes of phase "last": memory recomputation (where the peak activation memory is above the
   input's, recorded before step 1: cheap nodes copied, ``onnxopt.transforms.recompute``), then memory reordering
   (the nodes' order only, where that strictly lowers the peak, ``onnxopt.transforms.memory``).

A pass's changes count as rewrites (``max_rewrites``, ``stop_after``); a pass runs whole, so with
``stop_after`` it is one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import onnx_ir as ir

from onnxopt.library import passes
from onnxopt.core.driver import Driver
from onnxopt.core.stats import DriverResult, RuleStats
from onnxopt.ir.util import gc_paused, remove_unused
from onnxopt.core.pattern import Rule
from onnxopt.core.purity import Purity
from onnxopt.transforms.recompute import BASELINE_KEY, SIZES_KEY

_MAX_PASS_ROUNDS = 32


def run(model: ir.Model, rules: Sequence[Rule], *, graph_passes: Iterable[str] = passes.NAMES,
        max_rewrites: int | None = None, stop_after: int | None = None, keep_log: bool = False,
        options: dict | None = None, strict: bool = False,
        progress: Callable[[str, int, int], None] | None = None) -> DriverResult:
    """Optimize ``model`` in place with ``rules`` and the named whole-graph passes; the driver's
    result, with each pass's statistics among the rules'. ``strict``: a bug in a rule raises
    (``onnxopt.errors.RuleBug``) instead of being recorded in the result's ``errors``.
    ``progress(step, done, total)`` hears of each pass and driver round (``onnxopt.reporting.console.Status``)."""
    with gc_paused():
        return _run(model, rules, graph_passes, max_rewrites, stop_after, keep_log, options, strict,
                    progress or (lambda step, done=0, total=0: None))


def _run(model, rules, graph_passes, max_rewrites, stop_after, keep_log, options, strict, progress) -> DriverResult:
    chosen = [p for p in passes.PASSES if p.name in set(graph_passes)]
    stats = {p.name: RuleStats() for p in chosen}
    if passes.RECOMPUTE in stats:  # the input's peaks, before anything changes (timed as that pass's)
        from onnxopt.transforms.memory import baseline

        t0 = time.perf_counter()
        baseline(model)
        stats[passes.RECOMPUTE].seconds += time.perf_counter() - t0
    _remove_dead(model)
    passes.mark_declared(model)
    early, early_log = 0, []
    for p in chosen:
        if p.phase == "first":
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
    between = [p for p in chosen if p.phase == "between"]
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
    if passes.TRANSPOSES in options["graph_passes"] and not driver.at_limit:
        # the rules that wait for the transpose pass (transpose_to_reshape) take the Transposes it
        # left; and every node is tried once more, since the pass moves nodes past what the
        # worklist re-queues (a zero offset before a Transpose and a Conv whose bias came later)
        from onnxopt.transforms.transposes import SETTLED

        driver.options[SETTLED] = True
        if stats[passes.TRANSPOSES].fired or any(n.op_type == "Transpose" for n in model.graph):
            driver.run(seed=True)
    _remove_dead(model)
    passes.forget_inferred_shapes(model)
    for p in chosen:
        if p.phase == "last" and not driver.at_limit:
            progress(f"rewriting: {p.name.replace('_', ' ')}")
            n = _run_pass(p, stats[p.name], model, None)
            result.rewrites += n
            if n and keep_log:
                result.log.append({"pass": p.name, "rewrites": n})
    result.memory_before = model.graph.meta.pop(BASELINE_KEY, None)
    model.graph.meta.pop(SIZES_KEY, None)  # (the memory passes' shared inference)
    result.rules.update(stats)
    return result


def _remove_dead(model: ir.Model) -> int:
    return remove_unused(model, Purity(model).removable)


def _run_pass(p: passes.Pass, st: RuleStats, model: ir.Model, touched) -> int:
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
