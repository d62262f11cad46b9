"""rules/embedding.py: word + position (+ segment) embeddings and their LayerNormalization (or an
earlier rule's SkipLayerNormalization of two of them) become com.microsoft EmbedLayerNormalization.

Synthetic BERT embeddings (position ids as HF's sliced buffer, as Range/Unsqueeze/Expand, or a
position_ids input; with and without the segment embedding; the Adds in every association) fire
and give onnxruntime CPU's outputs before and after within fp32 rounding on inputs the outputs
depend on; each refusal names its reason; the zoo's BERT and MiniLM (both exporters) fuse their one
embedding LayerNormalization under --target ort-cuda (and ort-cpu) with the same outputs on padded
batches, and no node of the fusion runs on the CPU under the CUDA provider."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import run_ort
from helpers import init, model, tinfo
from onnx import TensorProto, helper

from onnxopt import optimize
from onnxopt.rules._embedding_parts import NO_POSITION, NOT_A_TABLE, NOT_ARANGE
from onnxopt.targets.advice import cuda_placement

from . import zoo_cases
from .check import fires, mismatches, refuses, run_rule
from .zoo_cases import every_fusion  # noqa: F401 (a fixture)

RULE, SKIP_RULE = "embed_layer_normalization", "embed_layer_normalization_skip"
CPU = {"target": "ort-cpu"}
TOL = 1e-5
V, P, T, H = 16, 12, 3, 8
RNG = np.random.default_rng(0)
WORD = RNG.standard_normal((V, H)).astype(np.float32)
POS = RNG.standard_normal((P, H)).astype(np.float32)
SEG = RNG.standard_normal((T, H)).astype(np.float32)
GAMMA = RNG.uniform(0.5, 1.5, H).astype(np.float32)
BETA = RNG.standard_normal(H).astype(np.float32)
I64 = TensorProto.INT64


def n(op, ins, out, **kw):
    outs = out if isinstance(out, list) else [out]
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **kw)


def positions(form: str, buffer=None, start=0) -> tuple[list, dict]:
    """Nodes making ``pos`` (the position ids) from ``input_ids``' sequence length, and their constants."""
    if form == "input":
        return [], {}
    shape = [n("Shape", ["input_ids"], "ids_shape"), n("Gather", ["ids_shape", "one"], "seq", axis=0)]
    consts = {"one": np.array(1, np.int64)}
    if form == "slice":  # the legacy export: Slice(buffer[1, P], [0], Unsqueeze(S), axes [1])
        consts.update(buffer=np.arange(P, dtype=np.int64)[None] if buffer is None else buffer,
                      zero1=np.array([0], np.int64), ax0=np.array([0], np.int64), ax1=np.array([1], np.int64))
        return shape + [n("Unsqueeze", ["seq", "ax0"], "end"),
                        n("Slice", ["buffer", "zero1", "end", "ax1"], "pos")], consts
    if form.startswith("cumsum"):  # rules/shape_ops.py's range_of_dim form: CumSum(ConstantOfShape([S], 1))
        exclusive = 0 if form == "cumsum-inclusive" else 1
        consts.update(ax0=np.array([0], np.int64), axis=np.array(0, np.int64))
        return [n("Shape", ["input_ids"], "seq1", start=1, end=2),
                helper.make_node("ConstantOfShape", ["seq1"], ["ones"], name="ones",
                                 value=helper.make_tensor("v", I64, [1], [1])),
                n("CumSum", ["ones", "axis"], "r", exclusive=exclusive), n("Unsqueeze", ["r", "ax0"], "pos")], consts
    consts.update(start=np.array(start, np.int64), delta=np.array(1, np.int64), ax0=np.array([0], np.int64))
    return shape + [n("Range", ["start", "seq", "delta"], "r"), n("Unsqueeze", ["r", "ax0"], "ru"),
                    n("Expand", ["ru", "ids_shape"], "pos")], consts


