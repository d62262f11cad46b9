"""``onnxopt quantize MODEL -o OUT --calib DATA``: INT8 (QDQ) with calibration
(``onnxopt.quantize``); its flags and config keys come from ``onnxopt.options.QuantizeOptions``."""

from __future__ import annotations

import argparse
import os

from onnxopt import options
from onnxopt.cli import config
from onnxopt.cli.common import EXIT_OK, Flags, Parser, add_config_arg, fail, outputs_for, run_face, stage_json, status
from onnxopt.reporting.console import show


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnxopt quantize",
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
    flags = Flags(p, options.QUANTIZE)
    flags.add("calibration", "method", "per_channel", "target", "exclude", "fidelity", "keep_float", "threads",
              "latency_budget", "reduce_range", "workers", "held_out", "percentile", "input_shapes", "strict", "json",
              "quiet")
    add_config_arg(p)
    flags.add_rest()
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def run():
        nonlocal args
        args = config.merge(args, argv, parser, config.QUANTIZE)
        return config.with_locus(args, quantize_run)

    def quantize_run():
        if args.calib is None:
            return fail("no calibration data: add --calib DATA (or calibration in the config file's [quantize])")
        from onnxopt.quantize.api import quantize
        from onnxopt.reporting.text import format_quantize

        with outputs_for(args, args.input, data_files=False) as outputs, status(args) as progress:
            outputs.protect(args.calib, f"the calibration data {args.calib}")
            if os.path.isdir(args.calib):  # (its files: an output may not replace one)
                for entry in sorted(os.scandir(args.calib), key=lambda e: e.name):
                    if entry.is_file() and entry.name.endswith((".npy", ".npz")):
                        outputs.protect(entry.path, f"calibration data file {entry.path}")
            opts = options.QuantizeOptions.from_args(args, return_report=True, outputs=outputs, progress=progress)
            _, report = quantize(args.input, args.calib, args.output, options=opts)
            stage_json(outputs, args.json, {"input": args.input, "output": args.output, **report.as_dict(),
                                             **config.report_entry(args)})
        if not args.quiet:
            show(format_quantize(report, args.input, args.output))
        return EXIT_OK

    return run_face(run)
