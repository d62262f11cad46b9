"""fp16 conversion (onnxopt.transforms.precision, optimize(precision="fp16"), --precision) and the verifier's
fp16 fidelity criterion.

Small models check each decision (what converts, what stays float32 and why, where Casts go,
Cast pairs merged, I/O types and names kept, refusals). The zoo's BERT, GPT-2, MiniLM, resnet50
and mobilenet_v2 are converted and verified on onnxruntime CPU against their float32 originals on
the zoo's realistic inputs (token ids with padding, photographs): cosine >= 0.999, max abs error
<= 1% of the output's range, top-1 agreement >= 99% for logits (GPT-2: next token at every
position), and a bounded number of Casts.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxopt import optimize
from onnxopt.cli import main as cli_main
from onnxopt.errors import UsageError
from onnxopt.transforms.precision import DEFAULT_BLOCK_OPS, convert_fp16
from onnxopt.verify import compare_fp16, is_fp16, is_logits, verify

from conftest import run_ort
from helpers import feeds_for, init, model, tinfo

rng = np.random.default_rng(0)
F16 = TensorProto.FLOAT16


def _w(*shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _convert(proto, check=True, **kw):
    m = ir.serde.deserialize_model(proto)
    rep = convert_fp16(m, **kw)
    out = ir.serde.serialize_model(m)
    if check:  # (onnx's checker knows no com.microsoft op)
        onnx.checker.check_model(out)
    return out, rep


def _node(proto, op):
    return [n for n in proto.graph.node if n.op_type == op]


def _casts(proto):
    return len(_node(proto, "Cast"))


def _close(before, after, feeds, tol=1e-2):
    for a, b in zip(run_ort(before, feeds), run_ort(after, feeds)):
        assert a.dtype == b.dtype and a.shape == b.shape
        span = float(a.max() - a.min()) or 1.0
        assert float(np.abs(a.astype(np.float64) - b).max()) / span <= tol


def _mlp(**kw):
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return model(nodes, [tinfo("x", [2, 8])], [tinfo("y", [2, 4])],
                 [init("w1", _w(8, 16)), init("b1", _w(16)), init("w2", _w(16, 4))], **kw)


# --------------------------------------------------------------------------------------------
# Decisions on small models


def test_mlp_converts_with_casts_only_at_the_edges():
    src = _mlp()
    out, rep = _convert(src)
    assert [i.data_type for i in out.graph.initializer] == [F16] * 3
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].name == "y"  # the output keeps its name (a Cast carries it)
    assert _casts(out) == 2 and rep.casts == 2 and rep.nodes_fp16 == 4 and rep.nodes_fp32 == 0
    assert rep.weight_bytes_after * 2 == rep.weight_bytes_before
    _close(src, out, feeds_for(src))


def test_keep_io_types_false_makes_inputs_and_outputs_fp16():
    src = _mlp()
    out, rep = _convert(src, keep_io_types=False)
    assert out.graph.input[0].type.tensor_type.elem_type == F16
    assert out.graph.output[0].type.tensor_type.elem_type == F16
    assert rep.casts == 0
    # an initializer that is also a graph input (a default the caller may override) keeps float32
    src = _mlp()
    src.graph.input.append(tinfo("b1", [16]))
    out, rep = _convert(src, keep_io_types=False)
    assert {i.name: i.data_type for i in out.graph.initializer}["b1"] == TensorProto.FLOAT
    assert rep.casts == 1  # Add and Relu flipped together to float16: b1 is cast instead of two values
    x = feeds_for(src)["x"]
    np.testing.assert_allclose(run_ort(out, {"x": x.astype(np.float16)})[0], run_ort(src, {"x": x})[0],
                               rtol=2e-2, atol=2e-3)


def test_block_list_reductions_stay_fp32_with_their_reason():
    # a LayerNorm decomposition between two MatMuls: statistics in float32, few Casts
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]),
             helper.make_node("ReduceMean", ["a"], ["mu"], axes=[-1]),
             helper.make_node("Sub", ["a", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["ng"]),
             helper.make_node("Add", ["ng", "b"], ["nb"]),
             helper.make_node("MatMul", ["nb", "w2"], ["y"])]
    src = model(nodes, [tinfo("x", [2, 3, 8])], [tinfo("y", [2, 3, 8])],
                [init("w1", _w(8, 8)), init("two", np.float32(2)), init("eps", np.float32(1e-12)),
                 init("g", _w(8) + 1), init("b", _w(8)), init("w2", _w(8, 8))], opset=17)
    out, rep = _convert(src)
    assert rep.kept_fp32["ReduceMean: block list"] == 2
    assert rep.kept_fp32["Pow: block list"] == 1
    assert any("smallest normal" in k and "guarding" in k for k in rep.kept_fp32)  # eps 1e-12 underflows
    # no Cast storm: into the statistics, out of them, and the I/O
    assert rep.casts <= 5, rep.as_dict()
    _close(src, out, feeds_for(src))


def _masked_attention(big):
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["one", "mf"], ["inv"]),
             helper.make_node("Mul", ["inv", "big"], ["bias"]),
             helper.make_node("Add", ["s", "bias"], ["sb"]),
             helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    return model(nodes, [tinfo("q", [2, 4, 4]), tinfo("mask", [2, 1, 4], TensorProto.INT64)],
                 [tinfo("y", [2, 4, 4])],
                 [init("k", _w(4, 4)), init("one", np.float32(1)), init("big", np.float32(big)), init("v", _w(4, 4))])


_MASK_FEEDS = {"q": _w(2, 4, 4, scale=1), "mask": np.array([[[1, 1, 0, 0]], [[0, 0, 0, 0]]], np.int64)}


def test_sentinel_mask_converts_to_fp16_max_on_cuda():
    # scores + (1 - mask) * finfo(float32).min: on ort-cuda the sentinel becomes -65504 (not -inf:
    # a fully masked row stays finite, as in float32), and the whole attention runs in float16
    src = _masked_attention(np.finfo(np.float32).min)
    _, rep = _convert(src, target="ort-cpu")  # exact masks: the readers stay float32
    assert rep.kept_fp32["Mul: a constant beyond float16's range (|x| > 65504)"] == 1
    out, rep = _convert(src, target="ort-cuda")
    assert rep.nodes_fp32 == 0 and rep.casts == 3  # q in, y out, and the mask's Cast made float16
    big = [i for i in out.graph.initializer if i.name == "big"][0]
    assert big.data_type == F16 and float(onnx.numpy_helper.to_array(big)) == -65504.0
    before, after = run_ort(src, _MASK_FEEDS), run_ort(out, _MASK_FEEDS)
    assert np.isfinite(after[0]).all()
    # rows with a key to attend agree; a fully masked row (batch 1) is uniform in float32
    # (score + finfo.min == finfo.min), and score - 65504 in float16 keeps a trace of the scores
    # where the runtime adds in float32 (onnxruntime's CPU provider): finite, not equal
    np.testing.assert_allclose(after[0][0], before[0][0], rtol=1e-2, atol=1e-3)


def test_tiny_bias_converts_tiny_epsilon_does_not():
    # a bias that happens to be tiny is flushed harmlessly; an epsilon before a root is kept float32
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "tiny"], ["hb"]),
             helper.make_node("MatMul", ["hb", "w"], ["y"])]
    src = model(nodes, [tinfo("x", [2, 4])], [tinfo("y", [2, 4])],
                [init("w", _w(4, 4)), init("tiny", np.full(4, 1e-6, np.float32))])
    out, rep = _convert(src)
    assert rep.nodes_fp32 == 0 and rep.casts == 2
    _close(src, out, feeds_for(src))
    nodes[2] = helper.make_node("Sqrt", ["hb"], ["y"])
    src = model(nodes, [tinfo("x", [2, 4])], [tinfo("y", [2, 4])],
                [init("w", _w(4, 4)), init("tiny", np.full(4, 1e-6, np.float32))])
    _, rep = _convert(src)
    assert "Add: a constant below float16's smallest normal (|x| < 6.1e-5), guarding a division or root" in rep.kept_fp32


def test_large_constant_keeps_its_reader_and_softmax_fp32():
    # a value beyond float16's range that is data (not a sentinel): its reader stays float32, and
    # the Softmax it reaches too (its input would not survive float16)
    src = _masked_attention(-1e6)
    out, rep = _convert(src, target="ort-cuda")
    assert rep.kept_fp32["Mul: a constant beyond float16's range (|x| > 65504)"] == 1
    assert any(k.startswith("Softmax: its input is float32") for k in rep.kept_fp32)
    before, after = run_ort(src, _MASK_FEEDS), run_ort(out, _MASK_FEEDS)
    np.testing.assert_allclose(after[0], before[0], rtol=1e-2, atol=1e-3)


def test_softmax_follows_a_float16_input():
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    src = model(nodes, [tinfo("q", [2, 4])], [tinfo("y", [2, 4])], [init("k", _w(4, 4)), init("v", _w(4, 4))])
    out, rep = _convert(src)
    assert rep.nodes_fp32 == 0 and rep.casts == 2


def test_resize_scales_keep_their_fixed_type():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="nearest")]
    src = model(nodes, [tinfo("x", [1, 2, 4, 4])], [tinfo("y", [1, 3, 8, 8])],
                [init("w", _w(3, 2, 3, 3)), init("scales", np.array([1, 1, 2, 2], np.float32))])
    out, _ = _convert(src)
    kinds = {i.name: i.data_type for i in out.graph.initializer}
    assert kinds["scales"] == TensorProto.FLOAT and kinds["w"] == F16
    _close(src, out, feeds_for(src))


def test_casts_from_integers_become_fp16_and_casts_to_integers_read_fp16():
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["f", "w"], ["h"]),
             helper.make_node("Cast", ["h"], ["hi"], to=TensorProto.INT64),
             helper.make_node("Relu", ["h"], ["y"])]
    src = model(nodes, [tinfo("ids", [2, 4], TensorProto.INT64)],
                [tinfo("y", [2, 4]), tinfo("hi", [2, 4], TensorProto.INT64)], [init("w", _w(4, 4, scale=1))])
    out, rep = _convert(src)
    casts = _node(out, "Cast")
    to = {c.output[0]: c.attribute[0].i for c in casts}
    assert to["f"] == F16  # the model's own Cast now makes float16: no second Cast
    assert to["hi"] == TensorProto.INT64 and [c for c in casts if c.output[0] == "hi"][0].input[0] == "h"
    assert rep.casts == 3  # int->fp16, fp16->int64 (the model's own two) and the output's
    _close(src, out, {"ids": np.arange(8, dtype=np.int64).reshape(2, 4)})


def test_cast_pairs_merged():
    # ids -> float read by a float32 reader (Mul with a ReduceSum) and a float16 one (MatMul):
    # the float32 reader casts the integers directly (int -> fp16 -> fp32 would round above 2048)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("ReduceSum", ["h", "ax"], ["s"]),  # fp32 (block list)
             helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["s", "f"], ["y"]),
             helper.make_node("MatMul", ["f", "w2"], ["z"])]
    src = model(nodes, [tinfo("x", [2, 4]), tinfo("ids", [2, 1], TensorProto.INT64)],
                [tinfo("y", [2, 1]), tinfo("z", [2, 4])],
                [init("w", _w(4, 4)), init("ax", np.array([1], np.int64)), init("w2", _w(1, 4))], opset=13)
    out, rep = _convert(src)
    assert rep.casts_merged == 1
    ids_casts = [n for n in _node(out, "Cast") if n.input[0] == "ids"]
    assert sorted(n.attribute[0].i for n in ids_casts) == [TensorProto.FLOAT, F16]
    feeds = {"x": _w(2, 4, scale=1), "ids": np.array([[4097], [3]], np.int64)}
    a, b = run_ort(src, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-2)


def test_subgraph_readers_get_float32():
    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [], [tinfo("t", [2, 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [], [tinfo("e", [2, 4])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    src = model(nodes, [tinfo("x", [2, 4]), tinfo("c", [], TensorProto.BOOL)], [tinfo("y", [2, 4])],
                [init("w", _w(4, 4))])
    out, rep = _convert(src)
    assert rep.kept_fp32 == {"If: has subgraphs": 1}
    for c in (True, False):
        feeds = {"x": _w(2, 4, scale=1), "c": np.array(c)}
        np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(src, feeds)[0], rtol=1e-2, atol=1e-3)


def test_normalization_converts_on_ort_targets_only():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n", "w"], ["y"])]
    src = model(nodes, [tinfo("x", [2, 3, 8])], [tinfo("y", [2, 3, 8])],
                [init("w", _w(8, 8)), init("g", _w(8) + 1), init("b", _w(8))])
    out, rep = _convert(src, target="portable")
    assert any(k.startswith("LayerNormalization: normalization statistics") for k in rep.kept_fp32)
    out, rep = _convert(src, target="ort-cpu")
    assert rep.nodes_fp32 == 0 and rep.casts == 2
    _close(src, out, feeds_for(src))


def _contrib(nodes, inits):
    g = helper.make_graph(nodes, "g", [tinfo("x", [2, 4, 8])], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                               None)],
                          [init(k, _w(*v)) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _mm(w, out):
    return helper.make_node("MatMul", ["x", w], [out])


MS = "com.microsoft"
CONTRIB = {  # the fused ops of the ort-* targets (rules/normalization.py, activation.py, attention.py)
    "SkipLayerNormalization": ([_mm("w", "h"), helper.make_node("SkipLayerNormalization", ["h", "x", "g", "b"], ["y"],
                                                                domain=MS, epsilon=1e-5)],
                               {"w": (8, 8), "g": (8,), "b": (8,)}),
    "SimplifiedLayerNormalization": ([_mm("w", "h"), helper.make_node("SimplifiedLayerNormalization", ["h", "g"], ["y"],
                                                                      epsilon=1e-5, axis=-1)], {"w": (8, 8), "g": (8,)}),
    "Gelu": ([_mm("w", "h"), helper.make_node("Gelu", ["h"], ["y"], domain=MS)], {"w": (8, 8)}),
    "FastGelu": ([_mm("w", "h"), helper.make_node("FastGelu", ["h", "b"], ["y"], domain=MS)], {"w": (8, 8), "b": (8,)}),
    "BiasGelu": ([_mm("w", "h"), helper.make_node("BiasGelu", ["h", "b"], ["y"], domain=MS)], {"w": (8, 8), "b": (8,)}),
    "MultiHeadAttention": ([_mm("wq", "q"), _mm("wk", "k"), _mm("wv", "v"),
                            helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain=MS, num_heads=2)],
                           {"wq": (8, 8), "wk": (8, 8), "wv": (8, 8)}),
    "Attention": ([helper.make_node("Attention", ["x", "w", "b"], ["y"], domain=MS, num_heads=2, unidirectional=1)],
                  {"w": (8, 24), "b": (24,)}),
}


@pytest.mark.parametrize("op", list(CONTRIB))
def test_contrib_ops_convert(op):
    # their schemas come from onnxruntime's registry: T admits float16; they run on the CPU provider
    src = _contrib(*CONTRIB[op])
    out, rep = _convert(src, check=False, target="ort-cuda")
    assert rep.nodes_fp32 == 0 and rep.casts == 2
    assert [n for n in out.graph.node if n.op_type == op]
    _close(src, out, {"x": _w(2, 4, 8, scale=1)})


def test_custom_block_list():
    out, rep = _convert(_mlp(), block_ops=DEFAULT_BLOCK_OPS | {"Relu"})
    assert rep.kept_fp32 == {"Relu: block list": 1}


def test_refusals_are_one_line():
    fp16 = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [2], F16)], [tinfo("y", [2], F16)])
    with pytest.raises(UsageError, match="already computes in float16") as e:
        _convert(fp16)
    assert "\n" not in str(e.value)
    q = model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
               helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
              [tinfo("x", [2])], [tinfo("y", [2])], [init("s", np.float32(0.1)), init("z", np.uint8(0))])
    with pytest.raises(UsageError, match="quantized"):
        _convert(q)
    with pytest.raises(UsageError, match="quantized"):
        optimize(q, precision="fp16")
    with pytest.raises(UsageError, match="choose fp32 or fp16"):
        optimize(_mlp(), precision="bf16")
    with pytest.raises(UsageError, match="exact"):
        optimize(_mlp(), precision="fp16", exact=True)


def test_optimize_precision_and_report():
    src = _mlp()
    out, rep = optimize(src, precision="fp16", target="ort-cpu", return_report=True)
    assert rep.precision["nodes_fp32"] == 0 and rep.settings["precision"] == "fp16"
    assert rep.precision["nodes_fp16"] == len(out.graph.node) - 2  # all but the two Casts (MatMul+Add fused)
    assert rep.as_dict()["precision"]["casts"] == 2
    assert is_fp16(out)
    assert any("slower there" in w for w in rep.warnings)  # float16 is for GPUs
    _, rep = optimize(src, precision="fp16", target="ort-cuda", return_report=True)
    assert not rep.warnings
    _, rep32 = optimize(src, return_report=True)
    assert rep32.precision is None and "precision" not in rep32.settings


def test_cli_precision(tmp_path, capsys):
    src, dst, js = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(_mlp(), src)
    assert cli_main([str(src), "-o", str(dst), "--precision", "fp16", "--target", "ort-cpu", "--json", str(js),
                     "-q"]) == 0
    out = onnx.load(str(dst))
    assert {i.data_type for i in out.graph.initializer} == {F16}
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert json.loads(js.read_text())["precision"]["nodes_fp32"] == 0
    capsys.readouterr()
    # onnxopt verify judges a float16 model against its float32 original by fp16 fidelity
    assert cli_main(["verify", str(src), str(dst), "--runs", "0", "--json", str(tmp_path / "v.json")]) == 0
    v = json.loads((tmp_path / "v.json").read_text())
    assert "fp16" in v and v["providers"]["cpu"]["outputs"][0]["error_of_range"] <= 0.01
    capsys.readouterr()
    assert cli_main([str(dst), "-o", str(tmp_path / "again.onnx"), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already computes in float16" in err and len(err.splitlines()) == 1


def _sensitive():
    # probs = Softmax(x @ Wl): Wl = 50 + fine detail that float16 (spacing 0.03 at 50) rounds away;
    # beside it a benign MLP branch, whose MatMuls are the other candidates
    nodes = [helper.make_node("MatMul", ["x", "wl"], ["l"], name="logits_mm"),
             helper.make_node("Softmax", ["l"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="mm2"), helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("MatMul", ["r2", "w3"], ["h3"], name="mm3"), helper.make_node("Relu", ["h3"], ["r3"]),
             helper.make_node("MatMul", ["r3", "w4"], ["y"], name="mm4")]
    r = np.random.default_rng(1)
    wl = (50 + r.standard_normal((16, 64)) * 0.05).astype(np.float32)
    return model(nodes, [tinfo("x", [8, 16])], [tinfo("probs", [8, 64]), tinfo("y", [8, 16])],
                 [init("wl", wl), init("w1", _w(16, 16)), init("w2", _w(16, 16)), init("w3", _w(16, 16)),
                  init("w4", _w(16, 16))])


def test_fidelity_fallback_keeps_the_sensitive_node_fp32():
    src = _sensitive()
    feeds = {"x": np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)}
    plain = verify(src, optimize(src, precision="fp16"), feeds=feeds, runs=0)
    assert not plain["ok"]  # float16 rounds Wl's detail away
    out, rep = optimize(src, precision="fp16", return_report=True, verify="cpu",
                        verify_options={"feeds": feeds, "runs": 0})
    fb = rep.precision["fallback"]
    assert fb["ok"] and fb["kept"] == ["logits_mm"] and fb["badness_before"] > 1 >= fb["badness_after"], fb
    assert rep.verification["ok"]
    assert rep.precision["kept_fp32"]["MatMul: kept in float32 by name (keep_nodes)"] == 1
    assert {i.name: i.data_type for i in out.graph.initializer}["w1"] == F16


# --------------------------------------------------------------------------------------------
# The verifier's fp16 criterion


def test_compare_fp16_criterion():
    a = np.linspace(-1, 1, 1000, dtype=np.float32).reshape(10, 100)
    ok = compare_fp16(a, (a + 1e-3).astype(np.float32), "hidden")
    assert ok["ok"] and ok["error_of_range"] == pytest.approx(5e-4, rel=1e-3) and "top1_agreement" not in ok
    bad = compare_fp16(a, (a + 0.05).astype(np.float32), "hidden")
    assert not bad["ok"] and "of the range" in bad["problem"]
    logits = rng.standard_normal((4, 8, 50)).astype(np.float32)
    flipped = logits.copy()
    flipped[0, 0] = -flipped[0, 0]  # one position of 32 disagrees
    row = compare_fp16(logits, flipped, "logits")
    assert row["top1_agreement"] == pytest.approx(31 / 32) and not row["ok"] and "top-1" in row["problem"]
    assert is_logits("logits", logits) and is_logits("probs", np.zeros((1, 1000), np.float32))
    assert not is_logits("last_hidden_state", np.zeros((2, 3, 1024), np.float32))


def test_verify_judges_fp16_by_fidelity():
    src = _mlp()
    out = optimize(src, precision="fp16")
    report = verify(src, out, runs=0)
    assert report["ok"] and "fp16" in report
    row = report["providers"]["cpu"]["outputs"][0]
    assert row["tolerance"].startswith("fp16 model") and row["error_of_range"] <= 0.01


# --------------------------------------------------------------------------------------------
# The zoo: fidelity on realistic inputs, Cast counts, I/O types

ZOO = [(name, "ort-cpu") for name in ("bert-legacy", "bert-dynamo", "gpt2-legacy", "gpt2-dynamo", "minilm-legacy",
                                      "resnet50-legacy", "mobilenet_v2-legacy", "mobilenet_v2-dynamo")]
ZOO += [("bert-dynamo", "ort-cuda"), ("gpt2-dynamo", "ort-cuda")]  # finfo.min masks as -65504


@pytest.mark.parametrize("name,target", ZOO, ids=[f"{n}-{t}" for n, t in ZOO])
def test_zoo_fp16(name, target):
    from onnxopt.models import zoo

    spec = zoo.get(name)
    path = spec.path()
    if not path.exists():
        pytest.skip(f"{name} is not in the zoo cache (python -m onnxopt.models build --only {name})")
    feeds = spec.inputs(path)
    out, rep = optimize(onnx.load(str(path)), precision="fp16", target=target, return_report=True, verify="cpu",
                        verify_options={"feeds": feeds, "runs": 0})
    v = rep.verification
    assert v["ok"] and "fp16" in v, v
    for row in v["providers"]["cpu"]["outputs"]:
        assert row["cosine"] >= 0.999 and row["error_of_range"] <= 0.01, row
        if name.startswith("gpt2") or spec.family == "vision":  # logits: next token / class
            assert row["top1_agreement"] >= 0.99, row
    # I/O types kept
    src = onnx.load(str(path), load_external_data=False)
    assert [i.type.tensor_type.elem_type for i in out.graph.input] == \
        [i.type.tensor_type.elem_type for i in src.graph.input]
    assert [o.type.tensor_type.elem_type for o in out.graph.output] == \
        [o.type.tensor_type.elem_type for o in src.graph.output]
    p = rep.precision
    assert p["weight_bytes_after"] <= 0.51 * p["weight_bytes_before"]
    # no Cast storm: measured on ort-cpu 3 (BERT legacy), 11 (BERT dynamo: its finfo.min mask keeps
    # Softmax float32), 10-18 (GPT-2: its tanh Gelu with Pow stays float32), 3 (MiniLM legacy), 2
    # (resnet50), 2-4 (mobilenet_v2); on ort-cuda 3 (BERT dynamo), 10 (GPT-2 dynamo). The bound:
    # 4 per attention layer + 6, or 6 for a CNN
    layers = sum(1 for n in src.graph.node if n.op_type == "Softmax")
    assert p["casts"] <= (4 * layers + 6 if layers else 6), p


def test_the_checked_conversion_says_when_onnxruntime_cannot_run_the_original():
    from onnxopt.errors import UsageError
    from onnxopt.verify.fp16_fallback import convert_fp16_checked

    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                          [helper.make_tensor("c", TensorProto.FLOAT, [4], [1, 2, 3, 4])])
    m = ir.from_proto(helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(UsageError, match="cannot run the original model"):
        convert_fp16_checked(m, {"x": np.zeros((2, 3), np.float32)})  # 3 does not broadcast with 4


@pytest.mark.parametrize("options", [["--precision", "fp16"], ["--input-layout", "x=NHWC", "--precision", "fp16"]],
                         ids=["fp16", "fp16-and-layout"])
def test_a_failed_verification_writes_nothing_with_fp16_or_layouts(options, tmp_path, capsys):
    """--verify with tolerances the result misses: exit 1 and no model, with fp16 or changed edges as without
    (the failure used to be printed, then the model written and 0 returned)."""
    rng = np.random.default_rng(0)
    w = init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    src = tmp_path / "m.onnx"
    onnx.save(model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                     helper.make_node("Relu", ["c"], ["y"])],
                    [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 4, 8, 8])], [w]), src)
    out = tmp_path / "o.onnx"
    # tolerance 0: fp16 cannot meet it
    code = cli_main([str(src), "-o", str(out), *options, "--verify", "cpu", "--atol", "0", "--rtol", "0",
                     "--runs", "1", "--warmup", "1", "-q"])
    assert code == 1
    assert not out.exists()
    # the bisect command the failure suggests replays the rewrites only: it says so (it was given as
    # the way to find the rewrite, and finds none, the fp16 conversion being the cause)
    err = capsys.readouterr().err
    if "--input-layout" not in options:
        assert "to find the rewrite: python -m onnxopt bisect" in err
    assert "to find the rewrite" not in err or "it replays the rewrites without the fp16 conversion" in err
