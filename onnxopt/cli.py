"""``python -m onnxopt`` / ``onnxopt``: thin wiring of the library for the shell.

Exit codes: 0 success, 2 bad input or usage (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from . import __version__, fold, io, passes, registry
from .api import optimize, resolve_rules
from .errors import OnnxoptError

EXIT_OK, EXIT_BAD_INPUT = 0, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"onnxopt: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="onnxopt",
        description="Rewrite an ONNX model with onnxopt's rules until nothing more applies.",
    )
    p.add_argument("input", nargs="?", help="the ONNX model to optimize (never modified)")
    p.add_argument("-o", "--output", help="where to write the optimized model (written atomically)")
    p.add_argument("--json", metavar="REPORT", help="also write the report as JSON to this file")
    p.add_argument("--list-rules", action="store_true", help="list the rules with one-line docs and exit")
    p.add_argument("--disable", metavar="RULE", action="append", default=[], help="leave a rule out (repeatable)")
    p.add_argument("--rules", metavar="FILE", action="append", default=[],
                   help="a Python file whose RULES are added to the built-in ones (repeatable)")
    p.add_argument("--no-builtin-rules", action="store_true", help="use only the rules given with --rules")
    p.add_argument("--target", choices=["cpu", "cuda"], help="only rules valid for this execution provider")
    p.add_argument("--max-rewrites", type=int, metavar="N", help="cap on the number of rewrites")
    p.add_argument("--fold-size-limit", type=int, metavar="BYTES", default=fold.DEFAULT_SIZE_LIMIT,
                   help="constant folding creates a larger tensor only in place of at least as many bytes of "
                        "constants that become unused (default 1 MiB)")
    ext = p.add_mutually_exclusive_group()
    ext.add_argument("--external-data", metavar="NAME", nargs="?", const=True,
                     help="save weights to an external data file (default name: OUTPUT.data)")
    ext.add_argument("--single-file", action="store_true", help="save weights inside the model file")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.add_argument("--version", action="version", version=f"onnxopt {__version__}")
    return p


def _table(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def format_report(report, src: str, dst: str) -> str:
    d = report.as_dict()
    ops = sorted(set(report.before) | set(report.after))
    rows = [(op, report.before.get(op, 0), report.after.get(op, 0),
             f"{report.after.get(op, 0) - report.before.get(op, 0):+d}") for op in ops]
    rows.append(("total", d["nodes_before"], d["nodes_after"], f"{d['nodes_after'] - d['nodes_before']:+d}"))
    out = [f"onnxopt {src} -> {dst}", "", _table(rows, ("op type", "before", "after", "change"))]
    fired = [(name, st.tried, st.fired, st.refused, f"{st.seconds * 1e3:.1f}")
             for name, st in report.rules.items() if st.tried]
    if fired:
        out += ["", _table(fired, ("rule", "tried", "fired", "refused", "ms"))]
    s = d["seconds"]
    out += ["", f"{report.rewrites} rewrites; time: load {s['load']:.3f} s, rewrite {s['rewrite']:.3f} s, "
                f"save {s['save']:.3f} s, total {s['total']:.3f} s"]
    out += [f"warning: {w}" for w in report.warnings]
    return "\n".join(out)


def _write_json(path: str, data: dict) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        os.chmod(tmp, io.FILE_MODE)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fail(message: str) -> int:
    print(f"onnxopt: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # usage errors exit 2 with a one-line message
    try:
        extra = []
        for path in args.rules:
            extra.extend(registry.load_rules_file(path))
        base = [] if args.no_builtin_rules else None
        if args.list_rules:
            for rule in resolve_rules(base, extra, args.disable, args.target):
                targets = ",".join(sorted(rule.targets))
                print(f"{rule.name:<28} {rule.pattern.op_type:<20} p={rule.priority:<3} [{targets}]  {rule.summary}")
            if base is None:
                for name in passes.PASSES:
                    if name not in args.disable:
                        print(f"{name:<28} {'(graph pass)':<20} {'':<5} [cpu,cuda]  {passes.SUMMARY[name]}")
            return EXIT_OK
        if not args.input:
            return _fail("the input model is missing (usage: onnxopt IN -o OUT)")
        if not args.output:
            return _fail("-o/--output is required (the input file is never overwritten)")
        external = False if args.single_file else args.external_data
        _, report = optimize(
            args.input, rules=base, extra_rules=extra, disable=args.disable, target=args.target,
            output=args.output, external_data=external, max_rewrites=args.max_rewrites, return_report=True,
            fold_size_limit=args.fold_size_limit,
        )
        if args.json:
            data = {"input": args.input, "output": args.output, **report.as_dict()}
            _write_json(args.json, data)
        if not args.quiet:
            print(format_report(report, args.input, args.output))
        return EXIT_OK
    except OnnxoptError as exc:
        return _fail(str(exc))
    except (OSError, MemoryError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
