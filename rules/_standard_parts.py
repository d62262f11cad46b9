"""What the ``portable`` fusions into the standard opset-23 operators share (rules/standard_*.py):
the one refusal they all make before writing a standard op.

``portable`` promises standard ONNX ops only, so these rules write ``RMSNormalization``,
``RotaryEmbedding`` and ``Attention`` (all since opset 23) and nothing from com.microsoft. Two facts
gate them, checked here, each refused with its reason:

- the model imports the default domain at opset 23 or more (the rule never raises a model's opset:
  an opset-23 op in an older model is not valid ONNX);
- the installed onnxruntime registers a kernel for the op at the model's opset and element type
  (``kernel`` in rules/_semantic.py, asked for its CPU provider: the runtime this project verifies
  portable outputs on). Where it cannot tell (no onnxruntime), the rule is refused too: an op no
  runtime here can run is not verified.

May import rules/_semantic.py and onnxopt.targets only.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxopt.rules._semantic import kernel
from onnxopt.targets import ORT_CPU

STANDARD_OPSET = 23  # RMSNormalization, RotaryEmbedding and Attention enter the default domain here


def standard_refusal(op: str, opset: int, dtype: ir.DataType | None) -> str | None:
    """Why the standard ``op`` cannot be written into a model importing ``opset`` for ``dtype``, else None."""
    if opset < STANDARD_OPSET:
        return f"{op} is a standard op from opset {STANDARD_OPSET}; the model imports opset {opset}"
    has = kernel(op, "", opset, ORT_CPU, dtype)
    what = dtype.name.lower() if dtype is not None else "an unknown type"
    if has is None:
        return f"cannot tell whether the installed onnxruntime runs {op}-{opset} (no kernel listing)"
    if not has:
        return f"the installed onnxruntime has no {op}-{opset} kernel for {what}"
    return None
