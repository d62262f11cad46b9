"""Streaming, mergeable calibration statistics and the range methods (onnxopt.quantize.calibrate)."""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import init, model, tinfo
from onnxopt.errors import UsageError
from onnxopt.quantize import calibrate as C
from onnxopt.quantize.data import open_calibration

COLS = 256
TENSORS = ["y", "r", "zero", "three", "lg"]


def skew_model():
    """y = x * 1 (two-sided), r = Relu(y) (one-sided), zero = x * 0, three = zero + 3 (constants),
    lg = Log(r) (-inf where r is 0), i = Cast(x, int64)."""
    one, nil, three = (init(n, np.array(v, np.float32)) for n, v in (("one", 1.0), ("nil", 0.0), ("k3", 3.0)))
    nodes = [helper.make_node("Mul", ["x", "one"], ["y"]), helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Mul", ["x", "nil"], ["zero"]), helper.make_node("Add", ["zero", "k3"], ["three"]),
             helper.make_node("Log", ["r"], ["lg"]), helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64)]
    outs = [tinfo(n, 2) for n in ("r", "three", "lg")] + [tinfo("i", 2, TensorProto.INT64)]
    return model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", COLS])], outs, [one, nil, three])


def skew_feeds(n, seed=0, rows=64):
    """Laplace (long-tailed) values with rare large outliers on both sides, one feed at a time."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        x = rng.laplace(0.0, 1.0, (rows, COLS)).astype(np.float32)
        if i % 8 == 0:
            x[0, i % COLS] = 40.0 + i
            x[1, (i * 7) % COLS] = -30.0 - i
        yield {"x": x}


@pytest.fixture(scope="module")
def skew():
    m = skew_model()
    data = list(skew_feeds(24))
    return m, data, open_calibration(data, m)


def fake_quant_mse(values, lo, hi, qmax=255):
    scale = (hi - lo) / qmax
    zp = np.round(-lo / scale)
    q = np.clip(np.round(values / scale) + zp, 0, qmax)
    return float(np.mean(((q - zp) * scale - values) ** 2))


def test_methods_on_a_long_tailed_distribution(skew):
    m, data, calib = skew
    x = np.concatenate([f["x"].ravel() for f in data]).astype(np.float64)
    got = {method: C.calibrate(m, TENSORS, calib, method=method) for method in C.METHODS}
    mm = got["minmax"]
    assert mm["y"] == (float(x.min()), float(x.max())) and mm["r"] == (0.0, float(x.max()))
    for method, ranges in got.items():
        assert list(ranges) == TENSORS
        for t, (lo, hi) in ranges.items():
            assert math.isfinite(lo) and math.isfinite(hi) and lo <= 0.0 <= hi and hi > lo, (method, t)
        assert ranges["r"][0] == 0.0  # one-sided: only the upper end searched
        assert ranges["zero"] == (0.0, 1.0)  # only zeros: a usable non-zero width
        assert ranges["three"][0] == 0.0 and 0 < ranges["three"][1] <= 3.0
        if method != "minmax":  # outliers clipped: narrower than minmax on both tensors
            for t in ("y", "r"):
                assert ranges[t][1] - ranges[t][0] < 0.9 * (mm[t][1] - mm[t][0]), (method, t, ranges[t], mm[t])
    assert got["entropy"]["y"] != mm["y"] and got["entropy"]["r"] != mm["r"]
    # mse minimizes the actual uint8 quantization error, measured on the data: below minmax's, and
    # no better range nearby (moving either end by 10% either way)
    for t, vals in (("y", x), ("r", np.maximum(x, 0))):
        lo, hi = got["mse"][t]
        err = fake_quant_mse(vals, lo, hi)
        assert err < 0.9 * fake_quant_mse(vals, *mm[t])
        for a, b in ((lo * 0.9, hi), (lo * 1.1, hi), (lo, hi * 0.9), (lo, hi * 1.1)):
            assert err <= fake_quant_mse(vals, a, b) * 1.001, (t, (lo, hi), (a, b))
    # percentile: the 99.999th and 0.001th percentiles of the values (between the two values
    # around that rank, within a histogram bin)
    width = (mm["y"][1] - mm["y"][0]) / C.DEFAULT_BINS
    lo, hi = got["percentile"]["y"]
    for value, q in ((lo, 0.001), (hi, 99.999)):
        assert np.percentile(x, q, method="lower") - width <= value <= np.percentile(x, q, method="higher") + width
    # qmin/qmax reach the methods: fewer levels, more clipping pays
    narrow = C.calibrate(m, ["y"], calib, method="mse", qmax=15)["y"]
    assert narrow[1] - narrow[0] < got["mse"]["y"][1] - got["mse"]["y"][0]
    p9 = C.calibrate(m, ["y"], calib, method="percentile", percentile=99.9)["y"]
    assert p9[1] < lo + (hi - lo) and p9[1] < hi


def test_nonfinite_activations_are_counted_and_left_out(skew):
    m, data, calib = skew
    ranges = C.collect_ranges(m, ["lg", "r"], calib)
    lo, hi, count, nonfinite = ranges.stats["lg"]
    zeros = sum(int((f["x"] <= 0).sum()) for f in data)
    assert nonfinite == zeros and count == len(data) * 64 * COLS - zeros
    assert math.isfinite(lo) and math.isfinite(hi)
    hists = C.collect_histograms(m, ["lg", "r"], calib, ranges)
    assert int(hists.counts["lg"].sum()) == count
    assert int(hists.counts["r"].sum()) == len(data) * 64 * COLS and hists.zeros["r"] == zeros
    for method in C.METHODS:
        lo, hi = C.choose_ranges(ranges, hists, method)["lg"]
        assert math.isfinite(lo) and math.isfinite(hi) and lo <= 0 <= hi


def test_shards_merged_equal_one_pass_exactly(skew):
    m, data, calib = skew
    tensors = ["y", "r", "lg"]
    one = C.collect_ranges(m, tensors, calib)
    parts = [C.collect_ranges(m, tensors, calib.shard(i, 5)) for i in range(5)]
    merged = C.RangeStats.merge_all(parts[::-1])  # in any order
    assert merged == one and merged.to_dict() == one.to_dict() and merged.feeds == len(data)
    # through JSON (as a Ray or Spark job would ship them)
    shipped = [C.RangeStats.from_dict(json.loads(json.dumps(p.to_dict()))) for p in parts]
    assert C.RangeStats.merge_all(shipped) == one
    h_one = C.collect_histograms(m, tensors, calib, one)
    h_parts = [C.collect_histograms(m, tensors, calib.shard(i, 5), merged) for i in range(5)]
    h_merged = C.HistStats.from_dict(json.loads(json.dumps(C.HistStats.merge_all(h_parts).to_dict())))
    assert h_merged == h_one
    for t in tensors:
        np.testing.assert_array_equal(h_merged.counts[t], h_one.counts[t])
        assert h_merged.counts[t].dtype == np.int64
    for method in C.METHODS:
        assert C.choose_ranges(merged, h_merged, method) == C.choose_ranges(one, h_one, method)
    # histograms on other edges do not merge
    other = C.collect_histograms(m, tensors, calib.shard(0, 5), parts[0])
    with pytest.raises(UsageError, match="different bin edges"):
        h_one.merge(other)


def test_workers_give_bit_identical_ranges_for_any_count_and_source(skew):
    from onnxruntime.quantization import CalibrationDataReader

    m, data, calib = skew
    tensors = ["y", "r", "three"]

    class Reader(CalibrationDataReader):  # no rewind(): spooled to disk
        def __init__(self):
            self.it = iter(data)

        def get_next(self):
            return next(self.it, None)

    one = C.calibrate(m, tensors, calib, method="entropy", workers=1)
    assert one == C.calibrate(m, tensors, calib, method="entropy", workers=1)  # deterministic
    two = C.calibrate(m, tensors, open_calibration(Reader(), m), method="entropy", workers=2)
    three = C.calibrate(m, tensors, open_calibration((f for f in data), m), method="entropy", workers=3)
    assert one == two == three
    assert all(type(v) is float for r in (one, two, three) for pair in r.values() for v in pair)


def test_progress_over_feeds(skew):
    m, data, calib = skew
    calls = []
    C.calibrate(m, ["y"], calib.shard(0, 4), method="mse", progress=lambda *a: calls.append(a))
    n = len(calib.shard(0, 4))
    assert calls == [("calibrating: ranges", i, n) for i in range(1, n + 1)] + \
        [("calibrating: histograms", i, n) for i in range(1, n + 1)]
    calls.clear()
    C.calibrate(m, ["y"], calib.shard(0, 4), method="minmax", progress=lambda *a: calls.append(a))
    assert {c[0] for c in calls} == {"calibrating: ranges"}  # minmax: one pass


def dynamic_model():
    w = np.random.default_rng(9).standard_normal((8, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"])]
    return model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])], [tinfo("r", 3)],
                 [init("w", w)]), w


def test_dynamic_batch_and_sequence_shapes():
    m, w = dynamic_model()
    rng = np.random.default_rng(10)
    data = [{"x": rng.standard_normal((b, s, 8)).astype(np.float32)} for b, s in ((1, 3), (4, 17), (2, 1), (3, 64))]
    got = C.calibrate(m, ["h", "r"], open_calibration(data, m), method="mse")
    ranges = C.collect_ranges(m, ["h"], data)  # a plain list of feeds works too
    h = np.concatenate([(f["x"] @ w).ravel() for f in data])
    assert ranges.range("h")[0] == pytest.approx(h.min(), rel=1e-5)
    assert ranges.range("h")[1] == pytest.approx(h.max(), rel=1e-5)
    assert got["r"][0] == 0.0 and got["h"][0] < 0 < got["h"][1] <= ranges.range("h")[1]
    assert C.calibrate(m, ["h", "r"], data, method="mse") == got  # a source as open_calibration takes it


def _peak(n):
    m = skew_model()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    calib = open_calibration(skew_feeds(n, seed=3), m)
    ranges = C.collect_ranges(m, ["y", "r", "lg"], calib)
    hists = C.collect_histograms(m, ["y", "r", "lg"], calib, ranges)
    assert ranges.feeds == hists.feeds == n
    return tracemalloc.get_traced_memory()[1] - start


def test_memory_does_not_grow_with_the_number_of_feeds():
    tracemalloc.start()
    try:
        _peak(5)  # warm-up: first-use allocations
        small, large = _peak(10), _peak(300)
    finally:
        tracemalloc.stop()
    feed = 64 * COLS * 4
    # 290 more feeds of 64 KiB would be 18 MiB if anything were kept per feed
    assert large <= small * 1.1 + 4 * feed, (small, large)


def test_tensor_and_option_errors(skew):
    m, data, calib = skew
    with pytest.raises(UsageError, match=r"^calibration tensors: 'nope' is not values? of the model's main graph$"):
        C.calibrate(m, ["y", "nope"], calib)
    with pytest.raises(UsageError, match=r"^calibration tensors without a known float type: 'i' \(int64\)$"):
        C.calibrate(m, ["y", "i"], calib)
    with pytest.raises(UsageError, match=r"^unknown calibration method 'kl' \(choose from minmax, percentile"):
        C.calibrate(m, ["y"], calib, method="kl")
    with pytest.raises(UsageError, match=r"^calibration method minmax takes no option 'percentile'"):
        C.calibrate(m, ["y"], calib, method="minmax", percentile=99.0)
    with pytest.raises(UsageError, match=r"percentile: expected a number in \(50, 100\]"):
        C.calibrate(m, ["y"], calib, method="percentile", percentile=101)
    with pytest.raises(UsageError, match=r"qmin 5 and qmax 5 must be integers with qmin < qmax"):
        C.calibrate(m, ["y"], calib, method="mse", qmin=5, qmax=5)
    with pytest.raises(UsageError, match=r"workers: expected an integer >= 1"):
        C.calibrate(m, ["y"], calib, workers=0)
    ranges = C.collect_ranges(m, ["y"], calib.shard(0, 8))
    with pytest.raises(UsageError, match=r"^calibration method entropy needs the histograms of the second pass$"):
        C.choose_ranges(ranges, None, "entropy")
    with pytest.raises(UsageError, match=r"range statistics of different tensors cannot merge"):
        ranges.merge(C.collect_ranges(m, ["r"], calib.shard(0, 8)))
