"""Whole-model transforms the rule language does not express: the model's edges (input/output
layout and pixel preprocessing, ``edges``), the transpose placement pass (``transposes``), float16
conversion (``precision``), and peak memory (``liveness``, ``memory``, ``recompute``).

May import: ``onnxopt.core``, ``onnxopt.ir``, ``onnxopt.targets``, ``onnxopt.errors``. Never a rule
family, quantize, verify, the API or the command line.
"""
