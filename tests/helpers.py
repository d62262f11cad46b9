"""Small model builders for the tests, and the scripts under scripts/ loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
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


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(file: str, name: str | None = None):
    """scripts/``file`` imported as the module ``name`` (default: the file's stem), once: the
    scripts import each other by those names (``_peers``, ``bench``)."""
    name = name or Path(file).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def zoo_model(name: str, folder: Path) -> Path:
    """A zoo model: from the zoo cache when built there, else built into ``folder`` (models fetched from
    a wheel are skipped when not cached: no network in tests)."""
    import pytest

    from onnxopt.models import zoo

    spec = zoo.get(name)
    if spec.path().exists():
        return spec.path()
    if spec.family == "ocr" or spec.missing():
        pytest.skip(f"{name} is not in the zoo cache (python -m onnxopt.models build --only {name})")
    path = Path(folder) / f"{name}.onnx"
    if not path.exists():
        spec.build(path)
    return path
