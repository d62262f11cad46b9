"""``--keep-float auto`` decides from the shipped cost table, not from a timing taken while quantizing
(issue 27 item 14): the same input gives the same bytes, and the report names the table entries
that decided; ``--keep-float measure`` times both models on this machine, when asked, at --threads."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import onnxopt
from onnxopt.errors import UsageError
from onnxopt.quantize import fidelity
from test_quant_api import _cnn, _feeds

pytest.importorskip("onnxruntime")


def test_auto_gives_the_same_bytes_and_decides_from_the_table(monkeypatch):
    def no_timing(*a, **k):
        raise AssertionError("keep_float='auto' timed the models")

    monkeypatch.setattr(fidelity, "latency_check", no_timing)
    monkeypatch.setattr("onnxopt.verify.runtime.measure_latency", no_timing)
    a, report = onnxopt.quantize(_cnn(), _feeds(10), return_report=True)
    b = onnxopt.quantize(_cnn(), _feeds(10))
    assert a.SerializeToString() == b.SerializeToString()
    lat = report.latency
    assert lat["mode"] == "table" and lat["table"].endswith("ort_cpu_costs.json") and lat["nodes"] >= 1
    assert lat["ratio"] == pytest.approx(lat["int8_us"] / lat["float_us"], rel=1e-3)
    assert report.kept == ("int8" if lat["ratio"] <= 1 - lat["min_speedup"] else "float")
    assert lat["entries"] and abs(sum(e["share"] for e in lat["entries"]) - 1) < 1e-3
    assert lat["entries"][0]["entry"].split("nearest measured: ")[-1].split(" | ")[0] in report.reason
    assert "cost table" in report.reason and "latency" not in report.seconds


def test_table_decision_rule():
    from onnxopt.quantize.fidelity import table_decision

    entries = [{"entry": "Conv full k3x3", "nodes": 2, "share": 1.0, "ratio": 0.5}]
    assert table_decision({"ratio": 0.5, "nodes": 2, "entries": entries})[0] == "int8"
    keep, reason, entry = table_decision({"ratio": 0.99, "nodes": 2, "entries": entries})
    assert keep == "float" and "Conv full k3x3" in reason and entry["mode"] == "table"
    assert table_decision({"ratio": None, "nodes": 0, "entries": []})[0] == "int8"


def test_measure_times_on_this_machine_at_the_threads_asked():
    q, report = onnxopt.quantize(_cnn(), _feeds(10), keep_float="measure", threads=1,
                                 latency_budget=1.0, return_report=True)
    lat = report.latency
    assert lat["mode"] == "measure" and lat["threads"] == 1 and lat["machine_dependent"]
    assert lat["rounds"] >= 10 and lat["ratio_ci90"] and lat["ratio"] > 0
    assert report.kept in ("int8", "float") and "measured on this machine" in report.reason
    assert report.settings["threads"] == 1 and report.settings["latency_budget"] == 1.0
    with pytest.raises(UsageError, match="threads"):
        onnxopt.quantize(_cnn(), _feeds(6), keep_float="measure", threads=-1)


def test_cli_keep_float_measure_and_threads(tmp_path, capsys):
    from onnxopt import cli

    src, calib = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(_cnn(), src)
    np.savez(calib, x=np.concatenate([f["x"] for f in _feeds(8)]))
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--calib", str(calib), "--keep-float",
                     "measure", "--threads", "1", "--latency-budget", "0.3", "--json", str(tmp_path / "r.json"),
                     "-q"]) == 0
    lat = json.loads((tmp_path / "r.json").read_text())["latency"]
    assert lat["mode"] == "measure" and lat["threads"] == 1
    capsys.readouterr()
    assert cli.main(["quantize", str(src), "-o", str(tmp_path / "q2.onnx"), "--calib", str(calib), "--keep-float",
                     "measure", "--threads", "-1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "q2.onnx").exists()
