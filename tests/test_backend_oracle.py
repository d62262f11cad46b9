"""Correctness oracle: the ONNX backend node tests.

onnx's own generator gives about 1,900 one-node models with inputs and expected outputs, offline
(``scripts/oracles/_backend_cases.py``, shared with the folding oracle ``scripts/oracles/fold.py``). For
every case whose expected outputs onnxruntime itself reproduces, onnxopt's output must reproduce them too:

- as given (the inputs stay graph inputs), and
- with the inputs baked in as initializers, so that constant folding meets every op (where every
  input is a tensor: a sequence or an optional cannot be an initializer).

Sequence and optional values are compared element by element; the few cases with maps are
skipped (onnxruntime's Python API does not take them).

By default (CI) a deterministic representative subset runs: the first case (by name) of every
(domain, op type, expanded or not) -- so every op onnx generates cases for, as one node and as its
expanded function body -- and every ``SPREAD``-th case besides (about 290 of the ~1,900 cases).
The whole set: ``ONNXOPT_FULL=1 python -m pytest -q tests/test_backend_oracle.py`` (about three
minutes on two cores); ``ONNXOPT_ORACLE_SUBSET=N`` runs every N-th case only.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

from onnxopt import optimize  # noqa: E402
from onnxopt.errors import OnnxoptError  # noqa: E402

from scripts.oracles import _backend_cases as backend  # noqa: E402


CASES = backend.cases()
SPREAD = 20  # the CI subset: besides one case per (domain, op, expanded), every SPREAD-th case


def representative(names: list[str]) -> list[str]:
    """The first case of every (domain, op type of its first node, expanded) and every SPREAD-th case,
    in name order."""
    first: dict[tuple, str] = {}
    for name in names:
        graph = CASES[name].model.graph
        key = (graph.node[0].domain, graph.node[0].op_type, name.endswith("_expanded") or len(graph.node) > 1)
        first.setdefault(key, name)
    keep = set(first.values()) | set(names[::SPREAD])
    return [n for n in names if n in keep]


_STEP = int(os.environ.get("ONNXOPT_ORACLE_SUBSET", "0") or 0)
if os.environ.get("ONNXOPT_FULL") == "1":
    NAMES = sorted(CASES)
elif _STEP > 0:
    NAMES = sorted(CASES)[::_STEP]
else:
    NAMES = representative(sorted(CASES))


def _supported(case) -> bool:
    """Values onnxruntime's Python API takes and gives: tensors, sequences of tensors, optionals."""
    def ok(x):
        return x is None or isinstance(x, np.ndarray) or (isinstance(x, list) and all(isinstance(e, np.ndarray) for e in x))

    inputs, outputs = backend.data(case)
    return all(ok(x) for x in list(inputs) + list(outputs))


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


@pytest.mark.parametrize("name", NAMES)
def test_backend_node_case(name):
    case = CASES[name]
    if not _supported(case):
        pytest.skip("map values or sequences of maps")
    model = case.model
    inputs, expected = backend.data(case)
    feeds = {v.name: x for v, x in zip(model.graph.input, inputs)}
    rtol, atol = case.rtol, case.atol
    try:
        reference = backend.run(model, feeds)
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
    if backend.tensor_inputs(case):  # sequences and optionals cannot be initializers
        variants.append(("inputs baked in", backend.baked(model, inputs), {}))
    for variant, source, run_feeds in variants:
        try:
            optimized = optimize(source)
        except OnnxoptError as exc:
            failures.append(f"{variant}: optimize failed: {exc}")
            continue
        try:
            got = backend.run(optimized, run_feeds)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{variant}: onnxruntime rejects the result: {str(exc).splitlines()[0][:200]}")
            continue
        reason = _matches(expected, got, rtol, atol)
        if reason is not None:
            failures.append(f"{variant}: {reason}")
    assert not failures, "; ".join(failures)
