"""onnxopt.inspect.analysis and ``onnxopt inspect``: FLOPs (2 x multiply-accumulates) and bytes per op
family on tiny graphs counted by hand, symbolic dimensions, --input-shape, the device table and the
cached measurement of this CPU, the command line, and a model with over 2 GB of external data
analyzed without reading it."""

from __future__ import annotations

import builtins
import io as stdio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, model, shared_zoo_model, tinfo
from onnxopt.reporting.inspect_text import format_inspect
from onnxopt.inspect import analysis
from onnxopt import cli
from onnxopt.errors import InvalidModelError, UsageError

DEV = "h100-sxm"  # (a table device: nothing is measured)
F32 = 4


def one_node(node, inputs, outputs, inits=(), domain_ms=False, opset=17):
    m = model([node], inputs, outputs, inits, opset=opset)
    if domain_ms:
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def flops_of(m, **kw) -> dict:
    r = analysis.analyze(m, device=DEV, **kw)
    assert len(r["nodes"]) == 1
    return r["nodes"][0]


# ---------------------------------------------------------------------------------------------
# each op family, counted by hand


def test_conv_with_groups_dilations_and_bias():
    # x [1,4,8,8], W [6, 4/2, 3, 3], groups 2, dilation 2: output 8 - 2*(3-1) = 4 -> y [1,6,4,4]
    w, b = np.ones((6, 2, 3, 3), np.float32), np.ones(6, np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=2, dilations=[2, 2])
    n = flops_of(one_node(node, [tinfo("x", [1, 4, 8, 8])], [tinfo("y", None)], [init("w", w), init("b", b)]))
    outputs = 6 * 4 * 4
    assert n["flops"] == 2 * outputs * (2 * 9) + outputs  # a MAC per weight of a group, + the bias
    assert n["bytes_read"] == F32 * (4 * 64 + 6 * 2 * 9 + 6) and n["bytes_written"] == F32 * outputs
    assert n["weight_bytes"] == F32 * (6 * 2 * 9 + 6)
    assert n["intensity"] == round(n["flops"] / (n["bytes_read"] + n["bytes_written"]), 4)


def test_conv_transpose():
    # x [1,2,3,3], W [Cin 2, Cout/groups 3, 2, 2] -> y [1,3,4,4]: each input element meets 3 x 4 weights
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"])
    n = flops_of(one_node(node, [tinfo("x", [1, 2, 3, 3])], [tinfo("y", None)],
                          [init("w", np.ones((2, 3, 2, 2), np.float32))]))
    assert n["flops"] == 2 * (2 * 9) * 3 * 4
    assert n["bytes_written"] == F32 * 3 * 16


def test_batched_matmul_and_gemm_with_transposes():
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    n = flops_of(one_node(node, [tinfo("a", [2, 3, 4, 5]), tinfo("b", [5, 6])], [tinfo("y", None)]))
    assert n["flops"] == 2 * (2 * 3 * 4 * 6) * 5
    # Gemm: A [K=5, M=3] transposed, B [N=4, K=5] transposed, C: 2MNK + MN
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1)
    n = flops_of(one_node(node, [tinfo("a", [5, 3])], [tinfo("y", None)],
                          [init("b", np.ones((4, 5), np.float32)), init("c", np.ones(4, np.float32))]))
    assert n["flops"] == 2 * 3 * 4 * 5 + 3 * 4
    assert n["weight_bytes"] == F32 * (20 + 4) and n["bytes_read"] == F32 * (15 + 20 + 4)


def test_attention_like_matmuls_and_einsum():
    # scores = Q K' per head: [b, h, s, d] x [b, h, d, s]
    node = helper.make_node("MatMul", ["q", "k"], ["s"])
    n = flops_of(one_node(node, [tinfo("q", [2, 4, 16, 8]), tinfo("k", [2, 4, 8, 16])], [tinfo("s", None)]))
    assert n["flops"] == 2 * (2 * 4 * 16 * 16) * 8
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="bij,bjk->bik")
    n = flops_of(one_node(node, [tinfo("a", [2, 3, 4]), tinfo("b", [2, 4, 5])], [tinfo("y", None)], opset=17))
    assert n["flops"] == 2 * 2 * 3 * 4 * 5


@pytest.mark.parametrize("op, attrs, extra, per", [
    ("Relu", {}, [], 1), ("Sigmoid", {}, [], 1), ("Erf", {}, [], 1), ("Tanh", {}, [], 1),
    ("Softmax", {"axis": -1}, [], 5), ("Cast", {"to": TensorProto.FLOAT16}, [], 0),
    ("Transpose", {"perm": [1, 0]}, [], 0),
])
def test_element_wise_per_element(op, attrs, extra, per):
    node = helper.make_node(op, ["x", *extra], ["y"], **attrs)
    n = flops_of(one_node(node, [tinfo("x", [3, 5])], [tinfo("y", None)]))
    assert n["flops"] == per * 15
    assert n["bytes_read"] == F32 * 15
    assert n["bytes_written"] == (2 if op == "Cast" else F32) * 15


