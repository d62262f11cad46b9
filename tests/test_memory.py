"""onnxopt.transforms.memory: peak activation memory by liveness (hand-computed on tiny graphs), the
memory_reordering pass (lowers the peak where an order can, never changes outputs, deterministic)
and optimize()'s report of both."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from conftest import run_ort
from helpers import feeds_for, init, model, random_twins, tinfo, zoo_model
from onnxopt.ir import io
from onnxopt.transforms import liveness
from onnxopt.transforms import memory
from onnxopt import optimize
from onnxopt.ir.shapes import infer_model
from onnxopt.reporting.text import format_memory

F = 4  # bytes of a float32
X = 256 * F  # the input x: [1, 256] float32
BIG = 64 * 256 * F  # Tile(x, [64, 1]): [64, 256]


def _reordered(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    m = io.to_ir(proto)
    return m, memory.reorder(m)


def test_chain_hand_computed():
    # x -> Relu a -> Relu b -> Relu c (output): a node's inputs and outputs are alive while it runs
    m = model([helper.make_node("Relu", ["x"], ["a"], name="n0"), helper.make_node("Relu", ["a"], ["b"], name="n1"),
               helper.make_node("Relu", ["b"], ["c"], name="n2")],
              [tinfo("x", [1000])], [tinfo("c", [1000])])
    r = memory.peak(m)
    assert r["curve"] == [8000, 12000, 12000]
    assert r["peak_bytes"] == 12000 and r["peak_at"] == {"index": 1, "name": "n1"}
    assert r["alive_at_peak"] == [["a", 4000], ["b", 4000], ["x", 4000]]
    assert r["inputs_bytes"] == 4000 and r["weights_bytes"] == 0 and r["unknown"] == [] and not r["lower_bound"]
    json.dumps(r)  # JSON-ready


def test_diamond_and_weights_apart():
    # x -> A = Mul(x, w) and B = Relu(x); Add(A, B): both branches are alive at the Add, whatever the order
    w = init("w", np.ones([1000], np.float32))
    m = model([helper.make_node("Mul", ["x", "w"], ["A"]), helper.make_node("Relu", ["x"], ["B"]),
               helper.make_node("Add", ["A", "B"], ["y"])], [tinfo("x", [1000])], [tinfo("y", [1000])], [w])
    r = memory.peak(m)
    assert r["curve"] == [8000, 12000, 16000]
    assert r["weights_bytes"] == 4000
    assert memory.reorder(io.to_ir(m)) == 0  # no order lowers it


def _branches(first_both: bool = True) -> onnx.ModelProto:
    """Two independent branches x -> Tile or Expand (big) -> ReduceSum (a scalar), added; with ``first_both``
    the order runs both Tiles first (peak: both big values at once)."""
    tile1, tile2 = helper.make_node("Tile", ["x", "reps"], ["e1"], name="tile1"), \
        helper.make_node("Expand", ["x", "big_shape"], ["e2"], name="tile2")  # (not CSE's twins)
    red1, red2 = helper.make_node("ReduceSum", ["e1"], ["r1"], name="red1", keepdims=0), \
        helper.make_node("ReduceSum", ["e2"], ["r2"], name="red2", keepdims=0)
    add = helper.make_node("Add", ["r1", "r2"], ["y"], name="add")
    nodes = [tile1, tile2, red1, red2, add] if first_both else [tile1, red1, tile2, red2, add]
    return model(nodes, [tinfo("x", [1, 256])], [tinfo("y", [])], [init("reps", np.array([64, 1], np.int64)),
                                                                    init("big_shape", np.array([64, 256], np.int64))])


def test_branches_reordered_lower_the_peak():
    m = _branches()
    r = memory.peak(m)
    assert r["curve"] == [X + BIG, X + 2 * BIG, X + 2 * BIG + F, X + BIG + 2 * F, X + 3 * F]
    assert r["peak_bytes"] == X + 2 * BIG + F and r["peak_at"]["name"] == "red1"
    assert r["alive_at_peak"][:2] == [["e1", BIG], ["e2", BIG]]
    reordered, changed = _reordered(m)
    assert changed == 1
    assert [n.name for n in reordered.graph] == ["tile1", "red1", "tile2", "red2", "add"]
    after = memory.peak(reordered)
    assert after["peak_bytes"] == X + BIG + 2 * F < r["peak_bytes"]
    # already the best order: left alone
    assert _reordered(_branches(first_both=False))[1] == 0


def test_reorder_is_deterministic_and_keeps_outputs():
    m = _branches()
    a, b = _reordered(m)[0], _reordered(m)[0]
    pa, pb = ir.serde.serialize_model(a), ir.serde.serialize_model(b)
    assert pa.SerializeToString() == pb.SerializeToString()
    onnx.checker.check_model(pa)
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(pa, feeds)):
        np.testing.assert_array_equal(x, y)


def _random_branchy(seed: int) -> onnx.ModelProto:
    """A random DAG of element-wise ops, Tiles (large) and reductions (small) on [1, 16]; nodes in a
    random topological order."""
    rng = np.random.default_rng(seed)
    values = [("x", 16)]  # (name, elements)
    nodes, inits = [], [init("reps", np.array([8, 1], np.int64))]
    for k in range(24):
        kind = rng.choice(["tile", "reduce", "add", "relu"])
        a = values[int(rng.integers(len(values)))]
        out = f"v{k}"
        if kind == "tile" and a[1] == 16:
            nodes.append(helper.make_node("Tile", [a[0], "reps"], [out], name=f"n{k}"))
            values.append((out, 128))
        elif kind == "reduce" and a[1] == 128:
            nodes.append(helper.make_node("ReduceMax", [a[0]], [out], name=f"n{k}", axes=[0], keepdims=1))
            values.append((out, 16))
        elif kind == "add":
            same = [v for v in values if v[1] == a[1]]
            b = same[int(rng.integers(len(same)))]
            nodes.append(helper.make_node("Add", [a[0], b[0]], [out], name=f"n{k}"))
            values.append((out, a[1]))
        else:
            nodes.append(helper.make_node("Relu", [a[0]], [out], name=f"n{k}"))
            values.append((out, a[1]))
    read = {i for n in nodes for i in n.input}
    outs = [tinfo(n.output[0], [1, 16] if dict(values)[n.output[0]] == 16 else [8, 16])
            for n in nodes if n.output[0] not in read]
    return model(nodes, [tinfo("x", [1, 16])], outs, inits, opset=17)


def test_random_branchy_graphs_reorder_keeps_outputs_and_never_raises():
    fired = 0
    for seed in range(12):
        m = _random_branchy(seed)
        before = memory.peak(m)["peak_bytes"]
        reordered, changed = _reordered(m)
        fired += changed
        proto = ir.serde.serialize_model(reordered)
        assert memory.peak(proto)["peak_bytes"] <= before
        assert (memory.peak(proto)["peak_bytes"] < before) == bool(changed)
        feeds = feeds_for(m, seed)
        for x, y in zip(run_ort(m, feeds), run_ort(proto, feeds)):
            np.testing.assert_array_equal(x, y)
    assert fired  # some of them had a better order


@pytest.mark.parametrize("name", ["efficientnet_b0-legacy", "ppocrv4-det"])
def test_zoo_candidate_orders_keep_outputs(name, tmp_path):
    # the pass's candidate orders, written out whether or not the pass would keep them: valid models
    # with the same outputs, bit for bit; for efficientnet_b0-legacy one lowers the peak in the nodes' order
    path = zoo_model(name, tmp_path)
    proto = onnx.load(str(path))
    m = io.to_ir(proto)
    if name == "ppocrv4-det":
        from onnxopt.ir.input_shapes import fix
        fix(m, {"x": [1, 3, 320, 320]})
    g = liveness.Liveness(m, liveness.Sizes(m, infer_model))
    greedy, depth_first, nodes0 = g.greedy(), g.depth_first(), list(g.nodes)
    if name == "efficientnet_b0-legacy":  # (ppocrv4-det's input: its Constant weights are no activations)
        assert min(g.peak_of(greedy), g.peak_of(depth_first)) < g.peak_of(range(len(g.nodes)))
    feeds = feeds_for(proto) if name != "ppocrv4-det" else \
        {"x": np.random.default_rng(0).standard_normal([1, 3, 320, 320]).astype(np.float32)}
    want = run_ort(proto, feeds)
    for order in (greedy, depth_first):
        assert sorted(order) == list(range(len(g.nodes)))
        nodes = [nodes0[k] for k in order]
        m.graph.remove(list(m.graph), safe=False)
        m.graph.extend(nodes)
        out = ir.serde.serialize_model(m)
        onnx.checker.check_model(out)
        for x, y in zip(want, run_ort(out, feeds)):
            np.testing.assert_array_equal(x, y)


def test_onnxruntime_order_hand_computed():
    # onnxruntime's default order: depth-first from the nodes no node reads, the producer with the
    # highest index explored first: [tile1, tile2, red1, red2, add] runs as tile2, red2, tile1, red1, add
    m = io.to_ir(_branches())
    g = liveness.Liveness(m, liveness.Sizes(m, infer_model))
    assert liveness.onnxruntime_order(g) == [1, 3, 0, 2, 4]
    r = memory.peak(_branches(), order="onnxruntime")
    assert r["peak_bytes"] == r["onnxruntime_peak_bytes"] == X + BIG + 2 * F
    assert memory.peak(_branches())["onnxruntime_peak_bytes"] == X + BIG + 2 * F


def test_symbolic_dims_unknown_then_fixed():
    m = model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
              [tinfo("x", ["n", 256])], [tinfo("y", ["n", 256])])
    r = memory.peak(m)
    assert r["unknown"] == ["x", "a", "y"] and r["lower_bound"] and r["peak_bytes"] == 0
    fixed = memory.peak(m, {"x": [2, 256]})
    assert fixed["unknown"] == [] and fixed["peak_bytes"] == 3 * 2 * 256 * F
    assert memory.peak(m, ["x=2,256"])["peak_bytes"] == fixed["peak_bytes"]  # the command line's grammar
    assert memory.reorder(io.to_ir(m)) == 0  # (sizes unknown: the pass leaves the order alone)
    # an onnx_ir model is sized at the shapes given and left with its own (no copy is made of it)
    m_ir = io.to_ir(m)
    declared = [(v.name, v.shape) for v in (*m_ir.graph.inputs, *m_ir.graph.outputs, *(o for n in m_ir.graph
                                                                                       for o in n.outputs))]
    assert memory.peak(m_ir, {"x": [2, 256]})["peak_bytes"] == fixed["peak_bytes"]
    assert [(v.name, v.shape) for v in (*m_ir.graph.inputs, *m_ir.graph.outputs,
                                        *(o for n in m_ir.graph for o in n.outputs))] == declared
    assert str(m_ir.graph.inputs[0].shape) == "[n,256]"
    with pytest.raises(Exception):
        memory.peak(m_ir, {"x": [2, 255]})  # (a static dimension changed: refused, the model as it was)
    assert str(m_ir.graph.inputs[0].shape) == "[n,256]"


def test_sub_byte_and_string_sizes():
    # int4 [3]: 12 bits -> 2 bytes; a string tensor has no size: unknown, not 0 silently
    m = model([helper.make_node("Identity", ["q"], ["q2"]), helper.make_node("Identity", ["s"], ["s2"])],
              [tinfo("q", [3], TensorProto.INT4), tinfo("s", [2], TensorProto.STRING)],
              [tinfo("q2", [3], TensorProto.INT4), tinfo("s2", [2], TensorProto.STRING)], opset=21)
    r = memory.peak(m)
    assert r["inputs_bytes"] == 2 and r["peak_bytes"] == 4 and r["unknown"] == ["s", "s2"]


def test_if_body_values_charged_at_the_if():
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [tinfo("t", [100])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e1"]), helper.make_node("Abs", ["e1"], ["e"])],
                              "else", [], [tinfo("e", [100])])
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="if")],
              [tinfo("x", [100]), tinfo("c", [], TensorProto.BOOL)], [tinfo("y", [100])])
    r = memory.peak(m)
    # inputs 401 bytes, the If's output 400, and every body value (both branches) 1200
    assert r["peak_bytes"] == 401 + 400 + 1200
    assert ["if (subgraph values)", 1200] in r["alive_at_peak"]


def _cse_raises(fixable: bool) -> onnx.ModelProto:
    """T1 = Tile(x) read first by a ReduceMax; a big Expand of that scalar, reduced; then the twin
    T2 = Tile(x), read by a last node. CSE makes T2 T1, whose life then spans the big Expand. With
    ``fixable`` T2's reader needs nothing else (reordering runs it early); else it needs the reduced
    Expand too (a MatMul with a vector made from it), and no order can help."""
    nodes = [helper.make_node("Tile", ["x", "reps"], ["T1"], name="tile1"),
             helper.make_node("ReduceMax", ["T1"], ["a"], name="max", keepdims=0),
             helper.make_node("Expand", ["a", "big_shape"], ["c"], name="expand"),
             helper.make_node("ReduceSum", ["c"], ["d"], name="sum_c", keepdims=0),
             helper.make_node("Tile", ["x", "reps"], ["T2"], name="tile2")]
    if fixable:
        nodes += [helper.make_node("ReduceSum", ["T2"], ["e"], name="sum_t2", keepdims=0),
                  helper.make_node("Add", ["d", "e"], ["y"], name="add")]
        out = tinfo("y", [])
    else:
        nodes += [helper.make_node("Expand", ["d", "vec_shape"], ["v"], name="vec"),
                  helper.make_node("MatMul", ["T2", "v"], ["y"], name="matmul")]
        out = tinfo("y", [64, 1])
    inits = [init("reps", np.array([64, 1], np.int64)), init("big_shape", np.array([64, 256], np.int64)),
             init("vec_shape", np.array([256, 1], np.int64))]
    return model(nodes, [tinfo("x", [1, 256])], [out], inits)


@pytest.mark.parametrize("fixable", [True, False])
def test_optimize_reports_memory_and_what_happens_when_rewrites_raise_the_peak(fixable):
    # (the memory_recomputation pass off: what the rewrites alone do; with it, the next test)
    m = _cse_raises(fixable)
    before = memory.peak(m)
    out, report = optimize(m, return_report=True, disable=["memory_recomputation"])
    assert report.rules["common_subexpression_elimination"].fired == 1
    mem = report.memory
    assert set(mem) == {"before", "after", "reordered"} and "curve" not in mem["before"]
    assert mem["before"]["peak_bytes"] == before["peak_bytes"]
    after = memory.peak(out)
    assert mem["after"]["peak_bytes"] == after["peak_bytes"]
    assert report.as_dict()["memory"] == mem
    # CSE keeps T1 alive through the big Expand, in the nodes' order: the peak rises, and the report
    # says so (a warning naming both orders' figures)
    assert mem["after"]["peak_bytes"] > before["peak_bytes"] and ["T1", BIG] in after["alive_at_peak"]
    assert any("peak activation memory rose" in w for w in report.warnings)
    assert not mem["reordered"]
    if fixable:
        # an order that runs T2's reader (now T1's) first exists, and onnxruntime, whose depth-first
        # order explores the last-written operand first, already runs that one: written out, it would
        # make onnxruntime's worse, so the pass leaves the order
        assert mem["after"]["onnxruntime_peak_bytes"] <= mem["before"]["onnxruntime_peak_bytes"]
        g = liveness.Liveness(io.to_ir(out), liveness.Sizes(io.to_ir(out), infer_model))
        assert g.peak_of(g.greedy()) <= before["peak_bytes"]
        assert liveness._onnxruntime_peak(g, g.greedy()) > mem["after"]["onnxruntime_peak_bytes"]
    else:
        # no order helps: in onnxruntime's order it rises too
        assert mem["after"]["onnxruntime_peak_bytes"] > mem["before"]["onnxruntime_peak_bytes"]
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(y, x, rtol=1e-5)


@pytest.mark.parametrize("fixable", [True, False])
def test_recomputation_wins_back_what_cse_raised(fixable):
    # with every pass on, optimize never raises the peak: T1's producer (a Tile of the input) is
    # copied before T2's reader, so T1 dies at the ReduceMax again; both orders back to the input's
    m = _cse_raises(fixable)
    before = memory.peak(m, curve=False)
    out, report = optimize(m, return_report=True)
    assert report.rules["common_subexpression_elimination"].fired == 1
    assert report.rules["memory_recomputation"].fired == 1
    mem = report.memory
    assert mem["after"]["peak_bytes"] <= before["peak_bytes"]
    assert mem["after"]["onnxruntime_peak_bytes"] <= before["onnxruntime_peak_bytes"]
    assert mem["after"] == memory.peak(out, curve=False)  # the pass's figure is the written model's
    assert not any("peak activation memory rose" in w for w in report.warnings)
    assert [n.op_type for n in out.graph.node].count("Tile") == 2
    copy = next(n for n in out.graph.node if n.name.startswith("tile1_recomputed"))
    assert list(copy.input) == ["x", "reps"] and "T1" not in [i for n in out.graph.node[2:] for i in n.input]
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(y, x)
    assert out.SerializeToString() == optimize(m).SerializeToString()  # deterministic


def test_recomputation_leaves_a_model_whose_peak_did_not_rise():
    m = _branches()
    out, report = optimize(m, return_report=True)
    assert report.rules["memory_recomputation"].fired == 0
    assert not any("_recomputed" in n.name for n in out.graph.node)


def test_recomputation_makes_one_copy_for_a_reader_of_the_value_twice():
    # CSE merges S2 = Sigmoid(x) into S1, read early; S2's reader Mul(S2, S2) comes after a big Tile.
    # The copy for that reader replaces both of its inputs: one copy, not one per use (the second
    # was left in the written model with nothing reading it)
    n = 1000
    nodes = [helper.make_node("Sigmoid", ["x"], ["S1"], name="s1"),
             helper.make_node("Add", ["S1", "x"], ["a"], name="add1"),
             helper.make_node("Tile", ["a", "reps"], ["big"], name="tile"),
             helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=1),
             helper.make_node("Sigmoid", ["x"], ["S2"], name="s2"),
             helper.make_node("Mul", ["S2", "S2"], ["y"], name="square"),
             helper.make_node("Add", ["y", "s"], ["out"], name="add2")]
    m = model(nodes, [tinfo("x", [n])], [tinfo("out", [n])], [init("reps", np.array([100], np.int64))])
    out, report = optimize(m, return_report=True)
    assert report.rules["common_subexpression_elimination"].fired == 1
    assert report.rules["memory_recomputation"].fired == 1
    assert [node.op_type for node in out.graph.node].count("Sigmoid") == 2
    read = {i for node in out.graph.node for i in node.input} | {o.name for o in out.graph.output}
    assert all(o in read for node in out.graph.node for o in node.output)
    assert report.memory["after"]["peak_bytes"] <= report.memory["before"]["peak_bytes"]
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(y, x)
    # the copy records the pass that made it, and merged nothing (it had the kept twin's onnxopt.merged,
    # and no onnxopt.rule: the diff listed it as created by no rule)
    copy = next(node for node in out.graph.node if node.name.startswith("s1_recomputed"))
    props = {p.key: p.value for p in copy.metadata_props}
    assert props == {"onnxopt.rule": "memory_recomputation", "onnxopt.replaced": "[]"}
    kept = next(node for node in out.graph.node if node.name == "s1")
    assert {p.key: p.value for p in kept.metadata_props} == {"onnxopt.merged": '["s2"]'}
    from onnxopt import diff

    created = diff.mapping(m, out)["created"]
    assert {"after": copy.name, "rule": "memory_recomputation", "replaced": []} in created


def test_recomputation_splits_a_graph_output_read_before_and_after_the_peak():
    # CSE merges the graph output R2 = Relu(x) into R1, read by the Sigmoid before the big Tile: the
    # output now lives from the start through the peak, and is read after it too. Copying it for every
    # reader kept the copy alive across the peak (the peak stayed raised, with a warning): the copy is
    # for the Sigmoid, the producer (the output) runs just before the Add that reads it late
    n = 256
    nodes = [helper.make_node("Relu", ["x"], ["R1"], name="r1"),
             helper.make_node("Sigmoid", ["R1"], ["s"], name="sig"),
             helper.make_node("Tile", ["s", "reps"], ["big"], name="tile"),
             helper.make_node("ReduceMax", ["big"], ["m"], name="max", keepdims=1),
             helper.make_node("Relu", ["x"], ["R2"], name="r2"),
             helper.make_node("Add", ["R2", "m"], ["out"], name="add")]
    m = model(nodes, [tinfo("x", [n])], [tinfo("out", [n]), tinfo("R2", [n])], [init("reps", np.array([50], np.int64))])
    before = memory.peak(m, curve=False)
    out, report = optimize(m, return_report=True)
    assert report.rules["common_subexpression_elimination"].fired == 1
    assert report.rules["memory_recomputation"].fired == 1
    mem = report.memory
    assert mem["after"]["peak_bytes"] <= before["peak_bytes"]
    assert mem["after"]["onnxruntime_peak_bytes"] <= before["onnxruntime_peak_bytes"]
    assert not any("peak activation memory rose" in w for w in report.warnings)
    order = [(node.op_type, list(node.input), list(node.output)) for node in out.graph.node]
    assert order[-2:] == [("Relu", ["x"], ["R2"]), ("Add", ["R2", "m"], ["out"])]
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(y, x)


def test_recomputation_copies_no_graph_output_that_nothing_reads():
    # CSE makes the early R1 = Relu(x) the graph output R2; the pass's first copy gives the Max its own
    # Relu and runs the output's producer late; the output, read by nothing now, was then "copied" for
    # no reader: a copy left in the written model with nothing reading it
    n = 256
    nodes = [helper.make_node("Relu", ["x"], ["R1"], name="r1"),
             helper.make_node("Max", ["R1", "R1"], ["a"], name="max1"),
             helper.make_node("Tile", ["a", "reps"], ["big"], name="tile"),
             helper.make_node("ReduceMax", ["big"], ["m"], name="max2", keepdims=1),
             helper.make_node("Relu", ["x"], ["R2"], name="r2"),
             helper.make_node("Sigmoid", ["a"], ["s"], name="sig"),
             helper.make_node("Mul", ["s", "m"], ["out"], name="mul")]
    m = model(nodes, [tinfo("x", [n])], [tinfo("out", [n]), tinfo("R2", [n])], [init("reps", np.array([50], np.int64))])
    out, report = optimize(m, return_report=True)
    assert report.rules["common_subexpression_elimination"].fired == 1
    assert report.rules["memory_recomputation"].fired == 1
    read = {i for node in out.graph.node for i in node.input} | {o.name for o in out.graph.output}
    assert all(o in read for node in out.graph.node for o in node.output)
    assert [node.op_type for node in out.graph.node].count("Relu") == 2
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(y, x)


def test_recomputation_leaves_no_copy_without_a_reader():
    # CSE merges C2 = Cast(xi) into C1; the copy made for C2's reader runs before the ReduceSum (early,
    # as onnxruntime's order wants), alive across the nodes' order's peak: a copy read only after the
    # peak is not copied again (the copy of the copy took its only reader, and the first copy stayed
    # in the written model with nothing reading it)
    n = 1000
    nodes = [helper.make_node("Cast", ["xi"], ["C1"], name="c1", to=TensorProto.FLOAT),
             helper.make_node("Add", ["C1", "x"], ["a"], name="add1"),
             helper.make_node("Tile", ["a", "reps"], ["big"], name="tile"),
             helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=1),
             helper.make_node("Cast", ["xi"], ["C2"], name="c2", to=TensorProto.FLOAT),
             helper.make_node("Add", ["C2", "s"], ["out"], name="add2")]
    m = model(nodes, [tinfo("x", [n]), tinfo("xi", [n], TensorProto.INT32)], [tinfo("out", [n])],
              [init("reps", np.array([100], np.int64))])
    out, report = optimize(m, return_report=True)
    assert report.rules["common_subexpression_elimination"].fired == 1
    assert report.rules["memory_recomputation"].fired >= 1
    read = {i for node in out.graph.node for i in node.input} | {o.name for o in out.graph.output}
    assert all(o in read for node in out.graph.node for o in node.output)
    assert [node.op_type for node in out.graph.node].count("Cast") == 2
    feeds = feeds_for(m)
    for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("name,copies", [("bert-legacy", 3), ("minilm-legacy", 5)])
def test_recomputation_on_the_zoo_keeps_outputs_and_never_raises(name, copies, tmp_path):
    # the legacy BERT exports: CSE shares the attention mask (float) where each layer made its own
    # from the smaller boolean one; the pass gives every later layer its own again
    from onnxopt.models import zoo

    path = zoo_model(name, tmp_path)
    src = onnx.load(str(path))
    out, report = optimize(src, return_report=True)
    b, a = report.memory["before"], report.memory["after"]
    assert a["peak_bytes"] <= b["peak_bytes"] and a["onnxruntime_peak_bytes"] <= b["onnxruntime_peak_bytes"]
    assert report.rules["memory_recomputation"].fired == copies
    without = optimize(src, return_report=True, disable=["memory_recomputation"])[1].memory["after"]
    assert without["peak_bytes"] > b["peak_bytes"] or without["onnxruntime_peak_bytes"] > b["onnxruntime_peak_bytes"]
    feeds = zoo.get(name).inputs(path)
    for x, y in zip(run_ort(src, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_optimize_without_the_pass_and_report_line():
    m = _branches()
    out, report = optimize(m, return_report=True, disable=["memory_reordering"])
    assert not report.memory["reordered"]
    assert report.memory["after"]["peak_bytes"] == report.memory["before"]["peak_bytes"]
    out2, report2 = optimize(m, return_report=True)
    assert report2.memory["reordered"] and report2.memory["after"]["peak_bytes"] < report.memory["after"]["peak_bytes"]
    # the figure the pass kept for the order it left is the one peak() finds in the written model
    assert report2.memory["after"] == memory.peak(out2, curve=False)
    line = format_memory(report2.memory)
    assert line.startswith("peak activation memory: 129.0 KiB -> 65.0 KiB (reordered)")
    assert out2.SerializeToString() == optimize(m).SerializeToString()  # deterministic


def test_peak_refuses_other_things():
    from onnxopt.errors import UsageError

    with pytest.raises(UsageError, match="memory.peak takes"):
        memory.peak(42)


def test_onnxruntime_reuse_holds_a_released_buffer_until_taken_again():
    # onnxruntime's planner gives d (shape [1000]) the buffer b (same shape) released at c; that
    # buffer then stays allocated through e, which plain liveness frees: 16004 bytes against 12004.
    # Views and in-place activations share their input's buffer; a graph output takes no released one.
    nodes = [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Abs", ["a"], ["b"]),
             helper.make_node("ReduceSum", ["b"], ["c"], keepdims=1),
             helper.make_node("Expand", ["c", "s2000"], ["e"]),
             helper.make_node("ReduceSum", ["e"], ["f"], keepdims=1),
             helper.make_node("Expand", ["f", "s1000"], ["d"]), helper.make_node("Neg", ["d"], ["y"])]
    m = model(nodes, [tinfo("x", [1000])], [tinfo("y", [1000])],
              [init("s2000", np.array([2000], np.int64)), init("s1000", np.array([1000], np.int64))])
    plain = memory.peak(m)
    assert plain["peak_bytes"] == 12004 and plain["peak_at"]["index"] == 3
    ort = memory.peak(m, order="onnxruntime")
    assert ort["peak_bytes"] == 16004 and ort["peak_at"]["index"] == 3
    assert ["b", 4000] in ort["alive_at_peak"]  # (held for d)
    # a Relu in place and a Reshape view allocate nothing more: x -> Neg a -> Relu r -> Reshape v -> Neg y
    m2 = model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
                helper.make_node("Reshape", ["r", "shape"], ["v"]), helper.make_node("Neg", ["v"], ["y"])],
               [tinfo("x", [1000])], [tinfo("y", [10, 100])], [init("shape", np.array([10, 100], np.int64))])
    assert memory.peak(m2)["peak_bytes"] == 4000 * 3
    assert memory.peak(m2, order="onnxruntime")["peak_bytes"] == 4000 * 3  # x, a (= r = v) and y
    assert memory.peak(m2, order="onnxruntime")["curve"] == [8000, 8000, 8000, 12000]


def test_the_report_sizes_a_dynamic_model_at_the_verifiers_shapes():
    """A model with symbolic input dimensions: the report's peaks are taken at the shapes the verifier runs
    it at (recorded under "at"), with onnxruntime's symbolic inference where onnx's leaves sizes open; not a
    lower bound of a few bytes."""
    import tempfile

    path = zoo_model("bert-legacy", tempfile.mkdtemp())
    _, report = optimize(onnx.load(path), return_report=True)
    for side in ("before", "after"):
        m = report.memory[side]
        assert m["at"] == {"input_ids": [1, 16], "attention_mask": [1, 16], "token_type_ids": [1, 16]}
        assert not m["unknown"] and not m["lower_bound"] and m["peak_bytes"] > 100_000


def test_fp16_output_cast_rise_is_named():
    # a model whose largest value is its float32 output: float16 keeps the output float32, made by a
    # Cast from the float16 MatMul's result, both alive at once; the warning says that, not "rewrites"
    w = np.random.default_rng(0).standard_normal((64, 4000)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tinfo("x", [1, 64])], [tinfo("y", [1, 4000])],
              [init("w", w)])
    _, report = optimize(m, return_report=True, precision="fp16", target="ort-cuda")
    b, a = report.memory["before"], report.memory["after"]
    assert a["peak_bytes"] > b["peak_bytes"]
    rose = [x for x in report.warnings if "peak activation memory rose" in x]
    assert rose and "float16 conversion" in rose[0] and "rewrites" not in rose[0]
    _, plain = optimize(m, return_report=True)
    assert not any("peak activation memory rose" in x for x in plain.warnings)


def test_random_graphs_with_twins_never_end_above_the_input():
    # CSE raises the peak of many of these (a twin read far away, a graph output merged with an
    # early twin); with the recomputation pass neither order ends above the input's, outputs equal
    rose_without, copied = 0, 0
    for seed in range(80):
        m = random_twins(seed, 30 if seed % 2 else 60)
        out, report = optimize(m, return_report=True)
        b, a = report.memory["before"], report.memory["after"]
        assert a["peak_bytes"] <= b["peak_bytes"], seed
        assert a["onnxruntime_peak_bytes"] <= b["onnxruntime_peak_bytes"], seed
        assert a == memory.peak(out, curve=False)
        read = {i for node in out.graph.node for i in node.input} | {o.name for o in out.graph.output}
        assert all(o in read for node in out.graph.node for o in node.output), seed  # (no copy left unread)
        without = optimize(m, return_report=True, disable=["memory_recomputation"])[1].memory["after"]
        rose_without += without["peak_bytes"] > b["peak_bytes"] or \
            without["onnxruntime_peak_bytes"] > b["onnxruntime_peak_bytes"]
        if report.rules["memory_recomputation"].fired:
            copied += 1
            feeds = feeds_for(m, seed)
            for x, y in zip(run_ort(m, feeds), run_ort(out, feeds)):
                np.testing.assert_array_equal(x, y)
    assert rose_without >= 5 and copied >= 5, (rose_without, copied)


def _profiled_ops(proto: onnx.ModelProto) -> list[str]:
    """The ops onnxruntime's CPU session runs, in its order (its profile; graph optimizations off)."""
    import tempfile

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = f"{tmp}/profile"
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        sess.run(None, feeds_for(proto))
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def _without_cpu_hardswish():
    from onnxopt.ir.kernels import kernel_defs

    kernels = kernel_defs()
    if kernels is None or any(op == "HardSwish" and domain == "" and provider == "CPUExecutionProvider"
                              and lo <= 14 <= hi for op, domain, lo, hi, provider, _ in kernels):
        pytest.skip("this onnxruntime registers a CPU HardSwish kernel (or cannot list its kernels)")


