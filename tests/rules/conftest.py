"""tests/rules: the rule-coverage check over the built-in rules (see coverage.py)."""

from __future__ import annotations

from pathlib import Path

from onnxopt import default_rules

from .coverage import RuleCoverage


def pytest_configure(config):
    config.pluginmanager.register(RuleCoverage(Path(__file__).parent, default_rules()), "onnxopt-rule-coverage")
