"""A model whose weights pass protobuf's 2 GiB limit: loaded lazily, saved with external data."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import model, tinfo
from onnx import TensorProto, helper

from onnxopt import io as oio
from onnxopt import optimize

BIG = (2**31 + 2**20) // 4  # float32 elements: just over 2 GiB


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    stat = os.statvfs(root)
    if stat.f_bavail * stat.f_frsize < 8 * 2**30:
        pytest.skip("needs 8 GiB of free disk for a >2 GiB model and its optimized copy")
    # A sparse data file: 2 GiB of zeros that take no disk until written.
    data = root / "weights.bin"
    with open(data, "wb") as f:
        f.truncate(BIG * 4)
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [BIG])  # placeholder for typing
    del w
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[BIG])
    tensor.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "weights.bin"), ("offset", "0"), ("length", str(BIG * 4))):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v
    nodes = [helper.make_node("Identity", ["w"], ["wi"], name="id"),
             helper.make_node("ReduceSum", ["wi"], ["s"], name="sum", keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"], name="add")]
    m = model(nodes, [tinfo("x", [])], [tinfo("y", [])], [tensor])
    path = root / "big.onnx"
    onnx.save(m, path)
    return path


@pytest.mark.slow
def test_over_2gb_model_round_trip(big_model, tmp_path):
    loaded = oio.load(big_model)
    value = loaded.model.graph.initializers["w"]
    assert isinstance(value.const_value, ir.ExternalTensor)  # not read on load
    out = tmp_path / "out.onnx"
    _, report = optimize(big_model, output=out, return_report=True)
    assert report.fired == {"identity_elimination": 1}
    assert os.path.getsize(out) < 1_000_000  # the graph only
    data = tmp_path / "out.onnx.data"
    assert data.exists() and os.path.getsize(data) >= BIG * 4
    proto = onnx.load(str(out), load_external_data=False)
    assert [n.op_type for n in proto.graph.node] == ["ReduceSum", "Add"]
    init = proto.graph.initializer[0]
    assert init.data_location == TensorProto.EXTERNAL
    # The values survive: spot-check through the memory map.
    reloaded = ir.load(out)
    arr = reloaded.graph.initializers["w"].const_value.numpy()
    assert arr.shape == (BIG,) and float(arr[-1]) == 0.0 and float(arr[12345]) == 0.0
