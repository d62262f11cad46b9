"""rules/attention.py: scaled dot-product attention -> com.microsoft Attention / MultiHeadAttention.

Small onnx-helper models cover each form the rule reads (packed QKV through a Split as GPT-2's
c_attn, three projections of one input as BERT, cross-attention into MultiHeadAttention; the key
transposed 4-D, as [B,S,N,D] -> [B,N,D,S], or through 3-D as the dynamo exporter does; scales on
Q and K or on the scores; additive masks [B,1,S,S] and [B,1,1,S] (expanded), Where(mask, 0, -inf);
torch's NaN guard after Softmax; the output flattened further for a Gemm) and each refusal with its
reason. Then the zoo's bert/gpt2/minilm from both exporters: every layer fused (count == layers),
onnxruntime CPU gives the original's outputs on padded batches (rows with different
attention-mask lengths), relative to each output's largest magnitude within 1e-4, with dynamic
shapes and with fixed input_shapes.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_ort
from helpers import init, model
from helpers import tinfo as _tinfo
from onnx import TensorProto, helper

import onnx_ir as ir

from onnxopt import optimize
from onnxopt.rules.attention import standard_attention_runs

from .check import fires, refuses

B, S, T, N, D = 3, 5, 4, 2, 8
H = N * D
RULE = "attention_fusion"
CPU = {"target": "ort-cpu"}


def attention_model(*, proj="bert", key="bnds", scale="qk", mask="bias4", guard=True, out="merge",
                    softmax_axis=-1, mask_then_scale=False, q_heads="nd", dtype=TensorProto.FLOAT, seed=0,
                    static=False, opset=17, pre=None, fill=None):
    """One attention block on x [b, s, H] (and y [b, t, H] for proj="cross"); ``static``: the
    inputs' dimensions are numbers (B, S, T)."""
    rng = np.random.default_rng(seed)
    sizes = {"b": B, "s": S, "t": T}

    def tinfo(name, shape, dt):
        return _tinfo(name, [sizes.get(d, d) for d in shape] if static and not isinstance(shape, int) else shape, dt)

    npd = helper.tensor_dtype_to_np_dtype(dtype)
    nodes, inits = [], []
    inputs = [tinfo("x", ["b", "s", H], dtype)]

    def c(name, value, dt=None):
        inits.append(init(name, np.asarray(value, dtype=dt or np.int64)))
        return name

    def w(name, shape):
        inits.append(init(name, (rng.standard_normal(shape) * 0.3).astype(npd)))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    src = "x"
    if pre == "skip_layer_norm":  # a contrib op before the projections: onnx's shape inference knows it not
        inputs.append(tinfo("skip", ["b", "s", H], dtype))
        nodes.append(helper.make_node("SkipLayerNormalization", ["x", "skip", w("gamma", (H,)), w("beta", (H,))],
                                      ["xn"], domain="com.microsoft", epsilon=1e-5))
        src = "xn"
    if proj in ("gpt2", "gpt2-two-splits"):
        node("MatMul", [src, w("w_qkv", (H, 3 * H))], "qkv_mm")
        node("Add", ["qkv_mm", w("b_qkv", (3 * H,))], "qkv")
        if proj == "gpt2":
            nodes.append(helper.make_node("Split", ["qkv", c("split", [H, H, H])], ["q", "k", "v"], axis=2))
        else:  # the dynamo export: Q from one Split, K and V from another of the same value
            nodes.append(helper.make_node("Split", ["qkv", c("split", [H, H, H])], ["q", "q_k", "q_v"], axis=2))
            nodes.append(helper.make_node("Split", ["qkv", "split"], ["k_q", "k", "v"], axis=2))
    else:
        kv_src = src
        if proj == "cross":
            inputs.append(tinfo("y", ["b", "t", H], dtype))
            kv_src = "y"
        for name, x in (("q", src), ("k", kv_src), ("v", kv_src)):
            node("MatMul", [x, w(f"w_{name}", (H, H))], f"{name}_mm")
            node("Add", [f"{name}_mm", w(f"b_{name}", (H,))], name)
    heads = c("heads", [0, 0, N, -1])
    if q_heads == "nd":
        node("Reshape", ["q", heads], "q_r")
        node("Transpose", ["q_r"], "q4", perm=[0, 2, 1, 3])
    else:  # heads split the wrong way round: [B, S, D, N] taken as [B, N, S, D]
        node("Reshape", ["q", c("heads_dn", [0, 0, D, -1])], "q_r")
        node("Transpose", ["q_r"], "q4", perm=[0, 3, 1, 2])
    node("Reshape", ["k", heads], "k_r")
    if key == "bnds":
        node("Transpose", ["k_r"], "kt", perm=[0, 2, 3, 1])
    elif key == "t4":
        node("Transpose", ["k_r"], "k4", perm=[0, 2, 1, 3])
        node("Transpose", ["k4"], "kt", perm=[0, 1, 3, 2])
    else:  # "3d": the dynamo exporter's [B,N,T,D] -> [B*N,T,D] -> [B*N,D,T] -> [B,N,D,T]
        node("Transpose", ["k_r"], "k4", perm=[0, 2, 1, 3])
        node("Shape", ["k4"], "k4_lead", start=0, end=2)
        node("Shape", ["k4"], "k4_t", start=2, end=3)
        node("Concat", [c("m1", [-1]), "k4_t", c("dd", [D])], "k3_shape", axis=0)
        node("Reshape", ["k4", "k3_shape"], "k3")
        node("Transpose", ["k3"], "k3t", perm=[0, 2, 1])
        node("Concat", ["k4_lead", c("dd2", [D]), "k4_t"], "kt_shape", axis=0)
        node("Reshape", ["k3t", "kt_shape"], "kt")
    node("Reshape", ["v", heads], "v_r")
    node("Transpose", ["v_r"], "v4", perm=[0, 2, 1, 3])
    q, k = "q4", "kt"
    if scale == "qk":
        f = c("qk_scale", D ** -0.25, npd)
        q, k = node("Mul", [q, f], "q_s"), node("Mul", [k, f], "k_s")
    scores = node("MatMul", [q, k], "scores")
    if scale == "div":
        scores = node("Div", [scores, c("sqrt_d", D ** 0.5, npd)], "scores_s")
    feeds_mask = {}
    t_dim = "t" if proj == "cross" else "s"
    if mask is not None:
        if mask == "bias4":
            inputs.append(tinfo("mask", ["b", 1, "s", t_dim], dtype))
            m = "mask"
        elif mask == "pad":
            inputs.append(tinfo("mask", ["b", 1, 1, t_dim], dtype))
            m = "mask"
        elif mask == "rank2":
            inputs.append(tinfo("mask", ["s", t_dim], dtype))
            m = "mask"
        elif mask in PADDING_FORMS:  # made from a 2-D key-padding mask attention_mask [b, t] (int64)
            inputs.append(tinfo("attention_mask", ["b", t_dim], TensorProto.INT64))
            m = _padding_mask(node, c, mask, dtype, fill)
        else:  # "where": Where(keep, 0, -inf) of a bool mask
            inputs.append(tinfo("keep", ["b", 1, "s", t_dim], TensorProto.BOOL))
            m = node("Where", ["keep", c("zero", 0.0, npd), c("ninf", -np.inf, npd)], "mask_add")
        scores = node("Add", [scores, m], "scores_m")
        if mask_then_scale:
            scores = node("Mul", [scores, c("late", 0.5, npd)], "scores_late")
    probs = node("Softmax", [scores], "probs", axis=softmax_axis)
    if guard:
        node("IsNaN", [probs], "nan")
        probs = node("Where", ["nan", c("zero_p", 0.0, npd), probs], "probs_g")
    node("MatMul", [probs, "v4"], "o4")
    if out == "merge":
        node("Transpose", ["o4"], "o_t", perm=[0, 2, 1, 3])
        node("Reshape", ["o_t", c("merged", [0, 0, H])], "o")
    elif out == "flat":
        node("Transpose", ["o4"], "o_t", perm=[0, 2, 1, 3])
        node("Reshape", ["o_t", c("flat", [-1, H])], "o")
    else:  # "wrong": heads and head size swapped in the merge
        node("Transpose", ["o4"], "o_t", perm=[0, 2, 3, 1])
        node("Reshape", ["o_t", c("merged", [0, 0, H])], "o")
    node("MatMul", ["o", w("w_o", (H, H))], "y_out")
    m = model(nodes, inputs, [_tinfo("y_out", 2 if out == "flat" else 3, dtype)], inits, opset=opset)
    if pre is not None:
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    m.ir_version = max(m.ir_version, 11 if opset >= 23 else 0)
    return m


