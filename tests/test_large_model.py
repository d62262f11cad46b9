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
from onnxopt.rules import packing
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


# --- weights a rewrite moves are computed when read (issue 30, point 5) -----------------------------

def _external_model(tmp_path, nodes, inputs, outputs, weights: dict) -> Path:
    """A model whose weights are external data beside it, as a model over 2 GB keeps them."""
    path = tmp_path / "m.onnx"
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in weights.items()]
    onnx.save(model(nodes, inputs, outputs, inits), path, save_as_external_data=True, location="m.data",
              size_threshold=0)
    return path


def test_large_weight_transpose_folds_to_a_tensor_computed_when_read(tmp_path):
    """The dynamo exporter's Transpose(W) before a MatMul: folded into a tensor that reads the input's
    external data when it is written (not before, not kept), with the bytes a transpose gives; a small
    weight's Transpose is folded into an array as before."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((390, 1024), dtype=np.float32)  # 1.5 MiB (not a whole number of 64-row bands)
    small = rng.standard_normal((16, 8), dtype=np.float32)
    nodes = [helper.make_node("Transpose", ["wb"], ["wbt"], name="tb"),
             helper.make_node("MatMul", ["x", "wbt"], ["y"], name="mb"),
             helper.make_node("Transpose", ["ws"], ["wst"], name="ts"),
             helper.make_node("MatMul", ["x2", "wst"], ["y2"], name="ms")]
    src = _external_model(tmp_path, nodes, [tinfo("x", ["n", 1024]), tinfo("x2", ["n", 8])],
                          [tinfo("y", ["n", 390]), tinfo("y2", ["n", 16])], {"wb": big, "ws": small})
    result = optimize(ir.load(src))
    inits = {v.name: v.const_value for v in result.graph.initializers.values()}
    (lazy,) = [t for t in inits.values() if isinstance(t, ir.LazyTensor)]
    assert lazy.dtype == ir.DataType.FLOAT and tuple(lazy.shape) == (1024, 390)
    assert np.array_equal(lazy.numpy(), big.T)
    (eager,) = [t for t in inits.values() if tuple(t.shape) == (8, 16)]
    assert not isinstance(eager, ir.LazyTensor) and np.array_equal(eager.numpy(), small.T)
    out = tmp_path / "out.onnx"
    optimize(src, output=out)
    for one_file in (False, True):  # the external data writer and write_streamed
        target = tmp_path / ("one.onnx" if one_file else "out.onnx")
        if one_file:
            optimize(src, output=target, external_data=False)
        saved = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(tmp_path))
                 for t in onnx.load(str(target)).graph.initializer}
        assert any(np.array_equal(a, big.T) for a in saved.values()), one_file
    import onnxruntime as ort

    feed = {"x": rng.standard_normal((2, 1024), dtype=np.float32), "x2": rng.standard_normal((2, 8), dtype=np.float32)}
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)
    assert np.allclose(got[0], feed["x"] @ big.T, rtol=1e-4, atol=1e-4)


def test_packed_projections_of_large_weights_are_concatenated_when_read(tmp_path, monkeypatch):
    """gate/up MatMuls of one activation by external weights: the packed weight is a tensor computed when
    read (the weights side by side, bit for bit), deduplication reads it once per deferred tensor, and the
    model written agrees with the original on onnxruntime."""
    import onnxruntime as ort

    import onnxopt.ir.util as irutil

    rng = np.random.default_rng(1)
    gate = rng.standard_normal((256, 768), dtype=np.float32)
    up = rng.standard_normal((256, 768), dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
             helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
             helper.make_node("Mul", ["g", "s"], ["silu"], name="silu"),
             helper.make_node("Mul", ["silu", "u"], ["y"], name="gated")]
    src = _external_model(tmp_path, nodes, [tinfo("x", ["n", 256])], [tinfo("y", ["n", 768])],
                          {"wg": gate, "wu": up})
    calls = []
    real = irutil.deferred

    def counted(compute, dtype, shape):
        def compute_counted():
            calls.append(tuple(shape))
            return compute()
        return real(compute_counted, dtype, shape)

    monkeypatch.setattr(packing, "deferred", counted)
    result, report = optimize(ir.load(src), target="ort-cpu", return_report=True)
    assert report.fired.get("packed_projections") == 1
    (packed,) = [v.const_value for v in result.graph.initializers.values() if tuple(v.const_value.shape) == (256, 1536)]
    assert isinstance(packed, ir.LazyTensor)
    assert len(calls) <= 1  # (the deduplication pass's sample, kept on the tensor across passes)
    assert np.array_equal(packed.numpy(), np.concatenate([gate, up], axis=1))
    out = tmp_path / "out.onnx"
    ir.save(result, out, external_data="out.data")
    feed = {"x": rng.standard_normal((3, 256), dtype=np.float32)}
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


def _projections_model(path: Path, layers: int, hidden: int, inner: int, seed: int = 0) -> int:
    """A decoder's projections as the dynamo exporter writes them, weights in external data beside ``path``:
    per layer q, k, v, gate and up MatMuls of one activation by ``Transpose(W)`` (packed into one), and the
    down projection's (folded alone). Returns the weights' bytes."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    shapes = {"q": (hidden, hidden), "k": (hidden // 2, hidden), "v": (hidden // 2, hidden), "gate": (inner, hidden),
              "up": (inner, hidden), "down": (hidden, inner)}
    for i in range(layers):
        for name, shape in shapes.items():
            inits.append(onnx.numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32), f"w_{name}{i}"))
            nodes.append(helper.make_node("Transpose", [f"w_{name}{i}"], [f"t_{name}{i}"], perm=[1, 0]))
            if name != "down":
                nodes.append(helper.make_node("MatMul", [x, f"t_{name}{i}"], [f"{name}{i}"]))
        nodes += [helper.make_node("Sigmoid", [f"gate{i}"], [f"s{i}"]),
                  helper.make_node("Mul", [f"gate{i}", f"s{i}"], [f"silu{i}"]),
                  helper.make_node("Mul", [f"silu{i}", f"up{i}"], [f"h{i}"]),
                  helper.make_node("MatMul", [f"h{i}", f"t_down{i}"], [f"d{i}"]),
                  helper.make_node("Concat", [f"k{i}", f"v{i}"], [f"kv{i}"], axis=-1),
                  helper.make_node("Add", [f"q{i}", f"kv{i}"], [f"a{i}"]),
                  helper.make_node("Add", [f"a{i}", f"d{i}"], [f"x{i + 1}"])]
        x = f"x{i + 1}"
    onnx.save(model(nodes, [tinfo("x", ["n", hidden])], [tinfo(x, ["n", hidden])], inits), path,
              save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return sum(int(np.prod(t.dims)) * 4 for t in inits)


def test_rewritten_weights_are_held_one_at_a_time(tmp_path):
    """The command line on 84 MB of transposed and packed projections in external data (the dynamo export's
    form, no torch needed): its anonymous memory grows by about the largest rewritten weight (10 MiB) over
    the same graph with small weights (20 MiB here), not by the rewritten weights together (the base code: 144 MiB);
    the data written are the transposes and concatenations, bit for bit."""
    from scripts import child_env
    from scripts.oracles.big_decoder import rewritten_bytes
    from scripts.oracles.big_model import run_sampled

    layers, hidden, inner = 6, 512, 2048
    src, small = tmp_path / "big" / "m.onnx", tmp_path / "small" / "m.onnx"
    src.parent.mkdir()
    small.parent.mkdir()
    size = _projections_model(src, layers, hidden, inner)
    _projections_model(small, layers, 32, 64)
    env = child_env()
    runs = {}
    for name, path in (("small", small), ("big", src)):
        out = path.parent / "out.onnx"
        run, peaks = run_sampled([sys.executable, "-m", "onnxopt", str(path), "-o", str(out), "--target", "ort-cpu",
                                  "-q"], env, interval=0.005)
        assert run.returncode == 0, run.stderr
        runs[name] = peaks
    rewritten = rewritten_bytes(src, src.parent / "out.onnx")
    assert rewritten["tensors"] == 2 * layers and rewritten["kept_bytes"] == 0
    assert rewritten["largest_bytes"] == hidden * (2 * hidden + 2 * inner) * 4  # q, k, v, gate, up side by side
    assert rewritten["bytes"] == size
    grown = runs["big"]["RssAnon"] - runs["small"]["RssAnon"]
    # (the packed weight and one source beside it while it is written; the base code: 144 MiB over)
    assert grown <= 2 * rewritten["largest_bytes"] + 8 * 2**20, (grown >> 20, rewritten)
    assert grown < size / 2, (grown >> 20, size >> 20)
    got = ir.load(src.parent / "out.onnx")
    weights = {v.name: v.const_value for v in ir.load(src).graph.initializers.values()}
    down = [v.const_value for v in got.graph.initializers.values() if tuple(v.const_value.shape) == (inner, hidden)]
    assert len(down) == layers and any(np.array_equal(down[0].numpy(), w.numpy().T) for w in weights.values()
                                       if tuple(w.shape) == (hidden, inner))


def test_big_decoder_script_small_scale(tmp_path):
    """scripts/oracles/big_decoder.py as run for the figures, on a 56 MB decoder: a dynamo-exported Llama
    decode step (KV cache) with its weights in external data; GroupQueryAttention, RotaryEmbedding, the
    RMSNorms and packed projections fire on it as on the tiny zoo export; the command's anonymous memory
    grows by about the largest rewritten weight (the transposed lm_head, 16 MiB) over the same graph with
    small weights, less than the 38 MiB rewritten (the base code held them all: 51 MiB over it), and the
    outputs agree on onnxruntime. (Two dynamo exports on the meta device: ~30 s on this 2-core machine.)"""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    figures = tmp_path / "dec.json"
    run = subprocess.run([sys.executable, "-m", "scripts.oracles.big_decoder", "--dir", str(tmp_path / "work"),
                          "--layers", "2", "--hidden", "512", "--intermediate", "1408", "--heads", "8",
                          "--kv-heads", "2", "--vocab", "8192", "--json", str(figures)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(figures.read_text())
    opt = got["optimize"]
    assert opt["fusions_fired"] is True, opt["ops_after"]
    assert opt["ops_after"]["GroupQueryAttention"] == 2 and opt["ops_after"]["packed_projections"] == 4
    assert {"group_query_attention", "rms_normalization", "rotary_embedding", "packed_projections",
            "constant_folding"} <= set(opt["fired"])
    rewritten = opt["rewritten"]
    # the transposed lm_head (16 MiB), the packed and transposed projections of both layers
    assert rewritten["tensors"] == 9 and rewritten["largest_bytes"] == 8192 * 512 * 4
    grown = opt["peak_rss_anon_bytes"] - opt["small_weights_peak_rss_anon_bytes"]
    # (measured here: 19 to 25 MiB; the base code held every rewritten weight: 51 MiB)
    assert grown <= 2 * rewritten["largest_bytes"] + 8 * 2**20, (grown, rewritten)
    assert grown < rewritten["bytes"], (grown, rewritten)
    assert got["verify"]["ok"] is True and got["verify"]["exit"] == 0, got["verify"]
    src = ir.load(tmp_path / "work" / "big.onnx")
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in src.graph.initializers.values()
               if v.const_value.nbytes > 1024)
