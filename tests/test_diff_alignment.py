"""onnxopt.diff's alignment (no provenance) against the provenance mapping and against mappings known
by construction: merged twins, bypassed nodes, chains folded, regions of several rewrites split, a
small transformer optimized by onnxopt (and by a peer tool), and a zoo transformer."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import diff, optimize
from onnxopt.models import zoo

D, HEADS = 32, 4


def _model(nodes, inits=(), outputs=("y",), inputs=(("x", [1, 8]),)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _sets(m):
    return {k: set(v) for k, v in m["pairs"].items()}


def _align(before, after, names=True):
    return diff.align(diff.Graph(before), diff.Graph(after), use_names=names)


# --------------------------------------------------------------------------------------------
# Mappings known by construction


def test_twins_merged_link_by_link_and_dead_twins_removed():
    """r2 -> n2 duplicate r1 -> n1 (CSE keeps the first); n2 reads r2, not r1: found through r2's
    merge. r3 -> s3 duplicates too, but nothing reads it: removed, not merged."""
    node = helper.make_node
    before = _model([node("Relu", ["x"], ["a1"], name="r1"), node("Relu", ["x"], ["a2"], name="r2"),
                     node("Neg", ["a1"], ["b1"], name="n1"), node("Neg", ["a2"], ["b2"], name="n2"),
                     node("Relu", ["x"], ["a3"], name="r3"), node("Sigmoid", ["a3"], ["c3"], name="s3"),
                     node("Add", ["b1", "x"], ["y"], name="add"), node("Mul", ["b2", "x"], ["z"], name="mul")],
                    outputs=("y", "z"))
    after = _model([node("Relu", ["x"], ["a1"], name="r1"), node("Neg", ["a1"], ["b1"], name="n1"),
                    node("Add", ["b1", "x"], ["y"], name="add"), node("Mul", ["b1", "x"], ["z"], name="mul")],
                   outputs=("y", "z"))
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"r1": {"r1", "r2"}, "n1": {"n1", "n2"}, "add": {"add"}, "mul": {"mul"}}, names
        assert set(m["removed"]) == {"r3", "s3"}


def test_bypassed_nodes_eliminated_or_folded_into_their_chain():
    """An Add of zeros and an Identity go (nothing stands for them); Reshape(Reshape(x)) is the second
    Reshape alone: both stand in it."""
    node = helper.make_node
    inits = [_const("w", np.ones((8, 6))), _const("zero", np.zeros(6)), _const("s1", [2, 3], np.int64),
             _const("s2", [3, 2], np.int64)]
    before = _model([node("MatMul", ["x", "w"], ["m"], name="mm"), node("Add", ["m", "zero"], ["a"], name="bias"),
                     node("Identity", ["a"], ["i"], name="ident"), node("Reshape", ["i", "s1"], ["r1"], name="rs1"),
                     node("Reshape", ["r1", "s2"], ["r2"], name="rs2"), node("Relu", ["r2"], ["y"], name="relu")],
                    inits)
    after = _model([node("MatMul", ["x", "w"], ["m"], name="mm"), node("Reshape", ["m", "s2"], ["r2"], name="rs2"),
                    node("Relu", ["r2"], ["y"], name="relu")], [inits[0], inits[3]])
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"mm": {"mm"}, "rs2": {"rs1", "rs2"}, "relu": {"relu"}}, names
        assert set(m["removed"]) == {"bias", "ident"}
        assert [c["after"] for c in m["created"]] == ["rs2"]  # (a node standing for two: made)


def test_fused_producer_is_not_an_elimination():
    """Conv+BatchNormalization folded: the Relu reads past the BatchNormalization, but what it reads
    now is a changed Conv: the BatchNormalization was fused into it, not eliminated."""
    node = helper.make_node
    rng = np.random.default_rng(0)
    inits = [_const("w", rng.standard_normal((4, 3, 1, 1))), *(_const(n, np.ones(4)) for n in ("sc", "b", "mu", "v"))]
    before = _model([node("Conv", ["x", "w"], ["c"], name="conv"),
                     node("BatchNormalization", ["c", "sc", "b", "mu", "v"], ["n"], name="bn"),
                     node("Relu", ["n"], ["y"], name="relu")], inits, inputs=(("x", [1, 3, 4, 4]),))
    after = _model([node("Conv", ["x", "w2", "b2"], ["n"], name="conv"), node("Relu", ["n"], ["y"], name="relu")],
                   [_const("w2", rng.standard_normal((4, 3, 1, 1))), _const("b2", np.ones(4))],
                   inputs=(("x", [1, 3, 4, 4]),))
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"conv": {"conv", "bn"}, "relu": {"relu"}}, names
        assert m["removed"] == []


def test_pad_folded_into_conv_pads_is_fused_not_eliminated():
    """Pad -> Conv became one Conv with pads: the Conv reads past the Pad, but gained an attribute
    value (its pads): the Pad went into it. Without names the Conv pairs only through the Pad (its
    reader's producer, one node up): found all the same."""
    node = helper.make_node
    inits = [_const("w", np.ones((4, 3, 3, 3))), _const("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64)]
    shape = (("x", [1, 3, 4, 4]),)
    before = _model([node("Pad", ["x", "pads"], ["p"], name="pad"), node("Conv", ["p", "w"], ["c"], name="conv"),
                     node("Relu", ["c"], ["y"], name="relu")], inits, inputs=shape)
    after = _model([node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                    node("Relu", ["c"], ["y"], name="relu")], inits[:1], inputs=shape)
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"conv": {"pad", "conv"}, "relu": {"relu"}}, names
        assert m["removed"] == []


def test_region_split_by_a_changed_partner_and_shared_constants():
    """MatMul + Add became a Gemm beside a Transpose that changed: one region; the Transpose keeps its
    partner, the Gemm takes the nodes reading its weight and bias."""
    node = helper.make_node
    inits = [_const("w", np.ones((8, 6))), _const("bias", np.arange(6))]
    before = _model([node("MatMul", ["x", "w"], ["m"], name="mm"), node("Add", ["m", "bias"], ["a"], name="add"),
                     node("Transpose", ["a"], ["t"], name="tr", perm=[1, 0]), node("Neg", ["t"], ["y"], name="neg")],
                    inits)
    after = _model([node("Gemm", ["x", "w", "bias"], ["a"], name="gemm"),
                    node("Transpose", ["a"], ["t"], name="tr", perm=[0, 1]), node("Neg", ["t"], ["y"], name="neg")],
                   inits)
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"gemm": {"mm", "add"}, "tr": {"tr"}, "neg": {"neg"}}, names


def test_region_of_several_rewrites_split_at_a_fork():
    """Reshape -> Gemm -> Reshape -> SplitToSequence -> SequenceAt x2 became MatMul -> Split: one region
    on each side; the MatMul is anchored by the weight it shares with the Gemm, the Split where it
    sits (upstream of both readers' partners), the rest goes to the nearest anchor."""
    node = helper.make_node
    inits = [_const("w", np.ones((8, 8))), _const("bias", np.zeros(8)), _const("flat", [-1, 8], np.int64),
             _const("back", [1, -1, 8], np.int64), _const("sizes", [4, 4], np.int64), _const("i0", 0, np.int64),
             _const("i1", 1, np.int64)]
    tail = [node("Neg", ["s0"], ["y"], name="neg0"), node("Abs", ["s1"], ["z"], name="abs1")]
    before = _model([node("Reshape", ["x", "flat"], ["f"], name="view_in"),
                     node("Gemm", ["f", "w", "bias"], ["g"], name="gemm"),
                     node("Reshape", ["g", "back"], ["h"], name="view_out"),
                     node("SplitToSequence", ["h", "sizes"], ["seq"], name="to_seq", axis=-1),
                     node("SequenceAt", ["seq", "i0"], ["s0"], name="at0"),
                     node("SequenceAt", ["seq", "i1"], ["s1"], name="at1"), *tail],
                    inits, outputs=("y", "z"), inputs=(("x", [1, 2, 8]),))
    after = _model([node("MatMul", ["x", "w"], ["h"], name="matmul"),
                    node("Split", ["h", "split4"], ["s0", "s1"], name="split", axis=-1), *tail],
                   [inits[0], _const("split4", [4, 4], np.int32)],  # (other contents: no constant anchor)
                   outputs=("y", "z"), inputs=(("x", [1, 2, 8]),))
    for names in (True, False):
        m = _align(before, after, names)
        assert _sets(m) == {"matmul": {"view_in", "gemm", "view_out"}, "split": {"to_seq", "at0", "at1"},
                            "neg0": {"neg0"}, "abs1": {"abs1"}}, names


# --------------------------------------------------------------------------------------------
# A small transformer block, optimized by onnxopt


def _transformer() -> onnx.ModelProto:
    """LayerNorm decomposed, then self-attention with shape arithmetic (Shape/Gather/Unsqueeze/Concat
    feeding Reshape, twice the same), Transpose/MatMul/Softmax, a zero bias, an Identity, a residual."""
    rng = np.random.default_rng(1)
    hd = D // HEADS
    inits = [_const(f"w{k}", rng.standard_normal((D, D)) * 0.1) for k in "qkvo"]
    inits += [_const(f"b{k}", rng.standard_normal(D) * 0.1) for k in "qko"] + [_const("bv", np.zeros(D))]
    inits += [_const("gamma", rng.standard_normal(D)), _const("beta", rng.standard_normal(D)), _const("two", 2.0),
              _const("eps", 1e-5), _const("scale", np.sqrt(hd)), _const("i0", [0], np.int64),
              _const("i1", [1], np.int64), _const("heads", [HEADS, hd], np.int64), _const("dim", [D], np.int64),
              _const("ax0", [0], np.int64)]
    n = helper.make_node
    nodes = [n("ReduceMean", ["x"], ["mean"], name="ln/mean", axes=[-1]), n("Sub", ["x", "mean"], ["d"], name="ln/sub"),
             n("Pow", ["d", "two"], ["sq"], name="ln/pow"), n("ReduceMean", ["sq"], ["var"], name="ln/var", axes=[-1]),
             n("Add", ["var", "eps"], ["ve"], name="ln/add_eps"), n("Sqrt", ["ve"], ["sd"], name="ln/sqrt"),
             n("Div", ["d", "sd"], ["nrm"], name="ln/div"), n("Mul", ["nrm", "gamma"], ["g"], name="ln/mul"),
             n("Add", ["g", "beta"], ["h"], name="ln/add")]
    for tag in ("", "_2"):  # the heads' shape, then the merged one's: twice the same arithmetic
        nodes += [n("Shape", ["h"], [f"shape{tag}"], name=f"shape{tag}"),
                  n("Gather", [f"shape{tag}", "i0"], [f"bsz{tag}"], name=f"gather_b{tag}", axis=0),
                  n("Gather", [f"shape{tag}", "i1"], [f"seq{tag}"], name=f"gather_s{tag}", axis=0)]
    nodes += [n("Concat", ["bsz", "seq", "heads"], ["split_shape"], name="concat_heads", axis=0),
              n("Concat", ["bsz_2", "seq_2", "dim"], ["merge_shape"], name="concat_merge", axis=0)]
    perms = {"q": [0, 2, 1, 3], "k": [0, 2, 3, 1], "v": [0, 2, 1, 3]}
    for k in "qkv":
        nodes += [n("MatMul", ["h", f"w{k}"], [f"{k}m"], name=f"{k}/matmul"),
                  n("Add", [f"{k}m", f"b{k}"], [f"{k}a"], name=f"{k}/bias"),
                  n("Reshape", [f"{k}a", "split_shape"], [f"{k}r"], name=f"{k}/reshape"),
                  n("Transpose", [f"{k}r"], [f"{k}t"], name=f"{k}/transpose", perm=perms[k])]
    nodes += [n("MatMul", ["qt", "kt"], ["scores"], name="att/qk"),
              n("Div", ["scores", "scale"], ["scaled"], name="att/div"),
              n("Softmax", ["scaled"], ["probs"], name="att/softmax", axis=-1),
              n("MatMul", ["probs", "vt"], ["ctx"], name="att/pv"),
              n("Transpose", ["ctx"], ["ctx_t"], name="att/transpose", perm=[0, 2, 1, 3]),
              n("Reshape", ["ctx_t", "merge_shape"], ["merged"], name="att/reshape"),
              n("Identity", ["merged"], ["merged_i"], name="att/identity"),
              n("MatMul", ["merged_i", "wo"], ["om"], name="o/matmul"), n("Add", ["om", "bo"], ["oa"], name="o/bias"),
              n("Add", ["oa", "x"], ["y"], name="residual")]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    folder = tmp_path_factory.mktemp("block")
    before = folder / "before.onnx"
    onnx.save(_transformer(), before)
    after = folder / "after.onnx"
    # ort-cpu: LayerNormalization fused. (attention_fusion off: next to the LayerNormalization fusion, with
    # nothing matched between them, the alignment draws the two regions as one: a limit it has.)
    optimize(str(before), output=str(after), target="ort-cpu", disable=["attention_fusion"])
    return onnx.load(before), onnx.load(after)


def test_transformer_block_alignment_agrees_with_provenance(block):
    before, after = block
    b = diff.Graph(before)
    ref = diff.from_provenance(b, diff.Graph(after))
    assert ref["method"] == "provenance"
    # the optimizer did something worth aligning: a fusion of the LayerNorm decomposition at least
    assert max(len(v) for v in ref["pairs"].values()) >= 5, ref["pairs"]
    assert ref["removed"]
    keys = [n.key for n in b.nodes]
    # Without names, a Reshape a rewrite made read a constant shape looks like one whose shape arithmetic
    # was folded first (then the arithmetic is removed; provenance records it with the rewrite): 8 of 60.
    for names, bar in ((True, 0.95), (False, 0.8)):
        m = diff.align(b, diff.Graph(diff.strip_provenance(after)), use_names=names)
        score = diff.agreement(ref, m, keys)
        assert score["ratio"] >= bar, (names, score)
        assert m == diff.align(b, diff.Graph(diff.strip_provenance(after)), use_names=names)  # deterministic


def test_transformer_block_peer_tool(block):
    """onnxslim's output (no provenance) aligns as it was made: the shape arithmetic computed twice
    is merged (common subexpressions), the Add of a zero bias and the Identity are gone, the rest kept."""
    onnxslim = pytest.importorskip("onnxslim")
    before, _ = block
    slim = onnxslim.slim(onnx.ModelProto.FromString(before.SerializeToString()))
    b, a = diff.Graph(before), diff.Graph(slim)
    twins = {"shape": "shape_2", "gather_b": "gather_b_2", "gather_s": "gather_s_2"}
    if any(k in a.by_key for k in twins.values()) or "v/bias" in a.by_key:
        pytest.skip(f"onnxslim {onnxslim.__version__} no longer merges or drops what this test expects")
    expected = {n.key: {n.key} | ({twins[n.key]} if n.key in twins else set()) for n in a.nodes}
    for names in (True, False):
        m = diff.align(b, a, use_names=names)
        assert m["method"] == "alignment"
        assert _sets(m) == expected, names
        assert sorted(m["removed"]) == ["att/identity", "v/bias"]
        assert not m["created"] and not m["changed"]


# --------------------------------------------------------------------------------------------
# A zoo transformer (built without network where not cached)


@pytest.fixture(scope="module")
def zoo_bert(tmp_path_factory):
    spec = zoo.get("bert-legacy")
    if spec.path().exists():
        return spec.path()
    if spec.missing():
        pytest.skip(f"bert-legacy not cached and cannot be built here: needs {', '.join(spec.missing())}")
    path = tmp_path_factory.mktemp("zoo") / "bert-legacy.onnx"
    spec.build(path)
    return path


# The Shape-vector rules (rules/shape_ops.py, issue 29) replace Shape -> Gather -> Unsqueeze chains that many
# Reshapes share: provenance credits each new node with the whole shared chain, the alignment (per node) does
# not, so the two agree less there (0.878 measured); without those rules they agree as before (0.991).
SHAPE_VECTOR_RULES = ["shape_dim_unsqueeze", "shape_dim_reshape", "shape_slice_to_attributes", "shape_concat_merge",
                      "expand_shape_from_input", "range_of_dim"]


@pytest.mark.parametrize("disable, floor", [(SHAPE_VECTOR_RULES, 0.97), ([], 0.85)])
def test_zoo_bert_alignment_agrees_with_provenance(zoo_bert, tmp_path, disable, floor):
    out = tmp_path / "bert.opt.onnx"
    optimize(str(zoo_bert), output=str(out), disable=disable)
    b = diff.Graph(onnx.load(zoo_bert))
    after = onnx.load(out)
    ref = diff.from_provenance(b, diff.Graph(after))
    keys = [n.key for n in b.nodes]
    for names in (True, False):
        score = diff.agreement(ref, diff.align(b, diff.Graph(diff.strip_provenance(after)), use_names=names), keys)
        assert score["ratio"] >= floor, (names, score)
