"""``onnxopt MODEL -o OUT``: optimize (and verify before writing), and ``onnxopt --list-rules``.

Its flags and its config keys come from ``onnxopt.options``; the call is ``optimize(MODEL, OUT,
options=OptimizeOptions.from_args(...))``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shlex
import textwrap
from pathlib import Path

from onnxopt import __version__, options, targets
from onnxopt import verify
from onnxopt.api import optimize
from onnxopt.cli import config
from onnxopt.cli.common import (EXIT_CODES_TEXT, EXIT_OK, INPUT_FLAGS, MEASURE_FLAGS, RULE_FLAGS, Flags, Parser,
                                add_config_arg, fail, outputs_for, rule_sets, run_face, stage_json, status,
                                verify_settings)
from onnxopt.ir import evaluate
from onnxopt.ir import io
from onnxopt.library import registry
from onnxopt.reporting.console import show
from onnxopt.reporting.text import format_optimize, format_rules, format_verification
from onnxopt.verify import VerificationError


def parser() -> argparse.ArgumentParser:
    p = Parser(
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
               "  onnxopt --list-rules --target ort-cuda\n\n" + textwrap.fill(EXIT_CODES_TEXT, 78),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", nargs="?", metavar="MODEL", help="the ONNX model to optimize (never modified)")
    p.add_argument("-o", "--output", help="where to write the optimized model (written atomically)")
    p.add_argument("--list-rules", action="store_true",
                   help="list the rules by family (targets, exactness, what each does) and the graph passes, "
                        "and exit")
    flags = Flags(p, options.OPTIMIZE)
    flags.add(*RULE_FLAGS, "external_data", "precision", "providers", "input_layout", "output_layout",
              "input_preprocess", *INPUT_FLAGS, *MEASURE_FLAGS, "json", "quiet", "diff", "html")
    add_config_arg(p)
    p.add_argument("--version", action="version", version=f"onnxopt {__version__}")
    flags.add_rest()
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)  # usage errors exit 2 with a one-line message

    def merged_run():
        merged = config.merge(args, argv, parser)
        return config.with_locus(merged, lambda: run(merged))

    return run_face(merged_run)


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

    with io.Outputs() as outputs, status(args) as progress:
        for path in (args.input, args.output):
            for read in io.files_read(path):
                outputs.protect(read)
        outputs.claim(args.report, "--report")
        progress("writing the report page")
        echo = config.report_entry(args).get("config")  # (-c FILE: the settings the run used, on the page)
        settings = {"file": echo["file"], **echo["settings"]} if echo else None
        data = html_report.build(args.input, args.output, report, page=args.report, diff_page=args.diff,
                                 verify_options=verify_settings(args, progress, options.OPTIMIZE), profile_runs=min(args.runs, 10),
                                 config=settings)
        Path(outputs.stage(args.report)).write_text(html_report.render(data), encoding="utf-8")


def run(args) -> int:
    files: dict = {}
    base, extra = rule_sets(args, files)
    if args.list_rules:
        skipped: list[dict] = []
        show(format_rules(*registry.resolve(base, extra, args.disable, args.target, exact=args.exact, skipped=skipped),
                          _families(files), targets.normalize(args.target), skipped))
        return EXIT_OK
    if not args.input:
        return fail(f"no model given: onnxopt MODEL -o OUTPUT optimizes one; {_OTHER_COMMANDS} (see --help)")
    if not args.output:
        suggested = Path(args.input).with_name(Path(args.input).name.removesuffix(".onnx") + ".opt.onnx")
        return fail(f"no output given: add -o OUTPUT to write the optimized model "
                     f"({shlex.join(['onnxopt', args.input, '-o', str(suggested)])}; the input is never "
                     f"overwritten); {_OTHER_COMMANDS}")
    if args.provider_option:  # (checked whether or not it is used)
        verify.parse_provider_options(args.provider_option)
        if args.verify is None:
            return fail("--provider-option sets the sessions of --verify: add --verify PROVIDERS (e.g. --verify cuda)")
    with outputs_for(args, args.input, data_files=False) as outputs, status(args) as progress:
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
            stage_json(outputs, args.json, {"input": args.input, "output": None, "verification": exc.report,
                                             **config.report_entry(args)})
            outputs.commit()  # the report only: no model was staged
            progress.close()
            if not args.quiet and exc.report is not None:
                show(format_verification(exc.report))
            raise
        stage_json(outputs, args.json, {"input": args.input, "output": args.output, **report.as_dict(),
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
