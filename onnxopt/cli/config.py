"""The config file: ``onnxopt MODEL -o OUT -c onnxopt.toml`` (and ``onnxopt quantize ... -c``).

A TOML file (``tomllib``; ``tomli`` before Python 3.11) whose keys are the command line's settings:
:data:`SCHEMA` names every key, its type, its allowed values, the flag it stands for and which
commands read it; it is derived from the declarations of ``onnxopt.options`` (a key is written once, there). Values are checked with the same parsers the flags go through
(``onnxopt.ir.input_shapes``, ``onnxopt.transforms.edges``, ``onnxopt.verify``), so one grammar holds.

- A flag given on the command line replaces the file's value of its key (lists included); a flag
  left at its default does not (:func:`given` tells them apart by a second parse whose defaults
  are suppressed).
- Relative paths in the file are relative to the file's folder.
- An unknown key, a value of the wrong type or an unparsable file is one line naming the file and
  the key (with a "did you mean" for a misspelt key): a ``UsageError``, exit 2 on the command line.
- Each command reads the keys that apply to it (the main command everything but ``[quantize]``;
  ``onnxopt quantize`` the ``[quantize]`` table, ``target``, ``input_shapes``, ``strict`` and
  ``[report]``); the others are checked and listed as ``ignored`` in the echo.
- :func:`merge` returns the command's ``argparse.Namespace`` with the file applied, and
  :func:`report_entry` the ``"config"`` entry of the JSON report: the file, the merged settings,
  and which of them came from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from onnxopt import options
from onnxopt.errors import UsageError
from onnxopt.options import shown as _shown

OPTIMIZE, QUANTIZE = options.OPTIMIZE, options.QUANTIZE
_ATTR = "config_echo"  # where merge() leaves the echo on the Namespace


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the file. ``name`` is dotted (``verify.rtol`` is ``rtol`` in ``[verify]``).
    ``kind``: "string", "integer", "number", "boolean", "false", "strings" (a list of strings, or
    one string), "table" (names to values), or a combination written with "|" ("boolean|string").
    ``flag``: the command-line flag it stands for; ``dests``: the argparse destinations it sets, by
    command (a command not named there does not read it; ``external_data`` sets two: the exclusive
    --external-data and --single-file)."""

    name: str
    kind: str
    help: str
    dests: Mapping[str, tuple[str, ...]]
    flag: str
    choices: Callable[[], tuple] | None = None
    path: bool = False  # its value (or values) a path: relative to the file's folder
    check: Callable[[Any, str], Any] | None = None  # the value -> the Namespace's value (UsageError if bad)
    minimum: int | None = None


def _key(name: str, declared: list) -> Key:
    """The key of the options that declare ``name`` (the first one describes it; each one's
    command reads it into its flag's destinations)."""
    first = declared[0]
    dests = {c: opt.dests for opt in declared for c in opt.commands if c in options.CONFIG_COMMANDS}
    return Key(name, first.kind, first.about, dests, first.flag, choices=first.choices, path=first.path,
               check=first.check, minimum=first.minimum)


# Derived from the options' declarations (onnxopt.options): a key is written there, once.
SCHEMA: tuple[Key, ...] = tuple(_key(name, declared) for name, declared in options.config_options())
KEYS = {k.name: k for k in SCHEMA}
TABLES = sorted({k.name.split(".")[0] for k in SCHEMA if "." in k.name})


# --------------------------------------------------------------------------------------------
# Reading and checking


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover (Python 3.10)
        import tomli as tomllib
    return tomllib


def read(path: str | os.PathLike) -> dict:
    """The file's tables flattened to dotted keys (``{"verify.rtol": 1e-4}``); UsageError (one line)
    for a missing or unreadable file, bad TOML (with its line) or an unknown key."""
    from onnxopt import readers

    toml = _toml()
    # Bounded: 1 MiB (``-c /dev/zero`` is refused, not read without end), 64 levels of nesting (tomllib
    # recurses: 5,000 nested arrays were a RecursionError), a UTF-8 byte order mark accepted.
    raw = readers.read_bytes(path, "config file", readers.MAX_CONFIG_BYTES)
    try:
        text = raw[len(readers.BOM):].decode("utf-8") if raw.startswith(readers.BOM) else raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})") from None
    readers.check_nesting(text, path, "config file")
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {str(exc).splitlines()[0]}") from None
    except RecursionError:  # (the count above should have caught it)
        raise UsageError(f"{path}: nested too deeply for a config file") from None
    if readers.data_depth(data) > readers.MAX_NESTING:  # dotted keys nest tables without brackets
        raise UsageError(f"{path}: nested more than {readers.MAX_NESTING} levels of tables (dotted keys)")
    flat: dict = {}
    for name, value in data.items():
        if name in TABLES:
            if not isinstance(value, dict):
                raise UsageError(f"{path}: {name} is a table ([{name}]), not {_shown(value)}")
            for sub, v in value.items():
                flat[f"{name}.{sub}"] = v
        elif name not in KEYS and isinstance(value, dict) and value:  # a misspelt table: name its keys
            flat.update((f"{name}.{sub}", v) for sub, v in value.items())
        else:
            flat[name] = value
    for name in flat:
        if name not in KEYS:
            raise UsageError(f"{path}: unknown key {name!r}{_suggest(name)}")
    return flat