def embeddings(order="(w+t)+p", form="slice", *, word=WORD, pos_table=POS, seg=SEG, dtype=TensorProto.FLOAT,
               shape=("batch", "seq"), ids_type=I64, sum_output=False, root="ln", **pos_kw) -> onnx.ModelProto:
    """A BERT embedding layer: the Gathers summed in ``order`` ('w', 'p', 't': word, position,
    token type) and normalized (``root``: 'ln', or 'skip': a SkipLayerNormalization of the last
    Add's operands)."""
    nodes, consts = positions(form, **pos_kw)
    pos_ids = "position_ids" if form == "input" else "pos"
    nodes += [n("Gather", ["word", "input_ids"], "w"), n("Gather", ["pos_table", pos_ids], "p")]
    if "t" in order:
        nodes.append(n("Gather", ["seg", "token_type_ids"], "t"))
    last = {"(w+t)+p": (("w", "t"), "p"), "(w+p)+t": (("w", "p"), "t"), "t+(p+w)": ("t", ("p", "w")),
            "w+p": ("w", "p"), "p+w": ("p", "w")}[order]
    names = []
    for k, operand in enumerate(last):
        if isinstance(operand, tuple):
            nodes.append(n("Add", list(operand), f"inner{k}"))
            names.append(f"inner{k}")
        else:
            names.append(operand)
    if root == "skip":
        nodes.append(helper.make_node("SkipLayerNormalization", [*names, "gamma", "beta"], ["y", "", "", "sum"]
                                      if sum_output else ["y"], domain="com.microsoft", epsilon=1e-12))
    else:
        nodes += [n("Add", names, "sum"), n("LayerNormalization", ["sum", "gamma", "beta"], "y", axis=-1,
                                             epsilon=1e-12)]
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    consts.update(word=word.astype(np_dtype) if word is not None else None, pos_table=pos_table.astype(np_dtype),
                  gamma=GAMMA.astype(np_dtype), beta=BETA.astype(np_dtype))
    if "t" in order:
        consts["seg"] = seg.astype(np_dtype)
    inputs = [tinfo("input_ids", list(shape), ids_type)]
    if "t" in order:
        inputs.append(tinfo("token_type_ids", list(shape), ids_type))
    if form == "input":
        inputs.append(tinfo("position_ids", list(shape), I64))
    if word is None:  # (the word table an input)
        inputs.append(tinfo("word", [V, H], dtype))
        del consts["word"]
    outputs = [tinfo("y", [*shape, H], dtype)] + ([tinfo("sum", [*shape, H], dtype)] if sum_output else [])
    m = model(nodes, inputs, outputs, [init(k, v) for k, v in consts.items()])
    if root == "skip":
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def feeds(m: onnx.ModelProto, batch=2, seq=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    names = {i.name for i in m.graph.input}
    out = {"input_ids": rng.integers(0, V - 2, (batch, seq))}
    if "token_type_ids" in names:
        out["token_type_ids"] = rng.integers(0, T - 1, (batch, seq))
    if "position_ids" in names:
        out["position_ids"] = rng.integers(0, P - 2, (batch, seq))
    if "word" in names:
        out["word"] = WORD
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in m.graph.input}
    return {k: v.astype(types[k]) for k, v in out.items()}


def ops(m: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in m.graph.node)


def embed_node(m: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [x for x in m.graph.node if x.op_type == "EmbedLayerNormalization"]
    return node


# --- fires ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["slice", "range", "input", "cumsum"])
@pytest.mark.parametrize("order", ["(w+t)+p", "(w+p)+t", "t+(p+w)", "w+p", "p+w"])
def test_fires(order, form):
    m = embeddings(order, form)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=TOL, **CPU)
    counts = ops(out)
    assert counts["EmbedLayerNormalization"] == 1 and counts["LayerNormalization"] == 0
    assert not {"Add", "Gather", "Slice", "Range", "Expand"} & set(counts), counts  # the position ids went too
    node = embed_node(out)
    assert node.domain == "com.microsoft"
    assert node.input[2] == "word" and node.input[3] == "pos_table"
    assert node.input[4] == ("seg" if "t" in order else "")
    assert list(node.input[8:]) == (["position_ids_int32"] if form == "input" else [])
    assert helper.get_attribute_value(node.attribute[0]) == pytest.approx(1e-12)
    casts = {x.output[0]: x.input[0] for x in out.graph.node if x.op_type == "Cast"}
    assert casts["input_ids_int32"] == "input_ids" and node.input[0] == "input_ids_int32"
    fires(RULE, m, feeds=feeds(m, batch=3, seq=7, seed=1), tol=TOL, **CPU)  # another shape


