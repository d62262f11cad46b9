"""rules/standard_attention.py: a decoder's attention as the standard Attention (opset 23) for ``portable``
(issue 30): group_query_attention's matcher, the op's q_num_heads/kv_num_heads, the model's mask as
attn_mask, past_key/past_value in and present_key/present_value replacing the model's cache Concats; where
the model imports opset >= 23 and onnxruntime has the kernel, refused with the reason otherwise.

The end-to-end tests export the tiny Llama (models/decoder_models.py) with torch.onnx's legacy exporter at
opset 23 and optimize it for ``portable`` with every rule: RMSNormalization, RotaryEmbedding and Attention
appear, nothing of com.microsoft, and onnxruntime gives the same outputs (logits and presents) on the zoo's
feeds (batch 2, padded rows). The zoo's opset-17 Llama gets the normalization's and the rotary's miss
reasons (its attention is then no candidate: its Q is still the decomposed rotary). An encoder's attention
(rules/attention.py's forms) becomes the standard op through ``standard_encoder_attention``."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from helpers import shared_zoo_model
from onnx import helper

from onnxopt import optimize

from .check import RULES, fires, refuses
from .test_group_query_attention import D, G, N, _feeds, _session, decoder_attention

ort = pytest.importorskip("onnxruntime")

RULE = "standard_attention"
STANDARD = ("standard_rms_normalization", "standard_rotary_embedding", "standard_attention")  # (the decoder's)


def at(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    model.opset_import[0].version = opset  # (decoder_attention's ops are the same at 17 and 23)
    return model


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("guard,fill", [(True, -np.inf), (False, float(np.finfo(np.float32).min))],
                         ids=["nan-guard", "lowest-fill"])
def test_one_decode_step_becomes_attention_with_the_cache(guard, fill):
    model = at(decoder_attention("batch", 1, fill=fill, guard=guard), 23)
    out, report = fires(RULE, model, feeds=_feeds(3, 1), tol=1e-5)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and "IsNaN" not in ops, ops
    assert not [n for n in out.graph.node if n.op_type == "Concat" and {"past_k", "past_v"} & set(n.input)]
    node = next(n for n in out.graph.node if n.op_type == "Attention")
    attrs = _attrs(node)
    assert node.domain == "" and (attrs["q_num_heads"], attrs["kv_num_heads"]) == (N, G)
    assert abs(attrs["scale"] - D ** -0.5) < 1e-7 and "is_causal" not in attrs
    assert list(node.input[4:]) == ["past_k", "past_v"] and list(node.output[1:]) == ["present_k", "present_v"]
    onnx.checker.check_model(out, full_check=True)
    assert report.fusions[RULE]["hits"] == 1


def test_prefill_without_a_cache_at_other_shapes():
    model = at(decoder_attention("batch", "seq", past=False), 23)
    out, _ = fires(RULE, model, feeds=_feeds(2, 6, past=False), tol=1e-5)
    assert len(next(n for n in out.graph.node if n.op_type == "Attention").output) == 1
    for batch, new in ((1, 3), (3, 7)):
        feeds = _feeds(batch, new, past=False, seed=batch)
        np.testing.assert_allclose(_session(out).run(None, feeds)[0], _session(model).run(None, feeds)[0],
                                   rtol=1e-4, atol=1e-5)


def test_before_opset_23_it_is_refused_with_the_reason():
    _, report = refuses(RULE, decoder_attention("batch", 1), "the model imports opset 17", feeds=_feeds(3, 1))
    assert any("Attention is a standard op from opset 23" in r for r in report.fusions[RULE]["reasons"])


def test_a_cache_read_before_the_attention_stays_and_the_ops_present_is_not_read():
    model = at(decoder_attention("batch", 1), 23)
    g = model.graph
    k = next(i for i, n in enumerate(g.node) if n.op_type == "Concat" and n.output[0] == "present_k")
    g.node.insert(k + 1, helper.make_node("Identity", ["present_k"], ["present_k_early"]))
    g.output.append(helper.make_tensor_value_info("present_k_early", onnx.TensorProto.FLOAT, ["batch", G, None, D]))
    out, _ = fires(RULE, model, feeds=_feeds(3, 1), tol=1e-5)
    node = next(n for n in out.graph.node if n.op_type == "Attention")
    assert list(node.input[4:]) == ["past_k", "past_v"]
    assert not [n for n in out.graph.node if set(n.input) & set(node.output[1:])]  # (its present unread)
    assert sorted(n.output[0] for n in out.graph.node if n.op_type == "Concat"
                  and n.input[0] in ("past_k", "past_v")) == ["present_k", "present_v"]


# --- the tiny Llama exported at opset 23 ------------------------------------------------------------

@pytest.fixture(scope="module")
def llama23(tmp_path_factory):
    pytest.importorskip("torch", reason="the decoders are exported from transformers")
    from onnxopt.models import decoder_models as dm

    folder = tmp_path_factory.mktemp("llama23")
    module = dm.build_module("llama")
    return module, {form: dm.export_module(module, form, folder / f"llama-{form}-legacy-23.onnx", "legacy", opset=23)
                    for form in ("prefill", "kv")}


@pytest.mark.parametrize("form", ["prefill", "kv"])
def test_an_opset_23_decoder_gets_the_standard_ops_and_the_same_outputs(llama23, form):
    from onnxopt.models import decoder_models as dm

    module, paths = llama23
    original = onnx.load(str(paths[form]))
    out, report = optimize(original, target="portable", return_report=True)
    ops = collections.Counter(n.op_type for n in out.graph.node)
    layers = 2
    assert (ops["RMSNormalization"], ops["RotaryEmbedding"], ops["Attention"]) == (2 * layers + 1, 2 * layers, layers)
    assert "Softmax" not in ops and {n.domain for n in out.graph.node} <= {""}, ops
    for rule, hits in zip(STANDARD, (2 * layers + 1, 2 * layers, layers)):
        assert report.fusions[rule]["hits"] == hits, report.fusions[rule]
    onnx.checker.check_model(out, full_check=True)
    feed = dm.feeds(form, module, 2, 12, seed=3)  # (padded rows: the mask matters)
    names = [i.name for i in original.graph.input]
    ref = _session(original).run(None, {n: feed[n] for n in names})
    got = _session(out).run(None, {n: feed[n] for n in names})
    assert len(ref) == (1 if form == "prefill" else 1 + 2 * layers)
    for x, y in zip(ref, got):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=2e-5)


def test_a_decoder_below_opset_23_gets_the_miss_reasons():
    pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")
    path = shared_zoo_model("llama-kv-legacy")
    model = onnx.load(str(path))
    assert model.opset_import[0].version < 23
    out, report = optimize(model, target="portable", return_report=True)
    assert not {"RMSNormalization", "RotaryEmbedding", "Attention"} & {n.op_type for n in out.graph.node}
    for rule in STANDARD[:2]:
        f = report.fusions[rule]
        assert f["hits"] == 0 and f["missed"] >= 2, f
        assert any("is a standard op from opset 23; the model imports opset 17" in r for r in f["reasons"]), f
    # the rotary left as it is, the attention's Q is no candidate (its own opset refusal: the test above)
    assert report.fusions["standard_attention"]["hits"] == 0
    assert "Q is not a projection's heads (normalized per head or not, rotated or not)" in \
        report.rules["standard_attention"].reasons


def test_only_for_portable():
    assert all(RULES[r].targets == frozenset({"portable"}) or tuple(RULES[r].targets) == ("portable",)
               for r in STANDARD)


# --- an encoder's attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("form", [dict(proj="bert"), dict(proj="gpt2", mask="where"),
                                  dict(proj="cross", mask="pad", static=True)], ids=["bert", "gpt2", "cross"])
def test_an_encoders_attention_becomes_the_standard_op(form):
    from .test_attention import attention_model, feeds

    m = attention_model(opset=23, **form)
    out, report = fires("standard_encoder_attention", m, feeds=feeds(m), tol=1e-4)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and {n.domain for n in out.graph.node} <= {""}
    onnx.checker.check_model(out, full_check=True)


def test_an_encoder_below_opset_23_is_refused_with_the_reason():
    from .test_attention import attention_model, feeds

    m = attention_model()
    refuses("standard_encoder_attention", m, "Attention is a standard op from opset 23; the model imports opset 17",
            feeds=feeds(m))
