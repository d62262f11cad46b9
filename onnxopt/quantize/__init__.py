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
  the latency check that keeps the float model when int8 is not faster.
"""
