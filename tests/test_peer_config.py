"""Peers are run as their documentation asks a user to run them (issue 27, item 20).

onnxruntime's transformers optimizer was called with ``num_heads=0, hidden_size=0``: it logged "Failed to
detect num_heads and hidden_size for Attention fusion" (the adapter had lowered its logger to ERROR, so
nobody saw it) and fused no attention, which made onnxopt look 1.5x ahead on CUDA where it is behind.
Here every peer of scripts/bench/peers.py and scripts/bench/targets.py runs, the way the benchmarks run it, on
small BERT and GPT-2 exports; what it logs is captured, and a line saying it was called wrongly fails
the test. A pattern a peer does not support (the transformers optimizer on GPT-2's attention) keeps the
row, with a note saying so.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from helpers import optimum_absent, optimum_mark

from scripts import ROOT
from scripts.bench import _peers as peers
from scripts.bench import peers as bench
from scripts.bench import targets as bt

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="needs torch and transformers")

LAYERS = 2  # bench_targets.TINY's layer count for bert-base and gpt2-small


# ---------------------------------------------------------------------------------------------
# The capture itself: a fake peer that logs what onnxruntime's optimizer logs when called wrongly

FAKE_PEER = '''
import logging, warnings

def setup(ctx):
    log = logging.getLogger("onnxruntime.transformers.fusion_attention")
    log.setLevel(logging.ERROR)  # as the old adapter did: the warning must still be seen
    quiet = logging.getLogger("fake.unpropagated")
    quiet.propagate = False

    def run(src, dst):
        log.warning("Failed to detect num_heads and hidden_size for Attention fusion. "
                    "Please specify those parameters in argument.")
        quiet.warning("something else, not about the configuration")
        warnings.warn("a deprecation the peer emits")
        open(dst, "wb").write(open(src, "rb").read())
        return {"fused": {}}

    return run
'''


def _small_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_a_configuration_failure_is_captured_and_flagged(tmp_path):
    (tmp_path / "fakepeer.py").write_text(FAKE_PEER)
    src = _small_model(tmp_path / "m.onnx")
    level = logging.getLogger("onnxruntime.transformers.fusion_attention").level
    job = {"kind": "optimize", "target": "fakepeer:setup", "pythonpath": str(tmp_path), "src": str(src),
           "dst": str(tmp_path / "out.onnx"), "ctx": {}}
    res = bench._job(job)
    assert any("Failed to detect num_heads" in ln for ln in res["config_failures"])
    assert len(res["config_failures"]) == 1  # the other lines are kept in the log, not flagged
    assert any("something else" in ln for ln in res["log"]) and any("deprecation" in ln for ln in res["log"])
    logging.getLogger("onnxruntime.transformers.fusion_attention").setLevel(level)
    # the flag reaches the tables: the per-model notes and the summary's best-peer cell
    variants = {"original": {"tool": "original", "precision": "fp32", "status": "ok"},
                "fake/fp32": {"tool": "ort-transformers", "precision": "fp32", "status": "ok",
                              "config_failures": res["config_failures"], "info": {}},
                "onnxopt/fp32": {"tool": "onnxopt", "precision": "fp32", "status": "ok", "info": {}}}
    ok = {"fidelity": {"ok": True}}
    m = {"batch": 1, "options": "default", "rows": {"original": {"latency": {"median_ms": 2.0}, **ok},
                                                     "fake/fp32": {"latency": {"median_ms": 1.0}, **ok},
                                                     "onnxopt/fp32": {"latency": {"median_ms": 1.5}, **ok}}}
    bt.rank(m, variants)
    assert "Failed to detect" in m["best_peer"]["fp32"]["config_failure"]
    meta = bt._meta(bt.Options(), [], [])
    text = bt.render_markdown({"meta": meta, "models": {"x": {"family": "encoder", "description": "x",
                                                               "variants": variants,
                                                               "measurements": {"1|default": m}}}})
    assert text.count("**configuration failure**") == 2, text
    # a peer silent about its configuration is not flagged
    assert peers.config_failures(["WARNING x: Attention (or MultiHeadAttention) not fused"]) == []


def test_peer_log_restores_logging(tmp_path):
    before = (logging.Logger.isEnabledFor, logging.Logger.callHandlers)
    with peers.PeerLog() as plog, warnings.catch_warnings():
        logging.getLogger("x.y").warning("seen")
    assert plog.lines == ["WARNING x.y: seen"]
    assert (logging.Logger.isEnabledFor, logging.Logger.callHandlers) == before


# ---------------------------------------------------------------------------------------------
# The real peers on small transformer exports


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from onnxopt.models import transformers_models as tm

    d = tmp_path_factory.mktemp("peer-exports")
    out = {}
    for kind in ("bert-base", "gpt2-small"):
        out[kind] = tm.export_bench(kind, d / f"{kind}.onnx", "legacy", attn="eager", config=bt.TINY[kind])
    return out


def _targets_job(bm_name: str, tool, src: Path, dst: Path) -> dict:
    """The optimize job scripts/bench/targets.py gives ``tool`` for model ``bm_name`` (tiny config, fp32,
    CPU), run in this process."""
    bm = bt.get_model(bm_name)
    ctx = {"model": bm.name, "target": "ort-cpu", "provider": "cpu", "precision": "fp32", "tiny": True,
           "model_type": bm.model_type, "family": bm.family, **bm.attention(True), **dict(tool.config)}
    return bench._job({"kind": "optimize", "target": tool.target, "src": str(src), "dst": str(dst), "ctx": ctx})


needs_optimum = optimum_mark()


@needs_torch
@pytest.mark.parametrize("kind", ["bert-base", "gpt2-small"])
def test_target_bench_peers_run_as_documented(exports, tmp_path, kind):
    """bench_targets' transformer peers (every configuration) on a small BERT and GPT-2: nothing logged
    about their configuration; the transformers optimizer fuses BERT's attention in every layer, and on
    GPT-2 (whose attention it does not match) keeps its row with a note."""
    peers_here = [t for t in bt.TOOLS if t.peer and t.families and "encoder" in t.families and t.makes("fp32", "cpu")
                  and not t.per_batch  # (the fixed-shape rows: test_fixed_peer_gets_the_model_onnxsim_fixed)
                  and (not t.name.startswith("optimum") or optimum_absent() is None)]
    assert {t.name for t in peers_here} >= {"ort-transformers", "ort-transformers-o0", "ort-transformers-o2",
                                            "ort-transformers-o99", "onnxscript-ort"}
    for tool in peers_here:
        res = _targets_job(f"{kind}-eager-legacy", tool, exports[kind], tmp_path / f"{tool.name}.onnx")
        assert not res.get("config_failures"), (tool.name, res.get("config_failures"))
        info = res["info"]
        if tool.name.startswith("optimum"):  # ORTOptimizer reads heads and width from the config.json written
            attention = info["fused"].get("Attention", 0)
            assert info["options"]["optimize_for_gpu"] is False and info["options"]["optimization_level"] == 2
            assert (attention == LAYERS) if kind == "bert-base" else ("attention not fused" in info["note"]), info
            continue
        if not tool.name.startswith("ort-transformers"):
            continue
        assert info["config"]["num_heads"] == 4 and info["config"]["hidden_size"] == 64, info
        assert info["config"]["opt_level"] == dict(tool.config).get("opt_level"), info
        if kind == "bert-base":
            assert info["fused"].get("Attention") == LAYERS, (tool.name, info)
            assert "note" not in info
        else:
            assert "attention not fused" in info["note"], (tool.name, info)


@needs_torch
def test_side_by_side_bench_peers_run_as_documented(exports, tmp_path):
    """scripts/bench/peers.py's peers (onnxsim, onnxslim, onnxoptimizer, onnxscript, ort-extended,
    ort-transformers) with the context scripts/bench/peers.py gives them, on a small BERT: no configuration failure
    logged; the transformers optimizer is given the model's heads and width and fuses its attention."""
    ctx = {"model": "bert-legacy", "family": "transformer", "model_type": "bert", "num_heads": 4,
           "hidden_size": 64, "use_gpu": False}
    for tool in peers.TOOLS:
        if tool.package.startswith("onnxopt") or importlib.util.find_spec(tool.package) is None:
            continue
        res = bench._job({"kind": "optimize", "target": tool.target, "src": str(exports["bert-base"]),
                          "dst": str(tmp_path / f"{tool.name}.onnx"), "ctx": ctx})
        assert not res.get("config_failures"), (tool.name, res.get("config_failures"))
        if tool.name == "ort-transformers":
            assert res["info"]["fused"].get("Attention") == LAYERS, res["info"]
    # peers.py's own context: the zoo's config of the model it names
    assert peers.attention_params("bert-legacy") == {"num_heads": 4, "hidden_size": 256}
    assert peers.attention_params("gpt2-dynamo") == {"num_heads": 4, "hidden_size": 256}
    assert peers.attention_params("minilm-legacy") == {"num_heads": 12, "hidden_size": 384}
    assert peers.attention_params("resnet50-legacy") == {}