# the exporters' key-padding masks, made from attention_mask [b, t]: transformers 4 eager
# (1 - m[:, None, None, :]) * fill, its sdpa masked_fill form, transformers 5's Flatten/Gather (legacy
# exporter) and GatherND (dynamo) forms, with the causal factor t <= s; "t5-transposed" gathers
# element t*B + b (not [b, t]); "computed" reads a mask computed from x, not a graph input
PADDING_FORMS = ("t4", "t4-sdpa", "t5", "t5-causal", "gathernd", "gathernd-causal", "t5-transposed", "computed")


def _padding_mask(node, c, form, dtype, fill):
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    m = "attention_mask"
    if form == "computed":  # the mask a graph computes from x: not a graph input's
        node("ReduceMax", ["x"], "x_top", axes=[-1], keepdims=0)
        m = node("Cast", [node("Greater", ["x_top", c("thr", -0.5, npd)], "x_keep")], "x_mask", to=TensorProto.INT64)
        form = "t4"
    if form == "t4":
        u = node("Unsqueeze", [m, c("ax12", [1, 2])], "m_u")
        inv = node("Sub", [c("one", 1.0, npd), node("Cast", [u], "m_f", to=dtype)], "m_inv")
        return node("Mul", [inv, c("fill", -10000.0 if fill is None else fill, npd)], "mask_add")
    if form == "t4-sdpa":
        u = node("Unsqueeze", [m, c("ax12", [1, 2])], "m_u")
        node("Shape", [m], "m_b", start=0, end=1)
        node("Shape", [m], "m_t", start=1, end=2)
        node("Shape", ["x"], "x_s", start=1, end=2)
        node("Concat", ["m_b", c("one_i", [1]), "x_s", "m_t"], "m_shape", axis=0)
        f = node("Cast", [node("Expand", [u, "m_shape"], "m_e")], "m_f", to=dtype)
        inv = node("Sub", [c("one", 1.0, npd), f], "m_inv")
        fill_c = c("fill", float(np.finfo(npd).min) if fill is None else fill, npd)
        return node("Where", [node("Cast", [inv], "m_invb", to=TensorProto.BOOL), fill_c, inv], "mask_add")
    # transformers 5: index ranges over batch, keys and queries
    node("Shape", [m], "m_shape")
    node("Shape", ["x"], "x_shape")
    nb = node("Gather", ["m_shape", c("i0", 0)], "n_b", axis=0)
    nt = node("Gather", ["m_shape", c("i1", 1)], "n_t", axis=0)
    ns = node("Gather", ["x_shape", "i1"], "n_s", axis=0)
    rb = node("Unsqueeze", [node("Range", [c("r0", 0), nb, c("r1", 1)], "r_b"), c("ax123", [1, 2, 3])], "b4")
    rt = node("Unsqueeze", [node("Range", ["r0", nt, "r1"], "r_t"), c("ax012", [0, 1, 2])], "t4")
    rs = node("Unsqueeze", [node("Range", ["r0", ns, "r1"], "r_s"), c("ax013", [0, 1, 3])], "s4")
    mb = node("Cast", [m], "m_bool", to=TensorProto.BOOL)
    if form.startswith("gathernd"):
        shape = node("Shape", [node("Max", [rb, rt], "bt")], "bt_shape")
        eb = node("Unsqueeze", [node("Expand", [rb, shape], "b_e"), c("axm1", [-1])], "b_u")
        et = node("Unsqueeze", [node("Expand", [rt, shape], "t_e"), "axm1"], "t_u")
        kept = node("GatherND", [mb, node("Concat", [eb, et], "bt_idx", axis=-1)], "kept")
    else:
        if form == "t5-transposed":  # t * B + b: the flat index of [t, b], not [b, t]
            idx = node("Add", [rb, node("Mul", [rt, nb], "t_n")], "idx")
        else:
            idx = node("Add", [rt, node("Mul", [rb, nt], "b_n")], "idx")
        flat = node("Flatten", [mb], "m_flat", axis=2)
        g = node("Gather", [flat, idx], "m_g", axis=0)
        node("Shape", [idx], "idx_shape")
        kept = node("Reshape", [node("Reshape", [g, c("m1_", [-1])], "m_g1"), "idx_shape"], "kept")
    if form.endswith("causal"):
        rows = node("LessOrEqual", [rt, rs], "causal")
    else:
        rows = node("GreaterOrEqual", [rs, c("zero_i", 0)], "rows")
    keep = node("And", [rows, kept], "keep_bt")
    node("Concat", [node("Unsqueeze", [nb, c("ax0", [0])], "nb1"), c("one_i", [1]),
                    node("Unsqueeze", [ns, "ax0"], "ns1"), node("Unsqueeze", [nt, "ax0"], "nt1")], "keep_shape",
         axis=0)
    expanded = node("Expand", [keep, "keep_shape"], "keep_e")
    fill_c = c("fill", -np.inf if fill is None else fill, npd)
    return node("Where", [expanded, c("zero", 0.0, npd), fill_c], "mask_add")


