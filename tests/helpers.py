"""Small model builders for the tests (imported as ``helpers`` by the tests, as ``tests.helpers`` by the
scripts under scripts/ that reuse them: it imports nothing of tests/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR = 10


def model(nodes, inputs, outputs, inits=(), opset=17, **kw):
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR, **kw)


def tinfo(name, shape, dtype=TensorProto.FLOAT):
    """A tensor value info; an int shape means that rank with unknown (symbolic) dims."""
    if isinstance(shape, int):
        shape = [f"{name}_d{i}" for i in range(shape)]
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def bn_params(prefix, c, rng, dtype=np.float32):
    return [
        init(f"{prefix}.scale", rng.uniform(0.5, 1.5, c).astype(dtype)),
        init(f"{prefix}.beta", (rng.standard_normal(c) * 0.3).astype(dtype)),
        init(f"{prefix}.mean", (rng.standard_normal(c) * 0.3).astype(dtype)),
        init(f"{prefix}.var", rng.uniform(0.3, 2.0, c).astype(dtype)),
    ]


def bn_node(x, y, prefix, **attrs):
    return helper.make_node("BatchNormalization",
                            [x, f"{prefix}.scale", f"{prefix}.beta", f"{prefix}.mean", f"{prefix}.var"],
                            [y], name=f"{prefix}/bn", **attrs)


def op_types(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def feeds_for(m: onnx.ModelProto, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    inits = {i.name for i in m.graph.initializer}
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value or 1 for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            out[vi.name] = rng.standard_normal(dims).astype(dtype)
        elif dtype == np.bool_:
            out[vi.name] = rng.integers(0, 2, dims).astype(bool)
        else:
            out[vi.name] = rng.integers(0, 5, dims).astype(dtype)
    return out


def minmax(proto: onnx.ModelProto, tensors, feeds) -> dict[str, tuple[float, float]]:
    """Each tensor's (min, max) over ``feeds``: onnxruntime CPU, graph optimizations off, with the
    tensors exposed as outputs (the quantizer tests' ranges, independent of onnxopt's calibration)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    have = {o.name for o in m.graph.output}
    for t in tensors:
        if t not in have:
            m.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    ranges: dict[str, tuple[float, float]] = {}
    for feed in feeds:
        outs = dict(zip(names, sess.run(None, feed)))
        for t in tensors:
            lo, hi = float(outs[t].min()), float(outs[t].max())
            ranges[t] = (min(ranges[t][0], lo), max(ranges[t][1], hi)) if t in ranges else (lo, hi)
    return ranges


# issue 27 item 3's float16 arithmetic cases (tests/test_fp16_arith.py; on CUDA: scripts/oracles/gpu_fp16_arith.py):
# each returns (model, feeds) whose plain float16 conversion overflows or misses in float16 arithmetic

FP16_W16 = (np.random.default_rng(1).standard_normal((16, 16)) / 2).astype(np.float32)


def _fp16_matmul():  # x[2,4096] @ 10s reaches 409,600; / 1000 brings it back to 409.6
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t"], name="mm"), helper.make_node("Div", ["t", "k"], ["y"])]
    m = model(nodes, [tinfo("x", [2, 4096])], [tinfo("y", [2, 8])],
              [init("W", np.full((4096, 8), 10, np.float32)), init("k", np.array(1000, np.float32))])
    x = np.random.default_rng(0).uniform(9.5, 10.5, (2, 4096)).astype(np.float32)
    return m, {"x": x}


def _fp16_mulmul():  # MatMul, then *300 *300 /1e4 (9e4 x |h| overflows float16), then MatMul
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Mul", ["h", "a"], ["t1"]),
             helper.make_node("Mul", ["t1", "a"], ["t2"]), helper.make_node("Div", ["t2", "d"], ["t3"]),
             helper.make_node("MatMul", ["t3", "W"], ["y"])]
    m = model(nodes, [tinfo("x", [4, 16])], [tinfo("y", [4, 16])],
              [init("W", FP16_W16), init("a", np.array(300, np.float32)), init("d", np.array(1e4, np.float32))])
    return m, {"x": np.random.default_rng(0).uniform(0, 2, (4, 16)).astype(np.float32)}


def _fp16_cancel():  # MatMul, then (h + 1000) - 1000 (float16 rounds by 0.25 at 1000), then MatMul
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "c"], ["t"]),
             helper.make_node("Sub", ["t", "c"], ["t3"]), helper.make_node("MatMul", ["t3", "W"], ["y"])]
    m = model(nodes, [tinfo("x", [4, 16])], [tinfo("y", [4, 16])],
              [init("W", FP16_W16), init("c", np.array(1000, np.float32))])
    return m, {"x": np.random.default_rng(0).uniform(0, 1, (4, 16)).astype(np.float32)}


FP16_ARITH_CASES = {"matmul-409600": _fp16_matmul, "mul300x300": _fp16_mulmul, "plus-minus-1000": _fp16_cancel}


