"""onnxopt.models.decoder_models: tiny decoders exported with and without a key/value cache match torch
on realistic feeds, their outputs follow their inputs, and their dynamic axes take other sizes. A
representative subset of scripts/oracles/decoder_exports.py's matrix (seconds; the dynamo export is
the slow one)."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest

needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "onnxruntime")),
    reason="needs torch, transformers and onnxruntime (the decoders are exported from transformers models)")
needs_onnxscript = pytest.mark.skipif(importlib.util.find_spec("onnxscript") is None,
                                      reason="the dynamo exporter needs onnxscript")

TOL = 1e-4
# (arch, form, exporter): GQA + cache through dynamo, QK-norm without cache through legacy, partial rotary
# and fused projections with cache through legacy
CASES = [
    pytest.param(("llama", "kv", "dynamo"), marks=needs_onnxscript, id="llama-kv-dynamo"),
    pytest.param(("qwen3", "prefill", "legacy"), id="qwen3-prefill-legacy"),
    pytest.param(("phi3", "kv", "legacy"), id="phi3-kv-legacy"),
]


@pytest.fixture(scope="module", params=CASES)
def exported(request, tmp_path_factory):
    """(arch, form, torch model, onnxruntime session, path) of one exported case (the zoo's build: seed 0,
    transformers' default attention)."""
    import onnxruntime as ort

    from onnxopt.models import decoder_models as dm

    arch, form, exporter = request.param
    model = dm.build_module(arch)
    path = dm.export_module(model, form, tmp_path_factory.mktemp("dec") / f"{arch}-{form}-{exporter}.onnx", exporter)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return arch, form, model, ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]), path


def _run(sess, feed):
    return dict(zip([o.name for o in sess.get_outputs()],
                    sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})))


def _assert_matches_torch(form, model, sess, feed):
    from onnxopt.models import decoder_models as dm

    ref, got = dm.torch_outputs(form, model, feed), _run(sess, feed)
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert got[name].shape == r.shape, name
        np.testing.assert_allclose(got[name], r, rtol=0, atol=TOL, err_msg=name)


@needs_torch
def test_export_matches_torch_on_feeds(exported):
    """genai's input/output names, IR <= 13, and torch's outputs within 1e-4 on padded feeds."""
    from onnxopt.models import decoder_models as dm

    arch, form, model, sess, path = exported
    proto = onnx.load(str(path), load_external_data=False)
    assert proto.ir_version <= 13
    names, outs = dm.io_names(form, 2)
    assert [i.name for i in sess.get_inputs()] == names
    assert [o.name for o in sess.get_outputs()] == outs
    feed = dm.feeds(form, model)
    assert feed["attention_mask"].min() == 0  # a padded row: the masking path runs
    _assert_matches_torch(form, model, sess, feed)
    if form == "kv":
        assert feed["past_key_values.0.key"].shape == (2, model.config.num_key_value_heads, dm.KV_PAST, 16)
        assert _run(sess, feed)["present.1.value"].shape[2] == dm.KV_PAST + 1


@needs_torch
def test_dynamic_axes_take_other_sizes(exported):
    """Another batch and sequence (prefill) or past length (kv), one longer and one shorter than traced."""
    from onnxopt.models import decoder_models as dm

    arch, form, model, sess, _ = exported
    for batch, length in ((3, 10), (1, 5)):
        _assert_matches_torch(form, model, sess, dm.feeds(form, model, batch, length, seed=1))


@needs_torch
def test_logits_follow_tokens_and_past(exported):
    """One token changed moves the logits (prefill: at the last position, through attention only); kv: the
    cache of another prefix, same new token, moves them too."""
    from onnxopt.models import decoder_models as dm

    arch, form, model, sess, _ = exported
    feed = dm.feeds(form, model)
    base = _run(sess, feed)["logits"]
    ids = feed["input_ids"].copy()
    col = 0 if form == "kv" else ids.shape[1] // 2
    ids[0, col] = 3 + (ids[0, col] - 3 + 1) % (model.config.vocab_size - 3)
    moved = _run(sess, {**feed, "input_ids": ids})["logits"]
    assert np.abs(moved[0, -1] - base[0, -1]).max() > 1e-2
    np.testing.assert_array_equal(moved[1], base[1])  # rows do not mix
    if form == "kv":
        other = dm.feeds(form, model, seed=2)
        past = {k: v for k, v in other.items() if k.startswith("past_key_values.")}
        assert np.abs(_run(sess, {**feed, **past})["logits"] - base).max() > 1e-2


