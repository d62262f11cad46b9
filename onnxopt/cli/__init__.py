"""``python -m onnxopt`` / ``onnxopt``: thin wiring of the library for the shell.

    onnxopt MODEL -o OUT [--verify cpu,cuda]  optimize (and verify before writing)
    onnxopt verify ORIGINAL OPTIMIZED ...     compare two models on onnxruntime
    onnxopt bisect MODEL ...                  find the rewrite that breaks a model
    onnxopt quantize MODEL -o OUT --calib DATA  INT8 (QDQ) with calibration, for onnxruntime's CPU
    onnxopt diff BEFORE AFTER [--html OUT]    what changed, node by node (live in Netron, or a static page)
    onnxopt inspect MODEL (or onnxopt MODEL)  FLOPs, bytes, parameters and rooflines, per node (onnxopt.inspect.analysis)
    onnxopt --list-rules                      the rules and passes, by family

Reports go to stdout (tables and colour on a terminal, plain text in a pipe: ``onnxopt.reporting.console``),
errors and progress to stderr.

Exit codes: 0 success, 1 outputs differ beyond tolerance (verification), 2 bad input or usage
(one line on stderr, no traceback), 3 an internal error (a bug in onnxopt, a built-in rule's
included; one line too), 130 interrupted, 141 the output's reader went away (quietly).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import pkgutil
import shlex
import textwrap
import sys
import warnings
from pathlib import Path

from onnxopt.cli import config
from onnxopt.ir import evaluate
from onnxopt.ir import input_shapes
from onnxopt.ir import io
from onnxopt.library import registry
from onnxopt import __version__, targets, verify
from onnxopt.api import optimize
from onnxopt.verify.bisect import bisect
from onnxopt.reporting.console import Status, say, show
from onnxopt.errors import OnnxoptError, RuleBug
from onnxopt.reporting.text import Styled, format_bisect, format_optimize, format_rules, format_verification, summary_line
from onnxopt.verify import VerificationError

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        say(f"error: {message} (see {self.prog} --help)")
        self.exit(EXIT_BAD_INPUT)


_EXIT_CODES = ("exit codes: 0 ok, 1 outputs differ (verification), 2 bad input or usage, 3 internal error (a bug "
               "in onnxopt), 130 interrupted, 141 the output's reader went away.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="onnxopt",
        usage="onnxopt MODEL -o OUTPUT [options]\n       onnxopt verify ORIGINAL OPTIMIZED [options]\n"
              "       onnxopt bisect MODEL [options]\n       onnxopt quantize MODEL -o OUTPUT --calib DATA [options]\n"
              "       onnxopt diff BEFORE AFTER [--html OUT] [options]\n"
              "       onnxopt inspect MODEL [--input-shape NAME=DIMS] [--device NAME] [--json OUT] [--top N]\n"
              "       onnxopt --list-rules [--target TARGET] [--rules FILE]",
        description=textwrap.fill(
            "Rewrite an ONNX model with onnxopt's rules until nothing more applies, and print what changed. "
            "'onnxopt verify' compares two models on onnxruntime (outputs, kernels, latency; see 'onnxopt verify "
            "--help'); 'onnxopt bisect' finds the rewrite after which a model's outputs differ (see 'onnxopt "
            "bisect --help').", 78),
        epilog="examples:\n"
               "  onnxopt model.onnx -o model.opt.onnx\n"
               "  onnxopt model.onnx -o model.opt.onnx --verify cpu --json report.json\n"
               "  onnxopt model.onnx -o model.opt.onnx --verify cpu --report report.html\n"
               "  onnxopt verify model.onnx model.opt.onnx --input-shape input=1x3x224x224\n"
               "  onnxopt bisect model.onnx --rules my_rules.py\n"
               "  onnxopt diff model.onnx model.opt.onnx --html diff.html\n"
               "  onnxopt inspect model.onnx --input-shape input=1x3x224x224 --device h100-sxm\n"
               "  onnxopt --list-rules --target ort-cuda\n\n" + textwrap.fill(_EXIT_CODES, 78),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", nargs="?", metavar="MODEL", help="the ONNX model to optimize (never modified)")
    p.add_argument("-o", "--output", help="where to write the optimized model (written atomically)")
    p.add_argument("--list-rules", action="store_true",
                   help="list the rules by family (targets, exactness, what each does) and the graph passes, "
                        "and exit")
    _add_rule_args(p)
    ext = p.add_mutually_exclusive_group()
    ext.add_argument("--external-data", metavar="NAME", nargs="?", const=True,
                     help="save weights to an external data file (default name: OUTPUT.data)")
    ext.add_argument("--single-file", action="store_true", help="save weights inside the model file")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: after the rules, float32 weights and compute become float16 (precision-sensitive "
                        "ops stay float32, input and output types are kept); default fp32")
    p.add_argument("--verify", metavar="PROVIDERS",
                   help="before writing, verify the result against the input on onnxruntime (cpu, cuda or "
                        "cpu,cuda): on a difference, exit 1 and write nothing")
    _add_layout_args(p)
    _add_verify_args(p)
    _add_report_args(p, quiet="print nothing on success")
    p.add_argument("--diff", metavar="PAGE.html",
                   help="also write the static diff page (what each rule did, node by node; the live view: "
                        "onnxopt diff MODEL OUTPUT)")
    p.add_argument("--report", metavar="PAGE.html",
                   help="also write the report as one self-contained HTML page: the tables, where FLOPs, bytes and "
                        "(with --verify) measured latency go by op type, memory over time, the verification, a "
                        "link to --diff's page")
    _add_config_arg(p)
    p.add_argument("--version", action="version", version=f"onnxopt {__version__}")
    return p


class _Once(argparse.Action):
    """A flag that may be given once (a second -c would silently replace the first file)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) not in (None, argparse.SUPPRESS):
            parser.error(f"{option_string} given twice: give one file (its settings, then the flags)")
        setattr(namespace, self.dest, values)


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", metavar="FILE.toml", action=_Once,
                   help="settings from a TOML file (the README's 'Config file' lists its keys); flags given here "
                        "override it, relative paths in it are relative to its folder")


