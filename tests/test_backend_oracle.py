"""Correctness oracle: the ONNX backend node tests.

onnx's own generator (``onnx.backend.test.case.node.collect_testcases``) gives about 1,900 one-node
models with inputs and expected outputs, offline. For every case whose expected outputs
onnxruntime itself reproduces, onnxopt's output must reproduce them too:

- as given (the inputs stay graph inputs), and
- with the inputs baked in as initializers, so that constant folding meets every op (where every
  input is a tensor: a sequence or an optional cannot be an initializer).

Sequence and optional values are compared element by element; the few cases with maps are
skipped (onnxruntime's Python API does not take them).

All cases run by default (about a minute on two cores); ``ONNXOPT_ORACLE_SUBSET=N`` runs every
N-th case only, for a quick local loop.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

from onnxopt import optimize  # noqa: E402
from onnxopt.errors import OnnxoptError  # noqa: E402


def _cases():
    import warnings

    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases(None)
    out = {}
    for case in cases:
        if case.model is None or not case.data_sets:
            continue
        out[case.name] = case
    return out


CASES = _cases()
_STEP = int(os.environ.get("ONNXOPT_ORACLE_SUBSET", "1") or 1)
NAMES = sorted(CASES)[::_STEP]


def _normalize(x):
    """The data sets hold numpy scalars and, for float8/4-bit/bfloat16 data, TensorProtos: arrays."""
    if isinstance(x, onnx.TensorProto):
        return onnx.numpy_helper.to_array(x)
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, list):
        return [_normalize(e) for e in x]
    return x


def _data(case):
    inputs, outputs = case.data_sets[0]
    return [_normalize(x) for x in inputs], [_normalize(x) for x in outputs]


def _tensor_inputs(case) -> bool:
    """Every input is a plain tensor (so it can be baked in as an initializer)."""
    g = case.model.graph
    inputs, _ = _data(case)
    return all(v.type.HasField("tensor_type") for v in g.input) and all(isinstance(x, np.ndarray) for x in inputs)


def _supported(case) -> bool:
    """Values onnxruntime's Python API takes and gives: tensors, sequences of tensors, optionals."""
    def ok(x):
        return x is None or isinstance(x, np.ndarray) or (isinstance(x, list) and all(isinstance(e, np.ndarray) for e in x))

    inputs, outputs = _data(case)
    return all(ok(x) for x in list(inputs) + list(outputs))


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _matches(expected, got, rtol, atol) -> str | None:
    if len(expected) != len(got):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        if e is None or g is None:  # an empty optional
            if e is not g:
                return f"output {i}: {'empty' if g is None else 'a value'}, expected {'empty' if e is None else 'a value'}"
            continue
        if isinstance(e, list) or isinstance(g, list):  # a sequence: element by element
            if not (isinstance(e, list) and isinstance(g, list)):
                return f"output {i}: sequence and tensor"
            reason = _matches(e, g, rtol, atol)
            if reason is not None:
                return f"output {i} element {reason}"
            continue
        g = np.asarray(g)
        if e.dtype != g.dtype and not (e.dtype == object or g.dtype == object):
            return f"output {i}: dtype {g.dtype}, expected {e.dtype}"
        if e.shape != g.shape:
            return f"output {i}: shape {g.shape}, expected {e.shape}"
        if e.dtype == object or e.dtype.kind in "USb":
            if not np.array_equal(e, g):
                return f"output {i}: values differ"
            continue
        try:
            np.testing.assert_allclose(g.astype(np.float64) if g.dtype.kind == "f" and g.itemsize < 4 else g,
                                       e.astype(np.float64) if e.dtype.kind == "f" and e.itemsize < 4 else e,
                                       rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as exc:
            return f"output {i}: {str(exc).strip().splitlines()[-1][:200]}"
        except TypeError:
            if not np.array_equal(e, g):
                return f"output {i}: values differ"
    return None


def _baked(model: onnx.ModelProto, inputs) -> onnx.ModelProto:
    baked = onnx.ModelProto()
    baked.CopyFrom(model)
    if baked.ir_version < 4:  # initializers that are not graph inputs need IR 4
        baked.ir_version = 4
    g = baked.graph
    names = [v.name for v in g.input]
    for name, array in zip(names, inputs):
        g.initializer.append(onnx.numpy_helper.from_array(array, name))
    del g.input[:]
    return baked


@pytest.mark.parametrize("name", NAMES)
def test_backend_node_case(name):
    case = CASES[name]
    if not _supported(case):
        pytest.skip("map values or sequences of maps")
    model = case.model
    inputs, expected = _data(case)
    feeds = {v.name: x for v, x in zip(model.graph.input, inputs)}
    rtol, atol = case.rtol, case.atol
    try:
        reference = _run(model, feeds)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"onnxruntime cannot run the original: {str(exc).splitlines()[0][:120]}")
    if _matches(expected, reference, rtol, atol) is not None:
        pytest.skip("onnxruntime does not reproduce the expected outputs")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError:
        pytest.skip("the case fails the ONNX checker")

    failures = []
    variants = [("as given", model, feeds)]
    if _tensor_inputs(case):  # sequences and optionals cannot be initializers
        variants.append(("inputs baked in", _baked(model, inputs), {}))
    for variant, source, run_feeds in variants:
        try:
            optimized = optimize(source)
        except OnnxoptError as exc:
            failures.append(f"{variant}: optimize failed: {exc}")
            continue
        try:
            got = _run(optimized, run_feeds)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{variant}: onnxruntime rejects the result: {str(exc).splitlines()[0][:200]}")
            continue
        reason = _matches(expected, got, rtol, atol)
        if reason is not None:
            failures.append(f"{variant}: {reason}")
    assert not failures, "; ".join(failures)
