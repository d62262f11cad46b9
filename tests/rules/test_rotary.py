"""rules/rotary.py: x * cos + rotate_half(x) * sin becomes com.microsoft RotaryEmbedding reading the model's own
per-token cos/sin as its tables (issue 30)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import init, model, shared_zoo_model, tinfo
from onnx import TensorProto, helper

from .check import fires, refuses, run_rule

ort = pytest.importorskip("onnxruntime")

B, N, S, H = 2, 3, 5, 8
TOL = 1e-5


def _feeds(pos_batch=B, seed=0, width=H):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, N, S, width)).astype(np.float32),
            "pos": rng.integers(0, 40, (pos_batch, S)).astype(np.int64)}


def rotary_model(*, split=False, partial=0, pos_batch=B, second=None, table_b=None, rank4=True, dtype=TensorProto.FLOAT,
                 expanded=False, computed_half=False, heads=N):
    """x [B, N, S, H (+ partial)] rotated by the cos/sin of position ids ``pos`` [pos_batch, S] (HF's
    LlamaRotaryEmbedding and apply_rotary_pos_emb, as torch.onnx exports them). ``second``: the second
    operand of the angle Concat (default the first: half-periodic); ``table_b``: the Unsqueeze axis;
    ``expanded``: the angles as transformers 4.x computes them (optimum's exports): ``inv_freq[None, :, None]
    .expand(pos.shape[0], -1, 1) @ pos[:, None, :]``, transposed (the expand's target through torch's
    ``Where(Equal(t, -1), 1, t)``: inference does not know the batch); ``computed_half``: the second half's
    start is ``x.shape[-1] // 2`` computed in the graph (a legacy export's Shape, Gather, Div, Unsqueeze);
    ``heads``: x's head dimension (a name: not known)."""
    h = H
    inv = (1.0 / 10000 ** (np.arange(0, h, 2, dtype=np.float32) / h)).astype(np.float32)
    if expanded:
        nodes = [helper.make_node("Shape", ["pos"], ["pshape"]),
                 helper.make_node("Gather", ["pshape", "i0"], ["pb"], axis=0),
                 helper.make_node("Unsqueeze", ["pb", "ax0"], ["pb1"]),
                 helper.make_node("Concat", ["pb1", "minus1", "one1"], ["t"], axis=0),
                 helper.make_node("Equal", ["t", "minus1x3"], ["is_m1"]),
                 helper.make_node("Where", ["is_m1", "ones3", "t"], ["target"]),
                 helper.make_node("Expand", ["inv3", "target"], ["invb"]),
                 helper.make_node("Unsqueeze", ["pos", "ax1p"], ["p3"]),
                 helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT),
                 helper.make_node("MatMul", ["invb", "pf"], ["Ft"]),
                 helper.make_node("Transpose", ["Ft"], ["F"], perm=[0, 2, 1])]
    else:
        nodes = [helper.make_node("Unsqueeze", ["pos", "ax2"], ["p3"]),
                 helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["pf", "inv"], ["F"])]
    inits = [init("inv", inv), init("ax2", np.array([2], np.int64)), init("ax1", np.array([table_b or 1], np.int64)),
             init("h2", np.array([h // 2], np.int64)), init("zero", np.array([0], np.int64)),
             init("big", np.array([2**62], np.int64)), init("last", np.array([-1], np.int64)),
             init("hw", np.array([h], np.int64)), init("two", np.array(2.0, np.float32))]
    if expanded:
        inits += [init("inv3", inv.reshape(1, -1, 1)), init("i0", np.array(0, np.int64)),
                  init("ax0", np.array([0], np.int64)), init("ax1p", np.array([1], np.int64)),
                  init("minus1", np.array([-1], np.int64)), init("one1", np.array([1], np.int64)),
                  init("minus1x3", np.array([-1, -1, -1], np.int64)), init("ones3", np.array([1, 1, 1], np.int64))]
    other = "F"
    if second == "scaled":
        nodes.append(helper.make_node("Mul", ["F", "two"], ["F2"]))
        other = "F2"
    nodes += [helper.make_node("Concat", ["F", other], ["E"], axis=-1),
              helper.make_node("Cos", ["E"], ["C3"]), helper.make_node("Sin", ["E"], ["S3"]),
              helper.make_node("Unsqueeze", ["C3", "ax1"], ["C4"]), helper.make_node("Unsqueeze", ["S3", "ax1"], ["S4"])]
    x = "x"
    if partial:
        nodes.append(helper.make_node("Slice", ["x", "zero", "hw", "last"], ["xr"]))
        nodes.append(helper.make_node("Slice", ["x", "hw", "big", "last"], ["xp"]))
        x = "xr"
    if split:
        nodes.append(helper.make_node("Split", [x], ["x1", "x2"], axis=-1, num_outputs=2))
    elif computed_half:
        inits += [init("i3", np.array(3, np.int64)), init("two_i", np.array(2, np.int64)),
                  init("ax0h", np.array([0], np.int64))]
        nodes += [helper.make_node("Shape", [x], ["xshape"]), helper.make_node("Gather", ["xshape", "i3"], ["xw"], axis=0),
                  helper.make_node("Div", ["xw", "two_i"], ["xh"]), helper.make_node("Unsqueeze", ["xh", "ax0h"], ["xh1"]),
                  helper.make_node("Slice", [x, "zero", "xh1", "last"], ["x1"]),
                  helper.make_node("Slice", [x, "xh1", "big", "last"], ["x2"])]
    else:
        nodes += [helper.make_node("Slice", [x, "zero", "h2", "last"], ["x1"]),
                  helper.make_node("Slice", [x, "h2", "big", "last"], ["x2"])]
    nodes += [helper.make_node("Neg", ["x2"], ["nx2"]), helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
              helper.make_node("Mul", ["rot", "S4"], ["rs"]), helper.make_node("Mul", [x, "C4"], ["xc"]),
              helper.make_node("Add", ["xc", "rs"], ["y" if not partial else "yr"])]
    if partial:
        nodes.append(helper.make_node("Concat", ["yr", "xp"], ["y"], axis=-1))
    width = h + partial
    shape = ["b", heads, "s", width] if rank4 else ["b", "s", width]
    return model(nodes, [tinfo("x", shape, dtype), tinfo("pos", ["b" if pos_batch == B else 1, "s"], TensorProto.INT64)],
                 [tinfo("y", shape, dtype)], inits, opset=18)


@pytest.mark.parametrize("split", [False, True], ids=["slices", "split"])
def test_rotary_fires_on_slices_and_split(split):
    out, _ = fires("rotary_embedding", rotary_model(split=split), feeds=_feeds(), tol=TOL, target="ort-cpu")
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("RotaryEmbedding") == 1 and "Neg" not in ops and "Sin" in ops  # the model's own sin, as table


def test_halves_computed_from_a_shape_recorded_as_unknown():
    """Phi-3's legacy export: rotate_half's bounds are ``x.shape[-1] // 2`` (Shape, Gather, Div, Unsqueeze), and
    x's recorded shape holds onnx's unknown symbols (left by a Reshape an earlier rewrite made constant): its
    last dimension is read through the node that made it."""
    m = rotary_model()
    nodes = list(m.graph.node)
    for node in nodes:  # x -> xs = Identity(x), recorded [unk__0, unk__1, unk__2, unk__3]
        node.input[:] = ["xs" if i == "x" else i for i in node.input]
    x1, x2 = (n for n in nodes if n.op_type == "Slice")
    x1.input[2], x2.input[1] = "half", "half"
    extra = [helper.make_node("Identity", ["x"], ["xs"]), helper.make_node("Shape", ["xs"], ["xs_shape"]),
             helper.make_node("Gather", ["xs_shape", "three"], ["width"], axis=0),
             helper.make_node("Div", ["width", "two_i"], ["half0"]),
             helper.make_node("Unsqueeze", ["half0", "zero"], ["half"])]
    del m.graph.node[:]
    m.graph.node.extend(extra + nodes)
    m.graph.initializer.extend([init("three", np.array(3, np.int64)), init("two_i", np.array(2, np.int64))])
    m.graph.value_info.append(tinfo("xs", [f"unk__{k}" for k in range(4)]))
    out, _ = fires("rotary_embedding", m, feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert [n.op_type for n in out.graph.node].count("RotaryEmbedding") == 1


def test_partial_rotary_takes_the_whole_head_with_its_rotary_dim():
    out, _ = fires("rotary_embedding", rotary_model(partial=4), feeds=_feeds(width=H + 4), tol=TOL, target="ort-cpu")
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["rotary_embedding_dim"] == H and node.input[0] == "x"


def test_positions_shared_by_the_batch_use_the_offset_form():
    """cos/sin of [1, S] positions (HF without position_ids: cache_position.unsqueeze(0)): a table of S rows and
    position_ids = [0]."""
    out, _ = fires("rotary_embedding", rotary_model(pos_batch=1), feeds=_feeds(pos_batch=1), tol=TOL,
                   target="ort-cuda")
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    offset = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert onnx.numpy_helper.to_array(offset).tolist() == [0]


def test_the_tables_are_built_once_for_q_and_k():
    m = rotary_model()
    g = m.graph
    # a second rotated value (k) reading the same cos/sin
    shared = ("C4", "S4", "h2", "zero", "big", "last")
    for n in list(g.node)[-7:]:  # the two Slices, Neg, Concat, the two Muls and the Add, on k
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = ["k" if i == "x" else i if i in shared else i + "_k" for i in n.input]
        c.output[:] = ["yk" if o == "y" else o + "_k" for o in n.output]
        g.node.append(c)
    g.input.append(tinfo("k", ["b", N, "s", H]))
    g.output.append(tinfo("yk", ["b", N, "s", H]))
    feeds = {**_feeds(), "k": np.random.default_rng(5).standard_normal((B, N, S, H)).astype(np.float32)}
    out, _ = fires("rotary_embedding", m, times=2, feeds=feeds, tol=TOL, target="ort-cuda")
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and ops.count("CumSum") == 1 and ops.count("Reshape") == 4


def test_angles_of_an_expanded_inv_freq_fire():
    """transformers 4.x (optimum's exports): the angles' batch is Expand(inv_freq, [Shape(pos)[0], -1, 1]) through
    torch's Where(Equal(t, -1), 1, t), MatMul'd with the positions: read through, it is the positions' batch."""
    out, _ = fires("rotary_embedding", rotary_model(expanded=True), feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert [n.op_type for n in out.graph.node].count("RotaryEmbedding") == 1


def test_halves_at_a_computed_bound_fire():
    """The second half starting at x.shape[-1] // 2 computed in the graph (Shape, Gather, Div, Unsqueeze)."""
    out, _ = fires("rotary_embedding", rotary_model(computed_half=True), feeds=_feeds(), tol=TOL, target="ort-cpu")
    assert [n.op_type for n in out.graph.node].count("RotaryEmbedding") == 1


def test_partial_rotary_of_an_unknown_head_count_is_refused():
    """onnxruntime's RotaryEmbedding needs num_heads with rotary_embedding_dim (its kernel refuses the model
    otherwise)."""
    refuses("rotary_embedding", rotary_model(partial=4, heads="n"), "head count is not known",
            feeds=_feeds(width=H + 4), target="ort-cpu")


def test_partial_rotary_reads_the_head_count_of_a_view_with_minus_one():
    """x = Transpose(Reshape(x3, [x3.shape[0], x3.shape[1], -1, head])) (transformers' view(*input_shape, -1,
    head_dim)): the -1 is x3's size over the others, their symbols cancelling: num_heads is N."""
    m = rotary_model(partial=4, heads="n")
    g = m.graph
    width = H + 4
    g.input[0].CopyFrom(tinfo("x3", ["b", "s", N * width]))
    g.initializer.extend([init("i0s", np.array(0, np.int64)), init("i1s", np.array(1, np.int64)),
                          init("ax0s", np.array([0], np.int64)), init("m1", np.array([-1], np.int64)),
                          init("head", np.array([width], np.int64))])
    view = [helper.make_node("Shape", ["x3"], ["x3s"]),
            helper.make_node("Gather", ["x3s", "i0s"], ["d0"], axis=0), helper.make_node("Gather", ["x3s", "i1s"], ["d1"], axis=0),
            helper.make_node("Unsqueeze", ["d0", "ax0s"], ["d0u"]), helper.make_node("Unsqueeze", ["d1", "ax0s"], ["d1u"]),
            helper.make_node("Concat", ["d0u", "d1u", "m1", "head"], ["tgt"], axis=0),
            helper.make_node("Reshape", ["x3", "tgt"], ["x4"]), helper.make_node("Transpose", ["x4"], ["x"], perm=[0, 2, 1, 3])]
    nodes = view + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    rng = np.random.default_rng(0)
    feeds = {"x3": rng.standard_normal((B, S, N * width)).astype(np.float32),
             "pos": rng.integers(0, 40, (B, S)).astype(np.int64)}
    out, _ = fires("rotary_embedding", m, feeds=feeds, tol=TOL, target="ort-cpu")
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_heads"] == N and attrs["rotary_embedding_dim"] == H


def test_not_half_periodic_is_refused():
    refuses("rotary_embedding", rotary_model(second="scaled"), "not half-periodic", feeds=_feeds(),
            target="ort-cpu")


def test_cos_not_an_unsqueeze_of_a_table_is_refused():
    m = rotary_model()
    nodes = list(m.graph.node)
    k = next(i for i, n in enumerate(nodes) if n.op_type == "Unsqueeze" and n.input[0] == "C3")
    nodes[k].output[0] = "C4u"
    nodes.insert(k + 1, helper.make_node("Identity", ["C4u"], ["C4"]))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    refuses("rotary_embedding", m, "not an Unsqueeze", feeds=_feeds(), target="ort-cpu")


def test_interleaved_halves_are_not_matched():
    m = rotary_model()
    g = m.graph
    g.initializer.extend([init("one", np.array([1], np.int64)), init("step2", np.array([2], np.int64))])
    for n in g.node:
        if n.op_type == "Slice" and n.output[0] == "x2":
            n.input[:] = ["x", "one", "big", "last", "step2"]
        if n.op_type == "Slice" and n.output[0] == "x1":
            n.input[:] = ["x", "zero", "big", "last", "step2"]
    refuses("rotary_embedding", m, "second half", feeds=_feeds(), target="ort-cpu")


def test_rank_3_input_is_refused():
    refuses("rotary_embedding", rotary_model(rank4=False), "not 4", feeds={
        "x": np.random.default_rng(0).standard_normal((B, S, H)).astype(np.float32),
        "pos": np.random.default_rng(1).integers(0, 40, (B, S)).astype(np.int64)}, target="ort-cpu")


@pytest.mark.parametrize("name", ["llama-kv-legacy", "qwen3-prefill-legacy", "phi3-kv-dynamo"])
def test_zoo_decoders_rotate_every_q_and_k(name):
    """The exports' halves are sliced by bounds the other rules fold first: the whole optimization."""
    pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")
    from onnxopt import optimize
    from onnxopt.models import zoo

    path = shared_zoo_model(name)
    feeds = zoo.get(name).inputs(path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    for target in ("ort-cpu", "ort-cuda"):
        out, report = optimize(onnx.load(str(path)), target=target, return_report=True)
        assert report.fusions["rotary_embedding"]["hits"] == 4, report.fusions["rotary_embedding"]
        assert sum(n.op_type == "Neg" for n in out.graph.node) == 0
        got = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        for x, y in zip(ref, got):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_dim_through_reads_past_unknown_symbols():
    """dim_through: a dimension recorded as onnx's unknown is read through Transpose, Reshape (0 copies, -1 what
    the others leave), Slice and a broadcasting MatMul; a named symbol is kept; what no node says stays unknown."""
    import onnx_ir as ir

    from onnxopt.rules._attention_parts import dim_through

    nodes = [helper.make_node("Slice", ["x", "zero", "s64", "last"], ["xs"]),  # [b, s, 64]
             helper.make_node("Reshape", ["xs", "split"], ["x4"]),  # [b, s, 4, 16]
             helper.make_node("Transpose", ["x4"], ["xt"], perm=[0, 2, 1, 3]),  # [b, 4, s, 16]
             helper.make_node("MatMul", ["xt", "w"], ["y"])]  # [b, 4, s, 3]
    inits = [init("zero", np.array([0], np.int64)), init("s64", np.array([64], np.int64)),
             init("last", np.array([-1], np.int64)), init("split", np.array([0, 0, -1, 16], np.int64)),
             init("w", np.zeros((1, 1, 16, 3), np.float32))]
    proto = model(nodes, [tinfo("x", ["b", "s", 128])], [tinfo("y", [f"unk__{k}" for k in range(4)])], inits, opset=18)
    for name in ("xs", "x4", "xt"):
        proto.graph.value_info.append(tinfo(name, [f"unk__{name}{k}" for k in range(3 if name == "xs" else 4)]))
    g = ir.serde.deserialize_model(proto).graph
    y = g.outputs[0]
    opsets = {"": 18}
    assert [str(dim_through(y, k, opsets)) for k in range(4)] == ["b", "4", "s", "3"]
    assert dim_through(y, 1, opsets) == 4 and dim_through(y, -1, opsets) == 3
