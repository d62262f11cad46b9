"""rules/packing.py: MatMuls of one activation by constant weights become one MatMul by the concatenated weights
and a Split (decoders' packed QKV and gate/up; issue 30)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import init, model, shared_zoo_model, tinfo
from onnx import TensorProto, helper, numpy_helper

from .check import fires, mismatches, opaque, refuses, run_rule, with_opaque

ort = pytest.importorskip("onnxruntime")

K = 8
WIDTHS = (8, 4, 4)  # q, k, v of grouped-query attention: k and v narrower than q
TOL = 1e-5


def _feeds(rank=3, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shape = (2, 3, K)[3 - rank:]
    x = rng.standard_normal(shape) if dtype == np.float32 else rng.integers(-3, 4, shape)
    return {"x": x.astype(dtype)}


def projections(widths=WIDTHS, *, biases=(), shared_weight=False, shared_bias=False, weight_rank=2, rank=3,
                activation=False, pending=(), unknown_rank=False, dtype=TensorProto.FLOAT, opset=17,
                outputs_direct=False):
    """x [2, 3, K] -> MatMul(x, W_i) (+ b_i for i in ``biases``) -> Relu -> y_i. ``shared_weight``: W_0 is
    read by a MatMul of another activation too; ``shared_bias``: b_0 is added to x too; ``activation``: x
    is also multiplied by itself (x @ x^T); ``pending``: those W_i are Transpose(W_i^T) (constant folding
    makes them initializers); ``outputs_direct``: the projections are graph outputs (no Relu)."""
    rng = np.random.default_rng(1)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    nodes, inits, outs = [], [], []
    x = "x"
    if unknown_rank:
        nodes.append(opaque("x", "xo"))
        x = "xo"
    for i, n in enumerate(widths):
        shape = (K, n) if weight_rank == 2 else (1, K, n)
        w = (rng.standard_normal(shape) if dtype == TensorProto.FLOAT else rng.integers(-2, 3, shape)).astype(np_dtype)
        if i in pending:
            inits.append(init(f"wt{i}", np.ascontiguousarray(np.swapaxes(w, -1, -2))))
            nodes.append(helper.make_node("Transpose", [f"wt{i}"], [f"w{i}"]))
        else:
            inits.append(init(f"w{i}", w))
        y = f"y{i}" if outputs_direct else f"p{i}"
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}" if i in biases else y], name=f"proj{i}"))
        if i in biases:
            inits.append(init(f"b{i}", rng.standard_normal(n).astype(np_dtype)))
            nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [y], name=f"bias{i}"))
        if not outputs_direct:
            nodes.append(helper.make_node("Relu", [y], [f"y{i}"]))
        outs.append(tinfo(f"y{i}", ["b", "s", n] if rank == 3 else (["b", n] if rank == 2 else rank), dtype))
    if shared_weight:
        nodes += [helper.make_node("Neg", ["x"], ["nx"]),
                  helper.make_node("MatMul", ["nx", "w0"], ["z"], name="elsewhere")]
        outs.append(tinfo("z", ["b", "s", widths[0]], dtype))
    if shared_bias:
        nodes.append(helper.make_node("Add", ["x", "b0"], ["zb"], name="bias_elsewhere"))
        outs.append(tinfo("zb", ["b", "s", K], dtype))
    if activation:
        nodes += [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", ["x", "xt"], ["gram"], name="gram")]
        outs.append(tinfo("gram", ["b", "s", "s"], dtype))
    shape = ["b", "s", K] if rank == 3 else ["b", K]
    m = model(nodes, [tinfo("x", shape, dtype)], outs, inits, opset=opset)
    return with_opaque(m) if unknown_rank else m


def _ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def _split_sizes(m: onnx.ModelProto) -> list[list[int]]:
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    out = []
    for n in m.graph.node:
        if n.op_type == "Split":
            attr = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            out.append([int(v) for v in (inits[n.input[1]] if len(n.input) > 1 and n.input[1] else attr["split"])])
    return out


# --- fires --------------------------------------------------------------------------------------------


def test_grouped_query_projections_become_one_matmul_and_a_split():
    m = projections()
    out, _ = fires("packed_projections", m, feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert _ops(out).count("MatMul") == 1 and _ops(out).count("Split") == 1
    assert _split_sizes(out) == [list(WIDTHS)]  # in graph order
    packed = next(n for n in out.graph.node if n.op_type == "MatMul")
    w = next(numpy_helper.to_array(i) for i in out.graph.initializer if i.name == packed.input[1])
    originals = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    np.testing.assert_array_equal(w, np.concatenate([originals[f"w{i}"] for i in range(3)], axis=1))
    # the originals are dropped: no weight is held twice
    assert not {i.name for i in out.graph.initializer} & set(originals)
    split = next(n for n in out.graph.node if n.op_type == "Split")
    assert list(split.output) == ["p0", "p1", "p2"]  # each takes the name of the projection it stands for
    meta = {p.key: p.value for p in packed.metadata_props}
    assert meta["onnxopt.rule"] == "packed_projections" and "proj2" in meta["onnxopt.replaced"]


def test_gate_and_up_as_graph_outputs():
    out, _ = fires("packed_projections", projections((16, 16), outputs_direct=True), feeds=_feeds(), tol=TOL,
                   target="ort-cuda")
    assert [o.name for o in out.graph.output] == ["y0", "y1"] and _ops(out) == ["MatMul", "Split"]


def test_every_bias_is_packed_into_one_add():
    out, _ = fires("packed_projections", projections(biases=(0, 1, 2)), feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert _ops(out).count("Add") == 1 and _ops(out).count("MatMul") == 1
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert add.output[0] == next(n for n in out.graph.node if n.op_type == "Split").input[0]


def test_where_only_some_have_a_bias_their_adds_stay():
    out, _ = fires("packed_projections", projections(biases=(1,)), feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert _ops(out).count("Add") == 1 and _ops(out).count("MatMul") == 1
    add = next(n for n in out.graph.node if n.op_type == "Add")
    split = next(n for n in out.graph.node if n.op_type == "Split")
    assert add.input[0] == split.output[1]  # the biased projection's own Add reads its part


def test_a_bias_the_group_shares_is_packed_as_copies():
    m = projections((4, 4), biases=(0, 1))
    b1 = next(i for i in m.graph.initializer if i.name == "b1")
    m.graph.initializer.remove(b1)
    next(n for n in m.graph.node if n.name == "bias1").input[1] = "b0"  # (a legacy export's shared zero bias)
    out, _ = fires("packed_projections", m, feeds=_feeds(), tol=TOL, target="ort-cpu")
    add = next(n for n in out.graph.node if n.op_type == "Add")
    bias = next(numpy_helper.to_array(i) for i in out.graph.initializer if i.name == add.input[1])
    b0 = next(numpy_helper.to_array(i) for i in m.graph.initializer if i.name == "b0")
    np.testing.assert_array_equal(bias, np.concatenate([b0, b0]))
    assert "b0" not in {i.name for i in out.graph.initializer}


def test_a_product_of_activations_is_no_member():
    out, _ = fires("packed_projections", projections((8, 4), activation=True), feeds=_feeds(), tol=TOL,
                   target="ort-cpu")
    assert _ops(out).count("MatMul") == 2  # the packed one, and x @ x^T untouched
    assert _split_sizes(out) == [[8, 4]]


def test_rank_2_activation_and_opset_9_split_attribute():
    out, _ = fires("packed_projections", projections(rank=2, opset=9), feeds=_feeds(rank=2), tol=TOL,
                   target="ort-cpu")
    split = next(n for n in out.graph.node if n.op_type == "Split")
    assert len(split.input) == 1 and _split_sizes(out) == [list(WIDTHS)]
    assert next(a.i for a in split.attribute if a.name == "axis") == 1  # (no negative axis before opset 11)


def test_same_model_same_bytes():
    m = projections(biases=(0, 1, 2), activation=True)
    a, _ = run_rule("packed_projections", m, target="ort-cpu")
    b, _ = run_rule("packed_projections", m, target="ort-cpu")
    assert a.SerializeToString() == b.SerializeToString()


# --- refuses ----------------------------------------------------------------------------------------------


def test_a_weight_read_elsewhere_is_refused():
    refuses("packed_projections", projections(shared_weight=True), "the weight of proj0 is read elsewhere too",
            feeds=_feeds(), target="ort-cpu")


def test_a_bias_read_elsewhere_is_copied():
    out, _ = fires("packed_projections", projections(biases=(0, 1, 2), shared_bias=True), feeds=_feeds(), tol=TOL,
                   target="ort-cpu")
    assert _ops(out).count("Add") == 2 and "b0" in {i.name for i in out.graph.initializer}  # (its other reader's)


def test_a_weight_of_rank_3_is_refused():
    refuses("packed_projections", projections(weight_rank=3), "has rank 3, not 2", feeds=_feeds(), target="ort-cpu")


def test_x_of_unknown_rank_is_refused():
    refuses("packed_projections", projections(unknown_rank=True), "x's rank is unknown", feeds=_feeds(),
            target="ort-cpu")


def test_integer_projections_are_refused():
    refuses("packed_projections", projections(dtype=TensorProto.INT32), "x is not of a float type",
            feeds=_feeds(dtype=np.int32), target="ort-cpu")


def test_one_projection_is_no_candidate():
    mismatches("packed_projections", projections((8,)), "x is not read by two or more MatMuls", feeds=_feeds(),
               target="ort-cpu")


def test_a_weight_still_to_fold_makes_the_group_wait():
    m = projections(pending=(2,))
    mismatches("packed_projections", m, "waits for its weight to fold", feeds=_feeds(), target="ort-cpu")
    # with constant folding the weight becomes an initializer, and the whole group is packed at once
    from onnxopt import optimize

    out, report = optimize(m, target="ort-cpu", return_report=True)
    assert report.rules["packed_projections"].fired == 1 and _split_sizes(out) == [list(WIDTHS)]


def test_not_in_portable():
    from onnxopt.rules.packing import RULES

    assert RULES[0].targets == frozenset({"ort-cpu", "ort-cuda"}) and RULES[0].exact is False


# --- the zoo ------------------------------------------------------------------------------------------------


def test_encoder_qkv_is_left_to_attention_fusion():
    """BERT's Q/K/V: attention_fusion packs them into com.microsoft Attention itself."""
    from onnxopt import optimize

    out, report = optimize(onnx.load(str(shared_zoo_model("bert-legacy"))), target="ort-cpu", return_report=True)
    st = report.rules["packed_projections"]
    assert st.fired == 0 and any("attention_fusion packs them" in r for r in st.reasons), dict(st.reasons)
    assert report.rules["attention_fusion"].fired == 4 and "Split" not in _ops(out)


