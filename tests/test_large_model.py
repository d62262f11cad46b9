"""A model whose weights pass protobuf's 2 GiB limit: loaded lazily, saved with external data, refused as
one file; scripts/oracles/big_model.py (the 3 GB end-to-end benchmark) at a small scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import model, tinfo
from onnx import TensorProto, helper

from onnxopt.ir import io as oio
from onnxopt import optimize

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.slow
def test_over_2gb_single_file_refused_in_one_line(big_model, tmp_path):
    """--single-file on a model past protobuf's limit: exit 2, one line, nothing written."""
    out = tmp_path / "one.onnx"
    run = subprocess.run([sys.executable, "-m", "onnxopt", str(big_model), "-o", str(out), "--single-file"],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "2 GiB limit" in lines[0] and "external data" in lines[0], run.stderr
    assert list(tmp_path.iterdir()) == []


def test_single_file_past_the_limit_refused_before_the_work(tmp_path, monkeypatch):
    """The refusal comes when the output is planned, not after the rewriting (a 3 GB model would
    be optimized for nothing); at a small scale, with the limit lowered."""
    import onnxopt.core.pipeline
    from onnxopt.errors import UsageError

    weights = onnx.numpy_helper.from_array(np.zeros(4096, np.float32), "w")
    nodes = [helper.make_node("Identity", ["w"], ["wi"], name="id"),
             helper.make_node("ReduceSum", ["wi"], ["s"], name="sum", keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"], name="add")]
    src = tmp_path / "m.onnx"
    onnx.save(model(nodes, [tinfo("x", [])], [tinfo("y", [])], [weights]), src, save_as_external_data=True,
              location="m.data", size_threshold=0)
    monkeypatch.setattr(oio, "PROTO_LIMIT", 4096 * 4)

    def no_work(*args, **kwargs):
        raise AssertionError("optimized a model it cannot write")

    monkeypatch.setattr(onnxopt.core.pipeline, "run", no_work)
    with pytest.raises(UsageError, match="protobuf's 2 GiB limit for one file"):
        optimize(src, output=tmp_path / "out.onnx", external_data=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.data", "m.onnx"]


def test_big_model_script_end_to_end_small_scale(tmp_path):
    """scripts/oracles/big_model.py as run for the figures (generate, optimize by the command line with
    memory sampled, verify on onnxruntime), on a small encoder."""
    figures = tmp_path / "big.json"
    run = subprocess.run([sys.executable, "-m", "scripts.oracles.big_model", "--dir", str(tmp_path / "work"),
                          "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "32", "--positions", "32",
                          "--json", str(figures)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(figures.read_text())
    opt = got["optimize"]
    assert opt["rewrites"] > 0 and opt["nodes_after"] < opt["nodes_before"]
    assert {"dropout_elimination", "identity_elimination", "reshape_shape_from_input"} <= set(opt["fired"])
    assert 0 < opt["peak_rss_anon_bytes"] <= opt["peak_vm_hwm_bytes"]
    assert got["verify"]["ok"] is True and got["verify"]["exit"] == 0
    assert got["single_file"]["exit"] == 0  # small enough for one file
    # the model as generated: weights in one data file beside it, read back as external tensors
    src = ir.load(tmp_path / "work" / "big.onnx")
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in src.graph.initializers.values()
               if v.const_value.nbytes > 1024)
    assert got["model"]["bytes_on_disk"] >= got["model"]["weight_bytes"]