def test_binary_element_wise_broadcasts_to_its_output():
    node = helper.make_node("Add", ["x", "b"], ["y"])
    n = flops_of(one_node(node, [tinfo("x", [4, 6])], [tinfo("y", None)], [init("b", np.ones(6, np.float32))]))
    assert n["flops"] == 24 and n["bytes_read"] == F32 * 30 and n["weight_bytes"] == F32 * 6


def test_normalizations():
    x = [tinfo("x", [2, 3, 4])]
    ln = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)
    inits = [init("g", np.ones(4, np.float32)), init("b", np.ones(4, np.float32))]
    assert flops_of(one_node(ln, x, [tinfo("y", None)], inits))["flops"] == 7 * 24
    ln = helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=-1)
    assert flops_of(one_node(ln, x, [tinfo("y", None)], inits[:1]))["flops"] == 6 * 24
    c = 3
    bn = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])
    params = [init(n, np.ones(c, np.float32)) for n in "sbmv"]
    n = flops_of(one_node(bn, [tinfo("x", [1, c, 4, 4])], [tinfo("y", None)], params))
    assert n["flops"] == 2 * c * 16 and n["weight_bytes"] == F32 * 4 * c


def test_pooling_and_reductions():
    mp = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    assert flops_of(one_node(mp, [tinfo("x", [1, 2, 4, 4])], [tinfo("y", None)]))["flops"] == (2 * 2 * 2) * 4
    ap = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3])
    assert flops_of(one_node(ap, [tinfo("x", [1, 1, 5, 5])], [tinfo("y", None)]))["flops"] == 9 * 9
    gp = helper.make_node("GlobalAveragePool", ["x"], ["y"])
    assert flops_of(one_node(gp, [tinfo("x", [1, 2, 3, 3])], [tinfo("y", None)]))["flops"] == 18
    rm = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1])
    n = flops_of(one_node(rm, [tinfo("x", [2, 6])], [tinfo("y", None)], opset=13))
    assert n["flops"] == 12 and n["bytes_written"] == F32 * 2
    rs = helper.make_node("ReduceSumSquare", ["x"], ["y"], axes=[1])
    assert flops_of(one_node(rs, [tinfo("x", [2, 6])], [tinfo("y", None)], opset=13))["flops"] == 24


def ms(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)


def test_microsoft_fusions():
    b, s, hidden, heads = 1, 4, 8, 2
    x = [tinfo("x", [b, s, hidden])]
    out = [tinfo("y", [b, s, hidden])]
    w = init("w", np.ones((hidden, 3 * hidden), np.float32))
    bias = init("bias", np.ones(3 * hidden, np.float32))
    n = flops_of(one_node(ms("Attention", ["x", "w", "bias"], ["y"], num_heads=heads), x, out, [w, bias],
                          domain_ms=True))
    scores = b * heads * s * s
    head = hidden // heads
    assert n["op"] == "com.microsoft.Attention"
    assert n["flops"] == (2 * b * s * hidden * 3 * hidden + b * s * 3 * hidden  # the QKV projection and bias
                          + 2 * scores * head * 2  # Q K' and P V
                          + 7 * scores)  # scale, mask, softmax
    g, be = init("g", np.ones(hidden, np.float32)), init("be", np.ones(hidden, np.float32))
    n = flops_of(one_node(ms("SkipLayerNormalization", ["x", "skip", "g", "be"], ["y"]),
                          [*x, tinfo("skip", [b, s, hidden])], out, [g, be], domain_ms=True))
    assert n["flops"] == (1 + 7) * b * s * hidden
    bb = init("bb", np.ones(hidden, np.float32))
    n = flops_of(one_node(ms("BiasGelu", ["x", "bb"], ["y"]), x, out, [bb], domain_ms=True))
    assert n["flops"] == 6 * b * s * hidden
    n = flops_of(one_node(ms("FastGelu", ["x", "bb"], ["y"]), x, out, [bb], domain_ms=True))
    assert n["flops"] == 9 * b * s * hidden
    wc = init("wc", np.ones((2, 3, 1, 1), np.float32))
    n = flops_of(one_node(ms("FusedConv", ["c", "wc"], ["y"], activation="Relu"), [tinfo("c", [1, 3, 4, 4])],
                          [tinfo("y", [1, 2, 4, 4])], [wc], domain_ms=True))
    assert n["flops"] == 2 * 32 * 3 + 32


