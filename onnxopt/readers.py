"""Reading the small text files a user hands onnxopt (a config file, a JSON report read back, a benefit or
cost table, a calibration list): bounded in size and in nesting, each refusal one line
(:class:`~onnxopt.errors.UsageError`, exit 2 on the command line).

Python's ``tomllib`` and ``json`` parse nested arrays and tables by recursion: a file of a few kilobytes
(``a = [[[[...]]]]`` 5,000 deep) ends in a ``RecursionError``, and a device or a huge file
(``-c /dev/zero``) is read without end. Here a file is read up to its limit (one byte more tells that it
is larger), a UTF-8 byte order mark is dropped, and the nesting of brackets and braces outside strings
and comments is counted before any parser sees the text.
"""

from __future__ import annotations

import json
import os

from onnxopt.errors import UsageError

MAX_CONFIG_BYTES = 1 << 20  # a config file
MAX_JSON_BYTES = 64 << 20  # a JSON report or table read back
MAX_NESTING = 64  # arrays and tables inside each other
BOM = b"\xef\xbb\xbf"


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the file; UsageError (one line) when it is larger, missing, a folder or
    unreadable. ``what`` names the file in the message ("config file", "benefit table", ...)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: a folder, not a {what}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise UsageError(f"{path}: larger than {_size_text(limit)}, too large for a {what}")
    return data


def read_text(path: str | os.PathLike, what: str, limit: int) -> str:
    """The file as UTF-8 text (a byte order mark dropped), bounded as :func:`read_bytes`."""
    data = read_bytes(path, what, limit)
    if data.startswith(BOM):
        data = data[len(BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}), not a {what}") from None


def nesting(text: str) -> tuple[int, int]:
    """The deepest nesting of ``[``/``{`` in TOML or JSON text, outside strings and comments, and the line
    where it is first reached. Strings: "..." and '...' (TOML's literal strings), and their triple-quoted
    multi-line forms; comments: '#' to the end of the line (none in JSON, and none outside a JSON string)."""
    depth = deepest = 0
    where = 1
    line = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "\"'":
            triple = text.startswith(c * 3, i)
            quote = c * 3 if triple else c
            j = i + len(quote)
            while j < n:
                if c == '"' and text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    break
                if text[j] == "\n" and not triple:  # an unterminated string: the parser will say so
                    break
                j += 1
            line += text.count("\n", i, j)
            i = j + len(quote)
            continue
        elif c in "[{":
            depth += 1
            if depth > deepest:
                deepest, where = depth, line
        elif c in "]}":
            depth -= 1
        i += 1
    return deepest, where


def check_nesting(text: str, path, what: str, limit: int = MAX_NESTING) -> None:
    deepest, line = nesting(text)
    if deepest > limit:
        raise UsageError(f"{path}: nested {deepest} levels deep at line {line}; a {what} may nest at most "
                         f"{limit} levels of arrays and tables")


def data_depth(value, limit: int = MAX_NESTING) -> int:
    """How deeply lists and dicts nest in ``value`` (counted without recursion, up to ``limit + 1``)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_json(path: str | os.PathLike, what: str, limit: int = MAX_JSON_BYTES):
    """A JSON file, bounded in size and nesting; UsageError (one line) for anything else."""
    text = read_text(path, what, limit)
    check_nesting(text, path, what)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{path}: not a valid JSON {what} ({str(exc).splitlines()[0]})") from None


MAX_NPZ_BYTES = 4 << 30  # what the arrays of one .npz may inflate to (numpy reads each member whole)


def check_npz(path: str | os.PathLike, what: str, limit: int | None = None, *, compressed_only: bool = False) -> None:
    """Refuse (one line) an .npz whose arrays inflate past ``limit`` bytes before numpy reads them: a few
    megabytes of compressed zeros can declare gigabytes. ``compressed_only``: count only the members read
    whole (a stored member is memory-mapped by onnxopt's calibration). A file that is not a zip archive is
    left to the caller's own message."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return
    limit = MAX_NPZ_BYTES if limit is None else limit
    total = sum(i.file_size for i in infos if not compressed_only or i.compress_type != zipfile.ZIP_STORED)
    if total > limit:
        raise UsageError(f"{what} {path}: its arrays inflate to {total:,} bytes, more than {_size_text(limit)}")