def _suggest(name: str) -> str:
    names = list(KEYS) + [k.name.rsplit(".", 1)[-1] for k in SCHEMA if "." in k.name]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close and "." in name:  # a key put in the wrong table, or a misspelt table
        close = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(KEYS), n=1, cutoff=0.6)
        close = close or difflib.get_close_matches(name.split(".")[0], TABLES, n=1, cutoff=0.6)
    if not close:
        return f" (keys: {', '.join(KEYS)})"
    full = next((k for k in KEYS if k == close[0] or k.endswith("." + close[0])), close[0])
    return f" (did you mean {full!r}?)"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_TEXT = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
              "strings": "a list of strings", "table": "a table", "false": "false"}


def _fits(kind: str, value) -> bool:
    return {"string": lambda v: isinstance(v, str),
            "integer": _is_int,
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool),
            "strings": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
            "table": lambda v: isinstance(v, dict),
            "false": lambda v: v is False}[kind](value)


def check(key: Key, value, folder: str | os.PathLike, where: str = "") -> Any:
    """A file's value of ``key`` as the command line's parser would have made it (paths resolved
    against ``folder``); UsageError naming the key and what it takes."""
    kinds = key.kind.split("|")
    if "strings" in kinds and isinstance(value, str) and "string" not in kinds:
        value = [value]
    prefix = f"{where}: " if where else ""
    if not any(_fits(k, value) for k in kinds):
        raise UsageError(f"{prefix}{key.name}: expected {' or '.join(_KIND_TEXT[k] for k in kinds)}, "
                         f"got {_shown(value)}")
    if key.choices is not None and isinstance(value, str) and value not in key.choices():
        close = difflib.get_close_matches(value, key.choices(), n=1)
        raise UsageError(f"{prefix}{key.name}: {value!r} is not one of {', '.join(key.choices())}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    if key.minimum is not None and _is_int(value) and value < key.minimum:
        raise UsageError(f"{prefix}{key.name}: {value} is below {key.minimum}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{prefix}{key.name}: expected a finite number, got {value}")
    if key.minimum is not None and isinstance(value, float) and value < key.minimum:
        raise UsageError(f"{prefix}{key.name}: {value} is below {key.minimum}")
    if isinstance(value, str) and not value.strip() and (key.path or key.choices is not None or key.kind == "string"
                                                           or "string" in kinds):
        raise UsageError(f"{prefix}{key.name}: empty" + (" (a path)" if key.path else ""))
    if isinstance(value, list) and any(isinstance(v, str) and not v.strip() for v in value):
        raise UsageError(f"{prefix}{key.name}: an empty entry in {_shown(value)}")
    if key.path:
        value = [_resolve(v, folder) for v in value] if isinstance(value, list) else _resolve(value, folder)
    if key.check is not None:
        try:
            value = key.check(value, key.name)
        except UsageError as exc:
            text = str(exc)
            raise UsageError(prefix + (text if text.startswith(key.name) else f"{key.name}: {text}")) from None
    return value


def _resolve(path: str, folder) -> str:
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(folder, path))


def load(path: str | os.PathLike) -> dict:
    """The file's settings, checked: dotted key -> the value in the command line's form."""
    folder = os.path.dirname(os.path.abspath(path))
    return {name: check(KEYS[name], value, folder, str(path)) for name, value in read(path).items()}


# --------------------------------------------------------------------------------------------
# Merging with the command line


