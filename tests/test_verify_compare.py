"""How the verifier compares outputs (issue 11, item 10): matched by name and position, non-finite
differences reported as such, every kind of value onnxruntime returns (tensors of every dtype,
sequences, maps), and no numpy warnings on the way."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import init, model, tinfo
from onnxopt import cli, verify
from onnxopt.reporting.text import format_verification

pytest.importorskip("onnxruntime")


def run_main(capsys, *args):
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _save(tmp_path, name, m):
    path = tmp_path / name
    onnx.save(m, str(path))
    return path


def _relus(outputs):
    """y_i = Relu(x) for each output name given (in that order)."""
    return model([helper.make_node("Relu", ["x"], [o]) for o in outputs], [tinfo("x", [3])],
                 [tinfo(o, [3]) for o in outputs])


@pytest.mark.parametrize("after,problems", [
    (["z"], {"y": "missing in the optimized model (output 0 is now 'z')",
             "z": "output 0 of the optimized model, not in the original"}),
    (["y", "extra"], {"extra": "output 1 of the optimized model, not in the original"}),
    (["w", "y"], {"y": "output 0 in the original, output 1 now", "w": "output 1 in the original, output 0 now"}),
], ids=["renamed", "extra", "swapped"])
def test_outputs_are_matched_by_name_and_position(tmp_path, capsys, after, problems):
    """A renamed, added or moved output breaks callers that fetch outputs by name or position:
    each fails verification, although every value is the same."""
    before = ["y", "w"] if "w" in after else ["y"]
    a, b = _save(tmp_path, "a.onnx", _relus(before)), _save(tmp_path, "b.onnx", _relus(after))
    code, out, err = run_main(capsys, "verify", a, b, "--runs", "0", "--json", tmp_path / "r.json")
    assert code == 1, out + err
    rows = json.loads((tmp_path / "r.json").read_text())["providers"]["cpu"]["outputs"]
    assert {r["name"]: r["problem"] for r in rows if not r["ok"]} == problems
    assert "OUTPUTS DIFFER" in out and "outputs agree" not in out


def _constant_plus_x(value, dtype=TensorProto.FLOAT):
    """y = c + x with c computed at run time from a constant (so no one folds it away)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    return model([helper.make_node("Identity", ["c"], ["k"]), helper.make_node("Add", ["x", "k"], ["y"])],
                 [tinfo("x", [3], dtype)], [tinfo("y", [3], dtype)], [init("c", np.full(3, value, np_dtype))])


def test_an_infinity_against_a_finite_value_is_reported_as_such(tmp_path, capsys):
    """inf against 100 was summarised as "max abs 0, max rel 0"."""
    a = _save(tmp_path, "a.onnx", _constant_plus_x(np.inf))
    b = _save(tmp_path, "b.onnx", model([helper.make_node("Mul", ["x", "zero"], ["m"]),
                                         helper.make_node("Add", ["m", "h"], ["y"])], [tinfo("x", [3])],
                                        [tinfo("y", [3])], [init("zero", np.float32(0)), init("h", np.float32(100))]))
    code, out, err = run_main(capsys, "verify", a, b, "--runs", "0", "-q", "--json", tmp_path / "r.json")
    assert code == 1
    assert ("3/3 elements out of tolerance (3 non-finite: 0 NaN, 3 inf), "
            "first non-finite mismatch: inf vs 100 at [0]; max abs inf, max rel inf") in out, out
    row = json.loads((tmp_path / "r.json").read_text())["providers"]["cpu"]["outputs"][0]
    assert row["max_abs"] == row["max_rel"] == "inf" and row["inf_mismatch"] == 3 and row["cosine"] is None
    assert row["example"] == {"index": [0], "before": "inf", "after": 100.0, "which": "first non-finite mismatch"}


@pytest.mark.parametrize("before,after,text,field", [
    ([1.0, np.nan, 3.0], [1.0, 2.0, 3.0], "nan vs 2 at [1]", "nan_mismatch"),
    ([1.0, 2.0, 3.0], [1.0, 2.0, np.nan], "3 vs nan at [2]", "nan_mismatch"),
    ([1.0, np.inf, 3.0], [1.0, -np.inf, 3.0], "inf vs -inf at [1]", "inf_mismatch"),
    ([1.0, 1e38, 3.0], [1.0, np.inf, 3.0], "1e+38 vs inf at [1]", "inf_mismatch"),
])
def test_non_finite_mismatches(before, after, text, field):
    r = verify.compare(np.array(before, np.float32), np.array(after, np.float32), 1e-4, 1e-5)
    assert not r["ok"] and r["out_of_tolerance"] == 1 and r[field] == 1
    assert text in verify.problem_text(r)
    expected = float("nan") if field == "nan_mismatch" else float("inf")
    assert np.isnan(r["max_abs"]) if np.isnan(expected) else r["max_abs"] == expected
    # the finite pairs' statistics stay finite
    assert r["mean_abs"] == 0.0 and r["p99_abs"] == 0.0