def test_fires_int32_ids_without_cast():
    m = embeddings(ids_type=TensorProto.INT32)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=TOL, **CPU)
    assert "Cast" not in ops(out) and embed_node(out).input[0] == "input_ids"


def test_sum_read_elsewhere_is_output_2():
    m = embeddings(sum_output=True)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=TOL, **CPU)
    node = embed_node(out)
    assert len(node.output) == 3 and node.output[2] == "sum"


def test_existing_int32_cast_is_shared():
    m = embeddings()
    m.graph.node.insert(0, n("Cast", ["input_ids"], "ids32", to=TensorProto.INT32))
    m.graph.output.append(tinfo("ids32", ["batch", "seq"], TensorProto.INT32))
    out, _ = fires(RULE, m, feeds=feeds(m), tol=TOL, **CPU)
    assert ops(out)["Cast"] == 2 and embed_node(out).input[0] == "ids32"


def test_fires_fixed_shapes():
    m = embeddings(shape=(2, 5))
    fires(RULE, m, feeds=feeds(m), tol=TOL, **CPU)


def folded(order="(w+t)+p", rows=5, shape=(2, 5), root="ln") -> onnx.ModelProto:
    """At fixed shapes the position Gather folds to a constant: its table's first S rows, [1, S, H]."""
    m = embeddings(order, shape=shape, root=root)
    keep = [x for x in m.graph.node if x.output[0] not in ("ids_shape", "seq", "end", "pos", "p")]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    m.graph.initializer.append(init("p", POS[None, :rows]))
    return m


@pytest.mark.parametrize("root,rule", [("ln", RULE), ("skip", SKIP_RULE)])
def test_fires_position_embedding_folded(root, rule):
    m = folded(root=root)
    out, _ = fires(rule, m, feeds=feeds(m), tol=TOL, **CPU)
    node = embed_node(out)
    table = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}[node.input[3]]
    assert table.shape == (5, H) and np.array_equal(table, POS[:5])


def test_refuses_folded_positions_of_another_length():
    m = folded(rows=1)  # [1, 1, H]: one row broadcast over every position (a bias, not positions)
    refuses(RULE, m, "is not [1, S, H] with S the input ids' static sequence length", feeds=feeds(m), **CPU)


@pytest.mark.parametrize("order", ["(w+t)+p", "(w+p)+t", "t+(p+w)", "w+p"])
def test_skip_root_fires(order):
    """Where skip_layer_normalization made the last Add a SkipLayerNormalization first (its input
    the full [batch, S, H] operand, the skip the other)."""
    m = embeddings(order, root="skip", sum_output=order == "(w+t)+p")
    out, _ = fires(SKIP_RULE, m, feeds=feeds(m), tol=TOL, **CPU)
    counts = ops(out)
    assert counts["EmbedLayerNormalization"] == 1 and "SkipLayerNormalization" not in counts
    assert len(embed_node(out).output) == (3 if order == "(w+t)+p" else 2)


def test_skip_root_refuses_offset_positions():
    """The SkipLayerNormalization root gives the same reasons as the LayerNormalization one (here: a Range
    that does not count from 0)."""
    _, report = run_rule(SKIP_RULE, embeddings("(w+t)+p", form="range", root="skip", start=1), **CPU)
    assert any("the Range does not count from 0 by 1" in r for r in report.rules[SKIP_RULE].reasons), \
        dict(report.rules[SKIP_RULE].reasons)


def test_skip_layer_normalization_does_not_take_it_first():
    """With both rules, the LayerNormalization root (priority 5) fires before skip_layer_normalization."""
    from onnxopt.library.registry import builtin_rules
    from onnxopt.targets import benefit

    rules = {r.name: r for r in builtin_rules()}
    m = embeddings("(w+t)+p", shape=(2, 5))
    with benefit.using(None):
        out, report = optimize(m, rules=[rules["skip_layer_normalization"], rules[RULE], rules[SKIP_RULE]],
                               return_report=True, **CPU)
    assert report.rules[RULE].fired == 1 and report.rules["skip_layer_normalization"].fired == 0
    assert ops(out)["EmbedLayerNormalization"] == 1