def test_onnxruntime_inlines_a_function_op_without_a_cpu_kernel():
    _without_cpu_hardswish()
    # onnxruntime has no CPU kernel for HardSwish (opset 14+): its session runs x * HardSigmoid(x), so
    # the HardSigmoid's value s is allocated besides a and h. x -> Neg a -> HardSwish h -> Neg y.
    m = model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("HardSwish", ["a"], ["h"], name="hs"),
               helper.make_node("Neg", ["h"], ["y"])], [tinfo("x", [1000])], [tinfo("y", [1000])], opset=15)
    assert memory.peak(m)["curve"] == [8000, 12000, 12000]  # the file's graph: one value for the HardSwish
    ort = memory.peak(m, order="onnxruntime")
    assert ort["curve"] == [8000, 12000, 16000, 12000]  # Neg, HardSigmoid (x, a, s), Mul (and h), Neg
    assert ort["peak_bytes"] == 16000 and len(ort["alive_at_peak"]) == 4
    assert ort["peak_at"] == {"index": 2, "name": "hs/Mul"}  # (the body's nodes named after the HardSwish)
    # the bodies take node numbers after the file's, and of two operands onnxruntime explores the
    # higher-numbered one first: the HardSwish branch (inlined) runs before the Relu branch, as its
    # profile shows, where numbering the bodies in the file's place would run the Relu first
    m2 = model([helper.make_node("HardSwish", ["x"], ["h"]), helper.make_node("Relu", ["x"], ["r"], name="relu"),
                helper.make_node("Add", ["h", "r"], ["y"], name="add")], [tinfo("x", [1000])], [tinfo("y", [1000])],
               opset=15)
    g, late = liveness.onnxruntime_graph(io.to_ir(m2))
    assert [n.op_type for n in g.graph] == ["HardSigmoid", "Mul", "Relu", "Add"] and late == {0, 1}
    lv = liveness.Liveness(g, liveness.Sizes(g, infer_model), late=late)
    modelled = [lv.nodes[i].op_type for i in liveness.onnxruntime_order(lv)]
    assert modelled == ["HardSigmoid", "Mul", "Relu", "Add"]
    assert [lv.nodes[i].op_type for i in liveness.onnxruntime_order(liveness.Liveness(g, liveness.Sizes(
        g, infer_model)))] == ["Relu", "HardSigmoid", "Mul", "Add"]  # (numbered in place: the other way)
    assert _profiled_ops(m2) == modelled
    # an op with a CPU kernel (HardSigmoid) is not inlined: the model comes back as it is
    plain = io.to_ir(model([helper.make_node("HardSigmoid", ["x"], ["y"])], [tinfo("x", [4])], [tinfo("y", [4])]))
    assert liveness.onnxruntime_graph(plain) == (plain, frozenset())


