"""scripts/bench/targets.py and the benchmark builders of onnxopt.models.transformers_models, on tiny
configs and the CPU provider (seconds)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ["-m", "scripts.bench.targets"]


from scripts.bench import targets as bt

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="needs torch and transformers")


# ---------------------------------------------------------------------------------------------
# Builders


@needs_torch
@pytest.mark.parametrize("kind,exporter,attn", [
    ("bert-base", "legacy", "eager"), ("gpt2-small", "legacy", "sdpa"), ("gpt2-past", "legacy", "eager"),
    ("llama", "legacy", "sdpa"), ("gpt2-past", "dynamo", "sdpa"),
])
def test_bench_builders_match_torch(tmp_path, kind, exporter, attn):
    """Each benchmark kind exports (tiny config) with the attention asked for, IR <= 13, dynamic axes, and
    gives torch's outputs on padded inputs at another batch and length than it was traced at."""
    import onnxruntime as ort
    import torch

    from onnxopt.models import transformers_models as tm

    cfg = bt.TINY[kind]
    path = tm.export(kind, tmp_path / "m.onnx", exporter, attn=attn, config=cfg)
    proto = onnx.load(str(path))
    assert proto.ir_version <= 13
    names, outs = tm.bench_io_names(kind, cfg)
    assert [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}] \
        == list(names)
    assert [o.name for o in proto.graph.output] == list(outs)
    module = tm.wrap_bench(kind, tm.build_bench_module(kind, attn=attn, config=cfg))
    assert module.inner.config._attn_implementation == attn
    feeds = tm.bench_feeds(kind, 3, 24, seed=4, config=cfg, past=20)
    if "attention_mask" in feeds:
        assert feeds["attention_mask"].min() == 0  # padded rows: the masking path is exercised
    with torch.no_grad():
        ref = [t.numpy() for t in module(*[torch.from_numpy(feeds[n]) for n in names])]
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    if kind == "gpt2-past":
        assert got[0].shape[:2] == (3, 1) and got[1].shape[2] == 21  # presents: past + the new token


@needs_torch
def test_bench_builder_refuses_unknown_attention(tmp_path):
    from onnxopt.models import transformers_models as tm

    with pytest.raises(ValueError, match="attention implementation"):
        tm.build_bench_module("llama", attn="flash", config=bt.TINY["llama"])
    with pytest.raises(ValueError, match="config="):
        tm.export("bert", tmp_path / "x.onnx", config={"hidden_size": 8})


@needs_torch
def test_existing_builder_unchanged(tmp_path):
    """The zoo's bert-legacy is built as before (same bytes as the cached one, when there is one)."""
    from onnxopt.models import transformers_models as tm
    from onnxopt.models.cache import cache_dir

    cached = cache_dir() / "bert-legacy.onnx"
    if not cached.exists():
        pytest.skip("no zoo bert-legacy in the cache")
    path = tm.export("bert", tmp_path / "bert-legacy.onnx", "legacy")
    assert path.read_bytes() == cached.read_bytes()


# ---------------------------------------------------------------------------------------------
# Pieces


