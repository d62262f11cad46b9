"""onnxruntime-genai as the peer (scripts/bench/_genai.py): its model builder on the tiny Llama-style Hugging
Face folder writes the graph onnxopt's ``--genai`` output is measured against (GroupQueryAttention with the
rotary inside, shared past/present buffers in BNSH), and its generator's greedy tokens equal transformers'
on the same weights (fp32). That generation is the reference onnxopt's own genai folder is tested against.

Skips, saying why, where onnxruntime_genai (setup.cfg's ``genai`` extra), torch, transformers or tokenizers
cannot be imported. About 20 s on a 2-core machine, most of it the builder's imports in its child process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from scripts.bench import _genai

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (setup.cfg's genai extra: "
                                                     "pip install -e '.[genai]'); the peer's tests need it")
pytest.importorskip("torch", reason="the tiny Hugging Face model is built with torch (setup.cfg's export extra)")
pytest.importorskip("transformers", reason="the tiny Hugging Face model is built with transformers")
pytest.importorskip("tokenizers", reason="the tiny model's tokenizer is trained with tokenizers")

PROMPT = "def main(argv):\n    parser = "
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    hf_dir = _genai.write_tiny_llama(root / "hf")
    res = _genai.build(hf_dir, root / "genai", precision="fp32", execution_provider="cpu", timeout=300)
    assert res["ok"], res.get("error")
    return hf_dir, root / "genai", res


def test_builder_writes_gqa_with_rotary_inside_and_shared_bnsh_cache(built):
    hf_dir, out_dir, res = built
    assert res["command"].startswith(f"python -m onnxruntime_genai.models.builder -i {hf_dir} -o {out_dir} "
                                     "-p fp32 -e cpu -c ")
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(res["files"])
    assert res["onnxruntime_genai"] == og.__version__
    s = _genai.graph_summary(out_dir)
    assert s["ops"]["com.microsoft:GroupQueryAttention"] == 2  # one per layer
    assert s["ops"]["com.microsoft:SkipSimplifiedLayerNormalization"] == 4  # 2 per layer, the last one the final norm
    assert "com.microsoft:RotaryEmbedding" not in s["ops"]  # the rotary is inside GQA
    assert s["ops"]["MatMul"] == 11  # per layer: packed QKV, o_proj, gate, up, down; and the LM head
    for gqa in s["attention"]:
        assert gqa["op"] == "GroupQueryAttention"
        a = gqa["attributes"]
        assert (a["num_heads"], a["kv_num_heads"], a["do_rotary"], a["rotary_interleaved"]) == (4, 2, 1, 0)
        assert gqa["inputs"][1:3] == ["", ""] and gqa["inputs"][7:9] == ["cos_cache", "sin_cache"]
    inputs = {v["name"]: v for v in s["inputs"]}
    assert list(inputs)[:2] == ["input_ids", "attention_mask"] and "position_ids" not in inputs
    for i in range(2):
        for kind in ("key", "value"):
            assert inputs[f"past_key_values.{i}.{kind}"]["shape"] == ["batch_size", 2, "past_sequence_length",
                                                                      "kv_cache_dim"]
    outputs = {v["name"]: v for v in s["outputs"]}
    assert outputs["logits"]["shape"] == ["batch_size", "sequence_length", 512]
    assert outputs["present.1.value"]["shape"] == ["batch_size", 2, "total_sequence_length", "kv_cache_dim"]
    cfg = s["genai_config"]
    dec = cfg["model"]["decoder"]
    assert dec["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                             "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    assert dec["outputs"] == {"logits": "logits", "present_key_names": "present.%d.key",
                              "present_value_names": "present.%d.value"}
    assert (dec["head_size"], dec["num_key_value_heads"], dec["num_attention_heads"], dec["num_hidden_layers"]) == \
        (16, 2, 4, 2)
    assert cfg["model"]["type"] == "llama" and cfg["model"]["context_length"] == 256
    assert cfg["search"]["past_present_share_buffer"] is True and cfg["search"]["do_sample"] is False
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["model"]["eos_token_id"], cfg["model"]["bos_token_id"], cfg["model"]["pad_token_id"]) == \
        (hf_config["eos_token_id"], hf_config["bos_token_id"], hf_config["pad_token_id"])


def test_genai_greedy_tokens_equal_transformers_greedy(built):
    hf_dir, out_dir, _ = built
    _genai.skip_torchvision_meta_registrations()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = hf_tok(PROMPT).input_ids
    model = _genai.load_model(out_dir, threads=1)
    assert list(og.Tokenizer(model).encode(PROMPT)) == ids  # genai's tokenizer reads the same tokenizer.json

    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    expected = gen.sequences[0, len(ids):].tolist()
    # each step's winner leads by more than fp32 noise, so equal tokens are a real check
    for scores in gen.scores:
        top2 = torch.topk(scores[0], 2).values
        assert float(top2[0] - top2[1]) > 1e-4

    assert _genai.greedy_tokens(model, [ids], NEW_TOKENS) == [expected]
    # the prefill's logits too (the generator holds the last position's)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(np.asarray(generator.get_logits()).reshape(-1), ref, atol=1e-4, rtol=1e-4)


def test_batched_greedy_rows_match_single_rows(built):
    _, out_dir, _ = built
    model = _genai.load_model(out_dir, threads=1)
    rows = [[5, 60, 7, 200, 9], [300, 8, 71, 6, 50]]
    together = _genai.greedy_tokens(model, rows, NEW_TOKENS)
    assert together == [_genai.greedy_tokens(model, [r], NEW_TOKENS)[0] for r in rows]


def test_time_generation_separates_prefill_from_decode(built):
    _, out_dir, _ = built
    r = _genai.time_generation(out_dir, prompt_tokens=32, new_tokens=8, batch=2, repeats=2, warmup=1, threads=1)
    assert r["device"] == "CPU" and r["onnxruntime_genai"] == og.__version__
    # genai loads the onnxruntime package's library (it bundles none)
    assert "libonnxruntime.so" in r["onnxruntime_library"] and r["onnxruntime"] in r["onnxruntime_library"]
    assert len(r["samples"]["prefill_s"]) == len(r["samples"]["decode_s"]) == 2 and r["samples"]["decode_steps"] == 7
    assert r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0
    assert r["decode_tokens_per_s"] == pytest.approx(
        float(np.median([2 * 7 / d for d in r["samples"]["decode_s"]])), rel=1e-3)
    json.dumps(r)  # JSON-able
    with pytest.raises(ValueError, match="context length 256"):
        _genai.time_generation(out_dir, prompt_tokens=200, new_tokens=100)


def test_builder_failure_is_one_line():
    stderr = ("Extra options: {}\nLoading weights: 100%|####| 21/21\rLoading weights: 100%\n"
              "Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n"
              "    raise NotImplementedError(f\"The {hf_name} model is not currently supported.\")\n"
              "NotImplementedError: The /x model is not currently supported.\n")
    assert _genai._error_line(stderr) == "NotImplementedError: The /x model is not currently supported."
    assert _genai._error_line("Loading 10%\rLoading 100%\n") == "Loading 100%"
    assert _genai.build("/nonexistent-hf", "/tmp/unused")["error"] == \
        "/nonexistent-hf: not a Hugging Face model folder (no config.json)"
    assert "one of fp32" in _genai.build("/nonexistent-hf", "/tmp/unused", precision="fp64")["error"]


def test_command_line_usage_errors_exit_2(tmp_path, capsys):
    assert _genai.main(["build", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
    assert _genai.main(["time", str(tmp_path)]) == 2
    assert "not a genai model folder" in capsys.readouterr().err