@pytest.mark.parametrize("name", ["llama-kv-legacy", "llama-kv-dynamo", "llama-prefill-legacy",
                                  "llama-prefill-dynamo", "qwen2-kv-dynamo"])
def test_zoo_decoders_pack_qkv_and_gate_up(name):
    """The tiny llama (4 heads, 2 key/value heads: q 64 wide, k and v 32; the MLP 128): per layer one packed
    QKV and one gate/up; the outputs (logits, and the presents of the kv form) are the original's. Qwen2's
    q/k/v have biases (zeros at transformers' init: packed, then gone as x + 0)."""
    pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")
    from onnxopt import optimize
    from onnxopt.models import zoo

    path = shared_zoo_model(name)
    feeds = zoo.get(name).inputs(path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    original = onnx.load(str(path))
    ref = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    moved = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {k: (v + 1) % 500 if k == "input_ids" else v for k, v in feeds.items()})
    assert not np.array_equal(ref[0], moved[0])  # the logits depend on the tokens
    out, report = optimize(original, target="ort-cpu", return_report=True)
    assert report.fusions["packed_projections"]["hits"] == 4, report.fusions["packed_projections"]
    assert report.fusions["packed_projections"]["missed"] == 0
    assert sorted(_split_sizes(out)) == [[64, 32, 32]] * 2 + [[128, 128]] * 2
    got = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    for x, y in zip(ref, got, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
    if name == "llama-kv-legacy":  # the same export, the same bytes (the rule alone: its weights are initializers)
        once, report = run_rule("packed_projections", original, target="ort-cpu")
        assert report.rules["packed_projections"].fired == 4
        assert run_rule("packed_projections", original, target="ort-cpu")[0].SerializeToString() == \
            once.SerializeToString()
