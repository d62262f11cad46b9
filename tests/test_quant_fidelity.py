"""Fidelity (onnxopt.quantize.fidelity): SQNR, its accumulation over feeds, per-layer SQNR against a
numpy recomputation, the fallback to float on a model with one badly quantized layer, and the
latency rule that keeps the float model when int8 is not faster."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt.errors import UsageError
from onnxopt.quantize import fidelity
from onnxopt.quantize.fidelity import (decide_keep, fallback, latency_check, layer_sqnr, node_damage, output_sqnr,
                                       sqnr_db)

ort = pytest.importorskip("onnxruntime")

WIDTH = 24
LAYERS = 4


def _init(name, array, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(array, dtype), name)


def _run(model, feed):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


# ---- sqnr_db ---------------------------------------------------------------------------------------------------


def test_sqnr_edge_cases():
    ref = np.ones(4, np.float32)
    assert sqnr_db(ref, ref + 0.1) == pytest.approx(20.0)  # 4 / (4 * 0.01)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(np.zeros(3), np.zeros(3)) == math.inf  # identical zero signals: no noise
    assert sqnr_db(np.zeros(3), [0, 1e-3, 0]) == -math.inf  # noise on a zero signal
    assert math.isnan(sqnr_db([1.0, np.nan], [1.0, 2.0]))
    assert sqnr_db(np.full(2, 1e30, np.float32), np.zeros(2, np.float32)) == pytest.approx(0.0)  # float64 sums
    with pytest.raises(UsageError, match="shapes differ"):
        sqnr_db(np.ones(3), np.ones(4))


# ---- a float chain and its QDQ versions, written here ---------------------------------------------------------


def chain(seed=0) -> onnx.ModelProto:
    """x -> (MatMul -> Relu) x 3 -> MatMul -> y, nodes mm1..mm4 and relu1..relu3."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for k in range(1, LAYERS + 1):
        inits.append(_init(f"W{k}", rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)))
        out = "y" if k == LAYERS else f"m{k}"
        nodes.append(helper.make_node("MatMul", [x, f"W{k}"], [out], name=f"mm{k}"))
        if k < LAYERS:
            nodes.append(helper.make_node("Relu", [out], [f"h{k}"], name=f"relu{k}"))
            x = f"h{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def feeds(n=4, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, WIDTH)).astype(np.float32)} for _ in range(n)]


def float_values(model, feed):
    """Every value of the chain in numpy (float32, as onnxruntime computes it)."""
    vals = {"x": feed["x"]}
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        a = vals[n.input[0]]
        vals[n.output[0]] = a @ w[n.input[1]] if n.op_type == "MatMul" else np.maximum(a, 0)
    return vals


def calibrated_scales(model, calib):
    """uint8 scales from the calibration maxima: x (zero point 128) and h1..h3 (after Relu, zero point 0)."""
    vals = [float_values(model, f) for f in calib]
    scales = {"x": max(np.abs(v["x"]).max() for v in vals) / 127}
    for k in range(1, LAYERS):
        scales[f"h{k}"] = max(v[f"h{k}"].max() for v in vals) / 255
    return scales


def weight_q(w):
    s = np.abs(w).max() / 127
    return np.clip(np.round(w / s), -127, 127).astype(np.int8), np.float32(s)


