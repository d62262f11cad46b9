"""Tests of the rule library, one file per family of rules/ (test_cast.py for rules/cast.py...).

A package so that its file names may repeat those of tests/ (test_folding.py). check.py is the
one way these tests run a rule; coverage.py checks that every rule fires and is refused somewhere
here (registered by conftest.py).
"""
