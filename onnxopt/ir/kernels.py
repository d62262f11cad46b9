"""What the installed onnxruntime registers: its kernel definitions (op, domain, opset range,
provider, the types they take), read once per process.

onnxruntime lists them through ``get_all_opkernel_def()``. On a GPU build that enumeration loads
every provider library the wheel ships, and where one cannot load (onnxruntime-gpu's TensorRT
provider without TensorRT installed: "libnvinfer.so.10: cannot open shared object file") the
process dies of a segmentation fault, which no ``try`` catches. So a build with providers beyond
the CPU's is asked in a child process; if the child dies, the answer is None ("cannot tell"), as
for an onnxruntime without the function. A CPU-only build is asked in this process.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

Kernel = tuple[str, str, int, int, str, tuple[str, ...]]  # op, domain ("" for ai.onnx), lo, hi, provider, types

_SAFE_PROVIDERS = {"CPUExecutionProvider", "AzureExecutionProvider"}

_CHILD = """
import json, sys
from onnxruntime.capi import onnxruntime_pybind11_state as C
out = [(k.op_name, k.domain, *k.version_range, k.provider, sorted({t for ts in k.type_constraints.values() for t in ts}))
       for k in C.get_all_opkernel_def()]
sys.stdout.write(json.dumps(out))
"""


def _norm(op, domain, lo, hi, provider, types) -> Kernel:
    return (op, "" if domain == "ai.onnx" else domain, int(lo), int(hi), provider, tuple(types))


@functools.cache
def kernel_defs() -> tuple[Kernel, ...] | None:
    """Every kernel the installed onnxruntime registers, or None when it cannot tell (not
    installed, a build without the listing, or one whose listing crashes)."""
    try:
        import onnxruntime
        from onnxruntime.capi import onnxruntime_pybind11_state as C
    except Exception:  # noqa: BLE001 - absent or broken: cannot tell
        return None
    if not hasattr(C, "get_all_opkernel_def"):
        return None
    try:
        providers = set(onnxruntime.get_available_providers())
    except Exception:  # noqa: BLE001
        providers = {"?"}
    if providers <= _SAFE_PROVIDERS:
        try:
            return tuple(_norm(k.op_name, k.domain, *k.version_range, k.provider,
                               sorted({t for ts in k.type_constraints.values() for t in ts}))
                         for k in C.get_all_opkernel_def())
        except Exception:  # noqa: BLE001
            return None
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, timeout=120, text=True)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    try:
        return tuple(_norm(*k) for k in json.loads(done.stdout))
    except (ValueError, TypeError):
        return None