def test_quantized_ops_count_their_float_equivalent():
    u8 = TensorProto.UINT8
    inputs = [tinfo("a", [2, 3], u8)]
    inits = [init("as", np.float32(0.1)), init("az", np.uint8(0)), init("b", np.ones((3, 4), np.uint8)),
             init("bs", np.float32(0.1)), init("bz", np.uint8(0)), init("ys", np.float32(0.1)),
             init("yz", np.uint8(0))]
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    n = flops_of(one_node(node, inputs, [tinfo("y", None, u8)], inits))
    assert n["flops"] == 2 * 2 * 4 * 3 and n["dtype"] == "uint8"
    node = helper.make_node("DequantizeLinear", ["a", "as", "az"], ["y"])
    n = flops_of(one_node(node, inputs, [tinfo("y", None)], inits[:2]))
    assert n["flops"] == 2 * 6 and n["bytes_read"] == 6 + 4 + 1 and n["bytes_written"] == F32 * 6


def test_an_op_not_in_the_table_is_listed_as_uncounted():
    node = helper.make_node("Hardmax", ["x"], ["y"])
    r = analysis.analyze(one_node(node, [tinfo("x", [2, 3])], [tinfo("y", None)]), device=DEV)
    assert r["uncounted_op_types"] == ["Hardmax"] and r["flops"] == 0


def test_partial_readers_read_what_they_take():
    # a Gather of 16 rows from a 1000 x 64 table reads 16 rows (and its indices), not the table;
    # a Slice reads its slice; a Shape reads none of the data
    table = init("table", np.zeros((1000, 64), np.float32))
    node = helper.make_node("Gather", ["table", "ids"], ["y"])
    n = flops_of(one_node(node, [tinfo("ids", [16], TensorProto.INT64)], [tinfo("y", None)], [table]))
    assert n["bytes_read"] == 16 * 64 * F32 + 16 * 8 and n["bytes_written"] == 16 * 64 * F32
    assert n["weight_bytes"] == 16 * 64 * F32  # (the rows read, of the weights)
    starts, ends = init("starts", np.array([0], np.int64)), init("ends", np.array([10], np.int64))
    node = helper.make_node("Slice", ["x", "starts", "ends"], ["y"])
    n = flops_of(one_node(node, [tinfo("x", [100, 4])], [tinfo("y", None)], [starts, ends]))
    assert n["bytes_read"] == 10 * 4 * F32 + 16 and n["bytes_written"] == 10 * 4 * F32
    node = helper.make_node("Shape", ["x"], ["y"])
    n = flops_of(one_node(node, [tinfo("x", [100, 4])], [tinfo("y", None)]))
    assert n["bytes_read"] == 0 and n["bytes_written"] == 2 * 8


# ---------------------------------------------------------------------------------------------
# the whole report; symbolic dimensions


