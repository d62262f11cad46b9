"""onnxopt: declarative ONNX graph rewriting with proof on onnxruntime."""

__version__ = "0.1.0"

from .api import Report, default_rules, optimize  # noqa: E402
from .errors import InvalidModelError, OnnxoptError, RuleError, UsageError  # noqa: E402
from .pattern import ANY, Builder, Const, Match, Op, Opt, Refuse, Rule, Var  # noqa: E402
from . import rules as _rules  # noqa: E402,F401  (the built-in library, loaded with the package)

__all__ = [
    "ANY", "Builder", "Const", "InvalidModelError", "Match", "Op", "OnnxoptError", "Opt", "Refuse",
    "Report", "Rule", "RuleError", "UsageError", "Var", "default_rules", "optimize",
]
