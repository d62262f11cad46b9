"""The terminal side of the command line: reports (``onnxopt.reporting.text``) drawn with rich, tables
and colour, where stdout is a terminal, and as their plain text anywhere else (a pipe, a file: no
escape codes, no box drawing); one-line messages on stderr; progress on stderr.

What counts as a terminal is rich's call, so its conventions hold: ``NO_COLOR`` (set, not empty)
takes the colour out; ``FORCE_COLOR`` or ``TTY_COMPATIBLE=1`` make any output a terminal,
``TTY_COMPATIBLE=0`` none; ``TERM=dumb`` gets neither colour nor progress; ``TTY_INTERACTIVE=0``
turns progress off, ``=1`` on.
"""

from __future__ import annotations

import sys
import threading
import time

from rich.console import Console
from rich.text import Text

from onnxopt.reporting.text import Table


def _console(stream) -> Console:
    return Console(file=stream, highlight=False, markup=False, emoji=False)


def _text(cell) -> Text:
    return Text(str(cell), style=getattr(cell, "style", ""))


def _tables(t: Table) -> list:
    """A report's table for rich: one per section, under its title, the columns but the last as
    wide in each (the last takes the rest of the line and wraps)."""
    from rich import box  # (rich's tables and progress are imported where drawn: a pipe needs neither)
    from rich.table import Table as RichTable

    widths = [max(len(str(r[i])) for _, rows in t.sections for r in [t.header, *rows]) for i in range(len(t.header))]
    out = []
    for title, rows in t.sections:
        table = RichTable(title=_text(title) if title else None, title_justify="left", box=box.SIMPLE_HEAD,
                          header_style="bold", show_edge=False, pad_edge=False)
        for i, (name, align) in enumerate(zip(t.header, t.aligns)):
            last = i == len(t.header) - 1
            table.add_column(name, justify="left" if align == "l" else "right", no_wrap=not last,
                             min_width=None if last else widths[i])
        for row in rows:
            table.add_row(*map(_text, row))
        out.append(table)
    return out


def show(doc: str, stream=None) -> None:
    """Print a report (an ``onnxopt.reporting.text.Doc``, or any string) on ``stream`` (stdout): drawn
    with rich on a terminal, its plain text elsewhere."""
    stream = stream or sys.stdout
    con = _console(stream)
    if not con.is_terminal:
        print(doc, file=stream)
        return
    for block in getattr(doc, "blocks", (doc,)):
        if isinstance(block, Table):
            for i, table in enumerate(_tables(block)):
                con.print(*[""] * (i > 0), table)
        else:
            con.print(_text(block), soft_wrap=True)  # (long lines, such as a command to copy, stay whole)


def say(message: str, style: str = "bold red") -> None:
    """``onnxopt: MESSAGE`` on stderr, one line; the message in ``style`` on a terminal."""
    con = _console(sys.stderr)
    if not con.is_terminal:
        print(f"onnxopt: {message}", file=sys.stderr)
        return
    con.print(Text.assemble(("onnxopt: ", "bold"), (message, style)), soft_wrap=True)


def _elapsed(start: float):
    """A progress column of the seconds since ``start``."""
    from rich.progress import ProgressColumn

    class Elapsed(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{time.monotonic() - start:.0f} s", style="dim")

    return Elapsed()


class Status:
    """Progress on stderr for a person watching: the hook ``optimize(progress=)``, the pipeline,
    ``onnxopt.verify.verify`` and ``onnxopt.verify.bisect.bisect`` report to, as
    ``status(step, done, total)`` (a bar when ``total`` is given), and ``close()`` when an activity
    ends. Drawn only where stderr is an interactive terminal (``enabled=None``; the command line
    passes False for ``-q``), and only once an activity has run :attr:`DELAY` seconds, so a quick
    command prints nothing; close() clears the line, and the next call starts a new activity."""

    DELAY = 1.0

    def __init__(self, enabled: bool | None = None, stream=None, delay: float | None = None):
        self._console = _console(stream or sys.stderr)
        self.enabled = self._console.is_interactive if enabled is None else enabled
        self.delay = self.DELAY if delay is None else delay
        self._lock = threading.Lock()
        self._state = ("", 0, 0)
        self._started = 0.0
        self._timer: threading.Timer | None = None
        self._bar = None  # (a rich Progress while drawn)

    def __call__(self, step: str, done: int = 0, total: int = 0) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._state = (step, done, total)
            if self._bar is not None:
                self._bar.update(self._bar.task_ids[0], **self._fields())
            elif self._timer is None:
                self._started = time.monotonic()
                self._timer = threading.Timer(self.delay, self._show)
                self._timer.daemon = True
                self._timer.start()

    def _fields(self) -> dict:
        step, done, total = self._state
        return {"description": step, "completed": done, "total": total or None,
                "count": f"{done}/{total}" if total else ""}

    def _show(self) -> None:
        with self._lock:
            if self._timer is None:  # closed meanwhile
                return
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

            fields = self._fields()
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[count]}"), _elapsed(self._started), console=self._console,
                                 transient=True, redirect_stdout=False)
            self._bar.add_task(fields.pop("description"), **fields)
            self._bar.start()

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
