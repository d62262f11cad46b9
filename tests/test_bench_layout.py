"""scripts/bench/layout.py (issue 16's layout benchmark): its pure parts (numpy preprocessing, the
NhwcConv rewrite and its CPU emulation, transpose facts, ranking) on onnx-helper models, and each part
end to end with --tiny on the CPU provider (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_ort
from onnx import TensorProto, helper, numpy_helper

from onnxopt.transforms import edges as layout
from onnxopt.models.nhwc import keras_like

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ["-m", "scripts.bench.layout"]


from scripts.bench import layout as bl
IMAGENET = bl.IMAGENET


# ---------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("text", [f"uint8,HWC,{IMAGENET}", f"uint8,HWC,{IMAGENET},bgr", f"uint8,NHWC,{IMAGENET},bgr",
                                  "uint8,HWC,scale=1/255,mean=0.5,std=0.5"])
def test_numpy_preprocess_is_the_reference(text):
    pre = layout.parse_preprocess({"x": text})["x"]
    shape = (2, 5, 7, 3) if pre.batched else (5, 7, 3)
    pix = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    got = bl.numpy_preprocess(pix, pre)
    ref = layout.reference_input(pix, pre)
    assert got.shape == ref.shape and got.dtype == np.float32 and got.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def _convnet(pads=1, group=1, batch=1, c=4, hw=8):
    """x -> Conv 3x3 -> Relu -> Conv 3x3 (group) -> Add(residual) -> Relu -> MaxPool -> Conv 1x1 -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in
             (("w0", (c, 3, 3, 3)), ("w1", (c, c // group, 3, 3)), ("w2", (6, c, 1, 1)))]
    inits.append(numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b0"))
    p = [pads] * 4
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=p),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=p, group=group),
             helper.make_node("Add", ["c1", "r0"], ["a"]),
             helper.make_node("Relu", ["a"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["m"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["m", "w2"], ["y"])]
    g = helper.make_graph(nodes, "convnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 6, hw // 2, hw // 2])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("group", [1, 2])
def test_nhwc_conv_rewrite_structure_and_arithmetic(group):
    proto = _convnet(group=group)
    out, facts = bl.to_nhwc_conv(proto, target=None)  # the rewrite alone
    assert facts["convs_rewritten"] == 3 and facts["transposes_inserted"] == 6
    ops = [(n.domain, n.op_type) for n in out.graph.node]
    assert ops.count(("com.microsoft", "NhwcConv")) == 3 and ("", "Conv") not in ops
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in out.opset_import)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    orig = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for n in out.graph.node:
        if n.op_type != "NhwcConv":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        w = inits[n.input[1]]
        src = orig[n.input[1].removesuffix("__ohwi")]
        np.testing.assert_array_equal(w, src.transpose(0, 2, 3, 1))  # [M, kH, kW, C/group]
        assert attrs["kernel_shape"] == list(src.shape[2:])
        assert attrs.get("group", 1) == (group if src.shape[1] != 3 and src.shape[2] == 3 else 1)
    # the transposes around consecutive convs cancel in onnxopt's pipeline
    opt, facts = bl.to_nhwc_conv(proto, target="ort-cpu")
    assert facts["transposes_after"] < facts["transposes_inserted"] and facts["transposes_after"] <= 4
    # what the NhwcConv model computes (through its standard-ONNX emulation) is the original's
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (ref,) = run_ort(proto, {"x": x})
    for m in (out, opt):
        emu = bl.nhwc_conv_emulation(m)
        assert not any(n.domain == "com.microsoft" for n in emu.graph.node)
        (got,) = run_ort(emu, {"x": x})
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_nhwc_conv_keeps_convs_it_cannot_take():
    proto = _convnet()
    w = proto.graph.initializer[0]
    proto.graph.input.append(helper.make_tensor_value_info(w.name, TensorProto.FLOAT, list(w.dims)))
    proto.graph.initializer.remove(w)  # w0 now a graph input: not constant
    out, facts = bl.to_nhwc_conv(proto, target=None)
    assert facts["convs_rewritten"] == 2 and facts["convs_left"] == 1
    assert [n.op_type for n in out.graph.node].count("Conv") == 1


def test_transpose_facts(tmp_path):
    p = tmp_path / "k.onnx"
    onnx.save(keras_like(1, 1, 8, 4), str(p))
    f = bl.transpose_facts(str(p))
    assert f["transposes"] == 6 and f["transposes_at_input"] == 1
    assert f["bytes"] == 4 * f["elements_static"] and f["elements_static"] > 0
    assert f["op_types"]["Transpose"] == 6


def test_rank_keras_targets():
    tools = [bl.get_keras_tool(t) for t in ("onnxopt", "ort-basic", "onnxsim")]
    res = {"rows": {
        "original": {"status": "baseline", "transposes": 10, "latency": {"median_ms": 2.0}},
        "onnxopt": {"status": "ok", "transposes": 1, "latency": {"median_ms": 1.01}},
        "ort-basic": {"status": "ok", "transposes": 2, "latency": {"median_ms": 1.0}},
        "onnxsim": {"status": "differs", "transposes": 0, "latency": {"median_ms": 0.5}},
    }}
    bl.rank_keras(res, tools)
    assert res["best_peer"]["latency"] == {"tool": "ort-basic", "median_ms": 1.0}  # onnxsim differs: not ranked
    assert res["rows"]["onnxopt"]["target"] == {"fewest_transposes": True, "latency_within_2pct": True}
    assert res["rows"]["onnxopt"]["latency"]["x_original"] == pytest.approx(0.505)
    res["rows"]["ort-basic"]["transposes"] = 0
    bl.rank_keras(res, tools)
    assert res["rows"]["onnxopt"]["target"]["fewest_transposes"] is False


def test_random_feeds_and_manifest():
    m = keras_like(1, "N", 8, 4)
    feeds = bl.random_feeds(m)
    assert feeds["x"].shape == (1, 8, 8, 3) and feeds["x"].dtype == np.float32
    manifest = {"m.json": {"models": [{"file": "/a/keras-x-tf2onnx-opt.onnx", "opt": True}]}}
    assert bl._manifest_entry(manifest, "keras-x-tf2onnx-opt.onnx") == {"file": "/a/keras-x-tf2onnx-opt.onnx",
                                                                        "opt": True}
    assert bl._manifest_entry(manifest, "other.onnx") is None


def test_raw_photo():
    pytest.importorskip("skimage")
    img = bl.raw_photo(1, (32, 48))
    assert img.shape == (32, 48, 3) and img.dtype == np.uint8 and img.std() > 5
    page = bl.raw_page(0, (64, 64))
    assert page.shape == (64, 64, 3) and page.dtype == np.uint8


# ---------------------------------------------------------------------------------------------
# End to end, --tiny, CPU


def _start(tmp_path, *args):
    """One part of the script, --tiny, started (not waited for): the parts run side by side."""
    out = tmp_path / f"{args[0]}.json"
    return subprocess.Popen([sys.executable, *SCRIPT, *args, "--tiny", "--runs", "3", "--warmup", "1",
                             "--min-rounds", "2", "--work", str(tmp_path / f"work-{args[0]}"),
                             "--cache", str(tmp_path / f"cache-{args[0]}"), "--json", str(out),
                             "--markdown", str(tmp_path / f"{args[0]}.md")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _finish(tmp_path, part, proc):
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    return json.loads((tmp_path / f"{part}.json").read_text()), (tmp_path / f"{part}.md").read_text()


def test_tiny_keras_stand_ins(tmp_path):
    """What ``keras --tiny`` measures when no Keras export is cached: keras_like and bench_targets'
    tinyconv rewritten as tf2onnx writes Keras models (the end-to-end test below feeds the first
    one by path, the same bench_keras either way)."""
    models = bl.keras_models(None, tmp_path / "cache", tmp_path / "work", True, lambda s: None)
    assert [m[0] for m in models] == ["keras_like-2x16x8", "tinyconv-nhwc"]
    assert all(m[3] is None and m[2].startswith("stand-in: ") for m in models)
    assert bl.transpose_facts(str(models[0][1]))["transposes"] == 10
    assert bl.transpose_facts(str(models[1][1]))["transposes"] > 1
    given = bl.keras_models([models[0][1]], tmp_path / "cache", tmp_path / "work", True, lambda s: None)
    assert given == [("keras_like-2x16x8", models[0][1], "given on the command line", None)]


def test_tiny_end_to_end(tmp_path):
    """The three parts side by side (two cores), each on one tiny model, then rendered together.
    keras: the keras_like stand-in (test_tiny_keras_stand_ins checks what --tiny adds) with onnxopt
    and one peer."""
    src = tmp_path / "keras-models" / "keras_like-2x16x8.onnx"
    src.parent.mkdir()
    onnx.save(keras_like(2, 1, 16, 8), str(src))
    procs = {"keras": _start(tmp_path, "keras", "--models", str(src), "--tools", "onnxopt", "ort-basic"),
             "edge": _start(tmp_path, "edge", "--photos", "1"),
             "gpu": _start(tmp_path, "gpu", "--provider", "cpu", "--precisions", "fp32")}
    try:
        keras, md = _finish(tmp_path, "keras", procs["keras"])
        rows = keras["models"]["keras_like-2x16x8"]["rows"]
        assert rows["original"]["transposes"] == 10 and rows["onnxopt"]["transposes"] < rows["ort-basic"]["transposes"]
        assert rows["onnxopt"]["status"] == "ok" and rows["onnxopt"]["latency"]["median_ms"] > 0
        assert rows["onnxopt"]["target"]["fewest_transposes"] is True and "x_best_peer" in rows["onnxopt"]["latency"]
        assert "## A. Keras models" in md and "| keras_like-2x16x8 | onnxopt | 1 |" in md

        edge, md = _finish(tmp_path, "edge", procs["edge"])
        v = edge["models"]["tinyconv"]["variants"]
        for lay in ("hwc", "nhwc"):
            row = v[f"onnxopt-uint8-{lay}"]
            assert row["target_one_transpose_at_input"] and row["outputs_equal"], row
            assert row["x_numpy_nchw"] > 0
        assert set(edge["models"]["tinyconv"]["latency"]) == {
            "onnxopt-uint8-hwc", "numpy(HWC)+onnxopt-nchw", "numpy(HWC)+original", "onnxopt-uint8-nhwc",
            "numpy(NHWC)+onnxopt-nchw", "numpy(NHWC)+original"}
        assert "| tinyconv | HWC | 1 (1) |" in md

        gpu, md = _finish(tmp_path, "gpu", procs["gpu"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    m = gpu["models"]["tinyconv"]["batch"]["1"]["variants"]
    assert set(m) == {"original/fp32", "onnxopt/fp32", "onnxopt-uint8/fp32", "onnxopt-nhwcconv/fp32"}
    for k, row in m.items():
        assert row["status"] == "ok" and "default" in row["latency"], (k, row)
        if k != "original/fp32":
            assert row["fidelity"]["ok"], (k, row["fidelity"])
    assert m["onnxopt-nhwcconv/fp32"]["rewrite"]["convs_rewritten"] == 2
    assert m["onnxopt-nhwcconv/fp32"]["transposes"] == 2  # of the NhwcConv model, not of its emulation
    assert "emulation" in m["onnxopt-nhwcconv/fp32"]["note"]
    assert "## C. resnet50 and PP-OCRv4 det on CPU" in md

    both = tmp_path / "all.md"
    jsons = [str(tmp_path / f"{part}.json") for part in ("keras", "edge", "gpu")]
    r = subprocess.run([sys.executable, *SCRIPT, "render", *jsons, "--markdown", str(both)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text = both.read_text()
    assert text.count("- part ") == 3 and "## A." in text and "## B." in text and "## C." in text


@pytest.mark.parametrize("part,flag", [("render", "--markdown"), ("benefit", "--json")])
def test_an_output_that_is_an_input_is_refused(tmp_path, part, flag):
    report = tmp_path / "r.json"
    report.write_text('{"meta": {}, "models": {}}')
    before = report.read_bytes()
    r = subprocess.run([sys.executable, *SCRIPT, part, str(report), flag, str(report)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "is one of the reports read" in r.stderr and len(r.stderr.splitlines()) == 1
    assert report.read_bytes() == before
