"""The ONNX backend node test cases, offline, for the oracles that compare onnxopt with onnxruntime
(tests/test_backend_oracle.py, scripts/oracles/fold.py).

onnx's own generator (``onnx.backend.test.case.node.collect_testcases``) gives about 1,900 one-node
models (and expanded function bodies) with inputs and expected outputs. Here: collecting them,
their data as numpy arrays, baking the inputs in as initializers, and running onnxruntime CPU.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx


@functools.cache
def cases() -> dict:
    """Name -> backend test case, for every case with a model and a data set."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        collected = node.collect_testcases(None)
    return {case.name: case for case in collected if case.model is not None and case.data_sets}


def normalize(x):
    """The data sets hold numpy scalars and, for float8/4-bit/bfloat16 data, TensorProtos: arrays."""
    if isinstance(x, onnx.TensorProto):
        return onnx.numpy_helper.to_array(x)
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, list):
        return [normalize(e) for e in x]
    return x


def data(case) -> tuple[list, list]:
    """The first data set's inputs and expected outputs."""
    inputs, outputs = case.data_sets[0]
    return [normalize(x) for x in inputs], [normalize(x) for x in outputs]


def tensor_inputs(case) -> bool:
    """Every input is a plain tensor (so it can be baked in as an initializer)."""
    inputs, _ = data(case)
    return all(v.type.HasField("tensor_type") for v in case.model.graph.input) \
        and all(isinstance(x, np.ndarray) for x in inputs)


def baked(model: onnx.ModelProto, inputs) -> onnx.ModelProto:
    """``model`` with its graph inputs replaced by initializers holding ``inputs``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if out.ir_version < 4:  # initializers that are not graph inputs need IR 4
        out.ir_version = 4
    g = out.graph
    for vi, array in zip(g.input, inputs):
        g.initializer.append(onnx.numpy_helper.from_array(np.asarray(array), vi.name))
    del g.input[:]
    return out


def run(model: onnx.ModelProto, feeds: dict | None = None) -> list:
    """onnxruntime CPU's outputs, with its default session options (what a user gets)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds or {})
