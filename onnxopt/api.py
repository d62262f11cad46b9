"""``optimize()``: the library face.

``optimize()`` reads its settings (``onnxopt.options.OptimizeOptions``, the keywords as shortcuts),
checks them, and runs :data:`STAGES` in order on one :class:`_Run`: load, the input's figures,
edges, the output planned, rewrite, precision, the result's figures, verify, save; each stage is a
function that reads the options and what the stages before it left, and adds its part of the
:class:`Report` (built at the end by ``_report``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from onnxopt.ir import genai, io
from onnxopt.transforms import edges as layouts
from onnxopt.core import pipeline
from onnxopt.library import registry
from onnxopt import targets
from onnxopt.transforms import precision as precisions
from onnxopt.verify import fp16_fallback
from onnxopt import verify as verifier
from onnxopt.verify.bisect import bisect_failure
from onnxopt.errors import UsageError, bug_warnings, strict_default
from onnxopt.options import OptimizeOptions, QuantizeOptions
from onnxopt.ir.input_shapes import fix as fix_input_shapes, normalize as normalize_input_shapes
from onnxopt.core.stats import RuleStats
from onnxopt.ir.util import gc_paused, node_counts
from onnxopt.transforms.transposes import report_summary
from onnxopt.transforms.liveness import PEAK_KEY
from onnxopt.transforms.memory import report_peak
from onnxopt.core import passes
from onnxopt.library.passes import MEMORY_BASELINE
from onnxopt.core.pattern import Rule
from onnxopt.reporting.text import summary_line
from onnxopt.ir.input_shapes import RUN_SHAPES_KEY, refine_fixed, symbolic_run_shapes
from onnxopt.ir.shapes import SOURCE_KEY
from onnxopt.verify.inputs import data_shapes, run_shapes


@dataclasses.dataclass
class Report:
    """What one optimize() call did: node counts before/after, per-rule statistics, timings."""

    before: dict[str, int]
    after: dict[str, int]
    rules: dict[str, RuleStats]
    rewrites: int
    seconds: dict[str, float]
    cycles: list[dict]
    hit_limit: bool
    warnings: list[str]
    errors: list[dict] = dataclasses.field(default_factory=list)  # rules that raised (bugs), see strict
    log: list[dict] = dataclasses.field(default_factory=list)  # the rewrites in order (with stop_after)
    verification: dict | None = None  # verify.verify()'s report, with verify=
    settings: dict = dataclasses.field(default_factory=dict)  # what shaped the result: target, exact, input_shapes
    # rules left out for the target, with the reason (registry.select): not valid there, or the measured
    # benefit table says the fusion does not pay there
    skipped: list[dict] = dataclasses.field(default_factory=list)
    advice: dict | None = None  # for ort-cuda: provider options that pay, CPU islands (onnxopt.targets.advice)
    fusions: dict = dataclasses.field(default_factory=dict)  # fusion rule -> hits, misses and why (below)
    precision: dict | None = None  # precision.Fp16Report.as_dict(), with precision="fp16"
    layout: dict | None = None  # onnxopt.transforms.edges.apply's record: inputs/outputs whose layout or preprocessing changed
    # Transposes of the main graph before and after, and what they move per inference
    # (onnxopt.transforms.transposes.report_summary); None where neither has one
    transposes: dict | None = None
    # peak activation memory of the main graph (onnxopt.transforms.memory.peak, without the curve): "before" (the
    # input at the fixed input shapes), "after", and "reordered" (the memory_reordering pass changed the order)
    memory: dict | None = None

    @property
    def fired(self) -> dict[str, int]:
        return {name: st.fired for name, st in self.rules.items() if st.fired}

    def as_dict(self) -> dict:
        return {
            "nodes_before": sum(self.before.values()),
            "nodes_after": sum(self.after.values()),
            "op_types_before": self.before,
            "op_types_after": self.after,
            "rewrites": self.rewrites,
            "rules": {name: st.as_dict() for name, st in self.rules.items()},
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "cycles": self.cycles,
            "hit_limit": self.hit_limit,
            "warnings": self.warnings,
            "errors": self.errors,
            "settings": self.settings,
            "skipped": self.skipped,
            **({"fusions": self.fusions} if self.fusions else {}),
            **({"advice": self.advice} if self.advice is not None else {}),
            **({"log": self.log} if self.log else {}),
            **({"verification": self.verification} if self.verification is not None else {}),
            **({"precision": self.precision} if self.precision is not None else {}),
            **({"layout": self.layout} if self.layout is not None else {}),
            **({"transposes": self.transposes} if self.transposes is not None else {}),
            **({"memory": self.memory} if self.memory is not None else {}),
        }


def optimize(model: io.ModelLike, output: str | os.PathLike | None = None, *, options: OptimizeOptions | None = None,
             **shortcuts):
    """Rewrite ``model`` with the rules until nothing more applies.

    The settings are ``options`` (``onnxopt.options.OptimizeOptions``: one frozen dataclass per
    concern) and the keywords below, each a shortcut for one of its fields, applied over
    ``options`` (``optimize(m, target="ort-cuda")`` is
    ``optimize(m, options=OptimizeOptions(target=TargetOptions(target="ort-cuda")))``).

    Args:
        model: a path, bytes, onnx.ModelProto, onnx_ir.Model or onnx_graphsurgeon.Graph; the
            result is of the same kind (for a path, the path written, which ``output`` must name;
            for a graphsurgeon Graph, a new Graph: the one given is never modified).
        rules: the rule set (default: onnxopt's built-in library).
        extra_rules: rules added to ``rules``.
        disable: names of rules to leave out.
        target: where the model will run (``onnxopt.targets``): "portable" (the default: standard
            ONNX ops only), "ort-cpu" or "ort-cuda" (onnxruntime's providers; "cpu" and "cuda" are
            aliases); only rules valid there run.
        output: where to write the result (required for a path input; optional otherwise).
        external_data: weights file name for the output, True for ``<output>.data``, False for one
            file; by default a model that came with external data is saved with it too.
        max_rewrites: cap on rewrites (default 10 x nodes + 1000).
        fold_size_limit: bytes; constant folding creates a larger tensor only in place of at least
            as many bytes of constants that become unused (default 1 MiB).
        fold_input_limit: bytes; a node whose constant inputs together pass this is not
            evaluated (default 256 MiB), so huge weights are not read to fold them.
        graph_passes: whole-graph passes (``onnxopt.library.passes.NAMES``: constant lifting, initializer
            deduplication, common-subexpression elimination, shape completion); default all of them
            with the built-in rules, none with an explicit ``rules`` list. ``disable`` takes their
            names too.
        check: run the ONNX checker and external-data check on the input.
        inplace: for an onnx_ir.Model, rewrite it in place instead of a copy (a graphsurgeon Graph
            cannot be: refused).
        return_report: return ``(result, Report)`` instead of the result alone.
        stop_after: stop once N rewrites are made, and record them in ``Report.log``; for
            bisecting (``python -m onnxopt bisect``). A graph pass runs whole and counts its merges
            as rewrites (constant lifting always runs first, so ``stop_after=0`` lifts constants and
            applies no rule); the first N rewrites of two runs are the same ones.
        verify: run onnxruntime on the original and the result and compare them (``True`` or
            ``"cpu"``, ``"cuda"``, ``"cpu,cuda"``, or a list): outputs, kernels, latency, see
            ``onnxopt.verify.verify``. When outputs differ beyond tolerance it raises
            ``onnxopt.verify.VerificationError`` (its ``report`` attribute has the details, and
            under ``"bisect"`` the rewrite after which outputs differ, see
            ``onnxopt.verify.bisect.bisect_failure``) and writes no output (an onnx_ir.Model rewritten
            ``inplace`` stays rewritten). The report is ``Report.verification``.
        verify_options: keyword arguments for ``onnxopt.verify.verify`` (inputs, input_shapes,
            int_ranges, seed, rtol, atol, runs, warmup, latency, threads, progress).
        input_shapes: fix the model's inputs before rewriting, e.g. ``{"x": [1, 3, 224, 224]}``:
            per input, whole numbers and symbol names (``["batch", 3, 224, 224]`` keeps or renames
            that dimension's symbol), or text as ``--input-shape`` takes it (``"1x3x224x224"``,
            ``["x=batch,3,224,224"]``); see ``onnxopt.ir.input_shapes``. A symbol given a number or a
            new name takes it everywhere in the model; the rules fold what becomes static. With
            ``verify``, the original (still dynamic) is run at the same shapes.
        strict: a rule whose condition or replacement raises (anything but ``Refuse``) has a bug:
            with ``strict`` it raises ``onnxopt.errors.RuleBug`` (a RuleError) at once; without,
            the rule is skipped at that node and the bug is reported (``Report.errors``, a warning
            line). Default: the environment variable ``ONNXOPT_STRICT=1`` (on in onnxopt's tests).
        exact: apply only rewrites whose result gives the same bits as the input on the installed
            onnxruntime's CPU provider with default session options (``Rule.exact``; the passes
            likewise); rules that do not declare it are left out (a warning names them). With
            ``verify``, tolerances default to 0 (rtol and atol): outputs must be equal.
        outputs: an ``onnxopt.ir.io.Outputs`` to stage the written files in instead of putting them in
            place at once: the caller commits them together with its own (the command line
            writes its JSON report so). Without it, ``output`` is written atomically here. Either
            way the input file and its data files are never written, and a failure leaves no
            output.
        progress: called as ``progress(step, done, total)`` as loading, rewriting and saving go
            (``onnxopt.reporting.console.Status`` draws it on a terminal, as the command line does); pass it
            in ``verify_options`` too for the verification's steps.
        quantize: INT8 quantization after the cleanup: a dict of ``onnxopt.quantize``'s options,
            ``calibration`` required (e.g. ``{"calibration": "calib/", "method": "entropy"}``);
            ``target`` (default "ort-cpu"), ``output``, ``external_data``, ``check``, ``input_shapes``,
            ``strict``, ``return_report`` (then a ``QuantizeReport``) and ``progress`` are taken from
            this call. It cannot be combined with custom rules, ``verify``, ``exact`` or
            ``stop_after``.
        precision: "fp32" (the default: types as they are) or "fp16": after the rules' fixpoint,
            float32 weights and compute become float16 with precision-sensitive ops kept in float32
            and the model's input and output types kept (``onnxopt.transforms.precision.convert_fp16``, for
            ``target``); ``Report.precision`` says what was converted and why the rest was not. A
            model already in float16 or quantized is refused. With ``verify``, each output is judged
            by fp16 fidelity against the original (cosine, max error over the output's range, top-1
            agreement for logits; ``onnxopt.verify.compare_fp16``) on each provider and in float16
            arithmetic (``onnxopt.verify.fp16``), and the conversion is measured first on the
            verifier's inputs: values float16 cannot hold there (beyond its range, or rounded by
            more than 1% of their spread) stay float32, and where the conversion misses those
            bounds, the fewest heavy nodes that meet them stay float32 too
            (``onnxopt.transforms.precision.convert_fp16_checked``; ``Report.precision["ranges"]`` and
            ``["fallback"]``). Without ``verify``, bounds from the weights and constants decide.
        input_layout: inputs the model is to take channels-last, ``{"x": "NHWC"}`` (or ``"NHWC"``
            for every input of rank 4; text as ``--input-layout`` takes it): the input keeps its
            name and takes the new shape, and a Transpose at it gives the model what it computed
            on (``onnxopt.transforms.edges``). ``input_shapes`` are given in the model's own layout.
        output_layout: likewise for outputs, ``{"y": "NHWC"}``: a Transpose before the output.
        input_preprocess: inputs that become raw images, ``{"x": "uint8,HWC,scale=1/255,mean=
            0.485,0.456,0.406,std=0.229,0.224,0.225,bgr"}`` (or a dict of those settings): the
            input is uint8 pixels, the model casts, swaps channels and normalizes them itself,
            folded into the first Convs where they take it (``onnxopt.transforms.edges``). With any of
            the three, the model records its edges (metadata ``onnxopt.io_layout``) and the
            verifier (here and ``python -m onnxopt verify``) feeds the original the same data in
            its own layout (raw pixels preprocessed in numpy), compares the outputs in the
            original's layout, and a failure is not bisected.
        diff: a path: write the static diff page there (``onnxopt.diff``: the node mapping from the
            result's provenance, a summary with the verification's kernels and latency where
            ``verify`` ran); ``model`` must be a path or an onnx.ModelProto. The live view is
            ``python -m onnxopt diff BEFORE AFTER``.
    """
    opts = (options or OptimizeOptions()).with_shortcuts(**shortcuts)
    if opts.report.diff is not None:
        return _optimize_with_diff(model, output, opts)
    opts.validate()  # each field's own check: one line on a bad value
    target, precision = opts.target.target, opts.target.precision
    rw, save, report = opts.rewrite, opts.save, opts.report
    exact, quantize = rw.exact, opts.quantize
    if precision == "fp16" and (exact or quantize is not None):
        raise UsageError(f"precision fp16 cannot be combined with {'exact' if exact else 'quantize'}: float16 "
                         f"changes every value")
    edges = opts.layout.edges()  # one line on a bad spec
    if edges and quantize is not None:
        raise UsageError("input/output layouts and preprocessing cannot be combined with quantize yet")
    if quantize is not None:
        return _optimize_quantized(model, quantize, rules=rw.rules, extra_rules=rw.extra_rules, disable=rw.disable,
                                   target=target, output=output, external_data=save.external_data, check=save.check,
                                   inplace=save.inplace, return_report=report.return_report,
                                   stop_after=rw.stop_after, verify=opts.verify.providers, outputs=save.outputs,
                                   strict=rw.strict,
                                   input_shapes=opts.layout.input_shapes, exact=exact, progress=report.progress)
    with gc_paused():
        return _optimize(model, output, opts, edges)


def _optimize_with_diff(model, output, opts: OptimizeOptions):
    """optimize(), then the diff page between ``model`` and the result."""
    import onnx

    from onnxopt import diff as diffs

    page = opts.report.diff
    if not isinstance(model, (str, os.PathLike, onnx.ModelProto)):
        raise UsageError(f"diff= needs the model as a path or an onnx.ModelProto, not {type(model).__name__}")
    want_report = opts.report.return_report
    opts = opts.with_shortcuts(diff=None, return_report=True)
    with io.Outputs() as outputs:  # the page: claimed first (never an input or the output), put in place atomically
        for path in (model, output):
            if isinstance(path, (str, os.PathLike)):
                outputs.protect(path)
        outputs.claim(page, "diff=")
        result, report = optimize(model, output, options=opts)
        after = os.fspath(result) if isinstance(result, (str, os.PathLike)) else result
        if not isinstance(after, (str, onnx.ModelProto)):
            after = ir.serde.serialize_model(result)
        names = (os.fspath(model) if isinstance(model, (str, os.PathLike)) else "BEFORE (in memory)",
                 after if isinstance(after, str) else "AFTER (in memory)")
        diffs.run(model, after, html_out=str(outputs.stage(page)), verify_report=report.verification, names=names)
    return (result, report) if want_report else result


@dataclasses.dataclass
class _Run:
    """One optimize() call as the stages see it: the settings (read from the options once), the
    model as it goes, and what the report gathers. A stage reads the settings and what the stages
    before it left, and adds its part."""

    model: Any  # the input as given
    output: str | os.PathLike | None
    options: OptimizeOptions
    rules: list | None
    extra_rules: list
    disable: list
    target: str | None
    strict: bool
    input_shapes: dict
    progress: Any
    edges: Any
    verify_options: dict | None
    clock: dict[str, float]  # stage name -> when it started (perf_counter); "start" and "end"
    chosen: list = dataclasses.field(default_factory=list)
    graph_passes: list = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    providers: list | None = None
    loaded: Any = None  # onnxopt.ir.io.load's result: the model being rewritten
    original: Any = None  # what the verifier runs as the original
    run_at: dict = dataclasses.field(default_factory=dict)
    transposes: dict | None = None
    memory: dict | None = None
    edited: dict | None = None
    plan: Any = None  # onnxopt.ir.io.plan_give_back's: the outputs claimed before the work
    genai: Any = None  # onnxopt.ir.genai.claim's files (with ``genai``), and the Outputs this run commits
    own_outputs: Any = None
    result: Any = None  # onnxopt.core.pipeline.run's
    fp16: Any = None
    before: dict | None = None
    after: dict | None = None
    advice: dict | None = None
    verification: dict | None = None
    out: Any = None

    @property
    def verify(self):
        return self.options.verify.providers

    @property
    def exact(self) -> bool:
        return self.options.rewrite.exact

    @property
    def precision(self) -> str:
        return self.options.target.precision

    @property
    def return_report(self) -> bool:
        return self.options.report.return_report


def _load(run: _Run) -> None:
    """The rules chosen for the target, the verifier's settings checked, the model loaded (a
    copy unless ``inplace``), its inputs fixed, and what the verifier will run as the original."""
    opts = run.options
    if run.rules is not None:  # onnxscript's rules made Rules once, for the run, the warning and a bisect
        run.rules = registry.as_rules(run.rules)
    run.extra_rules = registry.as_rules(run.extra_rules, "extra_rules")
    run.chosen, run.graph_passes = registry.resolve(run.rules, run.extra_rules, run.disable, run.target,
                                                    opts.rewrite.graph_passes, exact=run.exact, skipped=run.skipped)
    if run.verify and run.exact:  # exact mode's promise, checked as made: no tolerance unless one is given
        run.verify_options = {**(run.verify_options or {})}
        run.verify_options.update({k: 0.0 for k in ("rtol", "atol") if run.verify_options.get(k) is None})
    if run.verify:
        # before the work: a missing provider or a bad setting is a usage error
        run.providers = verifier.check_settings(run.verify, **(run.verify_options or {}))
    model = run.model
    run.progress(f"loading {model}" if isinstance(model, (str, os.PathLike)) else "loading the model")
    run.loaded = loaded = io.load(model, check=opts.save.check, copy_ir=not opts.save.inplace)
    if run.precision == "fp16":
        precisions.check_convertible(loaded.model)  # before the work: one line
    # what the verifier runs as the original: the input as given (a path, bytes, a proto, an IR
    # model left untouched, a graphsurgeon Graph's export), or for an IR model rewritten in place,
    # a clone taken now (tensors are shared: rules make new initializers rather than change them)
    if run.verify:
        run.original = loaded.model.clone() if loaded.kind == "ir" and opts.save.inplace else \
            model if loaded.exported is None else loaded.exported
    # (with edges the verifier feeds the original the same data in its own layout, preprocessed in
    # numpy, and compares the outputs in its layout: onnxopt.transforms.edges.edge_feeds, outputs_back)
    if run.input_shapes:
        fix_input_shapes(loaded.model, run.input_shapes)
    if run.input_shapes:
        vo = run.verify_options
        if run.verify and "feeds" not in (vo or {}):  # the original runs at the shapes fixed
            # (in the original's layout: taken before the edges change the inputs)
            run.verify_options = {**(vo or {}), "input_shapes": run_shapes(
                loaded.model, (vo or {}).get("input_shapes"), (vo or {}).get("inputs"))}
    # one set of shapes per report: the figures of symbolic inputs (peak memory) are taken at the
    # shapes the verification's data runs them at (--inputs, feeds), not at generated ones
    run.run_at = data_shapes(loaded.model, run.verify_options) if run.verify and run.return_report else {}
    if run.run_at:
        loaded.model.graph.meta[RUN_SHAPES_KEY] = run.run_at


def _measure_input(run: _Run) -> None:
    """For the report, the input's figures before the edges change it: its Transposes and what
    they move, and its peak activation memory where the pipeline will not record it."""
    loaded = run.loaded
    # the Transposes the model had (before its edges changed) and what they move, for the report
    run.transposes = {"before": report_summary(loaded.model)} if run.return_report else None
    # the input's peak: the pipeline records it before its first pass (the recomputation pass's limit);
    # taken here where the layout edges change the model first or that pass does not run
    early_peak = run.return_report and (bool(run.edges) or not passes.needing(run.graph_passes, MEMORY_BASELINE))
    run.memory = {"before": report_peak(loaded.model)} if early_peak else {} if run.return_report else None


def _edges(run: _Run) -> None:
    """Channels-last inputs and outputs and raw-pixel inputs (``onnxopt.transforms.edges``)."""
    loaded = run.loaded
    run.edited = layouts.apply(loaded.model, run.edges) if run.edges else None
    if run.edited and run.run_at:  # (the edited inputs' shapes: channels-last, raw pixels)
        recs = (layouts.edges_of(loaded.model.metadata_props) or {}).get("inputs", {})
        loaded.model.graph.meta[RUN_SHAPES_KEY] = {k: layouts.edge_shape(recs[k], v) if k in recs else v
                                                   for k, v in run.run_at.items()}


def _plan_output(run: _Run) -> None:
    """The output claimed before the work (a clash is an error now, and a failure later leaves
    nothing): ``onnxopt.ir.io.plan_give_back``."""
    read = [(run.verify_options or {}).get("inputs")] if run.verify else []  # (the verifier's inputs file)
    save = run.options.save
    outputs = save.outputs
    if save.genai is not None:  # the genai files are committed with the model: one Outputs for all of them
        if run.output is None:
            raise UsageError("genai= writes files beside the output: give output=")
        folder = genai.check_folder(save.genai)
        genai.config(run.loaded.model, folder, Path(run.output).name)  # (not a decoder: one line, before the work)
        if outputs is None:
            outputs = run.own_outputs = io.Outputs()
    run.plan = io.plan_give_back(run.loaded, run.output, external_data=save.external_data,
                                 outputs=outputs, also_read=read)
    if save.genai is not None:
        run.genai = genai.claim(outputs, run.output, folder)


def _rewrite(run: _Run) -> None:
    """The rules and passes to their fixpoint (``onnxopt.core.pipeline.run``), then the edges'
    preprocessing folded into the weights."""
    rw, loaded, edited = run.options.rewrite, run.loaded, run.edited
    run.before = node_counts(loaded.model) if run.return_report else None  # (a report's figure)
    if loaded.source is not None and not run.input_shapes and not edited:
        # the model as read, unchanged: what the pipeline records of the input may read the proto
        # it was read from rather than serialize the model again (onnxopt.ir.shapes.light_source)
        loaded.model.graph.meta[SOURCE_KEY] = loaded.source
    run.result = pipeline.run(loaded.model, run.chosen, max_rewrites=rw.max_rewrites, graph_passes=run.graph_passes,
                              stop_after=rw.stop_after, keep_log=rw.stop_after is not None, strict=run.strict,
                              progress=run.progress,
                              options={"fold_size_limit": int(rw.fold_size_limit),
                                       "fold_input_limit": int(rw.fold_input_limit), "exact": bool(run.exact),
                                       "target": targets.normalize(run.target), "precision": run.precision,
                                       "padding": run.options.layout.padding})
    if run.options.layout.padding != "any":  # (the promise the rewrites relied on: the verifier keeps it)
        loaded.model.metadata_props[io.PADDING_KEY] = run.options.layout.padding
    if edited and not run.exact and rw.stop_after is None:  # (folding changes the rounding: not exact)
        layouts.fold(loaded.model, edited)
    elif edited:
        for rec in edited["inputs"].values():
            rec.setdefault("not_folded", "exact: folding into the weights changes the rounding" if run.exact else
                           "stop_after: rewrites are being bisected")


def _precision(run: _Run) -> None:
    """With precision "fp16", after the fusion fixpoint (the fused ops convert whole): float16
    weights and compute, measured on the verifier's inputs where it verifies; then the dims that
    inference proves once every input is static (the last change to the model)."""
    loaded, edited = run.loaded, run.edited
    if run.precision == "fp16":
        run.progress("converting to float16")
        if run.verify:  # measured on the verifier's inputs: the fewest float32 nodes that meet the bounds
            vo = run.verify_options or {}
            feeds = vo.get("feeds")
            edges_made = layouts.edges_of(loaded.model.metadata_props) if edited else None
            how = None
            if feeds is None:
                feeds, how = verifier.make_inputs(run.original, shapes=vo.get("input_shapes"), npz=vo.get("inputs"),
                                                  int_ranges=vo.get("int_ranges"), seed=vo.get("seed") or 0,
                                                  pixels=layouts.pixel_inputs(edges_made))
            if edited:  # the model being converted takes the edited edges' inputs (the data given)
                feeds = layouts.edge_feeds(edges_made, feeds, vo.get("seed") or 0,
                                           how if how is not None else {k: {"source": "given"} for k in feeds})[1]
            run.fp16 = fp16_fallback.convert_fp16_checked(loaded.model, feeds, target=run.target,
                                                          progress=run.progress)
        else:
            run.fp16 = precisions.convert_fp16(loaded.model, target=run.target)
    # every input static: the outputs' and declared values' dims that inference proves (verified as written)
    refine_fixed(loaded.model)


def _measure(run: _Run) -> None:
    """For the report, the result's figures: node counts, Transposes, peak activation memory, and
    for ort-cuda the provider advice (none of it changes the model)."""
    loaded, result, memory, transposes = run.loaded, run.result, run.memory, run.transposes
    run.after = node_counts(loaded.model) if run.return_report else None
    if transposes is not None:
        transposes["after"] = report_summary(loaded.model)
        if not (transposes["before"]["count"] or transposes["after"]["count"]):
            run.transposes = None
    kept = loaded.model.graph.meta.pop(PEAK_KEY, None)  # (the reorder pass's figure for the order it left)
    if memory is not None:
        if "before" not in memory:
            memory["before"] = result.records[MEMORY_BASELINE.name]
        if kept is not None and not (run.edited or run.fp16):  # (the reorder pass's, sized as report_peak sizes)
            shapes = symbolic_run_shapes(loaded.model)
            memory["after"] = {**kept, "at": shapes} if shapes else kept
        else:  # (changed after the passes)
            memory["after"] = report_peak(loaded.model)
        memory["reordered"] = passes.any_fired(run.graph_passes, passes.Effect.ORDER, result.rules)
        if run.run_at and any(side.get("at") for side in (memory["before"], memory["after"])):
            memory["at_source"] = "data"  # (the verification's --inputs/feeds: one set of shapes per report)
    if run.return_report and targets.normalize(run.target) == targets.ORT_CUDA:
        from onnxopt.targets.advice import advise
        run.advice = advise(loaded.model, targets.ORT_CUDA)


def _verify(run: _Run) -> None:
    """With ``verify``: onnxruntime on the original and the result; on a difference the rewrite
    that caused it where bisecting is quick enough, and a VerificationError (nothing written)."""
    if not run.verify:
        return
    rw, result, fp16, edges = run.options.rewrite, run.result, run.fp16, run.edges
    verification = verifier.verify(run.original, run.loaded.model, providers=run.providers,
                                   **(run.verify_options or {}))
    run.verification = verification
    # bisect names the rewrite, when that is quick enough (it replays the rules without the edges)
    if not verification["ok"]:
        if fp16 is None and not edges:
            verification["bisect"] = bisect_failure(
                run.original, verification, seconds=time.perf_counter() - run.clock["start"],
                rewrites=result.rewrites, verify_options=run.verify_options, rules=run.rules,
                extra_rules=run.extra_rules, disable=run.disable, target=run.target, optimize_options={
                    "max_rewrites": rw.max_rewrites, "fold_size_limit": rw.fold_size_limit,
                    "fold_input_limit": rw.fold_input_limit, "graph_passes": run.graph_passes,
                    "strict": run.strict, "input_shapes": run.input_shapes, "exact": run.exact})
        elif verification.get("bisect_command"):  # (it would replay the rewrites alone)
            what = ("the fp16 conversion" if fp16 is not None else "the changed edges") + (
                " and the changed edges" if fp16 is not None and edges else "")
            verification["bisect_command"] += (f" (it replays the rewrites without {what}: where the "
                                               f"verification passes without them, they are the cause)")
        # (with fp16 or changed edges too: a model that fails its verification is never written)
        raise verifier.VerificationError(f"verification failed, no output written: "
                                         f"{summary_line(verification)}", verification)


def _save(run: _Run) -> None:
    """The result written (atomically, with the outputs planned) or converted to the input's kind."""
    run.progress(f"saving {run.output}" if run.output is not None else "converting the result")
    run.out = io.give_back(run.loaded, run.output, run.plan)
    if run.genai is not None:
        made = genai.config(run.loaded.model, Path(run.options.save.genai), Path(run.output).name,
                            provider="cuda" if targets.normalize(run.target) == targets.ORT_CUDA else None)
        genai.stage(run.plan.outputs, run.genai, made)
    if run.own_outputs is not None:
        run.own_outputs.commit()