def feeds(m: onnx.ModelProto, seed=0) -> dict:
    """x (and y) normal; masks that keep a prefix of each row's keys (right padding: every row keeps
    at least its first key)."""
    rng = np.random.default_rng(seed)
    names = {vi.name: vi for vi in m.graph.input}
    dtype = helper.tensor_dtype_to_np_dtype(names["x"].type.tensor_type.elem_type)
    out = {"x": rng.standard_normal((B, S, H)).astype(dtype)}
    if "skip" in names:
        out["skip"] = rng.standard_normal((B, S, H)).astype(dtype)
    t = S
    if "y" in names:
        out["y"] = rng.standard_normal((B, T, H)).astype(dtype)
        t = T
    lengths = np.array([t] + [max(1, t - 1 - i) for i in range(B - 1)])
    keep = np.arange(t)[None, :] < lengths[:, None]  # [B, t]
    if "keep" in names:
        out["keep"] = np.broadcast_to(keep[:, None, None, :], (B, 1, S, t)).copy()
    if "attention_mask" in names:
        out["attention_mask"] = keep.astype(np.int64)
    if "mask" in names:
        rank = len(names["mask"].type.tensor_type.shape.dim)
        bias = np.where(keep, 0.0, -1e9).astype(dtype)
        if rank == 2:
            out["mask"] = np.where(np.tril(np.ones((S, t), bool)), 0.0, -1e9).astype(dtype)
        elif names["mask"].type.tensor_type.shape.dim[2].dim_value == 1:
            out["mask"] = bias[:, None, None, :]
        else:
            out["mask"] = (np.broadcast_to(bias[:, None, None, :], (B, 1, S, t))
                           + rng.standard_normal((B, 1, S, t)) * 0.1).astype(dtype)
    return out


def fused(m: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in m.graph.node
                   if n.domain == "com.microsoft" and n.op_type in ("Attention", "MultiHeadAttention"))


FORMS = [
    dict(proj="bert"),
    dict(proj="gpt2", mask="where"),
    dict(proj="cross", mask="pad", guard=False),
    dict(proj="bert", key="t4", scale="div", mask=None),
    dict(proj="gpt2", key="3d", mask="pad"),
    dict(proj="gpt2-two-splits", mask="where", guard=False),
    dict(proj="gpt2", mask="where", pre="skip_layer_norm"),
    dict(proj="bert", mask="bias4", pre="skip_layer_norm"),
    dict(proj="bert", key="3d", scale="none", out="flat"),
]


