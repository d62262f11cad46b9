"""GroupQueryAttention reading sequence lengths from the attention mask (``--padding right|none``): the form
ort-cuda's kernel needs (it takes no mask), checked on onnxruntime's CPU provider (issue 30).

The model's own mask must be proven causal with the attention mask's padding (rules/_mask_probe.py); the rewrite
then agrees with the original on masks padded at the end of each row (right) or not at all (none)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import shared_zoo_model

from .test_group_query_attention import _session, decoder_attention

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the zoo's decoders are exported from transformers")


def _optimize(name, **kw):
    from onnxopt import optimize

    out, report = optimize(onnx.load(str(shared_zoo_model(name))), return_report=True, **kw)
    return out, report.fusions["group_query_attention"]


def _gqa(model):
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _decode_feeds(model, past, masks):
    """One new token after ``past`` keys, each row's attention mask given (ones where a key is real)."""
    rng = np.random.default_rng(3)
    masks = np.asarray(masks, np.int64)
    batch = masks.shape[0]
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 100, (batch, 1))
        elif i.name == "attention_mask":
            feeds[i.name] = masks
        elif i.name == "position_ids":
            feeds[i.name] = masks[:, :-1].sum(axis=1, keepdims=True)
        else:
            feeds[i.name] = rng.standard_normal((batch, dims[1], past, dims[3])).astype(np.float32)
    return feeds


def test_right_padding_reads_lengths_and_agrees_on_right_padded_rows():
    out, fusion = _optimize("llama-kv-dynamo", target="ort-cpu", padding="right")
    assert fusion["hits"] == 2
    for node in _gqa(out):
        assert len(node.input) == 7  # no attention_bias: seqlens_k and total_sequence_length from the mask
        assert "causal" not in [a.name for a in node.attribute]  # (the op's default: causal)
    assert any(n.op_type == "ReduceSum" and n.input[0] == "attention_mask" for n in out.graph.node)
    assert {p.key: p.value for p in out.metadata_props}.get("onnxopt.padding") == "right"
    onnx.checker.check_model(out)
    original = onnx.load(str(shared_zoo_model("llama-kv-dynamo")))
    # row 0 unpadded; row 1's prompt padded at its end (3 real keys of 6), then the new token
    feeds = _decode_feeds(original, 6, [[1] * 7, [1, 1, 1, 0, 0, 0, 1]])
    ref = dict(zip([o.name for o in original.graph.output], _session(original).run(None, feeds)))
    got = dict(zip([o.name for o in out.graph.output], _session(out).run(None, feeds)))
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-4, atol=2e-5)
    # (the op's cache holds row 1's new key right after its real ones: equal where both hold the same keys)
    np.testing.assert_allclose(got["present.0.key"][0], ref["present.0.key"][0], rtol=1e-4, atol=2e-5)


def test_a_sliding_window_is_kept_without_padding_and_refused_with_it():
    out, fusion = _optimize("mistral-kv-dynamo", target="ort-cpu", padding="none")
    windows = [a.i for n in _gqa(out) for a in n.attribute if a.name == "local_window_size"]
    assert fusion["hits"] == 2 and len(windows) == 2
    original = onnx.load(str(shared_zoo_model("mistral-kv-dynamo")))
    for past in (4, 20):  # within the tiny config's window of 8 keys, and beyond it
        feeds = _decode_feeds(original, past, np.ones((2, past + 1)))
        ref, got = _session(original).run(None, feeds)[0], _session(out).run(None, feeds)[0]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    # with padding, the op counts the window over a row's real keys, the model over its positions
    _, fusion = _optimize("mistral-kv-dynamo", target="ort-cuda", precision="fp16", padding="right")
    assert fusion["hits"] == 0
    assert any("sliding window of 8 keys with padding" in r for r in fusion["reasons"]), fusion["reasons"]