def _add_rule_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("rules")
    p.add_argument("--disable", metavar="RULE", action="append", default=[], help="leave a rule out (repeatable)")
    p.add_argument("--rules", metavar="FILE", action="append", default=[],
                   help="a Python file whose RULES are added to the built-in ones (repeatable)")
    p.add_argument("--no-builtin-rules", action="store_true", help="use only the rules given with --rules")
    p.add_argument("--builtin-rules", dest="no_builtin_rules", action="store_false", default=argparse.SUPPRESS,
                   help="the built-in rules too (the default; overrides a config file's no_builtin_rules)")
    p.add_argument("--target", choices=[*targets.TARGETS, *targets.ALIASES], metavar="TARGET",
                   help="where the model will run: portable (default: standard ONNX ops only), ort-cpu, ort-cuda "
                        "(onnxruntime's CPU or CUDA provider; cpu and cuda are aliases); only rules valid there run")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=False,
                   help="only rewrites that keep every output bit-identical on onnxruntime's CPU provider with its "
                        "default settings (rules declared exact; see --list-rules); --no-exact overrides a config "
                        "file's exact")
    p.add_argument("--max-rewrites", type=int, metavar="N", help="cap on the number of rewrites")
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="a rule that raises (a bug in it) stops the run with an error instead of being skipped "
                        "and reported (default: on when ONNXOPT_STRICT=1); --no-strict overrides a config file's "
                        "strict")
    p.add_argument("--fold-size-limit", type=int, metavar="BYTES", default=evaluate.DEFAULT_SIZE_LIMIT,
                   help="constant folding creates a larger tensor only in place of at least as many bytes of "
                        "constants that become unused (default 1 MiB)")


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("layout")
    p.add_argument("--input-layout", metavar="NAME=LAYOUT", action="append", default=[],
                   help="an input the model is to take channels-last, e.g. x=NHWC (or NHWC: every 4-D input); "
                        "a Transpose at the input gives the model its NCHW (repeatable)")
    p.add_argument("--output-layout", metavar="NAME=LAYOUT", action="append", default=[],
                   help="an output the model is to return channels-last, e.g. y=NHWC (repeatable)")
    p.add_argument("--input-preprocess", metavar="NAME=SPEC", action="append", default=[],
                   help="an input that becomes raw images, e.g. x=uint8,HWC,scale=1/255,mean=0.485,0.456,0.406,"
                        "std=0.229,0.224,0.225[,bgr]: the model casts, swaps channels and normalizes itself (folded "
                        "into the first Conv where it can be) (repeatable)")


def _add_report_args(p: argparse.ArgumentParser, quiet: str) -> None:
    p.add_argument("--json", metavar="REPORT", help="also write the report as JSON to this file")

    p.add_argument("-q", "--quiet", action="store_true", help=f"{quiet}; no progress on stderr")
    p.add_argument("--no-quiet", dest="quiet", action="store_false", default=argparse.SUPPRESS,
                   help="print as usual (overrides a config file's report.quiet)")