def test_every_transformer_of_the_target_bench_has_its_config():
    """Each transformer the target benchmark measures hands its heads and width to the peers, from
    the config it is built with (full size and tiny)."""
    for bm in bt.MODELS:
        if not bm.transformer:
            continue
        full, tiny = bm.attention(False), bm.attention(True)
        assert full["num_heads"] > 0 and full["hidden_size"] % full["num_heads"] == 0, bm.name
        assert tiny["num_heads"] > 0, bm.name
    assert bt.get_model("bert-base-eager-legacy").attention(False) == {"num_heads": 12, "hidden_size": 768}
    assert bt.get_model("gpt2-small-sdpa-dynamo").attention(False) == {"num_heads": 12, "hidden_size": 768}
    assert bt.get_model("minilm-legacy").attention(False) == {"num_heads": 12, "hidden_size": 384}


def test_cuda_table_names_machine_spread_and_where_onnxopt_is_behind(tmp_path):
    """The compact CUDA table: the GPU and onnxruntime-gpu version, medians with p10-p90, the ratio to
    the best peer (bold past 1.02: onnxopt behind), the peer's Attention count, a configuration failure;
    put between the markers of a document and nowhere else."""
    lat = lambda med, lo, hi: {"median_ms": med, "p10_ms": lo, "p90_ms": hi}  # noqa: E731
    variants = {"original": {"tool": "original", "precision": "fp32", "status": "ok"},
                "ort-transformers/fp32": {"tool": "ort-transformers", "precision": "fp32", "status": "ok",
                                          "info": {"fused": {"Attention": 12, "SkipLayerNormalization": 24}}},
                "onnxopt/fp32": {"tool": "onnxopt", "precision": "fp32", "status": "ok", "info": {}}}
    rows = {"original": {"latency": lat(2.5, 2.4, 2.7), "fidelity": {"ok": True}},
            "ort-transformers/fp32": {"latency": lat(1.28, 1.25, 1.33), "fidelity": {"ok": True}},
            "onnxopt/fp32": {"latency": lat(1.56, 1.5, 1.6), "fidelity": {"ok": True}}}
    m = {"batch": 1, "options": "default", "rows": rows}
    bt.rank(m, variants)
    run = {"date": "2026-11-27 17:00 UTC", "gpu": "NVIDIA H200, 580.1", "target": "ort-cuda",
           "versions": {"onnxruntime-gpu": "1.31.1"}, "machine": {}, "command": "x"}
    report = {"runs": [run], "models": {"bert-base-eager-legacy": {"variants": variants,
                                                                   "measurements": {"1|default": m}}}}
    text = bt.compact_markdown(report)
    assert "NVIDIA H200" in text and "onnxruntime-gpu 1.31.1" in text
    assert "| bert-base-eager-legacy | 1 | fp32 | 2.5 | 1.28 (1.25-1.33) (ort-transformers; 12) | " \
           "1.56 (1.5-1.6) | **1.22** |" in text, text
    assert "behind the best peer (above 1.02x) on 1 of 1 rows" in text
    doc = tmp_path / "DOC.md"
    doc.write_text("before\n<!-- cuda-transformers:begin -->\nold\n<!-- cuda-transformers:end -->\nafter\n")
    assert bt.replace_section(doc, "cuda-transformers", text)
    new = doc.read_text()
    assert new.startswith("before\n<!-- cuda-transformers:begin -->\n**CUDA, NVIDIA H200**")
    assert "\nold\n" not in new and new.endswith("<!-- cuda-transformers:end -->\nafter\n")
    assert not bt.replace_section(doc, "cuda-transformers-summary", "x")


