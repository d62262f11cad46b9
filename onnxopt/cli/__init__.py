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
from onnxopt import __version__, options, targets, verify
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
    flags = _Flags(p, options.OPTIMIZE)
    flags.add(*_RULE_FLAGS, "external_data", "precision", "providers", "input_layout", "output_layout",
              "input_preprocess", *_INPUT_FLAGS, *_MEASURE_FLAGS, "json", "quiet", "diff", "html")
    _add_config_arg(p)
    p.add_argument("--version", action="version", version=f"onnxopt {__version__}")
    flags.add_rest()
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


_RULE_FLAGS = ("disable", "extra_rules", "rules", "target", "exact", "max_rewrites", "strict", "fold_size_limit")
_INPUT_FLAGS = ("inputs", "input_shapes", "int_ranges", "seed", "rtol", "atol")
_MEASURE_FLAGS = ("runs", "latency_budget", "warmup", "threads", "provider_options")


class _Flags:
    """A command's flags, from the options' declarations (``onnxopt.options``): ``add`` puts the
    named ones in the order the command shows them (in their argparse group, made on first use),
    ``add_rest`` every other option the command takes (a new option needs no edit here)."""

    def __init__(self, parser: argparse.ArgumentParser, command: str):
        self.parser, self.command = parser, command
        self.options = dict(options.flag_options(command))
        self.groups: dict[str, argparse._ArgumentGroup] = {}
        self.added: set[str] = set()

    def add(self, *names: str) -> None:
        for name in names:
            opt = self.options[name]
            where = self.parser
            if opt.group is not None:
                if opt.group not in self.groups:
                    self.groups[opt.group] = self.parser.add_argument_group(opt.group)
                where = self.groups[opt.group]
            if opt.exclusive:
                where = where.add_mutually_exclusive_group()
            kwargs = {k: (v() if k == "choices" and callable(v) else v) for k, v in opt.argparse.items()}
            where.add_argument(*opt.flags, help=opt.help_for(self.command), **kwargs)
            for flags, more in opt.also:
                where.add_argument(*flags, **more)
            self.added.add(name)

    def add_rest(self) -> None:
        self.add(*[name for name in self.options if name not in self.added])


def _status(args) -> Status:
    """Progress on stderr: on a terminal, never with -q."""
    return Status(enabled=False if args.quiet else None)


def _verify_options(args, progress: Status, command: str = options.VERIFY) -> dict:
    """The verifier's settings the flags give (``onnxopt.options.VerifyOptions``), with ``progress``."""
    return {**(options.VerifyOptions(**_values(args, options.VerifyOptions, command)).verifier_kwargs() or {}),
            "progress": progress}


def _values(args, cls, command: str) -> dict:
    """The fields of ``cls`` that ``command``'s flags set, from the parsed ``args``."""
    return {f.name: opt.value_from(args) for f, opt in options.described(cls) if opt.flags and command in opt.commands}


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
    flags = _Flags(p, options.VERIFY)
    flags.add(*_INPUT_FLAGS, *_MEASURE_FLAGS, "json", "quiet")
    flags.add_rest()
    return p


def _bisect_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxopt bisect",
                description="Binary search over the rewrites onnxopt makes to MODEL for the first one after which "
                            "its outputs differ on onnxruntime; names the rule and the nodes.",
                epilog="exit codes: 0 the fully optimized model verifies (nothing to bisect), 1 a culprit was "
                       "found, 2 bad input or usage, 3 internal error.")
    p.add_argument("model", help="the original model")
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    flags = _Flags(p, options.BISECT)
    flags.add(*_RULE_FLAGS)
    p.add_argument("--fix-input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="an input shape the optimization fixed (optimize's --input-shape, the same grammar): MODEL's "
                        "input is fixed to it before the rewrites are replayed (repeatable)")
    flags.add(*_INPUT_FLAGS, "json", "quiet")
    flags.add_rest()
    return p


def _quantize_parser() -> argparse.ArgumentParser:
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
    flags = _Flags(p, options.QUANTIZE)
    flags.add("calibration", "method", "per_channel", "target", "exclude", "fidelity", "keep_float", "threads",
              "latency_budget", "reduce_range", "workers", "held_out", "percentile", "input_shapes", "strict", "json",
              "quiet")
    _add_config_arg(p)
    flags.add_rest()
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

        with _outputs(args, args.input, data_files=False) as outputs, _status(args) as progress:
            outputs.protect(args.calib, f"the calibration data {args.calib}")
            if os.path.isdir(args.calib):  # (its files: an output may not replace one)
                for entry in sorted(os.scandir(args.calib), key=lambda e: e.name):
                    if entry.is_file() and entry.name.endswith((".npy", ".npz")):
                        outputs.protect(entry.path, f"calibration data file {entry.path}")
            opts = options.QuantizeOptions.from_args(args, return_report=True, outputs=outputs, progress=progress)
            _, report = quantize(args.input, args.calib, args.output, options=opts)
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
        # the options the flags set (onnxopt.options); the diff page is written here, after the model
        given = {"rules": base, "extra_rules": extra, "outputs": outputs, "progress": progress, "return_report": True,
                 "diff": None}
        if args.verify is not None:
            given["verify_options"] = {"progress": progress, "bisect_options": _rule_words(args)}
        without = () if args.verify is not None else ("verify",)  # (its flags are read only with --verify)
        opts = options.OptimizeOptions.from_args(args, options.OPTIMIZE, without=without, **given)
        try:
            _, report = optimize(args.input, args.output, options=opts)
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