def test_fidelity_bounds():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 50)).astype(np.float32) * 4
    hidden = rng.standard_normal((2, 5, 8)).astype(np.float32)
    ref = [("logits", logits), ("hidden", hidden)]
    same = bt.fidelity(ref, ref, "fp32")
    assert same["ok"] and same["cosine"] == pytest.approx(1.0) and same["err_range"] == 0 and same["top1"] == 1.0
    noisy = [("logits", (logits + rng.standard_normal(logits.shape) * 1e-2).astype(np.float32)), ("hidden", hidden)]
    f16 = bt.fidelity(ref, noisy, "fp16")
    assert f16["ok"], f16
    f32 = bt.fidelity(ref, noisy, "fp32")
    assert not f32["ok"] and "logits" in f32["why"]  # 1e-2 noise is beyond fp32 tolerance
    # top-1: a flipped argmax at a padded position does not count
    flipped = logits.copy()
    flipped[1, 4] = -flipped[1, 4]
    mask = np.ones((2, 5), np.int64)
    mask[1, 4] = 0
    f = bt.fidelity([("logits", logits)], [("logits", flipped)], "fp16", mask)
    assert f["outputs"]["logits"]["top1"] == 1.0
    f = bt.fidelity([("logits", logits)], [("logits", flipped)], "fp16")
    assert f["outputs"]["logits"]["top1"] == pytest.approx(0.9)
    bad = bt.fidelity([("y", hidden)], [("y", np.full_like(hidden, np.nan))], "fp16")
    assert not bad["ok"] and "non-finite" in bad["why"]
    shape = bt.fidelity([("y", hidden)], [("y", hidden[:1])], "fp16")
    assert not shape["ok"] and "shape" in shape["why"]


def test_parts_cover_every_model_once():
    models = [m for m in bt.MODELS if "full" in m.sets]
    for k in (1, 3, 6, 8):
        parts = bt.split_parts(models, k)
        names = [m.name for p in parts for m in p]
        assert sorted(names) == sorted(m.name for m in models)
        loads = [sum(m.weight for m in p) for p in parts]
        assert max(loads) - min(loads) <= max(m.weight for m in models)
    core = [m.name for m in bt.MODELS if "core" in m.sets]
    assert {"bert-base-eager-legacy", "gpt2-small-eager-legacy", "gpt2-past-eager-legacy", "resnet50-legacy",
            "minilm-legacy", "ppocrv4-det", "mobilenet_v2-legacy"} <= set(core)
    assert any(n.startswith("llama-") for n in core) and any("sdpa-dynamo" in n for n in core)
    zoo = [m.name for m in bt.MODELS if "zoo" in m.sets]
    assert {"bert-legacy", "gpt2-dynamo", "minilm-legacy", "resnet50-legacy"} <= set(zoo)
    assert not any(m.startswith(("bert-base", "gpt2-small")) for m in zoo)  # small enough for a small CPU


def test_provider_options():
    assert bt.parse_option("cuda:prefer_nhwc=1", "cuda") == ("prefer_nhwc", "1")
    assert bt.parse_option("prefer_nhwc=1", "cuda") == ("prefer_nhwc", "1")
    with pytest.raises(ValueError, match="target's"):
        bt.parse_option("cpu:x=1", "cuda")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bt.parse_option("prefer_nhwc", "cuda")
    assert bt._option_sets(["default", "prefer_nhwc=1,enable_cuda_graph=0"], "cuda") == (
        ("default", {}), ("prefer_nhwc=1,enable_cuda_graph=0", {"prefer_nhwc": "1", "enable_cuda_graph": "0"}))


# ---------------------------------------------------------------------------------------------
# End to end