def qdq_chain(model, scales, excluded=frozenset(), *, bad=None, bad_factor=40.0):
    """The chain with Q/DQ: a tensor is quantized (uint8) when the nodes writing and reading it are not
    excluded, a MatMul's weight (int8, per tensor) when the MatMul is not. ``bad``: a tensor quantized
    with a scale ``bad_factor`` times too small (its range saturates)."""
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes, inits = [], []
    rename = {}
    owner = {"x": None, **{f"h{k}": (f"mm{k}", f"mm{k + 1}") for k in range(1, LAYERS)}}
    for t, pair in owner.items():
        if pair is not None and set(pair) & excluded or t == "x" and "mm1" in excluded:
            continue
        s = scales[t] / (bad_factor if t == bad else 1.0)
        zp = 128 if t == "x" else 0
        inits += [_init(f"{t}_s", s), _init(f"{t}_z", zp, np.uint8)]
        rename[t] = f"{t}_dq"
    for n in model.graph.node:
        if n.op_type == "MatMul":
            a, wname = rename.get(n.input[0], n.input[0]), n.input[1]
            if n.name not in excluded:
                q, s = weight_q(w[wname])
                inits += [_init(f"{wname}_q", q, np.int8), _init(f"{wname}_s", s)]
                nodes.append(helper.make_node("DequantizeLinear", [f"{wname}_q", f"{wname}_s"], [f"{wname}_dq"],
                                              name=f"{wname}_DQ"))
                wname = f"{wname}_dq"
            else:
                inits.append(numpy_helper.from_array(w[wname], wname))
            nodes.append(helper.make_node("MatMul", [a, wname], list(n.output), name=n.name))
        else:
            nodes.append(helper.make_node("Relu", [rename.get(n.input[0], n.input[0])], list(n.output), name=n.name))
        if n.input[0] == "x" and "x" in rename:
            nodes[-1:-1] = _qdq_nodes("x", 128)
    for t in rename:
        if t != "x":
            i = next(i for i, n in enumerate(nodes) if t in n.output)
            nodes[i + 1:i + 1] = _qdq_nodes(t, 0)
    graph = helper.make_graph(nodes, "qdq", list(model.graph.input), list(model.graph.output), inits)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(out)
    return out


def _qdq_nodes(t, zp):
    return [helper.make_node("QuantizeLinear", [t, f"{t}_s", f"{t}_z"], [f"{t}_q"], name=f"{t}_Q"),
            helper.make_node("DequantizeLinear", [f"{t}_q", f"{t}_s", f"{t}_z"], [f"{t}_dq"], name=f"{t}_DQ")]


def np_qdq(v, s, zp):
    return ((np.clip(np.round(v / s) + zp, 0, 255) - zp) * s).astype(np.float32)


# ---- output and layer SQNR -------------------------------------------------------------------------------------


def test_output_sqnr_sums_energies_over_feeds():
    model = chain()
    q = qdq_chain(model, calibrated_scales(model, feeds(8, seed=5)))
    fs = feeds(3)
    fs[1] = {"x": fs[1]["x"] * 0.05}  # a quiet feed: its SQNR is far lower (a fixed quantization step)
    signal = noise = 0.0
    per_feed = []
    for f in fs:
        (a,), (b,) = _run(model, f), _run(q, f)
        signal += float(np.sum(a.astype(np.float64) ** 2))
        noise += float(np.sum((a.astype(np.float64) - b) ** 2))
        per_feed.append(sqnr_db(a, b))
    got = output_sqnr(model, q, fs)
    assert list(got) == ["y"]
    assert got["y"] == pytest.approx(10 * math.log10(signal / noise), abs=1e-9)
    assert abs(got["y"] - np.mean(per_feed)) > 1.0  # not an average of dB figures
    assert output_sqnr(model, model, fs) == {"y": math.inf}
    assert output_sqnr(model, q, fs[0]) == pytest.approx({"y": per_feed[0]})  # one feed dict


def test_layer_sqnr_matches_numpy():
    model = chain()
    scales = calibrated_scales(model, feeds(8, seed=5))
    q = qdq_chain(model, scales)
    fs = feeds(3)
    wq = {t.name: weight_q(numpy_helper.to_array(t)) for t in model.graph.initializer}
    sums = {t: [0.0, 0.0] for t in ("x", "h1", "h2", "h3")}
    for f in fs:
        ref = float_values(model, f)
        v = np_qdq(f["x"], scales["x"], 128)
        got = {"x": v}
        for k in range(1, LAYERS):
            wk, sk = wq[f"W{k}"]
            v = np_qdq(np.maximum(v @ (wk.astype(np.float32) * sk), 0), scales[f"h{k}"], 0)
            got[f"h{k}"] = v
        for t, acc in sums.items():
            acc[0] += float(np.sum(ref[t].astype(np.float64) ** 2))
            acc[1] += float(np.sum((ref[t].astype(np.float64) - got[t]) ** 2))
    expected = {t: 10 * math.log10(s / n) for t, (s, n) in sums.items()}
    measured = layer_sqnr(model, q, None, fs)
    assert list(measured) == ["x", "h1", "h2", "h3"]
    for t in expected:  # (a rounding tie flipped by float32 summation order moves a figure by ~1e-3 dB)
        assert measured[t] == pytest.approx(expected[t], abs=0.02), t
    assert layer_sqnr(model, q, ["h2"], fs) == {"h2": measured["h2"]}
    with pytest.raises(UsageError, match="'m1' is not quantized"):
        layer_sqnr(model, q, ["m1"], fs)


