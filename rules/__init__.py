"""The built-in rule library: one module per family, each exporting ``RULES``.

Modules are discovered in name order, so adding a family is adding a file; adding a rule to a
family touches only that family's file.
"""

from __future__ import annotations

import importlib
import pkgutil

from onnxopt.core.pattern import Rule


def _discover() -> list[Rule]:
    rules: list[Rule] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        rules.extend(getattr(module, "RULES", ()))
    return rules


RULES: list[Rule] = _discover()