# optimize()'s flow, in order: a stage is a function of the run (adding a stage is adding an entry)
STAGES: tuple[Callable[[_Run], None], ...] = (_load, _measure_input, _edges, _plan_output, _rewrite, _precision,
                                              _measure, _verify, _save)


def _optimize(model, output, opts: OptimizeOptions, edges):
    rw = opts.rewrite
    run = _Run(model=model, output=output, options=opts, rules=rw.rules, extra_rules=rw.extra_rules,
               disable=list(rw.disable), target=opts.target.target, strict=strict_default(rw.strict),
               input_shapes=normalize_input_shapes(opts.layout.input_shapes),
               progress=opts.report.progress or verifier.Progress(), edges=edges,
               verify_options=opts.verify.verifier_kwargs(), clock={"start": time.perf_counter()})
    try:
        for stage in STAGES:
            run.clock[stage.__name__.lstrip("_")] = time.perf_counter()
            stage(run)
    except BaseException:
        if run.plan is not None and run.plan.own:
            run.plan.outputs.abort()  # the claimed output's staging goes; nothing was written
        if run.own_outputs is not None:
            run.own_outputs.abort()
        raise
    run.clock["end"] = time.perf_counter()
    if not run.return_report:
        return run.out
    return run.out, _report(run)


def _report(run: _Run) -> Report:
    """The Report of a run: what each stage left, the warnings in their order, the timings."""
    result, fp16, memory, target, clock = run.result, run.fp16, run.memory, run.target, run.clock
    warnings = [c["message"] for c in result.cycles]
    left_out = registry.undeclared([*(run.rules or ()), *run.extra_rules]) if run.exact else []
    if left_out:
        warnings.append(f"exact: left out {len(left_out)} rule(s) that do not declare exact=True or False: "
                        f"{', '.join(left_out)}")
    warnings += bug_warnings(result.errors)
    if fp16 is not None and targets.normalize(target) != targets.ORT_CUDA:
        warnings.append(f"precision fp16 for target {targets.normalize(target)}: onnxruntime's CPU provider has "
                        "float16 kernels for few ops and runs the rest in float32 behind Casts it inserts, so the "
                        "model is half the size but slower there (1 thread: bert 38 -> 47 ms, resnet50 49 -> 65 ms "
                        "on this project's CPU); fp16 is for GPUs (target ort-cuda)")
    if fp16 is not None and (fp16.fallback or {}).get("kept"):
        warnings.append(f"precision fp16: {len(fp16.fallback['kept'])} node(s) kept in float32 to meet the fidelity "
                        f"bounds on the verifier's inputs: {', '.join(fp16.fallback['kept'][:5])}")
    elif fp16 is not None and fp16.fallback and not fp16.fallback.get("ok"):
        warnings.append(f"precision fp16: the conversion misses the fidelity bounds on the verifier's inputs "
                        f"({fp16.fallback.get('gave_up') or fp16.fallback.get('skipped')})")
    if memory is not None:
        warnings += _memory_warnings(memory, fp16=fp16 is not None)
    if result.hit_limit:
        warnings.append(f"stopped at the rewrite limit ({result.rewrites} rewrites); the result is valid but "
                        "may not be fully optimized")
    seconds = {"load": clock["rewrite"] - clock["start"], "rewrite": clock["verify"] - clock["rewrite"],
               "save": clock["end"] - clock["save"], "total": clock["end"] - clock["start"]}
    if run.verification is not None:
        seconds["verify"] = clock["save"] - clock["verify"]
    precision, edges = run.precision, run.edges
    return Report(run.before, run.after, result.rules, result.rewrites, seconds, result.cycles, result.hit_limit,
                  warnings, [bug.as_dict() for bug in result.errors], log=result.log, verification=run.verification,
                  settings={"target": targets.normalize(target), "exact": bool(run.exact),
                            "input_shapes": {name: list(dims) for name, dims in run.input_shapes.items()},
                            **({"precision": precision} if precision != "fp32" else {}),
                            **({"padding": run.options.layout.padding} if run.options.layout.padding != "any" else {}),
                            **(edges.as_dict() if edges else {})},
                  skipped=run.skipped, advice=run.advice, fusions=_fusions(run.chosen, result.rules),
                  precision=fp16.as_dict() if fp16 is not None else None, layout=run.edited,
                  transposes=run.transposes, memory=memory)