def test_where_kernel_working_memory():
    # onnxruntime's CPU Where selects X and Y in two broadcasts before it merges them: X_selection has the
    # shape of the condition broadcast with X ([1, 100] here: 400 bytes), Y_selection that of the
    # condition broadcast with Y ([10, 100]: 4000), both alive with the output ([10, 100]: 4000)
    m = model([helper.make_node("IsNaN", ["c"], ["cond"]), helper.make_node("Where", ["cond", "x", "y"], ["w"])],
              [tinfo("c", [1, 100]), tinfo("x", [1, 1]), tinfo("y", [10, 100])], [tinfo("w", [10, 100])])
    inputs = 400 + 4 + 4000
    plain = memory.peak(m)
    assert plain["peak_bytes"] == inputs + 100 + 4000  # (liveness of the graph's values only)
    ort = memory.peak(m, order="onnxruntime")
    assert ort["peak_bytes"] == inputs + 100 + 4000 + 400 + 4000
    assert ["Where (kernel working memory)", 4400] in ort["alive_at_peak"]
    assert ort["onnxruntime_peak_bytes"] == ort["peak_bytes"] == plain["onnxruntime_peak_bytes"]


def test_softmax_and_conv_transpose_kernel_working_memory():
    # Softmax (opset 13+) over an axis that is not the last: the input transposed, and the result before it
    # is transposed back, two temporaries of the input's size; over the last axis, none
    # (x -> Neg a -> Softmax s -> Neg y: the Softmax of float runs in place, in a's buffer)
    def softmax(axis, opset=17, dtype=TensorProto.FLOAT):
        return model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Softmax", ["a"], ["s"], axis=axis),
                      helper.make_node("Neg", ["s"], ["y"])], [tinfo("x", [4, 50, 10], dtype)],
                     [tinfo("y", [4, 50, 10], dtype)], opset=opset)

    for axis, scratch in ((1, 2 * 8000), (-1, 0), (2, 0)):
        assert memory.peak(softmax(axis), order="onnxruntime")["curve"] == [16000, 16000 + scratch, 24000]
    # (opset 12: the input seen as 2-D, nothing moved; a double Softmax is not run in place)
    assert memory.peak(softmax(1, opset=12), order="onnxruntime")["curve"] == [16000, 16000, 24000]
    assert memory.peak(softmax(-1, dtype=TensorProto.DOUBLE), order="onnxruntime")["curve"] == [32000, 48000, 48000]
    # ConvTranspose: a column buffer of (output channels / group) x kernel size x input image size elements
    w = init("w", np.ones([6, 4, 3, 3], np.float32))  # 6 input channels, groups of 2: 4 x 2 = 8 output channels
    m = model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], group=2, strides=[2, 2])],
              [tinfo("x", [1, 6, 5, 5])], [tinfo("y", [1, 8, 11, 11])], [w])
    r = memory.peak(m, order="onnxruntime")
    assert r["peak_bytes"] == 6 * 25 * F + 8 * 121 * F + 4 * 9 * 25 * F