@pytest.mark.parametrize("form", FORMS, ids=["-".join(f"{v}" for v in f.values()) for f in FORMS])
def test_fires(form):
    m = attention_model(**form)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    want = "MultiHeadAttention" if form["proj"] == "cross" else "Attention"
    assert fused(out) == Counter({want: 1})
    assert "Softmax" not in {n.op_type for n in out.graph.node}


def test_the_fusion_replaces_the_head_merge_and_absorbs_what_lies_under_it():
    """The pattern (rules/_attention_parts.py) matches the whole block; the rewrite claims its ends,
    the head merge's Reshape and Transpose (onnxopt.replaced), and what lies under them goes with it
    (onnxopt.sources): the provenance the rule wrote when its condition did the walking."""
    import json

    from onnxopt.ir.util import REPLACED_KEY, SOURCES_KEY

    m = attention_model(proj="bert")
    for n in m.graph.node:
        n.name = n.output[0]
    out = optimize(m, **CPU)
    [node] = [n for n in out.graph.node if n.op_type == "Attention"]
    meta = {p.key: p.value for p in node.metadata_props}
    assert node.name.startswith("o::attention_fusion")
    assert json.loads(meta[REPLACED_KEY]) == ["o", "o_t"]
    sources = json.loads(meta[SOURCES_KEY])
    assert sources[:2] == ["o", "o_t"]
    assert {"o4", "probs", "scores", "q_r", "k_r", "v_r", "q_mm", "k_mm", "v_mm"} <= set(sources)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rows_with_every_key_masked_stay_zero(static):
    """Left padding with a causal -inf mask: the first query of a padded row sees no key. torch's
    NaN guard makes its output 0; the fused ops alone would give NaN there (and the next layer would
    spread it to every row): the fusion keeps the guard's zeros."""
    m = attention_model(proj="gpt2", mask="where", static=static)
    f = feeds(m)
    causal = np.tril(np.ones((S, S), bool))
    lengths = [S, S - 2, 1]
    keys = np.arange(S)[None, :] >= (S - np.array(lengths))[:, None]  # left padding
    f["keep"] = (causal[None] & keys[:, None, :])[:, None]
    assert not f["keep"].any(-1).all(), "some query must see no key"
    out, _ = fires(RULE, m, feeds=f, tol=1e-4, **CPU)
    y = run_ort(out, f)[0]
    assert np.isfinite(y).all()


def test_mask_is_expanded_only_where_its_shape_is_unproven():
    m = attention_model(mask="pad", static=True)  # [B, 1, 1, S]: onnxruntime wants [B, 1, S, S]
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    assert "Expand" in {n.op_type for n in out.graph.node}
    m = attention_model(mask="bias4", static=True)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    assert "Expand" not in {n.op_type for n in out.graph.node}


@pytest.mark.parametrize("form", [dict(proj="bert"), dict(proj="cross", mask="pad", static=True)],
                         ids=["self", "cross"])
def test_standard_attention_at_opset_23(form):
    """A model at opset 23 gets the standard Attention where the installed onnxruntime runs it."""
    if not standard_attention_runs("ort-cpu", ir.DataType.FLOAT):
        pytest.skip("the installed onnxruntime has no CPU kernel for the standard Attention")
    m = attention_model(opset=23, **form)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    assert not fused(out)
    assert [n.op_type for n in out.graph.node if n.domain in ("", "ai.onnx")].count("Attention") == 1


def test_not_for_portable():
    m = attention_model()
    out = optimize(m, target="portable")
    assert not fused(out)


REFUSALS = [
    (dict(softmax_axis=2), "Softmax is not over the last axis"),
    (dict(mask_then_scale=True), "the mask is added before a scale"),
    (dict(q_heads="dn"), "Q does not reach the MatMul"),
    (dict(out="wrong"), "the attention output is not merged"),
    (dict(mask="rank2"), "the mask has rank 2"),
    (dict(dtype=TensorProto.DOUBLE), "has no fused kernel on ort-cpu"),
]


@pytest.mark.parametrize("form,reason", REFUSALS, ids=[r for _, r in REFUSALS])
def test_refuses(form, reason):
    m = attention_model(**form)
    refuses(RULE, m, reason, feeds=feeds(m), **CPU)


def _with_scale(m: onnx.ModelProto, **values) -> onnx.ModelProto:
    """``m`` with its scale constants (qk_scale, sqrt_d) set to ``values``."""
    for i in m.graph.initializer:
        if i.name in values:
            i.CopyFrom(onnx.numpy_helper.from_array(np.array(values[i.name], np.float32), i.name))
    return m


UNDERFLOWS = [
    (dict(qk_scale=1e-25), dict(), "rounds to 0 in float32"),  # 1e-50: scale=0 would mean 1/sqrt(D)
    (dict(qk_scale=1e-20), dict(), "is subnormal in float32"),  # 1e-40
    (dict(sqrt_d=3e38), dict(scale="div"), "is subnormal in float32"),  # scores / 3e38: 3.3e-39
    (dict(qk_scale=1e20), dict(), "is inf or NaN in float32"),  # 1e40
]