def _memory_warnings(memory: dict, fp16: bool = False) -> list[str]:
    """A line where the peak activation memory rose, in the nodes' order or in onnxruntime's (not
    where the input's figure is a lower bound: symbolic sizes the rewrites made known). The rewrites
    leave it raised only where the memory_recomputation pass finds no copy that wins it back (none on
    the zoo; a few small random graphs); what else can is what runs after them: the float16
    conversion, whose float32 outputs are made from a float16 copy alive at the same time, and the
    layout edges."""
    b, a = memory["before"], memory["after"]
    if b["lower_bound"]:
        return []
    sides = [(what, b[key], a[key]) for what, key in (("the nodes' order", "peak_bytes"),
                                                       ("onnxruntime's order", "onnxruntime_peak_bytes"))]
    if not any(after > before for _, before, after in sides):
        return []
    moves = "; ".join(f"in {what} it {'rose' if after > before else 'fell' if after < before else 'stayed'} "
                      f"{before} -> {after} bytes" for what, before, after in sides)
    why = ("the float16 conversion keeps float32 inputs and outputs: a float32 output is made from its float16 "
           "copy, both alive at once" if fp16 else "rewrites made values live longer or larger, and neither "
           "reordering nor recomputation wins it back")
    return [f"peak activation memory rose ({moves}): {why}; onnxopt.transforms.memory.peak names what is alive at the peak"]


