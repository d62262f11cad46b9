"""rules/group_query_attention.py: a decoder's attention (rotated heads, a Concat(past, new) cache or none,
repeat_kv or torch's grouped sdpa form, any additive mask) becomes com.microsoft GroupQueryAttention with the
model's own mask as attention_bias (causal=0), and the present Concat becomes the op's output (issue 30)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import init, shared_zoo_model
from onnx import TensorProto, helper

from .check import RULES

ort = pytest.importorskip("onnxruntime")

G, R, D, P = 2, 2, 8, 5  # key/value heads, query heads per key/value head, head size, past length
N = G * R


def _fused(model, feeds, tol=(1e-4, 1e-5)):
    """optimize with the two rules alone (whatever the benefit table says), and the outputs on ``feeds``."""
    from onnxopt import optimize
    from onnxopt.targets import benefit

    with benefit.using(None):
        out = optimize(model, rules=[RULES["group_query_attention"], RULES["group_query_attention_present"]],
                       graph_passes=(), target="ort-cpu")
    onnx.checker.check_model(out)
    ref, got = _session(model).run(None, feeds), _session(out).run(None, feeds)
    for x, y in zip(ref, got):
        assert np.isfinite(x).all() == np.isfinite(y).all()
        np.testing.assert_allclose(y, x, rtol=tol[0], atol=tol[1])
    return out


def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _rms_norm(nodes, c, x, y, axis, gamma):
    """``y = x / sqrt(mean(x^2, axis) + eps) * gamma`` as the exporters write an RMSNorm (Qwen3's QK-norm)."""
    c += [init(f"{y}_axes", np.array([axis], np.int64)), init(f"{y}_gamma", gamma)]
    nodes += [helper.make_node("Pow", [x, "two"], [f"{y}_sq"]),
              helper.make_node("ReduceMean", [f"{y}_sq"], [f"{y}_ms"], axes=[axis], keepdims=1),
              helper.make_node("Add", [f"{y}_ms", "eps"], [f"{y}_ve"]), helper.make_node("Sqrt", [f"{y}_ve"], [f"{y}_rs"]),
              helper.make_node("Reciprocal", [f"{y}_rs"], [f"{y}_inv"]), helper.make_node("Mul", [x, f"{y}_inv"], [f"{y}_n"]),
              helper.make_node("Mul", [f"{y}_n", f"{y}_gamma"], [y])]


def decoder_attention(batch, new, *, fill=-np.inf, guard=True, past=True, qk_norm=None):
    """One cached attention as transformers' eager/sdpa code exports it: x [B, S, H] projected to Q (N heads)
    and K, V (G heads), K/V concatenated after ``past_key``/``past_value`` [B, G, P, D] (the model's present
    outputs), repeat_kv (Unsqueeze/Expand/Reshape), scores scaled, the mask ``Where(keep, 0, fill)`` added
    (``keep`` [B, 1, S, T] a graph input), Softmax (with torch's NaN guard), merged, o_proj. ``batch``/``new``
    an int or a symbol name. ``qk_norm``: Q and K RMS-normalized per head over D (weights not 1) on the split
    [B, S, heads, D] ("split", Qwen3's order) or on the transposed [B, heads, S, D] ("heads", Gemma 3's), or over
    the heads axis of the split ("heads-axis": not a per-head norm)."""
    rng = np.random.default_rng(0)
    hid = N * D
    t = f"{new}+{P}" if isinstance(new, str) else new + P if past else new
    w = {k: init(k, (rng.standard_normal((hid, n)) / np.sqrt(hid)).astype(np.float32))
         for k, n in (("wq", N * D), ("wk", G * D), ("wv", G * D), ("wo", hid))}
    c = [init("q_shape", np.array([0, 0, N, D], np.int64)), init("kv_shape", np.array([0, 0, G, D], np.int64)),
         init("ax2", np.array([2], np.int64)), init("rep", np.array([1, 1, R, 1, 1], np.int64)),
         init("heads", np.array([0, N, -1, D], np.int64)), init("merged", np.array([0, 0, hid], np.int64)),
         init("scale", np.array(D ** -0.5, np.float32)), init("zero", np.array(0.0, np.float32)),
         init("fill", np.array(fill, np.float32))]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"])]
    c += [init("two", np.array(2.0, np.float32)), init("eps", np.array(1e-6, np.float32))]
    for p, shape in (("q", "q_shape"), ("k", "kv_shape"), ("v", "kv_shape")):
        nodes.append(helper.make_node("Reshape", [p, shape], [f"{p}4"]))
        gamma = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
        if qk_norm in ("split", "heads-axis") and p != "v":
            _rms_norm(nodes, c, f"{p}4", f"{p}4n", -1 if qk_norm == "split" else 2,
                      gamma if qk_norm == "split" else np.float32(1.5))
        normed = qk_norm is not None and p != "v"
        nodes.append(helper.make_node("Transpose", [f"{p}4n" if normed and qk_norm != "heads" else f"{p}4"],
                                      [f"{p}h0" if normed and qk_norm == "heads" else f"{p}h"], perm=[0, 2, 1, 3]))
        if normed and qk_norm == "heads":
            _rms_norm(nodes, c, f"{p}h0", f"{p}h", 3, gamma)
    for p in ("k", "v"):
        src = f"{p}h"
        if past:
            nodes.append(helper.make_node("Concat", [f"past_{p}", f"{p}h"], [f"present_{p}"], axis=2))
            src = f"present_{p}"
        nodes += [helper.make_node("Unsqueeze", [src, "ax2"], [f"{p}u"]),
                  helper.make_node("Expand", [f"{p}u", "rep"], [f"{p}e"]),
                  helper.make_node("Reshape", [f"{p}e", "heads"], [f"{p}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qh", "kt"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["scores"]),
              helper.make_node("Where", ["keep", "zero", "fill"], ["bias"]),
              helper.make_node("Add", ["scores", "bias"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["probs"], axis=-1)]
    probs = "probs"
    if guard:
        nodes += [helper.make_node("IsNaN", ["probs"], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", "probs"], ["guarded"])]
        probs = "guarded"
    nodes += [helper.make_node("MatMul", [probs, "vr"], ["pv"]),
              helper.make_node("Transpose", ["pv"], ["pvt"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["pvt", "merged"], ["attn"]), helper.make_node("MatMul", ["attn", "wo"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, new, hid]),
              helper.make_tensor_value_info("keep", TensorProto.BOOL, [batch, 1, new, t])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, new, hid])]
    if past:
        inputs += [helper.make_tensor_value_info(f"past_{p}", TensorProto.FLOAT, [batch, G, "past", D]) for p in "kv"]
        outputs += [helper.make_tensor_value_info(f"present_{p}", TensorProto.FLOAT, [batch, G, None, D]) for p in "kv"]
    graph = helper.make_graph(nodes, "decoder_attention", inputs, outputs, list(w.values()) + c)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _feeds(batch, new, *, past=True, left_pad=2, seed=1):
    """Row 1 left-padded by ``left_pad`` keys (every query row of it sees no key there), causal."""
    rng = np.random.default_rng(seed)
    t = new + P if past else new
    pos = np.arange(t)
    causal = pos[None, :] <= (t - new + np.arange(new))[:, None]  # [S, T]
    keep = np.broadcast_to(causal, (batch, 1, new, t)).copy()
    if batch > 1:
        keep[1, :, :, :left_pad] = False
    feeds = {"x": rng.standard_normal((batch, new, N * D)).astype(np.float32), "keep": keep}
    if past:
        feeds.update({f"past_{p}": rng.standard_normal((batch, G, P, D)).astype(np.float32) for p in "kv"})
    return feeds


@pytest.mark.parametrize("guard", [True, False], ids=["nan-guard", "no-guard"])
@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min)], ids=["-inf", "lowest"])
def test_one_decode_step_becomes_gqa_and_agrees_with_left_padding(guard, fill):
    model = decoder_attention("batch", 1, fill=fill, guard=guard)
    feeds = _feeds(3, 1)
    out = _fused(model, feeds)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("GroupQueryAttention") == 1 and "Softmax" not in ops and "IsNaN" not in ops, ops
    gqa = next(n for n in out.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["causal"]) == (N, G, 1)  # (one new token: causal is free)
    assert abs(attrs["scale"] - D ** -0.5) < 1e-7
    assert list(gqa.output[1:]) == ["present_k", "present_v"]  # the model's present outputs, written by the op


@pytest.mark.parametrize("guard,fill", [(True, -np.inf), (False, float(np.finfo(np.float32).min))],
                         ids=["nan-guard", "lowest-fill"])
def test_prefill_without_a_cache_at_any_batch_and_length(guard, fill):
    """Row 1 left-padded: its first query rows see no key (the guard's 0, or the finite fill's uniform average
    over every key, which causal=0 reproduces)."""
    model = decoder_attention("batch", "seq", past=False, guard=guard, fill=fill)
    out = _fused(model, _feeds(2, 6, past=False))
    assert [n.op_type for n in out.graph.node].count("GroupQueryAttention") == 1
    for batch, new in ((1, 3), (3, 7)):  # other shapes of the same model
        feeds = _feeds(batch, new, past=False, seed=batch)
        ref, got = _session(model).run(None, feeds), _session(out).run(None, feeds)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-5)