def given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` gives (not those left at their defaults): ``argv``
    parsed again with every default suppressed."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _to_namespace(key: Key, value, dests: tuple[str, ...]) -> dict:
    if key.name == "external_data":  # one key for the two exclusive flags
        return {"external_data": None if value is False else value, "single_file": value is False}
    if len(dests) != 1:  # pragma: no cover (a schema entry would need its own case above)
        raise AssertionError(key.name)
    return {dests[0]: value}


def _from_namespace(key: Key, args, dests) -> Any:
    if key.name == "external_data":
        return False if args.single_file else args.external_data
    return getattr(args, dests[0])


def merge(args: argparse.Namespace, argv: list[str], parser_factory: Callable[[], argparse.ArgumentParser],
          command: str = OPTIMIZE) -> argparse.Namespace:
    """``args`` (the command line parsed) with the file of ``args.config`` applied under the flags
    given; the echo for :func:`report_entry` rides on the Namespace. Without ``--config``: ``args``."""
    path = getattr(args, "config", None)
    if path is None:
        return args
    settings = load(path)
    cli = given(parser_factory(), argv)
    merged = argparse.Namespace(**vars(args))
    echo_settings, from_cli, ignored = {}, [], []
    for key in SCHEMA:
        dests = key.dests.get(command)
        if not dests:
            if key.name in settings:
                ignored.append(key.name)
            continue
        missing = [d for d in dests if not hasattr(args, d)]
        if any(d in cli for d in dests):
            from_cli.append(key.name)
            echo_settings[key.name] = _from_namespace(key, args, dests)
        elif key.name in settings:
            if missing:
                raise UsageError(f"{path}: {key.name}: this onnxopt's {command} command has no {key.flag} to "
                                 "take it")
            vars(merged).update(_to_namespace(key, settings[key.name], dests))
            echo_settings[key.name] = settings[key.name]
    if getattr(merged, "quiet", False) and "report.quiet" not in from_cli:
        # the file's quiet silences warnings as -q does (main() does so for -q, inside its catch_warnings)
        warnings.simplefilter("ignore")
    setattr(merged, _ATTR, {"file": str(path), "settings": echo_settings, "from_command_line": from_cli,
                            **({"ignored": ignored} if ignored else {})})
    return merged


def locate(args: argparse.Namespace, message: str) -> str | None:
    """Where in the config file a setting that ``message`` (an error found only against the model:
    an input it lacks, a rule it does not know) complains of came from: ``"FILE: key"``, or None
    where no setting the file gave (and the command line did not override) is named in it."""
    echo = getattr(args, _ATTR, None)
    if not echo:
        return None
    by_name = {key.name: key for key in SCHEMA}
    for name in echo["settings"]:
        key = by_name.get(name)
        if key is None or name in echo["from_command_line"]:
            continue
        named = re.search(rf"(?<![\w-]){re.escape(key.flag)}(?![\w-])", message) is not None
        if named or (name == "disable" and "to disable" in message) or (name == "rules" and "rules file" in message):
            return f"{echo['file']}: {name}"
    return None


def with_locus(args: argparse.Namespace, run: Callable[[], int]) -> int:
    """``run()``, a UsageError it raises about a setting from the config file naming the file and key."""
    try:
        return run()
    except UsageError as exc:
        where = locate(args, str(exc))
        if where is None:
            raise
        raise UsageError(f"{where}: {exc}") from exc


def report_entry(args: argparse.Namespace) -> dict:
    """``{"config": {...}}`` for the JSON report of a command run with ``--config``, else ``{}``."""
    echo = getattr(args, _ATTR, None)
    return {} if echo is None else {"config": echo}


# --------------------------------------------------------------------------------------------
# Documentation


def markdown_table() -> str:
    """Every key as a Markdown table (the README's "Config file" section)."""
    rows = ["| key | type | flag | read by | what |", "|---|---|---|---|---|"]
    for key in SCHEMA:
        kind = " or ".join(_KIND_TEXT[k] for k in key.kind.split("|"))
        by = " and ".join({OPTIMIZE: "onnxopt MODEL", QUANTIZE: "onnxopt quantize"}[c] for c in key.dests)
        help = key.help + (f" ({', '.join(key.choices())})" if key.choices and key.name != "target" else "")
        rows.append(f"| `{key.name}` | {kind} | `{key.flag}` | {by} | {help.replace('|', '/')} |")
    return "\n".join(rows)


__all__ = ["KEYS", "SCHEMA", "Key", "check", "given", "load", "markdown_table", "merge", "read", "report_entry"]