def _fusions(chosen, stats) -> dict:
    """The fusions that ran (rules with a measured-benefit key): hits, and the candidates they
    missed with the reasons (a condition's refusals; pattern mismatches are not candidates)."""
    out = {}
    for r in chosen:
        st = stats.get(r.name)
        if r.benefit is None or st is None:
            continue
        out[r.name] = {"key": r.benefit, "hits": st.fired, "missed": st.refused,
                       "reasons": dict(st.reasons.most_common(5)) if st.refused else {}}
    return out


def _optimize_quantized(model, options, *, rules, extra_rules, disable, target, output, external_data, check, inplace,
                        return_report, stop_after, verify, outputs, strict, input_shapes, exact, progress):
    from onnxopt.quantize.api import quantize as _quantize

    if not isinstance(options, dict) or "calibration" not in options:
        raise UsageError("optimize(quantize=...) takes a dict of onnxopt.quantize options with 'calibration', "
                         "e.g. {'calibration': 'calib/'}")
    clash = [name for name, given in (("rules", rules is not None), ("extra_rules", bool(extra_rules)),
                                      ("disable", bool(list(disable))), ("verify", bool(verify)), ("exact", exact),
                                      ("stop_after", stop_after is not None), ("inplace", inplace)) if given]
    clash += [k for k in ("output", "external_data", "check", "input_shapes", "strict", "return_report",
                          "progress", "target", "outputs") if k in options]
    if clash:
        raise UsageError(f"optimize(quantize=...) cannot take {', '.join(clash)} (there, or inside quantize=): the "
                         f"quantization runs onnxopt's built-in cleanup and takes these from optimize's own arguments")
    options = dict(options)
    calibration = options.pop("calibration")
    known = {"output", *QuantizeOptions.keywords()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(f"optimize(quantize=...): unknown option(s) {', '.join(map(repr, unknown))}; onnxopt.quantize "
                         f"takes {', '.join(sorted(known - {'output', 'external_data', 'check', 'input_shapes', 'strict', 'return_report', 'progress', 'target', 'outputs'}))}")
    return _quantize(model, calibration, output=output, external_data=external_data, check=check,
                     input_shapes=input_shapes, strict=strict, return_report=return_report, progress=progress,
                     target=target, outputs=outputs, **options)


def default_rules() -> list[Rule]:
    return registry.builtin_rules()


__all__ = ["Report", "default_rules", "optimize", "ir"]