def test_several_new_tokens_after_a_past_need_batch_one():
    """onnxruntime's GroupQueryAttention refuses S > 1 with a past at batch > 1: with both dynamic, refused;
    at batch 1 it fires and agrees for several new tokens."""
    from onnxopt import optimize

    _, report = optimize(decoder_attention("batch", "seq"), target="ort-cpu", return_report=True)
    reasons = report.fusions["group_query_attention"]["reasons"]
    assert any("batch not proven 1" in r for r in reasons), reasons
    model = decoder_attention(1, "seq")
    out = _fused(model, _feeds(1, 4))
    assert [n.op_type for n in out.graph.node].count("GroupQueryAttention") == 1


def test_a_mask_that_differs_by_head_is_refused():
    model = decoder_attention("batch", 1)
    keep = next(i for i in model.graph.input if i.name == "keep")
    keep.type.tensor_type.shape.dim[1].dim_value = N
    from onnxopt import optimize

    _, report = optimize(model, target="ort-cpu", return_report=True)
    assert report.fusions["group_query_attention"]["hits"] == 0
    assert "the mask differs by head" in report.fusions["group_query_attention"]["reasons"]


@pytest.mark.parametrize("where", ["split", "heads"])
def test_heads_normalized_per_head_qk_norm_fuse_and_agree(where):
    """Qwen3 / Gemma 3's QK-norm (an RMSNorm over D of each head of Q and K, before or after the heads'
    Transpose): matched, and rebuilt on the op's [B, S, N, D] view of the projection (the same nodes)."""
    model = decoder_attention("batch", 1, qk_norm=where)
    out = _fused(model, _feeds(3, 1))
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("GroupQueryAttention") == 1 and "Softmax" not in ops, ops
    assert ops.count("ReduceMean") == 2 and ops.count("Sqrt") == 2  # (Q's and K's norms, on the 3-D projections)
    prefill = decoder_attention("batch", "seq", past=False, qk_norm=where)
    assert [n.op_type for n in _fused(prefill, _feeds(2, 5, past=False)).graph.node].count("GroupQueryAttention") == 1


