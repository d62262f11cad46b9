"""The import paths of onnxopt before its modules were grouped by concern (0.1: ``onnxopt.pattern``,
``onnxopt.irutil``, ``onnxopt.layout_pass``, ...) keep working: each is the moved module itself
(``import onnxopt.pattern`` gives ``onnxopt.core.pattern``, the same object), with a
DeprecationWarning naming the new path. Users' rules files written against 0.1 run unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "onnxopt.pattern": "onnxopt.core.pattern", "onnxopt.driver": "onnxopt.core.driver",
    "onnxopt.pipeline": "onnxopt.core.pipeline", "onnxopt.stats": "onnxopt.core.stats",
    "onnxopt.purity": "onnxopt.core.purity",
    "onnxopt.registry": "onnxopt.library.registry", "onnxopt.passes": "onnxopt.library.passes",
    "onnxopt.onnxscript_rules": "onnxopt.library.onnxscript_rules",
    "onnxopt.io": "onnxopt.ir.io", "onnxopt.shapes": "onnxopt.ir.shapes",
    "onnxopt.input_shapes": "onnxopt.ir.input_shapes", "onnxopt.evaluate": "onnxopt.ir.evaluate",
    "onnxopt.irutil": "onnxopt.ir.util", "onnxopt.optypes": "onnxopt.ir.optypes",
    "onnxopt.kernels": "onnxopt.ir.kernels",
    "onnxopt.benefit": "onnxopt.targets.benefit", "onnxopt.advice": "onnxopt.targets.advice",
    "onnxopt.layout": "onnxopt.transforms.edges", "onnxopt.layout_pass": "onnxopt.transforms.transposes",
    "onnxopt.precision": "onnxopt.transforms.precision", "onnxopt.memory": "onnxopt.transforms.memory",
    "onnxopt.liveness": "onnxopt.transforms.liveness", "onnxopt.recompute": "onnxopt.transforms.recompute",
    "onnxopt.bisect": "onnxopt.verify.bisect", "onnxopt.analysis": "onnxopt.inspect.analysis",
    "onnxopt.diff_live": "onnxopt.diff.live",
    "onnxopt.report": "onnxopt.reporting.text", "onnxopt.html_report": "onnxopt.reporting.html",
    "onnxopt.console": "onnxopt.reporting.console", "onnxopt.config": "onnxopt.cli.config",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the new module (no second copy: sys.modules holds one
    module under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=_stacklevel())
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the moved module is already executed


def _stacklevel() -> int:
    """The frame of the user's import statement, past importlib's own frames."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame, level = frame.f_back, level + 1
    return level


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
