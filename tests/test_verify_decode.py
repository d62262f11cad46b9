"""Generation compared (issue 30, point 4): `onnxopt verify --decode N` runs greedy generation with the
key/value cache on both decoders, each with its own cache, and compares token by token and the logits of
every step; a decoder with a cache is verified on inputs of sizes that agree (a real past from its own run)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from helpers import shared_zoo_model
from onnxopt import cli, optimize, verify
from onnxopt.errors import UsageError

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch", reason="the tiny decoders are exported from transformers (the export extra)")
pytest.importorskip("transformers", reason="the tiny decoders are exported from transformers (the export extra)")

from onnxopt.verify.decode import compare_generation, decoder_io, decoder_step_feeds  # noqa: E402


def _session(path):
    from onnxopt.verify.runtime import session

    return session(str(path), "cpu")


@pytest.fixture(scope="module")
def llama_kv(tmp_path_factory):
    """The zoo's tiny Llama decode step (legacy export: one token per run, past_key_values.N in) and onnxopt's
    ort-cpu result of it."""
    src = shared_zoo_model("llama-kv-legacy")
    out = tmp_path_factory.mktemp("decode") / "llama-kv.opt.onnx"
    optimize(str(src), target="ort-cpu", output=str(out))
    return src, out


def test_the_optimized_decoder_generates_the_same_tokens_for_64_steps_on_8_prompts(llama_kv):
    src, out = llama_kv
    io = decoder_io(_session(out))
    assert io.one_token and len(io.cache) == 4 and io.position_ids == "position_ids"
    res = compare_generation(_session(src), _session(out), steps=64)
    assert res["ok"] and res["prompts"] == 8 and res["tokens_compared"] == 512 and res["tokens_identical"] == 512
    assert res["first_divergence"] is None and res["logits"]["max_abs"] < 1e-4
    # the prompts make different continuations (the tokens depend on the prompt, not a constant)
    assert len({tuple(p["tokens"]) for p in res["per_prompt"]}) > 1


def _swap_layer0_cache(src, dst):
    """A decoder whose present.0.key and present.0.value are swapped: a cache written in the wrong slot, which
    one forward pass with an empty past cannot show."""
    m = onnx.load(str(src))
    outs = {o.name: o for o in m.graph.output}
    for n in m.graph.node:
        for i, name in enumerate(n.output):
            if name == "present.0.key":
                n.output[i] = "present.0.value.tmp"
            elif name == "present.0.value":
                n.output[i] = "present.0.key"
    for n in m.graph.node:
        for i, name in enumerate(n.output):
            if name == "present.0.value.tmp":
                n.output[i] = "present.0.value"
    for n in m.graph.node:  # readers of the old names inside the graph
        for i, name in enumerate(n.input):
            if name in outs and name.startswith("present.0."):
                n.input[i] = "present.0.value" if name.endswith("key") else "present.0.key"
    onnx.save(m, str(dst))


def test_a_cache_written_in_the_wrong_slot_is_caught_with_its_first_divergence(llama_kv, tmp_path):
    src, _ = llama_kv
    bad = tmp_path / "swapped.onnx"
    _swap_layer0_cache(src, bad)
    res = compare_generation(_session(src), _session(bad), steps=16)
    assert not res["ok"] and res["tokens_identical"] < res["tokens_compared"]
    first = res["first_divergence"]
    assert first is not None and first["original"] != first["optimized"]
    assert res["logits"]["max_abs"] > 1e-3
    # the step's text names it
    assert "first divergence: prompt" in verify.decode_text(res) and "FAILS" in verify.decode_text(res)


def test_verify_takes_decode_and_given_prompts_from_the_command_line(llama_kv, tmp_path, capsys):
    src, out = llama_kv
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3], [7, 8, 9, 10, 11]]))
    rep = tmp_path / "r.json"
    assert cli.main(["verify", str(src), str(out), "--decode", "6", "--decode-prompts", str(prompts), "--runs", "0",
                     "--json", str(rep)]) == 0
    dec = json.loads(rep.read_text())["providers"]["cpu"]["decode"]
    assert dec["prompts"] == 2 and dec["steps"] == 6 and dec["tokens_compared"] == 12 and dec["prompts_given"]
    assert [p["prompt_tokens"] for p in dec["per_prompt"]] == [3, 5]
    assert "generation: 12 of 12 tokens identical" in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    (["--decode", "-2"], "--decode -2"),
    (["--decode", "3", "--decode-prompts", "{missing}"], "cannot read it"),
    (["--decode", "3", "--decode-prompts", "{notjson}"], "not JSON"),
    (["--decode", "3", "--decode-prompts", "{outside}"], "outside the vocabulary"),
])
def test_bad_decode_settings_are_one_line_exit_2(llama_kv, tmp_path, capsys, args, words):
    src, out = llama_kv
    (tmp_path / "bad.txt").write_text("[[1, 2,")
    (tmp_path / "outside.json").write_text("[[1, 2, 100000]]")
    args = [a.format(missing=tmp_path / "none.json", notjson=tmp_path / "bad.txt", outside=tmp_path / "outside.json")
            for a in args]
    assert cli.main(["verify", str(src), str(out), "--runs", "0", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_decode_on_a_model_that_is_no_decoder_says_why(tmp_path):
    from helpers import model, tinfo
    from onnx import helper

    m = model([helper.make_node("Relu", ["x"], ["y"])], [tinfo("x", [2, 3])], [tinfo("y", [2, 3])])
    p = tmp_path / "relu.onnx"
    p.write_bytes(m.SerializeToString())
    with pytest.raises(UsageError, match="no input_ids input"):
        verify.verify(str(p), str(p), decode=2, latency=False)


def test_a_decoder_is_verified_on_a_real_cache_without_being_told_its_sizes(llama_kv):
    """Generated sizes do not agree for a decode step (mask = past + 1): its inputs come from its own run."""
    src, out = llama_kv
    feeds, how = decoder_step_feeds(_session(src), seed=0)
    assert feeds["attention_mask"].shape[1] == feeds["past_key_values.0.key"].shape[2] + 1 == 9
    assert np.abs(feeds["past_key_values.1.value"]).max() > 0  # a real cache, not zeros
    report = verify.verify(str(src), str(out), latency=False)
    assert report["ok"] and "decode step" in report["inputs"]["input_ids"]["source"]
