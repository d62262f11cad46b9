"""``onnxopt bisect MODEL``: the rewrite after which a model's outputs differ
(``onnxopt.verify.bisect``)."""

from __future__ import annotations

import argparse

from onnxopt import options
from onnxopt import verify
from onnxopt.cli.common import (EXIT_DIFFERS, EXIT_OK, INPUT_FLAGS, RULE_FLAGS, Flags, Parser, outputs_for, rule_sets,
                                run_face, stage_json, status)
from onnxopt.ir import input_shapes
from onnxopt.reporting.console import show
from onnxopt.reporting.text import format_bisect
from onnxopt.verify.bisect import bisect


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnxopt bisect",
                description="Binary search over the rewrites onnxopt makes to MODEL for the first one after which "
                            "its outputs differ on onnxruntime; names the rule and the nodes.",
                epilog="exit codes: 0 the fully optimized model verifies (nothing to bisect), 1 a culprit was "
                       "found, 2 bad input or usage, 3 internal error.")
    p.add_argument("model", help="the original model")
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    flags = Flags(p, options.BISECT)
    flags.add(*RULE_FLAGS)
    p.add_argument("--fix-input-shape", metavar="NAME=DIMS", action="append", default=[],
                   help="an input shape the optimization fixed (optimize's --input-shape, the same grammar): MODEL's "
                        "input is fixed to it before the rewrites are replayed (repeatable)")
    flags.add(*INPUT_FLAGS, "json", "quiet")
    flags.add_rest()
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def run():
        base, extra = rule_sets(args)
        with outputs_for(args, args.model) as outputs, status(args) as progress:
            report = bisect(
                args.model, rules=base, extra_rules=extra, disable=args.disable,
                target=args.target, provider=args.provider, inputs=args.inputs,
                input_shapes=verify.parse_input_shapes(args.input_shape),
                int_ranges=verify.parse_int_ranges(args.int_range), seed=args.seed, rtol=args.rtol, atol=args.atol,
                optimize_options={"max_rewrites": args.max_rewrites, "fold_size_limit": args.fold_size_limit,
                                  "strict": args.strict, "exact": args.exact,
                                  "input_shapes": input_shapes.parse(args.fix_input_shape, flag="--fix-input-shape")},
                progress=progress)
            stage_json(outputs, args.json, report)
        text = format_bisect(report)
        show(text.blocks[-1] if args.quiet else text)
        return EXIT_OK if report["ok"] else EXIT_DIFFERS

    return run_face(run)