def test_onnxruntime_planner_shapes_decide_in_place_and_constants_are_weights():
    # A Relu runs in place only where onnxruntime's planner knows its input's and output's shapes the
    # same (FindReusableInput's SameSize): x declared of unknown size and fixed by input_shapes, it
    # knows neither, and the Relu allocates
    def chain(x_shape):
        return model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
                      helper.make_node("Neg", ["r"], ["y"])], [helper.make_tensor_value_info(
                          "x", TensorProto.FLOAT, x_shape)], [tinfo("y", [1000])])

    assert memory.peak(chain([1000]), order="onnxruntime")["curve"] == [8000, 8000, 12000]
    unknown = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000])
    unknown.type.tensor_type.shape.dim[0].Clear()
    m = model(chain([1000]).graph.node, [unknown], [tinfo("y", [1000])])
    assert memory.peak(m, {"x": [1000]}, order="onnxruntime")["curve"] == [8000, 12000, 12000]
    # a name onnx's inference invents for a dimension (a Reshape to a shape computed at run time) is no
    # name to the planner; a declared one is
    m = model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Shape", ["x"], ["s"]),
               helper.make_node("Reshape", ["a", "s"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
              [tinfo("x", ["N"])], [tinfo("y", ["N"])])
    planned = liveness.plan_shapes(m)
    assert planned["a"] == (32, ("N",)) and "r" not in planned
    # a Constant node's value is a weight (to onnxruntime an initializer once loaded), not an activation,
    # in both orders
    c = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1000], [1.0] * 1000))
    m = model([c, helper.make_node("Add", ["x", "c"], ["y"])], [tinfo("x", [1000])], [tinfo("y", [1000])])
    assert memory.peak(m)["curve"] == [4000, 8000]
    assert memory.peak(m, order="onnxruntime")["curve"] == [4000, 8000]
    assert memory.peak(m)["weights_bytes"] == 4000


