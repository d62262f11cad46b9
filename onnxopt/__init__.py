"""onnxopt: declarative ONNX graph rewriting with proof on onnxruntime.

The rule language (``Rule``, ``Op``, ``Const``, ...) and the errors load with the package; the
optimizer (``optimize``, ``Report``, ``default_rules``) loads on first use, so that a rules file or
``import onnxopt.core.pattern`` pays for neither the evaluator, the verifier, onnxruntime nor the
built-in rule library.
"""

from onnxopt._version import __version__  # noqa: E402,F401


from . import _compat  # noqa: E402

_compat.install()  # the 0.1 import paths (onnxopt.pattern, onnxopt.irutil, ...): onnxopt._compat

from onnxopt.errors import InvalidModelError, OnnxoptError, RuleError, UsageError  # noqa: E402
from onnxopt.core.pattern import (ANY, Absorbed, All, Around, Builder, Const, Explain, Match, Not, Op, Opt,  # noqa: E402
                                  Or, Refuse, Repeat, Rule, Var, forward)

_LAZY = {"optimize": "api", "Report": "api", "default_rules": "api"}


def __getattr__(name: str):
    """``optimize``, ``Report`` and ``default_rules`` from onnxopt.api, imported when first asked for;
    ``quantize``, the subpackage that is also a function (``onnxopt.quantize(model, calibration)``)."""
    if name == "quantize":
        import importlib

        return importlib.import_module(".quantize", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxopt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ANY", "Absorbed", "All", "Around", "Builder", "Const", "Explain", "Not", "Or", "Repeat", "InvalidModelError", "Match", "Op", "OnnxoptError", "Opt", "Refuse",
    "Report", "Rule", "RuleError", "UsageError", "Var", "default_rules", "forward", "optimize",
    "quantize",
]