def test_bench_one_tool_failure_is_a_row(tmp_path):
    """A tool that fails is a row with its one-line error; the others are measured (kernels, latency,
    fidelity) at every batch. (Each tool call is a subprocess of ~1.3 s here: the failing tool fails at
    fp32 only, and onnxopt-fixed's one file per batch is checked by test_fp32_rows_only_at_the_batches_asked,
    which runs it.)"""
    broken = bt.BTool("broken", "scripts.bench.targets:no_such_setup", "fails", peer=True, precisions=("fp32",))
    tools = [bt.get_tool("onnxopt"), bt.get_tool("ort-extended"), broken]
    opts = bt.Options(target="ort-cpu", precisions=("fp32", "fp16"), runs=3, warmup=1, min_rounds=2,
                      latency_budget=2, tiny=True, timeout=120, jobs=2)  # jobs: optimize/evaluate side by side
    res = bt.bench_one(bt.get_model("tinyconv"), tools, opts, tmp_path / "cache", tmp_path / "work", lambda s: None)
    v = res["variants"]
    assert v["broken/fp32"]["status"] == "error" and "no_such_setup" in v["broken/fp32"]["error"]
    assert "\n" not in v["broken/fp32"]["error"]
    assert v["onnxopt/fp32"]["status"] == "ok" and v["ort-extended/fp32"]["status"] == "ok"
    assert "broken/fp16" not in v  # a tool's precisions are honoured
    assert v["onnxopt/fp16"]["status"] == "ok" or "precision" in v["onnxopt/fp16"]["error"]
    assert res["batches"] == [1, 4]
    for b in (1, 4):
        m = res["measurements"][f"{b}|default"]
        for name in ("original", "onnxopt/fp32", "ort-extended/fp32", "ort-extended/fp16"):
            row = m["rows"][name]
            assert row["kernels"] > 0 and row["by_provider"]["CPUExecutionProvider"] == row["kernels"]
            assert row["latency"]["median_ms"] > 0 and row["latency"]["rounds"] >= 2
            assert row["fidelity"]["ok"], (name, row["fidelity"])
        assert m["rows"]["ort-extended/fp16"]["fidelity"]["err_range"] > 0  # fp16 really ran
        assert m["best_peer"]["fp32"]["variant"] == "ort-extended/fp32"
        assert "x_best_peer" in m["rows"]["onnxopt/fp32"]["latency"]
        assert "broken/fp32" not in m["rows"]
    text = bt.render_markdown({"meta": bt._meta(opts, [], tools), "models": {"tinyconv": res}})
    assert "no_such_setup" in text and "| tinyconv | 4 | default | fp32 |" in text