def test_estimate_against_a_measured_onnxruntime_run(tmp_path):
    """One real run (scripts/oracles/memory_check.py's measurement: a fresh process, arena and memory pattern
    off, the peak resident growth) of a graph where the rules above decide the figure: a HardSwish
    onnxruntime inlines and a Where with its two selections, 1 MiB values."""
    import os

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    _without_cpu_hardswish()
    from scripts.oracles import memory_check as check
    n = [256, 1024]
    m = model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("HardSwish", ["a"], ["h"]),
               helper.make_node("IsNaN", ["h"], ["nan"]), helper.make_node("Where", ["nan", "x", "h"], ["w"]),
               helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)], [tinfo("x", n)], [tinfo("y", [])], opset=15)
    path, feeds = tmp_path / "m.onnx", tmp_path / "feeds.npz"
    onnx.save(m, path)
    np.savez(feeds, x=np.random.default_rng(0).standard_normal(n).astype(np.float32))
    est = memory.peak(m, order="onnxruntime")
    expected = est["peak_bytes"] - est["inputs_bytes"]
    mib = 1 << 20
    # at the Where: h, the condition (0.25 MiB), the output (in the HardSigmoid's released buffer) and
    # both selections (1 MiB each); liveness of the file's values alone says h, the condition and w
    assert expected == 4 * mib + mib // 4
    assert memory.peak(m)["peak_bytes"] - est["inputs_bytes"] == 2 * mib + mib // 4
    growth = check.measure(path, feeds, "disabled")["growth"]
    assert abs(growth / expected - 1) < 0.1, (growth, expected)


