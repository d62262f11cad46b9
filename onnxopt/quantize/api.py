"""``onnxopt.quantize()``: INT8 post-training quantization with calibration, as one call.

The steps, in order (each one's module says more):

1. load and check the model; a model that is already quantized, or computes in fp16/bf16, is refused
   (there is nothing useful to make of it), and so is the ``ort-cuda`` target (onnxruntime's CUDA
   provider runs QDQ models in float, slower than the fp32 model);
2. onnxopt's normal cleanup (``optimize``, portable rules: Conv+BatchNormalization folded first);
3. the target's rules (``plan.target_rules``) and the tensors whose ranges the plan needs;
4. calibration (``calibrate``): streaming and mergeable, over the calibration set less a held-out
   part kept for measuring fidelity;
5. the plan (scales and zero points) and the QDQ rewrite (the rule family ``rules/qdq.py``);
6. fidelity (``fidelity``): output SQNR on the held-out samples; below ``fidelity`` dB, the layers
   that hurt most fall back to float until it is met;
7. integer-kernel coverage (``coverage``): which nodes onnxruntime runs as integer kernels, which
   stay float, and why; per-layer SQNR;
8. with ``keep_float="auto"`` the shipped cost table (``ort_cpu_costs.json``, as the per-layer
   decisions) estimates the quantized nodes' time in int8 against float: unless int8 is at least 3%
   faster the float model is kept, with the reason and the table entries that decided in the report;
   no timing, so the same input gives the same bytes. ``keep_float="measure"`` times both models on
   this machine instead (interleaved, at ``threads``; machine-dependent); ``"never"`` always int8.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnxopt.ir import evaluate
from onnxopt.ir import io
from onnxopt.core import pipeline
from onnxopt.library import registry
from onnxopt import targets
from onnxopt.errors import UsageError, strict_default
from onnxopt.ir.input_shapes import fix as fix_input_shapes, normalize as normalize_input_shapes, refine_fixed
from onnxopt.ir.util import node_counts

from onnxopt.options import DEFAULT_FIDELITY_DB, DEFAULT_METHOD, QuantizeOptions  # noqa: F401 (the defaults: there)
KEEP_FLOAT = ("auto", "measure", "never")
MIN_SPEEDUP = 0.03  # keep_float="auto": the int8 model must be at least this much faster
MAX_HELD_OUT = 64
SMALL_HELD_OUT = 8  # (onnxopt.quantize.fidelity.SMALL_HELD_OUT: fewer held-out samples are flagged as small)

_QUANT_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "MatMulInteger",
    "ConvInteger", "QGemm", "QLinearAdd", "QLinearMul", "QLinearAveragePool", "QLinearGlobalAveragePool",
    "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul", "QAttention", "MatMulNBits", "QLinearReduceMean", "QLinearWhere",
})
_LOW_PRECISION = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass
class QuantizeReport:
    """What one ``quantize()`` call did, and the evidence: settings and the target's rules,
    calibration, the plan, fidelity (output and per-layer SQNR, the fallback), integer-kernel
    coverage, the latency check and what was kept."""

    kept: str  # "int8" or "float"
    reason: str  # one line: why that was kept
    settings: dict
    calibration: dict
    plan: dict
    fidelity: dict
    coverage: dict | None
    latency: dict | None
    nodes: dict  # op-type counts: "input", "cleaned" (the float model after cleanup), "output"
    seconds: dict
    warnings: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {"kept": self.kept, "reason": self.reason, "settings": self.settings, "calibration": self.calibration,
                "plan": self.plan, "fidelity": self.fidelity, "coverage": self.coverage, "latency": self.latency,
                "nodes": self.nodes, "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "warnings": self.warnings}


def refusal(model: ir.Model) -> str | None:
    """Why ``model`` cannot be quantized (already quantized, or fp16/bf16), or None."""
    ops = sorted({n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type in _QUANT_OPS})
    if ops:
        return f"the model is already quantized (it has {', '.join(ops[:4])}); quantize its float original"
    low = [v for v in (*model.graph.inputs, *model.graph.initializers.values()) if v.dtype in _LOW_PRECISION]
    if low:
        return (f"the model computes in {low[0].dtype.name.lower()} ({low[0].name!r}); int8 quantization starts "
                f"from the fp32 model")
    floats = [v for v in model.graph.inputs if v.dtype is not None and v.dtype.is_floating_point()]
    if not floats and not any(v.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)
                              for v in model.graph.initializers.values() if v.dtype is not None):
        return "the model has no float weights or inputs: nothing to quantize"
    return None


def check_options(*, method: str, target: str | None, keep_float: str, fidelity, workers: int,
                  exclude, threads: int = 1) -> str:
    """The options checked before any work (a one-line UsageError each); the target, normalized."""
    from onnxopt.quantize.calibrate import METHODS

    if method not in METHODS:
        raise UsageError(f"unknown calibration method {method!r}; choose from {', '.join(METHODS)}")
    target = targets.normalize(target or targets.ORT_CPU)
    if target == targets.ORT_CUDA:
        raise UsageError("--target ort-cuda: onnxruntime's CUDA provider runs QDQ models in float, slower than the "
                         "fp32 model; quantize for ort-cpu, or use fp16 on CUDA")
    if keep_float not in KEEP_FLOAT:
        raise UsageError(f"keep_float must be one of {', '.join(KEEP_FLOAT)}, not {keep_float!r}")
    if fidelity is not None and (not isinstance(fidelity, (int, float)) or isinstance(fidelity, bool)
                                 or not np.isfinite(fidelity)):
        raise UsageError(f"fidelity is a minimum output SQNR in dB (a finite number) or None, not {fidelity!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 2**31 - 1:
        raise UsageError(f"threads must be 0 (onnxruntime's choice) or a positive whole number, not {threads!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise UsageError(f"workers must be a whole number >= 1, not {workers!r}")
    if isinstance(exclude, str):
        raise UsageError("exclude is a list of node names or op types, not one string")
    return target


def quantize(model: io.ModelLike, calibration, output: str | os.PathLike | None = None, *,
             options: QuantizeOptions | None = None, **shortcuts):
    """Quantize ``model`` to INT8 (QDQ) for onnxruntime's CPU provider, calibrated on ``calibration``.

    The settings are ``options`` (``onnxopt.options.QuantizeOptions``) and the keywords below, each
    a shortcut for its field, applied over ``options``.

    Args:
        model: a path, bytes, onnx.ModelProto or onnx_ir.Model (the result is of the same kind; for a
            path, the path written, which ``output`` must name).
        calibration: a folder of .npy/.npz files (one feed each), one .npz file, an iterable of feed
            dicts, or an onnxruntime ``CalibrationDataReader`` (see ``onnxopt.quantize.data``).
        output: where to write the result (atomically; required for a path input).
        method: calibration method: "minmax", "percentile", "entropy" or "mse".
        per_channel: weights quantized per output channel where the op allows (default), else per tensor.
        target: "ort-cpu" (the default) or "portable"; "ort-cuda" is refused.
        exclude: node names or op types left in float.
        fidelity: minimum output SQNR (dB) against the float model on the held-out samples
            (default ``DEFAULT_FIDELITY_DB``); the layers that hurt most fall back to float until
            it is met. None: no fallback.
        keep_float: "auto" (default): keep the float model unless the shipped cost table
            (``ort_cpu_costs.json``) estimates the quantized nodes at least 3% faster in int8 (no
            timing: byte-identical run to run; the report names the table entries that decided);
            "measure": time both models on this machine instead (interleaved, at ``threads``
            intra-op threads; the result depends on the machine and its load); "never": always the
            quantized model.
        reduce_range: 7-bit weights for CPUs without VNNI (default: off, see ``plan.target_rules``).
        workers: calibration processes (results are bit-identical for any number).
        held_out: calibration samples kept out of calibration to measure fidelity (default: a
            quarter, at least 8 where that leaves half for calibration, at most 64; none when fewer
            than 5 samples are given, with a warning). The report states the estimate's sample size
            and a 90% bootstrap interval per output (``fidelity["estimate"]``); fewer than 8 held-out
            samples is a warning.
        input_shapes: fix the model's inputs first (as ``optimize``).
        return_report: return ``(result, QuantizeReport)``.
        method_options: passed to the calibration method (e.g. ``{"percentile": 99.99}``).
        threads: onnxruntime intra-op threads of ``keep_float="measure"``'s timing (default 1; 0:
            onnxruntime's choice).
        latency_budget: seconds of ``keep_float="measure"``'s timing rounds at most (default 10).
    """
    o = (options or QuantizeOptions()).with_shortcuts(**shortcuts)
    strict = strict_default(o.strict)
    exclude = list(o.exclude or ())
    target = check_options(method=o.method, target=o.target, keep_float=o.keep_float, fidelity=o.fidelity,
                           workers=o.workers, exclude=exclude, threads=o.threads)
    latency_budget = o.latency_budget
    if isinstance(latency_budget, bool) or not isinstance(latency_budget, (int, float)) or not 0 < latency_budget < 1e6:
        raise UsageError(f"latency_budget {latency_budget!r}: a number of seconds above 0")
    progress = o.progress or (lambda step, done=0, total=0: None)
    return _quantize(model, calibration, output, o.method, o.per_channel, target, exclude, o.fidelity, o.keep_float,
                     o.reduce_range, o.workers, o.held_out, normalize_input_shapes(o.input_shapes), o.external_data,
                     o.check, o.return_report, o.outputs, strict, progress, dict(o.method_options or {}), o.threads,
                     latency_budget)


def _quantize(model, calibration, output, method, per_channel, target, exclude, fidelity, keep_float, reduce_range,
              workers, held_out, input_shapes, external_data, check, return_report, outputs, strict, progress,
              method_options, threads=1, latency_budget=10.0):
    from onnxopt.quantize.calibrate import calibrate, check_runs
    from onnxopt.quantize.coverage import integer_coverage
    from onnxopt.quantize.data import open_calibration
    from onnxopt.quantize.fidelity import (fallback as run_fallback, held_out_estimate, latency_check, layer_sqnr, output_sqnr,
                           table_decision)
    from onnxopt.quantize.plan import apply_plan, calibration_tensors, make_plan, strip_plan_keys, target_rules

    seconds: dict[str, float] = {}
    warnings: list[str] = []
    t0 = time.perf_counter()
    progress(f"loading {model}" if isinstance(model, (str, os.PathLike)) else "loading the model")
    loaded = io.load(model, check=check, copy_ir=True)
    if (why := refusal(loaded.model)) is not None:
        raise UsageError(why)
    rules = target_rules(target, per_channel=per_channel, reduce_range=reduce_range)
    give_back_plan = io.plan_give_back(loaded, output, external_data=external_data, outputs=outputs,
                                       also_read=_calibration_files(calibration))
    try:
        nodes = {"input": node_counts(loaded.model)}
        # 2. cleanup (portable: standard ops only, which the QDQ rules know)
        progress("cleaning up")
        cleaned = loaded.model
        if input_shapes:
            fix_input_shapes(cleaned, input_shapes)
        chosen, graph_passes = registry.resolve(None, (), (), targets.PORTABLE, None)
        pipeline.run(cleaned, chosen, graph_passes=graph_passes, strict=strict, progress=progress,
                     options={"fold_size_limit": evaluate.DEFAULT_SIZE_LIMIT,
                              "fold_input_limit": evaluate.DEFAULT_INPUT_LIMIT, "exact": False})
        nodes["cleaned"] = node_counts(cleaned)
        _fill_types(cleaned)  # (the plan reads value types; cleanup forgets the shapes it inferred)
        with tempfile.TemporaryDirectory(prefix="onnxopt-quantize-") as tmp:
            float_path = _write_temp(cleaned, Path(tmp) / "float.onnx")
            seconds["cleanup"] = time.perf_counter() - t0
            # 3.-4. calibration
            t1 = time.perf_counter()
            # what the plan needs, and every float activation: the fallback (more nodes float) and an
            # absorption the plan undoes (a Clip whose calibrated range passes its bounds) change
            # which tensors share a range
            tensors = calibration_tensors(cleaned, rules, exclude=exclude)
            tensors = list(dict.fromkeys([*tensors, *_float_activations(cleaned)]))
            calib = open_calibration(calibration, float_path)
            n = len(calib)
            k = _held_out_count(n, held_out)
            if k:
                calib_part, held = calib.split(k)
            else:
                calib_part, held = calib, calib
                warnings.append("fidelity is measured on the calibration samples themselves: " + (
                    "held_out=0" if held_out == 0 else f"{n} sample(s) given, too few to hold some out (give at least 5)"))
            ranges = calibrate(float_path, tensors, calib_part, method=method, workers=workers,
                                          progress=progress, **method_options)
            seconds["calibrate"] = time.perf_counter() - t1
            held_feeds = list(held)
            if k:  # feeds calibration did not run: one the float model cannot take is the user's (exit 2)
                check_runs(float_path, held_feeds, "held-out calibration")

            # 5. plan and rewrite; requantize() is what the fallback calls with more layers in float
            t2 = time.perf_counter()
            made: dict[frozenset, tuple] = {}
            tried: list[frozenset] = []

            def requantize(excluded: frozenset = frozenset()):
                """The QDQ model with ``excluded`` left float, written beside the float model (its
                path: weights the input keeps in external files are copied into its own)."""
                if excluded not in made:
                    quant = cleaned.clone()
                    plan = make_plan(quant, ranges, rules, exclude=[*exclude, *sorted(excluded)])
                    stats = apply_plan(quant, plan, strict=strict, keep_plan_keys=True)
                    _keep_output_types(quant, cleaned)
                    made.clear()  # (keep one: models are big)
                    made[excluded] = (quant, plan, stats, _write_temp(quant, Path(tmp) / f"q{len(tried)}.onnx"))
                    tried.append(excluded)
                return made[excluded][3]

            progress("quantizing")
            first = requantize()
            quant_ir, plan, stats, quant_proto = made[frozenset()]
            if plan.unmatched_exclude:
                warnings.append(f"--exclude: {', '.join(plan.unmatched_exclude)} matched no node name, op type or "
                                "source node name")
            seconds["quantize"] = time.perf_counter() - t2

            # 6. fidelity and the fallback
            t3 = time.perf_counter()
            progress("measuring fidelity")
            fallback = None
            out_sqnr = output_sqnr(float_path, first, held_feeds)
            if not out_sqnr:
                warnings.append("the model has no float output: fidelity (output SQNR) not measured, no fallback")
            if fidelity is not None and not _worst(out_sqnr) >= fidelity:  # (NaN: below any target)
                fallback = run_fallback(float_path, requantize, held_feeds, fidelity,
                                              candidates=sorted(plan.nodes), progress=progress)
                requantize(frozenset(fallback.excluded))  # (made already: the fallback's last model)
                quant_ir, plan, stats, quant_proto = made[frozenset(fallback.excluded)]
                out_sqnr = dict(fallback.output_db)  # (the fallback measured its last model)
                if not fallback.met:
                    warnings.append(f"fidelity {fidelity:g} dB not met even with every layer in float")
            estimate, more = held_out_estimate(float_path, quant_proto, held_feeds, held_out=k)
            warnings += more
            layers = layer_sqnr(float_path, quant_proto, None, held_feeds)
            seconds["fidelity"] = time.perf_counter() - t3

            # 7. coverage
            t4 = time.perf_counter()
            progress("integer-kernel coverage")
            reasons = dict(plan.skipped)
            if fallback is not None:
                reasons.update({name: f"left float for fidelity ({fidelity:g} dB)" for name in fallback.excluded})
            cover = integer_coverage(quant_proto, plan_reasons=reasons)
            seconds["coverage"] = time.perf_counter() - t4

            # 8. the latency check
            kept, reason, latency = "int8", "quantized", None
            if not plan.nodes:  # nothing to time: the "int8" model computes in float
                kept = "float"
                reason = ("every quantizable node fell back to float for fidelity" if fallback is not None and
                          fallback.excluded else "no node could be quantized (see the plan's skipped reasons)")
            elif keep_float == "auto":  # the shipped table decides: the same input gives the same bytes
                kept, reason, latency = table_decision(plan.costs, MIN_SPEEDUP)
            elif keep_float == "measure":  # asked for: a timing on this machine decides
                t5 = time.perf_counter()
                progress("timing int8 against float")
                check_result = latency_check(float_path, quant_proto, held_feeds[:1],
                                                       min_speedup=MIN_SPEEDUP, threads=threads,
                                                       budget_s=latency_budget)
                latency = _as_dict(check_result)
                kept, reason = check_result.keep, check_result.reason
                seconds["latency"] = time.perf_counter() - t5
            if kept == "int8":
                strip_plan_keys(quant_ir)
                result_model = quant_ir
            else:
                result_model = cleaned
            nodes["output"] = node_counts(result_model)
        loaded.model = result_model
        refine_fixed(loaded.model)  # (every input static: the dims that inference proves, as optimize writes them)
        progress(f"saving {output}" if output is not None else "converting the result")
        t6 = time.perf_counter()
        out = io.give_back(loaded, output, give_back_plan)
        seconds["save"] = time.perf_counter() - t6
    except BaseException:
        if give_back_plan is not None and give_back_plan.own:
            give_back_plan.outputs.abort()
        raise
    seconds["total"] = time.perf_counter() - t0
    if not return_report:
        return out
    report = QuantizeReport(
        kept=kept, reason=reason,
        settings={"target": target, "method": method, "per_channel": bool(per_channel), "exclude": list(exclude),
                  "fidelity_db": fidelity, "keep_float": keep_float, "workers": workers,
                  **({"threads": threads, "latency_budget": latency_budget} if keep_float == "measure" else {}),
                  "method_options": method_options,
                  "input_shapes": {k: list(v) for k, v in input_shapes.items()},
                  "target_rules": _as_dict(rules)},
        calibration={"samples": n, "calibrated_on": n - k if k else n, "held_out": k, "tensors": len(tensors),
                     "method": method},
        plan={"quantized_nodes": len(plan.nodes), "quantized_tensors": len(plan.params),
              "skipped": dict(sorted(plan.skipped.items())), "rules": _rule_stats(stats)},
        fidelity={"min_db": fidelity, "output_sqnr_db": out_sqnr, "estimate": estimate,
                  "layer_sqnr_db": dict(sorted(layers.items(), key=lambda kv: kv[1])),
                  "fallback": None if fallback is None else _as_dict(fallback, skip=("model",))},
        coverage=cover.as_dict(), latency=latency, nodes=nodes, seconds=seconds, warnings=warnings)
    return out, report


def _keep_output_types(quant: ir.Model, cleaned: ir.Model) -> None:
    """The graph outputs keep the type and shape they had: a rule's DequantizeLinear that takes an
    output's name is a new value, without the shape (onnx's checker requires one)."""
    before = {v.name: v for v in cleaned.graph.outputs}
    for value in quant.graph.outputs:
        old = before.get(value.name)
        if old is None:
            continue
        if value.type is None and old.type is not None:
            value.type = old.type
        if value.shape is None and old.shape is not None:
            value.shape = ir.Shape(old.shape)


def _calibration_files(calibration) -> list:
    """The files a calibration source given as a path reads (a folder's .npy/.npz files): outputs may
    not replace them."""
    if not isinstance(calibration, (str, os.PathLike)):
        return []
    path = Path(calibration)
    if path.is_dir():
        return [path, *sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".npy", ".npz"))]
    return [path]


def _worst(sqnr: dict) -> float:
    """The lowest output SQNR; NaN when any is NaN (a NaN output is below any target)."""
    values = list(sqnr.values())
    return float("nan") if any(v != v for v in values) else min(values, default=float("inf"))


def _held_out_count(n: int, held_out: int | None) -> int:
    if held_out is not None:
        if isinstance(held_out, numbers.Integral) and not isinstance(held_out, bool):
            held_out = int(held_out)
        if not isinstance(held_out, int) or isinstance(held_out, bool) or held_out < 0 or held_out >= n:
            raise UsageError(f"held_out must be a whole number from 0 to {n - 1} (the calibration set has {n} samples), "
                             f"not {held_out!r}")
        return held_out
    # a quarter, at least 8 where that leaves half for calibration (3 of 16 gave 20.4 dB where 23 other
    # photos gave 17.9: too few to estimate from)
    return 0 if n < 5 else min(MAX_HELD_OUT, max(n // 4, min(SMALL_HELD_OUT, n // 2)))


def _float_activations(model: ir.Model) -> list[str]:
    """The float32 values computed in the main graph, and its float32 inputs, in graph order."""
    values = [v for v in model.graph.inputs if not v.is_initializer()]
    values += [v for node in model.graph for v in node.outputs]
    return [v.name for v in values if v.name and v.dtype == ir.DataType.FLOAT]


def _fill_types(model: ir.Model) -> None:
    """Types (and shapes, where missing) of the main graph's values from onnx's shape inference."""
    from onnxopt.library import passes

    values = {v.name: v for node in model.graph for v in node.outputs if v.name}
    if all(v.type is not None for v in values.values()):
        return
    try:
        inferred = passes.infer_model(model)
    except Exception:  # noqa: BLE001 - inference refusing the model: the plan says what it cannot type
        return
    for info in inferred.graph.value_info:
        value = values.get(info.name)
        if value is None or not info.type.HasField("tensor_type"):
            continue
        tt = info.type.tensor_type
        if value.type is None and tt.elem_type:
            value.type = ir.TensorType(ir.DataType(tt.elem_type))
        if value.shape is None and tt.HasField("shape"):
            value.shape = ir.serde.deserialize_type_proto_for_shape(info.type)


def _write_temp(model: ir.Model, path: Path) -> str:
    """The float model written for onnxruntime, alone in its folder (weights the input kept in
    external files copied into its own data file when large)."""
    io.save(model, path, external_data=True if io.initializer_bytes(model) >= io.PROTO_LIMIT // 2 else None)
    return str(path)


def _rule_stats(stats) -> dict:
    if isinstance(stats, dict):
        return {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in sorted(stats.items())}
    return {}


def _as_dict(obj, skip: Sequence[str] = ()) -> dict:
    if hasattr(obj, "as_dict"):
        d = obj.as_dict()
    elif dataclasses.is_dataclass(obj):
        d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    else:
        d = dict(obj)
    return {k: (list(v) if isinstance(v, (tuple, frozenset, set)) else v) for k, v in d.items() if k not in skip}
