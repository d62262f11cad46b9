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
import logging
import warnings
from pathlib import Path

import pytest

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
    ctx = {"model": bm.name, "target": "ort-cpu", "provider": "cpu", "precision": "fp32",
           "model_type": bm.model_type, "family": bm.family, **bm.attention(True), **dict(tool.config)}
    return bench._job({"kind": "optimize", "target": tool.target, "src": str(src), "dst": str(dst), "ctx": ctx})


@needs_torch
@pytest.mark.parametrize("kind", ["bert-base", "gpt2-small"])
def test_target_bench_peers_run_as_documented(exports, tmp_path, kind):
    """bench_targets' transformer peers (every configuration) on a small BERT and GPT-2: nothing logged
    about their configuration; the transformers optimizer fuses BERT's attention in every layer, and on
    GPT-2 (whose attention it does not match) keeps its row with a note."""
    peers_here = [t for t in bt.TOOLS if t.peer and t.families and "encoder" in t.families]
    assert {t.name for t in peers_here} >= {"ort-transformers", "ort-transformers-o2", "onnxscript-ort"}
    for tool in peers_here:
        res = _targets_job(f"{kind}-eager-legacy", tool, exports[kind], tmp_path / f"{tool.name}.onnx")
        assert not res.get("config_failures"), (tool.name, res.get("config_failures"))
        if not tool.name.startswith("ort-transformers"):
            continue
        info = res["info"]
        assert info["config"]["num_heads"] == 4 and info["config"]["hidden_size"] == 64, info
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
