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
    assert "calibration data: onnxruntime cannot run the model on a feed of x 1x3x6x6 float32" in lines[0]
    assert "the model declares x ?x3x?x? float" in lines[0]
    assert not out.exists()


def test_held_out_shapes_the_model_cannot_run_exit_2(tmp_path, capsys):
    """Calibration runs (8x8); the one held-out feed (position 3 of 6) is 6x6: refused before fidelity."""
    model = _strided(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    code, lines, err = _main(capsys, "quantize", model, "-o", out,
                             "--calib", _calib(tmp_path / "c", [8, 8, 8, 6, 8, 8]), "--held-out", "1")
    assert code == 2 and len(lines) == 1, err
    assert "held-out calibration data: onnxruntime cannot run the model on a feed of x 1x3x6x6" in lines[0]
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