@pytest.mark.parametrize("values,form,reason", UNDERFLOWS, ids=[r + str(v) for v, _, r in UNDERFLOWS])
def test_refuses_a_scale_float32_cannot_hold(values, form, reason):
    """Issue 27: the product of the scales is the fused op's float32 ``scale``; where it rounds to 0
    (onnxruntime then uses 1/sqrt(head_size): the output moved by 1.7x its largest value), to a
    subnormal or to inf, the fusion is refused with the reason."""
    m = _with_scale(attention_model(mask=None, guard=False, **form), **values)
    overflow = "inf" in reason  # (the original's scores overflow: its outputs are NaN at every input)
    refuses(RULE, m, reason, feeds=feeds(m), depends=not overflow, **CPU)


def test_refuses_a_scale_float16_cannot_hold_in_a_float16_model():
    """fp16 on ort-cuda: 1e-3 on Q and on K is 1e-6, below float16's smallest normal (6.1e-5)."""
    m = attention_model(mask=None, guard=False, dtype=TensorProto.FLOAT16)
    for i in m.graph.initializer:
        if i.name == "qk_scale":
            i.CopyFrom(onnx.numpy_helper.from_array(np.array(1e-3, np.float16), i.name))
    refuses(RULE, m, "is subnormal in float16", feeds=feeds(m), target="ort-cuda")


def test_tiny_scale_that_float32_holds_fuses():
    """1e-18 on Q and on K: 1e-36 is a normal float32, the fused op gives the original's outputs."""
    m = _with_scale(attention_model(mask=None, guard=False), qk_scale=1e-18)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    scale = [a.f for n in out.graph.node if n.domain == "com.microsoft" for a in n.attribute if a.name == "scale"]
    assert scale == [pytest.approx(1e-36, rel=1e-6)]


# --------------------------------------------------------------------------------------------
# The zoo's transformers

ZOO = Path(os.environ.get("ONNXOPT_CACHE", Path.home() / ".cache" / "onnxopt")) / "models"
LAYERS = {"bert": 4, "gpt2": 4, "minilm": 6}
VOCAB = {"bert": 8192, "gpt2": 8192, "minilm": 30522}
CASES = [(k, e) for k in LAYERS for e in ("legacy", "dynamo")]


def _zoo(kind, exporter) -> Path:
    path = ZOO / f"{kind}-{exporter}.onnx"
    if not path.exists():
        pytest.skip(f"{path.name} is not in the zoo cache (python -m onnxopt.models build --only {path.stem})")
    return path


def _padded(kind, proto, batch, seq, seed=0):
    from onnxopt.models import inputs

    feeds = inputs.text_inputs(batch, seq, VOCAB[kind], pad_id=VOCAB[kind] - 1 if kind == "gpt2" else 0)(proto, seed)
    lengths = feeds["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1, "the batch must have rows of different lengths"
    return feeds


def _same(src: Path, out: onnx.ModelProto, feeds, rtol=1e-4):
    a = run_ort(onnx.load(str(src)), feeds)
    b = run_ort(out, feeds)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        assert float(np.abs(x - y).max()) <= rtol * max(float(np.abs(x).max()), 1e-30)


@pytest.mark.parametrize("kind,exporter", CASES, ids=[f"{k}-{e}" for k, e in CASES])
def test_zoo_fused_dynamic(kind, exporter):
    src = _zoo(kind, exporter)
    proto = onnx.load(str(src), load_external_data=False)
    out, report = optimize(proto, target="ort-cpu", return_report=True)
    assert report.fired.get(RULE, 0) == LAYERS[kind]
    assert fused(out)["Attention"] == LAYERS[kind]
    assert "Softmax" not in {n.op_type for n in out.graph.node}
    # nothing of the unfused attention stays alive: the MatMuls/Gemms left are the layers' three others
    # (attention output, feed-forward in and out) and GPT-2's language-model head or BERT's pooler
    assert sum(n.op_type in ("MatMul", "Gemm") for n in out.graph.node) == 3 * LAYERS[kind] + 1
    # the mask reduced once: every layer reads one int32 Cast of the 2-D attention_mask
    layers = _attention_nodes(out)
    assert {_note(n) for n in layers} == {"mask_index"} and len({n.input[3] for n in layers}) == 1
    assert [n.output[0] for n in out.graph.node if "attention_mask" in n.input and n.op_type == "Cast"
            and _attrs(n)["to"] == TensorProto.INT32] == [layers[0].input[3]]
    if kind == "gpt2":  # the Conv1D Gemms (attention's c_proj too) are all MatMuls
        assert "Gemm" not in {n.op_type for n in out.graph.node}
    for batch, seq in ((3, 16), (2, 7)):
        _same(src, out, _padded(kind, proto, batch, seq))


@pytest.mark.parametrize("kind,exporter", [("gpt2", "legacy"), ("bert", "dynamo"), ("minilm", "legacy")])
def test_zoo_fused_fixed_shapes(kind, exporter):
    src = _zoo(kind, exporter)
    proto = onnx.load(str(src), load_external_data=False)
    names = [vi.name for vi in proto.graph.input]
    out, report = optimize(proto, target="ort-cpu", return_report=True, input_shapes={n: [2, 16] for n in names})
    assert report.fired.get(RULE, 0) == LAYERS[kind]
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == LAYERS[kind] and ops["Expand"] == 0  # the mask's shape is proven at fixed shapes
    # the exporter's index arithmetic folded into constants is still read as key padding
    assert {_note(n) for n in _attention_nodes(out)} == {"mask_index"}
    _same(src, out, _padded(kind, proto, 2, 16))


# --------------------------------------------------------------------------------------------
# Exports with each attention implementation (built here, small configs; the legacy exporter)

SMALL = {
    "bert": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                 max_position_embeddings=128, type_vocab_size=2),
    "gpt2": dict(vocab_size=1024, n_embd=128, n_layer=2, n_head=4, n_positions=128, bos_token_id=1023,
                 eos_token_id=1023),
    "llama": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def _export(kind: str, attn: str, path: Path) -> Path:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from onnxopt.models import inputs, transformers_models as tm

    tf = tm.import_transformers()
    torch.manual_seed(0)
    if kind == "bert":
        module = tf.BertModel(tf.BertConfig(**SMALL[kind], attn_implementation=attn))
    elif kind == "gpt2":
        module = tf.GPT2LMHeadModel(tf.GPT2Config(**SMALL[kind], use_cache=False, attn_implementation=attn))
    else:
        module = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL[kind], use_cache=False, attn_implementation=attn))
    module.config.use_cache = False
    assert module.config._attn_implementation == attn
    wrapped = tm.wrap("bert" if kind == "bert" else "gpt2", module.eval())
    names = list(tm.INPUT_NAMES["bert" if kind == "bert" else "gpt2"])
    feeds = inputs.text_feeds(names, 2, 16, 1024)
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tracer warnings of every export)
        torch.onnx.export(wrapped, args, str(path), dynamo=False, opset_version=17, input_names=names,
                          dynamic_axes=axes)
    return path


