"""scripts/oracles/optimum_exports.py: the tiny decoders exported by optimum-cli in optimum's own environment.

What runs without optimum (the command line it builds, the config translation for transformers 4.x, the
exporter's error line, the table from a recorded report, the exit without the environment) is tested
everywhere; the export itself needs optimum-onnx's environment (``python -m scripts.bench._optimum setup``)
and skips with the reason where it is absent (CI)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import optimum_mark

from scripts.oracles import optimum_exports as oe


needs_optimum = optimum_mark()
needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "onnxruntime")),
    reason="needs torch, transformers and onnxruntime")


def test_export_command_is_the_documented_one():
    assert oe.export_argv("hf", "kv", "out") == ["export", "onnx", "--model", "hf", "--task",
                                                 "text-generation-with-past", "out"]
    assert oe.export_argv("hf", "prefill", "out")[5] == "text-generation"
    with pytest.raises(ValueError, match="unknown form"):
        oe.export_argv("hf", "chunk", "out")


def test_rope_parameters_become_transformers_4_keys():
    """transformers 5's rope_parameters (Phi-3's partial rotary) as 4.x reads them: top-level keys."""
    got = oe.config_entries({"hidden_size": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                    "partial_rotary_factor": 0.75}})
    assert got == {"hidden_size": 64, "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    assert oe.config_entries({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="llama3"):
        oe.config_entries({"rope_parameters": {"rope_type": "llama3"}})


def test_job_takes_every_tiny_config_translated():
    pytest.importorskip("onnx")
    from onnxopt.models import decoder_models as dm

    archs = oe.job_archs(list(dm.ARCHS))
    assert set(archs) == set(dm.ARCHS)
    assert archs["phi3"]["config"]["partial_rotary_factor"] == 0.75 and "rope_parameters" not in archs["phi3"]["config"]
    assert (archs["gemma3"]["config_class"], archs["gemma3"]["model_class"]) == ("Gemma3TextConfig", "Gemma3ForCausalLM")


def test_exporter_error_is_the_traceback_last_line():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "ValueError: Trying to export a foo model, that is a custom or unsupported architecture\n"
            "some trailing log line\n")
    assert oe.exporter_error(text, 1).startswith("ValueError: Trying to export a foo model")
    assert oe.exporter_error("just a line\n", 1) == "just a line"
    assert oe.exporter_error("", 3) == "optimum-cli exited with 3"


REPORT = {"fusions": {
    "group_query_attention": {"key": "group_query_attention", "hits": 0, "missed": 2,
                              "reasons": {"not an attention output": 62, "the mask differs by head": 2}},
    "group_query_attention_present": {"hits": 0, "missed": 0, "reasons": {}},
    "rotary_embedding": {"hits": 4, "missed": 0, "reasons": {}},
    "rms_normalization": {"hits": 4, "missed": 2, "reasons": {"no residual Add precedes it": 2}},
    "packed_projections": {"hits": 4, "missed": 0, "reasons": {}}},
    "op_types_after": {"com.microsoft.RotaryEmbedding": 4, "com.microsoft.SkipSimplifiedLayerNormalization": 4,
                       "MatMul": 9}}


def test_fusions_and_table_from_a_recorded_report():
    """The misses' own reasons come before a reason counted more often than the misses (the pattern's)."""
    fu = oe.fusion_summary(REPORT)
    assert fu["gqa"] == {"hits": 0, "missed": 2, "reasons": REPORT["fusions"]["group_query_attention"]["reasons"]}
    assert fu["rotary"]["hits"] == 4 and fu["ops"] == {"RotaryEmbedding": 4, "SkipSimplifiedLayerNormalization": 4}
    cell = oe._cell(fu["gqa"])
    assert cell.startswith("0/2 (the mask differs by head x2; not an attention output x62")
    rows = [{"arch": "llama", "form": "kv", "status": "ok", "nodes": 625, "max_abs_diff": 1e-6,
             "max_abs_diff_other_sizes": 2e-6, "fusions": fu, "verify": "outputs agree on cpu",
             "decode": {"tokens_compared": 128, "tokens_identical": 128}},
            {"arch": "llama", "form": "kv", "status": "ok", "input_shape": "input_ids=1,sequence_length",
             "fusions": fu, "max_abs_diff": 1e-6, "max_abs_diff_other_sizes": 2e-6},
            {"arch": "foo", "form": "prefill", "status": "error", "error": "ValueError: a | b"}]
    meta = {"machine": "m", "optimum": {"optimum-onnx": "0.1.0"}, "onnxruntime": "1", "target": "ort-cpu", "decode": 16}
    md = oe.markdown(rows, meta).splitlines()
    table = [ln for ln in md if ln.startswith("| llama") or ln.startswith("| foo")]
    assert len(table) == 3
    assert "| 4/4 |" in table[0] and "128/128 tokens" in table[0] and "2.0e-06" in table[0]
    assert "RotaryEmbedding 4, SkipSimplifiedLayerNormalization 4" in table[0]
    assert "--input-shape input_ids=1,sequence_length" in table[1]
    assert table[2].endswith("| ValueError: a / b |")  # (a | in the error kept out of the table's cells)


def test_without_optimum_environment_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from scripts.bench import _optimum

    monkeypatch.delenv(_optimum.SITE_ENV, raising=False)
    monkeypatch.setenv(_optimum.VENV_ENV, str(tmp_path / "no-venv"))
    assert oe.main(["--only", "llama", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scripts.bench._optimum setup" in err[0]
    assert not (tmp_path / "out").exists()


def test_reuse_needs_a_kept_run(tmp_path):
    with pytest.raises(SystemExit):
        oe.main(["--reuse", "--keep", str(tmp_path)])


@needs_torch
def test_batch_one_names_the_sequence_symbol(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    def model(dims):
        x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims)
        y = helper.make_tensor_value_info("y", TensorProto.INT64, dims)
        g = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["y"])], "g", [x], [y])
        path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.onnx"
        onnx.save(helper.make_model(g), str(path))
        return path

    assert oe.batch_one(model(["batch_size", "sequence_length"])) == "input_ids=1,sequence_length"
    assert oe.batch_one(model([1, "sequence_length"])) is None


@needs_optimum
@needs_torch
def test_optimum_exports_llama_with_cache_and_onnxopt_rotates_it(tmp_path):
    """optimum-cli's export of the tiny Llama with the cache agrees with transformers (its own environment's),
    takes decoder_models' names, and onnxopt fuses its four rotary embeddings (transformers 4.x's expanded
    inv_freq) and verifies it over 8 generated prompts; at batch 1 its two attentions become GroupQueryAttention."""
    res = oe.export_all(["llama"], ["kv"], tmp_path)
    (rec,) = res["rows"]
    assert rec["status"] == "ok", rec
    assert rec["max_abs_diff"] < oe.TOLERANCE and rec["max_abs_diff_other_sizes"] < oe.TOLERANCE
    assert rec["inputs"][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert rec["outputs"][:2] == ["logits", "present.0.key"]
    oe.optimize_and_verify(rec, tmp_path, "ort-cpu", 4)
    assert rec["fusions"]["rotary"]["hits"] == 4, rec["fusions"]["rotary"]
    assert rec["verify_ok"] and rec["decode"]["tokens_identical"] == rec["decode"]["tokens_compared"] > 0
    assert json.dumps(rec)  # (the row is what the JSON records)
    # at batch 1, GroupQueryAttention: transformers 4.57's sdpa mask (its head axis read through the Slice of
    # the keys and the Expand; the Slice's end, the cache's length, rebuilt from the op's own T)
    one = {**rec, "input_shape": oe.batch_one(rec["path"])}
    oe.optimize_and_verify(one, tmp_path, "ort-cpu", 4)
    assert one["fusions"]["gqa"]["hits"] == 2, one["fusions"]["gqa"]
    assert one["verify_ok"] and one["decode"]["tokens_identical"] == one["decode"]["tokens_compared"] > 0, one
