"""Errors that onnxopt reports to its users as one line."""

from __future__ import annotations

import os


class OnnxoptError(Exception):
    """Base class: the message is a complete one-line explanation for the user."""


class InvalidModelError(OnnxoptError, ValueError):
    """The input is not a usable ONNX model (not ONNX, truncated, fails the checker, missing data)."""


class RuleError(OnnxoptError, ValueError):
    """A rule or a rules file is malformed (duplicate names, no RULES, wrong types)."""


class UsageError(OnnxoptError, ValueError):
    """The caller asked for something inconsistent (unknown rule to disable, same input and output)."""


def strict_default(strict: bool | None) -> bool:
    """Whether a rule bug raises: ``strict`` when given, else the environment variable
    ``ONNXOPT_STRICT=1`` (on in onnxopt's test suite)."""
    return os.environ.get("ONNXOPT_STRICT") == "1" if strict is None else bool(strict)


class RuleBug(RuleError):
    """A rule's condition or replacement raised something other than ``Refuse``: a bug in the
    rule. Raised with ``strict``; otherwise recorded (``DriverResult.errors``) and the rule skipped
    at that node."""

    def __init__(self, rule: str, node: str, phase: str, exc: BaseException):
        self.rule, self.node, self.phase = rule, node, phase
        self.exception = f"{type(exc).__name__}: {exc}"
        super().__init__(f"rule {rule} raised {self.exception} in its {phase} at node {node!r}")


    def as_dict(self) -> dict:
        return {"rule": self.rule, "node": self.node, "phase": self.phase, "exception": self.exception}


def bug_warnings(bugs: "list[RuleBug]") -> list[str]:
    """The warning lines of a run that went on past rule bugs (not strict): one per rule, phase and
    exception, with how many nodes it happened at (a typo in a condition meets every node)."""
    groups: dict[tuple, list[RuleBug]] = {}
    for bug in bugs:
        groups.setdefault((bug.rule, bug.phase, bug.exception), []).append(bug)
    lines = []
    for (rule, phase, exception), met in groups.items():
        where = f"at node {met[0].node!r}" if len(met) == 1 else f"at {len(met)} nodes (the first {met[0].node!r})"
        lines.append(f"rule {rule} raised {exception} in its {phase} {where}: a bug in the rule, skipped there")
    return lines


def feeds_text(feeds, declared=None) -> str:
    """" at inputs x 1x3x48x192 float32 (the model declares x ?x3x?x? float)": the shapes a run of the user's
    data used, and the model's declared ones (``declared``: onnx ValueInfoProtos or onnxruntime NodeArgs),
    for a one-line message about onnxruntime refusing to run them."""
    def dims(shape) -> str:
        return "x".join(str(d) if isinstance(d, int) and d >= 0 else "?" for d in shape) if len(shape) else "scalar"

    given = ", ".join(f"{k} {dims(getattr(v, 'shape', ()))} {getattr(v, 'dtype', type(v).__name__)}"
                      for k, v in (feeds or {}).items())
    text = f" at inputs {given}" if given else ""
    shown = []
    for d in declared or ():
        if hasattr(d, "type") and hasattr(d.type, "tensor_type"):  # onnx ValueInfoProto
            shape = [x.dim_value if x.HasField("dim_value") else None for x in d.type.tensor_type.shape.dim]
        else:  # onnxruntime NodeArg
            shape = [x if isinstance(x, int) else None for x in (d.shape or [])]
        shown.append(f"{d.name} {dims([-1 if s is None else s for s in shape])}")
    return text + (f" (the model declares {', '.join(shown)}; '?' is any size, but its layers may need "
                   f"particular sizes)" if shown else "")
