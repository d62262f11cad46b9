"""Benchmarks: onnxopt against its peers and against itself (``python -m scripts.bench.peers --help``, ...).
Imports onnxopt, onnxopt.models and the other scripts (``scripts.bench._peers``, ...); writes under
scripts/results/ and BENCHMARKS.md only when asked."""