def test_cuda_fp16_fires():
    m = embeddings(dtype=TensorProto.FLOAT16)
    out, report = run_rule(RULE, m, target="ort-cuda")
    assert report.rules[RULE].fired == 1 and ops(out)["EmbedLayerNormalization"] == 1


# --- refuses --------------------------------------------------------------------------------------

def test_refuses_fp16_on_cpu():
    m = embeddings(dtype=TensorProto.FLOAT16)
    refuses(RULE, m, "no EmbedLayerNormalization kernel for float16 on ort-cpu", feeds=feeds(m), **CPU)


def test_refuses_bfloat16_on_cuda():
    """No bfloat16 kernel on CUDA (onnxruntime's OperatorKernels.md: float, float16); only the reason
    is checked (no bfloat16 LayerNormalization to run it on the CPU)."""
    _, report = run_rule(RULE, embeddings(dtype=TensorProto.BFLOAT16), target="ort-cuda")
    assert any("no EmbedLayerNormalization kernel for bfloat16 on ort-cuda" in r
               for r in report.rules[RULE].reasons), dict(report.rules[RULE].reasons)


def test_refuses_offset_positions():
    """RoBERTa counts positions from padding_idx + 1."""
    m = embeddings(buffer=np.arange(2, P + 2, dtype=np.int64)[None] % P)
    refuses(RULE, m, "position ids are not 0..S-1 (the sliced buffer is not 0, 1, 2, ... (an offset))",
            feeds=feeds(m), **CPU)


def test_refuses_slice_of_the_buffers_batch_axis():
    """Slice(buffer[1, P], [0], [S]) without axes slices axis 0 (size 1): all P positions stay (the model
    runs where S = P)."""
    m = embeddings(shape=(2, P))
    for node in m.graph.node:
        if node.op_type == "Slice":
            del node.input[3:]
    f = feeds(m, seq=P)
    refuses(RULE, m, "the Slice does not start at 0 along the buffer with step 1", feeds=f, **CPU)


def test_refuses_cumsum_that_is_not_an_arange():
    """CumSum of ones counted inclusively is 1..S, not 0..S-1 (shape_ops' range_of_dim writes exclusive=1)."""
    _, report = run_rule(RULE, embeddings(form="cumsum-inclusive"), **CPU)
    assert any("the CumSum does not count int64 ones from 0" in r for r in report.rules[RULE].reasons), \
        dict(report.rules[RULE].reasons)


def test_refuses_range_not_from_zero():
    """Range(1, S): S - 1 positions, which the Expand to [batch, S] refuses at run time (only the reason
    is checked)."""
    _, report = run_rule(RULE, embeddings(form="range", start=1), **CPU)
    assert any("the Range does not count from 0 by 1" in r for r in report.rules[RULE].reasons), \
        dict(report.rules[RULE].reasons)


def test_refuses_computed_positions():
    """Position ids computed otherwise (here the buffer slice + 1) are not proven 0..S-1."""
    m = embeddings("w+p")
    for node in m.graph.node:
        if node.op_type == "Slice":
            node.output[0] = "pos0"
    m.graph.node.append(n("Add", ["pos0", "one"], "pos"))
    m = _toposorted(m)
    refuses(RULE, m, "position ids are not 0..S-1 (nor a graph input)", feeds=feeds(m), **CPU)


def test_refuses_positions_computed_from_the_ids():
    """RoBERTa's form: the position ids are computed from the ids (here ids * 0 + 2): neither 0..S-1 nor
    a graph input (not passed as the segment's either, though the kernel would sum them alike)."""
    m = embeddings("(w+t)+p", form="input")
    m.graph.input.pop()  # (no position_ids input: computed)
    m.graph.node.insert(0, n("Mul", ["input_ids", "zero"], "z"))
    m.graph.node.insert(1, n("Add", ["z", "two"], "position_ids"))
    m.graph.initializer.extend([init("zero", np.array(0, np.int64)), init("two", np.array(2, np.int64))])
    refuses(RULE, m, "position ids are not 0..S-1 (nor a graph input)", feeds=feeds(m), **CPU)