# ---- fallback --------------------------------------------------------------------------------------------------


def test_fallback_returns_the_badly_quantized_layer_first():
    model = chain()
    scales = calibrated_scales(model, feeds(8, seed=5))
    calls = []

    def requantize(excluded):
        calls.append(excluded)
        return qdq_chain(model, scales, excluded, bad="h2")

    held_out = feeds(4, seed=9)
    good = output_sqnr(model, qdq_chain(model, scales), held_out)["y"]
    bad = output_sqnr(model, requantize(frozenset()), held_out)["y"]
    assert bad < good - 10  # h2 saturates at 1/40 of its range
    # the damage ranking: mm2 writes h2 (through relu2, absorbed into h2's QuantizeLinear)
    damage = node_damage(model, requantize(frozenset()), held_out, candidates=[f"mm{k}" for k in range(1, 5)])
    assert max(damage, key=damage.get) == "mm2"
    target = good - 3  # reachable once h2 is float
    steps = []
    res = fallback(model, requantize, held_out, target, candidates=[f"mm{k}" for k in range(1, 5)],
                   progress=lambda step, done, total: steps.append((step, done, total)))
    assert res.met and res.excluded[0] == "mm2"
    assert res.history[0] == (0, pytest.approx(bad)) and res.history[-1][1] >= target
    assert [k for k, _ in res.history] == [0, 1]
    assert res.output_db["y"] == res.history[-1][1]
    assert calls[-1] == frozenset({"mm2"}) and steps[0][1:] == (0, 4)
    assert res.as_dict()["excluded"] == ["mm2"] and res.as_dict()["met"] is True


def test_fallback_doubles_and_stops_when_everything_is_float():
    model = chain()
    scales = calibrated_scales(model, feeds(8, seed=5))
    cands = [f"mm{k}" for k in range(1, 5)]
    res = fallback(model, lambda ex: qdq_chain(model, scales, ex), feeds(2), 200.0, candidates=cands)
    assert [k for k, _ in res.history] == [0, 1, 3, 4]  # batches of 1, 2, then the one left
    assert sorted(res.excluded) == cands
    assert res.met and res.history[-1][1] == math.inf  # all float: the float model's outputs exactly
    # a requantizer that cannot help: every candidate tried, the target missed, the last model returned
    stuck = qdq_chain(model, scales, bad="h2")
    res = fallback(model, lambda ex: stuck, feeds(2), 200.0, candidates=cands, model=stuck)
    assert not res.met and len(res.excluded) == 4 and res.model is stuck
    assert len({db for _, db in res.history}) == 1
    with pytest.raises(UsageError, match="finite"):
        fallback(model, lambda ex: model, feeds(1), math.nan, candidates=["mm1"])


# ---- latency ---------------------------------------------------------------------------------------------------


def test_decide_keep_rule():
    assert decide_keep(10.0, 9.6)[0] == "int8"  # 4% faster
    keep, reason = decide_keep(10.0, 9.8)
    assert keep == "float" and "not at least 3% faster" in reason and "9.800" in reason
    assert decide_keep(10.0, 12.0)[0] == "float"
    assert decide_keep(10.0, 9.8, min_speedup=0.01)[0] == "int8"
    assert decide_keep(0.0, 1.0)[0] == "float"
    assert "\n" not in reason