def reference_output(proto, feeds):
    """The first output of onnx's reference evaluator (float16 computed in float16)."""
    from onnx.reference import ReferenceEvaluator

    with np.errstate(all="ignore"):
        return ReferenceEvaluator(proto).run(None, feeds)[0]


def error_of_range(ref, got):
    """max |got - ref| over the range of ref."""
    span = float(ref.max() - ref.min()) or float(np.abs(ref).max())
    return float(np.abs(got.astype(np.float64) - ref).max()) / span


def random_twins(seed: int, n: int = 30) -> onnx.ModelProto:
    """A random DAG on [1, 16] of element-wise ops, Tiles (large), reductions (small) and twins of
    earlier nodes (CSE merges them); every value nothing reads is a graph output."""
    rng = np.random.default_rng(seed)
    values = {"x": 16}  # name -> elements
    nodes, inits = [], [init("reps", np.array([8, 1], np.int64))]
    for k in range(n):
        kind = str(rng.choice(["tile", "reduce", "add", "relu", "twin", "neg"]))
        names = list(values)
        a = names[int(rng.integers(len(names)))]
        out = f"v{k}"
        if kind == "twin" and nodes:
            src = nodes[int(rng.integers(len(nodes)))]
            attrs = {at.name: helper.get_attribute_value(at) for at in src.attribute}
            nodes.append(helper.make_node(src.op_type, list(src.input), [out], name=f"n{k}", **attrs))
            values[out] = values[src.output[0]]
        elif kind == "tile" and values[a] == 16:
            nodes.append(helper.make_node("Tile", [a, "reps"], [out], name=f"n{k}"))
            values[out] = 128
        elif kind == "reduce" and values[a] == 128:
            nodes.append(helper.make_node("ReduceMax", [a], [out], name=f"n{k}", axes=[0], keepdims=1))
            values[out] = 16
        elif kind == "add":
            same = [v for v in names if values[v] == values[a]]
            nodes.append(helper.make_node("Add", [a, same[int(rng.integers(len(same)))]], [out], name=f"n{k}"))
            values[out] = values[a]
        else:
            nodes.append(helper.make_node("Neg" if kind == "neg" else "Relu", [a], [out], name=f"n{k}"))
            values[out] = values[a]
    read = {i for node in nodes for i in node.input}
    outs = [tinfo(node.output[0], [1, 16] if values[node.output[0]] == 16 else [8, 16])
            for node in nodes if node.output[0] not in read]
    return model(nodes, [tinfo("x", [1, 16])], outs, inits, opset=17)


def zoo_model(name: str, folder: Path) -> Path:
    """A zoo model: from the zoo cache when built there, else a copy in ``folder`` of the one export
    this session makes (:func:`shared_zoo_model`; models fetched from a wheel are skipped when not
    cached: no network in tests)."""
    from onnxopt.models import zoo

    spec = zoo.get(name)
    if spec.path().exists():
        return spec.path()
    path = Path(folder) / f"{name}.onnx"
    if not path.exists():  # the test owns its copy
        import shutil

        built = shared_zoo_model(name)
        for src in built.parent.glob(f"{built.name}*"):  # the model and any data file beside it
            shutil.copyfile(src, Path(folder) / src.name)
    return path


_SHARED_ZOO: dict[str, Path] = {}


def shared_zoo_model(name: str) -> Path:
    """A zoo model built at most once per test session: from the zoo cache when built there, else
    exported once into a folder of this process (removed at exit) and that file given to every later
    caller (``zoo_model`` gives each test its own copy of it). On CI's empty cache, a model several
    tests read is exported once instead of once per test."""
    if name not in _SHARED_ZOO:
        import atexit
        import shutil
        import tempfile

        import pytest

        from onnxopt.models import zoo

        spec = zoo.get(name)
        if spec.path().exists():
            _SHARED_ZOO[name] = spec.path()
        else:
            if spec.family == "ocr" or spec.missing():
                pytest.skip(f"{name} is not in the zoo cache (python -m onnxopt.models build --only {name})")
            folder = Path(tempfile.mkdtemp(prefix=f"onnxopt-zoo-{name}-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            spec.build(folder / f"{name}.onnx")
            _SHARED_ZOO[name] = folder / f"{name}.onnx"
    return _SHARED_ZOO[name]


def optimum_absent() -> str | None:
    """Why optimum-onnx's own environment (scripts/bench/_optimum.py) is not here; None when it is."""
    from scripts.bench import _optimum

    try:
        _optimum.environment()
    except _optimum.OptimumUnavailable as exc:
        return str(exc)
    return None


def optimum_mark():
    """A skip mark for tests that run optimum in its environment, with the reason it is absent."""
    import pytest

    reason = optimum_absent()
    return pytest.mark.skipif(reason is not None, reason=f"optimum-onnx's environment: {reason}")