@needs_torch
def test_cli_parts_and_merge(tmp_path):
    """The command line on a tiny GPT-2 with the transformer peers, then --merge of two runs."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    common = [sys.executable, *SCRIPT, "--target", "ort-cpu", "--tiny", "--cache", str(cache),
              "--runs", "3", "--warmup", "1", "--min-rounds", "2", "--latency-budget", "2", "--precisions", "fp32"]
    common_b = [str(tmp_path / "cache-b") if a == str(cache) else a for a in common]

    def start(args):  # the two runs and the bad name side by side (two cores), each run in its own cache
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    procs = {"a": start(common + ["--models", "gpt2-small-eager-legacy", "--batches", "2", "--jobs", "2",
                                  "--tools", "onnxopt", "ort-transformers", "onnxscript-ort",
                                  "--json", str(out / "a.json")]),
             "b": start(common_b + ["--models", "tinyconv", "--batches", "1", "--tools", "onnxopt",  # (one latency job)
                                    "--json", str(out / "b.json")]),
             "bad": start([sys.executable, *SCRIPT, "--models", "nope"])}
    try:
        done = {name: (p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    (_, stderr), rc = done["a"]
    assert rc == 0, stderr[-2000:]
    a = json.loads((out / "a.json").read_text())
    res = a["models"]["gpt2-small-eager-legacy"]
    assert res["build"]["all"]["cached"] is False and res["build"]["all"]["build_s"] > 0
    rows = res["measurements"]["2|default"]["rows"]
    for name in ("original", "onnxopt/fp32", "ort-transformers/fp32", "onnxscript-ort/fp32"):
        assert res["variants"][name]["status"] == "ok", res["variants"][name]
        assert rows[name]["fidelity"]["ok"] and rows[name]["fidelity"]["top1"] == 1.0
        assert rows[name]["latency"]["median_ms"] > 0
    assert res["variants"]["ort-transformers/fp32"]["info"]["model_type"] == "gpt2"
    (_, stderr), rc = done["b"]
    assert rc == 0, stderr[-2000:]
    (_, stderr), rc = done["bad"]
    assert rc == 2 and "no benchmark model 'nope'" in stderr
    r = subprocess.run([sys.executable, *SCRIPT, "--merge", str(out / "a.json"), str(out / "b.json"),
                        "-o", str(out / "all.json"), "--markdown", str(out / "all.md")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    merged = json.loads((out / "all.json").read_text())
    assert list(merged["models"]) == ["gpt2-small-eager-legacy", "tinyconv"]
    assert len(merged["runs"]) == 2 and merged["models"]["tinyconv"]["run"] == 1
    md = (out / "all.md").read_text()
    assert "## gpt2-small-eager-legacy" in md and "## tinyconv" in md and "Run 2." in md


def test_advised_options_table():
    """Vision models measured under several option sets: the fp16 rows of each set against the fp32
    original with the defaults."""
    lat = lambda ms: {"latency": {"median_ms": ms}, "fidelity": {"ok": True}}  # noqa: E731
    res = {"family": "vision", "batches": [32],
           "option_sets": [{"label": "default", "options": {}}, {"label": "prefer_nhwc=1", "options": {}}],
           "variants": {"original": {"tool": "original", "precision": "fp32"},
                        "onnxopt/fp16": {"tool": "onnxopt", "precision": "fp16"}},
           "measurements": {"32|default": {"batch": 32, "options": "default",
                                           "rows": {"original": lat(9.2), "onnxopt/fp16": lat(7.3)}},
                            "32|prefer_nhwc=1": {"batch": 32, "options": "prefer_nhwc=1",
                                                 "rows": {"original": lat(8.0), "onnxopt/fp16": lat(6.6)}}}}
    rows = bt.advised_rows({"resnet50-legacy": res})
    assert [(r["options"], round(r["speedup"], 2)) for r in rows] == [("default", 1.26), ("prefer_nhwc=1", 1.39)]


def test_fp32_rows_only_at_the_batches_asked(tmp_path):
    """--fp32-batches 1 (the issue's table: fp16 at batches 1 and 8, fp32 at 1): the tools' fp32 rows are
    optimized and measured at batch 1 only, their fp16 rows and the original at every batch."""
    tools = [bt.get_tool("onnxopt-fixed"), bt.get_tool("ort-extended")]  # one model per batch; one for all
    opts = bt.Options(target="ort-cpu", precisions=("fp32", "fp16"), runs=2, warmup=1, min_rounds=1,
                      latency_budget=1, tiny=True, timeout=120, jobs=2, fp32_batches=(1,))
    res = bt.bench_one(bt.get_model("tinyconv"), tools, opts, tmp_path / "cache", tmp_path / "work", lambda s: None)
    v = res["variants"]
    assert v["onnxopt-fixed/fp32"]["status"] == "ok" and list(v["onnxopt-fixed/fp32"]["files"]) == ["1"]
    assert sorted(v["onnxopt-fixed/fp16"]["files"]) == ["1", "4"] and sorted(v["original"]["files"]) == ["1", "4"]
    assert v["onnxopt-fixed/fp16"]["files"]["1"] != v["onnxopt-fixed/fp16"]["files"]["4"]  # one model per batch
    b1, b4 = (res["measurements"][f"{b}|default"]["rows"] for b in (1, 4))
    assert {"original", "onnxopt-fixed/fp32", "ort-extended/fp32", "ort-extended/fp16"} <= set(b1)
    assert not any(name.endswith("/fp32") for name in b4) and {"original", "ort-extended/fp16"} <= set(b4)
    assert list(v["ort-extended/fp32"]["files"]) == ["1"] and sorted(v["ort-extended/fp16"]["files"]) == ["1", "4"]
    assert all("latency" in row for row in b4.values()) and b4["ort-extended/fp16"]["fidelity"]["ok"]
    text = bt.render_markdown({"meta": bt._meta(opts, [], tools), "models": {"tinyconv": res}})
    assert "| tinyconv | 4 | default | fp16 |" in text and "onnxopt-fixed" in text
    assert bt.parse_args(["--fp32-batches", "1"]).fp32_batches == "1"