@pytest.mark.parametrize("kind,attn", [("bert", "sdpa"), ("gpt2", "sdpa"), ("gpt2", "eager")])
def test_exports_by_attention_implementation(tmp_path, kind, attn):
    src = _export(kind, attn, tmp_path / f"{kind}-{attn}.onnx")
    proto = onnx.load(str(src))
    out, report = optimize(proto, target="ort-cpu", return_report=True)
    assert report.fired.get(RULE, 0) == 2 and fused(out)["Attention"] == 2
    from onnxopt.models import inputs

    feeds = inputs.text_inputs(3, 16, 1024, pad_id=1023 if kind == "gpt2" else 0)(proto, 0)
    _same(src, out, feeds)


def test_llama_rotary_attention_is_refused_with_its_reason(tmp_path):
    """Not fused yet: rotary embeddings sit between the heads' split and the scores' MatMul (and the
    keys are repeated for grouped-query attention); the report says so."""
    src = _export("llama", "sdpa", tmp_path / "llama.onnx")
    out, report = optimize(onnx.load(str(src)), target="ort-cpu", return_report=True)
    assert report.fired.get(RULE, 0) == 0
    assert any("Q is not a reshape of a projection into heads" in r for r in report.rules[RULE].reasons)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_zoo_gpt2_left_padding(exporter):
    """Batched generation pads on the left: a padded row's first queries see no key. The fused model
    gives the original's outputs there too (no NaN spreading from those rows)."""
    src = _zoo("gpt2", exporter)
    proto = onnx.load(str(src), load_external_data=False)
    out = optimize(proto, target="ort-cpu")
    feeds = _padded("gpt2", proto, 3, 16)
    mask = feeds["attention_mask"]
    feeds["attention_mask"] = np.ascontiguousarray(mask[:, ::-1])  # the same lengths, padded on the left
    feeds["input_ids"] = np.ascontiguousarray(feeds["input_ids"][:, ::-1])
    assert np.isfinite(run_ort(out, feeds)[0]).all()
    _same(src, out, feeds)


# --------------------------------------------------------------------------------------------
# Key-padding masks of a 2-D graph input: read element by element, reduced once for all layers

from onnxopt.rules.attention import MASK_KEY  # noqa: E402


def two_layers(m: onnx.ModelProto) -> onnx.ModelProto:
    """The block twice: the second reads the first's output as x, both the one attention_mask."""
    import copy

    g = m.graph
    shared = {vi.name for vi in g.input if vi.name != "x"}

    def name(n):
        return n if n in shared or n == "" else "y_out" if n == "x" else f"l2_{n}"

    nodes = []
    for n in g.node:
        n2 = copy.deepcopy(n)
        n2.input[:] = [name(i) for i in n.input]
        n2.output[:] = [name(o) for o in n.output]
        nodes.append(n2)
    inits = []
    for t in g.initializer:
        t2 = copy.deepcopy(t)
        t2.name = name(t.name)
        inits.append(t2)
    out = copy.deepcopy(m)
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(inits)
    del out.graph.output[:]
    out.graph.output.append(_tinfo("l2_y_out", 3, g.output[0].type.tensor_type.elem_type))
    return out


def _padded_feeds(m, left: bool, empty: bool = False) -> dict:
    """Rows of different lengths, padded on the right or the left; ``empty``: one row masks every key."""
    f = feeds(m)
    lengths = [S, S - 2, 0 if empty else 1]
    keep = np.arange(S)[None, :] < np.array(lengths)[:, None]
    f["attention_mask"] = (keep[:, ::-1] if left else keep).astype(np.int64).copy()
    return f


