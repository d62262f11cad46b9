"""Oracles: onnxopt's outputs checked against an independent answer (onnxruntime, exact arithmetic,
recorded hashes, measured memory). Imports onnxopt, onnxopt.models and, for their random-graph
builders, tests.helpers."""