def test_memory_trace_parses_strace_and_lines_mappings_up_with_nodes():
    from scripts.oracles import memory_trace as trace
    nodes = [(10.0, 10.5, "w [Where]"), (11.0, 11.2, "r [ReduceSum]")]
    text = "\n".join([
        "7 9.000000 mmap(NULL, 8192, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x10",  # (warm-up run)
        '7 9.500000 write(2, "onnxopt-trace-begin\\n", 20) = 20',
        "7 10.100000 mmap(NULL, 1052672, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x20",
        "7     10.200000 mmap(NULL, 1052672, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x30",
        "7 10.300000 mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, 3, 0) = 0x40",  # a file mapping: not memory
        "7 10.400000 munmap(0x20, 1052672) = 0",
        "7 10.700000 munmap(0x30, 1052672) = 0",
        "7 10.800000 munmap(0x10, 8192) = 0",  # mapped before the run: not counted
        '7 12.000000 write(2, "onnxopt-trace-end\\n", 18) = 18',
        "7 12.100000 mmap(NULL, 1052672, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x50",
    ])
    events, peak = trace.parse(text, nodes)
    assert [(e["sign"], e["bytes"], e["total"], e["node"]) for e in events] == [
        ("+", 1052672, 1052672, "w [Where]"), ("+", 1052672, 2105344, "w [Where]"),
        ("-", 1052672, 1052672, "w [Where]"), ("-", 1052672, 0, "after w [Where]")]
    assert peak == 2105344


