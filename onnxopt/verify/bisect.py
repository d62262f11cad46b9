"""Bisecting the rewrites: replay the pipeline's sequence of rewrites and binary-search the first
one after which the optimized model's outputs differ from the original's on onnxruntime.

Above the pipeline and the verifier, below ``onnxopt.api`` (whose ``optimize(verify=...)`` runs
it after a failed verification, see :func:`bisect_failure`): it chooses the rules and passes as
``optimize()`` does (``onnxopt.library.registry.resolve``) and runs ``onnxopt.core.pipeline.run`` with
``stop_after`` on a copy of the model per attempt.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from onnxopt.ir import evaluate
from onnxopt.ir import io
from onnxopt.core import pipeline
from onnxopt.library import registry
from onnxopt.errors import bug_warnings, strict_default
from onnxopt.ir.input_shapes import fix as fix_input_shapes, normalize as normalize_input_shapes
from onnxopt.verify import (Progress, check_providers, check_tolerances, compare_all, find_culprit, is_fp16,
                     is_low_precision, parse_providers)
from onnxopt.verify.inputs import inputs_for, run_failure, run_shapes
from onnxopt.verify.fp16 import Fp16Unavailable, run_fp16
from onnxopt.verify.runtime import OrtModel, run_outputs as _run_outputs


def bisect(model, *, rules=None, extra_rules=(), disable: Iterable[str] = (), target: str | None = None,
           provider: str = "cpu", inputs: str | os.PathLike | None = None,
           feeds: Mapping[str, np.ndarray] | None = None, input_shapes: Mapping[str, Sequence[int]] | None = None,
           int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
           atol: float | None = None, optimize_options: dict | None = None,
           progress: Progress | None = None) -> dict:
    """Binary search over the driver's sequence of rewrites for the first one after which the
    optimized model's outputs differ from ``model``'s on ``provider``.

    The driver is deterministic, so optimizing with ``stop_after=n`` makes the same first rewrites
    as the full run and stops after ``n`` (constant lifting runs first, and a graph pass runs
    whole, counting its merges as rewrites: each is one step).
    The result names the step: the rule and the nodes it replaced and created (or the pass),
    and the first diverging value in the model right after it. Inputs as for ``onnxopt.verify.verify``.
    ``optimize_options``: ``optimize()``'s max_rewrites, fold_size_limit, fold_input_limit,
    graph_passes, strict and input_shapes (the inputs are fixed to these before the rewrites are
    replayed; the original, as given, runs at the same shapes)."""
    provider = parse_providers(provider)[0]
    check_providers([provider])
    check_tolerances(rtol, atol)
    progress = progress or Progress()
    original = OrtModel(model, "original")
    try:
        return _bisect(original, rules, extra_rules, disable, target, provider, inputs, feeds, input_shapes,
                       int_ranges, seed, rtol, atol, optimize_options, progress)
    finally:
        progress.close()
        original.close()


def _bisect(original: OrtModel, rules, extra_rules, disable, target, provider, inputs, feeds, input_shapes,
            int_ranges, seed, rtol, atol, optimize_options, progress) -> dict:
    source = io.load(original.path, check=False).model if original.path is not None else io.to_ir(original.proto)
    max_rewrites, graph_passes, options, strict, fixed = _settings(**(optimize_options or {}))
    if fixed:  # the optimization fixed the inputs first; the original runs at those shapes
        fix_input_shapes(source, fixed, flag="--fix-input-shape")
        if feeds is None:
            input_shapes = run_shapes(source, input_shapes, inputs)
    feeds, how = inputs_for(original, feeds, inputs, input_shapes, int_ranges, seed)
    low = is_low_precision(original.proto)
    arithmetic: list[str] = []

    def run_outputs(model, feeds, provider):  # a float16 model in float16 arithmetic (onnxruntime's CPU
        if half:                              # provider computes many float16 ops in float32)
            try:
                (got,), how = run_fp16(model, [feeds], provider)
                arithmetic[:] = [how]
                return got
            except Fp16Unavailable:
                pass
        return _run_outputs(model, feeds, provider)

    half = is_fp16(original.proto)
    try:
        reference = run_outputs(original.source(), feeds, provider)
    except Exception as exc:  # noqa: BLE001 - the shapes and the options that change them, in one line
        raise run_failure("the original model", exc, how, provider, [i for i in original.proto.graph.input if i.name not in {t.name for t in original.proto.graph.initializer}]) from None
    chosen, graph_passes = registry.resolve(rules, extra_rules, disable, target, graph_passes, exact=options["exact"])
    runs: dict = {}

    def attempt(n: int | None):
        key = -1 if n is None else n
        if key not in runs:
            model = source.clone()  # (tensors shared: rules make new initializers rather than change them)
            rep = pipeline.run(model, chosen, graph_passes=graph_passes, max_rewrites=max_rewrites, stop_after=n,
                               keep_log=True, options=options, strict=strict)
            built = OrtModel(model, "optimized")
            try:
                rows = compare_all(reference, run_outputs(built.source(), feeds, provider), low_precision=low,
                                   rtol=rtol, atol=atol)
                ok, error = all(r["ok"] for r in rows), None
            except Exception as exc:  # noqa: BLE001 - a model onnxruntime rejects fails verification
                rows, ok, error = [], False, f"onnxruntime cannot run it: {io.first_line(exc, 300)}"
            runs[key] = {"ok": ok, "rows": rows, "error": error, "log": rep.log, "rewrites": rep.rewrites,
                         "bugs": rep.errors, "model": built}
        return runs[key]

    try:
        progress("full optimization", 0, 1)
        full = attempt(None)
        total = full["rewrites"]
        report: dict = {"model": original.name, "provider": provider, "inputs": how, "seed": seed,
                        "rewrites": total, "errors": [bug.as_dict() for bug in full["bugs"]],
                        "warnings": bug_warnings(full["bugs"])}  # rule bugs met (without strict)
        if arithmetic:
            report["arithmetic"] = arithmetic[0]
        if full["ok"]:
            report.update(ok=True, message=f"the fully optimized model ({total} rewrites) verifies on {provider}: "
                                           "nothing to bisect")
            return report
        lo, hi = 0, total
        steps_total = max(1, int(np.ceil(np.log2(total + 1))) + 1)
        done = 0
        progress(f"bisecting {total} rewrites", done, steps_total)
        if not attempt(0)["ok"]:
            hi = 0
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                done += 1
                progress(f"bisecting: rewrites {lo}..{hi}", done, steps_total)
                if attempt(mid)["ok"]:
                    lo = mid
                else:
                    hi = mid
                _drop_models(runs, keep=(lo, hi, -1))  # (only the bounds' models are read again)
        bad = attempt(hi) if hi < total else full
        good_log = attempt(lo)["log"] if hi > 0 else []
        steps = bad["log"][len(good_log):] if hi > 0 else bad["log"]
        report.update(ok=False, first_failing_rewrite=hi, steps=steps, outputs=bad["rows"], error=bad["error"])
        named = [s.get("rule") or s.get("pass") for s in steps]
        report["culprit_rule"] = named[0] if named else None
        if hi == 0:
            report["message"] = ("outputs already differ before any rule fires: the graph passes that run first "
                                 f"({', '.join(named) or 'none'}) or the model itself")
        progress("locating the first diverging value", steps_total, steps_total)
        # against the model right before the failing rewrite (the original where it is the first):
        # against the original, the first value beyond tolerance may be an earlier rewrite's, within
        # tolerance at the outputs then, and the report named two culprits (conv_bn_fold's value and
        # the conv_mul_fold rewrite)
        before = attempt(lo)["model"] if hi > 0 else original
        try:
            culprit = find_culprit(before, bad["model"], feeds, provider, low_precision=low, rtol=rtol, atol=atol)
        except Exception as exc:  # noqa: BLE001
            culprit = {"message": f"could not expose intermediate values: {io.first_line(exc, 300)}"}
        culprit["compared_with"] = f"the model after rewrite {lo}" if hi > 0 else "the original model"
        report["culprit"] = consistent_culprit(culprit, named[0] if named else None)
        return report
    finally:
        _drop_models(runs, keep=())
        for r in runs.values():
            r.pop("model", None)


def _drop_models(runs: dict, keep) -> None:
    for key, r in runs.items():
        if key not in keep and r.get("model") is not None:
            r["model"].close()
            r["model"] = None


def consistent_culprit(culprit: dict, step: str | None) -> dict:
    """``culprit`` (``onnxopt.verify.culprit.find_culprit``) naming no rule other than ``step``,
    the rewrite bisect found: one with another rule keeps its value and node, and says why no rule
    is named."""
    other = culprit.get("rule")
    if other is None or other == step:
        return culprit
    culprit = {k: v for k, v in culprit.items() if k not in ("rule", "replaced")}
    culprit["reason"] = (f"the node that produced it was made by {other}, but outputs stay within tolerance until "
                         f"{step or 'the rewrite bisect found'}: the difference adds up over several rewrites")
    return culprit


def _settings(max_rewrites: int | None = None, fold_size_limit: int = evaluate.DEFAULT_SIZE_LIMIT,
              fold_input_limit: int = evaluate.DEFAULT_INPUT_LIMIT, graph_passes: Iterable[str] | None = None,
              strict: bool | None = None, input_shapes=None, exact: bool = False):
    """``optimize_options`` (``optimize()``'s keywords of these names) as ``pipeline.run`` takes
    them, and the input shapes the optimization fixed (``onnxopt.ir.input_shapes``)."""
    return max_rewrites, graph_passes, {"fold_size_limit": int(fold_size_limit),
                                        "fold_input_limit": int(fold_input_limit), "exact": bool(exact)}, \
        strict_default(strict), normalize_input_shapes(input_shapes)


BISECT_BUDGET_S = 60.0


def bisect_failure(model, report: dict, *, seconds: float, rewrites: int, verify_options: Mapping | None = None,
                   budget_s: float | None = None, **optimize_settings) -> dict:
    """After ``optimize(..., verify=...)`` found outputs that differ (``report``): :func:`bisect`
    the rewrites on the first provider that failed, with the same inputs, when the estimate,
    (log2(rewrites) + 1) x ``seconds`` (the measured optimize + verify time, less the latency
    measurement, which bisect does not repeat), is under ``budget_s`` (default
    :data:`BISECT_BUDGET_S`); else ``{"skipped": why}``. Where it names a rewrite, ``report``'s
    culprits keep no rule other than that one (:func:`consistent_culprit`). ``optimize_settings``: rules,
    extra_rules, disable, target and optimize_options, as the optimization ran."""
    budget_s = BISECT_BUDGET_S if budget_s is None else budget_s
    seconds -= sum(e.get("latency", {}).get("seconds", 0) for e in report["providers"].values())
    estimate = (math.log2(max(1, rewrites)) + 1) * seconds
    if estimate >= budget_s:
        return {"skipped": f"not run: about {estimate:.0f} s for {rewrites} rewrites, over {budget_s:.0f} s",
                "estimate_s": round(estimate, 1)}
    provider = next(p for p, e in report["providers"].items() if not e["ok"])
    keys = ("inputs", "feeds", "input_shapes", "int_ranges", "seed", "rtol", "atol", "progress")
    try:
        found = bisect(model, provider=provider, **{k: v for k, v in (verify_options or {}).items() if k in keys},
                       **optimize_settings)
    except Exception as exc:  # noqa: BLE001 - the verification's verdict stands; say why there is no bisect
        return {"skipped": f"failed: {io.first_line(exc, 300)}"}
    if found.get("culprit_rule"):  # one culprit in the report: the verification's names no other rule
        for entry in report["providers"].values():
            if entry.get("culprit"):
                entry["culprit"] = consistent_culprit(entry["culprit"], found["culprit_rule"])
    return found
