"""Finding rules: the built-in library, users' rules files (onnxopt's rules and onnxscript's), and
selection by name and target."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from onnxopt.core import passes
from onnxopt.library import passes as _builtin_passes  # noqa: F401  (registers the built-in passes)
from onnxopt.errors import RuleError, UsageError
from onnxopt import targets as _targets
from onnxopt.core.pattern import Rule


def builtin_rules() -> list[Rule]:
    """The rules shipped in onnxopt's rule library (``rules/``, installed as ``onnxopt.rules``)."""
    try:
        from onnxopt.rules import RULES
    except ModuleNotFoundError as exc:
        if exc.name != "onnxopt.rules":
            raise
        import onnxopt

        raise UsageError(f"onnxopt's rule library (onnxopt.rules) is not installed: {Path(onnxopt.__file__).parent} "
                         f"is a source checkout's; run `pip install -e .` in the checkout (setup.cfg maps rules/ "
                         f"to onnxopt.rules)") from None
    return list(RULES)


def as_rules(rules, what: str = "rules") -> list[Rule]:
    """``rules`` as onnxopt Rules: its Rules as they are, onnxscript's RewriteRule and
    RewriteRuleSet (``rules`` may be one of them) made Rules by ``onnxopt.library.onnxscript_rules``;
    anything else is a RuleError naming ``what`` held it."""
    if _is_onnxscript(rules):
        rules = [rules]
    try:
        rules = list(rules)
    except TypeError:
        raise RuleError(f"{what}: {type(rules).__name__} is not a list of rules") from None
    foreign = [r for r in rules if _is_onnxscript(r)]
    bad = [r for r in rules if not isinstance(r, Rule) and not _is_onnxscript(r)]
    if bad:
        raise RuleError(f"{what} holds {type(bad[0]).__name__}, not Rule")
    if not foreign:
        return rules
    from onnxopt.library import onnxscript_rules

    return [r for r in rules if isinstance(r, Rule)] + onnxscript_rules.from_onnxscript(foreign)


def _is_onnxscript(obj) -> bool:
    """One of onnxscript's objects (it was imported, or the object could not exist)."""
    if "onnxscript" not in sys.modules:
        return False
    from onnxopt.library import onnxscript_rules

    return onnxscript_rules.is_onnxscript(obj)


def load_rules_file(path: str | os.PathLike) -> list[Rule]:
    """Import a Python file and return its ``RULES`` list (or, lacking one, every Rule it defines),
    onnxscript's RewriteRule and RewriteRuleSet among them (see :func:`as_rules`)."""
    path = Path(path)
    if not path.is_file():
        raise RuleError(f"rules file {path}: no such file")
    module_name = f"onnxopt_user_rules_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RuleError(f"rules file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's code (even sys.exit()): report it on one line
        sys.modules.pop(module_name, None)
        raise RuleError(f"rules file {path}: raised {type(exc).__name__}: {exc}" if isinstance(exc, SystemExit)
                        else f"rules file {path}: {type(exc).__name__}: {exc}") from None
    rules = getattr(module, "RULES", None)
    if rules is None:
        rules = [v for v in vars(module).values() if isinstance(v, Rule) or _is_rewrite_rule(v)]
    try:
        rules = as_rules(rules, f"rules file {path}: RULES")
    except RuleError as exc:
        raise RuleError(str(exc) if str(exc).startswith("rules file") else f"rules file {path}: {exc}") from None
    if not rules:
        raise RuleError(f"rules file {path}: defines no rules")
    return rules


def _is_rewrite_rule(obj) -> bool:
    return _is_onnxscript(obj) and type(obj).__name__ == "RewriteRule"


def resolve(rules: Sequence[Rule] | None = None, extra_rules: Sequence[Rule] = (), disable: Iterable[str] = (),
            target: str | None = None, graph_passes: Iterable[str] | None = None, exact: bool = False,
            skipped: list[dict] | None = None) -> tuple[list[Rule], list[str]]:
    """The rules and whole-graph passes one optimization runs: ``rules`` (default: the built-in
    library) plus ``extra_rules``, less those ``disable`` names (rules or passes), those not valid
    for ``target`` and, with ``exact``, those not declared exact; the passes named (default: all of
    the registered ones, ``onnxopt.core.passes``, with the built-in library, none with an explicit
    rule list) less the disabled ones, those not for ``target`` (``Pass.targets``) and, with
    ``exact``, those not declared exact. ``skipped``: a list :func:`select` records the rules
    left out for the target in (see there)."""
    disable = list(disable)
    base = builtin_rules() if rules is None else as_rules(rules)
    chosen = select([*base, *as_rules(extra_rules, "extra_rules")],
                    disable=[d for d in disable if passes.get(d) is None], target=target, exact=exact,
                    skipped=skipped)
    if graph_passes is None:
        graph_passes = passes.names() if rules is None else ()
    target = _targets.normalize(target)
    return chosen, [name for name in graph_passes if name not in disable and _for_target(name, target)
                    and (not exact or _exact_pass(name))]


def _exact_pass(name: str) -> bool:
    p = passes.get(name)
    return p is not None and p.exact is True


def _for_target(name: str, target: str) -> bool:
    p = passes.get(name)
    return p is None or p.runs_for(target)  # (an unknown name is the pipeline's error)


def select(rules: Sequence[Rule], *, disable: Iterable[str] = (), target: str | None = None,
           exact: bool = False, skipped: list[dict] | None = None, table=None) -> list[Rule]:
    """Drop disabled rules (unknown names are an error), rules not valid for ``target``
    (``onnxopt.targets``: portable by default; cpu and cuda are aliases of ort-cpu and ort-cuda),
    rules whose ``benefit`` key the measured benefit table (``onnxopt.targets.benefit``; ``table``, default
    the one in effect) says does not pay on ``target`` and, with ``exact``, rules not declared exact
    (``Rule.exact`` False or undeclared).

    ``skipped``: a list to record the rules left out for the target in, one dict each:
    ``{"rule", "why": "target", "reason"}`` for a rule not valid there, ``{"rule", "why": "benefit",
    "key", "reason", "evidence"}`` for one the table leaves out (the reason cites the measurement).
    A rule with a ``benefit`` key the table has not measured for the target runs."""
    from onnxopt.targets import benefit as _benefit

    names = {r.name for r in rules}
    disable = set(disable)
    unknown = sorted(disable - names)
    if unknown:
        raise UsageError(f"unknown rule(s) to disable: {', '.join(unknown)} (see --list-rules)")
    target = _targets.normalize(target)
    table = table or _benefit.current()
    chosen = []
    for r in rules:
        if r.name in disable:
            continue
        if target not in r.targets:
            if skipped is not None:
                valid = ", ".join(t for t in _targets.TARGETS if t in r.targets)
                skipped.append({"rule": r.name, "why": "target",
                                "reason": f"{r.name}: not valid for {target} (valid for {valid})"})
            continue
        if exact and r.exact is not True:
            continue
        if r.benefit is not None:
            d = table.decide(r.benefit, target)
            if not d.apply:
                if skipped is not None:
                    skipped.append({"rule": r.name, "why": "benefit", "key": r.benefit,
                                    "reason": f"{r.name}: skipped for {target}: {d.reason}", "evidence": d.evidence})
                continue
        chosen.append(r)
    return chosen


def undeclared(rules: Iterable[Rule]) -> list[str]:
    """The names of ``rules`` that do not say whether they are exact (exact mode leaves them out)."""
    return [r.name for r in rules if r.exact is None]