def test_memory_trace_shows_wheres_selections_in_a_real_run(tmp_path):
    """The Where rule read in where_op.cc, seen in a run: inside the Where node the kernel maps its two
    selections and its output (1 MiB each) and unmaps the selections before it returns."""
    import os
    import shutil
    import subprocess

    if shutil.which("strace") is None or subprocess.run(["strace", "-o", os.devnull, "true"]).returncode:
        pytest.skip("needs strace, with ptrace allowed")
    from scripts.oracles import memory_trace as trace
    n = [256, 1024]
    # then a Softmax over the first axis (its two transposed temporaries; its output in place, in w's
    # buffer) and a ConvTranspose (its 2 MiB of columns: 2 output channels x 4 x 4 kernel x 128 x 128 input
    # image x 4 bytes, besides its 0.5 MiB output)
    w = init("wt", np.ones([16, 2, 4, 4], np.float32))
    m = model([helper.make_node("IsNaN", ["x"], ["c"]), helper.make_node("Where", ["c", "x", "x"], ["w"], name="w"),
               helper.make_node("Softmax", ["w"], ["s"], axis=0, name="s"),
               helper.make_node("Reshape", ["s", "shape"], ["r"]),
               helper.make_node("ConvTranspose", ["r", "wt"], ["t"], strides=[2, 2], pads=[1, 1, 1, 1], name="t"),
               helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0)], [tinfo("x", n)], [tinfo("y", [])],
              [w, init("shape", np.array([1, 16, 128, 128], np.int64))])
    path, feeds = tmp_path / "m.onnx", tmp_path / "feeds.npz"
    onnx.save(m, path)
    np.savez(feeds, x=np.ones(n, np.float32))
    events, peak = trace.trace(path, feeds, "disabled")

    def inside(node):
        return [(e["sign"], round(e["bytes"] / 2**20, 1)) for e in events if e["node"] == node]  # (MiB)

    assert inside("w [Where]") == [("+", 1), ("+", 1), ("+", 1), ("-", 1), ("-", 1)]
    assert inside("s [Softmax]") == [("+", 1), ("+", 1), ("-", 1), ("-", 1)]
    assert inside("t [ConvTranspose]") == [("+", 0.5), ("+", 2), ("-", 2)]  # (its output: 2 x 256 x 256)
    est = memory.peak(m, order="onnxruntime")
    assert abs(peak / (est["peak_bytes"] - est["inputs_bytes"]) - 1) < 0.05


def test_a_constant_nodes_tensor_is_a_weight():
    # a 256 KiB weight kept in a Constant node (PP-OCR's exports keep every weight so) is no activation:
    # the same figures as with it as an initializer, in both orders
    w = np.ones((256, 256), np.float32)
    as_node = model([helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w, "w")),
                     helper.make_node("MatMul", ["x", "w"], ["y"])], [tinfo("x", [2, 256])], [tinfo("y", [2, 256])])
    as_init = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tinfo("x", [2, 256])], [tinfo("y", [2, 256])],
                    [init("w", w)])
    a, b = memory.peak(as_node, curve=False), memory.peak(as_init, curve=False)
    assert a["peak_bytes"] == b["peak_bytes"] == 2 * 2 * 256 * 4
    assert a["onnxruntime_peak_bytes"] == b["onnxruntime_peak_bytes"]
    assert a["weights_bytes"] == b["weights_bytes"] == w.nbytes


def _count_inferences(monkeypatch):
    """Counts the memory passes' inferences after the rewrites (``memory._sized``) and their reuses of
    the baseline's (``memory._carried``)."""
    calls = {"inferred": 0, "carried": 0}
    sized, carried = memory._sized, memory._carried

    def counting_sized(m):
        calls["inferred"] += 1
        return sized(m)

    def counting_carried(m):
        got = carried(m)
        calls["carried"] += got is not None
        return got

    monkeypatch.setattr(memory, "_sized", counting_sized)
    monkeypatch.setattr(memory, "_carried", counting_carried)
    return calls


def _bn_alone() -> onnx.ModelProto:
    # x -> Relu -> BatchNormalization (no Conv to fold it into: bn_to_mul_add makes a Mul and an Add,
    # the Mul's output a value of the rewrite's own) -> Relu
    c = 4
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu0"),
             helper.make_node("BatchNormalization", ["r", "s", "b", "m", "v"], ["n"], name="bn"),
             helper.make_node("Relu", ["n"], ["y"], name="relu1")]
    inits = [init("s", np.linspace(0.5, 2, c).astype(np.float32)), init("b", np.linspace(-1, 1, c).astype(np.float32)),
             init("m", np.linspace(-0.2, 0.2, c).astype(np.float32)), init("v", np.linspace(1, 3, c).astype(np.float32))]
    return model(nodes, [tinfo("x", [1, c, 8, 8])], [tinfo("y", [1, c, 8, 8])], inits)


