"""``onnxopt diff BEFORE AFTER``: what changed, node by node (``onnxopt.diff``): live in Netron, or a
static page."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from onnxopt.cli.common import EXIT_OK, Parser, fail, outputs_for, run_face
from onnxopt.reporting.console import show


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="onnxopt diff",
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


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def run():
        from onnxopt import diff as diffs

        for path in (args.before, args.after):
            if not os.path.isfile(path):
                return fail(f"{path}: no such model file")
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
        with outputs_for(args, args.before, args.after) as outputs:  # (claims --json; written atomically)
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

    return run_face(run)
