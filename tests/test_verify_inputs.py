"""The verifier's settings and inputs files (issue 11, items 16 and 18): every value a user gives
``verify``, ``bisect`` and ``--verify`` is refused in one line with exit 2 when it is bad, never
with an internal error (exit 3) and never silently accepted; nothing but the verdict under -q."""

from __future__ import annotations

import io as _io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, model, tinfo
from onnxopt import cli, verify
from onnxopt.errors import UsageError
from test_verify import _text_model

pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[1]


def _npz_bytes(**arrays) -> bytes:
    buf = _io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _npy_bytes(array) -> bytes:
    buf = _io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _zip_bytes(**members: bytes) -> bytes:
    import zipfile

    buf = _io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


INPUTS_FILES = {
    "empty": b"",
    "truncated": _npz_bytes(input_ids=np.ones((1, 3), np.int64))[:100],
    "npy": _npy_bytes(np.ones((1, 3), np.int64)),
    "pickled": _npz_bytes(input_ids=np.array([{"a": 1}], dtype=object)),
    "wrong-rank": _npz_bytes(input_ids=np.ones(3, np.int64)),
    "member-not-npy": _zip_bytes(**{"input_ids.npy": b"not an array"}),
}

BAD_SETTINGS = {
    "shape-overflow": ["--input-shape", "input_ids=99999999999999999999x3"],
    "shape-trailing-x": ["--input-shape", "input_ids=2x3x"],
    "shape-empty-dim": ["--input-shape", "input_ids=2xx3"],
    "shape-sign": ["--input-shape", "input_ids=+2x3"],
    "shape-twice": ["--input-shape", "input_ids=2x3", "--input-shape", "input_ids=2x4"],
    "shape-too-large": ["--input-shape", "input_ids=99999999999999x3"],  # 2.4 PB of int64
    "shape-beyond-numpy": ["--input-shape", "input_ids=4611686018427387904x3"],
    "shape-symbol": ["--input-shape", "input_ids=batch,3"],  # (a run needs numbers; optimize takes symbols)
    "shape-placeholder": ["--input-shape", "input_ids=2,None"],
    "shape-mixed-forms": ["--input-shape", "input_ids=2x3,4"],
    "range-twice": ["--int-range", "input_ids=0:3", "--int-range", "input_ids=0:4"],
    "range-reversed": ["--int-range", "input_ids=3:0"],
    "warmup-0": ["--warmup", "0"],
    "threads-overflow": ["--threads", "99999999999"],
}


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxopt: error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.onnx"
    onnx.save(_text_model(), str(path))
    return path


