"""Rule coverage: every rule fires in some test of a directory, every rule that can refuse (it
has a condition, or its replacement raises Refuse) is refused in some test there, and every rule
declared exact (``Rule.exact``) is shown bit-identical under onnxruntime's default settings in
some test there (``prove_exact``, which tests/rules/check.py's ``fires`` calls once it has
checked the bits).

``RuleCoverage(directory, rules)`` is a pytest plugin (tests/rules/conftest.py registers it for
tests/rules/ and the built-in rules). While a test of the directory runs it records, from the
driver's statistics of every ``onnxopt.core.pipeline.run`` (each ``optimize``), the rules that fired
and those that were refused, by test. When the session collected every test of the directory
(no node ids, nothing deselected by -k, -m, --deselect or --lf), it adds one last item, ``rule
coverage``, which fails naming each rule that never fired or never refused; a session that runs
only part of the directory, or none of it, checks nothing. ``ONNXOPT_RULE_COVERAGE=1`` prints the
table (rule: the tests it fired in, the tests it was refused in) at the end.

Only the rule objects given count (a test's own rule of the same name does not), and only runs
that returned (a run a rule bug stopped records nothing).
"""

from __future__ import annotations

import dis
import os
import types
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from onnxopt.core import pipeline
from onnxopt.core.pattern import Refuse, Rule

ENV_TABLE = "ONNXOPT_RULE_COVERAGE"


def can_refuse(rule: Rule) -> bool:
    """The rule has a condition, or its replacement (or a function of its module it calls, at any
    depth) raises ``Refuse``."""
    return rule.condition is not None or _raises_refuse(rule.replacement, set())


def _raises_refuse(func, seen: set) -> bool:
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _global_names(code)
    found = getattr(func, "__globals__", {})
    if any(found.get(n) is Refuse for n in names):
        return True
    return any(isinstance(found.get(n), types.FunctionType) and _raises_refuse(found[n], seen) for n in names)


def _global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and the functions defined in it) loads."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def gaps(rules: Sequence[Rule], fired: dict[str, Iterable], refused: dict[str, Iterable],
         proven: dict[str, Iterable] | None = None) -> list[str]:
    """One line per rule that never fired, or can refuse and never was refused, or (with
    ``proven``) is declared exact and was never shown bit-identical."""
    lines = []
    for rule in rules:
        missing = []
        if not fired.get(rule.name):
            missing.append("never fired")
        if can_refuse(rule) and not refused.get(rule.name):
            missing.append("never refused (it has a condition)" if rule.condition is not None
                           else "never refused (its replacement can refuse)")
        if proven is not None and rule.exact and not proven.get(rule.name):
            missing.append("declared exact, never shown bit-identical under onnxruntime's default settings")
        if missing:
            lines.append(f"{rule.name}: {' and '.join(missing)}")
    return lines


def table(rules: Sequence[Rule], fired: dict[str, Iterable], refused: dict[str, Iterable], examples: int = 2,
          proven: dict[str, Iterable] | None = None) -> list[str]:
    """One line per rule: in how many tests it fired and was refused (and, for a rule declared
    exact, shown bit-identical), and the first few of them."""

    def tests(ids) -> str:
        names = sorted(i.split("::", 1)[-1] for i in ids)
        return ", ".join(names[:examples]) + (", ..." if len(names) > examples else "")

    lines = []
    for rule in rules:
        f, r = fired.get(rule.name, ()), refused.get(rule.name, ())
        refusals = f"refused in {len(r):>3}" + ("" if can_refuse(rule) else " (cannot refuse: the driver's)")
        exact = f", exact in {len(proven.get(rule.name, ())):>3}" if proven is not None and rule.exact else ""
        lines.append(f"{rule.name:<26} fired in {len(f):>3}, {refusals}{exact}  [{tests(f)}] [{tests(r)}]")
    return lines


