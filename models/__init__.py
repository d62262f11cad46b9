"""Builders and fetchers for the models that onnxopt's tests and benchmarks use.

Installed as ``onnxopt.models``. Torch-based builders import torch lazily, so the core library
does not need it.
"""