def _add_input_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inputs and tolerances")
    g.add_argument("--inputs", metavar="FILE.npz", help="input arrays by name (others are generated)")
    g.add_argument("--input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="an input's shape, NAME=D1,D2,... or NAME=1x3x224x224 (repeatable): optimize fixes the "
                        "model's input to it (a D may be a symbol name, which keeps or renames that dimension's "
                        "symbol) and --verify runs at it; verify and bisect generate the input at it (numbers only)")
    g.add_argument("--int-range", metavar="NAME=LOW:HIGH", action="append", default=[],
                   help="inclusive range of a generated integer input, e.g. input_ids=0:30521 (repeatable; "
                        "default: the rows of the Gather table it indexes, 0:1 for names with 'mask', else 0:9)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    g.add_argument("--rtol", type=float, help="relative tolerance for every output (default per dtype: "
                                              "float32 1e-4, float16 1e-2, ...)")
    g.add_argument("--atol", type=float, help="absolute tolerance for every output (default per dtype: "
                                              "float32 1e-5, float16 1e-3, ...)")


def _add_verify_args(p: argparse.ArgumentParser) -> None:
    _add_input_args(p)
    g = p.add_argument_group("measurement")
    g.add_argument("--runs", type=int, default=verify.LATENCY_RUNS, metavar="N",
                   help="at most N interleaved timing rounds (each runs both models) per provider after the warm-up "
                        f"(default {verify.LATENCY_RUNS}; 0: no latency)")
    g.add_argument("--latency-budget", type=float, default=verify.LATENCY_BUDGET_S, metavar="SECONDS",
                   help="at most this many seconds of timing rounds per provider (default "
                        f"{verify.LATENCY_BUDGET_S:g}); the ratio's 90%% interval narrows with more rounds")
    g.add_argument("--warmup", type=int, default=5, metavar="N", help="warm-up runs per session (default 5)")
    g.add_argument("--threads", type=int, default=verify.LATENCY_THREADS, metavar="N",
                   help=f"onnxruntime intra-op threads of the sessions (default {verify.LATENCY_THREADS}: timings "
                        "that repeat; 0: onnxruntime's choice)")
    g.add_argument("--provider-option", action="append", default=[], metavar="PROVIDER:NAME=VALUE",
                   help="an execution provider option for both models' sessions, e.g. cuda:prefer_nhwc=1 or "
                        "cuda:enable_cuda_graph=1 (repeatable; the advice of --target ort-cuda names them)")


def _status(args) -> Status:
    """Progress on stderr: on a terminal, never with -q."""
    return Status(enabled=False if args.quiet else None)


def _verify_options(args, progress: Status) -> dict:
    return {"inputs": args.inputs, "int_ranges": verify.parse_int_ranges(args.int_range), "seed": args.seed,
            "rtol": args.rtol, "atol": args.atol, "runs": args.runs, "warmup": args.warmup, "threads": args.threads,
            "budget_s": args.latency_budget,
            "progress": progress, **({"provider_options": verify.parse_provider_options(args.provider_option)}
                                     if args.provider_option else {})}


def _verify_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxopt verify",
                description="Run onnxruntime on an original and an optimized model and compare outputs, kernel "
                            "counts and latency per execution provider.",
                epilog="exit codes: 0 outputs agree, 1 they differ beyond tolerance (or the optimized model does "
                       "not run), 2 bad input or usage, 3 internal error.")
    p.add_argument("original", help="the model before optimization")
    p.add_argument("optimized", help="the model after optimization")
    p.add_argument("--providers", default="cpu", help="cpu, cuda or cpu,cuda (default cpu)")
    p.add_argument("--min-sqnr", type=float, default=None, metavar="DB",
                   help="a quantized OPTIMIZED against a float ORIGINAL: each float output passes when its SQNR is "
                        f"at least DB (default {verify.INT8_MIN_SQNR_DB:g}; --rtol/--atol instead judge it "
                        "elementwise); the integer-kernel coverage table is shown")
    _add_verify_args(p)
    _add_report_args(p, quiet="print only the verdict line")
    return p


