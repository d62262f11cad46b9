"""``--genai HF_FOLDER`` (onnxopt/ir/genai.py): an exported decoder, optimized (GroupQueryAttention), written
with genai_config.json and the tokenizer, runs in onnxruntime-genai and generates what transformers generates.

The decoder: the tiny Llama-style Hugging Face folder of scripts/bench/_genai.py (the peer's test model),
exported in the chunk form (models/decoder_models.py: the prompt with an empty past, then one token at a
time), batch fixed to 1 (``--input-shape input_ids=1,sequence``: onnxruntime's GroupQueryAttention takes
several new tokens after a past only at batch 1). Skips, saying why, without onnxruntime-genai or torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from scripts.bench import _genai

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (setup.cfg's genai extra: "
                                                     "pip install -e '.[genai]')")
pytest.importorskip("torch", reason="the decoder is exported from transformers (the export extra)")
pytest.importorskip("tokenizers", reason="the test folder's tokenizer is made with tokenizers")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def main(argv):\n    parser = "
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the Hugging Face folder, its chunk export, transformers' greedy tokens for PROMPT)."""
    root = tmp_path_factory.mktemp("genai-out")
    hf_dir = _genai.write_tiny_llama(root / "hf")
    _genai.skip_torchvision_meta_registrations()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxopt.models import decoder_models

    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    path = decoder_models.export_module(hf, "chunk", root / "chunk.onnx", "legacy")
    ids = AutoTokenizer.from_pretrained(hf_dir)(PROMPT).input_ids
    return hf_dir, path, ids, _genai.transformers_greedy(hf_dir, [ids], NEW_TOKENS)[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_genai_runs_the_optimized_decoder_and_generates_transformers_tokens(exported, tmp_path):
    hf_dir, path, ids, expected = exported
    out = tmp_path / "out"
    out.mkdir()
    r = _cli(path, "-o", out / "model.onnx", "--target", "ort-cpu", "--input-shape", "input_ids=1,sequence",
             "--genai", hf_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {"model.onnx", "genai_config.json", "tokenizer.json",
                                               "tokenizer_config.json"}
    proto = onnx.load(out / "model.onnx")
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "Softmax" not in ops
    cfg = json.loads((out / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert (dec["num_hidden_layers"], dec["num_attention_heads"], dec["num_key_value_heads"], dec["head_size"]) \
        == (2, 4, 2, 16)
    assert dec["inputs"]["position_ids"] == "position_ids" and cfg["search"]["past_present_share_buffer"] is False
    assert cfg["model"]["eos_token_id"] == 1 and cfg["model"]["context_length"] == 256

    model = _genai.load_model(out, threads=1)
    assert list(og.Tokenizer(model).encode(PROMPT)) == ids
    assert _genai.greedy_tokens(model, [ids], NEW_TOKENS) == [expected]


def test_the_original_export_generates_the_same_in_genai(exported, tmp_path):
    """The reference the optimized folder is held to: the unoptimized export with the same config."""
    hf_dir, path, ids, expected = exported
    out = tmp_path / "orig"
    out.mkdir()
    from onnxopt import optimize

    optimize(str(path), str(out / "model.onnx"), target="portable", genai=str(hf_dir))
    model = _genai.load_model(out, threads=1)
    assert _genai.greedy_tokens(model, [ids], NEW_TOKENS) == [expected]


def test_bad_genai_input_is_one_line_and_nothing_is_written(exported, tmp_path):
    from onnx import TensorProto, helper

    hf_dir, path, _, _ = exported
    plain = tmp_path / "plain.onnx"  # no cache: not what genai runs
    graph = helper.make_graph([helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), plain)
    for model, folder, want in ((path, tmp_path / "missing", "not a folder"), (path, tmp_path, "no config.json"),
                                (plain, hf_dir, "not a decoder with onnxruntime-genai's names")):
        r = _cli(model, "-o", tmp_path / "o.onnx", "--genai", folder)
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.onnx"]
    same = tmp_path / "same"  # the output beside the folder's own tokenizer: never written over
    shutil.copytree(hf_dir, same)
    before = {p.name: p.read_bytes() for p in same.iterdir()}
    r = _cli(path, "-o", same / "model.onnx", "--genai", same)
    assert r.returncode == 2 and "never overwrites what it reads" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in same.iterdir()} == before


def test_shared_buffers_only_where_nothing_else_reads_the_past_length():
    """past_present_share_buffer: every past read by GroupQueryAttention alone (a Shape of its batch is
    harmless, one of its length is not), every present the op's output."""
    import onnx_ir as ir

    from onnxopt.ir.genai import shares_buffers

    def model(shape_of=None):
        past_k = ir.Value(name="past_key_values.0.key", type=ir.TensorType(ir.DataType.FLOAT16),
                          shape=ir.Shape(["batch", 2, "past", 8]))
        past_v = ir.Value(name="past_key_values.0.value", type=ir.TensorType(ir.DataType.FLOAT16),
                          shape=ir.Shape(["batch", 2, "past", 8]))
        q = ir.Value(name="q", type=ir.TensorType(ir.DataType.FLOAT16), shape=ir.Shape(["batch", 1, 32]))
        lens = ir.Value(name="seqlens_k", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape(["batch"]))
        total = ir.Value(name="total", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
        gqa = ir.node("GroupQueryAttention", [q, q, q, past_k, past_v, lens, total], domain="com.microsoft",
                      num_outputs=3, attributes={"num_heads": 4, "kv_num_heads": 2})
        nodes, outs = [gqa], [gqa.outputs[0], gqa.outputs[1], gqa.outputs[2]]
        gqa.outputs[1].name, gqa.outputs[2].name, gqa.outputs[0].name = "present.0.key", "present.0.value", "y"
        if shape_of is not None:
            shape = ir.node("Shape", [past_k], attributes=shape_of)
            shape.outputs[0].name = "s"
            nodes.append(shape)
            outs.append(shape.outputs[0])
        return ir.Model(ir.Graph([q, past_k, past_v, lens, total], outs, nodes=nodes,
                                 opset_imports={"": 18, "com.microsoft": 1}), ir_version=10)

    assert shares_buffers(model())
    assert shares_buffers(model({"end": 1}))  # the batch
    assert not shares_buffers(model({"start": 2, "end": 3}))  # the past's length
    assert not shares_buffers(model({}))  # the whole shape