def two_layer(batch="batch", seq="seq"):
    """x [batch, seq, 8] @ W [8, 16] then Relu, and the scores x x' ([batch, seq, seq])."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["x", "xt"], ["s"], name="scores")]
    w = init("w", np.ones((8, 16), np.float32))
    h = init("h16", np.ones(3, np.float16))  # (a float16 weight nothing reads: params by dtype)
    return model(nodes, [tinfo("x", [batch, seq, 8])], [tinfo("r", None), tinfo("s", None)], [w, h])


def test_report_keys_params_and_totals():
    r = analysis.analyze(two_layer(2, 5), device=DEV)
    assert list(r)[:12] == ["flops_convention", "inputs", "outputs", "opsets", "op_types", "params", "flops",
                            "bytes_read", "bytes_written", "intensity", "symbolic", "uncounted_op_types"]
    assert "2 x multiply-accumulates" in r["flops_convention"]
    assert r["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 5, 8]}]
    assert r["outputs"][1] == {"name": "s", "dtype": "float32", "shape": [2, 5, 5]}
    assert r["opsets"] == {"ai.onnx": 17}
    assert r["op_types"] == {"MatMul": 2, "Relu": 1, "Transpose": 1}
    assert r["params"] == {"count": 128 + 3, "bytes": 128 * 4 + 3 * 2,
                           "by_dtype": {"float32": {"count": 128, "bytes": 512}, "float16": {"count": 3, "bytes": 6}}}
    proj, scores = 2 * 2 * 5 * 16 * 8, 2 * 2 * 5 * 5 * 8
    assert r["flops"] == proj + 2 * 5 * 16 + scores and not r["symbolic"]
    assert r["by_op_type"]["MatMul"] == {"nodes": 2, "flops": proj + scores,
                                         "bytes_read": 4 * (80 + 128 + 80 + 80), "bytes_written": 4 * (160 + 50)}
    assert [n["name"] for n in r["nodes"]] == ["proj", "act", "t", "scores"]
    ridge = r["device"]["ridge"]["float32"]
    assert ridge == round(67e12 / 3.35e12, 3)
    for n in r["nodes"]:
        assert n["bound"] == ("compute" if n["intensity"] >= ridge else "memory") or n["intensity"] is None
    assert json.loads(json.dumps(r)) == r  # JSON-ready


def test_symbolic_dims_give_polynomials_and_input_shape_fixes_them():
    r = analysis.analyze(two_layer(), device=DEV)
    assert r["symbolic"] and r["inputs"][0]["shape"] == ["batch", "seq", 8]
    assert r["expr"]["flops"] == "16*batch*seq^2 + 272*batch*seq"  # 2*8*16 + 16 (Relu); 2*8 per score
    assert r["flops"] == 16 + 272  # every symbol at 1
    scores = r["nodes"][3]
    assert scores["symbolic"] and scores["expr"]["flops"] == "16*batch*seq^2"
    assert scores["expr"]["bytes_written"] == "4*batch*seq^2"
    fixed = analysis.analyze(two_layer(), input_shapes=["x=2x5x8"], device=DEV)
    assert not fixed["symbolic"] and "expr" not in fixed
    assert fixed["flops"] == 16 * 2 * 25 + 272 * 2 * 5
    assert fixed == analysis.analyze(two_layer(2, 5), device=DEV)
    half = analysis.analyze(two_layer(), input_shapes={"x": ["batch", 7, 8]}, device=DEV)
    assert half["expr"]["flops"] == f"{16 * 49 + 272 * 7}*batch"


def test_bad_input_shapes_and_models_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="has no input 'y'"):
        analysis.analyze(two_layer(), input_shapes=["y=1x2"], device=DEV)
    with pytest.raises(UsageError, match="unknown device"):
        analysis.analyze(two_layer(), device="nope")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(InvalidModelError):
        analysis.analyze(bad, device=DEV)
    for other in (123, b"model bytes"):  # (a TypeError from os.fspath, not the documented one line)
        with pytest.raises(UsageError, match="analyze takes a path or an onnx.ModelProto, not"):
            analysis.analyze(other, device=DEV)


# ---------------------------------------------------------------------------------------------
# devices


def test_the_device_table_names_its_sources():
    table = analysis.devices_table()
    assert {"h100-sxm", "h200-sxm", "epyc-9654", "xeon-8480plus"} <= set(table)
    for name, e in table.items():
        assert e["name"] and "http" in e["source"] and e["bandwidth"] > 0 and e["peak_flops"]["float32"] > 0
        d = analysis.device(name)
        assert d["ridge"]["float32"] == round(e["peak_flops"]["float32"] / e["bandwidth"], 3)
    assert table["h200-sxm"]["bandwidth"] > table["h100-sxm"]["bandwidth"]


def test_this_machine_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(analysis.CACHE_ENV, str(tmp_path))
    calls = []

    def fake():
        calls.append(1)
        return {"name": "test cpu", "kind": "cpu", "peak_flops": {"float32": 1e11}, "bandwidth": 1e10,
                "source": "measured"}

    first = analysis.local_device(measure=fake)
    again = analysis.local_device(measure=fake)
    assert first == again and calls == [1]
    (cached,) = tmp_path.glob("*.json")  # (and its lock file)
    assert cached.name.startswith("device-") and cached.suffix == ".json"
    assert json.loads(cached.read_text())["peak_flops"] == {"float32": 1e11}
    d = analysis.device(None)
    assert d["key"] == "local" and d["ridge"] == {"float32": 10.0}
    # the real measurement, small
    m = analysis.measure_cpu(n=128, copy_mib=4, repeats=1)
    assert m["peak_flops"]["float32"] > 1e8 and m["bandwidth"] > 1e8 and "measured" in m["source"]


def _fake_cpu(calls, delay=0.0):
    def fake():
        calls.append(1)
        time.sleep(delay)
        return {"name": "test cpu", "kind": "cpu", "peak_flops": {"float32": 2e11}, "bandwidth": 1e10,
                "source": "measured"}
    return fake


def test_concurrent_first_runs_measure_once(tmp_path, monkeypatch):
    """Two first runs at once: the second waits for the first's lock and reads its figure."""
    import threading

    monkeypatch.setenv(analysis.CACHE_ENV, str(tmp_path))
    calls, results, start = [], [], threading.Barrier(2)

    def run():
        start.wait()
        results.append(analysis.local_device(measure=_fake_cpu(calls, delay=0.5)))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len(results) == 2 and results[0] == results[1]
    assert results[0]["peak_flops"] == {"float32": 2e11}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_the_cache_is_keyed_by_the_usable_cpus_too(tmp_path, monkeypatch):
    monkeypatch.setenv(analysis.CACHE_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    analysis.local_device(measure=_fake_cpu(calls))
    analysis.local_device(measure=_fake_cpu(calls))
    assert calls == [1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    analysis.local_device(measure=_fake_cpu(calls))  # (a taskset run: measured on its own)
    assert calls == [1, 1] and len(list(tmp_path.glob("device-*.json"))) == 2


@pytest.mark.parametrize("content", [
    '{"name": "x"}', "[1, 2]", '"text"', "null",
    '{"name": "x", "kind": "cpu", "peak_flops": {"float32": 1e11}, "bandwidth": 0, "source": "s"}',
    '{"name": "x", "kind": "cpu", "peak_flops": {"float32": NaN}, "bandwidth": 1e10, "source": "s"}',
    '{"name": "x", "kind": "cpu", "peak_flops": {"float32": 1e11}, "bandwidth": Infinity, "source": "s"}',
    '{"name": "x", "kind": "cpu", "peak_flops": {}, "bandwidth": 1e10, "source": "s"}',
    '{"name": "x", "kind": "cpu", "peak_flops": {"float32": "1e11"}, "bandwidth": 1e10, "source": "s"}',
    '{"kind": "cpu", "peak_flops": {"float32": 1e11}, "bandwidth": 1e10, "source": "s"}',
])
def test_a_bad_cache_entry_is_measured_again(tmp_path, monkeypatch, content):
    monkeypatch.setenv(analysis.CACHE_ENV, str(tmp_path))
    calls = []
    analysis.local_device(measure=_fake_cpu(calls))
    (cached,) = tmp_path.glob("*.json")
    cached.write_text(content)
    entry = analysis.local_device(measure=_fake_cpu(calls))
    assert calls == [1, 1] and entry["bandwidth"] == 1e10
    assert json.loads(cached.read_text()) == entry  # overwritten
    assert analysis.local_device(measure=_fake_cpu(calls)) == entry and calls == [1, 1]


def test_a_cache_that_cannot_be_written_gives_the_figures_uncached(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv(analysis.CACHE_ENV, str(folder))
    folder.chmod(0o500)
    try:
        (folder / "probe").touch()
    except OSError:
        pass
    else:  # (root writes anyway: the write fails as it would)
        (folder / "probe").unlink()

        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(analysis.tempfile, "mkstemp", refuse)
    try:
        calls = []
        entry = analysis.local_device(measure=_fake_cpu(calls))
        assert entry["peak_flops"] == {"float32": 2e11} and calls == [1]
        assert not list(folder.glob("*.json"))
        analysis.local_device(measure=_fake_cpu(calls))
        assert calls == [1, 1]  # (measured again: nothing was cached)
    finally:
        folder.chmod(0o700)


# ---------------------------------------------------------------------------------------------
# published figures (scripts/oracles/flops.py has the whole table)


def test_resnet50_within_5_percent_of_torchvision(tmp_path):
    r = analysis.analyze(shared_zoo_model("resnet50-legacy"), device=DEV)
    assert abs(r["flops"] / 8.18e9 - 1) < 0.05  # torchvision: 4.09 GMACs
    assert r["by_op_type"]["Conv"]["nodes"] == 53 and r["params"]["count"] > 25_000_000


def test_small_bert_matmuls_counted_by_hand(tmp_path):
    """The zoo's small BERT (4 layers, 256 wide, 4 heads of 64, 1024 intermediate) at 1x16."""
    s, d, ff, layers = 16, 256, 1024, 4
    path = shared_zoo_model("bert-legacy")
    shapes = {n: [1, s] for n in ("input_ids", "attention_mask", "token_type_ids")}
    r = analysis.analyze(path, input_shapes=shapes, device=DEV)
    per_layer = 2 * s * d * (4 * d + 2 * ff) + 2 * 2 * s * s * d  # projections, FFN; Q K' and P V
    assert r["by_op_type"]["MatMul"]["flops"] == layers * per_layer
    assert r["by_op_type"]["Gemm"]["flops"] == 2 * d * d + d  # the pooler
    matmuls = layers * per_layer + 2 * d * d + d
    assert matmuls < r["flops"] < 1.03 * matmuls  # element-wise work: biases, GELU, layer norms, softmax
    assert not r["symbolic"] and r["nodes_with_unknown_shapes"] == 0


# ---------------------------------------------------------------------------------------------
# the command line


def test_inspect_prints_the_summary_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(two_layer(), str(path))
    out = tmp_path / "r.json"
    code = cli.main(["inspect", str(path), "--input-shape", "x=2x5x8", "--device", DEV, "--json", str(out),
                     "--top", "2"])
    text = capsys.readouterr().out
    assert code == 0
    assert "FLOPs: 3.52 k (3,520; 2 per multiply-accumulate)" in text
    assert "top 2 nodes by FLOPs" in text and "top 2 nodes by bytes moved" in text
    assert "NVIDIA H100 SXM5 80GB (h100-sxm)" in text
    lines = text.splitlines()
    first = lines[lines.index("top 2 nodes by FLOPs") + 3].split()
    assert first[:2] == ["proj", "MatMul"]
    data = json.loads(out.read_text())
    assert data["model"] == str(path) and data["flops"] == 3520 and len(data["nodes"]) == 4
    first_bytes = out.read_bytes()
    assert cli.main(["inspect", str(path), "--input-shape", "x=2x5x8", "--device", DEV, "--json", str(out),
                     "-q"]) == 0
    assert out.read_bytes() == first_bytes and capsys.readouterr().out == ""


def test_inspect_sizes_the_memory_of_symbolic_inputs_at_the_verifiers_shapes(tmp_path, capsys):
    # without --input-shape every activation was of unknown size (a lower bound of the inputs alone:
    # 0 bytes); they are taken at the shapes optimize's report takes them at (x 1x16x8), and say so
    from onnxopt.transforms import memory

    path = tmp_path / "m.onnx"
    onnx.save(two_layer(), str(path))
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    assert cli.main(["inspect", str(path), "--device", DEV, "--json", str(out), "--html", str(page), "-q"]) == 0
    mem = json.loads(out.read_text())["memory"]
    assert mem["at"] == {"x": [1, 16, 8]} and not mem["lower_bound"] and mem["unknown"] == []
    fixed = memory.peak(str(path), input_shapes={"x": [1, 16, 8]}, curve=False)
    assert mem["peak_bytes"] == fixed["peak_bytes"] > 0
    assert "symbolic inputs at the verifier&#x27;s shapes: x 1x16x8" in page.read_text()
    # an input the command line fixes is taken as given
    assert cli.main(["inspect", str(path), "--input-shape", "x=2x5x8", "--device", DEV, "--json", str(out), "-q"]) == 0
    mem = json.loads(out.read_text())["memory"]
    assert "at" not in mem and mem["peak_bytes"] == memory.peak(str(path), input_shapes={"x": [2, 5, 8]})["peak_bytes"]
    capsys.readouterr()


def test_a_bare_model_is_inspected(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(two_layer(), str(path))
    env = {**os.environ, analysis.CACHE_ENV: str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "onnxopt", str(path), "--device", "epyc-9654"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "symbolic dimensions set to 1" in proc.stdout and "16*batch*seq^2 + 272*batch*seq" in proc.stdout
    assert "AMD EPYC 9654" in proc.stdout
    # a bad value of an inspect option is inspect's error (--top -1 was "unrecognized arguments: --top -1")
    proc = subprocess.run([sys.executable, "-m", "onnxopt", str(path), "--top", "-1"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 2 and proc.stderr == "onnxopt: error: --top -1: expected a whole number >= 0\n"
    # an optimize option without -o is still optimize's error
    proc = subprocess.run([sys.executable, "-m", "onnxopt", str(path), "--target", "ort-cpu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("onnxopt: error: no output given")


@pytest.mark.parametrize("args, message", [
    (["--top", "-1"], "--top -1"), (["--device", "nope"], "unknown device"),
    (["--input-shape", "x=1x2"], "x=1x2"), (["--input-shape", "q=1"], "no input 'q'"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    path = tmp_path / "m.onnx"
    onnx.save(two_layer(), str(path))
    with pytest.raises(SystemExit) if args == ["--frobnicate"] else _nothing() as raised:
        code = cli.main(["inspect", str(path), *args])
    if raised is not None:
        code = raised.value.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_missing_and_bad_model_files(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "none.onnx"), "--device", DEV]) == 2
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00" * 10)
    assert cli.main(["inspect", str(bad), "--device", DEV]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no such file" in err[0]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# a model of over 2 GB of external data: its weights are never read


def test_a_model_over_2gb_is_analyzed_without_reading_its_weights(tmp_path, monkeypatch):
    k, n = 16384, 32800  # W: 16384 x 32800 float32 = 2.15 GB in weights.bin (a sparse file)
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[k, n])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(k * n * 4))):
        w.external_data.add(key=key, value=value)
    shape = TensorProto(name="shape", data_type=TensorProto.INT64, dims=[2])
    shape.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "shape.bin"), ("offset", "0"), ("length", "16")):
        shape.external_data.add(key=key, value=value)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Reshape", ["h", "shape"], ["y"])]
    m = model(nodes, [tinfo("x", ["batch", k])], [tinfo("y", None)], [w, shape])
    path = tmp_path / "big.onnx"
    onnx.save(m, str(path))
    big = tmp_path / "weights.bin"
    with open(big, "wb") as f:
        f.truncate(k * n * 4)
    (tmp_path / "shape.bin").write_bytes(np.array([-1, 41], np.int64).tobytes())  # [batch*n/41, 41]
    assert big.stat().st_size > 2 * 10**9

    opened = []
    real_open, real_os_open = builtins.open, os.open
    real_fd = onnx.external_data_helper._open_external_data_fd

    def track(path, *a, **kw):
        opened.append(Path(os.fspath(path)).name if isinstance(path, (str, os.PathLike)) else path)
        return real_open(path, *a, **kw)

    def track_os(path, *a, **kw):
        opened.append(Path(os.fspath(path)).name)
        return real_os_open(path, *a, **kw)

    def track_fd(base, location, *a, **kw):
        opened.append(Path(location).name)
        return real_fd(base, location, *a, **kw)

    monkeypatch.setattr(builtins, "open", track)
    monkeypatch.setattr(stdio, "open", track)
    monkeypatch.setattr(os, "open", track_os)
    monkeypatch.setattr(onnx.external_data_helper, "_open_external_data_fd", track_fd)
    os.utime(big, (0, big.stat().st_mtime))
    t = time.perf_counter()
    r = analysis.analyze(path, input_shapes=["x=2x16384"], device=DEV)
    seconds = time.perf_counter() - t
    monkeypatch.undo()
    assert "shape.bin" in opened  # (the tracking sees the small shape tensor read for shape inference)
    assert "weights.bin" not in opened
    assert big.stat().st_atime == 0 or big.stat().st_atime < big.stat().st_mtime  # never read
    assert seconds < 5
    assert r["flops"] == 2 * 2 * k * n
    assert r["params"]["bytes"] == k * n * 4 + 16
    assert r["outputs"][0]["shape"] == [2 * n // 41, 41]  # the shape tensor's values reached shape inference


def test_fusions_count_as_what_they_replace(tmp_path):
    """The small BERT optimized for onnxruntime's CPU (Attention, Gelu, LayerNormalization fused in
    com.microsoft ops): its FLOPs stay within 1% of the unfused model's."""
    from onnxopt import optimize

    src = shared_zoo_model("bert-legacy")
    out = tmp_path / "bert-cpu.onnx"
    optimize(str(src), output=str(out), target="ort-cpu")
    shapes = {n: [1, 16] for n in ("input_ids", "attention_mask", "token_type_ids")}
    before = analysis.analyze(src, input_shapes=shapes, device=DEV)
    after = analysis.analyze(out, input_shapes=shapes, device=DEV)
    assert after["op_types"].get("com.microsoft.Attention") == 4
    assert after["uncounted_op_types"] == [] and after["nodes_with_unknown_shapes"] == 0
    assert abs(after["flops"] / before["flops"] - 1) < 0.01


def test_constant_nodes_are_parameters_too():
    """Some exporters (paddle2onnx) keep every weight in a Constant node."""
    w = helper.make_node("Constant", [], ["w"], value=init("wv", np.ones((8, 4), np.float32)))
    mm = helper.make_node("MatMul", ["x", "w"], ["y"])
    r = analysis.analyze(model([w, mm], [tinfo("x", [2, 8])], [tinfo("y", None)]), device=DEV)
    assert r["params"]["count"] == 32 and r["params"]["bytes"] == 128
    assert r["nodes"][1]["weight_bytes"] == 128 and r["nodes"][1]["flops"] == 2 * 2 * 4 * 8


def _attention_model():
    """A fused BERT-like block with symbolic batch and sequence: onnx's shape inference knows
    nothing of com.microsoft.Attention's output, so only the fit at concrete sizes counts it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Attention", ["x", "qkv", "qkv_b"], ["a"], domain="com.microsoft", num_heads=2,
                              name="attn"),
             helper.make_node("MatMul", ["a", "out"], ["y"], name="proj")]
    inits = [init("qkv", rng.standard_normal((16, 48)).astype(np.float32)),
             init("qkv_b", np.zeros(48, np.float32)), init("out", rng.standard_normal((16, 16)).astype(np.float32))]
    m = model(nodes, [tinfo("x", ["batch", "seq", 16])], [tinfo("y", None)], inits)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def test_nodes_the_fit_counted_have_known_shapes():
    r = analysis.analyze(_attention_model(), device=DEV)
    assert r["symbolic"] and r["nodes_with_unknown_shapes"] == 0
    attn = r["nodes"][0]
    assert attn["op"] == "com.microsoft.Attention" and attn.get("shapes_known", True) is True
    assert attn["expr"]["bytes_written"] == "64*batch*seq" and attn["intensity"] is not None
    text = format_inspect(r, "m.onnx")
    assert "unknown shapes" not in text


def test_a_node_of_unknown_shapes_has_no_intensity_or_bound():
    nodes = [helper.make_node("Mystery", ["x"], ["t"], domain="custom.domain", name="mystery"),
             helper.make_node("Relu", ["t"], ["y"], name="relu"),
             helper.make_node("MatMul", ["x", "w"], ["z"], name="known")]
    m = model(nodes, [tinfo("x", [4, 8])], [tinfo("y", None), tinfo("z", None)],
              [init("w", np.ones((8, 8), np.float32))])
    m.opset_import.append(helper.make_opsetid("custom.domain", 1))
    r = analysis.analyze(m, device=DEV)
    assert r["nodes_with_unknown_shapes"] == 2
    for n in r["nodes"][:2]:
        assert n["shapes_known"] is False and n["intensity"] is None and n["bound"] is None
    assert r["nodes"][2]["intensity"] > 0 and r["nodes"][2]["bound"] == "memory"
    assert json.loads(json.dumps(r))["nodes"][1]["intensity"] is None
    lines = format_inspect(r, "m.onnx", top=3).splitlines()
    relu = next(line.split() for line in lines if line.startswith("relu "))
    assert relu[-2:] == ["-", "-"]  # FLOPs/byte and bound
    assert "nodes compute-bound: 0, memory-bound: 1" in "\n".join(lines)


def test_params_count_the_initializers_of_subgraphs():
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "w_then"], ["t"])], "then", [],
                               [tinfo("t", [2, 8])], [init("w_then", np.ones((16, 8), np.float32))])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["e"],
                                                 value=init("c", np.ones((2, 8), np.float16)))],
                               "else", [], [tinfo("e", [2, 8], TensorProto.FLOAT16)])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)
    m = model([node], [tinfo("cond", [], TensorProto.BOOL), tinfo("x", [2, 16])], [tinfo("y", None)],
              [init("top", np.ones(4, np.float32))])
    r = analysis.analyze(m, device=DEV)
    assert r["params"] == {"count": 4 + 128 + 16, "bytes": 4 * 4 + 128 * 4 + 16 * 2,
                           "by_dtype": {"float32": {"count": 132, "bytes": 528},
                                        "float16": {"count": 16, "bytes": 32}}}


def _nonzero_model(n):
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Cast", ["nz"], ["y"], to=1),
             helper.make_node("Relu", ["y"], ["z"])]
    return model(nodes, [tinfo("x", [n])], [tinfo("z", None)])


def test_symbols_shape_inference_invents_are_not_asked_for():
    r = analysis.analyze(_nonzero_model(4), device=DEV)
    assert r["symbolic"]
    (unk,) = r["symbols"]["undetermined"]
    assert r["symbols"]["inputs"] == [] and unk in r["expr"]["flops"]
    assert f"{unk}: dimensions shape inference could not determine" in r["symbols_note"]
    text = format_inspect(r, "m.onnx")
    assert "--input-shape cannot set them" in text and unk in text and "give them with --input-shape" not in text
    # an input's own symbol is still asked for, the invented one named apart
    r = analysis.analyze(_nonzero_model("n"), device=DEV)
    assert r["symbols"] == {"inputs": ["n"], "undetermined": [unk]}
    text = format_inspect(r, "m.onnx")
    assert "(give them with --input-shape): n;" in text and f"cannot set them): {unk}" in text


def test_symbolic_inference_leaves_no_file_in_the_current_folder(tmp_path, monkeypatch):
    """onnxruntime's symbolic shape inference saves sym_shape_infer_temp.onnx into the current folder where
    a shape stays open (then raises); the analysis and the memory figures use its loop without that."""
    from onnxopt.transforms import memory

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Mystery", ["x"], ["t"], domain="my.ops"), helper.make_node("Relu", ["t"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),  # (an op neither inference knows)
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    monkeypatch.chdir(tmp_path)
    analysis.analyze(m)
    memory.peak(m)
    assert list(tmp_path.iterdir()) == []


def test_symbolic_shape_inference_imports_neither_torch_nor_onnxruntime():
    """onnxruntime's symbolic shape inference is read from its file: the package onnxruntime.tools imports
    torch where torch is installed (1.5 s of every command that infers shapes), and the tool needs neither."""
    import subprocess
    import sys

    pytest.importorskip("onnxruntime")
    code = ("import sys, onnx\n"
            "from onnx import helper, TensorProto\n"
            "from onnxopt.ir import shapes\n"
            "x = helper.make_tensor_value_info('x', TensorProto.FLOAT, ['n', 3])\n"
            "y = helper.make_tensor_value_info('y', TensorProto.INT64, None)\n"
            "g = helper.make_graph([helper.make_node('Shape', ['x'], ['y'])], 'g', [x], [y])\n"
            "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)])\n"
            "out = shapes.symbolic_infer(m)\n"
            "dims = out.graph.output[0].type.tensor_type.shape.dim\n"
            "print(len(dims), dims[0].dim_value, 'torch' in sys.modules, 'onnxruntime' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1", "2", "False", "False"]
