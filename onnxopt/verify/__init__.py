"""The verifier: run onnxruntime on a model before and after optimization and prove they agree.

For every requested execution provider (``cpu``, ``cuda``) it compares every output
(:mod:`.compare`), counts the kernels onnxruntime's profiler records per run and times both
models (:mod:`.runtime`), on inputs given or generated (:mod:`.inputs`). With CPU and CUDA both
requested it also compares each model's CPU outputs with its CUDA outputs. When outputs differ it
finds the culprit (:mod:`.culprit`); :mod:`onnxopt.verify.bisect` goes further and names the rewrite.

This package knows no command line; ``onnxopt.cli``, ``onnxopt.api`` and ``scripts/bench/peers.py``
use it, and ``onnxopt.reporting.text`` prints its reports.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping, Sequence

import numpy as np

from onnxopt.ir import io
from onnxopt.transforms import edges as layouts
from onnxopt.errors import OnnxoptError, UsageError
from onnxopt.verify.compare import (FP16_MAX_ERROR, FP16_MIN_COSINE, FP16_MIN_TOP1, INT8_MIN_SQNR_DB, LOW_PRECISION, TOLERANCES,
                      check_tolerances, compare, compare_all, compare_fp16, compare_int8, compare_value, is_fp16,
                      is_logits, is_low_precision, is_quantized, problem_text, sqnr_db, tolerance)
from onnxopt.verify.culprit import find_culprit
from onnxopt.verify.decode import compare_generation, decode_text, decoder_step_feeds, looks_like_a_decoder
from onnxopt.verify.inputs import inputs_for, make_inputs, parse_input_shapes, parse_int_ranges, run_failure
from onnxopt.verify.runtime import (LATENCY_BUDGET_S, LATENCY_RUNS, LATENCY_THREADS, NO_DIFFERENCE, PROVIDERS, OrtModel,
                      VerifyUnavailable, check_providers, count_kernels, latency_text, measure_latency,
                      parse_provider_options, parse_providers, ratio_interval, run_profiled, session)

__all__ = [
    "INT8_MIN_SQNR_DB", "LATENCY_BUDGET_S", "LATENCY_RUNS", "LATENCY_THREADS", "LOW_PRECISION", "NO_DIFFERENCE",
    "PROVIDERS", "TOLERANCES", "Progress", "VerificationError",
    "VerifyUnavailable", "bisect_command", "check_providers", "check_settings", "check_tolerances", "compare",
    "compare_all", "compare_value", "compare_int8", "compare_fp16", "compare_generation", "decode_text", "is_fp16", "is_logits", "count_kernels",
    "find_culprit", "is_low_precision", "is_quantized", "latency_entry", "latency_text", "make_inputs", "measure_latency", "parse_input_shapes",
    "parse_int_ranges", "parse_provider_options", "parse_providers", "ratio_interval",
    "problem_text", "run_profiled", "session", "sqnr_db", "tolerance", "verify",
]


class VerificationError(OnnxoptError):
    """The optimized model's outputs differ from the original's beyond tolerance."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class Progress:
    """The hook verify() and ``onnxopt.verify.bisect`` report their steps to: called as
    ``progress(step, done, total)`` at each step, ``close()`` when they end. This one shows nothing;
    ``onnxopt.reporting.console.Status`` (the command line's) draws it on a terminal."""

    def __call__(self, step: str, done: int = 0, total: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


def check_settings(providers: str | Sequence[str] = "cpu", *, runs: int = LATENCY_RUNS, warmup: int = 5,
                   threads: int = LATENCY_THREADS, rtol: float | None = None, atol: float | None = None,
                   min_sqnr: float | None = None, provider_options=None, budget_s: float = LATENCY_BUDGET_S,
                   decode: int = 0, **_) -> list[str]:
    """Refuse bad verification settings (UsageError, one line) before any work; the providers parsed."""
    providers = parse_providers(providers)
    check_providers(providers)
    if runs < 0:
        raise UsageError(f"--runs {runs}: must not be negative (0: no latency)")
    if warmup < 1:
        raise UsageError(f"--warmup {warmup}: at least 1 warm-up run")
    if not 0 <= threads <= 2**31 - 1:
        raise UsageError(f"--threads {threads}: must be 0 (onnxruntime's choice) or a positive 32-bit number")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < 1e6:
        raise UsageError(f"--latency-budget {budget_s}: a number of seconds above 0")
    check_tolerances(rtol, atol)
    unused = sorted(set(parse_provider_options(provider_options)) - set(providers))
    if unused:
        raise UsageError(f"provider options for {', '.join(unused)}, which this verification does not run "
                         f"(--providers {','.join(providers)})")
    if min_sqnr is not None and not np.isfinite(min_sqnr):
        raise UsageError(f"--min-sqnr {min_sqnr}: must be a finite number of dB")
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 0:
        raise UsageError(f"--decode {decode}: a number of tokens to generate (0: no generation)")
    return providers


def read_prompts(source) -> list | None:
    """Prompts for ``--decode``: None (generated), a list of token id lists, or a JSON file holding one;
    UsageError (one line) on a file that is not that."""
    if source is None or isinstance(source, (list, tuple)):
        return None if source is None else list(source)
    import json

    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise UsageError(f"--decode-prompts {source}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(f"--decode-prompts {source}: not JSON ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(p, list) for p in data) or not data:
        raise UsageError(f"--decode-prompts {source}: not a JSON list of token id lists")
    return data


def verify(original, optimized, *, providers: str | Sequence[str] = "cpu", inputs: str | os.PathLike | None = None,
           feeds: Mapping[str, np.ndarray] | None = None, input_shapes: Mapping[str, Sequence[int]] | None = None,
           int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
           atol: float | None = None, runs: int = LATENCY_RUNS, warmup: int = 5, latency: bool = True,
           culprit: bool = True, threads: int = LATENCY_THREADS, progress: Progress | None = None,
           bisect_options: Sequence[str] | None = None, min_sqnr: float | None = None, provider_options=None,
           budget_s: float = LATENCY_BUDGET_S, decode: int = 0, decode_prompts=None) -> dict:
    """Verify ``optimized`` against ``original`` on each provider; returns the report (a dict
    that ``onnxopt.reporting.text.format_verification`` prints); ``report["ok"]`` is False when an
    output differs.

    ``original``/``optimized``: paths, bytes, onnx.ModelProto or onnx_ir.Model. Inputs come from
    ``feeds``, else from ``inputs`` (.npz) and generation (see :func:`make_inputs`).

    Latency: both models' sessions at ``threads`` intra-op threads (default 1; 0: onnxruntime's
    choice), warmed up by ``warmup`` runs, then timed in interleaved rounds (each round runs both,
    the order alternating), at most ``runs`` rounds and at most ``budget_s`` seconds per provider
    (0 runs skips latency, as does ``latency=False``). ``report["providers"][p]["latency"]`` holds
    the ratio of medians (optimized / original), its 90% bootstrap interval over the rounds
    (deterministic: :func:`ratio_interval`) and the verdict: "faster"/"slower" only when the interval
    excludes 1.0 (and does not lie within 2% of it, what two sessions of one model differ by), else
    "no measurable difference".
    When outputs differ, ``report["bisect_command"]`` is the ``python -m onnxopt bisect`` command
    with these settings; ``bisect_options``: the command-line options that made ``optimized``
    (--rules, --disable, ...), None when unknown (the command then says to add them).

    A quantized ``optimized`` against a float ``original`` (Q/DQ or integer kernels in the second
    only) is judged by the int8 criterion: each float output passes when its SQNR against the
    original's is at least ``min_sqnr`` dB (default ``INT8_MIN_SQNR_DB``, 20 dB), not by an
    elementwise tolerance int8 cannot meet; the elementwise statistics are reported beside it, and
    ``rtol``/``atol``, when given, apply instead. Culprit search and bisect are skipped there (every
    quantized value differs from float by design). Two float models, or two quantized ones, are
    compared as ever.

    ``provider_options``: ``{provider: {option: value}}`` or ``["cuda:prefer_nhwc=1", ...]`` (see
    ``runtime.parse_provider_options``), given to both models' sessions of that provider (outputs,
    kernels and latency); the report records them (``report["provider_options"]``).

    A float16 ``optimized`` (float16 weights or Casts to it) against a float32 ``original``, the
    result of ``optimize(precision="fp16")``, is judged by fp16 fidelity (``compare_fp16``): each
    float output passes when its cosine is at least FP16_MIN_COSINE (0.999), its max abs error at
    most FP16_MAX_ERROR (1%) of the original output's range, and, for logits, its top-1 agreement at
    least FP16_MIN_TOP1 (99%); ``rtol``/``atol``, when given, apply instead. ``report["fp16"]`` states
    the criterion; culprit search and bisect are skipped (every value differs by design). It is also
    judged in float16 arithmetic (:mod:`.fp16`: every op's output rounded to float16, which
    onnxruntime's CPU provider does not do), at these inputs only: ``report["fp16"]["arithmetic"]``,
    ``["ok"]``, ``["outputs"]``; two float16 models are both run so (``report["fp16_arithmetic"]``).

    ``decode`` (N > 0): decoders with a key/value cache are also compared over greedy generation of N tokens
    on each prompt, each model with its own cache (:mod:`.decode`): ``report["providers"][p]["decode"]``;
    float32 passes when every token is the original's, float16 when at least 99% are. ``decode_prompts``: a
    JSON file (or a list) of token id lists; default 8 generated prompts of 8 tokens."""
    providers = check_settings(providers, runs=runs, warmup=warmup, threads=threads, rtol=rtol, atol=atol,
                               min_sqnr=min_sqnr, provider_options=provider_options, budget_s=budget_s, decode=decode)
    provider_options = parse_provider_options(provider_options)
    prompts = read_prompts(decode_prompts) if decode else None
    progress = progress or Progress()
    before = after = None
    try:
        before = OrtModel(original, "original")
        after = OrtModel(optimized, "optimized")
        int8 = None
        if rtol is None and atol is None and is_quantized(after.proto) and not is_quantized(before.proto):
            int8 = INT8_MIN_SQNR_DB if min_sqnr is None else float(min_sqnr)
        # a float16 model against its float32 original: judged by fp16 fidelity (compare_fp16)
        fp16 = int8 is None and rtol is None and atol is None and is_fp16(after.proto) and \
            not is_low_precision(before.proto)
        # a model optimize gave other input/output layouts or raw-image inputs (onnxopt.transforms.edges): the
        # original gets the same data in its own layout, the outputs are compared in the original's
        edges = layouts.edges_between(_metadata(before.proto), _metadata(after.proto))
        report = _verify(before, after, providers, feeds, inputs, input_shapes, int_ranges, seed, rtol, atol, runs,
                         warmup, latency, culprit and int8 is None and not fp16 and not edges, threads, progress, int8,
                         provider_options, fp16, edges, budget_s, decode, prompts)
        if not report["ok"] and int8 is None and not fp16 and not edges:
            report["bisect_command"] = bisect_command(
                original, next((p for p, e in report["providers"].items() if not e["ok"]), providers[0]), inputs=inputs,
                input_shapes=input_shapes, int_ranges=int_ranges, seed=seed, rtol=rtol, atol=atol,
                options=bisect_options)
        return report
    finally:
        progress.close()
        for m in (before, after):
            if m is not None:
                m.close()


def latency_entry(lat: Mapping, *, warmup: int, threads: int, budget_s: float) -> dict:
    """A report's latency entry from :func:`measure_latency`'s result (entries "before" and "after"):
    medians and p90 of each, the ratio of medians with its bootstrap interval and verdict
    (:func:`ratio_interval`), the rounds, the threads and the budget they ran under."""
    res = lat["results"]
    entry: dict = {"rounds": lat["rounds"], "warmup": warmup, "threads": threads, "budget_s": budget_s,
                   "interleaved": True,
                   **{k: {"median_ms": round(v["median_ms"], 4), "p90_ms": round(v["p90_ms"], 4)}
                      for k, v in res.items()}}
    if "before" in res and "after" in res and res["before"]["median_ms"] > 0:
        ci = ratio_interval(res["before"]["times_ms"], res["after"]["times_ms"])
        entry["ratio_median"] = round(ci["ratio"], 4)
        entry["ratio_p90"] = round(res["after"]["p90_ms"] / res["before"]["p90_ms"], 4)
        entry["interval"] = None if ci["interval"] is None else [round(x, 4) for x in ci["interval"]]
        entry["confidence"] = ci["confidence"]
        if "session_spread" in ci:
            entry["session_spread"] = ci["session_spread"]
        entry["verdict"] = ci["verdict"]
    return entry


def _declared(model: OrtModel) -> list:
    """The graph inputs of ``model`` that are not initializers (what a run feeds)."""
    inits = {t.name for t in model.proto.graph.initializer}
    return [i for i in model.proto.graph.input if i.name not in inits]


def _folder(model: OrtModel) -> str | None:
    """The folder of a model given by path (None for one given in memory)."""
    src = model.source()
    return os.path.dirname(os.path.abspath(src)) if isinstance(src, (str, os.PathLike)) else None


def _metadata(proto) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def _verify(before: OrtModel, after: OrtModel, providers, feeds, inputs, input_shapes, int_ranges, seed, rtol, atol,
            runs, warmup, latency, culprit, threads, progress, int8: float | None = None,
            provider_options: dict | None = None, fp16: bool = False, edges: dict | None = None,
            budget_s: float = LATENCY_BUDGET_S, decode: int = 0, prompts=None) -> dict:
    decoder_how = None
    if feeds is None and inputs is None and not input_shapes and not edges and looks_like_a_decoder(before.proto):
        # a decoder with a key/value cache: inputs of sizes that agree (past + new = mask), from its own run
        step = decoder_step_feeds(session(before.source(), "cpu"), seed)
        if step is not None:
            feeds, decoder_how = step
    feeds, how = inputs_for(before, feeds, inputs, input_shapes, int_ranges, seed, layouts.pixel_inputs(edges),
                            padding=_metadata(after.proto).get(io.PADDING_KEY, "any"))
    how = decoder_how or how
    model_feeds = {"before": feeds, "after": feeds}
    if edges:  # (the data given is what runs: raw pixels, or those the given float values are made of)
        model_feeds["before"], model_feeds["after"] = layouts.edge_feeds(edges, feeds, seed, how)
        feeds = model_feeds["before"]
    low = is_low_precision(before.proto)
    report: dict = {"original": before.name, "optimized": after.name,
                    "seed": seed, "inputs": how, "low_precision": low, "providers": {}}
    if provider_options:
        report["provider_options"] = provider_options
    if edges:
        report["edges"] = layouts.describe_edges(edges, how)
    if int8 is not None:
        report["int8"] = {"min_sqnr_db": int8, "criterion": f"each float output: SQNR >= {int8:g} dB against the "
                                                            "float model"}
    if fp16:
        report["fp16"] = {"criterion": f"each float output: cosine >= {FP16_MIN_COSINE:g}, max abs error <= "
                                       f"{FP16_MAX_ERROR:.0%} of the original's range, top-1 agreement >= "
                                       f"{FP16_MIN_TOP1:.0%} for logits"}
    outputs: dict[str, dict[str, list]] = {}
    steps = len(providers) * (2 + (1 if latency and runs else 0))
    step = 0
    for p in providers:
        entry: dict = {}
        got = {}
        for label, model in (("before", before), ("after", after)):
            progress(f"{p}: running the {'original' if label == 'before' else 'optimized'} model", step, steps)
            try:
                got[label], kernels, init_s = run_profiled(model.source(), model_feeds[label], p, threads=threads,
                                                           provider_options=provider_options)
                if edges and label == "after":
                    got[label] = layouts.outputs_back(edges, got[label])
            except UsageError:  # (a provider option the provider does not take)
                raise
            except Exception as exc:  # noqa: BLE001 - onnxruntime refusing a model is a result
                if label == "before":  # the reference itself does not run: bad input, or inputs it cannot take
                    raise run_failure("the original model", exc, how, p, _declared(before)) from None
                entry["error"] = f"onnxruntime ({p}) cannot run the optimized model: {io.first_line(exc, 300)}"
                break
            entry.setdefault("kernels", {})[label] = {**kernels, "session_init_s": round(init_s, 4)}
            step += 1
        if "error" in entry:  # the optimized model does not run where the original does: it fails
            entry.update(ok=False, outputs=[{"name": name, "ok": False, "problem": "the optimized model does not run"}
                                            for name, _ in got["before"]])
            report["providers"][p] = entry
            continue
        outputs[p] = got
        entry["outputs"] = (_compare_int8(got["before"], got["after"], int8) if int8 is not None else
                            _compare_fp16(got["before"], got["after"]) if fp16 or low else
                            compare_all(got["before"], got["after"], low_precision=low, rtol=rtol, atol=atol))
        entry["ok"] = all(r["ok"] for r in entry["outputs"])
        if decode:
            progress(f"{p}: generating {decode} tokens with both models", step, steps)
            entry["decode"] = compare_generation(
                session(before.source(), p, threads=threads, provider_options=provider_options),
                session(after.source(), p, threads=threads, provider_options=provider_options),
                steps=decode, prompts=prompts, seed=seed, fp16=fp16 or low, folders=(_folder(before), _folder(after)))
            entry["ok"] = entry["ok"] and entry["decode"]["ok"]
        if latency and runs:
            progress(f"{p}: latency", step, steps)
            t0 = time.perf_counter()
            lat = measure_latency({"before": before.source(), "after": after.source()}, feeds, provider=p,
                                  runs=runs, warmup=warmup, threads=threads, budget_s=budget_s, gap_s=0.0,
                                  min_rounds=min(runs, 5), provider_options=provider_options,
                                  entry_inputs=model_feeds if edges else None,
                                  progress=lambda d, t, p=p, s=step: progress(f"{p}: latency {d}/{t}", s, steps))
            entry["latency"] = latency_entry(lat, warmup=warmup, threads=threads, budget_s=budget_s)
            entry["latency"]["seconds"] = round(time.perf_counter() - t0, 3)
            step += 1
        if not entry["ok"] and culprit:
            progress(f"{p}: looking for the first diverging value", step, steps)
            try:
                entry["culprit"] = find_culprit(before, after, feeds, p, low_precision=low, rtol=rtol, atol=atol)
            except Exception as exc:  # noqa: BLE001 - the verdict stands without it
                entry["culprit"] = {"message": f"could not run the models with their intermediate values exposed: "
                                               f"{io.first_line(exc, 300)}"}
        report["providers"][p] = entry
    if fp16 and outputs:  # the float16 model in float16 arithmetic: what onnxruntime's CPU provider does not do
        report["fp16"].update(_judge_fp16(before, after, outputs, model_feeds["after"], edges, progress))
    elif outputs and int8 is None and low and is_fp16(before.proto) and is_fp16(after.proto):
        # an optimized float16 model: both in float16 arithmetic (a rewrite's overflow shows there only)
        report["fp16_arithmetic"] = _judge_fp16(before, after, outputs, model_feeds, edges, progress, rtol, atol,
                                                pair=True)
    if "cpu" in outputs and len(outputs) > 1:
        report["cross_provider"] = {}
        for p in outputs:
            if p == "cpu":
                continue
            report["cross_provider"][f"cpu-vs-{p}"] = {
                label: compare_all(outputs["cpu"][label], outputs[p][label], rtol=rtol, atol=atol,
                                   low_precision=low or (fp16 and label == "after"))
                for label in ("before", "after")}
    report["ok"] = all(e["ok"] for e in report["providers"].values()) and \
        all((report.get(k) or {}).get("ok", True) for k in ("fp16", "fp16_arithmetic"))
    return report


def _judge_fp16(before: OrtModel, after: OrtModel, outputs: dict, feeds, edges, progress, rtol=None, atol=None,
                pair: bool = False) -> dict:
    """``fp16.judge``: the optimized model in float16 arithmetic (on CUDA where verified there, else
    the CPU) against the original's outputs on that provider; ``pair`` (two float16 models, ``feeds``
    both models' inputs by "before"/"after"): ``fp16.judge_pair``, both in float16 arithmetic."""
    import onnx

    from onnxopt.verify.fp16 import judge, judge_pair

    p = "cuda" if "cuda" in outputs else next(iter(outputs))
    progress("judging the float16 model in float16 arithmetic")
    load = lambda m: onnx.load(m.path) if m.external else m.proto  # noqa: E731
    back = (lambda got: layouts.outputs_back(edges, got)) if edges else None
    if pair:
        return judge_pair(load(before), load(after), feeds["before"], feeds["after"], p, back=back,
                                     rtol=rtol, atol=atol)
    return judge(outputs[p]["before"], load(after), feeds, p, back=back)


def _compare_int8(before, after, min_db: float) -> list[dict]:
    """compare_all's rows (outputs matched by name and position), each output found at its place
    judged by :func:`compare_int8` (SQNR)."""
    rows = compare_all(before, after, low_precision=True)
    for i, (name, value) in enumerate(before):
        if i < len(after) and after[i][0] == name:
            rows[i] = {"name": name, **compare_int8(value, after[i][1], min_db)}
    return rows


def _compare_fp16(before, after) -> list[dict]:
    """compare_all's rows, each output found at its place judged by :func:`compare_fp16`."""
    rows = compare_all(before, after, low_precision=True)
    for i, (name, value) in enumerate(before):
        if i < len(after) and after[i][0] == name:
            rows[i] = {"name": name, **compare_fp16(value, after[i][1], name)}
    return rows


def bisect_command(model, provider: str = "cpu", *, inputs: str | os.PathLike | None = None,
                   input_shapes: Mapping[str, Sequence[int]] | None = None,
                   int_ranges: Mapping[str, tuple[int, int]] | None = None, seed: int = 0, rtol: float | None = None,
                   atol: float | None = None, options: Sequence[str] | None = None) -> str:
    """The ``python -m onnxopt bisect`` command that replays a verification's settings on
    ``model`` (a path; ORIGINAL for a model in memory). ``options``: the command-line options that
    made the optimized model (--rules, --disable, ...); None when unknown, and the command says so."""
    words = ["python", "-m", "onnxopt", "bisect", str(model) if isinstance(model, (str, os.PathLike)) else "ORIGINAL"]
    if provider != "cpu":
        words += ["--provider", provider]
    if inputs is not None:
        words += ["--inputs", str(inputs)]
    words += [w for name, dims in (input_shapes or {}).items()
              for w in ("--input-shape", f"{name}={'x'.join(map(str, dims))}")]
    words += [w for name, (lo, hi) in (int_ranges or {}).items() for w in ("--int-range", f"{name}={lo}:{hi}")]
    words += ["--seed", str(seed)] if seed else []
    words += [w for flag, v in (("--rtol", rtol), ("--atol", atol)) if v is not None for w in (flag, repr(v))]
    text = shlex.join([*words, *(options or [])])
    if options is None:
        text += " (plus the --rules/--disable/--target options that made the optimized model)"
    return text