def _attention_nodes(out: onnx.ModelProto):
    return [n for n in out.graph.node
            if n.domain == "com.microsoft" and n.op_type in ("Attention", "MultiHeadAttention")]


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _note(node) -> str:
    return {p.key: p.value for p in node.metadata_props}[MASK_KEY]


KEY_PADDING = [("t4", False), ("t4-sdpa", False), ("t5", False), ("t5-causal", True), ("gathernd", False),
               ("gathernd-causal", True)]


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("form,causal", KEY_PADDING, ids=[f for f, _ in KEY_PADDING])
def test_key_padding_mask_is_given_raw_once_on_cpu(form, causal, left):
    """ort-cpu: each exporter's form is read as key padding (+ causal): every layer's Attention reads
    one int32 Cast of attention_mask as mask_index (no attention_bias), unidirectional=1 exactly where
    causal; outputs as the original's with rows padded on the right and on the left."""
    m = two_layers(attention_model(proj="gpt2" if causal else "bert", mask=form))
    out, _ = fires(RULE, m, times=2, feeds=_padded_feeds(m, left), tol=1e-4, **CPU)
    layers = _attention_nodes(out)
    assert len(layers) == 2
    assert {n.input[3] for n in layers} != {""} and len({n.input[3] for n in layers}) == 1
    casts = [n for n in out.graph.node if n.op_type == "Cast" and n.input[0] == "attention_mask"
             and _attrs(n)["to"] == TensorProto.INT32]
    assert len(casts) == 1 and casts[0].output[0] == layers[0].input[3] == "attention_mask_int32"
    for n in layers:
        assert len(n.input) == 4  # no attention_bias
        assert _attrs(n).get("unidirectional", 0) == int(causal)
        assert _note(n) == "mask_index"


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("form,causal", KEY_PADDING, ids=[f for f, _ in KEY_PADDING])
def test_key_padding_mask_becomes_one_bias_without_shape_arithmetic_on_cuda(form, causal, left):
    """ort-cuda (the lead's CUDA probe: the raw mask is not exact there for causal rows with no key):
    one attention_bias [B,1,T,T] built from attention_mask by data ops, read by every layer; no
    Shape, Concat or Expand left of the mask; unidirectional never set."""
    from onnxopt.targets.advice import cuda_placement

    m = two_layers(attention_model(proj="gpt2" if causal else "bert", mask=form))
    out, _ = fires(RULE, m, times=2, feeds=_padded_feeds(m, left), tol=1e-4, target="ort-cuda")
    layers = _attention_nodes(out)
    assert len({n.input[5] for n in layers}) == 1 and layers[0].input[3] == ""
    assert all(_note(n) == "attention_bias from the 2-D mask" and "unidirectional" not in _attrs(n) for n in layers)
    # what the mask's bias is made of: no node on the way reads a shape
    producers = {o: n for n in out.graph.node for o in n.output}
    seen, todo = set(), [layers[0].input[5]]
    while todo:
        n = producers.get(todo.pop())
        if n is not None and id(n) not in seen:
            seen.add(id(n))
            assert n.op_type not in ("Shape", "Concat", "Expand", "Gather", "Range"), n.op_type
            todo.extend(n.input)
    assert cuda_placement(ir.from_proto(out))["cpu_nodes"] == 0


def test_the_guard_keeps_rows_with_no_key_zero_with_a_key_padding_mask():
    """sdpa's NaN guard with a -inf fill: a row whose every key is masked gives 0 (the original's
    guard), through one factor computed from the 2-D mask (no per-layer Reshape)."""
    m = two_layers(attention_model(proj="bert", mask="t5"))
    f = _padded_feeds(m, left=False, empty=True)
    for target in ("ort-cpu", "ort-cuda"):
        out, _ = fires(RULE, m, times=2, feeds=f, tol=1e-4, target=target)
        y = run_ort(out, f)[0]
        assert np.isfinite(y).all()
        ops = Counter(n.op_type for n in out.graph.node)
        assert ops["Reshape"] == 0 and ops["ReduceMax"] == 1 and ops["Mul"] >= 2


@pytest.mark.parametrize("fill,want", [(-10000.0, None), (-1e9, -1e9), (float(np.finfo(np.float32).min),
                                                                       float(np.finfo(np.float32).min))])
def test_mask_filter_value_is_the_fill(fill, want):
    m = attention_model(proj="bert", mask="t4", fill=fill)
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    [node] = _attention_nodes(out)
    got = _attrs(node).get("mask_filter_value")
    assert got == (None if want is None else pytest.approx(want, rel=1e-6))


def test_minus_inf_fill_is_the_lowest_float_as_mask_filter_value():
    m = attention_model(proj="bert", mask="t5")
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    [node] = _attention_nodes(out)
    assert _attrs(node)["mask_filter_value"] == pytest.approx(float(np.finfo(np.float32).min), rel=1e-6)


