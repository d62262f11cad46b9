"""The measured benefit table: whether a fusion (or a session option) pays on a target.

A fusion can help on one target and hurt on another (onnxruntime's SkipLayerNormalization is
faster on CUDA and slower than the unfused graph on this project's CPU). A rule names its entry
with ``Rule(..., benefit="<key>")``; ``onnxopt.library.registry.select`` asks :func:`decide` and leaves the
rule out for a target where the table says it does not pay, recording why (the optimize report
lists it). Session advice (``onnxopt.targets.advice``) reads the same table for provider options
(keys ``cuda_prefer_nhwc``, ``cuda_graph``).

The table is data shipped in the package (``onnxopt/data/benefit.json``), written by
``scripts/data/benefit.py`` from the runs it cites; it is never measured while optimizing, so a
model's output depends only on the table's contents. Its form::

    {"schema": 1,
     "entries": {
       "<key>": {
         "<target>": {"apply": false,
                      "evidence": {"ratio": 1.08,            # time with / time without (> 1: slower)
                                   "models": {"bert-legacy": {"without_ms": 9.77, "with_ms": 11.03,
                                                              "ratio": 1.129}, ...},
                                   "summary": "...",           # one line, for the report
                                   "source": {"command": "...", "date": "...", "machine": {...},
                                              "file": "...", "commit": "..."}}}}}}

A key or target the table has no entry for is *not measured*: the rule runs (and the report says
it was not measured). ``ONNXOPT_BENEFIT_TABLE`` names another table file (for benchmarks);
:func:`using` swaps the table in effect inside a ``with`` block (``using(None)``: an empty table,
every rule runs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from onnxopt import targets as _targets
from onnxopt.errors import UsageError

SCHEMA = 1
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "data" / "benefit.json"
ENV = "ONNXOPT_BENEFIT_TABLE"
# A fusion is left out where, over the models measured, it is slower than without it by more than
# this (the geometric mean of the with/without median ratios): below it, run-to-run noise.
NOISE = 0.01


@dataclasses.dataclass(frozen=True)
class Decision:
    """The table's verdict for one key on one target: ``apply``; ``measured`` False where the
    table has no entry (the rule runs); ``reason``: one line citing the evidence."""

    key: str
    target: str
    apply: bool
    measured: bool
    reason: str
    evidence: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"key": self.key, "target": self.target, "apply": self.apply, "measured": self.measured,
                "reason": self.reason, "evidence": self.evidence}


class Table:
    """The benefit table: ``entries[key][target] = {"apply": bool, "evidence": {...}}``."""

    def __init__(self, entries: Mapping | None = None, *, meta: Mapping | None = None, path: str | None = None):
        self.entries: dict[str, dict[str, dict]] = {}
        self.meta = dict(meta or {})
        self.path = path
        for key, by_target in (entries or {}).items():
            for target, entry in by_target.items():
                self.set(key, target, entry["apply"], entry.get("evidence") or {})

    # -- reading

    @classmethod
    def from_dict(cls, data: Mapping, path: str | None = None) -> Table:
        where = f"benefit table {path}" if path else "benefit table"
        if not isinstance(data, Mapping) or not isinstance(data.get("entries", {}), Mapping):
            raise UsageError(f"{where}: not a benefit table (expected an object with 'entries')")
        if data.get("schema", SCHEMA) != SCHEMA:
            raise UsageError(f"{where}: schema {data.get('schema')!r}, this onnxopt reads schema {SCHEMA}")
        for key, by_target in data.get("entries", {}).items():
            if not isinstance(by_target, Mapping):
                raise UsageError(f"{where}: entry {key!r} is not an object of targets")
            for target, entry in by_target.items():
                if not isinstance(entry, Mapping) or not isinstance(entry.get("apply"), bool):
                    raise UsageError(f"{where}: {key}/{target}: needs 'apply': true or false")
        try:
            return cls(data.get("entries", {}), meta={k: v for k, v in data.items() if k not in ("entries", "schema")},
                       path=path)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Table:
        from onnxopt.readers import load_json

        if not os.path.exists(path):
            raise UsageError(f"benefit table {path}: no such file")
        data = load_json(path, "benefit table")  # (bounded in size and nesting; one line otherwise)
        return cls.from_dict(data, str(path))

    def entry(self, key: str, target: str) -> dict | None:
        return self.entries.get(key, {}).get(_targets.normalize(target))

    def decide(self, key: str, target: str) -> Decision:
        target = _targets.normalize(target)
        e = self.entry(key, target)
        if e is None:
            return Decision(key, target, True, False, f"no measurement of {key} for {target} in the benefit table; "
                                                      "applied")
        ev = e.get("evidence") or {}
        return Decision(key, target, bool(e["apply"]), True, evidence_text(ev, e["apply"]), copy.deepcopy(ev))

    # -- writing

    def set(self, key: str, target: str, apply: bool, evidence: Mapping) -> None:
        if not isinstance(apply, bool):
            raise UsageError(f"{key}/{target}: apply must be true or false, not {apply!r}")
        self.entries.setdefault(str(key), {})[_targets.normalize(target)] = {
            "apply": apply, "evidence": copy.deepcopy(dict(evidence))}

    def merge(self, other: Table | Mapping, *, overwrite: bool = True) -> list[tuple[str, str]]:
        """Take ``other``'s entries (a Table or a table's dict): per key and target, the newer run
        replaces this one's (``overwrite``) or is taken only where this table has none; a replaced
        entry is kept in the new one's ``evidence["earlier"]`` (its verdict, ratio and source, first),
        so the table keeps the history of what was measured. Returns the (key, target) pairs taken."""
        other = other if isinstance(other, Table) else Table.from_dict(other)
        taken = []
        for key, by_target in other.entries.items():
            for target, e in by_target.items():
                old = self.entry(key, target)
                if overwrite or old is None:
                    evidence = dict(e["evidence"])
                    if old is not None and old["evidence"].get("source") != evidence.get("source"):
                        before = old["evidence"]
                        history = [{"apply": old["apply"], "ratio": before.get("ratio"),
                                    "source": before.get("source")}, *before.get("earlier", [])]
                        seen = {json.dumps(h.get("source"), sort_keys=True) for h in evidence.get("earlier", [])}
                        evidence["earlier"] = [*evidence.get("earlier", []),
                                               *(h for h in history if json.dumps(h.get("source"), sort_keys=True)
                                                 not in seen)]
                    self.set(key, target, e["apply"], evidence)
                    taken.append((key, target))
        return taken

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, **self.meta,
                "entries": {k: dict(sorted(v.items())) for k, v in sorted(self.entries.items())}}

    def save(self, path: str | os.PathLike) -> None:
        text = json.dumps(self.as_dict(), indent=1, sort_keys=False) + "\n"
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _fmt_ratio(r: float) -> str:
    if r > 1:
        return f"{r:.2f}x slower"
    if r < 1:
        return f"{1 / r:.2f}x faster"
    return "no faster"


def evidence_text(evidence: Mapping, apply: bool | None = None) -> str:
    """One line for a report: what was measured and where it came from."""
    parts = []
    ratio = evidence.get("ratio")
    models = evidence.get("models") or {}
    if evidence.get("summary"):
        parts.append(str(evidence["summary"]))
    elif isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0:
        what = f"measured {_fmt_ratio(ratio)}"
        per = [f"{name} {_fmt_ratio(m['ratio'])}" for name, m in models.items()
               if isinstance(m, Mapping) and isinstance(m.get("ratio"), (int, float)) and m["ratio"] > 0
               and m.get("isolated", True)]  # (a model where the runtime fuses it itself is not counted)
        if per:
            what += f" ({', '.join(per[:4])}{', ...' if len(per) > 4 else ''})"
        parts.append(what)
    else:
        parts.append("applied" if apply else "left out" if apply is not None else "")
    src = evidence.get("source") or {}
    cite = "; ".join(str(src[k]) for k in ("file" if src.get("file") else "command", "date") if src.get(k))
    if isinstance(src.get("machine"), Mapping):
        m = src["machine"]
        where = " ".join(str(m[k]) for k in ("cpu", "gpu", "logical_cores") if m.get(k))
        if where:
            cite += ("; " if cite else "") + where + (" cores" if m.get("logical_cores") and not m.get("gpu") else "")
    elif src.get("machine"):
        cite += ("; " if cite else "") + str(src["machine"])
    return f"{parts[0]} ({cite})" if cite else parts[0]


# -- the table in effect

_cache: dict[str, Table] = {}
_override: list[Table] = []


def load(path: str | os.PathLike | None = None) -> Table:
    """The table at ``path``; default: ``$ONNXOPT_BENEFIT_TABLE``, else the shipped one (cached)."""
    path = str(path or os.environ.get(ENV) or DEFAULT_PATH)
    if path not in _cache:
        if path == str(DEFAULT_PATH) and not DEFAULT_PATH.is_file():
            _cache[path] = Table(path=path)  # (a build without the data file: nothing measured)
        else:
            _cache[path] = Table.load(path)
    return _cache[path]


def current() -> Table:
    """The table rule selection consults: the innermost :func:`using`, else :func:`load`'s."""
    return _override[-1] if _override else load()


@contextlib.contextmanager
def using(table: Table | Mapping | str | os.PathLike | None) -> Iterator[Table]:
    """Select rules with ``table`` inside the block (a Table, a table's dict, a path; None: an empty
    table, so every rule with a ``benefit=`` key runs), e.g. for benchmarking a fusion the shipped
    table leaves out."""
    if table is None:
        table = Table()
    elif isinstance(table, (str, os.PathLike)):
        table = Table.load(table)
    elif not isinstance(table, Table):
        table = Table.from_dict(table)
    _override.append(table)
    try:
        yield table
    finally:
        _override.pop()


def decide(key: str, target: str, table: Table | None = None) -> Decision:
    return (table or current()).decide(key, target)