@pytest.mark.parametrize("case", ["synthetic", "twins", "new values", "ppocrv4-det", "ppocr-mobile-cls",
                                  "minilm-legacy"])
def test_the_memory_passes_reuse_the_baselines_inference_with_the_same_result(case, monkeypatch, tmp_path):
    # the passes after the rewrites take the types the baseline's inference gave (no second
    # inference) where every value is one it sized, and type the few values a rewrite made node by
    # node; the output is the one a second inference of the graph gives
    from onnxopt.models import synthetic

    if case == "synthetic":  # Conv+BN folded, Identity dropped: every value the input's or one taking its name
        models = [synthetic.build(300)]
    elif case == "twins":
        models = [random_twins(seed, 30) for seed in range(12)]
    elif case == "new values":
        models = [_bn_alone()]
    else:
        models = [onnx.load(zoo_model(case, tmp_path))]
    calls = _count_inferences(monkeypatch)
    carried = [optimize(m).SerializeToString() for m in models]
    reused, inferred = calls["carried"], calls["inferred"]
    monkeypatch.setattr(memory, "_carried", lambda m: None)  # a second inference, always
    assert carried == [optimize(m).SerializeToString() for m in models]
    if case == "new values":
        assert any(n.op_type == "Mul" for n in onnx.load_from_string(carried[0]).graph.node)  # (the rewrite ran)
    if case in ("synthetic", "twins", "new values", "ppocrv4-det"):
        assert reused >= len(models) and inferred == 0
    else:  # (the cls model: sizes its inference leaves unknown, so the graph is inferred again)
        assert reused + inferred >= 1


def test_a_value_taking_a_removed_values_name_is_not_carried():
    # baseline on x -> Relu a -> Relu b -> Relu c; then `b` removed and a new value named "b" made:
    # through redirect (the same tensor, its name taken) it is carried; made otherwise, it is not
    from onnxopt.ir.util import redirect

    def relus():
        m = io.to_ir(model([helper.make_node("Relu", ["x"], ["a"], name="n0"),
                            helper.make_node("Relu", ["a"], ["b"], name="n1"),
                            helper.make_node("Relu", ["b"], ["c"], name="n2")],
                           [tinfo("x", [1000])], [tinfo("c", [1000])]))
        memory.baseline(m)
        assert memory._carried(m) is not None  # nothing changed: every value carried
        return m

    m = relus()
    n1 = m.graph.node(1)
    twin = ir.node("Relu", [n1.inputs[0]], name="n1_twin")
    m.graph.insert_after(n1, twin)
    redirect(n1.outputs[0], twin.outputs[0], take_name=True)
    m.graph.remove(n1, safe=True)
    assert twin.outputs[0].name == "b" and memory._carried(m) is not None

    # a value named "b" made otherwise (twice as long): not the old "b"'s type, but its own, from its
    # producer's inference (a value a rewrite made), or no reuse at all where that cannot type it
    m = relus()
    n1 = m.graph.node(1)
    other = ir.node("Concat", [n1.inputs[0], n1.inputs[0]], attributes={"axis": 0}, name="n1_other")
    m.graph.insert_after(n1, other)
    n1.outputs[0].replace_all_uses_with(other.outputs[0])
    m.graph.remove(n1, safe=True)
    other.outputs[0].name = "b"  # (a name reused, not taken over by redirect)
    got = memory._carried(m)
    assert [d.dim_value for d in got["b"].tensor_type.shape.dim] == [2000]
    other.attributes["axis"] = ir.AttrInt64("axis", 5)  # (inference refuses it: the graph is inferred again)
    assert memory._carried(m) is None


@pytest.mark.parametrize("case", ["synthetic", "declared", "resnet50-dynamo", "ppocrv4-det"])
def test_the_light_proto_taken_from_the_file_infers_what_the_serialized_one_does(case, tmp_path, monkeypatch):
    # the baseline's inference reads the proto the file was parsed into (no serialization of the
    # graph): the types it gives every node output and input are those of the serialized model's
    from onnxopt.ir.shapes import SOURCE_KEY, infer_proto, light_proto, light_source
    from onnxopt.models import synthetic

    if case == "synthetic":
        proto = synthetic.build(200)
    elif case == "declared":  # recorded values, an initializer that is an input, a large one, a graph output one
        nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
                 helper.make_node("Add", ["a", "b"], ["c"], name="add"),
                 helper.make_node("Reshape", ["c", "shape"], ["y"], name="rs")]
        proto = model(nodes, [tinfo("x", ["n", 64]), tinfo("b", [64])], [tinfo("y", 2), tinfo("shape", [2], TensorProto.INT64)],
                      [init("w", np.ones((64, 64), np.float32)), init("b", np.zeros(64, np.float32)),
                       init("shape", np.array([-1, 32], np.int64))])
        proto.graph.value_info.extend([tinfo("a", ["n", 64]), tinfo("w", [64, 64]), tinfo("gone", [3])])
    else:
        proto = onnx.load(zoo_model(case, tmp_path))
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    loaded = io.load(path)
    m = loaded.model
    assert light_source(m) is None  # (only where the reader left it)
    m.graph.meta[SOURCE_KEY] = loaded.source
    light = light_source(m)
    assert light is not None and not any(t.raw_data and len(t.raw_data) > 1000 for t in light.graph.initializer)
    ours, theirs = (liveness.inferred_types(infer_proto(p)) for p in (light, light_proto(m)))
    names = [o.name for n in m.graph for o in n.outputs] + [v.name for v in m.graph.inputs]
    assert [ours.get(k) for k in names] == [theirs.get(k) for k in names]
    assert sum(t is not None for t in (ours.get(k) for k in names)) >= len(names) // 2
    # optimize from the file (the light proto taken from it) writes what it writes with the model serialized
    optimize(str(path), output=tmp_path / "out.onnx")
    monkeypatch.setattr(memory, "light_source", lambda m: None)
    optimize(str(path), output=tmp_path / "serialized.onnx")
    assert (tmp_path / "out.onnx").read_bytes() == (tmp_path / "serialized.onnx").read_bytes()


def test_the_pipeline_drops_the_proto_it_was_read_from():
    from onnxopt.core import pipeline
    from onnxopt.ir.shapes import SOURCE_KEY
    from onnxopt.library import registry

    m = io.to_ir(_branches())
    m.graph.meta[SOURCE_KEY] = onnx.ModelProto()
    pipeline.run(m, registry.builtin_rules())
    assert SOURCE_KEY not in m.graph.meta
