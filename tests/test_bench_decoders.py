"""The decoder benchmark (scripts/bench/decoders.py): its command line on the tiny Llama-style folder (legacy
exporter, 2 rounds) writes a JSON and a markdown table with a row for every variant asked for, a peer that
fails included (its one-line reason, not a crash), with latency and fidelity; the genai model, fed the same
token state, gives torch's logits; the ranking picks the fastest peer whose fidelity holds.

The command-line test skips, saying why, where onnxruntime-genai, torch, transformers, tokenizers or onnxscript
cannot be imported; it takes about 30 s on 2 cores (the genai builder's imports, the tiny tokenizer's training).
The ranking and merge tests need none of them.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from scripts.bench import decoders

BROKEN = "RuntimeError: peer broke on purpose"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    for mod, why in (("onnxruntime_genai", "onnxruntime-genai is not installed (setup.cfg's genai extra)"),
                     ("torch", "the exports need torch (setup.cfg's export extra)"),
                     ("transformers", "the tiny Hugging Face model is built with transformers"),
                     ("tokenizers", "the tiny model's tokenizer is trained with tokenizers"),
                     ("onnxscript", "the onnxscript peer needs onnxscript")):
        pytest.importorskip(mod, reason=why)
    tmp = tmp_path_factory.mktemp("decbench")
    real_argv = decoders.tool_argv

    def argv(tool, src, dst, hf_dir):  # one peer fails on purpose: it must keep its row with the reason
        if tool == "onnxscript":
            return [sys.executable, "-c", "raise RuntimeError('peer broke on purpose')"]
        return real_argv(tool, src, dst, hf_dir)

    mp = pytest.MonkeyPatch()
    mp.setattr(decoders, "tool_argv", argv)
    try:
        rc = decoders.main(["--models", "tiny", "--exporters", "legacy", "--tools", "onnxopt", "ort-llama-cli",
                            "onnxscript", "genai", "--past", "8", "--batches", "1", "2", "--prefill", "8",
                            "--rounds", "2", "--warmup", "1", "--budget", "1", "--cache", str(tmp / "cache"),
                            "--json", str(tmp / "bench.json"), "--markdown", str(tmp / "bench.md")])
    finally:
        mp.undo()
    assert rc == 0
    return json.loads((tmp / "bench.json").read_text()), (tmp / "bench.md").read_text()


def test_every_variant_keeps_a_row_with_latency_or_its_reason(report):
    data, md = report
    variants = {"original", "onnxopt", "ort-llama-cli", "onnxscript", "genai"}
    for form, settings in (("decode", {(1, 8), (2, 8)}), ("prefill", {(1, 8)})):
        length = "past" if form == "decode" else "sequence"
        rows = [r for r in data["rows"] if r["form"] == form]
        assert {(r["batch"], r[length]) for r in rows} == settings
        for setting in settings:
            got = [r for r in rows if (r["batch"], r[length]) == setting]
            assert sorted(r["variant"] for r in got) == sorted(variants)
            for r in got:
                assert r.get("error") or r.get("latency"), r
        broken = [r for r in rows if r["variant"] == "onnxscript"]
        assert broken and all(r["error"] == BROKEN and "latency" not in r for r in broken)
        for r in rows:
            if r["variant"] in ("original", "onnxopt", "genai"):
                lat = r["latency"]
                assert lat["rounds"] == 2 and len(lat["times_ms"]) == 2
                assert lat["p10_ms"] <= lat["median_ms"] <= lat["p90_ms"]
                assert r["nodes"] > 0 and r["kernels"] > 0
                fid = r["fidelity"]
                for against in ("vs_original", "vs_torch"):
                    assert {"max_abs", "err_range", "greedy_agree", "greedy_total"} <= set(fid[against])
                assert fid["vs_torch"]["greedy_total"] == (r["batch"] if form == "decode" else r["batch"] * 8)
        ours = [r for r in rows if r["variant"] == "onnxopt"]
        assert all(r["latency"]["best_peer"] == "-/genai" and r["latency"]["x_best_peer"] > 0 for r in ours)
    assert data["models"]["tiny"]["variants"]["decode/legacy/onnxscript"]["error"] == BROKEN
    assert data["runs"][0]["threads"] == 1 and data["runs"][0]["versions"]["onnxruntime"]
    assert "### Decode step" in md and "### Prefill" in md
    assert md.count(f"failed: {BROKEN}") == 3  # two decode settings, one prefill
    assert "| 1 | 8 | legacy | onnxopt |" in md and "| 2 | 8 | - | genai |" in md


def test_genai_model_gets_the_same_token_state(report):
    """The genai model (GroupQueryAttention, no position_ids, the past as its own buffer) and the export give
    torch's logits on the same inputs: the feeds mean the same thing to both."""
    data, _ = report
    for r in data["rows"]:
        if r["variant"] in ("genai", "original", "onnxopt"):
            t = r["fidelity"]["vs_torch"]
            assert t["err_range"] < 1e-4 and t["greedy_agree"] == t["greedy_total"], r
            assert r["fidelity_ok"]
    genai = [r for r in data["rows"] if r["variant"] == "genai"]
    assert all(r["fused_ops"].get("com.microsoft.GroupQueryAttention") == 2 for r in genai)
    assert data["models"]["tiny"]["variants"]["genai"]["command"].startswith(
        "python -m onnxruntime_genai.models.builder -i ")


