"""onnxopt's version, in a module that imports nothing: the bottom of the layers, so that a module
low in them (``onnxopt.ir.io`` records the version in the models it writes) reads it without importing
the package root, which re-exports the rule language (``onnxopt.core.pattern``). ``onnxopt.__version__``
is this value; setup.cfg reads it from here without importing anything."""

__version__ = "0.1.0"