# ---------------------------------------------------------------------------------------------
# Every configuration each peer offers is a row of its own; the kwargs each gets


def test_each_opt_level_is_a_row_with_the_documented_kwargs():
    """onnxruntime's transformers optimizer: one row per opt_level it offers (default = 1 for bert/gpt2, 0, 2,
    99), each given model_type, num_heads, hidden_size from the model's config and use_gpu on CUDA."""
    levels = {}
    for tool in bt.TOOLS:
        if tool.target.endswith(":setup_ort_transformers"):
            assert tool.peer and tool.families == ("encoder", "decoder")
            levels[tool.name] = dict(tool.config).get("opt_level")
    assert levels == {"ort-transformers": None, "ort-transformers-o0": 0, "ort-transformers-o2": 2,
                      "ort-transformers-o99": 99}
    bm = bt.get_model("bert-base-eager-legacy")
    for provider in ("cpu", "cuda"):
        for name, level in levels.items():
            ctx = {"model": bm.name, "provider": provider, "model_type": bm.model_type, **bm.attention(False),
                   **dict(bt.get_tool(name).config)}
            kw = peers.ort_transformers_kwargs({**ctx, "use_gpu": provider == "cuda"})
            assert kw == {"model_type": "bert", "num_heads": 12, "hidden_size": 768, "opt_level": level,
                          "use_gpu": provider == "cuda"}
    gpt2 = peers.ort_transformers_kwargs({"model": "gpt2-small-sdpa-dynamo", "provider": "cuda", "use_gpu": True,
                                          **bt.get_model("gpt2-small-sdpa-dynamo").attention(False)})
    assert gpt2["model_type"] == "gpt2" and gpt2["num_heads"] == 12 and gpt2["use_gpu"] is True
    # the side-by-side benchmark has the same levels, and optimum's O2/O3
    side = {t.name for t in peers.TOOLS}
    assert side >= {"ort-transformers", "ort-transformers-o0", "ort-transformers-o2", "ort-transformers-o99",
                    "optimum-o2", "optimum-o3"}