class _Check(pytest.Item):
    """The last item of a session that collected all of the directory: fails on a gap."""

    def __init__(self, *, coverage: RuleCoverage, **kw):
        super().__init__(**kw)
        self.coverage = coverage

    def runtest(self) -> None:
        lines = self.coverage.gaps()
        if lines:
            raise _Gap(lines)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, _Gap):
            where = os.path.relpath(self.coverage.directory, self.config.rootpath)
            return (f"{len(excinfo.value.lines)} rule(s) lack a test in {where}/ (over its "
                    f"{self.coverage.runs} optimize() runs):\n  " + "\n  ".join(excinfo.value.lines)
                    + "\n(a test there that makes the rule fire, or refuse, closes the gap)")
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, "rule coverage"


class _Gap(Exception):
    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


_ACTIVE: list[RuleCoverage] = []  # the plugins of this session (prove_exact reports to them)


def prove_exact(rule_name: str) -> None:
    """Record that the test running now showed the rule ``rule_name`` (declared exact) give the
    same bits under onnxruntime's default settings."""
    for plugin in _ACTIVE:
        plugin.proved(rule_name)


class RuleCoverage:
    """The pytest plugin; see the module docstring."""

    def __init__(self, directory: Path, rules: Sequence[Rule]):
        self.directory = Path(directory).resolve()
        self.rules = list(rules)
        self._names = {rule: rule.name for rule in self.rules}
        self.fired: dict[str, set[str]] = {r.name: set() for r in self.rules}
        self.refused: dict[str, set[str]] = {r.name: set() for r in self.rules}
        self.proven: dict[str, set[str]] = {r.name: set() for r in self.rules}
        self.runs = 0
        self._test: str | None = None  # the node id of the test of the directory running now
        self._deselected = False
        self._run = pipeline.run

    # -- recording ----------------------------------------------------------------------------
    def pytest_configure(self, config) -> None:
        pipeline.run = self._recording_run
        _ACTIVE.append(self)

    def pytest_unconfigure(self, config) -> None:
        pipeline.run = self._run
        _ACTIVE.remove(self)

    def proved(self, rule_name: str) -> None:
        if self._test is not None and rule_name in self.proven:
            self.proven[rule_name].add(self._test)

    def _recording_run(self, model, rules, **kw):
        rules = list(rules)
        result = self._run(model, rules, **kw)
        if self._test is not None:
            self.runs += 1
            for rule in rules:
                name = self._names.get(rule)
                st = result.rules.get(name) if name is not None else None
                if st is not None and st.fired:
                    self.fired[name].add(self._test)
                if st is not None and st.refused:
                    self.refused[name].add(self._test)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self._test = item.nodeid if self._inside(item.path) and not isinstance(item, _Check) else None
        try:
            return (yield)
        finally:
            self._test = None

    def gaps(self) -> list[str]:
        return gaps(self.rules, self.fired, self.refused, self.proven)

    # -- is the whole directory in the session? --------------------------------------------------
    def _inside(self, path) -> bool:
        return Path(path).resolve().is_relative_to(self.directory)

    def pytest_deselected(self, items) -> None:
        if any(self._inside(item.path) for item in items):
            self._deselected = True

    @pytest.hookimpl(trylast=True)  # after -k, -m, --deselect and --lf took their share
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        if hasattr(config, "workerinput"):
            return  # a pytest-xdist worker runs only its share of the tests
        files = {Path(item.path).resolve() for item in items if self._inside(item.path)}
        whole = files and files == set(self.directory.rglob("test_*.py")) and not self._deselected and not any(
            "::" in arg and self._inside(Path(config.invocation_params.dir, arg.split("::")[0]))
            for arg in config.args)
        if whole:
            last = next(item for item in reversed(items) if self._inside(item.path))
            parent = next(node for node in last.listchain() if Path(node.path).resolve() == self.directory)
            items.append(_Check.from_parent(parent, name="rule coverage", coverage=self))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if os.environ.get(ENV_TABLE) == "1":
            terminalreporter.section(f"rule coverage of {self.directory.name}/")
            for line in table(self.rules, self.fired, self.refused, proven=self.proven):
                terminalreporter.line(line)