def test_mismatches_positions_neither_arange_nor_input():
    """Word ids cast from int32 and position ids the buffer slice + 1: no Gather of the sum has ids
    0..S-1 or a graph input."""
    m = embeddings("w+p", ids_type=TensorProto.INT32)
    for node in m.graph.node:
        if node.op_type == "Slice":
            node.output[0] = "pos0"
        if node.op_type == "Gather" and node.input[0] == "word":
            node.input[1] = "ids64"
    m.graph.node.extend([n("Add", ["pos0", "one"], "pos"), n("Cast", ["input_ids"], "ids64", to=I64)])
    m = _toposorted(m)
    mismatches(RULE, m, NOT_ARANGE, feeds=feeds(m), **CPU)


def test_mismatches_gather_on_another_axis():
    """Gather(word, ids, axis=1) takes columns: no embedding (a square table, so that every width agrees)."""
    m = embeddings("w+p", word=WORD[:H].T.copy())  # ids index the columns
    for node in m.graph.node:
        if node.op_type == "Gather" and node.input[0] == "word":
            node.attribute.append(helper.make_attribute("axis", 1))
    f = {"input_ids": (np.arange(H)[None] % 5).astype(np.int64)}  # ([H, 1, S] + [1, S, H]: S = H)
    _, report = mismatches(RULE, m, "", feeds=f, depends=False, **CPU)
    assert report.rules[RULE].tried == 1


def test_mismatches_no_position_embedding():
    """The word embedding and a float input: no second embedding."""
    nodes = [n("Gather", ["word", "input_ids"], "w"), n("Add", ["w", "x"], "sum"),
             n("LayerNormalization", ["sum", "gamma", "beta"], "y", axis=-1)]
    m = model(nodes, [tinfo("input_ids", ["batch", "seq"], I64), tinfo("x", ["batch", "seq", H])],
              [tinfo("y", ["batch", "seq", H])], [init("word", WORD), init("gamma", GAMMA), init("beta", BETA)])
    f = feeds(m)
    f["x"] = RNG.standard_normal((2, 5, H)).astype(np.float32)
    mismatches(RULE, m, NO_POSITION, feeds=f, **CPU)


def test_mismatches_table_not_constant():
    m = embeddings(word=None)
    mismatches(RULE, m, NOT_A_TABLE, feeds=feeds(m), **CPU)


def test_refuses_table_not_2d():
    m = embeddings("w+p", word=WORD[:, None, :])
    m.graph.output[0].CopyFrom(tinfo("y", 4))
    refuses(RULE, m, "the word table is not 2-D", feeds=feeds(m), **CPU)


def test_refuses_widths_differ():
    m = embeddings(word=WORD[:, :1])  # (the Add broadcasts it)
    refuses(RULE, m, "the tables' widths differ (word 1, position 8, segment 8)", feeds=feeds(m), **CPU)


def test_refuses_position_table_shorter_than_sequence():
    """Fixed at S = 10 with 6 position rows: the model itself fails at run time (Gather out of
    range), so only the refusal is checked."""
    m = embeddings(shape=(2, 10), pos_table=POS[:6])
    _, report = run_rule(RULE, m, **CPU)
    st = report.rules[RULE]
    assert st.fired == 0 and any("the position table has 6 rows, fewer than the sequence length 10" in r
                                 for r in st.reasons), dict(st.reasons)


def test_refuses_ids_not_int():
    """int16 ids (no Gather takes them: the refusal is a guard; only the reason is checked)."""
    m = embeddings("w+p", ids_type=TensorProto.INT16)
    _, report = run_rule(RULE, m, **CPU)
    assert any("the input ids are not int32/int64" in r for r in report.rules[RULE].reasons), \
        dict(report.rules[RULE].reasons)


