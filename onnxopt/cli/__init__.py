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

This package: this module dispatches (:func:`main`, the ``onnxopt`` entry point); one module per
subcommand (``optimize``, ``verify``, ``bisect``, ``quantize``, ``diff``, ``inspect``), each with
its ``parser()`` and ``main(argv)``; ``common`` what they share; ``config`` the config file. It
imports the library; nothing in the library imports it.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings

from onnxopt.cli import bisect, common, diff, inspect, optimize, quantize, verify
from onnxopt.cli.common import (EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_DIFFERS, EXIT_INTERNAL, EXIT_INTERRUPTED,
                                EXIT_OK, fail)
from onnxopt.ir import io  # noqa: F401  (onnxopt.cli.io, as before the split)
from onnxopt.reporting.console import say

_stage_json = common.stage_json  # (as before the split: tests write a report with it)
_COMMANDS = {"verify": verify.main, "bisect": bisect.main, "quantize": quantize.main, "diff": diff.main,
             "inspect": inspect.main}


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
    if argv and argv[0] in _COMMANDS:
        return _COMMANDS[argv[0]](argv[1:])
    if inspect.inspects(argv):
        return inspect.main(argv)
    if argv and not argv[0].startswith("-") and not os.path.exists(argv[0]):
        close = difflib.get_close_matches(argv[0], list(_COMMANDS), n=1, cutoff=0.7)
        if close:  # (a model path would exist, or have a suffix)
            return fail(f"no model or command {argv[0]!r}: did you mean 'onnxopt {close[0]}'?")
    return optimize.main(argv)


__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "EXIT_DIFFERS", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK", "main"]
