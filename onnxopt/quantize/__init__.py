"""INT8 post-training quantization: calibration (streaming, mergeable), QDQ planning, fidelity
fallback and integer-kernel coverage.

Modules:
- ``data``: calibration data sources (a folder of .npy/.npz, one .npz, an iterable of feed dicts,
  an onnxruntime CalibrationDataReader), validated against the model.
- ``calibrate``: two-pass streaming statistics (ranges, then histograms on fixed bin edges) that
  shard and merge exactly; the methods minmax, percentile, entropy and mse.
- ``plan``: target knowledge (``ort-cpu``) and the plan of which tensors get which scale and zero
  point; the QDQ rewrite itself is the rule family ``rules/qdq.py``.
- ``coverage``: which nodes onnxruntime runs as integer kernels and which stay float, and why.
- ``fidelity``: per-layer and output SQNR, fallback to float until a fidelity target is met, and
  the keep-float decision (from the shipped cost table, or timed when asked) that keeps the float
  model when int8 is not faster.

The package is also the function: ``onnxopt.quantize(model, calibration, ...)`` calls
:func:`onnxopt.quantize.api.quantize` (so does ``from onnxopt import quantize; quantize(...)``),
while ``onnxopt.quantize.calibrate`` and the others stay importable modules.
"""

import sys as _sys
import types as _types


def quantize(model, calibration, **options):
    """INT8 quantization with calibration; see :func:`onnxopt.quantize.api.quantize`."""
    from onnxopt.quantize.api import quantize as _quantize

    return _quantize(model, calibration, **options)


class _CallableModule(_types.ModuleType):
    def __call__(self, model, calibration, **options):
        return quantize(model, calibration, **options)


_sys.modules[__name__].__class__ = _CallableModule