def test_a_norm_over_the_heads_axis_is_refused_with_the_reason():
    from onnxopt import optimize

    _, report = optimize(decoder_attention("batch", 1, qk_norm="heads-axis"), target="ort-cpu", return_report=True)
    found = report.fusions["group_query_attention"]
    assert found["hits"] == 0
    assert any("does not average the last axis" in r for r in found["reasons"]), found["reasons"]


def test_not_for_portable_and_cuda():
    from onnxopt import optimize

    for target in ("portable", "ort-cuda"):
        out = optimize(decoder_attention("batch", 1), target=target)
        assert "GroupQueryAttention" not in [n.op_type for n in out.graph.node]


# The zoo's exported decoders: batch 2, kv feeds left-padded, prefill feeds right-padded (models/decoder_models.py)
ZOO_FIRES = ["llama-kv-legacy", "llama-kv-dynamo", "llama-prefill-legacy", "llama-prefill-dynamo",
             "llama-mha-kv-legacy", "mistral-kv-dynamo", "qwen2-kv-legacy", "phi3-kv-dynamo", "gemma2-kv-legacy",
             # QK-norm (Qwen3, Gemma 3: two rotary tables, sliding window); Phi-3's legacy rotary (computed halves)
             "qwen3-kv-dynamo", "qwen3-prefill-legacy", "gemma3-kv-legacy", "gemma3-prefill-dynamo",
             "phi3-prefill-legacy", "phi3-kv-legacy"]


@pytest.mark.parametrize("name", ZOO_FIRES)
def test_zoo_decoders_every_layer_and_outputs_agree(name):
    pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")
    from onnxopt import optimize
    from onnxopt.models import zoo

    path = shared_zoo_model(name)
    feeds = zoo.get(name).inputs(path)
    out, report = optimize(onnx.load(str(path)), target="ort-cpu", return_report=True)
    layers = 2
    assert report.fusions["group_query_attention"]["hits"] == layers, report.fusions["group_query_attention"]
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("GroupQueryAttention") == layers and "Softmax" not in ops
    if "-kv-" in name:  # the cache is written once, by the op
        assert report.fusions["group_query_attention_present"]["hits"] == 2 * layers
    onnx.checker.check_model(out)
    ref = _session(onnx.load(str(path))).run(None, feeds)
    got = _session(out).run(None, feeds)
    for x, y in zip(ref, got):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-5)


def test_the_whole_optimization_of_a_decoder_gives_the_same_bytes_in_two_processes(tmp_path):
    """(Node sets ordered by address once made the rotary rewrite's node order vary from run to run.)"""
    import hashlib
    import subprocess
    import sys

    pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")
    path = shared_zoo_model("llama-kv-legacy")
    digests = set()
    for i in range(2):
        out = tmp_path / f"o{i}.onnx"
        r = subprocess.run([sys.executable, "-m", "onnxopt", str(path), "-o", str(out), "--target", "ort-cpu", "-q"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-1000:]
        digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
    assert len(digests) == 1