def test_refuses_sequence_not_proven():
    """The buffer is sliced to another input's length."""
    m = embeddings()
    m.graph.input.append(tinfo("other", ["batch", "len"], I64))
    for node in m.graph.node:
        if node.op_type == "Shape":
            node.input[0] = "other"
    f = feeds(m)
    f["other"] = np.zeros((2, 5), np.int64)
    refuses(RULE, m, "the Slice's end is not proven the input ids' sequence length", feeds=f, depends=False, **CPU)


def test_refuses_segment_of_another_shape():
    m = embeddings()
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "one"
    refuses(RULE, m, "the segment ids are not proven of the input ids' shape", feeds=feeds(m), **CPU)


def _toposorted(m: onnx.ModelProto) -> onnx.ModelProto:
    done = {i.name for i in m.graph.input} | {i.name for i in m.graph.initializer} | {""}
    left, order = list(m.graph.node), []
    while left:
        for node in left:
            if all(i in done for i in node.input):
                order.append(node)
                done.update(node.output)
                left.remove(node)
                break
    del m.graph.node[:]
    m.graph.node.extend(order)
    return m


# --- the zoo --------------------------------------------------------------------------------------

# GPT-2's ln_1 normalizes wte + wpe, whose sum the residual reads too (output 2); the dynamo export's
# positions are Range(0, S), the legacy export's read S from Shape of the word embedding (below)
ENCODERS = ["bert-legacy", "bert-dynamo", "minilm-legacy", "minilm-dynamo", "gpt2-dynamo"]


def _padded(name, proto, batch, seq):
    f = zoo_cases.feeds(name, proto, batch, seq)
    assert len(set(f["attention_mask"].sum(1).tolist())) > 1 or batch == 1
    return f


# MiniLM (6 layers, real weights) takes 5 s a run: one target each exporter, the 4-layer models take both
ZOO_CASES = [(n, t) for n in ENCODERS for t in ("ort-cuda", "ort-cpu")
             if not (n == "minilm-legacy" and t == "ort-cuda") and not (n == "minilm-dynamo" and t == "ort-cpu")]


@pytest.mark.parametrize("name, target", ZOO_CASES)
def test_zoo(name, target, every_fusion):  # noqa: F811
    src = zoo_cases.load(name)
    out, report = optimize(src, target=target, return_report=True)
    fired = report.rules[RULE].fired + report.rules[SKIP_RULE].fired
    counts = collections.Counter(f"{x.domain}:{x.op_type}" for x in out.graph.node)
    assert fired == 1 and counts["com.microsoft:EmbedLayerNormalization"] == 1, counts
    assert counts[":LayerNormalization"] == 0  # the embeddings' was the one left unfused on the legacy exports
    assert len(embed_node(out).output) == (3 if name.startswith("gpt2") else 2)  # GPT-2's residual reads the sum
    zoo_cases.assert_close(name, src, out)
    fixed = optimize(src, target=target, input_shapes={i.name: [2, 16] for i in src.graph.input})
    assert collections.Counter(x.op_type for x in fixed.graph.node)["EmbedLayerNormalization"] == 1
    for a, b in zip(run_ort(src, _padded(name, src, 2, 16)), run_ort(fixed, _padded(name, src, 2, 16)), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))
    if target == "ort-cuda":  # nothing of the fusion on the CPU under the CUDA provider
        placed = cuda_placement(ir.from_proto(out))
        assert not {"com.microsoft.EmbedLayerNormalization", "Cast"} & set(placed["by_op"]), placed["by_op"]


def test_zoo_gpt2_legacy_misses_where_the_positions_read_the_word_embeddings_shape(every_fusion):  # noqa: F811
    """The legacy GPT-2 export takes S for Range(0, S) from Shape of the word embedding's output: that
    Gather has a second reader, so it is not the rule's to replace (left as it was, with the reason)."""
    src = zoo_cases.load("gpt2-legacy")
    out, report = optimize(src, target="ort-cpu", return_report=True)
    assert report.rules[RULE].fired + report.rules[SKIP_RULE].fired == 0
    assert any("has 2 uses" in r for r in report.rules[RULE].reasons), dict(report.rules[RULE].reasons)
    assert "EmbedLayerNormalization" not in {x.op_type for x in out.graph.node}