def test_a_transposed_index_is_not_read_as_key_padding():
    """Flatten + Gather at t*B + b addresses [t, b] of the mask: not key padding; the fusion keeps the
    additive attention_bias and says why."""
    m = attention_model(proj="bert", mask="t5-transposed")
    f = feeds(m)
    f["attention_mask"] = np.ones((B, S), np.int64)  # (square in the sense of the Gather: in range)
    f["attention_mask"][1, 3:] = 0
    from onnxopt.rules._attention_parts import read_key_padding

    mi = ir.from_proto(m)
    where = next(n for n in mi.graph if n.op_type == "Where" and n.outputs[0].name == "mask_add")
    assert "does not address [b, t]" in read_key_padding(where.inputs[0], {"": 17})
    out = optimize(m, **CPU)
    [node] = _attention_nodes(out)
    assert node.input[3] == "" and node.input[5] != ""
    assert _note(node) == "attention_bias: the mask's index arithmetic does not address [b, t]"


def test_a_mask_not_from_a_graph_input_keeps_attention_bias():
    m = attention_model(proj="bert", mask="computed")
    out, _ = fires(RULE, m, feeds=feeds(m), tol=1e-4, **CPU)
    [node] = _attention_nodes(out)
    assert node.input[5] != "" and (len(node.input) < 4 or node.input[3] == "")
    assert _note(node).startswith("attention_bias: the mask is computed with")


def test_cross_attention_takes_the_key_padding_mask_as_key_padding_mask():
    """MultiHeadAttention (Q of x, K and V of y): the 2-D mask is its key_padding_mask (input 4)."""
    m = attention_model(proj="cross", mask="t4", guard=False)
    f = feeds(m)
    out, _ = fires(RULE, m, feeds=f, tol=1e-4, **CPU)
    [node] = _attention_nodes(out)
    assert node.op_type == "MultiHeadAttention" and node.input[4] == "attention_mask_int32"
    assert _note(node) == "key_padding_mask"


@pytest.mark.parametrize("kind,exporter", CASES, ids=[f"{k}-{e}" for k, e in CASES])
def test_zoo_mask_once_on_cuda(kind, exporter):
    """ort-cuda: every layer reads one attention_bias built from attention_mask by data ops (the
    static CUDA placement estimate puts no node of the mask or of the attention on the CPU); the
    outputs (onnxruntime CPU, the contrib ops' CPU kernels) are the original's with rows padded on
    the right and on the left."""
    from onnxopt.targets.advice import cuda_placement

    src = _zoo(kind, exporter)
    proto = onnx.load(str(src), load_external_data=False)
    out, report = optimize(proto, target="ort-cuda", return_report=True)
    layers = _attention_nodes(out)
    assert len(layers) == LAYERS[kind] and report.fired.get(RULE, 0) == LAYERS[kind]
    assert {_note(n) for n in layers} == {"attention_bias from the 2-D mask"}
    assert len({n.input[5] for n in layers}) == 1
    if kind == "gpt2":
        assert "Gemm" not in {n.op_type for n in out.graph.node}
    # nothing that depends on attention_mask's values is placed on the CPU (its shape: the position
    # ids' arithmetic, another fusion's)
    readers, mask_side = {}, {"attention_mask"}
    for n in out.graph.node:
        if n.op_type != "Shape" and any(i in mask_side for i in n.input):
            mask_side.update(n.output)
            readers[n.name] = n
    placed = cuda_placement(ir.from_proto(out), examples=1000)
    assert not [e for e in placed["examples"] if e["node"] in readers]
    feeds = _padded(kind, proto, 3, 16)
    _same(src, out, feeds)
    feeds["attention_mask"] = np.ascontiguousarray(feeds["attention_mask"][:, ::-1])  # left padding
    feeds["input_ids"] = np.ascontiguousarray(feeds["input_ids"][:, ::-1])
    _same(src, out, feeds)


@pytest.mark.parametrize("kind,exporter", [("bert", "legacy"), ("bert", "dynamo"), ("gpt2", "dynamo")])
def test_zoo_fixed_batch_of_one_reads_key_padding(kind, exporter):
    """At input_shapes [1, 16] the mask's index arithmetic is folded into constants (b is 0): still
    read as key padding; the dynamo export's heads, whose batch of 1 shape rules drop and put back
    (Reshape to [S, N, D], Transpose, Unsqueeze), still fuse; outputs the original's."""
    src = _zoo(kind, exporter)
    proto = onnx.load(str(src), load_external_data=False)
    out = optimize(proto, target="ort-cpu", input_shapes={i.name: [1, 16] for i in proto.graph.input})
    assert len(_attention_nodes(out)) == LAYERS[kind]
    assert {_note(n) for n in _attention_nodes(out)} == {"mask_index"}
    feeds = _padded(kind, proto, 2, 16)
    feeds = {k: v[1:] for k, v in feeds.items()}  # (the shorter row: padded)
    assert feeds["attention_mask"].sum() < 16
    _same(src, out, feeds)


def test_a_mask_that_is_not_key_padding_is_expanded_once_for_all_layers():
    """An additive [B,1,1,S] graph-input mask (not a 2-D key-padding mask): each layer's Expand reads
    S from the graph input carrying its symbol, so the layers build the same Expand and one is left."""
    m = two_layers(attention_model(proj="bert", mask="pad"))
    out = optimize(m, **CPU)
    layers = _attention_nodes(out)
    assert len(layers) == 2 and len({n.input[5] for n in layers}) == 1
    assert Counter(n.op_type for n in out.graph.node)["Expand"] == 1
    assert _note(layers[0]) == "attention_bias: the mask is not Where(keep, 0, fill) nor (1 - keep) * fill"
    f = feeds(m)
    for x, y in zip(run_ort(m, f), run_ort(out, f), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)