def test_optimum_levels_precisions_and_best_peer():
    """optimum: O2 and O3 make the fp32 rows, O4 (its mixed precision, offered for GPUs only) the fp16 row
    on CUDA only; every configuration of every peer competes for the best peer, an optimum row included."""
    o2, o3, o4 = (bt.get_tool(f"optimum-o{n}") for n in (2, 3, 4))
    assert [dict(t.config)["optimum_level"] for t in (o2, o3, o4)] == ["O2", "O3", "O4"]
    assert o2.makes("fp32", "cuda") and o2.makes("fp32", "cpu") and not o2.makes("fp16", "cuda")
    assert o4.makes("fp16", "cuda") and not o4.makes("fp16", "cpu") and not o4.makes("fp32", "cuda")
    assert all(t.makes(p, "cuda") for t in bt.TOOLS if t.name.startswith("ort-transformers") for p in bt.PRECISIONS)
    variants = {"original": {"tool": "original", "precision": "fp32", "status": "ok"},
                "onnxopt/fp16": {"tool": "onnxopt", "precision": "fp16", "status": "ok"}}
    ok = {"fidelity": {"ok": True}}
    rows = {"original": {"latency": {"median_ms": 3.0}, **ok}, "onnxopt/fp16": {"latency": {"median_ms": 1.0}, **ok}}
    fp16_peers = [t for t in bt.TOOLS if t.peer and t.makes("fp16", "cuda") and t.families != ("vision", "ocr")
                  and not t.per_batch]  # (dynamic shapes: the fixed-shape peers compete for onnxopt-fixed)
    for i, t in enumerate(fp16_peers):
        v = f"{t.name}/fp16"
        variants[v] = {"tool": t.name, "precision": "fp16", "status": "ok"}
        rows[v] = {"latency": {"median_ms": 2.0 - 0.1 * i}, **ok}
    assert "optimum-o4/fp16" in rows and "ort-transformers-o99/fp16" in rows
    fastest = min((r["latency"]["median_ms"], v) for v, r in rows.items() if v not in ("original", "onnxopt/fp16"))
    m = {"batch": 1, "options": "default", "rows": rows}
    bt.rank(m, variants)
    assert m["best_peer"]["fp16"]["variant"] == fastest[1]
    assert rows["onnxopt/fp16"]["latency"]["x_best_peer"] == pytest.approx(1.0 / fastest[0])