def test_latency_check_with_measured_numbers():
    model = chain()

    def measure(models, feed, **kw):
        assert list(models) == ["float", "int8"] and set(feed) == {"x"}
        assert kw["runs"] == 40 and kw["min_rounds"] == 30
        f = [2.0 + 0.01 * (i % 5) for i in range(40)]
        return {"rounds": 40, "errors": {}, "results": {"float": {"times_ms": f},
                                                         "int8": {"times_ms": [t * 0.9 for t in f]}}}

    res = latency_check(model, model, feeds(1), runs=40, measure=measure)
    assert res.keep == "int8" and res.ratio == pytest.approx(0.9)
    assert res.float_ms["median"] == pytest.approx(2.02) and res.float_ms["p10"] <= res.float_ms["p90"]
    assert res.ratio_ci90 == pytest.approx((0.9, 0.9))
    assert res.as_dict()["keep"] == "int8"

    def slow(models, feed, **kw):
        return {"rounds": 40, "errors": {}, "results": {"float": {"times_ms": [1.0] * 40},
                                                         "int8": {"times_ms": [1.8] * 40}}}

    res = latency_check(model, model, feeds(1), runs=40, measure=slow)
    assert res.keep == "float" and "float model kept" in res.reason

    def broken(models, feed, **kw):
        return {"rounds": 0, "errors": {"int8": "cannot run"}, "results": {"float": {"times_ms": [1.0]}}}

    res = latency_check(model, model, feeds(1), measure=broken)
    assert res.keep == "float" and "int8: cannot run" in res.reason


def test_latency_check_real_call_shape():
    model = chain()
    q = qdq_chain(model, calibrated_scales(model, feeds(4)))
    res = latency_check(model, q, feeds(1), runs=6, min_rounds=3, warmup=1, budget_s=2.0)
    d = res.as_dict()
    assert d["keep"] in ("int8", "float") and d["reason"] and d["rounds"] >= 3
    assert set(d["float_ms"]) == set(d["int8_ms"]) == {"median", "p10", "p90"}
    assert res.ratio == res.int8_ms["median"] / res.float_ms["median"]
    assert d["ratio"] == pytest.approx(res.ratio, rel=1e-4)
    # int8 only when the medians say so and the ratio's 90% interval lies below 1.0 (none under 10 rounds)
    rule = decide_keep(res.float_ms["median"], res.int8_ms["median"])[0]
    assert res.keep == ("int8" if rule == "int8" and res.ratio_ci90 and res.ratio_ci90[1] < 1.0 else "float")
    with pytest.raises(UsageError):
        latency_check(model, q, [], runs=3)


def test_module_exports():
    assert set(fidelity.__all__) >= {"sqnr_db", "output_sqnr", "layer_sqnr", "fallback", "latency_check"}


def test_fallback_keeps_only_trials_that_raise_the_sqnr(monkeypatch):
    """The worst-ranked node A makes the output worse when float (its neighbours' requantization
    stays); the fallback drops that trial, tries B alone, which meets the target, and stops there."""
    from onnxopt.quantize import fidelity as fid

    sqnr = {frozenset(): 19.0, frozenset({"A"}): 18.0, frozenset({"B"}): 23.0}
    monkeypatch.setattr(fid, "output_sqnr", lambda f, q, feeds, **kw: {"y": sqnr[q]})
    monkeypatch.setattr(fid, "node_damage", lambda f, q, feeds, **kw: {"A": 3.0, "B": 2.0, "C": 1.0})
    made = []

    def requantize(excluded):
        made.append(excluded)
        return excluded

    res = fid.fallback("float", requantize, [{}], 20.0, candidates=["A", "B", "C"])
    assert res.met and res.excluded == ("B",) and res.output_db == {"y": 23.0}
    assert made == [frozenset(), frozenset({"A"}), frozenset({"B"})]
    assert [r["accepted"] for r in res.rounds] == [False, True]


def test_fallback_ends_all_float_when_no_trial_helps(monkeypatch):
    from onnxopt.quantize import fidelity as fid

    monkeypatch.setattr(fid, "output_sqnr", lambda f, q, feeds, **kw: {"y": float("inf") if len(q) == 3 else 10.0})
    monkeypatch.setattr(fid, "node_damage", lambda f, q, feeds, **kw: {"A": 3.0, "B": 2.0, "C": 1.0})
    res = fid.fallback("float", lambda ex: ex, [{}], 20.0, candidates=["A", "B", "C"])
    assert res.met and set(res.excluded) == {"A", "B", "C"}
    assert any(r["forced"] for r in res.rounds)
