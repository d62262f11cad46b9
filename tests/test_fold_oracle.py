"""The folding oracle's fixed subset (scripts/oracles/fold.py --subset): the hand-written edge cases
and every SUBSET_STEP-th generated one, with and without onnxruntime. Every folded node must give
what onnxruntime computes on the unfolded model (floats within 1 ulp), or be left unfolded.
The whole oracle: ``python -m scripts.oracles.fold --jobs 2``."""

from __future__ import annotations


import pytest

pytest.importorskip("onnxruntime")

from scripts.oracles import fold as fold_oracle  # noqa: E402


def test_fold_oracle_subset():
    cases = fold_oracle.subset(fold_oracle.all_cases())
    verdicts = fold_oracle.run(cases, ["ort", "exact"])
    text, disagreements = fold_oracle.summary(verdicts, ["ort", "exact"])
    print(text)
    assert disagreements == 0, text
    folded = {m: sum(v.kind == "agreed" for v in verdicts if v.mode == m) for m in ("ort", "exact")}
    # the subset does exercise folding: most cases fold with onnxruntime, the exact set without it
    assert folded["ort"] > len(cases) / 2 and folded["exact"] > len(cases) / 8, text


def test_oracle_finds_a_wrong_fold(monkeypatch):
    """The oracle is not blind: a folder that computes fp16 in fp16 (onnx's reference evaluator,
    as before issue 11) is caught on the large fp16 sum."""
    from onnxopt.ir import evaluate

    def reference_evaluate(runtime, proto, opset, arrays):
        return evaluate._reference(proto, opset, arrays)

    monkeypatch.setattr(evaluate, "_run_onnxruntime", reference_evaluate)
    case = next(c for c in fold_oracle.handmade() if c.name == "handmade:ReduceMean-fp16-1000x100")
    [verdict] = fold_oracle.check(case, ["ort"])
    assert verdict.kind == "disagreed" and "ulps apart" in verdict.detail