@needs_torch
def test_kv_feeds_past_is_the_prefix_cache():
    """The kv feeds' past is the model's real cache: one decode step gives the logits that the whole
    left-padded sequence gives at its last position without a cache (mistral: the sliding window bites)."""
    import torch

    from onnxopt.models import decoder_models as dm

    model = dm.build_module("mistral")
    feed = dm.feeds("kv", model, 2, 11, seed=3)
    ids, mask, pos, new = dm.kv_prefix(model.config.vocab_size, 2, 11, seed=3)
    step = dm.torch_outputs("kv", model, feed)["logits"][:, -1]
    whole_mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    with torch.no_grad():
        whole = model(input_ids=torch.from_numpy(np.concatenate([ids, new], axis=1)),
                      attention_mask=torch.from_numpy(whole_mask),
                      position_ids=torch.from_numpy(np.concatenate([pos, feed["position_ids"]], axis=1)),
                      use_cache=False).logits[:, -1].numpy()
    np.testing.assert_allclose(step, whole, atol=1e-4)
    assert feed["position_ids"][0, 0] == 11 and feed["position_ids"][1, 0] == mask[1].sum()


@needs_torch
def test_zoo_registers_the_decoders(exported):
    """Every tiny decoder is a zoo model (``<arch>-<form>-<exporter>``); the zoo's inputs of this one (64
    tokens, a past of 64) pass the zoo's check that every output follows the inputs."""
    from onnxopt.models import decoder_models as dm
    from onnxopt.models import zoo

    names = {s.name for s in zoo.SPECS if s.family == "decoder"}
    assert names == {f"{a}-{f}-{e}" for a in dm.ARCHS for f in dm.ZOO_FORMS for e in dm.EXPORTERS}
    arch, form, model, sess, path = exported
    spec = zoo.get(path.stem)
    feed = spec.inputs(path, 0)
    assert list(feed) == [i.name for i in sess.get_inputs()]
    assert feed["attention_mask"].shape[1] == dm.ZOO_LENGTH + (form == "kv")
    figures = zoo.check_outputs_vary(spec, path)
    assert set(figures) == {o.name for o in sess.get_outputs()}


def test_bench_configs_are_real_sizes():
    """The GPU benchmark configs (not built here): grouped-query, ~1B and ~0.5B parameters."""
    from onnxopt.models import decoder_models as dm

    cfgs = dm.bench_configs()
    assert set(cfgs) == {"llama-1b", "qwen2-0.5b"}
    for name, (arch, c) in cfgs.items():
        assert arch in dm.ARCHS and c["num_key_value_heads"] < c["num_attention_heads"]
        head = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        layer = c["hidden_size"] * head * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2) \
            + 3 * c["hidden_size"] * c["intermediate_size"]
        params = c["num_hidden_layers"] * layer + c["vocab_size"] * c["hidden_size"]
        assert (0.9e9 < params < 1.6e9) if name == "llama-1b" else (0.3e9 < params < 0.7e9), (name, params)


@needs_torch
def test_the_command_line_exports_at_an_opset_with_config_entries_and_writes_feeds(tmp_path, capsys):
    """``--opset 23`` (the standard ops portable fuses into), ``--config`` over the tiny config, ``--feeds``
    of --batch rows and --length tokens; a --config that is not a JSON object is one line, exit 2."""
    from onnxopt.models import decoder_models as dm

    out, npz = tmp_path / "m.onnx", tmp_path / "f.npz"
    assert dm.main(["llama", "prefill", str(out), "--opset", "23", "--config", '{"num_hidden_layers": 1}',
                    "--feeds", str(npz), "--batch", "1", "--length", "7"]) == 0
    model = onnx.load(str(out))
    assert [(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] == [("", 23)]
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == 1  # (one layer)
    with np.load(npz) as f:
        assert sorted(f.files) == sorted(i.name for i in model.graph.input) and f["input_ids"].shape == (1, 7)
    with pytest.raises(SystemExit) as exc:
        dm.main(["llama", "prefill", str(out), "--config", "[1]"])
    assert exc.value.code == 2 and "not a JSON object" in capsys.readouterr().err
