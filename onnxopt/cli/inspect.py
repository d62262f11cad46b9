"""``onnxopt inspect MODEL`` (and ``onnxopt MODEL`` without -o): FLOPs, bytes, parameters and
rooflines per node (``onnxopt.inspect.analysis``), and the peak activation memory."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from onnxopt.reporting.inspect_text import format_inspect
from onnxopt.cli.common import EXIT_OK, Parser, outputs_for, run_face, stage_json
from onnxopt.ir import input_shapes
from onnxopt.ir import io
from onnxopt.reporting.console import show


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnxopt inspect",
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


def _peak_memory(model: str, shapes) -> dict:
    """Peak activation memory by liveness (onnxopt.transforms.memory). Inputs left with symbolic dimensions
    are taken at the shapes the verifier runs them at (recorded as ``at``), as optimize's report and its
    page take them: sized at none, most values were of unknown size."""
    import onnx

    from onnxopt.transforms.memory import peak

    graph = io.to_ir(onnx.load(model, load_external_data=False))  # (the graph only: no weights read)
    if shapes:
        input_shapes.fix(graph, input_shapes.normalize(shapes))
    at = input_shapes.symbolic_run_shapes(graph)
    result = peak(model, input_shapes={**input_shapes.normalize(shapes), **at} or None)
    return {**result, "at": at} if at else result


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def run():
        from onnxopt.inspect import analysis

        analysis.check_top(args.top)
        with outputs_for(args, args.input) as outputs:  # (--json is never the model or one of its data files)
            if args.html:
                outputs.claim(args.html, "--html")
            shapes = input_shapes.parse(args.input_shape)
            report = analysis.analyze(args.input, input_shapes=shapes, device=args.device)
            memory = _peak_memory(args.input, shapes)
            if memory and "unavailable" not in memory:
                report["memory"] = {k: v for k, v in memory.items() if k != "curve"}
            stage_json(outputs, args.json, {"model": args.input, **report})
            if args.html:
                from onnxopt.reporting.html import render_inspect

                Path(outputs.stage(args.html)).write_text(render_inspect(args.input, report, memory, args.top),
                                                          encoding="utf-8")
        if not args.quiet:
            show(format_inspect(report, args.input, args.top))
        return EXIT_OK

    return run_face(run)


def inspects(argv: list[str]) -> bool:
    """``onnxopt MODEL [inspect options]``: a model file and no option that only optimizing takes."""
    if not argv or argv[0].startswith("-") or not os.path.isfile(argv[0]):
        return False
    known = {o for a in parser()._actions for o in a.option_strings}

    def inspects(word: str) -> bool:  # (an unambiguous prefix too, as argparse takes one)
        flag = word.split("=", 1)[0]
        return flag in known or (flag.startswith("--") and len([o for o in known if o.startswith(flag)]) == 1)

    # (a negative number is a value, as argparse takes it: --top -1 is inspect's error, not 'unrecognized')
    return all(not w.startswith("-") or w[1:2].isdigit() or inspects(w) for w in argv[1:])