def test_transformers_config_is_the_builders():
    """The config.json optimum reads is the config each model is built with, model_type included."""
    from onnxopt.models import transformers_models as tm

    bert = peers.transformers_config("bert-legacy")
    assert bert["model_type"] == "bert" and bert["num_attention_heads"] == 4 and bert["hidden_size"] == 256
    assert peers.transformers_config("gpt2-dynamo") == {**tm.GPT2_CONFIG, "model_type": "gpt2"}
    base = peers.transformers_config("bert-base-sdpa-dynamo")
    assert base == {**tm.BERT_BASE_CONFIG, "model_type": "bert"}
    tiny = peers.transformers_config("gpt2-small-eager-legacy", bt.TINY["gpt2-small"])
    assert tiny["model_type"] == "gpt2" and tiny["n_embd"] == 64 and tiny["n_layer"] == 2
    assert peers.transformers_config("llama-sdpa-legacy")["model_type"] == "llama"
    assert peers.transformers_config("resnet50-legacy") == {}
    if (tm.minilm_dir_if_present() / "config.json").exists():
        minilm = peers.transformers_config("minilm-legacy")
        assert minilm["model_type"] == "bert" and (minilm["num_attention_heads"], minilm["hidden_size"]) == (12, 384)


def test_optimum_model_dir_and_absent_environment(tmp_path, monkeypatch):
    """The optimum runner writes the folder ORTOptimizer.from_pretrained reads (config.json + model.onnx);
    without its environment the peer fails with a clear reason, and that reason fails the run."""
    from scripts.bench import _optimum

    src = _small_model(tmp_path / "m.onnx")
    d = _optimum.model_dir(src, {"model_type": "bert", "hidden_size": 8}, tmp_path / "dir")
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.onnx"]
    assert (d / "model.onnx").read_bytes() == src.read_bytes()
    assert '"model_type": "bert"' in (d / "config.json").read_text()
    with pytest.raises(ValueError, match="model_type"):
        _optimum.model_dir(src, {"hidden_size": 8}, tmp_path / "dir2")
    monkeypatch.delenv(_optimum.SITE_ENV, raising=False)
    monkeypatch.setenv(_optimum.VENV_ENV, str(tmp_path / "no-venv"))
    with pytest.raises(_optimum.OptimumUnavailable, match="scripts.bench._optimum setup") as exc:
        peers.setup_optimum({"model": "bert-legacy", "provider": "cpu"})
    assert peers.config_failures([f"OptimumUnavailable: {exc.value}"])
    assert _optimum.versions()["optimum-onnx"].startswith("absent")
    monkeypatch.setenv(_optimum.SITE_ENV, str(tmp_path))  # a folder without the wheels installed
    with pytest.raises(_optimum.OptimumUnavailable, match="holds no optimum-onnx"):
        _optimum.environment()


def test_a_configuration_failure_fails_the_run(tmp_path):
    """A row with a configuration failure, logged or raised, makes both benchmarks exit 3; --merge then puts
    nothing into the documents. A peer's own limit (an error of another kind) does not."""
    meta = {**bt._meta(bt.Options(), [], []), "target": "ort-cpu"}
    variants = {"ort-transformers/fp32": {"tool": "ort-transformers", "precision": "fp32", "status": "ok",
                                          "config_failures": ["WARNING x: --num_heads is 12. Detected value is 4"]},
                "optimum-o2/fp32": {"tool": "optimum-o2", "precision": "fp32", "status": "error",
                                    "error": "KeyError: 'foo model type is not supported yet. Only bert are "
                                             "supported."},
                "onnxscript-ort/fp32": {"tool": "onnxscript-ort", "precision": "fp32", "status": "error",
                                        "error": "RuntimeError: shape inference failed"}}
    report = {"meta": meta, "runs": [meta], "models": {"x": {"family": "encoder", "variants": variants,
                                                              "measurements": {}}}}
    lines = bt.config_failure_lines(report["models"])
    assert len(lines) == 2 and lines[0].startswith("x ort-transformers/fp32: ") and "optimum-o2" in lines[1]
    src = tmp_path / "r.json"
    src.write_text(json.dumps(report))
    doc = tmp_path / "DOC.md"
    doc.write_text("<!-- cuda-transformers:begin -->\nold\n<!-- cuda-transformers:end -->\n")
    assert bt.main(["--merge", str(src), "-o", str(tmp_path / "all.json"), "--into", str(doc)]) == 3
    assert "\nold\n" in doc.read_text()
    del variants["ort-transformers/fp32"], variants["optimum-o2/fp32"]
    src.write_text(json.dumps(report))
    assert bt.main(["--merge", str(src), "-o", str(tmp_path / "all.json")]) == 0
    override = "WARNING optimum: Overriding for_gpu=False to for_gpu=True as half precision is available only on GPU."
    rows = {"optimum-o3": {"status": "ok", "config_failures": [override]},
            "onnxsim": {"status": "error", "error": "RuntimeError: onnxsim.simplify: the simplified model failed"}}
    assert bench.config_failure_lines({"m": {"rows": rows}}) == [f"m optimum-o3: {override}"]