def _row(exporter, variant, times, ok=True):
    return {"exporter": exporter, "variant": variant, "variant_key": f"{exporter}/{variant}", "fidelity_ok": ok,
            "latency": {"median_ms": float(np.median(times)), "times_ms": list(times)}}


def test_rank_picks_the_fastest_peer_whose_fidelity_holds():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, size=(6, 30))
    rows = [_row("dynamo", "original", 2.0 + noise[0]), _row("dynamo", "onnxopt", 1.0 + noise[1]),
            _row("dynamo", "onnxscript", 1.5 + noise[2]),
            _row("dynamo", "ort-llama", 0.5 + noise[3], ok=False),  # faster, but its logits are off
            _row("-", "genai", 1.25 + noise[4]), _row("legacy", "original", 3.0 + noise[5])]
    decoders.rank(rows)
    ours = rows[1]["latency"]
    assert ours["best_peer"] == "-/genai"
    assert ours["x_best_peer"] == pytest.approx(1.0 / 1.25, rel=0.03)
    lo, hi = ours["x_best_peer_interval"]
    assert lo <= ours["x_best_peer"] <= hi and hi < 0.85 and ours["x_best_peer_verdict"] == "faster"
    assert rows[0]["latency"]["x_best_peer"] == pytest.approx(1.6, rel=0.03)
    assert ours["x_original"] == pytest.approx(0.5, rel=0.03)
    assert "x_best_peer" not in rows[2]["latency"] and "x_original" not in rows[4]["latency"]
    assert rows[5]["latency"]["best_peer"] == "-/genai"  # the legacy original: only genai is its peer


def test_merge_keeps_every_model_replaces_a_rerun_one_and_ranks_again():
    def rows(model, version, ours_ms):
        setting = {"model": model, "form": "decode", "batch": 1, "past": 8, "v": version}
        return [{**_row("legacy", "original", [2.0] * 12), **setting},
                {**_row("legacy", "onnxopt", [ours_ms] * 12), **setting}, {**_row("-", "genai", [1.0] * 12), **setting}]

    a = {"runs": [{"date": "1"}], "models": {"trained": {}, "tiny": {}},
         "rows": rows("trained", 1, 1.5) + rows("tiny", 1, 1.5)}
    b = {"runs": [{"date": "2"}], "models": {"tiny": {"again": True}}, "rows": rows("tiny", 2, 0.9)}
    m = decoders.merge([a, b])
    assert [r["date"] for r in m["runs"]] == ["1", "2"]
    assert m["models"]["tiny"] == {"again": True} and set(m["models"]) == {"trained", "tiny"}
    assert sorted({(r["model"], r["v"]) for r in m["rows"]}) == [("tiny", 2), ("trained", 1)]
    ours = {r["model"]: r["latency"] for r in m["rows"] if r["variant"] == "onnxopt"}
    assert ours["tiny"]["x_genai"] == pytest.approx(0.9) and ours["trained"]["x_genai"] == pytest.approx(1.5)
    assert decoders.target_verdict(ours["tiny"], "genai", 1.0) == "met"
    assert decoders.target_verdict(ours["trained"], "genai", 1.0) == "missed"
    assert ours["tiny"]["x_original"] == pytest.approx(0.45)


@pytest.mark.parametrize("argv", [["--past", "0", "--json", "x.json"], ["--models", "tiny"],
                                  ["--models", "nope", "--json", "x.json"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        decoders.main(argv)
    assert exc.value.code == 2