def test_cuda_needs_half_precision_and_a_padding_promise():
    _, fusion = _optimize("llama-kv-dynamo", target="ort-cuda")
    assert any("float16 and bfloat16 kernels only" in r for r in fusion["reasons"]), fusion["reasons"]
    _, fusion = _optimize("llama-kv-dynamo", target="ort-cuda", precision="fp16")
    assert any("takes no mask" in r for r in fusion["reasons"]), fusion["reasons"]
    out, fusion = _optimize("llama-kv-dynamo", target="ort-cuda", precision="fp16", padding="right")
    assert fusion["hits"] == 2
    nodes = _gqa(out)
    assert len(nodes) == 2 and all(len(n.input) == 7 for n in nodes)
    types = {v.name: v.type.tensor_type.elem_type for v in [*out.graph.value_info, *out.graph.input]}
    assert all(types.get(n.input[0]) == onnx.TensorProto.FLOAT16 for n in nodes)  # (converted whole)


def test_a_mask_that_is_not_made_from_an_attention_mask_is_refused():
    from onnxopt import optimize

    _, report = optimize(decoder_attention(1, 1), target="ort-cuda", precision="fp16", padding="right",
                         return_report=True)
    reasons = report.fusions["group_query_attention"]["reasons"]
    assert any("the attention mask" in r for r in reasons), reasons


def test_the_probe_tells_a_causal_mask_from_a_bidirectional_one():
    """A prefill's mask run on probes: the causal mask of the padding passes; a bidirectional one (every real key
    for every query) is refused with the probe that shows it."""
    from onnxopt.rules import _mask_probe

    def mask_model(causal: bool):
        b = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
        ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
        nodes = []

        def op(t, *ins, **attrs):
            node = ir.node(t, list(ins), attributes=attrs)
            nodes.append(node)
            return node.outputs[0]

        def const(a):
            return op("Constant", value=ir.tensor(np.asarray(a)))

        keep = op("Cast", op("Unsqueeze", b, const([1, 2])), to=int(ir.DataType.BOOL))  # [B, 1, 1, T]
        if causal:  # key j <= query i
            n = op("Squeeze", op("Shape", ids, start=1, end=2), const([0]))
            k = op("Range", const(np.int64(0)), n, const(np.int64(1)))
            keep = op("And", keep, op("LessOrEqual", op("Unsqueeze", k, const([0])), op("Unsqueeze", k, const([1]))))
        mask = op("Where", keep, const(np.float32(0)), const(np.float32(np.finfo(np.float32).min)))
        graph = ir.Graph([b, ids], [mask], nodes=nodes, opset_imports={"": 18})
        return graph, mask, b, ids

    class M:
        pass

    for causal in (True, False):
        graph, mask, b, ids = mask_model(causal)
        m = M()
        m.graph, m.opsets = graph, {"": 18}
        answer = _mask_probe.causal_padding_window(m, mask, b, ids, None, ir.DataType.FLOAT)
        if causal:
            assert answer == {"window": None, "checked_keys": _mask_probe.PREFILL_LONG}, answer
        else:
            assert isinstance(answer, str) and "not causal" in answer, answer


def test_the_window_onnxruntime_attends():
    from onnxopt.rules._mask_probe import window_extra, window_keys

    extra = window_extra()
    assert extra in (0, 1)
    assert window_keys(4, "CPUExecutionProvider") == 4 + extra
    assert window_keys(2, "NoSuchProvider") is None


def test_verify_feeds_the_promised_masks():
    from onnxopt.verify.inputs import make_inputs

    model = onnx.load(str(shared_zoo_model("llama-prefill-dynamo")))
    for padding, check in (("right", lambda r: (np.diff(r) <= 0).all() and r[0] == 1),
                           ("none", lambda r: (r == 1).all())):
        feeds, how = make_inputs(model, shapes={"input_ids": [4, 9], "attention_mask": [4, 9],
                                                "position_ids": [4, 9]}, padding=padding)
        assert all(check(row) for row in feeds["attention_mask"]), feeds["attention_mask"]
        assert padding in how["attention_mask"]["distribution"]