@needs_torch
@needs_optimum
def test_optimum_called_wrongly_is_flagged(exports, tmp_path):
    """ORTOptimizer's own messages match CONFIG_FAILURES: O4 asked for a CPU (for_gpu=False: optimum overrides
    it) with a config.json whose head count is not the model's is flagged, not a quiet result."""
    from scripts.bench import _optimum

    cfg = peers.transformers_config("bert-base-eager-legacy", bt.TINY["bert-base"])
    wrong = {**cfg, "num_attention_heads": 2}  # the model has 4
    with peers.PeerLog() as plog:
        _optimum.optimize(str(exports["bert-base"]), str(tmp_path / "o4.onnx"), wrong, level="O4", for_gpu=False)
    flagged = peers.config_failures(plog.lines)
    assert any("Overriding for_gpu=False" in ln for ln in flagged), plog.lines
    assert any("num_heads" in ln for ln in flagged), plog.lines
    if "CUDAExecutionProvider" not in _ort_providers():
        assert any("There is no gpu" in ln for ln in flagged), plog.lines


def _ort_providers():
    import onnxruntime

    return onnxruntime.get_available_providers()


@needs_torch
def test_target_run_without_optimum_fails(exports, tmp_path):
    """The benchmark run with an optimum row and no optimum environment: the row says why, the run exits 3
    after writing its JSON."""
    (tmp_path / "cache" / "bench").mkdir(parents=True)  # the tiny export, as the run would build it
    (tmp_path / "cache" / "bench" / "bert-base-eager-legacy-tiny.onnx").write_bytes(exports["bert-base"].read_bytes())
    env = {**os.environ, "ONNXOPT_OPTIMUM_VENV": str(tmp_path / "none"), "OMP_NUM_THREADS": "1"}
    env.pop("ONNXOPT_OPTIMUM_SITE", None)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.targets", "--target", "ort-cpu", "--tiny",
                           "--models", "bert-base-eager-legacy", "--tools", "optimum-o2", "--precisions", "fp32",
                           "--batches", "1", "--runs", "1", "--warmup", "1", "--min-rounds", "1",
                           "--latency-budget", "0.1", "--cache", str(tmp_path / "cache"), "--work",
                           str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "peer configuration failure" in proc.stderr and "scripts.bench._optimum setup" in proc.stderr
    row = json.loads(out.read_text())["models"]["bert-base-eager-legacy"]["variants"]["optimum-o2/fp32"]
    assert row["status"] == "error" and "environment is absent" in row["error"]