def _run(capsys, *args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("face", ["verify", "bisect", "optimize"])
@pytest.mark.parametrize("kind", sorted(INPUTS_FILES))
def test_a_bad_inputs_file_is_one_line_exit_2(text_model, tmp_path, capsys, face, kind):
    """An empty file, a truncated archive and a .npy file ended in an internal error (exit 3)."""
    npz = tmp_path / f"{kind}.npz"
    npz.write_bytes(INPUTS_FILES[kind])
    args = {"verify": ["verify", text_model, text_model], "bisect": ["bisect", text_model],
            "optimize": [text_model, "-o", tmp_path / "o.onnx", "--verify", "cpu"]}[face]
    code, out, err = _run(capsys, *args, "--inputs", npz)
    assert code == 2, err
    line = _one_line(err)
    assert str(npz) in line
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("args", list(BAD_SETTINGS.values()), ids=list(BAD_SETTINGS))
def test_bad_settings_are_one_line_exit_2(text_model, capsys, args):
    code, out, err = _run(capsys, "verify", text_model, text_model, "--runs", "1", *args)
    assert code == 2, out + err
    assert args[0] in _one_line(err) or "cannot make an array" in err  # the setting it is about
    if args[0] != "--warmup" and args[0] != "--threads":  # (bisect takes no latency settings)
        code, out, err = _run(capsys, "bisect", text_model, *args)
        assert code == 2, out + err
        _one_line(err)


@pytest.mark.parametrize("text,shape", [("x=2x3", [2, 3]), ("x=2,3", [2, 3]), ("x=", []), ("x=0x5", [0, 5]),
                                        (f"x={2**63 - 1}", [2**63 - 1])])
def test_input_shapes_that_are_accepted(text, shape):
    assert verify.parse_input_shapes([text]) == {"x": shape}


def test_the_readme_forms_are_what_is_accepted():
    """The manual (docs/verify.md): `--input-shape NAME=1x3x224x224`, `--warmup` at least 1."""
    readme = (ROOT / "docs" / "verify.md").read_text()
    assert "--input-shape NAME=1x3x224x224" in readme and "(`--warmup`, default 5, at least 1)" in readme
    with pytest.raises(UsageError):
        verify.verify(_text_model(), _text_model(), runs=1, warmup=0)


def test_warmup_1_is_accepted(text_model, capsys, tmp_path):
    code, out, err = _run(capsys, "verify", text_model, text_model, "--runs", "2", "--warmup", "1", "-q")
    assert code == 0 and out.strip() == "verdict: outputs agree", err


def _scaled(c):
    nodes = [helper.make_node("Mul", ["x", "c"], ["y"])]
    return model(nodes, [tinfo("x", [3], TensorProto.DOUBLE)], [tinfo("y", [3], TensorProto.DOUBLE)],
                 [init("c", np.float64(c))])


def test_nothing_but_the_verdict_under_quiet(tmp_path):
    """Differences beyond float64's range made numpy print RuntimeWarnings to stderr under -q."""
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(_scaled(1e308), str(a))
    onnx.save(_scaled(-1e308), str(b))
    np.savez(tmp_path / "x.npz", x=np.array([0.5, 1.0, -1.5]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-m", "onnxopt", "verify", str(a), str(b), "--inputs",
                           str(tmp_path / "x.npz"), "--runs", "0", "-q"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("verdict: outputs differ on cpu: y: 3/3 elements out of tolerance")
    assert "max abs inf" in proc.stdout


def test_a_non_tensor_input_is_not_promised_to_an_npz_file():
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])
    m = model([helper.make_node("SequenceLength", ["s"], ["n"])], [seq], [tinfo("n", [], TensorProto.INT64)])
    with pytest.raises(UsageError, match=r"feeds=") as exc:
        verify.make_inputs(m)
    assert "npz" not in str(exc.value)
    rep = verify.verify(m, m, feeds={"s": [np.zeros(2, np.float32)] * 3}, runs=0)
    assert rep["ok"]


@pytest.mark.parametrize("feeds", [{}, {"x": np.zeros(3, np.float32), "other": np.zeros(1)}])
def test_feeds_must_name_the_model_inputs(feeds):
    """A missing feed was reported as 'onnxruntime (cpu) cannot run the original model: 'x''."""
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [3])], [tinfo("y", [3])])
    with pytest.raises(UsageError, match="the model takes x; given"):
        verify.verify(m, m, feeds=feeds, runs=0)


@pytest.mark.parametrize("setting", [{"warmup": 0}, {"runs": -1}, {"threads": -2}, {"rtol": float("nan")}])
def test_verify_settings_refused_before_optimizing(setting, monkeypatch):
    """optimize(verify=...) checks the verifier's settings before the rewrite: no work is wasted."""
    from onnxopt.core import pipeline
    from onnxopt import optimize

    monkeypatch.setattr(pipeline, "run", lambda *a, **k: pytest.fail("optimized before checking the settings"))
    with pytest.raises(UsageError):
        optimize(_text_model(), verify="cpu", verify_options=setting)


def test_a_declared_shape_too_large_to_generate_is_refused_before_allocating():
    """A declared 30000x30000 float input would be drawn as 7.2 GB of float64: refused by size."""
    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [30000, 30000])], [tinfo("y", [30000, 30000])])
    with pytest.raises(UsageError, match="would take 7200000000 bytes"):
        verify.make_inputs(m)
