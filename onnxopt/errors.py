"""Errors that onnxopt reports to its users as one line."""

from __future__ import annotations


class OnnxoptError(Exception):
    """Base class: the message is a complete one-line explanation for the user."""


class InvalidModelError(OnnxoptError, ValueError):
    """The input is not a usable ONNX model (not ONNX, truncated, fails the checker, missing data)."""


class RuleError(OnnxoptError, ValueError):
    """A rule or a rules file is malformed (duplicate names, no RULES, wrong types)."""


class UsageError(OnnxoptError, ValueError):
    """The caller asked for something inconsistent (unknown rule to disable, same input and output)."""