def test_fixed_shapes_are_judged_against_every_peer_dynamic_against_dynamic_peers():
    """onnxopt (dynamic shapes) against the peers' dynamic models only; onnxopt-fixed against every peer row,
    the peers given the model onnxsim fixed (--overwrite-input-shape) included; both tables say which."""
    ok = {"fidelity": {"ok": True}}
    variants = {"original": {"tool": "original", "precision": "fp32", "status": "ok"},
                "ort-transformers/fp32": {"tool": "ort-transformers", "precision": "fp32", "status": "ok", "info": {}},
                "ort-transformers-fixed/fp32": {"tool": "ort-transformers-fixed", "precision": "fp32",
                                                "status": "ok", "info": {}},
                "onnxopt/fp32": {"tool": "onnxopt", "precision": "fp32", "status": "ok", "info": {}},
                "onnxopt-fixed/fp32": {"tool": "onnxopt-fixed", "precision": "fp32", "status": "ok", "info": {}}}
    m = {"batch": 1, "options": "default",
         "rows": {"original": {"latency": {"median_ms": 4.0}, **ok},
                  "ort-transformers/fp32": {"latency": {"median_ms": 2.0}, **ok},
                  "ort-transformers-fixed/fp32": {"latency": {"median_ms": 1.0}, **ok},
                  "onnxopt/fp32": {"latency": {"median_ms": 1.9}, **ok},
                  "onnxopt-fixed/fp32": {"latency": {"median_ms": 1.2}, **ok}}}
    bt.rank(m, variants)
    assert m["best_peer"]["fp32"]["variant"] == "ort-transformers/fp32"
    assert m["best_peer_fixed"]["fp32"]["variant"] == "ort-transformers-fixed/fp32"
    assert m["rows"]["onnxopt/fp32"]["latency"]["x_best_peer"] == pytest.approx(0.95)
    assert m["rows"]["onnxopt-fixed/fp32"]["latency"]["x_best_peer"] == pytest.approx(1.2)
    models = {"x": {"family": "encoder", "variants": variants, "measurements": {"1|default": m}}}
    row, = bt.compact_rows(models)
    assert row["onnxopt"]["onnxopt"]["x_best_peer"] == pytest.approx(0.95)
    assert row["onnxopt"]["onnxopt-fixed"]["x_best_peer"] == pytest.approx(1.2)
    assert row["best_peer_fixed"]["tool"] == "ort-transformers-fixed"
    summary, = bt.summary_rows(models)
    assert summary["onnxopt"]["onnxopt-fixed"]["x_best_peer"] == pytest.approx(1.2)
    line = next(ln for ln in bt.compact_markdown({"meta": bt._meta(bt.Options(), [], []), "models": models})
                .splitlines() if ln.startswith("| x |"))
    assert "(ort-transformers-fixed; 0)" in line and "**1.20**" in line and "0.95" in line


def test_fixed_peer_gets_the_model_onnxsim_fixed(tmp_path):
    """The fixed peers' chain: onnxsim --overwrite-input-shape first (the peer then sees static shapes)."""
    pytest.importorskip("onnxsim")
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(src))
    out = bt.fix_shapes_by_onnxsim(str(src), {"x": [3, 4]}, str(tmp_path / "fixed.onnx"))
    dims = [d.dim_value for d in onnx.load(out).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [3, 4]
    tool = bt.get_tool("ort-transformers-fixed")
    assert tool.per_batch and dict(tool.config)["peer_setup"].endswith("setup_ort_transformers")


def test_ratio_to_the_best_peer_carries_its_paired_bootstrap_interval():
    """Rows that kept their interleaved rounds get the 90% paired bootstrap interval of the ratio of medians;
    rows without rounds (older runs) get none and the tables still render."""
    ok = {"fidelity": {"ok": True}}
    rng = np.random.default_rng(0)
    base = 1.0 + 0.05 * rng.standard_normal(60)
    variants = {"original": {"tool": "original", "precision": "fp32", "status": "ok"},
                "ort-transformers/fp32": {"tool": "ort-transformers", "precision": "fp32", "status": "ok", "info": {}},
                "onnxopt/fp32": {"tool": "onnxopt", "precision": "fp32", "status": "ok", "info": {}}}

    def lat(samples):
        return {"median_ms": float(np.median(samples)), "samples_ms": [float(v) for v in samples]}

    m = {"batch": 1, "options": "default",
         "rows": {"original": {"latency": lat(2 * base), **ok}, "ort-transformers/fp32": {"latency": lat(base), **ok},
                  "onnxopt/fp32": {"latency": lat(1.1 * base), **ok}}}
    bt.rank(m, variants)
    lo, hi = m["rows"]["onnxopt/fp32"]["latency"]["x_best_peer_interval"]
    assert lo <= 1.1 <= hi and hi - lo < 0.01  # paired: the shared noise cancels
    models = {"x": {"family": "encoder", "variants": variants, "measurements": {"1|default": m}}}
    row, = bt.compact_rows(models)
    assert row["onnxopt"]["onnxopt"]["x_best_peer_interval"] == [lo, hi]
    assert f"({lo:.2f}-{hi:.2f})" in bt.compact_markdown({"meta": bt._meta(bt.Options(), [], []), "models": models})
    del m["rows"]["onnxopt/fp32"]["latency"]["samples_ms"]
    row, = bt.compact_rows(models)
    assert "x_best_peer_interval" not in row["onnxopt"]["onnxopt"]
