"""The import paths of onnxopt before its modules were grouped by concern (0.1: ``onnxopt.pattern``,
``onnxopt.irutil``, ``onnxopt.layout_pass``, ...) keep working: each is the moved module itself
(``import onnxopt.pattern`` gives ``onnxopt.core.pattern``, the same object), with a
DeprecationWarning naming the new path. Users' rules files written against 0.1 run unchanged
(tests/test_compat.py lists every 0.1 path).

One exception: a 0.1 module some of whose names moved to a layer its new home may not import
(``onnxopt.precision``'s measured conversion went to ``onnxopt.verify.fp16_fallback``, above
``onnxopt.transforms``) is a stand-in module (:class:`_Facade`): every name of the new module
through it, and each of those names from its new home, with a second warning naming that home.

Nothing of onnxopt imports this module's paths; it sits outside the layers (setup.cfg's
``[importlinter]``) and imports the new modules only when an old path is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
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

# 0.1 names that did not go where their module went, because its new home may not import theirs (a layer
# above it): old path -> name -> the module holding the name now.
MOVED_NAMES = {
    "onnxopt.precision": {"convert_fp16_checked": "onnxopt.verify.fp16_fallback",
                          "MAX_CANDIDATES": "onnxopt.verify.fp16_fallback"},
}


class _Facade(types.ModuleType):
    """An old path whose names are now in two modules: MOVED's (read through) and MOVED_NAMES'."""

    def __getattr__(self, name: str):
        home = MOVED_NAMES[self.__name__].get(name)
        if home is None:
            return getattr(importlib.import_module(MOVED[self.__name__]), name)
        warnings.warn(f"{self.__name__}.{name} moved to {home}.{name}; import it from there (the old path will be "
                      "removed)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    def __dir__(self):
        return sorted(set(dir(importlib.import_module(MOVED[self.__name__]))) | set(MOVED_NAMES[self.__name__]))


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the new module (no second copy: sys.modules holds one
    module under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name]
        # stacklevel 2: the user's import statement (warnings skips importlib's own frames)
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        if spec.name in MOVED_NAMES:
            return _Facade(spec.name, module.__doc__)
        spec.loader_state = module.__spec__  # importlib sets __spec__ to the old path's: exec_module puts it back
        return module

    def exec_module(self, module):
        # the moved module is already executed; its own spec (name, origin) stays its own
        if module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