def test_equal_non_finite_values_and_signed_zeros_agree():
    a = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    b = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)
    r = verify.compare(a, b, 0.0, 0.0)  # -0 == 0 (IEEE), even with zero tolerance
    assert r["ok"] and r["max_abs"] == 0.0 and r["nan_mismatch"] == r["inf_mismatch"] == 0


def test_differences_beyond_float64_give_no_warnings_and_count():
    big = np.array([1e308, -1e308, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would reach stderr under -q
        r = verify.compare(big, -big, 1e-7, 1e-9)
        also = verify.compare(np.array([np.inf, np.nan]), np.array([1.0, np.inf]), 1e-7, 1e-9)
    assert not r["ok"] and r["out_of_tolerance"] == 3 and r["max_abs"] == float("inf")
    assert r["example"]["which"] == "largest difference" and r["example"]["index"] in ([0], [1])
    assert not also["ok"] and also["out_of_tolerance"] == 2


def test_integer_and_bool_outputs_compare_exactly_with_an_example():
    r = verify.compare(np.array([5, 7, 9], np.int32), np.array([5, 8, 19], np.int32), 0.0, 0.0)
    assert not r["ok"] and r["out_of_tolerance"] == 2 and r["max_abs"] == 10.0
    assert "largest difference: 9 vs 19 at [2]" in verify.problem_text(r)
    big = np.array([2**63 - 1, -2**63], np.int64)
    r = verify.compare(big, big[::-1].copy(), 0.0, 0.0)  # no overflow: exact differences of 2**64 - 1
    assert not r["ok"] and r["max_abs"] == float(2**64 - 1)
    r = verify.compare(np.array([True, False]), np.array([True, True]), 0.0, 0.0)
    assert not r["ok"] and "False vs True at [1]" in verify.problem_text(r)


def test_strings_dtype_and_shape_mismatches():
    r = verify.compare(np.array(["a", "b"], object), np.array(["a", "c"], object), 0.0, 0.0)
    assert not r["ok"] and "first difference: 'b' vs 'c' at [1]" in verify.problem_text(r)
    r = verify.compare(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32), 1e-4, 1e-5)
    assert verify.problem_text(r) == "shape 2x3 in the original, 3x2 now"
    r = verify.compare(np.zeros(3, np.float32), np.zeros(3, np.float16), 1e-4, 1e-5)
    assert verify.problem_text(r) == "dtype float32 in the original, float16 now"
    r = verify.compare(np.float32(1.0)[()], np.zeros(1, np.float32), 1e-4, 1e-5)
    assert verify.problem_text(r) == "shape scalar in the original, 1 now"


def _sequence_model(n, scale=1.0):
    """s = [x * scale, ...] (n tensors), y = x."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["xs"]), helper.make_node("SequenceConstruct", ["xs"] * n, ["s"]),
             helper.make_node("Identity", ["x"], ["y"])]
    return model(nodes, [tinfo("x", [3])], [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [3]),
                                            tinfo("y", [3])], [init("k", np.float32(scale))])


@pytest.mark.parametrize("after,ok,problem", [((2, 1.0), True, None),
                                              ((3, 1.0), False, "a sequence of 2 in the original, of 3 now"),
                                              ((2, 2.0), False, "element 0: 3/3 elements out of tolerance")])
def test_sequence_outputs(tmp_path, after, ok, problem):
    """onnxruntime returns a sequence as a list; it was turned into one stacked array (or failed
    as 'onnxruntime cannot run the original model' when its tensors differed in shape)."""
    rep = verify.verify(_sequence_model(2), _sequence_model(*after), runs=0)
    row = rep["providers"]["cpu"]["outputs"][0]
    assert rep["ok"] is ok and row["name"] == "s" and row["ok"] is ok
    if problem:
        assert row["problem"].startswith(problem)
    else:
        assert row["kind"] == "sequence" and row["length"] == 2 and row["elements"] == 6
    assert "seq[" in format_verification(rep) or not ok


def test_ragged_sequences_and_other_value_kinds():
    parts = [np.zeros(2, np.float32), np.zeros((3, 1), np.float32)]
    assert verify.compare_value(parts, [p.copy() for p in parts])["ok"]
    assert verify.compare_value(None, None)["ok"]
    assert verify.compare_value(None, np.zeros(1))["problem"] == "a empty optional in the original, a tensor now"
    assert verify.compare_value(parts, np.zeros(2))["problem"] == "a sequence in the original, a tensor now"
    zipmap = [{0: 0.25, 1: 0.75}]
    assert verify.compare_value(zipmap, [{0: 0.25, 1: 0.75000001}])["ok"]  # float32 tolerance for ZipMap's floats
    assert not verify.compare_value(zipmap, [{0: 0.25, 1: 0.8}])["ok"]
    assert verify.compare_value(zipmap, [{0: 0.25, 2: 0.75}])["problem"] == "element 0: the map's keys differ"
