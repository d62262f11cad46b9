"""``onnxopt verify ORIGINAL OPTIMIZED``: compare two models on onnxruntime (``onnxopt.verify``)."""

from __future__ import annotations

import argparse

from onnxopt import options
from onnxopt import verify
from onnxopt.cli.common import (EXIT_DIFFERS, EXIT_OK, INPUT_FLAGS, MEASURE_FLAGS, Flags, Parser, outputs_for, run_face,
                                stage_json, status, verify_settings)
from onnxopt.errors import OnnxoptError
from onnxopt.reporting.console import show
from onnxopt.reporting.text import Styled, format_verification, summary_line


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnxopt verify",
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
    flags = Flags(p, options.VERIFY)
    flags.add(*INPUT_FLAGS, *MEASURE_FLAGS, "json", "quiet")
    flags.add_rest()
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def run():
        with outputs_for(args, args.original, args.optimized) as outputs, status(args) as progress:
            report = verify.verify(args.original, args.optimized, providers=args.providers,
                                   input_shapes=verify.parse_input_shapes(args.input_shape),
                                   min_sqnr=args.min_sqnr, **verify_settings(args, progress))
            coverage = _verify_coverage(args.optimized)
            if coverage is not None:
                report["coverage"] = coverage
            stage_json(outputs, args.json, report)
        if args.quiet:
            show(Styled("verdict: " + ("outputs agree" if report["ok"] else summary_line(report)),
                        "bold green" if report["ok"] else "bold red"))
        else:
            show(format_verification(report))
        return EXIT_OK if report["ok"] else EXIT_DIFFERS

    return run_face(run)


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