def _bisect_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxopt bisect",
                description="Binary search over the rewrites onnxopt makes to MODEL for the first one after which "
                            "its outputs differ on onnxruntime; names the rule and the nodes.",
                epilog="exit codes: 0 the fully optimized model verifies (nothing to bisect), 1 a culprit was "
                       "found, 2 bad input or usage, 3 internal error.")
    p.add_argument("model", help="the original model")
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    _add_rule_args(p)
    p.add_argument("--fix-input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="an input shape the optimization fixed (optimize's --input-shape, the same grammar): MODEL's "
                        "input is fixed to it before the rewrites are replayed (repeatable)")
    _add_input_args(p)
    _add_report_args(p, quiet="print only the culprit line")
    return p


def _quantize_parser() -> argparse.ArgumentParser:
    from onnxopt.quantize.api import DEFAULT_FIDELITY_DB, DEFAULT_METHOD
    from onnxopt.quantize.calibrate import METHODS

    p = _Parser(prog="onnxopt quantize",
                description="Quantize a float model to INT8 (QDQ) for onnxruntime's CPU provider: cleanup, "
                            "calibration, QDQ placement by rules, fidelity fallback to float, integer-kernel "
                            "coverage, and (by default) a check against the cost table shipped in the package that keeps "
                            "the float model when int8 is not estimated at least 3% faster (--keep-float measure "
                            "times both on this machine instead).",
                epilog="calibration data (--calib): a folder of .npy/.npz files (one feed each; .npz keys are input "
                       "names), or one .npz whose arrays hold the samples along their first axis.\n"
                       "exit codes: 0 written (int8, or the float model where --keep-float auto kept it), 2 bad "
                       "input, bad calibration data or usage, 3 internal error.")
    p.add_argument("input", metavar="MODEL", help="the float ONNX model (never modified)")
    p.add_argument("-o", "--output", required=True, help="where to write the quantized model (atomically)")
    p.add_argument("--calib", metavar="DATA", help="calibration data (see below; required, here or as "
                                                   "calibration in the config file's [quantize])")
    p.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help=f"calibration method (default {DEFAULT_METHOD})")
    pc = p.add_mutually_exclusive_group()
    pc.add_argument("--per-channel", dest="per_channel", action="store_true", default=True,
                    help="weights per output channel where the op allows (default)")
    pc.add_argument("--per-tensor", dest="per_channel", action="store_false", help="weights per tensor")
    p.add_argument("--target", default="ort-cpu", metavar="TARGET",
                   help="ort-cpu (default) or portable; ort-cuda is refused (its QDQ kernels run in float)")
    p.add_argument("--exclude", metavar="NAME_OR_OP", nargs="+", action="extend", default=[],
                   help="node names or op types to leave in float")
    p.add_argument("--fidelity", type=float, default=DEFAULT_FIDELITY_DB, metavar="DB",
                   help=f"minimum output SQNR (dB) against the float model on held-out calibration samples "
                        f"(default {DEFAULT_FIDELITY_DB:g}); the layers that hurt most fall back to float until met")
    p.add_argument("--no-fidelity", dest="fidelity", action="store_const", const=None,
                   help="no fidelity target (no fallback)")
    p.add_argument("--keep-float", choices=["auto", "measure", "never"], default="auto",
                   help="auto (default): keep the float model unless the shipped cost table estimates int8 at least "
                        "3%% faster (no timing: the same bytes run to run); measure: time both models on this "
                        "machine instead (machine-dependent; --threads); never: always int8")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="onnxruntime intra-op threads of --keep-float measure's timing (default 1; 0: onnxruntime's)")
    p.add_argument("--latency-budget", type=float, default=10.0, metavar="SECONDS",
                   help="seconds of --keep-float measure's timing rounds at most (default 10)")
    p.add_argument("--reduce-range", action="store_true", default=None,
                   help="7-bit weights, for x86 CPUs without VNNI (default off)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="calibration processes (results bit-identical for any N)")
    p.add_argument("--held-out", type=int, default=None, metavar="N",
                   help="calibration samples kept to measure fidelity (default a quarter, at least 8 where half remain, at most 64)")
    p.add_argument("--percentile", type=float, default=None, metavar="P",
                   help="--method percentile: the percentile kept (default 99.999)")
    p.add_argument("--input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="fix an input's shape first (as onnxopt MODEL --input-shape)")
    p.add_argument("--strict", action="store_true", default=None, help="a rule bug stops the run")
    _add_report_args(p, quiet="print nothing on success")
    _add_config_arg(p)
    return p


def quantize_main(argv: list[str]) -> int:
    args = _quantize_parser().parse_args(argv)

    def run():
        nonlocal args
        args = config.merge(args, argv, _quantize_parser, config.QUANTIZE)
        return config.with_locus(args, quantize_run)

    def quantize_run():
        if args.calib is None:
            return _fail("no calibration data: add --calib DATA (or calibration in the config file's [quantize])")
        from onnxopt.quantize.api import quantize
        from onnxopt.reporting.text import format_quantize

        method_options = {} if args.percentile is None else {"percentile": args.percentile}
        with _outputs(args, args.input, data_files=False) as outputs, _status(args) as progress:
            outputs.protect(args.calib, f"the calibration data {args.calib}")
            if os.path.isdir(args.calib):  # (its files: an output may not replace one)
                for entry in sorted(os.scandir(args.calib), key=lambda e: e.name):
                    if entry.is_file() and entry.name.endswith((".npy", ".npz")):
                        outputs.protect(entry.path, f"calibration data file {entry.path}")
            _, report = quantize(
                args.input, args.calib, output=args.output, method=args.method, per_channel=args.per_channel,
                target=args.target, exclude=args.exclude, fidelity=args.fidelity, keep_float=args.keep_float,
                reduce_range=args.reduce_range, workers=args.workers, held_out=args.held_out,
                input_shapes=input_shapes.parse(args.input_shape), return_report=True, outputs=outputs,
                strict=args.strict, progress=progress, method_options=method_options, threads=args.threads,
                latency_budget=args.latency_budget)
            _stage_json(outputs, args.json, {"input": args.input, "output": args.output, **report.as_dict(),
                                             **config.report_entry(args)})
        if not args.quiet:
            show(format_quantize(report, args.input, args.output))
        return EXIT_OK

    return _errors(run)


def _errors(fn):
    """Run a face; one-line errors and exit codes for everything it raises."""
    try:
        return fn()
    except VerificationError as exc:
        say(str(exc))
        return EXIT_DIFFERS
    except RuleBug as exc:
        if exc.rule in {rule.name for rule in registry.builtin_rules()}:  # our bug, not the user's rules file
            say(f"internal error: {exc} (please report it)")
            return EXIT_INTERNAL
        return _fail(str(exc))
    except OnnxoptError as exc:
        return _fail(str(exc))
    except BrokenPipeError:
        raise  # the reader went away (| head): main ends quietly
    except (OSError, MemoryError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug of ours: say so in one line, and not with 1 ("outputs differ")
        say(f"internal error: {io.first_line(exc, 300, typed=True)} (please report it)")
        return EXIT_INTERNAL


def _inspect_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxopt inspect",
                description="What a model computes, without running it or reading its weights: inputs and "
                            "outputs, opsets, op counts, parameters by dtype, FLOPs (2 per multiply-accumulate) "
                            "and bytes per node, and whether each node is compute- or memory-bound on a device's "
                            "roofline. 'onnxopt MODEL' (without -o) does the same.",
                epilog="devices: local (this machine's CPU, measured once and cached; the default) or a name of "
                       "onnxopt/data/devices.json (h100-sxm, h200-sxm, epyc-9654, xeon-8480plus).\n"
                       "exit codes: 0 ok, 2 bad input or usage, 3 internal error.")
    p.add_argument("input", metavar="MODEL", help="the ONNX model (its weights are not read)")
    p.add_argument("--input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="fix an input's shape (as onnxopt MODEL --input-shape): symbolic dimensions not given "
                        "stay symbols (figures at 1, and the polynomials in the JSON) (repeatable)")
    p.add_argument("--device", metavar="NAME", help="the roofline to judge nodes against (default: local)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="nodes shown by FLOPs and by bytes (default 10)")
    p.add_argument("--json", metavar="OUT", help="also write the whole analysis (every node) as JSON")
    p.add_argument("--html", metavar="OUT.html", help="also write it as one self-contained page: tables, where FLOPs "
                                                     "and bytes go by op type, top nodes, memory over time")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing (with --json or --html)")
    return p


def _peak_memory(model: str, shapes) -> dict | None:
    """Peak activation memory by liveness (onnxopt.transforms.memory), or why it is not there. Inputs left with
    symbolic dimensions are taken at the shapes the verifier runs them at (recorded as ``at``), as
    optimize's report and its page take them: sized at none, most values were of unknown size."""
    try:
        from onnxopt.transforms.memory import peak
    except ImportError:
        return {"unavailable": "onnxopt.transforms.memory is not in this onnxopt"}
    import onnx

    graph = io.to_ir(onnx.load(model, load_external_data=False))  # (the graph only: no weights read)
    if shapes:
        input_shapes.fix(graph, input_shapes.normalize(shapes))
    at = input_shapes.symbolic_run_shapes(graph)
    result = peak(model, input_shapes={**input_shapes.normalize(shapes), **at} or None)
    return {**result, "at": at} if at else result


def inspect_main(argv: list[str]) -> int:
    args = _inspect_parser().parse_args(argv)

    def run():
        from onnxopt.inspect import analysis

        analysis.check_top(args.top)
        with _outputs(args, args.input) as outputs:  # (--json is never the model or one of its data files)
            if args.html:
                outputs.claim(args.html, "--html")
            shapes = input_shapes.parse(args.input_shape)
            report = analysis.analyze(args.input, input_shapes=shapes, device=args.device)
            memory = _peak_memory(args.input, shapes)
            if memory and "unavailable" not in memory:
                report["memory"] = {k: v for k, v in memory.items() if k != "curve"}
            _stage_json(outputs, args.json, {"model": args.input, **report})
            if args.html:
                from onnxopt.reporting.html import render_inspect

                Path(outputs.stage(args.html)).write_text(render_inspect(args.input, report, memory, args.top),
                                                          encoding="utf-8")
        if not args.quiet:
            show(analysis.format_inspect(report, args.input, args.top))
        return EXIT_OK

    return _errors(run)


def _inspects(argv: list[str]) -> bool:
    """``onnxopt MODEL [inspect options]``: a model file and no option that only optimizing takes."""
    if not argv or argv[0].startswith("-") or not os.path.isfile(argv[0]):
        return False
    known = {o for a in _inspect_parser()._actions for o in a.option_strings}

    def inspects(word: str) -> bool:  # (an unambiguous prefix too, as argparse takes one)
        flag = word.split("=", 1)[0]
        return flag in known or (flag.startswith("--") and len([o for o in known if o.startswith(flag)]) == 1)

    # (a negative number is a value, as argparse takes it: --top -1 is inspect's error, not 'unrecognized')
    return all(not w.startswith("-") or w[1:2].isdigit() or inspects(w) for w in argv[1:])


def _verify_coverage(path: str) -> dict | None:
    """Integer-kernel coverage of a QDQ model (None for a model without Q/DQ); a model onnxruntime
    cannot optimize gives {"error": ...}."""
    import onnx

    from onnxopt.quantize.coverage import integer_coverage, is_qdq_model

    if not is_qdq_model(onnx.load(path, load_external_data=False)):
        return None
    try:
        return integer_coverage(path).as_dict()
    except OnnxoptError as exc:
        return {"error": str(exc)}


def _diff_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxopt diff",
                description="What an optimizer did, node by node: the mapping between BEFORE and AFTER (from "
                            "onnxopt's provenance, or an alignment by names, weights and structure for models "
                            "another tool optimized), shown live with both models side by side in Netron "
                            "(the default; needs pip install \"onnxopt[diff]\"), or as a static page (--html).",
                epilog="exit codes: 0 ok, 2 bad input or usage, 3 internal error.")
    p.add_argument("before", help="the model before optimization")
    p.add_argument("after", help="the model after optimization")
    p.add_argument("--html", metavar="OUT", help="write the static page (one offline file) and serve nothing")
    p.add_argument("--json", metavar="MAP", help="write the mapping and summary as JSON")
    p.add_argument("--model-explorer", metavar="MAP", dest="me_json",
                   help="write the mapping as Model Explorer's node-mapping JSON (its split view's "
                        "'Upload mapping from computer')")
    p.add_argument("--verify-report", metavar="JSON",
                   help="a report of onnxopt verify --json (or onnxopt MODEL --verify ... --json): kernels "
                        "and latency in the summary")
    p.add_argument("--port", type=int, help="the live view's port (default: the first free one from 8090)")
    p.add_argument("--no-browser", action="store_true", help="serve the live view without opening a browser")
    p.add_argument("-q", "--quiet", action="store_true", help="print only where things went")
    return p


def diff_main(argv: list[str]) -> int:
    args = _diff_parser().parse_args(argv)

    def run():
        from onnxopt import diff as diffs

        for path in (args.before, args.after):
            if not os.path.isfile(path):
                return _fail(f"{path}: no such model file")
        live = None
        if not args.html:
            try:
                from onnxopt.diff import live  # (the live view: onnxopt.diff.live)
            except ImportError:
                live = None
            if live is not None and live.netron_dir() is None:
                live = None
        page = args.html
        if not page and live is None:  # no live view here: the static page, beside the AFTER model
            page = str(Path(args.after).with_suffix("")) + ".diff.html"
        with _outputs(args, args.before, args.after) as outputs:  # (claims --json; written atomically)
            if args.verify_report:
                outputs.protect(args.verify_report, f"the verify report {args.verify_report}")
            staged = {}
            for path, what in ((page, "--html"), (args.me_json, "--model-explorer")):
                if path:
                    outputs.claim(path, what)
            for path in (page, args.json, args.me_json):
                if path:
                    staged[path] = str(outputs.stage(path))
            m, summ = diffs.run(args.before, args.after, html_out=staged.get(page), json_out=staged.get(args.json),
                                me_out=staged.get(args.me_json), verify_report=args.verify_report,
                                names=(args.before, args.after))
        c = summ["counts"]
        if not args.quiet:
            show(f"{summ['nodes_before']} -> {summ['nodes_after']} nodes ({m['method']}): {c['created']} created "
                 f"({c['fused']} fused), {c['removed']} removed, {c['changed']} changed, {c['kept']} kept; rules: "
                 + (", ".join(f"{r} x{n}" for r, n in summ["rules"].items()) or "none recorded"))
        for path, what in ((page, "static page"), (args.json, "mapping"), (args.me_json, "Model Explorer mapping")):
            if path:
                show(f"{what}: {path}")
        if live is None:
            if not args.html:
                show("live view: not available here (it needs onnxopt.diff.live and Netron: "
                     "pip install \"onnxopt[diff]\"); open the static page above")
            return EXIT_OK
        return live.run(args.before, args.after, diffs.live_mapping(m, summ), port=args.port,
                        open_browser=not args.no_browser, echo=show)

    return _errors(run)


def verify_main(argv: list[str]) -> int:
    args = _verify_parser().parse_args(argv)

    def run():
        with _outputs(args, args.original, args.optimized) as outputs, _status(args) as progress:
            report = verify.verify(args.original, args.optimized, providers=args.providers,
                                   input_shapes=verify.parse_input_shapes(args.input_shape),
                                   min_sqnr=args.min_sqnr, **_verify_options(args, progress))
            coverage = _verify_coverage(args.optimized)
            if coverage is not None:
                report["coverage"] = coverage
            _stage_json(outputs, args.json, report)
        if args.quiet:
            show(Styled("verdict: " + ("outputs agree" if report["ok"] else summary_line(report)),
                        "bold green" if report["ok"] else "bold red"))
        else:
            show(format_verification(report))
        return EXIT_OK if report["ok"] else EXIT_DIFFERS

    return _errors(run)


def bisect_main(argv: list[str]) -> int:
    args = _bisect_parser().parse_args(argv)

    def run():
        base, extra = _rule_sets(args)
        with _outputs(args, args.model) as outputs, _status(args) as progress:
            report = bisect(
                args.model, rules=base, extra_rules=extra, disable=args.disable,
                target=args.target, provider=args.provider, inputs=args.inputs,
                input_shapes=verify.parse_input_shapes(args.input_shape),
                int_ranges=verify.parse_int_ranges(args.int_range), seed=args.seed, rtol=args.rtol, atol=args.atol,
                optimize_options={"max_rewrites": args.max_rewrites, "fold_size_limit": args.fold_size_limit,
                                  "strict": args.strict, "exact": args.exact,
                                  "input_shapes": input_shapes.parse(args.fix_input_shape, flag="--fix-input-shape")},
                progress=progress)
            _stage_json(outputs, args.json, report)
        text = format_bisect(report)
        show(text.blocks[-1] if args.quiet else text)
        return EXIT_OK if report["ok"] else EXIT_DIFFERS

    return _errors(run)


def _outputs(args, *inputs: str, data_files: bool = True) -> io.Outputs:
    """The command's outputs: ``--json`` claimed at once, before any work; what it reads (the
    models and their data files, rules files, the inputs file) protected (see ``onnxopt.ir.io.Outputs``).
    ``data_files=False``: the models' data files are protected later, when they are loaded
    (``optimize`` does so before writing anything), so they are not parsed twice."""
    outputs = io.Outputs()
    for path in inputs:
        for read in io.files_read(path) if data_files else [Path(path)]:
            outputs.protect(read, f"the input {path}" if read == Path(path) else f"a data file of the input {path}")
    for path in getattr(args, "rules", []):
        outputs.protect(path, f"the rules file {path}")
    if getattr(args, "inputs", None):
        outputs.protect(args.inputs, f"the inputs file {args.inputs}")
    if getattr(args, "config", None):
        outputs.protect(args.config, f"the config file {args.config}")
    if getattr(args, "json", None):
        outputs.claim(args.json, "--json")
    return outputs


def _stage_json(outputs: io.Outputs, path: str | None, data: dict) -> None:
    """Write the report (strict JSON) to its staged file; it is put in place with the command's
    other outputs."""
    if not path:
        return
    with open(outputs.stage(path), "w") as f:
        json.dump(_finite(data), f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")


def _finite(data):
    """The report with non-finite floats as strings ("nan", "inf"): strict JSON for any reader."""
    if isinstance(data, float):
        return data if data == data and abs(data) != float("inf") else str(data)
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _fail(message: str) -> int:
    say(f"error: {message}")
    return EXIT_BAD_INPUT


EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # as a shell reports a command whose reader went away (128 + SIGPIPE)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with warnings.catch_warnings():
            # numpy's RuntimeWarnings (overflow, invalid value) come from comparing or folding
            # non-finite numbers, which the reports state themselves; -q silences everything.
            warnings.filterwarnings("ignore", category=RuntimeWarning)
            if "-q" in argv or "--quiet" in argv:
                warnings.simplefilter("ignore")
            return _main(argv)
    except KeyboardInterrupt:  # staged outputs are already removed (onnxopt.ir.io.Outputs)
        say("interrupted", "")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout's reader stopped reading (| head): end quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the final flush cannot fail)
        return EXIT_BROKEN_PIPE


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    if argv and argv[0] == "bisect":
        return bisect_main(argv[1:])
    if argv and argv[0] == "quantize":
        return quantize_main(argv[1:])
    if argv and argv[0] == "diff":
        return diff_main(argv[1:])
    if argv and argv[0] == "inspect":
        return inspect_main(argv[1:])
    if _inspects(argv):
        return inspect_main(argv)
    if argv and not argv[0].startswith("-") and not os.path.exists(argv[0]):
        close = difflib.get_close_matches(argv[0], ["verify", "bisect", "quantize", "diff", "inspect"], n=1, cutoff=0.7)
        if close:  # (a model path would exist, or have a suffix)
            return _fail(f"no model or command {argv[0]!r}: did you mean 'onnxopt {close[0]}'?")
    parser = _parser()
    args = parser.parse_args(argv)  # usage errors exit 2 with a one-line message
    def run():
        merged = config.merge(args, argv, _parser)
        return config.with_locus(merged, lambda: _optimize_main(merged))

    return _errors(run)


def _rule_sets(args, files: dict | None = None) -> tuple[list | None, list]:
    """(base rules: None for the built-in library, extra rules from --rules files); ``files``
    gets each file's rules by path."""
    extra = []
    for path in args.rules:
        rules = registry.load_rules_file(path)
        extra.extend(rules)
        if files is not None:
            files[path] = rules
    return ([] if args.no_builtin_rules else None), extra


def _families(files: dict) -> dict[int, str]:
    """``id(rule)`` -> where the rule comes from: its family file in rules/, or its --rules file."""
    import onnxopt.rules as library

    found = {}
    for info in pkgutil.iter_modules(library.__path__):
        for rule in getattr(importlib.import_module(f"{library.__name__}.{info.name}"), "RULES", ()):
            found[id(rule)] = f"{info.name} (rules/{info.name}.py)"
    found.update((id(rule), path) for path, rules in files.items() for rule in rules)
    return found


def _total_bytes(path: str) -> int | None:
    """The bytes of a model file and the data files it names; a file over 64 MiB holds its
    weights itself, so its data files are not looked for (that would parse it again)."""
    try:
        size = os.path.getsize(path)
        files = io.files_read(path)[1:] if size < 64 << 20 else []
        return size + sum(os.path.getsize(f) for f in files)
    except OSError:
        return None


def _rule_words(args) -> list[str]:
    """The options that decide the rewrites, as words for the bisect command a failed --verify shows."""
    pairs = [("--rules", f) for f in args.rules] + [("--disable", d) for d in args.disable]
    pairs += [("--fix-input-shape", shape) for shape in args.input_shape]
    size = args.fold_size_limit if args.fold_size_limit != evaluate.DEFAULT_SIZE_LIMIT else None
    pairs += [(flag, str(v)) for flag, v in (("--target", args.target), ("--max-rewrites", args.max_rewrites),
                                             ("--fold-size-limit", size)) if v is not None]
    flags = ["--no-builtin-rules"] * args.no_builtin_rules + ["--exact"] * args.exact
    return [w for pair in pairs for w in pair] + flags


_OTHER_COMMANDS = ("other commands: onnxopt verify ORIGINAL OPTIMIZED, onnxopt bisect MODEL, "
                   "onnxopt quantize MODEL -o OUT --calib DATA, onnxopt diff BEFORE AFTER, onnxopt --list-rules")


def _write_diff(before: str, after: str, page: str, verification: dict | None) -> None:
    """The static diff page between the input and the optimized model (both on disk now), atomically."""
    from onnxopt import diff as diffs

    with io.Outputs() as outputs:
        for path in (before, after):
            for read in io.files_read(path):
                outputs.protect(read)
        outputs.claim(page, "--diff")
        diffs.run(before, after, html_out=str(outputs.stage(page)), verify_report=verification, names=(before, after))


def _write_report(args, report) -> None:
    """The HTML report page (``onnxopt.reporting.html``), with both models on disk, atomically."""
    from onnxopt.reporting import html as html_report

    with io.Outputs() as outputs, _status(args) as progress:
        for path in (args.input, args.output):
            for read in io.files_read(path):
                outputs.protect(read)
        outputs.claim(args.report, "--report")
        progress("writing the report page")
        echo = config.report_entry(args).get("config")  # (-c FILE: the settings the run used, on the page)
        settings = {"file": echo["file"], **echo["settings"]} if echo else None
        data = html_report.build(args.input, args.output, report, page=args.report, diff_page=args.diff,
                                 verify_options=_verify_options(args, progress), profile_runs=min(args.runs, 10),
                                 config=settings)
        Path(outputs.stage(args.report)).write_text(html_report.render(data), encoding="utf-8")


def _optimize_main(args) -> int:
    files: dict = {}
    base, extra = _rule_sets(args, files)
    if args.list_rules:
        skipped: list[dict] = []
        show(format_rules(*registry.resolve(base, extra, args.disable, args.target, exact=args.exact, skipped=skipped),
                          _families(files), targets.normalize(args.target), skipped))
        return EXIT_OK
    if not args.input:
        return _fail(f"no model given: onnxopt MODEL -o OUTPUT optimizes one; {_OTHER_COMMANDS} (see --help)")
    if not args.output:
        suggested = Path(args.input).with_name(Path(args.input).name.removesuffix(".onnx") + ".opt.onnx")
        return _fail(f"no output given: add -o OUTPUT to write the optimized model "
                     f"({shlex.join(['onnxopt', args.input, '-o', str(suggested)])}; the input is never "
                     f"overwritten); {_OTHER_COMMANDS}")
    external = False if args.single_file else args.external_data
    if args.provider_option:  # (checked whether or not it is used)
        verify.parse_provider_options(args.provider_option)
        if args.verify is None:
            return _fail("--provider-option sets the sessions of --verify: add --verify PROVIDERS (e.g. --verify cuda)")
    with _outputs(args, args.input, data_files=False) as outputs, _status(args) as progress:
        if args.diff:  # claimed now (a clash is an error before any work), written after the model
            outputs.claim(args.diff, "--diff")
        if args.report:  # likewise
            outputs.claim(args.report, "--report")
        verify_args = {}
        if args.verify is not None:
            verify_args = {"verify": args.verify,
                           "verify_options": {**_verify_options(args, progress), "bisect_options": _rule_words(args)}}
        try:
            _, report = optimize(
                args.input, rules=base, extra_rules=extra, disable=args.disable, target=args.target,
                output=args.output, external_data=external, max_rewrites=args.max_rewrites, return_report=True,
                strict=args.strict, input_shapes=input_shapes.parse(args.input_shape), exact=args.exact,
                fold_size_limit=args.fold_size_limit, outputs=outputs, progress=progress, precision=args.precision,
                input_layout=args.input_layout, output_layout=args.output_layout,
                input_preprocess=args.input_preprocess, **verify_args,
            )
        except VerificationError as exc:  # the evidence (and its JSON), then the one-line verdict (exit 1)
            _stage_json(outputs, args.json, {"input": args.input, "output": None, "verification": exc.report,
                                             **config.report_entry(args)})
            outputs.commit()  # the report only: no model was staged
            progress.close()
            if not args.quiet and exc.report is not None:
                show(format_verification(exc.report))
            raise
        _stage_json(outputs, args.json, {"input": args.input, "output": args.output, **report.as_dict(),
                                         **config.report_entry(args)})
    if args.diff:
        _write_diff(args.input, args.output, args.diff, report.verification)
    if args.report:
        _write_report(args, report)
    if not args.quiet:
        show(format_optimize(report, args.input, args.output, (_total_bytes(args.input), _total_bytes(args.output))))
        if report.layout:
            from onnxopt.transforms.edges import summary

            show("\n".join(f"layout: {line}" for line in summary(report.layout)))
        if report.verification is not None:
            show("")
            show(format_verification(report.verification))
    return EXIT_OK
