"""What the subcommands share: the one-line argparse parser, exit codes, flags made from the
options' declarations (``onnxopt.options``), the outputs a command claims and protects, the JSON
report, and the one place every error becomes one line and an exit code (:func:`run_face`).

Imports the library (options, verify, ir, library, reporting, errors); no subcommand module.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from onnxopt import options
from onnxopt.errors import OnnxoptError, RuleBug
from onnxopt.ir import io
from onnxopt.library import registry
from onnxopt.reporting.console import Status, say
from onnxopt.verify import VerificationError

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # as a shell reports a command whose reader went away (128 + SIGPIPE)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        say(f"error: {message} (see {self.prog} --help)")
        self.exit(EXIT_BAD_INPUT)


EXIT_CODES_TEXT = ("exit codes: 0 ok, 1 outputs differ (verification), 2 bad input or usage, 3 internal error "
                   "(a bug in onnxopt), 130 interrupted, 141 the output's reader went away.")


class Once(argparse.Action):
    """A flag that may be given once (a second -c would silently replace the first file)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) not in (None, argparse.SUPPRESS):
            parser.error(f"{option_string} given twice: give one file (its settings, then the flags)")
        setattr(namespace, self.dest, values)


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", metavar="FILE.toml", action=Once,
                   help="settings from a TOML file (the README's 'Config file' lists its keys); flags given here "
                        "override it, relative paths in it are relative to its folder")


RULE_FLAGS = ("disable", "extra_rules", "rules", "target", "exact", "max_rewrites", "strict", "fold_size_limit")
INPUT_FLAGS = ("inputs", "input_shapes", "int_ranges", "seed", "rtol", "atol")
MEASURE_FLAGS = ("runs", "latency_budget", "warmup", "threads", "provider_options")


class Flags:
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


def status(args) -> Status:
    """Progress on stderr: on a terminal, never with -q."""
    return Status(enabled=False if args.quiet else None)


def verify_settings(args, progress: Status, command: str = options.VERIFY) -> dict:
    """The verifier's settings the flags give (``onnxopt.options.VerifyOptions``), with ``progress``."""
    return {**(options.VerifyOptions(**values_of(args, options.VerifyOptions, command)).verifier_kwargs() or {}),
            "progress": progress}


def values_of(args, cls, command: str) -> dict:
    """The fields of ``cls`` that ``command``'s flags set, from the parsed ``args``."""
    return {f.name: opt.value_from(args) for f, opt in options.described(cls) if opt.flags and command in opt.commands}


def run_face(fn):
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
        return fail(str(exc))
    except OnnxoptError as exc:
        return fail(str(exc))
    except BrokenPipeError:
        raise  # the reader went away (| head): main ends quietly
    except (OSError, MemoryError) as exc:
        return fail(f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug of ours: say so in one line, and not with 1 ("outputs differ")
        say(f"internal error: {io.first_line(exc, 300, typed=True)} (please report it)")
        return EXIT_INTERNAL


def outputs_for(args, *inputs: str, data_files: bool = True) -> io.Outputs:
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


def stage_json(outputs: io.Outputs, path: str | None, data: dict) -> None:
    """Write the report (strict JSON) to its staged file; it is put in place with the command's
    other outputs."""
    if not path:
        return
    with open(outputs.stage(path), "w") as f:
        json.dump(finite(data), f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")


def finite(data):
    """The report with non-finite floats as strings ("nan", "inf"): strict JSON for any reader."""
    if isinstance(data, float):
        return data if data == data and abs(data) != float("inf") else str(data)
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def fail(message: str) -> int:
    say(f"error: {message}")
    return EXIT_BAD_INPUT


def rule_sets(args, files: dict | None = None) -> tuple[list | None, list]:
    """(base rules: None for the built-in library, extra rules from --rules files); ``files``
    gets each file's rules by path."""
    extra = []
    for path in args.rules:
        rules = registry.load_rules_file(path)
        extra.extend(rules)
        if files is not None:
            files[path] = rules
    return ([] if args.no_builtin_rules else None), extra
