"""issue 27 items 9 and 11: calibration data a model cannot run, or values near float32's limit, are the
user's (one line, exit 2), never an internal error (exit 3); our own bugs stay exit 3."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxopt import cli
from onnxopt.errors import UsageError
from onnxopt.quantize import calibrate as cal


def _strided(path):
    """x [N,3,H,W] (H, W dynamic) -> Conv stride 2 -> Add a [1,4,4,4] constant -> Relu: runs at 8x8 only
    (at 6x6 the Conv gives 3x3, which does not broadcast with 4x4), like a detector whose strides need
    multiples of 32."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((1, 4, 4, 4)).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Add", ["c", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", 1, ["n", 4, 4, 4])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _calib(folder, sizes):
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i, s in enumerate(sizes):
        np.save(folder / f"{i:03d}.npy", rng.standard_normal((1, 3, s, s)).astype(np.float32))
    return folder


def _main(capsys, *args):
    code = cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning")]
    return code, lines, err


@pytest.mark.parametrize("workers", [1, 2])
def test_calibration_shapes_the_model_cannot_run_exit_2(tmp_path, capsys, workers):
    model = _strided(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    code, lines, err = _main(capsys, "quantize", model, "-o", out, "--calib", _calib(tmp_path / "c", [6] * 4),
                             "--workers", workers)
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "internal error" not in lines[0], lines
    assert "calibration data: onnxruntime cannot run the model at inputs x 1x3x6x6 float32" in lines[0]
    assert "(the model declares x ?x3x?x?;" in lines[0]
    assert not out.exists()


def test_held_out_shapes_the_model_cannot_run_exit_2(tmp_path, capsys):
    """Calibration runs (8x8); the one held-out feed (position 3 of 6) is 6x6: refused before fidelity."""
    model = _strided(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    code, lines, err = _main(capsys, "quantize", model, "-o", out,
                             "--calib", _calib(tmp_path / "c", [8, 8, 8, 6, 8, 8]), "--held-out", "1")
    assert code == 2 and len(lines) == 1, err
    assert "held-out calibration data: onnxruntime cannot run the model at inputs x 1x3x6x6" in lines[0]
    assert not out.exists()
    # the same data at sizes the model takes is quantized
    code, _, err = _main(capsys, "quantize", model, "-o", out, "--calib", _calib(tmp_path / "ok", [8] * 6),
                         "--held-out", "1")
    assert code == 0, err
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)


def test_errors_of_our_own_stay_bugs(tmp_path):
    """Only onnxruntime refusing the float model on a feed is the user's; a Python error of ours is not."""
    model = _strided(tmp_path / "m.onnx")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feed = {"x": np.zeros((1, 3, 6, 6), np.float32)}
    with pytest.raises(Exception) as info:
        sess.run(None, feed)
    made = cal.feed_error(info.value, feed, sess, "calibration")
    assert isinstance(made, UsageError) and "x 1x3x6x6 float32" in str(made)
    assert cal.feed_error(KeyError("x"), feed, sess, "calibration") is None
    assert cal.feed_error(UsageError("x"), feed, sess, "calibration") is None
    cal.check_runs(str(model), [{"x": np.zeros((1, 3, 8, 8), np.float32)}] * 3, "calibration")  # runs: no error


def _matmul(path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 4)) * 1e-3).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [1, 8])],
                              [helper.make_tensor_value_info("y", 1, [1, 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_values_at_float32s_limit_exit_2(tmp_path, capsys, method):
    """Calibration values spanning +-3.4e38: the 8-bit scale's lowest code dequantizes to -inf (was a model
    computing inf, written with exit 0). Refused in one line naming the tensor; 3e37 still quantizes."""
    model = _matmul(tmp_path / "m.onnx")
    big = np.finfo(np.float32).max
    folder = tmp_path / "c"
    folder.mkdir()
    rng = np.random.default_rng(2)
    for i in range(6):
        a = rng.uniform(-1, 1, (1, 8)).astype(np.float32)
        a[0, :2] = (-big, big)
        np.save(folder / f"{i}.npy", a)
    out = tmp_path / "q.onnx"
    code, lines, err = _main(capsys, "quantize", model, "-o", out, "--calib", folder, "--method", method,
                             "--target", "portable", "--keep-float", "never")
    assert code == 2 and len(lines) == 1, err
    assert "calibration: tensor 'x' ranges over [-3.403e+38, 3.403e+38], too wide" in lines[0]
    assert not out.exists()
    near = tmp_path / "near"
    near.mkdir()
    for i in range(6):
        np.save(near / f"{i}.npy", (rng.uniform(-1, 1, (1, 8)) * 3e37).astype(np.float32))
    code, lines, err = _main(capsys, "quantize", model, "-o", out, "--calib", near, "--method", method,
                             "--target", "portable", "--keep-float", "never")
    assert code == 0, err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    import onnxruntime as ort

    x = (rng.uniform(-1, 1, (1, 8)) * 3e37).astype(np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.isfinite(got).all()


def test_check_scale_bounds():
    big = float(np.finfo(np.float32).max)
    cal._check_scale("t", -3e37, 3e37)
    cal._check_scale("t", 0.0, big)  # (0 .. 255 * scale: the top code is float32's largest)
    for lo, hi in ((-big, big), (-big / 1.001, big)):
        with pytest.raises(UsageError, match="too wide for an 8-bit float32 scale"):
            cal._check_scale("t", lo, hi)


def _bomb(path, name, shape):
    """A compressed .npz whose one array inflates to 4 bytes per element of ``shape`` (zeros: a few KB)."""
    np.savez_compressed(path, **{name: np.zeros(shape, np.float32)})
    return path


def test_npz_that_inflates_past_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    """issue 27 item 8's class: numpy reads an .npz member whole, so a small compressed file can declare
    gigabytes. verify --inputs and calibration files are refused in one line when their arrays inflate past
    readers.MAX_NPZ_BYTES (4 GiB; 1 MiB here so the test stays small), before numpy allocates them."""
    from onnxopt import readers

    monkeypatch.setattr(readers, "MAX_NPZ_BYTES", 1 << 20)
    model = _strided(tmp_path / "m.onnx")
    bomb = _bomb(tmp_path / "big.npz", "x", (1, 3, 256, 256))  # 786,432 bytes: under the limit...
    assert bomb.stat().st_size < 20_000
    bomb = _bomb(tmp_path / "big.npz", "x", (2, 3, 256, 256))  # ...1,572,864: over it
    code, lines, err = _main(capsys, "verify", model, model, "--inputs", bomb)
    assert code == 2 and len(lines) == 1, err
    assert f"inputs file {bomb}: its arrays inflate to 1,572,992 bytes, more than 1 MiB" in lines[0]
    # calibration: one .npz of samples (compressed members are read whole), and a folder of per-feed files
    out = tmp_path / "q.onnx"
    code, lines, err = _main(capsys, "quantize", model, "-o", out, "--calib", bomb)
    assert code == 2 and len(lines) == 1 and "inflate to 1,572,992 bytes" in lines[0], err
    folder = tmp_path / "c"
    folder.mkdir()
    _bomb(folder / "0.npz", "x", (1, 3, 8, 8))
    _bomb(folder / "1.npz", "x", (1, 3, 512, 512))
    code, lines, err = _main(capsys, "quantize", model, "-o", out, "--calib", folder)
    assert code == 2 and len(lines) == 1 and "1.npz: its arrays inflate to 3,145,856 bytes" in lines[0], err
    assert not out.exists()
    # stored (uncompressed) samples are memory-mapped, not read whole: not counted
    stored = tmp_path / "stored.npz"
    np.savez(stored, x=np.zeros((2, 1, 3, 256, 256), np.float32))
    readers.check_npz(stored, "calibration file", compressed_only=True)
    with pytest.raises(UsageError, match="inflate"):
        readers.check_npz(stored, "inputs file")


@pytest.mark.parametrize("face", ["verify", "bisect"])
def test_verify_and_bisect_name_the_shapes_the_model_cannot_run(tmp_path, capsys, face):
    """The class of item 11 in verify and bisect: the original refusing the user's inputs was already exit 2;
    the line now names the shapes run and the model's declared ones."""
    model = _strided(tmp_path / "m.onnx")
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.zeros((1, 3, 6, 6), np.float32))
    args = [model, model] if face == "verify" else [model]
    code, lines, err = _main(capsys, face, *args, "--inputs", npz)
    assert code == 2 and len(lines) == 1, err
    assert "cannot run the original model at the shapes of the data given (x=1x3x6x6)" in lines[0]
    assert "(the model declares x ?x3x?x?;" in lines[0]


def test_deep_json_in_a_models_metadata(tmp_path, capsys):
    """issue 27 item 8's class, JSON read back from a model: onnxopt's provenance keys (onnxopt.sources,
    .replaced, .merged) and the io_layout record hold JSON; 100,000 nested arrays there were a RecursionError
    (exit 3) in optimize and diff. Provenance that is not onnxopt's is ignored; the layout record is refused
    in one line."""
    deep = "[" * 100_000 + "]" * 100_000
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="r0"), helper.make_node("Relu", ["x"], ["r2"], name="r1"),
             helper.make_node("Add", ["r", "r2"], ["y"], name="a0")]
    for n in nodes:
        for key in ("onnxopt.sources", "onnxopt.rule", "onnxopt.replaced", "onnxopt.merged"):
            n.metadata_props.add(key=key, value=deep)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 4])],
                              [helper.make_tensor_value_info("y", 1, [1, 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "deep.onnx"
    onnx.save(m, src)
    out = tmp_path / "o.onnx"
    assert cli.main([str(src), "-o", str(out)]) == 0, capsys.readouterr().err
    opt = onnx.load(str(out))
    onnx.checker.check_model(opt, full_check=True)
    assert sum(n.op_type == "Relu" for n in opt.graph.node) == 1  # the twin Relu merged, its record rewritten
    import onnxruntime as ort

    x = np.linspace(-2, 2, 4, dtype=np.float32).reshape(1, 4)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_array_equal(run(src), run(out))
    assert cli.main(["diff", str(src), str(out), "--html", str(tmp_path / "d.html")]) == 0, capsys.readouterr().err
    m.metadata_props.add(key="onnxopt.io_layout", value=deep)
    onnx.save(m, src)
    code, lines, err = _main(capsys, "verify", src, src)
    assert code == 2 and len(lines) == 1 and "onnxopt.io_layout is not what onnxopt writes" in lines[0], err


def test_bias_scale_that_overflows_leaves_the_weights_float(tmp_path, capsys):
    """issue 27 item 9's class, computed scales: activations near 3e37 times weights near 1e6 give a bias scale
    (x_scale * w_scale) of inf in float32, written as a DequantizeLinear scale (0 * inf = NaN). The weights
    rule now refuses such a node (weights and bias stay float); every scale written is a finite normal float."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 1, 1)) * 1e6).astype(np.float32), "w")
    b = numpy_helper.from_array(np.ones(4, np.float32), "b")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", 1, [1, 4, 4, 4])], [w, b])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(6):
        a = (rng.uniform(-1, 1, (1, 3, 4, 4)) * 3e37).astype(np.float32)
        a[0, 1:] = 0
        np.save(folder / f"{i}.npy", a)
    out = tmp_path / "q.onnx"
    code, _, err = _main(capsys, "quantize", model, "-o", out, "--calib", folder, "--target", "portable",
                         "--keep-float", "never", "--no-fidelity")
    assert code == 0, err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    scales = [inits[n.input[1]] for n in q.graph.node if n.op_type in ("DequantizeLinear", "QuantizeLinear")]
    # (none here: the plan leaves the Conv float with no Q after it -- onnxruntime would quantize
    # DequantizeLinear -> Conv -> QuantizeLinear itself, with the same scales; tests/test_quant_qdq_range.py)
    for s in scales:
        assert np.all(np.isfinite(s)) and np.all(s >= np.finfo(np.float32).tiny), s
    assert any(n.op_type == "Conv" and n.input[1] == "w" for n in q.graph.node)  # the weights stay float
